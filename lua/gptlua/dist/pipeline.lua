-- gptlua.dist.pipeline — pipeline parallelism: the model's blocks cut into
-- stages on the ranks of the mesh's pp group, microbatches streamed through
-- them in the order a schedule (gptlua.dist.schedules) gives.
--
--   local pipe = pipeline.new(model, mesh.pp, { schedule = '1f1b', microbatches = 8,
--                                              batch = {B, T} })
--   optimizer over pipe.params                 -- this rank's parameters only
--   local loss = pipe:step(xs, ys)             -- xs[i], ys[i]: microbatch i's (B, T) ids
--
-- step runs forward and backward of every microbatch; afterwards each
-- owned parameter's .grad is the gradient of the mean of the microbatches'
-- losses, as one rank accumulating them would have it (the loss scaled by
-- 1/m), and the mean loss comes back on every pp rank.
--
-- Stages: the embeddings are on the first stage, the final norm, head and
-- loss on the last, the blocks cut between them (partition: by parameter
-- count, by FLOPs, a list of block counts, or a function of the per-block
-- costs).  With v virtual stages (the interleaved schedule) each rank holds
-- v stages, r, r + p, ...  gpt2's lm_head is its token embedding (tied):
-- the first and the last stage each hold a copy and all-reduce its gradient
-- after the step, so the same update keeps them equal.
--
-- Point to point: one activation (B, T, C) forward and one gradient back per
-- microbatch and stage boundary (o.rows rows instead of T: the T/cp shard
-- under context parallelism, in the zig-zag order under ring, T/tp under
-- sequence parallelism; o.seq_mode(T) then tells the model's layouts, on a
-- stage that does not start at the embedding, what its embedding would
-- have: that this forward runs split; nanochat v2: a stack of x, x0 and,
-- after the backout block, its output, (k, B, rows, C): see the adapter),
-- on communicators of their own per model
-- chunk and direction (so messages on a link can only arrive in the order
-- the schedule sends them: schedules.check proves the per-stage order).
-- Receive buffers are made once, as many per stage as the schedule keeps
-- microbatches in flight there (schedules.in_flight): 1F1B's activation
-- memory is bounded by the stages, GPipe's grows with the microbatches.
-- Sends are asynchronous; a receive waits.  All communication goes through
-- Comm methods (the planner runs this over a fake world).
--
-- A split schedule (ZB-H1: W actions) runs B with the blocks' weight
-- gradients deferred (autograd.defer_weight_grads: linear's and mlp's dW
-- and their biases' sums; norms' and embeddings' weight gradients, cheap,
-- stay in B) and W runs that microbatch's queue; its buffers are free only
-- then.  The fused head (ops_head.lua) makes its dW in the forward: only
-- its scaling by the upstream gradient is in B.
local gl = require 'gptlua'
local autograd = require 'gptlua.autograd'
local common = require 'gptlua.models.common'
local schedules = require 'gptlua.dist.schedules'

local M = {}

local function fail(msg) error('pipeline: ' .. msg, 0) end

-- ------------------------------------------------------------ models --
-- What a stage needs of a model beyond its blocks: the embedding (first
-- stage), per-step preparation, the final norm + head + loss (last stage),
-- and which parameters belong to the first and the last stage.  These
-- mirror the models' own forward (models/gpt2.lua, models/nanochat.lua).
local adapters = {}

adapters.GPT2 = {
  first = { 'transformer.wte.', 'transformer.wpe.' },
  last = { 'transformer.ln_f.', 'transformer.wte.weight' },
  tied = 'transformer.wte.weight',   -- the embedding is also the lm_head
  embed = function(model, idx)
    local tr, T = model.transformer, idx.shape[2]
    local x = tr.wte(idx) + tr.wpe(gl.arange(0, T, { device = idx.device }))
    return gl.dropout(x, model.config.dropout, model.training)
  end,
  finish = function(model, x, y)
    local _, loss = common.head(model, model.transformer.ln_f(x), y, gl.linear, model.lm_head_weight, 0)
    return loss
  end,
}

-- nanochat runs its own forward's parts (GPT:prepare, embed, layer,
-- finish).  Version 2's blocks read x0 (the embedding) and the last stage
-- subtracts the backout block's output, so a stage's message is a stack
-- (k, B, T, C) of x, x0 (with lambdas) and, once the backout block has run,
-- its output: message_parts says which after a block.  Value embeddings
-- live on the stage of their layer (looked up from the microbatch's ids,
-- which every stage reads); the smear on the first stage, the backout
-- lambda on the last; the per-layer lambdas (one vector) on every stage,
-- each stage's gradient its layers' entries, summed over pp after the step.
local nanochat_model = require 'gptlua.models.nanochat'
local function message_parts(cfg, after)
  local b = nanochat_model.backout_at(cfg)
  return 1 + (cfg.lambdas and 1 or 0) + ((b and after >= b) and 1 or 0)
