-- gptlua — the Lua library.  `local gl = require 'gptlua'` gives tensors,
-- differentiable ops, autograd controls, memory statistics and the engine.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
require 'gptlua.ops_math'

local gl = {
  ffi = G.ffi, lib = G.lib, check = G.check, Tensor = Tensor,
  version = G.ffi.string(G.lib.gl_version()),
}

-- every op function (gl.zeros, gl.matmul, ...) at top level
for k, v in pairs(O) do gl[k] = v end

gl.empty = Tensor.empty
gl.scope = Tensor.scope
-- a CPU tensor in pinned (page-locked) memory; needs a CUDA build and device
function gl.empty_pinned(shape, opts)
  local dt = Tensor.dtype_id((opts and opts.dtype) or Tensor.get_default_dtype(), 'empty_pinned')
  local dims = G.ffi.new('int64_t[8]')
  for i, n in ipairs(shape) do dims[i - 1] = n end
  return Tensor.wrap(G.lib.gl_empty_pinned(dt, #shape, dims))
end
gl.tensor = Tensor.from_table
gl.is_tensor = O.is_tensor
gl.set_default_dtype, gl.get_default_dtype = Tensor.set_default_dtype, Tensor.get_default_dtype
gl.no_grad, gl.set_grad_enabled, gl.is_grad_enabled = A.no_grad, A.set_grad_enabled, A.is_grad_enabled
gl.backward, gl.checkpoint = A.backward, A.checkpoint

function gl.set_num_threads(n) G.check(G.lib.gl_set_num_threads(n), 2) end
function gl.get_num_threads() return G.lib.gl_get_num_threads() end
-- the BLAS library and the kernels it picked for this CPU, as a string
function gl.blas_info() return G.ffi.string(G.lib.gl_blas_info()) end

-- memory statistics of a device ('cpu' or 'cuda:N') as a Lua table
function gl.memory_stats(device)
  local dev = Tensor.device_id(device or 'cpu', 'memory_stats')
  local st = G.ffi.new('gl_mem_stats')
  G.check(G.lib.gl_mem_stats_get(dev, st), 2)
  return { allocated = tonumber(st.allocated), reserved = tonumber(st.reserved), peak = tonumber(st.peak),
           n_allocs = tonumber(st.n_allocs), n_frees = tonumber(st.n_frees),
           cache_hits = tonumber(st.cache_hits), n_live = tonumber(st.n_live) }
end
function gl.reset_peak_memory(device) G.check(G.lib.gl_mem_reset_peak((Tensor.device_id(device or 'cpu'))), 2) end
function gl.empty_cache(device) G.check(G.lib.gl_empty_cache((Tensor.device_id(device or 'cpu'))), 2) end

function gl.cuda_available() return G.lib.gl_cuda_device_count() > 0 end
-- "cuda if available, else cpu"
function gl.default_device() return gl.cuda_available() and 'cuda:0' or 'cpu' end

-- the memory plan of a config (see lua/gptlua/plan.lua): gl.plan(cfg, opts)
function gl.plan(...) return require('gptlua.plan').plan(...) end

-- the project (or install) root: recipes/ and data/ live there
gl.root = (GPTLUA and GPTLUA.root) or G.libdir .. '/..'

return gl
