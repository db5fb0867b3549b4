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
local function new_state(p, keys)
  local st = {}
  for _, k in ipairs(keys) do st[k] = gl.zeros(p.shape, { dtype = 'float32', device = p.device }):keep() end
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
      local keys = self.state_keys
      if needs_master(p) then keys = { unpack(keys) }; keys[#keys + 1] = 'master' end
      for _, k in ipairs(keys) do
        local key = self.prefix .. g.names[i] .. '.' .. k
        local t = sd.tensors[key]
        if t == nil then error('optimizer state: missing ' .. key, 3) end
        check.tensor(t, 'optimizer load_state_dict', key, 3)
        if not gl.same_shape(t.shape, p.shape) then
          error(('optimizer state: %s has shape {%s}, parameter has {%s}'):format(key,
            table.concat(t.shape, ','), table.concat(p.shape, ',')), 3)
        end
        pending[#pending + 1] = { p, k, t }
      end
    end
  end
  for _, e in ipairs(pending) do
    local p, k, t = e[1], e[2], e[3]
    self.state[p] = self.state[p] or {}
    local dst = self.state[p][k] or gl.zeros(p.shape, { dtype = 'float32', device = p.device }):keep()
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
  local self = setmetatable({ groups = make_groups(params, d, 'AdamW'), state = {}, t = 0, prefix = 'adamw.',
                              state_keys = { 'm', 'v' } }, AdamW)
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
        if not st then st = new_state(p, self.state_keys); self.state[p] = st end
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

-- ---------------------------------------------------------------- Muon
-- Quintic Newton–Schulz orthogonalisation (modded-nanogpt coefficients):
-- X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation.
-- `dtype`: what the iteration runs in (default G's own).  Muon runs it in
-- bfloat16 for a bf16 parameter on a GPU (optim.ns_dtype): the three
-- products of each step on cuBLASLt's bf16 tensor cores, as modded-nanogpt
-- and nanochat do, since the iteration only has to land the singular values
-- in a band around 1, which bf16 rounding does not disturb; float32 and
-- float64 training, and the CPU, keep G's dtype.  The result comes back in
-- G's dtype; the caller's state (Muon's momentum buffer) stays fp32.
local NS = { 3.4445, -4.7750, 2.0315 }
function optim.ns_dtype(p)
  if p.device ~= 'cpu' and p.dtype == 'bfloat16' then return 'bfloat16' end
  return nil
end
function optim.newton_schulz(G, steps, dtype)
  steps = steps or 5
  dtype = dtype or G.dtype
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
    if X.device == 'cpu' then Xs = X * (1 / (gl.global_norm({ X }) + 1e-7))
    else  -- on a GPU the norm stays on the device: no host wait per matrix
      local n = gl._raw.reduce_raw(lib.GL_R_NORM2, X, nil, false, 'newton_schulz')
      local d = n + 1e-7
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
    for _ = 1, steps do
      local Xt = X:t()
      local Am = gl.matmul_raw(X, Xt)
      local Bm = Am:clone()
      gl.matmul_raw(Am, Am, Bm, NS[2], NS[3])  -- b A + c A^2
      local Xn = X:clone()
      gl.matmul_raw(Bm, X, Xn, NS[1], 1)       -- a X + B X
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

local Muon = {}
Muon.__index = Muon
optim.Muon = Muon
-- Muon(params, {lr=0.02, momentum=0.95, nesterov=true, ns_steps=5}); 2-D only
setmetatable(Muon, { __call = function(_, params, opts)
  opts = opts or {}
  local d = { lr = opts.lr or 0.02, momentum = opts.momentum or 0.95, nesterov = opts.nesterov ~= false,
              ns_steps = opts.ns_steps or 5 }
  local self = setmetatable({ groups = make_groups(params, d, 'Muon'), state = {}, t = 0, prefix = 'muon.',
                              state_keys = { 'momentum_buffer' } }, Muon)
  for _, g in ipairs(self.groups) do
    check_num(g.momentum, 'Muon: momentum', 0)
    check.integer(g.ns_steps, 'Muon', 'ns_steps', 0, nil, 3)
    for i, p in ipairs(g.params) do
      if #p.shape ~= 2 then
        error(('Muon: parameter %s has %d dims; Muon applies only to 2-D matrices'):format(g.names[i], #p.shape), 2)
      end
    end
  end
  return self
end })
Muon.set_lr_mult, Muon.state_dict, Muon.load_state_dict = set_lr_mult, state_dict, load_state_dict

-- the orthogonalised update of one matrix (momentum applied to buf in place)
function Muon.update_direction(p, grad, buf, g)
  local upd = gl.empty(p.shape, { dtype = 'float32', device = p.device })
  K(lib.gl_momentum_update(upd.c, buf.c, grad.c, 0, p:numel(), g.momentum, g.nesterov and 1 or 0))
  local X = optim.newton_schulz(upd, g.ns_steps, optim.ns_dtype(p))
  Tensor.release(upd)
  return X
end

function Muon:step()
  self.t = self.t + 1
  gl.no_grad(function()
    for _, g in ipairs(self.groups) do
      for _, p in ipairs(g.params) do
        if p.grad then
          local st = self.state[p]
          if not st then st = new_state(p, self.state_keys); self.state[p] = st end
          -- (a tensor-parallel run sets update_direction and matrix_shape on
          -- the instance: the direction of the whole matrix, cut to the shard)
          local X = (self.update_direction or Muon.update_direction)(p, p.grad, st.momentum_buffer, g)
          local shape = self.matrix_shape and self.matrix_shape(p) or p.shape
          local scale = math.sqrt(math.max(1, shape[1] / shape[2]))
          local target = update_target(p, st)
          local Xd = X:to(target.dtype)
          target:add_(Xd, -g.lr * scale)
          write_back(p, st)
          Tensor.release(X)  -- one matrix's temporaries at a time
          if Xd ~= X then Tensor.release(Xd) end
        end
      end
    end
  end)
end

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

-- nanochat's split: hidden matrices -> Muon, embedding / lm_head / vectors
-- -> AdamW with their own learning rates (scaled by (n_embd/768)^-0.5).
function optim.nanochat(model, opts)
  opts = opts or {}
  local C = model.config.n_embd
  local scale = (C / 768) ^ -0.5
  local matrices, emb, head, other = {}, {}, {}, {}
  for _, np in ipairs(model:named_parameters()) do
    local name, p = np[1], np[2]
    if name:match('^transformer%.h%.') and #p.shape == 2 then matrices[#matrices + 1] = np
    elseif name:match('wte') then emb[#emb + 1] = np
    elseif name:match('lm_head') then head[#head + 1] = np
    else other[#other + 1] = np end
  end
  local adam_groups = {}
  if #emb > 0 then adam_groups[#adam_groups + 1] = { params = emb, lr = (opts.embedding_lr or 0.2) * scale } end
  if #head > 0 then adam_groups[#adam_groups + 1] = { params = head, lr = (opts.unembedding_lr or 0.004) * scale } end
  if #other > 0 then adam_groups[#adam_groups + 1] = { params = other, lr = (opts.scalar_lr or 0.004) * scale } end
  local list = { AdamW(adam_groups, { betas = opts.adam_betas or { 0.8, 0.95 }, eps = 1e-10, weight_decay = 0 }) }
  if #matrices > 0 then
    list[#list + 1] = Muon(matrices, { lr = opts.matrix_lr or 0.02, momentum = opts.momentum or 0.95 })
  end
  return Combined(list)
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
optim.newton_schulz = check.wrap('newton_schulz', 'G:tensor, steps:integer?, dtype:string?', optim.newton_schulz)
optim.nanochat = check.wrap('nanochat', 'model:module, opts:opts?', optim.nanochat)

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

-- schedule constructors: numbers in, a function of the step out
local SCHEDULES = {
  linear_warmup = 'warmup:number', cosine = 'warmup:number, total:number, min_ratio:number?',
  wsd = 'warmup:number, total:number, cooldown_frac:number?, final_ratio:number?',
  muon_momentum = 'from:number?, to:number?, steps:number?',
}
check.wrap_table(optim.schedules, SCHEDULES, 'schedules.')

return optim
