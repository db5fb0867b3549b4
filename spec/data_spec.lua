-- Token shards (format, validation) and the loader (nanoGPT sampling,
-- sequential walk, rank slicing, exact resume, BOS alignment, prefetching),
-- plus recipes/prepare.lua end to end.
local gl = require 'gptlua'
local tok = require 'gptlua.tokenizer'
local data = require 'gptlua.data'
local ffi = gl.ffi

local ROOT = gl.root
local SHAKESPEARE = ROOT .. '/data/tinyshakespeare.txt'

local function tmpdir()
  local p = os.tmpname(); os.remove(p)
  os.execute('mkdir -p ' .. p)
  return p
end
local function rmrf(p) os.execute('rm -rf ' .. p) end
local function read(path) local f = assert(io.open(path, 'rb')); local s = f:read('*a'); f:close(); return s end
local function write(path, s) local f = assert(io.open(path, 'wb')); f:write(s); f:close() end
local function raises(msg, f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, 'expected an error containing: ' .. msg)
  assert.is_truthy(tostring(err):find(msg, 1, true), 'error was: ' .. tostring(err))
end

local function rows(t)  -- (B, T) tensor -> list of row tables
  local out = {}
  for i, r in ipairs(t:totable()) do out[i] = r end
  return out
end
local function write_shard(path, ids, vocab)
  local w = data.shard_writer(path, vocab)
  w:append(ids)
  w:close()
end

