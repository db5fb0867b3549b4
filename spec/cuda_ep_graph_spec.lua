-- Expert parallelism in a CUDA graph: an ep 2 MoE layer's forward and
-- backward over NCCL with the fixed exchange (moe.ep_exchange, chosen by
-- 'auto' while capturing) captured as one graph and replayed bit for bit
-- like the same step op by op on another batch (other routing), that step
-- op by op making no host synchronisation, and equal to the counts
-- exchange bit for bit (spec/dist/ep_graph.lua, on 2 ranks); and a
-- trainer step with the fixed exchange makes no host sync; and the
-- trainer's whole step under ddp with ep replays as one graph
-- (spec/dist/ep_train_graph.lua).  Under the
-- CUDA simulator (GL_SIM_DEVICES=2: a simulated GPU per rank, its stream
-- trace counting the host syncs) or on 2 GPUs; pending otherwise.
local cuda = require 'gptlua.cuda'
local H = require 'support.mpi'

local NGPU = cuda.device_count()
local SIM = NGPU > 0 and cuda.get_device_name(0):find('cuda-sim', 1, true) ~= nil

describe('expert parallelism in a CUDA graph #cuda', function()
  if not H.MPIRUN or not (SIM or NGPU >= 2) then
    pending(H.MPIRUN and 'needs the CUDA simulator or 2 GPUs' or 'mpirun is not installed (make deps)')
    return
  end
  local env = SIM and 'env GL_SIM_DEVICES=2 ' or ''
  -- a trainer step (DDP, a MoE layer in every block, ep over both ranks)
  -- by recipes/tools/host_syncs.lua: the fixed exchange's step has no host
  -- sync (the gradient norm's reads apart, as under DDP alone), the counts
  -- exchange's has; the two train alike bit for bit
  it('trains with no host sync inside the step, bit for bit like the counts exchange', function()
    if not SIM then pending('the host syncs are read from the simulator\'s trace') return end
    local out = H.tmpdir()
    local o, rc = H.sh(('env GL_SIM_DEVICES=2 %s -np 2 --oversubscribe --allow-run-as-root %s '
      .. 'recipes/tools/host_syncs.lua --policies=ep,ep_counts --waits=device --steps=2 --out=%s'):format(
      H.MPIRUN, H.EXE, out), 300)
    H.assert_ranks_ok(o, rc, 2)
    local fixed, counts = H.read_json(out .. '/ep-device.json'), H.read_json(out .. '/ep_counts-device.json')
    assert.equal(2, #fixed.steps)
    for i, s in ipairs(fixed.steps) do
      assert.equal(0, s.host_syncs, ('step %d: host syncs inside the step with the fixed exchange\n%s'):format(i, o))
      assert.is_true(counts.steps[i].host_syncs > 0, ('step %d: the counts exchange reads its counts\n%s'):format(i, o))
    end
    assert.same(counts.losses, fixed.losses)
    local load = require('gptlua.checkpoint').load_safetensors
    local a, b = load(out .. '/ep_counts-device.safetensors'), load(out .. '/ep-device.safetensors')
    for k, t in pairs(a) do assert.same(t:tolist(), b[k]:tolist(), k) end
    os.execute('rm -rf ' .. out)
  end)

  for _, cf in ipairs({ 0, 0.5 }) do
    it(('replays an ep 2 layer as one graph with no host sync, capacity factor %g'):format(cf), function()
      local out, rc = H.sh(env .. H.EXE .. ' -n 2 spec/dist/ep_graph.lua ' .. cf, 300)
      H.assert_ranks_ok(out, rc, 2)
    end)
  end

  -- the trainer's whole step (gptlua.train_graph, cuda_graph = true) under
  -- ddp with ep 2 (and ep 1: ddp alone), two MoE layers, two micro-steps:
  -- captured once, replayed, bit for bit the op-by-op trainer's losses,
  -- norms, parameters and routers' bias
  for _, c in ipairs({ { 0, 2 }, { 0.5, 2 }, { 0, 1 } }) do
    it(('replays the trainer\'s ddp step (ep %d) as one graph like op by op, capacity factor %g'):format(c[2], c[1]),
      function()
        local out, rc = H.sh(('%s%s -n 2 spec/dist/ep_train_graph.lua %g %d'):format(env, H.EXE, c[1], c[2]), 300)
        H.assert_ranks_ok(out, rc, 2)
      end)
  end
end)
