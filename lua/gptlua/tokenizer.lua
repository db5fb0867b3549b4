-- gptlua.tokenizer — byte-level BPE (GPT-4 style) and character tokenizers,
-- backed by engine/tokenizer.c.
--
--   local tok = require 'gptlua.tokenizer'
--   local t = tok.char(text)                          -- distinct bytes of text
--   local t = tok.train({'data/a.txt', ...}, 4096, {special_tokens = {'<|bos|>'}})
--   local t = tok.load(path); t:save(path)            -- path (tiktoken ranks) + path..'.json'
--   t.vocab_size, t.bos_id, t.kind ('bpe' | 'char'), t.n_special
--   t:encode(text [, {tensor=true, bos=true, prepend=id}])  -> Lua table (or int32 tensor)
--   t:encode_batch(texts [, opts])                    -> list of tables (or tensors)
--   t:decode(ids)                                     -> string (ids: table or tensor)
--   t:token_bytes(id), t:split(text), t:merges(), t:special_id(name)
--
-- Ids are 0-based (as stored in tensors).  Special tokens are never produced
-- by encoding plain text; `bos=true` prepends BOS explicitly.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local ffi, lib, check, check_ptr = G.ffi, G.lib, G.check, G.check_ptr

local M = {}
local Tokenizer = {}
Tokenizer.__index = Tokenizer
Tokenizer.__name = 'Tokenizer'
M.Tokenizer = Tokenizer

M.GPT4_PATTERN = ffi.string(lib.gl_tok_gpt4_pattern())
M.R50K_PATTERN = ffi.string(lib.gl_tok_r50k_pattern())   -- GPT-2's (r50k_base, p50k_base)
M.O200K_PATTERN = ffi.string(lib.gl_tok_o200k_pattern())

local len_buf = ffi.new('int64_t[1]')

local function cstrings(list, what)
  local n = #list
  local arr = ffi.new('const char *[?]', math.max(n, 1))
  for i, s in ipairs(list) do
    if type(s) ~= 'string' then error(('%s: entry %d expected a string, got %s'):format(what, i, type(s)), 3) end
    arr[i - 1] = s
  end
  return arr, n
end

local function wrap(p)
  check_ptr(p, 3)
  local c = ffi.gc(p, lib.gl_tok_free)
  local self = setmetatable({ c = c }, Tokenizer)
  self.vocab_size = lib.gl_tok_vocab_size(c)
  self.n_ordinary = lib.gl_tok_n_ordinary(c)
  self.n_special = lib.gl_tok_n_special(c)
  self.kind = lib.gl_tok_is_char(c) == 1 and 'char' or 'bpe'
  local pat = lib.gl_tok_pattern(c)
  self.pattern = pat ~= nil and ffi.string(pat) or nil
  self.unicode_version = ffi.string(lib.gl_tok_unicode_version(c))
  self.special_tokens = {}
  for id = self.n_ordinary, self.vocab_size - 1 do
    self.special_tokens[self:token_bytes(id)] = id
  end
  self.bos_id = self.special_tokens['<|bos|>']
  return self
end

-- Special tokens first.  Some files (Hugging Face's, for models that put
-- <|endoftext|> or <pad> at id 0) give the first `front` ids to special
-- tokens and the ordinary ones after them.  The engine keeps ordinary
-- tokens at 0..n-1 and specials after them, so such a tokenizer maps ids
-- where they cross its boundary: outside, specials 0..front-1, ordinary
-- front..front+n-1, any later specials where they were.
local function engine_id(self, e)
  local k, n = self.front, self.n_ordinary
  if not k or e < 0 then return e end
  if e < k then return n + e elseif e < k + n then return e - k end
  return e
end
local function outside_id(self, i)
  local k, n = self.front, self.n_ordinary
  if not k then return i end
  if i < n then return i + k elseif i < n + k then return i - n end
  return i
end
-- an int32 tensor of the engine's ids, mapped in place to outside ids
local function map_out(self, t)
  if not self.front then return t end
  local p = ffi.cast('int32_t *', t:data_ptr())
  for i = 0, t:numel() - 1 do p[i] = outside_id(self, p[i]) end
  return t
