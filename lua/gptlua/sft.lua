-- gptlua.sft — supervised fine-tuning on conversations (recipes/sft.lua
-- runs it):
--
--   * conversations: JSONL, one {"messages": [{"role", "content"}, ...]} a
--     line, rendered through the chat template (gptlua.chat), which gives
--     each token a mask: only the assistant's tokens (and its
--     <|assistant_end|>) are targets, every other target is -1, the index
--     the loss ignores;
--   * the tokenizer gains the template's special tokens when it lacks
--     them (M.with_chat_tokens), and the model's embedding and head grow
--     rows for them (M.grow_state: the mean of the existing rows);
--   * packing: conversations are laid one after another into rows of
--     block_size + 1 tokens (a conversation starts a new row when it does
--     not fit what is left; one longer than a row is cut), each position
--     carrying its conversation's segment id, so attention never crosses
--     from one conversation into another (gl.with_segments: the attention
--     kernels' document masking) and no target is a token of the next
--     conversation.  Padding at a row's end is a segment of its own with
--     no targets.
local gl = require 'gptlua'
local cjson = require 'cjson'
local chat = require 'gptlua.chat'
local tokenizer = require 'gptlua.tokenizer'

local M = {}

local function fail(msg) error('sft: ' .. msg, 0) end

-- the conversations of a JSONL file; a bad line stops with one line naming it
function M.load_conversations(path)
  local f, err = io.open(path, 'rb')
  if not f then fail(('cannot open the conversations %s'):format(err)) end
  local out, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:match('%S') then
      local where = ('%s, line %d'):format(path, n)
      local ok, rec = pcall(cjson.decode, line)
      if not ok then f:close(); fail(('%s: expected a JSON object {"messages": [...]}, got %q'):format(where, line:sub(1, 60))) end
      local ok2, e = pcall(chat.check_conversation, rec, where)
      if not ok2 then f:close(); fail(e) end
      out[#out + 1] = rec.messages
    end
  end
  f:close()
  if #out == 0 then fail(('%s holds no conversations'):format(path)) end
  return out
end

-- with_chat_tokens(tok) -> tok2, added: the tokenizer with the chat
-- template's special tokens after its own (every existing id keeps its
-- bytes; checked), and the names added (empty: tok itself comes back)
function M.with_chat_tokens(tok)
  local have, added = {}, {}
  for name in pairs(tok.special_tokens or {}) do have[name] = true end
  for _, name in ipairs(chat.SPECIALS) do if not have[name] then added[#added + 1] = name end end
  if #added == 0 then return tok, added end
  -- the existing specials in id order, then the new ones
  local specials = {}
  for name, id in pairs(tok.special_tokens or {}) do specials[#specials + 1] = { id, name } end
  table.sort(specials, function(a, b) return a[1] < b[1] end)
  local names = {}
  for i, s in ipairs(specials) do names[i] = s[2] end
  for _, name in ipairs(added) do names[#names + 1] = name end
  local out
  if tok.kind == 'char' then
    local chars = {}
    for id = 0, tok.vocab_size - 1 do
      local b = tok:token_bytes(id)
      if not (tok.special_tokens or {})[b] then chars[#chars + 1] = b end
    end
    out = tokenizer.char(table.concat(chars), { special_tokens = names })
  elseif tok.kind == 'bpe' and not tok.front then
    -- its ranks as they are (GPT-2's byte tokens are not in byte order), then the specials
    local ranks = {}
    for id = 0, tok.vocab_size - #specials - 1 do ranks[id + 1] = tok:token_bytes(id) end
    out = tokenizer.from_ranks(ranks, { special_tokens = names, pattern = tok.pattern or '' })
  else
    fail('this tokenizer (its special tokens come before its ranks) cannot gain the chat tokens; give one that has them')
  end
  for id = 0, tok.vocab_size - 1 do
    if out:token_bytes(id) ~= tok:token_bytes(id) then
      fail(('adding the chat tokens moved token %d; give a tokenizer that has them'):format(id))
    end
  end
  return out, added
end

-- the model's state with the checkpoint's values: equal shapes copied, a
-- tensor with more rows (the vocabulary grew) takes the old rows and the
-- mean of them in each new one.  Returns the state dict to load.
function M.grow_state(model, old)
  local sd = model:state_dict()
  local out = {}
  for name, want in pairs(sd) do
    local src = old[name]
    if src == nil then fail(('the checkpoint has no %s'):format(name)) end
    local same = #src.shape == #want.shape
    for d = 2, #want.shape do same = same and src.shape[d] == want.shape[d] end
    if not same or src.shape[1] > want.shape[1] then
      fail(('%s has shape {%s} in the checkpoint, the model {%s}'):format(name, table.concat(src.shape, ','),
        table.concat(want.shape, ',')))
    end
    if src.shape[1] == want.shape[1] then out[name] = src
    else
      local t = gl.zeros(want.shape, { dtype = src.dtype })
      local n = src.shape[1]
      t:narrow(1, 1, n):copy_(src)
      local mean = gl.mean(src:to('float64'), 1, true):to(src.dtype)
      for r = n + 1, want.shape[1] do t:narrow(1, r, 1):copy_(mean) end
      out[name] = t
    end
  end
  return out
end

-- pack(convs, tok, T) -> rows {x, y, seg} (lists of T), and a count of conversations cut
function M.pack(convs, tok, T)
  local rows, cut = {}, 0
  local cur, curmask, curseg, doc = {}, {}, {}, 0
  local function flush()
    if #cur == 0 then return end
    local x, y, seg = {}, {}, {}
    local pad = cur[#cur]
    doc = doc + 1
    for t = 1, T do
      x[t] = cur[t] or pad
      seg[t] = curseg[t] or doc  -- the padding: a segment of its own
      -- a target: the next token, when it is the same conversation's and the assistant's
      local nxt = t + 1
      y[t] = (cur[nxt] and curseg[nxt] == curseg[t] and curmask[nxt] == 1) and cur[nxt] or -1
    end
    rows[#rows + 1] = { x = x, y = y, seg = seg }
    cur, curmask, curseg = {}, {}, {}
  end
  for i, msgs in ipairs(convs) do
    local ids, mask = chat.render(tok, msgs, 'sft: conversation ' .. i)
    if #ids > T + 1 then
      cut = cut + 1
      for k = #ids, T + 2, -1 do ids[k], mask[k] = nil, nil end
    end
    if #cur + #ids > T + 1 then flush() end
    doc = doc + 1
    for k = 1, #ids do cur[#cur + 1], curmask[#curmask + 1], curseg[#curseg + 1] = ids[k], mask[k], doc end
  end
  flush()
  return rows, cut
end

-- a loader over packed rows in the trainer's interface: next_batch() -> x,
-- y (B, T) int64 on device, its rows in a seeded order, epoch after epoch;
-- M.segments_of[x] is the batch's segment ids (a weak table: x's lifetime)
M.segments_of = setmetatable({}, { __mode = 'k' })
local Loader = {}
Loader.__index = Loader

function M.loader(rows, opts)
  if #rows == 0 then fail('no rows to load') end
  local self = setmetatable({ rows = rows, batch_size = opts.batch_size, device = opts.device or 'cpu',
    seed = opts.seed or 1337, pos = 0 }, Loader)
  return self
end

-- the order of epoch e: a permutation of the rows from a seeded generator
function Loader:order(e)
  local n = #self.rows
  local p = {}
  for i = 1, n do p[i] = i end
  local u = gl.rand({ n }, { seed = self.seed, offset = e * n, dtype = 'float64' }):tolist()
  for i = n, 2, -1 do
    local j = math.floor(u[i] * i) + 1
    p[i], p[j] = p[j], p[i]
  end
  return p
end

function Loader:next_batch()
  local n, B = #self.rows, self.batch_size
  local x, y, seg = {}, {}, {}
  for b = 1, B do
    local e, i = math.floor(self.pos / n), self.pos % n
    if not self.cache or self.cache.e ~= e then self.cache = { e = e, p = self:order(e) } end
    local r = self.rows[self.cache.p[i + 1]]
    x[b], y[b], seg[b] = r.x, r.y, r.seg
    self.pos = self.pos + 1
  end
  local opt = { dtype = 'int64', device = self.device }
  local xt = gl.tensor(x, opt)
  M.segments_of[xt] = gl.tensor(seg, opt)
  return xt, gl.tensor(y, opt)
end

function Loader:state() return { pos = self.pos } end
function Loader:set_state(st) self.pos = st.pos or 0 end
function Loader:close() end

-- model's forward runs every attention with the segment ids of its batch
-- (M.segments_of); a forward with a KV cache or of another batch runs as it was
function M.mask_documents(model)
  local forward = model.forward
  model.forward = function(self, idx, targets, caches)
    local seg = not caches and M.segments_of[idx] or nil
    if seg then return gl.with_segments(seg, forward, self, idx, targets, caches) end
    return forward(self, idx, targets, caches)
  end
  return model
end

return M
