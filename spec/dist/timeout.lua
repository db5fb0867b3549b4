-- Run by spec/dist_spec.lua: the last rank never joins the second
-- all_reduce (it sleeps); the others must abort after the 2 s timeout,
-- naming the op, the group, the sequence number and the missing rank.
-- arg 1 'split': the same inside a sub-communicator whose ranks run in
-- reverse order (so group and world ranks differ in the message).
local gl = require 'gptlua'
local ffi = require 'ffi'
local dist = require 'gptlua.dist'
-- The 2 s apply from the second collective on: ranks start up to seconds
-- apart on a loaded machine, and the first all_reduce (under the default
-- timeout) lines them up, so only the sleeping rank can be missing.
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi' }
local group = world
if arg[1] == 'split' then group = world:split(0, -world.rank) end
local t = gl.full({ 10 }, 1)
group:all_reduce(t)
world:set_timeout(2); group:set_timeout(2)
if world.rank == world.size - 1 then
  ffi.cdef 'int poll(void *fds, unsigned long nfds, int timeout);'
  -- asleep in-process, so nothing outlives the abort; longer than the spec's
  -- time limit, so a sleeper the abort misses shows as that limit
  ffi.C.poll(nil, 0, 300000)
end
group:all_reduce(t)
print('unreachable: rank ' .. world.rank .. ' finished')
