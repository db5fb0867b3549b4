-- The shipped recipes are valid configurations, and the helper recipes run.
local train = require 'gptlua.train'
local root, exe = GPTLUA.root, GPTLUA.exe

describe('shipped recipes', function()
  for _, name in ipairs({ 'shakespeare', 'shakespeare_gpu', 'gpt2_124m', 'nanochat_d20', 'tiny' }) do
    it(name .. '.lua is a valid config', function()
      local r = dofile(root .. '/recipes/' .. name .. '.lua')
      local cfg = train.resolve_config(r, { '--device=cpu' })
      assert.equal('cpu', cfg.device)
      assert.is_true(cfg.max_iters > 0)
    end)
  end
  it("tiny.lua is the README's example, word for word, and trains as the README says", function()
    local f = assert(io.open(root .. '/README.md', 'rb'))
    local readme = f:read('*a')
    f:close()
    f = assert(io.open(root .. '/recipes/tiny.lua', 'rb'))
    local tiny = f:read('*a')
    f:close()
    assert.equal(readme:match('```lua\n(%-%- recipes/tiny%.lua.-)```'), tiny)
    local d = os.tmpname(); os.remove(d)
    local p = io.popen(('cd %s && %s recipes/tiny.lua --max_iters=4 --eval_interval=2 --eval_iters=1 --sample_length=0 '
      .. '--device=cpu --out_dir=%s 2>&1; echo "rc=$?"'):format(root, exe, d))
    local out = p:read('*a')
    p:close()
    assert.truthy(out:find('rc=0', 1, true), out)
    assert.truthy(out:find('step 4: train loss', 1, true), out)
    os.execute('rm -rf ' .. d)
  end)
  it('gpt2_124m and nanochat_d20 are the documented sizes', function()
    local g = train.resolve_config(dofile(root .. '/recipes/gpt2_124m.lua'), { '--device=cpu' })
    assert.same({ 12, 12, 768, 1024 }, { g.n_layer, g.n_head, g.n_embd, g.block_size })
    local n = require('gptlua.models.nanochat').resolve({ depth = 20, vocab_size = 65536, block_size = 2048 })
    assert.same({ 20, 1280, 10 }, { n.n_layer, n.n_embd, n.n_head })
  end)
  it('sample.lua generates from a checkpoint, deterministically for a seed', function()
    local d = os.tmpname(); os.remove(d)
    local function sh(cmd) local p = io.popen('cd ' .. root .. ' && ' .. cmd .. ' 2>&1'); local s = p:read('*a'); p:close(); return s end
    sh(('%s recipes/shakespeare.lua --max_iters=2 --eval_interval=0 --sample_length=0 --n_layer=1 --out_dir=%s'):format(exe, d))
    local cmd = ('%s recipes/sample.lua --ckpt %s/shakespeare/checkpoints --prompt "ROMEO:" --n=30 --seed=3'):format(exe, d)
    local a, b = sh(cmd), sh(cmd)
    assert.truthy(a:match('^ROMEO:'), a)
    assert.equal(a, b)
    assert.is_true(#a >= 36)
    -- an empty prompt: the char tokenizer has no document token to start from
    local empty = sh(('%s recipes/sample.lua --ckpt %s/shakespeare/checkpoints --prompt "" --n=5'):format(exe, d))
    assert.equal('sample: --prompt must encode to at least one token, got "" (this tokenizer has no <|bos|> or '
      .. '<|endoftext|> to start from)\n', empty)
    local bad = sh(exe .. ' recipes/sample.lua --bogus=1')
    assert.truthy(bad:find('sample: unknown key --bogus', 1, true), bad)
    os.execute('rm -rf ' .. d)
  end)
end)

describe('distributed recipes', function()
  it('runs the default recipe on 2 ranks under fsdp, evaluating and sampling on every rank', function()
    local d = os.tmpname(); os.remove(d)
    local p = io.popen(('cd %s && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 %s -n 2 ' ..
      'recipes/shakespeare.lua --dist=fsdp --max_iters=4 --eval_interval=2 --eval_iters=1 --log_interval=2 ' ..
      '--sample_length=20 --n_layer=2 --out_dir=%s 2>&1; echo "exit=$?"'):format(root, exe, d))
    local out = p:read('*a'); p:close()
    assert.truthy(out:find('exit=0', 1, true), out)
    assert.truthy(out:find('step 4: train loss', 1, true), out)
    assert.truthy(out:find('--- sample ---', 1, true), out)
    local _, n = out:gsub('step 4: train loss', '')
    assert.equal(1, n)  -- rank 0 prints, the others stay quiet
    os.execute('rm -rf ' .. d)
  end)
end)

describe('benchmarks', function()
  it('the whole-model benchmark path runs (shrunk models on CPU)', function()
    local p = io.popen(('cd %s && %s recipes/tools/bench.lua --only=models --small=1 --iters=1 2>&1; echo "exit=$?"'):format(root, exe))
    local out = p:read('*a'); p:close()
    assert.truthy(out:find('exit=0', 1, true), out)
    for _, m in ipairs({ 'gpt2_124m', 'nanochat_d12', 'nanochat_d20' }) do
      assert.truthy(out:find(m .. ': [%d.]+ ms/step, %d+ tokens/s, MFU'), out)
    end
  end)
  it('the MoE step benchmark times recipes/moe.lua against its dense model and prints the ratio', function()
    local p = io.popen(('cd %s && %s recipes/tools/moe_step.lua --iters=1 --rounds=1 2>&1; echo "exit=$?"'):format(root, exe))
    local out = p:read('*a'); p:close()
    assert.truthy(out:find('exit=0', 1, true), out)
    assert.truthy(out:find('dense +[%d.]+ +1%.00 +%d+\n'), out)
    local ms = out:match('moe 8 x top%-2 +([%d.]+) +[%d.]+ +%d+\n')
    assert.truthy(ms and tonumber(ms) > 0, out)
  end)
  it('the CPU training-step benchmark runs its rounds and reports ms/iter, MFU and the BLAS share', function()
    local p = io.popen(('cd %s && %s recipes/tools/bench.lua --only=step --iters=2 --rounds=2 2>&1; echo "exit=$?"'):format(root, exe))
    local out = p:read('*a'); p:close()
    assert.truthy(out:find('exit=0', 1, true), out)
    assert.truthy(out:find('round 2: gptlua gpt2 [%d.]+ ms/iter, gptlua nanochat [%d.]+ ms/iter, gptlua recipe [%d.]+ ms/iter'), out)
    -- each step says what it is: the default recipe's own (Muon) apart from the AdamW comparisons
    for _, label in ipairs({ "nanoGPT's GPT%-2 block, AdamW %(the PyTorch comparison%)",
                             "the recipe's block %(nanochat v1%), AdamW",
                             'the default recipe as it trains %(nanochat v1 block, Muon %+ AdamW%)' }) do
      assert.truthy(out:find('training step %(4x128, batch 12, context 64%), ' .. label ..
        ': [%d.]+ ms/iter, %d+ tokens/s, MFU [%d.]+%% of [%d.]+ GFLOP/s sgemm[^,]*, %d+%% in BLAS, peak memory [%d.]+ [KM]iB'), out)
    end
  end)
end)
