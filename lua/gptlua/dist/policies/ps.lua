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
-- Asynchronous (k > 0).  Every rank pushes its own gradient (a point-to-
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
-- from fresh parameters.)  Servers serve whenever their rank is inside the
-- policy (while waiting for its replies).  Before any collective
-- (average_number: evals; checkpoints) every worker parks (a PARK
-- message), the servers serve until all are parked, and every shard is
-- broadcast from its server, so every rank continues from the servers'
-- parameters.  The trainer's per-step {loss, stop} all-reduce is skipped
-- (policy.asynchronous): the logged loss is rank 0's own, and stop signals
-- are not acted on (the ranks do not meet each step to agree on the step
-- to stop at; a limit of this mode: the run ends at max_iters).  Every
-- applied update's staleness is recorded: metrics staleness_max /
-- staleness_mean / updates / dropped since the last log record (rank 0's,
-- the server of shard 1, which every push reaches), policy.log the whole
-- list {worker, staleness[, dropped]}.  The order of updates depends on
-- timing: asynchronous runs do not repeat exactly.  Bytes per step: every
-- worker sends each server its shard's gradient and receives it back.
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

-- the version a flat buffer carries in its last element (asynchronous
-- mode), and a message's kind in the one before
local function version(t) return t:get(t:numel()) end
local function set_version(t, v) t:set(v, t:numel()) end
local function kind(t) return t:get(t:numel() - 1) end

local PS = {}
PS.__index = PS

function PS.new(name, o)
  local self = A.init(setmetatable({}, PS), name, o)
  local N = self.comm.size
  local S = A.check_int(self.cfg, 'ps_servers', 1)
  if S > N then A.fail(('ps_servers expected at most the number of ranks (%d), got %d'):format(N, S)) end
  self.k = A.check_int(self.cfg, 'max_staleness', 0)
  self.asynchronous = self.k > 0
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

function PS:optimizer_state_bytes() return B.optimizer_state_bytes(self.optimizer) end

