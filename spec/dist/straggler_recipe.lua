-- Run by spec/stragglers_spec.lua under `gptlua -n 3` with
-- GPTLUA_TEST_SLOW_RANK=R:MS: a tiny ddp run that logs every 2 steps.
local r = dofile('spec/dist/elastic_recipe.lua')
r.name, r.checkpoint_interval, r.log_interval, r.max_iters, r.dist = 'straggler', 0, 2, 6, 'ddp'
return r
