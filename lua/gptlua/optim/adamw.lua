-- gptlua.optim.adamw — AdamW: every parameter in one multi-tensor update per
-- (device, betas, eps), a flat slice (the shards the sharded policies own),
-- or with its rates read from a captured step's block.
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local check = require 'gptlua.check'
local ffi, lib, Tensor = gl.ffi, gl.lib, gl.Tensor
local groups = require 'gptlua.optim.groups'
local check_num, load_state_dict, make_groups, new_state, set_lr_mult, state_dict, update_target = groups.check_num, groups.load_state_dict, groups.make_groups, groups.new_state, groups.set_lr_mult, groups.state_dict, groups.update_target

local optim = {}

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

-- One AdamW update of the flat slice [start, start + len) of param, with
-- grad, m and v laid out alike and group g's settings at step t: how the
-- sharded policies (ZeRO, FSDP) step the shards they own with this
-- optimizer's arithmetic instead of a copy of it.
function AdamW.update_slice(param, grad, m, v, start, len, g, t)
  G.check(lib.gl_adamw_update(param.c, grad.c, m.c, v.c, start, len, g.lr, g.betas[1], g.betas[2], g.eps,
    g.weight_decay, t), 2)
end

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
    G.check(lib.gl_adamw_update_multi(n, a.params, a.grads, a.ms, a.vs, a.outs, a.lrs, a.wds, g0.betas[1], g0.betas[2],
      g0.eps, self.t), 2)
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
require 'gptlua.libc'   -- pow
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
  G.check(lib.gl_adamw_update_block(n, a.params, a.grads, a.ms, a.vs, a.outs, block.c, a.slots), 2)
end
function AdamW:step_taken()
  self.t = self.t + 1
  for _, p in ipairs(self._block_list or {}) do  -- the rounded weights were written in place
    if self.state[p].master then local v = versions.counter(p); v[1] = v[1] + 1 end
  end
end

return { AdamW = AdamW, optim = optim }
