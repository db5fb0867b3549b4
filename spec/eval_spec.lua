-- Evaluations (lua/gptlua/eval.lua): multiple-choice scores against a
-- bigram model whose log-probabilities the spec computes itself, few-shot
-- prompts, items dealt over ranks, bits per byte against a hand count, the
-- trainer's eval records, and bad task files as one line.
local gl = require 'gptlua'
local ev = require 'gptlua.eval'
local tok = require 'gptlua.tokenizer'
local common = require 'gptlua.models.common'
local cjson = require 'cjson'
local root, exe = GPTLUA.root, GPTLUA.exe

-- A bigram model: the logits after token i are E[i] W^T, through the
-- models' own head (common.head), so the eval's path is the real one.
-- E and W hold multiples of 1/8 (exact in float64).
local V, C = 6, 3
local function E_at(i, c) return ((i * 3 + c * 5) % 7 - 3) / 4 end
local function W_at(j, c) return ((j * 5 + c * 3) % 11 - 5) / 8 end
local Bigram = {}
Bigram.__index = Bigram
local function bigram(dtype)
  local E, W = {}, {}
  for i = 1, V do E[i], W[i] = {}, {} for c = 1, C do E[i][c], W[i][c] = E_at(i - 1, c), W_at(i - 1, c) end end
  return setmetatable({ E = gl.tensor(E, { dtype = dtype }), W = gl.tensor(W, { dtype = dtype }),
    config = { block_size = 16 } }, Bigram)
end
function Bigram:forward(idx, targets) return common.head(self, gl.embedding(idx, self.E), targets, gl.linear, self.W, 0) end
function Bigram:eval() end
function Bigram:train() end
function Bigram:parameters() return { self.E, self.W } end

-- log p(j | i) computed here in plain Lua
local function logp(i, j)
  local z = {}
  for k = 0, V - 1 do
    local s = 0
    for c = 1, C do s = s + E_at(i, c) * W_at(k, c) end
    z[k] = s
  end
  local mx = -math.huge
  for k = 0, V - 1 do mx = math.max(mx, z[k]) end
  local se = 0
  for k = 0, V - 1 do se = se + math.exp(z[k] - mx) end
  return z[j] - mx - math.log(se)
end

-- characters a..d, space and newline: ids 0..5 in the tokenizer's order
local chars = tok.char('abcd \n')

-- the summed and mean nats of text's tokens from position start on, by hand
local function hand(text, start)
  local ids = chars:encode(text)
  local s, n = 0, 0
  for t = start, #ids do s = s - logp(ids[t - 1], ids[t]); n = n + 1 end
  return s, s / n
end

local function write(path, lines)
  local f = assert(io.open(path, 'w'))
  for _, l in ipairs(lines) do f:write(type(l) == 'string' and l or cjson.encode(l), '\n') end
  f:close()
end

