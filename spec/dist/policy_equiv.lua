-- Run on every rank by spec/dist_policy_spec.lua: trains the small GPT of
-- policy_recipe.lua for 20 steps under each data-parallel policy and, on
-- rank 0, writes what the spec compares with one process running N times
-- the gradient accumulation:
--   OUT/<optimizer>_<policy>.safetensors   final parameters
--   OUT/<optimizer>_<policy>.json          {losses, state_bytes (per rank), world,
--                                           master_bytes and shard_elements (per
--                                           rank; ZeRO with a bfloat16 model)}
--   OUT/runs_<optimizer>_<policy>/p/metrics.jsonl   (loss, grad_norm, ... per step)
--   OUT/<optimizer>_<policy>.masterR.safetensors  rank R's fp32 master pieces
--                                           ("<key>@<offset>"; bfloat16 ZeRO runs)
-- args: OUT ACCUM BUCKET_MB [dtype=DTYPE] optimizer:policy[,policy...] ...
-- shard_elements counts, from the bucket layout, the elements this rank
-- keeps an fp32 master of: its slice c of every low-precision flat bucket
-- (padding included) plus every low-precision replicated parameter.
-- Prints "OK rank R of N" at the end.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local out, accum, bucket_mb = arg[1], tonumber(arg[2]), tonumber(arg[3])
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi', timeout = 120 }
local optim = require 'gptlua.optim'
local dtype = 'float32'
for i = 4, #arg do dtype = arg[i]:match('^dtype=(%w+)$') or dtype end

local function shard_elements(pol)
  local n = 0
  for _, b in ipairs(pol.buckets or {}) do
    if optim.needs_master(b.params[1]) then
      if b.kind == 'replicated' then for _, p in ipairs(b.params) do n = n + p:numel() end
      else n = n + b.c end
    end
  end
  return n
end

for i = 4, #arg do
  local opt, pols = arg[i]:match('^(%w+):(.+)$')
  for pol in (pols or ''):gmatch('[^,]+') do
    local r = recipe({ optimizer = opt, dist = pol, gradient_accumulation_steps = accum, dtype = dtype,
      bucket_mb = bucket_mb, out_dir = ('%s/runs_%s_%s'):format(out, opt, pol) })
    -- ranks start from different weights: the policy broadcasts rank 0's
    r.build_model = function(cfg)
      gl.manual_seed(cfg.seed + 101 * world.rank)
      return train.build_model(cfg)
    end
    local t = train.new(r, {})
    local res = t:run()
    local bytes, master, elems = {}, {}, {}
    local mine = t.policy.state_bytes and t.policy:state_bytes() or { master = 0 }
    for r = 0, world.size - 1 do
      local me = r == world.rank
      bytes[r + 1] = world:all_reduce_number(me and t.policy:optimizer_state_bytes() or 0, 'sum')
      master[r + 1] = world:all_reduce_number(me and mine.master or 0, 'sum')
      elems[r + 1] = world:all_reduce_number(me and shard_elements(t.policy) or 0, 'sum')
    end
    -- fp32 masters: every rank writes its pieces (the replicated ones: rank 0)
    if mine.master > 0 then
      local pieces = {}
      t.policy:each_state(function(k, v, off, replicated, kind)
        if kind == 'master' and (not replicated or world.rank == 0) then
          pieces[('%s@%d'):format(k, off)] = v:clone()
        end
      end)
      ckpt.save_safetensors(('%s/%s_%s.master%d.safetensors'):format(out, opt, pol, world.rank), pieces)
    end
    if world.rank == 0 then
      local sd = t.model:state_dict()
      ckpt.save_safetensors(('%s/%s_%s.safetensors'):format(out, opt, pol), sd)
      local f = assert(io.open(('%s/%s_%s.json'):format(out, opt, pol), 'wb'))
      f:write(cjson.encode({ losses = res.losses, state_bytes = bytes, world = world.size, master_bytes = master,
        shard_elements = elems }))
      f:close()
    end
    t.policy:detach()
  end
end
world:barrier()
print(('OK rank %d of %d'):format(world.rank, world.size))
