-- The harness the CUDA kernel-twin specs share (spec/cuda_spec.lua,
-- cuda_rows_spec.lua, cuda_nn_spec.lua, cuda_attention_spec.lua, ...): the
-- same body runs three times on identical inputs: on the GPU (or the CUDA
-- simulator), on the CPU in the same precision (the CPU twin) and on the CPU
-- in float64 (the reference; a float64 run adds one in float32), and every
-- output is checked by one rule (the rule, below).
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local assert = require 'luassert'  -- busted's, as the specs see it
local M = {}
local HAVE_GPU = cuda.is_available()
local DEV = 'cuda:0'
local NO_GPU = 'no CUDA device on this machine'
-- GL_CUDA_SPEC_VERBOSE=1 prints every comparison's error against its bound
local VERBOSE = os.getenv('GL_CUDA_SPEC_VERBOSE') ~= nil


-- ------------------------------------------------------------ inputs
-- Fixed inputs by default, so that a run gives the same verdict on every
-- machine with the same build; GL_CUDA_SPEC_SEED=N draws other ones (make
-- test-seeds runs the kernel twins under many, and every failure names its
-- seed).  Each input's seed is RUN_SEED + its position in the run.
local DEFAULT_SEED = 1000
local RUN_SEED = DEFAULT_SEED
if os.getenv('GL_CUDA_SPEC_SEED') then
  RUN_SEED = tonumber(os.getenv('GL_CUDA_SPEC_SEED'))
  if not RUN_SEED or RUN_SEED ~= math.floor(RUN_SEED) or RUN_SEED < 0 or RUN_SEED >= 2 ^ 52 then
    error(('GL_CUDA_SPEC_SEED is %q, expected a non-negative integer'):format(os.getenv('GL_CUDA_SPEC_SEED')), 0)
  end
end
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

-- ------------------------------------------------------------ the rule
-- Every output is checked against a float64 reference computed by the CPU
-- twin on the same input values, as FlashAttention's tests check theirs:
--
--   max |kernel - ref| <= 2 * e_twin + (eps(dtype) + eps(acc) * sqrt(n)) * max |ref|
--
-- where e_twin is the error of the CPU twin in the run's own precision
-- (dtype), max |twin - ref|, or, where larger, the error that precision's
-- rounding of the inputs makes: max |ref(inputs * (1 +- u)) - ref| with u
-- = eps(dtype) / 2 and the signs drawn at random per element (what a
-- backward-stable kernel may err by: the rule then does not rest on one
-- lucky rounding of the twin where an output has few elements), so that
-- 2 * e_twin allows the kernel the same roundings in another order;
-- eps(dtype) is the dtype's machine epsilon (one rounding of the result at
-- its scale, for a twin that happens to round luckily), and eps(acc) * sqrt(n)
-- the probabilistic bound of a sum of n terms accumulated in acc (float32 for
-- the 16-bit dtypes, as every kernel and twin accumulates; Higham and Mary,
-- "A new approach to probabilistic rounding error analysis", 2019), with n
-- the longest reduction the outputs come from (1 for element-wise ops).
-- Integer outputs must equal the twin's exactly; numbers (C doubles, as
-- the sums of squares) are checked as float64 results.  Where no higher
-- precision can measure the twin's error (a float64 run, an op with no
-- float64 form) `check` says how it is taken.
local EPS = { float64 = 2 ^ -52, float32 = 2 ^ -23, bfloat16 = 2 ^ -7, float16 = 2 ^ -10 }
local ACC = { float64 = 'float64', float32 = 'float32', bfloat16 = 'float32', float16 = 'float32' }
local FACTOR = 2

-- the error allowed beyond FACTOR times the twin's, for a run in dtype with
-- reductions of n terms and a result of the given scale
local function bound(dtype, n, scale)
  assert(EPS[dtype], 'cuda_twin: no machine epsilon for dtype ' .. tostring(dtype))
  return (EPS[dtype] + EPS[ACC[dtype]] * math.sqrt(n or 1)) * scale
end

