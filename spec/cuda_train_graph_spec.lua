-- The trainer's CUDA graph mode (lua/gptlua/train_graph.lua, config key
-- cuda_graph): steps whose forward and backward are replayed from one
-- captured graph give the same losses and the same parameters, bit for bit,
-- as the same steps launched op by op (cuda_graph_warmup past the run);
-- what cannot be captured is said, and refused under cuda_graph = true.
-- On a GPU and under the CUDA simulator; pending without either.
local gl = require 'gptlua'
local train = require 'gptlua.train'
local twin = require 'support.cuda_twin'

local gpu_it = twin.gpu_it(it, pending)

-- a tiny trainer of the default recipe on cuda:0
local function trainer(over)
  local r = dofile(gl.root .. '/recipes/shakespeare.lua')
  r.n_layer, r.n_head, r.n_embd, r.block_size, r.batch_size = 1, 2, 32, 16, 4
  r.quiet, r.device, r.eval_interval, r.sample_length, r.tensorboard = true, 'cuda:0', 0, 0, false
  r.out_dir = os.tmpname()
  os.remove(r.out_dir)
  r.warmup_iters = 1
  r.optimizer, r.nanochat = 'adamw', { version = 'v1' }  -- (the default's block and optimizer when this was written)
  for k, v in pairs(over or {}) do r[k] = v end
  return train.new(r, {})
end

local function param_bits(t)
  local out = {}
  for i, p in ipairs(t.params) do
    local c = p:to('cpu'):float():contiguous()
    local ffi = require 'ffi'
    local d, n = ffi.cast('uint32_t *', c:data_ptr()), c:numel()
    local bits = {}
    for j = 0, n - 1 do bits[j + 1] = tonumber(d[j]) end
    out[i] = bits
  end
  return out
end

describe('trainer: cuda_graph #cuda', function()
  gpu_it('replays steps bit for bit like steps launched op by op', function()
    local steps = 4
    local graphed = trainer({ cuda_graph = true, cuda_graph_warmup = 1, gradient_accumulation_steps = 2 })
    local eager = trainer({ cuda_graph = true, cuda_graph_warmup = 100, gradient_accumulation_steps = 2 })
    for s = 1, steps do
      local la, na = graphed:train_step()
      local lb, nb = eager:train_step()
      assert.are.equal(lb, la, 'loss of step ' .. s)
      assert.are.equal(nb, na, 'gradient norm of step ' .. s)
    end
    assert.is_truthy(graphed.graph.g, 'the graphed trainer captured')
    assert.is_nil(eager.graph.g)
    assert.are.same(param_bits(eager), param_bits(graphed))
    graphed.graph:free()
  end)

  -- recipes/moe.lua's layers at tiny size: routing, dispatch and the grouped
  -- products read no count on the host, so the whole step is one graph; the
  -- routers' bias update (after the step, from the load the graph counted)
  -- and the load metrics are the op-by-op run's too
  gpu_it('replays a step with mixture-of-experts layers bit for bit, bias update and load metrics included', function()
    local mc = dofile(gl.root .. '/recipes/moe.lua').moe
    mc.experts, mc.hidden, mc.capacity_factor = 4, 64, 1.25  -- some tokens dropped
    local over = { moe = mc, cuda_graph = true, gradient_accumulation_steps = 2 }
    over.cuda_graph_warmup = 1
    local graphed = trainer(over)
    over.cuda_graph_warmup = 100
    local eager = trainer(over)
    assert.is_true(graphed.graph.whole)
    local moe = require 'gptlua.moe'
    for s = 1, 4 do
      local la, na = graphed:train_step()
      local lb, nb = eager:train_step()
      assert.are.equal(lb, la, 'loss of step ' .. s)
      assert.are.equal(nb, na, 'gradient norm of step ' .. s)
      assert.are.same(moe.metrics(eager.moe_layers), moe.metrics(graphed.moe_layers), 'metrics of step ' .. s)
    end
    assert.is_truthy(graphed.graph.g, 'the graphed trainer captured')
    assert.are.same(param_bits(eager), param_bits(graphed))
    local bias = graphed.moe_layers[1][2].expert_bias:to('cpu')
    assert.are.same(eager.moe_layers[1][2].expert_bias:to('cpu'):tolist(), bias:tolist())
    assert.is_true(bias:abs():max():item() > 0, 'the bias moved')
    graphed.graph:free()
  end)

  gpu_it('says what cannot be captured, and refuses it under cuda_graph = true', function()
    local ok, err = pcall(trainer, { cuda_graph = true, dropout = 0.1 })
    assert.is_false(ok)
    assert.matches('cuda_graph = true: dropout 0.1 > 0 draws a fresh mask', err, 1, true)
    assert.is_nil(trainer({ cuda_graph = 'auto', dropout = 0.1 }).graph)
    assert.is_nil(trainer({ cuda_graph = false }).graph)
    ok, err = pcall(trainer, { cuda_graph = 'sometimes' })
    assert.is_false(ok)
    assert.matches("cuda_graph must be 'off' (false), 'auto' or true, got sometimes", err, 1, true)
    local auto = trainer({}).graph  -- 'auto' by default on a CUDA device
    assert.is_truthy(auto)
    assert.are.equal('auto', auto.mode)
    assert.is_nil(trainer({ cuda_graph = 'off' }).graph)
  end)

  gpu_it("is on by default ('auto'), and the warm-up's cached blocks make way for the graph's pool", function()
    local cuda = require 'gptlua.cuda'
    local t = trainer({})
    t:train_step()  -- the warm-up step, op by op: the allocator caches its temporaries
    local before = cuda.memory_stats('cuda:0').reserved
    t:train_step()  -- captures, then replays
    assert.is_truthy(t.graph.g, 'captured under the default')
    local after = cuda.memory_stats('cuda:0').reserved
    -- without handing the cache back, reserved = before + the pool
    assert.is_true(after < before + t.graph.g.pool_bytes,
      ('reserved %d after the capture, %d before, pool %d'):format(after, before, t.graph.g.pool_bytes))
    t.graph:free()
  end)
end)

describe('trainer: cuda_graph on the CPU', function()
  it('is off under auto and an error under true', function()
    local r = dofile(gl.root .. '/recipes/shakespeare.lua')
    r.n_layer, r.n_head, r.n_embd, r.block_size, r.batch_size = 1, 2, 32, 16, 4
    r.quiet, r.device, r.eval_interval, r.sample_length, r.tensorboard = true, 'cpu', 0, 0, false
    r.out_dir = os.tmpname()
    assert.is_nil(train.new(r, {}).graph)  -- the default, 'auto', does not apply on the CPU
    r.cuda_graph = true
    local ok, err = pcall(train.new, r, {})
    assert.is_false(ok)
    assert.matches('cuda_graph = true: the device is cpu', err, 1, true)
    -- from the command line: --cuda_graph is true, --cuda_graph=off / false / auto
    r.cuda_graph = nil
    ok, err = pcall(train.new, r, { '--cuda_graph' })
    assert.is_false(ok)
    assert.matches('cuda_graph = true: the device is cpu', err, 1, true)
    for _, w in ipairs({ 'off', 'false', 'auto' }) do assert.is_nil(train.new(r, { '--cuda_graph=' .. w }).graph) end
  end)
end)
