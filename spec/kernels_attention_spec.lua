-- The CPU rope and attention kernels (engine/gl_ops.h).
-- Called directly through gl.lib.gl_xxx(t.c, ...): every forward kernel is
-- compared with a plain Lua float64 reference (odd sizes, size-1 dims, several
-- memory layouts), every backward kernel with a central finite difference of
-- its forward in float64.  Helpers: spec/support/kernels.lua.
local gl = require 'gptlua'
local lib = gl.lib
local K = require 'support.kernels'
local check, randn, empty, assert_close, LAYOUTS, layout, numgrad, wsum, FD_TOL, map =
  K.check, K.randn, K.empty, K.assert_close, K.LAYOUTS, K.layout, K.numgrad, K.wsum, K.FD_TOL, K.map

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
