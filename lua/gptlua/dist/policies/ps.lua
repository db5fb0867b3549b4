-- gptlua.dist.policies.ps — parameter servers, synchronous: dist = 'ps',
-- ps_servers = S.
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
  local k = A.check_int(self.cfg, 'max_staleness', 0)
  if k ~= 0 then
    A.fail(('max_staleness %d: asynchronous parameter servers are not implemented, only synchronous ones '
      .. '(max_staleness = 0)'):format(k))
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
    sh.pflat = B.flat(math.max(sh.n, 1), p1.dtype, p1.device)
    sh.gflat = B.flat(math.max(sh.n, 1), p1.dtype, p1.device)
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
  return self
end

function PS:zero_grad() for _, sh in ipairs(self.shards) do sh.gflat:zero_() end end
function PS:before_micro_step() end
function PS:average_number(x) return self.comm:all_reduce_number(x, 'avg') end
function PS:detach() end

-- push: every shard's gradient to its server, averaged
function PS:after_backward()
  local works = {}
  for _, sh in ipairs(self.shards) do
    works[#works + 1] = self.comm:reduce_async(sh.gflat, sh.server, 'avg')
  end
  for _, w in ipairs(works) do w:wait() end
end

function PS:grad_norm()
  local s = self.mine and B.sumsq(self.mine.gflat) or 0
  return math.sqrt(self.comm:all_reduce_number(s, 'sum'))
end

function PS:scale_grads(s) if self.mine then self.mine.gflat:mul_(s) end end

-- the server's update of its own parameters, then pull: every shard from its server
function PS:step()
  local mine = self.mine
  if mine then
    local hidden = {}
    for _, p in ipairs(self.params) do
      if self.server_of[p] ~= mine then hidden[p] = p.grad; p.grad = nil end
    end
    local ok, err = pcall(self.optimizer.step, self.optimizer)
    for p, g in pairs(hidden) do p.grad = g end
    if not ok then error(err, 0) end
  end
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
end

return PS
