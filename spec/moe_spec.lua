-- Mixture-of-experts layers (lua/gptlua/moe.lua) in both model families:
-- the whole layer's gradient (with its balancing and z losses) against
-- float64 central differences, the router's choice and its bias update,
-- the keys' checks, active parameters equal to the dense model's, and
-- training: recipes/moe.lua at a tiny size lowers the loss and writes the
-- expert load into metrics.jsonl, a recipe's moe_router hook routes, a
-- capacity drops, activation checkpointing keeps the gradients.
local gl = require 'gptlua'
local moe = require 'gptlua.moe'
local train = require 'gptlua.train'
local cjson = require 'cjson'

local function tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end
local root = gl.root

-- a layer's value for the gradient check: sum(out R) plus its balancing and
-- z losses (whose gradient backward adds at scale 1)
local function layer_value(layer, x, R)
  moe.begin_step({ { 'l', layer } }, 1)
  local out = layer(x)
  local s = layer.stats
  return out, (out * R):sum(), s and (s.aux:item() + s.z:item()) or 0
end

local function check_layer(mc, act, N, C)
  local mcr = moe.resolve(mc, C)
  local layer = moe.MoE(mcr, C, act, 0.3, 0.3):to('float64')
  gl.no_grad(function() layer.router.weight:copy_(gl.randn(layer.router.weight.shape, { seed = 7, dtype = 'float64' })) end)
  layer:train()
  local x = gl.randn({ N, C }, { seed = 8, dtype = 'float64' }):requires_grad_()
  local R = gl.randn({ N, C }, { seed = 9, dtype = 'float64' })
  local _, v = layer_value(layer, x, R)
  v:backward()
  local inputs = { x }
  for _, np in ipairs(layer:named_parameters()) do inputs[#inputs + 1] = np[2] end
  local eps, worst = 1e-6, 0
  for k, t in ipairs(inputs) do
    local analytic = t.grad:contiguous():tolist()
    for i = 1, t:numel() do
      local flat = t:view(-1)
      local v0 = flat:get(i)
      local function value(val)
        gl.no_grad(function() flat:set(val, i) end)
        return gl.scope(function()
          local _, s, extra = layer_value(layer, x, R)
          return s:item() + extra
        end)
      end
      local fp, fm = value(v0 + eps), value(v0 - eps)
      value(v0)
      local numeric = (fp - fm) / (2 * eps)
      local err = math.abs(numeric - analytic[i]) / math.max(1, math.abs(numeric), math.abs(analytic[i]))
      worst = math.max(worst, err)
      assert(err < 1e-6, ('input %d element %d: analytic %.10g vs numeric %.10g'):format(k, i, analytic[i], numeric))
    end
  end
  return worst
end

describe('moe layer', function()
  it('gradient of the whole layer (router, experts, shared expert, losses) matches float64 central differences', function()
    -- softmax router, GELU experts, a shared expert, a capacity that drops, both losses
    check_layer({ experts = 4, top_k = 2, shared = 1, hidden = 5, capacity_factor = 0.75, aux_loss = 0.1, z_loss = 0.01 },
      'gelu', 9, 6)
    -- sigmoid router with the selection bias on, ReLU² experts, top-1, dropless
    check_layer({ experts = 3, top_k = 1, hidden = 4, router = 'sigmoid', bias_update = 0.01, aux_loss = 0.05 },
      'relu2', 7, 5)
  end)

  it('top_k picks the largest scores; the bias steers the choice, never the weights', function()
    local x = gl.tensor({ { 0.1, 0.5, 0.3, 0.2 }, { 0.9, 0.1, 0.8, 0.0 } })
    assert.same({ 1, 2, 0, 2 }, moe.top_k(x, 2):tolist())
    local layer = moe.MoE(moe.resolve({ experts = 4, top_k = 2, bias_update = 0.1, router = 'sigmoid' }, 4), 4, 'relu2', 0.02, 0)
    local logits = gl.tensor({ { 2.0, 1.0, 0.0, -1.0 } })
    layer.expert_bias:copy_(gl.tensor({ 0, 0, 5, 0 }))
    local experts, w = layer.policy:route(layer, logits)
    assert.same({ 2, 0 }, experts:tolist())  -- expert 2 lifted by its bias, then expert 0
    local s2, s0 = 1 / (1 + math.exp(0)), 1 / (1 + math.exp(-2))
    local wl = w:tolist()
    assert.near(s2 / (s0 + s2), wl[1], 1e-6)
    assert.near(s0 / (s0 + s2), wl[2], 1e-6)
    -- after a step: +rate below the mean load, -rate above, unchanged at it
    layer.policy:after_step(layer, gl.tensor({ 1, 5, 3, 3 }))
    assert.same(gl.tensor({ 0.1, -0.1, 5, 0 }):tolist(), layer.expert_bias:tolist())  -- (float32 buffer)
  end)

  it('refuses bad moe keys in one line naming the key', function()
    local function err(t, extra)
      local r = { moe = t, device = 'cpu' }
      for k, v in pairs(extra or {}) do r[k] = v end
      local ok, e = pcall(train.resolve_config, r, {})
      assert.is_false(ok)
      return tostring(e)
    end
    assert.equal('config: moe.top_k must be an integer in [1, 4], got 5', err({ experts = 4, top_k = 5 }))
    assert.equal("config: moe.router must be 'softmax' or 'sigmoid', got 'relu'", err({ experts = 4, router = 'relu' }))
    assert.equal('config: moe.capacity_factor must be a finite number >= 0, got -1', err({ experts = 4, capacity_factor = -1 }))
    local ok, e = pcall(train.resolve_config, { device = 'cpu' }, { '--moe.every=0', '--moe.experts=2' })
    assert.is_false(ok)
    assert.equal('config: moe.every must be an integer >= 1, got 0', tostring(e))
  end)

  it('has the active parameters of the dense model it replaces (plus the router), in both families', function()
    for _, fam in ipairs({ 'gpt2', 'nanochat' }) do
      local base = { vocab_size = 65, block_size = 16, n_layer = 2, n_head = 2, n_embd = 16 }
      if fam == 'gpt2' then base.bias = false end
      local M = require('gptlua.models.' .. fam)
      local dense = M.GPT(base)
      base.moe = { experts = 8, top_k = 2, hidden = 32, every = 2 }  -- the second block only
      local sparse = M.GPT(base)
      local router = 8 * 16
      assert.equal(dense:num_params() + router, sparse:num_params() - moe.inactive_params(sparse))
      assert.equal(1, #moe.layers(sparse))
      assert.equal(dense:flops_per_token(16) + 6 * router, sparse:flops_per_token(16))
    end
    local m = require('gptlua.models.gpt2').GPT({ vocab_size = 65, block_size = 8, n_layer = 1, n_head = 2, n_embd = 8,
      moe = { experts = 2, top_k = 1 } })
    local ok, err = pcall(require('gptlua.hf').save_gpt2, m, os.tmpname() .. '.d')
    assert.is_false(ok)
    assert.matches('hf.save_gpt2: a gpt2 model with mixture%-of%-experts blocks has no Hugging Face GPT%-2 form', err)
  end)

  -- recipes/moe.lua, tiny
  local function tiny(over, args)
    local r = dofile(root .. '/recipes/moe.lua')
    local t = { n_layer = 2, n_head = 2, n_embd = 32, block_size = 32, batch_size = 8, max_iters = 30,
                warmup_iters = 3, lr_decay_iters = 30, eval_interval = 0, log_interval = 5, sample_length = 0,
                quiet = true, device = 'cpu', out_dir = tmpdir(), threads = 1 }
    for k, v in pairs(t) do r[k] = v end
    r.moe.hidden = 2 * r.n_embd
    for k, v in pairs(over or {}) do r[k] = v end
    return r, train.main(r, args or {})
  end
  local function records(r)
    local out = {}
    local p = assert(io.popen('ls -d ' .. r.out_dir .. '/' .. r.name .. '*'))
    local dir = p:read('*l'); p:close()
    for line in io.lines(dir .. '/metrics.jsonl') do
      local rec = cjson.decode(line)
      if rec.loss then out[#out + 1] = rec end
    end
    return out, dir
  end
  local function mean(t, a, b) local s = 0 for i = a, b do s = s + t[i] end return s / (b - a + 1) end

  it('recipes/moe.lua trains at a tiny size: the loss falls, the expert load is in metrics.jsonl', function()
    local r, res = tiny()
    local L = res.losses
    assert.is_true(mean(L, 26, 30) < mean(L, 1, 5) - 0.3, ('loss %.3f -> %.3f'):format(mean(L, 1, 5), mean(L, 26, 30)))
    local last = records(r)[#records(r)]
    for _, l in ipairs({ 0, 1 }) do
      local p = 'moe.layer' .. l .. '.'
      assert.is_true(last[p .. 'load_max_mean'] >= 1, p .. 'load_max_mean')
      assert.is_true(last[p .. 'load_cv'] >= 0, p .. 'load_cv')
      assert.equal(0, last[p .. 'dropped'])
      assert.is_true(last[p .. 'aux_loss'] > 0, p .. 'aux_loss')
      -- the biases moved apart, 30 steps of 1e-3 at most each (float32 sums)
      local lo, hi = last[p .. 'bias_min'], last[p .. 'bias_max']
      assert.is_true(hi > lo and hi <= 30e-3 * (1 + 1e-5) and lo >= -30e-3 * (1 + 1e-5), ('bias %g..%g'):format(lo, hi))
    end
    assert.is_true(last.moe_load_max_mean >= 1)
    -- TensorBoard gets every layer's numbers, `gptlua plot` a row of MoE panels
    local tags = {}
    for _, s in ipairs(require('gptlua.observe.tensorboard').scalars(last)) do tags[s[1]] = true end
    assert.is_true(tags['train/moe.layer1.load_cv'] and tags['train/moe.layer0.dropped'] and tags['train/moe_load_max_mean'])
    local plot = require 'gptlua.observe.plot'
    local _, dir = records(r)
    local script = plot.script({ plot.read_run(dir) }, tmpdir())
    assert.truthy(script:find('set multiplot layout 4,2', 1, true), script)
    assert.truthy(script:find("set title 'MoE expert load, max / mean (worst layer)'", 1, true), script)
    assert.truthy(script:find("run1_train.dat' using 1:9 with lines", 1, true), script)
  end)

  it("a recipe's moe_router hook routes, and a capacity drops what it cannot keep", function()
    -- every token to experts 0 and 1: their load is all of it, E/K = 4 times the mean
    local r = tiny({ max_iters = 2, log_interval = 1, moe_router = function(cfg)
      local R = moe.router(moe.resolve(cfg.moe, cfg.n_embd))
      function R:route(layer, logits)
        local N = logits.shape[1]
        local ex = gl.tensor({ 0, 1 }, { dtype = 'int64' }):view(1, 2):expand(N, 2):contiguous()
        return ex, gl.full({ N, 2 }, 0.5), gl.softmax(logits, -1)
      end
      return R
    end })
    local rec = records(r)[2]
    assert.equal(4, rec['moe.layer0.load_max_mean'])
    -- capacity factor 1 with everything on 2 of 8 experts: each keeps N K / E of its N, 3/4 dropped
    r = tiny({ max_iters = 1, log_interval = 1, moe_router = r.moe_router })
    r.moe.capacity_factor = 1
    r.out_dir = tmpdir()
    train.main(r, {})
    assert.equal(0.75, records(r)[1]['moe.layer0.dropped'])
  end)

  it("the README's moe_router example runs as a recipe hook, its router in every layer", function()
    local f = assert(io.open(root .. '/README.md', 'rb'))
    local readme = f:read('*a'); f:close()
    local code = assert(readme:match("```lua\n(local moe = require 'gptlua.moe'\nmoe_router = .-)```"))
    local env = setmetatable({}, { __index = _G })
    assert(load(code, 'README', 't', env))()
    local seen = 0
    local r = tiny({ max_iters = 1, log_interval = 1, moe_router = function(cfg)
      local router = env.moe_router(cfg)
      local route = router.route
      function router:route(layer, logits) seen = seen + 1; return route(self, layer, logits) end
      return router
    end })
    assert.equal(2, seen)  -- both blocks' layers, one forward
    assert.equal(1, #records(r))
  end)

  it('activation checkpointing gives the same gradients, balancing losses included', function()
    local grads = {}
    for _, ckpt in ipairs({ false, true }) do
      gl.manual_seed(3)
      local m = require('gptlua.models.nanochat').GPT({ vocab_size = 20, block_size = 8, n_layer = 2, n_head = 2,
        n_embd = 16, activation_checkpointing = ckpt, moe = { experts = 4, top_k = 2, aux_loss = 0.1, z_loss = 0.1 } })
      m:to('float64'):train()
      gl.no_grad(function()
        for _, p in ipairs(m:parameters()) do p:copy_(gl.randn(p.shape, { seed = p:numel(), dtype = 'float64' }) * 0.3) end
      end)
      local idx = gl.tensor({ { 1, 5, 7, 2, 9, 3, 0, 4 } }, { dtype = 'int64' })
      moe.begin_step(moe.layers(m), 0.5)
      local _, loss = m:forward(idx, idx)
      loss:backward()
      grads[#grads + 1] = m.transformer.h[1].mlp.router.weight.grad:tolist()
    end
    for i = 1, #grads[1] do assert.near(grads[1][i], grads[2][i], 1e-12) end
  end)
end)
