-- Helpers the CPU kernel specs (spec/kernels_*_spec.lua) share: random
-- inputs with a running seed, memory layouts, a relative-error check, central
-- finite differences, and the unary ops' Lua reference table (the unary
-- kernels' spec and the float32/bfloat16 spec both walk it).
-- The kernels are called directly through gl.lib.gl_xxx(t.c, ...).
local gl = require 'gptlua'
local assert = require 'luassert'  -- busted's, not the global of this module's environment
local lib, ffi = gl.lib, gl.ffi

local function check(rc) if rc ~= 0 then error(ffi.string(lib.gl_last_error()), 2) end end

-- ------------------------------------------------------------------ helpers
local seed = 9000
local function randn(shape, dtype)
  seed = seed + 1
  return gl.randn(shape, { seed = seed, dtype = dtype or 'float64' })
end
local function uniform(shape, lo, hi, dtype)
  seed = seed + 1
  return gl.uniform(shape, lo, hi, { seed = seed, dtype = dtype or 'float64' })
end
local function empty(shape, dtype) return gl.empty(shape, { dtype = dtype or 'float64' }) end
-- random integers in [lo, hi] as an integer tensor
local function randint(shape, lo, hi, dtype)
  local u = uniform(shape, 0, 1):tolist()
  local t = empty(shape, dtype or 'int64')
  local v = {}
  for i = 1, #u do v[i] = lo + math.floor(u[i] * (hi - lo + 1)) end
  return t:copy_(gl.tensor(v, { dtype = 'float64' }):view(shape))
end

local function numel(shape) local n = 1 for _, s in ipairs(shape) do n = n * s end return n end
local function copy_shape(s) local r = {} for i, v in ipairs(s) do r[i] = v end return r end
-- 0-based multi-index of row-major flat index i, and back
local function unravel(i, shape)
  local idx = {}
  for d = #shape, 1, -1 do idx[d] = i % shape[d]; i = math.floor(i / shape[d]) end
  return idx
end
local function ravel(idx, shape)
  local i = 0
  for d = 1, #shape do i = i * shape[d] + idx[d] end
  return i
end

-- max |got - want| / max(|want|, floor); NaN and infinities must match
local function assert_close(got, want, tol, what, floor)
  assert.equal(#want, #got, what .. ': element count')
  local num, den = 0, floor or 1e-300
  for i = 1, #want do
    local g, w = got[i], want[i]
    if w ~= w or w == math.huge or w == -math.huge then
      assert.is_true(g ~= g and w ~= w or g == w, ('%s: element %d is %s, expected %s'):format(what, i, g, w))
    else
      local d = math.abs(g - w)
      if d ~= d then d = math.huge end
      num = math.max(num, d); den = math.max(den, math.abs(w))
    end
  end
  local err = num / den
  assert.is_true(err <= tol, ('%s: relative error %.3g > %.3g'):format(what, err, tol))
end

-- t's values laid out differently in memory (for 'broadcast' the values
-- change: the first slice along dim 1, expanded with a 0 stride)
local LAYOUTS = { 'contiguous', 'transposed', 'narrowed', 'broadcast' }
local function layout(t, kind)
  local shape, nd = t.shape, #t.shape
  if kind == 'contiguous' or nd == 0 then return t:clone() end
  if kind == 'transposed' then
    if nd < 2 then return layout(t, 'narrowed') end
    local s = copy_shape(shape)
    s[nd], s[nd - 1] = s[nd - 1], s[nd]
    local v = gl.empty(s, { dtype = t.dtype }):transpose(nd - 1, nd)
    return v:copy_(t)
  elseif kind == 'narrowed' then
    local s = copy_shape(shape)
    s[nd] = s[nd] + 3
    return gl.zeros(s, { dtype = t.dtype }):narrow(nd, 2, shape[nd]):copy_(t)
  elseif kind == 'broadcast' then
    return t:narrow(1, 1, 1):clone():expand(shape)
  end
  error('unknown layout ' .. kind)