describe('multiple-choice evaluation', function()
  it('scores each choice by the log-likelihood of its tokens, per token and in total', function()
    local item = { context = 'ab', choices = { 'c', 'db', 'ca', 'bcd' }, answer = 1 }
    local texts = ev.render(item, {}, ' ')
    assert.same({ 'ab c', 'ab db', 'ab ca', 'ab bcd' }, texts)
    local seqs, starts = ev.item_tokens(chars, texts, 16, 'spec')
    for _, s in ipairs(starts) do assert.equal(4, s) end  -- 'ab ' is shared: the choices' tokens follow it
    local want_sum, want_mean, best_sum, best_mean = {}, {}, 1, 1
    for c, text in ipairs(texts) do
      want_sum[c], want_mean[c] = hand(text, 4)
      if want_sum[c] < want_sum[best_sum] then best_sum = c end
      if want_mean[c] < want_mean[best_mean] then best_mean = c end
    end
    -- the case tells the two rules apart
    assert.are_not.equal(best_sum, best_mean)
    for _, dt in ipairs({ 'float64', 'float32' }) do
      local pick, pick_raw, got = ev.score_item(bigram(dt), chars, seqs, starts, 'cpu')
      assert.equal(best_mean - 1, pick)
      assert.equal(best_sum - 1, pick_raw)
      -- float32: each log-probability is a sum of 3 products and a log-sum-exp of 6, all of size < 4:
      -- a few ulps of 4 (2^-21) per token, at most 3 tokens
      local tol = dt == 'float64' and 1e-13 or 3 * 8 * 2 ^ -21
      for c = 1, #texts do
        assert.is_true(math.abs(got.sums[c] - want_sum[c]) <= tol, dt .. ' sum of choice ' .. c)
        assert.is_true(math.abs(got.means[c] - want_mean[c]) <= tol, dt .. ' mean of choice ' .. c)
      end
    end
  end)

  it('counts accuracy over a task, and the ranks\' shares add up to it', function()
    local dir = os.tmpname(); os.remove(dir); os.execute('mkdir -p ' .. dir)
    local items = {
      { context = 'ab', choices = { 'c', 'dd', 'ca', 'bcd' }, answer = 0 },
      { context = 'dc', choices = { 'a', 'b' }, answer = 1 },
      { context = 'a', choices = { 'bb', 'cc', 'dd' }, answer = 2 },
      { context = 'ccc', choices = { 'ab', 'ba' }, answer = 0 },
      { context = 'b', choices = { 'd', 'a' }, answer = 0 },
    }
    write(dir .. '/t.jsonl', items)
    local task = ev.load_task(dir .. '/t.jsonl')
    assert.equal('t', task.name)
    -- the expected counts, by hand
    local correct, correct_raw = 0, 0
    for _, it in ipairs(items) do
      local bs, bm = 1, 1
      local s, m = {}, {}
      for c, ch in ipairs(it.choices) do
        s[c], m[c] = hand(it.context .. ' ' .. ch, #chars:encode(it.context .. ' ') + 1)
        if s[c] < s[bs] then bs = c end
        if m[c] < m[bm] then bm = c end
      end
      if bm - 1 == it.answer then correct = correct + 1 end
      if bs - 1 == it.answer then correct_raw = correct_raw + 1 end
    end
    local model = bigram('float64')
    local all = ev.run_task(model, chars, task, { block_size = 16, device = 'cpu' })
    assert.same({ correct = correct, correct_raw = correct_raw, n = 5 }, all)
    local sum = { correct = 0, correct_raw = 0, n = 0 }
    for r = 0, 2 do
      local part = ev.run_task(model, chars, task, { block_size = 16, device = 'cpu', rank = r, ranks = 3 })
      for k, v in pairs(part) do sum[k] = sum[k] + v end
    end
    assert.same(all, sum)
    os.execute('rm -rf ' .. dir)
  end)

  it('puts few-shot examples of the same task before the context, the same ones every time', function()
    local items = { { context = 'a', choices = { 'b', 'c' }, answer = 0 }, { context = 'b', choices = { 'c', 'd' }, answer = 1 },
                    { context = 'c', choices = { 'd', 'a' }, answer = 0 } }
    local task = { name = 't', path = 't.jsonl', items = items }
    assert.same({ 'a b\n\nc d', 'a b\n\nc a' }, ev.render(items[3], { items[1] }, ' '))
    local seen = {}
    local model = setmetatable({}, { __index = bigram('float64') })
    local inner = model.forward
    function model:forward(idx, targets)
      seen[#seen + 1] = idx:select(1, 1):tolist()
      return inner(self, idx, targets)
    end
    ev.run_task(model, chars, task, { block_size = 16, device = 'cpu', fewshot = 2 })
    local first = seen
    seen = {}
    ev.run_task(model, chars, task, { block_size = 16, device = 'cpu', fewshot = 2 })
    assert.same(first, seen)
    -- each prompt holds the two other items (a context, space, answer, blank line) before its own
    local text = chars:decode(first[3])
    assert.truthy(text:find('a b\n\n', 1, true) and text:find('b d\n\n', 1, true), text)
  end)

  it('puts the tokenizer\'s document token first when it has one', function()
    local withbos = require('gptlua.sft').with_chat_tokens(chars)
    local seqs, starts = ev.item_tokens(withbos, { 'a c', 'a dd' }, 16, 'spec')
    assert.equal(withbos.bos_id, seqs[1][1]); assert.equal(withbos.bos_id, seqs[2][1])
    assert.equal(4, starts[1])  -- <|bos|> 'a' ' ' shared
  end)

  it('crops a long prompt on the left to block_size', function()
    local seqs, starts = ev.item_tokens(chars, { 'abcdabcd c', 'abcdabcd dd' }, 6, 'spec')
    assert.equal(7, #seqs[1]); assert.equal(7, #seqs[2])  -- block_size + 1 tokens
    assert.same(chars:encode('bcd dd'), { unpack(seqs[2], 2) })
    assert.equal(7, starts[1]); assert.equal(6, starts[2])
    assert.has_error(function() ev.item_tokens(chars, { 'a c', 'a bcdabcdabcd' }, 6, 'spec item') end,
      'eval: spec item: choice 1 has 11 continuation tokens, more than block_size 6 leaves after one of context')
  end)

  it('refuses bad task files with one line naming the file, line and field', function()
    local path = os.tmpname()
    local cases = {
      { { '{"context": 3}' }, path .. ', line 1: expected "context" (or "query") a string, got 3' },
      { { '{"query": "a", "choices": ["x"], "gold": 0}' }, 'expected "choices" a list of at least 2 strings, got a list of 1' },
      { { '', '{"context": "a", "choices": ["x", ""], "answer": 0}' }, path .. ', line 2: expected choice 1 a non-empty string' },
      { { '{"context": "a", "choices": ["x", "y"], "answer": 2}' }, 'expected "answer" (or "gold") an index from 0 to 1, got 2' },
      { { '{"context": "a", "choices": ["x", "y"], "answer": 0.5}' }, 'an index from 0 to 1, got 0.5' },
      { { 'not json' }, path .. ', line 1: expected a JSON object, got "not json"' },
      { { '' }, path .. ' holds no items' },
    }
    for _, case in ipairs(cases) do
      write(path, case[1])
      local ok, err = pcall(ev.load_task, path)
      assert.is_false(ok)
      assert.truthy(err:find(case[2], 1, true), err)
      assert.is_nil(err:find('\n'), err)
      assert.truthy(require('gptlua.cli').is_user_error(err), err)
    end
    local ok, err = pcall(ev.load_task, path .. '.missing')
    assert.is_false(ok)
    assert.truthy(err:find('^eval: cannot open task file .*%.missing'), err)
    -- the trainer refuses it before it builds anything
    write(path, { '{"context": "a"}' })
    local out = io.popen(('cd %s && %s recipes/tiny.lua --eval_tasks=%s 2>&1; echo "rc=$?"'):format(root, exe, path)):read('*a')
    assert.truthy(out:find('^eval: ' .. path:gsub('%p', '%%%0') .. ', line 1: expected "choices"'), out)
    assert.truthy(out:find('\nrc=1\n$'), out)
    os.remove(path)
  end)
end)

describe('per-token losses of the fused head', function()
  it('are the rows the mean averages (reduction none), 0 where ignored, and have no backward', function()
    gl.manual_seed(2)
    local x, W = gl.randn({ 2, 5, 4 }), gl.randn({ 7, 4 })
    local t = gl.tensor({ { 1, 2, -1, 3, 4 }, { 5, 6, 0, -1, 1 } }, { dtype = 'int64' })
    local rows = gl.no_grad(function() return gl.linear_cross_entropy(x, W, t, { ignore_index = -1, reduction = 'none', chunk_rows = 3 }) end)
    assert.same({ 2, 5 }, rows.shape)
    local l = gl.log_softmax(gl.linear(x, W), -1):to('float64'):totable()
    local tt = t:totable()
    for b = 1, 2 do for i = 1, 5 do
      local id = tonumber(tt[b][i])
      local want = id < 0 and 0 or -l[b][i][id + 1]
      assert.is_true(math.abs(rows:to('float64'):totable()[b][i] - want) <= 1e-5)
    end end
    x.requires_grad = true
    local ok, err = pcall(gl.linear_cross_entropy, x, W, t, { reduction = 'none' })
    assert.is_false(ok)
    assert.truthy(err:find("reduction 'none' has no backward; call it under gl.no_grad", 1, true), err)
    ok, err = pcall(gl.linear_cross_entropy, x, W, t, { reduction = 'sum' })
    assert.truthy(err:find("reduction must be 'mean' or 'none', got sum", 1, true), err)
  end)
end)

describe('bits per byte', function()
  it('divides nats by ln 2 times the bytes the targets decode to, special tokens none', function()
    local bpe = tok.train({ 'hello hello world, ünïcödé' }, 256 + 8, { special_tokens = { '<|bos|>' } })
    local ids = bpe:encode('hello wörld', { bos = true })
    local counts = ev.token_byte_counts(bpe, bpe.vocab_size)
    assert.equal(0, counts[bpe.bos_id + 1])
    -- 'hello wörld' is 12 bytes (ö is two); the ignored target (-1) and <|bos|> count none
    local y = { ids, { -1, bpe.bos_id } }
    local bytes, n = ev.target_bytes(counts, y)
    assert.equal(12, bytes); assert.equal(#ids + 1, n)  -- <|bos|> is a target, of no bytes
    assert.equal(12, (ev.target_bytes(counts, gl.tensor({ ids }, { dtype = 'int64' }))))
    assert.equal(24 / (math.log(2) * 12), ev.bpb(24, 12))
  end)

  it('is logged beside the val loss: on characters, the val loss over ln 2', function()
    local out = os.tmpname(); os.remove(out)
    local train = require 'gptlua.train'
    local t = train.new(dofile(root .. '/recipes/tiny.lua'), { '--quiet', '--max_iters=2', '--eval_interval=2', '--eval_iters=2',
      '--out_dir=' .. out, '--sample_length=0', '--data_path=' .. root .. '/data/tinyshakespeare.txt',
      '--eval_tasks=' .. root .. '/data/eval_example.jsonl', '--eval_task_limit=6', '--control=false', '--tensorboard=false' })
    local res = t:run()
    -- every character of tiny Shakespeare is one byte: bpb = mean nats / ln 2, to the rounding of the sums
    assert.is_true(math.abs(res.eval.val_bpb - res.eval.val / math.log(2)) <= 1e-12 * res.eval.val_bpb)
    local recs = {}
    for line in io.lines(res.run_dir .. '/metrics.jsonl') do
      local r = cjson.decode(line)
      if r.eval then recs[#recs + 1] = r end
    end
    assert.equal(2, #recs)  -- step 0 and the last
    for _, r in ipairs(recs) do
      assert.is_number(r.val_bpb)
      local acc, raw = r.task_eval_example_acc, r.task_eval_example_acc_raw
      assert.is_number(acc); assert.is_number(raw)
      assert.is_true(math.abs(acc * 6 - math.floor(acc * 6 + 0.5)) < 1e-9)  -- a count of 6 items
    end
    -- gptlua plot draws them: a fourth row with bits per byte and each task's accuracy
    local plot = require 'gptlua.observe.plot'
    local run = plot.read_run(res.run_dir)
    assert.same({ 'eval_example' }, run.tasks)
    local script = plot.script({ run }, '/d')
    assert.truthy(script:find('set multiplot layout 4,2', 1, true), script)
    assert.truthy(script:find("set title 'val bits per byte'", 1, true), script)
    assert.truthy(script:find("'/d/run1_eval.dat' using 1:5", 1, true), script)
    assert.truthy(script:find("'/d/run1_task1.dat' using 1:2 with lines lw 1.5 lc 1 dt 1 title 'tiny eval_example'", 1, true), script)
    os.execute('rm -rf ' .. out)
  end)
end)

describe('tasks on two ranks', function()
  it('deal the items over the ranks and sum the counts: the one-process accuracies', function()
    local mpi = require 'support.mpi'
    local out = os.tmpname(); os.remove(out)
    -- 7 items: 4 on rank 0, 3 on rank 1 (it scores its last one again, uncounted)
    local args = ' recipes/tiny.lua --max_iters=1 --eval_interval=1 --eval_iters=1 --sample_length=0 --control=false '
      .. '--tensorboard=false --eval_tasks=data/eval_example.jsonl --eval_task_limit=7 --out_dir=' .. out
    local res, rc = mpi.sh(exe .. ' -n 2' .. args .. ' --dist=ddp --name=two', 300)
    assert.equal(0, rc, res)
    res, rc = mpi.sh(exe .. args .. ' --name=one', 300)
    assert.equal(0, rc, res)
    local function first_eval(name)
      for line in io.lines(out .. '/' .. name .. '/metrics.jsonl') do
        local r = cjson.decode(line)
        if r.eval then return r end
      end
    end
    local a, b = first_eval('two'), first_eval('one')
    -- step 0: the same weights on every rank and in the one process
    assert.equal(b.task_eval_example_acc, a.task_eval_example_acc)
    assert.equal(b.task_eval_example_acc_raw, a.task_eval_example_acc_raw)
    assert.is_true(math.abs(a.task_eval_example_acc * 7 - math.floor(a.task_eval_example_acc * 7 + 0.5)) < 1e-9)
    os.execute('rm -rf ' .. out)
  end)
end)

describe('gptlua eval', function()
  it('scores a run\'s checkpoint on task files, and refuses a bad one in one line', function()
    local out = os.tmpname(); os.remove(out)
    local cmd = ('cd %s && %s recipes/tiny.lua --quiet --max_iters=1 --eval_interval=0 --out_dir=%s --sample_length=0 '
      .. '--control=false --tensorboard=false'):format(root, exe, out)
    assert.is_true(os.execute(cmd) == 0 or os.execute(cmd) == true)
    local res = io.popen(('cd %s && %s eval %s/tiny --tasks=data/eval_example.jsonl --limit=8 --bpb 2>&1; echo "rc=$?"'):format(
      root, exe, out)):read('*a')
    assert.truthy(res:find('val loss %d%.%d+, val bpb %d%.%d+'), res)
    assert.truthy(res:find('eval_example: acc %d%.%d+ %(raw %d%.%d+%), 8 items, 0%-shot'), res)
    assert.truthy(res:find('rc=0\n$'), res)
    local bad = os.tmpname()
    write(bad, { '{"context": "a", "choices": "xy", "answer": 0}' })
    res = io.popen(('cd %s && %s eval %s/tiny --tasks=%s 2>&1; echo "rc=$?"'):format(root, exe, out, bad)):read('*a')
    assert.equal(('eval: %s, line 1: expected "choices" a list of at least 2 strings, got "xy"\nrc=1\n'):format(bad), res)
    os.remove(bad)
    os.execute('rm -rf ' .. out)
  end)
end)
