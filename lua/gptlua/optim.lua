-- gptlua.optim — AdamW, Muon, a combined optimizer over parameter groups,
-- gradient clipping and learning-rate schedules.  The per-element update
-- math is in C kernels that take a slice (start, len) of a flat tensor, so
-- the sharded optimizers of gptlua.dist run the same code on their shard.
local gl = require 'gptlua'
local check = require 'gptlua.check'
local ffi, lib, Tensor = gl.ffi, gl.lib, gl.Tensor

local optim = {}

local function K(rc) if rc ~= 0 then error(ffi.string(lib.gl_last_error()), 3) end end

local function check_num(v, what, lo)
  if type(v) ~= 'number' or v ~= v or (lo and v < lo) then
    error(('%s must be a number%s, got %s'):format(what, lo and (' >= ' .. lo) or '', tostring(v)), 4)
  end
end

-- normalises params into groups: accepts a list of tensors, a list of
-- {name, tensor} pairs, or a list of groups {params = ..., lr = ...}
local function make_groups(params, defaults, what)
  if type(params) ~= 'table' or #params == 0 then error(what .. ': expected a non-empty list of parameters', 3) end
  local raw = params
  if not (type(params[1]) == 'table' and params[1].params) then raw = { { params = params } } end
  local groups = {}
  for gi, g in ipairs(raw) do
    if type(g) ~= 'table' then check.fail(what, ('group %d'):format(gi), 'a table {params = {...}, ...}', g, 3) end
    if type(g.params) ~= 'table' then check.fail(what, ('group %d params'):format(gi), 'a list of parameters', g.params, 3) end
    local grp = {}
    for k, v in pairs(defaults) do grp[k] = v end
    for k, v in pairs(g) do if k ~= 'params' then grp[k] = v end end
    grp.params, grp.names = {}, {}
    for i, p in ipairs(g.params) do
      local name, t = nil, p
      if not gl.is_tensor(p) and type(p) == 'table' then name, t = p[1], p[2] end
      if not gl.is_tensor(t) then
        check.fail(what, ('group %d entry %d'):format(gi, i), 'a Tensor or a {name, Tensor} pair', p, 3)
      end
      grp.params[i], grp.names[i] = t, name or ('g' .. gi .. '.' .. i)
    end
    check_num(grp.lr, what .. ': lr', 0)
    grp.initial_lr = grp.initial_lr or grp.lr
    groups[gi] = grp
  end
  return groups
end

