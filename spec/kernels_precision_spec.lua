-- The CPU kernels in float32 against float64, and bfloat16 storage through
-- the element-wise, norm, attention and loss kernels (engine/gl_ops.h).
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib = gl.lib
local K = require 'support.kernels'
local check, randn, empty, assert_close, UNARY, unary =
  K.check, K.randn, K.empty, K.assert_close, K.UNARY, K.unary

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
