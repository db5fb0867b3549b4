-- The harness the CUDA kernel-twin specs share (spec/cuda_spec.lua, cuda_rows_spec.lua,
-- cuda_nn_spec.lua, cuda_attention_spec.lua): the same body runs on the CPU and on the
-- GPU (or the CUDA simulator) on identical random inputs, and every output
-- is compared within the dtype's tolerance of the result's scale (the
-- tolerances and the poisoning are described at the top of cuda_spec.lua).
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local assert = require 'luassert'  -- busted's, as the specs see it
local M = {}
local HAVE_GPU = cuda.is_available()
local DEV = 'cuda:0'
local NO_GPU = 'no CUDA device on this machine'
local TOL = { float32 = 1e-5, bfloat16 = 1e-2, float16 = 1e-2, float64 = 1e-10 }
-- GL_CUDA_SPEC_VERBOSE=1 prints every comparison's error against its tolerance
local VERBOSE = os.getenv('GL_CUDA_SPEC_VERBOSE') ~= nil


-- ------------------------------------------------------------ inputs
-- every run draws new inputs; GL_CUDA_SPEC_SEED=N repeats the run that
-- printed "run seed N" in a failure
local RUN_SEED = tonumber(os.getenv('GL_CUDA_SPEC_SEED') or '') or (os.time() % 1000000) * 1000
local seq = 0
local function next_seed() seq = seq + 1; return RUN_SEED + seq end

local function copy_shape(s) local r = {} for i, v in ipairs(s) do r[i] = v end return r end

-- A pair {cpu, gpu} of tensors with identical values of `shape`:
--   opts.dtype   float dtype (default float32)
--   opts.dist    'normal' (default) or {lo, hi} uniform
--   opts.layout  'contiguous' | 'transposed' (last two dims swapped in memory)
--                | 'narrow' (rows padded: stride[-2] > size[-1]) | 'broadcast' (dim 1 expanded)
local function pair(shape, opts)
  opts = opts or {}
  local dtype, layout = opts.dtype or 'float32', opts.layout or 'contiguous'
  local nd = #shape
  local bshape = copy_shape(shape)
  if layout == 'transposed' then bshape[nd - 1], bshape[nd] = shape[nd], shape[nd - 1]
  elseif layout == 'narrow' then bshape[nd] = shape[nd] + 3
  elseif layout == 'broadcast' then bshape[1] = 1 end
  local seed = next_seed()
  local base
  if type(opts.dist) == 'table' then base = gl.uniform(bshape, opts.dist[1], opts.dist[2], { seed = seed })
  else base = gl.randn(bshape, { seed = seed }) end
  if dtype ~= 'float32' then base = base:to(dtype) end
  local gbase = base:to(DEV)
  local function view(t)
    if layout == 'transposed' then return t:transpose(nd - 1, nd)
    elseif layout == 'narrow' then return t:narrow(nd, 2, shape[nd])
    elseif layout == 'broadcast' then return t:expand(shape) end
    return t
  end
  return { view(base), view(gbase) }
end

-- random integer ids in [0, limit) (some replaced by `ignore` when given)
local function id_pair(shape, limit, dtype, ignore)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  math.randomseed(next_seed())
  local vals = {}
  for i = 1, n do vals[i] = math.random(0, limit - 1) end
  if ignore then for i = 1, n, 5 do vals[i] = ignore end end
  local t = gl.tensor(vals, { dtype = dtype or 'int64' }):view(shape)
  return { t, t:to(DEV) }
end

-- an output of shape: on the GPU poisoned with NaN (integers with -7);
-- layout 'transposed' gives a non-contiguous view
local function output(shape, dtype, on_gpu, layout)
  dtype = dtype or 'float32'
  local nd = #shape
  local bshape = copy_shape(shape)
  if layout == 'transposed' then bshape[nd - 1], bshape[nd] = shape[nd], shape[nd - 1] end
  local t = gl.empty(bshape, { dtype = dtype, device = on_gpu and DEV or 'cpu' })
  if on_gpu then t:fill_(gl.Tensor.FLOATING[dtype] and 0 / 0 or -7) end
  if layout == 'transposed' then t = t:transpose(nd - 1, nd) end
  return t
end