describe('token shards', function()
  local dir
  before_each(function() dir = tmpdir() end)
  after_each(function() rmrf(dir) end)

  it('round-trip as uint16 or uint32 with a validated header', function()
    local small, big = dir .. '/a.bin', dir .. '/b.bin'
    write_shard(small, { 0, 1, 65535, 7 }, 65536)
    write_shard(big, gl.tensor({ 0, 65536, 99999 }, { dtype = 'int64' }), 100000)
    local h = data.shard_header(small)
    assert.same({ 2, 65536, 4 }, { h.token_bytes, h.vocab_size, h.n_tokens })
    assert.equal(64 + 4 * 2, #read(small))
    assert.equal('GLTOKENS', read(small):sub(1, 8))
    assert.equal(4, data.shard_header(big).token_bytes)
    assert.same({ 0, 1, 65535, 7 }, data.read_shard(small):tolist())
    assert.same({ 0, 65536, 99999 }, data.read_shard(big):tolist())
  end)

  it('streams appends and leaves nothing behind on abort', function()
    local p = dir .. '/s.bin'
    local w = data.shard_writer(p, 1000)
    for i = 0, 9 do w:append(gl.arange(100, { dtype = 'int32' }) + i) end
    assert.equal(1000, w:count())
    assert.is_nil(io.open(p, 'rb'))         -- only p.tmp until close
    w:close()
    local t = data.read_shard(p)
    assert.equal(1000, t:numel())
    assert.equal(108, t:tolist()[1000])
    local w2 = data.shard_writer(dir .. '/x.bin', 10)
    w2:append({ 1, 2 })
    w2:abort()
    assert.same({}, data.list_files(dir, 'x'))
    raises("ids[2] = 10 is out of range [0, 10)", function()
      local w3 = data.shard_writer(dir .. '/y.bin', 10); w3:append({ 1, 10 }) end)
  end)

  it('rejects corrupt files with errors naming them', function()
    local p = dir .. '/c.bin'
    write_shard(p, gl.arange(1000, { dtype = 'int32' }), 1000)
    local good = read(p)
    write(p, 'NOTASHRD' .. good:sub(9))
    raises("'" .. p .. "' is not a token shard", data.read_shard, p)
    write(p, good:sub(1, 8) .. '\2\0\0\0' .. good:sub(13))
    raises("'" .. p .. "': version expected 1, got 2", data.read_shard, p)
    write(p, good:sub(1, #good - 10))
    raises("'" .. p .. "' is truncated: the header promises 1000 tokens (2064 bytes), the file has 2054 bytes", data.read_shard, p)
    write(p, good .. 'xx')
    raises("'" .. p .. "' has 2 bytes after its 1000 tokens", data.read_shard, p)
    write(p, good:sub(1, 100) .. 'Z' .. good:sub(102))
    raises("'" .. p .. "': checksum mismatch", data.read_shard, p)
    write(p, good:sub(1, 30))
    raises("'" .. p .. "' is truncated: 30 bytes, smaller than the 64-byte header", data.read_shard, p)
    write(p, good)
    raises("'" .. p .. "': token 500 is 500, expected < 500 (the model's vocab_size)", data.read_shard, p, 500)
    raises("data.loader: shard " .. p .. " has vocabulary 1000, larger than the loader's vocab_size (the tokenizer's or the model's) 500", function()
      data.loader { files = { p }, batch_size = 1, block_size = 4, vocab_size = 500 } end)
    raises("cannot open '" .. dir .. "/none.bin'", data.read_shard, dir .. '/none.bin')
  end)
end)

describe('loader', function()
  local N = 5000
  local tokens = gl.arange(N, { dtype = 'int32' })  -- token i == position i: rows show where they come from

  it('makes nanoGPT batches: y is x shifted, windows uniform over the data', function()
    local L = data.loader { tokens = tokens, batch_size = 8, block_size = 16, seed = 1 }
    local seen_hi, seen_lo = 0, N
    for _ = 1, 50 do
      local x, y = L:next_batch()
      assert.equal('int64', x.dtype)
      assert.same({ 8, 16 }, x.shape)
      for i, r in ipairs(rows(x)) do
        local yr = rows(y)[i]
        for j = 1, 16 do
          assert.equal(r[1] + j - 1, r[j])     -- a contiguous window
          assert.equal(r[j] + 1, yr[j])        -- y = x shifted by one
        end
        seen_lo, seen_hi = math.min(seen_lo, r[1]), math.max(seen_hi, r[1])
        assert.is_true(r[1] >= 0 and r[1] <= N - 17)
      end
    end
    assert.is_true(seen_lo < 100 and seen_hi > N - 200)
    L:close()
  end)

  it('is deterministic in the seed', function()
    local function first(seed)
      local L = data.loader { tokens = tokens, batch_size = 4, block_size = 8, seed = seed }
      local x = L:next_batch()
      L:close()
      return x:tolist()
    end
    assert.same(first(7), first(7))
    assert.are_not.same(first(7), first(8))
  end)

  it('walks the data in order with sequential sampling, epoch after epoch', function()
    local L = data.loader { tokens = gl.arange(100, { dtype = 'int32' }), batch_size = 2, block_size = 10,
                            sampling = 'sequential' }
    assert.equal(9, L.n_windows)              -- (100 - 1) // 10
    local starts = {}
    for _ = 1, 9 do
      local x = L:next_batch()
      for _, r in ipairs(rows(x)) do starts[#starts + 1] = r[1] end
    end
    assert.same({ 0, 10, 20, 30, 40, 50, 60, 70, 80, 0, 10, 20, 30, 40, 50, 60, 70, 80 }, starts)
    assert.equal(2, L:state().epoch)
  end)

  for _, sampling in ipairs({ 'random', 'sequential' }) do
    it('gives each rank its slice of the world-size-1 batch (' .. sampling .. ')', function()
      local W, B = 4, 3
      local one = data.loader { tokens = tokens, batch_size = W * B, block_size = 12, seed = 5, sampling = sampling }
      local ranks = {}
      for r = 0, W - 1 do
        ranks[r] = data.loader { tokens = tokens, batch_size = B, block_size = 12, seed = 5, sampling = sampling,
                                 rank = r, world_size = W }
      end
      for _ = 1, 5 do
        local x, y = one:next_batch()
        local xr, yr = rows(x), rows(y)
        for r = 0, W - 1 do
          local rx, ry = ranks[r]:next_batch()
          for i, row in ipairs(rows(rx)) do assert.same(xr[r * B + i], row) end
          for i, row in ipairs(rows(ry)) do assert.same(yr[r * B + i], row) end
        end
      end
    end)
  end

  it('resumes exactly from a plain-table state, also on another rank count', function()
    local cfg = { tokens = tokens, batch_size = 8, block_size = 10, seed = 3 }
    local L = data.loader(cfg)
    for _ = 1, 7 do L:next_batch() end
    local st = L:state()
    for k, v in pairs(st) do assert.is_true(type(v) == 'number' or type(v) == 'string' or type(v) == 'boolean', k) end
    assert.equal(56, st.sample)
    local want = {}
    for i = 1, 3 do want[i] = L:next_batch():tolist() end
    -- same shape, fresh loader
    local R = data.loader(cfg)
    R:set_state(st)
    for i = 1, 3 do assert.same(want[i], R:next_batch():tolist()) end
    -- two ranks of batch 4: their rows together are the batch of 8
    local parts = {}
    for r = 0, 1 do
      local Q = data.loader { tokens = tokens, batch_size = 4, block_size = 10, seed = 3, rank = r, world_size = 2 }
      Q:set_state(st)
      parts[r] = Q:next_batch():tolist()
    end
    local joined = {}
    for _, v in ipairs(parts[0]) do joined[#joined + 1] = v end
    for _, v in ipairs(parts[1]) do joined[#joined + 1] = v end
    assert.same(want[1], joined)
    -- the same loader rewinds too
    L:set_state(st)
    assert.same(want[1], L:next_batch():tolist())
    raises('the state is for seed = 3, this loader has 4', function()
      data.loader { tokens = tokens, batch_size = 8, block_size = 10, seed = 4 }:set_state(st) end)
    raises('the state is for block_size = 10, this loader has 11', function()
      data.loader { tokens = tokens, batch_size = 8, block_size = 11, seed = 3 }:set_state(st) end)
  end)

  it('never lets a window cross a shard boundary', function()
    local dir = tmpdir()
    local files = {}
    for s = 0, 2 do
      files[s + 1] = ('%s/train_%06d.bin'):format(dir, s)
      write_shard(files[s + 1], gl.arange(300, { dtype = 'int32' }) + s * 1000, 4000)
    end
    write_shard(dir .. '/val_000000.bin', { 1, 2, 3 }, 4000)
    local L = data.loader { files = dir, batch_size = 16, block_size = 20, seed = 11 }
    assert.same(files, L.files)
    assert.equal(900, L.n_tokens)
    local by_shard = {}
    for _ = 1, 20 do
      for _, r in ipairs(rows((L:next_batch()))) do
        assert.equal(r[1] + 19, r[20])
        assert.is_true(r[1] % 1000 <= 279)
        by_shard[math.floor(r[1] / 1000)] = true
      end
    end
    assert.same({ [0] = true, true, true }, by_shard)
    local S = data.loader { files = files, batch_size = 1, block_size = 100, sampling = 'sequential' }
    local starts = {}
    for _ = 1, 7 do starts[#starts + 1] = rows((S:next_batch()))[1][1] end
    assert.same({ 0, 100, 1000, 1100, 2000, 2100, 0 }, starts)
    rmrf(dir)
  end)

  it('aligns rows to BOS tokens', function()
    -- documents of varied length; BOS is id 0, any other token is its position + 1
    local ids, bos_pos = {}, {}
    for d = 1, 60 do
      bos_pos[#bos_pos + 1] = #ids
      ids[#ids + 1] = 0
      for _ = 1, 5 + (d * 7) % 23 do ids[#ids + 1] = #ids + 1 end
    end
    local n, T = #ids, 16
    local is_bos = {}
    for _, p in ipairs(bos_pos) do is_bos[p] = true end
    local t = gl.tensor(ids, { dtype = 'int32' })
    local function start_of(r) assert.equal(0, r[1]); return r[2] - 2 end
    local R = data.loader { tokens = t, batch_size = 8, block_size = T, bos_aligned = true, bos_id = 0 }
    for _ = 1, 10 do
      for _, r in ipairs(rows((R:next_batch()))) do
        local p = start_of(r)
        assert.is_true(is_bos[p] and p + T + 1 <= n)
      end
    end
    -- sequential: greedy rows, each at the first BOS at or after the previous row's last token
    local S = data.loader { tokens = t, batch_size = 1, block_size = T, bos_aligned = true, bos_id = 0,
                            sampling = 'sequential' }
    local want, p = {}, bos_pos[1]
    while p and p + T + 1 <= n do
      want[#want + 1] = p
      local nxt
      for _, q in ipairs(bos_pos) do if q >= p + T then nxt = q; break end end
      p = nxt
    end
    assert.equal(#want, S.n_windows)
    for i = 1, #want + 1 do
      assert.equal(want[(i - 1) % #want + 1], start_of(rows((S:next_batch()))[1]))
    end
    raises('bos_aligned needs bos_id', data.loader, { tokens = t, batch_size = 1, block_size = 4, bos_aligned = true })
    raises('no BOS token (id 7) has block_size + 1 = 5 tokens after it', data.loader,
      { tokens = { 1, 2, 3, 4, 5, 6 }, batch_size = 1, block_size = 4, bos_aligned = true, bos_id = 7 })
  end)

  it('has a uniform random source for benchmarks', function()
    local L = data.loader { source = 'random', vocab_size = 50, batch_size = 4, block_size = 64, seed = 9 }
    local x, y = L:next_batch()
    local hist = {}
    for _, v in ipairs(x:tolist()) do assert.is_true(v >= 0 and v < 50); hist[v] = true end
    local distinct = 0
    for _ in pairs(hist) do distinct = distinct + 1 end
    assert.is_true(distinct > 40)
    local xr, yr = rows(x), rows(y)
    for i = 1, 4 do for j = 1, 63 do assert.equal(xr[i][j + 1], yr[i][j]) end end
    local M2 = data.loader { source = 'random', vocab_size = 50, batch_size = 4, block_size = 64, seed = 9 }
    assert.same(x:tolist(), M2:next_batch():tolist())
  end)

  it('reads a text file with the char tokenizer', function()
    local L = data.loader { text = SHAKESPEARE, batch_size = 4, block_size = 32, seed = 2 }
    assert.equal(65, L.tokenizer.vocab_size)
    local text = read(SHAKESPEARE)
    local x = L:next_batch()
    for _, r in ipairs(rows(x)) do
      assert.is_truthy(text:find(L.tokenizer:decode(r), 1, true))
    end
    local d = data.text_file(SHAKESPEARE, { val_fraction = 0.1 })
    assert.equal(#text, d.train:numel() + d.val:numel())
    assert.equal(math.floor(#text * 0.9), d.train:numel())
  end)

  it('prefetches: next_batch does not wait in steady state', function()
    local L = data.loader { tokens = tokens, batch_size = 16, block_size = 64, prefetch = 4 }
    L:next_batch()
    local t0 = os.clock()
    while os.clock() - t0 < 0.05 do end     -- the producer fills the ring meanwhile
    for _ = 1, 3 do L:next_batch(); assert.equal(0, L:last_wait()) end
    L:close()
    L:close()
    raises('the loader is closed', L.next_batch, L)
  end)

  it('recycles the previous batch on request: no new memory in steady state', function()
    local L = data.loader { tokens = tokens, batch_size = 8, block_size = 64, recycle = true }
    local x = L:next_batch()
    for _ = 1, 5 do L:next_batch() end
    assert.is_true(x:is_freed())
    local before = gl.memory_stats('cpu')
    for _ = 1, 20 do L:next_batch() end
    local after = gl.memory_stats('cpu')
    assert.equal(before.reserved, after.reserved)
    assert.equal(before.n_allocs - before.cache_hits, after.n_allocs - after.cache_hits)
    L:close()
  end)

  it('refuses a shard whose vocabulary is larger than the tokenizer\'s, naming both', function()
    local dir = tmpdir()
    local t = tok.char('abcdef')                     -- vocabulary 6
    write_shard(dir .. '/train_000000.bin', gl.tensor({ 0, 1, 2, 3, 4, 5, 0, 1, 2, 3 }, { dtype = 'int32' }), 300)
    raises("data.loader: shard " .. dir .. "/train_000000.bin has vocabulary 300, larger than the tokenizer's vocabulary 6",
      data.loader, { files = dir, batch_size = 1, block_size = 4, tokenizer = t })
    raises("has vocabulary 300, larger than the loader's vocab_size (the tokenizer's or the model's) 6",
      data.loader, { files = { dir .. '/train_000000.bin' }, batch_size = 1, block_size = 4, vocab_size = t.vocab_size })
    -- a shard of the same or a smaller vocabulary loads
    write_shard(dir .. '/train_000000.bin', gl.tensor({ 0, 1, 2, 3, 4, 5, 0, 1, 2, 3 }, { dtype = 'int32' }), 6)
    data.loader({ files = dir, batch_size = 1, block_size = 4, tokenizer = t }):close()
    raises('data.loader: tokenizer expected a Tokenizer, got string', data.loader,
      { files = dir, batch_size = 1, block_size = 4, tokenizer = 'gpt2' })
    rmrf(dir)
  end)

  it('rejects bad options clearly', function()
    raises('expected exactly one of tokens, files, text, source; got none', data.loader, { batch_size = 1, block_size = 1 })
    raises('got tokens, source', data.loader, { tokens = tokens, source = 'random', batch_size = 1, block_size = 1 })
    raises('batch_size must be an integer >= 1, got 0', data.loader, { tokens = tokens, batch_size = 0, block_size = 4 })
    raises('block_size must be a finite integer < 2^62, got 2.5', data.loader, { tokens = tokens, batch_size = 1, block_size = 2.5 })
    for _, p in ipairs({ 0, -1, 1 }) do
      raises('data.loader: prefetch must be an integer in [2, 64], got ' .. p, data.loader,
        { tokens = tokens, batch_size = 1, block_size = 4, prefetch = p })
    end
    for _, p in ipairs({ 1 / 0, 0 / 0 }) do
      raises('data.loader: prefetch must be a finite integer < 2^62, got ' .. tostring(p), data.loader,
        { tokens = tokens, batch_size = 1, block_size = 4, prefetch = p })
    end
    -- the C loader itself: prefetch 0 (a zeroed config) is refused, not made 4
    for _, p in ipairs({ 0, 1, -3, 65 }) do
      local cfg = ffi.new('gl_loader_config', { batch_size = 1, block_size = 4, world_size = 1, prefetch = p })
      assert.is_true(gl.lib.gl_loader_new(cfg) == nil, 'prefetch ' .. p)
      assert.equal('gl_loader_new: prefetch expected in [2, 64], got ' .. p, ffi.string(gl.lib.gl_last_error()))
    end
    raises('rank expected in [0, world_size), got rank 2, world_size 2', data.loader,
      { tokens = tokens, batch_size = 1, block_size = 4, rank = 2, world_size = 2 })
    raises('no source has block_size + 1 = 5001 tokens (the longest has 5000)', data.loader,
      { tokens = tokens, batch_size = 1, block_size = 5000 })
    raises('tokens[2] = -1, expected in [0, ', data.loader, { tokens = { 1, -1, 2 }, batch_size = 1, block_size = 1 })
    raises('tokens[3] = 9, expected in [0, 9)', data.loader, { tokens = { 1, 2, 9 }, batch_size = 1, block_size = 1, vocab_size = 9 })
    raises("sampling expected 'random' or 'sequential', got shuffled", data.loader,
      { tokens = tokens, batch_size = 1, block_size = 4, sampling = 'shuffled' })
    raises('the random source needs vocab_size >= 1', data.loader, { source = 'random', batch_size = 1, block_size = 4 })
    raises('no shards', data.loader, { files = ROOT .. '/spec', batch_size = 1, block_size = 4 })
  end)
end)

describe('recipes/prepare.lua', function()
  it('trains a tokenizer and writes train/val shards that load', function()
    local dir = tmpdir()
    local docs = dir .. '/docs'
    os.execute('mkdir -p ' .. docs)
    local text = read(SHAKESPEARE)
    write(docs .. '/a.txt', text:sub(1, 200000))
    write(docs .. '/b.txt', text:sub(200001, 300000))
    local exe = GPTLUA and GPTLUA.exe or (ROOT .. '/build/gptlua')
    local cmd = ('%s %s/recipes/prepare.lua --input %s --tokenizer %s/tok --vocab-size 512 --out %s/out --val-fraction 0.1 --quiet')
      :format(exe, ROOT, docs, dir, dir)
    local rc = os.execute(cmd)
    assert.is_true(rc == 0 or rc == true, cmd)
    local t = tok.load(dir .. '/out/tokenizer')
    assert.equal(512, t.vocab_size)
    local train, val = data.read_shard(dir .. '/out/train_000000.bin'), data.read_shard(dir .. '/out/val_000000.bin')
    local all = t:decode(train) .. t:decode(val)
    -- every document is BOS-prefixed; the val part starts a document
    assert.equal(t.bos_id, train:tolist()[1])
    assert.equal(t.bos_id, val:tolist()[1])
    local plain = all:gsub('<|bos|>', '')
    assert.equal(text:sub(1, 300000), plain)
    assert.is_true(math.abs(#t:decode(val) - 30000) < 200)
    local L = data.loader { files = dir .. '/out', batch_size = 2, block_size = 32, vocab_size = t.vocab_size }
    assert.same({ 2, 32 }, (L:next_batch()).shape)
    rmrf(dir)
  end)

  it('streams big files in pieces without changing the tokens', function()
    local dir = tmpdir()
    local t = tok.train({ SHAKESPEARE }, 600, { special_tokens = { '<|bos|>' } })
    local r = data.prepare { input = SHAKESPEARE, tokenizer = t, out = dir .. '/out', val_fraction = 0, block_bytes = 65536 }
    assert.same({}, r.val)
    local got = data.read_shard(r.train[1]):tolist()
    assert.same(t:encode(read(SHAKESPEARE), { bos = true }), got)
    rmrf(dir)
  end)

  it('reports bad arguments', function()
    local exe = GPTLUA and GPTLUA.exe or (ROOT .. '/build/gptlua')
    local f = io.popen(exe .. ' ' .. ROOT .. '/recipes/prepare.lua --input x 2>&1')
    local out = f:read('*a'); f:close()
    assert.is_truthy(out:find('prepare: --tokenizer is required', 1, true), out)
  end)

  -- one run of recipes/prepare.lua over a small input (under `timeout`: a
  -- refused argument must not loop); returns its output and exit status
  local function prepare_cli(dir, extra)
    local exe = GPTLUA and GPTLUA.exe or (ROOT .. '/build/gptlua')
    write(dir .. '/in.txt', read(SHAKESPEARE):sub(1, 20000))
    local f = io.popen(('timeout 60 %s %s/recipes/prepare.lua --input %s/in.txt --tokenizer char --quiet %s 2>&1; echo "exit=$?"')
      :format(exe, ROOT, dir, extra))
    local out = f:read('*a'); f:close()
    return out, tonumber(out:match('exit=(%d+)'))
  end
  local function ls(dir)
    local names, p = {}, io.popen('ls -1A ' .. dir .. ' 2>/dev/null')
    for n in p:lines() do names[#names + 1] = n end
    p:close()
    return table.concat(names, ' ')
  end

  it('refuses --shard-tokens 0, negative, fractional or infinite at once, writing nothing', function()
    local dir = tmpdir()
    for _, c in ipairs({ { '0', 'an integer >= 1, got 0' }, { '-5', 'an integer >= 1, got -5' },
                         { '2.5', 'a finite integer < 2^62, got 2.5' }, { 'inf', 'a finite integer < 2^62, got inf' } }) do
      local out, rc = prepare_cli(dir, '--out ' .. dir .. '/out --shard-tokens=' .. c[1])
      assert.equal(1, rc, out)
      assert.truthy(out:find('prepare: --shard-tokens must be ' .. c[2], 1, true), out)
      assert.equal('in.txt', ls(dir))
    end
    local t = tok.char('abc')
    raises('data.prepare: shard_tokens must be an integer >= 1, got 0', data.prepare,
      { input = dir .. '/in.txt', tokenizer = t, out = dir .. '/out', shard_tokens = 0 })
    raises('data.prepare: val_fraction expected in [0, 1), got nan', data.prepare,
      { input = dir .. '/in.txt', tokenizer = t, out = dir .. '/out', val_fraction = 0 / 0 })
    assert.equal('in.txt', ls(dir))
    rmrf(dir)
  end)

  it('refuses an existing output directory unless --force, which replaces it whole', function()
    local dir = tmpdir()
    local out, rc = prepare_cli(dir, '--out ' .. dir .. '/out --shard-tokens 5000')
    assert.equal(0, rc, out)
    assert.equal('tokenizer tokenizer.json train_000000.bin train_000001.bin train_000002.bin train_000003.bin val_000000.bin',
      ls(dir .. '/out'))
    local before = read(dir .. '/out/train_000000.bin')
    out, rc = prepare_cli(dir, '--out ' .. dir .. '/out --shard-tokens 10000')
    assert.equal(1, rc, out)
    assert.truthy(out:find('data.prepare: output ' .. dir .. '/out already exists (force = true, or prepare.lua --force', 1, true), out)
    assert.equal(before, read(dir .. '/out/train_000000.bin'))
    assert.equal(4, #data.list_files(dir .. '/out', 'train_'))
    -- --force: the old shards are gone (two shards now, not four), nothing is left beside it
    out, rc = prepare_cli(dir, '--out ' .. dir .. '/out/ --shard-tokens 10000 --force')
    assert.equal(0, rc, out)
    assert.equal('tokenizer tokenizer.json train_000000.bin train_000001.bin val_000000.bin', ls(dir .. '/out'))
    assert.equal('in.txt out', ls(dir))
    rmrf(dir)
  end)

  it('writes into out.partial and renames it into place; a leftover .partial is removed, a failure leaves out absent', function()
    local dir = tmpdir()
    os.execute('mkdir -p ' .. dir .. '/out.partial && touch ' .. dir .. '/out.partial/train_000009.bin')
    local t = tok.char(read(SHAKESPEARE))
    local r = data.prepare { input = SHAKESPEARE, tokenizer = t, out = dir .. '/out', val_fraction = 0.1, tokenizer_file = 'tok' }
    assert.same({ dir .. '/out/train_000000.bin' }, r.train)
    assert.same({ dir .. '/out/val_000000.bin' }, r.val)
    assert.equal('out', ls(dir))
    assert.equal('tok tok.json train_000000.bin val_000000.bin', ls(dir .. '/out'))
    -- a tokenizer that cannot encode the input: the error comes out, nothing is left
    raises('', data.prepare, { input = SHAKESPEARE, tokenizer = tok.char('ab'), out = dir .. '/bad' })
    assert.equal('out', ls(dir))
    rmrf(dir)
  end)
end)

describe('loader on a GPU #cuda', function()
  local it = gl.cuda_available() and it or function(name) pending(name .. ' (no CUDA device on this machine)') end
  it('moves batches to the device with the same values as on the CPU', function()
    local tokens = gl.arange(3000, { dtype = 'int32' })
    local C = data.loader { tokens = tokens, batch_size = 4, block_size = 32, seed = 21 }
    local D = data.loader { tokens = tokens, batch_size = 4, block_size = 32, seed = 21, device = 'cuda:0' }
    for _ = 1, 3 do
      local cx, cy = C:next_batch()
      local dx, dy = D:next_batch()
      assert.equal('cuda:0', dx.device)
      assert.equal('int64', dx.dtype)
      assert.same(cx:tolist(), dx:to('cpu'):tolist())
      assert.same(cy:tolist(), dy:to('cpu'):tolist())
    end
  end)
end)
