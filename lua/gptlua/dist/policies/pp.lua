-- gptlua.dist.policies.pp — the trainer's policy for a pipeline-parallel
-- model (gptlua.dist.pipeline) on a mesh with pp > 1: wraps the
-- data-parallel policy that runs over the mesh's dp group, as the tp
-- policy does.
--
-- Inner policies: ddp, zero1, zero2, fsdp and hsdp, and the tp policy over
-- any of them (pp x tp, pp x dp x tp: the stages of a model cut over tp;
-- the norm weighs replicated gradients by 1/tp as tp's does, checkpoints
-- go through tp's gathering; pp x tp x fsdp, torchtitan's 3-D layout:
-- FSDP shards each stage's tp shards over dp, as below).
-- Context parallelism (Ulysses or ring) and tp's sequence parallelism cut
-- the stage messages too: each carries this rank's (B, T/cp, C) rows, in
-- ring's zig-zag order, or (B, T/tp, C) under sp; the embedding keeps this
-- rank's token rows and the head its targets, as without pp.
-- FSDP: the simplest correct composition.  1F1B interleaves forwards and
-- backwards of different microbatches, and FSDP's own per-call gather,
-- reshard and recompute follow the model's forward (which the pipeline does
-- not call: it runs the stages' pieces), so a stage's units are gathered
-- once before the schedule and kept, their gradients accumulating in whole
-- buffers (FSDP's accumulate = 'unsharded'), until after_backward
-- reduce-scatters them (after the tied embedding's copies were summed)
-- and reshards: during the step a stage holds its whole parameters and
-- gradients, as under DDP; between steps only its shards and their
-- optimizer state.  Evaluation and sampling gather the units for their
-- duration.
--
-- Layout: every rank holds the parameters of its stages only
-- (gptlua.dist.pp_build: the others stay in the model without storage,
-- held_by their pp rank; the initial values are a one-rank build's), and
-- so do its gradients, its optimizer and the inner policy (ddp over the dp
-- ranks of the same stage).  The accumulation steps are the pipeline's
-- microbatches: every rank of a pp group reads the same batches (the data
-- is split over dp only), the first stage uses the inputs, the last the
-- targets.
--
-- Step: the schedule runs forward and backward of all microbatches
-- (micro_steps); the inner policy's reductions wait until the pipeline is
-- done (one all-reduce per step, as DDP's last micro-step; zero2's
-- reduce-scatter too, after the tied copies are summed: during the
-- schedule a stage holds its whole gradients, as zero1 does, and between
-- steps its shard only);
-- the gradient norm is the whole model's: each stage's sum of squares (the
-- tied embedding and nanochat's per-layer lambdas, held by several stages,
-- counted once, on the first stage) summed over the world
-- (counted on dp rank 0), so every rank clips by the same factor and agrees
-- on skipping a non-finite step (the loss, from the last stage, is the
-- same on every pp rank too).
--
-- Evaluation runs each batch forward through the stages (Pipeline:eval_loss:
-- no parameter leaves its stage).  Sampling needs the whole model on every
-- rank for its duration: before_sample gives the other stages' parameters
-- storage and broadcasts them from their owners over pp, after_sample
-- releases them (a sample's peak holds the whole model's parameters, not
-- its gradients or optimizer state).  Checkpoints: every stage writes its
-- own parameters and optimizer state (gptlua.dist.pp_checkpoint); they
-- read as an unsharded run's, so they load into any pp size, pp = 1
-- included; loading keeps this rank's part.
local B = require 'gptlua.dist.policies.base'
local gl = require 'gptlua'

local P = {}
P.__index = P

local function fail(msg) error('pipeline parallel: ' .. msg, 0) end

-- The trainer's schedule: a recipe's pp_schedule(p, m, v) hook returns one
-- of its own (an edited one, say), else cfg.pp_schedule's; made once
function P.schedule(trainer)
  if trainer.pp_schedule then return trainer.pp_schedule end
  local cfg, mesh = trainer.cfg, trainer.mesh
  local hook = trainer.hooks.pp_schedule
  local s = hook and hook(mesh.size.pp, cfg.gradient_accumulation_steps, cfg.pp_virtual) or cfg.pp_schedule
  local schedules = require 'gptlua.dist.schedules'
  if type(s) == 'string' then s = schedules.make(s, mesh.size.pp, cfg.gradient_accumulation_steps, cfg.pp_virtual or 1) end
  trainer.pp_schedule = schedules.check(s)
  return s
end

-- The trainer's model cut into its pipeline (trainer.pipeline); returns
-- what this rank trains, a stand-in for the model that the optimizer and
-- the policies take (named_parameters, parameters, config).
function P.stages(trainer, model)
  local cfg, mesh = trainer.cfg, trainer.mesh
  local pipeline = require 'gptlua.dist.pipeline'
  -- the stage messages carry this rank's rows: T/cp (cp's order), T/tp more under sp
  local tp_layout, cp_layout = model.tp_layout, model.cp_layout
  local sp = tp_layout and tp_layout.sequence_parallel and tp_layout.size or 1
  local function seq_mode(T)  -- (as the embedding decides: cp's cut, then tp's of what is left)
    if cp_layout then require('gptlua.dist.context_parallel').seq_mode(cp_layout, T); T = T / cp_layout.size end
    if tp_layout then require('gptlua.dist.tensor_parallel').seq_mode(tp_layout, T) end
  end
  trainer.pipeline = pipeline.new(model, mesh.pp, { schedule = P.schedule(trainer), virtual = cfg.pp_virtual,
    microbatches = cfg.gradient_accumulation_steps, batch = { cfg.batch_size, cfg.block_size },
    rows = cfg.block_size / mesh.size.cp / sp, seq_mode = (cp_layout or sp > 1) and seq_mode or nil,
    partition = trainer.hooks.pp_partition or cfg.pp_partition })
  local named = trainer.pipeline.named
  return {
    config = model.config, ties_head_to_embedding = model.ties_head_to_embedding,
    named_parameters = function() return named end,
    parameters = function() return trainer.pipeline.params end,
  }
end

-- inner: the data-parallel policy over mesh.dp of this rank's stage params
function P.new(inner, pipe, mesh, dist_name)
  local ok = { ddp = true, zero1 = true, zero2 = true, fsdp = true, hsdp = true }
  if not ok[dist_name] then
    fail(("dist '%s' with pp > 1 is not composed yet (expected 'ddp', 'zero1', 'zero2', 'fsdp' or 'hsdp' over the dp "
      .. 'dimension)'):format(tostring(dist_name)))
  end
  local self = setmetatable({ inner = inner, pipe = pipe, mesh = mesh, optimizer = inner.optimizer,
    params = pipe.params, collective_forward = true }, P)
  -- FSDP (alone or under tp's policy): a stage's units stay gathered, with
  -- their whole gradients, through the pipeline step (see the header)
  local fsdp = self:_fsdp()
  if fsdp then fsdp.accumulate = 'unsharded' end
  -- the whole model's parameters by name, and which pp rank trains each
  self.owner = {}
  for _, np in ipairs(pipe.model:named_parameters()) do
    local r = pipe:owner_of(np[1])
    if not r then fail(('parameter %s belongs to no stage'):format(np[1])) end
    self.owner[#self.owner + 1] = { np[1], np[2], r }
  end
  return self
end

function P:zero_grad() return self.inner:zero_grad() end

-- the data-parallel policy (the inner one, or the one tp's or ep's policy wraps)
function P:_dp()
  local p = self.inner
  while p.inner do p = p.inner end
  return p
end
-- that policy when it is FSDP/HSDP (its units), else nil
function P:_fsdp() local dp = self:_dp(); return dp.units and dp or nil end

-- the pipeline runs every micro-step; returns the sum of their losses
function P:micro_steps(trainer, accum)
  local xs, ys = {}, {}
  for i = 1, accum do xs[i], ys[i] = trainer.data.train:next_batch() end
  local dp = self:_dp()
  dp:before_micro_step(1, accum + 1)   -- no reduction during the schedule's backwards
  dp.sync = false                      -- (not zero2's per micro-step either: see the header)
  if dp.units then  -- FSDP: gathered for the step, gradients in whole buffers; after_backward reduces and reshards
    for _, u in ipairs(dp.units) do dp:_acquire(u); dp:_expect_hooks(u) end
    dp.phase = 'pipeline'  -- (not 'forward': a block neither recomputes nor reshards)
  end
  local loss = self.pipe:step(xs, ys)
  return loss * accum
end

function P:after_backward() return self.inner:after_backward() end
B.delegate_to_inner(P)

-- the whole model's gradient norm (see the header)
function P:grad_norm()
  local s = 0
  local skip = self.pipe.tied_param and self.mesh.coord.pp ~= 0 and self.pipe.tied_param or nil
  -- under tp (the inner tp policy's layout) a replicated gradient is on every tp rank: each adds 1/tp
  local layout = self.inner.layout
  -- (the tied copy weighs 0: a non-finite value in it still makes the norm so, and every rank skip)
  local function add(p, g, counted)
    if counted and g then
      -- (parameters every stage holds, nanochat's lambdas, counted on the first stage only)
      local elsewhere = p == skip or (self.mesh.coord.pp ~= 0 and self.pipe.shared_set and self.pipe.shared_set[p])
      s = s + B.sumsq(g) * (elsewhere and 0 or (layout and not layout.sharded[p]) and 1 / layout.size or 1)
    end
  end
  local each = self.inner.each_grad or self.inner._each_grad
  if each then each(self.inner, add)  -- ZeRO: its pieces, replicated ones counted once
  else
    local counted = self.mesh.coord.dp == 0 and self.mesh.coord.cp == 0  -- (cp ranks hold the same average)
    for _, p in ipairs(self.params) do add(p, p.grad, counted) end
  end
  return math.sqrt(self.mesh.world:all_reduce_number(s, 'sum'))
end

-- FSDP: every unit of this stage gathered (fn's blocks release theirs
-- after use), the rest released after fn
function P:_gathered(fn, ...)
  local fsdp = self:_fsdp()
  if fsdp then for _, u in ipairs(fsdp.units) do fsdp:_acquire(u) end end
  local r = { pcall(fn, ...) }
  if fsdp then for _, u in ipairs(fsdp.units) do fsdp:_release(u) end end
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, table.maxn(r))
end

-- one evaluation batch's loss, forward through the stages (collective over pp)
function P:eval_loss(x, y) return self:_gathered(self.pipe.eval_loss, self.pipe, x, y) end

-- Sampling: every parameter this rank does not hold gets storage and its
-- owner's values (a broadcast over pp per parameter), until after_sample
-- releases them again.
function P:before_sample()
  local Tensor = gl.Tensor
  self.lent = {}
  self:_gathered(gl.no_grad, function()
    for _, o in ipairs(self.owner) do
      local p = o[2]
      local by = rawget(p, 'held_by')
      if by then
        Tensor.rebind(p, gl.empty(p.shape, { dtype = p.dtype, device = p.device }):keep().c)
        self.lent[#self.lent + 1] = p
      end
      self.mesh.pp:broadcast(p, o[3])
    end
  end)
end
function P:after_sample()
  for _, p in ipairs(self.lent or {}) do gl.Tensor.release(p) end
  self.lent = nil
  local fsdp = self:_fsdp()
  if fsdp then for _, u in ipairs(fsdp.units) do fsdp:_release(u) end end
end

function P:save_checkpoint(trainer, model_sd, opt_sd, state)
  state.mesh = { pp = self.mesh.size.pp, dp = self.mesh.size.dp, tp = self.mesh.size.tp }
  return require('gptlua.dist.pp_checkpoint').save(self, trainer, opt_sd, state)
end

-- the checkpoint's whole model goes in whole (every rank builds it; tp cuts
-- its part); the optimizer takes its parameters' state
function P:load_model(sd)
  if self.inner.load_model then return self.inner:load_model(sd) end
  self.pipe.model:load_state_dict(sd)
end

function P:load_checkpoint(trainer, c, path)
  if self.inner.load_checkpoint then return self.inner:load_checkpoint(trainer, c, path) end  -- ZeRO: its pieces
  local st = c.state
  local tensors = st.shards and require('gptlua.dist.policies.shards').full_tensors(path, c) or c.optim
  self.optimizer:load_state_dict({ step = st.opt_step, steps = st.opt_steps, tensors = tensors })  -- (it reads its parameters' keys)
end

return P
