-- gptlua.dist.fsdp_checkpoint — the FSDP policy's inspection and checkpoints:
-- persistent bytes per rank, the whole model gathered unit by unit, and each
-- rank's pieces of parameters and optimizer state written and re-cut on load
-- (gptlua.dist.policies.shards).  Methods of the FSDP policy (gptlua.dist.fsdp
-- mixes them in).

local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local B = require 'gptlua.dist.policies.base'
local G = require 'gptlua.ffi'
local Tensor = gl.Tensor
local ffi, lib = G.ffi, G.lib

local function view(buf, off, shape) return B.view(buf, off, shape) end
local function tmp_view(buf, off, n) return B.view(buf, off, { n }, false) end
local function shaped(buf, off, shape) return B.view(buf, off, shape, false) end

local FSDP = {}

-- ---------------------------------------------------------- inspection --
-- Bytes this rank holds persistently: parameter shards, gradient shards,
-- optimizer state (AdamW m and v of its pieces, Muon momentum of its
-- matrices), fp32 master shards (0 unless the parameters are bfloat16).
function FSDP:state_bytes()
  local r = { params = 0, grads = 0, optimizer = 0, master = 0 }
  for _, u in ipairs(self.units) do
    r.params = r.params + B.bytes(u.pshard)
    r.grads = r.grads + B.bytes(u.gshard)
    if u.m then r.optimizer = r.optimizer + B.bytes(u.m) + B.bytes(u.v) end
    if u.master then r.master = r.master + B.bytes(u.master) end
  end
  for _, m in ipairs(self.muon and self.muon.owned or {}) do
    r.optimizer = r.optimizer + B.bytes(m.buf) + (m.vbuf and B.bytes(m.vbuf) or 0)
  end
  return r
end

function FSDP:optimizer_state_bytes() return self:state_bytes().optimizer end

-- name -> whole parameter (a fresh CPU tensor) and persistent buffers.
-- Collective over the shard group (every rank must call it); with
-- on_rank (a world rank) only that rank copies, the others get {}.
function FSDP:full_state_dict(on_rank)
  local out = {}
  local copy = on_rank == nil or on_rank == self.comm.rank
  for _, u in ipairs(self.units) do
    if u.f8_gathered or u.works then self:_release(u) end  -- gathered as FP8 codes: gather exactly
    local was = u.state
    if u.state == 'sharded' then self:_start_gather(u, true) end
    if u.state == 'gathering' then self:_wait_gather(u) end
    for i, p in ipairs(u.params) do
      if copy then
        local t = Tensor.empty(p.shape, { dtype = p.dtype, device = 'cpu' })
        G.check(lib.gl_copy(t.c, shaped(u.full, u.offs[i], p.shape).c), 2)
        out[u.names[i]] = t
      end
    end
    if was == 'sharded' then self:_release(u) end
  end
  if not copy then return out end
  for _, nb in ipairs(self.model:named_buffers()) do out[nb[1]] = nb[2] end
  return out
end

-- load_state_dict of the wrapped model: a whole state dict (a checkpoint's
-- model.safetensors, pretrained weights) goes into the shards.  The module's
-- own load_state_dict checks and copies it into local full buffers (no
-- communication); each rank keeps its range.
function FSDP:_load_full(orig, m, sd, opts)
  for _, u in ipairs(self.units) do
    self:_release(u)
    u.full = gl.empty({ u.padded }, { dtype = u.dtype, device = u.device }):keep()
    for i, p in ipairs(u.params) do Tensor.rebind(p, view(u.full, u.offs[i], p.shape).c) end
  end
  local ok, missing, extra = pcall(orig, m, sd, opts)
  for _, u in ipairs(self.units) do
    if ok then
      for _, pc in ipairs(u.pieces) do
        if sd[pc.name] ~= nil then
          local src = tmp_view(u.full, u.offs[pc.i] + pc.poff, pc.len)
          G.check(lib.gl_copy(tmp_view(u.pshard, pc.start, pc.len).c, src.c), 2)
          if u.master then G.check(lib.gl_copy(tmp_view(u.master, pc.start, pc.len).c, src.c), 2) end
        end
      end
    end
    for _, p in ipairs(u.params) do Tensor.release(p) end
    u.full:free()
    u.full = nil
  end
  if not ok then error(missing, 2) end
  return missing, extra
