-- gptlua.dist.work — the handle of a collective (Work: wait, test), and
-- what the host spends waiting: dist.wait_seconds (the straggler report's
-- wait time), dist.device_host_waits(), and the switches dist.device_waits
-- and dist._skip_device_waits.  install(dist) puts them on gptlua.dist's
-- table (their home, where callers read and set them) and returns Work and
-- completed(result), a Work already done; the backend library is
-- dist.backend_lib(), loaded by the first world of several ranks.
local G = require 'gptlua.ffi'
local monotonic = require('gptlua.libc').monotonic
local ffi = G.ffi

local M = {}

function M.install(dist)
  local Work = {}
  Work.__index = Work
  dist.Work = Work

  local function finish(self)
    if self.done then return end
    self.done = true
    if self.after then self.after() end
    self.keep, self.after = nil, nil    -- the tensors may go now
  end

  -- seconds the host has spent blocked in collectives' waits (gl_work_wait),
  -- summed over the process: the straggler report's wait time
  -- (gptlua.observe.stragglers).  NCCL's device-side waits block no host.
  dist.wait_seconds = 0
  local function host_wait(w, level)
    local t0 = monotonic()
    local rc = dist.backend_lib().gl_work_wait(w)
    dist.wait_seconds = dist.wait_seconds + (monotonic() - t0)
    G.check(rc, level + 1)
  end

  -- Returns the collective's result (the output tensor or list) once it can
  -- be used.  Over MPI (host memory) the host blocks until it completed.  Over
  -- NCCL (CUDA tensors) the device waits, not the host (the blocking form of
  -- a collective, without async, still waits on the host): the compute stream
  -- waits for the event the collective recorded on its own stream, so every
  -- kernel queued after this call sees the result and whatever compute was
  -- queued before it overlaps the collective; a host read of the result (a
  -- copy to the host) waits for the compute stream and so for the
  -- collective.  Either way a collective that does not complete within the
  -- communicator's timeout aborts every rank (see engine/gl_dist.h).
  function Work:wait()
    if not self.done then
      if self.w ~= nil and not self.device then
        host_wait(self.w, 2)
      elseif self.w ~= nil then
        if not dist.device_waits then  -- the host waits (as before; host_syncs.lua's 'host')
          host_wait(self.w, 2)
        elseif dist._skip_device_waits > 0 then  -- test hook: a missing wait (the stream check finds it)
          dist._skip_device_waits = dist._skip_device_waits - 1
        else
          G.check(dist.backend_lib().gl_work_wait_device(self.w), 2)
        end
        dist.backend_lib().gl_work_free(ffi.gc(self.w, nil))  -- watched by the library until its event passes
        self.w = nil
      end
      finish(self)
    end
    return self.result
  end

  -- false: Work:wait() of an NCCL collective blocks the host instead (to
  -- count what the device-side wait saves: recipes/tools/host_syncs.lua)
  dist.device_waits = true
  -- Test hook (spec/dist_overlap_spec.lua): the next n device-side waits are
  -- left out, as a missing cudaStreamWaitEvent would be.
  dist._skip_device_waits = 0

  -- host waits for NCCL collectives so far in this process (gl_work_wait on a
  -- work still running): 0 in a world without NCCL
  function dist.device_host_waits()
    local mpi = dist.backend_lib()
    return mpi and tonumber(mpi.gl_dist_device_host_waits()) or 0
  end

  -- true once complete (then the result is in place); never blocks.
  local done_buf = ffi.new('int[1]')
  function Work:test()
    if self.done then return true end
    if self.w == nil then  -- a fake world's: of one rank at once (as the local world's), else at wait()
      if self.eager then finish(self) end
      return self.done == true
    end
    G.check(dist.backend_lib().gl_work_test(self.w, done_buf), 2)
    if done_buf[0] ~= 0 then finish(self) end
    return self.done == true
  end

  local function completed(result)
    return setmetatable({ done = true, result = result }, Work)
  end

  return Work, completed, host_wait
end

return M
