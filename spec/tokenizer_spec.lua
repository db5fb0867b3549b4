-- Tokenizers: character level, byte-level BPE training (checked against an
-- independent naive trainer and a golden merge list), encode/decode
-- round trips on random bytes, special tokens, files, and bad input.
local gl = require 'gptlua'
local tok = require 'gptlua.tokenizer'

local ROOT = gl.root
local SHAKESPEARE = ROOT .. '/data/tinyshakespeare.txt'
local GOLDEN = ROOT .. '/spec/fixtures/bpe_golden_merges.txt'
local GOLDEN_BYTES, GOLDEN_VOCAB = 16384, 256 + 1 + 200  -- corpus prefix, vocab (1 special)

local function read(path) local f = assert(io.open(path, 'rb')); local s = f:read('*a'); f:close(); return s end
local shakespeare = read(SHAKESPEARE)

local function tmpname() local p = os.tmpname(); os.remove(p); return p end
-- f must raise an error containing msg (plain text)
local function raises(msg, f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, 'expected an error containing: ' .. msg)
  assert.is_truthy(tostring(err):find(msg, 1, true), 'error was: ' .. tostring(err))
end

-- ------------------------------------------------------------ reference code
-- The textbook algorithm, recounting every pair for every merge: ties go to
-- the smallest (left, right), and a pair whose bytes are already a token is
-- never merged.  Ids: bytes 0..255, merge m (1-based) makes 255 + m.
local function naive_train(chunks, n_merges)
  local count = {}
  for _, c in ipairs(chunks) do count[c] = (count[c] or 0) + 1 end
  local words = {}
  for c, n in pairs(count) do words[#words + 1] = { ids = { c:byte(1, -1) }, n = n } end
  local bytes, known = {}, {}
  for b = 0, 255 do bytes[b] = string.char(b); known[bytes[b]] = true end
  local K = 2 ^ 20
  local merges = {}
  for m = 1, n_merges do
    local pc = {}
    for _, w in ipairs(words) do
      local ids = w.ids
      for j = 1, #ids - 1 do local k = ids[j] * K + ids[j + 1]; pc[k] = (pc[k] or 0) + w.n end
    end
    local best, bestc
    for k, c in pairs(pc) do
      if best == nil or c > bestc or (c == bestc and k < best) then
        local a, b = math.floor(k / K), k % K
        if not known[bytes[a] .. bytes[b]] then best, bestc = k, c end
      end
    end
    if not best then break end
    local a, b, nid = math.floor(best / K), best % K, 255 + m
    merges[m] = { a, b }
    bytes[nid] = bytes[a] .. bytes[b]; known[bytes[nid]] = true
    for _, w in ipairs(words) do
      local ids, out, i = w.ids, {}, 1
      while i <= #ids do
        if i < #ids and ids[i] == a and ids[i + 1] == b then out[#out + 1] = nid; i = i + 2
        else out[#out + 1] = ids[i]; i = i + 1 end
      end
      w.ids = out
    end
  end
  return merges
end

-- minbpe's encode: repeatedly merge the lowest-ranked pair everywhere.
local function naive_encode(t, text)
  local rank = {}
  for _, m in ipairs(t:merges()) do rank[m[1] * 2 ^ 20 + m[2]] = m[3] end
  local out = {}
  for _, chunk in ipairs(t:split(text)) do
    local ids = { chunk:byte(1, -1) }
    while #ids >= 2 do
      local best
      for j = 1, #ids - 1 do
        local r = rank[ids[j] * 2 ^ 20 + ids[j + 1]]
        if r and (not best or r < best) then best = r end
      end
      if not best then break end
      local m = t:merges()[best - 255]
      local nids, i = {}, 1
      while i <= #ids do
        if i < #ids and ids[i] == m[1] and ids[i + 1] == m[2] then nids[#nids + 1] = best; i = i + 2
        else nids[#nids + 1] = ids[i]; i = i + 1 end
      end
      ids = nids
    end
    for _, id in ipairs(ids) do out[#out + 1] = id end
  end
  return out
end

-- random byte strings: words, digits, whitespace runs, UTF-8 and raw bytes
local PIECES = { 'the', ' the', 'Hello', ' world', "'s", "'LL", '123456', '  ', '\n', '\r\n', '\n\n', '\t',
  '!!', '?', '...', 'é', '日本語', '🙂', ' 👍🏽', 'Ω', '\0', '<|bos|>', '   x', 'ABCdef' }
local function random_string(rng_state, n)
  local parts = {}
  for _ = 1, n do
    local r = rng_state()
    if r < 0.55 then parts[#parts + 1] = PIECES[math.floor(rng_state() * #PIECES) + 1]
    elseif r < 0.8 then parts[#parts + 1] = string.char(math.floor(rng_state() * 256))
    else
      local k = math.floor(rng_state() * 8) + 1
      local s = {}
      for i = 1, k do s[i] = string.char(97 + math.floor(rng_state() * 26)) end
      parts[#parts + 1] = table.concat(s)
    end
  end
  return table.concat(parts)
end
local function lcg(seed)  -- a tiny deterministic generator, independent of math.random
  local s = seed
  return function() s = (s * 1103515245 + 12345) % 2147483648; return s / 2147483648 end
end

-- one trained tokenizer for the round-trip tests
local bpe = tok.train({ shakespeare }, 1024, { special_tokens = { '<|bos|>', '<|eos|>' }, texts = true })

describe('char tokenizer', function()
  it('maps the sorted distinct bytes to ids', function()
    local t = tok.char('hello world')
    assert.equal('char', t.kind)
    assert.equal(8, t.vocab_size)        -- ' ', d, e, h, l, o, r, w
    assert.same({ 3, 2, 4, 4, 5 }, t:encode('hello'))
    assert.equal('hello world', t:decode(t:encode('hello world')))
    assert.is_nil(t.bos_id)
  end)
  it('covers tiny shakespeare with 65 symbols', function()
    local t = tok.char(shakespeare)
    assert.equal(65, t.vocab_size)
    local ids = t:encode(shakespeare, { tensor = true })
    assert.equal('int32', ids.dtype)
    assert.equal(#shakespeare, ids:numel())
    assert.equal(shakespeare, t:decode(ids))
  end)
  it('rejects a byte outside its vocabulary, naming the offset', function()
    local t = tok.char('abc')
    raises('gl_tok_encode: byte 0x7a at offset 2 is not in the vocabulary', t.encode, t, 'abz')
    raises('in text 2', t.encode_batch, t, { 'a', 'zz' })
  end)
  it('takes special tokens after the bytes and saves/loads', function()
    local t = tok.char('ba', { special_tokens = { '<|bos|>' } })
    assert.equal(3, t.vocab_size)
    assert.equal(2, t.bos_id)
    assert.same({ 2, 1, 0 }, t:encode('ba', { bos = true }))
    local p = tmpname()
    t:save(p)
    local u = tok.load(p)
    assert.equal('char', u.kind)
    assert.equal(2, u.bos_id)
    assert.same(t:encode('abab'), u:encode('abab'))
    os.remove(p); os.remove(p .. '.json')
  end)
end)

describe('GPT-4 pre-tokenisation', function()
  local t = tok.train({ '' }, 256, { texts = true })
  it('splits like cl100k', function()
    assert.same({ 'Hello', ' world', "'s", ' ', '123', '45', '!!\n\n', ' ', ' x' },
      t:split("Hello world's 12345!!\n\n  x"))
    assert.same({ "'LL", ' 日本語', ' 🙂' }, t:split("'LL 日本語 🙂"))
  end)
  it('keeps invalid UTF-8 as chunks of its own', function()
    assert.same({ '\255\254', 'abc', ' ', '\192' }, t:split('\255\254abc \192'))
  end)
  it('handles a megabyte of whitespace (JIT stack, heap merge)', function()
    local code = tok.train({ string.rep('def f():\n    if x:\n        return 1\n\n\n', 50) }, 300, { texts = true, quiet = true })
    local s = string.rep(' ', 1000000) .. 'x' .. string.rep('\n', 100000)
    local ids = code:encode(s, { tensor = true })
    assert.equal(s, code:decode(ids))
    assert.is_true(ids:numel() <= 400000)   -- runs of spaces merged to multi-space tokens
    assert.equal(s, bpe:decode(bpe:encode(s, { tensor = true })))
  end)
end)

describe('BPE training', function()
  it('matches the naive trainer on a tiny corpus', function()
    local corpus = shakespeare:sub(1, 6000)
    local base = tok.train({ '' }, 256, { texts = true })
    local want = naive_train(base:split(corpus), 120)
    local t = tok.train({ corpus }, 256 + 120, { texts = true })
    local got = {}
    for i, m in ipairs(t:merges()) do got[i] = { m[1], m[2] }; assert.equal(255 + i, m[3]) end
    assert.same(want, got)
  end)
  it('matches the naive trainer without a split pattern and with ties everywhere', function()
    local corpus = string.rep('abcabd', 40) .. 'aaaaaaa bbbb ' .. string.rep('xy', 33)
    local want = naive_train({ corpus }, 40)
    local t = tok.train({ corpus }, 256 + 40, { texts = true, pattern = '', quiet = true })
    local got = {}
    for i, m in ipairs(t:merges()) do got[i] = { m[1], m[2] } end
    assert.same(want, got)
  end)
  it('reproduces the golden merge list (also checked by the naive trainer)', function()
    local corpus = shakespeare:sub(1, GOLDEN_BYTES)
    local t = tok.train({ corpus }, GOLDEN_VOCAB, { texts = true, special_tokens = { '<|bos|>' } })
    local lines = {}
    for _, m in ipairs(t:merges()) do lines[#lines + 1] = m[1] .. ' ' .. m[2] end
    local text = table.concat(lines, '\n') .. '\n'
    if os.getenv('GPTLUA_REGEN_GOLDEN') then
      local f = assert(io.open(GOLDEN, 'wb')); f:write(text); f:close()
    end
    assert.equal(read(GOLDEN), text)
    local base = tok.train({ '' }, 256, { texts = true })
    local want = {}
    for i, m in ipairs(naive_train(base:split(corpus), GOLDEN_VOCAB - 257)) do want[i] = m[1] .. ' ' .. m[2] end
    assert.equal(table.concat(want, '\n') .. '\n', text)
  end)
  it('trains tiny shakespeare to 4096 in seconds and counts specials in vocab_size', function()
    -- processor seconds (every thread's), not the wall clock of a shared machine
    local c0 = os.clock()
    local t = tok.train({ SHAKESPEARE }, 4096, { special_tokens = { '<|bos|>' } })
    assert.is_true(os.clock() - c0 < 10, ('took %.1f processor seconds'):format(os.clock() - c0))
    assert.equal(4096, t.vocab_size)
    assert.equal(4095, t.bos_id)
    assert.equal(4096 - 256 - 1, #t:merges())
    -- token bytes are unique (a tiktoken file needs that)
    local seen = {}
    for id = 0, t.vocab_size - 2 do
      local b = t:token_bytes(id)
      assert.is_nil(seen[b]); seen[b] = true
    end
  end)
  it('trains the same on one thread and many (big texts are counted in parallel)', function()
    local big = shakespeare:rep(4)
    local nt = gl.get_num_threads()
    gl.set_num_threads(1)
    local one = tok.train({ big }, 400, { texts = true })
    gl.set_num_threads(math.max(nt, 2))
    local many = tok.train({ big }, 400, { texts = true })
    gl.set_num_threads(nt)
    assert.same(one:merges(), many:merges())
    assert.same(tok.train({ shakespeare }, 400, { texts = true }):merges(), one:merges())
  end)
  it('stops early on a corpus without enough pairs', function()
    local t = tok.train({ 'abab' }, 300, { texts = true, quiet = true })
    assert.equal(258, t.vocab_size)  -- 'ab', then 'abab'
  end)
  it('rejects a bad vocab_size and a bad pattern', function()
    raises('gl_bpe_trainer_train: vocab_size expected >= 256 + 0 special tokens, got 100',
      tok.train, { 'x' }, 100, { texts = true })
    raises('pattern does not compile', tok.train, { 'x' }, 300, { texts = true, pattern = '(' })
  end)
end)

describe('BPE encode/decode', function()
  it('encodes the empty string to nothing', function()
    assert.same({}, bpe:encode(''))
    assert.equal(0, bpe:encode('', { tensor = true }):numel())
    assert.same({ bpe.bos_id }, bpe:encode('', { bos = true }))
    assert.equal('', bpe:decode({}))
  end)
  it('round-trips random byte strings, invalid UTF-8 included', function()
    local rng = lcg(12345)
    for _ = 1, 300 do
      local s = random_string(rng, math.floor(rng() * 40))
      assert.equal(s, bpe:decode(bpe:encode(s)))
    end
  end)
  it('agrees with the naive encoder, long chunks included', function()
    local rng = lcg(777)
    local texts = { shakespeare:sub(1, 3000), string.rep('ab', 200), string.rep('e', 150) .. ' the the',
                    string.rep('  ', 90) .. 'x', ('hereafter'):rep(30) }
    for _ = 1, 40 do texts[#texts + 1] = random_string(rng, 30) end
    for _, s in ipairs(texts) do assert.same(naive_encode(bpe, s), bpe:encode(s)) end
  end)
  it('never produces special tokens from text', function()
    local ids = bpe:encode('<|bos|> hello <|eos|>')
    for _, id in ipairs(ids) do assert.is_true(id < bpe.n_ordinary) end
    assert.equal('<|bos|> hello <|eos|>', bpe:decode(ids))
    local with = bpe:encode('hi', { bos = true })
    assert.equal(bpe.bos_id, with[1])
    assert.equal('<|bos|>hi', bpe:decode(with))
    assert.equal('<|eos|>', bpe:token_bytes(bpe:special_id('<|eos|>')))
  end)
  it('decodes tensors and reports out-of-range ids clearly', function()
    local ids = bpe:encode('To be, or not to be', { tensor = true })
    assert.equal('To be, or not to be', bpe:decode(ids))
    assert.equal('To be, or not to be', bpe:decode(ids:to('int64')))
    raises('gl_tok_decode: ids[2] = 1024 is out of range [0, 1024)', bpe.decode, bpe, { 5, 1024 })
    raises('gl_tok_decode: ids[1] = -1 is out of range [0, 1024)', bpe.decode, bpe, { -1 })
    raises('ids[1] expected an integer id, got 1.5', bpe.decode, bpe, { 1.5 })
    raises('ids expected an integer tensor, got float32', bpe.decode, bpe, gl.zeros({ 2 }))
  end)
  it('encodes batches and big texts the same on one thread and many', function()
    local docs = {}
    for i = 1, 50 do docs[i] = shakespeare:sub(i * 1000, i * 1000 + 700) end
    local batch = bpe:encode_batch(docs)
    for i = 1, 50 do assert.same(bpe:encode(docs[i]), batch[i]) end
    local big = shakespeare .. shakespeare
    local nt = gl.get_num_threads()
    gl.set_num_threads(1)
    local one = bpe:encode(big, { tensor = true })
    gl.set_num_threads(math.max(nt, 2))
    local many = bpe:encode(big, { tensor = true })
    gl.set_num_threads(nt)
    assert.same(one:tolist(), many:tolist())
    assert.equal(big, bpe:decode(many))
  end)
  it('cuts texts only where the parts encode like the whole', function()
    local s = shakespeare:sub(1, 20000)
    local cut = bpe:safe_cut(s)
    assert.is_true(cut > 19000)
    local parts = bpe:encode(s:sub(1, cut))
    for _, id in ipairs(bpe:encode(s:sub(cut + 1))) do parts[#parts + 1] = id end
    assert.same(bpe:encode(s), parts)
  end)
end)

describe('tokenizer files', function()
  it('saves tiktoken ranks plus JSON and loads them back', function()
    local p = tmpname()
    bpe:save(p)
    local first = read(p):match('^[^\n]*')
    assert.equal('AA== 0', first)             -- base64 of byte 0, rank 0
    local json = read(p .. '.json')
    assert.is_truthy(json:find('"<|bos|>":\t1022', 1, true))
    local t = tok.load(p)
    assert.equal(bpe.vocab_size, t.vocab_size)
    assert.equal(bpe.pattern, t.pattern)
    assert.same(bpe:merges(), t:merges())
    local s = shakespeare:sub(5000, 9000)
    assert.same(bpe:encode(s), t:encode(s))
    assert.equal(1022, t.bos_id)
    -- a bare tiktoken file (as from Python) that is none of the standard
    -- encodings needs its pattern ('bare tiktoken files' below); no specials
    os.remove(p .. '.json')
    local bare = tok.load(p, { pattern = tok.GPT4_PATTERN })
    assert.equal(tok.GPT4_PATTERN, bare.pattern)
    assert.equal(1022, bare.vocab_size)
    assert.same(bpe:encode(s), bare:encode(s))
    os.remove(p)
  end)
  it('names the file and line of a broken ranks file', function()
    local p = tmpname()
    local f = io.open(p, 'wb'); f:write('AA== 0\nAQ== 2\n'); f:close()
    raises(p .. "' line 2: rank 2, expected 1", tok.load, p)
    f = io.open(p, 'wb'); f:write('A*== 0\n'); f:close()
    raises("line 1: invalid base64", tok.load, p)
    f = io.open(p, 'wb'); f:write('AA== 0\nAA== 1\n'); f:close()
    raises("byte 0x00 is token 0 already", tok.load, p)
    f = io.open(p, 'wb'); f:write('YWI= 0\n'); f:close()
    raises("token 0 contains byte 0x61, which has no token", tok.load, p)
    f = io.open(p, 'wb'); f:write('YQ== 0\nYg== 1\nYWI= 2\nYWI= 3\n'); f:close()
    raises("token 3 is not a merge of two tokens of lower rank (it duplicates another token)", tok.load, p)
    -- a special token's id past int32 (found by the fuzzer: it was cast unchecked)
    f = io.open(p, 'wb'); f:write('YQ== 0\n'); f:close()
    for _, id in ipairs({ '2.9e17', '-1', '1.5', '"x"' }) do
      f = io.open(p .. '.json', 'wb'); f:write('{"type": "bpe", "pattern": null, "special_tokens": {"<|s|>": ' .. id .. '}}'); f:close()
      raises("special token '<|s|>' expected an integer id in [0, 2^31)", tok.load, p)
    end
    os.remove(p .. '.json')
    os.remove(p)
    raises('does not exist', tok.load, p)
  end)
  it('applies a merge list by rank, as tiktoken does, before and after save + load', function()
    -- (b,c) then (a,b) then (ab,c): "abc" reaches token 258 as (a, bc), since
    -- bc outranks ab; the listed pair (ab, c) never occurs.  Both the merge
    -- list and its ranks file must encode it the same way.
    local b = string.byte
    local t = tok.from_merges({ { b'b', b'c' }, { b'a', b'b' }, { 257, b'c' } }, { pattern = '' })
    assert.same({ 258 }, t:encode('abc'))
    assert.same({ 257, 257 }, t:encode('abab'))
    local p = tmpname()
    t:save(p)
    local u = tok.load(p)
    for _, s in ipairs({ 'abc', 'abab', 'cabcab', 'bcabc', 'aabbcc' }) do assert.same(t:encode(s), u:encode(s)) end
    os.remove(p); os.remove(p .. '.json')
    -- a merge list whose token duplicates an earlier one is refused, naming it
    raises('merge 3 (token 258) is not a merge of two tokens of lower rank (it duplicates another token)',
      tok.from_merges, { { b'a', b'b' }, { b'c', b'd' }, { b'a', b'b' } })
  end)
  it('records the Unicode version of its split tables, and says when they differ', function()
    local t = tok.from_merges({ { 32, 116 } })
    assert.matches('^%d+%.%d+%.%d+$', t.unicode_version)
    local p = tmpname()
    t:save(p)
    local f = io.open(p .. '.json'); local j = f:read('*a'); f:close()
    assert.matches('"unicode_version":%s*"' .. t.unicode_version:gsub('%.', '%%.') .. '"', j)
    f = io.open(p .. '.json', 'wb'); f:write((j:gsub('"unicode_version":%s*"[^"]*"', '"unicode_version": "9.0.0"'))); f:close()
    local err = os.tmpname()
    local h = io.open(err, 'w'); local old = io.stderr; io.stderr = h
    local ok, u = pcall(tok.load, p)
    io.stderr = old; h:close()
    assert.is_true(ok, u)
    assert.equal('9.0.0', u.unicode_version)
    h = io.open(err); local said = h:read('*a'); h:close(); os.remove(err)
    assert.matches('made with Unicode 9.0.0 tables, this build has ' .. t.unicode_version:gsub('%.', '%%.'), said)
    f = io.open(p .. '.json', 'wb'); f:write((j:gsub('"unicode_version":%s*"[^"]*"', '"unicode_version": 7'))); f:close()
    raises('unicode_version expected a version string', tok.load, p)
    os.remove(p); os.remove(p .. '.json')
  end)
  it('refuses a tokenizer file with no tokens, naming the file', function()
    local p = tmpname()
    for _, body in ipairs({ '', '\n\n', '\r\n' }) do
      local f = io.open(p, 'wb'); f:write(body); f:close()
      raises(p .. "' holds no tokens (vocabulary 0)", tok.load, p)
    end
    -- a sidecar with special tokens does not make an empty ranks file a vocabulary
    local f = io.open(p .. '.json', 'wb'); f:write('{"type":"char","special_tokens":{"<|bos|>":0}}'); f:close()
    f = io.open(p, 'wb'); f:write(''); f:close()
    raises(p .. "' holds no tokens (vocabulary 0)", tok.load, p)
    os.remove(p); os.remove(p .. '.json')
  end)
end)

-- A bare ranks file (no sidecar) says nothing about how text is split, and
-- another encoding's pattern silently gives other ids.  tiktoken's standard
-- encodings are recognised by their ranks (the 256 bytes, then 50256 for
-- r50k_base, 100256 for cl100k_base, 199998 for o200k_base); any other bare
-- file needs its pattern.  The files here have the standard rank counts
-- (single bytes, then 2- and 3-byte tokens), so the pattern is what differs.
describe('bare tiktoken files', function()
  local function bare_file(n)
    local ranks = {}
    for b = 0, 255 do ranks[#ranks + 1] = string.char(b) end
    for a = 0, 255 do
      for b = 0, 255 do
        if #ranks >= n then break end
        ranks[#ranks + 1] = string.char(a, b)
      end
    end
    for a = 0, 255 do
      for b = 0, 255 do
        for c = 0, 255 do
          if #ranks >= n then break end
          ranks[#ranks + 1] = string.char(a, b, c)
        end
      end
    end
    local p = tmpname() .. '.tiktoken'
    tok.from_ranks(ranks, { pattern = '' }):save(p)
    os.remove(p .. '.json')
    return p
  end
  -- the splits the standard patterns give (tiktoken_ext/openai_public.py)
  local text = "Hello World's 10000"
  for _, c in ipairs({
    { 'r50k_base', 50256, tok.R50K_PATTERN, { 'Hello', ' World', "'s", ' 10000' } },
    { 'cl100k_base', 100256, tok.GPT4_PATTERN, { 'Hello', ' World', "'s", ' ', '100', '00' } },
    { 'o200k_base', 199998, tok.O200K_PATTERN, { 'Hello', " World's", ' ', '100', '00' } },
  }) do
    it('reads a bare ' .. c[1] .. ' file with its own pattern', function()
      local p = bare_file(c[2])
      local t = tok.load(p)
      assert.equal(c[2], t.vocab_size)
      assert.equal(c[3], t.pattern)
      assert.same(c[4], t:split(text))
      os.remove(p)
    end)
  end
  it('refuses any other bare file, unless given its pattern', function()
    local p = bare_file(300)
    raises("' has no sidecar '" .. p .. ".json' to say how text is split, and its 300 ranks are not one of tiktoken's "
      .. 'standard encodings (r50k_base 50256, cl100k_base 100256, o200k_base 199998): give the pattern '
      .. '(tokenizer.load(path, {pattern = ...})) or write the sidecar', tok.load, p)
    local t = tok.load(p, { pattern = tok.R50K_PATTERN })
    assert.equal(300, t.vocab_size)
    assert.same({ 'Hello', ' World', "'s", ' 10000' }, t:split(text))
    os.remove(p)
  end)
end)
