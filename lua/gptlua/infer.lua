-- gptlua.infer — inference on a trained model: loading one, and the engine
-- that generates from it with a KV cache.
--
--   local infer = require 'gptlua.infer'
--   local m = infer.load('runs/shakespeare')         -- {model, tokenizer, cfg, path}
--   local e = infer.Engine.new(m.model, m.tokenizer)
--   local out = e:generate(m.tokenizer:encode('ROMEO:'), { n = 4, max_tokens = 100,
--     temperature = 0.8, top_k = 50, top_p = 0.95, seed = 1, stop = { id, ... },
--     on_token = function(row, id) ... end })
--   -- out[row] = {ids = {...}, logprobs = {...}, finish = 'stop' | 'length'}
--
-- Generation (nanochat's engine): the prompt is prefilled once, as one
-- forward over its tokens with a batch of one into a KV cache; the cache is
-- copied to n rows, one per sample, and every step decodes one token of
-- each row (one forward of (n, 1) tokens).  A list of prompts is prefilled
-- as one left-padded batch (padded_caches below).  On a GPU the decode
-- step is replayed as a CUDA graph (gptlua.infer_graph).  A row ends at one of the stop
-- tokens (not part of its ids) or when max_tokens or the context
-- (block_size) runs out.  Each token comes with its log-probability under
-- the model (temperature 1, no top-k or top-p): the decode step's logits
-- through the training loss's cross-entropy kernel (gptlua.eval.token_nats
-- computes the same over a whole sequence), what a policy-gradient step
-- compares against.
--
-- Sampling per row: logits / temperature, the top_k highest, then the
-- smallest set of the highest whose probabilities sum to top_p, then one
-- draw from a uniform number of the counter-based generator keyed by seed
-- (and the step), so a seed repeats a sample on any machine.  temperature
-- 0 takes the highest logit (the first of equal ones).
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local check = require 'gptlua.check'

local M = {}

local function fail(msg) error(msg, 0) end

-- ------------------------------------------------------------ loading

