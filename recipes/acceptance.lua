-- Acceptance check of the default recipe (not part of CI, ~5 minutes on 2
-- cores): trains recipes/shakespeare.lua for its full 2000 iterations and
-- checks nanoGPT's figure for that configuration, val loss <= 1.88.
--   gptlua recipes/acceptance.lua [--key=value overrides]
local train = require 'gptlua.train'
local target = 1.88
local args = { '--name=acceptance' }
for _, a in ipairs(arg) do args[#args + 1] = a end
local res = train.main(dofile((GPTLUA and GPTLUA.root or '.') .. '/recipes/shakespeare.lua'), args)
local val = res.eval and res.eval.val
print(('acceptance: final val loss %.4f, target <= %.2f: %s'):format(val or 0 / 0, target,
  val and val <= target and 'PASS' or 'FAIL'))
os.exit(val and val <= target and 0 or 1)
