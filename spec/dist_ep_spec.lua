-- Expert parallelism (--ep, gptlua.dist.expert_parallel) on MPI ranks,
-- float64: dropless ep 2 and ep 4 equal one process on the same global
-- batch (every step's loss and clipped gradient norm, the final
-- parameters: spec/support/dist_train.lua), under ddp, zero1, zero2, fsdp
-- and hsdp, in both model families, with AdamW and Muon; with a capacity factor the same assignments are dropped
-- (the drops happen on the rank the tokens come from, as at ep 1); a
-- checkpoint saved at ep 2 resumes at ep 1 and ep 4 to the same run; with
-- pipeline stages (pp 2: MoE blocks in their stage, ep over its dp ranks)
-- and with tensor parallelism (tp 2: attention cut, each MoE whole on every
-- tp rank) likewise, and their checkpoints resume without them; bad
-- ep values are refused in one line.
--
-- Tolerances: the rule of spec/support/dist_train.lua (runs:check): within
-- twice what the layout's roundings (the experts' gradients summed in another
-- order; fsdp's float32 reduce-scatter; Muon's float32 momentum) make of a
-- perturbed one-process run.
local H = require 'support.mpi'
local DT = require 'support.dist_train'
local cjson = require 'cjson'

describe('expert parallelism: bad ep values', function()
  local train = require 'gptlua.train'
  local compose = require 'gptlua.dist.compose'
  local MOE4 = '--moe.experts=4'
  -- the config's own checks (every rank alike, before any collective), then
  -- compose's with the world's size, each in one line
  local function refusal(args, world)
    local words = {}
    for w in args:gmatch('%S+') do words[#words + 1] = w end
    local ok, cfg = pcall(train.resolve_config, { device = 'cpu', n_embd = 32, n_head = 4 }, words)
    if ok and world then ok, cfg = pcall(compose.check, cfg, world) end
    assert.is_false(ok, args .. ': expected a refusal')
    local msg = tostring(cfg)
    assert.is_nil(msg:find('\n'), 'one line: ' .. msg)
    assert.is_nil(msg:match('%.lua:%d+:'), 'no position: ' .. msg)
    return msg
  end

  it('refuses them in one line naming ep and what it must divide, before anything is built', function()
    assert.equal('config: ep must be an integer in [1, 2147483647], got 0', refusal('--dist=ddp --ep=0 ' .. MOE4))
    assert.equal("config: ep 2 needs a distributed run (dist = 'ddp' or 'fsdp')", refusal('--ep=2 ' .. MOE4))
    assert.equal('config: ep 2 needs mixture-of-experts blocks (moe.experts > 0), got moe.experts 0',
      refusal('--dist=ddp --ep=2'))
    assert.equal('config: ep 3 does not divide moe.experts 4 (each ep rank holds moe.experts / ep experts)',
      refusal('--dist=ddp --ep=3 --moe.experts=4 --moe.top_k=1'))
    assert.equal('config: ep 4 does not divide the 2 data-parallel ranks', refusal('--dist=ddp --ep=4 ' .. MOE4, 2))
    assert.equal('config: ep 2 does not divide the 3 data-parallel ranks', refusal('--dist=fsdp --ep=2 ' .. MOE4, 3))
    assert.equal("config: dist 'localsgd' with ep > 1 is not supported (expected 'ddp', 'zero1', 'zero2', 'fsdp' or "
      .. "'hsdp')", refusal('--dist=localsgd --ep=2 ' .. MOE4, 2))
    -- and a layout it fits passes: ep 2 of dp 4
    local cfg = train.resolve_config({ device = 'cpu', n_embd = 32, n_head = 4 }, { '--dist=ddp', '--ep=2', MOE4 })
    assert.same({ pp = 1, dp = 4, cp = 1, tp = 1 }, compose.check(cfg, 4))
  end)
end)

describe('expert parallelism: the partial build', function()
  -- A rank makes only its own experts (gptlua.dist.pp_build): the others
  -- are left without storage, and its own have a one-rank build's values.
  it('builds only this rank\'s experts, with the values of a whole build', function()
    local gl = require 'gptlua'
    local train = require 'gptlua.train'
    local cfg = train.resolve_config({ device = 'cpu', n_layer = 2, n_head = 4, n_embd = 32, block_size = 16,
      vocab_size = 68, model = 'gpt2', seed = 7 }, { '--dist=ddp', '--ep=2', '--moe.experts=4', '--moe.every=2' })
    gl.manual_seed(cfg.seed)
    local whole = train.build_model(cfg)
    local want = {}
    for _, np in ipairs(whole:named_parameters()) do want[np[1]] = np[2] end
    for dp = 0, 3 do
      local trainer = { cfg = cfg, hooks = {}, mesh = { size = { pp = 1, dp = 4, ep = 2 }, coord = { pp = 0, dp = dp } } }
      gl.manual_seed(cfg.seed)
      local model = require('gptlua.dist.pp_build').build(trainer, train.build_model)
      local made, left = 0, 0
      for _, np in ipairs(model:named_parameters()) do
        local e = np[1]:match('experts%.(%d+)%.')
        local mine = not e or math.floor(tonumber(e) / 2) == dp % 2
        if mine then
          made = made + 1
          assert.is_false(np[2]:is_freed(), np[1])
          assert.same(want[np[1]]:tolist(), np[2]:tolist(), np[1])
        else
          left = left + 1
          assert.is_true(np[2]:is_freed(), np[1] .. ' is another ep rank\'s: not built here')
        end
      end
      assert.equal(4, left)   -- 2 experts x (c_fc, c_proj)
      assert.is_true(made > 4)
    end
  end)
end)

describe('expert parallelism planned (gptlua.plan)', function()
  -- The planner runs the trainer on meta tensors in a fake world: with no
  -- routing to read it assumes balanced routing, each of E experts getting
  -- N K / E of a rank's N K assignments.  Per MoE layer and micro-step a
  -- rank sends (ep-1)/ep of its N K rows of C elements four times (dispatch
  -- and combine, forward and backward) and (ep-1)/ep of its E counts once.
  it('counts the all-to-all bytes of a step (four row exchanges and one of counts per layer) and 1/ep of the experts', function()
    local plan = require 'gptlua.plan'
    local DT = require 'support.dist_train'
    for _, ep in ipairs({ 2, 4 }) do
      local r = DT.recipe('gpt2', { dist = 'ddp', ep = ep, moe = { experts = 4, top_k = 2, every = 2 } })
      local p = plan.plan(r, { world = 4, device_memory = '1GiB' })
      local got = 0
      for _, grp in pairs(p.traffic) do got = got + (grp.by.all_to_all and grp.by.all_to_all.bytes or 0) end
      local N, K, C, E, es = 16, 2, 32, 4, 8   -- (one micro-step of 16 tokens per rank, float64)
      local want = 4 * (ep - 1) / ep * N * K * C * es + (ep - 1) / ep * E * 8
      assert.equal(want, got, ('ep %d: all-to-all bytes per step'):format(ep))
      -- and a rank's parameters: ep 1's less (ep-1)/ep of the experts (4
      -- experts of two 32 x 128 matrices: whole size classes of the allocator)
      local one = plan.plan(DT.recipe('gpt2', { dist = 'ddp', ep = 1, moe = { experts = 4, top_k = 2, every = 2 } }),
        { world = 4, device_memory = '1GiB' })
      assert.equal(one.groups.parameters - (ep - 1) / ep * E * 2 * C * 4 * C * es, p.groups.parameters,
        ('ep %d: planned parameters'):format(ep))
    end
  end)
end)

describe('expert parallelism on MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs = DT.new(out)
  local MOE = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01, z_loss = 0.001, bias_update = 0.01 }
  local ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=2 --moe.aux_loss=0.01 --moe.z_loss=0.001 --moe.bias_update=0.01'
  local MOE_SHARED = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01, z_loss = 0.001, bias_update = 0.01, shared = 1 }
  local CAP = { experts = 4, top_k = 2, every = 1, capacity_factor = 0.5 }
  local CAP_ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=1 --moe.capacity_factor=0.5'

  local saved   -- the first test's runs (their step 3 checkpoints resume in the second)
  it('ep 2 and ep 4 equal one process under every data-parallel policy, dropless and with a capacity factor', function()
    local cases = {
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2', ref = MOE },
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --dist=fsdp --ep=2', ref = MOE, reduce = 'float32' },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=ddp --ep=4', ref = MOE },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2', ref = MOE, id = 'ddp2' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=fsdp --ep=4', ref = MOE, reduce = 'float32', id = 'fsdp4' },
      -- activation checkpointing: each block's exchanges run again in its recompute
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2 --activation_checkpointing=true', ref = MOE },
      -- a shared expert (run while the rows are in flight)
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --moe.shared=1 --dist=ddp --ep=2', ref = MOE_SHARED },
      -- the other sharded policies: the experts stepped by the optimizer beside their shards
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --dist=zero1 --ep=2', ref = MOE },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=zero2 --ep=2', ref = MOE },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=hsdp --shard_size=2 --ep=4', ref = MOE, reduce = 'float32' },
      -- pipeline stages: MoE blocks in their stage, ep over the stage's dp ranks
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --pp=2', ref = MOE },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --pp=2 --ep=2', ref = MOE, id = 'pp2' },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=fsdp --pp=2 --ep=2', ref = MOE, reduce = 'float32' },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=zero1 --pp=2 --ep=2', ref = MOE },
      -- tensor parallelism: attention cut over tp, every MoE whole on each tp rank, ep over the dp ranks
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --tp=2 --ep=2', ref = MOE, id = 'tp2' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=fsdp --tp=2 --ep=2', ref = MOE, reduce = 'float32' },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=zero2 --tp=2 --ep=2', ref = MOE },
      -- Muon (optimizer nanochat): each expert's matrix orthogonalised on its own
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2 --optimizer=nanochat', ref = MOE,
        over = { optimizer = 'nanochat' }, state32 = true },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=zero2 --ep=2 --optimizer=nanochat', ref = MOE,
        over = { optimizer = 'nanochat' }, state32 = true },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=fsdp --ep=2 --optimizer=nanochat', ref = MOE,
        over = { optimizer = 'nanochat' }, state32 = true,
        reduce = 'float32' },
      { ranks = 4, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --ep=1', ref = CAP, cap = true },
      { ranks = 4, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --ep=4', ref = CAP, cap = true },
    }
    local got = runs:launch(cases)
    saved = {}
    for i, c in ipairs(cases) do if c.id then saved[c.id] = got[i] end end
    for i, c in ipairs(cases) do
      local over = { moe = c.ref }
      for k, v in pairs(c.over or {}) do over[k] = v end
      if not c.cap then runs:check(c, got[i], over) end
    end
    -- with a capacity factor each rank drops past ceil(0.5 N K / E) rows of
    -- its own tokens: ep 4 drops what ep 1 on the same 4 dp ranks drops
    -- (the dropped fraction every step, and the same run)
    local function dropped(dir)
      local d = {}
      for line in io.lines(dir .. '/p/metrics.jsonl') do
        local m = cjson.decode(line)
        if m.moe_dropped then d[#d + 1] = m.moe_dropped end
      end
      return d
    end
    local one, four = got[#got - 1], got[#got]
    local d1, d4 = dropped(one.dir), dropped(four.dir)
    assert.equal(#one.losses, #d1)
    for s = 1, #d1 do assert.is_true(d1[s] > 0, 'step ' .. s .. ' drops assignments') end
    assert.same(d1, d4)
    one.what, one.tol = 'ep 1 with a capacity factor', 1e-9
    DT.assert_matches({ losses = one.losses, norms = one.norms, params = DT.final_params(one) }, four)
  end)

  -- Checkpoints hold whole experts under their global names: ep 2's step 3
  -- (ddp on 4 ranks) goes on to step 5 at ep 4, at ep 1 on 4 ranks and in
  -- one process, and under fsdp at ep 2; fsdp's at ep 4 (its experts'
  -- optimizer state written whole beside fsdp's pieces) under ddp at ep 2;
  -- each equal to the one-process run's steps 4 and 5 and its parameters.
  it('a checkpoint saved at one ep resumes at any other, under ddp and fsdp, and in one process', function()
    assert.truthy(saved, 'the first test saved the checkpoints')
    local ref = runs:reference('nanochat', { moe = MOE })
    local function step3(id) return (saved[id].checkpoint:gsub('step_0000005$', 'step_0000003')) end
    local ddp2, fsdp4, pp2, tp2 = step3('ddp2'), step3('fsdp4'), step3('pp2'), step3('tp2')
    local sd = require('gptlua.checkpoint').load(ddp2).model
    for e = 0, 3 do assert.truthy(sd['transformer.h.1.mlp.experts.' .. e .. '.c_fc.weight'], 'expert ' .. e) end
    local train = require 'gptlua.train'
    local t = train.new(DT.recipe('nanochat', { moe = MOE, out_dir = out .. '/one', max_iters = 5 }), { '--resume=' .. ddp2 })
    local one = t:run()
    -- (each resume by the rule, its perturbation that of the run it resumes
    -- from, 4 ranks, and of its own)
    local function check(res, reduce)
      local perturb = DT.rounding_of(4, reduce or 'float64')
      DT.assert_by_rule(ref, runs:reference('nanochat', { moe = MOE }, perturb), perturb, res, { 4, 5 })
    end
    check({ what = 'ep 2 -> one process', losses = one.losses, norms = DT.grad_norms(out .. '/one'),
            checkpoint = one.checkpoint })
    local cases = {
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=4 --resume=' .. ddp2, name = 'r_ep4' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=1 --resume=' .. ddp2, name = 'r_ep1' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=fsdp --ep=2 --resume=' .. ddp2, name = 'r_fsdp2', reduce = 'float32' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2 --resume=' .. fsdp4, name = 'r_from_fsdp', reduce = 'float32' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=zero2 --ep=4 --resume=' .. ddp2, name = 'r_zero2' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=4 --resume=' .. pp2, name = 'r_from_pp' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --pp=2 --ep=2 --resume=' .. ddp2, name = 'r_to_pp' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=4 --resume=' .. tp2, name = 'r_from_tp' },
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=zero2 --tp=2 --ep=2 --resume=' .. ddp2, name = 'r_to_tp' },
    }
    for i, res in ipairs(runs:launch(cases)) do check(res, cases[i].reduce) end
  end)

  -- a refusal as a user meets it: one line from rank 0, exit 1, nothing built
  it('gptlua -n refuses a bad ep in one line and exits 1', function()
    local recipe = ' recipes/moe.lua --device=cpu --max_iters=1 --eval_interval=0 --out_dir=' .. out .. '/refused'
    for _, run in ipairs({
      { '-n 2' .. recipe .. ' --dist=ddp --ep=4', 'config: ep 4 does not divide the 2 data-parallel ranks' },
      { '-n 2' .. recipe .. ' --dist=ddp --ep=3',
        'config: ep 3 does not divide moe.experts 8 (each ep rank holds moe.experts / ep experts)' },
      { '-n 2' .. recipe .. ' --dist=localsgd --ep=2',
        "config: dist 'localsgd' with ep > 1 is not supported (expected 'ddp', 'zero1', 'zero2', 'fsdp' or 'hsdp')" },
    }) do
      local o, rc = H.sh(H.EXE .. ' ' .. run[1], 60)
      assert.equal(1, rc, o)
      assert.equal(run[2] .. '\n', o)
    end
  end)

  -- The same exchange over Gloo (the TCP launcher, no MPI): ep 2 equals ep 1
  -- step by step on 2 ranks.
  it('trains at ep 2 over Gloo as at ep 1', function()
    if not io.open(require('gptlua.ffi').libdir .. '/libgptlua_gloo.so') then
      pending('libgptlua_gloo.so was not built (make deps: libgloo-dev)')
      return
    end
    local recipe = out .. '/gloo_recipe.lua'
    local f = assert(io.open(recipe, 'wb'))
    f:write(([[return dofile(%q)('nanochat', { dist = 'ddp', max_iters = 4, checkpoint_interval = 0,
      moe = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01 } })]]):format(H.ROOT .. '/spec/dist/tp_recipe.lua'))
    f:close()
    local function series(dir, key)
      local v = {}
      for line in io.lines(dir .. '/p/metrics.jsonl') do
        local m = cjson.decode(line)
        if m[key] then v[#v + 1] = m[key] end
      end
      return v
    end
    local got = {}
    for _, ep in ipairs({ 1, 2 }) do
      local dir = ('%s/gloo_ep%d'):format(out, ep)
      local o, rc = H.sh(('env GPTLUA_MPIRUN=/nonexistent/mpirun %s -n 2 --launcher=tcp %s --ep=%d --out_dir=%s'):format(
        H.EXE, recipe, ep, dir), 120)
      assert.equal(0, rc, o)
      got[ep] = { losses = series(dir, 'loss'), norms = series(dir, 'grad_norm') }
    end
    assert.equal(4, #got[1].losses)
    DT.assert_close(got[1].losses, got[2].losses, 'Gloo ep 2 loss')
    DT.assert_close(got[1].norms, got[2].norms, 'Gloo ep 2 gradient norm')
  end)
end)
