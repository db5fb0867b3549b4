-- Run on every rank by spec/dist_nccl_spec.lua (#cuda #sim): the simulated
-- NCCL's C API (spec/cudasim/nccl.h, exported by build/sim/libgptlua_mpi.so)
-- called directly through the FFI, below engine/mpi/nccl.c.  MPI comes up
-- through dist.init{backend = 'mpi'}; every rank needs its own simulated GPU
-- (GL_SIM_DEVICES = ranks).  arg 1:
--   api        argument checks and their messages, groups, NCCL's in-place
--              layouts, grouped send/recv of every pair at once, split,
--              destroy; prints "OK rank R of N"
--   recv_big   rank 1 receives fewer bytes than rank 0 sends: the receiver's
--              context stops with a message naming both sides
--   recv_small rank 1 receives more bytes than rank 0 sends: the same
--   abort FILE (GL_SIM_STREAMS=threads) rank 0 queues an all_reduce that
--              rank 1 joins only seconds later and aborts its communicator
--              while the all_reduce waits: ncclCommAbort returns, and the
--              stream is free again, before rank 1 joins (it creates FILE
--              as it does: the order, not a wall-clock bound, which a
--              loaded machine would stretch); prints "OK rank R of N"
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local cuda = require 'gptlua.cuda'
local ffi = gl.ffi

ffi.cdef [[
typedef struct ncclComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int *version);
const char *ncclGetErrorString(int result);
const char *ncclGetLastError(ncclComm_t comm);
int ncclGetUniqueId(ncclUniqueId *uniqueId);
int ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
int ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, void *config);
int ncclCommDestroy(ncclComm_t comm);
int ncclCommAbort(ncclComm_t comm);
int ncclCommGetAsyncError(ncclComm_t comm, int *asyncError);
int ncclCommCount(const ncclComm_t comm, int *count);
int ncclCommCuDevice(const ncclComm_t comm, int *device);
int ncclCommUserRank(const ncclComm_t comm, int *rank);
int ncclGroupStart(void);
int ncclGroupEnd(void);
int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, ncclComm_t comm, void *stream);
int ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, int datatype, int op, ncclComm_t comm, void *stream);
int ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype, ncclComm_t comm, void *stream);
int ncclSend(const void *sendbuff, size_t count, int datatype, int peer, ncclComm_t comm, void *stream);
int ncclRecv(void *recvbuff, size_t count, int datatype, int peer, ncclComm_t comm, void *stream);
]]
-- values of nccl.h
local SUCCESS, INVALID_ARGUMENT, INVALID_USAGE = 0, 4, 5
local FLOAT32, INT64, SUM, AVG = 7, 4, 0, 4

local mode = arg and arg[1] or 'api'
local world = dist.init { backend = 'mpi', timeout = 60 }
local R, N = world.rank, world.size
local DEV = dist.device()
local DEVN = cuda.ordinal(DEV)
local nccl = dist.backend_lib()
local STREAM = cuda.stream(DEVN, 'compute')   -- ordered with the kernels that fill the tensors

local function fail(msg) error(('rank %d: %s'):format(R, msg), 2) end
local function check(cond, msg) if not cond then fail(msg) end end
local function last() return ffi.string(nccl.ncclGetLastError(nil)) end
local function ok(rc, what) check(rc == SUCCESS, ('%s: %s: %s'):format(what, ffi.string(nccl.ncclGetErrorString(rc)), last())) end
-- rc is `want` and the last error contains `text`
local function refused(rc, want, text, what)
  check(rc == want, ('%s: returned %d, expected %d (%s)'):format(what, rc, want, last()))
  check(last():find(text, 1, true), ('%s: message %q lacks %q'):format(what, last(), text))
end

local SIZE = { float32 = 4, int64 = 8 }
-- the device address of element off of t
local function ptr(t, off) return ffi.cast('char *', gl.lib.gl_data_ptr(t.c)) + (off or 0) * SIZE[t.dtype] end
local function values(t) return t:to('cpu'):tolist() end
local function seq(n, f) local t = {} for i = 1, n do t[i] = f(i) end return t end

-- a communicator of the world's ranks (the id travels over MPI)
local function new_comm()
  local id = ffi.new('ncclUniqueId')
  if R == 0 then ok(nccl.ncclGetUniqueId(id), 'ncclGetUniqueId') end
  local bytes = gl.zeros({ 128 }, { dtype = 'uint8' })
  ffi.copy(gl.lib.gl_data_ptr(bytes.c), id, 128)
  world:broadcast(bytes, 0)
  ffi.copy(id, gl.lib.gl_data_ptr(bytes.c), 128)
  local out = ffi.new('ncclComm_t[1]')
  return out, id
end