-- load(path, opts) -> {model, tokenizer, cfg, path}: path is a run (its
-- latest checkpoint; a run's name is its newest run with a checkpoint), its
-- checkpoints/ directory or one checkpoint; opts.hf = true reads path as a
-- Hugging Face GPT-2 directory.  opts.device (default: the default device),
-- opts.what (the command, for messages).
function M.load(path, opts)
  opts = opts or {}
  local what = opts.what or 'load'
  local device = opts.device or gl.default_device()
  if opts.hf then
    local hf = require 'gptlua.hf'
    local model = hf.load_gpt2(path, { device = device })
    return { model = model, tokenizer = hf.load_tokenizer(path), cfg = { model = 'gpt2', device = device }, path = path }
  end
  local ckpt = require 'gptlua.checkpoint'
  local run, note = require('gptlua.runs').resolve(path, function(d) return ckpt.resolve('latest', d .. '/checkpoints') ~= nil end)
  if note then io.stderr:write(what, ': ', note, '\n') end
  local cp = ckpt.resolve('latest', run .. '/checkpoints') or ckpt.resolve('latest', run)
  if not cp and ckpt.exists(run .. '/state.json') then cp = run end
  if not cp then fail(('%s: no checkpoint in %s (expected a run directory, its checkpoints/ or a checkpoint)'):format(what, run)) end
  local c = ckpt.load(cp)
  local cfg = c.state.config
  -- a nanochat checkpoint from before the model's versions is the first-release model
  if cfg.model == 'nanochat' and cfg.nanochat == nil then cfg.nanochat = { version = 'v1' } end
  cfg.device = device
  -- one process: the run's layout is of no use here (checkpoints hold whole tensors)
  cfg.dist, cfg.tp, cfg.dp, cfg.cp, cfg.pp, cfg.sp = 'none', 1, 0, 1, 1, false
  cfg.resume, cfg.eval_tasks = '', ''
  local t = require('gptlua.train').new(cfg, { '--quiet' })
  t.model:load_state_dict(c.model)
  -- a fine-tuned model (recipes/sft.lua) saved the tokenizer it grew (the chat tokens) in its run's directory
  local tok = t.data.tokenizer
  for _, dir in ipairs({ cp, cp .. '/../..' }) do
    if ckpt.exists(dir .. '/tokenizer.json') then tok = require('gptlua.tokenizer').load(dir .. '/tokenizer'); break end
  end
  t.model:eval()
  return { model = t.model, tokenizer = tok, cfg = cfg, path = cp, trainer = t }
end

-- ------------------------------------------------------------ sampling

-- sample_row(row, opts, u) -> 0-based id: row a list of V logits (float64),
-- u a uniform number in [0, 1)
function M.sample_row(row, opts, u)
  local V = #row
  local temperature = opts.temperature or 1
  if temperature == 0 then
    local best = 1
    for i = 2, V do if row[i] > row[best] then best = i end end
    return best - 1
  end
  local top_k, top_p = opts.top_k, opts.top_p
  local order
  if (top_k and top_k > 0 and top_k < V) or (top_p and top_p < 1) then
    order = {}
    for i = 1, V do order[i] = i end
    table.sort(order, function(a, c) return row[a] > row[c] or (row[a] == row[c] and a < c) end)
  end
  local n = V
  if order and top_k and top_k > 0 and top_k < V then n = top_k end
  local mx = -math.huge
  for i = 1, V do if row[i] > mx then mx = row[i] end end
  -- weights of the candidates (all ids, or the first n of order), highest first when ordered
  local ids, w, total = {}, {}, 0
  for j = 1, n do
    local i = order and order[j] or j
    ids[j], w[j] = i, math.exp((row[i] - mx) / temperature)
    total = total + w[j]
  end
  if order and top_p and top_p < 1 then  -- the nucleus: the fewest highest whose mass reaches top_p
    local acc, keep = 0, n
    for j = 1, n do
      acc = acc + w[j]
      if acc >= top_p * total then keep = j; break end
    end
    n, total = keep, acc
  end
  local r, acc = u * total, 0
  for j = 1, n do
    acc = acc + w[j]
    if r < acc then return ids[j] - 1 end
  end
  return ids[n] - 1
end

-- the checked sampling options
function M.sampling_opts(opts, what)
  opts = opts or {}
  local t = opts.temperature or 1
  if type(t) ~= 'number' or t < 0 or t ~= t then fail(('%s: temperature must be a number >= 0, got %s'):format(what, tostring(t))) end
  local k = opts.top_k or 0
  if type(k) ~= 'number' or k < 0 or k ~= math.floor(k) then fail(('%s: top_k must be an integer >= 0 (0: all), got %s'):format(what, tostring(k))) end
  local p = opts.top_p or 1
  if type(p) ~= 'number' or not (p > 0 and p <= 1) then fail(('%s: top_p must be in (0, 1], got %s'):format(what, tostring(p))) end
  return { temperature = t, top_k = k, top_p = p }
end

-- ------------------------------------------------------------ the engine

local Engine = {}
Engine.__index = Engine
M.Engine = Engine

function Engine.new(model, tokenizer)
  return setmetatable({ model = model, tokenizer = tokenizer, device = model:parameters()[1].device }, Engine)
end

-- nats of ids (B) under logits (B, V) (the training loss's kernel), a list
local function row_nats(logits, ids, device)
  return gl.scope(function()
    local l2 = logits:contiguous()
    local t = gl.tensor(ids, { dtype = 'int64', device = device })
    local nats = Tensor.empty({ #ids }, { dtype = l2.dtype == 'float64' and 'float64' or 'float32', device = device })
    G.check(G.lib.gl_cross_entropy_forward(nats.c, nil, l2.c, t.c, -1, 0), 2)
    return nats:to('cpu'):to('float64'):tolist()
  end)
end
M.row_nats = row_nats

-- the caches of n rows holding the prefilled caches of one row (positions 1..pos)
local function replicate(model, one, n, S)
  local caches = model:new_caches(n, S)
  for i, c in ipairs(one) do
    for b = 1, n do
      caches[i].k:narrow(1, b, 1):narrow(3, 1, c.pos):copy_(c.k:narrow(3, 1, c.pos))
      caches[i].v:narrow(1, b, 1):narrow(3, 1, c.pos):copy_(c.v:narrow(3, 1, c.pos))
    end
    caches[i].pos = c.pos
  end
  if one.smear then
    for b = 1, n do caches.smear.x:narrow(1, b, 1):copy_(one.smear.x) end
    caches.smear.filled = one.smear.filled
  end
  return caches
end

-- A batch of prompts of different lengths: each is left-padded to the
-- longest (P tokens), so that every row writes its next token into the same
-- cache slot.  The caches then carry, for the model's forward:
--   segments (B, S) int64: 0 on a row's padding, 1 on its tokens; every
--     attention runs inside gl.with_segments on the slots so far, so no
--     token attends to padding (a padded query sees only padding);
--   positions (B, T), during a forward: each token's position in its own
--     prompt (slot minus the row's padding; 0 on the padding), for the
--     position embedding (GPT-2) or the rotary tables' rows (nanochat);
--   real (B, S, 1) of the model's dtype, during the prefill: 1 on tokens, 0
--     on padding, which nanochat multiplies its normed embedding by before
--     the smear.
-- A padded row then computes what its prompt alone does (the padding adds
-- exact zeros to its sums), up to the order of the products' sums.
local function padded_caches(self, prompts, S)
  local model, B, P = self.model, #prompts, 0
  for _, p in ipairs(prompts) do P = math.max(P, #p) end
  local tokens, seg, pos, real, pad = {}, {}, {}, {}, {}
  for b, p in ipairs(prompts) do
    pad[b] = P - #p
    tokens[b], seg[b], pos[b], real[b] = {}, {}, {}, {}
    for s = 1, S do
      seg[b][s] = s > pad[b] and 1 or 0
      real[b][s] = { seg[b][s] }
    end
    for t = 1, P do
      tokens[b][t] = t > pad[b] and p[t - pad[b]] or 0
      pos[b][t] = math.max(t - 1 - pad[b], 0)
    end
  end
  local caches = model:new_caches(B, S)
  local w = model:parameters()[1]
  caches.pad = pad
  caches.segments = gl.tensor(seg, { dtype = 'int64', device = self.device })
  caches.real = gl.tensor(real, { dtype = w.dtype, device = self.device })
  return caches, gl.tensor(tokens, { dtype = 'int64', device = self.device }), pos
end

-- the model's forward of idx (B, T) into caches, masked by their padding if
-- any; pos: each token's position (B lists of T), with padding
local function cached_forward(self, idx, caches, pos)
  if not caches.pad then return self.model:forward(idx, nil, caches) end
  local S = caches[1].pos + idx.shape[2]
  caches.positions = gl.tensor(pos, { dtype = 'int64', device = self.device })
  local ok, logits = pcall(gl.with_segments, caches.segments:narrow(2, 1, S), function()
    return self.model:forward(idx, nil, caches)
  end)
  caches.positions = nil
  if not ok then error(logits, 0) end
  return logits
end

-- prefill(prompt ids, n rows, capacity S) -> caches (n rows), the last
-- position's logits (n, V).  prompt may also be a list of prompts (one row
-- each, n ignored), of any lengths: left-padded to the longest.
function Engine:prefill(prompt, n, S)
  if type(prompt[1]) == 'table' then
    local caches, idx, pos = padded_caches(self, prompt, S)
    local logits = cached_forward(self, idx, caches, pos)
    caches.real = nil  -- (decoded tokens are never padding)
    return caches, logits:select(2, logits.shape[2]):contiguous()
  end
  local model = self.model
  local one = model:new_caches(1, S)
  local logits = model:forward(gl.tensor({ prompt }, { dtype = 'int64', device = self.device }), nil, one)
  local last = logits:select(2, logits.shape[2]):contiguous()
  if n == 1 then return one, last end
  return replicate(model, one, n, S), last
end

-- decode(caches, ids (n)) -> logits (n, V) of the next position of each row
function Engine:decode(caches, ids)
  local col = {}
  for b, id in ipairs(ids) do col[b] = { id } end
  local pos = {}  -- with padding, each row's next position in its own prompt
  for b, pad in ipairs(caches.pad or {}) do pos[b] = { caches[1].pos - pad } end
  local logits = cached_forward(self, gl.tensor(col, { dtype = 'int64', device = self.device }), caches, pos)
  return logits:select(2, 1):contiguous()
end

-- generate(prompt ids, opts) -> a list of n rows {ids, logprobs, finish}.
-- prompt may be a list of prompts of any lengths: n rows for each, in
-- order, one batch (left-padded, see padded_caches), each row generating
-- what its prompt alone does; max_tokens is then bounded by the context
-- the longest leaves.  opts: n (1), max_tokens (the context left), temperature (1), top_k (0:
-- all), top_p (1), seed (1337), stop (a list of ids), on_token(row, id)
-- called as each token is chosen, should_stop() polled between steps (true:
-- every row ends, finish 'interrupted').
function Engine:generate(prompt, opts)
  opts = opts or {}
  local what = opts.what or 'generate'
  local samp = M.sampling_opts(opts, what)
  local n = opts.n or 1
  if type(n) ~= 'number' or n < 1 or n ~= math.floor(n) then fail(('%s: n must be a positive integer, got %s'):format(what, tostring(n))) end
  if type(prompt) ~= 'table' or #prompt == 0 then fail(what .. ': the prompt must be at least one token') end
  local prompts, longest = nil, #prompt  -- a list of prompts: every row's own
  if type(prompt[1]) == 'table' then
    prompts, longest = {}, 0
    for i, p in ipairs(prompt) do
      if #p == 0 then fail(('%s: prompt %d must be at least one token'):format(what, i)) end
      for _ = 1, n do prompts[#prompts + 1] = p end
      longest = math.max(longest, #p)
    end
  end
  local B = prompts and #prompts or n
  local cfg = self.model.config
  local room = cfg.block_size - longest
  if room < 1 then
    fail(('%s: the prompt has %d tokens, block_size %d leaves no room to generate'):format(what, longest, cfg.block_size))
  end
  local max_tokens = math.min(opts.max_tokens or room, room)
  local stop = {}
  for _, id in ipairs(opts.stop or {}) do stop[id] = true end
  local seed = opts.seed or 1337
  local rows = {}
  for b = 1, B do rows[b] = { ids = {}, logprobs = {}, finish = nil } end
  local was_training = self.model.training
  self.model:eval()
  local ok, err = pcall(gl.no_grad, function()
    -- the decode step as a CUDA graph (gptlua.infer_graph) on a GPU unless
    -- opts.cuda_graph is false; its caches hold one slot more
    local graph_mod, why = nil, nil
    if opts.cuda_graph ~= false and max_tokens > 1 then
      graph_mod = require 'gptlua.infer_graph'
      why = graph_mod.obstacle(self.model, longest + max_tokens + 1, self.device)
      if why then
        if opts.cuda_graph == true then fail(('%s: cuda_graph: %s'):format(what, why)) end
        graph_mod = nil
      end
    end
    local caches, logits = self:prefill(prompts or prompt, n, longest + max_tokens + (graph_mod and 1 or 0))
    if logits.shape[1] < B then logits = logits:expand({ B, logits.shape[2] }):contiguous() end
    local graph = graph_mod and graph_mod.new(self, caches, B, { required = opts.cuda_graph == true })
    self.decode_graph = graph  -- (its counts: steps, replays, nodes; a note when its capture failed)
    for step = 1, max_tokens do
      local next_ids = gl.scope(function()
        local l64 = logits:to('cpu'):to('float64'):totable()
        local u = gl.rand({ B }, { seed = seed, offset = (step - 1) * B, dtype = 'float64' }):tolist()
        local ids = {}
        for b = 1, B do ids[b] = M.sample_row(l64[b], samp, u[b]) end
        local nats = row_nats(logits, ids, self.device)
        for b = 1, B do
          local r = rows[b]
          if not r.finish then
            if stop[ids[b]] then r.finish = 'stop'
            else
              r.ids[#r.ids + 1], r.logprobs[#r.logprobs + 1] = ids[b], -nats[b]
              if opts.on_token then opts.on_token(b, ids[b]) end
            end
          end
        end
        return ids
      end)
      local live = false
      for b = 1, B do if not rows[b].finish then live = true end end
      if not live then break end
      if opts.should_stop and opts.should_stop() then
        for b = 1, B do rows[b].finish = rows[b].finish or 'interrupted' end
        break
      end
      if step == max_tokens then break end
      if graph then
        logits = graph:step(next_ids)
      else
        local prev = logits
        logits = gl.scope(function() return self:decode(caches, next_ids) end)
        Tensor.release(prev)
      end
    end
    for b = 1, B do rows[b].finish = rows[b].finish or 'length' end
    if graph then graph:free() end
  end)
  self.model:train(was_training)
  if not ok then error(err, 0) end
  return rows
end

-- logprobs(ids) -> the log-probability of each token of ids after the
-- first, given those before it: the training forward over the whole
-- sequence (gptlua.eval.token_nats), so bit for bit what the loss of a
-- training step on these tokens averages
function Engine:logprobs(ids)
  if type(ids) ~= 'table' or #ids < 2 then fail('logprobs: expected a list of at least 2 token ids') end
  local x, y = {}, {}
  for t = 1, #ids - 1 do x[t], y[t] = ids[t], ids[t + 1] end
  local nats = require('gptlua.eval').token_nats(self.model, gl.tensor({ x }, { dtype = 'int64', device = self.device }),
    gl.tensor({ y }, { dtype = 'int64', device = self.device }))
  for i, v in ipairs(nats) do nats[i] = -v end
  return nats
end

-- the text of a token as bytes (a special token's name)
function Engine:token_text(id) return self.tokenizer:token_bytes(id) end

return M