end
local function pack(list)
  if #list == 1 then return list[1] end
  local parts = {}
  for j, t in ipairs(list) do parts[j] = t:unsqueeze(1) end
  return gl.cat(parts, 1)
end
-- x, x0, x_backout (nil where the message has none) of a message after block `after`
local function unpack_message(cfg, msg, after)
  local k = message_parts(cfg, after)
  if k == 1 then return msg, msg, nil end
  local x, x0 = msg:select(1, 1), cfg.lambdas and msg:select(1, 2) or nil
  local xb = k == (cfg.lambdas and 3 or 2) and msg:select(1, k) or nil
  return x, x0 or x, xb
end
adapters.Nanochat = {
  first = { 'transformer.wte.', 'smear_gate.', 'smear_lambda' },
  last = { 'lm_head.', 'backout_lambda' },
  shared = { 'resid_lambdas', 'x0_lambdas' },
  -- the 0-based block a parameter outside transformer.h belongs to
  block_of = function(name) local b = name:match('^value_embeds%.(%d+)%.') return b and tonumber(b) end,
  message_shape = function(model, B, T, after)
    local k, C = message_parts(model.config, after), model.config.n_embd
    return k == 1 and { B, T, C } or { k, B, T, C }
  end,
  embed = function(model, idx)
    local x = model:embed(idx)
    return pack(model.config.lambdas and { x, x } or { x })
  end,
  prepare = function(model, T) model:prepare(0, T) end,  -- the rotary rows and eps every block reads
  blocks = function(model, msg, from, to, idx)
    local cfg = model.config
    local x, x0, xb = unpack_message(cfg, msg, from - 1)
    local backout_at = nanochat_model.backout_at(cfg)
    for b = from, to do
      if cfg.value_embeds and nanochat_model.has_ve(cfg, b) and not idx then
        fail(("nanochat's value embedding of block %d needs the microbatch's ids on its stage"):format(b))
      end
      x = model:layer(b, x, x0, idx)
      if b == backout_at then xb = x end
    end
    local list = { x }
    if cfg.lambdas then list[#list + 1] = x0 end
    if xb then list[#list + 1] = xb end
    return pack(list)
  end,
  finish = function(model, msg, y)
    local x, _, xb = unpack_message(model.config, msg, model.config.n_layer)
    local _, loss = model:finish(x, xb, y)
    return loss
  end,
}

function M.adapter(model)
  local mt = getmetatable(model)
  local a = type(mt) == 'table' and adapters[mt.__name or ''] or nil   -- nn.class's name
  if not a then fail('model expected gpt2 or nanochat, got ' .. tostring(model)) end
  return a
end

-- --------------------------------------------------------- partition --
-- per-block costs: 'params' (parameter count) or 'flops' (training FLOPs
-- per token: 6 x the block's weights + the attention, 12 C T)
local function block_costs(model, by, T)
  local costs, cfg = {}, model.config
  for i = 1, model.transformer.h.n do
    local n = 0
    for _, p in ipairs(model.transformer.h[i]:parameters()) do n = n + p:numel() end
    costs[i] = by == 'flops' and 6 * n + 12 * cfg.n_embd * T or n
  end
  return costs
end

-- contiguous cut of the costs into S parts of at least one block each that
-- minimises the largest part (dynamic programming: L and S are small)
local function balanced(costs, S)
  local L = #costs
  local pre = { [0] = 0 }
  for i = 1, L do pre[i] = pre[i - 1] + costs[i] end
  local best, cut = {}, {}
  for s = 0, S do best[s], cut[s] = {}, {} end
  best[0][0] = 0
  for s = 1, S do
    for i = s, L - (S - s) do
      local b, c = math.huge, nil
      for j = s - 1, i - 1 do
        if best[s - 1][j] then
          local v = math.max(best[s - 1][j], pre[i] - pre[j])
          if v < b then b, c = v, j end
        end
      end
      best[s][i], cut[s][i] = b, c
    end
  end
  local counts, i = {}, L
  for s = S, 1, -1 do
    local j = cut[s][i]
    counts[s] = i - j
    i = j
  end
  return counts
end

-- partition(model, S, by, T) -> {blocks of stage 1, ..., stage S}
function M.partition(model, S, by, T)
  local L = model.transformer.h.n
  if L < S then fail(('%d blocks cannot fill %d stages (each needs one)'):format(L, S)) end
  by = by or 'params'
  local counts
  if type(by) == 'table' then counts = by
  elseif type(by) == 'function' then counts = by(block_costs(model, 'params', T), S)
  elseif by == 'params' or by == 'flops' then counts = balanced(block_costs(model, by, T), S)
  else fail(('partition expected params, flops, a list of block counts or a function, got %s'):format(tostring(by))) end
  local sum = 0
  for s = 1, S do
    local c = counts[s]
    if type(c) ~= 'number' or c < 1 or c ~= math.floor(c) then
      fail(('partition: stage %d expected a positive block count, got %s'):format(s, tostring(c)))
    end
    sum = sum + c
  end
  if #counts ~= S or sum ~= L then
    fail(('partition: %d counts summing to %d, expected %d stages summing to the %d blocks'):format(#counts, sum, S, L))
  end
  return counts
end

-- ---------------------------------------------------------- pipeline --
local Pipeline = {}
Pipeline.__index = Pipeline
M.Pipeline = Pipeline

local function starts_with(s, prefix) return s:sub(1, #prefix) == prefix end

-- new(model, comm, o): comm the pp group (mesh.pp); o.schedule a name
-- (schedules.builders) or a schedule table; o.microbatches m; o.virtual v;
-- o.partition; o.batch = {B, T} the microbatch shape (receive buffers are
-- made for it, with o.rows rows when the sequence is split); o.seq_mode.
-- Collective over comm (splits).
function M.new(model, comm, o)
  o = o or {}
  local p, me = comm.size, comm.rank
  local m, v = o.microbatches, o.virtual or 1
  local sched = o.schedule or '1f1b'
  if type(sched) == 'string' then sched = schedules.make(sched, p, m, v) end
  schedules.check(sched)
  if sched.ranks_n ~= p then fail(('schedule for %d ranks, the pp group has %d'):format(sched.ranks_n, p)) end
  if p == 1 and sched.stages > 1 then fail('virtual stages need a pp group of two ranks or more') end
  m = sched.microbatches
  local S = sched.stages
  local B, T = o.batch and o.batch[1], o.batch and o.batch[2]
  if type(B) ~= 'number' or type(T) ~= 'number' then fail('batch expected {B, T}, the microbatch shape') end
  local ad = M.adapter(model)
  local counts = M.partition(model, S, o.partition, T)
  local self = setmetatable({ model = model, comm = comm, schedule = sched, adapter = ad, m = m, S = S, p = p,
    counts = counts, stages = {}, B = B, T = T, seq_mode = o.seq_mode }, Pipeline)
  -- this rank's stages and their blocks
  local first_block = 1
  for st = 1, S do
    if schedules.rank_of(sched, st) == me + 1 then
      self.stages[st] = { index = st, chunk = math.floor((st - 1) / p) + 1, from = first_block,
        to = first_block + counts[st] - 1 }
    end
    first_block = first_block + counts[st]
  end
  -- the parameters this rank owns
  local owned, named, params = {}, {}, {}
  local function own(name, t) if not owned[t] then owned[t] = true; named[#named + 1] = { name, t }; params[#params + 1] = t end end
  for _, np in ipairs(model:named_parameters()) do
    local name = np[1]
    local keep = false
    for st, info in pairs(self.stages) do
      for b = info.from, info.to do
        if starts_with(name, ('transformer.h.%d.'):format(b - 1)) then keep = true end
      end
      if st == 1 then for _, pre in ipairs(ad.first) do if starts_with(name, pre) then keep = true end end end
      local b = ad.block_of and ad.block_of(name)
      if b and b + 1 >= info.from and b + 1 <= info.to then keep = true end
      if st == S then for _, pre in ipairs(ad.last) do if starts_with(name, pre) then keep = true end end end
    end
    for _, s in ipairs(ad.shared or {}) do if name == s then keep = true end end
    if keep then
      -- (gptlua.dist.pp_build leaves other stages' parameters without storage; these must have it)
      if rawget(np[2], 'held_by') then fail(('parameter %s of this rank\'s stages was not built here'):format(name)) end
      own(name, np[2])
    end
  end
  self.named, self.params = named, params
  -- parameters every stage holds (their gradients summed over pp after the step)
  self.shared, self.shared_set = {}, {}
  for _, np in ipairs(named) do
    for _, s in ipairs(ad.shared or {}) do
      if np[1] == s then self.shared[#self.shared + 1] = np[2]; self.shared_set[np[2]] = true end
    end
  end
  -- communicators: per chunk, one for activations and one for gradients
  local function dup() return comm:split(0, me, { size = p, rank = me }) end
  self.act, self.grad = {}, {}
  for c = 1, v do self.act[c] = dup(); self.grad[c] = dup() end
  -- the tied embedding's copies: first stage (rank 0) and last (rank p-1)
  if ad.tied and p > 1 then
    local color = (me == 0 or me == p - 1) and 0 or -1
    self.tied_comm = comm:split(color, me, color == 0 and { size = 2, rank = me == 0 and 0 or 1 } or nil)
    for _, np in ipairs(named) do if np[1] == ad.tied then self.tied_param = np[2] end end
  end
  -- receive buffers, as many per stage as microbatches in flight there
  local w = model.transformer.h[1]:parameters()[1]
  local like = { dtype = w.dtype, device = w.device }
  local C, rows = model.config.n_embd, o.rows or T
  for st, info in pairs(self.stages) do
    local n = schedules.in_flight(sched, st)
    info.inputs, info.grads, info.free = {}, {}, {}
    local function shape(after) return ad.message_shape and ad.message_shape(model, B, rows, after) or { B, rows, C } end
    for k = 1, n do
      if st > 1 then info.inputs[k] = gl.zeros(shape(info.from - 1), like):keep() end
      if st < S then info.grads[k] = gl.zeros(shape(info.to), like):keep() end
      info.free[#info.free + 1] = k
    end
    info.slot, info.out, info.deferred = {}, {}, {}
  end
  self.split = schedules.split(sched)
  return self
end

-- the pp rank (0-based) training parameter `name` (the partition says; no
-- communication): a block's stage's, the first stage's embeddings (gpt2's
-- tied one included), the last stage's head; nil for none
function Pipeline:owner_of(name)
  local b = name:match('^transformer%.h%.(%d+)%.') or (self.adapter.block_of and self.adapter.block_of(name))
  for _, s in ipairs(self.adapter.shared or {}) do if name == s then return 0 end end
  if b then
    local st, last = 0, 0
    for i, c in ipairs(self.counts) do
      last = last + c
      if tonumber(b) + 1 <= last then st = i; break end
    end
    return (st - 1) % self.p
  end
  for _, pre in ipairs(self.adapter.first) do if starts_with(name, pre) then return 0 end end
  for _, pre in ipairs(self.adapter.last) do if starts_with(name, pre) then return (self.S - 1) % self.p end end
  return nil
end

function Pipeline:__tostring()
  local mine = {}
  for st, info in pairs(self.stages) do
    mine[#mine + 1] = ('stage %d: blocks %d-%d'):format(st, info.from, info.to)
  end
  table.sort(mine)
  return ('Pipeline(%s, %d stages over %d ranks, %d microbatches; rank %d: %s)'):format(self.schedule.name or 'custom',
    self.S, self.p, self.m, self.comm.rank, table.concat(mine, ', '))
end

local function rank_of(self, st) return (st - 1) % self.p end

-- F: microbatch i through stage st
function Pipeline:forward(st, i, xs, ys)
  local info, model, ad = self.stages[st], self.model, self.adapter
  local slot = table.remove(info.free)
  info.slot[i] = slot
  local x
  if st == 1 then
    x = ad.embed(model, xs[i])
  else
    local buf = info.inputs[slot]
    buf.requires_grad = false
    -- from the previous stage: chunk of the sender
    self.act[math.floor((st - 2) / self.p) + 1]:recv(buf, rank_of(self, st - 1))
    buf.requires_grad = true
    if self.on_action then self.on_action('ready', self.action, self.action_n) end
    x = buf
    if self.seq_mode then self.seq_mode(self.T) end
  end
  if ad.blocks then x = ad.blocks(model, x, info.from, info.to, xs[i])
  else
    local blocks = model.transformer.h
    for b = info.from, info.to do x = common.run_block(blocks[b], x, nil, model.config) end
  end
  if st == self.S then
    info.out[i] = ad.finish(model, x, ys[i])
  else
    info.out[i] = x
    self.pending[#self.pending + 1] = self.act[info.chunk]:send_async(x, rank_of(self, st + 1))
  end
end

-- (B releases each op's output once its node has run, as the trainer's
-- backward does: nothing outside the graph reads them, and the pipeline's
-- steps run outside a tensor scope, so they would otherwise wait for the GC)
local FREE = { free_activations = true }

-- B: microbatch i back through stage st
function Pipeline:backward(st, i)
  local info = self.stages[st]
  local slot, out = info.slot[i], info.out[i]
  local queue = self.split and autograd.new_deferred() or nil
  local prev = autograd.defer_weight_grads(queue)
  local ok, err = pcall(function()
    if st == self.S then
      self.loss_sum = self.loss_sum == nil and out:detach() or self.loss_sum + out:detach()
      gl.backward(out * (1 / self.m), nil, FREE)
    else
      local g = info.grads[slot]
      self.grad[info.chunk]:recv(g, rank_of(self, st + 1))
      if self.on_action then self.on_action('ready', self.action, self.action_n) end
      gl.backward(out, g, FREE)
    end
  end)
  autograd.defer_weight_grads(prev)
  if not ok then error(err, 0) end
  info.out[i] = nil
  if st > 1 then
    local buf = info.inputs[slot]
    local gin = buf.grad
    buf.grad, buf.requires_grad = nil, false
    self.pending[#self.pending + 1] = self.grad[math.floor((st - 2) / self.p) + 1]:send_async(gin, rank_of(self, st - 1))
  end
  if queue then info.deferred[i] = queue; return end  -- the slot's buffers are read until W
  info.slot[i] = nil
  info.free[#info.free + 1] = slot
end

-- W: microbatch i's weight gradients on stage st (a split schedule's)
function Pipeline:weights(st, i)
  local info = self.stages[st]
  autograd.run_deferred(info.deferred[i])
  info.deferred[i] = nil
  info.free[#info.free + 1] = info.slot[i]
  info.slot[i] = nil
end

-- eval_loss(x, y): one batch's loss through the stages, forward only and
-- without recording (evaluation: every parameter stays on its stage); the
-- same number on every pp rank.  Collective over the pp group, between
-- steps (it reuses the first receive buffer of each stage); x (B, T) is read
-- on the first stage, y on the last.
function Pipeline:eval_loss(x, y)
  local model, ad = self.model, self.adapter
  if ad.prepare then ad.prepare(model, self.T) end
  local loss, sends = 0, {}
  gl.no_grad(function()
    for st = 1, self.S do
      local info = self.stages[st]
      if info then
        local h
        if st == 1 then h = ad.embed(model, x)
        else
          h = info.inputs[1]
          self.act[math.floor((st - 2) / self.p) + 1]:recv(h, rank_of(self, st - 1))
        end
        for b = info.from, info.to do h = common.run_block(model.transformer.h[b], h, nil, model.config) end
        if st == self.S then loss = ad.finish(model, h, y):item()
        else sends[#sends + 1] = self.act[info.chunk]:send_async(h, rank_of(self, st + 1)) end
      end
    end
  end)
  for _, r in ipairs(sends) do r:wait() end
  return self.p > 1 and self.comm:all_reduce_number(loss, 'sum') or loss
end

-- pipe.on_action(at, action, n), when set, is called at = 'start' and 'end'
-- of each action, and 'ready' when its message arrived (the wait before it
-- is the bubble: recipes/tools/bench_pipeline.lua measures it so).
-- step(xs, ys): one optimizer step's microbatches through the pipeline
-- (xs read on the first stage, ys on the last; others may pass nil lists);
-- returns the mean loss on every pp rank.  Errors end every rank, naming
-- the stage (a peer blocked in a receive would otherwise wait forever).
function Pipeline:step(xs, ys)
  self.pending, self.loss_sum = {}, nil
  if self.adapter.prepare then self.adapter.prepare(self.model, self.T) end
  local list = self.schedule.ranks[self.comm.rank + 1]
  local on_action = self.on_action
  for n, a in ipairs(list) do
    self.action, self.action_n = a, n
    local ok, err = pcall(function()
      if on_action then on_action('start', a, n) end
      if a[1] == 'F' then self:forward(a[3], a[2], xs or {}, ys or {})
      elseif a[1] == 'B' then self:backward(a[3], a[2])
      else self:weights(a[3], a[2]) end
      if on_action then on_action('end', a, n) end
    end)
    if not ok then
      local msg = ('pipeline stage %d (pp rank %d) failed at %s%d: %s'):format(a[3], self.comm.rank, a[1], a[2],
        tostring(err))
      if self.comm.size > 1 and self.on_stage_error ~= false then require('gptlua.dist').abort(msg) end
      error(msg, 0)
    end
  end
  for k = 1, #self.pending do self.pending[k]:wait() end
  self.pending = {}
  if self.tied_comm and self.tied_param.grad then self.tied_comm:all_reduce(self.tied_param.grad, 'sum') end
  if self.p > 1 then for _, p in ipairs(self.shared) do self.comm:all_reduce(p.grad, 'sum') end end
  local l = self.loss_sum and self.loss_sum:item() / self.m or 0
  self.loss_sum = nil
  return self.comm.size > 1 and self.comm:all_reduce_number(l, 'sum') or l
end

return M
