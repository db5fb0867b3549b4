-- Run on every rank by spec/dist_fsdp_spec.lua: trains the small GPT of
-- policy_recipe.lua under FSDP/HSDP with a global batch of 12 rows of one
-- row per micro-step (so 1, 2, 3 or 4 ranks read the same rows per step),
-- checkpointing every 3 steps; with a RESUME path it continues from that
-- checkpoint (written by another number of ranks: parameters and optimizer
-- state are re-cut).
-- args: OUT optimizer policy SHARD_SIZE MAX_ITERS [RESUME]
-- Rank 0 writes OUT/losses.json and OUT/final.safetensors (the gathered
-- parameters); prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')
dist.POLICIES.fsdp = dist.POLICIES.fsdp or 'gptlua.dist.fsdp'
dist.POLICIES.hsdp = dist.POLICIES.hsdp or 'gptlua.dist.fsdp'

local out, opt, pol, shard, iters, resume = arg[1], arg[2], arg[3], tonumber(arg[4]), tonumber(arg[5]), arg[6]
local world = dist.init { backend = 'mpi', timeout = 120 }
local args = {}
if resume then args[1] = '--resume=' .. resume end
local res, t = train.main(recipe({ optimizer = opt, dist = pol, shard_size = shard, max_iters = iters,
  batch_size = 1, total_batch_size = 16 * 12, checkpoint_interval = 3, keep_last = 5, out_dir = out }), args)
local sd = t.policy:full_state_dict(0)
if world.rank == 0 then
  ckpt.save_safetensors(out .. '/final.safetensors', sd)
  local f = assert(io.open(out .. '/losses.json', 'wb'))
  f:write(cjson.encode({ losses = res.losses, checkpoint = res.checkpoint }))
  f:close()
end
print(('OK rank %d of %d'):format(world.rank, world.size))
