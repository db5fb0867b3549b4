-- What steering and the journal cost a step (issue 18): times N calls of
-- the per-step hooks a run makes with control and journal on — the
-- control socket's poll at the boundary (no command waiting) and the
-- journal's record (hex floats, RNG, data position; a parameter and
-- optimizer hash every journal_hash_interval steps) — on the tiny model of
-- spec/dist/live_recipe.lua and on the default shakespeare model.
--   gptlua recipes/tools/live_overhead.lua [N]
local train = require 'gptlua.train'
local now = require('gptlua.cli').now
local N = tonumber(arg and arg[1]) or 20000

local function bench(recipe, args, label)
  local dir = os.tmpname(); os.remove(dir)
  local t = train.new(recipe, { '--out_dir=' .. dir, '--quiet=true', '--max_iters=1', '--eval_interval=0',
    '--sample_length=0', '--tensorboard=false', unpack(args) })
  t:run()                                   -- one real step: optimizer state exists
  t.run_id = nil
  t:open_run()
  t.control = require('gptlua.control').for_trainer(t)
  t.journal = require('gptlua.journal').start(t, t.step, nil)
  local t0 = now()
  for _ = 1, N do t.control:boundary() end
  local boundary = (now() - t0) / N
  t.journal.every = 0
  t0 = now()
  for s = 1, N do t.journal:step(s, 1.5, 0.25, 1, true) end
  local record = (now() - t0) / N
  t.journal.every = 1
  local M = math.max(1, math.floor(N / 100))
  t0 = now()
  for s = 1, M do t.journal:step(s, 1.5, 0.25, 1, true) end
  local hashed = (now() - t0) / M
  t:end_live()
  print(('%-28s control boundary %6.2f us | journal record %6.2f us | record with hashes %8.1f us (%.2fM params)')
    :format(label, boundary * 1e6, record * 1e6, hashed * 1e6, t.model:num_params() / 1e6))
  os.execute("rm -rf '" .. dir .. "'")
end

local tiny = dofile(GPTLUA.root .. '/spec/dist/live_recipe.lua')
tiny.on_log = nil
bench(tiny, {}, 'tiny (live_recipe)')
bench(dofile(GPTLUA.root .. '/recipes/shakespeare.lua'), { '--device=cpu' }, 'shakespeare (default)')
