-- nanochat's current model (version 'v2', nanochat commit 92d63d4) and the
-- first-release one ('v1') against an independent float64 PyTorch reference
-- (spec/fixtures/nanochat_v2, made by make_fixture.py there from nanochat's
-- definitions): the loss and every gradient from the same weights and ids.
-- Then each feature on its own: float64 finite-difference gradient checks,
-- the window rule, the padded vocabulary, generation with the KV cache
-- (smear's previous token, sliding windows) against full forwards, and the
-- version keys (defaults, bad values, checkpoints).
local gl = require 'gptlua'
local nanochat = require 'gptlua.models.nanochat'
local ckpt = require 'gptlua.checkpoint'
local gradcheck = require 'spec.support.gradcheck'
local cjson = require 'cjson'

local FIX = gl.root .. '/spec/fixtures/nanochat_v2'

local function fixture()
  local f = assert(io.open(FIX .. '/expected.json'))
  local e = cjson.decode(f:read('*a'))
  f:close()
  return e
end

-- the fixture's tensor t as float64, cut to p's rows (the first-release
-- model has the unpadded vocabulary; the reference cut its logits there)
local function fit(t, p)
  t = t:to('float64')
  if t.shape[1] ~= p.shape[1] then t = t:narrow(1, 1, p.shape[1]):contiguous() end
  return t
end

-- the fixture's model of `version`, its weights loaded, in float64
local function fixture_model(e, version, extra)
  local c = e.config
  local cfg = { version = version, depth = c.n_layer, n_embd = c.n_embd, n_head = c.n_head, n_kv_head = c.n_kv_head,
                vocab_size = c.vocab_size, block_size = c.block_size, softcap = c.softcap }
  if version == 'v2' then cfg.pad_vocab_to, cfg.short_window = c.pad_vocab_to, c.short_window end
  for k, v in pairs(extra or {}) do cfg[k] = v end
  local m = nanochat.GPT(cfg)
  m:to('float64')
  local W = ckpt.load_safetensors(FIX .. '/weights.safetensors')
  local sd = {}
  for _, np in ipairs(m:named_parameters()) do sd[np[1]] = fit(assert(W[np[1]], 'fixture lacks ' .. np[1]), np[2]) end
  m:load_state_dict(sd)
  return m
end

local function ids_of(rows) return gl.tensor(rows, { dtype = 'int64' }) end

local function compare(version)
  local e = fixture()
  local m = fixture_model(e, version)
  local _, loss = m:forward(ids_of(e.ids), ids_of(e.targets))
  local want = tonumber(e['loss_' .. version])
  assert.is_true(math.abs(loss:item() - want) <= 1e-12 * math.abs(want),
    ('%s loss %.17g, reference %.17g'):format(version, loss:item(), want))
  loss:backward()
  local G = ckpt.load_safetensors(FIX .. '/grads_' .. version .. '.safetensors')
  local n, worst = 0, 0
  for _, np in ipairs(m:named_parameters()) do
    local name, p = np[1], np[2]
    local g = fit(assert(G[name], 'reference has no gradient for ' .. name), p)
    local scale = math.max(g:abs():max():item(), 1e-30)
    local err = p.grad:max_abs_diff(g) / scale
    worst = math.max(worst, err)
    assert.is_true(err < 1e-12, ('%s %s: gradient differs by %.3g of its largest element'):format(version, name, err))
    assert.is_true(g:abs():max():item() > 0 or name == 'lm_head.weight', name .. ': the reference gradient is zero')
    n = n + 1
  end
  local m_n = 0
  for _ in pairs(G) do m_n = m_n + 1 end
  assert.equal(m_n, n)
  return math.abs(loss:item() - want) / want, worst
end

describe('nanochat against the float64 PyTorch reference', function()
  it("'v2' (92d63d4): loss and every gradient agree to 1e-12 (measured 3e-15)", function() compare("v2") end)
  it("'v1' (the first-release model): loss and every gradient agree to 1e-12 (measured 3e-15)", function() compare("v1") end)
end)

-- a tiny float64 v2 model with random weights everywhere
local function tiny(extra, seed)
  gl.manual_seed(seed or 7)
  local cfg = { version = 'v2', depth = 3, n_embd = 24, n_head = 4, n_kv_head = 2, vocab_size = 11, block_size = 8,
                pad_vocab_to = 8, short_window = 2 }
  for k, v in pairs(extra or {}) do cfg[k] = v end
  local m = nanochat.GPT(cfg)
  m:to('float64')
  gl.no_grad(function()
    for i, p in ipairs(m:parameters()) do p:add_(gl.randn(p.shape, { seed = 50 + i, dtype = 'float64' }), 0.2) end
  end)
  return m
end

describe('nanochat v2 features', function()
  local ids = ids_of({ { 1, 5, 2, 9, 3, 3, 0 }, { 4, 4, 10, 1, 7, 2, 6 } })
  -- every parameter of a model whose only v2 feature is `feature` (the
  -- first-release values otherwise), by central differences
  local function check_feature(extra)
    local cfg = { version = 'v1' }
    for k, v in pairs(extra) do cfg[k] = v end
    cfg.depth, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.vocab_size, cfg.block_size = 3, 24, 4, 2, 11, 8
    gl.manual_seed(3)
    local m = nanochat.GPT(cfg)
    m:to('float64')
    gl.no_grad(function()
      for i, p in ipairs(m:parameters()) do p:add_(gl.randn(p.shape, { seed = 70 + i, dtype = 'float64' }), 0.2) end
    end)
    local params = m:parameters()
    gradcheck.check(function()
      local _, loss = m:forward(ids, ids)
      return loss
    end, params, { tol = 1e-6, sample = 7 })
  end
  for _, case in ipairs({
    { 'lambdas', { lambdas = true } }, { 'value embeddings and their gates', { value_embeds = true } },
    { 'smear', { smear = true } }, { 'backout', { backout = true } },
    { 'sliding windows', { window_pattern = 'SL', short_window = 2 } }, { 'qk_scale', { qk_scale = 1.2 } },
    { "norm_eps 'dtype'", { norm_eps = 'dtype' } }, { 'padded vocabulary', { pad_vocab_to = 8 } } }) do
    it('gradient check (float64 central differences): ' .. case[1], function() check_feature(case[2]) end)
  end

  it("the window rule is nanochat's: a quarter of the context rounded up to 128, the last layer long", function()
    local function lefts(T, pattern, n)
      local cfg = nanochat.resolve({ version = 'v2', depth = n, n_embd = 128, n_head = 1, block_size = T,
                                     vocab_size = 10, window_pattern = pattern })
      local r = {}
      for i = 1, n do r[i] = nanochat.window_left(cfg, i) end
      return r
    end
    -- (nanochat's comment says 2048 -> 768; its expression gives 512)
    assert.same({ 512, 512, 512, 2048, 512, 2048 }, lefts(2048, 'SSSL', 6))
    assert.same({ 256, 1024, 256, 1024 }, lefts(1024, 'SL', 4))
    assert.same({ 128, 128, 256 }, lefts(256, 'sss', 3))  -- the last layer is long whatever the pattern
    assert.same({ 128, 200 }, lefts(200, 'S', 2))
    -- gl's window counts the query too: FA3's left 128 is 129 keys; long layers pass none
    local m = nanochat.GPT({ version = 'v2', depth = 2, n_embd = 32, n_head = 1, block_size = 512, vocab_size = 10 })
    assert.equal(129, m.transformer.h[1].attn.window)
    assert.equal(0, m.transformer.h[2].attn.window)
  end)

  it('a short layer sees exactly short_window keys back and itself', function()
    local m = tiny({ window_pattern = 'S', depth = 2, backout = false, smear = false, value_embeds = false,
                     lambdas = false })
    -- changing token p moves layer 1's output at p..p+2 only (left 2);
    -- layer 2 (long) spreads it further, so look at layer 1 alone
    local a = ids_of({ { 1, 2, 3, 4, 5, 6, 7, 8 } })
    local b = ids_of({ { 1, 2, 9, 4, 5, 6, 7, 8 } })
    local tr = m.transformer
    local function layer1(idx)
      return gl.no_grad(function()
        local cfg = m.config
        local rot = { cos = m.rope_cos:narrow(1, 1, 8):to('float64'), sin = m.rope_sin:narrow(1, 1, 8):to('float64') }
        local x = gl.rms_norm(tr.wte(idx), nil, 2 ^ -52)
        tr.h[1].rotary, tr.h[1].eps = rot, 2 ^ -52
        return tr.h[1].attn(x, rot.cos, rot.sin, nil, nil, 2 ^ -52), cfg
      end)
    end
    local d = (layer1(a) - layer1(b)):abs():max(3):totable()[1]
    assert.equal(0, d[1]); assert.equal(0, d[2])
    for t = 3, 5 do assert.is_true(d[t] > 0, 'position ' .. t) end
    for t = 6, 8 do assert.equal(0, d[t], 'position ' .. t) end
  end)

  it('pads the vocabulary to a multiple of pad_vocab_to and cuts the logits back', function()
    local m = tiny()
    assert.same({ 16, 24 }, m.transformer.wte.weight.shape)
    assert.same({ 16, 24 }, m.lm_head.weight.shape)
    assert.same({ 16, 12 }, m.value_embeds['2'].weight.shape)
    local logits = gl.no_grad(m.forward, m, ids)
    assert.same({ 2, 7, 11 }, logits.shape)
    local _, loss = m:forward(ids, ids)
    loss:backward()
    -- the padding rows of the head get no gradient
    assert.equal(0, m.lm_head.weight.grad:narrow(1, 12, 5):abs():max():item())
    assert.equal(16, nanochat.resolve({ version = 'v2', vocab_size = 16, depth = 2, pad_vocab_to = 16 }).padded_vocab_size)
    assert.equal(64, nanochat.resolve({ version = 'v2', vocab_size = 65, depth = 2, pad_vocab_to = 64 }).padded_vocab_size - 64)
  end)

  it('value embeddings on the layers nanochat puts them, the last always', function()
    local function layers(n)
      local cfg = nanochat.resolve({ version = 'v2', depth = n, n_embd = 32, n_head = 1, vocab_size = 10 })
      local r = {}
      for i = 1, n do if nanochat.has_ve(cfg, i) then r[#r + 1] = i - 1 end end
      return r
    end
    assert.same({ 1, 3 }, layers(4)); assert.same({ 0, 2, 4 }, layers(5)); assert.same({ 0 }, layers(1))
  end)

  it('generation with the KV cache equals full forwards (smear keeps the previous token, windows slide)', function()
    local m = tiny({ block_size = 12 })
    local prompt = ids_of({ { 1, 5, 2, 9 } })
    local out = m:generate(prompt, 7, { temperature = 0 })
    local seq = { 1, 5, 2, 9 }
    for _ = 1, 7 do
      local l = gl.no_grad(m.forward, m, ids_of({ seq }))
      local _, i = gl.max(l:select(2, #seq), 2)
      seq[#seq + 1] = i:item()
    end
    assert.same(seq, out:totable()[1])
    -- and the cached logits themselves, step by step
    local caches = m:new_caches(1, 12)
    gl.no_grad(function()
      local full = m:forward(ids_of({ seq }))
      local first = m:forward(ids_of({ { seq[1], seq[2], seq[3] } }), nil, caches)
      assert.is_true(first:max_abs_diff(full:narrow(2, 1, 3)) < 1e-12)
      for t = 4, 10 do
        local step = m:forward(ids_of({ { seq[t] } }), nil, caches)
        assert.is_true(step:max_abs_diff(full:narrow(2, t, 1)) < 1e-12, 'position ' .. t)
      end
    end)
  end)

  it('activation checkpointing gives the same gradients (the value embeddings included)', function()
    local function grads(ac)
      local m = tiny({ activation_checkpointing = ac })
      local _, loss = m:forward(ids, ids)
      loss:backward()
      local r = {}
      for _, np in ipairs(m:named_parameters()) do r[np[1]] = np[2].grad end
      return r
    end
    local a, b = grads(false), grads(true)
    for name, g in pairs(a) do assert.is_true(g:max_abs_diff(b[name]) < 1e-12, name) end
    assert.is_not_nil(a['value_embeds.0.weight'])
  end)

  it("init: nanochat's init_weights for 'v2'", function()
    gl.manual_seed(1)
    local m = nanochat.GPT({ version = 'v2', depth = 4, n_embd = 96, n_head = 2, vocab_size = 200, block_size = 8 })
    local s = math.sqrt(3 / 96)
    local h = m.transformer.h
    local r, x0 = m.resid_lambdas:totable(), m.x0_lambdas:totable()
    for i, v in ipairs({ 1.15, 1.15 - 0.1 / 3, 1.15 - 0.2 / 3, 1.05 }) do assert.is_true(math.abs(r[i] - v) < 1e-7) end
    for i, v in ipairs({ 0.2, 0.15, 0.1, 0.05 }) do assert.is_true(math.abs(x0[i] - v) < 1e-7) end
    assert.equal(0, m.smear_lambda:item()); assert.is_true(math.abs(m.backout_lambda:item() - 0.2) < 1e-7)
    assert.equal(0, h[1].attn.c_proj.weight:abs():max():item()); assert.equal(0, h[4].mlp.c_proj.weight:abs():max():item())
    assert.is_true(h[2].attn.c_q.weight:abs():max():item() <= s)
    assert.is_true(h[2].attn.c_q.weight:abs():max():item() > 0.9 * s)
    assert.is_true(h[2].mlp.c_fc.weight:abs():max():item() <= 0.4 * s)
    for _, w in ipairs({ m.smear_gate.weight, h[2].attn.ve_gate.weight }) do
      assert.is_true(w:min():item() >= 0 and w:max():item() <= 0.02)
    end
    local std = m.transformer.wte.weight:pow(2):mean():item() ^ 0.5
    assert.is_true(math.abs(std - 0.8) < 0.05, 'wte std ' .. std)
    -- v2's width from depth is rounded up to whole heads of head_dim
    assert.equal(256, nanochat.resolve({ version = 'v2', depth = 3 }).n_embd)
    assert.equal(192, nanochat.resolve({ version = 'v1', depth = 3 }).n_embd)
  end)

  -- F.rms_norm(x, shape) without eps takes the epsilon of the type it
  -- accumulates in (at::opmath_type): float32's 2^-23 for bfloat16 and
  -- float16 inputs, the dtype's own for float32 and float64
  it("norm_eps 'dtype' is PyTorch's F.rms_norm default: float32's epsilon for bfloat16 and float16", function()
    assert.same({ float32 = 2 ^ -23, float64 = 2 ^ -52, bfloat16 = 2 ^ -23, float16 = 2 ^ -23 }, nanochat.MACHINE_EPS)
    gl.manual_seed(4)
    local m = nanochat.GPT({ version = 'v2', depth = 2, n_embd = 64, n_head = 1, vocab_size = 16, block_size = 8,
                             smear = false })
    m:to('bfloat16')
    assert.equal(2 ^ -23, m:prepare(0, 4))
    -- an embedding whose mean square (1e-4) is below bfloat16's epsilon (2^-7 = 0.0078):
    -- the norm with 2^-23 scales it to rms 1, the one with 2^-7 would leave it near 0.11
    gl.no_grad(function() m.transformer.wte.weight:fill_(0.01) end)
    local idx = gl.tensor({ { 1, 2, 3 } }, { dtype = 'int64' })
    local x = gl.no_grad(m.embed, m, idx):to('float32')
    local rms = x:pow(2):mean():item() ^ 0.5
    assert.is_true(math.abs(rms - 1) < 2 ^ -7, 'rms of the normed embedding ' .. rms)
  end)

  it("FLOPs per token are nanochat's estimate_flops: products only, short layers count their window", function()
    local m = nanochat.GPT({ version = 'v2', depth = 4, n_embd = 64, n_head = 2, vocab_size = 100, block_size = 512 })
    local C, Vp = 64, 128
    local per_block = 4 * C * C + 2 * 4 * C * C   -- q, k, v, proj; fc, proj (n_kv_head = n_head)
    local matmul = 4 * per_block + 2 * 2 * 12 + 24 + Vp * C   -- ve gates on layers 1, 3; smear gate; head
    assert.equal(6 * matmul + 12 * C * (3 * 128 + 512), m:flops_per_token())
  end)
end)

describe('nanochat versions', function()
  it("defaults to the first-release model, whose keys match 'v1' exactly", function()
    local cfg = nanochat.resolve({ depth = 2, vocab_size = 10 })
    assert.equal('v1', cfg.version)
    assert.is_true(nanochat.first_release(cfg))
    assert.is_false(nanochat.first_release(nanochat.resolve({ depth = 2, vocab_size = 10, smear = true })))
    for k, v in pairs(nanochat.versions.v1) do assert.equal(v, cfg[k], k) end
    local v2 = nanochat.resolve({ version = 'v2', depth = 2, vocab_size = 10, smear = false, rope_base = 5000 })
    assert.is_false(v2.smear); assert.equal(5000, v2.rope_base); assert.is_true(v2.backout)
  end)

  it('refuses bad feature values in one line naming the key', function()
    for _, case in ipairs({
      { { version = 'v3' }, "version must be 'v1' or 'v2', got 'v3'" },
      { { qk_scale = -1 }, 'qk_scale must be a positive number' },
      { { rope_base = 0 }, 'rope_base must be a positive number' },
      { { norm_eps = 'x' }, "norm_eps must be a number in %[0, 1%) or 'dtype'" },
      { { window_pattern = 'SXL' }, 'window_pattern must be a string of S and L' },
      { { short_window = 1.5 }, 'short_window must be an integer >= 0' },
      { { smear = 1 }, 'smear must be true or false' },
      { { pad_vocab_to = 0 }, 'pad_vocab_to must be a positive integer' },
      { { init = 'v9' }, "init must be 'v1' or 'v2'" },
      { { smear = true, n_embd = 16, n_head = 2 }, 'smear reads the first 24 channels, n_embd is 16' },
      { { bogus = 1 }, 'unknown model option bogus' } }) do
      local cfg = { depth = 2, vocab_size = 10 }
      for k, v in pairs(case[1]) do cfg[k] = v end
      local ok, err = pcall(nanochat.GPT, cfg)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(case[2]), tostring(err))
      assert.is_nil(tostring(err):find('traceback'))
    end
  end)
end)

describe('nanochat versions in the trainer', function()
  local train = require 'gptlua.train'
  local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end
  local function recipe(over)
    local r = { name = 'nc', model = 'nanochat', optimizer = 'nanochat', data = 'char', n_layer = 2, n_head = 2,
                n_embd = 32, block_size = 16, batch_size = 2, max_iters = 2, eval_interval = 0, log_interval = 1,
                sample_length = 0, warmup_iters = 1, quiet = true, device = 'cpu', control = false, journal = false,
                tensorboard = false }
    for k, v in pairs(over or {}) do r[k] = v end
    return r
  end

  it('takes the version and each feature as nanochat.KEY, from a recipe and the command line', function()
    local t = train.new(recipe({ out_dir = tmpdir(), nanochat = { version = 'v2', smear = false } }),
                        { '--nanochat.rope_base=5000', '--nanochat.backout=off' })
    local c = t.model.config
    assert.equal('v2', c.version); assert.is_false(c.smear); assert.is_false(c.backout); assert.equal(5000, c.rope_base)
    assert.is_true(c.value_embeds); assert.equal(1.2, c.qk_scale); assert.equal(128, t.model.lm_head.weight.shape[1])
    local v1 = train.new(recipe({ out_dir = tmpdir() }), {})
    assert.is_true(nanochat.first_release(v1.model.config))
    for _, case in ipairs({ { '--nanochat.version=v3', "config: nanochat.version must be 'v1' or 'v2', got 'v3'" },
                            { '--nanochat.smear=maybe', "config: nanochat.smear must be true, false or 'auto', got maybe" },
                            { '--nanochat.short_window=-1', 'config: nanochat.short_window must be an integer >= 0' } }) do
      local ok, err = pcall(train.new, recipe({ out_dir = tmpdir() }), { case[1] })
      assert.is_false(ok)
      assert.truthy(tostring(err):find(case[2], 1, true), tostring(err))
    end
  end)

  it('checkpoints record the version: a resume under another version is refused, an old checkpoint is v1', function()
    local d = tmpdir()
    train.main(recipe({ out_dir = d, nanochat = { version = 'v2' } }), {})
    local ok, err = pcall(train.main, recipe({ out_dir = d, max_iters = 3 }), { '--resume=latest' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('has nanochat.version = v2, this run has v1; not loaded', 1, true), tostring(err))
    ok, err = pcall(train.main, recipe({ out_dir = d, max_iters = 3, nanochat = { version = 'v2', smear = false } }),
                    { '--resume=latest' })
    assert.is_false(ok)
    assert.truthy(tostring(err):find('has nanochat.smear = true, this run has false', 1, true), tostring(err))
    local res = train.main(recipe({ out_dir = d, max_iters = 3, nanochat = { version = 'v2' } }), { '--resume=latest' })
    assert.equal(1, #res.losses)
    -- a checkpoint written before the versions (no nanochat table) is the first-release model
    local d1 = tmpdir()
    train.main(recipe({ out_dir = d1 }), {})
    local st = d1 .. '/nc/checkpoints/step_0000002/state.json'
    local f = assert(io.open(st)); local s = cjson.decode(f:read('*a')); f:close()
    assert.equal('v1', s.config.nanochat.version)
    local t = train.new(recipe({ out_dir = tmpdir(), nanochat = { version = 'v2' } }), {})
    assert.equal('version', select(1, nanochat.config_mismatch(nil, t.cfg.nanochat)))
    assert.is_nil(nanochat.config_mismatch(nil, { version = 'v1' }))
    os.execute('rm -rf ' .. d .. ' ' .. d1)
  end)
end)

describe('recipes/speedrun.lua', function()
  local train = require 'gptlua.train'
  local function speedrun() return dofile(gl.root .. '/recipes/speedrun.lua') end

  it("is nanochat's v2 model with nanochat's parameter groups, every parameter in exactly one", function()
    local d = os.tmpname(); os.remove(d)
    local t = train.new(speedrun(), { '--device=cpu', '--quiet', '--out_dir=' .. d, '--control=false', '--block_size=32' })
    assert.equal('v2', t.model.config.version)
    local seen, n = {}, 0
    local adam, muon = t.optimizer.optimizers[1], t.optimizer.optimizers[2]
    for _, o in ipairs({ adam, muon }) do
      for _, g in ipairs(o.groups) do
        for i, p in ipairs(g.params) do
          assert.is_nil(seen[p], g.names[i] .. ' twice'); seen[p] = g; n = n + 1
        end
      end
    end
    assert.equal(#t.model:parameters(), n)
    local scale = (128 / 768) ^ -0.5
    local want = { ['lm_head.weight'] = { 0.008 * scale, 0.8, 0.96, 0.01 }, ['transformer.wte.weight'] = { 0.3 * scale, 0.8, 0.995, 0.001 },
                   ['value_embeds.1.weight'] = { 0.15 * scale, 0.8, 0.995, 0.01 }, resid_lambdas = { 0.005, 0.8, 0.95, 0.05 },
                   x0_lambdas = { 0.5, 0.96, 0.95, 0 }, smear_lambda = { 0.2, 0.8, 0.95, 0 }, backout_lambda = { 0.2, 0.8, 0.95, 0 } }
    for _, g in ipairs(adam.groups) do
      for i, name in ipairs(g.names) do
        local w = want[name]
        if w then
          assert.is_true(math.abs(g.initial_lr - w[1]) < 1e-12, name)
          assert.same({ w[2], w[3] }, g.betas); assert.equal(w[4], g.weight_decay); assert.equal(1e-10, g.eps)
          want[name] = nil
        end
      end
    end
    assert.is_nil(next(want))
    assert.is_true(seen[t.model.transformer.h[2].attn.ve_gate.weight].momentum ~= nil)  -- Muon, as nanochat
    os.execute('rm -rf ' .. d)
  end)

  it("schedules are base_train.py's: warmup 40, warm-down over the last 65% to 5%, momentum 0.85 -> 0.97 -> 0.90", function()
    local r = speedrun()
    local lr, mom = r.lr_schedule({ max_iters = 1000 }), r.momentum_schedule({ max_iters = 2000 })
    assert.equal(1 / 40, lr(0)); assert.equal(1, lr(39)); assert.equal(1, lr(350))
    assert.is_true(math.abs(lr(1000) - 0.05) < 1e-12); assert.is_true(math.abs(lr(675) - 0.525) < 1e-12)  -- halfway down
    assert.equal(0.85, mom(0)); assert.is_true(math.abs(mom(200) - 0.91) < 1e-12)
    assert.equal(0.97, mom(400)); assert.equal(0.97, mom(699))
    assert.is_true(math.abs(mom(1350) - 0.935) < 1e-12); assert.is_true(math.abs(mom(2000) - 0.90) < 1e-12)
  end)

  it('trains a few steps (the trainer takes its momentum_schedule hook)', function()
    local d = os.tmpname(); os.remove(d)
    local r = speedrun()
    local asked = {}
    local mom = r.momentum_schedule
    r.momentum_schedule = function(cfg) local f = mom(cfg); return function(it) asked[#asked + 1] = it; return f(it) end end
    local res = train.main(r, { '--device=cpu', '--quiet', '--out_dir=' .. d, '--control=false', '--block_size=32',
                               '--max_iters=3', '--eval_interval=0', '--sample_length=0' })
    assert.equal(3, #res.losses)
    assert.same({ 0, 1, 2 }, asked)
    os.execute('rm -rf ' .. d)
  end)
end)

describe('nanochat v2 on the GPU vs the CPU #cuda', function()
  local gpu_it = gl.cuda_available() and it or function(name) pending(name .. ' (no CUDA device on this machine)') end
  gpu_it('float32: loss and every gradient within 1e-5 / 1e-4 of the tensor (windows, GQA, every feature)', function()
    local function build()
      gl.manual_seed(9)
      local m = nanochat.GPT({ version = 'v2', depth = 4, n_embd = 64, n_head = 4, n_kv_head = 2, vocab_size = 50,
                               block_size = 16, short_window = 3 })
      gl.no_grad(function()  -- every weight nonzero, so each gradient path is live
        for i, p in ipairs(m:parameters()) do p:add_(gl.randn(p.shape, { seed = 30 + i }), 0.05) end
      end)
      return m
    end
    local cpu, gpu = build(), build():to('cuda')
    local ids = gl.tensor({ { 1, 7, 3, 9, 4, 4, 2, 11, 13, 0, 5, 8, 6, 49, 1, 2 } }, { dtype = 'int64' })
    local _, lc = cpu:forward(ids, ids)
    local _, lg = gpu:forward(ids:to('cuda'), ids:to('cuda'))
    assert.is_true(math.abs(lc:item() - lg:item()) <= 1e-5 * math.abs(lc:item()))
    lc:backward(); lg:backward()
    local pg = gpu:named_parameters()
    for i, np in ipairs(cpu:named_parameters()) do
      local a, b = np[2].grad, pg[i][2].grad:to('cpu')
      local scale = math.max(a:abs():max():item(), 1e-12)
      assert.is_true(a:max_abs_diff(b) <= 1e-4 * scale, np[1])
    end
  end)
end)
