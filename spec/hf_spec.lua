-- Hugging Face's GPT-2 files (gptlua.hf) against Hugging Face's own code: the
-- fixture (spec/fixtures/hf_gpt2, made by make_fixture.py there with
-- transformers and tokenizers) holds a tiny GPT2LMHeadModel, a byte-level BPE
-- in both file forms, and what those libraries computed with them.
local gl = require 'gptlua'
local hf = require 'gptlua.hf'
local tok = require 'gptlua.tokenizer'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'

local FIX = gl.root .. '/spec/fixtures/hf_gpt2'
local function read(path) local f = assert(io.open(path, 'rb')); local s = f:read('*a'); f:close(); return s end
local function write(path, s) local f = assert(io.open(path, 'wb')); f:write(s); f:close() end
local expected = cjson.decode(read(FIX .. '/expected.json'))
local function tmpdir()
  local p = os.tmpname(); os.remove(p); os.execute('mkdir -p ' .. p); return p
end
local function raises(msg, f, ...)
  local ok, err = pcall(f, ...)
  assert.is_false(ok, 'expected an error containing: ' .. msg)
  assert.is_truthy(tostring(err):find(msg, 1, true), 'error was: ' .. tostring(err))
end
-- a copy of the fixture with one file replaced
local function variant(name, content)
  local d = tmpdir()
  for _, f in ipairs({ 'config.json', 'model.safetensors', 'vocab.json', 'merges.txt', 'tokenizer.json' }) do
    write(d .. '/' .. f, read(FIX .. '/' .. f))
  end
  if name then write(d .. '/' .. name, content) end
  return d
end

