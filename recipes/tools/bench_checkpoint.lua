-- recipes/tools/bench_checkpoint.lua — what checkpoints cost a training run:
-- the wall time per step with a checkpoint every --every steps, written
-- synchronously and in the background (checkpoint_async), against none.
--
--   gptlua recipes/tools/bench_checkpoint.lua [--steps=40] [--every=10] [--n_layer=4] [--n_embd=256]
--                                             [--block_size=64] [--batch_size=8] [--device=cpu] [--out_dir=DIR]
--
-- Each mode trains the same gpt2 (char data) for --steps steps in this
-- process, the final save included in all three; the step time is the
-- run's wall time over its steps, and the stall is the time the loop spent
-- inside its periodic saves (the background mode's host copies, or the
-- synchronous mode's whole write), per save.  The modes alternate over
-- --rounds rounds and each reports its fastest, so a busy machine's noise
-- shows as the spread between rounds, printed too.
local train = require 'gptlua.train'
local now = require('gptlua.cli').now

local opts = { steps = 40, every = 10, n_layer = 4, n_embd = 256, block_size = 64, batch_size = 8, device = 'cpu',
               out_dir = nil, rounds = 3 }
for _, a in ipairs(arg or {}) do
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k or opts[k] == nil and k ~= 'out_dir' then error('bench_checkpoint: unknown option ' .. a, 0) end
  opts[k] = tonumber(v) or v
end
local base = opts.out_dir or os.tmpname()
if not opts.out_dir then os.remove(base) end

local function run(mode, round)
  local dir = ('%s/%s-%d'):format(base, mode, round)
  local r = { name = 'bench', model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt',
    n_layer = opts.n_layer, n_head = 4, n_embd = opts.n_embd, block_size = opts.block_size,
    batch_size = opts.batch_size, max_iters = opts.steps, eval_interval = 0, log_interval = 0, sample_length = 0,
    device = opts.device, out_dir = dir, quiet = true, tensorboard = false, control = false, keep_last = 2,
    checkpoint_interval = mode == 'none' and 0 or opts.every, checkpoint_async = mode == 'async' }
  local stall, saves = 0, 0
  local T = train.Trainer
  local save = T.save_checkpoint
  T.save_checkpoint = function(self, background)
    local t0 = now()
    local a, b = save(self, background)
    if background then stall, saves = stall + now() - t0, saves + 1 end
    return a, b
  end
  local t0 = now()
  local ok, err = pcall(train.main, r, {})
  local wall = now() - t0
  T.save_checkpoint = save
  os.execute('rm -rf ' .. dir)
  if not ok then error(err, 0) end
  return { ms = 1000 * wall / opts.steps, stall = saves > 0 and 1000 * stall / saves or 0, saves = saves }
end

local modes, best, all = { 'none', 'sync', 'async' }, {}, {}
for round = 1, opts.rounds do
  for _, m in ipairs(modes) do
    local res = run(m, round)
    all[m] = all[m] or {}
    table.insert(all[m], res.ms)
    if not best[m] or res.ms < best[m].ms then best[m] = res end
  end
end
local probe = train.new({ model = 'gpt2', data = 'char', data_path = 'data/tinyshakespeare.txt', n_layer = opts.n_layer,
  n_head = 4, n_embd = opts.n_embd, block_size = opts.block_size, device = opts.device, quiet = true }, {})
local params = probe.model:num_params()
print(('gpt2 %d layers, width %d: %.2fM parameters (checkpoint about %.0f MB: weights and AdamW moments, fp32), '
  .. '%d steps, a checkpoint every %d, device %s'):format(opts.n_layer, opts.n_embd, params / 1e6, params * 12 / 1e6,
  opts.steps, opts.every, opts.device))
print(('%-6s %12s %16s %22s'):format('mode', 'ms/step', 'vs none', 'stall per save (ms)'))
for _, m in ipairs(modes) do
  local b = best[m]
  local spread = {}
  for _, v in ipairs(all[m]) do spread[#spread + 1] = ('%.1f'):format(v) end
  print(('%-6s %12.2f %15.1f%% %22s   rounds: %s'):format(m, b.ms, 100 * (b.ms / best.none.ms - 1),
    m == 'none' and '-' or ('%.1f'):format(b.stall), table.concat(spread, ' ')))
end
