-- gptlua.dist.policies.powersgd — PowerSGD gradient compression (Vogels et
-- al. 2019) as DDP's communication hook: dist = 'ddp', powersgd_rank = r.
--
-- Every gradient matrix M (n x m: a parameter's first dimension by the rest)
-- is replaced by a rank-r approximation P Q^T agreed on by all ranks, with
-- error feedback so that what compression leaves out is sent later:
--   M = grad + e                        (e: this rank's error, kept)
--   P = M Q,  P = avg over ranks(P),  P = orthonormalised columns (Gram-Schmidt)
--   Q = M^T P,  Q = avg over ranks(Q)
--   grad = P Q^T,  e = M - P Q^T
-- Q starts random (the same seed on every rank) and is reused from the last
-- step (one power iteration per step, warm-started).  r is min(powersgd_rank,
-- n, m); at r = min(n, m) the approximation is the exact average (P spans
-- the averaged matrix's columns), so a full-rank hook equals DDP.  Vectors
-- (biases, norms' gains) are all-reduced uncompressed.
--
-- Layout: the P's of all matrices in one flat buffer, the Q's in another,
-- the vectors in a third: one step is three all-reduces, after backward
-- (the second needs the first's result, so the hook does not overlap
-- backward as DDP's bucket all-reduces do).  Bytes per step and rank:
-- 2(N-1)/N * s * (sum over matrices of (n + m) r + vector elements), s the
-- gradient dtype's size, against DDP's 2(N-1)/N * s * P.
-- The error buffers and Q are per-rank state: checkpoints hold them (the
-- policy's optim.rankNNNNN.safetensors), so a resume continues exactly.
local gl = require 'gptlua'
local B = require 'gptlua.dist.policies.base'
local shards = require 'gptlua.dist.policies.shards'
local ckpt = require 'gptlua.checkpoint'

local PowerSGD = {}
PowerSGD.__index = PowerSGD

-- ------------------------------------------------------------ checkpoints
-- DDP's optimizer state is alike on every rank (optim.safetensors, as a
-- plain checkpoint's); each rank's error buffers and Q's go to its own file
-- (dist.policies.shards), "powersgd.<param>.error" and ".q".
local function each_state(d, f)
  for k, t in pairs(d.optimizer:state_dict().tensors) do f(k, t, 0, true) end
  local self = d.powersgd
  for _, mt in ipairs(self.mats) do
    f('powersgd.' .. self.names[mt.p] .. '.error', mt.e, 0, false)
    f('powersgd.' .. self.names[mt.p] .. '.q', mt.Q, 0, false)
  end
end

local function state_layout(d)
  local out = {}
  for k, t in pairs(d.optimizer:state_dict().tensors) do out[k] = t.shape end
  return out
end

local function save_checkpoint(d, trainer, model_sd, _, state)
  state.powersgd = { rank = d.powersgd.rank }
  return shards.save(trainer, d, model_sd, state)
end

-- The optimizer state (from any DDP checkpoint); this rank's error buffers
-- and Q's when the checkpoint has them for as many ranks and the same rank
-- r (else compression starts afresh: zero error, Q as at the start).
local function load_checkpoint(d, _, c, path)
  local st = c.state
  d.optimizer:load_state_dict({ step = st.opt_step, steps = st.opt_steps, tensors = shards.full_tensors(path, c) })
  local self = d.powersgd
  local sh = st.shards
  if not (st.powersgd and st.powersgd.rank == self.rank and sh and sh.world == d.comm.size) then return end
  local mine = ckpt.load_safetensors(path .. '/' .. shards.rank_file(d.comm.rank))
  for _, mt in ipairs(self.mats) do
    for what, t in pairs({ error = mt.e, q = mt.Q }) do
      local k = ('powersgd.%s.%s@0'):format(self.names[mt.p], what)
      local src = mine[k]
      if not src or src:numel() ~= t:numel() then
        error(('resume: checkpoint %s lacks %s (%d elements) of rank %d'):format(path, k, t:numel(), d.comm.rank), 0)
      end
      t:copy_(src:view(t.shape))
    end
  end
end

-- Hooks the PowerSGD compression into the DDP policy `ddp` (its buckets
-- already hold the gradients); model (optional) names the parameters in
-- checkpoints.
function PowerSGD.install(ddp, rank, model)
  if type(rank) ~= 'number' or rank ~= math.floor(rank) or rank < 0 then
    error(('config: powersgd_rank expected an integer >= 0, got %s'):format(tostring(rank)), 0)
  end
  local self = setmetatable({ ddp = ddp, rank = rank, mats = {}, vecs = {}, names = {} }, PowerSGD)
  if model then for _, np in ipairs(model:named_parameters()) do self.names[np[2]] = np[1] end end
  for i, p in ipairs(ddp.params) do self.names[p] = self.names[p] or ('p' .. i) end
  local np, nq, nv = 0, 0, 0
  local first = ddp.params[1]
  for i, p in ipairs(ddp.params) do
    if #p.shape >= 2 then
      local n = p.shape[1]
      local m = p:numel() / n
      local r = math.min(rank, n, m)
      self.mats[#self.mats + 1] = { p = p, n = n, m = m, r = r, poff = np, qoff = nq, index = i }
      np, nq = np + n * r, nq + m * r
    else
      self.vecs[#self.vecs + 1] = { p = p, off = nv }
      nv = nv + p:numel()
    end
  end
  local dtype, device = first.dtype, first.device
  self.pbuf = np > 0 and B.flat(np, dtype, device) or nil
  self.qbuf = nq > 0 and B.flat(nq, dtype, device) or nil
  self.vbuf = nv > 0 and B.flat(nv, dtype, device) or nil
  self.dot = B.flat(1, dtype, device)
  for _, mt in ipairs(self.mats) do
    mt.P = B.view(self.pbuf, mt.poff, { mt.n, mt.r })
    mt.Q = B.view(self.qbuf, mt.qoff, { mt.m, mt.r })
    mt.Q:copy_(gl.randn({ mt.m, mt.r }, { seed = 1000003 + mt.index, dtype = dtype, device = device }))
    mt.e = B.flat(mt.n * mt.m, dtype, device):view(mt.n, mt.m):keep()
  end
  ddp.powersgd = self
  -- DDP's hook points: nothing starts from backward; after_backward compresses
  ddp._launch = function() end
  ddp._finish = function(d) if d.sync then self:reduce() end end
  ddp.each_state, ddp.state_layout = each_state, state_layout
  ddp.save_checkpoint, ddp.load_checkpoint = save_checkpoint, load_checkpoint
  return self
end

-- Orthonormalises the columns of P (n x r) in place: modified Gram-Schmidt,
-- twice per column ("twice is enough"): where P has fewer independent
-- columns than r, what one pass leaves of a dependent column is rounding
-- noise that still leans on the earlier columns, and normalising it would
-- make a column far from orthogonal; the second pass removes that.  A
-- column that vanishes exactly stays zero.
function PowerSGD:_orthonormalise(P, r)
  local cols = {}
  for j = 1, r do cols[j] = P:narrow(2, j, 1) end
  for j = 1, r do
    local c = cols[j]
    for _ = 1, 2 do
      for k = 1, j - 1 do
        gl.matmul_raw(cols[k]:t(), c, self.dot:view(1, 1))
        local d = self.dot:item()
        if d ~= 0 then c:add_(cols[k], -d) end
      end
      local norm = math.sqrt(B.sumsq(c))
      if norm > 0 then c:mul_(1 / norm) end
    end
  end
end

-- The compressed all-reduce of every gradient (after backward).
function PowerSGD:reduce()
  local comm = self.ddp.comm
  gl.scope(function()
    local vwork
    if self.vbuf then
      for _, v in ipairs(self.vecs) do B.view(self.vbuf, v.off, v.p.shape, false):copy_(v.p.grad) end
      vwork = comm:all_reduce_async(self.vbuf, 'avg')
    end
    for _, mt in ipairs(self.mats) do
      local M = mt.p.grad:view(mt.n, mt.m)
      M:add_(mt.e)
      gl.matmul_raw(M, mt.Q, mt.P)
    end
    if self.pbuf then comm:all_reduce(self.pbuf, 'avg') end
    for _, mt in ipairs(self.mats) do
      self:_orthonormalise(mt.P, mt.r)
      gl.matmul_raw(mt.p.grad:view(mt.n, mt.m):t(), mt.P, mt.Q)
    end
    if self.qbuf then comm:all_reduce(self.qbuf, 'avg') end
    for _, mt in ipairs(self.mats) do
      local M = mt.p.grad:view(mt.n, mt.m)
      mt.e:copy_(M)
      gl.matmul_raw(mt.P, mt.Q:t(), mt.e, 1, -1)    -- e = M - P Q^T
      gl.matmul_raw(mt.P, mt.Q:t(), M, 0)           -- grad = P Q^T
    end
    if vwork then
      vwork:wait()
      for _, v in ipairs(self.vecs) do v.p.grad:copy_(B.view(self.vbuf, v.off, v.p.shape, false)) end
    end
  end)
end

return PowerSGD
