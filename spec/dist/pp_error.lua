-- Run on every rank by spec/dist_pp_spec.lua: a 2-stage gpt2 pipeline whose
-- stage 2 raises an error (arg "error") or its rank dies (arg "die") in its
-- forward of microbatch 2; every rank must end (no peer left blocked in a
-- receive), the error naming the stage.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local PP = require 'gptlua.dist.pipeline'

local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi', timeout = 60 }
local mesh = dist.mesh { pp = 2 }
gl.manual_seed(7)
local model = require('gptlua.models.gpt2').GPT({ vocab_size = 16, block_size = 8, n_layer = 2, n_head = 2,
  n_embd = 8 }):to('float64')
local pipe = PP.new(model, mesh.pp, { schedule = '1f1b', microbatches = 4, batch = { 1, 8 } })
pipe.on_action = function(at, a)
  if at == 'start' and a[1] == 'F' and a[2] == 2 and a[3] == 2 then
    if arg[1] == 'die' then os.exit(3) end
    error('injected failure')
  end
end
local x = gl.tensor({ { 1, 2, 3, 4, 5, 6, 7, 8 } }, { dtype = 'int64' })
pipe:step({ x, x, x, x }, { x, x, x, x })
print(('NOT REACHED rank %d'):format(world.rank))
