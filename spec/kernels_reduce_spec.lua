-- The CPU reduction kernels (engine/gl_ops.h): sums, means, max with its
-- index, sumsq.
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib, ffi = gl.lib, gl.ffi
local K = require 'support.kernels'
local check, randn, empty, randint, numel, copy_shape, unravel, ravel, assert_close, LAYOUTS, layout =
  K.check, K.randn, K.empty, K.randint, K.numel, K.copy_shape, K.unravel, K.ravel, K.assert_close, K.LAYOUTS, K.layout

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
