-- The fused LM head (gl.linear_cross_entropy, lua/gptlua/ops_head.lua)
-- against the unfused cross_entropy(linear(x, W)): same loss and gradients
-- over chunk edges, with and without ignore_index and softcap; float64
-- gradient checks; no gradient work under no_grad; the model heads use it.
-- The #cuda half runs the fused head on the (simulated) GPU in float32 and
-- bfloat16 against the CPU in float64.
local gl = require 'gptlua'
local gc = require 'support.gradcheck'

local function targets(N, V, ignore_every)
  local t = {}
  for i = 1, N do t[i] = (ignore_every and i % ignore_every == 0) and -1 or (i * 7 + 3) % V end
  return gl.tensor(t, { dtype = 'int64' })
end

-- loss and gradients of both heads (x (N, C) or (B, T, C), W (V, C))
local function both(x, W, t, opts, chunk)
  local function run(fused)
    local xi, Wi = x:clone(), W:clone()
    xi.requires_grad, Wi.requires_grad = true, true
    local loss
    if fused then
      local o = { chunk_rows = chunk }
      for k, v in pairs(opts) do o[k] = v end
      loss = gl.linear_cross_entropy(xi, Wi, t, o)
    else
      loss = gl.cross_entropy(gl.linear(xi, Wi), t, opts)
    end
    (loss * 0.7):backward()
    return loss:item(), xi.grad, Wi.grad
  end
  local l1, gx1, gW1 = run(false)
  local l2, gx2, gW2 = run(true)
  return l1, l2, gx1, gx2, gW1, gW2
end

describe('fused LM head: linear + softcap + cross-entropy in chunks of rows', function()
  it('equals the unfused head over chunk edges (float64 and float32)', function()
    local N, C, V = 37, 16, 23
    for _, dt in ipairs({ 'float64', 'float32' }) do
      gl.manual_seed(5)
      local x, W = gl.randn({ N, C }):to(dt), gl.randn({ V, C }):to(dt)
      local tol = dt == 'float64' and 1e-12 or 1e-5
      for _, opts in ipairs({ {}, { ignore_index = -1 }, { ignore_index = -1, softcap = 3 }, { softcap = 1.5 } }) do
        local t = targets(N, V, opts.ignore_index and 5 or nil)
        for _, chunk in ipairs({ 1, 8, 36, 37, 64 }) do
          local l1, l2, gx1, gx2, gW1, gW2 = both(x, W, t, opts, chunk)
          local what = ('%s chunk %d ignore %s softcap %s'):format(dt, chunk, tostring(opts.ignore_index),
            tostring(opts.softcap))
          assert.is_true(math.abs(l1 - l2) <= tol * math.abs(l1), what .. ': loss')
          assert.is_true(gx1:max_abs_diff(gx2) <= tol, what .. ': dx')
          assert.is_true(gW1:max_abs_diff(gW2) <= tol, what .. ': dW')
        end
      end
    end
  end)

  it('passes a float64 gradient check, batched input, several chunks', function()
    local t = targets(6, 5, 4):view(2, 3)
    for _, cap in ipairs({ 0, 2 }) do
      gc.check(function(x, W)
        return gl.linear_cross_entropy(x, W, t, { ignore_index = -1, softcap = cap, chunk_rows = 4 })
      end, { gc.rand({ 2, 3, 4 }, 40 + cap), gc.rand({ 5, 4 }, 50 + cap) })
    end
  end)

  it('all targets ignored: loss 0 and zero gradients (the mean divides by max(count, 1))', function()
    local x, W = gl.randn({ 4, 3 }), gl.randn({ 5, 3 })
    local l1, l2, gx1, gx2 = both(x, W, gl.tensor({ -1, -1, -1, -1 }, { dtype = 'int64' }), { ignore_index = -1 }, 3)
    assert.equal(0, l1); assert.equal(0, l2)
    assert.equal(0, gx2:abs():max():item()); assert.equal(0, gx1:max_abs_diff(gx2))
  end)

  it('no rows: loss 0, zero weight gradient', function()
    local x, W = gl.randn({ 0, 3 }), gl.randn({ 5, 3 })
    W.requires_grad = true
    local loss = gl.linear_cross_entropy(x, W, gl.empty({ 0 }, { dtype = 'int64' }), { ignore_index = -1 })
    loss:backward()
    assert.equal(0, loss:item())
    assert.equal(0, W.grad:abs():max():item())
  end)

  it('gradient of only one input, a second backward through a kept graph, and no_grad', function()
    local x, W = gl.randn({ 6, 4 }), gl.randn({ 7, 4 })
    local t = targets(6, 7)
    W.requires_grad = true
    local loss = gl.linear_cross_entropy(x, W, t, { chunk_rows = 4 })
    loss:backward(nil, { retain_graph = true })
    local once = W.grad:clone()
    loss:backward()
    assert.is_true(W.grad:max_abs_diff(once * 2) < 1e-6)
    assert.is_nil(x.grad)
    local l = gl.no_grad(gl.linear_cross_entropy, x, W, t)
    assert.is_nil(l.grad_fn)
    assert.is_true(math.abs(l:item() - loss:item()) < 1e-6)
  end)

  it('rejects bad arguments with one-line messages', function()
    local x, W, t = gl.randn({ 4, 3 }), gl.randn({ 5, 3 }), targets(4, 5)
    assert.has_error(function() gl.linear_cross_entropy(x, gl.randn({ 5, 2 }), t) end,
      'linear_cross_entropy: weight has shape {5,2}, expected {*,3} (features of x {4,3})')
    assert.has_error(function() gl.linear_cross_entropy(x, W, targets(3, 5)) end,
      'linear_cross_entropy: targets have 3 elements, expected 4 (one per row of x {4,3})')
    assert.has_error(function() gl.linear_cross_entropy(x, W, t, { chunk_rows = 0 }) end)
    assert.has_error(function() gl.linear_cross_entropy(x, W, t, { softcap = -1 }) end,
      'linear_cross_entropy: softcap must be a number >= 0 (0 disables it), got -1')
    assert.has_error(function() gl.linear_cross_entropy(x, W, targets(4, 9)) end)  -- target 8 >= V
  end)

  it('is the head of both models when they get targets; logits without targets', function()
    for _, kind in ipairs({ 'gpt2', 'nanochat' }) do
      gl.manual_seed(2)
      local m = kind == 'gpt2'
        and require('gptlua.models.gpt2').GPT({ vocab_size = 11, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8 })
        or require('gptlua.models.nanochat').GPT({ depth = 1, n_embd = 16, n_head = 2, vocab_size = 11, block_size = 8 })
      local idx = gl.tensor({ { 1, 2, 3, 4 }, { 5, 6, 7, 8 } }, { dtype = 'int64' })
      local logits, loss = m:forward(idx, idx)
      assert.is_nil(logits, kind)
      local full = m:forward(idx)
      local want = gl.cross_entropy(full, idx)
      assert.is_true(math.abs(loss:item() - want:item()) < 1e-5, kind)
    end
  end)
end)

