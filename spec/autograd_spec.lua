local gl = require 'gptlua'
local gc = require 'support.gradcheck'
local R = gc.rand

describe('gradient checks (float64 central differences) through autograd', function()
  it('arithmetic with broadcasting and scalars', function()
    gc.check(function(a, b) return (a + b) * a - b / (a * a + 2) end, { R({ 3, 1, 4 }, 1), R({ 2, 4 }, 2) })
    gc.check(function(a) return 3 - a * 2 + 1 / (a * a + 1) end, { R({ 5 }, 3) })
    gc.check(function(a, b) return gl.pow(gl.abs(a) + 0.5, b) end, { R({ 3 }, 4), R({ 3 }, 5) })
    gc.check(function(a, b) return gl.maximum(a, b) + gl.minimum(a, b) * 2 end, { R({ 4 }, 6), R({ 4 }, 7) })
  end)
  it('unary ops', function()
    for _, name in ipairs({ 'exp', 'tanh', 'gelu', 'silu', 'sigmoid', 'relu', 'relu2', 'sin', 'cos', 'square', 'neg' }) do
      gc.check(function(a) return gl[name](a) end, { R({ 2, 3 }, 10) })
    end
    gc.check(function(a) return gl.log(gl.abs(a) + 1) + gl.sqrt(gl.abs(a) + 1) + gl.rsqrt(gl.abs(a) + 1) end, { R({ 6 }, 11) })
    gc.check(function(a) return gl.clamp(a, -0.5, 0.5) end, { R({ 8 }, 12) })
    gc.check(function(a) return gl.softcap(a * 5, 3) end, { R({ 8 }, 13) })
    gc.check(function(a) return gl.pow(gl.abs(a) + 1, 2.5) end, { R({ 5 }, 14) })
  end)
  it('reductions', function()
    gc.check(function(a) return gl.sum(a, 2) end, { R({ 3, 4, 2 }, 20) })
    gc.check(function(a) return gl.mean(a, { 1, 3 }, true) end, { R({ 3, 4, 2 }, 21) })
    gc.check(function(a) return gl.sum(a) end, { R({ 3, 4 }, 22) })
    gc.check(function(a) return (gl.max(a, 2)) end, { R({ 3, 5 }, 23) })
    gc.check(function(a) return (gl.min(a, 1, true)) end, { R({ 3, 5 }, 24) })
    gc.check(function(a) return gl.norm(a, 2) end, { R({ 3, 5 }, 25) })
  end)
  it('matmul with broadcast batch dims, vectors and transposed views', function()
    gc.check(function(a, b) return gl.matmul(a, b) end, { R({ 2, 1, 3, 4 }, 30), R({ 3, 4, 5 }, 31) })
    gc.check(function(a, b) return gl.matmul(a, b:t()) end, { R({ 3, 4 }, 32), R({ 5, 4 }, 33) })
    gc.check(function(a, b) return gl.matmul(a, b) end, { R({ 4 }, 34), R({ 4, 3 }, 35) })
    gc.check(function(x, w, b) return gl.linear(x, w, b) end, { R({ 2, 3, 4 }, 36), R({ 5, 4 }, 37), R({ 5 }, 38) })
  end)
  it('the fused residual add + norm (gl.add_layer_norm, gl.add_rms_norm), both outputs used', function()
    gc.check(function(x, r, w, b)
      local s, h = gl.add_layer_norm(x, r, w, b)
      return s * 0.5 + h
    end, { R({ 2, 3, 6 }, 70), R({ 2, 3, 6 }, 71), R({ 6 }, 72), R({ 6 }, 73) })
    gc.check(function(x, r)
      local s, h = gl.add_rms_norm(x, r)
      return h * s
    end, { R({ 3, 5 }, 74), R({ 3, 5 }, 75) })
  end)
  it('the fused MLP (gl.mlp), GELU and ReLU^2, with and without biases', function()
    for _, act in ipairs({ 'gelu', 'relu2' }) do
      gc.check(function(x, w1, b1, w2, b2) return gl.mlp(x, w1, b1, w2, b2, act) end,
        { R({ 2, 3, 4 }, 60), R({ 6, 4 }, 61), R({ 6 }, 62), R({ 5, 6 }, 63), R({ 5 }, 64) })
      gc.check(function(x, w1, w2) return gl.mlp(x, w1, nil, w2, nil, act) end,
        { R({ 3, 4 }, 65), R({ 7, 4 }, 66), R({ 4, 7 }, 67) })
    end
  end)
  it('softmax and log_softmax over any dim', function()
    gc.check(function(a) return gl.softmax(a, -1) end, { R({ 3, 5 }, 40) })
    gc.check(function(a) return gl.log_softmax(a, 1) end, { R({ 3, 5 }, 41) })
  end)
  it('layer_norm and rms_norm with and without parameters', function()
    gc.check(function(x, w, b) return gl.layer_norm(x, w, b) end, { R({ 2, 3, 6 }, 50), R({ 6 }, 51), R({ 6 }, 52) })
    gc.check(function(x) return gl.layer_norm(x) end, { R({ 4, 5 }, 53) })
    gc.check(function(x, w) return gl.rms_norm(x, w) end, { R({ 3, 7 }, 54), R({ 7 }, 55) })
    gc.check(function(x) return gl.rms_norm(x) end, { R({ 3, 7 }, 56) })
  end)
  it('embedding, index_select and gather', function()
    local ids = gl.tensor({ { 0, 2, 2 }, { 4, 1, 0 } }, { dtype = 'int64' })
    gc.check(function(t) return gl.embedding(ids, t) end, { R({ 5, 3 }, 60) })
    local idx = gl.tensor({ 2, 0, 2 }, { dtype = 'int32' })
    gc.check(function(x) return gl.index_select(x, 2, idx) end, { R({ 2, 4 }, 61) })
    local gi = gl.tensor({ { 1, 0 }, { 2, 2 } }, { dtype = 'int64' })
    gc.check(function(x) return gl.gather(x, 2, gi) end, { R({ 2, 3 }, 62) })
  end)
  it('causal attention, grouped-query and sliding window', function()
    gc.check(function(q, k, v) return gl.scaled_dot_product_attention(q, k, v) end,
      { R({ 1, 2, 5, 4 }, 70), R({ 1, 2, 5, 4 }, 71), R({ 1, 2, 5, 4 }, 72) })
    gc.check(function(q, k, v) return gl.scaled_dot_product_attention(q, k, v, { window = 2 }) end,
      { R({ 2, 4, 3, 2 }, 73), R({ 2, 2, 3, 2 }, 74), R({ 2, 2, 3, 2 }, 75) })
    gc.check(function(q, k, v) return gl.scaled_dot_product_attention(q, k, v) end,  -- T < S: KV-cache offset
      { R({ 1, 1, 2, 3 }, 76), R({ 1, 1, 4, 3 }, 77), R({ 1, 1, 4, 3 }, 78) })
  end)
  it('rotary embedding', function()
    local cos, sin = gl.cos(R({ 3, 2 }, 80, false)), gl.sin(R({ 3, 2 }, 80, false))
    gc.check(function(x) return gl.rope(x, cos, sin) end, { R({ 2, 3, 2, 4 }, 81) })
  end)
  it('cross-entropy with ignore_index and soft-capping', function()
    local t = gl.tensor({ 1, 3, -1, 0 }, { dtype = 'int64' })
    gc.check(function(l) return gl.cross_entropy(l, t, { ignore_index = -1 }) end, { R({ 4, 5 }, 90) })
    gc.check(function(l) return gl.cross_entropy(l, t, { ignore_index = -1, softcap = 2 }) end, { R({ 4, 5 }, 91) })
  end)
  it('shape ops: cat, stack, split, views, where, to', function()
    gc.check(function(a, b) return gl.cat({ a, b }, 2) end, { R({ 2, 3 }, 100), R({ 2, 2 }, 101) })
    gc.check(function(a, b) return gl.stack({ a, b }, 1) end, { R({ 2, 3 }, 102), R({ 2, 3 }, 103) })
    gc.check(function(a) local p = gl.split(a, 2, 2); return p[1] * p[2] end, { R({ 3, 4 }, 104) })
    gc.check(function(a) return a:t():reshape(2, 6):narrow(2, 2, 3):select(1, 2) end, { R({ 4, 3 }, 105) })
    gc.check(function(a) return a:permute(3, 1, 2):unsqueeze(2):expand(2, 3, 2, 3):squeeze() end, { R({ 2, 3, 1 }, 106) })
    local cond = gl.tensor({ 1, 0, 1, 0 }, { dtype = 'bool' })
    gc.check(function(a, b) return gl.where(cond, a, b) end, { R({ 4 }, 107), R({ 4 }, 108) })
    gc.check(function(a) return (a:to('float32'):to('float64')) * 1 end, { R({ 3 }, 109) }, { tol = 1e-4, eps = 1e-3 })
  end)
  it('dropout is deterministic for a seed and has the matching backward', function()
    gl.manual_seed(5)
    local x = R({ 50 }, 110)
    gl.manual_seed(5); local y1 = gl.dropout(x, 0.3, true)
    gl.manual_seed(5); local y2 = gl.dropout(x, 0.3, true)
    assert.same(y1:tolist(), y2:tolist())
    gc.check(function(a) gl.manual_seed(5); return gl.dropout(a, 0.3, true) end, { R({ 20 }, 111) })
    assert.equal(x, gl.dropout(x, 0.3, false))
  end)
end)

