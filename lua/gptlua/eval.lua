-- gptlua.eval — evaluations beyond the validation loss:
--
--   * multiple-choice tasks in the shape of nanochat's CORE items (HellaSwag,
--     ARC, ...): a JSONL file, one item a line, {"context": ..., "choices":
--     [...], "answer": i} ("query" and "gold" are taken for "context" and
--     "answer", as CORE's bundle names them; answer counts from 0).  Each
--     choice is scored by the log-likelihood of its tokens given the context
--     (and K few-shot examples before it); the prediction is the choice of
--     the highest mean log-likelihood per token ("acc", nanochat's rule) and,
--     reported beside it, of the highest total ("acc_raw").
--   * the validation loss in bits per byte: the nats of the predicted tokens
--     over ln 2 times the bytes those tokens decode to, a number that does
--     not depend on the tokenizer (special tokens have no bytes).
--
-- During training (`--eval_tasks=a.jsonl,b.jsonl`) both run at every eval
-- (Trainer:evaluate calls M.extend); afterwards `gptlua eval RUN
-- --tasks=...` (M.main).  Items are dealt over the data-parallel ranks and
-- the counts summed over them.
local gl = require 'gptlua'
local cjson = require 'cjson'

local M = {}

local function fail(msg) error('eval: ' .. msg, 0) end

local function describe(v)
  if type(v) == 'string' then return ('%q'):format(#v > 40 and v:sub(1, 40) .. '...' or v) end
  if type(v) == 'table' then return 'a ' .. (v[1] ~= nil and 'list' or 'table') end
  return tostring(v)
end

-- one item from a decoded line; the error names the file, line and field
local function check_item(rec, where)
  if type(rec) ~= 'table' then fail(('%s: expected a JSON object {context, choices, answer}, got %s'):format(where, describe(rec))) end
  local context = rec.context ~= nil and rec.context or rec.query
  if type(context) ~= 'string' then
    fail(('%s: expected "context" (or "query") a string, got %s'):format(where, describe(context)))
  end
  local choices = rec.choices
  if type(choices) ~= 'table' or #choices < 2 then
    fail(('%s: expected "choices" a list of at least 2 strings, got %s'):format(where,
      type(choices) == 'table' and ('a list of %d'):format(#choices) or describe(choices)))
  end
  for i, c in ipairs(choices) do
    if type(c) ~= 'string' or c == '' then
      fail(('%s: expected choice %d a non-empty string, got %s'):format(where, i - 1, describe(c)))
    end
  end
  local answer = rec.answer ~= nil and rec.answer or rec.gold
  if type(answer) ~= 'number' or answer ~= math.floor(answer) or answer < 0 or answer >= #choices then
    fail(('%s: expected "answer" (or "gold") an index from 0 to %d, got %s'):format(where, #choices - 1, describe(answer)))
  end
  return { context = context, choices = choices, answer = answer }
end

-- M.load_task(path) -> {name, path, items}: name is the file's name without
-- .jsonl; a bad line stops with one line naming the file, line and field
function M.load_task(path)
  local f, err = io.open(path, 'rb')
  if not f then fail(('cannot open task file %s'):format(err)) end
  local items, n = {}, 0
  for line in f:lines() do
    n = n + 1
    if line:match('%S') then
      local ok, rec = pcall(cjson.decode, line)
      if not ok then f:close(); fail(('%s, line %d: expected a JSON object, got %q'):format(path, n, line:sub(1, 60))) end
      local ok2, item = pcall(check_item, rec, ('%s, line %d'):format(path, n))
      if not ok2 then f:close(); error(item, 0) end
      items[#items + 1] = item
    end
  end
  f:close()
  if #items == 0 then fail(('%s holds no items (expected JSON lines {context, choices, answer})'):format(path)) end
  return { name = path:match('([^/]+)$'):gsub('%.jsonl?$', ''), path = path, items = items }
end

-- the list of task files in a comma-separated string
function M.task_paths(s)
  local out = {}
  for p in tostring(s):gmatch('[^,]+') do
    p = p:match('^%s*(.-)%s*$')
    if p ~= '' then out[#out + 1] = p end
  end
  return out
end

-- ------------------------------------------------------------ scoring

-- token_nats(model, idx, targets) -> a Lua list of B*T nats (row-major),
-- -log p(targets[b][t] | idx[b][1..t]), 0 where the target is -1: the
-- training forward itself (model:forward(idx, targets), its fused head and
-- loss kernel) with each target's loss kept (model.loss_reduction = 'none'),
-- so these are the numbers the training loss averages, bit for bit.
-- idx, targets: (B, T) int64 tensors.
function M.token_nats(model, idx, targets)
  return gl.no_grad(function()
    return gl.scope(function()
      model.loss_reduction = 'none'
      local ok, _, nats = pcall(model.forward, model, idx, targets)
      model.loss_reduction = nil
      if not ok then error(_, 0) end
      return nats:contiguous():to('cpu'):to('float64'):view(nats:numel()):tolist()
    end)
  end)
end

-- the K few-shot examples of item i: K other items, drawn by a generator
-- seeded with i (so every rank and every run draws the same)
local function fewshot_examples(items, i, k)
  if k <= 0 then return {} end
  local others = {}
  for j = 1, #items do if j ~= i then others[#others + 1] = j end end
  local state = (i * 2654435761 + 12345) % 4294967296
  local function nexti(n)  -- a linear congruential generator (Numerical Recipes' constants)
    state = (state * 1664525 + 1013904223) % 4294967296
    return math.floor(state / 4294967296 * n) + 1
  end
  for a = #others, 2, -1 do
    local b = nexti(a)
    others[a], others[b] = others[b], others[a]
  end
  local out = {}
  for a = 1, math.min(k, #others) do out[a] = items[others[a]] end
  return out
end

-- the texts of an item's choices: few-shot examples (each context, the
-- delimiter and its answer, then a blank line), the context, the
-- delimiter, the choice
function M.render(item, fewshot, delimiter)
  local prefix = {}
  for _, ex in ipairs(fewshot) do
    prefix[#prefix + 1] = ex.context .. delimiter .. ex.choices[ex.answer + 1] .. '\n\n'
  end
  local head = table.concat(prefix) .. item.context .. delimiter
  local texts = {}
  for c, choice in ipairs(item.choices) do texts[c] = head .. choice end
  return texts
end

-- the token lists of an item's choices and where each one's continuation
-- starts: after the tokens all of them share (nanochat's rule, which keeps
-- a space that merges into the choice's first token with the choice); the
-- tokenizer's document token first when it has one (<|bos|>, GPT-2's
-- <|endoftext|>); cropped on the left to
-- block_size + 1 tokens
function M.item_tokens(tok, texts, block_size, where)
  local seqs = {}
  for c, text in ipairs(texts) do
    local ok, ids = pcall(tok.encode, tok, text)
    if not ok then fail(('%s: the tokenizer cannot encode choice %d: %s'):format(where, c - 1, tostring(ids):gsub('^.-:%d+: ', ''))) end
    local first = tok.bos_id or (tok.special_id and tok:special_id('<|endoftext|>'))
    if first then table.insert(ids, 1, first) end
    seqs[c] = ids
  end
  local common = #seqs[1]
  for c = 2, #seqs do
    local n = 0
    while n < common and n < #seqs[c] and seqs[c][n + 1] == seqs[1][n + 1] do n = n + 1 end
    common = n
  end
  local starts = {}
  for c, ids in ipairs(seqs) do
    if #ids == common then fail(('%s: choice %d adds no tokens to what the choices share'):format(where, c - 1)) end
    local start, continuation = common + 1, #ids - common  -- the first continuation token, their count
    local drop = math.max(0, #ids - (block_size + 1))
    if drop > 0 then
      for _ = 1, drop do table.remove(ids, 1) end
      start = start - drop
    end
    if start < 2 then
      fail(('%s: choice %d has %d continuation tokens, more than block_size %d leaves after one of context'):format(
        where, c - 1, continuation, block_size))
    end
    starts[c] = start
  end
  return seqs, starts
end

-- scores one item: the choices as one batch (right-padded), each choice's
-- summed and mean nats over its continuation tokens; returns the index
-- (from 0) of the best choice by mean and by sum, and the per-choice nats
function M.score_item(model, tok, seqs, starts, device)
  local B, T = #seqs, 0
  for _, ids in ipairs(seqs) do T = math.max(T, #ids - 1) end
  local x, y = {}, {}
  for b, ids in ipairs(seqs) do
    x[b], y[b] = {}, {}
    for t = 1, T do
      x[b][t] = ids[t] or 0
      y[b][t] = (t + 1 >= starts[b] and ids[t + 1]) or -1
    end
  end
  local nats = M.token_nats(model, gl.tensor(x, { dtype = 'int64', device = device }),
    gl.tensor(y, { dtype = 'int64', device = device }))
  local sums, means = {}, {}
  local best_mean, best_sum = 1, 1
  for b = 1, B do
    local s, n = 0, 0
    for t = 1, T do
      if y[b][t] >= 0 then s = s + nats[(b - 1) * T + t]; n = n + 1 end
    end
    sums[b], means[b] = s, s / n
    if means[b] < means[best_mean] then best_mean = b end
    if sums[b] < sums[best_sum] then best_sum = b end
  end
  return best_mean - 1, best_sum - 1, { sums = sums, means = means }
end

-- run_task(model, tok, task, opts) -> {correct, correct_raw, n} for the
-- items of this rank: opts.rank, opts.ranks (item i goes to rank
-- (i-1) % ranks), opts.fewshot, opts.delimiter, opts.limit (the first items
-- only), opts.device, opts.block_size.  Every rank scores the same number
-- of items (the last ones again, uncounted, where the items do not divide)
-- so that a layout whose forward is collective runs in step.
function M.run_task(model, tok, task, opts)
  local rank, ranks = opts.rank or 0, opts.ranks or 1
  local items = task.items
  local n = (opts.limit and opts.limit > 0) and math.min(opts.limit, #items) or #items
  local out = { correct = 0, correct_raw = 0, n = 0 }
  local rounds = math.ceil(n / ranks)
  for r = 0, rounds - 1 do
    local i = r * ranks + rank + 1
    local counted = i <= n
    if not counted then i = n end
    local item = items[i]
    local where = ('%s item %d'):format(task.path, i)
    local texts = M.render(item, fewshot_examples(items, i, opts.fewshot or 0), opts.delimiter or ' ')
    local seqs, starts = M.item_tokens(tok, texts, opts.block_size, where)
    local pick, pick_raw = M.score_item(model, tok, seqs, starts, opts.device)
    if counted then
      out.n = out.n + 1
      if pick == item.answer then out.correct = out.correct + 1 end
      if pick_raw == item.answer then out.correct_raw = out.correct_raw + 1 end
    end
  end
  return out
end

-- ------------------------------------------------------------ bits per byte

-- bytes of each token id as it decodes (special tokens: 0), a list indexed id+1
function M.token_byte_counts(tok, vocab_size)
  local specials = {}
  for _, id in pairs(tok.special_tokens or {}) do specials[id] = true end
  local counts = {}
  for id = 0, vocab_size - 1 do
    if specials[id] or id >= tok.vocab_size then counts[id + 1] = 0
    else counts[id + 1] = #tok:token_bytes(id) end
  end
  return counts
end

-- bytes the targets of y decode to (targets < 0 ignored), and the number
-- of targets; y a tensor or list of lists
function M.target_bytes(counts, y)
  local rows = gl.is_tensor(y) and y:to('cpu'):to('int64'):totable() or y
  local total, n = 0, 0
  for _, row in ipairs(rows) do
    if type(row) == 'number' then row = { row } end
    for _, id in ipairs(row) do
      id = tonumber(id)  -- (an int64 element is boxed)
      if id >= 0 then total, n = total + (counts[id + 1] or 0), n + 1 end
    end
  end
  return total, n
end

-- a function y -> the bytes its targets decode to and their number, for
-- the trainer's tokenizer (nil without one: random data has no bytes)
function M.bytes_counter(trainer)
  local tok = trainer.data.tokenizer
  if not tok then return nil end
  trainer.token_bytes = trainer.token_bytes or M.token_byte_counts(tok, trainer.cfg.vocab_size)
  local counts = trainer.token_bytes
  return function(y) return M.target_bytes(counts, y) end
end

-- bits per byte of nats over bytes
function M.bpb(nats, bytes) return bytes > 0 and nats / (math.log(2) * bytes) or 0 / 0 end

-- ------------------------------------------------------------ in the trainer

-- the metrics key of a task's accuracy
function M.acc_key(name, raw) return ('task_%s_%s'):format(name, raw and 'acc_raw' or 'acc') end

-- the trainer's tasks, loaded once (a bad file stops the run before it trains)
function M.trainer_tasks(trainer)
  if trainer.eval_tasks == nil then
    local list = {}
    for _, p in ipairs(M.task_paths(trainer.cfg.eval_tasks or '')) do list[#list + 1] = M.load_task(p) end
    trainer.eval_tasks = list
  end
  return trainer.eval_tasks
end

-- sums over the data-parallel ranks (each tp/cp rank of a group scored the
-- same items: the world's sum counts them world/dp times)
local function sum_ranks(trainer, x)
  if not trainer.comm or trainer.world == 1 then return x end
  return trainer.comm:all_reduce_number(x, 'sum') / (trainer.world / trainer.dp_size)
end

-- Trainer:evaluate's hook: adds ev.tasks = {{name, acc, acc_raw, n}, ...}
-- (model in eval mode here); a layout whose forward or head is not the
-- model's own (pipeline stages, split sequences, a vocabulary-parallel
-- head) leaves tasks out with a line said once
function M.extend(trainer, ev)
  local tasks = M.trainer_tasks(trainer)
  if #tasks == 0 then return ev end
  if trainer.policy.eval_loss or trainer.tp_layout or (trainer.mesh and trainer.mesh.size.cp > 1) then
    if not trainer.eval_tasks_refused then
      trainer:print('eval: eval_tasks run without pipeline, tensor or context parallelism only (gptlua eval scores a '
        .. 'checkpoint in one process); skipped')
      trainer.eval_tasks_refused = true
    end
    return ev
  end
  local tok = trainer.data.tokenizer
  if not tok then fail('eval_tasks need the data\'s tokenizer, and this data has none') end
  ev.tasks = {}
  for _, task in ipairs(tasks) do
    local r = M.run_task(trainer.model, tok, task, { rank = trainer.dp_rank, ranks = trainer.dp_size,
      fewshot = trainer.cfg.eval_fewshot, delimiter = trainer.cfg.eval_delimiter, limit = trainer.cfg.eval_task_limit,
      device = trainer.cfg.device, block_size = trainer.model.config.block_size })
    local n = sum_ranks(trainer, r.n)
    ev.tasks[#ev.tasks + 1] = { name = task.name, n = n, acc = sum_ranks(trainer, r.correct) / n,
      acc_raw = sum_ranks(trainer, r.correct_raw) / n }
  end
  return ev
end

-- the metrics record of an eval and the text its line adds
function M.record(step, ev)
  local rec = { step = step, eval = true, train_loss = ev.train, val_loss = ev.val, val_bpb = ev.val_bpb }
  local text = {}
  if ev.val_bpb then text[1] = (', val bpb %.4f'):format(ev.val_bpb) end
  for _, t in ipairs(ev.tasks or {}) do
    rec[M.acc_key(t.name)], rec[M.acc_key(t.name, true)] = t.acc, t.acc_raw
    text[#text + 1] = (', %s acc %.4f (raw %.4f)'):format(t.name, t.acc, t.acc_raw)
  end
  return rec, table.concat(text)
end

-- ------------------------------------------------------------ gptlua eval

local USAGE = [[
usage: gptlua eval RUN --tasks=a.jsonl[,b.jsonl] [--fewshot=0] [--delimiter=' '] [--limit=0] [--bpb] [--hf]
  RUN          a run (its latest checkpoint), its checkpoints/ or a checkpoint; with --hf a Hugging Face GPT-2 directory
  --tasks      multiple-choice task files: JSON lines {"context", "choices", "answer"} (or CORE's "query", "gold")
  --fewshot    examples of the same task put before each item
  --delimiter  the text between a context and its choice
  --limit      score the first N items of each task (0: all)
  --bpb        also the validation loss and bits per byte over the run's validation data (eval_iters batches)
]]
M.USAGE = USAGE

-- `gptlua eval RUN --tasks=...`: prints a line per task, returns 0
function M.main(args)
  local config = require 'gptlua.config'
  local run
  local rest = {}
  for _, a in ipairs(args) do
    if a == '-h' or a == '--help' then io.write(USAGE) return 0 end
    if a:sub(1, 1) ~= '-' and not run then run = a else rest[#rest + 1] = a end
  end
  if not run then fail('expected a run directory or checkpoint\n' .. USAGE) end
  local defaults = { tasks = '', fewshot = 0, delimiter = ' ', limit = 0, bpb = false, hf = false }
  local o = config.merge(defaults, config.parse_args(rest, defaults, { prefix = 'eval', hint = 'gptlua eval --help lists them' }))
  local paths = M.task_paths(o.tasks)
  if #paths == 0 and not o.bpb then fail('nothing to evaluate: give --tasks=FILE.jsonl[,...] and/or --bpb') end
  if o.fewshot < 0 or o.fewshot ~= math.floor(o.fewshot) then fail(('--fewshot must be an integer >= 0, got %s'):format(o.fewshot)) end
  if o.limit < 0 or o.limit ~= math.floor(o.limit) then fail(('--limit must be an integer >= 0, got %s'):format(o.limit)) end
  local tasks = {}
  for i, p in ipairs(paths) do tasks[i] = M.load_task(p) end
  local m = require('gptlua.infer').load(run, { hf = o.hf, what = 'eval' })
  io.write(('eval: %s\n'):format(m.path))
  if o.bpb then
    if not m.trainer then fail('--bpb needs a gptlua run (its validation data), not a Hugging Face directory') end
    local ev = m.trainer:evaluate()
    io.write(('val loss %.4f, val bpb %s (%d batches)\n'):format(ev.val, ev.val_bpb and ('%.4f'):format(ev.val_bpb) or 'n/a',
      m.trainer.cfg.eval_iters))
  end
  m.model:eval()
  for _, task in ipairs(tasks) do
    local r = M.run_task(m.model, m.tokenizer, task, { fewshot = o.fewshot, delimiter = o.delimiter, limit = o.limit,
      device = m.cfg.device, block_size = m.model.config.block_size })
    io.write(('%s: acc %.4f (raw %.4f), %d items, %d-shot\n'):format(task.name, r.correct / r.n, r.correct_raw / r.n,
      r.n, o.fewshot))
  end
  return 0
end

return M
