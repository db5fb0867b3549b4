-- Run by spec/dist_spec.lua: the last rank fails while the others block in
-- an all_reduce with the default 600 s timeout.  The job must end at once
-- with a non-zero status and the error shown.
--   no argument: a Lua error reaches the top level (gptlua exits with 1)
--   'on_error':  the rank reports through dist.on_error, as gptlua.cli's
--                error path does: every line prefixed, every rank aborted
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local world = dist.init { backend = os.getenv('GPTLUA_SPEC_BACKEND') or 'mpi' }
local t = gl.full({ 1000 }, 1)
world:all_reduce(t)
if world.rank == world.size - 1 then
  if arg[1] == 'on_error' then
    dist.on_error('deliberate failure on the last rank\nsecond line')
    print('unreachable: on_error returned')
  end
  error('deliberate failure on the last rank')
end
world:all_reduce(t)
print('unreachable: rank ' .. world.rank .. ' finished')
