-- Run on every rank by spec/dist_pp_spec.lua: several trainer runs of the
-- small float64 GPT of tp_recipe() in one launch (pipeline parallelism with
-- context or sequence parallelism), each as spec/dist/tp_train.lua runs one.
-- args: OUT MAX_ITERS RUN ...   RUN = name:model:override,override,...
-- (e.g. ring:gpt2:--pp=2,--cp=2,--cp_mode=ring,--dist=ddp).  Rank 0 writes
-- OUT/<name>/result.json {losses, checkpoint}; prints "OK rank R of N".
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'

local out, iters = arg[1], tonumber(arg[2])
local world = dist.init { backend = 'mpi', timeout = 120 }
local recipe = dofile(gl.root .. '/spec/dist/tp_recipe.lua')
local write_result = dofile(gl.root .. '/spec/dist/write_result.lua')
for i = 3, #arg do
  local name, model, list = arg[i]:match('^([^:]+):([^:]+):(.*)$')
  local args = {}
  for a in list:gmatch('[^,]+') do args[#args + 1] = a end
  local dir = out .. '/' .. name
  local res = train.main(recipe(model, { max_iters = iters, out_dir = dir }), args)
  if world.rank == 0 then
    write_result(dir .. '/result.json', res)
  end
end
print(('OK rank %d of %d'):format(world.rank, world.size))
