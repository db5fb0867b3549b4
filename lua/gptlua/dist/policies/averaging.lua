-- gptlua.dist.policies.averaging — what the parameter-averaging policies
-- (localsgd, diloco) share: every rank keeps its own gradients, optimizer
-- state and, between synchronisations, its own parameters.
--
-- Local steps.  Gradients are plain per-parameter .grad tensors that never
-- leave the rank: zero_grad, before_micro_step and after_backward are
-- local, the norm that clipping uses is this rank's own (clipping is a
-- per-replica decision, as every rank's optimizer is), and step() runs the
-- wrapped optimizer and then asks the policy whether to synchronise.
--
-- The values that are averaged.  A parameter's value is its fp32 master in
-- the optimizer state when it has one (bfloat16 weights, optim.needs_master)
-- and the parameter itself otherwise; Values packs them into one flat
-- buffer per (dtype, device) so a synchronisation is one collective per
-- buffer, and writes the result back into the masters and then (rounded)
-- into the parameters, so the inner optimizer continues from the averaged
-- values and not from its stale masters.
--
-- Checkpoints (through dist.policies.shards): each rank writes its own
-- file optim.rankNNNNN.safetensors holding its parameters ("param:<name>")
-- and its optimizer state; rank 0's optimizer keys are plain (so a run
-- without a policy can resume from rank 0's replica: state.shards.layout
-- lists them), rank r > 0 prefixes them "rank<r>:".  State every rank holds
-- alike (DiLoCo's outer state) goes to optim.safetensors.  The round
-- position and the policy's own counters are state.averaging.  A checkpoint
-- holds the local state of its N ranks: it resumes on N ranks only, exactly,
-- mid-round included.
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local B = require 'gptlua.dist.policies.base'
local ckpt = require 'gptlua.checkpoint'
local shards = require 'gptlua.dist.policies.shards'
local optim = require 'gptlua.optim'

local A = {}

-- config: a one-line error naming the key and what it expects
function A.fail(msg) error('config: ' .. msg, 0) end

function A.check_int(cfg, key, lo, hi)
  local v = cfg[key]
  if type(v) ~= 'number' or v ~= math.floor(v) or v < lo or (hi and v > hi) then
    A.fail(('%s expected an integer %s, got %s'):format(key,
      hi and ('in %d..%d'):format(lo, hi) or ('>= %d'):format(lo), tostring(v)))
  end
  return v
end

function A.check_real(cfg, key, lo, hi, lo_open)
  local v = cfg[key]
  if type(v) ~= 'number' or v ~= v or (lo_open and v <= lo or v < lo) or (hi and v > hi) then
    A.fail(('%s expected a number %s%s%s, got %s'):format(key, lo_open and '> ' or '>= ', lo,
      hi and (' and <= ' .. hi) or '', tostring(v)))
  end
  return v
end

-- ----------------------------------------------------------------- Values --
-- The fp32 master of p in the optimizer's state, or nil.
local function master_of(optimizer, p)
  for _, o in ipairs(optimizer.optimizers or { optimizer }) do
    local st = o.state and o.state[p]
    if st and st.master then return st.master end
  end
  return nil
end

local Values = {}
Values.__index = Values
A.Values = Values

-- Values over a list of parameters: flat buffers, one per (value dtype,
-- device): float64 parameters stay float64, everything else is fp32.
function A.values(params, optimizer)
  local self = setmetatable({ params = params, optimizer = optimizer, groups = {} }, Values)
  local by = {}
  for _, p in ipairs(params) do
    local dtype = p.dtype == 'float64' and 'float64' or 'float32'
    local k = dtype .. '@' .. p.device
    if not by[k] then
      by[k] = { dtype = dtype, device = p.device, params = {}, offs = {}, n = 0 }
      self.groups[#self.groups + 1] = by[k]
    end
    local g = by[k]
    g.params[#g.params + 1] = p
    g.offs[#g.offs + 1] = g.n
    g.n = g.n + p:numel()
  end
  for _, g in ipairs(self.groups) do g.flat = B.flat(g.n, g.dtype, g.device) end
  return self
end

-- the value tensor of p: its master, or p itself
function Values:value(p) return master_of(self.optimizer, p) or p end

-- copies every parameter's value into the group buffers
function Values:gather()
  for _, g in ipairs(self.groups) do
    for i, p in ipairs(g.params) do
      G.check(G.lib.gl_copy(B.view(g.flat, g.offs[i], p.shape, false).c, self:value(p).c))
    end
  end
end

-- copies the group buffers into every value (master and parameter)
function Values:scatter()
  for _, g in ipairs(self.groups) do
    for i, p in ipairs(g.params) do
      local src = B.view(g.flat, g.offs[i], p.shape, false)
      local m = master_of(self.optimizer, p)
      if m then G.check(G.lib.gl_copy(m.c, src.c)) end
      G.check(G.lib.gl_copy(p.c, src.c))
    end
  end
end

-- ------------------------------------------------------------ Local steps --
-- Methods of a policy whose gradients stay on its rank; mixed into the
-- policy table by A.local_steps(P).
local L = {}
function L:zero_grad() for _, p in ipairs(self.params) do if p.grad then p.grad:zero_() end end end
function L:before_micro_step() end
function L:after_backward() end
function L:average_number(x) return self.comm:all_reduce_number(x, 'avg') end
function L:grad_norm() return optim.clip_grad_norm(self.params, 0) end
function L:scale_grads(s) for _, p in ipairs(self.params) do if p.grad then p.grad:mul_(s) end end end
function L:detach() end
function L:optimizer_state_bytes() return B.optimizer_state_bytes(self.optimizer) end

function A.local_steps(P)
  for k, f in pairs(L) do if P[k] == nil then P[k] = f end end
  return P
end

-- Common construction: comm, params (trainable, in model order), their
-- names, the optimizer, every rank starting from rank 0's weights.
function A.init(self, name, o)
  if type(o) ~= 'table' or type(o.params) ~= 'table' or #o.params == 0 then
    error(('dist.policy: %s expected opts.params, a non-empty list of parameters'):format(name), 4)
  end
  if type(o.optimizer) ~= 'table' or type(o.optimizer.step) ~= 'function' then
    error(('dist.policy: %s expected opts.optimizer, an optimizer with step()'):format(name), 4)
  end
  self.name = name
  self.comm = o.comm or require('gptlua.dist').init()
  self.params = B.trainable(o.params)
  self.optimizer = o.optimizer
  self.cfg = o.cfg or require('gptlua.train').defaults
  self.names = {}
  if o.model then
    for _, np in ipairs(o.model:named_parameters()) do self.names[np[2]] = np[1] end
  end
  for i, p in ipairs(self.params) do self.names[p] = self.names[p] or ('p' .. i) end
  B.broadcast_params(self.comm, self.params)
  return self
end

-- --------------------------------------------------------------- checkpoints
-- policy:each_state(f) for dist.policies.shards: this rank's parameters and
-- optimizer state (own file), then policy:each_shared_state(f), if any
-- (replicated: optim.safetensors).
local function each_state(self, f)
  local prefix = self.comm.rank == 0 and '' or ('rank%d:'):format(self.comm.rank)
  for _, p in ipairs(self.params) do f(prefix .. 'param:' .. self.names[p], p, 0, false) end
  for k, t in pairs(self.optimizer:state_dict().tensors) do f(prefix .. k, t, 0, false) end
  if self.each_shared_state then self:each_shared_state(function(k, t) f(k, t, 0, true) end) end
end

-- the full shapes of rank 0's optimizer keys (what a plain run loads)
local function state_layout(self)
  local out = {}
  for k, t in pairs(self.optimizer:state_dict().tensors) do out[k] = t.shape end
  return out
end

function A.save(self, trainer, model_sd, state, extra)
  state.averaging = extra
  self.each_state, self.state_layout = self.each_state or each_state, self.state_layout or state_layout
  return shards.save(trainer, self, model_sd, state)
end

-- Loads this rank's parameters and optimizer state, and calls
-- load_shared(tensors) with optim.safetensors' tensors; returns
-- state.averaging.  The checkpoint must come from this policy on as many
-- ranks.
function A.load(self, c, path)
  local st = c.state
  local sh, avg = st.shards, st.averaging
  if not (sh and avg and sh.policy == self.name) then
    error(('resume: checkpoint %s was not written by dist = %s (it holds no %s state); not loaded'):format(
      path, self.name, self.name), 0)
  end
  if sh.world ~= self.comm.size then
    error(('resume: checkpoint %s holds the local state of %d %s ranks; resume it on %d ranks, not %d'):format(
      path, sh.world, self.name, sh.world, self.comm.size), 0)
  end
  local r = self.comm.rank
  local prefix = r == 0 and '' or ('rank%d:'):format(r)
  local mine = ckpt.load_safetensors(path .. '/' .. shards.rank_file(r))
  local function piece(k)
    local t = mine[prefix .. k .. '@0']
    if not t then error(('resume: checkpoint %s lacks %s of rank %d'):format(path, k, r), 0) end
    return t
  end
  for _, p in ipairs(self.params) do
    local t = piece('param:' .. self.names[p])
    if t:numel() ~= p:numel() then
      error(('resume: checkpoint %s has %d elements for %s, the model %d'):format(path, t:numel(),
        self.names[p], p:numel()), 0)
    end
    gl.no_grad(function() p:copy_(t:view(p.shape)) end)
  end
  -- the optimizer's keys are the file's other pieces (a fresh optimizer
  -- has no state yet to name them; load_state_dict checks they are all there)
  local tensors = {}
  for name, t in pairs(mine) do
    local key = name:sub(1, #prefix) == prefix and name:sub(#prefix + 1):match('^(.*)@0$')
    if key and not key:match('^param:') then tensors[key] = t end
  end
  if next(tensors) ~= nil then
    self.optimizer:load_state_dict({ step = st.opt_step, steps = st.opt_steps, tensors = tensors })
  end
  shards.set_steps(self.optimizer, st)
  return avg
end

return A
