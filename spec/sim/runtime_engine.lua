-- The engine's own CUDA runtime (kernels/runtime.cu) exercised the way the
-- library uses it: transfers, the caching allocator, pinned buffers,
-- copy_async with and without an event, timing events, stream waits, a
-- cuBLASLt product.  Used by spec/sim_runtime_spec.lua in-process and in a
-- GL_SIM_STREAMS=threads subprocess (spec/sim/run.lua rt engine).
-- Returns a function that raises an error on the first wrong value.
local gl = require 'gptlua'
local cuda = require 'gptlua.cuda'

local function same(a, b, what)
  local d = a:to('cpu'):max_abs_diff(b:to('cpu'))
  if d ~= 0 then error(('%s: max |difference| %g, expected 0'):format(what, d), 2) end
end

return function()
  local dev = 'cuda:0'
  -- transfers both ways, views, elementwise kernels
  local a = gl.randn({ 64, 33 }, { seed = 1 })
  local g = a:to(dev)
  same(g, a, 'round trip')
  same(g:t():contiguous():t(), a, 'transposed copy on the device')
  same(g * 2 + 1, a * 2 + 1, 'elementwise on the device')
  local z = gl.zeros({ 1000 }, { device = dev })
  same(z, gl.zeros({ 1000 }), 'zeros')
  -- the caching allocator hands the same blocks out again, step after step
  for step = 1, 5 do
    gl.scope(function()
      local t = gl.empty({ 256, 7 }, { device = dev }):fill_(step)
      same(t:sum(), gl.tensor({ 256 * 7 * step }):sum(), 'fill and sum, step ' .. step)
    end)
  end
  -- a cuBLASLt product against the CPU
  local b = gl.randn({ 33, 17 }, { seed = 2 })
  local d = gl.matmul(g, b:to(dev)):to('cpu'):max_abs_diff(gl.matmul(a, b))
  if d > 1e-4 then error(('matmul on the device differs from the CPU by %g'):format(d)) end
  -- pinned host memory and copy_async: host -> device with a done event
  local n = 4096
  local h = gl.empty_pinned({ n })
  h:copy_(gl.randn({ n }, { seed = 3 }))
  local dd = gl.empty({ n }, { device = dev })
  local ev = cuda.Event()
  cuda.copy_async(dd, h, ev)
  ev:wait('compute')
  same(dd * 3, h * 3, 'copy_async with an event, then compute')
  -- device -> pinned host, the compute stream waits for the copy
  local back = gl.empty_pinned({ n })
  cuda.copy_async(back, dd)
  cuda.synchronize(0)
  same(back, h, 'copy_async to pinned memory')
  -- copy_async from pageable memory (the host waits for the staging)
  local p = gl.randn({ n }, { seed = 4 })
  cuda.copy_async(dd, p)
  same(dd, p, 'copy_async from pageable memory')
  if cuda.copy_async_pending() < 0 then error('copy_async_pending negative') end
  -- timing events around work on the compute stream
  local t0, t1 = cuda.Event(), cuda.Event()
  t0:record()
  for _ = 1, 3 do g = g * 1 end
  t1:record()
  local ms = t0:elapsed_time(t1)
  if not (ms >= 0) then error('elapsed_time ' .. tostring(ms) .. ', expected >= 0') end
  if not t1:query() then error('an event synchronized by elapsed_time still pending') end
  -- explicit stream waits in both directions, work on the comm stream's side
  cuda.stream_wait(0, 'comm', 'compute')
  cuda.stream_wait(0, 'compute', 'comm')
  cuda.stream_synchronize(0, 'comm')
  local free, total = cuda.mem_get_info(0)
  if not (free > 0 and total >= free) then error(('mem_get_info %s of %s'):format(tostring(free), tostring(total))) end
  h:free(); back:free(); dd:free()
  cuda.synchronize()
  gl.empty_cache(dev)
end
