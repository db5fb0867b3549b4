-- Supervised fine-tuning (lua/gptlua/sft.lua, lua/gptlua/chat.lua,
-- recipes/sft.lua): the chat template and its loss mask, the tokenizer
-- gaining the chat tokens, packing with segment ids, a packed row's
-- losses against each conversation alone, the grown embedding, and the
-- recipe end to end (pretrain, fine-tune, chat, generate).
local gl = require 'gptlua'
local sft = require 'gptlua.sft'
local chat = require 'gptlua.chat'
local tok = require 'gptlua.tokenizer'
local cjson = require 'cjson'
local root, exe = GPTLUA.root, GPTLUA.exe

local base = tok.char('abcdefgh ?.\n')
local chars = sft.with_chat_tokens(base)
local S = {}
for _, name in ipairs(chat.SPECIALS) do S[name:match('^<|(.-)|>$')] = chars:special_id(name) end

describe('the chat template', function()
  it('renders a conversation with nanochat\'s tokens and marks only the assistant\'s as targets', function()
    local msgs = { { role = 'system', content = 'be.' }, { role = 'user', content = 'ab?' },
                   { role = 'assistant', content = 'cd' }, { role = 'user', content = 'e' }, { role = 'assistant', content = 'f.' } }
    local ids, mask = chat.render(chars, msgs)
    local function e(s) return chars:encode(s) end
    local want, wmask = {}, {}
    local function put(list, m) for _, id in ipairs(list) do want[#want + 1], wmask[#wmask + 1] = id, m end end
    put({ S.bos, S.user_start }, 0); put(e('be.\n\nab?'), 0); put({ S.user_end, S.assistant_start }, 0)
    put(e('cd'), 1); put({ S.assistant_end }, 1)
    put({ S.user_start }, 0); put(e('e'), 0); put({ S.user_end, S.assistant_start }, 0)
    put(e('f.'), 1); put({ S.assistant_end }, 1)
    assert.same(want, ids)
    assert.same(wmask, mask)
  end)

  it('refuses conversations out of turn, in one line', function()
    for _, case in ipairs({
      { { messages = {} }, 'expected {"messages": [{"role", "content"}, ...]} with at least one message' },
      { { messages = { { role = 'assistant', content = 'a' } } }, 'message 1: expected role "user" (or "system" before the first user message), got assistant' },
      { { messages = { { role = 'user', content = 'a' }, { role = 'user', content = 'b' } } }, 'message 2: expected role "assistant", got user' },
      { { messages = { { role = 'user', content = 3 } } }, 'message 1: expected {"role", "content": a string}' },
    }) do
      local ok, err = pcall(chat.check_conversation, case[1], 'x')
      assert.is_false(ok)
      assert.equal('x: ' .. case[2], err)
    end
    local path = os.tmpname()
    local f = io.open(path, 'w'); f:write('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": 1}\n'); f:close()
    local ok, err = pcall(sft.load_conversations, path)
    assert.is_false(ok)
    assert.equal(('sft: %s, line 2: expected {"messages": [{"role", "content"}, ...]} with at least one message'):format(path), err)
    os.remove(path)
  end)
end)

describe('the tokenizer gains the chat tokens', function()
  it('after its own ids, which keep their bytes (characters and BPE)', function()
    assert.equal(base.vocab_size + 5, chars.vocab_size)
    for id = 0, base.vocab_size - 1 do assert.equal(base:token_bytes(id), chars:token_bytes(id)) end
    assert.equal(base.vocab_size, S.bos)
    local again, added = sft.with_chat_tokens(chars)
    assert.equal(chars, again); assert.same({}, added)
    local bpe = tok.train({ 'hello hello world, the theme' }, 256 + 10, { special_tokens = { '<|endoftext|>' } })
    local grown, names = sft.with_chat_tokens(bpe)
    assert.equal(5, #names)
    assert.equal(bpe.vocab_size + 5, grown.vocab_size)
    assert.equal(bpe:special_id('<|endoftext|>'), grown:special_id('<|endoftext|>'))
    assert.same(bpe:encode('hello theme'), grown:encode('hello theme'))
  end)

  it('and the embedding and head grow rows: the old ones kept, the mean in each new one', function()
    local model = require('gptlua.models.gpt2').GPT({ vocab_size = 6, block_size = 8, n_layer = 1, n_head = 1, n_embd = 4 })
    local old = model:state_dict()
    local bigger = require('gptlua.models.gpt2').GPT({ vocab_size = 8, block_size = 8, n_layer = 1, n_head = 1, n_embd = 4 })
    local sd = sft.grow_state(bigger, old)
    local w, w0 = sd['transformer.wte.weight'], old['transformer.wte.weight']
    assert.same({ 8, 4 }, w.shape)
    assert.equal(0, w:narrow(1, 1, 6):max_abs_diff(w0))
    local mean = gl.mean(w0:to('float64'), 1, true)
    assert.is_true(w:narrow(1, 7, 1):to('float64'):max_abs_diff(mean) <= 1e-7)
    assert.equal(0, sd['transformer.h.0.attn.c_attn.weight']:max_abs_diff(old['transformer.h.0.attn.c_attn.weight']))
  end)
end)

describe('packing', function()
  local convs = {
    { { role = 'user', content = 'ab' }, { role = 'assistant', content = 'cd' } },
    { { role = 'user', content = 'e' }, { role = 'assistant', content = 'fgh' } },
    { { role = 'user', content = 'a b c d e f' }, { role = 'assistant', content = 'h' } },
  }

  it('lays conversations into rows with segment ids and targets only on the assistant\'s tokens', function()
    local T = 24
    local rows, cut = sft.pack(convs, chars, T)
    assert.equal(0, cut)
    local r1 = chat.render(chars, convs[1])
    local r2 = chat.render(chars, convs[2])
    local r3 = chat.render(chars, convs[3])
    assert.equal(2, #rows)  -- 9 + 9 tokens fit 25; the third (17) starts a row
    assert.equal(9, #r1); assert.equal(9, #r2); assert.equal(17, #r3)
    local row = rows[1]
    for t = 1, T do
      local want = t <= 9 and r1[t] or t <= 18 and r2[t - 9] or r2[9]
      assert.equal(want, row.x[t])
    end
    -- segments: 9, 9, then the padding of its own
    assert.equal(row.seg[1], row.seg[9]); assert.are_not.equal(row.seg[9], row.seg[10])
    assert.equal(row.seg[10], row.seg[18]); assert.are_not.equal(row.seg[18], row.seg[19])
    -- targets: the assistant's 'cd' and <|assistant_end|> predicted from the token before each
    local _, m1 = chat.render(chars, convs[1])
    for t = 1, T do
      local want = -1
      if t < 9 and m1[t + 1] == 1 then want = r1[t + 1] end
      if t >= 10 and t < 18 then
        local _, m2 = chat.render(chars, convs[2])
        if m2[t - 9 + 1] == 1 then want = r2[t - 9 + 1] end
      end
      assert.equal(want, row.y[t], 'target ' .. t)
    end
    assert.equal(-1, row.y[9])  -- the last token of a conversation predicts nothing of the next
    assert.equal(r1[8] and S.assistant_end, row.y[8])
    -- a conversation longer than a row is cut to T + 1 tokens
    local rows2, cut2 = sft.pack({ convs[3] }, chars, 10)
    assert.equal(1, cut2); assert.equal(1, #rows2)
    assert.same({ unpack(r3, 1, 10) }, rows2[1].x)
  end)

  it('gives each conversation of a packed row the losses it has alone (rotary positions, masked attention)', function()
    local T = 24
    local rows = sft.pack(convs, chars, T)
    local row = rows[1]
    gl.manual_seed(1)
    local model = require('gptlua.models.nanochat').GPT({ vocab_size = chars.vocab_size, block_size = 32, n_layer = 2,
      n_head = 2, n_embd = 16 })
    model:to('float64')
    gl.no_grad(function()
      for _, p in ipairs(model:parameters()) do p:copy_(gl.randn(p.shape, { seed = p:numel(), dtype = 'float64' }) * 0.3) end
    end)
    sft.mask_documents(model)
    local ev = require 'gptlua.eval'
    local x = gl.tensor({ row.x }, { dtype = 'int64' })
    sft.segments_of[x] = gl.tensor({ row.seg }, { dtype = 'int64' })
    local packed = ev.token_nats(model, x, gl.tensor({ row.y }, { dtype = 'int64' }))
    -- each conversation alone from position 0
    local at = 0
    for _, n in ipairs({ 9, 9 }) do
      local xs, ys = {}, {}
      for t = 1, n do xs[t], ys[t] = row.x[at + t], row.y[at + t] end
      local alone = ev.token_nats(model, gl.tensor({ xs }, { dtype = 'int64' }), gl.tensor({ ys }, { dtype = 'int64' }))
      for t = 1, n do
        -- rotary makes scores depend on relative positions only: equal up to float64 rounding of the rotations
        assert.is_true(math.abs(packed[at + t] - alone[t]) <= 1e-12, ('position %d: %.17g vs %.17g'):format(at + t, packed[at + t], alone[t]))
      end
      at = at + n
    end
    -- without the segment ids the second conversation sees the first: other losses
    local plain = ev.token_nats(model, gl.tensor({ row.x }, { dtype = 'int64' }), gl.tensor({ row.y }, { dtype = 'int64' }))
    local differs = false
    for t = 10, 18 do if row.y[t] >= 0 and math.abs(plain[t] - packed[t]) > 1e-6 then differs = true end end
    assert.is_true(differs)
  end)
end)

describe('recipes/sft.lua', function()
  it('fine-tunes a pretrained run on conversations; chat and generate use it', function()
    local out = os.tmpname(); os.remove(out)
    local function sh(cmd, input)
      local inp = os.tmpname()
      local f = io.open(inp, 'w'); f:write(input or ''); f:close()
      local res = io.popen(('cd %s && %s < %s 2>&1; echo "rc=$?"'):format(root, cmd, inp)):read('*a')
      os.remove(inp)
      return res
    end
    local common = ' --control=false --tensorboard=false --out_dir=' .. out
    local res = sh(exe .. ' recipes/tiny.lua --quiet --max_iters=2 --eval_interval=0 --sample_length=0' .. common)
    assert.truthy(res:find('rc=0\n$'), res)
    res = sh(exe .. ' recipes/sft.lua --init=' .. out .. '/tiny --max_iters=3 --eval_interval=3 --batch_size=2' .. common)
    assert.truthy(res:find('the tokenizer gained <|bos|> <|user_start|> <|user_end|> <|assistant_start|> <|assistant_end|>', 1, true), res)
    -- tiny's context is 32 characters: every conversation is cut to a row
    assert.truthy(res:find('sft: 36 conversations are longer than block_size + 1 = 33 tokens and were cut', 1, true), res)
    assert.truthy(res:find('33 conversations packed into 33 rows of 32 (3 held out: 3 rows)', 1, true), res)
    assert.truthy(res:find('rc=0\n$'), res)
    local evals = 0
    for line in io.lines(out .. '/tiny-sft/metrics.jsonl') do
      local r = cjson.decode(line)
      if r.eval then evals = evals + 1; assert.is_number(r.val_loss); assert.is_number(r.val_bpb) end
    end
    assert.equal(2, evals)  -- step 0 and step 3
    -- a chat over a pipe: one reply, then end of input
    res = sh(exe .. ' chat ' .. out .. '/tiny-sft --max_tokens=8 --seed=1', 'Who art thou?\n')
    assert.truthy(res:find('^you> assistant> '), res)
    assert.truthy(res:find('\nyou> \nrc=0\n$'), res)
    res = sh(exe .. ' generate ' .. out .. '/tiny-sft --prompt "Good" --max_tokens=5')
    assert.truthy(res:find('^Good'), res)
    assert.truthy(res:find('rc=0\n$'), res)
    -- a bad conversations file: one line
    local bad = os.tmpname()
    local f = io.open(bad, 'w'); f:write('{"messages": [{"role": "bot", "content": "x"}]}\n'); f:close()
    res = sh(exe .. ' recipes/sft.lua --init=' .. out .. '/tiny --conversations=' .. bad .. common)
    assert.equal(('sft: %s, line 1: message 1: expected role "user" (or "system" before the first user message), got bot\nrc=1\n')
      :format(bad), res)
    os.remove(bad)
    os.execute('rm -rf ' .. out)
  end)

  it('fine-tunes a Hugging Face GPT-2 directory: its BPE gains the chat tokens after <|endoftext|>', function()
    local hf = require 'gptlua.hf'
    local dir = os.tmpname(); os.remove(dir); os.execute('mkdir -p ' .. dir .. '/gpt2')
    local bpe = tok.train({ 'hello hello world, the theme of it' }, 256 + 10, { special_tokens = { '<|endoftext|>' },
      pattern = hf.GPT2_PATTERN })
    local m = require('gptlua.models.gpt2').GPT({ vocab_size = bpe.vocab_size, block_size = 16, n_layer = 1, n_head = 1, n_embd = 8 })
    hf.save_gpt2(m, dir .. '/gpt2', { tokenizer = bpe })
    local f = io.open(dir .. '/c.jsonl', 'w')
    for _, pair in ipairs({ { 'hello', 'the theme' }, { 'world', 'hello it' }, { 'it', 'of the world' } }) do
      f:write(cjson.encode({ messages = { { role = 'user', content = pair[1] }, { role = 'assistant', content = pair[2] } } }), '\n')
    end
    f:close()
    local res = io.popen(('cd %s && %s recipes/sft.lua --hf=%s/gpt2 --conversations=%s/c.jsonl --out_dir=%s/runs --max_iters=2 '
      .. '--eval_interval=2 --control=false --tensorboard=false 2>&1; echo "rc=$?"'):format(root, exe, dir, dir, dir)):read('*a')
    assert.truthy(res:find('rc=0\n$'), res)
    assert.truthy(res:find('2 conversations packed into 2 rows of 16 (1 held out: 1 rows), the tokenizer gained', 1, true), res)
    local grown = tok.load(dir .. '/runs/gpt2-sft/tokenizer')
    assert.equal(bpe.vocab_size + 5, grown.vocab_size)
    assert.equal(bpe:special_id('<|endoftext|>'), grown:special_id('<|endoftext|>'))
    local infer = require 'gptlua.infer'
    local loaded = infer.load(dir .. '/runs/gpt2-sft')
    assert.equal(bpe.vocab_size + 5, loaded.model.config.vocab_size)
    os.execute('rm -rf ' .. dir)
  end)
end)
