-- engine/fuzz/make_corpus.lua — writes the seed corpora of the fuzz targets
-- (engine/fuzz/corpus/TARGET/) with the project's own writers, so the seeds
-- are real files: `build/gptlua engine/fuzz/make_corpus.lua`.  Small on
-- purpose (the fuzzers mutate them; CI replays them every run).  The
-- checkpoint seeds pair with engine/fuzz/checkpoint/*.safetensors, the files
-- of a 2-step run of the default recipe:
--   build/gptlua recipes/shakespeare.lua --out_dir=DIR --n_layer=1 --n_embd=8 --n_head=2 --block_size=8
--     --batch_size=2 --max_iters=2 --checkpoint_interval=2 --eval_interval=0 --sample_length=0 --warmup_iters=0
local gl = require 'gptlua'
local data = require 'gptlua.data'
local tok = require 'gptlua.tokenizer'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'

local here = gl.root .. '/engine/fuzz'
local function out(target, name) return ('%s/corpus/%s/%s'):format(here, target, name) end
local function read(p) local f = assert(io.open(p, 'rb')); local s = f:read('*a'); f:close(); return s end
local function write(p, s) local f = assert(io.open(p, 'wb')); f:write(s); f:close() end
for _, t in ipairs({ 'safetensors', 'shards', 'tokenizer', 'checkpoint_state', 'config' }) do
  os.execute('mkdir -p ' .. here .. '/corpus/' .. t)
end

-- safetensors: every dtype with metadata, an empty file, the fixture checkpoint's
local all = {}
for i, dt in ipairs(gl.Tensor.DTYPES) do
  all['t_' .. dt] = gl.arange(i + 1):to(dt):view(1, i + 1)
end
ckpt.save_safetensors(out('safetensors', 'dtypes.safetensors'), all, { note = 'every dtype', format = 'pt' })
ckpt.save_safetensors(out('safetensors', 'empty.safetensors'), {})
ckpt.save_safetensors(out('safetensors', 'scalar.safetensors'), { s = gl.tensor(3.5):view() })
write(out('safetensors', 'model.safetensors'), read(here .. '/checkpoint/model.safetensors'))

-- token shards: uint16 and uint32 tokens, an empty one
local function shard(name, vocab, ids)
  local w = data.shard_writer(out('shards', name), vocab)
  if #ids > 0 then w:append(ids) end
  w:close()
end
shard('u16.bin', 300, { 0, 1, 2, 299, 5, 0, 7, 8, 9, 10, 11, 12, 0, 14, 15, 16 })
shard('u32.bin', 70000, { 0, 69999, 65536, 3, 0, 1, 2, 3 })
shard('empty.bin', 50, {})

-- tokenizer files: ranks, then NUL and the sidecar (as fuzz_tokenizer.c reads them)
local text = read(gl.root .. '/data/tinyshakespeare.txt'):sub(1, 20000)
local function tokfile(name, t, sidecar)
  local p = os.tmpname()
  t:save(p)
  local s = read(p)
  if sidecar then s = s .. '\0' .. read(p .. '.json') end
  os.remove(p); os.remove(p .. '.json')
  write(out('tokenizer', name), s)
end
tokfile('bpe.bin', tok.train(text, 300, { texts = true, special_tokens = { '<|bos|>', '<|eos|>' }, quiet = true }), true)
tokfile('bpe_no_sidecar.bin', tok.train(text, 270, { texts = true, quiet = true }), false)
tokfile('bpe_no_pattern.bin', tok.train(text, 262, { texts = true, pattern = '', quiet = true }), true)
tokfile('char.bin', tok.char(text:sub(1, 2000), { special_tokens = { '<|bos|>' } }), true)

-- checkpoint state: the fixture run's state.json and a few edits of it
local state = cjson.decode(read(here .. '/checkpoint/state.json'))
write(out('checkpoint_state', 'state.json'), read(here .. '/checkpoint/state.json'))
state.data.sample = 1e6
write(out('checkpoint_state', 'late.json'), cjson.encode(state))
state.rng = { seed = 1, offset = 0 }; state.history = {}
write(out('checkpoint_state', 'rng.json'), cjson.encode(state))
write(out('checkpoint_state', 'minimal.json'), cjson.encode({ format = 'gptlua-checkpoint-1', step = 0, files = {},
  config = { seed = 1 } }))

-- config: command lines (one argument a line), optionally after a JSON recipe
write(out('config', 'args.txt'), '--max_iters=10\n--n_layer=2\n--learning_rate=3e-4\n--resume\n--fsdp.prefetch=false')
write(out('config', 'recipe.txt'), cjson.encode({ model = 'nanochat', n_layer = 2, n_embd = 64, n_head = 4,
  optimizer = 'nanochat', dtype = 'bfloat16', fsdp = { accumulate = 'unsharded' } }) .. '\n--batch_size=4\n--sampling=sequential')
write(out('config', 'empty.txt'), '')
print('seed corpora written under ' .. here .. '/corpus')
