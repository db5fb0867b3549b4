-- Run on every rank by spec/dist_tp_spec.lua: the per-rank peak of one
-- forward and backward of a float32 gpt2 (width 64, context 128) cut over
-- tp 2, without and with sequence parallelism, from the allocator's
-- statistics (bytes above what was live before the model was built).
-- Sequence parallel keeps only the T/tp shard of each column-parallel
-- matrix's input (c_attn, c_fc, the head) and gathers it again in backward,
-- so its peak must sit below plain tp's by at least those inputs' other
-- (tp-1)/tp: (2L + 1) (tp-1)/tp B T C floats.
-- args: none.  Rank 0 prints "PEAK tp <bytes> sp <bytes>"; every rank "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local TP = require 'gptlua.dist.tensor_parallel'

local world = dist.init { backend = 'mpi', timeout = 120 }
local mesh = dist.mesh { tp = world.size }

local function settled() jit.flush(); for _ = 1, 3 do collectgarbage() end; return gl.memory_stats().allocated end

local function peak(sp)
  local base = settled()
  gl.reset_peak_memory()
  gl.scope(function()
    gl.manual_seed(7)
    local m = require('gptlua.models.gpt2').GPT({ vocab_size = 64, block_size = 128, n_layer = 2, n_head = 4,
      n_embd = 64, dropout = 0 })
    TP.parallelize(m, mesh.tp, { sequence_parallel = sp })
    local B, T = 4, 128
    local x = gl.zeros({ B, T }, { dtype = 'int64' })
    local _, loss = m:forward(x, x)
    loss:backward()
  end)
  return gl.memory_stats().peak - base
end

local tp, sp = peak(false), peak(true)
if world.rank == 0 then print(('PEAK tp %d sp %d'):format(tp, sp)) end
local want = (2 * 2 + 1) * (world.size - 1) / world.size * 4 * 128 * 64 * 4
assert(tp - sp >= want, ('rank %d: sequence parallel peak %d, plain tp %d: expected at least %d bytes less'):format(
  world.rank, sp, tp, want))
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
