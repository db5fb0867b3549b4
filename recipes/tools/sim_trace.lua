-- recipes/tools/sim_trace.lua — reads the CUDA simulator's stream trace
-- (spec/cudasim/trace.cpp) from Lua: start / stop / mark, the records, and a
-- summary of what a training step did with its streams (host syncs between
-- marks, where the NCCL calls ran, whether later compute was ordered after
-- them, the compute stream's waits on other streams; host syncs of one
-- call, syncs_of).  Loaded with dofile by recipes/tools/host_syncs.lua,
-- recipes/tools/graph_overhead.lua and the specs that count waits.
local gl = require 'gptlua'
local ffi = gl.ffi

local M = {}
M.KINDS = { [0] = 'work', 'wait', 'sync', 'query', 'mark' }

if not pcall(ffi.typeof, 'gl_sim_trace_rec') then ffi.cdef [[
typedef struct { int32_t kind, device, stream, other; int64_t seq; const char *what; } gl_sim_trace_rec;
void gl_sim_trace_start(void);
void gl_sim_trace_stop(void);
void gl_sim_trace_mark(const char *what);
int64_t gl_sim_trace_count(void);
int gl_sim_trace_get(int64_t i, gl_sim_trace_rec *out);
int gl_sim_trace_after(int64_t i, int64_t j);
int gl_sim_trace_stream_id(void *stream);
]] end

-- the library when it is the simulator, else nil and why
function M.library()
  local ok = pcall(function() return gl.lib.gl_sim_trace_count end)
  if not ok then return nil, 'this engine is not the CUDA simulator' end
  return gl.lib
end

function M.start() gl.lib.gl_sim_trace_start() end
function M.stop() gl.lib.gl_sim_trace_stop() end
function M.mark(what) if M.library() then gl.lib.gl_sim_trace_mark(what) end end

-- { {i, kind, device, stream, other, seq, what} ... } in record order (i is
-- the C index, 0-based)
function M.records()
  local lib, r, out = gl.lib, ffi.new('gl_sim_trace_rec'), {}
  local n = tonumber(lib.gl_sim_trace_count())
  for i = 0, n - 1 do
    assert(lib.gl_sim_trace_get(i, r) == 0)
    out[#out + 1] = { i = i, kind = M.KINDS[r.kind], device = r.device, stream = r.stream, other = r.other,
      seq = tonumber(r.seq), what = r.what ~= nil and ffi.string(r.what) or '' }
  end
  return out
end

local function is_collective(r) return r.kind == 'work' and r.what:find('^nccl') ~= nil end

-- What the records did, `compute` being the trace id of the compute stream:
--   window[mark] = { syncs, sync_kinds = {api -> n}, queries } from each mark
--     to the next (the last to the end)
--   sync_kinds: all host syncs of the trace by API
--   collectives: NCCL work items; collectives_on_compute: those queued on
--     the compute stream
--   after_input: collectives ordered after the compute item queued last
--     before them (their input was ready: the start's event)
--   overlapped: collectives that some compute item queued after them is not
--     ordered after (on a GPU the two run at the same time)
--   device_waits: cudaStreamWaitEvent of the compute stream on a stream
--     that ran NCCL calls
function M.summary(recs, compute)
  local lib = gl.lib
  local s = { window = {}, sync_kinds = {}, collectives = 0, collectives_on_compute = 0, after_input = 0,
    overlapped = 0, device_waits = 0 }
  local cur = nil
  local last_compute = nil
  local comm_streams = {}
  for _, r in ipairs(recs) do if is_collective(r) then comm_streams[r.stream] = true end end
  for k, r in ipairs(recs) do
    if r.kind == 'mark' then
      cur = { syncs = 0, sync_kinds = {}, queries = 0 }
      s.window[r.what] = cur
    elseif r.kind == 'sync' then
      s.sync_kinds[r.what] = (s.sync_kinds[r.what] or 0) + 1
      if cur then cur.syncs = cur.syncs + 1; cur.sync_kinds[r.what] = (cur.sync_kinds[r.what] or 0) + 1 end
    elseif r.kind == 'query' then
      if cur then cur.queries = cur.queries + 1 end
    elseif r.kind == 'wait' then
      if r.stream == compute and comm_streams[r.other] then s.device_waits = s.device_waits + 1 end
    elseif is_collective(r) then
      s.collectives = s.collectives + 1
      if r.stream == compute then s.collectives_on_compute = s.collectives_on_compute + 1 end
      if last_compute and lib.gl_sim_trace_after(last_compute.i, r.i) == 1 then s.after_input = s.after_input + 1 end
      for j = k + 1, #recs do
        local q = recs[j]
        if q.kind == 'work' and q.stream == compute and lib.gl_sim_trace_after(r.i, q.i) == 0 then
          s.overlapped = s.overlapped + 1
          break
        end
      end
    elseif r.kind == 'work' and r.stream == compute then
      last_compute = r
    end
  end
  return s
end

-- host syncs of one call of fn: their number and "API n, ..." by API, or
-- nil when this engine is not the simulator (fn still runs)
function M.syncs_of(fn)
  if not M.library() then fn(); return nil end
  M.start(); fn(); M.stop()
  local kinds, n = {}, 0
  for api, k in pairs(M.summary(M.records(), -1).sync_kinds) do kinds[#kinds + 1] = api .. ' ' .. k; n = n + k end
  table.sort(kinds)
  return n, table.concat(kinds, ', ')
end

-- the work one call of fn launched, by name ('NAME<...>' for a kernel,
-- 'cublasLt ...', 'cudaMemcpy ...'), or nil when this engine is not the
-- simulator (fn still runs)
function M.launched(fn)
  if not M.library() then fn(); return nil end
  M.start(); fn(); M.stop()
  local names = {}
  for _, r in ipairs(M.records()) do
    if r.kind == 'work' then names[#names + 1] = r.what:gsub('^kernel ', '') end
  end
  return names
end

-- how many of names match the Lua pattern pat
function M.count(names, pat)
  local n = 0
  for _, s in ipairs(names) do if s:find(pat) then n = n + 1 end end
  return n
end

return M
