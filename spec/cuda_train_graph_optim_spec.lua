-- The optimizer inside the trainer's CUDA graph (lua/gptlua/train_graph.lua,
-- gptlua.step_block, engine/ops_step.c, kernels/optim.cu): whole steps
-- replayed from one graph equal the same steps run op by op, bit for bit
-- (losses, norms, parameters, AdamW's state and step count), under a
-- learning rate that changes every step, clipping, gradient accumulation
-- and a skipped non-finite step; a bad target; one host wait per replayed
-- step.  The step block's entry points themselves, CPU against GPU and their
-- argument checks: spec/cuda_step_block_spec.lua.
local gl = require 'gptlua'
local ffi = require 'ffi'
local train = require 'gptlua.train'
local twin = require 'support.cuda_twin'

local gpu_it = twin.gpu_it(it, pending)

local function err(f)
  local ok, e = pcall(f)
  assert.is_false(ok, 'expected an error')
  return tostring(e)
end

-- a tiny trainer of the default recipe on cuda:0, AdamW, a warm-up and
-- cosine learning rate that changes every step, clipping that bites
local function trainer(over)
  local r = dofile(gl.root .. '/recipes/shakespeare.lua')
  r.n_layer, r.n_head, r.n_embd, r.block_size, r.batch_size = 1, 2, 32, 16, 4
  r.quiet, r.device, r.eval_interval, r.sample_length, r.tensorboard = true, 'cuda:0', 0, 0, false
  r.out_dir = os.tmpname()
  os.remove(r.out_dir)
  r.optimizer, r.nanochat = 'adamw', { version = 'v1' }
  r.warmup_iters, r.lr_decay_iters, r.max_iters, r.grad_clip = 3, 6, 6, 0.05
  r.gradient_accumulation_steps = 2
  for k, v in pairs(over or {}) do r[k] = v end
  return train.new(r, {})
end

-- every parameter's and optimizer state tensor's bits, as float32 words
local function bits(t)
  local out = {}
  local function add(x)
    local c = x:to('cpu'):float():contiguous()
    local d, n = ffi.cast('uint32_t *', c:data_ptr()), c:numel()
    local w = {}
    for j = 0, n - 1 do w[j + 1] = tonumber(d[j]) end
    out[#out + 1] = w
  end
  for _, p in ipairs(t.params) do
    add(p)
    local st
    for _, o in ipairs(t.optimizer.optimizers or { t.optimizer }) do st = st or o.state[p] end
    for _, k in ipairs({ 'm', 'v', 'master', 'momentum_buffer', 'second_momentum_buffer' }) do
      if st and st[k] then add(st[k]) end
    end
  end
  return out
end

describe('trainer: the optimizer in the CUDA graph #cuda', function()
  gpu_it('replays whole steps bit for bit like the same steps op by op, a skipped one included', function()
    local graphed = trainer({ cuda_graph = true, cuda_graph_warmup = 1 })
    local eager = trainer({ cuda_graph = true, cuda_graph_warmup = 100 })
    local classic = trainer({ cuda_graph = 'off' })
    assert.is_true(graphed.graph.whole)
    local lrs, poisoned = {}, 4
    for s = 1, 5 do
      local got = {}
      for i, t in ipairs({ graphed, eager, classic }) do
        local p, saved = t.params[1], nil
        if s == poisoned then  -- a non-finite gradient: the step is skipped, the weight put back after
          saved = p:clone()
          gl.no_grad(function() p:fill_(0 / 0) end)
        end
        got[i] = { t:train_step() }
        if saved then gl.no_grad(function() p:copy_(saved) end) end
        t.step = t.step + 1
      end
      lrs[s] = got[1][3]
      for i = 1, 3 do for j = 1, 2 do got[i][j] = tostring(got[i][j]) end end  -- (NaN ~= NaN)
      for i = 2, 3 do
        assert.are.same(got[1], got[i], ('step %d: graphed against %s'):format(s, i == 2 and 'op by op' or "cuda_graph 'off'"))
      end
      assert.are.equal(s ~= poisoned, got[1][4], 'step ' .. s .. ' taken')
      if s ~= poisoned then assert.is_true(tonumber(got[1][2]) > 0.05, 'the clip bites') end
    end
    assert.is_truthy(graphed.graph.g, 'the whole step was captured')
    assert.is_nil(eager.graph.g)
    assert.are_not.equal(lrs[2], lrs[3])  -- the rate changes every step: a frozen block would differ
    assert.are_not.equal(lrs[3], lrs[5])
    assert.are.equal(4, graphed.optimizer.t)  -- 5 steps, one skipped
    assert.are.equal(4, eager.optimizer.t)
    local b = bits(graphed)
    assert.are.same(bits(eager), b)
    assert.are.same(bits(classic), b)
    graphed.graph:free()
  end)

  gpu_it("with Muon and AdamW (nanochat's optimizer, its scheduled momentum): graphed == op by op", function()
    local over = { optimizer = 'nanochat', muon_variant = 'current', muon_weight_decay = 0.1,
      muon_weight_decay_schedule = 'cosine' }  -- NorMuon, cautious decay on a schedule
    over.cuda_graph, over.cuda_graph_warmup = true, 1
    local graphed = trainer(over)
    over.cuda_graph_warmup = 100
    local eager = trainer(over)
    over.cuda_graph = 'off'
    local classic = trainer(over)
    assert.is_true(graphed.graph.whole)
    assert.are.equal(0.9, graphed.optimizer.optimizers[2].groups[1].normuon_beta2)
    local poisoned = 3
    for s = 1, 4 do
      local got = {}
      for i, t in ipairs({ graphed, eager, classic }) do
        local p, saved = t.params[1], nil
        if s == poisoned then
          saved = p:clone()
          gl.no_grad(function() p:fill_(0 / 0) end)
        end
        got[i] = { t:train_step() }
        if saved then gl.no_grad(function() p:copy_(saved) end) end
        t.step = t.step + 1
        for j = 1, 2 do got[i][j] = tostring(got[i][j]) end
      end
      assert.are.same(got[1], got[2], 'step ' .. s .. ': graphed against op by op')
      assert.are.same(got[1], got[3], 'step ' .. s .. ": graphed against cuda_graph 'off'")
      assert.are.equal(s ~= poisoned, got[1][4], 'step ' .. s .. ' taken')
    end
    assert.is_truthy(graphed.graph.g, 'the whole step was captured')
    for i, o in ipairs(graphed.optimizer.optimizers) do
      assert.are.equal(3, o.t, 'optimizer ' .. i .. ': 4 steps, one skipped')
      assert.are.equal(3, eager.optimizer.optimizers[i].t)
    end
    local b = bits(graphed)
    assert.are.same(bits(eager), b)
    assert.are.same(bits(classic), b)
    graphed.graph:free()
  end)

  gpu_it('a bad target in a replayed step is named with its op after the step; nothing is updated', function()
    local t = trainer({ cuda_graph = true, cuda_graph_warmup = 1, gradient_accumulation_steps = 1 })
    local loader, V = t.data.train, t.cfg.vocab_size
    local next_batch, poison = loader.next_batch, false
    loader.next_batch = function(self)
      local x, y = next_batch(self)
      if not poison then return x, y end
      local yc = y:to('cpu'):contiguous()
      ffi.cast('int64_t *', yc:data_ptr())[5] = V
      return x, yc:to(y.device)
    end
    for _ = 1, 2 do t:train_step() end
    assert.is_truthy(t.graph.g, 'captured')
    local before = bits(t)
    poison = true
    local ok, e = pcall(t.train_step, t)
    assert.is_false(ok)
    assert.matches('targets%[5%] is ' .. V .. ', expected 0 <= targets < ' .. V, tostring(e))
    assert.are.same(before, bits(t), 'the bad step updated nothing')
    assert.are.equal(2, t.optimizer.t)
    poison = false
    local _, _, _, taken = t:train_step()
    assert.is_true(taken, 'the next step runs clean')
    assert.are.equal(3, t.optimizer.t)
    t.graph:free()
  end)

  -- the host waits once per replayed step: the id checks' slots come back
  -- on that wait (a copy queued before it), not on a copy and wait of their own
  local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')
  local syncs_of = trace.syncs_of
  local sim_it = trace.library() and gpu_it or pending

  sim_it('a replayed step makes one host wait, its id checks read on it', function()
    local t = trainer({ cuda_graph = true, cuda_graph_warmup = 1, gradient_accumulation_steps = 2 })
    for _ = 1, 2 do t:train_step() end
    assert.is_truthy(t.graph.g, 'captured')
    local n, kinds = syncs_of(function() t:train_step() end)
    assert.are.equal(1, n, 'host syncs of a replayed step: ' .. kinds)
    -- the graph's checks (ids, targets) were read on that wait: none is left
    assert.are.equal(0, (syncs_of(function() require('gptlua.cuda').check_flags('cuda:0') end)))
    t.graph:free()
  end)

  sim_it("a loss read is one host wait, the checks' read included; a bad id is still named", function()
    local Wc = gl.randn({ 8, 4 })
    local W = Wc:to('cuda:0')
    local ids = gl.tensor({ 1, 2, 3 }, { dtype = 'int64' })
    local want = gl.embedding(ids, Wc):sum():item()
    local got
    local n, kinds = syncs_of(function() got = gl.embedding(ids:to('cuda:0'), W):sum():item() end)
    assert.are.equal(1, n, 'host syncs of a loss read: ' .. kinds)
    assert.is_true(math.abs(got - want) <= 1e-5 * (1 + math.abs(want)), ('sum %g, expected %g'):format(got, want))
    local bad = gl.tensor({ 1, 9, 3 }, { dtype = 'int64' }):to('cuda:0')
    assert.matches('ids%[1%] is 9, expected 0 <= ids < 8', err(function() gl.embedding(bad, W):sum():item() end))
    assert.are.equal(got, gl.embedding(ids:to('cuda:0'), W):sum():item(), 'the next read runs clean')
  end)

  gpu_it('collects no garbage while capturing (a dropped pinned block, freed there, would end the capture)', function()
    local cuda = require 'gptlua.cuda'
    local x = gl.zeros({ 4 }, { device = 'cuda:0' })
    local running
    local g = cuda.graph(function() running = collectgarbage('isrunning'); x:add_(1) end, 'cuda:0')
    assert.is_false(running)
    assert.is_true(collectgarbage('isrunning'))
    g:free()
  end)
end)
