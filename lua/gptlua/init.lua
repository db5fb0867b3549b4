-- gptlua — the Lua library.  `local gl = require 'gptlua'` gives tensors,
-- differentiable ops, autograd controls, memory statistics and the engine.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
require 'gptlua.ops_math'
require 'gptlua.ops_linear'
require 'gptlua.ops_attention'
require 'gptlua.ops_shape'
require 'gptlua.ops_head'
require 'gptlua.ops_moe'
require 'gptlua.ops_fp8'

local gl = {
  ffi = G.ffi, lib = G.lib, Tensor = Tensor,
  version = G.ffi.string(G.lib.gl_version()),
}

-- Every public function declares its arguments here (gptlua.check.wrap), so
-- a wrong one says which function, which argument, what was expected and
-- what came ("matmul: b must be a Tensor, got 5") instead of a Lua internal.
-- Checks are by kind (Tensor, integer, table of options, ...); what the
-- values mean (shapes matching, dims in range) is checked where they are used.
local check = require 'gptlua.check'
local unary = 'x:tensor'
local OPS = {
  -- creation and random numbers
  full = 'shape:shape, value:real, opts:opts?', zeros = 'shape:shape, opts:opts?', ones = 'shape:shape, opts:opts?',
  zeros_like = 't:tensor', ones_like = 't:tensor', arange = 'start:number',
  empty_like = 't:tensor, shape:shape?, dtype:string?',
  randn = 'shape:shape, opts:opts?', rand = 'shape:shape, opts:opts?',
  normal = 'shape:shape, mean:number, std:number, opts:opts?', uniform = 'shape:shape, lo:number, hi:number, opts:opts?',
  manual_seed = 'seed:number', set_rng_state = 'state:opts', rng_take = 'n:size',
  -- elementwise
  exp = unary, log = unary, sqrt = unary, rsqrt = unary, tanh = unary, abs = unary, relu = unary, relu2 = unary,
  gelu = unary, silu = unary, sigmoid = unary, sin = unary, cos = unary, square = unary, reciprocal = unary,
  neg = unary, clamp = 'x:tensor, min:real?, max:real?', softcap = 'x:tensor, cap:number',
  add = 'a:scalar, b:scalar', sub = 'a:scalar, b:scalar', mul = 'a:scalar, b:scalar', div = 'a:scalar, b:scalar',
  pow = 'a:scalar, b:scalar', maximum = 'a:tensor, b:tensor', minimum = 'a:tensor, b:tensor',
  eq = 'a:tensor, b:scalar', ne = 'a:tensor, b:scalar', lt = 'a:tensor, b:scalar', le = 'a:tensor, b:scalar',
  gt = 'a:tensor, b:scalar', ge = 'a:tensor, b:scalar', where = 'cond:tensor, a:scalar, b:scalar',
  -- reductions
  sum = 'x:tensor, dim:dims?, keepdim:boolean?', mean = 'x:tensor, dim:dims?, keepdim:boolean?',
  norm = 'x:tensor, dim:dims?, keepdim:boolean?', max = 'x:tensor, dim:integer?, keepdim:boolean?',
  min = 'x:tensor, dim:integer?, keepdim:boolean?', argmax = 'x:tensor, dim:integer?', global_norm = 'tensors:tensors', sumsq_list = 'tensors:tensors',
  sum_to = 'g:tensor, shape:shape',
  -- products and network ops
  matmul = 'a:tensor, b:tensor', matmul_raw = 'a:tensor, b:tensor, out:tensor?, beta:number?, alpha:number?',
  matmul_pair_raw = 'a1:tensor, b1:tensor, a2:tensor, b2:tensor', linear = 'x:tensor1, weight:tensor, bias:tensor?, residual:tensor?',
  mlp = 'x:tensor1, fc_weight:tensor, fc_bias:tensor?, proj_weight:tensor, proj_bias:tensor?, activation:string, residual:tensor?',
  softmax = 'x:tensor, dim:integer?', log_softmax = 'x:tensor, dim:integer?',
  layer_norm = 'x:tensor, weight:tensor?, bias:tensor?, eps:number?', rms_norm = 'x:tensor, weight:tensor?, eps:number?',
  add_layer_norm = 'x:tensor, r:tensor, weight:tensor?, bias:tensor?, eps:number?',
  add_rms_norm = 'x:tensor, r:tensor, weight:tensor?, eps:number?',
  embedding = 'ids:tensor, weight:tensor', index_select = 'x:tensor, dim:integer, index:tensor',
  gather = 'x:tensor, dim:integer, index:tensor',
  scaled_dot_product_attention = 'q:tensor, k:tensor, v:tensor, opts:opts?',
  attention_qkv = 'qkv:tensor, n_head:count, opts:opts?', rope = 'x:tensor, cos:tensor, sin:tensor',
  with_segments = 'segments:tensor?, fn:callable',
  rope_rms_norm = 'x:tensor, cos:tensor, sin:tensor, eps:number?',
  cross_entropy = 'logits:tensor1, targets:tensor, opts:opts?',
  linear_cross_entropy = 'x:tensor1, weight:tensor, targets:tensor, opts:opts?', dropout = 'x:tensor, p:number, training:boolean?',
  moe_route = 'experts:tensor, n_experts:count, capacity:size?', moe_permute = 'x:tensor, slots:tensor, rows:size',
  moe_combine = 'y:tensor, slots:tensor, weights:tensor', grouped_linear = 'a:tensor, weights:tensors, counts:tensor',
  -- shapes
  cat = 'tensors:tensors, dim:integer?', stack = 'tensors:tensors, dim:integer?', split = 'x:tensor, size:count, dim:integer?',
  chunk = 'x:tensor, n:count, dim:integer?', broadcast_shape = 'a:shape, b:shape, what:string?', broadcast_view = 'x:tensor, shape:shape',
  expand_raw = 't:tensor, shape:shape, what:string?', same_shape = 'a:shape, b:shape',
  norm_dim = 't:tensor, dim:integer, what:string?', shape_of = 'what:string',
  -- raw helpers
  unary_raw = 'op:integer, x:tensor, p0:real?, p1:real?, out:tensor?',
  binary_raw = 'op:integer, a:tensor, b:tensor, what:string?, out_dtype:string?',
  raw_contiguous = 't:tensor', drop_view = 'view:tensor?, base:tensor?',
  -- FP8 (gptlua.ops_fp8)
  fp8_quantize = 'x:tensor, dtype:string, recipe:string?',
  fp8_matmul = 'a:tensor, a_scale_inv:tensor, b:tensor, b_scale_inv:tensor, dtype:string?',
  fp8_amax = 'x:tensor, recipe:string?', fp8_quantize_amax = 'x:tensor, dtype:string, amax:tensor',
  fp8_linear = 'x:tensor, weight:tensor, recipe:string, split:table?',
}
-- Tensor methods that are not also gl.* functions (self is checked as `self`)
local METHODS = {
  add_ = 'self:tensor, b:scalar, alpha:number?', mul_ = 'self:tensor, b:scalar', clamp_ = 'self:tensor, min:real?, max:real?',
  fill_ = 'self:tensor, value:real', zero_ = 'self:tensor', copy_ = 'self:tensor, src:tensor',
  normal_ = 'self:tensor, mean:number?, std:number?, opts:opts?', uniform_ = 'self:tensor, lo:number?, hi:number?',
  masked_fill = 'self:tensor, mask:tensor, value:scalar', detach = 'self:tensor', free = 'self:tensor',
  requires_grad_ = 'self:tensor, flag:boolean?', register_hook = 'self:tensor, fn:function',
  backward = 'self:tensor, grad:tensor?, opts:opts?', zero_grad = 'self:tensor',
  max_abs_diff = 'self:tensor, other:tensor', allclose = 'self:tensor, other:tensor, rtol:number?, atol:number?',
  expand = 'self:tensor', contiguous = 'self:tensor', clone = 'self:tensor', view = 'self:tensor',
  reshape = 'self:tensor', flatten = 'self:tensor', permute = 'self:tensor',
  transpose = 'self:tensor, dim:integer, dim:integer', t = 'self:tensor',
  narrow = 'self:tensor, dim:integer, start:integer, length:integer', select = 'self:tensor, dim:integer, index:integer',
  unsqueeze = 'self:tensor, dim:integer', squeeze = 'self:tensor, dim:integer?', to = 'self:tensor',
  float = 'self:tensor', double = 'self:tensor', cpu = 'self:tensor', cuda = 'self:tensor, index:integer?',
  keep = 'self:tensor', stride = 'self:tensor, dim:integer?', storage_offset = 'self:tensor',
  _as_strided = 'self:tensor, shape:shape, stride:shape, offset:integer?', view_dtype = 'self:tensor, dtype:string, shape:shape',
  is_contiguous = 'self:tensor', numel = 'self:tensor', dim = 'self:tensor', size = 'self:tensor, dim:integer?',
  is_floating = 'self:tensor', data_ptr = 'self:tensor', get = 'self:tensor', set = 'self:tensor, value:real',
  item = 'self:tensor', tolist = 'self:tensor', totable = 'self:tensor', is_freed = 'self:tensor',
}
do
  local sigs = {}
  for k, v in pairs(OPS) do if O[k] ~= nil then sigs[k] = v end end
  local wrapped = check.wrap_table(O, sigs)
  -- methods and operators that are the same functions (x:matmul, x + y) get the checked ones
  for k, v in pairs(Tensor) do if wrapped[v] then Tensor[k] = wrapped[v] end end
  local msigs = {}
  for k, v in pairs(METHODS) do if Tensor[k] ~= nil then msigs[k] = v end end
  check.wrap_table(Tensor, msigs)
