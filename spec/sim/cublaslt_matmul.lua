-- The engine's matmul on cuda:0 against the CPU, batched, transposed, with
-- alpha / beta, in float32, bfloat16 and float64.  Run with
-- GL_SIM_CUBLASLT_NO_ALGO=1, every cublasLtMatmulAlgoGetHeuristic answers
-- "no algorithm" and kernels/matmul.cu must compute with its fallback GEMM
-- kernel; without it the products go through the simulated cuBLASLt.
-- Returns a function that prints each case's max |cuda - cpu| relative to
-- the result's scale and returns how many are beyond the dtype's
-- tolerance.  Run by spec/sim_cublaslt_spec.lua in a process of its own
-- (spec/sim/run.lua lt matmul).
local gl = require 'gptlua'
local lib = gl.lib
local TOL = { float32 = 1e-5, bfloat16 = 1e-2, float64 = 1e-10 }

local function max_abs(t)
  local m = 0
  for _, v in ipairs(t:tolist()) do m = math.max(m, math.abs(v)) end
  return m
end

local failed = 0
local seed = 0
local function randn(shape, dt)
  seed = seed + 1
  local t = gl.randn(shape, { seed = 1000 + seed })
  return dt == 'float32' and t or t:to(dt)
end

-- out = alpha a @ b + beta c on the GPU and, in float32 (float64) on the same
-- input values, on the CPU
local function case(name, dt, a, b, c, alpha, beta, bias)
  local ref_t = dt == 'float64' and 'float64' or 'float32'
  if bias then  -- gl_matmul_bias: out = a @ b + bias
    local ya = gl.empty({ a.shape[1], b.shape[2] }, { dtype = ref_t })
    gl.check(lib.gl_matmul_bias(ya.c, a:to(ref_t).c, b:to(ref_t).c, bias:to(ref_t).c))
    local yg = gl.empty({ a.shape[1], b.shape[2] }, { dtype = dt, device = 'cuda:0' })
    gl.check(lib.gl_matmul_bias(yg.c, a:to('cuda:0').c, b:to('cuda:0').c, bias:to('cuda:0').c))
    c, alpha, beta = ya, 1, 0
    local got = yg:to('cpu'):to(ref_t)
    local rel = got:to('float64'):max_abs_diff(ya:to('float64')) / math.max(max_abs(ya), 1e-30)
    local ok = rel == rel and rel <= TOL[dt]
    if not ok then failed = failed + 1 end
    io.write(('%-34s rel %.3g %s\n'):format(name .. ' ' .. dt, rel, ok and 'ok' or 'FAIL'))
    return
  end
  local ya = c:to(ref_t):clone()
  gl.check(lib.gl_matmul(ya.c, a:to(ref_t).c, b:to(ref_t).c, alpha, beta))
  local yg = c:to('cuda:0'):clone()
  gl.check(lib.gl_matmul(yg.c, a:to('cuda:0').c, b:to('cuda:0').c, alpha, beta))
  local got = yg:to('cpu'):to(ref_t)
  local rel = got:to('float64'):max_abs_diff(ya:to('float64')) / math.max(max_abs(ya), 1e-30)
  local ok = rel == rel and rel <= TOL[dt]
  if not ok then failed = failed + 1 end
  io.write(('%-34s rel %.3g %s\n'):format(name .. ' ' .. dt, rel, ok and 'ok' or 'FAIL'))
end

return function()
  for _, dt in ipairs({ 'float32', 'bfloat16', 'float64' }) do
    local a, bt, c = randn({ 3, 17, 24 }, dt), randn({ 3, 9, 24 }, dt), randn({ 3, 17, 9 }, dt)
    case('batched, b transposed', dt, a, bt:transpose(2, 3), c, 1, 0)
    case('alpha 2, beta 0.5', dt, a, bt:transpose(2, 3), c, 2, 0.5)
    local w = randn({ 24, 9 }, dt)
    case('2-d, a transposed view', dt, randn({ 24, 17 }, dt):transpose(1, 2), w, randn({ 17, 9 }, dt), 1, 0)
    case('bias epilogue', dt, randn({ 17, 24 }, dt), w, nil, 1, 0, randn({ 9 }, dt))
  end
  io.stdout:flush()
  return failed
end
