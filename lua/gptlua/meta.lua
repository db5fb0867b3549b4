-- gptlua.meta — the meta device: run code on tensors that have a shape, a
-- dtype and a storage size but no data (engine/alloc.c, gl_core.h).
--
--   local meta = require 'gptlua.meta'          -- also gl.meta
--   local peak = meta.run(function()
--     local t = train.new(recipe)               -- the real code, unchanged
--     t:train_step()
--     return gl.memory_stats().peak             -- the allocator's, as planned
--   end, { reads = 'zeros' })
--
-- While fn runs, every storage the process makes is a meta storage: the
-- allocator charges its size class to the device's meta twin (the same
-- classes and caching as the CPU or CUDA allocator, so memory_stats reads
-- what the real run's would), and the engine's ops validate and allocate
-- exactly as they do for real but run no kernel.  Lua code (views,
-- autograd, scopes, releases, the optimizers, the policies) runs as it is.
-- Reading a meta tensor's values (item, tolist, get, printing, data_ptr,
-- copy to the host, save) is an error naming it; with reads = 'zeros' the
-- numbers read are 0 instead (the planner: the trainer reads its loss and
-- gradient norm).  meta.paused(fn) makes real tensors again inside a plan,
-- still counted in it: host values a run needs (its dataset).
local G = require 'gptlua.ffi'
local lib = G.lib

local M = {}

local MODES = { error = lib.GL_META_ON, zeros = lib.GL_META_ZEROS }

-- whether t is a meta tensor
function M.is_meta(t) local s = t.c.storage; return s ~= nil and s.meta == 1 end
-- whether a plan runs now (meta storages, no kernels)
function M.active() return lib.gl_meta_active() ~= 0 end

-- Forgets the twins of the devices a plan uses: statistics from zero, an
-- empty cache.  The previous plan's tensors must be gone (the GC is run).
local function reset(devices)
  jit.flush()  -- (compiled traces can hold the previous plan's tensors as constants)
  for _ = 1, 3 do collectgarbage('collect') end
  for _, d in ipairs(devices) do G.check(lib.gl_meta_reset(d), 3) end
end

-- run(fn, {reads = 'error'|'zeros', devices = {'cpu', 'cuda:0'}, keep =
-- false}): fn's results, run on the meta device from an empty allocator
-- (devices: whose twins start from zero; default cpu).  The mode is
-- restored however fn ends; an error in fn is raised again.
function M.run(fn, opts)
  opts = opts or {}
  local mode = MODES[opts.reads or 'error']
  if not mode then error(("meta.run: reads expected 'error' or 'zeros', got %s"):format(tostring(opts.reads)), 2) end
  local Tensor = require 'gptlua.tensor'
  local devs = {}
  for i, d in ipairs(opts.devices or { 'cpu' }) do devs[i] = Tensor.device_id(d, 'meta.run: devices') end
  if lib.gl_meta_mode() ~= 0 then error('meta.run: already planning (plans do not nest)', 2) end
  reset(devs)
  lib.gl_meta_set(mode)
  local res = { pcall(fn) }
  lib.gl_meta_set(lib.GL_META_OFF)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

-- paused(fn, ...): fn's results, its tensors real (and still charged to
-- the plan); outside a plan, simply fn(...)
function M.paused(fn, ...)
  local was = lib.gl_meta_pause(1)
  local res = { pcall(fn, ...) }
  lib.gl_meta_pause(was)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

return M
