-- The CPU cross-entropy and optimizer kernels (engine/gl_ops.h).
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib = gl.lib
local K = require 'support.kernels'
local check, randn, empty, randint, assert_close, LAYOUTS, layout, numgrad, FD_TOL =
  K.check, K.randn, K.empty, K.randint, K.assert_close, K.LAYOUTS, K.layout, K.numgrad, K.FD_TOL

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