end

-- central finite difference of loss() with respect to each element of the
-- contiguous float64 tensor x
local function numgrad(x, loss, h)
  h = h or 1e-5
  local g, v = {}, ffi.new('double[1]')
  for i = 0, x:numel() - 1 do
    check(lib.gl_get_item(x.c, i, v))
    local x0 = v[0]
    check(lib.gl_set_item(x.c, i, x0 + h)); local lp = loss()
    check(lib.gl_set_item(x.c, i, x0 - h)); local lm = loss()
    check(lib.gl_set_item(x.c, i, x0))
    g[i + 1] = (lp - lm) / (2 * h)
  end
  return g
end
local function wsum(t, w)
  local s, v = 0, t:tolist()
  for i = 1, #v do s = s + v[i] * w[i] end
  return s
end
local FD_TOL = 1e-6

local function map(list, f) local r = {} for i, v in ipairs(list) do r[i] = f(v, i) end return r end

local GELU_K = math.sqrt(2 / math.pi)
local function f1(g) return function(x) return g(x) end end -- one argument only
local UNARY = {
  { op = 'NEG', f = function(x) return -x end },
  { op = 'EXP', f = f1(math.exp) },
  { op = 'LOG', f = f1(math.log), lo = 0.1, hi = 3 },
  { op = 'SQRT', f = f1(math.sqrt), lo = 0.1, hi = 3 },
  { op = 'RSQRT', f = function(x) return 1 / math.sqrt(x) end, lo = 0.1, hi = 3 },
  { op = 'TANH', f = f1(math.tanh) },
  { op = 'ABS', f = f1(math.abs) },
  { op = 'RELU', f = function(x) return x > 0 and x or 0 end },
  { op = 'RELU2', f = function(x) return x > 0 and x * x or 0 end },
  { op = 'GELU_TANH', f = function(x) return 0.5 * x * (1 + math.tanh(GELU_K * (x + 0.044715 * x ^ 3))) end },
  { op = 'SILU', f = function(x) return x / (1 + math.exp(-x)) end },
  { op = 'SIGMOID', f = function(x) return 1 / (1 + math.exp(-x)) end },
  { op = 'SIN', f = f1(math.sin) },
  { op = 'COS', f = f1(math.cos) },
  { op = 'SQUARE', f = function(x) return x * x end },
  { op = 'RECIPROCAL', f = function(x) return 1 / x end, lo = 0.5, hi = 2 },
  { op = 'CLAMP', f = function(x, a, b) return math.min(math.max(x, a), b) end, p0 = -0.5, p1 = 0.7 },
  { op = 'POW', f = function(x, a) return x ^ a end, lo = 0.2, hi = 2, p0 = 2.5 },
  { op = 'ADD_SCALAR', f = function(x, a) return x + a end, p0 = 1.5 },
  { op = 'MUL_SCALAR', f = function(x, a) return x * a end, p0 = -2 },
  { op = 'AFFINE', f = function(x, a, b) return x * a + b end, p0 = 3, p1 = -1 },
  { op = 'RSUB_SCALAR', f = function(x, a) return a - x end, p0 = 2 },
  { op = 'RDIV_SCALAR', f = function(x, a) return a / x end, lo = 0.5, hi = 2, p0 = 3 },
  { op = 'SOFTCAP', f = function(x, a) return a * math.tanh(x / a) end, p0 = 1.5 },
}

local function unary(u, out, x) check(lib.gl_unary(lib['GL_U_' .. u.op], out.c, x.c, u.p0 or 0, u.p1 or 0)) end

return { check = check, randn = randn, uniform = uniform, empty = empty, randint = randint, numel = numel,
         copy_shape = copy_shape, unravel = unravel, ravel = ravel, assert_close = assert_close, LAYOUTS = LAYOUTS,
         layout = layout, numgrad = numgrad, wsum = wsum, FD_TOL = FD_TOL, map = map, UNARY = UNARY, unary = unary }
