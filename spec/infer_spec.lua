-- The KV-cache engine (lua/gptlua/infer.lua): cached decode against the
-- full forward, its log-probabilities against the training forward's,
-- sampling (temperature, top-k, top-p, seeds), stop tokens, the context's
-- end, and `gptlua generate`.
local gl = require 'gptlua'
local infer = require 'gptlua.infer'
local gpt2 = require 'gptlua.models.gpt2'
local nanochat = require 'gptlua.models.nanochat'
local root, exe = GPTLUA.root, GPTLUA.exe

local V, T = 40, 14
local SIZES = { vocab_size = V, block_size = 16, n_layer = 2, n_head = 2, n_embd = 32 }
local function sizes(extra)
  local c = {}
  for k, v in pairs(SIZES) do c[k] = v end
  for k, v in pairs(extra or {}) do c[k] = v end
  return c
end
local MODELS = {
  { 'gpt2', function() return gpt2.GPT(sizes()) end },
  { 'nanochat v1', function() return nanochat.GPT(sizes()) end },
  -- v2: smear (the cache keeps the previous position's embedding), sliding windows, value embeddings
  { 'nanochat v2', function() return nanochat.GPT(sizes({ version = 'v2', n_kv_head = 1 })) end },
}
local function build(make, dtype)
  gl.manual_seed(7)
  local m = make()
  if dtype ~= 'float32' then m:to(dtype) end
  -- nanochat zeroes its output projections at init: random ones, so every layer matters
  gl.no_grad(function()
    for _, p in ipairs(m:parameters()) do if p:numel() > 1 then p:copy_(gl.randn(p.shape, { seed = p:numel() }):to(p.dtype) * 0.3) end end
  end)
  m:eval()
  return m
end
local IDS = {}
for t = 1, T do IDS[t] = (t * 7 + 3) % V end

-- logits rows (T, V) as Lua tables: the full forward, and prefill(first k) + one-token decodes
local function full_rows(m)
  return gl.no_grad(function() return m:forward(gl.tensor({ IDS }, { dtype = 'int64' })) end):to('float64'):totable()[1]
end
local function cached_rows(m, k)
  local e = infer.Engine.new(m, nil)
  local rows = {}
  gl.no_grad(function()
    local caches, last = e:prefill({ unpack(IDS, 1, k) }, 1, T)
    rows[k] = last:to('float64'):totable()[1]
    for t = k + 1, T do rows[t] = e:decode(caches, { IDS[t] }):to('float64'):totable()[1] end
  end)
  return rows
end
local function max_diff(a, b, from)
  local d, scale = 0, 0
  for t = from, T do for i = 1, V do d = math.max(d, math.abs(a[t][i] - b[t][i])); scale = math.max(scale, math.abs(b[t][i])) end end
  return d, scale
end

describe('KV-cache engine', function()
  it('decodes with the cache what the full forward computes at each last position', function()
    -- Tolerance (the CUDA twins' rule, spec/support/cuda_twin.lua): cached and full forward are two
    -- float32 evaluations of one function whose products sum in another order (BLAS's kernel for
    -- 1 row is not its kernel for 14); against the float64 forward of the same weights the cached
    -- one may err at most twice the full one's own error plus (eps32 + eps32 sqrt(n)) of the
    -- logits' scale, n = 4 n_embd the longest sum.  In float64 the same with eps64.
    for _, case in ipairs(MODELS) do
      local ref = full_rows(build(case[2], 'float64'))
      for _, dt in ipairs({ 'float32', 'float64' }) do
        local m = build(case[2], dt)
        local full = full_rows(m)
        for _, k in ipairs({ 1, 5 }) do
          local cached = cached_rows(m, k)
          local eps = dt == 'float32' and 2 ^ -23 or 2 ^ -52
          local err_full, scale = max_diff(full, ref, k)
          local err_cached = max_diff(cached, ref, k)
          local tol = 2 * err_full + (eps + eps * math.sqrt(4 * SIZES.n_embd)) * scale
          assert.is_true(err_cached <= tol, ('%s %s prefill %d: cached error %.3g, full %.3g, tolerance %.3g'):format(
            case[1], dt, k, err_cached, err_full, tol))
        end
      end
    end
  end)

  it('computes a sequence\'s log-probabilities as the training forward does, bit for bit', function()
    for _, case in ipairs(MODELS) do
      local m = build(case[2], 'float32')
      local lp = infer.Engine.new(m, nil):logprobs(IDS)
      assert.equal(T - 1, #lp)
      -- the training step's loss on these tokens: the mean of exactly these numbers, summed and
      -- scaled as the loss kernel does (float32 sum, times 1/count)
      local x, y = { unpack(IDS, 1, T - 1) }, { unpack(IDS, 2, T) }
      local loss = gl.no_grad(function()
        local _, l = m:forward(gl.tensor({ x }, { dtype = 'int64' }), gl.tensor({ y }, { dtype = 'int64' }))
        return l:item()
      end)
      local neg = {}
      for i, v in ipairs(lp) do neg[i] = -v end
      local mean = (gl.sum(gl.tensor(neg, { dtype = 'float32' })) * gl.tensor({ 1 / (T - 1) }, { dtype = 'float32' })):item()
      assert.equal(loss, mean, case[1])
    end
  end)

  it('reports each sampled token\'s log-probability, the full forward\'s to the decode\'s rounding', function()
    local m = build(MODELS[2][2], 'float32')
    local e = infer.Engine.new(m, nil)
    local prompt = { unpack(IDS, 1, 4) }
    local rows = e:generate(prompt, { n = 3, max_tokens = 8, temperature = 1, seed = 5 })
    assert.equal(3, #rows)
    local ref = build(MODELS[2][2], 'float64')
    for b, r in ipairs(rows) do
      assert.equal(8, #r.ids); assert.equal('length', r.finish)
      local seq = { unpack(prompt) }
      for _, id in ipairs(r.ids) do seq[#seq + 1] = id end
      local full = e:logprobs(seq)
      local exact = infer.Engine.new(ref, nil):logprobs(seq)
      -- a log-probability z_t - lse(z) moves at most 2 max|dz|; each of the two float32 values is
      -- within the logits rule of the float64 one (the test above), so the two differ by at most
      -- the sum of their distances to it, and each is 4 n_embd sums of eps32 from it at worst
      for i, v in ipairs(r.logprobs) do
        local j = #prompt - 1 + i
        local d_full = math.abs(full[j] - exact[j])
        assert.is_true(math.abs(v - full[j]) <= 2 * d_full + 2 * 2 ^ -23 * math.sqrt(4 * 32) * math.max(1, math.abs(exact[j])),
          ('row %d token %d: %.9g vs %.9g'):format(b, i, v, full[j]))
      end
    end
    -- the rows are independent draws: not all the same
    assert.is_false(table.concat(rows[1].ids, ',') == table.concat(rows[2].ids, ',')
      and table.concat(rows[2].ids, ',') == table.concat(rows[3].ids, ','))
  end)

  it('repeats a sample from its seed and ends rows at stop tokens, max_tokens and the context', function()
    local m = build(MODELS[1][2], 'float32')
    local e = infer.Engine.new(m, nil)
    local prompt = { 1, 2, 3 }
    local a = e:generate(prompt, { n = 2, max_tokens = 6, temperature = 0.9, top_k = 10, top_p = 0.9, seed = 11 })
    local b = e:generate(prompt, { n = 2, max_tokens = 6, temperature = 0.9, top_k = 10, top_p = 0.9, seed = 11 })
    assert.same(a, b)
    local greedy = e:generate(prompt, { max_tokens = 6, temperature = 0 })[1]
    -- greedy = the argmax of the full forward at every step
    local seq = { unpack(prompt) }
    for _, id in ipairs(greedy.ids) do
      local logits = gl.no_grad(function() return m:forward(gl.tensor({ seq }, { dtype = 'int64' })) end)
      local row = logits:select(2, #seq):to('float64'):totable()[1]
      local best = 1
      for i = 2, V do if row[i] > row[best] then best = i end end
      assert.equal(best - 1, id)
      seq[#seq + 1] = id
    end
    -- a stop token ends the row before it (greedy's third token); tokens stream as chosen
    local streamed = {}
    local stopped = e:generate(prompt, { max_tokens = 6, temperature = 0, stop = { greedy.ids[3] },
      on_token = function(row, id) streamed[#streamed + 1] = row .. ':' .. id end })[1]
    local first = nil
    for i, id in ipairs(greedy.ids) do if id == greedy.ids[3] then first = i break end end
    assert.equal(first - 1, #stopped.ids)
    assert.equal('stop', stopped.finish)
    assert.equal(#stopped.ids, #streamed)
    -- the context: block_size 16 leaves 13 tokens after 3
    assert.equal(13, #e:generate(prompt, { max_tokens = 100, temperature = 0 })[1].ids)
    local long = {}
    for i = 1, 16 do long[i] = i end
    assert.has_error(function() e:generate(long, {}) end,
      'generate: the prompt has 16 tokens, block_size 16 leaves no room to generate')
    -- should_stop ends every row
    local n = 0
    local r = e:generate(prompt, { n = 2, max_tokens = 10, should_stop = function() n = n + 1 return n == 3 end })
    assert.equal('interrupted', r[1].finish); assert.equal(3, #r[1].ids)
  end)

  it('generates a batch of prompts of different lengths as each prompt alone', function()
    -- GPT-2 (learned positions), nanochat v1 (rotary) and v2 (smear, sliding windows, value embeddings,
    -- grouped-query heads): left padding must be neither attended, nor positioned, nor smeared in
    local prompts = { { 5, 9, 2 }, { 1, 2, 3, 4, 5, 6, 7 }, { 11 }, { 8, 3, 30, 12, 6 } }
    local eps = 2 ^ -23
    for _, case in ipairs(MODELS) do
      local m, ref = build(case[2], 'float32'), build(case[2], 'float64')
      for _, model in ipairs({ m, ref }) do  -- the smear's lambda starts at 0: on, so that it matters
        if model.smear_lambda then gl.no_grad(function() model.smear_lambda:fill_(0.8) end) end
      end
      local e, e64 = infer.Engine.new(m, nil), infer.Engine.new(ref, nil)
      local batch = e:generate(prompts, { max_tokens = 6, temperature = 0 })
      assert.equal(#prompts, #batch)
      for b, p in ipairs(prompts) do
        local alone = e:generate(p, { max_tokens = 6, temperature = 0 })[1]
        local exact = e64:generate(p, { max_tokens = 6, temperature = 0 })[1]
        assert.same(alone.ids, batch[b].ids, ('%s prompt %d'):format(case[1], b))
        assert.same(exact.ids, alone.ids, ('%s prompt %d in float64'):format(case[1], b))
        assert.equal('length', batch[b].finish)
        -- both are float32 evaluations of one function (the batch's products sum the rows in other
        -- orders): each within the logits rule of the float64 one (the tests above), so they differ by
        -- at most the sum of their distances to it, each 4 n_embd sums of eps32 at worst
        for i, v in ipairs(batch[b].logprobs) do
          local d_alone = math.abs(alone.logprobs[i] - exact.logprobs[i])
          assert.is_true(math.abs(v - alone.logprobs[i]) <= 2 * d_alone + 2 * eps * math.sqrt(4 * 32)
            * math.max(1, math.abs(exact.logprobs[i])), ('%s prompt %d token %d: %.9g alone %.9g'):format(
            case[1], b, i, v, alone.logprobs[i]))
        end
      end
    end
    -- n rows per prompt, in order; an empty prompt named
    local m = build(MODELS[1][2], 'float32')
    local two = infer.Engine.new(m, nil):generate({ { 1, 2 }, { 3 } }, { n = 2, max_tokens = 3, temperature = 0 })
    assert.equal(4, #two)
    assert.same(two[1].ids, two[2].ids); assert.same(two[3].ids, two[4].ids)
    assert.has_error(function() infer.Engine.new(m, nil):generate({ { 1 }, {} }, {}) end,
      'generate: prompt 2 must be at least one token')
  end)

  it('samples from temperature, top-k and top-p as computed by hand', function()
    local row = { 0, math.log(2), math.log(3) }  -- probabilities 1/6, 2/6, 3/6
    local s = infer.sample_row
    assert.equal(0, s(row, {}, 0.1)); assert.equal(1, s(row, {}, 0.2)); assert.equal(2, s(row, {}, 0.6))
    assert.equal(2, s(row, { temperature = 0 }, 0.01))
    -- top_k 2 keeps ids 2 and 1 (3/5, 2/5), highest first
    assert.equal(2, s(row, { top_k = 2 }, 0.59)); assert.equal(1, s(row, { top_k = 2 }, 0.61))
    -- top_p 0.5: id 2 alone reaches half the mass; 0.6: ids 2 and 1
    assert.equal(2, s(row, { top_p = 0.5 }, 0.99)); assert.equal(1, s(row, { top_p = 0.6 }, 0.99))
    -- temperature 2: weights sqrt(1), sqrt(2), sqrt(3)
    local w = 1 + math.sqrt(2) + math.sqrt(3)
    assert.equal(0, s(row, { temperature = 2 }, 1 / w - 1e-9)); assert.equal(1, s(row, { temperature = 2 }, 1 / w + 1e-9))
    for _, bad in ipairs({ { { temperature = -1 }, 'temperature must be a number >= 0' }, { { top_k = 1.5 }, 'top_k must be an integer >= 0' },
                          { { top_p = 0 }, 'top_p must be in (0, 1]' } }) do
      local ok, err = pcall(infer.sampling_opts, bad[1], 'generate')
      assert.is_false(ok); assert.truthy(err:find('generate: ' .. bad[2], 1, true), err)
    end
  end)
end)

describe('gptlua generate', function()
  it('samples a run\'s checkpoint, repeatably from a seed', function()
    local out = os.tmpname(); os.remove(out)
    local cmd = ('cd %s && %s recipes/tiny.lua --quiet --max_iters=1 --eval_interval=0 --out_dir=%s --sample_length=0 '
      .. '--control=false --tensorboard=false'):format(root, exe, out)
    local r = os.execute(cmd)
    assert.is_true(r == 0 or r == true)
    local function gen(extra)
      return io.popen(('cd %s && %s generate %s/tiny --prompt "ROMEO:" --max_tokens=20 %s 2>&1; echo "rc=$?"'):format(
        root, exe, out, extra)):read('*a')
    end
    local a, b = gen('--seed=3'), gen('--seed=3')
    assert.equal(a, b)
    assert.truthy(a:find('^ROMEO:'), a)
    assert.truthy(a:find('rc=0\n$'), a)
    local two = gen('--seed=3 --n=2')
    assert.truthy(two:find('\n%-%-%-%-%-%-%-%-%-%-%-%-%-%-%-\nROMEO:'), two)
    assert.equal('generate: top_p must be in (0, 1], got 2\nrc=1\n', gen('--top_p=2'))
    local chat = io.popen(('cd %s && %s chat %s/tiny < /dev/null 2>&1; echo "rc=$?"'):format(root, exe, out)):read('*a')
    assert.truthy(chat:find('^chat: .*tokenizer has no <|bos|>: fine%-tune it with recipes/sft%.lua first\nrc=1\n$'), chat)
    os.execute('rm -rf ' .. out)
  end)
end)
