-- The KV-cache engine's speed on the CPU (gptlua.infer): prefill tokens/s
-- (one forward over the prompt) and decode tokens/s (one-token steps of n
-- rows against the cache), on a model of the default recipe's sizes with
-- random weights, or a run's checkpoint; and, for comparison, decoding
-- without the cache (model:forward over the whole sequence each token).
-- Each figure is the best of --rounds.
--   gptlua recipes/tools/bench_infer.lua [--run=runs/NAME] [--prompt=48] [--tokens=64] [--n=1,4] [--rounds=3]
local gl = require 'gptlua'
local infer = require 'gptlua.infer'
local now = require('gptlua.cli').now
local config = require 'gptlua.config'

local defaults = { run = '', prompt = 48, tokens = 64, n = '1,4', rounds = 3, block_size = 256 }
local o = config.merge(defaults, config.parse_args(arg, defaults, { prefix = 'bench_infer', hint = 'see the file\'s opening comment' }))

local model, label
if o.run ~= '' then
  local m = infer.load(o.run, { what = 'bench_infer' })
  model, label = m.model, m.path
else
  -- the default recipe's model (nanochat v1: 4 layers, width 128), with a longer context
  gl.manual_seed(1337)
  model = require('gptlua.models.nanochat').GPT({ vocab_size = 65, block_size = o.block_size, n_layer = 4, n_head = 4, n_embd = 128 })
  label = ('nanochat v1, 4 layers, width 128, vocabulary 65, context %d, random weights'):format(o.block_size)
end
model:eval()
local cfg = model.config
if o.prompt + o.tokens > cfg.block_size then
  error(('bench_infer: prompt %d + tokens %d exceed the context %d'):format(o.prompt, o.tokens, cfg.block_size), 0)
end
local V = cfg.vocab_size
local prompt = {}
for i = 1, o.prompt do prompt[i] = (i * 31 + 7) % V end
local engine = infer.Engine.new(model, nil)

local function best(f)
  local t = math.huge
  for _ = 1, o.rounds do
    local t0 = now(); f(); t = math.min(t, now() - t0)
  end
  return t
end

print(('model: %s; %d threads'):format(label, gl.get_num_threads and gl.get_num_threads() or 0))
gl.no_grad(function()
  local t = best(function() gl.scope(function() engine:prefill(prompt, 1, o.prompt + 1) end) end)
  print(('prefill  %4d tokens, 1 row : %9.0f tokens/s (%.2f ms)'):format(o.prompt, o.prompt / t, 1000 * t))
end)
for n in tostring(o.n):gmatch('%d+') do
  n = tonumber(n)
  -- decode alone: the time of a whole generation less its prefill
  local tg = best(function() engine:generate(prompt, { n = n, max_tokens = o.tokens, temperature = 0, seed = 1 }) end)
  local tp = best(function() gl.no_grad(function() gl.scope(function() engine:prefill(prompt, n, o.prompt + o.tokens) end) end) end)
  local td = math.max(tg - tp, 1e-9)
  print(('decode   %4d tokens, %d row%s: %9.0f tokens/s (%.2f ms/step, sampling on the host included)'):format(
    o.tokens, n, n == 1 and ' ' or 's', n * (o.tokens - 1) / td, 1000 * td / (o.tokens - 1)))
end
-- without a cache: the whole sequence again for every new token (model:forward, batch 1)
local t = best(function()
  gl.no_grad(function()
    local seq = { unpack(prompt) }
    for _ = 1, o.tokens do
      gl.scope(function()
        local logits = model:forward(gl.tensor({ seq }, { dtype = 'int64' }))
        seq[#seq + 1] = gl.argmax(logits:select(2, #seq), -1):tolist()[1]
      end)
    end
  end)
end)
print(('no cache %4d tokens, 1 row : %9.0f tokens/s (%.2f ms/token)'):format(o.tokens, o.tokens / t, 1000 * t / o.tokens))
