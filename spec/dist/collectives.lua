-- Run on every rank by spec/dist_spec.lua (2 and 3 ranks): checks each
-- collective against values computed here, in every dtype, with even and
-- uneven sizes, list forms, strided tensors, async handles and
-- sub-communicators.  Prints "OK rank R of N" at the end; any failed check
-- raises, which takes the whole job down (non-zero exit).
local gl = require 'gptlua'
local dist = require 'gptlua.dist'

-- arg 1: 'mpi' (default), 'gloo' (started by gptlua -n N --launcher=tcp:
-- the TCP rendezvous, no MPI loaded) or 'auto' (a world of one without a
-- launcher: the Lua copies, and no MPI loaded)
local backend = arg and arg[1] or 'mpi'
local world = dist.init { backend = backend, timeout = 60 }
local R, N = world.rank, world.size

local function fail(msg) error(('rank %d: %s'):format(R, msg), 2) end
local function check(cond, msg) if not cond then fail(msg) end end

-- t's values (row-major) equal the list want
local function same(t, want, what)
  local got = t:tolist()
  check(#got == #want, ('%s: %d values, expected %d'):format(what, #got, #want))
  for i = 1, #want do
    if got[i] ~= want[i] then
      fail(('%s: element %d is %s, expected %s'):format(what, i, tostring(got[i]), tostring(want[i])))
    end
  end
end

local function tensor_of(list, dtype) return gl.tensor(list, { dtype = dtype }) end
local function seq(n, f) local t = {} for i = 1, n do t[i] = f(i) end return t end

-- value of element i on rank r: small integers, exact in every dtype
local function v(r, i) return (r + 1) * ((i - 1) % 5 + 1) end

local DTYPES = { 'float32', 'float64', 'bfloat16', 'int32', 'int64' }
local SIZES = { 1, 7, 1000, 65537 }

-- all_reduce: sum, max, min and avg (floats), in place
for _, dt in ipairs(DTYPES) do
  for _, n in ipairs(SIZES) do
    local ops = { 'sum', 'max', 'min' }
    if gl.Tensor.FLOATING[dt] then ops[#ops + 1] = 'avg' end
    for _, op in ipairs(ops) do
      local t = tensor_of(seq(n, function(i) return v(R, i) end), dt)
      local ret = world:all_reduce(t, op)
      check(ret == t, 'all_reduce returns its tensor')
      local k = N * (N + 1) / 2
      same(t, seq(n, function(i)
        local base = (i - 1) % 5 + 1
        if op == 'sum' then return k * base elseif op == 'max' then return N * base
        elseif op == 'min' then return base else return k / N * base end
      end), ('all_reduce %s %s n=%d'):format(dt, op, n))
    end
  end
end

-- bfloat16 sums accumulate in float32: 256 + 1 + 1 is 258 (bf16 steps of
-- 2 there), while adding in bf16 would round 257 back to 256 first
if N >= 3 then
  local t = tensor_of({ R == 0 and 256 or (R <= 2 and 1 or 0) }, 'bfloat16')
  world:all_reduce(t, 'sum')
  same(t, { 258 }, 'bfloat16 sum in float32')
end

-- a strided (transposed) tensor is staged and written back in its layout
do
  local base = gl.tensor(seq(12, function(i) return i + 100 * R end), { dtype = 'float32' }):view(3, 4)
  local tt = base:transpose(1, 2)
  world:all_reduce(tt, 'sum')
  same(base, seq(12, function(i) return N * i + 100 * N * (N - 1) / 2 end), 'all_reduce strided')
end

-- broadcast from every root, reduce to every root
for root = 0, N - 1 do
  for _, dt in ipairs(DTYPES) do
    local t = tensor_of(seq(7, function(i) return v(R, i) end), dt)
    world:broadcast(t, root)
    same(t, seq(7, function(i) return v(root, i) end), 'broadcast ' .. dt .. ' root ' .. root)
    local u = tensor_of(seq(7, function(i) return v(R, i) end), dt)
    world:reduce(u, root, 'max')
    same(u, seq(7, function(i) return v(R == root and N - 1 or R, i) end), 'reduce max ' .. dt .. ' root ' .. root)
  end
end

-- all_gather: even, uneven counts, a list of different sizes, and a shard
-- that is a view inside the gathered buffer (as ZeRO uses it)
for _, dt in ipairs(DTYPES) do
  local n = 5
  local out = gl.zeros({ N * n }, { dtype = dt })
  world:all_gather(out, tensor_of(seq(n, function(i) return v(R, i) end), dt))
  same(out, seq(N * n, function(j) local r = math.floor((j - 1) / n); return v(r, j - r * n) end), 'all_gather ' .. dt)
end
do
  local counts = seq(N, function(r) return r * 2 end)         -- 0, 2, 4 ...: rank 0 sends nothing
  local total = 0
  for _, c in ipairs(counts) do total = total + c end
  local out = gl.zeros({ total })
  world:all_gather(out, gl.full({ counts[R + 1] }, R + 1), { counts = counts })
  local want = {}
  for r = 0, N - 1 do for _ = 1, counts[r + 1] do want[#want + 1] = r + 1 end end
  same(out, want, 'all_gather uneven counts')

  local list = seq(N, function(r) return gl.zeros({ r, 2 }, { dtype = 'int64' }) end)
  check(not pcall(world.all_gather, world, list, gl.full({ R + 2, 2 }, R, { dtype = 'int64' })),
    'all_gather into a list slot of the wrong size raises')
  list = seq(N, function(r) return gl.zeros({ r, 2 }, { dtype = 'int64' }) end)
  world:all_gather(list, gl.full({ R + 1, 2 }, R, { dtype = 'int64' }))
  for r = 1, N do same(list[r], seq(2 * r, function() return r - 1 end), 'all_gather list ' .. r) end

  local n = 3
  local full = gl.zeros({ N * n }, { dtype = 'float64' })
  local shard = full:narrow(1, R * n + 1, n)
  shard:fill_(R + 0.5)
  world:all_gather(full, shard)
  same(full, seq(N * n, function(j) return math.floor((j - 1) / n) + 0.5 end), 'all_gather shard inside out')
end

-- reduce_scatter: even (sum, avg), uneven counts, list input
for _, dt in ipairs(DTYPES) do
  local n = 4
  local input = tensor_of(seq(N * n, function(j) return v(R, j) end), dt)
  local out = gl.zeros({ n }, { dtype = dt })
  world:reduce_scatter(out, input, 'sum')
  same(out, seq(n, function(i) return N * (N + 1) / 2 * ((R * n + i - 1) % 5 + 1) end), 'reduce_scatter ' .. dt)
end
do
  local counts = seq(N, function(r) return r == 1 and 0 or r + 2 end)
  local total = 0
  for _, c in ipairs(counts) do total = total + c end
  local out = gl.zeros({ counts[R + 1] }, { dtype = 'float32' })
  world:reduce_scatter(out, gl.full({ total }, R + 1), 'avg', { counts = counts })
  same(out, seq(counts[R + 1], function() return (N + 1) / 2 end), 'reduce_scatter avg uneven')
  local inputs = seq(N, function(r) return gl.full({ r, 1 }, r * 10 + R, { dtype = 'int32' }) end)
  local got = gl.zeros({ R + 1 }, { dtype = 'int32' })
  world:reduce_scatter(got, inputs, 'sum')
  same(got, seq(R + 1, function() return N * (R + 1) * 10 + N * (N - 1) / 2 end), 'reduce_scatter list')
end

-- gather and scatter, even and uneven (lists), to and from every root
for root = 0, N - 1 do
  local out = R == root and gl.zeros({ N, 3 }, { dtype = 'bfloat16' }) or nil
  world:gather(out, gl.full({ 3 }, R + 1, { dtype = 'bfloat16' }), root)
  if R == root then same(out, seq(3 * N, function(j) return math.floor((j - 1) / 3) + 1 end), 'gather root ' .. root) end

  local outs = R == root and seq(N, function(r) return gl.zeros({ r }) end) or nil
  world:gather(outs, gl.full({ R + 1 }, R * 2), root)
  if R == root then for r = 1, N do same(outs[r], seq(r, function() return (r - 1) * 2 end), 'gather list') end end

  local rec = gl.zeros({ 2 }, { dtype = 'int64' })
  world:scatter(rec, R == root and gl.arange(2 * N, { dtype = 'int64' }) or nil, root)
  same(rec, { 2 * R, 2 * R + 1 }, 'scatter root ' .. root)

  local parts = R == root and seq(N, function(r) return gl.full({ r }, r * 3 + root) end) or nil
  local mine = gl.zeros({ R + 1 })
  world:scatter(mine, parts, root)
  same(mine, seq(R + 1, function() return (R + 1) * 3 + root end), 'scatter list root ' .. root)
end

-- all_to_all: even tensors, then lists of sizes depending on both ranks
do
  local input = gl.tensor(seq(2 * N, function(j) return R * 100 + j end), { dtype = 'float64' })
  local out = gl.zeros({ 2 * N }, { dtype = 'float64' })
  world:all_to_all(out, input)
  same(out, seq(2 * N, function(j) local r = math.floor((j - 1) / 2); return r * 100 + R * 2 + (j - 1) % 2 + 1 end), 'all_to_all')
  local sends = seq(N, function(d) return gl.full({ R + d }, R * 10 + d - 1) end)   -- to rank d-1
  local recvs = seq(N, function(s) return gl.zeros({ s + R }) end)                 -- from rank s-1
  world:all_to_all(recvs, sends)
  for s = 1, N do same(recvs[s], seq(s + R, function() return (s - 1) * 10 + R end), 'all_to_all list from ' .. (s - 1)) end
  -- one flat tensor with per-peer counts, some of them zero (expert
  -- parallelism's token exchange: a rank may send a peer no rows, itself too):
  -- rank a sends rank b (a + b) % 3 elements, each a * 10 + b
  local function n(a, b) return (a + b) % 3 end
  local sc, rc, vals, want = {}, {}, {}, {}
  for d = 0, N - 1 do
    sc[d + 1], rc[d + 1] = n(R, d), n(d, R)
    for _ = 1, n(R, d) do vals[#vals + 1] = R * 10 + d end
    for _ = 1, n(d, R) do want[#want + 1] = d * 10 + R end
  end
  if #vals > 0 and #want > 0 then
    local got = gl.zeros({ #want }, { dtype = 'float64' })
    world:all_to_all(got, gl.tensor(vals, { dtype = 'float64' }), { send_counts = sc, recv_counts = rc })
    same(got, want, 'all_to_all with counts, zeros among them')
  end
end

-- send / recv around a ring (async both ways, so no order can deadlock)
if N > 1 then
  local nxt, prv = (R + 1) % N, (R - 1) % N
  local out = gl.tensor(seq(9, function(i) return R * 1000 + i end), { dtype = 'int32' })
  local into = gl.zeros({ 3, 3 }, { dtype = 'int32' })
  local hs = world:send_async(out, nxt)
  local hr = world:recv(into, prv, { async = true })
  hr:wait(); hs:wait()
  same(into, seq(9, function(i) return prv * 1000 + i end), 'ring send/recv')
  local wrong = gl.zeros({ 4 }, { dtype = 'int32' })
  check(not pcall(world.send, world, out, R), 'send to self raises')
  check(not pcall(world.recv, world, wrong, N), 'recv from a rank out of range raises')
end

world:barrier()

-- async: several in flight, waited in reverse; the handle keeps tensors
-- alive after every other reference is gone
do
  local hs = {}
  for k = 1, 6 do
    hs[k] = world:all_reduce_async(gl.full({ 1000 * k }, R + k), 'sum')
    collectgarbage('collect')
  end
  for k = 6, 1, -1 do
    check(type(hs[k]:test()) == 'boolean', 'test() answers a boolean')
    local t = hs[k]:wait()
    check(hs[k]:test() == true, 'test() after wait')
    same(t, seq(1000 * k, function() return N * k + N * (N - 1) / 2 end), 'async all_reduce ' .. k)
  end
  local big = world:all_reduce_async(gl.full({ 1048576 }, 1), 'sum')
  for _ = 1, 100 do dist.progress() end
  same(big:wait(), seq(1048576, function() return N end), 'async all_reduce advanced by progress()')
  local h = world:all_gather(gl.zeros({ N }), gl.full({ 1 }, R), { async = true })
  same(h:wait(), seq(N, function(j) return j - 1 end), 'async all_gather via opts')
end

-- argument errors are raised before anything starts, identically on every
-- rank, so the communicator stays usable
local function raises(pattern, f, ...)
  local ok, err = pcall(f, ...)
  check(not ok, 'expected an error matching ' .. pattern)
  check(tostring(err):find(pattern), ('error "%s" does not match "%s"'):format(tostring(err), pattern))
end
if N > 1 then
  raises('does not split evenly', world.reduce_scatter, world, gl.zeros({ 1 }), gl.zeros({ N + 1 }))
end
raises('expected one dtype', world.all_gather, world, gl.zeros({ N }), gl.zeros({ 1 }, { dtype = 'int32' }))
raises('avg expected a floating dtype', world.all_reduce, world, gl.zeros({ 2 }, { dtype = 'int64' }), 'avg')
raises("op expected 'sum'", world.all_reduce, world, gl.zeros({ 2 }), 'mean')
raises('root expected a rank in 0..', world.broadcast, world, gl.zeros({ 2 }), N)
raises('expected a tensor', world.all_reduce, world, 42)
raises('reductions expected', world.all_reduce, world, gl.zeros({ 2 }, { dtype = 'uint8' }))
raises('counts add up to', world.all_gather, world, gl.zeros({ 5 }), gl.zeros({ 1 }), { counts = seq(N, function() return 1 end) })
do local t = gl.full({ 3 }, 1); world:all_reduce(t); same(t, { N, N, N }, 'usable after errors') end

-- sub-communicators: by parity, reversed by key, one rank left out, nested
do
  local par = world:split(R % 2)
  local members = {}
  for r = 0, N - 1 do if r % 2 == R % 2 then members[#members + 1] = r end end
  check(par.size == #members, 'parity group size')
  check(par.rank == (R - R % 2) / 2, 'parity group rank')
  check(par.local_size == par.size and par.node == 0, 'parity group topology')
  local t = gl.full({ 4 }, R)
  par:all_reduce(t, 'sum')
  local s = 0
  for _, r in ipairs(members) do s = s + r end
  same(t, { s, s, s, s }, 'all_reduce on the parity group')

  local rev = world:split(0, -R)
  check(rev.rank == N - 1 - R, 'key orders the new group')
  local b = gl.full({ 2 }, R)
  rev:broadcast(b, 0)
  same(b, { N - 1, N - 1 }, 'broadcast from new rank 0 (old rank N-1)')

  local some = world:split(R == 0 and -1 or 1)
  check((R == 0) == (some == nil), 'color < 0 gives nil')
  if some then
    check(some.size == N - 1 and some.rank == R - 1, 'group without rank 0')
    local inner = some:split(0)
    local x = gl.full({ 1 }, 1)
    inner:all_reduce(x)
    same(x, { N - 1 }, 'nested split')
    inner:set_timeout(5)
  end
  local g = gl.full({ 1 }, 1)
  world:all_reduce(g)
  same(g, { N }, 'world after splits')
end

-- error lines carry the rank
if N > 1 then
  check(dist.prefix('a\nb') == ('[rank %d] a\n[rank %d] b'):format(R, R), 'rank prefix: ' .. dist.prefix('a\nb'))
else
  check(dist.prefix('a\nb') == 'a\nb', 'no prefix in a world of one')
end

-- topology and threads: one node, cores shared among its ranks
check(world.local_size == N and world.local_rank == R and world.node == 0 and world.nnodes == 1, 'world topology')
if backend == 'mpi' then
  -- big temporaries stay in the heap (no mmap per MPI call; see mpi.c)
  local ffi = require 'ffi'
  ffi.cdef [[
    struct spec_mallinfo2 { size_t arena, ordblks, smblks, hblks, hblkhd, usmblks, fsmblks, uordblks,
                            fordblks, keepcost; };
    struct spec_mallinfo2 mallinfo2(void);
  ]]
  if not pcall(function() return ffi.C.malloc end) then ffi.cdef 'void *malloc(size_t); void free(void *);' end
  local before = tonumber(ffi.C.mallinfo2().hblks)
  local p = ffi.C.malloc(64 * 2 ^ 20)
  check(tonumber(ffi.C.mallinfo2().hblks) == before, 'a 64 MB malloc was served by mmap')
  ffi.C.free(p)
  local cores = dist.backend_lib().gl_dist_cpu_count()
  check(os.getenv('OMP_NUM_THREADS') ~= nil or gl.get_num_threads() == dist.default_threads(cores, N),
    ('threads %d, expected %d'):format(gl.get_num_threads(), dist.default_threads(cores, N)))
elseif backend == 'gloo' then
  -- the TCP rendezvous and Gloo: no MPI anywhere in the process
  check(world.backend == 'gloo', 'backend ' .. tostring(world.backend) .. ', expected gloo')
  for line in io.lines('/proc/self/maps') do check(not line:find('libmpi'), 'libmpi is mapped: ' .. line) end
  local cores = dist.backend_lib().gl_dist_cpu_count()
  check(os.getenv('OMP_NUM_THREADS') ~= nil or gl.get_num_threads() == dist.default_threads(cores, N),
    ('threads %d, expected %d'):format(gl.get_num_threads(), dist.default_threads(cores, N)))
else
  check(world.backend == 'local' and dist.backend_lib() == nil, 'a world of one loads no MPI')
  for line in io.lines('/proc/self/maps') do check(not line:find('libmpi'), 'libmpi is mapped: ' .. line) end
end

-- a dropped, unfinished handle completes in the background; finalize waits
local kept = gl.full({ 50000 }, 1)
world:all_reduce_async(kept, 'sum')
collectgarbage('collect')
dist.finalize()
same(kept, seq(50000, function() return N end), 'detached all_reduce completed by finalize')
check(not dist.is_initialized(), 'finalized')

io.write(('OK rank %d of %d\n'):format(R, N))
