-- Generates text from a checkpoint: --ckpt is a run directory (its latest
-- checkpoint), its checkpoints/ directory, or one checkpoint.
--   gptlua recipes/sample.lua --ckpt runs/shakespeare --prompt "ROMEO:"
--     [--n=500] [--temperature=0.8] [--top_k=200] [--seed=1337] [--num_samples=1]
local gl = require 'gptlua'
local ckpt = require 'gptlua.checkpoint'
local train = require 'gptlua.train'

local config = require 'gptlua.config'

-- the flags and their defaults; --key value and --key=value (config.parse_args)
local opts = { ckpt = '', prompt = '\n', n = 500, temperature = 0.8, top_k = 200, seed = 1337, num_samples = 1 }
for _, a in ipairs(arg) do
  if a == '--help' or a == '-h' then
    io.write('usage: gptlua recipes/sample.lua --ckpt DIR [--prompt TEXT] [--n 500] [--temperature 0.8] ',
      '[--top_k 200] [--seed 1337] [--num_samples 1]\n')
    return 0
  end
end
opts = config.merge(opts, config.parse_args(arg, opts, { prefix = 'sample', hint = 'gptlua recipes/sample.lua --help lists them' }))
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
