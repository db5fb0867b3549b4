-- gptlua.dist — process groups and collectives on tensors.
--
--   local dist = require 'gptlua.dist'
--   local world = dist.init{ backend = 'auto', timeout = 600 }
--   world.rank, world.size, world.local_rank, world.local_size, world.node
--   world:all_reduce(grad, 'avg')                      -- blocking
--   local h = world:all_reduce(grad, 'sum', {async = true})   -- or all_reduce_async
--   ... h:test() ... h:wait()
--   local tp = world:split(world.rank % 2)             -- sub-communicator
--   world:all_reduce_number(loss, 'avg')               -- a Lua number
--   local policy = dist.policy('zero2', {params = ..., optimizer = ...})  -- what the trainer runs
--
-- A process started without a launcher is a world of one: no MPI is loaded
-- and every collective is a copy.  Under an MPI launcher (gptlua -n N,
-- mpirun, srun) the ranks talk through build/libgptlua_mpi.so (engine/mpi/);
-- under torchrun-style variables alone (RANK, WORLD_SIZE, MASTER_ADDR,
-- MASTER_PORT: torchrun, Kubernetes operators, gptlua -n N --launcher=tcp)
-- they meet at a TCP rendezvous and talk through build/libgptlua_gloo.so
-- (engine/gloo/).  One contract, engine/gl_dist.h, and one Comm table here.
--
-- Backends: CPU tensors travel over the world's host backend, MPI or Gloo.
-- CUDA tensors travel over NCCL (engine/mpi/nccl.c, a communicator per
-- group with its own stream, its unique id broadcast over the host backend)
-- when every rank can use it: a build with NCCL, one GPU per rank;
-- otherwise, or with dist.init{backend = 'mpi'|'gloo'}, over the host
-- backend through host copies (how several ranks share one GPU: NCCL
-- refuses that).  Each rank of a multi-rank world binds to GPU
-- local_rank % device_count (dist.device()).
--
-- Collectives take flat views of tensors: only numel matters.  Where a side
-- is split over ranks it can be one tensor (even split, or opts.counts for
-- uneven ones) or a Lua list of `size` tensors of any sizes.  Every method
-- has an async form (opts.async or NAME_async) returning a Work with
-- wait() and test(); the Work keeps its tensors alive until it completes.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local ffi, lib = G.ffi, G.lib

local dist = { timeout = 600 }

local COLL = { all_reduce = 0, reduce_scatter = 1, all_gather = 2, broadcast = 3, reduce = 4,
  gather = 5, scatter = 6, all_to_all = 7, barrier = 8, send = 9, recv = 10 }
local OPS = { sum = 0, avg = 1, max = 2, min = 3 }
local REDUCTION = { all_reduce = true, reduce_scatter = true, reduce = true }
local REDUCE_DTYPES = { float32 = true, float64 = true, bfloat16 = true, float16 = true, int32 = true, int64 = true }

local mpi        -- the ffi.load'ed backend library (libgptlua_mpi or libgptlua_gloo), once a
                 -- world of more than one rank exists
local world      -- the world Comm, once dist.init ran
local device_id  -- the CUDA device this rank is bound to (nil: none)


-- ------------------------------------------------------------ discovery --
-- Launchers, rank discovery, backends and GPUs: gptlua.dist.discover.
for name, v in pairs(require 'gptlua.dist.discover') do dist[name] = v end

-- ----------------------------------------------------------------- Work --
-- A collective's handle (wait, test) and the host's wait time:
-- gptlua.dist.work.
local Work, completed, host_wait = require('gptlua.dist.work').install(dist)

-- ----------------------------------------------------------------- Comm --
local Comm = {}
Comm.__index = Comm
dist.Comm = Comm

local function is_tensor(x) return getmetatable(x) == Tensor end

-- nccl: CUDA tensors of this group travel over NCCL (the NCCL
-- communicator itself, _nccl_c, is made by the first such collective)
local function wrap_comm(c, backend, nccl)
  return setmetatable({ c = c, backend = backend, nccl = nccl or false, rank = c.rank, size = c.size,
    local_rank = c.local_rank, local_size = c.local_size, node = c.node, nnodes = c.nnodes,
    name = ffi.string(c.name) }, Comm)
