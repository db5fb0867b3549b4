-- Run by spec/dist_spec.lua: the last rank never joins the second
-- all_reduce (it sleeps); the others must abort after the 2 s timeout,
-- naming the op, the group, the sequence number and the missing rank.
local gl = require 'gptlua'
local ffi = require 'ffi'
local dist = require 'gptlua.dist'
local world = dist.init { backend = 'mpi', timeout = 2 }
local t = gl.full({ 10 }, 1)
world:all_reduce(t)
if world.rank == world.size - 1 then
  ffi.cdef 'int poll(void *fds, unsigned long nfds, int timeout);'
  ffi.C.poll(nil, 0, 60000)   -- asleep in-process, so nothing outlives the abort
end
world:all_reduce(t)
print('unreachable: rank ' .. world.rank .. ' finished')
