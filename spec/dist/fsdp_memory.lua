-- Run on every rank by spec/dist_fsdp_spec.lua: allocator statistics of a
-- GPT-2 whose parameters dominate its activations, trained for two steps
-- unsharded (dist = 'none', no communication), then under FSDP, then under
-- FSDP with bfloat16 parameters (fp32 master shards):
--   persistent  bytes allocated between steps (parameters, gradients,
--               optimizer state, masters) over the baseline before the trainer
--   forward     peak over the baseline during one forward
--   step        peak over the baseline during one whole step
--   state       the policy's own count (state_bytes(): params, grads,
--               optimizer, master)
-- Rank 0 writes OUT/memory.json {world, none = {...}, fsdp = {per rank},
-- bf16 = {per rank}}.
-- args: OUT.  Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'
dist.POLICIES.fsdp = dist.POLICIES.fsdp or 'gptlua.dist.fsdp'

local out = arg[1]
local world = dist.init { backend = 'mpi', timeout = 120 }

local function recipe(pol, dtype)
  return { name = 'mem', model = 'gpt2', data = 'random', vocab_size = 256, n_layer = 6, n_head = 4, n_embd = 128,
    dtype = dtype or 'float32', block_size = 16, batch_size = 1, max_iters = 10, eval_interval = 0, log_interval = 0, sample_length = 0,
    warmup_iters = 0, quiet = true, device = 'cpu', peak_flops = 1e12, bias = false, seed = 3, dist = pol,
    out_dir = out .. '/runs' }
end

-- compiled traces can keep a dropped trainer reachable: flush them first
local function settle() jit.flush(); collectgarbage('collect'); collectgarbage('collect') end

local function measure(pol, dtype)
  local a0 = gl.memory_stats().allocated
  local t = train.new(recipe(pol, dtype), {})
  t:train_step(); t.step = 1
  t:train_step(); t.step = 2
  settle()
  local r = { persistent = gl.memory_stats().allocated - a0 }
  local policy, model = t.policy, t.model
  gl.reset_peak_memory()
  policy:zero_grad()
  gl.scope(function()
    local x, y = t.data.train:next_batch()
    policy:before_micro_step(1, 1)
    local _, loss = model:forward(x, y)
    r.forward = gl.memory_stats().peak - a0
    loss:backward()
  end)
  policy:after_backward()
  gl.scope(function() policy:step() end)
  r.step = gl.memory_stats().peak - a0
  if policy.state_bytes then r.state = policy:state_bytes() end
  if policy.detach then policy:detach() end
  return r
end

-- every rank's numbers of r (persistent, forward, step and the state counts)
local function per_rank(r)
  local all = {}
  for q = 0, world.size - 1 do
    local e = { state = {} }
    for _, k in ipairs({ 'persistent', 'forward', 'step' }) do
      e[k] = world:all_reduce_number(q == world.rank and r[k] or 0, 'sum')
    end
    for _, k in ipairs({ 'params', 'grads', 'optimizer', 'master' }) do
      e.state[k] = world:all_reduce_number(q == world.rank and r.state[k] or 0, 'sum')
    end
    all[q + 1] = e
  end
  return all
end

settle()
local none = measure('none')
settle()
local mine = measure('fsdp')
settle()
local bf16 = measure('fsdp', 'bfloat16')
local all, all_bf16 = per_rank(mine), per_rank(bf16)
if world.rank == 0 then
  local f = assert(io.open(out .. '/memory.json', 'wb'))
  f:write(cjson.encode({ world = world.size, none = none, fsdp = all, bf16 = all_bf16 }))
  f:close()
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