end

-- -------------------------------------------------------------- checkpoints --
local function key(w, k) return w.opt.prefix .. w.name .. '.' .. k end

-- f(key, tensor, offset, false, kind) for every piece this rank holds:
-- parameters ("param.<name>", kind 'param'), AdamW m and v, Muon momentum
-- (kind 'state') and fp32 masters (kind 'master').  (The fourth argument
-- is gptlua.dist.policies.shards' `replicated`: no piece is.)  Only the
-- first replica reports (HSDP replicas hold the same pieces) unless all is
-- true.
function FSDP:each_state(f, all)
  if self.replica_rank ~= 0 and not all then return end
  for _, u in ipairs(self.units) do
    for _, pc in ipairs(u.pieces) do
      f('param.' .. pc.name, tmp_view(u.pshard, pc.start, pc.len), pc.poff, false, 'param')
      if u.master and pc.w then f(key(pc.w, 'master'), tmp_view(u.master, pc.start, pc.len), pc.poff, false, 'master') end
    end
    for _, pc in ipairs(u.adam) do
      f(key(pc.w, 'm'), pc.mv, pc.poff, false, 'state')
      f(key(pc.w, 'v'), pc.vv, pc.poff, false, 'state')
    end
  end
  for _, m in ipairs(self.muon and self.muon.owned or {}) do
    f(key(m.w, 'momentum_buffer'), m.buf, 0, false, 'state')
    if m.vbuf then f(key(m.w, 'second_momentum_buffer'), m.vbuf, 0, false, 'state') end
  end
end

-- key -> shape of every tensor of the whole (unsharded) optimizer state,
-- masters included (as the single-process optimizers name them)
function FSDP:state_layout()
  local out = {}
  for p, w in pairs(self.own) do
    local u = self.unit_of[p]
    if u then
      for _, e in ipairs(w.opt:param_state(p, w.group)) do out[key(w, e[1])] = e[2] end
      if u.master then out[key(w, 'master')] = p.shape end
    end
  end
  return out
end

-- Collective over the world: every rank writes its pieces, rank 0 the
-- state and the whole model.
function FSDP:save_checkpoint(trainer, model_sd, opt_sd, state)
  local full = self:full_state_dict(0)
  state.fsdp = { shard_size = self.S }
  return require('gptlua.dist.policies.shards').save(trainer, self, full, state)
end

-- Parameters from their pieces when the checkpoint has them (else the
-- trainer's load_state_dict already put the whole model in), optimizer
-- state from pieces or whole tensors, re-cut for this layout.
-- Masters come from the checkpoint's master pieces or whole tensors; where
-- it has none (a float32 run's checkpoint) from its parameter pieces, else
-- from the whole model load_state_dict put in.
function FSDP:load_checkpoint(trainer, c, path)
  local shards = require 'gptlua.dist.policies.shards'
  local index = shards.index(path, c)
  for _, u in ipairs(self.units) do
    for _, pc in ipairs(u.pieces) do
      local k = 'param.' .. pc.name
      if index[k] then
        shards.fill(index, k, pc.poff, tmp_view(u.pshard, pc.start, pc.len), path)
        if u.master then shards.fill(index, k, pc.poff, tmp_view(u.master, pc.start, pc.len), path) end
      end
    end
  end
  self:each_state(function(k, t, off, _, kind)
    if kind == 'state' or (kind == 'master' and index[k]) then shards.fill(index, k, off, t, path) end
  end, true)
  shards.set_steps(self.optimizer, c.state)
end


return FSDP
