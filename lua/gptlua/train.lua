-- gptlua.train — the training loop every recipe runs.
--
-- One step: for each micro-step fetch a batch, forward, backward (loss
-- divided by the accumulation count); then check for NaN/Inf, clip by the
-- global norm, set the scheduled learning rate, optimizer step.  Every step
-- runs inside a tensor scope that releases the step's temporaries when it
-- ends, so memory is freed deterministically, not when the Lua GC decides.
-- Around it: eval (nanoGPT's line "step N: train loss X, val loss Y"),
-- samples, checkpoints (atomic, verified, keep_last; one at every eval by
-- default, as nanoGPT), the run's directory (gptlua.runs), what the run
-- prints and writes to metrics.jsonl (gptlua.train_report), what a resume
-- compares and keeps (gptlua.train_resume), and stopping: SIGINT or SIGUSR1
-- (what `gptlua -n N` sends every rank for its Ctrl-C) to any rank stops
-- every rank at the same step boundary, which saves one checkpoint and
-- returns normally (exit status 0).
local gl = require 'gptlua'
local config = require 'gptlua.config'
local check = require 'gptlua.check'
local optim = require 'gptlua.optim'
local ckpt = require 'gptlua.checkpoint'
local runs = require 'gptlua.runs'
local progress = require 'gptlua.progress'
local cuda = require 'gptlua.cuda'
local evals = require 'gptlua.eval'
local report = require 'gptlua.train_report'
local ffi = require 'ffi'

local M = {}

-- the clock of the progress numbers (monotonic seconds; specs replace it)
M.clock = require('gptlua.cli').now

-- Keys, hooks, config resolution and the default builders: gptlua.train_config.
for name, v in pairs(require 'gptlua.train_config') do M[name] = v end

local function fail(msg) error('config: ' .. msg, 0) end

-- --------------------------------------------------------------- MFU, memory
-- (gptlua.progress; these names stay for recipes/tools/bench.lua)
M.measure_cpu_flops, M.fmt_bytes = progress.measure_cpu_flops, progress.fmt_bytes

-- ------------------------------------------------------------ local policy
-- The interface every data-parallel policy implements (gptlua.dist.policy
-- returns the distributed ones); this is the single-process one.
local Local = {}
Local.__index = Local
M.LocalPolicy = Local
function Local.new(o) return setmetatable({ params = o.params, optimizer = o.optimizer }, Local) end
function Local:zero_grad() for _, p in ipairs(self.params) do if p.grad then p.grad:zero_() end end end
function Local:before_micro_step(micro, accum) end        -- DDP: skip communication before the last
function Local:after_backward() end                        -- DDP/ZeRO: finish gradient reductions
function Local:average_number(x) return x end              -- mean of a number over ranks
function Local:grad_norm() return optim.clip_grad_norm(self.params, 0) end  -- global L2 norm (over shards)
function Local:scale_grads(s) for _, p in ipairs(self.params) do if p.grad then p.grad:mul_(s) end end end
function Local:step() self.optimizer:step() end            -- ZeRO: update own shard, all-gather

-- --------------------------------------------------------------- trainer
local Trainer = {}
Trainer.__index = Trainer
M.Trainer = Trainer

-- fn(...) for a check every rank of a job makes alike, at the same point
-- and outside any collective: a user's error from it is a refusal, printed
-- once, every rank exiting cleanly (gptlua.dist.compose.exit_refused); alone, or
-- for a bug (an error with a position), an error as any other
local function agreed(fn, ...)
  local cli = require 'gptlua.cli'
  local found = require('gptlua.dist.discover').discover()
  if not (found and found.size > 1) or cli.verbose then return fn(...) end  -- (-v: the error's own traceback)
  local r = { pcall(fn, ...) }
  if r[1] then return unpack(r, 2, table.maxn(r)) end
  if cli.is_user_error(r[2]) then require('gptlua.dist.compose').exit_refused(r[2]) end
  error(r[2], 0)
end

-- the layout refusal of a recipe and its overrides on `world` ranks (one
-- line, as a job prints it), or nil when the layout composes; runs nothing
-- (spec/composition_spec.lua asks it of every cell)
function M.refusal(recipe, args, world)
  local ok, err = pcall(function()
    local cfg, hooks = M.resolve_config(recipe, args)
    if cfg.vocab_size == 0 then error('config: refusal needs the recipe to set vocab_size', 0) end
    require('gptlua.dist.compose').check(cfg, world, M.model_config(cfg, hooks), hooks)
  end)
  return not ok and tostring(err) or nil
end

function M.new(recipe, args)
  local cfg, hooks, launch = agreed(M.resolve_config, recipe, args)
  local self = setmetatable({ cfg = cfg, hooks = hooks, step = 0, bad_steps = 0, history = {}, launch = launch,
    best_val_loss = math.huge, args = args }, Trainer)
  self.rank, self.world = 0, 1
  if cfg.dist ~= 'none' then
    self.dist = require('gptlua.dist')
    self.comm = self.dist.init({ timeout = cfg.dist_timeout })
    self.rank, self.world = self.comm.rank, self.comm.size
  end
  -- a mesh (--dp, --tp): the data is split over its dp ranks only (the tp
  -- ranks of a group read the same batch)
  self.dp_rank, self.dp_size = self.rank, self.world
  -- the layout: the mesh's sizes and the policy now, the model's sizes once the data gave the vocabulary
  if self.comm then agreed(require('gptlua.dist.compose').check, cfg, self.world) end
  if cfg.tp > 1 or cfg.dp > 0 or cfg.cp > 1 or cfg.pp > 1 or cfg.ep > 1 then
    if not self.comm and cfg.pp > 1 then fail(("pp %d needs a distributed run (dist = 'ddp')"):format(cfg.pp)) end
    if not self.comm then
      fail(("tp %d, cp %d and dp %d need a distributed run (dist = 'ddp')"):format(cfg.tp, cfg.cp, cfg.dp))
    end
    self.mesh = self.dist.mesh({ dp = cfg.dp, tp = cfg.tp, cp = cfg.cp, pp = cfg.pp, ep = cfg.ep, world = self.comm })
    self.dp_rank, self.dp_size = self.mesh.coord.dp, self.mesh.size.dp
  end
  -- each rank of a distributed GPU run trains on the GPU it is bound to
  if self.dist and (cfg.device == 'cuda' or cfg.device == 'cuda:0') and self.dist.device() ~= 'cpu' then
    cfg.device = self.dist.device()
  end
  if cfg.threads > 0 then
    -- more threads than cores only slows a run down (and a huge number
    -- would have OpenMP start that many): capped, with a line saying so
    local cores = gl.num_cores()
    if cfg.threads > cores then
      self:print(('config: threads %d is more than the %d cores of this machine: using %d'):format(cfg.threads,
        cores, cores))
      cfg.threads = cores
    end
    gl.set_num_threads(cfg.threads)
  end
  gl.manual_seed(cfg.seed)
  local d = (hooks.build_data or M.build_data)(cfg, self.dp_rank, self.dp_size)
  self.data = d
  if cfg.vocab_size == 0 then
    cfg.vocab_size = d.vocab_size
    if d.vocab_note then self:print(d.vocab_note) end
  end
  if self.comm then agreed(require('gptlua.dist.compose').check, cfg, self.world, M.model_config(cfg, hooks), hooks) end
  if cfg.total_batch_size > 0 then
    local per = cfg.batch_size * cfg.block_size * self.dp_size
    if cfg.total_batch_size % per ~= 0 then
      fail(('total_batch_size %d is not a multiple of batch_size*block_size*world (%d)'):format(cfg.total_batch_size, per))
    end
    cfg.gradient_accumulation_steps = cfg.total_batch_size / per
  end
  gl.manual_seed(cfg.seed)
  local build = hooks.build_model or M.build_model
  -- pipeline stages (--pp) and experts (--ep): only this rank's parameters are materialised (gptlua.dist.pp_build)
  local partial = self.mesh and (self.mesh.size.pp > 1 or self.mesh.size.ep > 1)
  local model = partial and require('gptlua.dist.pp_build').build(self, build) or build(cfg)
  if cfg.dtype ~= 'float32' then model:to(cfg.dtype) end
  if cfg.device ~= 'cpu' then model:to(cfg.device) end
  self.fp8_line = require('gptlua.fp8').apply(model, cfg.fp8)  -- after the dtype: the banner names it
  if self.mesh and self.mesh.size.tp > 1 then  -- cut the whole model over the tp group
    self.flops_per_token = model:flops_per_token(cfg.block_size)  -- the whole model's
    self.whole_num_params = model:num_params()
    self.tp_layout = require('gptlua.dist.tensor_parallel').parallelize(model, self.mesh.tp,
      { sequence_parallel = cfg.sp })
  elseif cfg.sp then
    fail('sp (sequence parallel) needs tp > 1, got tp ' .. cfg.tp)
  end
  if self.mesh and self.mesh.size.cp > 1 then  -- split the sequence over the cp group (after tp's cut)
    local m, group = self.mesh, nil
    if cfg.sp and #require('gptlua.moe').layers(model) > 0 then  -- MoE layers: the cp x tp ranks sharing a sequence
      group = m.world:split(m.coord.pp * m.size.dp + m.coord.dp, m.coord.cp * m.size.tp + m.coord.tp,
        { size = m.size.cp * m.size.tp, rank = m.coord.cp * m.size.tp + m.coord.tp })
    end
    require('gptlua.dist.context_parallel').parallelize(model, m.cp, { mode = cfg.cp_mode, sequence_group = group })
  end
  if self.mesh and self.mesh.size.ep > 1 then  -- this rank's experts of every MoE layer (gptlua.dist.expert_parallel)
    self.flops_per_token = self.flops_per_token or model:flops_per_token(cfg.block_size)  -- the whole model's
    self.whole_num_params = self.whole_num_params or model:num_params()
    self.ep_layout = require('gptlua.dist.expert_parallel').parallelize(model, self.mesh.ep, self.mesh.ep_replica,
      self.mesh.size.dp, self.mesh.size.cp > 1 and self.mesh.cp or nil)
  end
  self.model = model
  -- mixture of experts (gptlua.moe): its layers, with the recipe's router when it has a moe_router hook
  self.moe_layers = require('gptlua.moe').layers(model)
  if hooks.moe_router and #self.moe_layers > 0 then
    require('gptlua.moe').install_router(self.moe_layers, hooks.moe_router(cfg))
  end
  -- pipeline stages (--pp): this rank trains its stages' parameters (gptlua.dist.policies.pp)
  local trained = self.mesh and self.mesh.size.pp > 1 and require('gptlua.dist.policies.pp').stages(self, model)
    or model
  local groups = hooks.param_groups and hooks.param_groups(cfg, trained) or nil
  self.optimizer = (hooks.build_optimizer or M.build_optimizer)(cfg, trained, groups)
  self.schedule = (hooks.lr_schedule or M.lr_schedule)(cfg)
  self.momentum_schedule = hooks.momentum_schedule and hooks.momentum_schedule(cfg) or optim.schedules.muon_momentum()
  self.params = trained:parameters()
  local popts = { comm = self.comm, model = model, optimizer = self.optimizer, params = self.params,
                  bucket_mb = cfg.bucket_mb, shard_size = cfg.shard_size, cfg = cfg, units = hooks.fsdp_units }
  if self.mesh then popts.comm = self.mesh.dp_cp end  -- gradients average over dp (x cp)
  if self.ep_layout then  -- the experts' gradients are reduced over their replicas only (the ep policy)
    local rest = {}
    for _, p in ipairs(self.params) do if not self.ep_layout.is_expert[p] then rest[#rest + 1] = p end end
    popts.params = rest
  end
  self.policy = self.dist and self.dist.policy(cfg.dist, popts) or Local.new(popts)
  if self.ep_layout then self.policy = require('gptlua.dist.expert_parallel').policy(self.policy, self.ep_layout) end
  if self.mesh and self.mesh.size.cp > 1 then self.policy.collective_forward = true end
  if self.tp_layout then
    self.policy = require('gptlua.dist.policies.tp').new(self.policy, self.tp_layout, self.mesh, cfg.dist)
  end
  if self.pipeline then
    self.policy = require('gptlua.dist.policies.pp').new(self.policy, self.pipeline, self.mesh, cfg.dist)
  end
  self.run_dir = cfg.out_dir .. '/' .. cfg.name
  self.ckpt_dir = self.run_dir .. '/checkpoints'
  self.tokens_per_step = cfg.batch_size * cfg.block_size * cfg.gradient_accumulation_steps * self.dp_size
  self.flops_per_token = self.flops_per_token or model:flops_per_token(cfg.block_size)
  self.tensorboard = require('gptlua.observe.tensorboard').for_trainer(self)  -- nil when off
  self.profiler = require('gptlua.observe.profiler').for_trainer(self)        -- wraps train_step; nil when off
  self.graph = require('gptlua.train_graph').for_trainer(self)                -- nil when off
  self:given(); self:followed()   -- what the command line gave, before anything changes cfg
  return self
end

function Trainer:print(...)
  if self.rank == 0 and not self.cfg.quiet then io.write(...); io.write('\n'); io.stdout:flush() end
end

-- the positions of the loaders evaluate() reads (a recipe's build_data may lack them)
function Trainer:eval_data_state()
  local out = {}
  for _, split in ipairs({ 'val', 'eval_train' }) do
    local loader = self.data[split]
    if type(loader) == 'table' and loader.state and loader ~= self.data.train then out[split] = loader:state() end
  end
  return next(out) and out or nil
end

-- mean loss over eval_iters batches of each split
function Trainer:evaluate()
  local cfg, model = self.cfg, self.model
  local out = {}
  if self.policy.before_eval then self.policy:before_eval() end
  model:eval()
  for _, split in ipairs({ 'train', 'val' }) do
    local loader = split == 'train' and (self.data.eval_train or self.data.train) or self.data.val
    local total = 0
    -- val: also the nats and the bytes their targets decode to, for bits per byte (gptlua.eval)
    local bytes_of, nats, bytes = split == 'val' and evals.bytes_counter(self), 0, 0
    for _ = 1, cfg.eval_iters do
      gl.scope(function()
        local x, y = loader:next_batch()
        local loss = self:eval_loss(x, y)
        total = total + loss
        if bytes_of then  -- (the loss is the mean over the targets kept)
          local b, n = bytes_of(y)
          nats, bytes = nats + loss * n, bytes + b
        end
      end)
    end
    local mean = total / cfg.eval_iters
    mean = self.policy:average_number(mean)
    out[split] = mean
    if bytes_of then out.val_bpb = evals.bpb(self.policy:average_number(nats), self.policy:average_number(bytes)) end
  end
  evals.extend(self, out)  -- the multiple-choice tasks (eval_tasks)
  model:train()
  return out
end

-- one batch's loss without recording (pp: forward through the stages)
function Trainer:eval_loss(x, y)
  if self.policy.eval_loss then return self.policy:eval_loss(x, y) end
  local _, loss = gl.no_grad(self.model.forward, self.model, x, y)
  return loss:item()
end

-- rank 0 samples; under a policy whose forward is collective (FSDP gathers
-- parameters across ranks) every rank must run it, and rank 0 prints
function Trainer:samples_here()
  return self.rank == 0 or (self.policy and self.policy.collective_forward) or false
end

-- mean loss over every non-overlapping window of the validation tokens
-- (exact, unlike the sampled estimate of evaluate); char data only
function Trainer:evaluate_full()
  local cfg, tokens = self.cfg, self.data.val_tokens
  if not tokens then return nil end
  local L = require('gptlua.data').loader({ tokens = tokens, batch_size = cfg.batch_size, block_size = cfg.block_size,
    sampling = 'sequential', seed = cfg.seed, device = cfg.device })
  local batches = math.floor(math.floor((tokens:numel() - 1) / cfg.block_size) / cfg.batch_size)
  local total = 0
  if self.policy.before_eval then self.policy:before_eval() end
  self.model:eval()
  for _ = 1, batches do
    gl.scope(function()
      local x, y = L:next_batch()
      total = total + self:eval_loss(x, y)
    end)
  end
  self.model:train()
  L:close()
  return total / math.max(batches, 1), batches * cfg.batch_size * cfg.block_size
end

function Trainer:sample(n)
  local tok = self.data.tokenizer
  if not tok then return nil end
  local policy = self.policy
  if policy.before_sample then policy:before_sample()  -- pp: every stage's parameters to every rank, for the sample
  elseif policy.before_eval then policy:before_eval() end
  local cfg = self.cfg
  local prompt = tok:encode(cfg.sample_prompt)
  if #prompt == 0 then prompt = { 0 } end
  local idx = gl.tensor({ prompt }, { dtype = 'int64', device = cfg.device })
  local out = self.model:generate(idx, n or cfg.sample_length, { temperature = cfg.temperature,
    top_k = cfg.top_k > 0 and cfg.top_k or nil, seed = cfg.seed })
  if policy.after_sample then policy:after_sample() end
  local ids = out:select(1, 1):tolist()
  return tok:decode(ids)
end

-- background (the periodic saves of run()): with checkpoint_async the
-- files are written by the checkpoint writer while training goes on
-- (gptlua.checkpoint's writer); any other save, and the next background
-- one, first waits for the one in flight.  Not under a policy whose ranks
-- serve each other between steps (ps's asynchronous servers): waiting for
-- a collective save's ranks would block a rank another one waits on.
function Trainer:save_checkpoint(background)
  local cfg = self.cfg
  if self.ckpt_writer then self.ckpt_writer:finish() end
  background = background and cfg.checkpoint_async and not self.policy.asynchronous
  if background and not self.ckpt_writer then
    local writer = ckpt.writer(function(path) self:print(('saved checkpoint %s'):format(path)) end)
    self.ckpt_writer = writer
    -- a rank that fails still publishes a save its writer finished (gptlua.dist's abort)
    if self.dist then self.dist.before_abort = function() writer:salvage() end end
  end
  self.save_writer = background and self.ckpt_writer or nil  -- read by the policies' saves
  local model_sd = self.model:state_dict()
  local opt_sd = self.optimizer:state_dict()
  local state = { rng = gl.get_rng_state(), opt_step = opt_sd.step, opt_steps = opt_sd.steps,
                  data = self.data.train:state(), config = cfg, history = self.history,
                  bad_steps = self.bad_steps, run_id = self.run_id, saved_at = runs.time(),
                  best_val_loss = self.best_val_loss < math.huge and self.best_val_loss or nil,
                  live = self.live_changes,  -- changes made through gptlua attach, re-applied on resume
                  -- where the evals' batches are, before this step's eval (a resume evaluates this step again)
                  eval_data = self.eval_data_before and self.eval_data_before.step == self.step
                    and self.eval_data_before.state or self:eval_data_state(),
                  ranks = self.dp_size, tokens_per_step = self.tokens_per_step,  -- compared on resume
                  given = self:given(), followed = self:followed() }
  self.saved_step = self.step
  if self.policy.save_checkpoint then  -- sharded state: the policy writes its shards
    return self.policy:save_checkpoint(self, model_sd, opt_sd, state)
  end
  if self.rank ~= 0 then return end
  local path, pending = ckpt.save(self.ckpt_dir, self.step, { model = model_sd, optim = opt_sd.tensors, state = state },
    cfg.keep_last, self.save_writer)
  if not pending then self:print(('saved checkpoint %s'):format(path)) end
  return path
end

-- waits for the checkpoint in flight, publishes it, frees the writer's staging
function Trainer:close_checkpoint_writer()
  if self.ckpt_writer then
    if self.dist then self.dist.before_abort = nil end
    self.ckpt_writer:close()
    self.ckpt_writer = nil
  end
end

-- loads a checkpoint into this trainer; returns its state table
function Trainer:load_checkpoint(path)
  local c = ckpt.load(path)
  local st = c.state
  local cfg = self.cfg
  local k, theirs, ours = self:mismatch(st.config)
  if k then
    error(('resume: checkpoint %s has %s = %s, this run has %s; not loaded'):format(path, k,
      tostring(theirs), tostring(ours)), 0)
  end
  if self.policy.load_model then self.policy:load_model(c.model)  -- a cut model takes its part
  else self.model:load_state_dict(c.model) end
  if self.policy.load_checkpoint then  -- sharded state: the policy takes its part
    self.policy:load_checkpoint(self, c, path)
  else  -- a sharded checkpoint (st.shards) is assembled whole
    local tensors = st.shards and require('gptlua.dist.policies.shards').full_tensors(path, c) or c.optim
    self.optimizer:load_state_dict({ step = st.opt_step, steps = st.opt_steps, tensors = tensors })
  end
  gl.set_rng_state(st.rng)
  self.data.train:set_state(st.data)
  for split, loader_state in pairs(st.eval_data or {}) do
    local loader = self.data[split]
    if type(loader) == 'table' and loader.set_state then loader:set_state(loader_state) end
  end
  self.step = st.step
  self.history = st.history or {}
  self.bad_steps = st.bad_steps or 0
  self.best_val_loss = st.best_val_loss or math.huge
  self.saved_step = st.step
  if st.live then require('gptlua.control').reapply(self, st.live) end
  self:print(('resumed from %s at step %d'):format(path, self.step))
  self:resume_settings(st)
  return st
end

-- What a resume compares and keeps (mismatch, given, followed,
-- resume_settings): gptlua.train_resume.
for name, f in pairs(require 'gptlua.train_resume') do Trainer[name] = f end

-- after a taken step: the routers' bias update from the step's load over
-- the data-parallel ranks (MoE layers only; op by op, also after a replay)
function Trainer:moe_after_step()   -- the routers' bias update from the step's load over the data-parallel ranks
  if #self.moe_layers == 0 then return end
  -- (pp: this stage's dp group; the cp ranks hold their micro-batches' whole load already: gptlua.moe)
  local dp = self.mesh and self.mesh.dp or self.policy.comm or self.comm
  gl.scope(function() require('gptlua.moe').after_step(self.moe_layers, dp) end)
end

-- one optimizer step; returns the mean loss, the gradient norm, the lr
-- multiplier, and whether the step was taken (false: non-finite, skipped)
function Trainer:train_step()
  local cfg, model, policy = self.cfg, self.model, self.policy
  local accum = cfg.gradient_accumulation_steps
  local lr_mult = self.schedule(self.step)
  self.optimizer:set_lr_mult(lr_mult)
  if self.optimizer.set_momentum then self.optimizer:set_momentum(self.momentum_schedule(self.step)) end
  if cfg.muon_weight_decay_schedule == 'cosine' and self.optimizer.set_muon_weight_decay_mult then  -- nanochat's
    self.muon_wd_schedule = self.muon_wd_schedule or optim.schedules.cosine_to_zero(cfg.max_iters)
    self.optimizer:set_muon_weight_decay_mult(self.muon_wd_schedule(self.step))
  end
  if #self.moe_layers > 0 then require('gptlua.moe').begin_step(self.moe_layers, 1 / accum) end
  if self.graph and self.graph.whole then  -- the whole step as one CUDA graph (gptlua.train_graph)
    local loss, norm, taken = self.graph:train_step(accum)
    if taken then self:moe_after_step() end
    return loss, norm, lr_mult, taken
  end
  policy:zero_grad()
  local loss_sum = 0
  if policy.micro_steps then loss_sum = policy:micro_steps(self, accum) end  -- a pipeline runs its schedule
  for micro = 1, policy.micro_steps and 0 or accum do
    if self.graph then  -- replayed as one CUDA graph after its warm-up (gptlua.train_graph)
      loss_sum = loss_sum + self.graph:micro_step(micro, accum)
    else
      gl.scope(function()
        local x, y = self.data.train:next_batch()
        policy:before_micro_step(micro, accum)
        local _, loss = model:forward(x, y)
        loss_sum = loss_sum + loss:item()
        local scaled = loss * (1 / accum)
        scaled:backward(nil, { free_activations = true })
      end)
    end
  end
  policy:after_backward()
  local loss = self:average_loss(loss_sum / accum)
  local norm = policy:grad_norm()
  cuda.check_flags()  -- the backward's id checks; grad_norm has waited for the device
  if loss ~= loss or loss == math.huge or norm ~= norm or norm == math.huge then
    return loss, norm, lr_mult, false
  end
  if cfg.grad_clip > 0 and norm > cfg.grad_clip then policy:scale_grads(cfg.grad_clip / (norm + 1e-6)) end
  gl.scope(function() policy:step() end)
  self:moe_after_step()
  if self.graph then self.graph:step_done() end
  return loss, norm, lr_mult, true
end

-- The one writer of metrics.jsonl: gptlua.train_report.
Trainer.write_metrics = report.write_metrics

-- Picks the run's directory (gptlua.runs: every rank the same one), removes
-- temporaries a killed save left there, and loads the checkpoint a resume
-- names.  Returns the path of the checkpoint loaded, or nil.  A trainer
-- that has run before (run() again in the REPL, max_iters raised) goes on
-- in its own directory from where it is.
function Trainer:open_run()
  local cfg = self.cfg
  if self.run_id then return nil end
  local plan = runs.plan(cfg, function(st) return self:mismatch(st.config) == nil end)
  local k, note = 1, nil
  if self.rank == 0 then k, note = runs.open(cfg, plan) end
  if self.comm and self.world > 1 then k = self.comm:all_reduce_number(k, 'max') end
  self.run_dir = runs.path(cfg.out_dir, cfg.name, k)
  self.ckpt_dir = self.run_dir .. '/checkpoints'
  if note then self:print(note) end
  if self.rank == 0 then
    for _, name in ipairs(ckpt.clean_temporaries(self.ckpt_dir)) do
      self:print(('removed %s/%s, left by a checkpoint save that did not finish'):format(self.ckpt_dir, name))
    end
  end
  local st
  if plan.checkpoint then st = self:load_checkpoint(plan.checkpoint)
  elseif plan.spec then
    self:print(('resume: no checkpoint of a run named %s under %s, starting a new run'):format(cfg.name, cfg.out_dir))
  end
  self.run_id = (plan.k and st.run_id) or runs.new_id(cfg.name)
  if not plan.k then self.saved_step = nil end  -- a new directory holds no checkpoint yet
  return plan.checkpoint
end

-- SIGINT (Ctrl-C) and SIGUSR1 (what `gptlua -n N` makes mpirun send every
-- rank for its Ctrl-C, see gptlua.dist.launch) stop a run: counted while
-- it lasts, acted on at the next step boundary.
local STOP_SIGNALS = { 2, require('gptlua.dist.launch').STOP_SIGNAL }

local function take_stop_signals(self)
  for _, sig in ipairs(STOP_SIGNALS) do
    if gl.lib.gl_signal_take(sig) > 0 then self.stop_signal = true end
  end
end
Trainer.take_stop_signals = take_stop_signals  -- gptlua.control: a paused job still stops

-- true when any rank has received a stop signal; every rank asks at every
-- step boundary.  On several ranks the answer is the one this step's loss
-- all-reduce carried (average_loss), so all ranks stop after the same step
-- and save one consistent checkpoint, for no collective of its own.
function Trainer:stop_requested()
  if self.comm and self.world > 1 then return self.stop_agreed == true end
  take_stop_signals(self)
  return self.stop_signal == true
end

-- The step's loss averaged over the ranks (policy:average_number), and on
-- several ranks also whether any rank has received a stop signal and
-- whether rank 0 holds a control command (gptlua.control), and the
-- digest of every rank's last step's collectives (gptlua.journal): one
-- float64 all-reduce (sum) of {loss, stop, command pending, h, h^2}.
function Trainer:average_loss(loss)
  if not (self.comm and self.world > 1) then return self.policy:average_number(loss) end
  if self.policy.asynchronous then take_stop_signals(self); return loss end  -- ranks do not meet every step
  take_stop_signals(self)
  local buf = self.step_numbers
  if not buf then
    buf = gl.empty({ 5 }, { dtype = 'float64' }):keep()
    self.step_numbers = buf
  end
  local d = ffi.cast('double *', buf:data_ptr())
  d[0], d[1], d[2] = loss, self.stop_signal and 1 or 0, self.control and self.control:pending() or 0
  local h = self.journal and self.journal:collective_digest() or 0   -- the last step's collectives (gptlua.journal)
  d[3], d[4] = h, h * h
  self.comm:all_reduce(buf, 'sum')
  self.stop_agreed, self.control_agreed = d[1] > 0, d[2] > 0
  if self.journal then self.journal:check_collectives(d[3], d[4], self.world) end
  return d[0] / self.world
end

local function signals(f) for _, sig in ipairs(STOP_SIGNALS) do f(sig) end end

function Trainer:run()
  local cfg = self.cfg
  -- without a policy every rank would train alone, print, and write the same run directory
  if cfg.dist == 'none' and self.launch.ranks > 1 then
    fail(("dist 'none' cannot run on %d ranks: each would train alone and write %s "
      .. '(use --dist=ddp, zero1, zero2, fsdp or hsdp)'):format(self.launch.ranks, self.run_dir))
  end
  local now = M.clock
  local resumed_from = self:open_run()
  local first_step = self.step
  if first_step >= cfg.max_iters and not cfg.eval_only then
    self:print(('run %s is already at step %d of max_iters %d: nothing to train (raise --max_iters to go on)')
      :format(self.run_dir, first_step, cfg.max_iters))
    return { losses = {}, checkpoint = resumed_from, finished = true, run_dir = self.run_dir }
  end
  if resumed_from then self:write_metrics({ step = first_step, resumed = true, from = resumed_from }) end
  local peak = report.opening(self)
  self.control = require('gptlua.control').for_trainer(self)  -- nil when cfg.control is off
  self.journal = require('gptlua.journal').start(self, first_step, resumed_from)
  self.stragglers = require('gptlua.observe.stragglers').for_trainer(self)   -- nil on one rank or when off
  require('gptlua.dist.elastic').on_start(self, resumed_from, first_step)     -- a restarted job's record
  signals(gl.lib.gl_signal_catch)
  -- time: the training steps apart from evals, samples and checkpoints
  -- ("pauses"), so ms/step, tok/s and MFU count steps only and the ETA adds
  -- the evals still to come at the last eval's cost
  local t_start = now()
  local t_last, tokens_since, steps_since, paused = t_start, 0, 0, 0
  local paused_total, eval_cost = 0, 0
  local last_eval
  local interrupted = false
  local losses = {}
  local function evals_left(step)  -- evals from step on (the final one included)
    if cfg.eval_interval <= 0 then return 0 end
    return math.floor((cfg.max_iters - 1) / cfg.eval_interval) - math.floor((step - 1) / cfg.eval_interval) + 1
  end
  while self.step < cfg.max_iters do
    local step = self.step
    if cfg.eval_interval > 0 and step % cfg.eval_interval == 0 then
      local t_eval = now()
      self.eval_data_before = { step = step, state = self:eval_data_state() }
      local ev = self:evaluate()
      last_eval = ev
      report.eval(self, step, ev)
      if self.hooks.on_eval then self.hooks.on_eval(self, ev) end
      if cfg.eval_only then break end
      -- nanoGPT: a checkpoint at every eval (always_save_checkpoint), or when val improves
      local improved = ev.val < self.best_val_loss
      if improved then self.best_val_loss = ev.val end
      if step > 0 and self.saved_step ~= step and (cfg.always_save_checkpoint or improved) then
        self:save_checkpoint(true)
      end
      eval_cost = now() - t_eval
      paused = paused + eval_cost
    end
    local t0 = now()
    local loss, norm, lr_mult, ok = self:train_step()
    local dt = now() - t0
    if self.stragglers then self.stragglers:step(dt) end
    if not ok then
      self.bad_steps = self.bad_steps + 1
      self:print(('step %d: loss %s, grad norm %s is not finite; step skipped (%d in a row)'):format(step,
        tostring(loss), tostring(norm), self.bad_steps))
      self:write_metrics({ step = step, skipped = true, loss = tostring(loss) })
      if self.bad_steps >= cfg.max_bad_steps then
        error(('training stopped: %d steps in a row with a non-finite loss or gradient (last loss %s at step %d)'):format(
          self.bad_steps, tostring(loss), step), 0)
      end
    else
      self.bad_steps = 0
    end
    losses[#losses + 1] = loss
    self.history[#self.history + 1] = loss
    self.step = step + 1
    local replayed = self.journal and self.journal:step(step, loss, norm, lr_mult, ok)
    tokens_since, steps_since = tokens_since + self.tokens_per_step, steps_since + 1
    if cfg.log_interval > 0 and (self.step % cfg.log_interval == 0 or self.step == cfg.max_iters) then
      local elapsed = math.max(now() - t_last - paused, 1e-9)
      report.log(self, { loss = loss, norm = norm, lr_mult = lr_mult, step_s = dt, elapsed = elapsed, peak = peak,
        steps = steps_since, tokens = tokens_since,
        eta = (cfg.max_iters - self.step) * elapsed / steps_since + evals_left(self.step) * eval_cost })
      paused_total = paused_total + paused
      t_last, tokens_since, steps_since, paused = now(), 0, 0, 0
    end
    local t_other = now()
    if cfg.sample_interval > 0 and self.step % cfg.sample_interval == 0 and self:samples_here() then
      local text = self:sample(200)
      self:print('--- sample ---\n' .. (text or '') .. '\n---')
    end
    if self.ckpt_writer then self.ckpt_writer:poll() end  -- publishes a background save once written
    if cfg.checkpoint_interval > 0 and self.step % cfg.checkpoint_interval == 0 and self.step < cfg.max_iters then
      self:save_checkpoint(true)
    end
    paused = paused + (now() - t_other)
    if self:stop_requested() then interrupted = true; break end
    if (self.control and self.control:boundary()) or replayed then interrupted = true; break end
  end
  signals(gl.lib.gl_signal_restore)
  self:end_live()
  local final = { run_dir = self.run_dir }
  if interrupted then
    self:print(('%s at step %d: saving a checkpoint'):format(
      self.stop_reason == 'profile' and 'stopped after the profile' or 'interrupted', self.step))
    if self.saved_step ~= self.step then final.checkpoint = self:save_checkpoint()
    else final.checkpoint = ('%s/step_%07d'):format(self.ckpt_dir, self.step) end
    self:close_checkpoint_writer()
    final.interrupted, final.losses = true, losses
    if self.metrics_file then self.metrics_file:close(); self.metrics_file = nil end
    return final
  end
  local t_final = now()
  if not cfg.eval_only and cfg.eval_interval > 0 then
    last_eval = self:evaluate()
    report.eval(self, self.step, last_eval)
  end
  if not cfg.eval_only then final.checkpoint = self:save_checkpoint() end
  self:close_checkpoint_writer()
  local total = now() - t_start
  paused_total = paused_total + paused + (now() - t_final)
  report.done(self, self.step - first_step, total, paused_total, last_eval)
  if cfg.sample_length > 0 and self:samples_here() and self.data.tokenizer then
    local text = self:sample()
    self:print('--- sample ---\n' .. text .. '\n---')
  end
  final.eval, final.losses = last_eval, losses
  final.seconds = { steps = total - paused_total, other = paused_total }
  if self.metrics_file then self.metrics_file:close(); self.metrics_file = nil end
  return final
end

-- closes the control socket (removing it) and the journal
function Trainer:end_live()
  if self.control then self.control:close(); self.control = nil end
  if self.journal then self.journal:close(); self.journal = nil end
end

-- entry point for a recipe table and command-line args
function M.main(recipe, args)
  local t = M.new(recipe, args)
  return t:run(), t
end

return M
