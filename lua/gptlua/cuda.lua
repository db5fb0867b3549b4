-- gptlua.cuda — the CUDA runtime from Lua: devices and their properties,
-- synchronisation, the compute / communication streams, timing events,
-- memory statistics and pinned host buffers.
--
--   local cuda = require 'gptlua.cuda'
--   if cuda.is_available() then
--     print(cuda.get_device_properties(0).name)
--     local t0, t1 = cuda.Event(), cuda.Event()
--     t0:record(); work(); t1:record()
--     print(t0:elapsed_time(t1), 'ms')
--   end
--
-- Devices are given as 0, 1, ... or 'cuda', 'cuda:N' (nil means cuda:0).
-- On an engine built without CUDA, or a machine without a GPU, only
-- built / device_count / is_available answer; everything else raises a
-- clear error.  Memory statistics are the caching allocator's (the same
-- table as gl.memory_stats('cuda:N')).
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local ffi, lib, check, check_ptr = G.ffi, G.lib, G.check, G.check_ptr

local cuda = {}

cuda.COMPUTE = 0   -- the stream every kernel runs on
cuda.COMM = 1      -- the stream collectives run on (gptlua.dist)
cuda.COPY = 2      -- the stream copy_async transfers run on (the data loader)

function cuda.built() return lib.gl_cuda_built() == 1 end
function cuda.device_count() return tonumber(lib.gl_cuda_device_count()) end
function cuda.is_available() return cuda.device_count() > 0 end

-- the ordinal of dev (nil, a number, 'cuda' or 'cuda:N'); errors for 'cpu'
-- and when the engine has no CUDA
local function ordinal(dev, what)
  what = what or 'gptlua.cuda'
  if not cuda.built() then error(what .. ': this engine was built without CUDA', 3) end
  local id
  if dev == nil then id = 0
  elseif type(dev) == 'number' then id = dev
  else id = Tensor.device_id(dev, what) end
  if id < 0 or id ~= math.floor(id) then
    error(('%s: expected a CUDA device (N, "cuda" or "cuda:N"), got %s'):format(what, tostring(dev)), 3)
  end
  return id
end
cuda.ordinal = ordinal

local STREAMS = { compute = cuda.COMPUTE, comm = cuda.COMM, copy = cuda.COPY,
  [cuda.COMPUTE] = cuda.COMPUTE, [cuda.COMM] = cuda.COMM, [cuda.COPY] = cuda.COPY }
local function stream_kind(kind, what)
  if kind == nil then return cuda.COMPUTE end
  local k = STREAMS[kind]
  if k then return k end
  error(('%s: stream expected "compute", "comm" or "copy", got %s'):format(what, tostring(kind)), 3)
end

function cuda.set_device(dev) check(lib.gl_cuda_set_device(ordinal(dev, 'cuda.set_device')), 2) end

-- waits for every stream of dev; with no argument, of every device
function cuda.synchronize(dev)
  if dev == nil then
    if not cuda.built() then return end
    check(lib.gl_cuda_synchronize(-1), 2)
  else
    check(lib.gl_cuda_synchronize(ordinal(dev, 'cuda.synchronize')), 2)
  end
end

-- Raises the first failed id check (embedding, cross-entropy, gather /
-- scatter) queued on dev (nil: every device) since the last read, e.g.
-- "gl_embedding_forward: ids[3] is 70000, expected 0 <= ids < 65 (rows of
-- table)".  The checks run on the device without a host wait; a copy to the
-- host and cuda.synchronize read them too.  Call it where the host already
-- waits (after a loss read): it costs one small copy.  No-op without CUDA.
function cuda.check_flags(dev)
  if dev == nil then
    if not cuda.built() then return end
    check(lib.gl_cuda_check_flags(-1), 2)
  else
    check(lib.gl_cuda_check_flags(ordinal(dev, 'cuda.check_flags')), 2)
  end
end

