-- Token files people already have, read directly as data = 'shards' sources:
-- llm.c / modded-nanogpt shards (256 int32 header, magic 20240520, uint16 or
-- uint32 tokens) and nanoGPT's headerless uint16 train.bin/val.bin.  The
-- files are written here byte by byte from the formats' definitions, not by
-- gptlua's writer.
local gl = require 'gptlua'
local data = require 'gptlua.data'
local train = require 'gptlua.train'
local ffi = gl.ffi

local function tmpdir()
  local p = os.tmpname(); os.remove(p)
  os.execute('mkdir -p ' .. p)
  return p
end
local function rmrf(p) os.execute('rm -rf ' .. p) end
local function write(path, s) local f = assert(io.open(path, 'wb')); f:write(s); f:close() end
local function raises(msg, f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, 'expected an error containing: ' .. msg)
  assert.is_truthy(tostring(err):find(msg, 1, true), 'error was: ' .. tostring(err))
end

local function u16s(ids)
  local b = ffi.new('uint16_t[?]', #ids)
  for i, v in ipairs(ids) do b[i - 1] = v end
  return ffi.string(b, 2 * #ids)
end
local function u32s(ids)
  local b = ffi.new('uint32_t[?]', #ids)
  for i, v in ipairs(ids) do b[i - 1] = v end
  return ffi.string(b, 4 * #ids)
end
-- llm.c's dev/data/data_common.py write_datafile: int32 header[256]
local function llmc_bytes(ids, version, count)
  local h = ffi.new('int32_t[256]')
  h[0], h[1], h[2] = 20240520, version or 1, count or #ids
  return ffi.string(h, 1024) .. ((version or 1) == 1 and u16s(ids) or u32s(ids))
end
-- llm.c's LLaMA-3 files (dev/data/data_common.py, model "llama-3"): magic
-- 20240801, version 7, uint32 tokens
local function llama3_bytes(ids, version)
  local h = ffi.new('int32_t[256]')
  h[0], h[1], h[2] = 20240801, version or 7, #ids
  return ffi.string(h, 1024) .. u32s(ids)
end
local function tokens(n, vocab, seed)
  local out, x = {}, seed or 7
  for i = 1, n do x = (x * 1103515245 + 12345) % 2147483648; out[i] = x % vocab end
  return out
end
local function batches(L, n)
  local out = {}
  for i = 1, n do local x, y = L:next_batch(); out[i] = { x:tolist(), y:tolist() } end
  return out
end

describe('llm.c and nanoGPT token files', function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rmrf(dir) end)

  it("reads llm.c's uint16 and uint32 shards by their magic", function()
    local ids = tokens(300, 50257)
    write(dir .. '/tiny_shakespeare_train.bin', llmc_bytes(ids))
    write(dir .. '/wide_train.bin', llmc_bytes({ 0, 70000, 128255 }, 2))
    local h = data.shard_header(dir .. '/tiny_shakespeare_train.bin')
    assert.same({ 'llm.c', 2, 300, 0 }, { h.format, h.token_bytes, h.n_tokens, h.vocab_size })
    assert.same(ids, data.read_shard(dir .. '/tiny_shakespeare_train.bin'):tolist())
    assert.same({ 0, 70000, 128255 }, data.read_shard(dir .. '/wide_train.bin'):tolist())
    assert.equal(4, data.shard_header(dir .. '/wide_train.bin').token_bytes)
  end)

  it("reads llm.c's LLaMA-3 files (magic 20240801, version 7, uint32 tokens)", function()
    local ids = { 128000, 0, 9906, 128255, 70000 }
    write(dir .. '/llama3_train_000000.bin', llama3_bytes(ids))
    local h = data.shard_header(dir .. '/llama3_train_000000.bin')
    assert.same({ 'llm.c', 7, 4, 5, 0 }, { h.format, h.version, h.token_bytes, h.n_tokens, h.vocab_size })
    assert.same(ids, data.read_shard(dir .. '/llama3_train_000000.bin'):tolist())
    write(dir .. '/bad.bin', llama3_bytes({ 1 }, 2))
    raises("llm.c LLaMA-3 shard version expected 7 (uint32 tokens), got 2", data.read_shard, dir .. '/bad.bin')
  end)

  it('says what vocabulary the shards need: their headers, else the largest token', function()
    write(dir .. '/a_train.bin', llmc_bytes({ 5, 50255, 7 }))
    write(dir .. '/b_train.bin', llama3_bytes({ 128000, 3 }))
    local w = data.shard_writer(dir .. '/c_train.bin', 300)
    w:append({ 1, 2, 299 }); w:close()
    assert.same({ vocab_size = 0, max_id = 50255 }, data.shards_vocab({ dir .. '/a_train.bin' }))
    assert.same({ vocab_size = 0, max_id = 128000 }, data.shards_vocab({ dir .. '/a_train.bin', dir .. '/b_train.bin' }))
    assert.same({ vocab_size = 300, max_id = -1 }, data.shards_vocab({ dir .. '/c_train.bin' }))
  end)

  it("reads nanoGPT's raw uint16 files only when asked, and refuses to guess", function()
    local ids = tokens(257, 65)
    write(dir .. '/train.bin', u16s(ids))
    assert.same(ids, data.read_shard(dir .. '/train.bin', 0, 'nanogpt'):tolist())
    assert.equal('nanogpt', data.shard_header(dir .. '/train.bin', 'nanogpt').format)
    raises("is not a token shard (magic expected \"GLTOKENS\", or llm.c's 20240520 or 20240801; nanoGPT's raw train.bin/val.bin: shard_format = 'nanogpt')",
      data.read_shard, dir .. '/train.bin')
    -- and a file that is one of the other formats is not read as raw tokens
    write(dir .. '/l.bin', llmc_bytes({ 1, 2 }))
    raises("is a llm.c shard, not raw uint16 tokens: read it with shard_format = 'auto'", data.read_shard, dir .. '/l.bin', 0, 'nanogpt')
    raises("shard_format expected 'auto' or 'nanogpt', got raw", data.read_shard, dir .. '/train.bin', 0, 'raw')
  end)

  it('refuses short, long and mismatched files, naming the file', function()
    local p = dir .. '/x_train.bin'
    write(p, llmc_bytes({ 1, 2, 3 }):sub(1, 1024 + 4))
    raises(p .. "' has 1028 bytes, expected 1030 (llm.c's header promises 3 tokens of 2 bytes)", data.read_shard, p)
    write(p, llmc_bytes({ 1, 2, 3 }) .. 'x')
    raises("has 1031 bytes, expected 1030", data.read_shard, p)
    write(p, llmc_bytes({ 1 }):sub(1, 600))
    raises(p .. "' is truncated: 600 bytes, smaller than llm.c's 1024-byte header", data.read_shard, p)
    write(p, llmc_bytes({ 1 }, 3))
    raises("llm.c shard version expected 1 (uint16 tokens) or 2 (uint32), got 3", data.read_shard, p)
    write(p, llmc_bytes({ 1 }, 1, -5))
    raises("llm.c token count expected >= 0, got -5", data.read_shard, p)
    write(p, u16s({ 1, 2 }) .. 'x')
    raises(p .. "' has 5 bytes, expected an even count (raw uint16 tokens)", data.read_shard, p, 0, 'nanogpt')
    write(p, '')
    raises(p .. "' holds no tokens (an empty file)", data.read_shard, p, 0, 'nanogpt')
    -- tokens past the model's vocabulary are refused with their position
    write(p, llmc_bytes({ 1, 2, 99, 3 }))
    raises("token 2 is 99, expected < 65 (the model's vocab_size)", data.read_shard, p, 65)
  end)

  it("gives the same batches as gptlua's shards of the same tokens, and resumes exactly", function()
    local tr = tokens(4000, 50257, 3)
    os.execute('mkdir -p ' .. dir .. '/a ' .. dir .. '/b ' .. dir .. '/c')
    write(dir .. '/a/fineweb_train_000000.bin', llmc_bytes({ table.unpack(tr, 1, 2500) }))
    write(dir .. '/a/fineweb_train_000001.bin', llmc_bytes({ table.unpack(tr, 2501, 4000) }))
    local w = data.shard_writer(dir .. '/b/train_000000.bin', 50257); w:append({ table.unpack(tr, 1, 2500) }); w:close()
    w = data.shard_writer(dir .. '/b/train_000001.bin', 50257); w:append({ table.unpack(tr, 2501, 4000) }); w:close()
    write(dir .. '/c/train_a.bin', u16s({ table.unpack(tr, 1, 2500) }))
    write(dir .. '/c/train_b.bin', u16s({ table.unpack(tr, 2501, 4000) }))
    local function loader(d, fmt, rank, world)
      return data.loader({ files = d, split = 'train', batch_size = 2, block_size = 16, seed = 5, shard_format = fmt,
                           vocab_size = 50257, rank = rank, world_size = world })
    end
    local want = batches(loader(dir .. '/b'), 6)
    assert.same(want, batches(loader(dir .. '/a'), 6))
    assert.same(want, batches(loader(dir .. '/c', 'nanogpt'), 6))
    -- resume after 3 batches, at another world size: the rows continue
    local L = loader(dir .. '/a'); batches(L, 3)
    local st = L:state()
    local r0, r1 = loader(dir .. '/a', nil, 0, 2), loader(dir .. '/a', nil, 1, 2)
    r0:set_state(st); r1:set_state(st)
    local x0, x1 = r0:next_batch(), r1:next_batch()
    assert.same(want[4][1], x0:tolist()); assert.same(want[5][1], x1:tolist())
  end)

  it("lists a directory's split for every naming scheme", function()
    for _, n in ipairs({ 'train.bin', 'val.bin', 'train_000000.bin', 'fineweb_train_000001.bin', 'tiny_shakespeare_val.bin',
                         'trainer.bin', 'x.txt' }) do write(dir .. '/' .. n, '') end
    local names = {}
    for _, p in ipairs(data.list_shards(dir, 'train')) do names[#names + 1] = p:match('[^/]+$') end
    assert.same({ 'fineweb_train_000001.bin', 'train.bin', 'train_000000.bin' }, names)
    assert.equal(2, #data.list_shards(dir, 'val'))
  end)

  it("trains from nanoGPT's train.bin/val.bin with data = 'shards'", function()
    write(dir .. '/train.bin', u16s(tokens(3000, 65, 1)))
    write(dir .. '/val.bin', u16s(tokens(600, 65, 2)))
    local args = { '--data=shards', '--data_dir=' .. dir, '--shard_format=nanogpt', '--vocab_size=65', '--max_iters=3',
                   '--n_layer=1', '--n_embd=16', '--n_head=2', '--block_size=8', '--batch_size=2', '--eval_interval=3',
                   '--eval_iters=1', '--log_interval=1', '--sample_length=0', '--out_dir=' .. dir .. '/runs', '--quiet' }
    local recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
    local t = train.new(recipe, args)
    t:run()
    assert.is_true(t.step == 3)
    raises("shard_format expected 'auto' or 'nanogpt', got raw", function()
      local a = {}; for i, v in ipairs(args) do a[i] = v:gsub('=nanogpt$', '=raw') end
      train.new(recipe, a):run()
    end)
  end)

  -- without --tokenizer the vocabulary comes from the data: the tokenizer
  -- prepare.lua saved beside the shards, the headers of gptlua's shards, or
  -- the largest id of llm.c / nanoGPT files rounded up to a multiple of 128
  -- (a line says which); the loader checks every token against the model's
  local function shard_args(extra)
    local a = { '--data=shards', '--data_dir=' .. dir, '--max_iters=1', '--n_layer=1', '--n_embd=16', '--n_head=2',
                '--block_size=8', '--batch_size=2', '--eval_interval=0', '--sample_length=0', '--out_dir=' .. dir .. '/runs',
                '--device=cpu' }
    for _, v in ipairs(extra or {}) do a[#a + 1] = v end
    return a
  end
  it("takes the vocabulary of llm.c's files from their largest id, with a line saying so", function()
    write(dir .. '/x_train_000001.bin', llmc_bytes(tokens(400, 300, 1)))
    write(dir .. '/x_val_000000.bin', llmc_bytes({ 50255, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 }))
    local recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
    local t = train.new(recipe, shard_args({ '--quiet' }))
    assert.equal(50304, t.cfg.vocab_size)
    assert.same({ 50304, 16 }, t.model.transformer.wte.weight.shape)
    local tok, V, note = train.shards_vocabulary(t.cfg, dir)
    assert.is_nil(tok)
    assert.equal(50304, V)
    assert.equal('data: vocab_size 50304 from the shards: their largest token is 50255, rounded up to a multiple of 128 '
      .. '(no tokenizer: --tokenizer or --vocab_size sets it)', note)
    -- a model vocabulary the data does not fit: one line naming the file, the token and the limit
    raises("x_train_000001.bin': token 4 is 256, expected < 256 (the model's vocab_size)", function()
      train.new(recipe, shard_args({ '--quiet', '--vocab_size=256' }))
    end)
  end)
  it("takes the vocabulary of prepare.lua's shards from the tokenizer beside them, else their headers", function()
    local tok = require('gptlua.tokenizer').char('abcdefgh\n')
    local text = dir .. '/in.txt'
    write(text, ('abcdefgh\n'):rep(200))
    data.prepare({ input = text, tokenizer = tok, out = dir .. '/p', val_fraction = 0.2, tokenizer_file = 'tokenizer' })
    local recipe = dofile(gl.root .. '/recipes/shakespeare.lua')
    local a = shard_args({ '--quiet' })
    a[2] = '--data_dir=' .. dir .. '/p'
    local t = train.new(recipe, a)
    assert.equal(tok.vocab_size, t.cfg.vocab_size)
    assert.equal(tok.vocab_size, t.data.tokenizer.vocab_size)
    os.remove(dir .. '/p/tokenizer'); os.remove(dir .. '/p/tokenizer.json')
    local _, V, note = train.shards_vocabulary(t.cfg, dir .. '/p')
    assert.equal(tok.vocab_size, V)
    assert.equal(("data: vocab_size %d from the shards' headers (no tokenizer: --tokenizer names one)"):format(V), note)
  end)
end)