if mode == 'api' then
  local v = ffi.new('int[1]')
  ok(nccl.ncclGetVersion(v), 'ncclGetVersion')
  check(v[0] == 21803, 'version ' .. v[0])
  check(ffi.string(nccl.ncclGetErrorString(INVALID_USAGE)) == 'invalid usage', 'error string')

  local out, id = new_comm()
  refused(nccl.ncclCommInitRank(out, N, id, N), INVALID_ARGUMENT, ('rank expected 0..%d, got %d'):format(N - 1, N), 'rank out of range')
  refused(nccl.ncclCommInitRank(out, N, ffi.new('ncclUniqueId'), R), INVALID_ARGUMENT,
    'commId was not made by ncclGetUniqueId', 'a zero id')
  ok(nccl.ncclCommInitRank(out, N, id, R), 'ncclCommInitRank')
  local c = out[0]
  ok(nccl.ncclCommCount(c, v), 'count'); check(v[0] == N, 'count ' .. v[0])
  ok(nccl.ncclCommUserRank(c, v), 'rank'); check(v[0] == R, 'rank ' .. v[0])
  ok(nccl.ncclCommCuDevice(c, v), 'device'); check(v[0] == DEVN, 'device ' .. v[0])

  -- argument checks (nothing is queued; no rank waits for another)
  local x = gl.full({ 8 }, R + 1, { device = DEV })
  local host = gl.zeros({ 8 })
  refused(nccl.ncclAllReduce(ptr(x), ptr(x), 8, FLOAT32, SUM, nil, STREAM), INVALID_ARGUMENT, 'ncclAllReduce: comm is NULL', 'NULL comm')
  refused(nccl.ncclAllReduce(ptr(x), ptr(x), 8, 12, SUM, c, STREAM), INVALID_ARGUMENT, 'datatype expected 0..9, got 12', 'bad type')
  refused(nccl.ncclAllReduce(ptr(x), ptr(x), 8, FLOAT32, 9, c, STREAM), INVALID_ARGUMENT, 'op expected', 'bad op')
  refused(nccl.ncclAllReduce(ptr(host), ptr(x), 8, FLOAT32, SUM, c, STREAM), INVALID_ARGUMENT, 'is not device memory', 'host memory')
  refused(nccl.ncclAllReduce(ptr(x), ptr(x), 9, FLOAT32, SUM, c, STREAM), INVALID_ARGUMENT,
    '+ 36 bytes leaves its', 'past the allocation')
  refused(nccl.ncclAllReduce(ptr(x), ptr(x, 1), 7, FLOAT32, SUM, c, STREAM), INVALID_ARGUMENT,
    'overlap but are not the in-place layout (sendbuff == recvbuff)', 'overlap')
  refused(nccl.ncclSend(ptr(x), 8, FLOAT32, N, c, STREAM), INVALID_ARGUMENT, ('peer expected 0..%d, got %d'):format(N - 1, N), 'bad peer')
  refused(nccl.ncclGroupEnd(), INVALID_USAGE, 'no group is open', 'ncclGroupEnd alone')
  ok(nccl.ncclGroupStart(), 'ncclGroupStart')
  refused(nccl.ncclSend(ptr(x), 8, FLOAT32, -1, c, STREAM), INVALID_ARGUMENT, 'peer expected', 'bad peer in a group')
  refused(nccl.ncclGroupEnd(), INVALID_ARGUMENT, 'nothing was started', 'the group of a failed call')

  -- NCCL's in-place layouts
  local g = gl.full({ 3 * N }, -1, { dtype = 'int64', device = DEV })
  g:narrow(1, 3 * R + 1, 3):fill_(R * 10)
  ok(nccl.ncclAllGather(ptr(g, 3 * R), ptr(g), 3, INT64, c, STREAM), 'ncclAllGather in place')
  check(table.concat(values(g), ',') == table.concat(seq(3 * N, function(i) return math.floor((i - 1) / 3) * 10 end), ','),
    'all_gather in place: ' .. table.concat(values(g), ','))
  local rs = gl.full({ 2 * N }, R + 1, { device = DEV })
  ok(nccl.ncclReduceScatter(ptr(rs), ptr(rs, 2 * R), 2, FLOAT32, AVG, c, STREAM), 'ncclReduceScatter in place')
  check(values(rs)[2 * R + 1] == (N + 1) / 2, 'reduce_scatter avg in place: ' .. values(rs)[2 * R + 1])

  -- every pair at once in one group, messages past MPI's eager size: a
  -- group starts its sends and receives together, so none waits for another
  local n = 50000
  local send = seq(N, function(q) return gl.full({ n }, R * 100 + q - 1, { device = DEV }) end)
  local recv = seq(N, function() return gl.zeros({ n }, { device = DEV }) end)
  ok(nccl.ncclGroupStart(), 'group')
  ok(nccl.ncclGroupStart(), 'nested group')
  for q = 0, N - 1 do
    ok(nccl.ncclSend(ptr(send[q + 1]), n, FLOAT32, q, c, STREAM), 'grouped send')
    ok(nccl.ncclRecv(ptr(recv[q + 1]), n, FLOAT32, q, c, STREAM), 'grouped recv')
  end
  ok(nccl.ncclGroupEnd(), 'inner ncclGroupEnd')
  ok(nccl.ncclGroupEnd(), 'ncclGroupEnd')
  for q = 0, N - 1 do
    local got = recv[q + 1]:narrow(1, n, 1):item()
    check(got == q * 100 + R, ('grouped recv from %d: %s'):format(q, got))
  end

  -- split by parity (key: reversed ranks), a rank left out
  local sub = ffi.new('ncclComm_t[1]')
  ok(nccl.ncclCommSplit(c, R % 2, -R, sub, nil), 'ncclCommSplit')
  local members, below = 0, 0
  for q = R % 2, N - 1, 2 do members = members + 1; if q > R then below = below + 1 end end
  ok(nccl.ncclCommCount(sub[0], v), 'split count'); check(v[0] == members, 'split count ' .. v[0])
  ok(nccl.ncclCommUserRank(sub[0], v), 'split rank'); check(v[0] == below, 'split rank ' .. v[0])
  local one = gl.full({ 1 }, R, { device = DEV })
  ok(nccl.ncclAllReduce(ptr(one), ptr(one), 1, FLOAT32, SUM, sub[0], STREAM), 'all_reduce on the split')
  local want = 0
  for q = R % 2, N - 1, 2 do want = want + q end
  check(one:item() == want, 'split all_reduce ' .. one:item())
  local none = ffi.new('ncclComm_t[1]')
  ok(nccl.ncclCommSplit(c, R == 0 and -1 or 0, 0, none, nil), 'split with NCCL_SPLIT_NOCOLOR')
  check((R == 0) == (none[0] == nil), 'NCCL_SPLIT_NOCOLOR gives NULL')
  if none[0] ~= nil then ok(nccl.ncclCommDestroy(none[0]), 'destroy') end
  ok(nccl.ncclCommDestroy(sub[0]), 'destroy the split')
  refused(nccl.ncclCommCount(sub[0], v), INVALID_ARGUMENT, 'is not a live communicator', 'a destroyed communicator')

  ok(nccl.ncclCommGetAsyncError(c, v), 'ncclCommGetAsyncError')
  check(v[0] == SUCCESS, 'no asynchronous error')
  ok(nccl.ncclCommDestroy(c), 'ncclCommDestroy')
