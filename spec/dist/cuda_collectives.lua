-- Run on every rank by spec/dist_nccl_spec.lua (#cuda): every collective on
-- CUDA tensors of this rank's GPU (dist.device()) against values computed
-- here.  arg 1 is the backend asked of dist.init: 'nccl' (CUDA tensors over
-- NCCL: a GPU per rank, or one rank), 'mpi' (over MPI through host memory:
-- ranks may share a GPU) or 'auto' (NCCL when every rank can use it).
-- Prints "OK rank R of N via ROUTE" at the end; a failed check raises, which
-- takes the whole job down.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local cuda = require 'gptlua.cuda'
local ffi = gl.ffi

local backend = arg and arg[1] or 'auto'
local world = dist.init { backend = backend, timeout = 120 }
local R, N = world.rank, world.size
local DEV = dist.device()

local function fail(msg) error(('rank %d: %s'):format(R, msg), 2) end
local function check(cond, msg) if not cond then fail(msg) end end

check(DEV == 'cuda:' .. (world.local_rank % cuda.device_count()), 'bound to GPU local_rank % devices, got ' .. DEV)
if backend == 'nccl' then check(world.nccl, "backend 'nccl' gives an NCCL world") end
if backend == 'mpi' then check(not world.nccl, "backend 'mpi' keeps CUDA tensors on MPI") end
local ROUTE = world.nccl and 'nccl' or 'mpi'

local function same(t, want, what)
  check(t.device == DEV, ('%s: result on %s, expected %s'):format(what, t.device, DEV))
  local got = t:to('cpu'):tolist()
  check(#got == #want, ('%s: %d values, expected %d'):format(what, #got, #want))
  for i = 1, #want do
    if got[i] ~= want[i] then
      fail(('%s: element %d is %s, expected %s'):format(what, i, tostring(got[i]), tostring(want[i])))
    end
  end
end

local function on(list, dtype) return gl.tensor(list, { dtype = dtype, device = DEV }) end
local function zeros(shape, dtype) return gl.zeros(shape, { dtype = dtype, device = DEV }) end
local function full(shape, v, dtype) return gl.full(shape, v, { dtype = dtype, device = DEV }) end
local function seq(n, f) local t = {} for i = 1, n do t[i] = f(i) end return t end
local function v(r, i) return (r + 1) * ((i - 1) % 5 + 1) end   -- small integers: exact in every dtype

-- a group split off before any CUDA collective makes its own NCCL
-- communicator on first use (a unique id of its own)
local early = world:split(0, -R)
check(early.nccl == world.nccl, 'a split inherits the NCCL choice')
do
  local t = full({ 3 }, R + 1)
  early:all_reduce(t, 'sum')
  same(t, { N * (N + 1) / 2, N * (N + 1) / 2, N * (N + 1) / 2 }, 'all_reduce on an early split')
end

local DTYPES = { 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64' }
local FLOATING = gl.Tensor.FLOATING

-- all_reduce in every dtype and op
for _, dt in ipairs(DTYPES) do
  for _, n in ipairs({ 1, 7, 65537 }) do
    local ops = { 'sum', 'max', 'min' }
    if FLOATING[dt] then ops[#ops + 1] = 'avg' end
    for _, op in ipairs(ops) do
      local t = on(seq(n, function(i) return v(R, i) end), dt)
      check(world:route(t, t) == ROUTE, 'route of a CUDA tensor: ' .. world:route(t, t))
      check(world:all_reduce(t, op) == t, 'all_reduce returns its tensor')
      local k = N * (N + 1) / 2
      same(t, seq(n, function(i)
        local base = (i - 1) % 5 + 1
        if op == 'sum' then return k * base elseif op == 'max' then return N * base
        elseif op == 'min' then return base else return k / N * base end
      end), ('all_reduce %s %s n=%d'):format(dt, op, n))
    end
  end
end
check(not world.nccl or world._nccl_c ~= nil, 'the first CUDA collective made the NCCL communicator')

-- a transposed tensor is staged on the device and written back in its layout
do
  local base = on(seq(12, function(i) return i + 100 * R end), 'float32'):view(3, 4)
  world:all_reduce(base:transpose(1, 2), 'sum')
  same(base, seq(12, function(i) return N * i + 100 * N * (N - 1) / 2 end), 'all_reduce strided')
end

for root = 0, N - 1 do
  for _, dt in ipairs({ 'float32', 'bfloat16', 'int64' }) do
    local t = on(seq(7, function(i) return v(R, i) end), dt)
    world:broadcast(t, root)
    same(t, seq(7, function(i) return v(root, i) end), 'broadcast ' .. dt .. ' root ' .. root)
    local u = on(seq(7, function(i) return v(R, i) end), dt)
    world:reduce(u, root, 'max')
    same(u, seq(7, function(i) return v(R == root and N - 1 or R, i) end), 'reduce max ' .. dt .. ' root ' .. root)
  end
end

-- all_gather: even, uneven counts (rank 0 sends nothing), a list, and a
-- shard viewed inside the gathered buffer
do
  local n = 5
  local out = zeros({ N * n }, 'int32')
  world:all_gather(out, on(seq(n, function(i) return v(R, i) end), 'int32'))
  same(out, seq(N * n, function(j) local r = math.floor((j - 1) / n); return v(r, j - r * n) end), 'all_gather')
  local counts = seq(N, function(r) return (r - 1) * 2 end)
  local total = 0
  for _, c in ipairs(counts) do total = total + c end
  if total > 0 then
    local uneven = zeros({ total })
    world:all_gather(uneven, full({ counts[R + 1] }, R + 1), { counts = counts })
    local want = {}
    for r = 0, N - 1 do for _ = 1, counts[r + 1] do want[#want + 1] = r + 1 end end
    same(uneven, want, 'all_gather uneven counts')
  end
  local list = seq(N, function(r) return zeros({ r, 2 }, 'int64') end)
  world:all_gather(list, full({ R + 1, 2 }, R, 'int64'))
  for r = 1, N do same(list[r], seq(2 * r, function() return r - 1 end), 'all_gather list ' .. r) end
  local whole = zeros({ N * 3 }, 'float64')
  local shard = whole:narrow(1, R * 3 + 1, 3)
  shard:fill_(R + 0.5)
  world:all_gather(whole, shard)
  same(whole, seq(N * 3, function(j) return math.floor((j - 1) / 3) + 0.5 end), 'all_gather shard inside out')
end

-- reduce_scatter: even, uneven (avg, a zero count), a list
do
  local n = 4
  local out = zeros({ n }, 'bfloat16')
  world:reduce_scatter(out, on(seq(N * n, function(j) return v(R, j) end), 'bfloat16'), 'sum')
  same(out, seq(n, function(i) return N * (N + 1) / 2 * ((R * n + i - 1) % 5 + 1) end), 'reduce_scatter')
  local counts = seq(N, function(r) return r == 2 and 0 or r + 2 end)
  local total = 0
  for _, c in ipairs(counts) do total = total + c end
  local mine = zeros({ counts[R + 1] })
  world:reduce_scatter(mine, full({ total }, R + 1), 'avg', { counts = counts })
  same(mine, seq(counts[R + 1], function() return (N + 1) / 2 end), 'reduce_scatter avg uneven')
  local got = zeros({ R + 1 }, 'int32')
  world:reduce_scatter(got, seq(N, function(r) return full({ r, 1 }, r * 10 + R, 'int32') end), 'sum')
  same(got, seq(R + 1, function() return N * (R + 1) * 10 + N * (N - 1) / 2 end), 'reduce_scatter list')
end

-- gather and scatter from every root, even and as lists of different sizes
for root = 0, N - 1 do
  local out = R == root and zeros({ N, 3 }, 'float16') or nil
  world:gather(out, full({ 3 }, R + 1, 'float16'), root)
  if R == root then same(out, seq(3 * N, function(j) return math.floor((j - 1) / 3) + 1 end), 'gather root ' .. root) end
  local outs = R == root and seq(N, function(r) return zeros({ r }) end) or nil
  world:gather(outs, full({ R + 1 }, R * 2), root)
  if R == root then for r = 1, N do same(outs[r], seq(r, function() return (r - 1) * 2 end), 'gather list') end end
  local rec = zeros({ 2 }, 'int64')
  world:scatter(rec, R == root and gl.arange(2 * N, { dtype = 'int64' }):to(DEV) or nil, root)
  same(rec, { 2 * R, 2 * R + 1 }, 'scatter root ' .. root)
  local mine = zeros({ R + 1 })
  world:scatter(mine, R == root and seq(N, function(r) return full({ r }, r * 3 + root) end) or nil, root)
  same(mine, seq(R + 1, function() return (R + 1) * 3 + root end), 'scatter list root ' .. root)
end

-- all_to_all: even, then chunk sizes depending on both ranks
do
  local out = zeros({ 2 * N }, 'float64')
  world:all_to_all(out, on(seq(2 * N, function(j) return R * 100 + j end), 'float64'))
  same(out, seq(2 * N, function(j) local r = math.floor((j - 1) / 2); return r * 100 + R * 2 + (j - 1) % 2 + 1 end),
    'all_to_all')
  local recvs = seq(N, function(s) return zeros({ s + R }) end)
  world:all_to_all(recvs, seq(N, function(d) return full({ R + d }, R * 10 + d - 1) end))
  for s = 1, N do same(recvs[s], seq(s + R, function() return (s - 1) * 10 + R end), 'all_to_all list ' .. s) end
  -- one flat tensor with per-peer counts, some zero (expert parallelism's
  -- exchange): rank a sends rank b (a + b) % 3 elements, each a * 10 + b
  local function n(a, b) return (a + b) % 3 end
  local sc, rc, vals, want = {}, {}, {}, {}
  for d = 0, N - 1 do
    sc[d + 1], rc[d + 1] = n(R, d), n(d, R)
    for _ = 1, n(R, d) do vals[#vals + 1] = R * 10 + d end
    for _ = 1, n(d, R) do want[#want + 1] = d * 10 + R end
  end
  if #vals > 0 and #want > 0 then
    local got = zeros({ #want }, 'float64')
    world:all_to_all(got, on(vals, 'float64'), { send_counts = sc, recv_counts = rc })
    same(got, want, 'all_to_all with counts, zeros among them')
  end
end

-- send / recv around a ring, both async
if N > 1 then
  local nxt, prv = (R + 1) % N, (R - 1) % N
  local into = zeros({ 3, 3 }, 'int32')
  local hs = world:send_async(on(seq(9, function(i) return R * 1000 + i end), 'int32'), nxt)
  local hr = world:recv_async(into, prv)
  hr:wait(); hs:wait()
  same(into, seq(9, function(i) return prv * 1000 + i end), 'ring send/recv')
end

world:barrier()

-- several in flight, waited in reverse; the handles keep their tensors alive
do
  local hs = {}
  for k = 1, 6 do
    hs[k] = world:all_reduce_async(full({ 1000 * k }, R + k), 'sum')
    collectgarbage('collect')
  end
  for k = 6, 1, -1 do
    check(type(hs[k]:test()) == 'boolean', 'test() answers a boolean')
    same(hs[k]:wait(), seq(1000 * k, function() return N * k + N * (N - 1) / 2 end), 'async all_reduce ' .. k)
    check(hs[k]:test(), 'test() after wait')
  end
end

-- kernels queued on the compute stream before a collective are its input,
-- and its result is what kernels queued after it read
do
  local t = full({ 2 ^ 20 }, 1)
  for _ = 1, 4 do t:mul_(2) end                 -- 16, queued
  world:all_reduce(t, 'sum')
  local u = t * 2                                -- reads the reduced values
  same(u:narrow(1, 1, 3), { 32 * N, 32 * N, 32 * N }, 'ordered against the compute stream')
end

-- CPU tensors of the same world still travel over MPI, mixed devices too
do
  local c = gl.full({ 4 }, R + 1)
  check(world:route(c, c) == 'mpi', 'CPU tensors go over MPI')
  world:all_reduce(c, 'sum')
  check(c.device == 'cpu', 'a CPU result stays on the CPU')
  for _, x in ipairs(c:tolist()) do check(x == N * (N + 1) / 2, 'CPU all_reduce in a GPU world') end
  local out = zeros({ N })
  check(world:route(gl.full({ 1 }, R), out) == 'mpi', 'mixed devices go over MPI')
  world:all_gather(out, gl.full({ 1 }, R))
  same(out, seq(N, function(j) return j - 1 end), 'all_gather from the CPU into a GPU tensor')
end

-- the NCCL communicator itself takes a CPU tensor (the C API must not
-- crash on one): staged through the device and copied back
if world.nccl then
  local mpi = dist.backend_lib()
  local t = gl.full({ 5 }, R + 1, { dtype = 'float64' })
  local a = ffi.new('gl_coll_args')
  a.coll, a.op, a.send, a.recv = 0, 0, t.c, t.c
  local w = mpi.gl_comm_start(world:_nccl_comm(), a)
  check(w ~= nil, 'gl_comm_start on the NCCL communicator: ' .. ffi.string(gl.lib.gl_last_error()))
  check(mpi.gl_work_wait(w) == 0, 'waiting: ' .. ffi.string(gl.lib.gl_last_error()))
  mpi.gl_work_free(w)
  for _, x in ipairs(t:tolist()) do check(x == N * (N + 1) / 2, 'a CPU tensor on the NCCL communicator') end
  if cuda.device_count() > 1 then
    local other = gl.zeros({ 2 }, { device = 'cuda:' .. ((world.local_rank + 1) % cuda.device_count()) })
    local ok, err = pcall(world.all_reduce, world, other)
    check(not ok and tostring(err):find('but NCCL communicator', 1, true), 'a tensor of another GPU: ' .. tostring(err))
  end
end

-- sub-communicators after the world's NCCL communicator exists (NCCL:
-- ncclCommSplit), by parity, with a rank left out, nested
do
  local par = world:split(R % 2)
  check(par.nccl == world.nccl and (not world.nccl or par._nccl_c ~= nil), 'the split carries an NCCL communicator')
  local s = 0
  for r = R % 2, N - 1, 2 do s = s + r end
  local t = full({ 4 }, R)
  par:all_reduce(t, 'sum')
  same(t, { s, s, s, s }, 'all_reduce on the parity group')
  local some = world:split(R == 0 and -1 or 1)
  check((R == 0) == (some == nil), 'color < 0 gives nil')
  if some then
    local inner = some:split(0)
    local x = full({ 1 }, 1)
    inner:all_reduce(x)
    same(x, { N - 1 }, 'nested split')
    inner:set_timeout(30)
  end
  local g = full({ 1 }, 1)
  world:all_reduce(g)
  same(g, { N }, 'world after splits')
end

-- a dropped, unfinished handle completes in the background; finalize waits
local kept = full({ 50000 }, 1)
world:all_reduce_async(kept, 'sum')
collectgarbage('collect')
dist.finalize()
same(kept, seq(50000, function() return N end), 'detached all_reduce completed by finalize')

io.write(('OK rank %d of %d via %s\n'):format(R, N, ROUTE))
