-- Run on every rank by spec/dist_policy_spec.lua: trains the small GPT of
-- policy_recipe.lua for 20 steps under each data-parallel policy and, on
-- rank 0, writes what the spec compares with one process running N times
-- the gradient accumulation:
--   OUT/<optimizer>_<policy>.safetensors   final parameters
--   OUT/<optimizer>_<policy>.json          {losses, state_bytes (per rank), world}
--   OUT/runs_<optimizer>_<policy>/p/metrics.jsonl   (loss, grad_norm, ... per step)
-- args: OUT ACCUM BUCKET_MB optimizer:policy[,policy...] ...
-- Prints "OK rank R of N" at the end.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local out, accum, bucket_mb = arg[1], tonumber(arg[2]), tonumber(arg[3])
local world = dist.init { backend = 'mpi', timeout = 120 }
for i = 4, #arg do
  local opt, pols = arg[i]:match('^(%w+):(.+)$')
  for pol in pols:gmatch('[^,]+') do
    local r = recipe({ optimizer = opt, dist = pol, gradient_accumulation_steps = accum,
      bucket_mb = bucket_mb, out_dir = ('%s/runs_%s_%s'):format(out, opt, pol) })
    -- ranks start from different weights: the policy broadcasts rank 0's
    r.build_model = function(cfg)
      gl.manual_seed(cfg.seed + 101 * world.rank)
      return train.build_model(cfg)
    end
    local t = train.new(r, {})
    local res = t:run()
    local bytes = {}
    for r = 0, world.size - 1 do
      bytes[r + 1] = world:all_reduce_number(r == world.rank and t.policy:optimizer_state_bytes() or 0, 'sum')
    end
    if world.rank == 0 then
      local sd = t.model:state_dict()
      ckpt.save_safetensors(('%s/%s_%s.safetensors'):format(out, opt, pol), sd)
      local f = assert(io.open(('%s/%s_%s.json'):format(out, opt, pol), 'wb'))
      f:write(cjson.encode({ losses = res.losses, state_bytes = bytes, world = world.size }))
      f:close()
    end
    t.policy:detach()
  end
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
