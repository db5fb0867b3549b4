-- The default recipe (recipes/shakespeare.lua) with nanochat's current
-- block and optimizer (issue 19's comparison): nanochat.version = 'v2',
-- nanochat's AdamW groups + Muon and base_train.py's schedules, as
-- recipes/speedrun.lua has them; everything else (data, sizes, batch,
-- steps, evals, seed) the default recipe's.
--   gptlua recipes/tools/shakespeare_nanochat.lua      (against: gptlua recipes/shakespeare.lua)
local root = require('gptlua').root
local speedrun = dofile(root .. '/recipes/speedrun.lua')
local r = dofile(root .. '/recipes/shakespeare.lua')
r.name = 'shakespeare_nanochat'
r.nanochat = { version = 'v2' }
r.optimizer, r.grad_clip = 'nanochat', 0
r.build_optimizer, r.lr_schedule, r.momentum_schedule = speedrun.build_optimizer, speedrun.lr_schedule,
  speedrun.momentum_schedule
return r