function cuda.get_device_properties(dev)
  local p = ffi.new('gl_cuda_props')
  check(lib.gl_cuda_get_props(ordinal(dev, 'cuda.get_device_properties'), p), 2)
  return {
    name = ffi.string(p.name), major = p.major, minor = p.minor,
    multiprocessor_count = p.multiprocessor_count, max_threads_per_block = p.max_threads_per_block,
    warp_size = p.warp_size, clock_khz = p.clock_khz, memory_clock_khz = p.memory_clock_khz,
    memory_bus_width = p.memory_bus_width, total_memory = tonumber(p.total_memory),
    shared_memory_per_block_optin = tonumber(p.shared_memory_per_block_optin),
    l2_cache_size = tonumber(p.l2_cache_size),
  }
end
function cuda.get_device_name(dev) return cuda.get_device_properties(dev).name end

-- free and total device memory in bytes as the driver sees it
function cuda.mem_get_info(dev)
  local f, t = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')
  check(lib.gl_cuda_mem_info(ordinal(dev, 'cuda.mem_get_info'), f, t), 2)
  return tonumber(f[0]), tonumber(t[0])
end

-- ---------------------------------------------------------------- memory
function cuda.memory_stats(dev)
  local st = ffi.new('gl_mem_stats')
  check(lib.gl_mem_stats_get(ordinal(dev, 'cuda.memory_stats'), st), 2)
  return { allocated = tonumber(st.allocated), reserved = tonumber(st.reserved), peak = tonumber(st.peak),
           n_allocs = tonumber(st.n_allocs), n_frees = tonumber(st.n_frees),
           cache_hits = tonumber(st.cache_hits), n_live = tonumber(st.n_live) }
end
function cuda.memory_allocated(dev) return cuda.memory_stats(dev).allocated end
function cuda.max_memory_allocated(dev) return cuda.memory_stats(dev).peak end
function cuda.memory_reserved(dev) return cuda.memory_stats(dev).reserved end
function cuda.reset_peak_memory_stats(dev) check(lib.gl_mem_reset_peak(ordinal(dev, 'cuda.reset_peak_memory_stats')), 2) end
function cuda.empty_cache(dev) check(lib.gl_empty_cache(ordinal(dev, 'cuda.empty_cache')), 2) end

-- ---------------------------------------------------------------- streams
-- the cudaStream_t of (dev, 'compute' | 'comm') as a void* cdata (for FFI
-- callers such as the NCCL backend)
function cuda.stream(dev, kind)
  return check_ptr(lib.gl_cuda_stream(ordinal(dev, 'cuda.stream'), stream_kind(kind, 'cuda.stream')), 2)
end
function cuda.stream_synchronize(dev, kind)
  check(lib.gl_cuda_stream_synchronize(ordinal(dev, 'cuda.stream_synchronize'),
                                       stream_kind(kind, 'cuda.stream_synchronize')), 2)
end
-- stream `waiter` of dev waits (on the GPU) for work queued so far on `waited`
function cuda.stream_wait(dev, waiter, waited)
  check(lib.gl_cuda_stream_wait(ordinal(dev, 'cuda.stream_wait'), stream_kind(waiter, 'cuda.stream_wait'),
                                stream_kind(waited, 'cuda.stream_wait')), 2)
end

-- ---------------------------------------------------------------- events
local Event = {}
Event.__index = Event
Event.__name = 'cuda.Event'

-- cuda.Event(dev): a timing event on dev (default cuda:0)
function cuda.Event(dev)
  local id = ordinal(dev, 'cuda.Event')
  local e = check_ptr(lib.gl_cuda_event_create(id), 2)
  ffi.gc(e, lib.gl_cuda_event_destroy)
  return setmetatable({ e = e, device = id }, Event)
