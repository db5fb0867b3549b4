-- Run by spec/dist_spec.lua: the last rank raises a Lua error while the
-- others block in an all_reduce with the default 600 s timeout.  The job
-- must end at once with a non-zero status and the error shown.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local world = dist.init { backend = 'mpi' }
local t = gl.full({ 1000 }, 1)
world:all_reduce(t)
if world.rank == world.size - 1 then error('deliberate failure on the last rank') end
world:all_reduce(t)
print('unreachable: rank ' .. world.rank .. ' finished')
