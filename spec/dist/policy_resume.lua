-- Run on every rank by spec/dist_policy_spec.lua: trains the small GPT of
-- policy_recipe.lua with a global batch fixed by total_batch_size (so any
-- number of ranks reads the same rows per step), checkpointing every 3
-- steps; with a RESUME path it continues from that checkpoint (written by
-- another number of ranks: the optimizer state is re-sharded).
-- args: OUT optimizer policy MAX_ITERS [RESUME] [dtype=DTYPE]
-- Rank 0 writes OUT/losses.json; prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'
local recipe = dofile(gl.root .. '/spec/dist/policy_recipe.lua')

local dtype = 'float32'
local pos = {}
for _, a in ipairs(arg) do
  local d = a:match('^dtype=(%w+)$')
  if d then dtype = d else pos[#pos + 1] = a end
end
local out, opt, pol, iters, resume = pos[1], pos[2], pos[3], tonumber(pos[4]), pos[5]
local world = dist.init { backend = 'mpi', timeout = 120 }
local args = {}
if resume then args[1] = '--resume=' .. resume end
local res = train.main(recipe({ optimizer = opt, dist = pol, max_iters = iters, total_batch_size = 2 * 16 * 6,
  checkpoint_interval = 3, keep_last = 5, out_dir = out, bucket_mb = 0.01, dtype = dtype }), args)
if world.rank == 0 then
  local f = assert(io.open(out .. '/losses.json', 'wb'))
  f:write(cjson.encode({ losses = res.losses, checkpoint = res.checkpoint }))
  f:close()
end
print(('OK rank %d of %d'):format(world.rank, world.size))
