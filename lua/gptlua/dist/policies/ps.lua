-- gptlua.dist.policies.ps — parameter servers: dist = 'ps', ps_servers = S;
-- synchronous (max_staleness = 0, equals DDP) or asynchronous with bounded
-- staleness (max_staleness = k > 0).
--
-- Layout: the parameters (whole tensors) are dealt to the S server ranks
-- 0..S-1, largest first to the least loaded, so server s owns shard s; the
-- servers are also workers (every rank computes, as in colocated PS
-- deployments).  Each shard is one flat parameter buffer (its parameters
-- become views into it) and one flat gradient buffer (their .grad views
-- into it), on every rank.  Optimizer state exists only on the shard's
-- server, for its parameters.
--
-- One step:
--   1. backward accumulates into the gradient buffers (micro-steps local);
--   2. push: every worker's gradient of shard s goes to server s, averaged
--      (a reduce to root s, one per shard, all in flight together);
--   3. the servers' shards hold the averaged gradient: the clipping norm is
--      the sum of the servers' squares (one number all-reduced);
--   4. each server runs the optimizer on its own parameters only;
--   5. pull: every worker receives shard s from server s (a broadcast).
-- The optimizer sees the average of every rank's gradient, as DDP's does:
-- this equals DDP.  Bytes per step: a worker sends its whole gradient
-- (4P, fp32) minus the shard it serves; server s sends its shard P_s
-- (counted once: a pipelined broadcast); DDP's ring all-reduce sends
-- 2(N-1)/N * 4P from every rank.
--
-- Asynchronous (k > 0, one server: send/recv have no tags, so a rank that
-- both serves and pulls from the same peer could not tell a push from a
-- reply).  Every rank pushes its own gradient (a point-to-
-- point message to each server; no averaging, local clipping) and pulls
-- the shard back from the reply; the server applies each push as its own
-- optimizer step, in arrival order.  Versions: server s counts the updates
-- it applied (V_s); a worker holds the version its last reply carried
-- (the last element of every message).  Staleness of an applied update =
-- V_s - the version it was computed on; bounded staleness (SSP): server s
-- applies a push only while every other worker still computing stays
-- within k versions of V_s + 1, so no update is applied to parameters more
-- than k updates newer than those it was computed on, and fast workers run
-- up to k updates ahead of a slow one instead of waiting for it every step.
-- (Two pushes queued at the bound cannot both be applied: the second is
-- dropped, counted in the metrics' `dropped`, and its worker continues
-- from fresh parameters.)  Servers serve whenever
-- their rank is inside the policy (while waiting for replies).  Before any
-- collective (average_number: evals; checkpoints) every worker parks (a
-- message with version -1), the servers serve until all are parked, and
-- every shard is broadcast from its server, so every rank continues from
-- the servers' parameters.  The trainer's per-step {loss, stop} all-reduce
-- is skipped (policy.asynchronous): the logged loss is rank 0's own, and
-- a stop signal is acted on by the rank that received it only (a limit of
-- this mode).  Every applied update's staleness is recorded: metrics
-- staleness_max / staleness_mean since the last log record (rank 0 serves
-- shard 0), policy.log the whole list {worker, staleness[, dropped]}.  The order of
-- updates depends on timing: asynchronous runs do not repeat exactly.
--
-- Checkpoints: each server writes its shard's optimizer state
-- (optim.rankNNNNN.safetensors, whole tensors at offset 0); state.json's
-- layout has every key's shape, so the state re-deals to any number of
-- ranks and servers, or loads whole into a run without a policy.
local gl = require 'gptlua'
local A = require 'gptlua.dist.policies.averaging'
local B = require 'gptlua.dist.policies.base'
local shards = require 'gptlua.dist.policies.shards'
local optim = require 'gptlua.optim'
local G = require 'gptlua.ffi'
local Tensor = gl.Tensor

local PS = {}
PS.__index = PS

