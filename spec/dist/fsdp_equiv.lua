-- Run on every rank by spec/dist_fsdp_spec.lua: trains the small GPT of
-- policy_recipe.lua under FSDP/HSDP (and DDP for the HSDP identity) and, on
-- rank 0, writes what the spec compares with one process running N times
-- the gradient accumulation:
--   OUT/<label>.safetensors   final parameters (gathered)
--   OUT/<label>.json          {losses, world, bytes = per-rank {params, grads, optimizer, master}}
-- args: OUT ACCUM RUN...; RUN is label=optimizer,dist[,key=value...] where
-- keys are recipe keys (shard_size, activation_checkpointing, max_iters,
-- dtype, checkpoint_interval: checkpoints under OUT/runs_<label>) or
-- options of gptlua.dist.fsdp (accumulate, reshard_after_forward,
-- reduce_dtype, prefetch).  Prints "OK rank R of N" at the end.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local fsdp = require 'gptlua.dist.fsdp'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local out, accum = arg[1], tonumber(arg[2])
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi', timeout = 120 }

-- the trainer reaches fsdp through dist.policy; options not in the recipe
-- schema are passed on here
local popts = {}
package.loaded['fsdp_spec_policy'] = { new = function(name, o)
  for k, v in pairs(popts) do o[k] = v end
  return fsdp.new(name, o)
end }
dist.POLICIES.fsdp, dist.POLICIES.hsdp = 'fsdp_spec_policy', 'fsdp_spec_policy'

local function value(v)
  if v == 'true' then return true elseif v == 'false' then return false end
  return tonumber(v) or v
end

for i = 3, #arg do
  local label, spec = arg[i]:match('^([%w_]+)=(.+)$')
  local fields = {}
  for f in spec:gmatch('[^,]+') do fields[#fields + 1] = f end
  local r = { optimizer = fields[1], dist = fields[2], gradient_accumulation_steps = accum,
              out_dir = out .. '/runs_' .. label, max_iters = 12 }
  popts = {}
  for j = 3, #fields do
    local k, v = fields[j]:match('^([%w_]+)=(.+)$')
    if fsdp.defaults[k] ~= nil then popts[k] = value(v) else r[k] = value(v) end
  end
  local t = train.new(recipe(r), {})
  local res = t:run()
  local mine = t.policy.state_bytes and t.policy:state_bytes() or { optimizer = t.policy:optimizer_state_bytes() }
  local bytes = {}
  for q = 0, world.size - 1 do
    local b = {}
    for _, k in ipairs({ 'params', 'grads', 'optimizer', 'master' }) do
      b[k] = world:all_reduce_number(q == world.rank and (mine[k] or 0) or 0, 'sum')
    end
    bytes[q + 1] = b
  end
  local sd = t.policy.full_state_dict and t.policy:full_state_dict() or t.model:state_dict()
  if world.rank == 0 then
    ckpt.save_safetensors(('%s/%s.safetensors'):format(out, label), sd)
    local f = assert(io.open(('%s/%s.json'):format(out, label), 'wb'))
    f:write(cjson.encode({ losses = res.losses, world = world.size, bytes = bytes }))
    f:close()
  end
  t.policy:detach()
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
