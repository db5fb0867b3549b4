-- Document masking in attention (gl_attention_forward_seg / _backward_seg,
-- engine/cpu/attention.c): segment ids per position, a query seeing only
-- keys of its own document.  Float64 gradient checks; a packed row against
-- each document attended alone (outputs and gradients); grouped-query
-- heads, windows, tiles of more than 32 queries, attention_qkv and
-- gl.with_segments; bad segments as one line.
local gl = require 'gptlua'
local gc = require 'support.gradcheck'

-- documents of the given lengths packed in one row: their ids
local function ids(lengths, first)
  local out, id = {}, first or 0
  for _, n in ipairs(lengths) do
    for _ = 1, n do out[#out + 1] = id end
    id = id + 1
  end
  return out
end

describe('attention with segment ids', function()
  it('passes a float64 gradient check (grouped-query heads, a window)', function()
    local seg = gl.tensor({ ids({ 3, 1, 4 }), ids({ 5, 3 }, 7) }, { dtype = 'int64' })
    for _, window in ipairs({ 0, 3 }) do
      gc.check(function(q, k, v) return gl.scaled_dot_product_attention(q, k, v, { segments = seg, window = window }) end,
        { gc.rand({ 2, 4, 8, 5 }, 1), gc.rand({ 2, 2, 8, 5 }, 2), gc.rand({ 2, 2, 8, 5 }, 3) })
    end
  end)

  it('equals each document attended alone, forward and backward, over several tiles', function()
    -- 70 positions: three tiles of 32 queries, documents crossing tile edges
    local lengths = { 5, 30, 1, 20, 14 }
    local T, H, Hkv, D = 70, 4, 2, 8
    for _, dt in ipairs({ 'float64', 'float32' }) do
      gl.manual_seed(3)
      local q, k, v = gl.randn({ 1, H, T, D }):to(dt), gl.randn({ 1, Hkv, T, D }):to(dt), gl.randn({ 1, Hkv, T, D }):to(dt)
      local g = gl.randn({ 1, H, T, D }):to(dt)
      local seg = gl.tensor({ ids(lengths) }, { dtype = 'int32' })
      local function run(qq, kk, vv, gg, s)
        qq, kk, vv = qq:clone():requires_grad_(), kk:clone():requires_grad_(), vv:clone():requires_grad_()
        local y = gl.scaled_dot_product_attention(qq, kk, vv, { segments = s })
        gl.sum(y * gg):backward()
        return y, qq.grad, kk.grad, vv.grad
      end
      local y, dq, dk, dv = run(q, k, v, g, seg)
      local at = 1
      -- the same rounding on both sides (the same kernel, the same sums): float64 to 1e-13, float32 to 1e-5
      local tol = dt == 'float64' and 1e-13 or 1e-5
      for _, n in ipairs(lengths) do
        local function part(t) return t:narrow(3, at, n):contiguous() end
        local y1, dq1, dk1, dv1 = run(part(q), part(k), part(v), part(g), nil)
        for i, pair in ipairs({ { y, y1 }, { dq, dq1 }, { dk, dk1 }, { dv, dv1 } }) do
          local d = part(pair[1]):max_abs_diff(pair[2])
          assert.is_true(d <= tol, ('%s document at %d, output %d: %.3g'):format(dt, at, i, d))
        end
        at = at + n
      end
    end
  end)

  it('with a KV cache (T < S) each query takes its position\'s id: the last rows of the whole call', function()
    -- left padding (id 0) before two prompts' tokens (id 1), as a batch of prompts of different lengths
    local S, T, H, Hkv, D = 11, 3, 4, 2, 6
    local seg = gl.tensor({ ids({ 4, 7 }), ids({ 0, 11 }) }, { dtype = 'int64' })
    for _, window in ipairs({ 0, 5 }) do
      for _, dt in ipairs({ 'float64', 'float32' }) do
        gl.manual_seed(6)
        local q = gl.randn({ 2, H, S, D }):to(dt)
        local k, v = gl.randn({ 2, Hkv, S, D }):to(dt), gl.randn({ 2, Hkv, S, D }):to(dt)
        local whole = gl.scaled_dot_product_attention(q, k, v, { segments = seg, window = window })
        local last = gl.scaled_dot_product_attention(q:narrow(3, S - T + 1, T):contiguous(), k, v,
          { segments = seg, window = window })
        -- each query's sums run over the same keys in the same order (the
        -- queries sit in vector lanes, the keys in rows): equal bit for bit
        local d = last:max_abs_diff(whole:narrow(3, S - T + 1, T))
        assert.equal(0, d, ('%s window %d'):format(dt, window))
      end
    end
    -- float64 gradient check of the cached form
    local s1 = gl.tensor({ ids({ 2, 5 }) }, { dtype = 'int64' })
    gc.check(function(q, k, v) return gl.scaled_dot_product_attention(q, k, v, { segments = s1 }) end,
      { gc.rand({ 1, 2, 3, 5 }, 8), gc.rand({ 1, 1, 7, 5 }, 9), gc.rand({ 1, 1, 7, 5 }, 10) })
  end)

  it('masks attention_qkv too, and every attention inside gl.with_segments', function()
    gl.manual_seed(4)
    local B, T, H, C = 2, 9, 2, 8
    local qkv = gl.randn({ B, T, 3 * C }, { dtype = 'float64' })
    local seg = gl.tensor({ ids({ 4, 5 }), ids({ 9 }) }, { dtype = 'int64' })
    local a = gl.attention_qkv(qkv, H, { segments = seg })
    local b = gl.with_segments(seg, function() return gl.attention_qkv(qkv, H) end)
    assert.equal(0, a:max_abs_diff(b))
    -- the second document of row 1 alone
    local alone = gl.attention_qkv(qkv:narrow(1, 1, 1):narrow(2, 5, 5):contiguous(), H)
    assert.is_true(a:narrow(1, 1, 1):narrow(2, 5, 5):max_abs_diff(alone) <= 1e-13)
    -- row 2 is one document: plain causal attention
    assert.is_true(a:narrow(1, 2, 1):max_abs_diff(gl.attention_qkv(qkv:narrow(1, 2, 1):contiguous(), H)) <= 1e-13)
    -- outside, nothing is masked: the first row's second document sees the first
    assert.is_true(gl.attention_qkv(qkv, H):narrow(1, 1, 1):narrow(2, 5, 5):max_abs_diff(alone) > 1e-3)
    -- a gradient check through attention_qkv
    local x = gc.rand({ 1, 6, 3 * C }, 5)
    local s1 = gl.tensor({ ids({ 2, 4 }) }, { dtype = 'int64' })
    gc.check(function(t) return gl.attention_qkv(t, H, { segments = s1 }) end, { x })
  end)

  it('refuses bad segments in one line', function()
    local q = gl.randn({ 1, 2, 4, 4 })
    local function err(seg, opts, kk)
      opts = opts or {}
      opts.segments = seg
      local ok, e = pcall(gl.scaled_dot_product_attention, q, kk or q, kk or q, opts)
      assert.is_false(ok)
      return e
    end
    assert.truthy(err(gl.tensor({ { 0, 0, 1 } }, { dtype = 'int64' })):find(
      'gl_attention_forward_seg: segments has shape {1,3}, expected {1,4} ((B, S) = (1, 4): q\'s batch, k\'s positions)',
      1, true))
    assert.truthy(err(gl.zeros({ 1, 4 })):find('attention: segments must be int32 or int64 ids, got float32', 1, true))
    assert.truthy(err(gl.zeros({ 1, 4 }, { dtype = 'int64' }), { window = -1 }):find(
      'segments need a causal mask (window >= 0), got window -1', 1, true))
    -- with a KV cache (S = 6 keys for T = 4 queries) the ids are the keys' positions'
    assert.truthy(err(gl.zeros({ 1, 4 }, { dtype = 'int64' }), nil, gl.randn({ 1, 2, 6, 4 })):find(
      'segments has shape {1,4}, expected {1,6}', 1, true))
  end)
end)