function PS.new(name, o)
  local self = A.init(setmetatable({}, PS), name, o)
  local N = self.comm.size
  local S = A.check_int(self.cfg, 'ps_servers', 1)
  if S > N then A.fail(('ps_servers expected at most the number of ranks (%d), got %d'):format(N, S)) end
  self.k = A.check_int(self.cfg, 'max_staleness', 0)
  self.asynchronous = self.k > 0
  -- (send/recv carry no tag: with two servers a rank would receive pushes
  -- and replies from the same peer in one stream, unmatched)
  if self.asynchronous and S > 1 then
    A.fail(('asynchronous ps (max_staleness %d) runs one server, got ps_servers = %d'):format(self.k, S))
  end
  self.S, self.own = S, B.owners(self.optimizer, name)
  local p1 = self.params[1]
  for _, p in ipairs(self.params) do
    if p.dtype ~= p1.dtype or p.device ~= p1.device then
      A.fail(('ps keeps one dtype and device per shard; %s is %s on %s, %s is %s on %s'):format(
        self.names[p1], p1.dtype, p1.device, self.names[p], p.dtype, p.device))
    end
  end
  -- deal the parameters: largest first, to the least loaded server
  local order = { unpack(self.params) }
  local index = {}
  for i, p in ipairs(self.params) do index[p] = i end
  table.sort(order, function(a, b)
    if a:numel() ~= b:numel() then return a:numel() > b:numel() end
    return index[a] < index[b]
  end)
  self.shards, self.server_of = {}, {}
  for s = 1, S do self.shards[s] = { server = s - 1, params = {}, n = 0 } end
  for _, p in ipairs(order) do
    local best = self.shards[1]
    for _, sh in ipairs(self.shards) do if sh.n < best.n then best = sh end end
    best.params[#best.params + 1] = p
    best.n = best.n + p:numel()
    self.server_of[p] = best
  end
  for _, sh in ipairs(self.shards) do
    table.sort(sh.params, function(a, b) return index[a] < index[b] end)   -- model order inside a shard
    -- one more element: the version a message carries (asynchronous mode)
    sh.pflat = B.flat(sh.n + 1, p1.dtype, p1.device)
    sh.gflat = B.flat(sh.n + 1, p1.dtype, p1.device)
    local off = 0
    for _, p in ipairs(sh.params) do
      local v = B.view(sh.pflat, off, p.shape)
      v:copy_(p)
      Tensor.rebind(p, v.c)
      local gv = B.view(sh.gflat, off, p.shape)
      if p.grad then gv:copy_(p.grad) end
      p.grad = gv
      off = off + p:numel()
    end
  end
  self.mine = self.shards[self.comm.rank + 1]   -- nil: this rank serves no shard
  if self.asynchronous then self:_init_async() end
  return self
end

function PS:zero_grad() for _, sh in ipairs(self.shards) do sh.gflat:zero_() end end
function PS:before_micro_step() end
function PS:detach() end

function PS:average_number(x)
  if self.asynchronous then self:_quiesce() end
  return self.comm:all_reduce_number(x, 'avg')
end

-- push: every shard's gradient to its server, averaged
function PS:after_backward()
  if self.asynchronous then return end   -- pushed whole by step()
  local works = {}
  for _, sh in ipairs(self.shards) do
    works[#works + 1] = self.comm:reduce_async(sh.gflat, sh.server, 'avg')
  end
  for _, w in ipairs(works) do w:wait() end
end

-- (asynchronous: this rank's own gradient, all shards)
function PS:grad_norm()
  if self.asynchronous then
    local s = 0
    for _, sh in ipairs(self.shards) do s = s + B.sumsq(sh.gflat) end
    return math.sqrt(s)
  end
  local s = self.mine and B.sumsq(self.mine.gflat) or 0
  return math.sqrt(self.comm:all_reduce_number(s, 'sum'))
end

function PS:scale_grads(s)
  if self.asynchronous then for _, sh in ipairs(self.shards) do sh.gflat:mul_(s) end
  elseif self.mine then self.mine.gflat:mul_(s) end
end

-- the optimizer step of this server's parameters on the gradient in its gflat
function PS:_update_shard()
  local mine = self.mine
  local hidden = {}
  for _, p in ipairs(self.params) do
    if self.server_of[p] ~= mine then hidden[p] = p.grad; p.grad = nil end
  end
  local ok, err = pcall(self.optimizer.step, self.optimizer)
  for p, g in pairs(hidden) do p.grad = g end
  if not ok then error(err, 0) end
end

-- the server's update of its own parameters, then pull: every shard from its server
function PS:step()
  if self.asynchronous then return self:_step_async() end
  if self.mine then self:_update_shard() end
  local works = {}
  for _, sh in ipairs(self.shards) do works[#works + 1] = self.comm:broadcast_async(sh.pflat, sh.server) end
  for _, w in ipairs(works) do w:wait() end
end

function PS:optimizer_state_bytes()
  local n = 0
  for _, o in ipairs(self.optimizer.optimizers or { self.optimizer }) do
    for _, st in pairs(o.state or {}) do for _, t in pairs(st) do n = n + B.bytes(t) end end
  end
  return n
end

-- ------------------------------------------------------------ checkpoints
-- the state keys of parameter p: {key, kind}
local function keys_of(self, p)
  local w = self.own[p]
  local out = {}
  for _, k in ipairs(w.opt.state_keys) do out[#out + 1] = { w.opt.prefix .. w.name .. '.' .. k, k } end
  if optim.needs_master(p) then out[#out + 1] = { w.opt.prefix .. w.name .. '.master', 'master' } end
  return out
end

function PS:each_state(f)
  if not self.mine then return end
  for _, p in ipairs(self.mine.params) do
    local w = self.own[p]
    local st = w.opt.state[p]
    if st then for _, kk in ipairs(keys_of(self, p)) do f(kk[1], st[kk[2]], 0, false) end end
  end
end

function PS:state_layout()
  local out = {}
  for _, p in ipairs(self.params) do for _, kk in ipairs(keys_of(self, p)) do out[kk[1]] = p.shape end end
  return out
end

function PS:save_checkpoint(trainer, model_sd, _, state)
  if self.asynchronous then
    self:_quiesce()
    state.ps_versions = {}
    for i, sh in ipairs(self.shards) do state.ps_versions[i] = self:_version(sh.pflat) end
  end
  return shards.save(trainer, self, model_sd, state)
end

-- the state of this server's parameters, from any checkpoint (sharded or not)
function PS:load_checkpoint(_, c, path)
  local index = shards.index(path, c)
  if self.mine then
    for _, p in ipairs(self.mine.params) do
      local w = self.own[p]
      local st = {}
      for _, kk in ipairs(keys_of(self, p)) do
        local t = gl.zeros(p.shape, { dtype = 'float32', device = p.device }):keep()
        if kk[2] == 'master' and not index[kk[1]] then G.check(G.lib.gl_copy(t.c, p.c))  -- a float32 run's
        else shards.fill(index, kk[1], 0, t, path) end
        st[kk[2]] = t
      end
      w.opt.state[p] = st
    end
  end
  shards.set_steps(self.optimizer, c.state)
  if self.asynchronous then
    local vs = c.state.ps_versions or {}
    for i, sh in ipairs(self.shards) do self:_set_version(sh.pflat, vs[i] or 0) end
    self:_reset_versions()
  end
end

-- ------------------------------------------------------------ asynchronous
local ffi = G.ffi
pcall(ffi.cdef, 'int usleep(unsigned int usec);')
local now = require('gptlua.cli').now
local PARKED = -1

function PS:_version(t) return t:get(t:numel()) end
function PS:_set_version(t, v) t:set(v, t:numel()) end

function PS:_init_async()
  local N, me = self.comm.size, self.comm.rank
  self.log, self.since = {}, { max = 0, sum = 0, n = 0 }
  self.applied, self.dropped = 0, 0
  if self.mine then
    local sh, dtype, device = self.mine, self.params[1].dtype, self.params[1].device
    sh.V = 0
    sh.inbox, sh.outbox, sh.recv_work, sh.send_work = {}, {}, {}, {}
    sh.queue = {}
    for w = 0, N - 1 do
      sh.inbox[w] = B.flat(sh.n + 1, dtype, device)
      if w ~= me then sh.outbox[w] = B.flat(sh.n + 1, dtype, device) end
    end
  end
  self:_reset_versions()
end

-- after a quiesce (or a resume): every worker holds every shard at its
-- server's version and computes
function PS:_reset_versions()
  local sh = self.mine
  if not sh then return end
  sh.V = self:_version(sh.pflat)
  sh.v, sh.computing, sh.parked = {}, {}, {}
  for w = 0, self.comm.size - 1 do sh.v[w], sh.computing[w], sh.parked[w] = sh.V, true, false end
end

-- may server shard sh apply a push from worker x now (SSP bound): every
-- other worker whose update is not applied yet (computing, or queued)
-- stays within k versions
function PS:_may_apply(sh, x)
  local queued = {}
  for _, w in ipairs(sh.queue) do queued[w] = true end
  for w = 0, self.comm.size - 1 do
    if w ~= x and (sh.computing[w] or queued[w]) and sh.V + 1 - sh.v[w] > self.k then return false end
  end
  return true
end

-- server: one pass over the inboxes and the queue; true if anything happened
function PS:_serve()
  local sh = self.mine
  if not sh then return false end
  local moved = false
  local me = self.comm.rank
  for w = 0, self.comm.size - 1 do
    if w ~= me then
      local rw = sh.recv_work[w]
      if not rw and not sh.parked[w] then   -- post the receive of w's next message
        sh.recv_work[w] = self.comm:recv_async(sh.inbox[w], w)
      elseif rw and rw:test() then
        sh.recv_work[w] = nil
        moved = true
        if self:_version(sh.inbox[w]) == PARKED then sh.parked[w], sh.computing[w] = true, false
        else sh.computing[w] = false; sh.queue[#sh.queue + 1] = w end
      end
    end
  end
  -- the oldest parameters first
  table.sort(sh.queue, function(a, b)
    local va, vb = self:_version(sh.inbox[a]), self:_version(sh.inbox[b])
    if va ~= vb then return va < vb end
    return a < b
  end)
  local i = 1
  while i <= #sh.queue do
    local x = sh.queue[i]
    local too_stale = sh.V - self:_version(sh.inbox[x]) > self.k
    if too_stale or self:_may_apply(sh, x) then
      table.remove(sh.queue, i)
      self:_apply(sh, x, too_stale)
      moved = true
      i = 1
    else
      i = i + 1
    end
  end
  return moved
end

-- server: applies worker x's push (or, when it is more than k versions
-- old, drops it: the rare case of several pushes queued at the bound) and
-- replies with the shard
function PS:_apply(sh, x, drop)
  local staleness = sh.V - self:_version(sh.inbox[x])
  if drop then
    self.dropped = self.dropped + 1
    self.log[#self.log + 1] = { x, staleness, true }
  else
    G.check(G.lib.gl_copy(sh.gflat.c, sh.inbox[x].c))
    self:_update_shard()
    sh.V = sh.V + 1
    self:_set_version(sh.pflat, sh.V)
    self.applied = self.applied + 1
    self.log[#self.log + 1] = { x, staleness }
    local m = self.since
    m.max, m.sum, m.n = math.max(m.max, staleness), m.sum + staleness, m.n + 1
  end
  sh.v[x], sh.computing[x] = sh.V, true
  if x ~= self.comm.rank then
    if sh.send_work[x] then sh.send_work[x]:wait() end
    sh.outbox[x]:copy_(sh.pflat)
    sh.send_work[x] = self.comm:send_async(sh.outbox[x], x)
  else
    sh.own_applied = true
  end
end

-- waits for every Work in list (and this rank's own update when own is
-- true) while serving; errors after the communicator's timeout
function PS:_wait_serving(works, own, what)
  local deadline = now() + (self.comm.timeout or 600)
  while true do
    local pending = own and not self.mine.own_applied
    for _, w in pairs(works) do if not w:test() then pending = true end end
    if not pending then return end
    if not self:_serve() then
      if now() > deadline then
        error(('ps: rank %d waited %g s for %s'):format(self.comm.rank, self.comm.timeout or 600, what), 0)
      end
      ffi.C.usleep(50)
    end
  end
end

-- worker: push this rank's gradient of every shard, pull the shards back
function PS:_step_async()
  local me = self.comm.rank
  local sends, recvs = {}, {}
  local own = false
  for _, sh in ipairs(self.shards) do
    self:_set_version(sh.gflat, self:_version(sh.pflat))
    if sh == self.mine then
      sh.inbox[me]:copy_(sh.gflat)
      sh.computing[me] = false
      sh.queue[#sh.queue + 1] = me
      sh.own_applied, own = false, true
    else
      sends[#sends + 1] = self.comm:send_async(sh.gflat, sh.server)
      recvs[#recvs + 1] = self.comm:recv_async(sh.pflat, sh.server)
    end
  end
  self:_wait_serving(sends, false, 'its pushes to the servers')
  self:_wait_serving(recvs, own, "the servers' replies")
end

-- every worker parks, servers serve until all are parked, every shard is
-- broadcast from its server: then a collective may run
function PS:_quiesce()
  local me = self.comm.rank
  local sends = {}
  for _, sh in ipairs(self.shards) do
    if sh == self.mine then sh.parked[me], sh.computing[me] = true, false
    else
      self:_set_version(sh.gflat, PARKED)
      sends[#sends + 1] = self.comm:send_async(sh.gflat, sh.server)
    end
  end
  self:_wait_serving(sends, false, 'its park messages to the servers')
  local sh = self.mine
  if sh then
    local deadline = now() + (self.comm.timeout or 600)
    while true do
      self:_serve()
      local all = #sh.queue == 0
      for w = 0, self.comm.size - 1 do if not sh.parked[w] then all = false end end
      if all then break end
      if now() > deadline then error(('ps: server rank %d waited for every worker to park'):format(me), 0) end
      ffi.C.usleep(50)
    end
    for _, w in pairs(sh.send_work) do w:wait() end
    sh.send_work = {}
  end
  local works = {}
  for _, s in ipairs(self.shards) do works[#works + 1] = self.comm:broadcast_async(s.pflat, s.server) end
  for _, w in ipairs(works) do w:wait() end
  self:_reset_versions()
end

-- staleness of the updates this rank applied since the last call (metrics)
function PS:metrics()
  if not self.asynchronous then return {} end
  local m = self.since
  self.since = { max = 0, sum = 0, n = 0 }
  return { staleness_max = m.max, staleness_mean = m.n > 0 and m.sum / m.n or 0, updates = self.applied,
    dropped = self.dropped }
end

return PS
