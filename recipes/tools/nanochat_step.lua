-- What nanochat's version-2 features cost per training step on the default
-- recipe's sizes (recipes/shakespeare.lua: 4 layers, width 128, context 64,
-- batch 12) with AdamW: v1, v2, v2 with one feature off at a time; and v1
-- and v2 with nanochat's optimizer (Muon classic / current), each timed
-- in every round, rounds interleaved so a loaded machine slows all alike.
-- Prints the median ms/step of each and its ratio to v1.
--   gptlua recipes/tools/nanochat_step.lua [--iters=20] [--rounds=3]
local gl = require 'gptlua'
local train = require 'gptlua.train'

local opts = { iters = 20, rounds = 3 }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(%d+)$')
  if not k or opts[k] == nil then error('nanochat_step: unknown argument ' .. a .. ' (--iters=N, --rounds=N)', 0) end
  opts[k] = tonumber(v)
end

local variants = {
  { 'v1', { '--nanochat.version=v1' } }, { 'v2', { '--nanochat.version=v2' } },
  { 'v2 - lambdas', { '--nanochat.version=v2', '--nanochat.lambdas=off' } },
  { 'v2 - value_embeds', { '--nanochat.version=v2', '--nanochat.value_embeds=off' } },
  { 'v2 - smear', { '--nanochat.version=v2', '--nanochat.smear=off' } },
  { 'v2 - backout', { '--nanochat.version=v2', '--nanochat.backout=off' } },
  { 'v2 - padding', { '--nanochat.version=v2', '--nanochat.pad_vocab_to=1' } },
  -- with nanochat's optimizer instead of the recipe's AdamW (Muon's Newton–Schulz is the extra cost)
  { 'v1 + muon classic', { '--nanochat.version=v1', '--optimizer=nanochat' } },
  { 'v2 + muon classic', { '--nanochat.version=v2', '--optimizer=nanochat' } },
  { 'v2 + muon current', { '--nanochat.version=v2', '--optimizer=nanochat', '--muon_variant=current' } },
}
local dir = os.tmpname(); os.remove(dir)
local trainers = {}
for i, v in ipairs(variants) do
  local args = { '--optimizer=adamw', '--quiet', '--control=false', '--journal=false', '--tensorboard=false',
                 '--eval_interval=0',
                 '--sample_length=0', '--log_interval=0', '--max_iters=1000000', '--out_dir=' .. dir, '--name=v' .. i }
  for _, a in ipairs(v[2]) do args[#args + 1] = a end
  trainers[i] = train.new(dofile(gl.root .. '/recipes/shakespeare.lua'), args)
  for _ = 1, 3 do trainers[i]:train_step() end  -- warm: optimizer state, caches
end
local medians = dofile(gl.root .. '/recipes/tools/step_rounds.lua')(trainers, opts.iters, opts.rounds)
os.execute('rm -rf ' .. dir)
local base = medians[1]
print(('%-20s %10s %8s'):format('model', 'ms/step', 'x v1'))
for i, v in ipairs(variants) do
  local m = medians[i]
  print(('%-20s %10.1f %8.2f'):format(v[1], m, m / base))
end
