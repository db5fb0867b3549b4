-- gptlua.dist.fsdp (dist = 'fsdp' and 'hsdp'): units, sharding and release
-- in this process (a world of one, where FSDP must equal the unsharded
-- trainer bit for bit, in float32 and in bfloat16 with fp32 master
-- shards); then on 2, 3 and 4 MPI ranks (spec/dist/fsdp_*.lua workers):
-- equivalence with one process running N times the gradient accumulation
-- (float32, and bfloat16 with masters), the HSDP identities (shard_size = N
-- is FSDP, 1 is DDP), bytes per rank from the allocator, and checkpoints
-- re-cut from 2 ranks to 3, to 4 as HSDP and to one unsharded process.
--
-- bfloat16 tolerances.  bfloat16 keeps 8 significant bits (a rounding moves
-- a value by up to 2^-9 of itself), and FSDP on N ranks rounds the gradient
-- differently from one process accumulating N micro-steps: each rank
-- rounds its own gradient and the fp32 average is rounded once, where the
-- single process rounds after every micro-step's addition.  AdamW divides
-- by sqrt(v) per element, so such a difference reaches the update at about
-- its own relative size, a few 2^-9 over the steps: losses and fp32
-- masters are compared at 1e-2.  (On 2 ranks with the fp32 reduce both
-- sides happen to round the same sums — halving is exact and the fp32 sum
-- of two bfloat16 values is exact — and agree bit for bit; on 3 ranks
-- AdamW's masters differ by about 2e-3.  Muon is checked on 2 ranks only:
-- Newton–Schulz multiplies the small singular values of the gradient by
-- up to ~480 over its 5 iterations, so an ulp of gradient noise moves a
-- zero-initialised projection's update by several percent.)
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local fsdp = require 'gptlua.dist.fsdp'
local B = require 'gptlua.dist.policies.base'
local cjson = require 'cjson'

local H = require 'support.mpi'
local ROOT, EXE, MPIRUN = H.ROOT, H.EXE, H.MPIRUN
local recipe = dofile(ROOT .. '/spec/dist/policy_recipe.lua')

-- The trainer reaches the policy through dist.policy (cfg.dist): each test
-- names the module (with options of its own, through a small wrapper) and
-- the registry is restored afterwards, so no other spec sees it.
local function use_policy(opts)
  local saved = { dist.POLICIES.fsdp, dist.POLICIES.hsdp }
  package.loaded['fsdp_spec_policy'] = { new = function(name, o)
    for k, v in pairs(opts or {}) do o[k] = v end
    return fsdp.new(name, o)
  end }
  dist.POLICIES.fsdp, dist.POLICIES.hsdp = 'fsdp_spec_policy', 'fsdp_spec_policy'
  finally(function()
    dist.POLICIES.fsdp, dist.POLICIES.hsdp = saved[1], saved[2]
    package.loaded['fsdp_spec_policy'] = nil
  end)
  return function(o) opts = o end   -- changes the options of later trainers
end

local sh, mpirun = H.sh, H.mpirun
local tmpdir = H.tmpdir
local read_json = H.read_json



local params_of = H.params_of

local rel_error = H.rel_error

local function assert_losses(want, got, what, tol)
  assert.equal(#want, #got, what)
  for i = 1, #want do
    local rel = math.abs(want[i] - got[i]) / math.abs(want[i])
    assert.is_true(rel < (tol or 1e-5), ('%s: step %d loss %.9g, expected %.9g (relative error %.2g)'):format(
      what, i, got[i], want[i], rel))
  end
end

local function assert_params(want, got, what, tol)
  local e = rel_error(want, got)
  assert.is_true(e < (tol or 1e-5), ('%s: final parameters differ, relative error %.3g'):format(what, e))
end

-- the fp32 masters by the optimizers' state keys ("<prefix><name>.master"):
-- of a single-process optimizer, of a policy in a world of one (its pieces
-- are the whole tensors), of a checkpoint (assembled from its pieces)
local function optimizer_masters(opt)
  local out = {}
  for _, o in ipairs(opt.optimizers or { opt }) do
    for _, g in ipairs(o.groups) do
      for i, p in ipairs(g.params) do out[o.prefix .. g.names[i] .. '.master'] = o.state[p].master end
    end
  end
  return out
end

local function policy_masters(pol)
  local layout, out = pol:state_layout(), {}
  pol:each_state(function(k, t, off, _, kind)
    if kind == 'master' then
      out[k] = out[k] or gl.zeros(layout[k], { dtype = 'float32' })
      B.view(out[k], off, { t:numel() }, false):copy_(t)
    end
  end)
  return out
end

local function checkpoint_masters(path)
  local out = {}
  for k, t in pairs(require('gptlua.dist.policies.shards').full_tensors(path, ckpt.load(path))) do
    if k:match('%.master$') then out[k] = t end
  end
  return out
end

-- elements of the shards of every unit on one rank of S: sum of ceil(unit/S)
-- over the default units of policy_recipe's models (each block, the
-- embeddings, the rest), from a whole state dict
local function shard_elements(params, S)
  local units = {}
  for name, p in pairs(params) do
    local u = name:match('^transformer%.h%.(%d+)%.') or (name:match('^transformer%.w[tp]e%.') and 'embeddings') or 'head'
    units[u] = (units[u] or 0) + p:numel()
  end
  local n = 0
  for _, numel in pairs(units) do n = n + math.ceil(numel / S) end
  return n
end

local function merged(a, b)
  local out = {}
  for k, v in pairs(a) do out[k] = v end
  for k, v in pairs(b or {}) do out[k] = v end
  return out
end

local function unit_names(pol)
  local out = {}
  for _, u in ipairs(pol.units) do out[#out + 1] = u.name .. (u.root and ' (root)' or '') end
  return out
end

-- ---------------------------------------------------------- one process --
describe('gptlua.dist.fsdp in one process', function()
  local out = tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  it('cuts the model into units: each block, the embeddings and the head, as padded flat shards', function()
    use_policy()
    local t = train.new(recipe({ dist = 'fsdp', n_layer = 3, max_iters = 1, out_dir = out }), {})
    local pol = t.policy
    assert.same({ 'transformer.h.0', 'transformer.h.1', 'transformer.h.2', 'embeddings (root)', 'head (root)' },
      unit_names(pol))
    local seen = 0
    for _, u in ipairs(pol.units) do
      local n = 0
      for _, p in ipairs(u.params) do n = n + p:numel(); seen = seen + 1 end
      assert.equal(n, u.numel)
      assert.equal(u.padded, u.pshard:numel())   -- one rank: the shard is the whole unit
      assert.equal(u.padded, u.gshard:numel())
      for _, p in ipairs(u.params) do assert.is_true(p:is_freed(), u.name) end
    end
    assert.equal(#t.params, seen)
    assert.same({ 'transformer.ln_f.weight' }, pol.units[5].names)  -- the head is tied to wte (embeddings)
    assert.same({ 'transformer.wte.weight', 'transformer.wpe.weight' }, pol.units[4].names)
    t:train_step()
    for _, u in ipairs(pol.units) do
      assert.equal('sharded', u.state)
      for _, p in ipairs(u.params) do assert.is_true(p:is_freed()); assert.is_nil(p.grad) end
    end
    assert.equal(0, pol.stats.live)
    -- nanochat: untied lm_head is the head unit; Muon owns every block matrix
    local n = train.new(recipe({ dist = 'fsdp', optimizer = 'nanochat', max_iters = 1, out_dir = out }), {})
    assert.same({ 'transformer.h.0', 'transformer.h.1', 'embeddings (root)', 'head (root)' }, unit_names(n.policy))
    assert.same({ 'lm_head.weight' }, n.policy.units[4].names)
    assert.equal(12, #n.policy.muon.owned)
    assert.equal(0, #n.policy.units[1].adam)
  end)

  it('trains exactly like the unsharded trainer in a world of one, whatever the options', function()
    local set_options = use_policy()
    local variants = {
      { {}, {} },
      { { activation_checkpointing = true }, {} },
      { {}, { accumulate = 'unsharded' } },
      { {}, { reshard_after_forward = false } },
      { { activation_checkpointing = true }, { reshard_after_forward = false, prefetch = false } },
    }
    for _, opt in ipairs({ 'adamw', 'nanochat' }) do
      local r = { optimizer = opt, max_iters = 4, gradient_accumulation_steps = 2, out_dir = out }
      local ref = train.new(recipe(r), {})
      local want = ref:run().losses
      for _, v in ipairs(variants) do
        local rr = { dist = 'fsdp' }
        for k, x in pairs(r) do rr[k] = x end
        for k, x in pairs(v[1]) do rr[k] = x end
        set_options(v[2])
        local t = train.new(recipe(rr), {})
        local what = opt .. ' ' .. cjson.encode(v)
        assert.same(want, t:run().losses, what)
        assert.equal(0, rel_error(params_of(ref.model), t.policy:full_state_dict()), what)
      end
    end
  end)

  it('keeps fp32 master shards for a bfloat16 model: the bfloat16 trainer bit for bit, checkpoints both ways', function()
    use_policy()
    for _, opt in ipairs({ 'adamw', 'nanochat' }) do
      local r = { optimizer = opt, dtype = 'bfloat16', max_iters = 4, gradient_accumulation_steps = 2,
                  checkpoint_interval = 2, out_dir = out .. '/bf_ref_' .. opt }
      local ref = train.new(recipe(r), {})
      local want = ref:run().losses
      local rf = merged(r, { dist = 'fsdp', out_dir = out .. '/bf_fsdp_' .. opt })
      local t = train.new(recipe(rf), {})
      assert.same(want, t:run().losses, opt)
      local pol = t.policy
      local padded = 0
      for _, u in ipairs(pol.units) do
        assert.equal('bfloat16', u.pshard.dtype)
        assert.equal('float32', u.master.dtype)
        assert.equal(u.c, u.master:numel())   -- one rank: the master is the whole padded unit
        padded = padded + u.padded
      end
      local bytes = pol:state_bytes()
      assert.equal(4 * padded, bytes.master)
      assert.equal(2 * bytes.params, bytes.master)
      assert.equal(0, rel_error(optimizer_masters(ref.optimizer), policy_masters(pol)), opt)
      assert.equal(0, rel_error(params_of(ref.model), pol:full_state_dict()), opt)
      -- the plain trainer's checkpoint (whole "<key>.master" tensors)
      -- resumed under FSDP, and FSDP's (pieces) by the plain trainer
      local function resume(from, pol_name)
        local x = merged(r, { dist = pol_name, out_dir = ('%s/bf_resume_%s_%s'):format(out, opt, pol_name) })
        local t2 = train.new(recipe(x), { '--resume=' .. from .. '/p/checkpoints/step_0000002' })
        return t2, t2:run().losses
      end
      local a, la = resume(r.out_dir, 'fsdp')
      assert.same({ want[3], want[4] }, la, opt .. ': unsharded checkpoint resumed under fsdp')
      assert.equal(0, rel_error(optimizer_masters(ref.optimizer), policy_masters(a.policy)), opt)
      local b, lb = resume(rf.out_dir, 'none')
      assert.same({ want[3], want[4] }, lb, opt .. ': fsdp checkpoint resumed by the plain trainer')
      assert.equal(0, rel_error(optimizer_masters(ref.optimizer), optimizer_masters(b.optimizer)), opt)
    end
    -- a float32 run's checkpoint has no masters: they start from its float32
    -- parameter pieces (the bfloat16 shards from them rounded)
    local f32 = train.new(recipe({ dist = 'fsdp', max_iters = 2, out_dir = out .. '/f32' }), {})
    f32:run()
    local t = train.new(recipe({ dist = 'fsdp', dtype = 'bfloat16', max_iters = 2, out_dir = out .. '/f32b' }), {})
    t:load_checkpoint(out .. '/f32/p/checkpoints/step_0000002')
    for i, u in ipairs(t.policy.units) do
      local v = f32.policy.units[i]
      assert.equal(0, u.master:max_abs_diff(v.pshard), u.name)
      assert.equal(0, u.pshard:max_abs_diff(v.pshard:to('bfloat16')), u.name)
    end
  end)

  it('gathers one block at a time plus the prefetched one, and a step leaves nothing behind', function()
    use_policy()
    local t = train.new(recipe({ dist = 'fsdp', n_layer = 4, max_iters = 1, gradient_accumulation_steps = 2,
      out_dir = out }), {})
    local pol = t.policy
    local roots, block = 0, 0
    for _, u in ipairs(pol.units) do
      if u.root then roots = roots + B.bytes(u.pshard) else block = math.max(block, B.bytes(u.pshard)) end
    end
    t:train_step()
    collectgarbage(); collectgarbage()
    local between = gl.memory_stats().allocated
    t:train_step()
    collectgarbage(); collectgarbage()
    assert.equal(between, gl.memory_stats().allocated)
    assert.is_true(pol.stats.peak_live <= roots + 2 * block, ('gathered %d bytes at once, expected at most %d')
      :format(pol.stats.peak_live, roots + 2 * block))
    assert.is_true(pol.stats.peak_live >= roots + block)
    assert.equal(0, pol.stats.live)
    -- per micro-step the forward gathers every unit, backward every block but the last
    assert.equal(2 * 2 * (6 + 3), pol.stats.gathers)   -- 2 steps
    assert.equal(2 * 2 * 6, pol.stats.reduces)
  end)

  it('evaluates, samples and loads whole state dicts through the shards', function()
    use_policy()
    local r = { max_iters = 3, out_dir = out, eval_iters = 2, data = 'char' }
    local ref = train.new(recipe(r), {})
    ref:run()
    r.dist = 'fsdp'
    local t = train.new(recipe(r), {})
    t:run()
    assert.same(ref:evaluate(), t:evaluate())
    local idx = gl.tensor({ { 1, 2, 3 } }, { dtype = 'int64' })
    assert.same(ref.model:generate(idx, 8, { temperature = 0 }):totable(),
      t.model:generate(idx, 8, { temperature = 0 }):totable())
    for _, u in ipairs(t.policy.units) do assert.equal('sharded', u.state) end
    -- fresh weights into the sharded model: the module's checks and messages
    local fresh = train.new(recipe({ max_iters = 1, seed = 99, out_dir = out }), {})
    t.model:load_state_dict(fresh.model:state_dict())
    assert.equal(0, rel_error(params_of(fresh.model), t.policy:full_state_dict()))
    assert.has_error(function() t.model:load_state_dict({ ['transformer.wte.weight'] = gl.zeros({ 2, 2 }) }) end)
    local ok, err = pcall(t.model.load_state_dict, t.model, {})
    assert.is_false(ok)
    assert.truthy(tostring(err):find('load_state_dict: missing: transformer.wte.weight', 1, true), err)
    assert.equal(0, rel_error(params_of(fresh.model), t.policy:full_state_dict()))  -- nothing copied
    -- detach: ordinary whole parameters again
    t.policy:detach()
    assert.equal(0, rel_error(params_of(fresh.model), params_of(t.model)))
    assert.is_nil(rawget(t.model, 'forward'))
  end)

  it("takes a recipe's own units: held groups of blocks and wrapped blocks", function()
    local units = function(m)
      local h = m.transformer.h
      return { { name = 'first two', modules = { h[1], h[2] }, root = true }, h[3], { name = 'last', module = h[4] } }
    end
    local set_options = use_policy({ units = units })
    local r = { n_layer = 4, max_iters = 3, gradient_accumulation_steps = 2, out_dir = out }
    local ref = train.new(recipe(r), {})
    local want = ref:run().losses
    r.dist = 'fsdp'
    local t = train.new(recipe(r), {})
    assert.same({ 'first two (root)', 'unit2', 'last', 'head (root)' }, unit_names(t.policy))
    assert.same(want, t:run().losses)
    assert.equal(0, rel_error(params_of(ref.model), t.policy:full_state_dict()))
    set_options({ units = function(m) return { m.transformer.h[1], { name = 'again', modules = { m.transformer.h[1] } } } end })
    assert.has_error(function() train.new(recipe(r), {}) end,
      'dist.policy: fsdp: parameter transformer.h.0.ln_1.weight is in units unit1 and again')
    set_options({ units = 'blocks' })
    assert.has_error(function() train.new(recipe(r), {}) end,
      'dist.policy: fsdp: opts.units expected a list or a function returning one')
  end)

  it('reduces a block called twice in one forward once, after the backward of its last call', function()
    local nn = require 'gptlua.nn'
    local Twice = nn.class('Twice', nn.Module)
    function Twice:__init() self:add('fc', nn.Linear(4, 4)); self:add('out', nn.Linear(4, 1)) end
    function Twice:forward(x) return self.out(gl.tanh(self.fc(gl.tanh(self.fc(x))))):sum() end
    gl.manual_seed(5)
    local ref = Twice()
    gl.manual_seed(5)
    local net = Twice()
    local x = gl.randn({ 3, 4 }, { seed = 1 })
    ref:forward(x):backward()
    local pol = fsdp.new('fsdp', { model = net, optimizer = require('gptlua.optim').AdamW(net:parameters()),
      units = { { name = 'fc', module = net.fc } } })
    pol:zero_grad()
    pol:before_micro_step(1, 1)
    net:forward(x):backward()
    pol:after_backward()
    assert.equal(2, pol.stats.reduces)   -- fc once, the head unit (out) once
    local fc = pol.units[1]
    assert.equal('fc', fc.name)
    local want = gl.cat({ ref.fc.weight.grad:reshape(16), ref.fc.bias.grad }, 1)
    assert.equal(0, want:max_abs_diff(fc.gshard))
  end)

  it('refuses bad options and optimizers it cannot shard', function()
    local t = train.new(recipe({ max_iters = 1, out_dir = out }), {})
    local o = { model = t.model, optimizer = t.optimizer, params = t.params }
    assert.has_error(function() fsdp.new('zero3', o) end, "dist.policy: fsdp.new: name expected 'fsdp' or 'hsdp', got zero3")
    assert.has_error(function() fsdp.new('fsdp', { optimizer = t.optimizer }) end,
      'dist.policy: fsdp expected opts.model, the nn module to shard')
    assert.has_error(function() fsdp.new('hsdp', { model = t.model, optimizer = t.optimizer, shard_size = 2 }) end,
      'dist.policy: hsdp needs shard_size dividing the world size 1 (ranks per shard group), got 2')
    assert.has_error(function() fsdp.new('hsdp', { model = t.model, optimizer = t.optimizer, shard_size = 0 }) end,
      'dist.policy: hsdp needs shard_size dividing the world size 1 (ranks per shard group), got 0')
    assert.has_error(function() fsdp.new('fsdp', { model = t.model, optimizer = t.optimizer, accumulate = 'lazy' }) end,
      "dist.policy: fsdp option accumulate expected 'sharded' or 'unsharded', got lazy")
    assert.has_error(function() fsdp.new('fsdp', { model = t.model, optimizer = t.optimizer, reduce_dtype = 'float16' }) end,
      "dist.policy: fsdp option reduce_dtype expected 'float32' or 'bfloat16', got float16")
    assert.has_error(function() fsdp.new('fsdp', { model = t.model, optimizer = t.optimizer, prefetch = 'yes' }) end,
      'dist.policy: fsdp option prefetch expected a boolean, got string yes')
    assert.has_error(function() fsdp.new('fsdp', { model = t.model, optimizer = { step = function() end, groups = {} } }) end,
      "dist.policy: fsdp shards optim.AdamW and optim.Muon (alone or in optim.Combined), got another optimizer; "
      .. "use dist = 'ddp' for it")
    -- a wrapped unit must return one tensor
    local nn = require 'gptlua.nn'
    local function net_returning(f)
      local Inner = nn.class('Inner', nn.Module)
      function Inner:__init() self:add('fc', nn.Linear(4, 4)) end
      Inner.forward = f
      local Top = nn.class('Top', nn.Module)
      function Top:__init() self:add('inner', Inner()) end
      function Top:forward(x) local y = self.inner(x); return (type(y) == 'table' and y[1] or y):sum() end
      local top = Top()
      local pol = fsdp.new('fsdp', { model = top, optimizer = require('gptlua.optim').AdamW(top:parameters()),
        units = { top.inner } })
      pol:zero_grad()
      pol:before_micro_step(1, 1)
      local ok, loss = pcall(top.forward, top, gl.ones({ 2, 4 }))
      if ok then loss:backward(); pol:after_backward() end
      return ok, ok and pol:grad_norm() or loss
    end
    local ok, norm = net_returning(function(self, x) return self.fc(x) end)
    assert.is_true(ok)
    assert.is_true(norm > 0)
    for what, f in pairs({ ['2 values'] = function(self, x) local y = self.fc(x); return y, y end,
                           table = function(self, x) return { self.fc(x) } end }) do
      local ok2, err = net_returning(f)
      assert.is_false(ok2)
      assert.truthy(tostring(err):find(('fsdp: unit unit1 returned %s; a unit that reshards after forward must '
        .. 'return one tensor (give it root = true)'):format(what), 1, true), err)
    end
  end)
end)

-- ------------------------------------------------------------ MPI ranks --
describe('gptlua.dist.fsdp over MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  -- one process with N*accum micro-steps reads the same rows per step
  -- (bf16: 10 steps of the bfloat16 model, whose masters are kept too)
  local refs = {}
  local BF16 = { dtype = 'bfloat16', max_iters = 10 }
  local function reference(opt, n_accum, over)
    local k = opt .. n_accum .. (over and over.dtype or '')
    if not refs[k] then
      local t = train.new(recipe(merged({ optimizer = opt, gradient_accumulation_steps = n_accum, max_iters = 12,
        out_dir = out .. '/ref' }, over)), {})
      refs[k] = { losses = t:run().losses, params = params_of(t.model) }
      if over then refs[k].masters = optimizer_masters(t.optimizer) end
    end
    return refs[k]
  end

  local function run(n, accum, runs)
    local dir = ('%s/n%d'):format(out, n)
    os.execute('mkdir -p ' .. dir)
    local list = {}
    for _, r in ipairs(runs) do list[#list + 1] = r[1] .. '=' .. r[2] end
    local o, rc = mpirun(n, 'spec/dist/fsdp_equiv.lua', ('%s %d %s'):format(dir, accum, table.concat(list, ' ')))
    H.assert_ranks_ok(o, rc, n)
    local res = {}
    for _, r in ipairs(runs) do
      local label = r[1]
      res[label] = read_json(('%s/%s.json'):format(dir, label))
      res[label].params = ckpt.load_safetensors(('%s/%s.safetensors'):format(dir, label))
      assert.equal(n, res[label].world)
    end
    return res
  end

  local function check(res, label, opt, n_accum, tol)
    local ref = reference(opt, n_accum)
    assert_losses(ref.losses, res[label].losses, label, tol)
    assert_params(ref.params, res[label].params, label, tol)
  end

  -- a bfloat16 run on n ranks (label=...,dtype=bfloat16,max_iters=10):
  -- losses and its last checkpoint's fp32 masters against the bfloat16
  -- process with n micro-steps, and master bytes per rank: 4 B for each
  -- element of the rank's shards
  local function check_bf16(res, label, opt, n)
    local ref = reference(opt, n, BF16)
    assert_losses(ref.losses, res[label].losses, label, 1e-2)
    local ckdir = ('%s/n%d/runs_%s/p/checkpoints'):format(out, n, label)
    local final = checkpoint_masters(ckdir .. '/step_0000010')
    assert_params(ref.masters, final, label .. ' masters', 1e-2)
    local want = 4 * shard_elements(res[label].params, n)
    for r = 1, n do
      local b = res[label].bytes[r]
      assert.equal(want, b.master, ('%s rank %d master bytes'):format(label, r - 1))
      assert.equal(2 * b.params, b.master)   -- fp32 masters of the bfloat16 shards
    end
    return ckdir, final
  end

  local function identical(a, b, what)
    assert.same(a.losses, b.losses, what)
    assert.equal(0, rel_error(a.params, b.params), what)
  end

  it('FSDP and HSDP on 2 ranks (2 micro-steps) match 1 rank with 4; shard_size 2 is FSDP, 1 is DDP', function()
    local res = run(2, 2, {
      { 'a_fsdp', 'adamw,fsdp' }, { 'a_hsdp2', 'adamw,hsdp,shard_size=2' },
      { 'a_ddp', 'adamw,ddp' }, { 'a_hsdp1', 'adamw,hsdp,shard_size=1' },
      { 'a_ac', 'adamw,fsdp,activation_checkpointing=true' }, { 'a_bf16', 'adamw,fsdp,reduce_dtype=bfloat16' },
      { 'n_fsdp', 'nanochat,fsdp' }, { 'n_ddp', 'nanochat,ddp' }, { 'n_hsdp1', 'nanochat,hsdp,shard_size=1' },
      { 'n_unsharded', 'nanochat,fsdp,accumulate=unsharded,activation_checkpointing=true' },
    })
    for _, l in ipairs({ 'a_fsdp', 'a_hsdp2', 'a_ac', 'a_hsdp1' }) do check(res, l, 'adamw', 4) end
    for _, l in ipairs({ 'n_fsdp', 'n_hsdp1', 'n_unsharded' }) do check(res, l, 'nanochat', 4) end
    check(res, 'a_bf16', 'adamw', 4, 1e-2)   -- gradients reduced in bfloat16
    identical(res.a_fsdp, res.a_hsdp2, 'hsdp shard_size 2 vs fsdp')
    identical(res.a_ddp, res.a_hsdp1, 'hsdp shard_size 1 vs ddp (adamw)')
    identical(res.n_ddp, res.n_hsdp1, 'hsdp shard_size 1 vs ddp (nanochat)')
    -- every rank holds half of the parameters, gradients and optimizer state
    for _, l in ipairs({ 'a_fsdp', 'n_fsdp' }) do
      local whole = res[l:sub(1, 1) .. '_hsdp1'].bytes[1]
      for r = 1, 2 do
        for _, k in ipairs({ 'params', 'grads', 'optimizer' }) do
          local ratio = res[l].bytes[r][k] / whole[k]
          assert.is_true(ratio > 0.4 and ratio < 0.6, ('%s rank %d holds %.3f of the %s'):format(l, r - 1, ratio, k))
        end
      end
    end
  end)

  it('bfloat16 with fp32 master shards on 2 ranks matches 1 rank with 2 micro-steps and resumes in one process', function()
    local res = run(2, 1, { { 'a_mixed', 'adamw,fsdp,dtype=bfloat16,max_iters=10,checkpoint_interval=5' },
      { 'n_mixed', 'nanochat,fsdp,dtype=bfloat16,max_iters=10,checkpoint_interval=5' } })
    for _, opt in ipairs({ 'adamw', 'nanochat' }) do
      local label = opt:sub(1, 1) .. '_mixed'
      local ckdir, final = check_bf16(res, label, opt, 2)
      -- the 2-rank checkpoint at step 5 in one bfloat16 process: its
      -- optimizer gets exactly the masters the pieces hold, and continues
      local t = train.new(recipe({ optimizer = opt, dtype = 'bfloat16', gradient_accumulation_steps = 2,
        max_iters = 10, out_dir = out .. '/bf_r1_' .. opt }), {})
      t:load_checkpoint(ckdir .. '/step_0000005')
      assert.equal(0, rel_error(checkpoint_masters(ckdir .. '/step_0000005'), optimizer_masters(t.optimizer)), label)
      assert_losses({ unpack(res[label].losses, 6, 10) }, t:run().losses, label .. ' resumed in one process', 1e-2)
      assert_params(final, optimizer_masters(t.optimizer), label .. ' resumed in one process: masters', 1e-2)
    end
  end)

  it('... and on 3 ranks (padded shards, Muon owners over 3 ranks) match 1 rank with 3', function()
    local res = run(3, 1, { { 'a_fsdp', 'adamw,fsdp' }, { 'n_fsdp', 'nanochat,fsdp' },
      { 'n_hsdp3', 'nanochat,hsdp,shard_size=3' }, { 'a_mixed', 'adamw,fsdp,dtype=bfloat16,max_iters=10' } })
    check(res, 'a_fsdp', 'adamw', 3)
    check(res, 'n_fsdp', 'nanochat', 3)
    check_bf16(res, 'a_mixed', 'adamw', 3)
    identical(res.n_fsdp, res.n_hsdp3, 'hsdp shard_size 3 vs fsdp')
    local sum = 0
    for r = 1, 3 do sum = sum + res.n_fsdp.bytes[r].optimizer end
    -- Muon keeps whole matrices: the ranks' shares are uneven but add up to one copy
    local whole = 0
    for name, p in pairs(res.n_fsdp.params) do
      if name:match('^transformer%.h%.') then whole = whole + 4 * p:numel() else whole = whole + 8 * p:numel() end
    end
    assert.is_true(math.abs(sum / whole - 1) < 0.01, ('the ranks hold %.3f copies of the optimizer state'):format(sum / whole))
  end)

  for _, n in ipairs({ 2, 3 }) do
    it(('holds 1/%d of the parameters, gradients and optimizer state per rank on %d ranks (allocator), and peaks lower')
      :format(n, n), function()
      local dir = ('%s/mem%d'):format(out, n)
      os.execute('mkdir -p ' .. dir)
      local o, rc = mpirun(n, 'spec/dist/fsdp_memory.lua', dir)
      assert.equal(0, rc, o)
      local m = read_json(dir .. '/memory.json')
      assert.equal(n, m.world)
      for r = 1, n do
        local f = m.fsdp[r]
        local ratio = f.persistent / m.none.persistent
        assert.is_true(ratio > 0.9 / n and ratio < 1.1 / n,
          ('rank %d keeps %.3f of the unsharded bytes between steps, expected about 1/%d'):format(r - 1, ratio, n))
        assert.is_true(f.forward < 0.7 * m.none.forward, ('rank %d forward peak %d vs unsharded %d'):format(r - 1,
          f.forward, m.none.forward))
        assert.is_true(f.step < 0.85 * m.none.step, ('rank %d step peak %d vs unsharded %d'):format(r - 1, f.step,
          m.none.step))
      end
      -- the allocator agrees with the policy's own count, float32 (no
      -- masters) and bfloat16 (fp32 master shards: 4 B per shard element,
      -- so bfloat16 + master holds what float32 holds)
      for r = 1, n do
        for _, k in ipairs({ 'fsdp', 'bf16' }) do
          local e = m[k][r]
          local st = e.state
          local held = st.params + st.grads + st.optimizer + st.master
          assert.is_true(math.abs(e.persistent - held) / held < 0.03,
            ('%s rank %d: allocator %d bytes vs policy %d'):format(k, r - 1, e.persistent, held))
        end
        local f, b = m.fsdp[r].state, m.bf16[r].state
        assert.equal(0, f.master)
        assert.equal(f.params, b.master)
        assert.equal(2 * b.params, b.master)
        assert.is_true(math.abs(m.bf16[r].persistent / m.fsdp[r].persistent - 1) < 0.01)
      end
    end)
  end

  it('resumes a checkpoint of 2 ranks on 3 ranks, on 4 ranks as HSDP 2 x 2 and in one process', function()
    use_policy()   -- one process resumes under the trainer here
    local d2, d3, d4, d1 = out .. '/r2', out .. '/r3', out .. '/r4', out .. '/r1'
    local o, rc = mpirun(2, 'spec/dist/fsdp_resume.lua', d2 .. ' nanochat fsdp 0 9')
    assert.equal(0, rc, o)
    local full = read_json(d2 .. '/losses.json').losses
    -- the 2-rank run itself matches one process with the same global batch
    local t1 = train.new(recipe({ optimizer = 'nanochat', max_iters = 9, batch_size = 1, total_batch_size = 16 * 12, out_dir = d1 }), {})
    assert_losses(t1:run().losses, full, '2 ranks vs one process')
    local step3 = d2 .. '/p/checkpoints/step_0000003'
    local st = read_json(step3 .. '/state.json')
    assert.equal(2, st.shards.world)
    assert.same({ 'optim.rank00000.safetensors', 'optim.rank00001.safetensors' }, st.shards.files)
    local kinds = {}
    for k in pairs(ckpt.load_safetensors(step3 .. '/optim.rank00001.safetensors')) do kinds[k:match('^(%a+)%.')] = true end
    assert.same({ param = true, adamw = true, muon = true }, kinds)   -- rank 1's pieces of everything
    local want = ckpt.load_safetensors(d2 .. '/final.safetensors')
    -- 3 ranks from the 2-rank checkpoint at step 3
    o, rc = mpirun(3, 'spec/dist/fsdp_resume.lua', ('%s nanochat fsdp 0 9 %s'):format(d3, step3))
    assert.equal(0, rc, o)
    assert_losses({ unpack(full, 4, 9) }, read_json(d3 .. '/losses.json').losses, 'resumed on 3 ranks')
    assert_params(want, ckpt.load_safetensors(d3 .. '/final.safetensors'), '3 ranks')
    -- 4 ranks, 2 replicas of shard groups of 2, from the 3-rank checkpoint at step 6
    local step6 = d3 .. '/p/checkpoints/step_0000006'
    assert.equal(3, read_json(step6 .. '/state.json').shards.world)
    o, rc = mpirun(4, 'spec/dist/fsdp_resume.lua', ('%s nanochat hsdp 2 9 %s'):format(d4, step6))
    assert.equal(0, rc, o)
    assert_losses({ unpack(full, 7, 9) }, read_json(d4 .. '/losses.json').losses, 'resumed on 4 ranks (hsdp)')
    assert_params(want, ckpt.load_safetensors(d4 .. '/final.safetensors'), '4 ranks (hsdp)')
    -- the second replica writes no pieces: the first one's are the shards
    local step9 = d4 .. '/p/checkpoints/step_0000009'
    assert.is_nil(next(ckpt.load_safetensors(step9 .. '/optim.rank00002.safetensors')))
    assert.is_not_nil(next(ckpt.load_safetensors(step9 .. '/optim.rank00001.safetensors')))
    -- one unsharded process from the 2-rank checkpoint at step 6 (whole
    -- model.safetensors, optimizer state assembled from the pieces)
    local t = train.new(recipe({ optimizer = 'nanochat', max_iters = 9, batch_size = 1, total_batch_size = 16 * 12,
      out_dir = d1 .. 'b' }), { '--resume=' .. d2 .. '/p/checkpoints/step_0000006' })
    assert_losses({ unpack(full, 7, 9) }, t:run().losses, 'resumed in one process')
    assert_params(want, params_of(t.model), 'one process')
  end)
end)
