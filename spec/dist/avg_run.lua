-- Run on every rank by spec/dist_avg_spec.lua: trains the small GPT of
-- policy_recipe.lua under one policy and writes, on rank 0, what the spec
-- compares:
--   OUT/losses.json        {losses, world, comm_bytes (rank 0's), metrics (every log record),
--                          ps_log (asynchronous ps: rank 0's applied updates {worker, staleness})}
--   OUT/params.safetensors rank 0's final parameters
-- args: OUT key=value ... (recipe overrides; optimizer=sgd builds
-- spec/dist/avg_sgd.lua; resume=PATH resumes from a checkpoint; numbers and
-- true/false are converted; slow=R:MS delays every training batch of rank R
-- by MS milliseconds: a recipe hook, build_data).  Ranks start from different weights: every
-- policy must broadcast rank 0's.  Prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local out = arg[1]
local world = dist.init { backend = 'mpi', timeout = 120 }
local over, args = { out_dir = out, grad_clip = 0 }, {}
local slow   -- slow=R:MS: rank R sleeps MS milliseconds before each training batch
for i = 2, #arg do
  local k, v = arg[i]:match('^([%w_]+)=(.*)$')
  if v == 'true' or v == 'false' then v = v == 'true' else v = tonumber(v) or v end
  if k == 'resume' then args[1] = '--resume=' .. v elseif k == 'slow' then slow = v else over[k] = v end
end
local sgd = over.optimizer == 'sgd'
if sgd then over.optimizer = 'adamw' end
local r = recipe(over)
if sgd then r.build_optimizer = dofile(gl.root .. '/spec/dist/avg_sgd.lua') end
r.build_model = function(cfg)
  gl.manual_seed(cfg.seed + 101 * world.rank)
  return train.build_model(cfg)
end
if slow then
  local rank, ms = slow:match('^(%d+):(%d+)$')
  if tonumber(rank) == world.rank then
    local ffi = require 'ffi'
    pcall(ffi.cdef, 'int usleep(unsigned int usec);')
    r.build_data = function(cfg, rk, ws)
      local d = train.build_data(cfg, rk, ws)
      local next_batch = d.train.next_batch
      d.train.next_batch = function(...) ffi.C.usleep(tonumber(ms) * 1000); return next_batch(...) end
      return d
    end
  end
end
local t = train.new(r, args)
local res = t:run()
if world.rank == 0 then
  local sd = t.model:state_dict()
  ckpt.save_safetensors(out .. '/params.safetensors', sd)
  local metrics = {}
  for line in io.lines(t.run_dir .. '/metrics.jsonl') do
    local m = cjson.decode(line)
    if m.loss then metrics[#metrics + 1] = m end
  end
  local f = assert(io.open(out .. '/losses.json', 'wb'))
  f:write(cjson.encode({ losses = res.losses, world = world.size, comm_bytes = t.comm.sent_bytes or 0,
    metrics = metrics, ps_log = t.policy.log }))
  f:close()
end
print(('OK rank %d of %d'):format(world.rank, world.size))