end
function Event:record(kind) check(lib.gl_cuda_event_record(self.e, stream_kind(kind, 'Event:record')), 2); return self end
function Event:synchronize() check(lib.gl_cuda_event_synchronize(self.e), 2); return self end
-- stream `kind` (default compute) waits on the GPU for what was recorded
-- before the event; the host does not wait
function Event:wait(kind) check(lib.gl_cuda_stream_wait_event(self.e, stream_kind(kind, 'Event:wait')), 2); return self end
-- true once everything recorded before the event has run
function Event:query()
  local r = lib.gl_cuda_event_query(self.e)
  check(r < 0 and r or 0, 2)
  return r == 1
end
-- milliseconds from this event to `later` (waits for `later`)
function Event:elapsed_time(later)
  local ms = ffi.new('double[1]')
  check(lib.gl_cuda_event_elapsed_ms(self.e, later.e, ms), 2)
  return ms[0]
end

-- Times fn on dev's compute stream: `warmup` untimed calls, then `iters`
-- timed ones between two events; returns milliseconds per call.
function cuda.time(fn, opts)
  opts = opts or {}
  local dev, iters, warmup = opts.device, opts.iters or 10, opts.warmup or 2
  for _ = 1, warmup do fn() end
  local t0, t1 = cuda.Event(dev), cuda.Event(dev)
  t0:record()
  for _ = 1, iters do fn() end
  t1:record()
  return t0:elapsed_time(t1) / iters
end

-- ---------------------------------------------------------------- graphs
-- cuda.graph(fn, dev): runs fn() with dev's compute stream captured (the
-- kernels, copies and sets it queues are recorded, not run) and returns a
-- cuda.Graph whose :replay() re-runs them with the same arguments on the
-- same memory, for the cost of one launch.  Tensors fn allocates (and frees)
-- belong to the graph's memory pool until g:free(); tensors made before
-- and used by fn are the graph's inputs and outputs: keep them alive, and
-- change inputs in place (copy_) before a replay.  What fn's host code
-- computes (shapes, Lua numbers) is frozen at capture.  A call the capture
-- cannot contain — the host reading the device (:item(), a synchronize) —
-- ends the capture: cuda.graph raises "cuda.graph: ... could not be
-- captured: <the op and call that broke it>".
local Graph = {}
Graph.__index = Graph
Graph.__name = 'cuda.Graph'

