-- gptlua.dist.policies.pp — the trainer's policy for a pipeline-parallel
-- model (gptlua.dist.pipeline) on a mesh with pp > 1: wraps the
-- data-parallel policy that runs over the mesh's dp group, as the tp
-- policy does.
--
-- Inner policies: ddp, zero1 and zero2 (FSDP gathers and reduces during
-- backward, before the tied embedding's copies are summed: not composed
-- yet), and
-- the tp policy over ddp (pp x tp, pp x dp x tp: the stages of a model cut
-- over tp; the norm weighs replicated gradients by 1/tp as tp's does,
-- checkpoints go through tp's gathering once the stages are broadcast).
--
-- Layout: every rank builds the whole model (same seed: the same initial
-- values everywhere) and trains the parameters of its stages only; its
-- optimizer and the inner policy (ddp over the dp ranks of the same stage)
-- hold those alone.  The accumulation steps are the pipeline's
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
-- Evaluation, sampling and checkpoints use the whole model: sync_model
-- broadcasts every parameter from the stage that trains it over pp (one
-- model's worth per evaluation: rare, not per step).  Checkpoints are then
-- an unsharded run's (the optimizer state gathered the same way), so they
-- load into any pp size, pp = 1 included; loading keeps this rank's part.
local B = require 'gptlua.dist.policies.base'
local ckpt = require 'gptlua.checkpoint'
local gl = require 'gptlua'

local P = {}
P.__index = P

local function fail(msg) error('pipeline parallel: ' .. msg, 0) end

-- The trainer's model cut into its pipeline (trainer.pipeline); returns
-- what this rank trains, a stand-in for the model that the optimizer and
-- the policies take (named_parameters, parameters, config).
function P.stages(trainer, model)
  local cfg, mesh = trainer.cfg, trainer.mesh
  if mesh.size.cp > 1 or cfg.sp then
    fail(('pp %d with cp %d%s: pipeline with context or sequence parallelism is not composed yet'):format(
      mesh.size.pp, mesh.size.cp, cfg.sp and ' and sp' or ''))
  end
  local pipeline = require 'gptlua.dist.pipeline'
  -- a recipe's pp_schedule(p, m, v) hook returns a schedule of its own (an edited one, say)
  local hook = trainer.hooks.pp_schedule
  local schedule = hook and hook(mesh.size.pp, cfg.gradient_accumulation_steps, cfg.pp_virtual) or cfg.pp_schedule
  trainer.pipeline = pipeline.new(model, mesh.pp, { schedule = schedule, virtual = cfg.pp_virtual,
    microbatches = cfg.gradient_accumulation_steps, batch = { cfg.batch_size, cfg.block_size },
    partition = trainer.hooks.pp_partition or cfg.pp_partition })
  local named = trainer.pipeline.named
  return {
    config = model.config,
    named_parameters = function() return named end,
    parameters = function() return trainer.pipeline.params end,
  }
end

-- inner: the data-parallel policy over mesh.dp of this rank's stage params
function P.new(inner, pipe, mesh, dist_name)
  if dist_name ~= 'ddp' and dist_name ~= 'zero1' and dist_name ~= 'zero2' then
    fail(("dist '%s' with pp > 1 is not composed yet (expected 'ddp', 'zero1' or 'zero2' over the dp dimension)"):format(
      tostring(dist_name)))
  end
  if inner.layout and dist_name ~= 'ddp' then
    fail(("dist '%s' with pp and tp > 1 is not composed yet (expected 'ddp')"):format(tostring(dist_name)))
  end
  local self = setmetatable({ inner = inner, pipe = pipe, mesh = mesh, optimizer = inner.optimizer,
    params = pipe.params, collective_forward = true }, P)
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

-- the pipeline runs every micro-step; returns the sum of their losses
function P:micro_steps(trainer, accum)
  local xs, ys = {}, {}
  for i = 1, accum do xs[i], ys[i] = trainer.data.train:next_batch() end
  self.inner:before_micro_step(1, accum + 1)   -- no reduction during the schedule's backwards
  self.inner.sync = false                      -- (not zero2's per micro-step either: see the header)
  local loss = self.pipe:step(xs, ys)
  return loss * accum
end

function P:after_backward() return self.inner:after_backward() end
function P:average_number(x) return self.inner:average_number(x) end
function P:scale_grads(s) return self.inner:scale_grads(s) end
function P:step() return self.inner:step() end
function P:detach() if self.inner.detach then self.inner:detach() end end
function P:optimizer_state_bytes()
  return self.inner.optimizer_state_bytes and self.inner:optimizer_state_bytes() or 0
end

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
    local counted = self.mesh.coord.dp == 0
    for _, p in ipairs(self.params) do add(p, p.grad, counted) end
  end
  return math.sqrt(self.mesh.world:all_reduce_number(s, 'sum'))
end

-- every parameter from its owner to all pp ranks (collective over pp)
function P:sync_model()
  gl.no_grad(function()
    for _, o in ipairs(self.owner) do self.mesh.pp:broadcast(o[2], o[3]) end
  end)
end
P.before_eval = P.sync_model

-- {key, shape, dtype} of each optimizer state tensor of every parameter by
-- name, whichever rank trains it, as the trainer's optimizer names them (a
-- Combined one's too: nanochat's AdamW + Muon): a twin optimizer over the
-- whole model lists them (optimizers make their state lazily: the twin
-- holds none)
local function state_entries(self, trainer)
  if self.entries then return self.entries end
  local optim = require 'gptlua.optim'
  local build = trainer.hooks.build_optimizer or require('gptlua.train_config').build_optimizer
  local twin = build(trainer.cfg, self.pipe.model)
  local out = {}
  for _, o in ipairs(twin.optimizers or { twin }) do
    for _, g in ipairs(o.groups) do
      for i, p in ipairs(g.params) do
        local list = {}
        for _, e in ipairs(o:param_state(p, g)) do
          list[#list + 1] = { o.prefix .. g.names[i] .. '.' .. e[1], e[2], o.state_dtype or 'float32' }
        end
        if optim.needs_master(p) then list[#list + 1] = { o.prefix .. g.names[i] .. '.master', p.shape, 'float32' } end
        out[g.names[i]] = list
      end
    end
  end
  self.entries = out
  return out
end

function P:save_checkpoint(trainer, model_sd, opt_sd, state)
  self:sync_model()
  -- the optimizer's state of every parameter, from its owner
  -- this stage's whole state (ZeRO's pieces assembled over dp, as the tp policy does)
  local mine = require('gptlua.dist.policies.tp')._local_optimizer_state(self, opt_sd)
  local full = {}
  if next(mine) ~= nil then  -- (before the first step there is no state)
    local entries = state_entries(self, trainer)
    for _, o in ipairs(self.owner) do
      for _, e in ipairs(entries[o[1]] or {}) do
        local t = mine[e[1]]
        if self.mesh.coord.pp ~= o[3] then t = gl.zeros(e[2], { dtype = e[3], device = o[2].device }) end
        self.mesh.pp:broadcast(t, o[3])
        full[e[1]] = t
      end
    end
  end
  state.mesh = { pp = self.mesh.size.pp, dp = self.mesh.size.dp }
  local model_sd = self.pipe.model:state_dict()
  if self.inner.layout then  -- tp: the shards gathered whole over tp, written by rank 0
    return self.inner:save_checkpoint(trainer, model_sd, { tensors = full, step = opt_sd.step, steps = opt_sd.steps },
      state)
  end
  if trainer.rank ~= 0 then return nil end
  local path = ckpt.save(trainer.ckpt_dir, trainer.step, { model = model_sd, optim = full,
    state = state }, trainer.cfg.keep_last)
  trainer:print(('saved checkpoint %s'):format(path))
  return path
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