end

local function local_comm(name)
  return setmetatable({ backend = 'local', nccl = false, rank = 0, size = 1, local_rank = 0, local_size = 1,
    node = 0, nnodes = 1, name = name, nsplits = 0, timeout = dist.timeout }, Comm)
end

function Comm:__tostring()
  return ("Comm(%s, rank %d of %d, %s)"):format(self.name, self.rank, self.size,
    self.nccl and self.backend .. ' + nccl' or self.backend)
end

-- the one check of a collective timeout (seconds, finite > 0)
local function check_timeout(seconds, fn, what)
  if type(seconds) ~= 'number' or not (seconds > 0 and seconds < math.huge) then
    error(('%s: %s expected a finite number of seconds > 0, got %s'):format(fn, what, tostring(seconds)), 3)
  end
  return seconds
end

function Comm:set_timeout(seconds)
  check_timeout(seconds, 'set_timeout', 'seconds')
  if self.c then
    G.check(mpi.gl_comm_set_timeout(self.c, seconds), 2)
    if self._nccl_c then G.check(mpi.gl_comm_set_timeout(self._nccl_c, seconds), 2) end
  end
  self.timeout = seconds
end

-- The group's NCCL communicator, made on first use (collective: every rank
-- reaches its first CUDA collective on this group together).
function Comm:_nccl_comm(level)
  if not self._nccl_c then
    local out = ffi.new('gl_comm*[1]')
    G.check(mpi.gl_nccl_comm_create(self.c, device_id, out), (level or 1) + 1)
    self._nccl_c = ffi.gc(out[0], mpi.gl_comm_free)
  end
  return self._nccl_c
end

-- Drops this group's NCCL communicator (freed once its last work is done).
function Comm:_drop_nccl()
  local c = self._nccl_c
  if c then
    self._nccl_c = nil
    ffi.gc(c, nil)
    mpi.gl_comm_free(c)
  end
end

