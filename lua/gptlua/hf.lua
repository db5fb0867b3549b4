-- gptlua.hf — GPT-2 in Hugging Face's files: the weights (config.json +
-- model.safetensors, Conv1D layout) and the byte-level BPE (vocab.json +
-- merges.txt, or tokenizer.json), read into gptlua's model and tokenizer
-- and written back.
--
--   local hf = require 'gptlua.hf'
--   local model = hf.load_gpt2('path/to/gpt2')        -- a directory, or its model.safetensors
--   local tok = hf.load_tokenizer('path/to/gpt2')     -- tokenizer.json, else vocab.json + merges.txt
--   hf.save_gpt2(model, 'out/dir', {tokenizer = tok}) -- config.json + model.safetensors (+ the tokenizer)
--   hf.save_tokenizer(tok, 'out/dir')                 -- tokenizer.json, vocab.json + merges.txt
--
-- The tokenizer: GPT-2 stores each token's bytes as printable characters
-- (bytes_to_unicode: a printable byte stands for itself, every other byte
-- for a character from U+0100 on), so the files are decoded back to bytes.
-- gptlua applies merges by rank, as tiktoken does, with rank = token id;
-- for GPT-2's files (merge i makes id 256 + i) that is the order of
-- merges.txt, which Hugging Face follows.  Files whose ids are not in
-- merge order would encode differently and are refused, as are
-- pre-tokenizer settings gptlua does not reproduce (add_prefix_space, a
-- normalizer).  Tokens that are neither a byte nor a merge's result
-- (<|endoftext|>) become special tokens and keep their ids, which come
-- after the ordinary ones or before them (ids 0, 1, ...: a tokenizer whose
-- <|endoftext|> is id 0).
--
-- The weights: Hugging Face's GPT2LMHeadModel stores the four projections
-- as Conv1D, (in, out), the transpose of gptlua's Linear (out, in); names
-- come with or without the "transformer." prefix; the attention's causal
-- mask buffers (attn.bias, attn.masked_bias) are skipped; the head is tied
-- to wte.  The config must be one gptlua's gpt2 computes: GELU with the
-- tanh approximation (gelu_new), LayerNorm eps 1e-5, no layer-index scaling.
local gl = require 'gptlua'
local cjson = require 'cjson'
local ckpt = require 'gptlua.checkpoint'
local tokenizer = require 'gptlua.tokenizer'
local util = require 'gptlua.util'

local M = {}

-- GPT-2's pre-tokenizer (Hugging Face's ByteLevel with use_regex)
M.GPT2_PATTERN = tokenizer.R50K_PATTERN

local function utf8_char(cp)
  if cp < 0x80 then return string.char(cp) end
  return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)  -- cp < 0x800 here
end

-- bytes_to_unicode: byte -> its character, and code point -> byte
local BYTE_CHAR, CP_BYTE = {}, {}
do
  local n = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255)
    local cp = printable and b or 256 + n
    if not printable then n = n + 1 end
    BYTE_CHAR[b], CP_BYTE[cp] = utf8_char(cp), b
  end
end