local function max_abs(t)
  local m = 0
  for _, v in ipairs(t:tolist()) do
    local a = math.abs(v)
    if a ~= a then return a end
    if a > m then m = a end
  end
  return m
end

-- the spec file that is running, for the command that repeats a failure
local function spec_file()
  for level = 2, 40 do
    local info = debug.getinfo(level, 'S')
    if not info then break end
    local f = info.source:match('(spec/[%w_]+_spec%.lua)$')
    if f then return f end
  end
  return 'spec/<file>'
end

local function repeat_hint()
  return ('run seed %d; repeat: GL_CUDA_SPEC_SEED=%d build/sim/gptlua spec/run.lua --tags=cuda %s')
    :format(RUN_SEED, RUN_SEED, spec_file())
end

-- max |a - b| of two results (tensors on any device, or numbers), in float64
local function err_of(a, b)
  if type(a) == 'number' then return math.abs(a - b) end
  return a:to('cpu'):to('float64'):max_abs_diff(b:to('cpu'):to('float64'))
end

-- The rule above for one output: got (the kernel's, any device), twin (the
-- CPU's in the same precision) and ref (float64).  Where the twin's error
-- e_t cannot be measured against a higher precision, the kernel is compared
-- with the twin, and |kernel - exact| <= 2 e_t + B (B = (eps(dtype) +
-- eps(acc) sqrt(n)) scale) becomes |kernel - twin| <= 3 e_t + B, with e_t
--  - in a float64 run: the same body's error in float32 (twin32) scaled to
--    float64's epsilon (an op that amplifies its roundings, as 1 - tanh^2 near
--    1 does, amplifies them the same in both);
--  - where the op has no float64 form (ref nil), or for a number (a C double)
--    without twin32: taken at its bound B.
-- refp: the reference on inputs perturbed by their rounding (see the rule).
-- Results are tensors or numbers.
local function check(what, got, twin, ref, dtype, n, twin32, refp, terms)
  if type(got) == 'number' then dtype = 'float64'
  else
    assert.same(twin.shape, got.shape, what .. ': shape')
    if not gl.Tensor.FLOATING[twin.dtype] then
      assert.same(twin:tolist(), got:to('cpu'):tolist(), what .. ' (exact)')
      return
    end
  end
  local measured = ref ~= nil and dtype ~= 'float64'
  local e_inputs = measured and refp ~= nil and err_of(refp, ref) or 0
  ref = ref == nil and twin or ref
  local e = err_of(got, ref)
  local scale = type(ref) == 'number' and math.abs(ref) or max_abs(ref:to('cpu'))
  if terms and terms > scale then scale = terms end
  local extra = bound(dtype, n, scale)
  local e_twin, how
  if measured then
    e_twin, how = err_of(twin, ref), ''
    if e_inputs > e_twin then e_twin, how = e_inputs, ' (from its inputs\' rounding)' end
  elseif twin32 ~= nil then e_twin, how = err_of(twin32, ref) * EPS.float64 / EPS.float32, ' (from float32)'
  else e_twin, how = extra, ' (its bound)' end
  local factor = measured and FACTOR or FACTOR + 1
  local allowed = factor * e_twin + extra
  if VERBOSE then
    print(('%-72s |gpu-%s| %.3g  twin\'s error %.3g%s  allowed %.3g  (%.2f of it)'):format(what,
      measured and 'ref' or 'twin', e, e_twin, how, allowed, allowed > 0 and e / allowed or 0))
  end
  assert(e == e and e <= allowed,
    ('%s: max |gpu - %s| = %.6g, allowed %.6g = %d x the CPU twin\'s error%s %.6g + %.6g (%s, n = %d, scale %.6g); %s')
      :format(what, measured and 'ref' or 'twin', e, allowed, factor, how, e_twin, extra, dtype, n or 1, scale,
        repeat_hint()))
end

-- 1 + u or 1 - u per element (float64, of shape), the signs random but the
-- same in every run: no input seed is taken from the run's sequence
local function rounding(shape, u)
  local r = gl.randn(shape, { seed = 7919, dtype = 'float64' })
  return gl.where(r:gt(0), gl.full(shape, 1 + u, { dtype = 'float64' }), gl.full(shape, 1 - u, { dtype = 'float64' }))
