-- recipes/tools/bench_data.lua — tokenizer and loader throughput on this machine.
--   build/gptlua recipes/tools/bench_data.lua [--mb 10] [--vocab 4096] [--steps 200]
-- Text: data/tinyshakespeare.txt repeated to at least --mb megabytes.
local gl = require 'gptlua'
local tok = require 'gptlua.tokenizer'
local data = require 'gptlua.data'
local now = require('gptlua.cli').now

local opts = { mb = 10, vocab = 4096, steps = 200 }
for _, a in ipairs({ ... }) do
  local k, v = a:match('^%-%-(%w+)=(.*)$')
  if not k or opts[k] == nil then error('data_bench: unknown argument ' .. a, 0) end
  opts[k] = tonumber(v)
end

-- wall seconds per call (best of reps after a warm-up: the machine is shared)
-- and process CPU seconds per call.  Garbage is collected before each call
-- so results reuse cached memory, as a long-running pipeline does (fresh
-- pages cost a page fault each, which dominates on this VM).
local function timeit(f, reps)
  reps = reps or 1
  f()
  local best, cpu = math.huge, 0
  for _ = 1, reps do
    collectgarbage()
    local t0, c0 = now(), os.clock()
    f()
    best = math.min(best, now() - t0)
    cpu = cpu + os.clock() - c0
  end
  return best, cpu / reps
end

local f = assert(io.open(gl.root .. '/data/tinyshakespeare.txt', 'rb'))
local one = f:read('*a'); f:close()
local copies = math.ceil(opts.mb * 1e6 / #one)
local big = one:rep(copies)
local MB = #big / 1e6
local nt = gl.get_num_threads()
print(('data_bench: %d threads, text = tiny shakespeare x %d = %.1f MB'):format(nt, copies, MB))

-- training
local t_small, bpe = nil, nil
t_small = timeit(function() bpe = tok.train({ one }, opts.vocab, { texts = true, special_tokens = { '<|bos|>' } }) end, 3)
print(('train  vocab %d on %.2f MB: %.3f s (%.1f MB/s)'):format(opts.vocab, #one / 1e6, t_small, #one / 1e6 / t_small))
local t_big = timeit(function() tok.train({ big }, opts.vocab, { texts = true, special_tokens = { '<|bos|>' } }) end, 3)
print(('train  vocab %d on %.1f MB: %.3f s (%.1f MB/s)'):format(opts.vocab, MB, t_big, MB / t_big))

-- encoding
local n_ids
local t_all, c_all = timeit(function() n_ids = bpe:encode(big, { tensor = true }):numel() end, 5)
print(('encode bpe %.1f MB, %d threads: %.3f s (%.1f MB/s, %.1f M tokens/s, %.2f bytes/token; %.1f MB/s per CPU second)')
  :format(MB, nt, t_all, MB / t_all, n_ids / t_all / 1e6, #big / n_ids, MB / c_all))
gl.set_num_threads(1)
local t_one, c_one = timeit(function() bpe:encode(big, { tensor = true }) end, 3)
gl.set_num_threads(nt)
print(('encode bpe %.1f MB, 1 thread:  %.3f s (%.1f MB/s; %.1f MB/s per CPU second)'):format(MB, t_one, MB / t_one, MB / c_one))
local docs = {}
for i = 1, math.floor(#big / 4000) do docs[i] = big:sub((i - 1) * 4000 + 1, i * 4000) end
local t_batch = timeit(function() bpe:encode_batch(docs, { tensor = true }) end, 3)
print(('encode_batch %d docs of 4 KB: %.3f s (%.1f MB/s)'):format(#docs, t_batch, #docs * 4000 / 1e6 / t_batch))
local ch = tok.char(one)
local t_char = timeit(function() ch:encode(big, { tensor = true }) end, 3)
print(('encode char %.1f MB: %.3f s (%.1f MB/s)'):format(MB, t_char, MB / t_char))
local ids = bpe:encode(big, { tensor = true })
local t_dec = timeit(function() bpe:decode(ids) end, 3)
print(('decode %.1f MB: %.3f s (%.1f MB/s)'):format(MB, t_dec, MB / t_dec))

-- loader: B=32, T=2048 from shards of the encoded text, and from the random source
local B, T = 32, 2048
local dir = os.tmpname(); os.remove(dir)
local r = data.prepare { input = (function()
  local p = dir .. '.txt'; local g = assert(io.open(p, 'wb')); g:write(big); g:close(); return p end)(),
  tokenizer = bpe, out = dir, val_fraction = 0 }
os.remove(dir .. '.txt')
print(('prepare %.1f MB -> %d tokens: %.2f s (%.1f MB/s)'):format(MB, r.train_tokens, r.seconds, MB / r.seconds))

-- mode 'scope': each step in gl.scope (as the trainer does), so batches go
-- back to the allocator's cache; 'recycle': the loader frees the previous batch
local function loader_bench(name, cfg, mode)
  collectgarbage()
  cfg.recycle = mode == 'recycle'
  local L = data.loader(cfg)
  local step = mode == 'scope' and function() gl.scope(function() L:next_batch() end) end
                               or function() L:next_batch() end
  for _ = 1, 10 do step() end
  local t0 = now()
  for _ = 1, opts.steps do step() end
  local dt = now() - t0
  print(('loader %-18s %-7s B=%d T=%d: %7.1f M tokens/s (%.3f ms/batch, back-to-back next_batch)')
    :format(name, mode, B, T, opts.steps * B * T / dt / 1e6, dt / opts.steps * 1e3))
  -- steady state: the consumer computes for 5 ms per step; how long does next_batch take?
  local calls, waited = {}, 0
  for i = 1, 60 do
    local s = now(); while now() - s < 0.005 do end
    local c0 = now()
    step()
    calls[i] = now() - c0
    if L:last_wait() > 0 then waited = waited + 1 end
  end
  table.sort(calls)
  print(('loader %-18s %-7s steady state: next_batch median %.1f us, p90 %.1f us, max %.1f us; waited for data %d/60')
    :format(name, mode, calls[30] * 1e6, calls[54] * 1e6, calls[60] * 1e6, waited))
  L:close()
end
for _, mode in ipairs({ 'scope', 'recycle' }) do
  loader_bench('shards random', { files = dir, batch_size = B, block_size = T, seed = 1 }, mode)
  loader_bench('shards sequential', { files = dir, batch_size = B, block_size = T, sampling = 'sequential' }, mode)
  loader_bench('random source', { source = 'random', vocab_size = 50304, batch_size = B, block_size = T }, mode)
end
os.execute('rm -rf ' .. dir)
return 0
