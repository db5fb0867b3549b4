-- The CPU row kernels (engine/gl_ops.h): softmax, layernorm and rmsnorm.
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib = gl.lib
local K = require 'support.kernels'
local check, randn, empty, copy_shape, assert_close, LAYOUTS, layout, numgrad, wsum, FD_TOL =
  K.check, K.randn, K.empty, K.copy_shape, K.assert_close, K.LAYOUTS, K.layout, K.numgrad, K.wsum, K.FD_TOL

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
