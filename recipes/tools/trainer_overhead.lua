-- The trainer's overhead over its bare step (issue 15): the default
-- recipe's loop (Trainer:run, real data) against `make bench`'s step
-- (Trainer:train_step on one fixed batch), and the two halves between them
-- (the loop on the fixed batch; bare steps on real data), timed in turns in
-- one process so that a busy machine slows every variant alike.
--   gptlua recipes/tools/trainer_overhead.lua [--steps=50] [--rounds=5] [--threads=N]
-- It also prints the bench step's median against its mean and the cost of
-- one eval.  What it found (2 cores shared with ~15 busy processes,
-- --steps=20 --rounds=8, two runs): the loop on real data at 101.4% and
-- 94.0% of the bare step's mean (the machine's noise is that wide), the
-- median 96% of the mean, and one eval worth 32 steps, which the trainer
-- used to count into ms/step (13% at eval_interval 250): the old 37 vs
-- 29.5 ms/step was evals and mean-vs-median, not the loop.
local gl = require 'gptlua'
local train = require 'gptlua.train'
local now = require('gptlua.cli').now

local opts = { steps = 50, rounds = 5, threads = 0 }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil then error('trainer_overhead: unknown argument ' .. a .. ' (--steps, --rounds, --threads)', 0) end
  opts[k] = tonumber(v) or error('trainer_overhead: --' .. k .. ' expects a number', 0)
end
if opts.threads > 0 then gl.set_num_threads(opts.threads) end

local out_dir = os.tmpname()
os.remove(out_dir)

-- a trainer of the default recipe; fixed = true: one fixed batch, as bench.lua's step
local function trainer(fixed)
  local r = dofile(gl.root .. '/recipes/shakespeare.lua')
  r.quiet, r.device, r.eval_interval, r.sample_length, r.out_dir = true, 'cpu', 0, 0, out_dir
  r.peak_flops = 1e12
  r.optimizer, r.nanochat = 'adamw', { version = 'v1' }  -- the v1 block with AdamW: the configuration its figures were measured with
  if fixed then
    local x = gl.uniform({ r.batch_size, r.block_size + 1 }, 0, 65, { seed = 5, dtype = 'float64' }):clamp_(0, 64):to('int64')
    local xs, ys = x:narrow(2, 1, r.block_size):contiguous():keep(), x:narrow(2, 2, r.block_size):contiguous():keep()
    r.build_data = function()
      local L = { next_batch = function() return xs, ys end, state = function() return {} end, set_state = function() end }
      return { train = L, val = L, vocab_size = 65 }
    end
  end
  local t = train.new(r, {})
  for _ = 1, 3 do t:train_step() end
  return t
end

-- seconds per step of n bare train_step calls (mean; the median, which
-- bench.lua reports, goes to medians)
local medians = {}
local function bare(t, n)
  local times = {}
  local t0 = now()
  for i = 1, n do
    local t1 = now()
    t:train_step()
    times[i] = now() - t1
  end
  local mean = (now() - t0) / n
  table.sort(times)
  medians[t] = (medians[t] or 0) + times[math.ceil(n / 2)]
  return mean
end

-- seconds per step of the training loop over n more steps (its step time
-- alone, as the trainer reports it: the final checkpoint and set-up apart)
local function loop(t, n)
  t.cfg.max_iters = t.step + n
  local res = t:run()
  return res.seconds.steps / n
end

local variants = {
  { 'bench step (train_step, fixed batch)', trainer(true), bare },
  { 'train_step on real data', trainer(false), bare },
  { 'loop (Trainer:run) on a fixed batch', trainer(true), loop },
  { 'loop (Trainer:run) on real data', trainer(false), loop },
}
local sums = {}
for round = 1, opts.rounds do
  local line = {}
  for i, v in ipairs(variants) do
    collectgarbage()
    local s = v[3](v[2], opts.steps)
    sums[i] = (sums[i] or 0) + s
    line[#line + 1] = ('%.2f'):format(s * 1000)
  end
  print(('round %d: %s ms/step'):format(round, table.concat(line, ' / ')))
end
for i, v in ipairs(variants) do
  print(('%-40s %6.2f ms/step (mean)  %5.1f%% of the bench step'):format(v[1], sums[i] / opts.rounds * 1000,
    100 * sums[i] / sums[1]))
end
local b = variants[1][2]
print(('bench step median (what bench.lua prints): %.2f ms/step, %.1f%% of its mean'):format(
  medians[b] / opts.rounds * 1000, 100 * medians[b] / sums[1]))
-- an eval of the default recipe (eval_iters batches of each split): what
-- an interval holding one used to add to the printed ms/step
local t = variants[4][2]
t.cfg.eval_iters = dofile(gl.root .. '/recipes/shakespeare.lua').eval_iters
local t0 = now()
t:evaluate()
local eval_s = now() - t0
print(('one eval: %.0f ms = %.1f bench steps; every 250 steps it adds %.1f%% to a mean that counts it'):format(
  eval_s * 1000, eval_s / (sums[1] / opts.rounds), 100 * eval_s / (250 * sums[1] / opts.rounds)))
os.execute("rm -rf '" .. out_dir .. "'")