-- Mixed precision: a parameter stored in bfloat16/float16 gets an fp32
-- master copy in its optimizer state; the update runs on the master and is
-- rounded into the parameter afterwards.
local function needs_master(p) return p.dtype ~= 'float32' and p.dtype ~= 'float64' end
-- spec: the optimizer's param_state(p, g), a list of {key, shape}; the
-- state is fp32 whatever the parameter's dtype (the sharded policies' too),
-- unless a float64 reference asks for float64 (Muon's state_dtype option)
local function new_state(p, spec, dtype)
  local st = {}
  for _, e in ipairs(spec) do st[e[1]] = gl.zeros(e[2], { dtype = dtype or 'float32', device = p.device }):keep() end
  if needs_master(p) then st.master = p:to('float32'):detach():keep() end
  return st
end
local function update_target(p, st) return st.master or p end
local function write_back(p, st) if st.master then gl.no_grad(function() p:copy_(st.master) end) end end
optim.needs_master = needs_master

-- sets every group's lr to initial_lr * mult (schedules call this)
local function set_lr_mult(self, mult)
  for _, g in ipairs(self.groups) do g.lr = g.initial_lr * mult end
end

-- state as {step = n, tensors = {key = tensor}} for checkpoints
local function state_dict(self)
  local tensors = {}
  for _, g in ipairs(self.groups) do
    for i, p in ipairs(g.params) do
      local st = self.state[p]
      if st then for k, t in pairs(st) do tensors[self.prefix .. g.names[i] .. '.' .. k] = t end end
    end
  end
  return { step = self.t, tensors = tensors }
end
local function load_state_dict(self, sd)
  check.type(sd.tensors, 'table', 'optimizer load_state_dict', 'state_dict.tensors')
  local pending = {}
  for _, g in ipairs(self.groups) do
    for i, p in ipairs(g.params) do
      local spec = { unpack(self:param_state(p, g)) }
      if needs_master(p) then spec[#spec + 1] = { 'master', p.shape } end
      if self.check_state then self:check_state(sd.tensors, g, i) end
      for _, e in ipairs(spec) do
        local k, shape = e[1], e[2]
        local key = self.prefix .. g.names[i] .. '.' .. k
        local t = sd.tensors[key]
        if t == nil then error('optimizer state: missing ' .. key, 3) end
        check.tensor(t, 'optimizer load_state_dict', key, 3)
        if not gl.same_shape(t.shape, shape) then
          error(('optimizer state: %s has shape {%s}, expected {%s}'):format(key,
            table.concat(t.shape, ','), table.concat(shape, ',')), 3)
        end
        pending[#pending + 1] = { p, k, t }
      end
    end
  end
  for _, e in ipairs(pending) do
    local p, k, t = e[1], e[2], e[3]
    self.state[p] = self.state[p] or {}
    local dst = self.state[p][k] or gl.zeros(t.shape, { dtype = k ~= 'master' and self.state_dtype or 'float32',
      device = p.device }):keep()
    dst:copy_(t)
    self.state[p][k] = dst
  end
  self.t = sd.step
end

-- ---------------------------------------------------------------- AdamW
local AdamW = {}
AdamW.__index = AdamW
optim.AdamW = AdamW
-- AdamW(params, {lr=1e-3, betas={0.9, 0.999}, eps=1e-8, weight_decay=0.01})
setmetatable(AdamW, { __call = function(_, params, opts)
  opts = opts or {}
  local d = { lr = opts.lr or 1e-3, betas = opts.betas or { 0.9, 0.999 }, eps = opts.eps or 1e-8,
              weight_decay = opts.weight_decay or 0.0 }
  local self = setmetatable({ groups = make_groups(params, d, 'AdamW'), state = {}, t = 0, prefix = 'adamw.' }, AdamW)
  for _, g in ipairs(self.groups) do
    check_num(g.eps, 'AdamW: eps', 0); check_num(g.weight_decay, 'AdamW: weight_decay', 0)
    if type(g.betas) ~= 'table' or #g.betas ~= 2 then check.fail('AdamW', 'betas', 'a pair {beta1, beta2}', g.betas, 2) end
    for _, b in ipairs(g.betas) do
      if type(b) ~= 'number' or b < 0 or b >= 1 then error('AdamW: betas must be in [0, 1), got ' .. tostring(b), 2) end
    end
  end
  return self
end })
AdamW.set_lr_mult, AdamW.state_dict, AdamW.load_state_dict = set_lr_mult, state_dict, load_state_dict
-- the state tensors of parameter p in group g: {key, shape} in order
function AdamW:param_state(p) return { { 'm', p.shape }, { 'v', p.shape } } end

-- Every parameter with a gradient is updated by one gl_adamw_update_multi
-- call per (device, betas, eps) — one launch on a GPU for the whole model —
-- which also rounds each fp32 master copy into its low-precision parameter.
-- The FFI arrays are kept between steps (no per-step allocation).
local versions = gl.Tensor.versions
local function multi_arrays(self, n)
  local a = self._multi
  if not a or a.cap < n then
    a = { cap = n, params = ffi.new('gl_tensor *[?]', n), grads = ffi.new('const gl_tensor *[?]', n),
          ms = ffi.new('gl_tensor *[?]', n), vs = ffi.new('gl_tensor *[?]', n), outs = ffi.new('gl_tensor *[?]', n),
          lrs = ffi.new('double[?]', n), wds = ffi.new('double[?]', n) }
    self._multi = a
  end
  return a
end

function AdamW:step()
  self.t = self.t + 1
  local calls, order = {}, {}
  for _, g in ipairs(self.groups) do
    for _, p in ipairs(g.params) do
      if p.grad then
        local st = self.state[p]
        if not st then st = new_state(p, self:param_state(p, g)); self.state[p] = st end
        local key = ('%s %.17g %.17g %.17g'):format(p.device, g.betas[1], g.betas[2], g.eps)
        local c = calls[key]
        if not c then c = { g = g }; calls[key] = c; order[#order + 1] = c end
        c[#c + 1] = { p, st, g }
      end
    end
  end
  for _, c in ipairs(order) do
    local n, g0 = #c, c.g
    local a = multi_arrays(self, n)
    for i, e in ipairs(c) do
      local p, st, g = e[1], e[2], e[3]
      a.params[i - 1], a.grads[i - 1], a.ms[i - 1], a.vs[i - 1] = update_target(p, st).c, p.grad.c, st.m.c, st.v.c
      a.outs[i - 1] = st.master and p.c or nil
      a.lrs[i - 1], a.wds[i - 1] = g.lr, g.weight_decay
    end
    K(lib.gl_adamw_update_multi(n, a.params, a.grads, a.ms, a.vs, a.outs, a.lrs, a.wds, g0.betas[1], g0.betas[2],
      g0.eps, self.t))
    for _, e in ipairs(c) do  -- the rounded weights were written in place
      if e[2].master then local v = versions.counter(e[1]); v[1] = v[1] + 1 end
    end
  end
end

-- The step block (gptlua.step_block, gl_ops.h): the same update with its
-- rates read from device memory, so a captured step (gptlua.train_graph)
-- replays this step's rates.  reserve_block gives each group its
-- GL_STEP_ADAMW_SLOTS slots; write_block writes them for step t + 1 into
-- the host block (double *b) in double, as the op-by-op call computes them
-- (pow from libm, not LuaJIT's ^, which differs in the last bit); the
-- kernel round them once; step_taken advances t after the host has read
-- that the step was not skipped.
pcall(ffi.cdef, 'double pow(double x, double y);')
function AdamW:reserve_block(block)
  for _, g in ipairs(self.groups) do g.block_slot = block:reserve(lib.GL_STEP_ADAMW_SLOTS) end
end
function AdamW:write_block(b)
  local t = self.t + 1
  for _, g in ipairs(self.groups) do
    local s, b1, b2 = g.block_slot, g.betas[1], g.betas[2]
    local bc1, bc2 = 1 - ffi.C.pow(b1, t), 1 - ffi.C.pow(b2, t)
    b[s], b[s + 1], b[s + 2], b[s + 3] = g.lr * g.weight_decay, g.lr / bc1, b1, b2
    b[s + 4], b[s + 5], b[s + 6], b[s + 7] = 1 - b1, 1 - b2, g.eps, 1 / bc2
  end
end
-- every parameter with a gradient in one gl_adamw_update_block call (its
-- state made on the first); block: the device tensor of the step block
function AdamW:step_block(block)
  local list = self._block_list or {}
  self._block_list = list
  local n = 0
  for _, g in ipairs(self.groups) do
    for _, p in ipairs(g.params) do
      if p.grad then
        if not self.state[p] then self.state[p] = new_state(p, self:param_state(p, g)) end
        n = n + 1
        list[n] = p
        list[-n] = g
      end
    end
  end
  for i = n + 1, #list do list[i], list[-i] = nil, nil end
  if n == 0 then return end
  local a = multi_arrays(self, n)
  if not a.slots then a.slots = ffi.new('int64_t[?]', a.cap) end
  for i = 1, n do
    local p, st = list[i], self.state[list[i]]
    a.params[i - 1], a.grads[i - 1], a.ms[i - 1], a.vs[i - 1] = update_target(p, st).c, p.grad.c, st.m.c, st.v.c
    a.outs[i - 1] = st.master and p.c or nil
    a.slots[i - 1] = list[-i].block_slot
  end
  K(lib.gl_adamw_update_block(n, a.params, a.grads, a.ms, a.vs, a.outs, block.c, a.slots))
end
function AdamW:step_taken()
  self.t = self.t + 1
  for _, p in ipairs(self._block_list or {}) do  -- the rounded weights were written in place
    if self.state[p].master then local v = versions.counter(p); v[1] = v[1] + 1 end
  end
end

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
  if blk then K(lib.gl_axpy_block(v.c, d.c, blk.block.c, blk.slot + 4))  -- 1 - beta2; untouched when skipped
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
  if blk then K(lib.gl_momentum_update_block(upd.c, buf.c, grad.c, blk.block.c, blk.slot, g.nesterov and 1 or 0))
  else K(lib.gl_momentum_update(upd.c, buf.c, grad.c, 0, p:numel(), g.momentum, g.nesterov and 1 or 0)) end
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
    K(lib.gl_axpy_block(target.c, Xd.c, blk.block.c, blk.slot + 2))
    if decay then K(lib.gl_axpy_block(target.c, decay.c, blk.block.c, blk.slot + 3)); rel(decay) end
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

-- ------------------------------------------------------- combined optimizer
local Combined = {}
Combined.__index = Combined
optim.Combined = Combined
setmetatable(Combined, { __call = function(_, list)
  local groups = {}
  for _, o in ipairs(list) do for _, g in ipairs(o.groups) do groups[#groups + 1] = g end end
  return setmetatable({ optimizers = list, groups = groups }, Combined)
end })
function Combined:step() for _, o in ipairs(self.optimizers) do o:step() end end
function Combined:set_lr_mult(m) for _, o in ipairs(self.optimizers) do o:set_lr_mult(m) end end
-- the step block (AdamW:reserve_block ...): every member must take it
function Combined:takes_block()
  for _, o in ipairs(self.optimizers) do if not optim.takes_block(o) then return false end end
  return true
end
function Combined:reserve_block(block) for _, o in ipairs(self.optimizers) do o:reserve_block(block) end end
function Combined:write_block(b) for _, o in ipairs(self.optimizers) do o:write_block(b) end end
function Combined:step_block(block) for _, o in ipairs(self.optimizers) do o:step_block(block) end end
function Combined:step_taken() for _, o in ipairs(self.optimizers) do o:step_taken() end end
function Combined:state_dict()
  local out = { steps = {}, tensors = {} }
  for i, o in ipairs(self.optimizers) do
    local sd = o:state_dict()
    out.steps[i] = sd.step
    for k, t in pairs(sd.tensors) do out.tensors[k] = t end
  end
  return out
end
function Combined:load_state_dict(sd)
  for i, o in ipairs(self.optimizers) do o:load_state_dict({ step = sd.steps[i], tensors = sd.tensors }) end
end
function Combined:set_momentum(mu)
  for _, o in ipairs(self.optimizers) do
    if getmetatable(o) == Muon then for _, g in ipairs(o.groups) do g.momentum = mu end end
  end
end
-- Muon's weight decay times mult (a schedule's value: nanochat decays it
-- to zero over the run, optim.schedules.cosine_to_zero)
function Combined:set_muon_weight_decay_mult(mult)
  for _, o in ipairs(self.optimizers) do
    if getmetatable(o) == Muon then for _, g in ipairs(o.groups) do g.weight_decay = g.initial_weight_decay * mult end end
  end
end

-- nanochat's split: hidden matrices -> Muon, everything else -> AdamW.
-- variant 'classic' (gptlua's first release): embedding, head and any other
-- parameters in three AdamW groups, betas (0.8, 0.95), no weight decay,
-- rates scaled by (n_embd/768)^-0.5, the other group at scalar_lr 0.004.
-- variant 'current' (nanochat 92d63d4, GPT.setup_optimizer): AdamW eps
-- 1e-10 in nanochat's groups, s = (n_embd/768)^-0.5:
--   lm_head            unembedding_lr s      betas (0.8, 0.96)   wd 0.01
--   wte                embedding_lr s        (0.8, 0.995)        0.001
--   value_embeds.*     embedding_lr s / 2    (0.8, 0.995)        0.01
--   resid_lambdas      scalar_lr / 100       (0.8, 0.95)         0.05
--   x0_lambdas         scalar_lr             (0.96, 0.95)        0
--   the rest (smear gate and lambda, backout lambda)  0.2  (0.8, 0.95)  0
-- and Muon variant 'current' (NorMuon beta2 0.9, cautious weight decay
-- muon_weight_decay, default 0 as setup_optimizer's).  Groups a model
-- lacks are left out.
local NANOCHAT_CURRENT_GROUPS = {   -- name pattern, lr (a function of opts, s), betas, weight decay
  { '^lm_head%.', function(o, s) return o.unembedding_lr * s end, { 0.8, 0.96 }, 0.01 },
  { '^transformer%.wte%.', function(o, s) return o.embedding_lr * s end, { 0.8, 0.995 }, 0.001 },
  { '^value_embeds%.', function(o, s) return o.embedding_lr * s * 0.5 end, { 0.8, 0.995 }, 0.01 },
  { '^resid_lambdas$', function(o) return o.scalar_lr * 0.01 end, { 0.8, 0.95 }, 0.05 },
  { '^x0_lambdas$', function(o) return o.scalar_lr end, { 0.96, 0.95 }, 0.0 },
  { '', function() return 0.2 end, { 0.8, 0.95 }, 0.0 },
}
-- A rank may hold none of a member's parameters (a pipeline stage of block
-- matrices only has no AdamW parameter; one of embeddings only, no Muon
-- matrix): the member still exists, with one empty group, so that every
-- rank's optim.Combined lists AdamW then Muon, and a checkpoint's steps[i]
-- names the same member on any layout.
local function or_empty(list, lr)
  if #list > 0 then return list end
  return { { params = {}, lr = lr } }
end

-- split: the non-matrix parameters as optim.nanochat sorted them {head, emb, other}
local function nanochat_current(opts, matrices, split, scale)
  local o = { unembedding_lr = opts.unembedding_lr or 0.008, embedding_lr = opts.embedding_lr or 0.3,
              scalar_lr = opts.scalar_lr or 0.5 }
  local members = {}
  for i = 1, #NANOCHAT_CURRENT_GROUPS do members[i] = {} end
  for _, np in ipairs(split.head) do table.insert(members[1], np) end  -- (a tied embedding's name is wte's)
  for _, list in ipairs({ split.emb, split.other }) do
    for _, np in ipairs(list) do
      for i, spec in ipairs(NANOCHAT_CURRENT_GROUPS) do
        if np[1]:match(spec[1]) then table.insert(members[i], np); break end
      end
    end
  end
  local groups = {}
  for i, spec in ipairs(NANOCHAT_CURRENT_GROUPS) do
    if #members[i] > 0 then
      groups[#groups + 1] = { params = members[i], lr = spec[2](o, scale), betas = spec[3], weight_decay = spec[4] }
    end
  end
  return Combined({ AdamW(or_empty(groups, 0.2), { eps = 1e-10 }),
    Muon(or_empty(matrices), { lr = opts.matrix_lr or 0.02, momentum = opts.momentum or 0.95,
      variant = 'current', normuon_beta2 = opts.muon_beta2, weight_decay = opts.muon_weight_decay }) })
end

function optim.nanochat(model, opts)
  opts = opts or {}
  local C = model.config.n_embd
  local scale = (C / 768) ^ -0.5
  local variant = opts.variant or 'classic'
  if not MUON_VARIANTS[variant] then check.fail('nanochat', 'variant', "'classic' or 'current'", variant, 3) end
  -- a model whose head is its token embedding (gpt2: ties_head_to_embedding)
  -- trains that matrix as the head: the embedding's rate, tuned for rows
  -- that one token's gradient reaches, diverges on the head's dense gradient
  local tied = model.ties_head_to_embedding
  local matrices, emb, head, other = {}, {}, {}, {}
  for _, np in ipairs(model:named_parameters()) do
    local name, p = np[1], np[2]
    if name:match('^transformer%.h%.') and #p.shape == 2 then matrices[#matrices + 1] = np
    elseif tied and name:match('^transformer%.wte%.') then head[#head + 1] = np
    elseif name:match('wte') then emb[#emb + 1] = np
    elseif name:match('lm_head') then head[#head + 1] = np
    else other[#other + 1] = np end
  end
  if variant == 'current' then
    return nanochat_current(opts, matrices, { head = head, emb = emb, other = other }, scale)
  end
  local adam_groups = {}
  if #emb > 0 then adam_groups[#adam_groups + 1] = { params = emb, lr = (opts.embedding_lr or 0.2) * scale } end
  if #head > 0 then adam_groups[#adam_groups + 1] = { params = head, lr = (opts.unembedding_lr or 0.004) * scale } end
  if #other > 0 then adam_groups[#adam_groups + 1] = { params = other, lr = (opts.scalar_lr or 0.004) * scale } end
  return Combined({
    AdamW(or_empty(adam_groups, (opts.embedding_lr or 0.2) * scale),
      { betas = opts.adam_betas or { 0.8, 0.95 }, eps = 1e-10, weight_decay = 0 }),
    Muon(or_empty(matrices), { lr = opts.matrix_lr or 0.02, momentum = opts.momentum or 0.95,
      weight_decay = opts.muon_weight_decay }) })
end

-- whether optimizer o runs its step from a step block (gptlua.step_block)
function optim.takes_block(o)
  if o.takes_block then return o:takes_block() end
  return o.step_block ~= nil
end

-- --------------------------------------------------------- gradient clipping
-- scales all gradients so their global L2 norm is at most max_norm;
-- returns the norm before clipping
optim.clip_grad_norm = check.wrap('clip_grad_norm', 'params:tensors, max_norm:number?', function(params, max_norm)
  local grads = {}
  for _, p in ipairs(params) do if p.grad then grads[#grads + 1] = p.grad end end
  local norm = gl.global_norm(grads)
  if max_norm and max_norm > 0 and norm > max_norm then
    local s = max_norm / (norm + 1e-6)
    for _, g in ipairs(grads) do g:mul_(s) end
  end
  return norm
end)

-- ------------------------------------------------------- argument checks
-- constructors and entry points check their arguments (gptlua.check.wrap)
local function checked(cls, name, sig)
  local mt = getmetatable(cls)
  mt.__call = check.wrap(name, 'class:any, ' .. sig, mt.__call)
end
checked(AdamW, 'AdamW', 'params:opts, opts:opts?')
checked(Muon, 'Muon', 'params:opts, opts:opts?')
checked(Combined, 'Combined', 'optimizers:opts')
for _, cls in ipairs({ AdamW, Muon, Combined }) do
  cls.load_state_dict = check.wrap('load_state_dict', 'self:opts, state_dict:opts', cls.load_state_dict)
  cls.step = check.wrap('step', 'self:opts', cls.step)
  cls.set_lr_mult = check.wrap('set_lr_mult', 'self:opts, mult:number', cls.set_lr_mult)
end
Combined.set_momentum = check.wrap('set_momentum', 'self:opts, momentum:number', Combined.set_momentum)
Combined.set_muon_weight_decay_mult = check.wrap('set_muon_weight_decay_mult', 'self:opts, mult:number',
  Combined.set_muon_weight_decay_mult)
optim.newton_schulz = check.wrap('newton_schulz', 'G:tensor, steps:integer?, dtype:string?, ortho:string?',
  optim.newton_schulz)
optim.nanochat = check.wrap('nanochat', 'model:opts, opts:opts?', optim.nanochat)  -- (a module, or a pipeline's stand-in)

-- --------------------------------------------------------------- schedules
-- plain functions of the step (0-based) returning an lr multiplier
optim.schedules = {}
function optim.schedules.constant() return function() return 1 end end
function optim.schedules.linear_warmup(warmup)
  return function(step) return warmup > 0 and math.min(1, (step + 1) / warmup) or 1 end
end
-- warmup, then cosine from 1 down to min_ratio at total_steps
function optim.schedules.cosine(warmup, total, min_ratio)
  min_ratio = min_ratio or 0.1
  return function(step)
    if step < warmup then return (step + 1) / warmup end
    if step >= total then return min_ratio end
    local p = (step - warmup) / math.max(1, total - warmup)
    return min_ratio + 0.5 * (1 - min_ratio) * (1 + math.cos(math.pi * p))
  end
end
-- warmup-stable-decay: constant, then linear warm-down over the last
-- `cooldown_frac` of training to `final_ratio`
function optim.schedules.wsd(warmup, total, cooldown_frac, final_ratio)
  cooldown_frac, final_ratio = cooldown_frac or 0.2, final_ratio or 0.0
  local cooldown_start = total - math.floor(cooldown_frac * total)
  return function(step)
    if step < warmup then return (step + 1) / warmup end
    if step < cooldown_start then return 1 end
    local p = (step - cooldown_start) / math.max(1, total - cooldown_start)
    return 1 - p * (1 - final_ratio)
  end
end
-- Muon momentum warmup (nanochat): 0.85 -> 0.95 over the first 300 steps
function optim.schedules.muon_momentum(from, to, steps)
  from, to, steps = from or 0.85, to or 0.95, steps or 300
  return function(step) local f = math.min(step / steps, 1); return (1 - f) * from + f * to end
end

-- cosine from 1 at step 0 to 0 at `total` (nanochat's Muon weight decay)
function optim.schedules.cosine_to_zero(total)
  return function(step) return 0.5 * (1 + math.cos(math.pi * math.min(step, total) / total)) end
end

-- schedule constructors: numbers in, a function of the step out
local SCHEDULES = {
  linear_warmup = 'warmup:number', cosine = 'warmup:number, total:number, min_ratio:number?',
  wsd = 'warmup:number, total:number, cooldown_frac:number?, final_ratio:number?',
  muon_momentum = 'from:number?, to:number?, steps:number?',
  cosine_to_zero = 'total:count',
}
check.wrap_table(optim.schedules, SCHEDULES, 'schedules.')

return optim