end

-- The same body three times (four in a float64 run): S.name is the run's
-- tensor of pair ins.name, S.out(shape, dtype, layout) a fresh output
-- (poisoned on the GPU), S.gpu whether this is the GPU run, S.ref whether it
-- is the float64 reference (every floating input and output float64 there;
-- in the 'refp' run each input times 1 +- u, S.ref too),
-- S.f32 whether it is a float64 run's float32 one (float32 there).  body
-- returns its outputs.  An output computed as a difference of larger terms
-- (a norm's backward: rstd (g - x^ mean(g x^))) errs at the terms' scale, not
-- its own: the body sets S.terms[i] in the reference run (S.ref) to the
-- largest term of output i, and the bound's scale is the larger of the two.
local function side(mode, ins, u)
  local S = { gpu = mode == 'gpu', ref = mode == 'ref' or mode == 'refp', f32 = mode == 'f32', device = mode == 'gpu' and DEV or 'cpu',
              terms = {} }
  local float = (mode == 'ref' or mode == 'refp') and 'float64' or mode == 'f32' and 'float32' or nil
  for k, p in pairs(ins) do
    local t = mode == 'gpu' and p[2] or p[1]
    if float and gl.Tensor.FLOATING[t.dtype] then t = t:to(float) end
    if mode == 'refp' and gl.Tensor.FLOATING[t.dtype] then t = t * rounding(t.shape, u) end
    S[k] = t
  end
  function S.out(shape, dtype, layout)
    if float and gl.Tensor.FLOATING[dtype or 'float32'] then dtype = float end
    return output(shape, dtype, mode == 'gpu', layout)
  end
  return S
end

-- runs body as the float64 reference (and a float64 run in float32), the
-- CPU twin and the kernel, and
-- checks every output by the rule above.  dtype: the precision the run
-- computes in; opts.n: the longest reduction (default 1), or a table of
-- them by output (1 where absent); opts.ref64 =
-- false for ops that exist only in the run's precision (the twin is the
-- reference there).
local function compare(ins, body, dtype, what, opts)
  opts = opts or {}
  local sref = side('ref', ins)
  local rr = opts.ref64 ~= false and { body(sref) } or nil
  local r32 = rr and dtype == 'float64' and { body(side('f32', ins)) } or nil
  -- (integer runs, as the index ops on int64, have nothing to round)
  local rp = rr and EPS[dtype] and dtype ~= 'float64' and { body(side('refp', ins, EPS[dtype] / 2)) } or nil
  local rc = { body(side('twin', ins)) }
  local rg = { body(side('gpu', ins)) }
  assert.equal(#rc, #rg, what .. ': number of outputs')
  for i = 1, #rc do
    local n = type(opts.n) == 'table' and (opts.n[i] or 1) or opts.n or 1
    assert(type(n) == 'number' and n >= 1, 'cuda_twin.compare: opts.n must be >= 1, got ' .. tostring(n))
    check(what .. ' output ' .. i, rg[i], rc[i], rr and rr[i], dtype, n, r32 and r32[i], rp and rp[i], rr and sref.terms[i])
  end
  -- the runs' tensors freed now, not when LuaJIT's collector (which
  -- does not see device memory) gets to them: in the simulator's race mode
  -- every launch costs more with more live allocations (cuda_rows_spec:
  -- 40 -> 25 CPU seconds)
  rr, r32, rp, rc, rg = nil, nil, nil, nil, nil
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

M.HAVE_GPU, M.DEV, M.NO_GPU, M.RUN_SEED, M.DEFAULT_SEED, M.EPS = HAVE_GPU, DEV, NO_GPU, RUN_SEED, DEFAULT_SEED, EPS
M.max_abs, M.next_seed, M.copy_shape, M.pair, M.id_pair, M.output = max_abs, next_seed, copy_shape, pair, id_pair, output
M.check, M.bound, M.compare, M.K = check, bound, compare, K
return M
