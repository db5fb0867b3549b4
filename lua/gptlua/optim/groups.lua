-- gptlua.optim.groups — what every optimizer shares: parameter groups (a
-- list of tensors, of {name, tensor} pairs, or of groups {params = ..., lr =
-- ...}), per-parameter state with an fp32 master for a low-precision
-- parameter, the learning-rate multiplier, and state dicts for checkpoints.
local gl = require 'gptlua'
local G = require 'gptlua.ffi'
local check = require 'gptlua.check'
local ffi, lib, Tensor = gl.ffi, gl.lib, gl.Tensor

local optim = {}

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

return {
  check_num = check_num,
  load_state_dict = load_state_dict,
  make_groups = make_groups,
  needs_master = needs_master,
  new_state = new_state,
  set_lr_mult = set_lr_mult,
  state_dict = state_dict,
  update_target = update_target,
  write_back = write_back,
  optim = optim,
}
