-- Run on 2 ranks by spec/dist_tcp_spec.lua: rank 1 receives into a tensor
-- of arg 1 elements what rank 0 sends as 4; a size that differs must be an
-- error naming both counts (as MPI's is), never a short or overrun result.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi', timeout = 10 }
if world.rank == 0 then world:send(gl.full({ 4 }, 1), 1)
else world:recv(gl.zeros({ tonumber(arg[1]) }), 0) end
print(('OK rank %d of %d'):format(world.rank, world.size))
