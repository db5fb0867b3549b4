-- Document masking in attention (gl_attention_forward_seg / _backward_seg,
-- engine/cpu/attention.c): segment ids per position, a query seeing only
-- keys of its own document.  Float64 gradient checks; a packed row against
-- each document attended alone (outputs and gradients); grouped-query
-- heads, windows, tiles of more than 32 queries, attention_qkv and
-- gl.with_segments; bad segments as one line.
local gl = require 'gptlua'
local gc = require 'support.gradcheck'
local twin = require 'support.cuda_twin'

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
    gl.manual_seed(3)
    local base = { gl.randn({ 1, H, T, D }), gl.randn({ 1, Hkv, T, D }), gl.randn({ 1, Hkv, T, D }), gl.randn({ 1, H, T, D }) }
    local seg = gl.tensor({ ids(lengths) }, { dtype = 'int32' })
    local function run(dt, s, at, n)
      local t = {}
      for i, b in ipairs(base) do
        t[i] = b:to(dt):clone()   -- (to() of the same dtype is b itself)
        if at then t[i] = t[i]:narrow(3, at, n):contiguous() end
        if i < 4 then t[i] = t[i]:requires_grad_() end
      end
      local y = gl.scaled_dot_product_attention(t[1], t[2], t[3], { segments = s })
      gl.sum(y * t[4]):backward()
      return { y, t[1].grad, t[2].grad, t[3].grad }
    end
    local packed = { float32 = run('float32', seg), float64 = run('float64', seg) }
    -- Each document of the packed row against the same document alone, by
    -- the kernel twins' rule (spec/support/cuda_twin.lua): the packed row's
    -- float32 result is within twice the lone document's float32 error
    -- against its float64 result, plus the rounding bound for reductions of
    -- max(D, n) terms; in float64 the lone document's float32 error, scaled
    -- to float64's epsilon, stands in for its own.  The masked keys add exact
    -- zeros, so only the order of the sums (the tiles) differs.
    local at = 1
    for _, n in ipairs(lengths) do
      local alone32, alone64 = run('float32', nil, at, n), run('float64', nil, at, n)
      for i, name in ipairs({ 'y', 'dq', 'dk', 'dv' }) do
        local what = ('document of %d at %d, %s'):format(n, at, name)
        local function part(t) return t:narrow(3, at, n):contiguous() end
        twin.check(what .. ' (float32)', part(packed.float32[i]), alone32[i], alone64[i], 'float32', math.max(D, n))
        twin.check(what .. ' (float64)', part(packed.float64[i]), alone64[i], nil, 'float64', math.max(D, n), alone32[i])
      end
      at = at + n
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
    -- (by the kernel twins' rule in float64: the float32 error of the same
    -- call, scaled to float64's epsilon, plus the bound for T terms)
    local function alone(x) return gl.attention_qkv(x, H), gl.attention_qkv(x:to('float32'), H) end
    local doc = qkv:narrow(1, 1, 1):narrow(2, 5, 5):contiguous()
    local a64, a32 = alone(doc)
    twin.check('row 1, second document', a:narrow(1, 1, 1):narrow(2, 5, 5):contiguous(), a64, nil, 'float64', T, a32)
    -- row 2 is one document: plain causal attention
    local r64, r32 = alone(qkv:narrow(1, 2, 1):contiguous())
    twin.check('row 2, one document', a:narrow(1, 2, 1):contiguous(), r64, nil, 'float64', T, r32)
    -- outside, nothing is masked: the first row's second document sees the first
    assert.is_true(gl.attention_qkv(qkv, H):narrow(1, 1, 1):narrow(2, 5, 5):max_abs_diff(a64) > 1e-3)
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
