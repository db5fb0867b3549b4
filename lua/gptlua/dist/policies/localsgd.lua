-- gptlua.dist.policies.localsgd — local SGD (periodic parameter averaging).
--
-- Every rank steps its own optimizer on its own batches, with its own
-- gradients, clipping and optimizer state (never communicated); every
-- sync_every (H) optimizer steps the ranks average their parameters (fp32
-- masters of bfloat16 weights included: dist.policies.averaging).  With
-- H = 1 and plain SGD this is DDP: the average of the ranks' SGD steps from
-- one point is one SGD step on the averaged gradient.  With AdamW the
-- moments stay local, so it is not.
--
-- Bytes per optimizer step and rank: a ring all-reduce of the P parameter
-- values every H steps, 2(N-1)/N * 4P / H (DDP: 2(N-1)/N * 4P every step).
--
-- Checkpoints: each rank's parameters and optimizer state in its own file,
-- the step within the round in state.averaging (resumes exactly on the same
-- number of ranks, mid-round included; see averaging.lua).
local A = require 'gptlua.dist.policies.averaging'

local LocalSGD = A.local_steps({})
LocalSGD.__index = LocalSGD

function LocalSGD.new(name, o)
  local self = A.init(setmetatable({}, LocalSGD), name, o)
  local cfg = self.cfg
  self.sync_every = A.check_int(cfg, 'sync_every', 1)
  self.steps = 0        -- optimizer steps taken
  self.syncs = 0        -- averagings done
  self.values = A.values(self.params, self.optimizer)
  return self
end

function LocalSGD:step()
  self.optimizer:step()
  self.steps = self.steps + 1
  if self.steps % self.sync_every == 0 then self:synchronize() end
end

-- averages every rank's parameters now
function LocalSGD:synchronize()
  local v = self.values
  v:gather()
  for _, g in ipairs(v.groups) do self.comm:all_reduce(g.flat, 'avg') end
  v:scatter()
  self.syncs = self.syncs + 1
end

-- where the run is: step within the round, averagings so far
function LocalSGD:metrics()
  return { round_step = self.steps % self.sync_every, syncs = self.syncs }
end

function LocalSGD:save_checkpoint(trainer, model_sd, _, state)
  return A.save(self, trainer, model_sd, state, { steps = self.steps, syncs = self.syncs })
end

function LocalSGD:load_checkpoint(_, c, path)
  local avg = A.load(self, c, path)
  self.steps, self.syncs = avg.steps, avg.syncs
end

return LocalSGD
