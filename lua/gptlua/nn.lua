-- gptlua.nn — modules in the spirit of Torch7's nn: a module owns named
-- parameters and child modules (both kept in registration order, so
-- named_parameters() is stable), and forward() reads like the math.
--   local nn = require 'gptlua.nn'
--   local fc = nn.Linear(128, 512)           -- y = x W^T + b
--   local y = fc(x)                           -- __call is forward
local gl = require 'gptlua'
local check = require 'gptlua.check'

local nn = {}

-- class(name [, parent]): a constructor table; Class(...) calls __init
function nn.class(name, parent)
  local cls = {}
  cls.__index = cls
  cls.__name = name
  cls.__call = function(self, ...) return self:forward(...) end
  cls.__tostring = function(self) return self:describe() end
  setmetatable(cls, {
    __index = parent,
    __call = function(c, ...)
      local obj = setmetatable({ _params = {}, _modules = {}, _buffers = {}, training = true }, c)
      obj:__init(...)
      return obj
    end,
  })
  cls.parent = parent
  return cls
end

local Module = nn.class('Module')
nn.Module = Module
function Module:__init() end
function Module:forward() error(getmetatable(self).__name .. ': forward is not defined', 2) end

-- registers a parameter (a floating tensor) under name; returns it.
-- nn.on_param(t), when set, sees every parameter as it is registered (a
-- pipeline rank builds only its stages: gptlua.dist.pp_build)
function Module:param(name, t)
  t.requires_grad = true
  if nn.on_param then nn.on_param(t) end
  self._params[#self._params + 1] = name
  self[name] = t
  return t
end
-- non-trainable state saved in state_dict (e.g. rotary tables)
function Module:buffer(name, t, persistent)
  self._buffers[#self._buffers + 1] = { name = name, persistent = persistent ~= false }
  self[name] = t
  return t
end
function Module:add(name, m)
  self._modules[#self._modules + 1] = name
  self[name] = m
  return m
end

-- list of {name, tensor} in a stable order (registration order, depth-first);
-- a tensor shared by two modules (tied weights) appears once, first name wins
function Module:named_parameters(prefix, out, seen)
  out, seen, prefix = out or {}, seen or {}, prefix or ''
  for _, n in ipairs(self._params) do
    local t = self[n]
    if t and not seen[t] then seen[t] = true; out[#out + 1] = { prefix .. n, t } end
  end
  for _, n in ipairs(self._modules) do self[n]:named_parameters(prefix .. n .. '.', out, seen) end
  return out
end
function Module:parameters()
  local ps = {}
  for i, np in ipairs(self:named_parameters()) do ps[i] = np[2] end
  return ps
end
function Module:named_buffers(prefix, out)
  out, prefix = out or {}, prefix or ''
  for _, b in ipairs(self._buffers) do
    if b.persistent then out[#out + 1] = { prefix .. b.name, self[b.name] } end
  end
  for _, n in ipairs(self._modules) do self[n]:named_buffers(prefix .. n .. '.', out) end
  return out
end
function Module:num_params()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end
function Module:modules(out)
  out = out or {}
  out[#out + 1] = self
  for _, n in ipairs(self._modules) do self[n]:modules(out) end
  return out
end
function Module:train(flag)
  if flag == nil then flag = true end
  for _, m in ipairs(self:modules()) do m.training = flag end
  return self
end
function Module:eval() return self:train(false) end
function Module:zero_grad()
  for _, p in ipairs(self:parameters()) do if p.grad then p.grad:zero_() end end
end

-- name -> tensor for parameters and persistent buffers
function Module:state_dict()
  local sd, order = {}, {}
  for _, np in ipairs(self:named_parameters()) do sd[np[1]] = np[2]; order[#order + 1] = np[1] end
  for _, nb in ipairs(self:named_buffers()) do sd[nb[1]] = nb[2]; order[#order + 1] = nb[1] end
  return sd, order
end

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end

-- Copies every entry into the module's tensors.  strict (default) rejects
-- missing and unexpected names; shapes must match.  Nothing is copied
-- unless everything checks out.  A parameter another pipeline rank holds
-- (t.held_by, gptlua.dist.pp_build) is checked and not copied.
function Module:load_state_dict(sd, opts)
  local strict = not (opts and opts.strict == false)
  local mine, order = self:state_dict()
  local missing, extra = {}, {}
  for _, n in ipairs(order) do if sd[n] == nil then missing[#missing + 1] = n end end
  for n in pairs(sd) do if mine[n] == nil then extra[#extra + 1] = n end end
  table.sort(extra)
  if strict and (#missing > 0 or #extra > 0) then
    local msg = {}
    if #missing > 0 then msg[#msg + 1] = 'missing: ' .. table.concat(missing, ', ') end
    if #extra > 0 then msg[#msg + 1] = 'unexpected: ' .. table.concat(extra, ', ') end
    error('load_state_dict: ' .. table.concat(msg, '; '), 2)
  end
  for _, n in ipairs(order) do
    local src = sd[n]
    if src ~= nil then
      check.tensor(src, 'load_state_dict', "state dict entry '" .. n .. "'")
      local dst = mine[n]
      if not gl.same_shape(dst.shape, src.shape) then
        error(('load_state_dict: %s has shape %s in the state dict, the model expects %s'):format(n,
          shape_str(src.shape), shape_str(dst.shape)), 2)
      end
    end
  end
  gl.no_grad(function()
    for _, n in ipairs(order) do if sd[n] ~= nil and not rawget(mine[n], 'held_by') then mine[n]:copy_(sd[n]) end end
  end)
  return missing, extra
end

-- moves/casts all parameters and buffers in place (keeps the same objects);
-- a parameter another pipeline rank holds (t.held_by) has no storage here:
-- only its dtype or device changes
function Module:to(device_or_dtype)
  local function move(t)
    if rawget(t, 'held_by') then
      local d = device_or_dtype
      if d == 'cpu' or d:match('^cuda') then t.device = select(2, gl.Tensor.device_id(d, 'to'))
      else t.dtype = select(2, gl.Tensor.dtype_id(d, 'to')) end
      return
    end
    local n = t:to(device_or_dtype):detach()
    t.c, t.shape, t.dtype, t.device = n.c, n.shape, n.dtype, n.device
    if t.grad then t.grad = nil end
  end
  for _, p in ipairs(self:parameters()) do move(p) end
  for _, m in ipairs(self:modules()) do
    for _, b in ipairs(m._buffers) do move(m[b.name]) end
  end
  return self
end

function Module:describe(indent)
  indent = indent or ''
  local name = getmetatable(self).__name
  local extra = self.extra_repr and self:extra_repr() or ''
  if #self._modules == 0 then return name .. '(' .. extra .. ')' end
  local lines = { name .. '(' .. extra }
  for _, n in ipairs(self._modules) do
    lines[#lines + 1] = indent .. '  (' .. n .. '): ' .. self[n]:describe(indent .. '  ')
  end
  lines[#lines + 1] = indent .. ')'
  return table.concat(lines, '\n')
end

-- parameter initialisation draws from the global seeded RNG
local function normal(shape, std, opts)
  return gl.normal(shape, 0, std, { dtype = opts and opts.dtype, device = opts and opts.device })
end
nn.normal = normal

-- Linear(in, out, {bias=true, std=0.02}): y = x W^T + b, W (out, in)
local Linear = nn.class('Linear', Module)
nn.Linear = Linear
function Linear:__init(n_in, n_out, opts)
  opts = opts or {}
  self.n_in, self.n_out = n_in, n_out
  local std = opts.std or 0.02
  local w = std == 0 and gl.zeros({ n_out, n_in }, opts) or normal({ n_out, n_in }, std, opts)
  self:param('weight', w)
  if opts.bias ~= false then self:param('bias', gl.zeros({ n_out }, opts)) end
end
-- self.fp8 ('tensorwise' / 'rowwise', set by the precision policy,
-- gptlua.fp8): the three products in FP8 (gl.fp8_linear), the bias added
-- after; self.fp8_tokens (set by context parallelism): a function giving
-- the comm that splits this forward's tokens, or nil
function Linear:forward(x)
  if self.fp8 then
    local y = gl.fp8_linear(x, self.weight, self.fp8, self.fp8_tokens and { tokens = self.fp8_tokens() } or nil)
    if self.bias then return y + self.bias end
    return y
  end
  return gl.linear(x, self.weight, self.bias)
end
function Linear:extra_repr() return ('%d -> %d%s'):format(self.n_in, self.n_out, self.bias and '' or ', no bias') end

-- Embedding(n, dim, {std=0.02})
local Embedding = nn.class('Embedding', Module)
nn.Embedding = Embedding
function Embedding:__init(n, dim, opts)
  opts = opts or {}
  self.n, self.dim = n, dim
  self:param('weight', normal({ n, dim }, opts.std or 0.02, opts))
end
function Embedding:forward(ids) return gl.embedding(ids, self.weight) end
function Embedding:extra_repr() return ('%d, %d'):format(self.n, self.dim) end

-- LayerNorm(dim, {bias=true, eps=1e-5})
local LayerNorm = nn.class('LayerNorm', Module)
nn.LayerNorm = LayerNorm
function LayerNorm:__init(dim, opts)
  opts = opts or {}
  self.dim, self.eps = dim, opts.eps or 1e-5
  self:param('weight', gl.ones({ dim }, opts))
  if opts.bias ~= false then self:param('bias', gl.zeros({ dim }, opts)) end
end
function LayerNorm:forward(x) return gl.layer_norm(x, self.weight, self.bias, self.eps) end
function LayerNorm:extra_repr() return tostring(self.dim) end

-- RMSNorm(dim, {weight=false, eps=1e-6}): nanochat's norm has no parameters
local RMSNorm = nn.class('RMSNorm', Module)
nn.RMSNorm = RMSNorm
function RMSNorm:__init(dim, opts)
  opts = opts or {}
  self.dim, self.eps = dim, opts.eps or 1e-6
  if opts.weight then self:param('weight', gl.ones({ dim }, opts)) end
end
function RMSNorm:forward(x) return gl.rms_norm(x, self.weight, self.eps) end
function RMSNorm:extra_repr() return tostring(self.dim) end

local Dropout = nn.class('Dropout', Module)
nn.Dropout = Dropout
function Dropout:__init(p)
  self.p = p or 0
  if not (self.p >= 0 and self.p < 1) then check.fail('Dropout', 'p', 'a probability in [0, 1)', p) end
end
function Dropout:forward(x) return gl.dropout(x, self.p, self.training) end
function Dropout:extra_repr() return tostring(self.p) end

-- ModuleList: children named 0, 1, ... (the GPT-2 checkpoint's h.0, h.1)
local ModuleList = nn.class('ModuleList', Module)
nn.ModuleList = ModuleList
function ModuleList:__init(list)
  self.n = 0
  for _, m in ipairs(list or {}) do self:append(m) end
end
function ModuleList:append(m)
  self:add(tostring(self.n), m)
  self.n = self.n + 1
  self[self.n] = m  -- also 1-based for Lua loops
  return m
end
function ModuleList:forward() error('ModuleList: has no forward; iterate over its modules', 2) end

local Sequential = nn.class('Sequential', ModuleList)
nn.Sequential = Sequential
function Sequential:forward(x)
  for i = 1, self.n do x = self[i](x) end
  return x
end

-- nn.checked(cls, sigs): every method named in sigs checks its arguments
-- (gptlua.check.wrap signatures); '__init' is the constructor, reported
-- under the class name.  Models declare their forward the same way.
function nn.checked(cls, sigs)
  for k, sig in pairs(sigs) do
    local name = cls.__name .. (k == '__init' and '' or ':' .. k)
    cls[k] = check.wrap(name, sig, cls[k], k == '__init' and 3 or 2)
  end
  return cls
end

local opts = 'opts:opts?'
nn.checked(Module, { param = 'self:module, name:string, tensor:tensor', buffer = 'self:module, name:string, tensor:tensor',
                     add = 'self:module, name:string, module:module', load_state_dict = 'self:module, state_dict:opts, ' .. opts,
                     train = 'self:module, flag:boolean?', to = 'self:module, device_or_dtype:any' })
nn.checked(Linear, { __init = 'self:module, in_features:count, out_features:count, ' .. opts, forward = 'self:module, x:tensor' })
nn.checked(Embedding, { __init = 'self:module, num_embeddings:count, dim:count, ' .. opts, forward = 'self:module, ids:tensor' })
nn.checked(LayerNorm, { __init = 'self:module, dim:count, ' .. opts, forward = 'self:module, x:tensor' })
nn.checked(RMSNorm, { __init = 'self:module, dim:count, ' .. opts, forward = 'self:module, x:tensor' })
nn.checked(Dropout, { __init = 'self:module, p:number?', forward = 'self:module, x:tensor' })
nn.checked(ModuleList, { __init = 'self:module, modules:opts?', append = 'self:module, module:module' })
nn.checked(Sequential, { forward = 'self:module, x:tensor' })

return nn
