-- Mixture-of-experts layers under data parallelism (ddp, zero2, fsdp), float64, equal to one
-- process on the same global batch: every step's loss and clipped gradient
-- norm and the final parameters (spec/support/dist_train.lua), with the
-- balancing and z losses (their gradient at the 1/accumulation scale on
-- every rank) and the bias update from the load summed over the ranks.
local H = require 'support.mpi'
local DT = require 'support.dist_train'

describe('mixture of experts on MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs = DT.new(out)
  local MOE = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01, z_loss = 0.001, bias_update = 0.01 }
  local ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=2 --moe.aux_loss=0.01 --moe.z_loss=0.001 --moe.bias_update=0.01'

  it('ddp, zero2 and fsdp on 2 ranks equal one process, in both model families', function()
    local cases = {
      { ranks = 2, model = 'nanochat', args = ARGS },
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --dist=zero2' },
      -- (fsdp reduce-scatters the float64 gradients in float32)
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=fsdp', reduce = 'float32' },
    }
    local got = runs:launch(cases)
    -- each by the rule of spec/support/dist_train.lua: within twice what the
    -- ranks' roundings make of the one-process run (the default optimizer
    -- of the float64 recipe is AdamW: no float32 state)
    for i, c in ipairs(cases) do
      local perturb = DT.rounding_of(c.ranks, c.reduce or 'float64')
      DT.assert_by_rule(runs:reference(c.model, { moe = MOE }), runs:reference(c.model, { moe = MOE }, perturb), perturb,
        got[i])
    end
  end)
end)

