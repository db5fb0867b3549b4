-- Generates text from a checkpoint: --ckpt is a run directory (its latest
-- checkpoint), its checkpoints/ directory, or one checkpoint.
--   gptlua recipes/sample.lua --ckpt runs/shakespeare --prompt "ROMEO:"
--     [--n=500] [--temperature=0.8] [--top_k=200] [--seed=1337] [--num_samples=1]
local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'
local train = require 'gptlua.train'

local opts = { ckpt = '', prompt = '\n', n = 500, temperature = 0.8, top_k = 200, seed = 1337, num_samples = 1 }
local i = 1
while arg[i] do
  local a = arg[i]
  local k, v = a:match('^%-%-([%w_]+)=(.*)$')
  if not k then k = a:match('^%-%-([%w_]+)$'); v = arg[i + 1]; i = i + 1 end
  if not k or opts[k] == nil then
    error(('sample: unknown argument %s (valid: --ckpt --prompt --n --temperature --top_k --seed --num_samples)'):format(a), 0)
  end
  opts[k] = type(opts[k]) == 'number' and assert(tonumber(v), 'sample: --' .. k .. ' expects a number') or v
  i = i + 1
end
if opts.ckpt == '' then error('sample: --ckpt DIR is required (a run directory, its checkpoints/ or a checkpoint)', 0) end
local path = ckpt.resolve('latest', opts.ckpt .. '/checkpoints') or ckpt.resolve('latest', opts.ckpt)
if not path and ckpt.exists(opts.ckpt .. '/state.json') then path = opts.ckpt end
if not path then
  error(('sample: no checkpoint in %s (expected a run directory, its checkpoints/ or a checkpoint)'):format(opts.ckpt), 0)
end
local c = ckpt.load(path)
local cfg = c.state.config
cfg.device = gl.default_device()
local t = train.new(cfg, { '--quiet' })
t.model:load_state_dict(c.model)
for s = 1, opts.num_samples do
  local prompt = t.data.tokenizer:encode(opts.prompt)
  local idx = gl.tensor({ prompt }, { dtype = 'int64', device = cfg.device })
  local out = t.model:generate(idx, opts.n, { temperature = opts.temperature,
    top_k = opts.top_k > 0 and opts.top_k or nil, seed = opts.seed + s - 1 })
  io.write(t.data.tokenizer:decode(out:select(1, 1):tolist()), '\n')
  if s < opts.num_samples then io.write('---------------\n') end
end