describe('fused LM head on the GPU vs the CPU in float64 #cuda', function()
  local it_gpu = gl.cuda_available() and it or function(name) pending(name .. ' (no CUDA device)') end
  it_gpu('float32 and bfloat16 over chunk edges, softcap and ignore_index', function()
    local N, C, V = 70, 64, 200   -- V not a multiple of the row kernels' tiles
    gl.manual_seed(9)
    local x, W = gl.randn({ N, C }, { dtype = 'float64' }), gl.randn({ V, C }, { dtype = 'float64' }) * 0.3
    local t = targets(N, V, 6)
    for _, dt in ipairs({ 'float32', 'bfloat16' }) do
      local tol = dt == 'float32' and 1e-4 or 3e-2
      for _, cap in ipairs({ 0, 15 }) do
        for _, chunk in ipairs({ 16, 64, 70 }) do
          local function run(dev, d)
            local xi, Wi = x:to(d):to(dev):detach(), W:to(d):to(dev):detach()
            xi.requires_grad, Wi.requires_grad = true, true
            local loss = gl.linear_cross_entropy(xi, Wi, t:to(dev), { ignore_index = -1, softcap = cap, chunk_rows = chunk })
            loss:backward()
            return loss:to('cpu'):item(), xi.grad:to('cpu'):to('float64'), Wi.grad:to('cpu'):to('float64')
          end
          local l0, gx0, gW0 = run('cpu', 'float64')
          local l1, gx1, gW1 = run('cuda', dt)
          local what = ('%s softcap %g chunk %d'):format(dt, cap, chunk)
          local gscale = math.max(gx0:abs():max():item(), 1e-12)
          local wscale = math.max(gW0:abs():max():item(), 1e-12)
          assert.is_true(math.abs(l1 - l0) <= tol * math.abs(l0), what .. ': loss ' .. l1 .. ' vs ' .. l0)
          assert.is_true(gx1:max_abs_diff(gx0) <= tol * gscale, what .. ': dx')
          assert.is_true(gW1:max_abs_diff(gW0) <= tol * wscale, what .. ': dW')
        end
      end
    end
  end)
end)