elseif mode == 'recv_big' or mode == 'recv_small' then
  local out, id = new_comm()
  ok(nccl.ncclCommInitRank(out, N, id, R), 'ncclCommInitRank')
  local c = out[0]
  local n = mode == 'recv_big' and 3 or 5
  if R == 0 then
    local t = gl.full({ 4 }, 1, { device = DEV })
    ok(nccl.ncclSend(ptr(t), 4, FLOAT32, 1, c, STREAM), 'ncclSend')
    cuda.synchronize(DEVN)
  elseif R == 1 then
    local t = gl.zeros({ n }, { device = DEV })
    ok(nccl.ncclRecv(ptr(t), n, FLOAT32, 0, c, STREAM), 'ncclRecv')
    cuda.synchronize(DEVN)   -- the sticky error surfaces here
    io.write('unreachable\n')
  end
  world:barrier()
elseif mode == 'abort' then
  local now = require('gptlua.cli').now
  local joined = assert(arg[2], 'sim_nccl_api.lua abort: expected the path of the file rank 1 creates as it joins')
  local out, id = new_comm()
  ok(nccl.ncclCommInitRank(out, N, id, R), 'ncclCommInitRank')
  local c = out[0]
  local t = gl.full({ 1000 }, 1, { device = DEV })
  if R == 0 then
    -- queued, posted on the stream's thread, waiting for rank 1
    ok(nccl.ncclAllReduce(ptr(t), ptr(t), 1000, FLOAT32, SUM, c, STREAM), 'ncclAllReduce')
    os.execute('sleep 0.3')
    local t0 = now()
    ok(nccl.ncclCommAbort(c), 'ncclCommAbort')
    check(not io.open(joined), ('ncclCommAbort waited %.2f s, until rank 1 joined'):format(now() - t0))
    t0 = now()
    cuda.synchronize(DEVN)   -- the aborted work item gave the stream back
    check(not io.open(joined), ('the stream stayed blocked %.2f s after the abort, until rank 1 joined'):format(now() - t0))
    refused(nccl.ncclCommCount(c, ffi.new('int[1]')), INVALID_ARGUMENT, 'is not a live communicator', 'an aborted communicator')
  else
    -- joins late: rank 0's transfer, left in flight by the abort, still completes it
    os.execute('sleep 3')
    assert(io.open(joined, 'w')):close()
    ok(nccl.ncclAllReduce(ptr(t), ptr(t), 1000, FLOAT32, SUM, c, STREAM), 'ncclAllReduce')
    cuda.synchronize(DEVN)
    ok(nccl.ncclCommDestroy(c), 'ncclCommDestroy')
  end
else
  fail('unknown mode ' .. tostring(mode))
end

dist.finalize()
io.write(('OK rank %d of %d\n'):format(R, N))