-- The same body on both devices: S.name is the side's tensor of pair
-- ins.name, S.out(shape, dtype, layout) a fresh output (poisoned on the
-- GPU), S.gpu whether this is the GPU run.  body returns its outputs.
local HALF = { bfloat16 = true, float16 = true }
-- For 16-bit float runs the CPU reference computes in float32 on the same
-- (16-bit) input values, so the comparison measures the GPU kernel's own
-- error rather than two roundings to bfloat16.
local function side(on_gpu, ins, ref32)
  local S = { gpu = on_gpu, device = on_gpu and DEV or 'cpu' }
  for k, p in pairs(ins) do
    local t = on_gpu and p[2] or p[1]
    if ref32 and HALF[t.dtype] then t = t:to('float32') end
    S[k] = t
  end
  function S.out(shape, dtype, layout)
    if ref32 and HALF[dtype or 'float32'] then dtype = 'float32' end
    return output(shape, dtype, on_gpu, layout)
  end
  return S
end

local function max_abs(t)
  local m = 0
  for _, v in ipairs(t:tolist()) do
    local a = math.abs(v)
    if a > m then m = a end
  end
  return m
end

-- got (any device) against ref (cpu): max abs difference within tol of ref's scale
-- slack: a factor on the dtype's tolerance, for ops whose own arithmetic
-- amplifies the inputs' rounding (a square doubles it)
-- scale: the scale to compare at, where ref's own would be wrong (see compare)
local function check_close(got, ref, dtype, what, slack, scale)
  local g = got:to('cpu')
  assert.same(ref.shape, g.shape, what .. ': shape')
  if not gl.Tensor.FLOATING[ref.dtype] then
    assert.same(ref:tolist(), g:tolist(), what .. ' (exact)')
    return
  end
  local d = g:to('float64'):max_abs_diff(ref:to('float64'))
  scale = math.max(scale or max_abs(ref), 1e-30)
  local tol = (TOL[dtype] or TOL.float32) * (slack or 1)
  if VERBOSE then print(('%-70s rel err %.3g (tolerance %g)'):format(what, d / scale, tol)) end
  assert(d == d and d <= tol * scale,
         ('%s: max |gpu - cpu| = %g, allowed %g (scale %g, run seed %d)'):format(what, d, tol * scale, scale, RUN_SEED))
end

-- runs body on both devices and compares every output
-- scales: optional {[i] = function(cpu_outputs) -> scale} for outputs whose
-- error does not follow their own size: a row's mean is a sum that cancels,
-- so its rounding follows the summands (|s| / sqrt(C) for C terms of size
-- |s|), not the mean, which can be near zero
local function compare(ins, body, dtype, what, slack, scales)
  local rc = { body(side(false, ins, HALF[dtype])) }
  local rg = { body(side(true, ins)) }
  assert.equal(#rc, #rg)
  for i = 1, #rc do
    if type(rc[i]) == 'number' then
      local tol = (TOL[dtype] or 1e-5) * (slack or 1) * math.max(math.abs(rc[i]), 1e-30)
      assert(math.abs(rg[i] - rc[i]) <= tol,
             ('%s: gpu %.17g cpu %.17g (run seed %d)'):format(what, rg[i], rc[i], RUN_SEED))
    else
      check_close(rg[i], rc[i], dtype, what .. ' output ' .. i, slack, scales and scales[i] and scales[i](rc))
    end
  end
  -- the two sides' tensors freed now, not when LuaJIT's collector (which
  -- does not see device memory) gets to them: in the simulator's race mode
  -- every launch costs more with more live allocations (cuda_rows_spec:
  -- 40 -> 25 CPU seconds)
  rc, rg = nil, nil
  collectgarbage()
end

local function K(rc) gl.check(rc, 2) end

-- a spec file's `it` for tests that need a device: where there is none they
-- are reported pending with the reason.  busted's it() and pending() live in
-- each spec file's own environment, so the file passes them in.
-- With a device it is `it` itself, so busted files each test under the spec
-- that calls it.
function M.gpu_it(it, pending)
  if HAVE_GPU then return it end
  return function(name) pending(name .. ' (' .. NO_GPU .. ')') end
end

M.HAVE_GPU, M.DEV, M.NO_GPU, M.TOL, M.RUN_SEED = HAVE_GPU, DEV, NO_GPU, TOL, RUN_SEED
M.max_abs, M.next_seed, M.copy_shape, M.pair, M.id_pair, M.output = max_abs, next_seed, copy_shape, pair, id_pair, output
M.check_close, M.compare, M.K = check_close, compare, K
return M