end

local function special_list(opts, what)
  local sp = opts and opts.special_tokens or {}
  if type(sp) ~= 'table' then error(what .. ': special_tokens expected a list of strings', 3) end
  return cstrings(sp, what .. ': special_tokens')
end

-- A BPE tokenizer from its ranks, as tiktoken holds one: ranks[i] is the
-- byte string of token i-1; every byte needs a one-byte token and each
-- longer token must be a merge of two of lower rank.  opts: pattern
-- (default GPT-4's, '' for none), special_tokens (ids after the ranks).
function M.from_ranks(ranks, opts)
  opts = opts or {}
  local n = #ranks
  local arr, lens = ffi.new('const char *[?]', math.max(n, 1)), ffi.new('int64_t[?]', math.max(n, 1))
  for i, s in ipairs(ranks) do
    if type(s) ~= 'string' then error(('tokenizer.from_ranks: ranks[%d] expected a string, got %s'):format(i, type(s)), 2) end
    arr[i - 1], lens[i - 1] = s, #s
  end
  local sp, ns = special_list(opts, 'tokenizer.from_ranks')
  local t = wrap(lib.gl_tok_from_ranks(opts.pattern, n, arr, lens, ns, sp))
  -- specials_first = k: the first k special tokens take ids 0..k-1, the
  -- ranks follow them (see engine_id)
  local k = opts.specials_first
  if k and k > 0 then
    if k > t.n_special then
      error(('tokenizer.from_ranks: specials_first is %d, but there are %d special tokens'):format(k, t.n_special), 2)
    end
    t.front = k
    local by_name = {}
    for name, id in pairs(t.special_tokens) do by_name[name] = outside_id(t, id) end
    t.special_tokens, t.bos_id = by_name, by_name['<|bos|>']
  end
  return t
end

-- Character-level tokenizer over the distinct bytes of text.
function M.char(text, opts)
  if type(text) ~= 'string' then error('tokenizer.char: text expected a string, got ' .. type(text), 2) end
  local arr, n = special_list(opts, 'tokenizer.char')
  return wrap(lib.gl_tok_char(text, #text, n, arr))
end

-- a merge list entry as an error message shows it: {97, 'x'} or the value
local function show_merge(m)
  local describe = require('gptlua.check').describe
  if type(m) ~= 'table' or getmetatable(m) ~= nil then return describe(m) end
  local parts = {}
  for j = 1, math.min(#m, 3) do parts[j] = describe(m[j]) end
  return '{' .. table.concat(parts, ', ') .. (#m > 3 and ', ...}' or '}')
end

-- A BPE tokenizer from a merge list {{left, right}, ...} (merge i makes id 255+i).
function M.from_merges(merges, opts)
  opts = opts or {}
  local pairs_buf = ffi.new('int32_t[?]', math.max(2 * #merges, 1))
  for i, m in ipairs(merges) do
    -- each merge a pair of ids that exist before it (the bytes, earlier
    -- merges); the engine refuses the rest (a pair merged twice)
    local ok = type(m) == 'table' and getmetatable(m) == nil and #m == 2
    for j = 1, 2 do
      local id = ok and m[j]
      ok = ok and type(id) == 'number' and id == math.floor(id) and id >= 0 and id < 255 + i
    end
    if not ok then
      error(('tokenizer.from_merges: merges[%d] must be a pair {left, right} of ids in [0, %d] (the bytes and '
        .. 'earlier merges), got %s'):format(i, 254 + i, show_merge(m)), 2)
    end
    pairs_buf[2 * i - 2] = m[1]; pairs_buf[2 * i - 1] = m[2]
  end
  local arr, n = special_list(opts, 'tokenizer.from_merges')
  return wrap(lib.gl_tok_from_merges(opts.pattern, #merges, pairs_buf, n, arr))
end

local function read_file(path, what) return require('gptlua.util').read_file(path, what, 2) end  -- a tail call

-- A string is a file path when opts.texts is not set, it has no newline and
-- a file of that name exists; otherwise it is the text itself.
local function is_path(s, opts)
  if opts.texts then return false end
  if #s > 4096 or s:find('\n', 1, true) then return false end
  local f = io.open(s, 'rb')
  if f then f:close() return true end
  return false
end

-- Trains byte-level BPE.  sources: a string or a list of strings (paths or
-- texts, see is_path).  vocab_size counts 256 bytes + merges + specials.
-- opts: special_tokens = {...}, pattern = regex (default GPT-4; '' = none),
-- texts = true (strings are texts), verbose = true (prints a summary),
-- quiet = true (no warning when the corpus runs out of pairs).
function M.train(sources, vocab_size, opts)
  opts = opts or {}
  if type(sources) == 'string' then sources = { sources } end
  if type(sources) ~= 'table' then error('tokenizer.train: sources expected a string or a list, got ' .. type(sources), 2) end
  if type(vocab_size) ~= 'number' then error('tokenizer.train: vocab_size expected a number', 2) end
  local tr = check_ptr(lib.gl_bpe_trainer_new(opts.pattern), 2)
  tr = ffi.gc(tr, lib.gl_bpe_trainer_free)
  local bytes, t0 = 0, require('gptlua.libc').cpu_seconds()
  for i, s in ipairs(sources) do
    if type(s) ~= 'string' then error(('tokenizer.train: source %d expected a string, got %s'):format(i, type(s)), 2) end
    local text = is_path(s, opts) and read_file(s, 'tokenizer.train') or s
    check(lib.gl_bpe_trainer_add(tr, text, #text), 2)
    bytes = bytes + #text
  end
  local arr, n = special_list(opts, 'tokenizer.train')
  local t = wrap(lib.gl_bpe_trainer_train(tr, vocab_size, n, arr))
  ffi.gc(tr, nil); lib.gl_bpe_trainer_free(tr)
  if t.vocab_size < vocab_size and not opts.quiet then
    io.stderr:write(('tokenizer.train: the corpus ran out of pairs to merge: vocab_size is %d, not %d\n')
      :format(t.vocab_size, vocab_size))
  end
  if opts.verbose then
    print(('tokenizer.train: %.2f MB, vocab %d, %.2f s CPU'):format(bytes / 1e6, t.vocab_size, require('gptlua.libc').cpu_seconds() - t0))
  end
  return t
end

-- A tokenizer made with other Unicode tables than this build's PCRE2 splits
-- characters added in between differently: said once, on stderr.
-- A ranks file without its sidecar (path.json) is read when it is one of
-- tiktoken's standard encodings (r50k_base, cl100k_base, o200k_base, known
-- by their ranks, each with its pattern), else refused: opts.pattern says
-- how such a file splits text (and overrides a sidecar's).
function M.load(path, opts)
  if type(path) ~= 'string' then error('tokenizer.load: path expected a string', 2) end
  local pattern = opts and opts.pattern
  local t = wrap(pattern and lib.gl_tok_load_pattern(path, pattern) or lib.gl_tok_load(path))
  local here = ffi.string(lib.gl_tok_unicode_version(nil))
  if t.kind == 'bpe' and t.pattern and t.unicode_version ~= here then
    io.stderr:write(('tokenizer.load: %s was made with Unicode %s tables, this build has %s: characters added '
      .. 'in between may split differently\n'):format(path, t.unicode_version, here))
  end
  return t
end

function Tokenizer:save(path)
  if type(path) ~= 'string' then error('Tokenizer:save: path expected a string', 2) end
  if self.front then
    error(('Tokenizer:save: this tokenizer puts %d special tokens before its ranks, which gptlua\'s format '
      .. '(specials after the ranks) cannot say: keep the files it was read from'):format(self.front), 2)
  end
  check(lib.gl_tok_save(self.c, path), 2)
end

function Tokenizer:special_id(name) return self.special_tokens[name] end

-- The bytes of a token (a special token's name for a special id).
function Tokenizer:token_bytes(id)
  local p = lib.gl_tok_token_bytes(self.c, engine_id(self, id), len_buf)
  check_ptr(p, 2)
  return ffi.string(p, len_buf[0])
end

-- the id to put first, as the engine numbers it (-1: none)
local function prepend_id(self, opts, what)
  if opts.prepend then return engine_id(self, opts.prepend) end
  if opts.bos then
    if not self.bos_id then error(what .. ': bos=true but this tokenizer has no <|bos|> token', 3) end
    return engine_id(self, self.bos_id)
  end
  return -1
end

local function ids_table(t)
  local n = t:numel()
  local p = ffi.cast('const int32_t *', t:data_ptr())
  local out = {}
  for i = 1, n do out[i] = p[i - 1] end
  return out
end

-- text -> ids (Lua table of 0-based ids, or an int32 tensor with tensor=true)
-- allowed_special = 'all' or a list of names: those special tokens are
-- recognised in the text (as tiktoken's encode does); otherwise text never
-- produces a special token.
local function encode_with_specials(self, text, opts)
  local names = {}
  if opts.allowed_special == 'all' then
    for name in pairs(self.special_tokens) do names[#names + 1] = name end
  elseif type(opts.allowed_special) == 'table' then
    for i, name in ipairs(opts.allowed_special) do
      if not self.special_tokens[name] then
        error(('Tokenizer:encode: allowed_special[%d] %q is not a special token of this tokenizer'):format(i, tostring(name)), 3)
      end
      names[#names + 1] = name
    end
  else
    error("Tokenizer:encode: allowed_special expected 'all' or a list of names, got " .. type(opts.allowed_special), 3)
  end
  local ids, pos = {}, 1
  local first = prepend_id(self, opts, 'Tokenizer:encode')
  if first >= 0 then ids[1] = outside_id(self, first) end
  while pos <= #text do
    local at, name = nil, nil
    for _, n in ipairs(names) do
      local s = text:find(n, pos, true)
      if s and (not at or s < at or (s == at and #n > #name)) then at, name = s, n end
    end
    local piece = text:sub(pos, (at or #text + 1) - 1)
    if #piece > 0 then
      local t = map_out(self, Tensor.wrap(check_ptr(lib.gl_tok_encode(self.c, piece, #piece, -1), 3)))
      for _, id in ipairs(ids_table(t)) do ids[#ids + 1] = id end
    end
    if not at then break end
    ids[#ids + 1] = self.special_tokens[name]
    pos = at + #name
  end
  return ids
end

function Tokenizer:encode(text, opts)
  opts = opts or {}
  if type(text) ~= 'string' then error('Tokenizer:encode: text expected a string, got ' .. type(text), 2) end
  if opts.allowed_special ~= nil then
    local ids = encode_with_specials(self, text, opts)
    if opts.tensor then return require('gptlua').tensor(ids, { dtype = 'int32' }) end
    return ids
  end
  local t = Tensor.wrap(check_ptr(lib.gl_tok_encode(self.c, text, #text, prepend_id(self, opts, 'Tokenizer:encode')), 2))
  map_out(self, t)
  if opts.tensor then return t end
  return ids_table(t)
end

-- list of texts -> list of id tables (or tensors), documents on all threads
function Tokenizer:encode_batch(texts, opts)
  opts = opts or {}
  local arr, n = cstrings(texts, 'Tokenizer:encode_batch')
  local lens = ffi.new('int64_t[?]', math.max(n, 1))
  for i = 1, n do lens[i - 1] = #texts[i] end
  local out = ffi.new('gl_tensor *[?]', math.max(n, 1))
  check(lib.gl_tok_encode_batch(self.c, n, arr, lens, prepend_id(self, opts, 'Tokenizer:encode_batch'), out), 2)
  local res = {}
  for i = 1, n do
    local t = map_out(self, Tensor.wrap(out[i - 1]))
    res[i] = opts.tensor and t or ids_table(t)
  end
  return res
end

-- ids (Lua table or integer tensor of any shape, flattened) -> string
function Tokenizer:decode(ids)
  local n, buf, keep
  if type(ids) == 'table' and getmetatable(ids) ~= Tensor then
    n = #ids
    buf = ffi.new('int32_t[?]', math.max(n, 1))
    for i = 1, n do
      local v = ids[i]
      if type(v) ~= 'number' or v ~= math.floor(v) or v < -2147483648 or v > 2147483647 then
        error(('Tokenizer:decode: ids[%d] expected an integer id, got %s'):format(i, tostring(v)), 2)
      end
      buf[i - 1] = engine_id(self, v)
    end
  elseif type(ids) == 'table' then
    require 'gptlua' -- tensor conversions (to, contiguous) live in the full library
    keep = ids
    if keep.device ~= 'cpu' then keep = keep:to('cpu') end
    if keep.dtype ~= 'int32' then
      if keep:is_floating() then error('Tokenizer:decode: ids expected an integer tensor, got ' .. keep.dtype, 2) end
      keep = keep:to('int32')
    end
    keep = keep:contiguous()
    n = keep:numel()
    buf = ffi.cast('const int32_t *', keep:data_ptr())
    if self.front then  -- a copy: the caller's tensor stays as it is
      local mapped = ffi.new('int32_t[?]', math.max(n, 1))
      for i = 0, n - 1 do mapped[i] = engine_id(self, buf[i]) end
      buf = mapped
    end
  else
    error('Tokenizer:decode: ids expected a table or a tensor, got ' .. type(ids), 2)
  end
  local len = lib.gl_tok_decoded_len(self.c, buf, n)
  if len < 0 then error(ffi.string(lib.gl_last_error()), 2) end
  local out = ffi.new('char[?]', math.max(tonumber(len), 1))
  check(lib.gl_tok_decode(self.c, buf, n, out), 2)
  return ffi.string(out, len)
end

-- the regex chunks of text (a list of strings)
function Tokenizer:split(text)
  local ends = Tensor.wrap(check_ptr(lib.gl_tok_split(self.c, text, #text), 2))
  local p = ffi.cast('const int64_t *', ends:data_ptr())
  local out, prev = {}, 0
  for i = 0, ends:numel() - 1 do
    local e = tonumber(p[i])
    out[#out + 1] = text:sub(prev + 1, e)
    prev = e
  end
  return out
end

-- merges in rank order: {{left, right, id}, ...}
function Tokenizer:merges()
  local l, r, id = ffi.new('int32_t[1]'), ffi.new('int32_t[1]'), ffi.new('int32_t[1]')
  local out = {}
  for i = 0, lib.gl_tok_n_merges(self.c) - 1 do
    check(lib.gl_tok_merge(self.c, i, l, r, id), 2)
    out[#out + 1] = { outside_id(self, l[0]), outside_id(self, r[0]), outside_id(self, id[0]) }
  end
  return out
end

-- Largest prefix length of text that can be encoded on its own without
-- changing the result (0: none); for streaming big files.
function Tokenizer:safe_cut(text)
  return tonumber(lib.gl_tok_safe_cut(self.c, text, #text))
end

function Tokenizer:__tostring()
  return ('Tokenizer(%s, vocab_size=%d, specials=%d)'):format(self.kind, self.vocab_size, self.n_special)
end

-- every entry point checks its arguments (gptlua.check): "tokenizer.train: vocab_size must be ..."
local check = require 'gptlua.check'
check.options('load_opts', { pattern = 'string?' })
check.wrap_table(M, { char = 'text:string, opts:opts?', from_merges = 'merges:opts, opts:opts?', from_ranks = 'ranks:opts, opts:opts?',
  train = 'sources:any, vocab_size:count, opts:opts?', load = 'path:string, opts:load_opts?' }, 'tokenizer.')
check.wrap_table(Tokenizer, { save = 'self:opts, path:string', special_id = 'self:opts, name:string',
  token_bytes = 'self:opts, id:integer', encode = 'self:opts, text:string, opts:opts?',
  encode_batch = 'self:opts, texts:opts, opts:opts?', decode = 'self:opts, ids:any', split = 'self:opts, text:string',
  safe_cut = 'self:opts, text:string', merges = 'self:opts' }, 'Tokenizer:')

return M