describe('autograd', function()
  it('accumulates a tensor used twice (shared subexpressions)', function()
    local x = gl.tensor({ 2 }, { dtype = 'float64' }):requires_grad_()
    local y = x * x
    local z = y + y * x   -- 2x^2 ... d/dx (x^2 + x^3) = 2x + 3x^2 = 16
    gl.sum(z):backward()
    assert.near(16, x.grad:item(), 1e-12)
    gl.sum(x * 3):backward()  -- .grad accumulates across backward calls
    assert.near(19, x.grad:item(), 1e-12)
  end)
  it('records nothing under no_grad and in its scope form; detach cuts the graph', function()
    local x = gl.ones({ 2 }):requires_grad_()
    local y = gl.no_grad(function() return x * 2 end)
    assert.is_nil(y.grad_fn)
    local prev = gl.set_grad_enabled(false)
    local z = x * 2
    gl.set_grad_enabled(prev)
    assert.is_nil(z.grad_fn)
    assert.is_nil(x:detach().requires_grad)
    assert.has_error(function() gl.sum(x:detach()):backward() end)
  end)
  it('fires gradient-ready hooks once per backward, in reverse order of use', function()
    local a, b, c = R({ 2 }, 120), R({ 2 }, 121), R({ 2 }, 122)
    local order = {}
    for name, t in pairs({ a = a, b = b, c = c }) do t:register_hook(function(p) order[#order + 1] = name; assert(p.grad) end) end
    local h = a * 2
    h = h * b
    h = h + a   -- a used again after b: a's gradient is final only at the end
    h = h * c
    gl.sum(h):backward()
    assert.same({ 'c', 'b', 'a' }, order)
    order = {}
    gl.sum(c * b):backward()
    assert.same({ 'c', 'b' }, order)
  end)
  it('releases op-internal saved tensors as backward goes', function()
    local x = R({ 64, 64 }, 130)
    local y = gl.layer_norm(x)
    local st0 = gl.memory_stats()
    gl.sum(y):backward()
    assert.is_nil(y.grad_fn.saved)
  end)
  it('checkpoint() gives the same gradients while keeping fewer tensors alive', function()
    local W1, W2 = R({ 32, 32 }, 140), R({ 32, 32 }, 141)
    local x = R({ 16, 32 }, 142)
    local function block(h) return gl.tanh(gl.linear(gl.gelu(gl.linear(h, W1)), W2)) end
    local function run(use_ckpt)
      W1.grad, W2.grad, x.grad = nil, nil, nil
      collectgarbage(); collectgarbage()
      local live0 = gl.memory_stats().n_live
      local h = x
      for _ = 1, 4 do h = use_ckpt and gl.checkpoint(block, h) or block(h) end
      collectgarbage(); collectgarbage()
      local live = gl.memory_stats().n_live - live0
      gl.sum(h):backward()
      return live, W1.grad:clone(), W2.grad:clone(), x.grad:clone()
    end
    local live_plain, a1, a2, a3 = run(false)
    local live_ckpt, b1, b2, b3 = run(true)
    assert.is_true(a1:max_abs_diff(b1) < 1e-12 and a2:max_abs_diff(b2) < 1e-12 and a3:max_abs_diff(b3) < 1e-12)
    assert.is_true(live_ckpt < live_plain, ('checkpoint kept %d tensors, plain %d'):format(live_ckpt, live_plain))
  end)
  it('scopes release temporaries deterministically and keep what is marked', function()
    local x = gl.ones({ 100 })
    local before = gl.memory_stats().allocated
    local kept
    gl.scope(function()
      local y = x * 2 + 1
      kept = (y * 3):keep()
      local z = gl.exp(y)
    end)
    local after = gl.memory_stats().allocated
    assert.is_true(after - before <= 1024)
    assert.equal(9, kept:get(1))
    local r = gl.scope(function() return x * 5 end)
    assert.equal(5, r:get(1))
  end)
end)

describe('fused attention from a qkv projection', function()
  it('matches split + scaled_dot_product_attention and passes a gradient check', function()
    local gl = require 'gptlua'
    local gc = require 'support.gradcheck'
    local B, T, H, D = 2, 4, 2, 3
    local C = H * D
    local qkv = gc.rand({ B, T, 3 * C }, 150)
    local function split_path(x)
      local function heads(i) return x:narrow(3, (i - 1) * C + 1, C):reshape(B, T, H, D):transpose(2, 3) end
      return gl.scaled_dot_product_attention(heads(1), heads(2), heads(3)):transpose(2, 3):reshape(B, T, C)
    end
    assert.is_true(gl.attention_qkv(qkv, H):max_abs_diff(split_path(qkv)) < 1e-12)
    gc.check(function(x) return gl.attention_qkv(x, H) end, { qkv })
    gc.check(function(x) return gl.attention_qkv(x, H, { window = 2 }) end, { gc.rand({ 1, 5, 3 * C }, 151) })
  end)
end)

describe('in-place changes and version counters (as PyTorch)', function()
  local function raises(fn, text)
    local ok, err = pcall(fn)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find(text, 1, true), tostring(err))
  end
  local version = gl.Tensor.versions.of
  it('every in-place method bumps the counter, which views and detach share with their base', function()
    local x = gl.zeros({ 2, 3 })
    assert.equal(0, version(x))
    x:fill_(1); x:add_(1); x:mul_(2)
    assert.equal(3, version(x))
    local v, d = x:narrow(2, 1, 2), x:detach()
    v:zero_()
    assert.equal(4, version(x)); assert.equal(4, version(d))
    d:set(5, 1, 1); x:t():copy_(gl.ones({ 3, 2 }))
    assert.equal(6, version(v))
    assert.equal(0, version(gl.zeros({ 1 })))  -- another storage has its own
  end)
  it('backward refuses a saved tensor modified in place, naming the op and the versions', function()
    local w = gl.tensor({ 1, 2, 3 }, { dtype = 'float64' }):requires_grad_()
    local x = gl.tensor({ 4, 5, 6 }, { dtype = 'float64' })
    local y = (w * x):sum()
    x:add_(1)
    raises(function() y:backward() end, 'a tensor saved by mul was modified in place (version 1, expected 0)')
    -- through a view of the saved tensor
    local a = gl.tensor({ { 1, 2 }, { 3, 4 } }, { dtype = 'float64' })
    local out = gl.matmul(w:narrow(1, 1, 2):view(1, 2), a):sum()
    a:select(1, 2):fill_(0)
    raises(function() out:backward() end, 'a tensor saved by matmul was modified in place (version 1, expected 0)')
    -- an op's saved output (softmax), changed under no_grad
    local s = gl.softmax(w, 1)
    local l = (s * x):sum()
    gl.no_grad(function() s:mul_(2) end)
    raises(function() l:backward() end, 'a tensor saved by softmax was modified in place (version 1, expected 0)')
    -- the saved indices of an embedding; the inputs of a checkpoint
    local tab = gl.randn({ 5, 2 }, { dtype = 'float64' }):requires_grad_()
    local ids = gl.tensor({ 1, 3 }, { dtype = 'int64' })
    local e = gl.embedding(ids, tab):sum()
    ids:fill_(4)
    raises(function() e:backward() end, 'a tensor saved by embedding was modified in place (version 1, expected 0)')
    local c = gl.checkpoint(function(p, q) return (p * q):sum() end, w, x)
    x:zero_()
    raises(function() c:backward() end, 'a tensor saved by checkpoint was modified in place (version 2, expected 1)')
  end)
  it('accepts changes to tensors that no backward reads, and gives the right gradient', function()
    local w = gl.tensor({ 1, 2, 3 }, { dtype = 'float64' }):requires_grad_()
    local x = gl.tensor({ 4, 5, 6 }, { dtype = 'float64' })
    local y = ((w + x) * 2):sum()  -- add and mul by a number save nothing
    x:fill_(100)
    y:backward()
    assert.same({ 2, 2, 2 }, w.grad:tolist())
  end)
  it('refuses in-place changes of a leaf that requires grad, a view of one, or a recorded output in grad mode', function()
    local p = gl.zeros({ 2, 2 }):requires_grad_()
    raises(function() p:fill_(1) end, 'fill_: a leaf tensor that requires grad cannot be modified in place; use gl.no_grad')
    raises(function() p:add_(1) end, 'add_: a leaf tensor that requires grad cannot be modified in place')
    raises(function() p:narrow(1, 1, 1):zero_() end,
      'zero_: a view of a leaf tensor that requires grad cannot be modified in place; use gl.no_grad')
    raises(function() p:view(4):copy_(gl.ones({ 4 })) end, 'copy_: a view of a leaf tensor that requires grad')
    local h = p * 2
    raises(function() h:mul_(3) end, 'mul_: a tensor that requires grad cannot be modified in place')
    raises(function() p:set(5, 1, 1) end, 'set: a leaf tensor that requires grad cannot be modified in place')
    assert.equal(0, version(p))  -- nothing was changed
    -- under no_grad (optimizers, checkpoint loading) all of them are allowed
    gl.no_grad(function() p:fill_(1); p:narrow(1, 1, 1):zero_(); h:mul_(3); p:set(7, 2, 2) end)
    assert.same({ 0, 0, 1, 7 }, p:tolist())
    assert.equal(3, version(p))
  end)
end)

-- A tensor an op saved for its backward holds its own reference to the
-- storage (as PyTorch's saved tensors do): the caller freeing its handle
-- (t:free(), a recycling loader) neither changes the gradient nor lets the
-- allocator hand the memory to another tensor before the backward ran.
describe('saved tensors outlive their freed handles', function()
  local function grads(free_target, fused)
    local x = gl.randn({ 4, 5 }, { seed = 1 }):requires_grad_()
    local w = gl.randn({ 7, 5 }, { seed = 2 }):requires_grad_()
    local t = gl.tensor({ 1, 2, 3, 0 }, { dtype = 'int64' })
    local loss = fused and gl.linear_cross_entropy(x, w, t) or gl.cross_entropy(gl.linear(x, w), t)
    if free_target then
      t:free()
      for _ = 1, 8 do gl.full({ 4 }, 6, { dtype = 'int64' }) end  -- fresh allocations of the same size
    end
    loss:backward()
    return { x.grad:tolist(), w.grad:tolist() }
  end
  it('cross_entropy and the fused head give the same gradient after their target is freed', function()
    assert.same(grads(false, false), grads(true, false))
    assert.same(grads(false, true), grads(true, true))
  end)
end)