end
gl.signatures = { ops = OPS, methods = METHODS }

-- every op function (gl.zeros, gl.matmul, ...) at top level
for k, v in pairs(O) do gl[k] = v end

-- an engine status (GL_OK / GL_ERR) to a Lua error carrying the engine's message
gl.check = check.wrap('check', 'status:integer, level:integer?', G.check)
gl.empty = check.wrap('empty', 'shape:shape, opts:opts?', Tensor.empty)
gl.scope = check.wrap('scope', 'fn:callable', Tensor.scope)
-- a CPU tensor in pinned (page-locked) memory; needs a CUDA build and device
gl.empty_pinned = check.wrap('empty_pinned', 'shape:shape, opts:opts?', function(shape, opts)
  local dt = Tensor.dtype_id((opts and opts.dtype) or Tensor.get_default_dtype(), 'empty_pinned')
  if #shape > 8 then check.fail('empty_pinned', 'shape', 'at most 8 dims', #shape .. ' dims', 2) end
  local dims = G.ffi.new('int64_t[8]')
  for i, n in ipairs(shape) do dims[i - 1] = check.size(n, 'empty_pinned', 'size of dim ' .. i, 3) end
  return Tensor.wrap(G.lib.gl_empty_pinned(dt, #shape, dims))
end)
-- Torch7's sizes as arguments: gl.randn(3, 4) is gl.randn({3, 4}) (options
-- may follow: gl.zeros(2, 3, {dtype = 'float64'})), for the constructors
-- whose first argument is the shape and only the shape
for _, what in ipairs({ 'zeros', 'ones', 'randn', 'rand', 'empty' }) do
  local f = gl[what]
  gl[what] = function(a, ...)
    if type(a) ~= 'number' then return f(a, ...) end
    local shape, rest, n = { a }, { ... }, select('#', ...)
    local i = 1
    while i <= n and type(rest[i]) == 'number' do shape[#shape + 1] = rest[i]; i = i + 1 end
    if i <= n and rest[i] ~= nil and type(rest[i]) ~= 'table' then
      error(('%s: expected sizes, then a table of options, got %s after the sizes'):format(what,
        check.describe(rest[i])), 2)
    end
    return f(shape, unpack(rest, i, math.max(n, i - 1)))
  end
end
gl.tensor = check.wrap('tensor', 'data:any, opts:opts?', Tensor.from_table)
gl.is_tensor = O.is_tensor
gl.set_default_dtype = check.wrap('set_default_dtype', 'dtype:string', function(d)
  Tensor.dtype_id(d, 'set_default_dtype')
  return Tensor.set_default_dtype(d)
end)
gl.get_default_dtype = Tensor.get_default_dtype
gl.no_grad, gl.set_grad_enabled, gl.is_grad_enabled = A.no_grad, A.set_grad_enabled, A.is_grad_enabled
gl.backward, gl.checkpoint = A.backward, A.checkpoint

gl.set_num_threads = check.wrap('set_num_threads', 'n:integer', function(n) G.check(G.lib.gl_set_num_threads(n), 2) end)
function gl.get_num_threads() return G.lib.gl_get_num_threads() end
-- the CPUs this process may run on (gl.set_num_threads refuses more than
-- GL_THREADS_PER_CORE threads for each)
function gl.num_cores() return G.lib.gl_num_cores() end
-- the BLAS library and the kernels it picked for this CPU, as a string
function gl.blas_info() return G.ffi.string(G.lib.gl_blas_info()) end

-- memory statistics of a device ('cpu' or 'cuda:N') as a Lua table
gl.memory_stats = check.wrap('memory_stats', 'device:device?', function(device)
  local dev = Tensor.device_id(device or 'cpu', 'memory_stats')
  local st = G.ffi.new('gl_mem_stats')
  G.check(G.lib.gl_mem_stats_get(dev, st), 2)
  return { allocated = tonumber(st.allocated), reserved = tonumber(st.reserved), peak = tonumber(st.peak),
           n_allocs = tonumber(st.n_allocs), n_frees = tonumber(st.n_frees),
           cache_hits = tonumber(st.cache_hits), n_live = tonumber(st.n_live) }
end)
gl.reset_peak_memory = check.wrap('reset_peak_memory', 'device:device?', function(device)
  G.check(G.lib.gl_mem_reset_peak((Tensor.device_id(device or 'cpu', 'reset_peak_memory'))), 2)
end)
gl.empty_cache = check.wrap('empty_cache', 'device:device?', function(device)
  G.check(G.lib.gl_empty_cache((Tensor.device_id(device or 'cpu', 'empty_cache'))), 2)
end)

function gl.cuda_available() return G.lib.gl_cuda_device_count() > 0 end
-- "cuda if available, else cpu"
function gl.default_device() return gl.cuda_available() and 'cuda:0' or 'cpu' end

-- the meta device: tensors with shapes and no data (lua/gptlua/meta.lua)
gl.meta = require 'gptlua.meta'

-- the memory plan of a config (see lua/gptlua/plan.lua): gl.plan(cfg, opts)
gl.plan = check.wrap('plan', 'recipe:any, opts:opts?', function(...) return require('gptlua.plan').plan(...) end)

-- the project (or install) root: recipes/ and data/ live there
gl.root = (GPTLUA and GPTLUA.root) or G.libdir .. '/..'

return gl
