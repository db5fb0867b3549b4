-- Run by spec/dist_spec.lua: ranks finish at different times without
-- calling dist.finalize; exiting with status 0 must finalise MPI (mpirun
-- reports a rank that exits without finalising as a failure).
local gl = require 'gptlua'
local ffi = require 'ffi'
local dist = require 'gptlua.dist'
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi' }
local t = gl.full({ 4 }, 1)
world:all_reduce_async(t)        -- dropped unfinished: completed at exit
local sub = world:split(0)       -- still alive at exit
if world.rank == 0 then
  ffi.cdef 'int poll(void *fds, unsigned long nfds, int timeout);'
  ffi.C.poll(nil, 0, 300)
end
dist.print0('rank 0 done, sub-communicator of ' .. sub.size)
