-- kernels_spec.lua — the CPU kernels behind engine/gl_ops.h, called directly
-- through gl.lib.gl_xxx(t.c, ...).
--
-- Every forward kernel is compared with a plain Lua float64 reference on
-- shapes with odd sizes and size-1 dims, with inputs in several memory
-- layouts (contiguous, transposed, narrowed, 0-stride broadcast).  Every
-- backward kernel is compared with a central finite difference of its
-- forward kernel in float64 (relative error < 1e-6).  Then float32 against
-- float64, bfloat16 storage, thread-count independence.
local gl = require 'gptlua'
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

-- ==================================================================== unary
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

describe('unary kernels', function()
  it('cover every op in the enum', function()
    assert.equal(tonumber(lib.GL_U_COUNT), #UNARY)
  end)
  it('match the Lua reference in every layout', function()
    for _, u in ipairs(UNARY) do
      for _, shape in ipairs({ { 7 }, { 3, 1, 5 }, { 2, 3, 4 } }) do
        local x = uniform(shape, u.lo or -2, u.hi or 2)
        for _, kind in ipairs(LAYOUTS) do
          local xv = layout(x, kind)
          local out = empty(shape)
          unary(u, out, xv)
          local want = map(xv:tolist(), function(v) return u.f(v, u.p0, u.p1) end)
          assert_close(out:tolist(), want, 1e-13, u.op .. ' ' .. kind)
        end
      end
    end
  end)
  it('write into strided outputs and work in place', function()
    local x = uniform({ 4, 6 }, -2, 2)
    local want = map(x:tolist(), math.tanh)
    local out = layout(empty({ 4, 6 }), 'transposed')
    unary(UNARY[6], out, x)
    assert_close(out:tolist(), want, 1e-15, 'tanh into a transposed out')
    local y = x:clone()
    unary(UNARY[6], y, y)
    assert_close(y:tolist(), want, 1e-15, 'tanh in place')
  end)
  it('handle 0-d tensors and mixed dtypes', function()
    local s = gl.tensor(0.5, { dtype = 'float64' })
    local o = empty({})
    unary(UNARY[2], o, s)
    assert.near(math.exp(0.5), o:item(), 1e-15)
    local ints = gl.tensor({ 1, -2, 3 }, { dtype = 'int64' })
    local f = empty({ 3 }, 'float32')
    unary(UNARY[1], f, ints)
    assert.same({ -1, 2, -3 }, f:tolist())
  end)
  it('float32 tanh (a vectorized rational approximation) stays within 1e-6 relative', function()
    local x = gl.tensor({ -12, -7.9, -3, -1, -0.5, -1e-3, -1e-30, 0, 1e-7, 0.01, 0.3, 0.55, 0.9, 2, 5, 8, 40 },
      { dtype = 'float32' })
    local xs = uniform({ 4001 }, -10, 10, 'float32')
    for _, input in ipairs({ x, xs }) do
      local out = empty(input.shape, 'float32')
      check(lib.gl_unary(lib.GL_U_TANH, out.c, input.c, 0, 0))
      local got = out:tolist()
      for i, v in ipairs(input:tolist()) do
        local want = math.tanh(v)
        assert.is_true(math.abs(got[i] - want) <= 1e-6 * math.abs(want) + 1e-38, ('tanh(%g) = %g, expected %g'):format(v, got[i], want))
      end
    end
    local nan = gl.tensor({ 0 / 0 }, { dtype = 'float32' })
    local o = empty({ 1 }, 'float32')
    check(lib.gl_unary(lib.GL_U_TANH, o.c, nan.c, 0, 0))
    assert.is_true(o:item() ~= o:item())
  end)
  it('float32 exp (vectorized Cephes polynomial) stays within 1e-6 relative, with IEEE edge cases', function()
    local x = gl.tensor({ -1 / 0, -200, -87.5, -86.9, -20, -1, -1e-8, 0, 1e-8, 0.34657, 0.5, 1, 10, 50, 88, 88.7, 1 / 0 },
      { dtype = 'float32' })
    for _, input in ipairs({ x, uniform({ 4001 }, -87, 88, 'float32') }) do
      local out = empty(input.shape, 'float32')
      check(lib.gl_unary(lib.GL_U_EXP, out.c, input.c, 0, 0))
      local got = out:tolist()
      for i, v in ipairs(input:tolist()) do
        local want = math.exp(v)
        if v > 88.7 or v < -87.3 then want = v > 0 and 1 / 0 or 0 end
        assert.is_true(got[i] == want or math.abs(got[i] - want) <= 1e-6 * want + 2e-38,
          ('exp(%g) = %g, expected %g'):format(v, got[i], want))
      end
    end
    local nan = gl.tensor({ 0 / 0 }, { dtype = 'float32' })
    local o = empty({ 1 }, 'float32')
    check(lib.gl_unary(lib.GL_U_EXP, o.c, nan.c, 0, 0))
    assert.is_true(o:item() ~= o:item())
  end)
  it('backward matches a finite difference of the forward kernel', function()
    for _, u in ipairs(UNARY) do
      local x = uniform({ 2, 5 }, u.lo or -2, u.hi or 2)
      local w = randn({ 2, 5 })
      local dx = empty({ 2, 5 })
      check(lib.gl_unary_backward(lib['GL_U_' .. u.op], dx.c, w.c, x.c, u.p0 or 0, u.p1 or 0))
      local out = empty({ 2, 5 })
      local num = numgrad(x, function() unary(u, out, x); return wsum(out, w:tolist()) end)
      assert_close(dx:tolist(), num, FD_TOL, u.op .. ' backward')
    end
  end)
  it('backward accepts strided inputs', function()
    local u = UNARY[10] -- gelu
    local x, w = uniform({ 3, 4 }, -2, 2), randn({ 3, 4 })
    local base = empty({ 3, 4 })
    check(lib.gl_unary_backward(lib.GL_U_GELU_TANH, base.c, w.c, x.c, 0, 0))
    local dx = layout(empty({ 3, 4 }), 'narrowed')
    check(lib.gl_unary_backward(lib.GL_U_GELU_TANH, dx.c, layout(w, 'transposed').c, layout(x, 'narrowed').c, 0, 0))
    assert_close(dx:tolist(), base:tolist(), 1e-15, u.op .. ' strided backward')
  end)
end)

-- =================================================================== binary
local BINARY = {
  { op = 'ADD', f = function(a, b) return a + b end },
  { op = 'SUB', f = function(a, b) return a - b end },
  { op = 'MUL', f = function(a, b) return a * b end },
  { op = 'DIV', f = function(a, b) return a / b end, blo = 0.5 },
  { op = 'POW', f = function(a, b) return a ^ b end, alo = 0.1 },
  { op = 'MAXIMUM', f = math.max },
  { op = 'MINIMUM', f = math.min },
  { op = 'EQ', f = function(a, b) return a == b and 1 or 0 end, cmp = true },
  { op = 'NE', f = function(a, b) return a ~= b and 1 or 0 end, cmp = true },
  { op = 'LT', f = function(a, b) return a < b and 1 or 0 end, cmp = true },
  { op = 'LE', f = function(a, b) return a <= b and 1 or 0 end, cmp = true },
  { op = 'GT', f = function(a, b) return a > b and 1 or 0 end, cmp = true },
  { op = 'GE', f = function(a, b) return a >= b and 1 or 0 end, cmp = true },
}

describe('binary and where kernels', function()
  it('cover every op in the enum', function() assert.equal(tonumber(lib.GL_B_COUNT), #BINARY) end)
  it('match the Lua reference with strided and broadcast operands', function()
    for _, o in ipairs(BINARY) do
      for _, shape in ipairs({ { 5 }, { 3, 1, 4 }, { 2, 3, 5 } }) do
        local a = uniform(shape, o.alo or -2, 2)
        local b = uniform(shape, o.blo or -2, 2)
        if o.cmp then b = layout(a, 'contiguous'); b:narrow(1, 1, 1):copy_(uniform(b:narrow(1, 1, 1).shape, -2, 2)) end
        for i, kind in ipairs(LAYOUTS) do
          local av, bv = layout(a, LAYOUTS[(i % 4) + 1]), layout(b, kind)
          local out = empty(shape, o.cmp and 'bool' or 'float64')
          check(lib.gl_binary(lib['GL_B_' .. o.op], out.c, av.c, bv.c))
          local bl = bv:tolist()
          local want = map(av:tolist(), function(x, j) return o.f(x, bl[j]) end)
          assert_close(out:tolist(), want, 1e-15, o.op .. ' ' .. kind)
        end
      end
    end
  end)
  it('propagate NaN through maximum and minimum', function()
    local a = gl.tensor({ 0 / 0, 1, 2 }, { dtype = 'float64' })
    local b = gl.tensor({ 1, 0 / 0, 3 }, { dtype = 'float64' })
    for _, op in ipairs({ 'MAXIMUM', 'MINIMUM' }) do
      local out = empty({ 3 })
      check(lib.gl_binary(lib['GL_B_' .. op], out.c, a.c, b.c))
      local v = out:tolist()
      assert.is_true(v[1] ~= v[1] and v[2] ~= v[2])
    end
  end)
  it('mix dtypes and alias the output with an input', function()
    local a = gl.tensor({ 1, 2, 3 }, { dtype = 'int32' })
    local b = gl.tensor({ 0.5, 0.25, 0.125 }, { dtype = 'float32' })
    local out = empty({ 3 }, 'float64')
    check(lib.gl_binary(lib.GL_B_ADD, out.c, a.c, b.c))
    assert.same({ 1.5, 2.25, 3.125 }, out:tolist())
    check(lib.gl_binary(lib.GL_B_MUL, b.c, b.c, b.c))
    assert.same({ 0.25, 0.0625, 0.015625 }, b:tolist())
  end)
  it('where selects by any nonzero condition', function()
    local shape = { 3, 1, 6 }
    local cond = randint(shape, 0, 1, 'bool')
    local a, b = randn(shape), randn(shape)
    for _, kind in ipairs(LAYOUTS) do
      local cv, av = layout(cond, kind), layout(a, kind)
      local out = layout(empty(shape), kind == 'broadcast' and 'contiguous' or kind)
      check(lib.gl_where(out.c, cv.c, av.c, b.c))
      local c, al, bl = cv:tolist(), av:tolist(), b:tolist()
      local want = map(c, function(v, i) return v ~= 0 and al[i] or bl[i] end)
      assert.same(want, out:tolist())
    end
  end)
end)

-- =============================================================== reductions
local REDUCE = {
  SUM = { init = 0, step = function(s, v) return s + v end },
  MEAN = { init = 0, step = function(s, v) return s + v end, fin = function(s, n) return s / n end },
  MAX = { init = -math.huge, step = math.max },
  MIN = { init = math.huge, step = math.min },
  SUMSQ = { init = 0, step = function(s, v) return s + v * v end },
  NORM2 = { init = 0, step = function(s, v) return s + v * v end, fin = function(s) return math.sqrt(s) end },
}

local function ref_reduce(r, x, mask)
  local shape, vals = x.shape, x:tolist()
  local oshape = {}
  for d = 1, #shape do oshape[d] = bit.band(mask, bit.lshift(1, d - 1)) ~= 0 and 1 or shape[d] end
  local acc, cnt = {}, {}
  for i = 1, #vals do
    local idx = unravel(i - 1, shape)
    for d = 1, #shape do if oshape[d] == 1 then idx[d] = 0 end end
    local o = ravel(idx, oshape) + 1
    acc[o] = r.step(acc[o] or r.init, vals[i]); cnt[o] = (cnt[o] or 0) + 1
  end
  for o = 1, numel(oshape) do acc[o] = r.fin and r.fin(acc[o], cnt[o]) or acc[o] end
  return acc, oshape
end

describe('reduction kernels', function()
  it('match the Lua reference for every op, dims mask and layout', function()
    for _, shape in ipairs({ { 5 }, { 3, 4 }, { 2, 1, 5 }, { 3, 4, 5 } }) do
      local x = randn(shape)
      for mask = 0, bit.lshift(1, #shape) - 1 do
        for name, r in pairs(REDUCE) do
          for _, kind in ipairs(LAYOUTS) do
            local xv = layout(x, kind)
            local want, oshape = ref_reduce(r, xv, mask)
            local out = empty(oshape)
            check(lib.gl_reduce(lib['GL_R_' .. name], out.c, xv.c, mask))
            assert_close(out:tolist(), want, 1e-13, ('%s mask %d %s'):format(name, mask, kind))
          end
        end
      end
    end
  end)
  it('reduce large tensors in parallel with float32 accumulation close to float64', function()
    local x64 = randn({ 300001 })
    local x32 = x64:to('float32')
    for _, name in ipairs({ 'SUM', 'MEAN', 'SUMSQ', 'MAX' }) do
      local o64, o32 = empty({ 1 }), empty({ 1 }, 'float32')
      check(lib.gl_reduce(lib['GL_R_' .. name], o64.c, x64.c, 1))
      check(lib.gl_reduce(lib['GL_R_' .. name], o32.c, x32.c, 1))
      local want = ref_reduce(REDUCE[name], x64, 1)
      assert_close(o64:tolist(), want, 1e-10, name .. ' float64')
      assert_close(o32:tolist(), want, name == 'SUM' and 2e-4 or 1e-5, name .. ' float32', 1)
    end
  end)
  it('are independent of the thread count', function()
    local x = randn({ 64, 4096 }, 'float32')
    local n0 = gl.get_num_threads()
    local res = {}
    for _, nt in ipairs({ 1, 2 }) do
      gl.set_num_threads(nt)
      local a, b = empty({ 1, 1 }, 'float32'), empty({ 64, 1 }, 'float32')
      check(lib.gl_reduce(lib.GL_R_SUM, a.c, x.c, 3))
      check(lib.gl_reduce(lib.GL_R_SUM, b.c, x.c, 2))
      res[nt] = { a:tolist(), b:tolist() }
    end
    gl.set_num_threads(n0)
    assert.same(res[1][2], res[2][2])
    assert.near(res[1][1][1], res[2][1][1], 1e-3)
  end)
  it('max over a dim returns the first maximal index', function()
    for _, shape in ipairs({ { 6 }, { 3, 5 }, { 2, 4, 3 } }) do
      local x = randint(shape, 0, 2, 'int64'):to('float64')
      for dim = 0, #shape - 1 do
        for _, kind in ipairs({ 'contiguous', 'transposed', 'narrowed' }) do
          local xv = layout(x, kind)
          local oshape = copy_shape(shape); oshape[dim + 1] = 1
          local out, idx = empty(oshape), empty(oshape, 'int64')
          check(lib.gl_reduce_max_dim(out.c, idx.c, xv.c, dim))
          local vals, wantv, wanti = xv:tolist(), {}, {}
          for i = 1, #vals do
            local m = unravel(i - 1, shape)
            local j = m[dim + 1]; m[dim + 1] = 0
            local o = ravel(m, oshape) + 1
            if wantv[o] == nil or vals[i] > wantv[o] then wantv[o], wanti[o] = vals[i], j end
          end
          assert.same(wantv, out:tolist())
          assert.same(wanti, idx:tolist())
        end
      end
    end
    local n = gl.tensor({ 1, 0 / 0, 5, 0 / 0 }, { dtype = 'float32' }) -- the first NaN wins
    local o, i = empty({ 1 }, 'float32'), empty({ 1 }, 'int64')
    check(lib.gl_reduce_max_dim(o.c, i.c, n.c, -1))
    assert.is_true(o:item() ~= o:item())
    assert.equal(1, i:item())
  end)
  it('sumsq accumulates in float64 for any dtype and layout', function()
    for _, dt in ipairs({ 'float32', 'float64', 'bfloat16' }) do
      local x = layout(randn({ 37, 29 }, dt), 'transposed')
      local want = 0
      for _, v in ipairs(x:tolist()) do want = want + v * v end
      local out = ffi.new('double[1]')
      check(lib.gl_sumsq(x.c, out))
      assert.near(want, out[0], 1e-12 * want)
    end
  end)
end)

-- =================================================================== matmul
local function ref_matmul(a, b, out0, alpha, beta)
  local nd = #a.shape
  local M, K, N = a.shape[nd - 1], a.shape[nd], b.shape[nd]
  local av, bv, ov = a:tolist(), b:tolist(), out0 and out0:tolist()
  local nb = numel(a.shape) / (M * K)
  local r = {}
  for bi = 0, nb - 1 do
    for m = 0, M - 1 do
      for n = 0, N - 1 do
        local s = 0
        for k = 0, K - 1 do s = s + av[bi * M * K + m * K + k + 1] * bv[bi * K * N + k * N + n + 1] end
        local o = bi * M * N + m * N + n + 1
        r[o] = alpha * s + (beta ~= 0 and beta * ov[o] or 0)
      end
    end
  end
  return r
end

-- a layout no BLAS call can take: every other element of a wider tensor
local function strided2(t)
  local nd, s = #t.shape, copy_shape(t.shape)
  s[nd] = 2 * s[nd]
  local big = gl.zeros(s, { dtype = t.dtype })
  local st = big:stride(); st[nd] = 2
  return big:_as_strided(t.shape, st, 0):copy_(t)
end
local MAT_LAYOUTS = {
  contiguous = function(t) return layout(t, 'contiguous') end,
  transposed = function(t) return layout(t, 'transposed') end,
  narrowed = function(t) return layout(t, 'narrowed') end,
  strided = strided2,
}

describe('matmul kernel', function()
  local function run(out, a, b, alpha, beta) check(lib.gl_matmul(out.c, a.c, b.c, alpha, beta)) end
  it('multiplies matrices in every operand layout, alpha and beta', function()
    for _, dims in ipairs({ { 5, 7, 3 }, { 1, 4, 6 }, { 6, 1, 1 }, { 3, 3, 1 } }) do
      local M, K, N = dims[1], dims[2], dims[3]
      local a, b = randn({ M, K }), randn({ K, N })
      for an, af in pairs(MAT_LAYOUTS) do
        for bn, bf in pairs(MAT_LAYOUTS) do
          local av, bv = af(a), bf(b)
          local out = empty({ M, N })
          run(out, av, bv, 1, 0)
          assert_close(out:tolist(), ref_matmul(av, bv, nil, 1, 0), 1e-13, ('%s @ %s'):format(an, bn))
        end
      end
      for on, of in pairs(MAT_LAYOUTS) do
        local c0 = randn({ M, N })
        local out = of(c0)
        run(out, a, b, 0.5, 2)
        assert_close(out:tolist(), ref_matmul(a, b, c0, 0.5, 2), 1e-13, 'alpha/beta into ' .. on)
      end
    end
  end)
  it('copies operands broadcast along their rows or columns (0 strides)', function()
    for _, dt in ipairs({ 'float64', 'float32' }) do
      local a = randn({ 1, 6 }, dt):expand({ 5, 6 })
      local b = randn({ 6, 1 }, dt):expand({ 6, 4 })
      local out = empty({ 5, 4 }, dt)
      run(out, a, b, 1, 0)
      assert_close(out:tolist(), ref_matmul(a, b, nil, 1, 0), dt == 'float64' and 1e-13 or 1e-6, 'broadcast ' .. dt)
    end
  end)
  it('overwrites with beta = 0 even over NaN, and handles K = 0', function()
    local a, b = randn({ 3, 4 }), randn({ 4, 2 })
    local out = gl.full({ 3, 2 }, 0 / 0, { dtype = 'float64' })
    run(out, a, b, 1, 0)
    assert_close(out:tolist(), ref_matmul(a, b, nil, 1, 0), 1e-13, 'beta 0')
    -- rows with a gap (ld > N) and a transposed out, both over NaN, in both dtypes
    for _, dt in ipairs({ 'float32', 'float64' }) do
      local a2, b2 = randn({ 3, 4 }, dt), randn({ 4, 2 }, dt)
      for _, v in ipairs({ gl.full({ 3, 5 }, 0 / 0, { dtype = dt }):narrow(2, 2, 2),
                           gl.full({ 2, 3 }, 0 / 0, { dtype = dt }):t() }) do
        run(v, a2, b2, 1, 0)
        assert_close(v:tolist(), ref_matmul(a2, b2, nil, 1, 0), dt == 'float64' and 1e-13 or 1e-6, 'beta 0 strided ' .. dt)
      end
    end
    local c0 = randn({ 3, 2 })
    local c = c0:clone()
    run(c, empty({ 3, 0 }), empty({ 0, 2 }), 1, 3)
    assert_close(c:tolist(), map(c0:tolist(), function(v) return 3 * v end), 1e-15, 'K = 0')
  end)
  it('batches with broadcast batch dims, folded and transposed views', function()
    local cases = {
      { a = { 2, 3, 4, 5 }, b = { 2, 3, 5, 6 } },
      { a = { 2, 1, 4, 5 }, b = { 1, 3, 5, 2 }, out = { 2, 3, 4, 2 } },
      { a = { 4, 6, 5 }, b = { 1, 5, 3 }, out = { 4, 6, 3 } }, -- b shared: folds into one GEMM
      { a = { 3, 1, 5 }, b = { 1, 5, 7 }, out = { 3, 1, 7 } },
    }
    for ci, c in ipairs(cases) do
      local nd = #c.a
      local out_shape = copy_shape(c.out or c.a); out_shape[nd] = c.b[nd]
      -- each operand broadcast to the batch dims of out
      local function full(s) local r = copy_shape(out_shape); r[nd - 1], r[nd] = s[nd - 1], s[nd]; return r end
      local a, b = randn(c.a), randn(c.b)
      for _, la in ipairs({ 'contiguous', 'transposed', 'narrowed' }) do
        for _, lb in ipairs({ 'contiguous', 'transposed' }) do
          local ae, be = MAT_LAYOUTS[la](a):expand(full(c.a)), MAT_LAYOUTS[lb](b):expand(full(c.b))
          for _, lo in ipairs({ 'contiguous', 'transposed', 'strided' }) do
            local c0 = randn(out_shape)
            local out = MAT_LAYOUTS[lo](c0)
            run(out, ae, be, 1.5, 1)
            assert_close(out:tolist(), ref_matmul(ae, be, c0, 1.5, 1), 1e-13,
              ('case %d %s @ %s -> %s'):format(ci, la, lb, lo))
          end
        end
      end
    end
  end)
  it('computes float32 close to float64 and bfloat16 through float32', function()
    local a, b = randn({ 2, 33, 17 }), randn({ 2, 17, 9 })
    local want = ref_matmul(a, b, nil, 1, 0)
    for dt, tol in pairs({ float32 = 1e-6, bfloat16 = 2e-2 }) do
      local out = empty({ 2, 33, 9 }, dt)
      run(out, a:to(dt), layout(b:to(dt), 'transposed'), 1, 0)
      assert_close(out:tolist(), want, tol, 'matmul ' .. dt)
    end
  end)
  it('splits tall products by rows over the threads, a operand plain or transposed', function()
    local nt = gl.get_num_threads()
    local b, c0 = randn({ 5, 7 }), randn({ 301, 7 })
    for _, threads in ipairs({ 1, 2, 3 }) do
      gl.set_num_threads(threads)
      for _, an in ipairs({ 'contiguous', 'transposed' }) do
        local a = layout(randn({ 301, 5 }), an)
        local out = c0:clone()
        run(out, a, b, 0.5, 2)
        assert_close(out:tolist(), ref_matmul(a, b, c0, 0.5, 2), 1e-13, ('%s a, %d threads'):format(an, threads))
        local out32 = empty({ 301, 7 }, 'float32')
        run(out32, a:to('float32'), b:to('float32'), 1, 0)
        assert_close(out32:tolist(), ref_matmul(a, b, nil, 1, 0), 1e-5, ('float32 %s a, %d threads'):format(an, threads))
      end
    end
    gl.set_num_threads(nt)
  end)
  it('runs a pair of independent products side by side, on 1 and 2 threads', function()
    local nt = gl.get_num_threads()
    local a1, b1 = randn({ 70, 33 }), randn({ 33, 21 })
    local a2, b2 = layout(randn({ 33, 70 }), 'transposed'), randn({ 2, 70, 5 })
    local c0, c1 = randn({ 2, 33, 5 }), randn({ 70, 21 })
    for _, threads in ipairs({ 1, 2 }) do
      gl.set_num_threads(threads)
      -- alpha and beta apply to both products
      local o1, o2 = c1:clone(), c0:clone()
      check(lib.gl_matmul_pair(o1.c, a1.c, b1.c, o2.c, a2:expand({ 2, 33, 70 }).c, b2.c, 0.5, 2))
      assert_close(o1:tolist(), ref_matmul(a1, b1, c1, 0.5, 2), 1e-13, 'first of the pair')
      assert_close(o2:tolist(), ref_matmul(a2:expand({ 2, 33, 70 }), b2, c0, 0.5, 2), 1e-13, 'second of the pair')
    end
    gl.set_num_threads(nt)
    local o1 = empty({ 70, 21 })
    local rc = lib.gl_matmul_pair(o1.c, a1.c, b1.c, empty({ 4, 4 }).c, a1.c, b1.c, 1, 0)
    assert.equal(-1, rc)
    assert.equal('gl_matmul_pair (second product): out has shape {4,4}, expected {70,21} (M of a is 70, N of b is 21)',
                 ffi.string(lib.gl_last_error()))
  end)
end)

-- ================================================================== softmax
local function ref_softmax(vals, C, log)
  local r = {}
  for row = 0, #vals / C - 1 do
    local m = -math.huge
    for c = 1, C do m = math.max(m, vals[row * C + c]) end
    local s = 0
    for c = 1, C do s = s + math.exp(vals[row * C + c] - m) end
    for c = 1, C do
      local z = vals[row * C + c] - m
      r[row * C + c] = log and z - math.log(s) or math.exp(z) / s
    end
  end
  return r
end

describe('softmax kernels', function()
  it('match the reference in every layout', function()
    for _, shape in ipairs({ { 7 }, { 3, 1 }, { 2, 3, 5 } }) do
      local x = randn(shape)
      for _, log in ipairs({ 0, 1 }) do
        for _, kind in ipairs(LAYOUTS) do
          local xv = layout(x, kind)
          local out = layout(empty(shape), kind == 'broadcast' and 'narrowed' or kind)
          check(lib.gl_softmax(out.c, xv.c, log))
          assert_close(out:tolist(), ref_softmax(xv:tolist(), shape[#shape], log == 1), 1e-14,
            ('softmax log=%d %s'):format(log, kind))
        end
      end
    end
    local big = gl.tensor({ 1000, 0, -1000 }, { dtype = 'float32' })
    local o = empty({ 3 }, 'float32')
    check(lib.gl_softmax(o.c, big.c, 0))
    assert.same({ 1, 0, 0 }, o:tolist())
  end)
  it('backward matches a finite difference', function()
    for _, log in ipairs({ 0, 1 }) do
      local x, w = randn({ 3, 6 }), randn({ 3, 6 })
      local y, dx = empty({ 3, 6 }), empty({ 3, 6 })
      check(lib.gl_softmax(y.c, x.c, log))
      check(lib.gl_softmax_backward(dx.c, y.c, layout(w, 'transposed').c, log))
      local num = numgrad(x, function() check(lib.gl_softmax(y.c, x.c, log)); return wsum(y, w:tolist()) end)
      assert_close(dx:tolist(), num, FD_TOL, 'softmax backward log=' .. log)
    end
  end)
end)

-- ============================================================ layer/rms norm
local function ref_norm(vals, C, w, b, eps, center)
  local y, mean, rstd = {}, {}, {}
  for row = 0, #vals / C - 1 do
    local m, v = 0, 0
    if center then for c = 1, C do m = m + vals[row * C + c] end m = m / C end
    for c = 1, C do v = v + (vals[row * C + c] - m) ^ 2 end
    local rs = 1 / math.sqrt(v / C + eps)
    for c = 1, C do y[row * C + c] = (vals[row * C + c] - m) * rs * (w and w[c] or 1) + (b and b[c] or 0) end
    mean[row + 1], rstd[row + 1] = m, rs
  end
  return y, mean, rstd
end

local function lead(shape) local s = copy_shape(shape); s[#s] = nil; return s end

describe('layernorm and rmsnorm kernels', function()
  local eps = 1e-5
  it('forward matches the reference with and without weight and bias', function()
    for _, shape in ipairs({ { 6 }, { 4, 1 }, { 2, 3, 7 } }) do
      local C = shape[#shape]
      local x, w, b = randn(shape), randn({ C }), randn({ C })
      for _, kind in ipairs(LAYOUTS) do
        local xv = layout(x, kind)
        for _, wb in ipairs({ { w, b }, { nil, nil }, { layout(w, 'narrowed'), nil } }) do
          local y, mean, rstd = empty(shape), empty(lead(shape)), empty(lead(shape))
          check(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, xv.c, wb[1] and wb[1].c, wb[2] and wb[2].c, eps))
          local ry, rm, rr = ref_norm(xv:tolist(), C, wb[1] and wb[1]:tolist(), wb[2] and wb[2]:tolist(), eps, true)
          assert_close(y:tolist(), ry, 1e-13, 'layernorm y ' .. kind)
          assert_close(mean:tolist(), rm, 1e-13, 'layernorm mean ' .. kind, 1)
          assert_close(rstd:tolist(), rr, 1e-13, 'layernorm rstd ' .. kind)
          local ry2, _, rr2 = ref_norm(xv:tolist(), C, wb[1] and wb[1]:tolist(), nil, eps, false)
          local y2, rstd2 = layout(empty(shape), kind == 'broadcast' and 'contiguous' or kind), empty(lead(shape))
          check(lib.gl_rmsnorm_forward(y2.c, rstd2.c, xv.c, wb[1] and wb[1].c, eps))
          assert_close(y2:tolist(), ry2, 1e-13, 'rmsnorm y ' .. kind)
          assert_close(rstd2:tolist(), rr2, 1e-13, 'rmsnorm rstd ' .. kind)
        end
      end
    end
  end)
  it('layernorm backward matches finite differences for x, weight and bias', function()
    local shape, C = { 2, 3, 5 }, 5
    local x, w, b, g = randn(shape), randn({ C }), randn({ C }), randn(shape)
    local y, mean, rstd = empty(shape), empty(lead(shape)), empty(lead(shape))
    local function loss()
      check(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, x.c, w.c, b.c, eps))
      return wsum(y, g:tolist())
    end
    loss()
    local dx, dw, db = empty(shape), empty({ C }), empty({ C })
    check(lib.gl_layernorm_backward(dx.c, dw.c, db.c, layout(g, 'transposed').c, x.c, w.c, mean.c, rstd.c))
    assert_close(dx:tolist(), numgrad(x, loss), FD_TOL, 'layernorm dx')
    assert_close(dw:tolist(), numgrad(w, loss), FD_TOL, 'layernorm dweight')
    assert_close(db:tolist(), numgrad(b, loss), FD_TOL, 'layernorm dbias')
    -- no weight: dx alone
    local function loss2()
      check(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, x.c, nil, nil, eps))
      return wsum(y, g:tolist())
    end
    loss2()
    check(lib.gl_layernorm_backward(dx.c, nil, nil, g.c, x.c, nil, mean.c, rstd.c))
    assert_close(dx:tolist(), numgrad(x, loss2), FD_TOL, 'layernorm dx without weight')
  end)
  it('rmsnorm backward matches finite differences for x and weight', function()
    local shape, C = { 3, 1, 6 }, 6
    local x, w, g = randn(shape), randn({ C }), randn(shape)
    local y, rstd = empty(shape), empty(lead(shape))
    local function loss()
      check(lib.gl_rmsnorm_forward(y.c, rstd.c, x.c, w.c, eps))
      return wsum(y, g:tolist())
    end
    loss()
    local dx, dw = empty(shape), empty({ C })
    check(lib.gl_rmsnorm_backward(dx.c, dw.c, g.c, x.c, w.c, rstd.c))
    assert_close(dx:tolist(), numgrad(x, loss), FD_TOL, 'rmsnorm dx')
    assert_close(dw:tolist(), numgrad(w, loss), FD_TOL, 'rmsnorm dweight')
  end)
  it('sums weight grads over many rows independently of the thread count', function()
    local x, g, w = randn({ 512, 64 }, 'float32'), randn({ 512, 64 }, 'float32'), randn({ 64 }, 'float32')
    local y, m, r = empty({ 512, 64 }, 'float32'), empty({ 512 }, 'float32'), empty({ 512 }, 'float32')
    check(lib.gl_layernorm_forward(y.c, m.c, r.c, x.c, w.c, nil, eps))
    local n0, res = gl.get_num_threads(), {}
    for _, nt in ipairs({ 1, 2 }) do
      gl.set_num_threads(nt)
      local dx, dw, db = empty({ 512, 64 }, 'float32'), empty({ 64 }, 'float32'), empty({ 64 }, 'float32')
      check(lib.gl_layernorm_backward(dx.c, dw.c, db.c, g.c, x.c, w.c, m.c, r.c))
      res[nt] = { dx:tolist(), dw:tolist(), db:tolist() }
    end
    gl.set_num_threads(n0)
    assert.same(res[1][1], res[2][1])
    assert_close(res[2][2], res[1][2], 1e-5, 'dweight across thread counts')
    assert_close(res[2][3], res[1][3], 1e-5, 'dbias across thread counts')
  end)
  -- dense float32 tensors take a pointer-walking path, others the strided
  -- one: same arithmetic, so the same bits
  it('dense and strided operands give identical rmsnorm, layernorm and rope results', function()
    local shape = { 3, 5, 4, 32 }
    for _, dt in ipairs({ 'float32', 'float64' }) do
      local x, g, w = randn(shape, dt), randn(shape, dt), randn({ 32 }, dt)
      local angle = randn({ 5, 16 }, dt)
      local cos, sin = gl.cos(angle), gl.sin(angle)
      local res = {}
      for _, kind in ipairs({ 'contiguous', 'transposed', 'narrowed' }) do
        local xv, gv = layout(x, kind), layout(g, kind)
        local y, m, r = layout(empty(shape, dt), kind), empty(lead(shape), dt), empty(lead(shape), dt)
        local dx, dw, db = layout(empty(shape, dt), kind), empty({ 32 }, dt), empty({ 32 }, dt)
        check(lib.gl_layernorm_forward(y.c, m.c, r.c, xv.c, w.c, nil, eps))
        check(lib.gl_layernorm_backward(dx.c, dw.c, db.c, gv.c, xv.c, w.c, m.c, r.c))
        local y2, r2, dx2 = layout(empty(shape, dt), kind), empty(lead(shape), dt), layout(empty(shape, dt), kind)
        check(lib.gl_rmsnorm_forward(y2.c, r2.c, xv.c, nil, eps))
        check(lib.gl_rmsnorm_backward(dx2.c, nil, gv.c, xv.c, nil, r2.c))
        local ro, ri = layout(empty(shape, dt), kind), layout(empty(shape, dt), kind)
        check(lib.gl_rope(ro.c, xv.c, layout(cos, kind).c, layout(sin, kind).c, 0))
        check(lib.gl_rope(ri.c, ro.c, cos.c, sin.c, 1))
        res[kind] = { y:tolist(), m:tolist(), r:tolist(), dx:tolist(), y2:tolist(), r2:tolist(), dx2:tolist(),
                      ro:tolist(), ri:tolist() }
      end
      assert.same(res.contiguous, res.transposed)
      assert.same(res.contiguous, res.narrowed)
      assert_close(res.contiguous[9], x:tolist(), dt == 'float32' and 1e-5 or 1e-12, 'rope inverse ' .. dt)
    end
  end)
end)

-- ======================================================== embedding, index ops
describe('embedding and index kernels', function()
  it('embedding forward gathers rows for int32 and int64 ids of any shape', function()
    local V, C = 7, 5
    local table_ = randn({ V, C })
    for _, idt in ipairs({ 'int32', 'int64' }) do
      for _, ishape in ipairs({ { 4 }, { 2, 3 }, { 1, 1, 2 }, { 3, 5 } }) do
        local ids = randint(ishape, 0, V - 1, idt)
        if ishape[2] == 5 then ids = ids:narrow(1, 1, 1):expand(ishape) end -- 0-stride ids
        for _, kind in ipairs({ 'contiguous', 'transposed' }) do
          local tv = layout(table_, kind)
          local oshape = copy_shape(ishape); oshape[#oshape + 1] = C
          local out = empty(oshape)
          check(lib.gl_embedding_forward(out.c, tv.c, ids.c))
          local tl, want = tv:tolist(), {}
          for r, id in ipairs(ids:tolist()) do
            for c = 1, C do want[(r - 1) * C + c] = tl[id * C + c] end
          end
          assert.same(want, out:tolist())
        end
      end
    end
  end)
  it('embedding backward matches a finite difference of the forward', function()
    local V, C = 6, 3
    local tab, ids, g = randn({ V, C }), randint({ 2, 4 }, 0, 4, 'int32'), randn({ 2, 4, C })
    local out = empty({ 2, 4, C })
    local dt = gl.full({ V, C }, 7, { dtype = 'float64' })
    check(lib.gl_embedding_backward(dt.c, layout(g, 'transposed').c, ids.c))
    local num = numgrad(tab, function() check(lib.gl_embedding_forward(out.c, tab.c, ids.c)); return wsum(out, g:tolist()) end)
    assert_close(dt:tolist(), num, FD_TOL, 'embedding backward')
    local bf = empty({ V, C }, 'bfloat16')
    check(lib.gl_embedding_backward(bf.c, g:to('bfloat16').c, ids.c))
    assert_close(bf:tolist(), num, 2e-2, 'embedding backward bfloat16')
  end)
  it('index_select and gather match the reference along every dim', function()
    local x = randn({ 4, 5, 3 })
    for dim = -1, 2 do
      local d = dim < 0 and 3 + dim or dim
      local n = 6
      local idx = randint({ n }, 0, x.shape[d + 1] - 1)
      local oshape = copy_shape(x.shape); oshape[d + 1] = n
      for _, kind in ipairs({ 'contiguous', 'transposed', 'broadcast' }) do
        local xv = layout(x, kind)
        local out = empty(oshape)
        check(lib.gl_index_select(out.c, xv.c, dim, idx.c))
        local xl, il, want = xv:tolist(), idx:tolist(), {}
        for i = 0, numel(oshape) - 1 do
          local m = unravel(i, oshape)
          m[d + 1] = il[m[d + 1] + 1]
          want[i + 1] = xl[ravel(m, x.shape) + 1]
        end
        assert.same(want, out:tolist())
        -- gather with an index narrower than x in the other dims
        local gshape = copy_shape(x.shape); gshape[d + 1] = 3
        for k = 1, 3 do if k ~= d + 1 then gshape[k] = gshape[k] - 1 end end
        local gidx = randint(gshape, 0, x.shape[d + 1] - 1, 'int32')
        local gout = empty(gshape)
        check(lib.gl_gather(gout.c, xv.c, dim, gidx.c))
        local gl_, gw = gidx:tolist(), {}
        for i = 0, numel(gshape) - 1 do
          local m = unravel(i, gshape)
          m[d + 1] = gl_[i + 1]
          gw[i + 1] = xl[ravel(m, x.shape) + 1]
        end
        assert.same(gw, gout:tolist())
      end
    end
  end)
  it('scatter_add and index_add accumulate and are the adjoints of gather and index_select', function()
    local x = randn({ 4, 5 })
    for dim = 0, 1 do
      local gshape = { 3, 4 }
      local idx = randint(gshape, 0, x.shape[dim + 1] - 1)
      local w = randn(gshape)
      local g = empty(gshape)
      check(lib.gl_gather(g.c, x.c, dim, idx.c))
      local base = randn({ 4, 5 })
      local acc = base:clone()
      check(lib.gl_scatter_add(acc.c, dim, idx.c, layout(w, 'transposed').c))
      -- <gather(x), w> == <x, scatter_add(0, w)>, and acc = base + scatter_add(0, w)
      local s = wsum(g, w:tolist())
      local al, bl, xl, t = acc:tolist(), base:tolist(), x:tolist(), 0
      for i = 1, #al do t = t + (al[i] - bl[i]) * xl[i] end
      assert.near(s, t, 1e-12)
      -- index_add against index_select
      local iidx = randint({ 7 }, 0, x.shape[dim + 1] - 1, 'int32')
      local sshape = copy_shape(x.shape); sshape[dim + 1] = 7
      local src, sel = randn(sshape), empty(sshape)
      check(lib.gl_index_select(sel.c, x.c, dim, iidx.c))
      local acc2 = base:clone()
      check(lib.gl_index_add(acc2.c, dim, iidx.c, src.c))
      local a2, t2 = acc2:tolist(), 0
      for i = 1, #a2 do t2 = t2 + (a2[i] - bl[i]) * xl[i] end
      assert.near(wsum(sel, src:tolist()), t2, 1e-12)
    end
  end)
end)

-- ===================================================================== rope
local function ref_rope(x, cs, sn, inverse)
  local B, T, H, D = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
  local xl, cl, sl, half, r = x:tolist(), cs:tolist(), sn:tolist(), D / 2, {}
  local sg = inverse and -1 or 1
  for row = 0, B * T * H - 1 do
    local t = math.floor(row / H) % T
    for i = 1, half do
      local x1, x2 = xl[row * D + i], xl[row * D + half + i]
      local c, s = cl[t * half + i], sl[t * half + i]
      r[row * D + i] = x1 * c + sg * x2 * s
      r[row * D + half + i] = x2 * c - sg * x1 * s
    end
  end
  return r
end

local function rope_tables(T, D, from)
  local ang = {}
  for t = 0, T - 1 do
    ang[t + 1] = {}
    for i = 0, D / 2 - 1 do ang[t + 1][i + 1] = (t + (from or 0)) / 10000 ^ (2 * i / D) end
  end
  local cs = gl.tensor(map(ang, function(row) return map(row, math.cos) end), { dtype = 'float64' })
  local sn = gl.tensor(map(ang, function(row) return map(row, math.sin) end), { dtype = 'float64' })
  return cs, sn
end

describe('rope kernel', function()
  it('rotates halves as the reference, from strided tables and in place', function()
    local x = randn({ 2, 3, 2, 6 })
    local cs, sn = rope_tables(8, 6)
    cs, sn = cs:narrow(1, 4, 3), sn:narrow(1, 4, 3) -- positions 3..5 of a cache
    for _, inv in ipairs({ 0, 1 }) do
      for _, kind in ipairs(LAYOUTS) do
        local xv = layout(x, kind)
        local out = empty(x.shape)
        check(lib.gl_rope(out.c, xv.c, cs.c, sn.c, inv))
        assert_close(out:tolist(), ref_rope(xv, cs, sn, inv == 1), 1e-14, 'rope ' .. kind)
      end
    end
    local y = x:clone()
    check(lib.gl_rope(y.c, y.c, cs.c, sn.c, 0))
    assert_close(y:tolist(), ref_rope(x, cs, sn, false), 1e-14, 'rope in place')
  end)
  it('inverse is the backward: finite difference of the forward', function()
    local x, g = randn({ 1, 3, 2, 4 }), randn({ 1, 3, 2, 4 })
    local cs, sn = rope_tables(3, 4)
    local out, dx = empty(x.shape), empty(x.shape)
    check(lib.gl_rope(dx.c, g.c, cs.c, sn.c, 1))
    local num = numgrad(x, function() check(lib.gl_rope(out.c, x.c, cs.c, sn.c, 0)); return wsum(out, g:tolist()) end)
    assert_close(dx:tolist(), num, FD_TOL, 'rope backward')
  end)
end)

-- ================================================================ attention
local function ref_attention(q, k, v, scale, window)
  local B, H, T, D = q.shape[1], q.shape[2], q.shape[3], q.shape[4]
  local Hkv, S = k.shape[2], k.shape[3]
  local ql, kl, vl, out, lse = q:tolist(), k:tolist(), v:tolist(), {}, {}
  for b = 0, B - 1 do
    for h = 0, H - 1 do
      local hk = math.floor(h / (H / Hkv))
      for t = 0, T - 1 do
        local pos = window < 0 and S - 1 or S - T + t  -- window < 0: no mask
        local lo = (window > 0) and math.max(0, pos - window + 1) or 0
        local qo = ((b * H + h) * T + t) * D
        local sc, m = {}, -math.huge
        for j = lo, pos do
          local ko, s = ((b * Hkv + hk) * S + j) * D, 0
          for d = 1, D do s = s + ql[qo + d] * kl[ko + d] end
          sc[j] = s * scale; m = math.max(m, sc[j])
        end
        local l = 0
        for j = lo, pos do sc[j] = math.exp(sc[j] - m); l = l + sc[j] end
        for d = 1, D do
          local acc = 0
          for j = lo, pos do acc = acc + sc[j] * vl[((b * Hkv + hk) * S + j) * D + d] end
          out[qo + d] = acc / l
        end
        lse[(b * H + h) * T + t + 1] = m + math.log(l)
      end
    end
  end
  return out, lse
end

-- t (B, H, T, D) as the transposed view of a (B, T, H, D) tensor, as models make it
local function heads_view(t)
  local s = t.shape
  return gl.empty({ s[1], s[3], s[2], s[4] }, { dtype = t.dtype }):transpose(2, 3):copy_(t)
end

describe('attention kernels', function()
  local cases = {
    { B = 2, H = 4, Hkv = 2, T = 3, S = 5, D = 3, window = 0 },
    { B = 1, H = 2, Hkv = 2, T = 4, S = 4, D = 5, window = 2 },
    { B = 2, H = 3, Hkv = 1, T = 1, S = 6, D = 4, window = 0 },
    { B = 1, H = 2, Hkv = 1, T = 5, S = 7, D = 2, window = 3 },
    { B = 3, H = 2, Hkv = 2, T = 2, S = 3, D = 20, window = 0, shared_kv = true },
    { B = 1, H = 2, Hkv = 1, T = 20, S = 37, D = 17, window = 11 }, -- spans several blocks of keys and dims
    { B = 1, H = 2, Hkv = 1, T = 45, S = 50, D = 33, window = 0 },   -- several query tiles, a KV offset
    { B = 1, H = 2, Hkv = 2, T = 70, S = 70, D = 8, window = 19 },   -- window edges inside and across tiles
    { B = 2, H = 4, Hkv = 2, T = 40, S = 9, D = 6, window = -1 },    -- no mask, T > S (ring attention's blocks)
    { B = 1, H = 2, Hkv = 1, T = 5, S = 38, D = 4, window = -1 },    -- no mask, T < S
  }
  it('forward matches the reference (GQA, KV offset, window, strided heads)', function()
    for ci, c in ipairs(cases) do
      local q = heads_view(randn({ c.B, c.H, c.T, c.D }))
      local k, v = randn({ c.B, c.Hkv, c.S, c.D }), layout(randn({ c.B, c.Hkv, c.S, c.D }), 'narrowed')
      if c.shared_kv then k, v = layout(k, 'broadcast'), layout(v, 'broadcast') end -- 0 batch stride
      local out, lse = empty({ c.B, c.H, c.T, c.D }), empty({ c.B, c.H, c.T })
      local scale = 1 / math.sqrt(c.D)
      check(lib.gl_attention_forward(out.c, lse.c, q.c, k.c, v.c, scale, c.window))
      local ro, rl = ref_attention(q, k, v, scale, c.window)
      assert_close(out:tolist(), ro, 1e-13, 'attention out case ' .. ci)
      assert_close(lse:tolist(), rl, 1e-13, 'attention lse case ' .. ci)
    end
  end)
  it('backward matches finite differences for q, k and v', function()
    for ci, c in ipairs(cases) do
      local q, k, v = randn({ c.B, c.H, c.T, c.D }), randn({ c.B, c.Hkv, c.S, c.D }), randn({ c.B, c.Hkv, c.S, c.D })
      local g = randn({ c.B, c.H, c.T, c.D })
      local out, lse = empty(q.shape), empty({ c.B, c.H, c.T })
      local scale = 0.7
      local function loss()
        check(lib.gl_attention_forward(out.c, lse.c, q.c, k.c, v.c, scale, c.window))
        return wsum(out, g:tolist())
      end
      loss()
      local dq, dk, dv = layout(empty(q.shape), 'transposed'), empty(k.shape), empty(k.shape)
      check(lib.gl_attention_backward(dq.c, dk.c, dv.c, heads_view(g).c, q.c, k.c, v.c,
        out.c, lse.c, scale, c.window))
      assert_close(dq:tolist(), numgrad(q, loss), FD_TOL, 'attention dq case ' .. ci)
      assert_close(dk:tolist(), numgrad(k, loss), FD_TOL, 'attention dk case ' .. ci)
      assert_close(dv:tolist(), numgrad(v, loss), FD_TOL, 'attention dv case ' .. ci)
    end
  end)
  -- ring attention's contract: the keys in two blocks (earlier ones
  -- unmasked, the last causal), each block's forward merged through the
  -- log-sum-exp, each block's backward given the merged out and lse: the
  -- whole attention's out and gradients
  it('blocks of keys merged through the log-sum-exp give the whole attention, forward and backward', function()
    local B, H, Hkv, T, S1, D = 2, 4, 2, 37, 23, 5
    local q, k, v = randn({ B, H, T, D }), randn({ B, Hkv, S1 + T, D }), randn({ B, Hkv, S1 + T, D })
    local g = randn({ B, H, T, D })
    local out, lse = empty(q.shape), empty({ B, H, T })
    check(lib.gl_attention_forward(out.c, lse.c, q.c, k.c, v.c, 0.6, 0))
    local dq, dk, dv = empty(q.shape), empty(k.shape), empty(k.shape)
    check(lib.gl_attention_backward(dq.c, dk.c, dv.c, g.c, q.c, k.c, v.c, out.c, lse.c, 0.6, 0))
    local k1, v1, k2, v2 = k:narrow(3, 1, S1), v:narrow(3, 1, S1), k:narrow(3, S1 + 1, T), v:narrow(3, S1 + 1, T)
    local o1, l1, o2, l2 = empty(q.shape), empty(lse.shape), empty(q.shape), empty(lse.shape)
    check(lib.gl_attention_forward(o1.c, l1.c, q.c, k1.c, v1.c, 0.6, -1))
    check(lib.gl_attention_forward(o2.c, l2.c, q.c, k2.c, v2.c, 0.6, 0))
    local m = gl.maximum(l1, l2)
    local w1, w2 = gl.exp(l1 - m), gl.exp(l2 - m)
    local l = m + gl.log(w1 + w2)
    local o = o1 * gl.exp(l1 - l):unsqueeze(4) + o2 * gl.exp(l2 - l):unsqueeze(4)
    assert_close(o:tolist(), out:tolist(), 1e-13, 'merged out')
    assert_close(l:tolist(), lse:tolist(), 1e-13, 'merged lse')
    local dq1, dq2 = empty(q.shape), empty(q.shape)
    local dk1, dv1, dk2, dv2 = empty(k1.shape), empty(k1.shape), empty(k2.shape), empty(k2.shape)
    check(lib.gl_attention_backward(dq1.c, dk1.c, dv1.c, g.c, q.c, k1.c, v1.c, o.c, l.c, 0.6, -1))
    check(lib.gl_attention_backward(dq2.c, dk2.c, dv2.c, g.c, q.c, k2.c, v2.c, o.c, l.c, 0.6, 0))
    assert_close((dq1 + dq2):tolist(), dq:tolist(), 1e-12, 'dq summed over blocks')
    assert_close(gl.cat({ dk1, dk2 }, 3):tolist(), dk:tolist(), 1e-12, 'dk of the blocks')
    assert_close(gl.cat({ dv1, dv2 }, 3):tolist(), dv:tolist(), 1e-12, 'dv of the blocks')
  end)
end)

-- ============================================================ cross-entropy
local function ref_ce(logits, targets, ignore, softcap)
  local N, V = logits.shape[1], logits.shape[2]
  local xl, tl, loss, lse = logits:tolist(), targets:tolist(), {}, {}
  for r = 0, N - 1 do
    if tl[r + 1] == ignore then loss[r + 1], lse[r + 1] = 0, 0
    else
      local z, m = {}, -math.huge
      for c = 1, V do
        local x = xl[r * V + c]
        z[c] = softcap > 0 and softcap * math.tanh(x / softcap) or x
        m = math.max(m, z[c])
      end
      local s = 0
      for c = 1, V do s = s + math.exp(z[c] - m) end
      lse[r + 1] = m + math.log(s)
      loss[r + 1] = lse[r + 1] - z[tl[r + 1] + 1]
    end
  end
  return loss, lse
end

describe('cross-entropy kernels', function()
  it('forward matches the reference with softcap and ignored rows', function()
    for _, softcap in ipairs({ 0, 3 }) do
      for _, idt in ipairs({ 'int32', 'int64' }) do
        local logits = randn({ 6, 11 })
        check(lib.gl_unary(lib.GL_U_MUL_SCALAR, logits.c, logits.c, 4, 0)) -- large enough for the cap to bite
        local targets = randint({ 6 }, 0, 10, idt)
        targets:set(-100, 3)
        for _, kind in ipairs(LAYOUTS) do
          local lv = layout(logits, kind)
          local losses, lse = empty({ 6 }), empty({ 6 })
          check(lib.gl_cross_entropy_forward(losses.c, lse.c, lv.c, targets.c, -100, softcap))
          local rl, re = ref_ce(lv, targets, -100, softcap)
          assert_close(losses:tolist(), rl, 1e-14, 'ce loss ' .. kind)
          assert_close(lse:tolist(), re, 1e-14, 'ce lse ' .. kind)
        end
      end
    end
  end)
  it('backward matches a finite difference of the forward', function()
    for _, softcap in ipairs({ 0, 2.5 }) do
      local logits = randn({ 4, 7 })
      local targets = gl.tensor({ 3, -1, 0, 6 }, { dtype = 'int64' })
      local losses, lse = empty({ 4 }), empty({ 4 })
      local scale = 0.37
      local function loss()
        check(lib.gl_cross_entropy_forward(losses.c, lse.c, logits.c, targets.c, -1, softcap))
        local s = 0
        for _, v in ipairs(losses:tolist()) do s = s + v end
        return s * scale
      end
      loss()
      local dl = layout(empty({ 4, 7 }), 'transposed')
      check(lib.gl_cross_entropy_backward(dl.c, logits.c, targets.c, lse.c, -1, softcap, scale, nil))
      assert_close(dl:tolist(), numgrad(logits, loss), FD_TOL, 'ce backward softcap ' .. softcap)
    end
  end)
  it('backward may overwrite the logits in place', function()
    local logits = randn({ 3, 5 })
    local targets = gl.tensor({ 1, 4, 0 }, { dtype = 'int32' })
    local losses, lse = empty({ 3 }), empty({ 3 })
    check(lib.gl_cross_entropy_forward(losses.c, lse.c, logits.c, targets.c, -100, 0))
    local want = empty({ 3, 5 })
    check(lib.gl_cross_entropy_backward(want.c, logits.c, targets.c, lse.c, -100, 0, 1, nil))
    check(lib.gl_cross_entropy_backward(logits.c, logits.c, targets.c, lse.c, -100, 0, 1, nil))
    assert.same(want:tolist(), logits:tolist())
  end)
  it('backward multiplies by a factor read from a tensor (scale_by)', function()
    for _, dt in ipairs({ 'float32', 'float64' }) do
      local logits = randn({ 3, 5 }):to(dt)
      local targets = gl.tensor({ 1, -1, 0 }, { dtype = 'int64' })
      local sd = dt == 'float64' and 'float64' or 'float32'
      local losses, lse = gl.empty({ 3 }, { dtype = sd }), gl.empty({ 3 }, { dtype = sd })
      check(lib.gl_cross_entropy_forward(losses.c, lse.c, logits.c, targets.c, -1, 2))
      local want, got = gl.empty({ 3, 5 }, { dtype = dt }), gl.empty({ 3, 5 }, { dtype = dt })
      check(lib.gl_cross_entropy_backward(want.c, logits.c, targets.c, lse.c, -1, 2, 0.5 * 0.25, nil))
      check(lib.gl_cross_entropy_backward(got.c, logits.c, targets.c, lse.c, -1, 2, 0.5, gl.tensor({ 0.25 }).c))
      assert.is_true(got:max_abs_diff(want) < 1e-7, dt)
    end
  end)
end)

-- ================================================================== dropout
describe('dropout kernel', function()
  local function philox_word(s, c)
    local w = ffi.new('uint32_t[4]')
    check(lib.gl_rand_u32(s, math.floor(c / 4), w))
    return w[c % 4]
  end
  it('keeps element i when the Philox word (offset + i) is below 1 - p, scaled', function()
    local x = randn({ 5, 37 })
    for _, kind in ipairs({ 'contiguous', 'transposed', 'narrowed', 'broadcast' }) do
      local xv = layout(x, kind)
      local out = empty(x.shape)
      local p, s, off = 0.3, 1234, 7
      check(lib.gl_dropout(out.c, xv.c, p, s, off))
      local xl, want, kept = xv:tolist(), {}, 0
      for i = 1, #xl do
        local unit = (bit.rshift(philox_word(s, off + i - 1), 8) + 1) / 16777216
        if unit < 1 - p then want[i] = xl[i] * (1 / (1 - p)); kept = kept + 1 else want[i] = 0 end
      end
      assert.same(want, out:tolist())
      assert.is_true(kept > 0.5 * #xl and kept < 0.9 * #xl)
    end
    local o = empty(x.shape)
    check(lib.gl_dropout(o.c, x.c, 0, 1, 0))
    assert.same(x:tolist(), o:tolist())
    -- p = 1 keeps nothing: a model that trains nothing, refused (issue 14)
    assert.equal(lib.GL_ERR, lib.gl_dropout(o.c, x.c, 1, 1, 0))
  end)
  it('backward is the same call on dy: finite difference', function()
    local x, g = randn({ 3, 8 }), randn({ 3, 8 })
    local out, dx = empty(x.shape), empty(x.shape)
    check(lib.gl_dropout(dx.c, g.c, 0.4, 99, 3))
    local num = numgrad(x, function() check(lib.gl_dropout(out.c, x.c, 0.4, 99, 3)); return wsum(out, g:tolist()) end)
    assert_close(dx:tolist(), num, FD_TOL, 'dropout backward')
  end)
end)

-- =============================================================== optimizers
describe('optimizer kernels', function()
  it('adamw matches the reference over several steps on a slice', function()
    for _, pdt in ipairs({ 'float64', 'float32' }) do
      for _, gdt in ipairs({ pdt, 'bfloat16' }) do
        local n, start, len = 37, 5, 20
        local p, m, v = randn({ n }, pdt), gl.zeros({ n }, { dtype = pdt }), gl.zeros({ n }, { dtype = pdt })
        local rp, rm, rv = p:tolist(), m:tolist(), v:tolist()
        local lr, b1, b2, eps, wd = 0.01, 0.9, 0.95, 1e-8, 0.1
        for step = 1, 3 do
          local g = randn({ n }, gdt)
          local gl_ = g:tolist()
          check(lib.gl_adamw_update(p.c, g.c, m.c, v.c, start, len, lr, b1, b2, eps, wd, step))
          for i = start + 1, start + len do
            rp[i] = rp[i] - lr * wd * rp[i]
            rm[i] = b1 * rm[i] + (1 - b1) * gl_[i]
            rv[i] = b2 * rv[i] + (1 - b2) * gl_[i] ^ 2
            rp[i] = rp[i] - lr * (rm[i] / (1 - b1 ^ step)) / (math.sqrt(rv[i] / (1 - b2 ^ step)) + eps)
          end
        end
        local tol = pdt == 'float64' and 1e-12 or 1e-5
        assert_close(p:tolist(), rp, tol, 'adamw param ' .. pdt .. '/' .. gdt)
        assert_close(m:tolist(), rm, tol, 'adamw m ' .. pdt .. '/' .. gdt)
        assert_close(v:tolist(), rv, tol, 'adamw v ' .. pdt .. '/' .. gdt)
      end
    end
  end)
  it('momentum matches nanochat lerps, nesterov or not, out aliasing grad', function()
    for _, nesterov in ipairs({ 0, 1 }) do
      local n, start, len, mu = 2500, 100, 2300, 0.95
      local buf, g = randn({ n }), randn({ n })
      local rb, rg = buf:tolist(), g:tolist()
      local want = g:tolist()
      for i = start + 1, start + len do
        rb[i] = rb[i] + (1 - mu) * (rg[i] - rb[i])
        want[i] = nesterov == 1 and rg[i] + mu * (rb[i] - rg[i]) or rb[i]
      end
      check(lib.gl_momentum_update(g.c, buf.c, g.c, start, len, mu, nesterov))
      assert_close(buf:tolist(), rb, 1e-14, 'momentum buf')
      assert_close(g:tolist(), want, 1e-14, 'momentum out')
    end
  end)
end)

-- ====================================================== precision and storage
describe('float32 and bfloat16', function()
  it('float32 kernels agree with float64', function()
    local x64 = randn({ 6, 33 })
    local x32 = x64:to('float32')
    local function both(fn)
      local a, b = fn(x64, 'float64'), fn(x32, 'float32')
      assert_close(b:tolist(), a:tolist(), 1e-5, 'float32 vs float64')
    end
    for _, u in ipairs(UNARY) do
      both(function(x, dt)
        local xi = x
        if u.lo then -- into the op's domain: |x| + lo
          xi = empty(x.shape, dt)
          check(lib.gl_unary(lib.GL_U_ABS, xi.c, x.c, 0, 0))
          check(lib.gl_unary(lib.GL_U_ADD_SCALAR, xi.c, xi.c, u.lo, 0))
        end
        local out = empty(x.shape, dt)
        unary(u, out, xi)
        return out
      end)
    end
    both(function(x, dt) local o = empty(x.shape, dt); check(lib.gl_softmax(o.c, x.c, 1)); return o end)
    both(function(x, dt)
      local o, m, r = empty(x.shape, dt), empty({ 6 }, dt), empty({ 6 }, dt)
      check(lib.gl_layernorm_forward(o.c, m.c, r.c, x.c, nil, nil, 1e-5)); return o
    end)
    both(function(x, dt)
      local t = gl.tensor({ 1, 2, 3, 4, 5, 6 }, { dtype = 'int64' })
      local l, e = empty({ 6 }, dt), empty({ 6 }, dt)
      check(lib.gl_cross_entropy_forward(l.c, e.c, x.c, t.c, -1, 0)); return l
    end)
  end)
  it('bfloat16 storage works through the elementwise, norm, attention and loss kernels', function()
    local x = randn({ 2, 3, 4, 8 }):to('bfloat16'):to('float64') -- representable in bf16
    local xb = x:to('bfloat16')
    local function cmp(got, want, what) assert_close(got:tolist(), want:tolist(), 2e-2, what) end
    local o64, ob = empty(x.shape), empty(x.shape, 'bfloat16')
    check(lib.gl_unary(lib.GL_U_GELU_TANH, o64.c, x.c, 0, 0)); check(lib.gl_unary(lib.GL_U_GELU_TANH, ob.c, xb.c, 0, 0))
    cmp(ob, o64, 'gelu bf16')
    check(lib.gl_binary(lib.GL_B_MUL, o64.c, x.c, x.c)); check(lib.gl_binary(lib.GL_B_MUL, ob.c, xb.c, xb.c))
    cmp(ob, o64, 'mul bf16')
    local m, r, mb, rb = empty({ 2, 3, 4 }), empty({ 2, 3, 4 }), empty({ 2, 3, 4 }, 'float32'), empty({ 2, 3, 4 }, 'float32')
    check(lib.gl_layernorm_forward(o64.c, m.c, r.c, x.c, nil, nil, 1e-5))
    check(lib.gl_layernorm_forward(ob.c, mb.c, rb.c, xb.c, nil, nil, 1e-5))
    cmp(ob, o64, 'layernorm bf16'); cmp(rb, r, 'layernorm rstd bf16')
    local lse, lseb = empty({ 2, 3, 4 }), empty({ 2, 3, 4 }, 'float32')
    check(lib.gl_attention_forward(o64.c, lse.c, x.c, x.c, x.c, 0.3, 0))
    check(lib.gl_attention_forward(ob.c, lseb.c, xb.c, xb.c, xb.c, 0.3, 0))
    cmp(ob, o64, 'attention bf16'); cmp(lseb, lse, 'attention lse bf16')
    local lg = x:view(24, 8)
    local t = gl.tensor({ 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7 }, { dtype = 'int64' })
    local l, e, lb, eb = empty({ 24 }), empty({ 24 }), empty({ 24 }, 'float32'), empty({ 24 }, 'float32')
    check(lib.gl_cross_entropy_forward(l.c, e.c, lg.c, t.c, -1, 0))
    check(lib.gl_cross_entropy_forward(lb.c, eb.c, xb:view(24, 8).c, t.c, -1, 0))
    cmp(lb, l, 'cross-entropy bf16')
    local d, db = empty({ 24, 8 }), empty({ 24, 8 }, 'bfloat16')
    check(lib.gl_cross_entropy_backward(d.c, lg.c, t.c, e.c, -1, 0, 1, nil))
    check(lib.gl_cross_entropy_backward(db.c, xb:view(24, 8).c, t.c, eb.c, -1, 0, 1, nil))
    cmp(db, d, 'cross-entropy backward bf16')
  end)
end)
