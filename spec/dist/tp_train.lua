-- Run on every rank by spec/dist_tp_spec.lua and spec/dist_pp_spec.lua
-- (through spec/support/dist_train.lua): trains the small float64 GPT of
-- tp_recipe() (gpt2 or nanochat with GQA, AdamW) with a fixed global batch,
-- so any mesh reads the same rows per step; the remaining arguments are
-- command-line overrides (--tp=2, --dp=2, --resume=PATH, ...).
-- Several runs may share one launch, separated by a lone '+': they run one
-- after another in this process, each with its own mesh, so the launch's
-- start-up (mpirun, MPI init, LuaJIT warm-up) is paid once.
-- args: OUT MODEL MAX_ITERS [overrides...] [+ OUT MODEL MAX_ITERS [overrides...]]...
-- Rank 0 writes OUT/result.json {losses, checkpoint} for each run; every rank
-- prints "OK rank R of N" once all runs are done.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local train = require 'gptlua.train'

local world = dist.init { backend = 'mpi', timeout = 120 }
local recipe = dofile(gl.root .. '/spec/dist/tp_recipe.lua')
local write_result = dofile(gl.root .. '/spec/dist/write_result.lua')

local runs, cur = {}, nil
for i = 1, #arg do
  if arg[i] == '+' then cur = nil
  elseif not cur then cur = { out = arg[i], args = {} }; runs[#runs + 1] = cur
  elseif not cur.model then cur.model = arg[i]
  elseif not cur.iters then cur.iters = tonumber(arg[i])
  else cur.args[#cur.args + 1] = arg[i] end
end

for _, run in ipairs(runs) do
  local res = train.main(recipe(run.model, { max_iters = run.iters, out_dir = run.out }), run.args)
  if world.rank == 0 then
    write_result(run.out .. '/result.json', res)
  end
end
print(('OK rank %d of %d'):format(world.rank, world.size))