-- the device whose work cuda.graph is capturing now, or nil (code that
-- has a capturable form picks it: gptlua.dist.expert_parallel's exchange)
local capturing
function cuda.capturing() return capturing end

function cuda.graph(fn, dev)
  if type(fn) ~= 'function' then error('cuda.graph: fn expected a function, got ' .. type(fn), 2) end
  local id = ordinal(dev, 'cuda.graph')
  check(lib.gl_cuda_graph_begin(id), 2)
  -- no garbage collection while capturing: a finalizer that frees pinned
  -- host memory (a dropped tensor's cudaFreeHost) would end the capture
  local collecting = collectgarbage('isrunning')
  collectgarbage('stop')
  capturing = id
  local ok, err = xpcall(fn, function(e) return e end)
  capturing = nil
  local g = lib.gl_cuda_graph_end(id)  -- always: the stream leaves capture mode
  if collecting then collectgarbage('restart') end
  if not ok then
    if g ~= nil then lib.gl_cuda_graph_destroy(g) end
    error(('cuda.graph: the work on cuda:%d could not be captured: %s'):format(id, tostring(err)), 2)
  end
  if g == nil then
    error(('cuda.graph: the work on cuda:%d could not be captured: %s'):format(id, ffi.string(lib.gl_last_error())), 2)
  end
  ffi.gc(g, lib.gl_cuda_graph_destroy)
  return setmetatable({ g = g, device = id, nodes = tonumber(lib.gl_cuda_graph_nodes(g)),
                        pool_bytes = tonumber(lib.gl_cuda_graph_pool_bytes(g)) }, Graph)
end

-- queues the recorded work on the compute stream again (the host does not wait)
function Graph:replay()
  if not self.g then error('cuda.Graph:replay: the graph was freed', 2) end
  check(lib.gl_cuda_graph_launch(self.g), 2)
  return self
end

-- destroys the graph now: its memory pool returns to the caching allocator
function Graph:free()
  if self.g then
    ffi.gc(self.g, nil)
    lib.gl_cuda_graph_destroy(self.g)
    self.g = nil
  end
end

-- ---------------------------------------------------------------- async copies
-- Copies src into dst (same dtype and numel, contiguous; one side on a CUDA
-- device) on that device's copy stream, behind the work queued so far on
-- its compute stream.  From pinned host memory the host does not wait.  The
-- engine keeps both tensors alive until the copy has run.  Without `done`
-- the compute stream waits for the copy (dst is ready for what follows);
-- with a cuda.Event `done` it is recorded after the copy instead, and
-- done:wait() must come before dst is used on the compute stream.
function cuda.copy_async(dst, src, done)
  if not cuda.built() then error('cuda.copy_async: this engine was built without CUDA', 2) end
  if getmetatable(dst) ~= Tensor or getmetatable(src) ~= Tensor then
    error('cuda.copy_async: dst and src expected tensors', 2)
  end
  if done ~= nil and getmetatable(done) ~= Event then error('cuda.copy_async: done expected a cuda.Event', 2) end
  check(lib.gl_copy_async(dst.c, src.c, done and done.e or nil), 2)
  return dst
end

-- copies started by copy_async that still hold their tensors
function cuda.copy_async_pending()
  if not cuda.built() then return 0 end
  return tonumber(lib.gl_copy_async_pending())
end

-- ---------------------------------------------------------------- pinned host memory
-- A block of page-locked host memory.  Tensors made from it (buf:tensor)
-- are CPU tensors whose copies to and from the GPU run at full PCIe speed.
-- The buffer owns the memory: it is freed when the buffer is collected or
-- buf:free() is called, so keep the buffer alive as long as its tensors (and
-- any views of them) are in use; each tensor keeps a reference to it.
local HostBuffer = {}
HostBuffer.__index = HostBuffer
HostBuffer.__name = 'cuda.HostBuffer'

function cuda.HostBuffer(nbytes)
  if type(nbytes) ~= 'number' or nbytes < 0 or nbytes ~= math.floor(nbytes) then
    error('cuda.HostBuffer: nbytes expected a non-negative integer, got ' .. tostring(nbytes), 2)
  end
  if not cuda.built() then error('cuda.HostBuffer: this engine was built without CUDA', 2) end
  -- the pinned bytes are a refcounted storage: every tensor made from the
  -- buffer shares it, so the memory lives until the last of them is gone
  local dims = ffi.new('int64_t[1]', nbytes)
  local base = Tensor.wrap(lib.gl_empty_pinned(lib.GL_U8, 1, dims)):keep()
  return setmetatable({ base = base, nbytes = nbytes }, HostBuffer)
end

-- a tensor of shape/dtype over the start of the buffer (shares its memory)
function HostBuffer:tensor(shape, dtype)
  if not self.base then error('HostBuffer:tensor: the buffer was freed', 2) end
  local dt = Tensor.dtype_id(dtype or Tensor.get_default_dtype(), 'HostBuffer:tensor')
  local dims = ffi.new('int64_t[8]')
  for i, s in ipairs(shape) do dims[i - 1] = s end
  return Tensor.wrap(lib.gl_view_dtype(self.base.c, dt, #shape, dims, 0))
end

-- drops the buffer's reference; tensors made from it keep the memory alive
function HostBuffer:free()
  if self.base then self.base:free(); self.base = nil end
end

-- bytes of pinned host memory currently allocated
function cuda.pinned_bytes()
  if not cuda.built() then return 0 end
  return tonumber(lib.gl_cuda_pinned_bytes())
end

return cuda