describe('Hugging Face GPT-2 tokenizer files', function()
  it('encode as Hugging Face encodes them, from tokenizer.json and from vocab.json + merges.txt', function()
    local tj = hf.load_tokenizer(FIX)                       -- the directory: tokenizer.json first
    local vm = hf.load_tokenizer(FIX .. '/vocab.json')
    for i, text in ipairs(expected.texts) do
      assert.same(expected.encoded_tokenizer_json[i], tj:encode(text, { allowed_special = 'all' }))
      assert.same(expected.encoded_vocab_merges[i], vm:encode(text, { allowed_special = 'all' }))
      assert.equal(text, tj:decode(tj:encode(text, { allowed_special = 'all' })))
    end
    assert.equal(expected.vocab_size, tj.vocab_size)
    assert.equal(300, tj.special_tokens['<|endoftext|>'])
    -- without allowed_special the special's text is ordinary text
    assert.is_nil(table.concat(vm:encode('a<|endoftext|>b'), ','):find('300'))
    raises('allowed_special[1] "<|bos|>" is not a special token', function() vm:encode('x', { allowed_special = { '<|bos|>' } }) end)
  end)

  -- the fixture's tokenizer with <|endoftext|> moved to id 0 and every
  -- other token one up (Hugging Face's BPE ranks merges by their order in
  -- the merge list, not by id: the tokenizers library gives the fixture's
  -- ids shifted for this file)
  it('read files whose special tokens come first (id 0)', function()
    local j = cjson.decode(read(FIX .. '/tokenizer.json'))
    local shifted = {}
    for s, id in pairs(j.model.vocab) do shifted[s] = id + 1 end
    shifted['<|endoftext|>'] = 0   -- in the vocabulary too, as such files have it (else Hugging Face renumbers it)
    j.model.vocab = shifted
    j.added_tokens[1].id = 0
    local d = variant('tokenizer.json', cjson.encode(j))
    local t = hf.load_tokenizer(d)
    local function shift(ids)
      local out = {}
      for i, id in ipairs(ids) do out[i] = id == 300 and 0 or id + 1 end
      return out
    end
    assert.equal(expected.vocab_size, t.vocab_size)
    assert.equal(0, t.special_tokens['<|endoftext|>'])
    for i, text in ipairs(expected.texts) do
      local ids = t:encode(text, { allowed_special = 'all' })
      assert.same(shift(expected.encoded_tokenizer_json[i]), ids)
      assert.equal(text, t:decode(ids))
      assert.equal(text, t:decode(gl.tensor(ids, { dtype = 'int64' })))
      assert.same(t:encode(text), t:encode_batch({ 'x', text })[2])
      assert.same(t:encode(text), t:encode(text, { tensor = true }):tolist())
    end
    assert.equal('<|endoftext|>', t:token_bytes(0))
    assert.equal('!', t:token_bytes(1))             -- the fixture's id 0
    assert.same({ 0, 1 }, t:encode('!', { prepend = 0 }))
    for _, m in ipairs(t:merges()) do assert.is_true(m[1] >= 1 and m[2] >= 1 and m[3] >= 257) end
    -- gptlua's own format has specials after the ranks: refused, not written wrong
    raises('Tokenizer:save: this tokenizer puts 1 special tokens before its ranks', t.save, t, os.tmpname())
    -- specials neither first nor last are refused, naming one
    j.added_tokens[1].id = 7
    for s, id in pairs(j.model.vocab) do if id <= 7 then j.model.vocab[s] = id - 1 end end
    j.model.vocab['<|endoftext|>'] = 7
    local d2 = variant('tokenizer.json', cjson.encode(j))
    raises('ids 0..299 expected to be the bytes and the merges, but id 7 is "<|endoftext|>", a special token',
      hf.load_tokenizer, d2)
    os.execute('rm -rf ' .. d .. ' ' .. d2)
  end)

  it('survive a save and load in gptlua\'s own format', function()
    local t = hf.load_tokenizer(FIX)
    local p = os.tmpname()
    t:save(p)
    local u = tok.load(p)
    for _, text in ipairs(expected.texts) do assert.same(t:encode(text), u:encode(text)) end
    os.remove(p); os.remove(p .. '.json')
  end)

  it('refuse what would encode differently, naming the file', function()
    local vocab = cjson.decode(read(FIX .. '/vocab.json'))
    local merges = read(FIX .. '/merges.txt')
    local d = tmpdir()
    -- two merges swapped: ids no longer in merge order
    local lines = {}
    for l in merges:gmatch('[^\n]+') do lines[#lines + 1] = l end
    lines[2], lines[3] = lines[3], lines[2]
    write(d .. '/vocab.json', read(FIX .. '/vocab.json')); write(d .. '/merges.txt', table.concat(lines, '\n') .. '\n')
    raises('ids not in merge order would encode differently', hf.load_tokenizer, d .. '/vocab.json')
    -- a byte without a token
    vocab['!'] = nil
    write(d .. '/vocab.json', cjson.encode(vocab)); write(d .. '/merges.txt', merges)
    raises("has no token for byte 0x21", hf.load_tokenizer, d .. '/vocab.json')
    local j = cjson.decode(read(FIX .. '/tokenizer.json'))
    j.pre_tokenizer.add_prefix_space = true
    write(d .. '/tokenizer.json', cjson.encode(j))
    raises(d .. '/tokenizer.json: ByteLevel add_prefix_space = true is not supported', hf.load_tokenizer, d .. '/tokenizer.json')
    j.pre_tokenizer.add_prefix_space = false; j.model.type = 'WordPiece'
    write(d .. '/tokenizer.json', cjson.encode(j))
    raises('model.type expected "BPE", got WordPiece', hf.load_tokenizer, d)
    raises('hf.load_tokenizer: ' .. d .. '/none.json does not exist', hf.load_tokenizer, d .. '/none.json')
    os.execute('rm -rf ' .. d)
  end)
end)

describe('tokenizer.from_ranks', function()
  it('derives the merges by rank and refuses ranks that are not merges', function()
    local ranks = {}
    for b = 0, 255 do ranks[b + 1] = string.char(b) end
    ranks[257], ranks[258] = 'ab', 'abc'
    local t = tok.from_ranks(ranks, { pattern = '' })
    assert.same({ 257 }, t:encode('abc'))
    ranks[259] = 'xyz'
    raises('token 258 is not a merge of two tokens of lower rank (its bytes do not merge to it)', tok.from_ranks, ranks)
    ranks[259] = nil; ranks[200] = 'a'
    raises('token 199 is byte 0x61, which is token 97 already', tok.from_ranks, ranks)
  end)
end)

describe('Hugging Face GPT-2 weights', function()
  it("compute Hugging Face's logits and loss", function()
    local m = hf.load_gpt2(FIX)
    local ids = expected.input_ids
    local x = gl.tensor({ ids }, { dtype = 'int64' })
    local logits = m:forward(x)
    for r, row in pairs(expected.logits_rows) do
      local got = logits:select(1, 1):select(1, tonumber(r)):tolist()
      for j = 1, #row do assert.is_true(math.abs(got[j] - row[j]) < 1e-5, ('row %s col %d: %g vs %g'):format(r, j, got[j], row[j])) end
    end
    local _, loss = m:forward(x:narrow(2, 1, #ids - 1), x:narrow(2, 2, #ids - 1))
    assert.is_true(math.abs(loss:item() - expected.loss) < 1e-5)
  end)

  it('write back what Hugging Face wrote: same names, layout and values', function()
    local m = hf.load_gpt2(FIX)
    local d = tmpdir()
    hf.save_gpt2(m, d)
    local a, b = ckpt.load_safetensors(FIX .. '/model.safetensors'), ckpt.load_safetensors(d .. '/model.safetensors')
    local n = 0
    for name, t in pairs(a) do
      n = n + 1
      assert.is_not_nil(b[name], name)
      assert.same(t.shape, b[name].shape)
      assert.equal(0, (t - b[name]):abs():max():item(), name)
    end
    for name in pairs(b) do assert.is_not_nil(a[name], name) end
    assert.equal(28, n)
    local cfg = cjson.decode(read(d .. '/config.json'))
    assert.same({ 2, 4, 32, 32, 301 }, { cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions, cfg.vocab_size })
    -- and gptlua reads its own output back to the same model
    local m2 = hf.load_gpt2(d)
    local x = gl.tensor({ expected.input_ids }, { dtype = 'int64' })
    assert.equal(0, (m:forward(x) - m2:forward(x)):abs():max():item())
    os.execute('rm -rf ' .. d)
  end)

  -- the files Hugging Face wrote for the fixture are the oracle: the same
  -- vocabulary, the same merges in the same order, the same ids
  it('write the tokenizer as Hugging Face does, and bos/eos ids from it', function()
    local m, t = hf.load_gpt2(FIX), hf.load_tokenizer(FIX)
    local d = tmpdir()
    hf.save_gpt2(m, d, { tokenizer = t })
    local cfg = cjson.decode(read(d .. '/config.json'))
    assert.same({ 300, 300 }, { cfg.bos_token_id, cfg.eos_token_id })  -- the fixture's config says 300 too
    assert.same(cjson.decode(read(FIX .. '/vocab.json')), cjson.decode(read(d .. '/vocab.json')))
    assert.equal(read(FIX .. '/merges.txt'), read(d .. '/merges.txt'))
    local theirs, ours = cjson.decode(read(FIX .. '/tokenizer.json')), cjson.decode(read(d .. '/tokenizer.json'))
    assert.same(theirs.model.vocab, ours.model.vocab)
    assert.same(theirs.model.merges, ours.model.merges)
    assert.same(theirs.pre_tokenizer, ours.pre_tokenizer)
    assert.same({ 300, '<|endoftext|>', true }, { ours.added_tokens[1].id, ours.added_tokens[1].content, ours.added_tokens[1].special })
    local back = hf.load_tokenizer(d)
    for i, text in ipairs(expected.texts) do
      assert.same(expected.encoded_tokenizer_json[i], back:encode(text, { allowed_special = 'all' }))
    end
    assert.equal('<|endoftext|>', cjson.decode(read(d .. '/tokenizer_config.json')).eos_token)
    -- without a tokenizer the ids are unknown: null, not GPT-2's 50256
    local d2 = tmpdir()
    hf.save_gpt2(m, d2)
    local c2 = read(d2 .. '/config.json')
    assert.truthy(c2:find('"bos_token_id":null', 1, true), c2)
    assert.truthy(c2:find('"eos_token_id":null', 1, true), c2)
    -- a tokenizer that splits with another pattern has no ByteLevel form
    raises("hf.save_tokenizer: the tokenizer splits with another pattern, expected GPT-2's pattern",
      hf.save_tokenizer, tok.train('hello world hello', 260, { texts = true, quiet = true }), d2)
    os.execute('rm -rf ' .. d .. ' ' .. d2)
  end)

  it('refuse configs gpt2 does not compute, untied heads and missing files, naming them', function()
    local c = cjson.decode(read(FIX .. '/config.json'))
    c.activation_function = 'gelu'
    local d = variant('config.json', cjson.encode(c))
    raises(d .. "/config.json: activation_function \"gelu\" is not supported", hf.load_gpt2, d)
    c.activation_function = 'gelu_new'; c.n_head = 5
    write(d .. '/config.json', cjson.encode(c))
    raises('n_embd 32 is not divisible by n_head 5', hf.load_gpt2, d)
    c.n_head = 4; c.n_layer = 3
    write(d .. '/config.json', cjson.encode(c))
    raises(d .. '/model.safetensors: missing: transformer.h.2.ln_1.weight', hf.load_gpt2, d)
    c.n_layer = 2
    write(d .. '/config.json', cjson.encode(c))
    local st = ckpt.load_safetensors(FIX .. '/model.safetensors')
    st['lm_head.weight'] = st['transformer.wte.weight'] * 2
    ckpt.save_safetensors(d .. '/model.safetensors', st)
    raises('lm_head.weight differs from wte.weight: an untied head is not supported', hf.load_gpt2, d)
    os.remove(d .. '/config.json')
    raises(d .. '/config.json does not exist', hf.load_gpt2, d)
    os.execute('rm -rf ' .. d)
  end)

  it('sample with recipes/sample.lua --hf', function()
    local p = io.popen(('cd %s && timeout 60 %s recipes/sample.lua --hf %s --prompt "First Citizen:" --n 8 --seed 3 2>&1; echo "exit=$?"')
      :format(gl.root, gl.root .. '/build/gptlua', FIX))
    local out = p:read('*a'); p:close()
    assert.is_truthy(out:find('exit=0', 1, true), out)
    assert.is_truthy(out:find('^First Citizen:'), out)
  end)
end)
