-- The mixture-of-experts ops (engine/ops_moe.c, engine/cpu/moe.c,
-- lua/gptlua/ops_moe.lua): the routing plan against a hand-worked example,
-- the permutation, combine and grouped products against plain Lua float64
-- references, each op's gradient against float64 central differences
-- (spec/support/gradcheck.lua), and bad input refused in one line.
local gl = require 'gptlua'
local gc = require 'support.gradcheck'

local function ids(rows, dtype) return gl.tensor(rows, { dtype = dtype or 'int64' }) end
local function flat(t) return t:contiguous():tolist() end

describe('moe ops', function()
  -- experts of 4 tokens, top-2, 3 experts:
  --   token 0 -> (0, 2), 1 -> (2, 1), 2 -> (0, 2), 3 -> (1, 0)
  -- expert 0 gets (0,0) (2,0) (3,1); expert 1 (1,1) (3,0); expert 2 (0,1) (1,0) (2,1)
  local EXPERTS = { { 0, 2 }, { 2, 1 }, { 0, 2 }, { 1, 0 } }

  it('moe_route counts the load and places each assignment in expert order, token order within', function()
    for _, dt in ipairs({ 'int64', 'int32' }) do
      local slots, counts, load = gl.moe_route(ids(EXPERTS, dt), 3, 0)
      assert.same({ 0, 5, 6, 3, 1, 7, 4, 2 }, flat(slots))
      assert.same({ 3, 2, 3 }, flat(counts))
      assert.same({ 3, 2, 3 }, flat(load))
    end
  end)

  it('moe_route with a capacity keeps each expert\'s first assignments and drops the rest (-1)', function()
    local slots, counts, load = gl.moe_route(ids(EXPERTS), 3, 2)
    -- expert 0 keeps (0,0) (2,0) and drops (3,1); expert 2 keeps (0,1) (1,0) and drops (2,1)
    assert.same({ 0, 4, 5, 2, 1, -1, 3, -1 }, flat(slots))
    assert.same({ 2, 2, 2 }, flat(counts))
    assert.same({ 3, 2, 3 }, flat(load))
  end)

  it('moe_permute and moe_combine match a Lua reference, unnamed rows zero, dropped assignments left out', function()
    local N, C, K = 4, 3, 2
    local x = gl.randn({ N, C }, { seed = 1, dtype = 'float64' })
    local w = gl.rand({ N, K }, { seed = 2, dtype = 'float64' })
    local slots = gl.moe_route(ids(EXPERTS), 3, 2)
    local rows = 7  -- one row past the 6 kept: zero
    local buf = gl.moe_permute(x, slots, rows)
    local xl, sl, wl, bl = x:totable(), slots:totable(), w:totable(), buf:totable()
    local named = {}
    for n = 1, N do
      for k = 1, K do
        local s = sl[n][k]
        if s >= 0 then named[s + 1] = true; assert.same(xl[n], bl[s + 1]) end
      end
    end
    for r = 1, rows do if not named[r] then assert.same({ 0, 0, 0 }, bl[r]) end end
    local y = gl.randn({ rows, C }, { seed = 3, dtype = 'float64' })
    local out, yl = gl.moe_combine(y, slots, w):totable(), y:totable()
    for n = 1, N do
      for c = 1, C do
        local want = 0
        for k = 1, K do
          local s = sl[n][k]
          if s >= 0 then want = want + wl[n][k] * yl[s + 1][c] end
        end
        assert.near(want, out[n][c], 1e-15 * math.max(1, math.abs(want)))
      end
    end
  end)

  it('grouped_linear multiplies each expert\'s rows by its weight, rows past the experts zero', function()
    local K, Nout = 3, 2
    local counts = gl.tensor({ 2, 0, 3 }, { dtype = 'int64' })
    local a = gl.randn({ 6, K }, { seed = 4, dtype = 'float64' })
    local ws = {}
    for e = 1, 3 do ws[e] = gl.randn({ Nout, K }, { seed = 10 + e, dtype = 'float64' }) end
    local out = gl.grouped_linear(a, ws, counts):totable()
    local al, owner = a:totable(), { 1, 1, 3, 3, 3 }
    for r = 1, 5 do
      local W = ws[owner[r]]:totable()
      for j = 1, Nout do
        local want = 0
        for k = 1, K do want = want + al[r][k] * W[j][k] end
        assert.near(want, out[r][j], 1e-14)
      end
    end
    assert.same({ 0, 0 }, out[6])
  end)

  it('grouped_linear in float32 and bfloat16, with a weight that is a transposed view, is the float64 product rounded',
    function()
    -- bfloat16 (and a weight whose rows are not contiguous) go through the products' contiguous copies;
    -- the result is rounded once to the output dtype (unit roundoff: 2^-8 for bfloat16, 2^-24 for
    -- float32, relative) after a float32 sum of K terms (K 2^-24 of the largest magnitude at most)
    local K = 16
    local counts = gl.tensor({ 5, 0, 7, 4 }, { dtype = 'int64' })
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local a = gl.randn({ 17, K }, { seed = 31 }):to(dt)
      local ws = {}
      for e = 1, 4 do ws[e] = gl.randn({ K, 6 }, { seed = 40 + e }):to(dt):t() end  -- (6, K), transposed views
      local got = gl.grouped_linear(a, ws, counts):to('float64'):totable()
      local w64 = {}
      for e = 1, 4 do w64[e] = ws[e]:to('float64') end
      local want = gl.grouped_linear(a:to('float64'), w64, counts):totable()
      local round = dt == 'bfloat16' and 2 ^ -8 or 2 ^ -24  -- unit roundoff
      for r = 1, 17 do
        for j = 1, 6 do
          local bound = round * math.abs(want[r][j]) + K * 2 ^ -24 * 16  -- |a w| terms below 4 x 4
          assert.is_true(math.abs(got[r][j] - want[r][j]) <= bound,
            ('%s row %d col %d: %.9g, expected %.9g'):format(dt, r, j, got[r][j], want[r][j]))
        end
      end
    end
  end)

  it('gradients of moe_permute, moe_combine and grouped_linear match float64 central differences', function()
    local slots, counts = gl.moe_route(ids(EXPERTS), 3, 2)  -- with drops, and a buffer row past the kept
    local x = gc.rand({ 4, 3 }, 21)
    gc.check(function(t) return gl.moe_permute(t, slots, 7) end, { x })
    local y, w = gc.rand({ 7, 3 }, 22), gl.rand({ 4, 2 }, { seed = 23, dtype = 'float64' }):requires_grad_()
    gc.check(function(a, b) return gl.moe_combine(a, slots, b) end, { y, w })
    -- an expert without rows (its weight's gradient is zero) and a row past the experts
    local c2 = gl.tensor({ 3, 0, 2 }, { dtype = 'int64' })
    local a = gc.rand({ 6, 4 }, 24)
    local w1, w2, w3 = gc.rand({ 5, 4 }, 25), gc.rand({ 5, 4 }, 26), gc.rand({ 5, 4 }, 27)
    gc.check(function(t, p, q, r) return gl.grouped_linear(t, { p, q, r }, c2) end, { a, w1, w2, w3 })
    assert.equal(0, w2.grad:abs():sum():item())
    assert.equal(3, counts:numel())
  end)

  it('refuses bad input in one line naming the argument and what was expected', function()
    local function err(f) local ok, e = pcall(f); assert.is_false(ok); return tostring(e) end
    assert.matches('gl_moe_route: experts%[2%] is 3, expected 0 <= experts < 3',
      err(function() gl.moe_route(ids({ { 0, 1 }, { 3, 0 } }), 3, 0) end))
    assert.matches('gl_moe_route: experts has dtype float64, expected int32 or int64',
      err(function() gl.moe_route(gl.zeros({ 2, 2 }, { dtype = 'float64' }), 3, 0) end))
    local slots = gl.moe_route(ids(EXPERTS), 3, 0)
    assert.matches('gl_moe_permute: slots%[0%]%[1%] is 5, expected %-1 %(dropped%) or 0 <= slot < 4',
      err(function() gl.moe_permute(gl.zeros({ 4, 3 }), slots, 4) end))
    assert.matches('gl_moe_permute: x has shape {3,3}, expected {4,3}',
      err(function() gl.moe_permute(gl.zeros({ 3, 3 }), slots, 8) end))
    local twice = ids({ { 0, 1 }, { 1, 2 } })
    assert.matches('gl_moe_combine: slots%[1%]%[0%] is 1, a row another assignment already names',
      err(function() gl.moe_combine(gl.zeros({ 3, 2 }), twice, gl.ones({ 2, 2 })) end))
    local a, w = gl.zeros({ 4, 3 }), { gl.zeros({ 2, 3 }), gl.zeros({ 2, 3 }) }
    assert.matches('gl_grouped_matmul: the counts sum to more than 4, expected at most the 4 rows',
      err(function() gl.grouped_linear(a, w, gl.tensor({ 3, 2 }, { dtype = 'int64' })) end))
    assert.matches('gl_grouped_matmul: bs%[1%] has shape {4,2}, expected {3,2}',
      err(function() gl.grouped_linear(a, { w[1], gl.zeros({ 2, 4 }) }, gl.tensor({ 1, 1 }, { dtype = 'int64' })) end))
    assert.matches('grouped_linear: counts has 3 entries, expected 2',
      err(function() gl.grouped_linear(a, w, gl.tensor({ 1, 1, 1 }, { dtype = 'int64' })) end))
  end)
end)