-- Under context parallelism (Ulysses and ring) and tensor parallelism with
-- sequence parallelism each rank routes its share of every sequence; what
-- one process computes over a micro-batch is computed over the ranks that
-- split it (gptlua.moe's split sequence): the load behind the balancing
-- loss and the bias update, the capacity and the assignments it drops, the
-- metrics (cp and sp together: over the cp x tp ranks).  Each run equals
-- one process by the same rule, with expert parallelism over the dp ranks
-- too; with a capacity factor the dropped fraction, the load metrics and
-- the balancing loss of every step are one process's (where dp is 1), and
-- its run the same.
describe('mixture of experts over a split sequence (cp, tp with sp) on MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local cjson = require 'cjson'
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs = DT.new(out)
  local MOE = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01, z_loss = 0.001, bias_update = 0.01 }
  local ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=2 --moe.aux_loss=0.01 --moe.z_loss=0.001 --moe.bias_update=0.01'
  -- (a capacity of ceil(0.5 x 16 tokens x 2 / 4) = 4 rows per expert and micro-batch: a rank's 8 tokens alone
  -- would keep 2)
  local CAP = { experts = 4, top_k = 2, every = 1, capacity_factor = 0.5, aux_loss = 0.01, bias_update = 0.01 }
  local CAP_ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=1 --moe.capacity_factor=0.5 --moe.aux_loss=0.01 '
    .. '--moe.bias_update=0.01'

  local function series(dir, key)
    local v = {}
    for line in io.lines(dir .. '/p/metrics.jsonl') do
      local m = cjson.decode(line)
      if m[key] then v[#v + 1] = m[key] end
    end
    return v
  end

  it('cp 2 (Ulysses and ring), tp 2 with sp and both equal one process, dropless and with a capacity factor, '
    .. 'with ep over the dp ranks', function()
    local cases = {
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=ddp --cp=2', ref = MOE },
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --dist=ddp --cp=2 --cp_mode=ring', ref = MOE },
      { ranks = 2, model = 'gpt2', args = ARGS .. ' --dist=ddp --tp=2 --sp', ref = MOE },
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=zero2 --tp=2 --sp', ref = MOE },
      { ranks = 2, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --cp=2', ref = CAP, cap = true },
      { ranks = 2, model = 'nanochat', args = CAP_ARGS .. ' --dist=ddp --cp=2 --cp_mode=ring', ref = CAP, cap = true },
      { ranks = 2, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --tp=2 --sp', ref = CAP, cap = true },
      -- expert parallelism over the dp ranks of each cp (or tp) coordinate
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=ddp --cp=2 --ep=2', ref = MOE },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=fsdp --cp=2 --cp_mode=ring --ep=2', ref = MOE,
        reduce = 'float32' },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=ddp --tp=2 --sp --ep=2', ref = MOE },
      { ranks = 4, model = 'nanochat', args = CAP_ARGS .. ' --dist=ddp --cp=2 --ep=2', ref = CAP },
      -- cp and sp together: the cp x tp ranks split each sequence (tp rank t the t-th half of its cp rank's rows)
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=ddp --cp=2 --tp=2 --sp', ref = MOE },
      -- (Ulysses cuts tp's KV heads over cp: nanochat's 2 made 4)
      { ranks = 4, model = 'nanochat', args = ARGS .. ' --dist=zero2 --cp=2 --tp=2 --sp --n_kv_head=4', ref = MOE,
        over = { n_kv_head = 4 } },
      { ranks = 4, model = 'nanochat', args = CAP_ARGS .. ' --dist=ddp --cp=2 --cp_mode=ring --tp=2 --sp', ref = CAP,
        cap = true },
      -- with tp's cut attention (no sp: the MoE sees the cp share whole on each tp rank), and in pipeline stages
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=ddp --tp=2 --cp=2 --cp_mode=ring', ref = MOE },
      { ranks = 4, model = 'gpt2', args = CAP_ARGS .. ' --dist=zero1 --pp=2 --cp=2', ref = CAP },
    }
    local got = runs:launch(cases)
    for i, c in ipairs(cases) do
      local over = { moe = c.ref }
      for k, v in pairs(c.over or {}) do over[k] = v end
      runs:check(c, got[i], over)
      -- (a group's micro-batches are one process's when dp is 1: the same dropped fraction every step)
      if c.cap then
        local want = series(runs:reference(c.model, over).dir, 'moe_dropped')
        assert.equal(5, #want)
        for s = 1, #want do assert.is_true(want[s] > 0, 'step ' .. s .. ' drops assignments') end
        assert.same(want, series(got[i].dir, 'moe_dropped'), c.args)
        -- and the load it watches (sums of counts: exact), the balancing loss to its sums' rounding
        local ref_dir = runs:reference(c.model, over).dir
        for _, k in ipairs({ 'moe.layer1.load_max_mean', 'moe.layer1.load_cv' }) do
          assert.same(series(ref_dir, k), series(got[i].dir, k), c.args .. ' ' .. k)
        end
        local aux, got_aux = series(ref_dir, 'moe.layer1.aux_loss'), series(got[i].dir, 'moe.layer1.aux_loss')
        -- (metrics.jsonl keeps 14 digits: 1e-13 relative between two records; the tokens' sums in another order)
        local tol = 1e-13 + DT.TOKENS * 2 ^ -53
        for s = 1, #aux do assert.near(aux[s], got_aux[s], tol * aux[s], c.args .. ' aux_loss step ' .. s) end
      end
    end
  end)
end)

describe('mixture of experts over a split sequence planned (gptlua.plan)', function()
  -- The plan (the trainer on meta tensors in a fake world) runs the same
  -- step: each rank dispatches its half of a micro-batch's tokens, and the
  -- header counts the whole model (every expert) whatever tp and ep cut.
  it('plans them: the rank\'s tokens dispatched, the whole model counted', function()
    local plan = require 'gptlua.plan'
    local function planned(over)
      local r = DT.recipe('gpt2', { dist = 'ddp', moe = { experts = 4, top_k = 2, every = 2, capacity_factor = 0.5 } })
      for k, v in pairs(over) do r[k] = v end
      return plan.plan(r, { world = 4, device_memory = '1GiB' })
    end
    local one = planned({})
    for _, over in ipairs({ { cp = 2 }, { cp = 2, cp_mode = 'ring', ep = 2 }, { tp = 2, sp = true },
                            { tp = 2, sp = true, ep = 2 }, { cp = 2, tp = 2, sp = true } }) do
      local p = planned(over)
      for _, k in ipairs({ 'total_params', 'active_params', 'expert_params' }) do
        assert.equal(one.moe[k], p.moe[k], k)
      end
      -- (N = 8 of a micro-batch's 16 tokens, 4 under cp and sp; the rows in expert order: without ep the
      -- least of their N K and the micro-batch's E x capacity, 4 experts x ceil(0.5 x 16 x 2 / 4) = 16 (a rank's
      -- own would be 8, or 4); under ep what balanced routing keeps of them, half of each expert's capacity on
      -- each of the 2 ranks)
      local N = over.cp and over.sp and 4 or 8
      assert.same({ tokens = N, top_k = 2, rows = over.ep and 8 or math.min(2 * N, 16) }, p.moe_shapes['transformer.h.1'])
    end
  end)
end)
