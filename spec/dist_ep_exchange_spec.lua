-- Expert parallelism's two exchanges (moe.ep_exchange, gptlua.dist.expert_parallel):
-- 'counts' reads the per-peer counts on the host and sends the rows routed;
-- 'fixed' sends each peer a block of a bound of rows, the counts staying on
-- the device.  The same rows meet the same experts in the same order, so on
-- MPI ranks (float64) the fixed exchange's run is the counts exchange's bit
-- for bit (every step's loss and gradient norm, the final parameters), and
-- equals one process by the rule of spec/support/dist_train.lua; dropless
-- and with a capacity factor.  The plan counts the fixed exchange's bytes.
-- Under the CUDA simulator the fixed exchange is captured in a CUDA graph:
-- spec/cuda_ep_graph_spec.lua.
local H = require 'support.mpi'
local DT = require 'support.dist_train'

describe('expert parallelism: moe.ep_exchange', function()
  it("is 'auto', 'counts' or 'fixed', refused in one line otherwise", function()
    local train = require 'gptlua.train'
    local ok, err = pcall(train.resolve_config, { device = 'cpu', n_embd = 32, n_head = 4 },
      { '--moe.experts=4', '--moe.ep_exchange=sometimes' })
    assert.is_false(ok)
    assert.equal("config: moe.ep_exchange must be 'auto', 'counts' or 'fixed', got 'sometimes'", tostring(err))
    local cfg = train.resolve_config({ device = 'cpu', n_embd = 32, n_head = 4 }, { '--moe.experts=4' })
    assert.equal('auto', require('gptlua.moe').resolve(cfg.moe, 32).ep_exchange)
  end)

  -- Per MoE layer and micro-step a rank sends (ep-1)/ep of its send buffer
  -- four times (dispatch and combine, forward and backward) and (ep-1)/ep
  -- of its E counts once.  Fixed: the buffer is ep blocks of B = N min(K,
  -- E/ep) rows (dropless) or E/ep min(capacity, N) (with a capacity, when
  -- smaller); counts, planned: the N K rows routed (balanced routing).
  it('plans the fixed exchange\'s all-to-all bytes: ep blocks of the bound per exchange', function()
    local plan = require 'gptlua.plan'
    local N, K, C, E, es = 16, 2, 32, 4, 8   -- (one micro-step of 16 tokens per rank, float64)
    local function bytes(ep, exchange, cf)
      local r = DT.recipe('gpt2', { dist = 'ddp', ep = ep,
        moe = { experts = E, top_k = K, every = 2, ep_exchange = exchange, capacity_factor = cf } })
      local p = plan.plan(r, { world = 4, device_memory = '1GiB' })
      local got = 0
      for _, grp in pairs(p.traffic) do got = got + (grp.by.all_to_all and grp.by.all_to_all.bytes or 0) end
      return got
    end
    for _, ep in ipairs({ 2, 4 }) do
      local El, counts = E / ep, (ep - 1) / ep * E * 8
      local B = N * math.min(K, El)
      assert.equal(4 * (ep - 1) * B * C * es + counts, bytes(ep, 'fixed', 0), ('ep %d dropless'):format(ep))
      assert.equal(4 * (ep - 1) / ep * N * K * C * es + counts, bytes(ep, 'counts', 0), ('ep %d counts'):format(ep))
      -- capacity factor 0.5: each expert keeps ceil(0.5 N K / E) = 4 rows
      B = math.min(B, El * 4)
      assert.equal(4 * (ep - 1) * B * C * es + counts, bytes(ep, 'fixed', 0.5), ('ep %d capacity'):format(ep))
    end
  end)
end)

describe('expert parallelism: the fixed exchange on MPI ranks', function()
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local runs = DT.new(out)
  local MOE = { experts = 4, top_k = 2, every = 2, aux_loss = 0.01, bias_update = 0.01, shared = 1 }
  local ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=2 --moe.aux_loss=0.01 --moe.bias_update=0.01 --moe.shared=1'
  local CAP = { experts = 4, top_k = 2, every = 1, capacity_factor = 0.5 }
  local CAP_ARGS = '--moe.experts=4 --moe.top_k=2 --moe.every=1 --moe.capacity_factor=0.5'

  it('equals the counts exchange bit for bit and one process by the rule (ep 2 and 4; capacity factor)', function()
    local cases = {
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2 --moe.ep_exchange=counts', ref = MOE },
      { ranks = 2, model = 'nanochat', args = ARGS .. ' --dist=ddp --ep=2 --moe.ep_exchange=fixed', ref = MOE },
      { ranks = 2, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --ep=2 --moe.ep_exchange=counts', ref = CAP },
      { ranks = 2, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --ep=2 --moe.ep_exchange=fixed', ref = CAP,
        cap = true },
      { ranks = 2, model = 'gpt2', args = CAP_ARGS .. ' --dist=ddp --ep=1' },
      -- ep 4: one expert a rank, four blocks
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=ddp --ep=4 --moe.ep_exchange=counts', ref = MOE },
      { ranks = 4, model = 'gpt2', args = ARGS .. ' --dist=ddp --ep=4 --moe.ep_exchange=fixed', ref = MOE },
    }
    local got = runs:launch(cases)
    for _, i in ipairs({ 1, 3, 6 }) do
      local counts, fixed = got[i], got[i + 1]
      assert.same(counts.losses, fixed.losses, cases[i + 1].what .. ': losses')
      assert.same(counts.norms, fixed.norms, cases[i + 1].what .. ': gradient norms')
      local a, b = DT.final_params(counts), DT.final_params(fixed)
      local n = 0
      for k, t in pairs(a) do
        assert.same(t:tolist(), b[k]:tolist(), cases[i + 1].what .. ': ' .. k)
        n = n + 1
      end
      assert.is_true(n > 0)
      if cases[i + 1].cap then
        -- with a capacity factor each rank drops past the capacity of its own
        -- tokens: the reference is ep 1 on the same dp ranks (dist_ep_spec.lua)
        local one = got[5]
        one.what, one.tol = 'ep 1 with a capacity factor', 1e-9
        DT.assert_matches({ losses = one.losses, norms = one.norms, params = DT.final_params(one) }, fixed)
      else
        runs:check(cases[i + 1], fixed, { moe = cases[i + 1].ref })
      end
    end
  end)
end)