-- a token's string in the files -> its bytes, or nil and the first code
-- point that is not one of GPT-2's byte characters
local function token_bytes(s)
  local out, i = {}, 1
  while i <= #s do
    local c = s:byte(i)
    local cp, len
    if c < 0x80 then cp, len = c, 1
    elseif c >= 0xC0 and c < 0xE0 and i + 1 <= #s then cp, len = (c - 0xC0) * 64 + (s:byte(i + 1) - 0x80), 2
    else return nil, c end
    local b = CP_BYTE[cp]
    if not b then return nil, cp end
    out[#out + 1] = string.char(b)
    i = i + len
  end
  return table.concat(out)
end

-- The token's string as the files write it (the inverse of token_bytes).
function M.token_string(bytes)
  return (bytes:gsub('.', function(c) return BYTE_CHAR[c:byte()] end))
end

local function read_json(path, what)
  local s = util.read_file(path, what, 3)
  local ok, v = pcall(cjson.decode, s)
  if not ok or type(v) ~= 'table' then error(('%s: %s is not valid JSON'):format(what, path), 3) end
  return v
end

local function exists(path) local f = io.open(path, 'rb'); if f then f:close() end; return f ~= nil end
local function is_dir(path) return exists(path .. '/.') end

-- vocab (string -> id), merges ({a, b} strings in order), specials
-- ({name = id}) -> Tokenizer.  what/where name the source in errors.
local function build(vocab, merges, specials, what, where)
  local by_id, ordinary = {}, {}
  for s, id in pairs(vocab) do
    if type(id) ~= 'number' or id < 0 or id ~= math.floor(id) then
      error(('%s: %s: token %q has id %s, expected an integer >= 0'):format(what, where, s, tostring(id)), 3)
    end
    if by_id[id] then error(('%s: %s: id %d is given to %q and %q'):format(what, where, id, by_id[id], s), 3) end
    by_id[id] = s
  end
  -- ordinary tokens: the 256 byte characters and every merge's result
  for b = 0, 255 do
    if not vocab[BYTE_CHAR[b]] then
      error(('%s: %s has no token for byte 0x%02x (%q): not a byte-level BPE'):format(what, where, b, BYTE_CHAR[b]), 3)
    end
    ordinary[BYTE_CHAR[b]] = true
  end
  local last = -1
  for i, m in ipairs(merges) do
    local a, b = m[1], m[2]
    if not vocab[a] or not vocab[b] then
      error(('%s: %s: merge %d (%s %s) joins a token the vocabulary lacks'):format(what, where, i, a, tostring(b)), 3)
    end
    local id = vocab[a .. b]
    if not id then error(('%s: %s: merge %d (%s %s) makes %q, which the vocabulary lacks'):format(what, where, i, a, b, a .. b), 3) end
    if id <= last then
      error(('%s: %s: merge %d (%s %s) makes id %d after id %d: ids not in merge order would encode differently '
        .. 'under rank order (gptlua applies merges by rank, as tiktoken does)'):format(what, where, i, a, b, id, last), 3)
    end
    last = id
    ordinary[a .. b] = true
  end
  local n_ordinary = 0
  for s in pairs(ordinary) do n_ordinary = n_ordinary + 1; if specials[s] then specials[s] = nil end end
  -- the special tokens: the rest, in id order; those at ids 0, 1, ... come
  -- before the ordinary tokens (front), the others after them
  local extra = {}
  for s, id in pairs(vocab) do if not ordinary[s] then specials[s] = specials[s] or id end end
  for s, id in pairs(specials) do extra[#extra + 1] = { s, id } end
  table.sort(extra, function(x, y) return x[2] < y[2] end)
  local front = 0
  while extra[front + 1] and extra[front + 1][2] == front do front = front + 1 end
  local ranks = {}
  for id = 0, n_ordinary - 1 do
    local s = by_id[front + id]
    if not s or not ordinary[s] then
      error(('%s: %s: ids %d..%d expected to be the bytes and the merges, but id %d is %s'):format(what, where,
        front, front + n_ordinary - 1, front + id, s and ('%q, a special token'):format(s) or 'missing'), 3)
    end
    local bytes, bad = token_bytes(s)
    if not bytes then error(('%s: %s: token %d has character U+%04X, not one of GPT-2\'s byte characters'):format(what, where, front + id, bad), 3) end
    ranks[id + 1] = bytes
  end
  local names = {}
  for k, e in ipairs(extra) do
    local want = k <= front and k - 1 or n_ordinary + k - 1
    if e[2] ~= want then
      error(('%s: %s: special token %q has id %d, expected %d (specials come before or after the %d ordinary tokens, '
        .. 'with no gaps)'):format(what, where, e[1], e[2], want, n_ordinary), 3)
    end
    names[k] = e[1]
  end
  return tokenizer.from_ranks(ranks, { pattern = M.GPT2_PATTERN, special_tokens = names, specials_first = front })
end

-- vocab.json + merges.txt (GPT-2's original files)
function M.load_vocab_merges(vocab_path, merges_path)
  local what = 'hf.load_tokenizer'
  local vocab = read_json(vocab_path, what)
  local text = util.read_file(merges_path, what, 2)
  local merges, line = {}, 0
  for l in (text .. '\n'):gmatch('([^\n]*)\n') do
    line = line + 1
    l = l:gsub('\r$', '')
    if l ~= '' and not (line == 1 and l:match('^#version')) then
      local a, b = l:match('^(%S+) (%S+)$')
      if not a then error(('%s: %s line %d: expected two tokens separated by a space, got %q'):format(what, merges_path, line, l), 2) end
      merges[#merges + 1] = { a, b }
    end
  end
  return build(vocab, merges, {}, what, vocab_path .. ' + ' .. merges_path)
end

-- the ByteLevel pre-tokenizer settings gptlua reproduces, wherever it sits
local function check_pretokenizer(pt, what, where)
  if pt == nil or pt == cjson.null then error(('%s: %s: no pre_tokenizer: expected ByteLevel'):format(what, where), 3) end
  if pt.type == 'Sequence' then
    if #pt.pretokenizers ~= 1 then
      error(('%s: %s: pre_tokenizer Sequence of %d: gptlua reproduces a single ByteLevel'):format(what, where, #pt.pretokenizers), 3)
    end
    pt = pt.pretokenizers[1]
  end
  if pt.type ~= 'ByteLevel' then error(('%s: %s: pre_tokenizer %s: expected ByteLevel'):format(what, where, tostring(pt.type)), 3) end
  if pt.add_prefix_space then error(('%s: %s: ByteLevel add_prefix_space = true is not supported (GPT-2 has false)'):format(what, where), 3) end
  if pt.use_regex == false then error(('%s: %s: ByteLevel use_regex = false is not supported (GPT-2 has true)'):format(what, where), 3) end
end

-- tokenizer.json (the tokenizers library's single file)
function M.load_tokenizer_json(path)
  local what = 'hf.load_tokenizer'
  local j = read_json(path, what)
  local model = j.model
  if type(model) ~= 'table' or model.type ~= 'BPE' then
    error(('%s: %s: model.type expected "BPE", got %s'):format(what, path, type(model) == 'table' and tostring(model.type) or 'none'), 2)
  end
  if j.normalizer ~= nil and j.normalizer ~= cjson.null then
    error(('%s: %s: a normalizer (%s) is not supported: GPT-2 has none'):format(what, path, tostring(j.normalizer.type)), 2)
  end
  check_pretokenizer(j.pre_tokenizer, what, path)
  local merges = {}
  for i, m in ipairs(model.merges or {}) do
    if type(m) == 'string' then
      local a, b = m:match('^(%S+) (%S+)$')
      if not a then error(('%s: %s: model.merges[%d] expected "a b", got %q'):format(what, path, i, m), 2) end
      merges[i] = { a, b }
    elseif type(m) == 'table' and type(m[1]) == 'string' and type(m[2]) == 'string' then
      merges[i] = { m[1], m[2] }
    else
      error(('%s: %s: model.merges[%d] expected "a b" or ["a", "b"]'):format(what, path, i), 2)
    end
  end
  local specials = {}
  for _, t in ipairs(j.added_tokens or {}) do specials[t.content] = t.id end
  return build(model.vocab or {}, merges, specials, what, path)
end

-- A GPT-2 BPE from a directory (tokenizer.json, else vocab.json + merges.txt)
-- or from one of those files.
function M.load_tokenizer(path)
  if type(path) ~= 'string' then error('hf.load_tokenizer: path expected a string', 2) end
  if is_dir(path) then
    if exists(path .. '/tokenizer.json') then return M.load_tokenizer_json(path .. '/tokenizer.json') end
    if exists(path .. '/vocab.json') and exists(path .. '/merges.txt') then
      return M.load_vocab_merges(path .. '/vocab.json', path .. '/merges.txt')
    end
    error(('hf.load_tokenizer: %s has neither tokenizer.json nor vocab.json + merges.txt'):format(path), 2)
  end
  if path:match('vocab%.json$') then return M.load_vocab_merges(path, path:gsub('vocab%.json$', 'merges.txt')) end
  if not exists(path) then error(('hf.load_tokenizer: %s does not exist'):format(path), 2) end
  return M.load_tokenizer_json(path)
end

-- ------------------------------------------------------------------ weights

local CONV1D = { ['attn.c_attn.weight'] = true, ['attn.c_proj.weight'] = true,
                 ['mlp.c_fc.weight'] = true, ['mlp.c_proj.weight'] = true }

-- config.json -> gptlua's gpt2 config, refusing what gpt2 does not compute
function M.gpt2_config(j, where)
  local what = 'hf.load_gpt2'
  local function need(k)
    local v = j[k]
    if type(v) ~= 'number' or v < 1 or v ~= math.floor(v) then
      error(('%s: %s: %s expected a positive integer, got %s'):format(what, where, k, tostring(v)), 3)
    end
    return v
  end
  if j.model_type ~= nil and j.model_type ~= 'gpt2' then
    error(('%s: %s: model_type expected "gpt2", got %q'):format(what, where, tostring(j.model_type)), 3)
  end
  local act = j.activation_function or 'gelu_new'
  if act ~= 'gelu_new' and act ~= 'gelu_pytorch_tanh' then
    error(('%s: %s: activation_function %q is not supported: gpt2 computes GELU with the tanh approximation '
      .. '(gelu_new)'):format(what, where, tostring(act)), 3)
  end
  local eps = j.layer_norm_epsilon or 1e-5
  if math.abs(eps - 1e-5) > 1e-12 then
    error(('%s: %s: layer_norm_epsilon %g is not supported: gpt2 uses 1e-5'):format(what, where, eps), 3)
  end
  local C = need('n_embd')
  if j.n_inner ~= nil and j.n_inner ~= cjson.null and j.n_inner ~= 4 * C then
    error(('%s: %s: n_inner %s is not supported: gpt2 uses 4 * n_embd = %d'):format(what, where, tostring(j.n_inner), 4 * C), 3)
  end
  for _, k in ipairs({ 'scale_attn_by_inverse_layer_idx', 'reorder_and_upcast_attn' }) do
    if j[k] == true then error(('%s: %s: %s = true is not supported'):format(what, where, k), 3) end
  end
  if j.scale_attn_weights == false then error(('%s: %s: scale_attn_weights = false is not supported'):format(what, where), 3) end
  if j.tie_word_embeddings == false then error(('%s: %s: tie_word_embeddings = false is not supported: gpt2 ties its head'):format(what, where), 3) end
  return { n_layer = need('n_layer'), n_head = need('n_head'), n_embd = C, block_size = need('n_positions'),
           vocab_size = need('vocab_size'), bias = true, dropout = 0 }
end

-- The weights of model.safetensors into a gpt2 model (HF names -> gptlua's,
-- Conv1D transposed); the tied head, if stored, must equal wte.
function M.load_gpt2_weights(model, path)
  local what = 'hf.load_gpt2'
  local st = ckpt.load_safetensors(path)
  local sd = {}
  for name, t in pairs(st) do
    local n = name:match('^transformer%.(.*)$') or name
    if n:match('%.attn%.bias$') or n:match('%.attn%.masked_bias$') then
      n = nil
    elseif n == 'lm_head.weight' then
      local wte = st['transformer.wte.weight'] or st['wte.weight']
      if not wte or not gl.same_shape(wte.shape, t.shape) or (wte - t):abs():max():item() ~= 0 then
        error(('%s: %s: lm_head.weight differs from wte.weight: an untied head is not supported'):format(what, path), 2)
      end
      n = nil
    end
    if n then
      local suffix = n:match('^h%.%d+%.(.*)$')
      if suffix and CONV1D[suffix] then
        if #t.shape ~= 2 then error(('%s: %s: %s expected a 2-D Conv1D weight, got %d dimensions'):format(what, path, name, #t.shape), 2) end
        t = t:t()  -- Conv1D (in, out) -> Linear (out, in)
      end
      sd['transformer.' .. n] = t:to(model.transformer.wte.weight.dtype):contiguous()
    end
  end
  local ok, err = pcall(model.load_state_dict, model, sd)
  if not ok then error(('%s: %s: %s'):format(what, path, tostring(err):gsub('^load_state_dict: ', '')), 2) end
  return model
end

-- A gpt2 model from a Hugging Face GPT-2 directory (config.json +
-- model.safetensors).  opts: dtype, device (as gl.tensor's).
function M.load_gpt2(path, opts)
  opts = opts or {}
  if type(path) ~= 'string' then error('hf.load_gpt2: path expected a string', 2) end
  local dir = is_dir(path) and path or path:match('^(.*)/[^/]*$') or '.'
  local weights = is_dir(path) and path .. '/model.safetensors' or path
  if not exists(dir .. '/config.json') then error(('hf.load_gpt2: %s/config.json does not exist'):format(dir), 2) end
  if not exists(weights) then error(('hf.load_gpt2: %s does not exist'):format(weights), 2) end
  local cfg = M.gpt2_config(read_json(dir .. '/config.json', 'hf.load_gpt2'), dir .. '/config.json')
  local model = require('gptlua.models.gpt2').GPT(cfg)
  M.load_gpt2_weights(model, weights)
  if opts.dtype then model:to(opts.dtype) end
  if opts.device then model:to(opts.device) end
  return model, cfg
end

local function write_atomic(path, s, what)
  what = what or 'hf.save_gpt2'
  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then error(('%s: cannot write %s: %s'):format(what, path, tostring(err)), 3) end
  f:write(s); f:close()
  local ok, e2 = os.rename(tmp, path)
  if not ok then os.remove(tmp); error(('%s: cannot write %s: %s'):format(what, path, tostring(e2)), 3) end
end

-- The document token of a tokenizer (GPT-2's <|endoftext|>, else <|bos|>):
-- what config.json names as bos_token_id and eos_token_id
local function document_token(t)
  local name = t.special_tokens['<|endoftext|>'] and '<|endoftext|>' or t.bos_id and '<|bos|>' or nil
  return name, name and t.special_tokens[name]
end

-- Writes a byte-level BPE as Hugging Face's GPT-2 tokenizer files:
-- tokenizer.json (the tokenizers library's), vocab.json + merges.txt (the
-- original pair) and tokenizer_config.json.  Token strings are
-- bytes_to_unicode's, merges in rank order (merge i makes id 256 + i, as
-- gptlua and Hugging Face both apply them), special tokens as added tokens.
-- Only GPT-2's split pattern has this form (Hugging Face's ByteLevel
-- pre-tokenizer is that regex).
function M.save_tokenizer(t, dir)
  if getmetatable(t) ~= tokenizer.Tokenizer or t.kind ~= 'bpe' then
    error('hf.save_tokenizer: tokenizer must be a byte-level BPE (a gptlua Tokenizer of kind bpe)', 2)
  end
  if t.pattern ~= M.GPT2_PATTERN then
    error(('hf.save_tokenizer: the tokenizer splits with %s, expected GPT-2\'s pattern (hf.GPT2_PATTERN): '
      .. 'Hugging Face\'s ByteLevel pre-tokenizer splits only that way'):format(t.pattern and 'another pattern' or 'no pattern'), 2)
  end
  local vocab, by_id = {}, {}
  for id = 0, t.n_ordinary - 1 do
    local s = M.token_string(t:token_bytes(id))
    vocab[s], by_id[id] = id, s
  end
  local merges, lines = {}, { '#version: 0.2' }
  for i, m in ipairs(t:merges()) do
    if m[3] ~= 255 + i then
      error(('hf.save_tokenizer: merge %d makes id %d, expected %d (ids in merge order)'):format(i, m[3], 255 + i), 2)
    end
    merges[i] = by_id[m[1]] .. ' ' .. by_id[m[2]]
    lines[i + 1] = merges[i]
  end
  local added, specials = {}, {}
  for id = t.n_ordinary, t.vocab_size - 1 do
    local name = t:token_bytes(id)
    specials[name] = id
    added[#added + 1] = { id = id, content = name, single_word = false, lstrip = false, rstrip = false,
                          normalized = false, special = true }
  end
  local all = {}
  for k, v in pairs(vocab) do all[k] = v end
  for k, v in pairs(specials) do all[k] = v end
  local byte_level = function(prefix, trim)
    return { type = 'ByteLevel', add_prefix_space = prefix, trim_offsets = trim, use_regex = true }
  end
  local j = { version = '1.0', truncation = cjson.null, padding = cjson.null, added_tokens = added,
              normalizer = cjson.null, pre_tokenizer = byte_level(false, true), post_processor = byte_level(true, false),
              decoder = byte_level(true, true),
              model = { type = 'BPE', dropout = cjson.null, unk_token = cjson.null, continuing_subword_prefix = '',
                        end_of_word_suffix = '', fuse_unk = false, byte_fallback = false, vocab = vocab, merges = merges } }
  if #added == 0 then j.added_tokens = setmetatable({}, cjson.array_mt) end
  if #merges == 0 then j.model.merges = setmetatable({}, cjson.array_mt) end
  require('gptlua.checkpoint').mkdir_p(dir)
  write_atomic(dir .. '/tokenizer.json', cjson.encode(j), 'hf.save_tokenizer')
  write_atomic(dir .. '/vocab.json', cjson.encode(all), 'hf.save_tokenizer')
  write_atomic(dir .. '/merges.txt', table.concat(lines, '\n') .. '\n', 'hf.save_tokenizer')
  local name = document_token(t)
  local tc = { tokenizer_class = 'GPT2Tokenizer', add_prefix_space = false, model_max_length = 1024 }
  if name then tc.bos_token, tc.eos_token, tc.unk_token = name, name, name end
  write_atomic(dir .. '/tokenizer_config.json', cjson.encode(tc), 'hf.save_tokenizer')
end

-- Writes a gpt2 model as Hugging Face's GPT2LMHeadModel.save_pretrained
-- does: config.json and model.safetensors (float32, "transformer." names,
-- Conv1D layout, the tied head left out).  opts.tokenizer: its files too
-- (hf.save_tokenizer) and its document token (<|endoftext|>, else <|bos|>)
-- as bos_token_id and eos_token_id, which config.json otherwise leaves null
-- (a model of gptlua's own vocabulary has no GPT-2 token 50256).
function M.save_gpt2(model, dir, opts)
  opts = opts or {}
  local cfg = model.config
  if type(cfg) ~= 'table' or not model.transformer or not model.transformer.wpe then
    error('hf.save_gpt2: model expected a gpt2 model (models.gpt2)', 2)
  end
  if cfg.bias == false then error('hf.save_gpt2: a gpt2 model without biases has no Hugging Face GPT-2 form', 2) end
  if cfg.moe then error('hf.save_gpt2: a gpt2 model with mixture-of-experts blocks has no Hugging Face GPT-2 form', 2) end
  require('gptlua.checkpoint').mkdir_p(dir)
  local tensors = {}
  for name, t in pairs(model:state_dict()) do
    local n = name:match('^transformer%.(.*)$')
    if n then
      local suffix = n:match('^h%.%d+%.(.*)$')
      t = t:to('cpu'):to('float32')
      if suffix and CONV1D[suffix] then t = t:t() end
      tensors[name] = t:contiguous()
    end
  end
  ckpt.save_safetensors(dir .. '/model.safetensors', tensors, { format = 'pt' })
  local j = { model_type = 'gpt2', architectures = { 'GPT2LMHeadModel' }, activation_function = 'gelu_new',
              n_layer = cfg.n_layer, n_head = cfg.n_head, n_embd = cfg.n_embd, n_positions = cfg.block_size,
              n_ctx = cfg.block_size, vocab_size = cfg.vocab_size, layer_norm_epsilon = 1e-5,
              initializer_range = 0.02, scale_attn_weights = true, tie_word_embeddings = true,
              torch_dtype = 'float32', attn_pdrop = cfg.dropout or 0, embd_pdrop = cfg.dropout or 0,
              resid_pdrop = cfg.dropout or 0, bos_token_id = cjson.null, eos_token_id = cjson.null }
  if opts.tokenizer then
    local _, id = document_token(opts.tokenizer)
    if opts.tokenizer.vocab_size > cfg.vocab_size then
      error(('hf.save_gpt2: the tokenizer has %d tokens, the model\'s vocab_size is %d'):format(
        opts.tokenizer.vocab_size, cfg.vocab_size), 2)
    end
    if id then j.bos_token_id, j.eos_token_id = id, id end
  end
  write_atomic(dir .. '/config.json', cjson.encode(j))
  if opts.tokenizer then M.save_tokenizer(opts.tokenizer, dir) end
end

-- every entry point checks its arguments (gptlua.check)
require('gptlua.check').wrap_table(M, { load_tokenizer = 'path:string', load_tokenizer_json = 'path:string',
  load_vocab_merges = 'vocab_path:string, merges_path:string', load_gpt2 = 'path:string, opts:opts?',
  load_gpt2_weights = 'model:any, path:string', save_gpt2 = 'model:any, dir:string, opts:opts?', token_string = 'bytes:string',
  save_tokenizer = 'tokenizer:any, dir:string' }, 'hf.')

return M
