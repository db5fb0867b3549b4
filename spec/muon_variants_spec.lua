-- Muon's variants (gptlua.optim: muon_variant 'classic' / 'current', and
-- each of Polar Express, MuonEq, Muon+, NorMuon and cautious weight decay
-- alone) against a float64 PyTorch reference written from nanochat 92d63d4
-- (spec/fixtures/muon_v2/make_fixture.py, numbers in expected.json); small
-- cases checked by hand; nanochat's parameter groups; state, checkpoints
-- and the config keys.  Sharded runs: spec/dist_muon_spec.lua.
local gl = require 'gptlua'
local optim = require 'gptlua.optim'
local train = require 'gptlua.train'
local cjson = require 'cjson'
local nn = require 'gptlua.nn'

local function read(path)
  local f = assert(io.open(gl.root .. '/' .. path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end

local function max_diff(t, want)
  local got, m = t:to('float64'):flatten():tolist(), 0
  assert.equal(#want, #got)
  for i = 1, #want do m = math.max(m, math.abs(got[i] - want[i])) end
  return m
end

local fixture = cjson.decode(read('spec/fixtures/muon_v2/expected.json'))

-- runs one fixture case through optim.Muon in `dtype`; returns the
-- optimizer, the parameter and the largest difference per step
local function run_case(case, dtype)
  local input = fixture.inputs[case.input]
  local shape = input.shape
  local W = gl.tensor(input.W0, { dtype = dtype }):view(shape[1], shape[2]):requires_grad_()
  local opts = { lr = fixture.lr, state_dtype = dtype }
  for k, v in pairs(case.opts) do opts[k] = v end
  local opt = optim.Muon({ W }, opts)
  local diffs = {}
  for s, mu in ipairs(fixture.momenta) do
    opt.groups[1].momentum = mu   -- what a momentum schedule does through set_momentum
    W.grad = gl.tensor(input.grads[s], { dtype = dtype }):view(shape[1], shape[2])
    opt:step()
    diffs[s] = max_diff(W, case.W[s])
  end
  return opt, W, diffs
end

describe('Muon variants', function()
  it('every variant and each of its parts equal the float64 reference over 3 steps (wide, tall, square)', function()
    assert.equal(27, #fixture.cases)
    for _, case in ipairs(fixture.cases) do
      local opt, W, diffs = run_case(case, 'float64')
      local what = ('%s {%s}'):format(case.name, table.concat(fixture.inputs[case.input].shape, ','))
      for s, d in ipairs(diffs) do assert.is_true(d < 1e-12, ('%s step %d: %.3g'):format(what, s, d)) end
      local st = opt.state[W]
      assert.is_true(max_diff(st.momentum_buffer, case.momentum_buffer) < 1e-13, what .. ' momentum')
      if case.second_momentum_buffer then
        assert.is_true(max_diff(st.second_momentum_buffer, case.second_momentum_buffer) < 1e-12, what .. ' NorMuon v')
      else
        assert.is_nil(st.second_momentum_buffer, what)
      end
    end
  end)

  it("in float32 the 'current' variant stays within float32 rounding of the reference", function()
    for _, case in ipairs(fixture.cases) do
      if case.name == 'current' or case.name == 'classic' then
        local _, _, diffs = run_case(case, 'float32')
        for s, d in ipairs(diffs) do assert.is_true(d < 2e-5, ('%s float32 step %d: %.3g'):format(case.name, s, d)) end
      end
    end
  end)

  it('the default Muon is the classic variant', function()
    local W = gl.randn({ 4, 3 }, { seed = 1 })
    local o = optim.Muon({ W })
    local g = o.groups[1]
    assert.same({ 'classic', 'newton_schulz', false, false, 0, false, 0 },
      { g.variant, g.ortho, g.row_equilibrate, g.renormalize, g.normuon_beta2, g.cautious, g.weight_decay })
    assert.same({ { 'momentum_buffer', { 4, 3 } } }, o:param_state(W, g))
    local P = gl.randn({ 4, 3 }, { seed = 2, dtype = 'float64' })   -- state is fp32 unless asked (state_dtype)
    local o64 = optim.Muon({ P })
    P.grad = gl.randn({ 4, 3 }, { seed = 3, dtype = 'float64' })
    o64:step()
    assert.equal('float32', o64.state[P].momentum_buffer.dtype)
  end)

  it('Polar Express on a diagonal matrix is the scalar polynomial on each diagonal entry', function()
    -- X X^T is diagonal, so every step maps each entry x to a x + b x^3 + c x^5
    local s = { 3, 1, 0.25, 0.01 }
    local G = gl.zeros({ 4, 6 }, { dtype = 'float64' })
    for i, v in ipairs(s) do G:set(v, i, i) end
    local norm = 0
    for _, v in ipairs(s) do norm = norm + v * v end
    norm = math.sqrt(norm)
    for steps = 1, 5 do
      local X = optim.newton_schulz(G, steps, nil, 'polar_express')
      for i, v in ipairs(s) do
        local x = v / (1.01 * norm + 1e-6)
        for k = 1, steps do
          local c = optim.POLAR_EXPRESS[k]
          x = c[1] * x + c[2] * x ^ 3 + c[3] * x ^ 5
        end
        assert.near(x, X:get(i, i), 1e-13)
      end
      assert.equal(0, X:get(1, 2))
    end
    -- five steps bring all four (from 3 down to 0.01 of the largest) near 1
    local X = optim.newton_schulz(G, 5, nil, 'polar_express')
    for i = 1, 4 do assert.is_true(math.abs(X:get(i, i) - 1) < 0.15, 'entry ' .. i .. ': ' .. X:get(i, i)) end
    assert.has_error(function() optim.newton_schulz(G, 6, nil, 'polar_express') end,
      'newton_schulz: polar_express has coefficients for 5 steps, got steps = 6')
  end)

  it('cautious weight decay decays only where update and parameter agree in sign (by hand)', function()
    -- ns_steps = 0: the direction is the Nesterov momentum u over |u| + 1e-7,
    -- on the first step u = (1 - mu^2) g (mu = 0.95)
    local W0 = { 1, -2, 3, -4 }
    local g = { 0.5, 0.5, -1, -1 }
    local function step(cautious)
      local W = gl.tensor(W0, { dtype = 'float64' }):view(2, 2)
      local o = optim.Muon({ W }, { lr = 0.1, ns_steps = 0, weight_decay = 0.5, cautious = cautious,
        state_dtype = 'float64' })
      W.grad = gl.tensor(g, { dtype = 'float64' }):view(2, 2)
      o:step()
      return W:flatten():tolist()
    end
    local k = 1 - 0.95 ^ 2
    local gn = math.sqrt(0.25 + 0.25 + 1 + 1)
    local plain, cautious = step(false), step(true)
    for i = 1, 4 do
      local x = k * g[i] / (k * gn + 1e-7)
      assert.near(W0[i] - 0.1 * x - 0.1 * 0.5 * W0[i], plain[i], 1e-14)
      local agree = x * W0[i] >= 0   -- entries 1 and 4 agree, 2 and 3 do not
      assert.equal(i == 1 or i == 4, agree)
      assert.near(W0[i] - 0.1 * x - (agree and 0.1 * 0.5 * W0[i] or 0), cautious[i], 1e-14)
    end
  end)

  it('NorMuon gives every neuron of the longer side the same norm and keeps the whole norm (first step, by hand)', function()
    -- v starts at 0, so after one step v = (1 - beta2) mean(X^2) per row and
    -- X scaled by v^-1/2 has rows of one norm; the rescale restores |X|
    local W = gl.zeros({ 6, 3 }, { dtype = 'float64' })
    local o = optim.Muon({ W }, { lr = 1, ns_steps = 0, momentum = 0, nesterov = false, normuon_beta2 = 0.9,
      state_dtype = 'float64' })
    local G = gl.randn({ 6, 3 }, { seed = 2, dtype = 'float64' })
    for j = 1, 3 do G:set(G:get(2, j) * 10, 2, j) end   -- one loud row
    W.grad = G
    o:step()
    local U = W * -1                                   -- the applied direction (lr 1)
    local rows = gl.norm(U, 2):tolist()
    for i = 2, 6 do assert.near(rows[1], rows[i], 1e-12) end
    -- ns_steps 0: X = G / (|G| + 1e-7); the rate is scaled by sqrt(6 / 3)
    local gn = gl.global_norm({ G })
    assert.near(math.sqrt(2) * gn / (gn + 1e-7), gl.global_norm({ U }), 1e-12)
    assert.same({ 6, 1 }, o.state[W].second_momentum_buffer.shape)
    local sq = gl.mean(gl.square(G / (gn + 1e-7)), 2, true)
    assert.is_true(o.state[W].second_momentum_buffer:max_abs_diff(sq * 0.1) < 1e-12)
  end)

  it('refuses bad options in one line', function()
    local W = gl.zeros({ 2, 2 })
    assert.has_error(function() optim.Muon({ W }, { variant = 'newest' }) end,
      "Muon: variant must be 'classic' or 'current', got the string 'newest'")
    assert.has_error(function() optim.Muon({ W }, { ortho = 'polar_express', ns_steps = 6 }) end,
      'Muon: ns_steps must be an integer in [0, 5], got 6')
    assert.has_error(function() optim.Muon({ W }, { normuon_beta2 = 1 }) end, 'Muon: normuon_beta2 must be in [0, 1), got 1')
    assert.has_error(function() optim.Muon({ W }, { weight_decay = -1 }) end,
      'Muon: weight_decay must be a number >= 0, got -1')
    assert.has_error(function() optim.Muon({ W }, { ortho = 'svd' }) end,
      "Muon: ortho must be one of newton_schulz, polar_express, got the string 'svd'")
    -- tensor parallelism overrides the direction with the classic one: the
    -- variant's steps would be skipped silently, so they are refused
    local o = optim.Muon({ W }, { variant = 'current' })
    o.update_direction = optim.Muon.update_direction
    W.grad = gl.ones({ 2, 2 })
    assert.has_error(function() o:step() end, "Muon: tensor parallelism runs the classic variant's direction, got variant current")
  end)

  it('state saves and restores exactly, and a variant mismatch is refused by name', function()
    local function run(restore_at, opts2)
      local W = gl.randn({ 6, 4 }, { seed = 3 })
      local opts = { lr = 0.02, variant = 'current', weight_decay = 0.2 }
      local opt = optim.Muon({ { 'w', W } }, opts)
      for t = 1, 5 do
        if t == restore_at then
          local sd = opt:state_dict()
          local copy = { step = sd.step, tensors = {} }
          for k, v in pairs(sd.tensors) do copy.tensors[k] = v:clone() end
          opt = optim.Muon({ { 'w', W } }, opts2 or opts)
          opt:load_state_dict(copy)
        end
        W.grad = gl.randn({ 6, 4 }, { seed = 10 + t })
        opt:step()
      end
      return W:tolist(), opt
    end
    local straight, o = run(nil)
    assert.same({ 6, 1 }, o:state_dict().tensors['muon.w.second_momentum_buffer'].shape)
    assert.same(straight, (run(3)))
    assert.has_error(function() run(3, { lr = 0.02 }) end,
      'optimizer state: muon.w.second_momentum_buffer is in the checkpoint, but this Muon does not use NorMuon '
      .. '(muon_variant classic); the checkpoint was saved by another Muon variant')
  end)
end)

describe("optim.nanochat's parameter groups", function()
  -- a stand-in with nanochat 92d63d4's parameter names (n_embd 192: s = 2)
  local function model()
    local names = { { 'transformer.wte.weight', { 10, 8 } }, { 'value_embeds.1.weight', { 10, 8 } },
      { 'transformer.h.0.attn.c_q.weight', { 8, 8 } }, { 'transformer.h.0.attn.ve_gate.weight', { 2, 12 } },
      { 'transformer.h.0.mlp.c_fc.weight', { 32, 8 } }, { 'resid_lambdas', { 2 } }, { 'x0_lambdas', { 2 } },
      { 'smear_gate.weight', { 1, 24 } }, { 'smear_lambda', { 1 } }, { 'backout_lambda', { 1 } },
      { 'lm_head.weight', { 10, 8 } } }
    local list = {}
    for i, e in ipairs(names) do list[i] = { e[1], gl.zeros(e[2]) } end
    local m = nn.Module()
    m.config = { n_embd = 192 }
    function m.named_parameters() return list end
    return m
  end
  local function by_name(opt)
    local out = {}
    for _, o in ipairs(opt.optimizers) do
      for _, g in ipairs(o.groups) do
        for _, n in ipairs(g.names) do out[n] = { kind = getmetatable(o) == optim.Muon and 'muon' or 'adamw', g = g } end
      end
    end
    return out
  end

  it("'current' is setup_optimizer's: per-group lr, betas and weight decay; Muon for the block matrices", function()
    local groups = by_name(optim.nanochat(model(), { variant = 'current', muon_weight_decay = 0.28 }))
    local s = (192 / 768) ^ -0.5
    local want = {   -- name, lr, beta1, beta2, weight decay
      { 'lm_head.weight', 0.008 * s, 0.8, 0.96, 0.01 }, { 'transformer.wte.weight', 0.3 * s, 0.8, 0.995, 0.001 },
      { 'value_embeds.1.weight', 0.15 * s, 0.8, 0.995, 0.01 }, { 'resid_lambdas', 0.005, 0.8, 0.95, 0.05 },
      { 'x0_lambdas', 0.5, 0.96, 0.95, 0 }, { 'smear_gate.weight', 0.2, 0.8, 0.95, 0 },
      { 'smear_lambda', 0.2, 0.8, 0.95, 0 }, { 'backout_lambda', 0.2, 0.8, 0.95, 0 } }
    for _, w in ipairs(want) do
      local e = groups[w[1]]
      assert.equal('adamw', e.kind, w[1])
      assert.near(w[2], e.g.lr, 1e-15)
      assert.same({ w[3], w[4] }, e.g.betas)
      assert.equal(w[5], e.g.weight_decay)
      assert.equal(1e-10, e.g.eps)
    end
    for _, n in ipairs({ 'transformer.h.0.attn.c_q.weight', 'transformer.h.0.attn.ve_gate.weight',
                         'transformer.h.0.mlp.c_fc.weight' }) do
      local g = groups[n].g
      assert.equal('muon', groups[n].kind, n)
      assert.same({ 'current', 0.02, 0.95, 5, 0.9, 0.28, true }, { g.variant, g.lr, g.momentum, g.ns_steps,
        g.normuon_beta2, g.weight_decay, g.cautious })
    end
  end)

  it("'classic' keeps the first release's three AdamW groups and plain Muon", function()
    local groups = by_name(optim.nanochat(model()))
    local s = (192 / 768) ^ -0.5
    assert.near(0.2 * s, groups['transformer.wte.weight'].g.lr, 1e-15)
    assert.near(0.004 * s, groups['lm_head.weight'].g.lr, 1e-15)
    assert.near(0.004 * s, groups['resid_lambdas'].g.lr, 1e-15)
    assert.same({ 0.8, 0.95 }, groups['value_embeds.1.weight'].g.betas)
    assert.equal(0, groups['lm_head.weight'].g.weight_decay)
    assert.equal('classic', groups['transformer.h.0.mlp.c_fc.weight'].g.variant)
  end)
end)

describe('muon_variant in the trainer', function()
  local out = os.tmpname()
  os.remove(out)
  teardown(function() os.execute('rm -rf ' .. out) end)
  local function recipe(over)
    local r = { name = 'm', model = 'nanochat', optimizer = 'nanochat', muon_variant = 'current',
      muon_weight_decay = 0.1, n_layer = 2, n_head = 2, n_embd = 32, block_size = 16, batch_size = 2, max_iters = 6,
      eval_interval = 0, log_interval = 1, sample_length = 0, quiet = true, device = 'cpu', dtype = 'float32',
      seed = 5, out_dir = out, tensorboard = false }
    for k, v in pairs(over or {}) do r[k] = v end
    return r
  end

  it('checks the keys', function()
    local function err(over) local ok, e = pcall(train.resolve_config, recipe(over), {}); assert.is_false(ok); return e end
    assert.equal("config: unknown muon_variant 'v3' (expected 'classic' or 'current')", err({ muon_variant = 'v3' }))
    assert.equal('config: muon_beta2 must be in [0, 1), got 1', err({ muon_beta2 = 1 }))
    assert.equal('config: muon_weight_decay must be >= 0, got -0.1', err({ muon_weight_decay = -0.1 }))
    assert.equal("config: muon_variant 'current' applies to optimizer = 'nanochat', got optimizer = 'adamw'",
      err({ optimizer = 'adamw' }))
    assert.equal("config: muon_variant 'current' with tp > 1 is not supported yet (tensor parallelism runs the "
      .. 'classic Muon)', err({ tp = 2 }))
  end)

  it("muon_weight_decay_schedule = 'cosine' takes Muon's weight decay to zero at max_iters, as nanochat", function()
    local c = optim.schedules.cosine_to_zero(4)
    assert.same({ 1, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0 }, { c(0), c(1), c(2), c(4) })
    local seen = {}
    local r = recipe({ name = 'wd', max_iters = 4, muon_weight_decay_schedule = 'cosine' })
    r.on_log = function(t) seen[#seen + 1] = t.optimizer.optimizers[2].groups[1].weight_decay end
    train.main(r, {})
    for s = 1, 4 do assert.near(0.1 * c(s - 1), seen[s], 1e-15) end
    local ok, e = pcall(train.resolve_config, recipe({ muon_weight_decay_schedule = 'linear' }), {})
    assert.equal("config: unknown muon_weight_decay_schedule 'linear' (expected 'constant' or 'cosine')", e)
  end)

  it('resumes NorMuon state exactly and refuses to resume under another variant', function()
    local straight = train.main(recipe({ name = 'a' }), {}).losses
    train.main(recipe({ name = 'b', max_iters = 3, checkpoint_interval = 3 }), {})
    local resumed = train.main(recipe({ name = 'b' }), { '--resume' }).losses
    assert.same({ straight[4], straight[5], straight[6] }, resumed)
    local t = train.new(recipe({ name = 'b', muon_variant = 'classic' }), {})
    local ok, e = pcall(t.load_checkpoint, t, out .. '/b/checkpoints/step_0000003')
    assert.is_false(ok)
    assert.matches('has muon_variant = current, this run has classic; not loaded', e, 1, true)
  end)
end)
