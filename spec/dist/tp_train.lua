-- Run on every rank by spec/dist_tp_spec.lua: trains the small float64 GPT
-- of tp_recipe() (gpt2 or nanochat with GQA, AdamW) with a fixed global
-- batch, so any mesh reads the same rows per step; the remaining arguments
-- are command-line overrides (--tp=2, --dp=2, --resume=PATH, ...).
-- args: OUT MODEL MAX_ITERS [overrides...]
-- Rank 0 writes OUT/result.json {losses, checkpoint}; prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'
local cjson = require 'cjson'

local out, model, iters = arg[1], arg[2], tonumber(arg[3])
local world = dist.init { backend = 'mpi', timeout = 120 }
local args = {}
for i = 4, #arg do args[#args + 1] = arg[i] end
local recipe = dofile(gl.root .. '/spec/dist/tp_recipe.lua')
local res = train.main(recipe(model, { max_iters = iters, out_dir = out }), args)
if world.rank == 0 then
  local f = assert(io.open(out .. '/result.json', 'wb'))
  f:write(cjson.encode({ losses = res.losses, checkpoint = res.checkpoint }))
  f:close()
end
print(('OK rank %d of %d'):format(world.rank, world.size))
