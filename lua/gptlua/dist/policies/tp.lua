-- gptlua.dist.policies.tp — the trainer's policy for a tensor-parallel
-- model (gptlua.dist.tensor_parallel) on a mesh: wraps the data-parallel
-- policy that runs over the mesh's dp group.
--
-- Layout: every rank holds its tp shard of the cut matrices (and of their
-- optimizer state) and a whole copy of the replicated parameters; ranks
-- with the same tp coordinate form a dp group, and the inner policy (ddp)
-- averages their gradients as it would for a whole model.
--
-- Inner policies: ddp, zero1, zero2, fsdp, hsdp (their gradient pieces
-- through each_grad, their optimizer state through each_state; FSDP's
-- parameters through full_state_dict).  FSDP's blocks recompute their
-- forward in backward, tp collectives included (one more forward's worth).
--
-- Step: forward and backward communicate over tp inside the model (f and
-- g); after_backward is the inner policy's (dp all-reduce of the local
-- shard's gradients: 2(dp-1)/dp * P/tp elements per rank), and under
-- sequence parallelism an all-reduce over tp of the replicated parameters'
-- gradients (each rank saw T/tp rows: 2(tp-1)/tp * P_replicated); the gradient
-- norm is the whole model's: sum of squares of the shards summed over tp
-- plus the replicated ones once — one all-reduce of a number over tp
-- (replicated gradients are equal on every tp rank, so each rank adds
-- 1/tp of theirs); AdamW then runs elementwise on each rank's shard.
--
-- Checkpoints hold full tensors: the dp-rank-0 row gathers every cut
-- parameter and its optimizer state over tp (tensor_parallel.gather) and
-- world rank 0 writes them as an unsharded run would, so a checkpoint loads
-- at any tp (or none); loading cuts the full tensors for this rank.
--
-- Muon (optimizer 'nanochat'): Newton–Schulz needs whole matrices.  The
-- momentum stays cut (it is elementwise: each rank keeps and updates its
-- shard's buffer), then the step's momentum update of each cut matrix is
-- all-gathered over tp, every tp rank orthogonalises the whole matrix and
-- keeps its own rows or columns of the result; the scale uses the whole
-- matrix's shape.  With ddp every rank does this for every matrix: (tp-1)/tp
-- * M fp32 elements received per rank per step for M hidden-matrix
-- elements, and each tp rank repeats the whole model's Newton–Schulz (not
-- divided by tp; gathering for one owner per matrix would divide it for a
-- scatter of the same volume more).  With zero1/zero2/fsdp, whose Muon
-- owns each whole (tp-shard) matrix on one dp rank, the owners plan alike
-- in every tp column (same shapes, same order), so a matrix's owners are
-- one tp group: they gather over tp and each keeps its part, (tp-1)/tp of
-- the matrix received per owner, (tp-1)/tp * M / dp per rank on average,
-- and Newton–Schulz divided by dp, as without tp.
local B = require 'gptlua.dist.policies.base'
local TP = require 'gptlua.dist.tensor_parallel'
local optim = require 'gptlua.optim'
local ckpt = require 'gptlua.checkpoint'
local shards = require 'gptlua.dist.policies.shards'
local gl = require 'gptlua'

local P = {}
P.__index = P

local function fail(msg) error('tensor parallel: ' .. msg, 0) end

-- Muon on cut matrices (see the header): each update's direction from the
-- whole matrix, the scale from its whole shape.
function P.whole_matrix_muon(muon, layout)
  local lib = require('gptlua.ffi').lib
  local spec_of = {}
  for _, np in ipairs(layout.model:named_parameters()) do spec_of[np[2]] = layout.specs[np[1]] end
  muon.update_direction = function(p, grad, buf, g)
    local spec = spec_of[p]
    if not spec then return optim.Muon.update_direction(p, grad, buf, g) end
    local upd = gl.empty(p.shape, { dtype = 'float32', device = p.device })
    require('gptlua.ffi').check(lib.gl_momentum_update(upd.c, buf.c, grad.c, 0, p:numel(), g.momentum,
      g.nesterov and 1 or 0))
    local whole = TP.gather(upd, spec, layout.comm)
    local X = optim.newton_schulz(whole, g.ns_steps)
    local mine = TP.slice(X, spec, layout.rank, layout.size)
    gl.Tensor.release(upd); gl.Tensor.release(whole); gl.Tensor.release(X)
    return mine
  end
  muon.matrix_shape = function(p)
    local np = spec_of[p] and layout.full_shape_of[p]
    return np or p.shape
  end
end

-- inner: the data-parallel policy over mesh.dp (its name in dist_name)
function P.new(inner, layout, mesh, dist_name)
  local ok = { ddp = true, zero1 = true, zero2 = true, fsdp = true, hsdp = true }
  if not ok[dist_name] then
    fail(("dist '%s' with tp > 1 is not supported (expected 'ddp', 'zero1', 'zero2', 'fsdp' or 'hsdp' over the dp "
      .. 'dimension)'):format(tostring(dist_name)))
  end
  for _, o in ipairs(inner.optimizer.optimizers or { inner.optimizer }) do
    if getmetatable(o) == optim.Muon then P.whole_matrix_muon(o, layout) end
  end
  local self = setmetatable({ inner = inner, layout = layout, mesh = mesh, optimizer = inner.optimizer,
    params = inner.params or B.trainable(layout.model:parameters()), collective_forward = true }, P)
  return self
end

function P:zero_grad() return self.inner:zero_grad() end
function P:before_micro_step(micro, accum) return self.inner:before_micro_step(micro, accum) end
-- f(p, grad, counted) for every piece of the averaged gradient this rank
-- holds (ZeRO: its slices; DDP: every gradient, counted on dp rank 0)
function P:_each_grad(f)
  if self.inner.each_grad then return self.inner:each_grad(f) end
  local counted = self.mesh.coord.dp == 0 and self.mesh.coord.cp == 0  -- (cp ranks hold the same average)
  for _, p in ipairs(self.params) do if p.grad then f(p, p.grad, counted) end end
end

function P:after_backward()
  self.inner:after_backward()
  -- sequence parallel: the replicated parameters' gradients summed over tp
  if self.layout.sequence_parallel then
    local sharded, tp = self.layout.sharded, self.layout.comm
    self:_each_grad(function(p, g) if not sharded[p] then tp:all_reduce_async(g, 'sum'):wait() end end)  -- a device wait over NCCL
  end
end
B.delegate_to_inner(P)

-- the whole model's gradient norm (see the header)
function P:grad_norm()
  local sharded, w = self.layout.sharded, 1 / self.layout.size
  local s = 0
  self:_each_grad(function(p, g, counted)
    if counted then s = s + B.sumsq(g) * (sharded[p] and 1 or w) end
  end)
  return math.sqrt(self.mesh.world:all_reduce_number(s, 'sum'))
end

-- This tp rank's whole optimizer state {key = tensor} (ZeRO's pieces
-- assembled over dp: one all-reduce of the state, for checkpoints only).
function P:_local_optimizer_state(opt_sd)
  local inner = self.inner
  if not inner.each_state then return opt_sd.tensors end
  local out, keys = {}, {}
  for k, shape in pairs(inner:state_layout()) do
    out[k] = gl.zeros(shape, { dtype = 'float32', device = self.params[1].device })
    keys[#keys + 1] = k
  end
  table.sort(keys)
  inner:each_state(function(k, t, off, replicated, kind)
    if kind ~= 'param' and (not replicated or inner.comm.rank == 0) then
      B.view(out[k], off, { t:numel() }, false):copy_(B.view(t, 0, { t:numel() }, false))
    end
  end)
  for _, k in ipairs(keys) do inner.comm:all_reduce(out[k], 'sum') end
  return out
end

-- "adamw.NAME.m" -> NAME
local function opt_param_name(key) return key:match('^[%w_]+%.(.*)%.[%w_]+$') end

function P:save_checkpoint(trainer, model_sd, opt_sd, state)
  local model_full, opt_full
  local opt_local = self:_local_optimizer_state(opt_sd)
  -- FSDP's parameters live in shards: gathered whole over dp first (collective)
  -- expert parallelism (the inner policy's): the experts, whole on every tp rank, gathered over ep
  local ep = self.inner.ep_layout
  local ep_model, ep_opt = {}, {}
  if ep then
    for k, t in pairs(opt_sd.tensors) do opt_local[k] = opt_local[k] or t end  -- (a sharded policy steps them apart)
    ep_model, ep_opt = ep:gather(model_sd), ep:gather(opt_local)
  end
  local dp = ep and self.inner.inner or self.inner
  if dp.full_state_dict then model_sd = dp:full_state_dict() end
  if self.mesh.coord.dp == 0 then  -- one tp group gathers; the others hold the same values
    model_full = TP.full_state(self.layout, model_sd)
    opt_full = TP.full_state(self.layout, opt_local, opt_param_name)
    for k, t in pairs(ep_model) do model_full[k] = t end
    for k, t in pairs(ep_opt) do opt_full[k] = t end
  end
  state.mesh = { dp = self.mesh.size.dp, tp = self.mesh.size.tp }
  if trainer.rank ~= 0 then return nil end
  local path, pending = ckpt.save(trainer.ckpt_dir, trainer.step,
    { model = model_full, optim = opt_full, state = state }, trainer.cfg.keep_last, trainer.save_writer)
  if not pending then trainer:print(('saved checkpoint %s'):format(path)) end
  return path
end

-- the model's part of a checkpoint's full tensors (train.lua's load hook)
function P:load_model(sd)
  if self.inner.ep_layout then sd = self.inner.ep_layout:local_entries(sd) end  -- (ep: this rank's experts)
  self.layout.model:load_state_dict(TP.local_state(self.layout, sd))
end

function P:load_checkpoint(trainer, c, path)
  local st = c.state
  local tensors = st.shards and shards.full_tensors(path, c) or c.optim
  tensors = TP.local_state(self.layout, tensors, opt_param_name)
  local inner = self.inner
  if not inner.each_state then
    self.optimizer:load_state_dict({ step = st.opt_step, steps = st.opt_steps, tensors = tensors })
    return
  end
  -- ZeRO: each rank copies its pieces out of this tp rank's whole state
  local index = shards.index(nil, { optim = tensors })
  if inner.reset_masters then inner:reset_masters() end
  inner:each_state(function(k, t, off, _, kind)
    if kind == 'state' or (kind == 'master' and index[k]) then shards.fill(index, k, off, t, path) end
  end, true)  -- (FSDP: every HSDP replica fills its pieces)
  if inner.ep_layout then inner:load_expert_state(index, path) end  -- (ep: the experts, whole, beside the pieces)
  shards.set_steps(self.optimizer, st)
end

return P
