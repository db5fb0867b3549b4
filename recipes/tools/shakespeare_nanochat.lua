-- The default recipe (recipes/shakespeare.lua) with nanochat's current
-- block and optimizer (issue 19's comparison): nanochat.version = 'v2',
-- its optimizer (muon_variant 'current') and base_train.py's schedules, as
-- recipes/speedrun.lua has them; everything else (data, sizes, batch,
-- steps, evals, seed) the default recipe's.
--   gptlua recipes/tools/shakespeare_nanochat.lua      (against: gptlua recipes/shakespeare.lua)
local root = require('gptlua').root
local speedrun = dofile(root .. '/recipes/speedrun.lua')
local r = dofile(root .. '/recipes/shakespeare.lua')
r.name = 'shakespeare_nanochat'
r.nanochat = { version = 'v2' }
r.max_iters, r.lr_decay_iters = 2000, 2000  -- the comparison's length (the default now runs 1175)
for _, k in ipairs({ 'optimizer', 'muon_variant', 'matrix_lr', 'embedding_lr', 'unembedding_lr', 'muon_weight_decay',
                    'grad_clip', 'lr_schedule', 'momentum_schedule' }) do
  r[k] = speedrun[k]
end
return r
