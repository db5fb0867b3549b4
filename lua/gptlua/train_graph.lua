-- gptlua.train_graph — the trainer's CUDA graph mode (config key cuda_graph).
--
-- The whole step (cuda_graph_warmup optimizer steps run op by op first, at
-- least one) is captured once and replayed from then on, when the
-- optimizer takes the step block (gptlua.step_block; AdamW, Muon and
-- nanochat's pair of them): the block's copy to the device, zero_grad,
-- every micro-step's forward and backward (each loss copied into the
-- block), the gradient's sum of squares, the norm, clip scale and skip flag
-- (gl_step_finalize), the optimizer's update (rates, momentum and clip
-- scale read from the block, nothing written when the flag is set) and the
-- block's copy back.  Lua dispatches nothing per op; the host
-- writes this step's rates into the pinned block, launches once, and waits
-- once, after the step, to read the losses, the norm and the flag (the
-- trainer's history and bad-step count need them).  The steps before the
-- capture, and a run whose capture failed, run the same function op by op,
-- so graphed and op-by-op steps are the same computation.
-- With an optimizer that does not take the block (a recipe's own) one
-- micro-step's forward and backward is captured and replayed per
-- micro-step, and the norm, clip and optimizer run op by op after it.
--   - Inputs: the batches are copied into fixed device tensors before each
--     replay (the graph reads them); gradients are the parameters' own .grad
--     tensors, made during the warm-up and zeroed in place each step, so the
--     replayed backward accumulates into them as the op-by-op one does.
--   - Memory: what the capture allocates comes from the graph's pool
--     (kernels/runtime.cu, engine/alloc.c) and stays the graph's; the
--     caching allocator's free blocks are handed back before the capture,
--     so the pool does not sit beside the warm-up's cached copy of the same
--     temporaries (twice the activations).
--   - Losses: gl.cross_entropy and the fused head read nothing on the host
--     (the count of targets and the upstream gradient stay on the device),
--     so a run is the same computation whether a step is replayed or
--     launched op by op.
-- cuda_graph = 'auto' (the default) uses a graph where one applies (a CUDA
-- device, one process, no dropout, no profiler; the trainer's batch shapes
-- are fixed) and says once why a capture failed, then runs op by op; true
-- makes either an error; 'off' or false never captures (and the trainer
-- steps as on the CPU: host norm, mul_ clip, host-rate optimizer).  CPU
-- runs are unaffected.  Ranks under ddp, with or without expert
-- parallelism, capture their whole step under cuda_graph = true (not
-- 'auto'): the policy's hooks run in it (the gradients' all-reduces and
-- the ep exchanges waited for on the device; the experts' sum of squares
-- summed over the ep group, policy:block_sumsq), the loss is averaged over
-- the ranks after the step's one host wait.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'
local optim = require 'gptlua.optim'
local step_block = require 'gptlua.step_block'

local M = {}

local WORDS = { auto = 'auto', ['true'] = true, on = true, ['false'] = false, off = false }

-- cfg.cuda_graph as 'auto', true or false ('off'); an error for anything else
function M.mode(cfg)
  local v = cfg.cuda_graph
  if type(v) == 'string' then v = WORDS[v:lower()] == nil and v or WORDS[v:lower()] end
  if v ~= 'auto' and v ~= true and v ~= false then
    error(("config: cuda_graph must be 'off' (false), 'auto' or true, got %s"):format(tostring(cfg.cuda_graph)), 0)
  end
  return v
end

-- why a graph cannot serve this trainer of several ranks, or nil: it
-- serves data-parallel ranks under ddp, with or without expert
-- parallelism (their collectives waited for on the device), capturing the
-- whole step (the optimizer takes the step block)
local function ranks_obstacle(t)
  local cfg, m = t.cfg, t.mesh and t.mesh.size or {}
  local inner = t.policy.ep_layout and t.policy.inner or t.policy
  local ok = cfg.dist == 'ddp' and inner.name == 'ddp' and (m.tp or 1) == 1 and (m.pp or 1) == 1
    and (m.cp or 1) == 1 and (cfg.powersgd_rank or 0) == 0 and optim.takes_block(t.optimizer)
  if ok then return nil end
  return ('the run has %d ranks (graphs serve one process, or ranks under ddp alone or with ep whose optimizer takes '
    .. 'the step block)'):format(t.world)
end

-- why a graph cannot serve this trainer, or nil
local function obstacle(t)
  local cfg = t.cfg
  if cfg.device == 'cpu' then return 'the device is cpu (CUDA graphs need a CUDA device)' end
  if t.world > 1 or t.dist then
    local why = ranks_obstacle(t)
    if why then return why end
    if M.mode(cfg) ~= true then return 'a run of several ranks captures under cuda_graph = true only' end
  end
  if cfg.dropout > 0 then
    return ('dropout %g > 0 draws a fresh mask each step from the host RNG, which a graph would replay'):format(cfg.dropout)
  end
  if cfg.profile ~= '' then return 'the profiler wraps every op, which a replay does not call' end
  return nil
end

local Graph = {}
Graph.__index = Graph

-- the graph mode of trainer t, or nil when off (an error when cuda_graph =
-- true cannot be honoured)
function M.for_trainer(t)
  local mode = M.mode(t.cfg)
  if mode == false then return nil end
  local why = obstacle(t)
  if why then
    if mode == true then error('cuda_graph = true: ' .. why, 0) end
    return nil
  end
  return setmetatable({ t = t, mode = mode, steps = 0, warmup = t.cfg.cuda_graph_warmup,
    whole = optim.takes_block(t.optimizer) }, Graph)
end

-- forward and backward of one micro-step on (x, y); on_loss(loss) sees the
-- loss before the backward frees the graph's tensors
local function forward_backward(model, x, y, accum, on_loss)
  local _, loss = model:forward(x, y)
  on_loss(loss)
  local scaled = loss * (1 / accum)
  scaled:backward(nil, { free_activations = true })
end

-- op by op, as the trainer without a graph; returns the loss
local function eager(model, x, y, accum)
  local v
  gl.scope(function() forward_backward(model, x, y, accum, function(l) v = l:item() end) end)
  return v
end

-- captures the micro-step on the fixed inputs; true, or false and why
function Graph:capture(model, accum)
  local loss
  local ok, err = pcall(cuda.graph, function()
    gl.scope(function()
      forward_backward(model, self.x, self.y, accum, function(l) loss = l:detach():clone():keep() end)
    end)
  end, self.t.cfg.device)
  if not ok then return false, tostring(err) end
  self.g, self.loss = err, loss
  return true
end

-- one micro-step (the trainer's loop body): the batch, forward, backward;
-- returns the loss as a number
function Graph:micro_step(micro, accum)
  return self:micro_step_body(micro, accum)
end

function Graph:micro_step_body(micro, accum)
  local t = self.t
  local x, y = t.data.train:next_batch()
  if self.g then
    self.x:copy_(x)
    self.y:copy_(y)
    self.g:replay()
    return self.loss:item()
  end
  if self.failed or self.steps < self.warmup then return eager(t.model, x, y, accum) end
  self.x, self.y = x:clone():keep(), y:clone():keep()
  cuda.empty_cache(t.cfg.device)  -- the warm-up's cached blocks: the pool replaces them
  local ok, why = self:capture(t.model, accum)
  if not ok then  -- nothing captured ran: this micro-step runs op by op
    self.failed, self.x, self.y = true, nil, nil
    if self.mode == true then error(why, 0) end
    t:print(why .. '; running op by op (cuda_graph = false silences this)')
    return eager(t.model, x, y, accum)
  end
  t:print(('cuda_graph: captured the forward and backward (%d nodes, %s of graph memory)')
    :format(self.g.nodes, require('gptlua.progress').fmt_bytes(self.g.pool_bytes)))
  self.g:replay()
  return self.loss:item()
end

-- ------------------------------------------------------------ the whole step
-- the block: the header, the micro-step losses, the optimizer's slots
function Graph:make_block(accum)
  local b = step_block.new(self.t.cfg.device)
  self.loss_at, self.accum = b:reserve(accum), accum
  self.t.optimizer:reserve_block(b)
  self.block = b:realize()
  return self.block
end

-- the step's device work on batches xs, ys (queued, op by op or captured):
-- nothing here reads the device
local function device_step(self, xs, ys)
  local t, b, accum = self.t, self.block, self.accum
  b:send()
  t.policy:zero_grad()
  for i = 1, accum do
    t.policy:before_micro_step(i, accum)
    gl.scope(function()
      forward_backward(t.model, xs[i], ys[i], accum, function(l) b:slot(self.loss_at + i - 1):copy_(l:reshape({ 1 })) end)
    end)
  end
  t.policy:after_backward()  -- (ddp: the gradients' all-reduces waited for on the device)
  gl.scope(function()
    if t.policy.block_sumsq then t.policy:block_sumsq(b, t.params)  -- (ep: the experts' over the ep group)
    else
      local grads = {}
      for _, p in ipairs(t.params) do if p.grad then grads[#grads + 1] = p.grad end end
      b:sumsq(grads)
    end
    b:finalize(self.loss_at, accum)
    t.optimizer:step_block(b.dev)
  end)
  b:fetch()
end

-- captures device_step on fixed batch tensors; true, or false and why
function Graph:capture_step(xs, ys)
  self.xs, self.ys = {}, {}
  for i = 1, #xs do self.xs[i], self.ys[i] = xs[i]:clone():keep(), ys[i]:clone():keep() end
  cuda.empty_cache(self.t.cfg.device)  -- the warm-up's cached blocks: the pool replaces them
  local ok, g = pcall(cuda.graph, function() device_step(self, self.xs, self.ys) end, self.t.cfg.device)
  if not ok then self.xs, self.ys = nil, nil; return false, tostring(g) end
  self.g = g
  return true
end

-- One optimizer step of accum micro-steps (the trainer's train_step when
-- self.whole): the block's rates written, the step replayed (or run op by
-- op), one host wait; returns the mean loss, the norm, and whether the
-- step was taken (false: the loss or the norm was not finite)
function Graph:train_step(accum)
  local t = self.t
  local b = self.block or self:make_block(accum)
  if accum ~= self.accum then error(('cuda_graph: the step block holds %d micro-step losses, got %d'):format(
    self.accum, accum), 0) end
  b.h[gl.lib.GL_STEP_MAX_NORM] = t.cfg.grad_clip
  t.optimizer:write_block(b.h)
  gl.scope(function()
    local xs, ys = {}, {}
    for i = 1, accum do xs[i], ys[i] = t.data.train:next_batch() end
    if self.g then
      for i = 1, accum do self.xs[i]:copy_(xs[i]); self.ys[i]:copy_(ys[i]) end
      self.g:replay()
    elseif self.failed or self.steps < math.max(self.warmup, 1) then  -- the optimizer's state is made op by op
      device_step(self, xs, ys)
    else
      local ok, why = self:capture_step(xs, ys)
      if ok then
        t:print(('cuda_graph: captured the whole step (%d nodes, %s of graph memory)')
          :format(self.g.nodes, require('gptlua.progress').fmt_bytes(self.g.pool_bytes)))
        for i = 1, accum do self.xs[i]:copy_(xs[i]); self.ys[i]:copy_(ys[i]) end
        self.g:replay()
      else  -- nothing captured ran: this step runs op by op
        self.failed = true
        if self.mode == true then error(why, 0) end
        t:print(why .. '; running op by op (cuda_graph = false silences this)')
        device_step(self, xs, ys)
      end
    end
  end)
  -- the step's one host wait: the block is back, and so are the step's id
  -- checks (a bad one raises here, named by its op, before anything is read)
  cuda.synchronize(t.cfg.device)
  local h = b.h
  local L = gl.lib
  local loss, norm, taken = h[L.GL_STEP_LOSS], h[L.GL_STEP_NORM], h[L.GL_STEP_SKIP] == 0
  if t.world > 1 then loss = t:average_loss(loss) end  -- (the norm is every rank's already)
  if taken then
    t.optimizer:step_taken()
    self:step_done()
  end
  return loss, norm, taken
end

-- an optimizer step ended (the warm-up counts them)
function Graph:step_done() self.steps = self.steps + 1 end

function Graph:free()
  if self.g then self.g:free() end
  self.g = nil
end

return M
