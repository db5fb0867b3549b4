-- recipes/tools/slow_links.lua — the slow-link policies on the default
-- recipe: validation loss after a fixed token budget and the bytes each
-- rank sent (gptlua.dist's Comm.sent_bytes: the textbook algorithms' wire
-- bytes), one line per run.  Run on every rank:
--
--   gptlua -n N recipes/tools/slow_links.lua --tokens=786432 [--dist=diloco --sync_every=32 ...]
--
-- --tokens: the global token budget; max_iters = tokens / (N * batch_size *
-- block_size), the schedule (warmup 10% of it, cosine to min_lr at the end)
-- scaled to it; one eval after the last step (eval_iters 50, the mean of
-- the ranks' losses).  Every other argument
-- is a trainer override.  Rank 0 prints
--   RESULT {"ranks":N,"args":"...","val_loss":...,"bytes_rank0":...,"bytes_mean":...,"bytes_max":...,"seconds":...,
--           "step_seconds":...}
-- seconds: the whole train.main (building, the steps, the final checkpoint);
-- step_seconds: the steps' share of it (the trainer's own account).
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'
local now = require('gptlua.cli').now

local tokens, over = 786432, {}
for _, a in ipairs(arg or {}) do
  local t = a:match('^%-%-tokens=(%d+)$')
  if t then tokens = tonumber(t) else over[#over + 1] = a end
end
local world = dist.init { timeout = 1200 }
local recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
recipe.optimizer, recipe.nanochat = 'adamw', { version = 'v1' }  -- the v1 block with AdamW: the configuration SLOW_LINKS.md's figures were measured with
local per_step = world.size * recipe.batch_size * recipe.block_size
local iters = math.floor(tokens / per_step)
local args = { '--max_iters=' .. iters, '--lr_decay_iters=' .. iters, '--warmup_iters=' .. math.floor(iters / 10),
  '--eval_interval=0', '--log_interval=' .. iters, '--sample_length=0', '--quiet=true', '--checkpoint_interval=0',
  -- one directory every rank names alike (a checkpoint is written by all ranks)
  '--out_dir=' .. (os.getenv('TMPDIR') or '/tmp') .. '/gptlua_slow_links', '--name=n' .. world.size,
  '--overwrite=true' }
for _, a in ipairs(over) do args[#args + 1] = a end
local t0 = now()
local final, t = train.main(recipe, args)
local seconds = now() - t0
t.cfg.eval_iters = 50
local ev = t:evaluate()   -- the one eval, after the budget (every policy ends its rounds there: H divides the steps)
local sent = t.comm.sent_bytes or 0
local sum, max = world:all_reduce_number(sent, 'sum'), world:all_reduce_number(sent, 'max')
if world.rank == 0 then
  print('RESULT ' .. cjson.encode({ ranks = world.size, args = table.concat(over, ' '), tokens = iters * per_step,
    steps = iters, val_loss = ev.val, bytes_rank0 = sent, bytes_mean = sum / world.size,
    bytes_max = max, seconds = seconds, step_seconds = final.seconds.steps }))
  os.execute('rm -rf ' .. t.run_dir)
end
