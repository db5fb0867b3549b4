-- The CPU element-wise kernels (engine/gl_ops.h): unary, binary and where,
-- and dropout.
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib, ffi = gl.lib, gl.ffi
local K = require 'support.kernels'
local check, randn, uniform, empty, randint, assert_close, LAYOUTS, layout, numgrad, wsum, FD_TOL, map, UNARY, unary =
  K.check, K.randn, K.uniform, K.empty, K.randint, K.assert_close, K.LAYOUTS, K.layout, K.numgrad, K.wsum, K.FD_TOL,
  K.map, K.UNARY, K.unary

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
