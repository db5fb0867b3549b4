-- What a step of recipes/moe.lua (8 experts of width 2 n_embd, top-2, in
-- every block) costs against the dense model of the same active parameters
-- (the same recipe with --moe.experts=0: the default recipe), both with the
-- recipe's optimizer (Muon classic) on the CPU: each timed in every round,
-- rounds interleaved so a loaded machine slows both alike.  Prints the
-- median ms/step of each, its ratio to the dense one, and the wall time of
-- the recipe's steps that ratio predicts from the dense run's.
--   gptlua recipes/tools/moe_step.lua [--iters=20] [--rounds=5] [--threads=1]
local gl = require 'gptlua'
local train = require 'gptlua.train'

local opts = { iters = 20, rounds = 5, threads = 1 }
for _, a in ipairs(arg) do
  local k, v = a:match('^%-%-([%w_]+)=(%d+)$')
  if not k or opts[k] == nil then
    error('moe_step: unknown argument ' .. a .. ' (--iters=N, --rounds=N, --threads=N)', 0)
  end
  opts[k] = tonumber(v)
end

local variants = { { 'dense', { '--moe.experts=0' } }, { 'moe 8 x top-2', {} } }
local dir = os.tmpname(); os.remove(dir)
local trainers = {}
for i, v in ipairs(variants) do
  local args = { '--quiet', '--control=false', '--journal=false', '--tensorboard=false', '--eval_interval=0',
                 '--sample_length=0', '--log_interval=0', '--max_iters=1000000', '--out_dir=' .. dir, '--name=v' .. i,
                 '--threads=' .. opts.threads, '--device=cpu' }
  for _, a in ipairs(v[2]) do args[#args + 1] = a end
  trainers[i] = train.new(dofile(gl.root .. '/recipes/moe.lua'), args)
  for _ = 1, 3 do trainers[i]:train_step() end  -- warm: optimizer state, caches
end
local medians = dofile(gl.root .. '/recipes/tools/step_rounds.lua')(trainers, opts.iters, opts.rounds)
os.execute('rm -rf ' .. dir)
local base = medians[1]
local steps = dofile(gl.root .. '/recipes/moe.lua').max_iters
print(('%-16s %10s %9s %16s'):format('model', 'ms/step', 'x dense', steps .. ' steps, s'))
for i, v in ipairs(variants) do
  local m = medians[i]
  print(('%-16s %10.1f %9.2f %16.0f'):format(v[1], m, m / base, m * steps / 1000))
end
