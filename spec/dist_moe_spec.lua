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
