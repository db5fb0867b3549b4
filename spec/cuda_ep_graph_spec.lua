-- Expert parallelism in a CUDA graph: an ep 2 MoE layer's forward and
-- backward over NCCL with the fixed exchange (moe.ep_exchange, chosen by
-- 'auto' while capturing) captured as one graph and replayed bit for bit
-- like the same step op by op on another batch (other routing), that step
-- op by op making no host synchronisation, and equal to the counts
-- exchange bit for bit (spec/dist/ep_graph.lua, on 2 ranks).  Under the
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
  for _, cf in ipairs({ 0, 0.5 }) do
    it(('replays an ep 2 step as one graph with no host sync, capacity factor %g'):format(cf), function()
      local out, rc = H.sh(env .. H.EXE .. ' -n 2 spec/dist/ep_graph.lua ' .. cf, 300)
      H.assert_ranks_ok(out, rc, 2)
    end)
  end
end)
