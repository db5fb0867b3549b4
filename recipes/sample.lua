-- Generates text from a checkpoint (it trains nothing; 500 characters from
-- the default recipe's model take seconds on a CPU): --ckpt is a run directory (its latest
-- checkpoint), its checkpoints/ directory, or one checkpoint; --hf is a
-- Hugging Face GPT-2 directory (config.json, model.safetensors and
-- tokenizer.json or vocab.json + merges.txt).
--   gptlua recipes/sample.lua --ckpt runs/shakespeare --prompt "ROMEO:"
--   gptlua recipes/sample.lua --hf path/to/gpt2 --prompt "Hello, I'm a language model,"
--     [--n=500] [--temperature=0.8] [--top_k=200] [--seed=1337] [--num_samples=1]
local gl = require 'gptlua'

local config = require 'gptlua.config'

-- the flags and their defaults; --key value and --key=value (config.parse_args)
local opts = { ckpt = '', hf = '', prompt = '\n', n = 500, temperature = 0.8, top_k = 200, seed = 1337, num_samples = 1 }
for _, a in ipairs(arg) do
  if a == '--help' or a == '-h' then
    io.write('usage: gptlua recipes/sample.lua (--ckpt DIR | --hf DIR) [--prompt TEXT] [--n 500] [--temperature 0.8] ',
      '[--top_k 200] [--seed 1337] [--num_samples 1]\n')
    return 0
  end
end
opts = config.merge(opts, config.parse_args(arg, opts, { prefix = 'sample', hint = 'gptlua recipes/sample.lua --help lists them' }))
-- the model and tokenizer: from a gptlua checkpoint or a Hugging Face directory (gptlua.infer.load)
if opts.hf ~= '' and opts.ckpt ~= '' then error('sample: give --ckpt or --hf, not both', 0) end
if opts.hf == '' and opts.ckpt == '' then
  error('sample: --ckpt DIR or --hf DIR is required (a run directory, its checkpoints/ or a checkpoint)', 0)
end
local loaded = require('gptlua.infer').load(opts.hf ~= '' and opts.hf or opts.ckpt, { hf = opts.hf ~= '', what = 'sample' })
local model, tokenizer, device = loaded.model, loaded.tokenizer, loaded.cfg.device
-- the prompt's ids; an empty one starts from the tokenizer's document
-- token (<|bos|>, GPT-2's <|endoftext|>), as Hugging Face's generate does
local prompt = tokenizer:encode(opts.prompt)
if #prompt == 0 then
  local start = tokenizer.bos_id or tokenizer:special_id('<|endoftext|>')
  if not start then
    error(("sample: --prompt must encode to at least one token, got %q (this tokenizer has no <|bos|> or "
      .. "<|endoftext|> to start from)"):format(opts.prompt), 0)
  end
  prompt = { start }
end
for s = 1, opts.num_samples do
  local idx = gl.tensor({ prompt }, { dtype = 'int64', device = device })
  local out = model:generate(idx, opts.n, { temperature = opts.temperature,
    top_k = opts.top_k > 0 and opts.top_k or nil, seed = opts.seed + s - 1 })
  io.write(tokenizer:decode(out:select(1, 1):tolist()), '\n')
  if s < opts.num_samples then io.write('---------------\n') end
end
