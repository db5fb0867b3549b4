-- gptlua.dist.fsdp_muon — the FSDP policy's Muon part: which rank owns each
-- whole matrix, the all-to-all layouts that bring a matrix's averaged gradient
-- pieces to its owner, and the owner's update sent back as pieces.  Methods of
-- the FSDP policy (gptlua.dist.fsdp mixes them in); see fsdp.lua's header for
-- the scheme and its volume.

local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local optim = require 'gptlua.optim'
local B = require 'gptlua.dist.policies.base'
local G = require 'gptlua.ffi'
local ffi, lib = G.ffi, G.lib

local function fail(msg, level) error('dist.policy: ' .. msg, (level or 1) + 1) end
local function tmp_view(buf, off, n) return B.view(buf, off, { n }, false) end

local FSDP = {}

-- Muon: owners of whole matrices, and the all-to-all layouts.  For each
-- pair of ranks the pieces travel in matrix order, so both sides agree on
-- the layout without telling each other.
function FSDP:_plan_muon()
  local S, s = self.S, self.s
  local mats = {}
  for _, u in ipairs(self.units) do
    for i, p in ipairs(u.params) do
      local w = self.own[p]
      if w and w.kind == 'muon' then
        local m = { u = u, i = i, p = p, w = w, pieces = {} }
        for q = 0, S - 1 do   -- rank q holds [lo, hi) of the matrix's elements
          local lo = math.max(u.offs[i], q * u.c) - u.offs[i]
          local hi = math.min(u.offs[i] + p:numel(), (q + 1) * u.c) - u.offs[i]
          if hi > lo then m.pieces[q] = { eoff = lo, len = hi - lo, start = u.offs[i] + lo - q * u.c } end
        end
        mats[#mats + 1] = m
      end
    end
  end
  if #mats == 0 then return end
  local dtype, device = mats[1].u.dtype, mats[1].u.device
  for _, m in ipairs(mats) do
    if m.u.dtype ~= dtype or m.u.device ~= device then
      fail(('fsdp: Muon matrices must share one dtype and device (%s is %s@%s)'):format(
        self.name_of[m.p], m.u.dtype, m.u.device), 3)
    end
  end
  local load = {}
  for q = 0, S - 1 do load[q] = 0 end
  for _, m in ipairs(mats) do
    local best
    for q = 0, S - 1 do
      local held = m.pieces[q] and m.pieces[q].len or 0
      if not best or load[q] < load[best] or (load[q] == load[best] and held > (m.pieces[best] and m.pieces[best].len or 0)) then
        best = q
      end
    end
    m.owner = best
    load[best] = load[best] + m.p:numel()
  end
  local mu = { send = {}, owned = {}, send_counts = {}, recv_counts = {} }
  local pos = 0
  for d = 0, S - 1 do                 -- my pieces, grouped by owner
    local n = 0
    for _, m in ipairs(mats) do
      local pc = m.pieces[s]
      if m.owner == d and pc then
        mu.send[#mu.send + 1] = { m = m, pos = pos, start = pc.start, len = pc.len }
        pos, n = pos + pc.len, n + pc.len
      end
    end
    mu.send_counts[d + 1] = n
  end
  mu.nsend, pos = pos, 0
  for _, m in ipairs(mats) do
    if m.owner == s then
      m.buf = gl.zeros(m.p.shape, { dtype = 'float32', device = device }):keep()
      if m.w.group.normuon_beta2 > 0 then   -- NorMuon's second moment (muon_variant 'current')
        m.vbuf = gl.zeros(optim.Muon.second_moment_shape(m.p.shape), { dtype = 'float32', device = device }):keep()
      end
      m.from = {}
      mu.owned[#mu.owned + 1] = m
    end
  end
  for q = 0, S - 1 do                 -- pieces of my matrices, grouped by holder
    local n = 0
    for _, m in ipairs(mu.owned) do
      local pc = m.pieces[q]
      if pc then
        m.from[#m.from + 1] = { pos = pos, eoff = pc.eoff, len = pc.len }
        pos, n = pos + pc.len, n + pc.len
      end
    end
    mu.recv_counts[q + 1] = n
  end
  -- the updates go back in the dtype they are applied in (the masters')
  mu.nrecv, mu.dtype, mu.device = pos, dtype, device
  mu.update_dtype = mats[1].u.master and mats[1].u.master.dtype or dtype
  self.muon = mu
end


-- the averaged gradient pieces of every Muon matrix to its owner (async)
function FSDP:_muon_gather_grads()
  local mu = self.muon
  local send = gl.empty({ mu.nsend }, { dtype = mu.dtype, device = mu.device })
  for _, e in ipairs(mu.send) do
    G.check(lib.gl_copy(tmp_view(send, e.pos, e.len).c, tmp_view(e.m.u.gshard, e.start, e.len).c), 2)
  end
  local recv = gl.empty({ mu.nrecv }, { dtype = mu.dtype, device = mu.device })
  local work = self.shard:all_to_all_async(recv, send, { send_counts = mu.send_counts, recv_counts = mu.recv_counts })
  return { send = send, recv = recv, work = work }
end

-- owners: momentum + Newton–Schulz on whole matrices; the updates go back
-- to the ranks holding the pieces, which apply them to their shards
function FSDP:_muon_update(x)
  local mu = self.muon
  x.work:wait()
  x.send:free()
  local recv = x.recv
  -- the updates take the gradients' places in recv, or (fp32 masters) a
  -- buffer of the masters' dtype laid out alike
  local upd = mu.update_dtype == mu.dtype and recv
    or gl.empty({ mu.nrecv }, { dtype = mu.update_dtype, device = mu.device })
  for _, m in ipairs(mu.owned) do
    local grad = gl.empty(m.p.shape, { dtype = mu.dtype, device = mu.device })
    for _, f in ipairs(m.from) do G.check(lib.gl_copy(tmp_view(grad, f.eoff, f.len).c, tmp_view(recv, f.pos, f.len).c), 2) end
    -- (tensor parallel's update_direction: the whole matrix's, over tp)
    local dir = optim.Muon.tp_direction(m.w.opt, m.w.group)
    local X = dir and dir(m.p, grad, m.buf, m.w.group) or optim.Muon.update_direction(grad, grad, m.buf, m.w.group, m.vbuf)
    if X.dtype ~= mu.update_dtype then X = X:to(mu.update_dtype) end
    for _, f in ipairs(m.from) do G.check(lib.gl_copy(tmp_view(upd, f.pos, f.len).c, tmp_view(X, f.eoff, f.len).c), 2) end
    grad:free()
    dist.progress()
  end
  if upd ~= recv then recv:free() end
  local back = gl.empty({ mu.nsend }, { dtype = mu.update_dtype, device = mu.device })
  self.shard:all_to_all(back, upd, { send_counts = mu.recv_counts, recv_counts = mu.send_counts })
  upd:free()
  for _, e in ipairs(mu.send) do
    -- elementwise, so a piece takes its part (cautious weight decay included)
    local g, u, o = e.m.w.group, e.m.u, e.m.w.opt
    local shape = o.matrix_shape and o.matrix_shape(e.m.p) or e.m.p.shape
    optim.muon_apply(tmp_view(u.master or u.pshard, e.start, e.len), tmp_view(back, e.pos, e.len),
      optim.Muon.scaled_lr(g, shape), g)
  end
  back:free()
end


return FSDP
