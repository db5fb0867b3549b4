-- Acceptance check of the default recipe (not part of CI, ~5 minutes on 2
-- cores): trains recipes/shakespeare.lua for its full run (1175 iterations) and
-- checks nanoGPT's figure for that configuration, val loss <= 1.88.
--   gptlua recipes/tools/acceptance.lua [--key=value overrides]
local train = require 'gptlua.train'
local target = 1.88
local args = { '--name=acceptance' }
for _, a in ipairs(arg) do args[#args + 1] = a end
local res, trainer = train.main(dofile((GPTLUA and GPTLUA.root or '.') .. '/recipes/shakespeare.lua'), args)
local val = res.eval and res.eval.val
-- the estimate above averages eval_iters random batches (about +-0.015);
-- the whole validation split gives the exact figure
local full, ntok = trainer:evaluate_full()
if full then print(('acceptance: val loss over the whole validation split (%d tokens) %.4f'):format(ntok, full)) end
print(('acceptance: final val loss %.4f, target <= %.2f: %s'):format(val or 0 / 0, target,
  val and val <= target and 'PASS' or 'FAIL'))
os.exit(val and val <= target and 0 or 1)
