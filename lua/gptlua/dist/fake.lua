-- gptlua.dist.fake — a fake world: one process plays rank r of N, so the
-- sharding policies run their real code for that rank without the others
-- (the planner runs it on the meta device; PyTorch's fake process group).
--
--   local fake = require 'gptlua.dist.fake'
--   local w = fake.world(64, 3)            -- rank 3 of 64: a gptlua.dist Comm
--   dist.set_world(w)                      -- what dist.init returns now
--   ... w:all_reduce(t) ...                -- returns at once
--   fake.traffic(w)                        -- {group = {bytes =, calls =, by = {collective = {bytes, calls}}}}
--
-- Every collective checks its arguments for N ranks (the sizes the real
-- backends check), returns at once (an async one's Work completes at
-- wait(), and test() says not yet: its tensors are kept as long as a real
-- one can keep them, so the plan is of the slowest network; in a world of
-- one test() completes it, as the local world's), and
-- leaves its output as it is: on the meta device there is nothing to move.
-- It counts the bytes this rank would send, by the ring algorithms' rule
-- the communication table of ARCHITECTURE.md uses: an all-reduce of n
-- bytes sends 2(N-1)/N·n, a reduce-scatter or all-gather of n bytes in all
-- (N-1)/N·n (exactly: all but this rank's own chunk), an all-to-all all
-- but its own chunk, broadcast and reduce n, send n, recv and barrier 0.
-- Counts are per group (a sub-communicator from split is a group of its
-- own, named as the real ones) and per collective.  split needs the new
-- group's size and this rank's place in it (Comm:split's third argument),
-- which one rank cannot see for itself.  A collective the fake world does
-- not know, or a Comm field it does not have, is an error naming it.
local Tensor = require 'gptlua.tensor'

local M = {}

local KNOWN = { all_reduce = true, reduce_scatter = true, all_gather = true, broadcast = true, reduce = true,
  gather = true, scatter = true, all_to_all = true, barrier = true, send = true, recv = true }
M.KNOWN = KNOWN

local BYTES = { float32 = 4, float64 = 8, bfloat16 = 2, float16 = 2, int32 = 4, int64 = 8, uint16 = 2, uint8 = 1,
  bool = 1, float8_e4m3fn = 1, float8_e5m2 = 1 }

-- (level: the caller of the Comm method: fail < traffic < run < dist's run < the method)
local function fail(fn, msg, deeper) error(('%s: %s'):format(fn, msg), 6 + (deeper or 0)) end

-- element count of this rank's chunk of a split side: counts[rank] or an
-- even share of total
local function chunk(self, fn, counts, total, what)
  if counts then
    local sum = 0
    for _, n in ipairs(counts) do sum = sum + n end
    if sum ~= total then fail(fn, ('%s add up to %d elements but the tensor has %d'):format(what, sum, total), 1) end
    return counts[self.rank + 1]
  end
  if total % self.size ~= 0 then
    fail(fn, ('a tensor of %d elements does not split evenly over %d ranks (pass counts)'):format(total, self.size), 1)
  end
  return total / self.size
end

local function expect(fn, t, n, what, why)
  if t:numel() ~= n then fail(fn, ('%s expected %d elements (%s), got %d'):format(what, n, why, t:numel()), 1) end
end

-- bytes this rank sends for collective `name` of spec s (validated)
local function traffic(self, name, s)
  local N, fn = self.size, name
  local send, recv = s.send, s.recv
  local t = recv or send
  local es = t and BYTES[t.dtype] or 0
  if name == 'all_reduce' then return 2 * (N - 1) / N * send:numel() * es end
  if name == 'reduce_scatter' then
    local own = chunk(self, fn, s.recv_counts, send:numel(), 'counts')
    expect(fn, recv, own, 'recv', s.recv_counts and 'counts[rank]' or "send's numel / ranks")
    return (send:numel() - own) * es
  end
  if name == 'all_gather' then
    local own = chunk(self, fn, s.recv_counts, recv:numel(), 'counts')
    expect(fn, send, own, 'send', s.recv_counts and 'counts[rank]' or "recv's numel / ranks")
    return (recv:numel() - own) * es
  end
  if name == 'broadcast' or name == 'reduce' then return self.rank == s.root and send:numel() * es or 0 end
  if name == 'gather' then
    return self.rank == s.root and 0 or send:numel() * es
  end
  if name == 'scatter' then
    if self.rank ~= s.root then return 0 end
    local own = chunk(self, fn, s.send_counts, send:numel(), 'counts')
    return (send:numel() - own) * es
  end
  if name == 'all_to_all' then
    local own = chunk(self, fn, s.send_counts, send:numel(), 'send_counts')
    chunk(self, fn, s.recv_counts, recv:numel(), 'recv_counts')
    return (send:numel() - own) * es
  end
  if name == 'send' then
    if s.peer == self.rank then fail(fn, ('peer expected a rank other than this one (%d)'):format(self.rank)) end
    return send:numel() * es
  end
  if name == 'recv' then
    if s.peer == self.rank then fail(fn, ('peer expected a rank other than this one (%d)'):format(self.rank)) end
    return 0
  end
  return 0  -- barrier
end

-- Comm's run for a fake communicator: count, and hand back a Work
local function run(self, name, s)
  if not KNOWN[name] then
    error(("fake world: collective '%s' is unknown to gptlua.dist.fake, which cannot plan it"):format(name), 5)
  end
  if s.send and s.recv and s.send.dtype ~= s.recv.dtype then
    fail(name, ('send is %s but recv is %s, expected one dtype'):format(s.send.dtype, s.recv.dtype))
  end
  local bytes = traffic(self, name, s)
  local g = self.fake.groups[self.name]
  g.bytes, g.calls = g.bytes + bytes, g.calls + 1
  local c = g.by[name] or { bytes = 0, calls = 0 }
  g.by[name] = c
  c.bytes, c.calls = c.bytes + bytes, c.calls + 1
  -- packing a list is real work the policy asked for (copies on the meta device)
  if s.pack_in then s.pack_in() end
  local dist = require 'gptlua.dist'
  return setmetatable({ result = s.result, after = s.unpack_out, keep = { s.send, s.recv, s.keep },
    eager = self.size == 1 }, dist.Work)
end

local FakeComm = {}
local function new_comm(state, name, size, rank)
  local dist = require 'gptlua.dist'
  state.groups[name] = state.groups[name] or { size = size, bytes = 0, calls = 0, by = {} }
  return setmetatable({ fake = state, backend = 'fake', nccl = false, rank = rank, size = size, local_rank = rank,
    local_size = size, node = 0, nnodes = 1, name = name, nsplits = 0, timeout = dist.timeout }, FakeComm)
end

-- fields a Comm may lack (no engine communicator, no caches yet)
local ABSENT = { c = true, _nccl_c = true, _number = true }
FakeComm.__index = function(_, k)
  local v = require('gptlua.dist').Comm[k]
  if v == nil and not ABSENT[k] then error(("fake world: a Comm has no field '%s' (gptlua.dist.fake plays the Comm interface only)")
    :format(tostring(k)), 2) end
  return v
end
FakeComm.__tostring = function(self) return ('Comm(%s, rank %d of %d, fake)'):format(self.name, self.rank, self.size) end

local function split(self, color, key, group)
  color = color or -1
  if type(color) ~= 'number' or color ~= math.floor(color) then
    error('split: color expected an integer, got ' .. tostring(color), 3)
  end
  self.nsplits = self.nsplits + 1
  if color < 0 then return nil end
  if type(group) ~= 'table' or type(group.size) ~= 'number' or type(group.rank) ~= 'number' then
    error(('split: a fake world sees one rank only: pass the new group as split(color, key, {size =, rank =}), got %s')
      :format(type(group)), 3)
  end
  local n, r = group.size, group.rank
  if n < 1 or n ~= math.floor(n) or n > self.size or r < 0 or r >= n or r ~= math.floor(r) then
    error(('split: group expected 1 <= size <= %d and 0 <= rank < size, got size %s rank %s'):format(self.size,
      tostring(n), tostring(r)), 3)
  end
  return new_comm(self.fake, ('%s.%d[%d]'):format(self.name, self.nsplits, color), n, r)
end

-- world(size, rank): rank `rank` of a fake world of `size` ranks
function M.world(size, rank)
  rank = rank or 0
  if type(size) ~= 'number' or size < 1 or size ~= math.floor(size) then
    error('fake.world: size expected a positive integer, got ' .. tostring(size), 2)
  end
  if type(rank) ~= 'number' or rank < 0 or rank >= size or rank ~= math.floor(rank) then
    error(('fake.world: rank expected an integer in 0..%d, got %s'):format(size - 1, tostring(rank)), 2)
  end
  local state = { groups = {}, run = run, split = split }
  return new_comm(state, 'world', size, rank)
end

-- traffic(w): the counts of w's world and every group split from it, by
-- group name: {size, bytes, calls, by = {collective = {bytes, calls}}}
function M.traffic(w) return w.fake.groups end

-- reset(w): counts from zero (the planner counts one step)
function M.reset(w)
  for _, g in pairs(w.fake.groups) do g.bytes, g.calls, g.by = 0, 0, {} end
end

M.is_fake = function(c) return type(c) == 'table' and rawget(c, 'fake') ~= nil end
M.Tensor = Tensor
return M
