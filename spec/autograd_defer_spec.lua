-- Deferred weight gradients (autograd.defer_weight_grads, the zero-bubble
-- pipeline's B/W split): under a queue, linear's and mlp's backward give
-- the input gradient only and queue their weights' (and linear's bias, mlp's
-- second bias) when those are parameters; run_deferred adds them in and
-- then fires the leaves' hooks.  Gradients equal one undeferred backward's
-- (float64); a checkpointed function computes its weights' gradients in B.
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local R = require('support.gradcheck').rand

local NAMES = { 'x', 'w1', 'b1', 'w2', 'b2', 'w3', 'b3' }
local function leaves(seed)
  local shapes = { x = { 2, 3, 4 }, w1 = { 6, 4 }, b1 = { 6 }, w2 = { 8, 6 }, b2 = { 8 }, w3 = { 6, 8 }, b3 = { 6 } }
  local t = {}
  for i, k in ipairs(NAMES) do t[k] = R(shapes[k], seed + i, true) end
  return t
end

-- a linear with bias plus one through a computed weight (w1 * 2: not
-- deferred, its gradient flows on to w1 in B), an mlp, and a linear reusing
-- the mlp's first weight
local function loss_of(t, act)
  local h = gl.linear(t.x, t.w1, t.b1) + gl.linear(t.x, t.w1 * 2)
  local y = gl.mlp(h, t.w2, t.b2, t.w3, t.b3, act)
  local z = gl.linear(y, t.w2)
  return (z * gl.arange(0, z:numel(), { dtype = 'float64' }):view(z.shape)):sum()
end

local function deferred(fn)
  local q = A.new_deferred()
  local prev = A.defer_weight_grads(q)
  local ok, err = pcall(fn)
  A.defer_weight_grads(prev)
  assert(ok, err)
  return q
end

describe('deferred weight gradients', function()
  for _, act in ipairs({ 'gelu', 'relu2' }) do
    it(act .. ": B gives the input gradients, W the weights', equal to one backward; hooks fire once, after W", function()
      local ref = leaves(5)
      loss_of(ref, act):backward()
      local t = leaves(5)
      local fired = {}
      for _, k in ipairs(NAMES) do
        if k ~= 'x' then t[k]:register_hook(function() fired[#fired + 1] = k end) end
      end
      local q = deferred(function() loss_of(t, act):backward() end)
      -- after B: the input's gradient and mlp's first bias (made with dpre); the deferred ones wait
      assert.is_true(t.x.grad:max_abs_diff(ref.x.grad) < 1e-12)
      assert.is_true(t.b2.grad:max_abs_diff(ref.b2.grad) < 1e-12)
      for _, k in ipairs({ 'b1', 'w2', 'w3', 'b3' }) do assert.is_nil(t[k].grad, k) end
      assert.is_not_nil(t.w1.grad)  -- its part through w1 * 2
      assert.same({ 'b2' }, fired)
      assert.equal(3, #q)           -- two linears and the mlp
      A.run_deferred(q)
      assert.equal(0, #q)
      for _, k in ipairs(NAMES) do
        assert.is_true(t[k].grad:max_abs_diff(ref[k].grad) < 1e-12, k)
      end
      table.sort(fired)
      assert.same({ 'b1', 'b2', 'b3', 'w1', 'w2', 'w3' }, fired)
    end)
  end

  it('without a queue nothing waits; a checkpointed function computes its weights in B', function()
    local ref = leaves(9)
    loss_of(ref, 'gelu'):backward()
    local t = leaves(9)
    local q = deferred(function() gl.checkpoint(function(x) return loss_of(t, 'gelu') + x:sum() * 0 end, t.x):backward() end)
    assert.equal(0, #q)
    for _, k in ipairs(NAMES) do assert.is_true(t[k].grad:max_abs_diff(ref[k].grad) < 1e-12, k) end
  end)
end)
