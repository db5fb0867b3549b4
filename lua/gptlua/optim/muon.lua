-- gptlua.optim.muon — Muon and its variants: momentum, an orthogonalised
-- update (Newton-Schulz or Polar Express), MuonEq, Muon+, NorMuon's second
-- moment and cautious weight decay, per matrix or on a tensor-parallel shard.
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local check = require 'gptlua.check'
local lib, Tensor = gl.lib, gl.Tensor
local groups = require 'gptlua.optim.groups'
local check_num, load_state_dict, make_groups, new_state, set_lr_mult, state_dict, update_target, write_back = groups.check_num, groups.load_state_dict, groups.make_groups, groups.new_state, groups.set_lr_mult, groups.state_dict, groups.update_target, groups.write_back

local optim = {}

-- ---------------------------------------------------------------- Muon
-- Orthogonalisation of an update G: X <- a X + (b A + c A^2) X with
-- A = X X^T, on the wide orientation (a tall G is transposed in and out).
--   'newton_schulz'  the quintic iteration with modded-nanogpt's fixed
--                    coefficients after X = G / (|G| + 1e-7): gptlua's
--                    first release (muon_variant 'classic');
--   'polar_express'  Polar Express (Amsel, Persson, Musco, Gower 2025,
--                    arXiv 2505.16932): one coefficient triple per
--                    iteration, computed for 5 iterations (safety factor
--                    2e-2, cushion 2; the values nanochat 92d63d4 uses),
--                    after X = G / (1.01 |G| + 1e-6); at most 5 steps.
-- `dtype`: what the iteration runs in (default G's own).  Muon runs it in
-- bfloat16 for a bf16 parameter on a GPU (optim.ns_dtype): the three
-- products of each step on cuBLASLt's bf16 tensor cores, as modded-nanogpt
-- and nanochat do, since the iteration only has to land the singular values
-- in a band around 1, which bf16 rounding does not disturb; float32 and
-- float64 training, and the CPU, keep G's dtype.  The result comes back in
-- G's dtype; the caller's state (Muon's momentum buffer) stays fp32.
local NS = { 3.4445, -4.7750, 2.0315 }
local POLAR_EXPRESS = {
  { 8.156554524902461, -22.48329292557795, 15.878769915207462 },
  { 4.042929935166739, -2.808917465908714, 0.5000178451051316 },
  { 3.8916678022926607, -2.772484153217685, 0.5060648178503393 },
  { 3.285753657755655, -2.3681294933425376, 0.46449024233003106 },
  { 2.3465413258596377, -1.7097828382687081, 0.42323551169305323 },
}
optim.POLAR_EXPRESS = POLAR_EXPRESS
local ORTHO = { newton_schulz = { scale = 1, eps = 1e-7 }, polar_express = { scale = 1.01, eps = 1e-6 } }
function optim.ns_dtype(p)
  if p.device ~= 'cpu' and p.dtype == 'bfloat16' then return 'bfloat16' end
  return nil
end
local reduce_raw = gl._raw.reduce_raw
function optim.newton_schulz(G, steps, dtype, ortho)
  steps = steps or 5
  dtype = dtype or G.dtype
  ortho = ortho or 'newton_schulz'
  local how = ORTHO[ortho]
  if not how then check.fail('newton_schulz', 'ortho', "'newton_schulz' or 'polar_express'", ortho, 3) end
  if ortho == 'polar_express' and steps > #POLAR_EXPRESS then
    error(('newton_schulz: polar_express has coefficients for %d steps, got steps = %d'):format(#POLAR_EXPRESS,
      steps), 3)
  end
  -- temporaries are released as soon as they are used: Muon runs this per
  -- matrix, and a whole model's worth of them would otherwise pile up
  local function free(t) if t ~= G then Tensor.release(t) end end
  return gl.no_grad(function()
    local rows, cols = G.shape[1], G.shape[2]
    local tall = rows > cols
    local Gt = tall and G:t() or nil
    local X = gl.raw_contiguous(Gt or G)
    if Gt then free(Gt) end  -- the view would keep G (the update direction) alive
    local Xs
    if X.device == 'cpu' then Xs = X * (1 / (gl.global_norm({ X }) * how.scale + how.eps))
    else  -- on a GPU the norm stays on the device: no host wait per matrix
      local n = reduce_raw(lib.GL_R_NORM2, X, nil, false, 'newton_schulz')
      local d = how.scale == 1 and n + how.eps or gl.unary_raw(lib.GL_U_AFFINE, n, how.scale, how.eps)
      Xs = X / d
      free(n); free(d)
    end
    free(X); X = Xs
    if X.dtype ~= dtype then  -- the iteration's precision (bf16 on a GPU)
      local Xd = X:to(dtype)
      free(X); X = Xd
    end
    -- the polynomial's scalar terms ride in the products' alpha and beta
    -- (out = alpha a b + beta out, out starting as a copy of A or X): one
    -- copy each instead of three and two element-wise passes (scale, the
    -- scaled operand, the add), each product rounded once
    for i = 1, steps do
      local c = ortho == 'polar_express' and POLAR_EXPRESS[i] or NS
      local Xt = X:t()
      local Am = gl.matmul_raw(X, Xt)
      local Bm = Am:clone()
      gl.matmul_raw(Am, Am, Bm, c[2], c[3])  -- b A + c A^2
      local Xn = X:clone()
      gl.matmul_raw(Bm, X, Xn, c[1], 1)      -- a X + B X
      free(Xt); free(Am); free(Bm); free(X)
      X = Xn
    end
    if tall then
      local Xt = X:t()
      local out = gl.raw_contiguous(Xt)
      free(Xt); free(X)
      X = out
    end
    if X.dtype ~= G.dtype then
      local Xg = X:to(G.dtype)
      free(X); X = Xg
    end
    return X
  end)
end

-- Muon's variants: each a set of the group options below.
--   classic  gptlua's first release (nanochat's first Muon): Nesterov
--            momentum, Newton–Schulz, no weight decay; one fp32 momentum
--            buffer per matrix.
--   current  nanochat 92d63d4 (nanochat/optim.py, muon_step_fused):
--            momentum, MuonEq row equilibration, Polar Express, Muon+
--            renormalisation, NorMuon (beta2 0.9) and cautious weight
--            decay; a second fp32 buffer of max(rows, cols) per matrix.
-- Options (per group): ortho ('newton_schulz' | 'polar_express');
-- row_equilibrate (MuonEq, arXiv 2603.28254: each row of the momentum
-- update scaled to the mean row norm |U|/sqrt(rows) before
-- orthogonalising, rows of norm < 1e-6 counted as 1e-6); renormalize
-- (Muon+, arXiv 2602.21545: X scaled to Frobenius norm sqrt(min(rows,
-- cols)), |X| floored at 1e-6); normuon_beta2 (NorMuon, arXiv 2510.05491,
-- 0: off: per neuron of the longer side, v = lerp(v, mean(X^2 along the
-- shorter side), 1 - beta2); X scaled by rsqrt(max(v, 1e-10)) per neuron,
-- then as a whole back to its Frobenius norm before (floored at 1e-10));
-- weight_decay (decoupled: p -= lr wd p, lr the shape-scaled rate) and
-- cautious (decay only where the update and the parameter agree in sign,
-- X * p >= 0, nanochat's mask).
local MUON_VARIANTS = {
  classic = { ortho = 'newton_schulz', row_equilibrate = false, renormalize = false, normuon_beta2 = 0,
              cautious = false },
  current = { ortho = 'polar_express', row_equilibrate = true, renormalize = true, normuon_beta2 = 0.9,
              cautious = true },
}
optim.MUON_VARIANTS = MUON_VARIANTS

local Muon = {}
Muon.__index = Muon
optim.Muon = Muon
-- Muon(params, {lr=0.02, momentum=0.95, nesterov=true, ns_steps=5,
-- variant='classic', weight_decay=0, and the variant's options above}); 2-D only.
-- state_dtype = 'float64' keeps the state (and so the whole update) in
-- float64: for float64 references (spec/muon_variants_spec.lua) in one
-- process; training and the sharded policies keep fp32 state.
setmetatable(Muon, { __call = function(_, params, opts)
  opts = opts or {}
  local variant = opts.variant or 'classic'
  local preset = MUON_VARIANTS[variant]
  if not preset then check.fail('Muon', 'variant', "'classic' or 'current'", variant, 3) end
  local d = { lr = opts.lr or 0.02, momentum = opts.momentum or 0.95, nesterov = opts.nesterov ~= false,
              ns_steps = opts.ns_steps or 5, weight_decay = opts.weight_decay or 0, variant = variant }
  for k, v in pairs(preset) do if opts[k] == nil then d[k] = v else d[k] = opts[k] end end
  local self = setmetatable({ groups = make_groups(params, d, 'Muon'), state = {}, t = 0, prefix = 'muon.',
                              state_dtype = opts.state_dtype or 'float32' }, Muon)
  check.one_of(self.state_dtype, { 'float32', 'float64' }, 'Muon', 'state_dtype', 3)
  for _, g in ipairs(self.groups) do
    check_num(g.momentum, 'Muon: momentum', 0)
    check.integer(g.ns_steps, 'Muon', 'ns_steps', 0, g.ortho == 'polar_express' and #POLAR_EXPRESS or nil, 3)
    check.one_of(g.ortho, { 'newton_schulz', 'polar_express' }, 'Muon', 'ortho', 3)
    check_num(g.weight_decay, 'Muon: weight_decay', 0)
    check_num(g.normuon_beta2, 'Muon: normuon_beta2', 0)
    if g.normuon_beta2 >= 1 then error('Muon: normuon_beta2 must be in [0, 1), got ' .. g.normuon_beta2, 2) end
    g.initial_weight_decay = g.weight_decay   -- what set_muon_weight_decay_mult scales
    for _, k in ipairs({ 'row_equilibrate', 'renormalize', 'cautious' }) do check.type(g[k], 'boolean', 'Muon', k, 3) end
    for i, p in ipairs(g.params) do
      if #p.shape ~= 2 then
        error(('Muon: parameter %s has %d dims; Muon applies only to 2-D matrices'):format(g.names[i], #p.shape), 2)
      end
    end
  end
  return self
end })
Muon.set_lr_mult, Muon.state_dict, Muon.load_state_dict = set_lr_mult, state_dict, load_state_dict

-- NorMuon's second moment: one number per neuron of the longer side
-- (rows of a tall or square matrix, columns of a wide one)
function Muon.second_moment_shape(shape)
  if shape[1] >= shape[2] then return { shape[1], 1 } end
  return { 1, shape[2] }
end
function Muon:param_state(p, g)
  local out = { { 'momentum_buffer', p.shape } }
  if g.normuon_beta2 > 0 then out[2] = { 'second_momentum_buffer', Muon.second_moment_shape(p.shape) } end
  return out
end
-- a checkpoint's NorMuon state must match this optimizer's: a variant
-- mismatch is refused by name, not as a missing or ignored tensor
function Muon:check_state(tensors, g, i)
  local key = self.prefix .. g.names[i] .. '.second_momentum_buffer'
  local has, wants = tensors[key] ~= nil, g.normuon_beta2 > 0
  if has ~= wants then
    error(('optimizer state: %s %s, but this Muon %s NorMuon (muon_variant %s); the checkpoint was saved by '
      .. 'another Muon variant'):format(key, has and 'is in the checkpoint' or 'is missing',
      wants and 'uses' or 'does not use', g.variant), 4)
  end
end

local U, BIN = { sq = lib.GL_U_SQUARE, rsqrt = lib.GL_U_RSQRT, sqrt = lib.GL_U_SQRT, clamp = lib.GL_U_CLAMP,
  mul = lib.GL_U_MUL_SCALAR, rdiv = lib.GL_U_RDIV_SCALAR }, { mul = lib.GL_B_MUL, div = lib.GL_B_DIV,
  sub = lib.GL_B_SUB, ge = lib.GL_B_GE }
local unary, binary, rel = gl.unary_raw, gl.binary_raw, Tensor.release
-- the Frobenius norm of X as a 0-d tensor on X's device (no host wait)
local function fro(X) return reduce_raw(lib.GL_R_NORM2, X, nil, false, 'Muon') end

-- MuonEq: X's rows scaled to the mean row norm, in place (fp32 X)
local function row_equilibrate(X)
  local total = fro(X)
  local target = unary(U.mul, total, 1 / math.sqrt(X.shape[1]))
  local rn = reduce_raw(lib.GL_R_NORM2, X, 2, true, 'Muon')      -- (rows, 1)
  rn:clamp_(1e-6)
  local s = binary(BIN.div, target, rn, 'Muon')
  X:mul_(s)
  rel(total); rel(target); rel(rn); rel(s)
end

-- Muon+: X scaled to Frobenius norm sqrt(min(rows, cols)), in place
local function renormalize(X)
  local n = fro(X)
  n:clamp_(1e-6)
  local s = unary(U.rdiv, n, math.sqrt(math.min(X.shape[1], X.shape[2])))
  X:mul_(s)
  rel(n); rel(s)
end

-- NorMuon: per-neuron second moment v (updated in place) and X scaled by
-- it, then back to its Frobenius norm, in place
local function normuon(X, v, beta2, blk)
  local rows, cols = X.shape[1], X.shape[2]
  local dim = rows >= cols and 2 or 1            -- the shorter side is averaged
  local n_red = X.shape[dim]
  local sq = unary(U.sq, X)
  local vmean = reduce_raw(lib.GL_R_MEAN, sq, dim, true, 'Muon')
  rel(sq)
  local before = fro(X)                          -- = sqrt(sum(vmean) * n_red)
  local d = binary(BIN.sub, vmean, v, 'Muon')
  if blk then G.check(lib.gl_axpy_block(v.c, d.c, blk.block.c, blk.slot + 4), 2)  -- 1 - beta2; untouched when skipped
  else v:add_(d, 1 - beta2) end
  rel(d)
  local floored = unary(U.clamp, v, 1e-10, math.huge)
  local step = unary(U.rsqrt, floored)           -- per neuron
  local w = binary(BIN.mul, vmean, unary(U.sq, step, nil, nil, floored), 'Muon')
  local after = reduce_raw(lib.GL_R_SUM, w, nil, false, 'Muon')
  local after_n = unary(U.sqrt, unary(U.mul, after, n_red, nil, after))   -- = |X scaled by step|
  after_n:clamp_(1e-10)
  local ratio = binary(BIN.div, before, after_n, 'Muon')
  local scale = binary(BIN.mul, step, ratio, 'Muon')
  X:mul_(scale)
  for _, t in ipairs({ vmean, before, floored, step, w, after, after_n, ratio, scale }) do rel(t) end
end

-- The update direction of one matrix (whole; momentum applied to buf and
-- NorMuon's second moment to vbuf in place): momentum -> [MuonEq] ->
-- orthogonalisation -> [Muon+] -> [NorMuon], in fp32 but for the
-- iteration itself (optim.ns_dtype).  The result is in p's dtype or fp32.
-- blk (Muon:step_block): {block = the step block's device tensor, slot =
-- the matrix's first slot}: the factors come from the block, the gradient
-- is clipped there, and nothing is written on a skipped step.
function Muon.update_direction(p, grad, buf, g, vbuf, blk)
  local upd = gl.empty(p.shape, { dtype = buf.dtype, device = p.device })   -- fp32 (state_dtype)
  if blk then G.check(lib.gl_momentum_update_block(upd.c, buf.c, grad.c, blk.block.c, blk.slot, g.nesterov and 1 or 0), 2)
  else G.check(lib.gl_momentum_update(upd.c, buf.c, grad.c, 0, p:numel(), g.momentum, g.nesterov and 1 or 0), 2) end
  if g.row_equilibrate then row_equilibrate(upd) end
  local X = optim.newton_schulz(upd, g.ns_steps, optim.ns_dtype(p), g.ortho)
  Tensor.release(upd)
  if g.renormalize then renormalize(X) end
  if g.normuon_beta2 > 0 then normuon(X, vbuf, g.normuon_beta2, blk) end
  return X
end

-- Applies an update direction X (or a piece of one: everything here is
-- elementwise) to target (the parameter, its fp32 master, or a shard of
-- either) at the shape-scaled rate lr: target -= lr X, and with weight
-- decay target -= lr wd target (cautious: only where X target >= 0), the
-- decay computed from target before the update as nanochat does.
-- blk (Muon:step_block): -lr and -lr wd from the block's slots, nothing
-- written on a skipped step; the decay is computed whenever the group has
-- one at all (a captured step keeps its branches while the schedule moves).
function optim.muon_apply(target, X, lr, g, blk)
  local Xd = X:to(target.dtype)
  local decay
  if g.weight_decay > 0 or (blk and (g.initial_weight_decay or 0) > 0) then
    if g.cautious then
      local prod = binary(BIN.mul, Xd, target, 'Muon')
      local zero = gl.zeros({}, { dtype = prod.dtype, device = prod.device })
      local mask = binary(BIN.ge, prod, zero, 'Muon', target.dtype)   -- 1 where they agree, else 0
      decay = binary(BIN.mul, mask, target, 'Muon')
      rel(prod); rel(zero); rel(mask)
    else
      decay = target:clone()
    end
  end
  if blk then
    G.check(lib.gl_axpy_block(target.c, Xd.c, blk.block.c, blk.slot + 2), 2)
    if decay then G.check(lib.gl_axpy_block(target.c, decay.c, blk.block.c, blk.slot + 3), 2); rel(decay) end
  else
    target:add_(Xd, -lr)
    if decay then target:add_(decay, -lr * g.weight_decay); rel(decay) end
  end
  if Xd ~= X then rel(Xd) end
end

-- A tensor-parallel run sets update_direction and matrix_shape on the Muon
-- instance (gptlua.dist.policies.tp): the direction of the whole matrix, cut
-- to the shard.  It runs the classic direction, so a variant's steps are
-- refused.  Returns the override (nil without tensor parallelism).
function Muon.tp_direction(o, g)
  local f = rawget(o, 'update_direction')
  if f and (g.ortho ~= 'newton_schulz' or g.row_equilibrate or g.renormalize or g.normuon_beta2 > 0) then
    error(("Muon: tensor parallelism runs the classic variant's direction, got variant %s"):format(g.variant), 0)
  end
  return f
end

-- the shape-scaled rate of a matrix of `shape`: lr sqrt(max(1, rows/cols))
function Muon.scaled_lr(g, shape) return g.lr * math.sqrt(math.max(1, shape[1] / shape[2])) end

function Muon:step()
  self.t = self.t + 1
  gl.no_grad(function()
    for _, g in ipairs(self.groups) do
      for _, p in ipairs(g.params) do
        if p.grad then
          local st = self.state[p]
          if not st then st = new_state(p, self:param_state(p, g), self.state_dtype); self.state[p] = st end
          local X = (Muon.tp_direction(self, g) or Muon.update_direction)(p, p.grad, st.momentum_buffer, g,
            st.second_momentum_buffer)
          local shape = self.matrix_shape and self.matrix_shape(p) or p.shape
          optim.muon_apply(update_target(p, st), X, Muon.scaled_lr(g, shape), g)
          write_back(p, st)
          Tensor.release(X)  -- one matrix's temporaries at a time
        end
      end
    end
  end)
end

-- The step block (gptlua.step_block; AdamW's above): each matrix's 5 slots
-- hold its momentum, 1 - momentum, the shape-scaled -lr and -lr wd, and
-- NorMuon's 1 - beta2, written by the host each step in double (the
-- scheduled momentum and weight decay included); step_block runs step()'s
-- work with them (no host number in any launch, nothing written on a
-- skipped step); step_taken counts the step.
function Muon:reserve_block(block)
  for _, g in ipairs(self.groups) do
    g.block_slots = {}
    for i = 1, #g.params do g.block_slots[i] = block:reserve(5) end
  end
end
function Muon:write_block(b)
  for _, g in ipairs(self.groups) do
    for i, p in ipairs(g.params) do
      local s = g.block_slots[i]
      local lr = Muon.scaled_lr(g, self.matrix_shape and self.matrix_shape(p) or p.shape)
      b[s], b[s + 1], b[s + 2], b[s + 3], b[s + 4] = g.momentum, 1 - g.momentum, -lr, -lr * g.weight_decay,
        1 - g.normuon_beta2
    end
  end
end
function Muon:step_block(block)
  gl.no_grad(function()
    for _, g in ipairs(self.groups) do
      for i, p in ipairs(g.params) do
        if p.grad then
          local st = self.state[p]
          if not st then st = new_state(p, self:param_state(p, g), self.state_dtype); self.state[p] = st end
          local blk = { block = block, slot = g.block_slots[i] }
          local X = Muon.update_direction(p, p.grad, st.momentum_buffer, g, st.second_momentum_buffer, blk)
          optim.muon_apply(update_target(p, st), X, nil, g, blk)
          write_back(p, st)
          Tensor.release(X)
        end
      end
    end
  end)
end
function Muon:step_taken() self.t = self.t + 1 end

return { Muon = Muon, MUON_VARIANTS = MUON_VARIANTS, optim = optim }