-- ------------------------------------------------------------ checkpoints
-- the state keys of parameter p: {key, kind}
local function keys_of(self, p)
  local w = self.own[p]
  local out = {}
  for _, e in ipairs(w.opt:param_state(p, w.group)) do out[#out + 1] = { w.opt.prefix .. w.name .. '.' .. e[1], e[1], e[2] } end
  if optim.needs_master(p) then out[#out + 1] = { w.opt.prefix .. w.name .. '.master', 'master', p.shape } end
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
  for _, p in ipairs(self.params) do for _, kk in ipairs(keys_of(self, p)) do out[kk[1]] = kk[3] end end
  return out
end

function PS:save_checkpoint(trainer, model_sd, _, state)
  if self.asynchronous then
    self:_quiesce()
    state.ps_versions = {}
    for i, sh in ipairs(self.shards) do state.ps_versions[i] = version(sh.pflat) end
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
    for i, sh in ipairs(self.shards) do set_version(sh.pflat, vs[i] or 0) end
    self:_reset_versions()
  end
end

-- ------------------------------------------------------------ asynchronous
-- Messages.  send/recv carry no tag, so every message between two ranks has
-- one size, M = the largest shard + 2, and says what it is: elements
-- [0, n) the shard's data, M-2 its kind (PUSH: a gradient for the
-- receiver's shard; REPLY: the sender's shard; PARK), M-1 the version.
-- Each rank keeps at most one receive posted per peer (only while it
-- expects something from it: a server from workers not parked, a worker
-- from the servers it awaits), so none is left pending at the end.
local ffi = G.ffi
require 'gptlua.libc'   -- usleep
local now = require('gptlua.cli').now
local PUSH, REPLY, PARK = 1, 2, 3


function PS:_init_async()
  local N, me = self.comm.size, self.comm.rank
  local dtype, device = self.params[1].dtype, self.params[1].device
  local maxn = 0
  for _, sh in ipairs(self.shards) do maxn = math.max(maxn, sh.n) end
  self.M = maxn + 2
  self.log, self.since = {}, { max = 0, sum = 0, n = 0 }
  self.applied, self.dropped = 0, 0
  self.chan, self.chan_work, self.awaiting = {}, {}, {}
  for p = 0, N - 1 do if p ~= me then self.chan[p] = B.flat(self.M, dtype, device) end end
  for _, sh in ipairs(self.shards) do
    sh.out = B.flat(self.M, dtype, device)   -- this rank's push or park to sh's server
    sh.data = B.view(sh.out, 0, { sh.n })
  end
  if self.mine then
    local sh = self.mine
    sh.inbox, sh.outbox, sh.send_work, sh.queue = {}, {}, {}, {}
    for w = 0, N - 1 do
      sh.inbox[w] = B.flat(self.M, dtype, device)
      if w ~= me then sh.outbox[w] = B.flat(self.M, dtype, device) end
    end
  end
  self:_reset_versions()
end

-- after a quiesce (or a resume): every worker holds every shard at its
-- server's version and computes
function PS:_reset_versions()
  local sh = self.mine
  if not sh then return end
  sh.V = version(sh.pflat)
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

-- a message from peer p arrived in chan[p]
function PS:_dispatch(p, msg)
  local k, sh = kind(msg), self.mine
  if k == REPLY then
    local from = self.shards[p + 1]
    G.check(G.lib.gl_copy(B.view(from.pflat, 0, { from.n }, false).c, B.view(msg, 0, { from.n }, false).c))
    set_version(from.pflat, version(msg))
    self.awaiting[p] = nil
  elseif k == PARK then
    sh.parked[p], sh.computing[p] = true, false
  else
    sh.inbox[p]:copy_(msg)
    sh.computing[p] = false
    sh.queue[#sh.queue + 1] = p
  end
end

-- one pass: receives what arrived, applies what the bound allows; true if
-- anything happened
function PS:_serve()
  local moved = false
  local sh = self.mine
  for p = 0, self.comm.size - 1 do
    if p ~= self.comm.rank then
      local rw = self.chan_work[p]
      if rw == nil then
        if self.awaiting[p] or (sh and not sh.parked[p]) then
          self.chan_work[p] = self.comm:recv_async(self.chan[p], p)
        end
      elseif rw:test() then
        self.chan_work[p] = nil
        self:_dispatch(p, self.chan[p])
        moved = true
      end
    end
  end
  if not sh then return moved end
  -- the oldest parameters first
  table.sort(sh.queue, function(a, b)
    local va, vb = version(sh.inbox[a]), version(sh.inbox[b])
    if va ~= vb then return va < vb end
    return a < b
  end)
  local i = 1
  while i <= #sh.queue do
    local x = sh.queue[i]
    local too_stale = sh.V - version(sh.inbox[x]) > self.k
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
  local staleness = sh.V - version(sh.inbox[x])
  if drop then
    self.dropped = self.dropped + 1
    self.log[#self.log + 1] = { x, staleness, true }
  else
    G.check(G.lib.gl_copy(B.view(sh.gflat, 0, { sh.n }, false).c, B.view(sh.inbox[x], 0, { sh.n }, false).c))
    self:_update_shard()
    sh.V = sh.V + 1
    set_version(sh.pflat, sh.V)
    self.applied = self.applied + 1
    self.log[#self.log + 1] = { x, staleness }
    local m = self.since
    m.max, m.sum, m.n = math.max(m.max, staleness), m.sum + staleness, m.n + 1
  end
  sh.v[x], sh.computing[x] = sh.V, true
  if x ~= self.comm.rank then
    if sh.send_work[x] then sh.send_work[x]:wait() end
    local out = sh.outbox[x]
    G.check(G.lib.gl_copy(B.view(out, 0, { sh.n }, false).c, B.view(sh.pflat, 0, { sh.n }, false).c))
    out:set(REPLY, self.M - 1)
    set_version(out, sh.V)
    sh.send_work[x] = self.comm:send_async(out, x)
  else
    sh.own_applied = true
  end
end

-- serves until done() is true; errors after the communicator's timeout
function PS:_serve_until(done, what)
  local deadline = now() + (self.comm.timeout or 600)
  while not done() do
    if not self:_serve() then
      if now() > deadline then
        error(('ps: rank %d waited %g s for %s'):format(self.comm.rank, self.comm.timeout or 600, what), 0)
      end
      ffi.C.usleep(50)
    end
  end
end

local function all_done(works)
  for _, w in pairs(works) do if not w:test() then return false end end
  return true
end

-- sends kind (PUSH or PARK) to every server but this rank's own
function PS:_send_all(k)
  local sends = {}
  for _, sh in ipairs(self.shards) do
    if sh ~= self.mine then
      if k == PUSH then sh.data:copy_(B.view(sh.gflat, 0, { sh.n }, false)) end
      sh.out:set(k, self.M - 1)
      set_version(sh.out, version(sh.pflat))
      if k == PUSH then self.awaiting[sh.server] = true end
      sends[#sends + 1] = self.comm:send_async(sh.out, sh.server)
    end
  end
  return sends
end

-- worker: push this rank's gradient of every shard, pull the shards back
function PS:_step_async()
  local me, sh = self.comm.rank, self.mine
  if sh then
    G.check(G.lib.gl_copy(B.view(sh.inbox[me], 0, { sh.n }, false).c, B.view(sh.gflat, 0, { sh.n }, false).c))
    set_version(sh.inbox[me], version(sh.pflat))
    sh.computing[me], sh.own_applied = false, false
    sh.queue[#sh.queue + 1] = me
  end
  local sends = self:_send_all(PUSH)
  self:_serve_until(function()
    return all_done(sends) and next(self.awaiting) == nil and (not sh or sh.own_applied)
  end, "the servers' replies")
end

-- every worker parks, servers serve until all are parked, every shard is
-- broadcast from its server: then a collective may run
function PS:_quiesce()
  local me, sh = self.comm.rank, self.mine
  if sh then sh.parked[me], sh.computing[me] = true, false end
  local sends = self:_send_all(PARK)
  self:_serve_until(function()
    if not all_done(sends) then return false end
    if not sh then return true end
    if #sh.queue > 0 then return false end
    for w = 0, self.comm.size - 1 do if not sh.parked[w] then return false end end
    return true
  end, 'every worker to park')
  if sh then
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