-- Sub-communicator of the ranks that pass the same color, ordered by key
-- (default: rank).  Collective over self.  color nil or < 0: this rank joins
-- none and gets nil.  group {size =, rank =}: what the caller knows the new
-- group will be (this rank's place in it); checked here, and what a fake
-- world (gptlua.dist.fake), which sees one rank only, needs to make it.
function Comm:split(color, key, group)
  if self.fake then return self.fake.split(self, color, key, group) end
  local child = self:_split(color, key)
  if group and child and (child.size ~= group.size or (group.rank and child.rank ~= group.rank)) then
    error(('split: the new group is rank %d of %d, the caller expected rank %s of %d'):format(child.rank, child.size,
      tostring(group.rank), group.size), 2)
  end
  return child
end

function Comm:_split(color, key)
  color = color or -1
  key = key or self.rank
  if type(color) ~= 'number' or color ~= math.floor(color) then
    error('split: color expected an integer, got ' .. tostring(color), 2)
  end
  if type(key) ~= 'number' or key ~= math.floor(key) then
    error('split: key expected an integer, got ' .. tostring(key), 2)
  end
  -- the child's role: which split of which communicator made it, the same
  -- on every rank (split is collective) whatever group the rank landed in
  self.nsplits = (self.nsplits or 0) + 1
  local role = ('%s/%d'):format(self.role or 'world', self.nsplits)
  if not self.c then
    if color < 0 then return nil end
    local child = local_comm(('%s.%d[%d]'):format(self.name, self.nsplits, color))
    child.timeout, child.role = self.timeout, role
    return child
  end
  local out = ffi.new('gl_comm*[1]')
  G.check(mpi.gl_comm_split(self.c, color, key, out), 2)
  local child = out[0] ~= nil and wrap_comm(ffi.gc(out[0], mpi.gl_comm_free), self.backend, self.nccl) or nil
  if child then child.timeout, child.role = self.timeout, role end   -- the engine's child inherits the timeout too
  -- an existing NCCL communicator is split too (ncclCommSplit shares its
  -- resources); otherwise the child makes its own on first use
  if self._nccl_c then
    G.check(mpi.gl_comm_split(self._nccl_c, color, key, out), 2)
    if child then child._nccl_c = ffi.gc(out[0], mpi.gl_comm_free) end
  end
  return child
end

-- ------------------------------------------------- argument normalising --
-- level: of the user's call, counted from here (4: called by a method)
local function check_tensor(x, fn, what, level)
  if not is_tensor(x) then error(('%s: %s expected a tensor, got %s'):format(fn, what, type(x)), level or 4) end
  return x
end

local function flat_slice(buf, off, shape)
  return buf:_as_strided(shape, Tensor.contiguous_strides(shape), off)
end

-- A tensor, or a list of `size` tensors packed into one flat buffer.
-- Returns the tensor, its per-rank counts (list form only), and for a list:
-- a function copying the list into the buffer (input) or out of it (output).
local function pack(self, x, fn, what, like)
  if is_tensor(x) then return x end
  if type(x) ~= 'table' then error(('%s: %s expected a tensor or a list of %d tensors, got %s'):format(
    fn, what, self.size, type(x)), 4) end
  if #x ~= self.size then
    error(('%s: %s expected a list of %d tensors (one per rank), got %d'):format(fn, what, self.size, #x), 4)
  end
  local counts, total = {}, 0
  for i, t in ipairs(x) do
    check_tensor(t, fn, ('%s[%d]'):format(what, i), 5)
    if t.dtype ~= x[1].dtype then
      error(('%s: %s[%d] is %s but %s[1] is %s, expected one dtype'):format(fn, what, i, t.dtype, what, x[1].dtype), 4)
    end
    counts[i] = t:numel(); total = total + counts[i]
  end
  like = like or x[1]
  local buf = Tensor.empty({ total }, { dtype = x[1].dtype, device = like.device })
  local function each(f)
    local off = 0
    for i, t in ipairs(x) do
      if counts[i] > 0 then f(t, flat_slice(buf, off, t.shape)) end
      off = off + counts[i]
    end
  end
  local copy_in = function() each(function(t, s) G.check(lib.gl_copy(s.c, t.c)) end) end
  local copy_out = function() each(function(t, s) G.check(lib.gl_copy(t.c, s.c)) end) end
  return buf, counts, copy_in, copy_out
end

local function counts_arg(self, counts, fn, what)
  if counts == nil then return nil end
  if type(counts) ~= 'table' or #counts ~= self.size then
    error(('%s: %s expected a list of %d counts (one per rank), got %s'):format(fn, what, self.size,
      type(counts) == 'table' and #counts .. ' entries' or type(counts)), 4)
  end
  for i, n in ipairs(counts) do
    if type(n) ~= 'number' or n < 0 or n ~= math.floor(n) then
      error(('%s: %s[%d] expected an integer >= 0, got %s'):format(fn, what, i, tostring(n)), 4)
    end
  end
  return counts
end

local function op_arg(op, fn)
  op = op or 'sum'
  if OPS[op] == nil then error(("%s: op expected 'sum', 'avg', 'max' or 'min', got %s"):format(fn, tostring(op)), 4) end
  return op
end

local function rank_arg(self, r, fn, what)
  if type(r) ~= 'number' or r ~= math.floor(r) or r < 0 or r >= self.size then
    error(('%s: %s expected a rank in 0..%d, got %s'):format(fn, what, self.size - 1, tostring(r)), 4)
  end
  return r
end

-- -------------------------------------------------------- the world of one
-- Every collective over one rank is a copy from send to recv (reductions of
-- one value are that value).  The checks and messages mirror
-- engine/mpi/comm.c for size 1.
local function local_total(counts, total, fn, what)
  if counts and counts[1] ~= total then
    error(('%s: %s add up to %d elements but the tensor has %d'):format(fn, what, counts[1], total), 6)
  end
  return total
end

local function local_numel(t, n, fn, what, why)
  if t:numel() ~= n then
    error(('%s: %s expected %d elements (%s), got %d'):format(fn, what, n, why, t:numel()), 6)
  end
end

local function local_check(name, s)
  local fn = name
  if s.peer then error(('%s: peer expected a rank other than this one (0)'):format(fn), 5) end
  local send, recv = s.send, s.recv
  if send and recv and send.dtype ~= recv.dtype then
    error(('%s: send is %s but recv is %s, expected one dtype'):format(fn, send.dtype, recv.dtype), 5)
  end
  local any = recv or send
  if REDUCTION[name] then
    if not REDUCE_DTYPES[any.dtype] then
      error(('%s: reductions expected float32, float64, bfloat16, float16, int32 or int64, got %s'):format(
        fn, any.dtype), 5)
    end
    if s.op == 'avg' and not Tensor.FLOATING[any.dtype] then
      error(('%s: avg expected a floating dtype, got %s (use sum)'):format(fn, any.dtype), 5)
    end
  end
  if name == 'reduce_scatter' then
    local n = local_total(s.recv_counts, send:numel(), fn, 'counts')
    local_numel(recv, n, fn, 'recv', s.recv_counts and 'counts[rank]' or "send's numel / ranks")
  elseif name == 'all_gather' or name == 'gather' then
    local n = local_total(s.recv_counts, recv:numel(), fn, 'counts')
    local_numel(send, n, fn, 'send', s.recv_counts and 'counts[rank]' or "recv's numel / ranks")
  elseif name == 'scatter' then
    local n = local_total(s.send_counts, send:numel(), fn, 'counts')
    local_numel(recv, n, fn, 'recv', s.send_counts and 'counts[rank]' or "send's numel / ranks")
  elseif name == 'all_to_all' then
    local n = local_total(s.send_counts, send:numel(), fn, 'send_counts')
    local_total(s.recv_counts, recv:numel(), fn, 'recv_counts')
    local_numel(recv, n, fn, 'recv', 'what this rank sends itself')
  end
end

local function run_local(self, name, s)
  local_check(name, s)
  if s.send and s.recv and s.send ~= s.recv then
    if s.pack_in then s.pack_in() end
    -- row-major order of send onto recv's shape, whatever the two shapes
    local src = s.send:is_contiguous() and s.send or s.send:contiguous()
    local view = src:_as_strided(s.recv.shape, Tensor.contiguous_strides(s.recv.shape), src:storage_offset())
    G.check(lib.gl_copy(s.recv.c, view.c))
    view:free()  -- the view holds send's storage: let it go now, not at scope end
    if s.unpack_out then s.unpack_out() end
  end
  return completed(s.result)
end

-- ------------------------------------------------------------ MPI ranks --
local args_buf = ffi.new('gl_coll_args')

local function counts_cdata(counts)
  if not counts then return nil end
  local c = ffi.new('int64_t[?]', #counts)
  for i, n in ipairs(counts) do c[i - 1] = n end
  return c
end

-- device: the CUDA device of an NCCL collective (its Work waits on the
-- device), nil over MPI
local function run_remote(self, c, name, s, device)
  if s.pack_in then s.pack_in() end
  local a = args_buf
  a.coll = COLL[name]
  a.op = OPS[s.op or 'sum']
  a.root = s.root or s.peer or 0
  a.send = s.send and s.send.c or nil
  a.recv = s.recv and s.recv.c or nil
  local sc, rc = counts_cdata(s.send_counts), counts_cdata(s.recv_counts)
  a.send_counts, a.recv_counts = sc, rc
  a.label = nil
  local w = mpi.gl_comm_start(c, a)
  a.send, a.recv, a.send_counts, a.recv_counts = nil, nil, nil, nil
  if w == nil then error(ffi.string(lib.gl_last_error()), 4) end
  return setmetatable({ w = ffi.gc(w, mpi.gl_work_free), result = s.result, after = s.unpack_out,
    keep = { s.send, s.recv, s.keep }, device = device }, Work)
end

local function on_cuda(t) return t ~= nil and t.device ~= 'cpu' end

-- Which backend carries a collective on send/recv: 'local' in a world of
-- one, 'nccl' when the group uses NCCL and every tensor is on a GPU, else
-- 'mpi' (CPU tensors, mixed devices, barrier).
function Comm:route(send, recv)
  if self.fake then return 'fake' end
  if not self.c then return 'local' end
  if self.nccl and (on_cuda(send) or on_cuda(recv)) and (send == nil or on_cuda(send))
      and (recv == nil or on_cuda(recv)) then
    return 'nccl'
  end
  return 'mpi'
end

-- Bytes this rank puts on the wire for a collective of n bytes per send
-- buffer, as the textbook algorithms move them (ring all-reduce 2(N-1)/N n;
-- reduce-scatter, all-to-all and scatter (N-1)/N n; all-gather (N-1) n;
-- broadcast n from the root; reduce and gather n from the others; send n).
-- Comm.sent_bytes sums them: what the policies' bytes per step report.
local function wire_bytes(self, name, s)
  local t = s.send
  if not t then return 0 end
  local n, N = t:numel() * lib.gl_dtype_size(t.c.dtype), self.size
  if name == 'all_reduce' then return 2 * (N - 1) / N * n
  elseif name == 'reduce_scatter' or name == 'all_to_all' then return (N - 1) / N * n
  elseif name == 'scatter' then return self.rank == s.root and (N - 1) / N * n or 0
  elseif name == 'all_gather' then return (N - 1) * n
  elseif name == 'broadcast' then return self.rank == s.root and n or 0
  elseif name == 'reduce' or name == 'gather' then return self.rank == s.root and 0 or n
  elseif name == 'send' then return n end
  return 0
end

-- dist.on_collective(name, comm, spec): called before every collective when
-- set (gptlua.journal hashes each step's sequence of collectives with it)
local function run(self, name, s, async)
  if dist.on_collective then dist.on_collective(name, self, s) end
  local r = self:route(s.send, s.recv)
  local work
  if r == 'local' then work = run_local(self, name, s)
  elseif r == 'fake' then work = self.fake.run(self, name, s)
  else
    self.sent_bytes = (self.sent_bytes or 0) + wire_bytes(self, name, s)
    work = run_remote(self, r == 'nccl' and self:_nccl_comm(3) or self.c, name, s, r == 'nccl' and device_id or nil)
  end
  if async then return work end
  -- the blocking form waits on the host, NCCL too: its caller may read the
  -- result at once, and a peer that never comes is caught by the watchdog
  -- right here (the async form's wait() is the device-side one)
  if work.device and work.w ~= nil then host_wait(work.w, 3) end
  return work:wait()
end

-- Each method builds a spec {send, recv, op, root|peer, counts, pack/unpack,
-- result} from its arguments and returns it with the opts table.
local methods = {}

function methods.all_reduce(self, t, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  check_tensor(t, 'all_reduce', 'tensor')
  return { send = t, recv = t, op = op_arg(op, 'all_reduce'), result = t }, opts
end

function methods.broadcast(self, t, root, opts)
  if type(root) == 'table' then root, opts = nil, root end
  check_tensor(t, 'broadcast', 'tensor')
  return { send = t, recv = t, root = rank_arg(self, root or 0, 'broadcast', 'root'), result = t }, opts
end

function methods.reduce(self, t, root, op, opts)
  if type(root) == 'table' then root, op, opts = nil, nil, root end
  if type(op) == 'table' then op, opts = nil, op end
  check_tensor(t, 'reduce', 'tensor')
  return { send = t, recv = t, root = rank_arg(self, root or 0, 'reduce', 'root'),
           op = op_arg(op, 'reduce'), result = t }, opts
end

-- reduce_scatter(out, input, op, opts): input is `size` chunks (one tensor,
-- or a list); out receives this rank's chunk, reduced over ranks.
function methods.reduce_scatter(self, out, input, op, opts)
  if type(op) == 'table' then op, opts = nil, op end
  opts = opts or {}
  check_tensor(out, 'reduce_scatter', 'out')
  local send, counts, pack_in = pack(self, input, 'reduce_scatter', 'input', out)
  counts = counts or counts_arg(self, opts.counts, 'reduce_scatter', 'counts')
  return { send = send, recv = out, recv_counts = counts, op = op_arg(op, 'reduce_scatter'),
           pack_in = pack_in, keep = input, result = out }, opts
end

-- all_gather(out, input, opts): out (one tensor or a list) receives every
-- rank's input in rank order.
function methods.all_gather(self, out, input, opts)
  opts = opts or {}
  check_tensor(input, 'all_gather', 'input')
  local recv, counts, _, unpack_out = pack(self, out, 'all_gather', 'out', input)
  counts = counts or counts_arg(self, opts.counts, 'all_gather', 'counts')
  return { send = input, recv = recv, recv_counts = counts, unpack_out = unpack_out, keep = out,
           result = out }, opts
end

-- gather(out, input, root, opts): out (tensor or list) matters on root only.
function methods.gather(self, out, input, root, opts)
  if type(root) == 'table' then root, opts = nil, root end
  opts = opts or {}
  root = rank_arg(self, root or 0, 'gather', 'root')
  check_tensor(input, 'gather', 'input')
  local s = { send = input, root = root, result = out }
  if self.rank == root then
    local recv, counts, _, unpack_out = pack(self, out, 'gather', 'out', input)
    s.recv, s.recv_counts, s.unpack_out, s.keep = recv, counts, unpack_out, out
  end
  s.recv_counts = s.recv_counts or counts_arg(self, opts.counts, 'gather', 'counts')
  return s, opts
end

-- scatter(out, input, root, opts): input (tensor or list) matters on root only.
function methods.scatter(self, out, input, root, opts)
  if type(root) == 'table' then root, opts = nil, root end
  opts = opts or {}
  root = rank_arg(self, root or 0, 'scatter', 'root')
  check_tensor(out, 'scatter', 'out')
  local s = { recv = out, root = root, result = out }
  if self.rank == root then
    local send, counts, pack_in = pack(self, input, 'scatter', 'input', out)
    s.send, s.send_counts, s.pack_in, s.keep = send, counts, pack_in, input
  end
  s.send_counts = s.send_counts or counts_arg(self, opts.counts, 'scatter', 'counts')
  return s, opts
end

-- all_to_all(out, input, opts): chunk r of input goes to rank r; chunk r of
-- out came from rank r.  Lists, or tensors with opts.send_counts/recv_counts.
function methods.all_to_all(self, out, input, opts)
  opts = opts or {}
  local send, sc, pack_in = pack(self, input, 'all_to_all', 'input')
  local recv, rc, _, unpack_out = pack(self, out, 'all_to_all', 'out', send)
  return { send = send, recv = recv, pack_in = pack_in, unpack_out = unpack_out, keep = { input, out },
           send_counts = sc or counts_arg(self, opts.send_counts, 'all_to_all', 'send_counts'),
           recv_counts = rc or counts_arg(self, opts.recv_counts, 'all_to_all', 'recv_counts'),
           result = out }, opts
end

function methods.send(self, t, peer, opts)
  check_tensor(t, 'send', 'tensor')
  return { send = t, peer = rank_arg(self, peer, 'send', 'peer'), result = t }, opts
end

function methods.recv(self, t, peer, opts)
  check_tensor(t, 'recv', 'tensor')
  return { recv = t, peer = rank_arg(self, peer, 'recv', 'peer'), result = t }, opts
end

function methods.barrier(self, opts)
  return {}, opts
end

for name, build in pairs(methods) do
  -- (no tail calls: error levels count these frames)
  Comm[name] = function(self, ...)
    local s, opts = build(self, ...)
    local r = run(self, name, s, opts and opts.async)
    return r
  end
  Comm[name .. '_async'] = function(self, ...)
    local s = build(self, ...)
    local r = run(self, name, s, true)
    return r
  end
end

-- A number reduced over the ranks (op: 'sum', 'avg', 'max', 'min'), in
-- float64 through one buffer per communicator: losses, norms, counts.
function Comm:all_reduce_number(x, op)
  if type(x) ~= 'number' then error('all_reduce_number: x expected a number, got ' .. type(x), 2) end
  op = op or 'sum'
  if OPS[op] == nil then
    error(("all_reduce_number: op expected 'sum', 'avg', 'max' or 'min', got %s"):format(tostring(op)), 2)
  end
  if self.size == 1 then return x end
  local buf = self._number
  if not buf then
    buf = Tensor.empty({ 1 }, { dtype = 'float64' })
    buf._keep = true
    self._number = buf
  end
  ffi.cast('double *', buf:data_ptr())[0] = x
  self:all_reduce(buf, op)
  return ffi.cast('double *', buf:data_ptr())[0]
end

-- --------------------------------------------------------- process group --
local BACKEND_LIBS = { mpi = { 'libgptlua_mpi.so', 'libopenmpi-dev' }, gloo = { 'libgptlua_gloo.so', 'libgloo-dev' } }

-- host: 'mpi' or 'gloo'; one process loads one of them, once
local function load_backend(host)
  if mpi then return mpi end
  local name, pkg = BACKEND_LIBS[host][1], BACKEND_LIBS[host][2]
  local path = G.libdir .. '/' .. name
  local ok, lib_or_err = pcall(ffi.load, path)
  if not ok then
    error(('gptlua.dist: cannot load %s (%s); install %s and run make'):format(path, tostring(lib_or_err), pkg), 3)
  end
  mpi = lib_or_err
  return mpi
end

-- Binds this rank to GPU local_rank % device_count when the engine has
-- CUDA devices (none: device_id stays nil).
local function bind_gpu(w)
  local cuda = require 'gptlua.cuda'
  device_id = dist.gpu_for(w.local_rank, cuda.device_count())
  if device_id then cuda.set_device(device_id) end
end

-- Decides, the same way on every rank, whether w's CUDA tensors use NCCL;
-- with backend 'nccl' returns nil and why not when they cannot.
local function choose_nccl(w, backend)
  if backend == 'mpi' or backend == 'gloo' then return false end
  local cuda = require 'gptlua.cuda'
  local ok, why = dist.nccl_plan { backend = backend, host = w.backend, nccl_version = mpi.gl_nccl_version(),
    device = device_id, local_size = w.local_size, device_count = cuda.device_count() }
  local all = w:all_reduce_number(ok and 1 or 0, 'min') == 1
  if backend == 'nccl' and not all then
    return nil, ("dist.init: backend 'nccl': %s"):format(ok and 'another rank cannot use NCCL (see its error)' or why)
  end
  return all
end

-- init{backend = 'auto'|'mpi'|'gloo'|'nccl', timeout = seconds, threads = n}:
-- the world.  'auto' uses the launcher's host backend when it started more
-- than one rank (MPI under mpirun/srun, Gloo over the TCP rendezvous under
-- torchrun-style variables alone), and NCCL for CUDA tensors when every
-- rank can (a build with NCCL, a GPU per rank); 'mpi' and 'gloo' always
-- initialise that host backend and move CUDA tensors over it too (through
-- host memory: ranks may share a GPU); 'nccl' always initialises the
-- launcher's host backend and fails unless CUDA tensors can use NCCL.  The
-- TCP rendezvous waits up to timeout for every rank and names the missing.
-- threads defaults to the node's cores over its ranks (unless
-- OMP_NUM_THREADS is set).  Ranks of a
-- multi-rank world bind to GPU local_rank % device_count.  Later calls
-- return the same world.
function dist.init(opts)
  opts = opts or {}
  local backend = opts.backend or 'auto'
  if backend ~= 'auto' and backend ~= 'mpi' and backend ~= 'gloo' and backend ~= 'nccl' then
    error(("dist.init: backend expected 'auto', 'mpi', 'gloo' or 'nccl', got %s"):format(tostring(backend)), 2)
  end
  local timeout = check_timeout(opts.timeout or dist.timeout, 'dist.init', 'timeout')
  if world then world:set_timeout(timeout); return world end

  local found = dist.discover()
  if backend == 'auto' and not (found and found.size > 1) then
    world = local_comm('world')
    world.timeout = timeout
    return world
  end
  local host = dist.host_backend(backend, found)
  local w
  if host == 'gloo' then
    if not found then
      error("dist.init: backend 'gloo' needs a torchrun-style launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; "
        .. 'gptlua -n N --launcher=tcp sets them)', 2)
    end
    local addr, port = dist.master()
    load_backend('gloo')
    G.check(mpi.gl_dist_init_tcp(found.rank, found.size, addr, port, timeout), 2)
    w = wrap_comm(mpi.gl_dist_world(), 'gloo')
  else
    load_backend('mpi')
    G.check(mpi.gl_dist_init(timeout), 2)
    w = wrap_comm(mpi.gl_dist_world(), 'mpi')
  end
  w.timeout = timeout
  if found and (found.rank ~= w.rank or found.size ~= w.size) then
    error(('dist.init: the %s variables say rank %d of %d but MPI sees rank %d of %d; '
      .. 'start the ranks with an MPI launcher (gptlua -n N, mpirun, srun)'):format(
      found.launcher, found.rank, found.size, w.rank, w.size), 2)
  end
  world = w
  local threads = opts.threads or (os.getenv('OMP_NUM_THREADS') == nil and
    dist.default_threads(mpi.gl_dist_cpu_count(), w.local_size))
  if threads then G.check(lib.gl_set_num_threads(threads), 2) end
  bind_gpu(w)
  local nccl, why = choose_nccl(w, backend)
  if nccl == nil then
    world = nil   -- MPI stays up: dist.init{backend = 'mpi'} still gets the world
    error(why, 2)
  end
  w.nccl = nccl
  return world
end

-- The data-parallel policies the trainer runs (cfg.dist), in
-- lua/gptlua/dist/policies/.  opts: params, optimizer, comm (default: the
-- world), bucket_mb (default 25), overlap (default true: collectives start
-- from the gradient-ready hooks).  See the trainer's policy interface
-- (gptlua.train, LocalPolicy).
dist.POLICIES = { ddp = 'gptlua.dist.policies.ddp', zero1 = 'gptlua.dist.policies.zero',
  zero2 = 'gptlua.dist.policies.zero', fsdp = 'gptlua.dist.fsdp', hsdp = 'gptlua.dist.fsdp',
  localsgd = 'gptlua.dist.policies.localsgd', diloco = 'gptlua.dist.policies.diloco', ps = 'gptlua.dist.policies.ps' }

function dist.policy(name, opts)
  local mod = dist.POLICIES[name]
  if not mod then
    error(("dist.policy: unknown policy %s (expected 'ddp', 'zero1', 'zero2', 'fsdp', 'hsdp', 'localsgd', 'diloco' or 'ps')")
      :format(tostring(name)), 2)
  end
  local p = require(mod).new(name, opts)
  return p
end

-- The world as a grid of named dimensions with a Comm per dimension
-- (dist.mesh{dp = 2, tp = 2}; lua/gptlua/dist/mesh.lua).
function dist.mesh(o) return require('gptlua.dist.mesh').new(o) end

-- Advances in-flight collectives without blocking (MPI moves data only
-- inside MPI calls): call it between pieces of compute to overlap them.
function dist.progress()
  if world and world.c then G.check(mpi.gl_dist_progress(), 2) end
end

function dist.is_initialized() return world ~= nil end
-- The device this rank computes on: 'cuda:N' of its bound GPU in a world of
-- several ranks, cuda:0 in a world of one when a GPU exists, else 'cpu'.
function dist.device()
  if device_id then return 'cuda:' .. device_id end
  if not (world and world.c) and lib.gl_cuda_device_count() > 0 then return 'cuda:0' end
  return 'cpu'
end
function dist.get_world() return world end
-- Makes w the world dist.init returns (a fake world: gptlua.dist.fake), or
-- forgets it (nil); returns the previous one.
function dist.set_world(w) local old = world; world = w; return old end
function dist.rank() return world and world.rank or 0 end
function dist.size() return world and world.size or 1 end
-- the MPI library, nil for a world of one (specs check nothing was loaded)
function dist.backend_lib() return mpi end

-- Completes detached work, meets every rank, and shuts MPI down.  Exiting
-- with status 0 does this by itself.
function dist.finalize()
  if world and world.c then
    world:_drop_nccl()
    G.check(mpi.gl_dist_finalize(), 2)
    world.c = nil
  end
  world = nil
end

-- Rank 0's prints, the rank prefix, abort and the error path:
-- gptlua.dist.errors.
require('gptlua.dist.errors').install(dist)

-- entry points and their options' fields checked (gptlua.check): "dist.init: backend must be a string, got 5"
local check = require 'gptlua.check'
check.options('dist_init_opts', { backend = 'string?', timeout = 'real?', threads = 'integer?' })
check.wrap_table(dist, { init = 'opts:dist_init_opts?', policy = 'name:string, opts:opts?', discover = 'getenv:callable?',
  mesh = 'sizes:opts' }, 'dist.')

return dist
