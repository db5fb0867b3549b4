-- The CPU embedding and index kernels (engine/gl_ops.h): embedding,
-- index_select, gather, scatter_add, index_add.
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib = gl.lib
local K = require 'support.kernels'
local check, randn, empty, randint, numel, copy_shape, unravel, ravel, assert_close, layout, numgrad, wsum, FD_TOL =
  K.check, K.randn, K.empty, K.randint, K.numel, K.copy_shape, K.unravel, K.ravel, K.assert_close, K.layout,
  K.numgrad, K.wsum, K.FD_TOL

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
