-- Run on 2 ranks by spec/cuda_ep_graph_spec.lua under the CUDA simulator
-- (GL_SIM_DEVICES=2: a simulated GPU per rank, NCCL between them): one MoE
-- layer of 4 experts (a shared expert beside them) split over ep 2, its
-- forward and backward (gptlua.dist.expert_parallel's fixed exchange) run
-- op by op on two batches, then captured as one CUDA graph on the first and
-- replayed on the second.  Checks, on every rank:
--   - the fixed exchange op by op equals the counts exchange bit for bit
--     (the output and every gradient, both batches: the routing differs);
--   - an op-by-op step of the fixed exchange makes no host synchronisation
--     (the simulator's trace: no blocking host wait; no host wait for an
--     NCCL work), where the counts exchange makes some;
--   - the replayed graph (moe.ep_exchange 'auto' picks the fixed exchange
--     while capturing) gives the op-by-op step's output and gradients on
--     the second batch, bit for bit.
-- On GPUs (2 of them) the same, the host syncs counted from NCCL's host
-- waits alone.  arg 1: the capacity factor (0: dropless).  Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local cuda = require 'gptlua.cuda'
local nn = require 'gptlua.nn'
local moe = require 'gptlua.moe'
local EP = require 'gptlua.dist.expert_parallel'
local trace = dofile(gl.root .. '/recipes/tools/sim_trace.lua')

local world = dist.init { backend = 'auto', timeout = 300 }
assert(world.size == 2 and world.nccl, 'ep_graph: 2 ranks with NCCL (GL_SIM_DEVICES=2)')
local dev = dist.device()
local cf = tonumber(arg[1] or '0')

local C, N = 16, 12
gl.manual_seed(3)
local mc = moe.resolve({ experts = 4, top_k = 2, hidden = 24, shared = 1, capacity_factor = cf }, C)
local Holder = nn.class('EpGraphHolder', nn.Module)
function Holder:__init() self:add('mlp', moe.MoE(mc, C, 'gelu', 0.2, 0.2)) end
local model = Holder():to(dev)
model:train()
local layer = model.mlp
local group, replica = EP.groups(world, 2)
EP.parallelize(model, group, replica, world.size)
local params = model:parameters()

-- this rank's two batches (each rank its own tokens)
gl.manual_seed(10 + world.rank)
local batches = { gl.randn({ N, C }):to(dev):keep(), gl.randn({ N, C }):to(dev):keep() }
local x = gl.empty({ N, C }, { device = dev }):keep()   -- the captured step's input
local y = gl.empty({ N, C }, { device = dev }):keep()   -- and its output

-- the step: gradients zeroed in place, forward, a loss that weighs every
-- output element differently, backward (gradients accumulate into .grad)
local wl = gl.randn({ N, C }):to(dev):keep()
local function step()
  for _, p in ipairs(params) do if p.grad then p.grad:zero_() end end
  gl.scope(function()
    local out = layer(x)
    y:copy_(out:detach())
    ;(out * wl):sum():backward()
  end)
end

-- output and gradients as host lists
local function results()
  local r = { y:to('cpu'):tolist() }
  for i, p in ipairs(params) do r[i + 1] = p.grad and p.grad:to('cpu'):tolist() or 'none' end
  return r
end

-- host syncs of an op-by-op step (the trace's blocking waits, and host
-- waits for NCCL works), and what they were
local function run_traced()
  local hw = dist.device_host_waits()
  local syncs, kinds = trace.syncs_of(step)   -- (nil on a GPU: NCCL's host waits only)
  local waits = dist.device_host_waits() - hw
  return (syncs or 0) + waits, ('%s; NCCL host waits %d'):format(kinds or 'not traced', waits)
end

local function eager(mode, b)
  layer.ep_exchange = mode
  x:copy_(batches[b])
  local syncs, kinds = run_traced()
  return results(), syncs, kinds
end

-- op by op: the fixed exchange equals the counts exchange, with no host sync
step()  -- (the gradients made, the constants of the fixed exchange kept)
layer.ep_exchange = 'fixed'
x:copy_(batches[1]); step()
local want = {}
for b = 1, 2 do
  local counts, counts_syncs = eager('counts', b)
  local fixed, fixed_syncs, kinds = eager('fixed', b)
  assert(counts_syncs > 0, 'the counts exchange waits on the host')
  assert(fixed_syncs == 0, ('rank %d batch %d: the fixed exchange made %d host syncs (%s)'):format(world.rank, b, fixed_syncs, kinds))
  require('luassert').are.same(counts, fixed, 'fixed == counts')
  want[b] = fixed
end

-- captured ('auto': the fixed exchange while capturing) on batch 1, replayed on batch 2
layer.ep_exchange = 'auto'
x:copy_(batches[1])
local g = cuda.graph(step, dev)
x:copy_(batches[2])
g:replay()
require('luassert').are.same(want[2], results(), 'replay == op by op')
g:replay()  -- again: the same
require('luassert').are.same(want[2], results(), 'second replay == op by op')
print(('ep_graph: rank %d graph of %d nodes, fixed exchange op by op: 0 host syncs'):format(world.rank, g.nodes))
g:free()
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
