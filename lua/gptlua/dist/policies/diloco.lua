-- gptlua.dist.policies.diloco — DiLoCo: an inner optimizer on every rank
-- alone for H steps, then one outer step on the averaged change.
--
-- Layout: every rank holds the whole model, its own inner optimizer state
-- (AdamW, or nanochat's Muon + AdamW: whatever the trainer built) and,
-- alike on every rank, the outer state: the start-of-round values theta0
-- (fp32) and the outer momentum m.
--
-- A round of fragment f (H = sync_every inner steps):
--   1. inner steps: optimizer:step() on local gradients (dist.policies.
--      averaging: local clipping, nothing communicated);
--   2. outer gradient: delta = theta0 - theta_local, averaged over ranks
--      (an all-reduce, in bfloat16 when outer_dtype = 'bfloat16': half the
--      bytes, fp32 everywhere else);
--   3. outer Nesterov SGD: m = mu m + delta; theta0 = theta0 - lr (delta + mu m);
--      every rank's parameters (and fp32 masters) become theta0.
-- With H = 1, outer lr 1, momentum 0 and plain SGD inside, this is DDP:
-- theta0 - avg(theta0 - theta_r) = avg(theta_r).
--
-- Streaming (diloco_fragments = F > 1): the parameters, in model order, are
-- cut into F fragments of about equal size (whole tensors: groups of
-- blocks); fragment f synchronises at steps f H/F + k H, so each step
-- moves about 1/F of what a plain round moves at once.  A fragment's
-- all-reduce starts after the inner step that ends its round and is waited
-- for, and its outer step applied, at the next step, just before the inner
-- step: the communication overlaps one forward and backward, and that
-- step's gradient of the fragment, computed on the local values, is applied
-- to the new outer values.
--
-- Bytes per inner step and rank: 2(N-1)/N * b P / H, b = 4 (fp32) or 2
-- (bfloat16); streaming spreads the same total over F steps per round.
--
-- Checkpoints: each rank's parameters and inner optimizer state in its own
-- file; theta0 and m of every fragment in optim.safetensors ("outer.<f>.
-- <dtype@device>.start" / ".momentum"); a fragment whose all-reduce is in
-- flight is completed and its averaged delta saved (".delta",
-- state.averaging.pending), so a resumed run applies it at the same step as
-- an uninterrupted one.
local A = require 'gptlua.dist.policies.averaging'
local B = require 'gptlua.dist.policies.base'

local DiLoCo = A.local_steps({})
DiLoCo.__index = DiLoCo

function DiLoCo.new(name, o)
  local self = A.init(setmetatable({}, DiLoCo), name, o)
  local cfg = self.cfg
  self.H = A.check_int(cfg, 'sync_every', 1)
  self.outer_lr = A.check_real(cfg, 'outer_lr', 0, nil, true)
  self.mu = A.check_real(cfg, 'outer_momentum', 0, 1)
  if self.mu >= 1 then A.fail('outer_momentum expected a number >= 0 and < 1, got ' .. self.mu) end
  if cfg.outer_dtype ~= 'float32' and cfg.outer_dtype ~= 'bfloat16' then
    A.fail(("outer_dtype expected 'float32' or 'bfloat16', got %s"):format(tostring(cfg.outer_dtype)))
  end
  self.outer_dtype = cfg.outer_dtype
  local F = A.check_int(cfg, 'diloco_fragments', 1)
  if F > self.H or F > #self.params then
    A.fail(('diloco_fragments expected at most sync_every (%d) and the number of parameter tensors (%d), got %d')
      :format(self.H, #self.params, F))
  end
  self.steps, self.syncs = 0, 0
  self.frags = {}
  local total = 0
  for _, p in ipairs(self.params) do total = total + p:numel() end
  local list, acc = {}, 0
  for i, p in ipairs(self.params) do
    list[#list + 1] = p
    acc = acc + p:numel()
    local left = #self.params - i
    -- close the fragment at its share of the elements, leaving a tensor for each fragment still to come
    if (acc >= total * (#self.frags + 1) / F and #self.frags < F - 1) or left < F - 1 - #self.frags then
      self.frags[#self.frags + 1] = list
      list = {}
    end
  end
  if #list > 0 then self.frags[#self.frags + 1] = list end
  for f, ps in ipairs(self.frags) do
    local fr = { index = f, offset = math.floor((f - 1) * self.H / F), values = A.values(ps, self.optimizer) }
    fr.values:gather()
    for _, g in ipairs(fr.values.groups) do
      g.start = B.flat(g.n, g.dtype, g.device):copy_(g.flat)
      g.momentum = B.flat(g.n, g.dtype, g.device)
      g.delta = B.flat(g.n, g.dtype, g.device)
      if self.outer_dtype == 'bfloat16' then g.send = B.flat(g.n, 'bfloat16', g.device) end
    end
    self.frags[f] = fr
  end
  self.streaming = #self.frags > 1
  return self
end

-- does fragment fr end a round after inner step s
function DiLoCo:_due(fr, s) return s > fr.offset and (s - fr.offset) % self.H == 0 end

-- starts fragment fr's averaged outer gradient: delta = theta0 - theta_local
function DiLoCo:_launch(fr)
  fr.values:gather()
  fr.works = {}
  for _, g in ipairs(fr.values.groups) do
    g.delta:copy_(g.flat):mul_(-1):add_(g.start)
    if g.send then g.send:copy_(g.delta) end
    fr.works[#fr.works + 1] = self.comm:all_reduce_async(g.send or g.delta, 'avg')
  end
  self.pending = fr
end

-- waits for the averaged delta of the pending fragment (into g.delta)
function DiLoCo:_transfer(fr)
  if not fr.works then return end
  for i, g in ipairs(fr.values.groups) do
    fr.works[i]:wait()
    if g.send then g.delta:copy_(g.send) end
  end
  fr.works = nil
end

-- the outer Nesterov step of fr; every rank's values become theta0
function DiLoCo:_apply(fr)
  self:_transfer(fr)
  for _, g in ipairs(fr.values.groups) do
    g.momentum:mul_(self.mu):add_(g.delta)
    if self.mu > 0 then g.delta:add_(g.momentum, self.mu) end
    g.start:add_(g.delta, -self.outer_lr)
    g.flat:copy_(g.start)
  end
  fr.values:scatter()
  self.pending = nil
  self.syncs = self.syncs + 1
end

function DiLoCo:step()
  if self.pending then self:_apply(self.pending) end   -- streaming: started one step ago
  self.optimizer:step()
  self.steps = self.steps + 1
  for _, fr in ipairs(self.frags) do
    if self:_due(fr, self.steps) then
      self:_launch(fr)
      if not self.streaming then self:_apply(fr) end
    end
  end
end

-- MPI moves a message only inside MPI calls: a fragment in flight gets a
-- push at every micro-step
function DiLoCo:before_micro_step()
  if self.pending then require('gptlua.dist').progress() end
end

function DiLoCo:metrics()
  return { round_step = self.steps % self.H, syncs = self.syncs }
end

-- optim.safetensors: the outer state of every fragment (alike on every rank)
function DiLoCo:each_shared_state(f)
  for _, fr in ipairs(self.frags) do
    for _, g in ipairs(fr.values.groups) do
      local k = ('outer.%d.%s@%s.'):format(fr.index, g.dtype, g.device)
      f(k .. 'start', g.start)
      f(k .. 'momentum', g.momentum)
      if self.pending == fr then f(k .. 'delta', g.delta) end
    end
  end
end

function DiLoCo:save_checkpoint(trainer, model_sd, _, state)
  if self.pending then self:_transfer(self.pending) end
  return A.save(self, trainer, model_sd, state, { steps = self.steps, syncs = self.syncs,
    pending = self.pending and self.pending.index or nil, fragments = #self.frags })
end

function DiLoCo:load_checkpoint(_, c, path)
  local avg = A.load(self, c, path)
  if avg.fragments ~= #self.frags then
    error(('resume: checkpoint %s has %s DiLoCo fragments, this run %d'):format(path, tostring(avg.fragments),
      #self.frags), 0)
  end
  for _, fr in ipairs(self.frags) do
    for _, g in ipairs(fr.values.groups) do
      local k = ('outer.%d.%s@%s.'):format(fr.index, g.dtype, g.device)
      for _, what in ipairs({ 'start', 'momentum', avg.pending == fr.index and 'delta' or nil }) do
        local t = c.optim[k .. what]
        if not t or t:numel() ~= g.n then
          error(('resume: checkpoint %s lacks DiLoCo state %s of %d elements'):format(path, k .. what, g.n), 0)
        end
        g[what]:copy_(t)
      end
    end
  end
  self.steps, self.syncs = avg.steps, avg.syncs
  self.pending = avg.pending and self.frags[avg.pending] or nil
  if self.pending then self.pending.works = nil end
end

return DiLoCo
