local gl = require 'gptlua'
local train = require 'gptlua.train'
local cjson = require 'cjson'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

-- a tiny char-level run on the shipped text
local function recipe(over)
  local r = { name = 't', model = 'gpt2', data = 'char', n_layer = 1, n_head = 2, n_embd = 16, block_size = 16,
              batch_size = 4, max_iters = 6, eval_interval = 0, log_interval = 1, sample_length = 0,
              warmup_iters = 2, lr_decay_iters = 6, quiet = true, device = 'cpu', learning_rate = 3e-3 }
  for k, v in pairs(over or {}) do r[k] = v end
  return r
end

-- a loader that always returns one fixed batch
local function fixed_loader(B, T, V)
  local x = gl.randn({ B, T + 1 }, { seed = 11, dtype = 'float64' }):abs():mul_(V / 3):clamp_(0, V - 1):to('int64')
  local L = { }
  function L:next_batch() return x:narrow(2, 1, T):contiguous(), x:narrow(2, 2, T):contiguous() end
  function L:state() return {} end
  function L:set_state() end
  return L
end

describe('trainer', function()
  it('overfits a fixed batch (loss below 0.1)', function()
    local r = recipe({ max_iters = 150, learning_rate = 1e-2, warmup_iters = 0, lr_decay_iters = 150, min_lr = 1e-2,
                       n_embd = 32, n_head = 2, n_layer = 2, batch_size = 2, block_size = 8, weight_decay = 0,
                       out_dir = tmpdir() })
    r.build_data = function(cfg) local L = fixed_loader(2, 8, 20); return { train = L, val = L, vocab_size = 20 } end
    local res = train.main(r, {})
    assert.is_true(res.losses[#res.losses] < 0.1, 'final loss ' .. res.losses[#res.losses])
  end)

  it('resumes so that the loss sequence equals an uninterrupted run, and writes metrics', function()
    local d1, d2 = tmpdir(), tmpdir()
    local full = train.main(recipe({ max_iters = 8, out_dir = d1, dropout = 0.1 }), {})
    train.main(recipe({ max_iters = 4, out_dir = d2, dropout = 0.1 }), {})
    local resumed = train.main(recipe({ max_iters = 8, out_dir = d2, dropout = 0.1 }), { '--resume=latest' })
    assert.equal(4, #resumed.losses)
    for i = 1, 4 do assert.equal(full.losses[4 + i], resumed.losses[i]) end
    local f = io.open(d1 .. '/t/metrics.jsonl')
    local n, last = 0, nil
    for line in f:lines() do n = n + 1; last = cjson.decode(line) end
    f:close()
    assert.equal(8, n)
    assert.equal(8, last.step)
    for _, k in ipairs({ 'loss', 'lr', 'grad_norm', 'tokens_per_sec', 'mfu', 'ms_per_step', 'mem_peak' }) do
      assert.is_not_nil(last[k], k)
    end
    os.execute('rm -rf ' .. d1 .. ' ' .. d2)
  end)

  it('refuses a checkpoint of a different model and a corrupted one, loading nothing', function()
    local d = tmpdir()
    train.main(recipe({ max_iters = 2, out_dir = d }), {})
    local ok, err = pcall(train.main, recipe({ max_iters = 4, out_dir = d, n_embd = 32 }), { '--resume=latest' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('has n_embd = 16, this run has 32; not loaded', 1, true))
    -- another optimizer's state, or other mixture-of-experts blocks
    ok, err = pcall(train.main, recipe({ max_iters = 4, out_dir = d, optimizer = 'nanochat' }), { '--resume=latest' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("has optimizer = adamw, this run has nanochat; not loaded", 1, true), tostring(err))
    ok, err = pcall(train.main, recipe({ max_iters = 4, out_dir = d }), { '--resume=latest', '--moe.experts=4' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('has moe.experts = 0, this run has 4; not loaded', 1, true), tostring(err))
    local ck = d .. '/t/checkpoints/step_0000002/optim.safetensors'
    local f = io.open(ck, 'ab'); f:write('x'); f:close()
    ok, err = pcall(train.main, recipe({ max_iters = 4, out_dir = d }), { '--resume=latest' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('failed verification', 1, true))
    os.execute('rm -rf ' .. d)
  end)

  it('evaluates the whole validation split exactly (evaluate_full)', function()
    local t = train.new(recipe({ out_dir = tmpdir() }), {})
    local loss, ntok = t:evaluate_full()
    local n_val = t.data.val_tokens:numel()
    assert.equal(math.floor(math.floor((n_val - 1) / 16) / 4) * 4 * 16, ntok)
    assert.is_true(math.abs(loss - math.log(t.cfg.vocab_size)) < 0.3, 'loss at init ' .. loss)
    assert.equal(loss, (t:evaluate_full()))  -- deterministic
  end)

  it('parses --key=value overrides with types, and rejects unknown keys and bad values', function()
    local t = train.new(recipe({ out_dir = tmpdir() }), { '--n_embd=32', '--decay_lr=false', '--name=x', '--bias' })
    assert.equal(32, t.cfg.n_embd)
    assert.is_false(t.cfg.decay_lr)
    assert.equal('x', t.cfg.name)
    assert.is_true(t.cfg.bias)
    local ok, err = pcall(train.new, recipe(), { '--n_embdd=3' })
    assert.truthy(err:find('config: unknown key --n_embdd (did you mean --n_embd?)', 1, true), err)
    ok, err = pcall(train.new, recipe(), { '--n_embd=wide' })
    assert.truthy(err:find('config: --n_embd expects a finite number, got "wide"', 1, true))
    ok, err = pcall(train.new, recipe(), { 'positional' })
    assert.truthy(err:find('cannot parse argument "positional"', 1, true))
    ok, err = pcall(train.new, recipe({ n_embdd = 3 }), {})
    assert.truthy(err:find('config: unknown key n_embdd', 1, true))
    ok, err = pcall(train.new, recipe({ n_embd = '3' }), {})
    assert.truthy(err:find('config: n_embd must be a number, got string', 1, true))
  end)

  local bad = {
    { { n_embd = 30, n_head = 4 }, 'n_embd 30 is not divisible by n_head 4' },
    { { optimizer = 'sgdx' }, "unknown optimizer 'sgdx'" },
    { { learning_rate = -1 }, 'learning_rate must be >= 0, got -1' },
    { { block_size = 2000000 }, 'block_size 2000000 is longer than the data' },
    { { model = 'llama' }, "unknown model 'llama'" },
    { { batch_size = 0 }, 'config: batch_size must be an integer in [1, 2147483647], got 0' },
    { { device = 'cuda:0' }, 'device cuda:0 requested but no CUDA device is available' },
    { { data = 'web' }, "unknown data source 'web'" },
    { { dropout = 1 }, 'dropout must be in [0, 1), got 1' },
    { { warmup_iters = -3 }, 'config: warmup_iters must be an integer in [0, 9007199254740992], got -3' },
    { { log_interval = 0.5 }, 'config: log_interval must be a finite integer < 2^62, got 0.5' },
    -- numbers are finite; integer keys hold integers their type can hold (issue 14)
    { { max_iters = 1 / 0 }, 'config: max_iters must be a finite number, got inf' },
    { { learning_rate = 0 / 0 }, 'config: learning_rate must be a finite number, got nan' },
    { { max_iters = 2 ^ 70 }, 'config: max_iters must be a finite integer < 2^62, got 1.1805916207174e+21' },
    { { max_iters = 2 ^ 60 }, 'config: max_iters must be an integer in [1, 9007199254740992], got' },
    { { n_embd = 2 ^ 40 }, 'config: n_embd must be an integer in [0, 2147483647], got' },
    { { seed = 1.5 }, 'config: seed must be a finite integer < 2^62, got 1.5' },
    { { eval_interval = 5, eval_iters = 0 }, 'eval_iters must be >= 1 when eval_interval is set (5), got 0' },
  }
  for _, c in ipairs(bad) do
    it('rejects a bad config: ' .. c[2], function()
      local ok, err = pcall(train.new, recipe(c[1]), {})
      assert.is_false(ok)
      assert.truthy(tostring(err):find(c[2], 1, true), tostring(err))
    end)
  end

  it('refuses non-finite and out-of-range numbers and valueless keys on the command line, naming the key', function()
    for _, c in ipairs({
      { '--max_iters=inf', 'config: --max_iters expects a finite number, got "inf"' },
      { '--max_iters=nan', 'config: --max_iters expects a finite number, got "nan"' },
      { '--max_iters=1e400', 'config: --max_iters expects a finite number, got "1e400"' },
      { '--learning_rate=-inf', 'config: --learning_rate expects a finite number, got "-inf"' },
      { '--max_iters=1e300', 'config: max_iters must be a finite integer < 2^62, got 1e+300' },
      { '--threads=2.5', 'config: threads must be a finite integer < 2^62, got 2.5' },
      { '--max_iters', 'config: --max_iters needs a value (--max_iters=N)' },
      { '--device', 'config: --device needs a value (--device=VALUE)' },
      { '--fsdp.reduce_dtype', 'config: --fsdp.reduce_dtype needs a value' },
    }) do
      local ok, err = pcall(train.resolve_config, recipe(), { c[1] })
      assert.is_false(ok, c[1])
      assert.truthy(tostring(err):find(c[2], 1, true), c[1] .. ': ' .. tostring(err))
    end
    -- flags without a value still work: booleans, and --resume (latest)
    local cfg = train.resolve_config(recipe(), { '--bias', '--resume', '--fsdp.prefetch' })
    assert.is_true(cfg.bias); assert.is_true(cfg.resume); assert.is_true(cfg.fsdp.prefetch)
  end)

  it("resolves dtype 'auto' (the default) to float32 on the CPU and bfloat16 mixed precision on a GPU", function()
    assert.equal('auto', train.defaults.dtype)
    local cfg = train.resolve_config(recipe(), {})
    assert.equal('float32', cfg.dtype)
    assert.equal('bfloat16', train.auto_dtype('cuda:0'))
    assert.equal('float64', (train.resolve_config(recipe({ dtype = 'float64' }), {})).dtype)
    local ok, err = pcall(train.resolve_config, recipe(), { '--dtype=half' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("dtype must be auto, float32, float64 or bfloat16, got 'half'", 1, true))
  end)

  it('names a hook that returns the wrong thing, and what it returned', function()
    for _, c in ipairs({
      { 'build_model', function() end, 'recipe: hook build_model returned nil, expected a model' },
      { 'build_data', function() return 'data' end, "recipe: hook build_data returned the string 'data', expected a table with a train loader" },
      { 'build_optimizer', function() return true end, 'recipe: hook build_optimizer returned true, expected an optimizer' },
      { 'lr_schedule', function() return 0.1 end, 'recipe: hook lr_schedule returned 0.1, expected a function of the step' },
    }) do
      local r = recipe({ out_dir = tmpdir() })
      r[c[1]] = c[2]
      local ok, err = pcall(train.new, r, {})
      assert.is_false(ok, c[1])
      assert.truthy(tostring(err):find(c[3], 1, true), tostring(err))
    end
  end)

  it('refuses a checkpoint whose state.json lacks its config, naming the file and the field, and rewrites nothing', function()
    local d = tmpdir()
    train.main(recipe({ max_iters = 2, out_dir = d }), {})
    local sp = d .. '/t/checkpoints/step_0000002/state.json'
    local st = cjson.decode(io.open(sp):read('*a'))
    st.config = nil
    local f = io.open(sp, 'wb'); f:write(cjson.encode(st)); f:close()
    local before = io.open(sp):read('*a')
    local metrics = io.open(d .. '/t/metrics.jsonl'):read('*a')
    for _, iters in ipairs({ 2, 4 }) do
      local ok, err = pcall(train.main, recipe({ max_iters = iters, out_dir = d }), { '--resume=latest' })
      assert.is_false(ok)
      assert.truthy(tostring(err):find(sp .. ' has no config', 1, true), tostring(err))
    end
    assert.equal(before, io.open(sp):read('*a'))
    assert.equal(metrics, io.open(d .. '/t/metrics.jsonl'):read('*a'))
    assert.equal(1, #require('gptlua.checkpoint').list(d .. '/t/checkpoints'))
    os.execute('rm -rf ' .. d)
  end)

  it('refuses to resume when the checkpoints path is a file, and leaves the run alone', function()
    local d = tmpdir()
    os.execute(('mkdir -p %s/run && printf old > %s/run/checkpoints && printf metrics > %s/run/metrics.jsonl'):format(d, d, d))
    local t = train.new(recipe({ out_dir = d, name = 'run', max_iters = 2, resume = 'latest' }), {})
    local ok, err = pcall(t.run, t)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('resume: ' .. d .. '/run/checkpoints is a file, expected a directory', 1, true), tostring(err))
    assert.equal('metrics', io.open(d .. '/run/metrics.jsonl'):read('*a'))
    os.execute('rm -rf ' .. d)
  end)

  it('skips non-finite steps and stops after max_bad_steps in a row', function()
    local r = recipe({ max_iters = 20, max_bad_steps = 3, out_dir = tmpdir() })
    r.build_data = function()
      local L = fixed_loader(4, 16, 10)
      return { train = L, val = L, vocab_size = 10 }
    end
    local t = train.new(r, {})
    gl.no_grad(function() t.model.transformer.wte.weight:fill_(0 / 0) end)
    local ok, err = pcall(t.run, t)
    assert.is_false(ok)
    assert.truthy(tostring(err):find('3 steps in a row with a non-finite loss or gradient', 1, true))
  end)
end)

describe('recipes from the command line', function()
  local exe, root = GPTLUA.exe, GPTLUA.root
  it('runs the default recipe end to end for a few iterations, with eval lines and a sample', function()
    local d = tmpdir()
    local p = io.popen(('cd %s && %s recipes/shakespeare.lua --max_iters=6 --eval_interval=3 --eval_iters=2 ' ..
      '--log_interval=3 --sample_length=40 --out_dir=%s 2>&1; echo "exit=$?"'):format(root, exe, d))
    local out = p:read('*a'); p:close()
    assert.truthy(out:find('step 3: train loss %d+%.%d+, val loss %d+%.%d+'), out)
    assert.truthy(out:find('step     6/6 | loss', 1, true), out)
    assert.truthy(out:find('tok/s', 1, true))
    assert.truthy(out:find('--- sample ---', 1, true))
    assert.truthy(out:find('exit=0', 1, true), out)
    assert.truthy(io.open(d .. '/shakespeare/checkpoints/step_0000006/state.json'))
    os.execute('rm -rf ' .. d)
  end)
  it('saves a checkpoint and exits cleanly on SIGINT', function()
    local d = tmpdir()
    local cmd = ('cd %s && (%s recipes/shakespeare.lua --max_iters=100000 --eval_interval=0 --log_interval=1 ' ..
      '--n_layer=1 --out_dir=%s > %s/log 2>&1 & pid=$!; ' ..
      'for i in $(seq 1 300); do [ -s %s/shakespeare/metrics.jsonl ] && break; sleep 0.1; done; ' ..
      'kill -INT $pid; wait $pid; echo "exit=$?")'):format(root, exe, d, d, d)
    local p = io.popen(cmd)
    local out = p:read('*a'); p:close()
    local log = io.open(d .. '/log'):read('*a')
    assert.truthy(out:find('exit=0', 1, true), out .. log)
    assert.truthy(log:find('interrupted at step %d+: saving a checkpoint'), log)
    local list = require('gptlua.checkpoint').list(d .. '/shakespeare/checkpoints')
    assert.equal(1, #list)
    assert.is_not_nil(require('gptlua.checkpoint').load(list[1].path))
    os.execute('rm -rf ' .. d)
  end)
end)
