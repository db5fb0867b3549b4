-- gptlua.tensor — the Tensor class: a Lua object holding one engine tensor
-- (a `gl_tensor*` FFI cdata released through ffi.gc) plus its autograd
-- fields.  Shapes are Lua tables; dims are 1-based as in Torch7 and negative
-- dims count from the end.  Views are computed here and bounds-checked by the
-- engine (gl_as_strided), so no view can reach outside its storage.
local G = require 'gptlua.ffi'
local ffi, lib, check, check_ptr = G.ffi, G.lib, G.check, G.check_ptr

local describe, printable = require('gptlua.check').describe, require('gptlua.check').printable

local Tensor = {}
Tensor.__name = 'Tensor'

-- Use after free.  Releasing a tensor (t:free(), the end of a scope, an
-- op dropping its temporaries) drops its storage but keeps its struct, so
-- a method reading data through it would read through NULL.  Every release
-- goes through Tensor.release, which also swaps the tensor's metatable for
-- Freed: its lookups raise "NAME: tensor was freed", and so do its
-- operators and printing.  A live tensor's lookups go through
-- Tensor.__index (below), which the guard does not touch.  Freed answers
-- getmetatable with Tensor (__metatable), so a freed tensor is still a
-- Tensor to every identity check and to the engine's own "has been freed".
-- Metadata stays readable after free (shape, dtype, numel, ...: FSDP keeps
-- parameters freed between uses, as PyTorch does, and gives them storage
-- again through Tensor.rebind), and so do the flags (free, is_freed, keep,
-- requires_grad_, register_hook).
local AFTER_FREE = { free = true, is_freed = true, keep = true, numel = true, dim = true, size = true,
  stride = true, storage_offset = true, is_contiguous = true, is_floating = true, requires_grad_ = true,
  register_hook = true }
local function freed(t) local c = rawget(t, 'c'); return c ~= nil and c.storage == nil end
-- x[i], x[i][j], x[i] = v: Torch's indexing.  A number i (1-based, a
-- negative one counting from the end) is row i: a view (x:select(1, i)) of
-- a tensor of 2 or more dims, the value of a 1-D one, so that x[i][j] reads
-- an element and x[i][j] = v writes one.  Every other key is the class's
-- (methods) or the tensor's own field; a number key is only ever a row, so
-- methods pay one type test.  Slices: x:narrow(dim, start, length).
local function row_of(t, i, what)
  local n = t.shape[1]
  if n == nil then error(what .. ': a 0-dim tensor has no rows (x:item() is its value)', 0) end
  if i ~= math.floor(i) then error(('%s: expected an integer row, got %s'):format(what, tostring(i)), 0) end
  local j = i < 0 and n + 1 + i or i
  if j < 1 or j > n or i == 0 then
    error(('%s: row %s is out of range for dim 1 of size %d (1..%d, or -%d..-1)'):format(what, tostring(i), n, n, n), 0)
  end
  return j
end
Tensor.__index = function(t, k)
  local v = Tensor[k]
  if v ~= nil or type(k) ~= 'number' then return v end
  local j = row_of(t, k, 'index')
  if #t.shape == 1 then return t:narrow(1, j, 1):item() end
  return t:select(1, j)
end
Tensor.__newindex = function(t, k, v)
  if type(k) ~= 'number' then rawset(t, k, v) return end
  local j = row_of(t, k, 'index assignment')
  if type(v) == 'number' then t:narrow(1, j, 1):fill_(v)
  elseif getmetatable(v) == Tensor and #t.shape == 1 then t:narrow(1, j, 1):fill_(v:item())
  elseif getmetatable(v) == Tensor then t:select(1, j):copy_(v)
  else error(('index assignment: expected a number or a Tensor, got %s'):format(describe(v)), 2) end
end
local Freed = { __name = 'Tensor', __metatable = Tensor }
Freed.__index = function(t, k)
  local v = Tensor[k]
  if type(v) == 'function' and not AFTER_FREE[k] then error(k .. ': tensor was freed', 2) end
  return v
end

-- Tensor.release(t): drops t's storage now (the memory returns to the
-- allocator at once, not when the Lua GC runs) and marks t freed.  The one
-- release function: every site that frees a tensor calls it.
function Tensor.release(t)
  local c = t.c
  if c.storage ~= nil then lib.gl_tensor_release(c) end
  if debug.getmetatable(t) ~= Freed then setmetatable(t, Freed) end
end
-- Tensor.rebind(t, c): t now holds the engine tensor c (FSDP and ZeRO move
-- a parameter into a view of their flat buffer); the old one is released.
function Tensor.rebind(t, c)
  local old = t.c
  if old ~= c and old.storage ~= nil then lib.gl_tensor_release(old) end
  t.c = c
  debug.setmetatable(t, c.storage ~= nil and Tensor or Freed)
end

-- Operands of the arithmetic metamethods (a and b): a live Tensor or a
-- number ("add: b must be a Tensor or a number, got the string 'a'").
local OPERATORS = { __add = 'add', __sub = 'sub', __mul = 'mul', __div = 'div', __pow = 'pow',
  __mod = 'mod', __unm = 'neg' }
local function operand(what, name, x)
  if type(x) == 'number' then return end
  if getmetatable(x) ~= Tensor then
    error(('%s: %s must be a Tensor or a number, got %s'):format(what, name, describe(x)), 3)
  end
  if freed(x) then error(('%s: %s: tensor was freed'):format(what, name), 3) end
end
-- Version counters (as PyTorch's).  Every tensor carries a counter, a
-- one-slot table shared by all the views of one storage (_as_strided and
-- view_dtype hand the base's to the view; detach too), and every in-place
-- method bumps it.  The in-place methods are recognised here, where Tensor
-- methods are defined (a name ending in '_', and set): each is wrapped once
-- so that versions.check, which autograd installs (no in-place change of a
-- tensor that requires grad while grad mode is on), runs before it and the
-- bump after it.  Autograd records the counters of the tensors an op saves
-- for backward and compares them before running its backward.
-- Tensor.versions.of(t) reads t's version.
-- set (element assignment) writes in place too, without the trailing '_'.
local NOT_INPLACE = { requires_grad_ = true }
local ALSO_INPLACE = { set = true }
local function is_inplace(k)
  return type(k) == 'string' and ((k:sub(-1) == '_' and not NOT_INPLACE[k]) or ALSO_INPLACE[k] ~= nil)
end
local versions = { check = function() end }
Tensor.versions = versions
function versions.counter(t)
  local v = rawget(t, '_version')
  if v == nil then v = { 0 }; rawset(t, '_version', v) end
  return v
end
function versions.of(t) return versions.counter(t)[1] end
local function bumped(t, ...)
  local v = versions.counter(t)
  v[1] = v[1] + 1
  return ...
end

setmetatable(Tensor, { __newindex = function(T, k, v)
  if is_inplace(k) and type(v) == 'function' then
    local f, what = v, k
    v = function(t, ...)
      if getmetatable(t) == Tensor then versions.check(t, what) end
      return bumped(t, f(t, ...))
    end
  elseif OPERATORS[k] and type(v) == 'function' then
    local f, what = v, OPERATORS[k]
    v = function(a, b) operand(what, 'a', a); operand(what, 'b', b); return f(a, b) end
  elseif k == '__tostring' and type(v) == 'function' then
    local f = v
    v = function(t) if freed(t) then error('tostring: tensor was freed', 3) end; return f(t) end
  end
  -- a freed tensor keeps the metamethods (their operand checks raise)
  if type(k) == 'string' and k:sub(1, 2) == '__' then Freed[k] = v end
  rawset(T, k, v)
end })

local DTYPES = { 'float32', 'float64', 'bfloat16', 'float16', 'int32', 'int64', 'uint16', 'uint8', 'bool',
  'float8_e4m3fn', 'float8_e5m2' }
local DTYPE_ID, DTYPE_NAME = {}, {}
for i, n in ipairs(DTYPES) do DTYPE_ID[n] = i - 1; DTYPE_NAME[i - 1] = n end
local ALIASES = { float = 'float32', double = 'float64', bf16 = 'bfloat16', half = 'float16',
  int = 'int32', long = 'int64', f32 = 'float32', f64 = 'float64', i32 = 'int32', i64 = 'int64',
  byte = 'uint8' }
local FLOATING = { float32 = true, float64 = true, bfloat16 = true, float16 = true,
  float8_e4m3fn = true, float8_e5m2 = true }
Tensor.DTYPES, Tensor.FLOATING = DTYPES, FLOATING

local default_dtype = 'float32'

function Tensor.dtype_id(d, what)
  local name = ALIASES[d] or d
  local id = DTYPE_ID[name]
  if id == nil then
    error(("%s: unknown dtype '%s' (expected one of %s)"):format(what or 'dtype', printable(d),
      table.concat(DTYPES, ', ')), 3)
  end
  return id, name
end

function Tensor.device_id(dev, what)
  if dev == nil or dev == 'cpu' or dev == -1 then return -1, 'cpu' end
  if dev == 'cuda' then return 0, 'cuda:0' end
  local n = type(dev) == 'string' and dev:match('^cuda:(%d+)$')
  if n then return tonumber(n), dev end
  error(("%s: unknown device '%s' (expected 'cpu', 'cuda' or 'cuda:N')"):format(what or 'device', printable(dev)), 3)
end

local function device_name(id) return id < 0 and 'cpu' or ('cuda:' .. id) end

function Tensor.set_default_dtype(d) local _, n = Tensor.dtype_id(d); default_dtype = n end
function Tensor.get_default_dtype() return default_dtype end

-- Tensor scopes: every tensor created while a scope is open is recorded
-- in it, and when the scope closes their storage references are dropped at
-- once (a view's release never frees storage another tensor still holds).
-- This is how the trainer frees each step's temporaries deterministically
-- instead of waiting for the Lua GC.  A tensor that must outlive the scope
-- (a gradient buffer, optimizer state) is marked with t:keep().
local scopes = {}

-- Wraps a fresh gl_tensor* (owned) into a Tensor.
function Tensor.wrap(p)
  check_ptr(p, 2)
  ffi.gc(p, lib.gl_tensor_free)
  local nd = p.ndim
  local shape = {}
  for d = 0, nd - 1 do shape[d + 1] = tonumber(p.shape[d]) end
  local t = setmetatable({ c = p, shape = shape, dtype = DTYPE_NAME[p.dtype], device = device_name(p.device) }, Tensor)
  local s = scopes[#scopes]
  if s then s[#s + 1] = t end
  local hook = Tensor.on_wrap  -- the planner's (gptlua.plan): it sees every tensor made
  if hook then hook(t) end
  return t
end

-- keep(): exempt this tensor from release at the end of the enclosing scope
function Tensor:keep() self._keep = true; return self end

-- scope(fn, ...): runs fn; afterwards releases every tensor it created that
-- is not kept and not among fn's results (those move to the outer scope).
function Tensor.scope(fn, ...)
  local list = {}
  scopes[#scopes + 1] = list
  local res = { pcall(fn, ...) }
  scopes[#scopes] = nil
  local n = table.maxn(res)
  local returned = {}
  for i = 2, n do if getmetatable(res[i]) == Tensor then returned[res[i]] = true end end
  local outer = scopes[#scopes]
  for i = 1, #list do
    local t = list[i]
    if returned[t] or t._keep then
      if outer and not t._keep then outer[#outer + 1] = t end
    elseif t.c.storage ~= nil then
      Tensor.release(t)
      t.grad_fn = nil
    end
  end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, n)
end

local shape_buf = ffi.new('int64_t[8]')
local stride_buf = ffi.new('int64_t[8]')

-- Accepts {2,3}, (2,3) varargs, or another tensor's shape.
local function shape_arg(s, ...)
  if type(s) == 'table' then
    if getmetatable(s) == Tensor then error('expected a shape, got a tensor', 3) end
    return s
  end
  return { s, ... }
end
Tensor.shape_arg = shape_arg

local function fill_shape(shape, what)
  if #shape > 8 then error(('%s: at most 8 dims, got %d'):format(what, #shape), 3) end
  for i, n in ipairs(shape) do
    if type(n) ~= 'number' or n ~= math.floor(n) then
      error(('%s: size of dim %d must be an integer, got %s'):format(what, i, tostring(n)), 3)
    end
    shape_buf[i - 1] = n
  end
  return #shape
end

-- empty(shape, {dtype=, device=})
function Tensor.empty(shape, opts)
  opts = opts or {}
  local dt = Tensor.dtype_id(opts.dtype or default_dtype, 'empty')
  local dev = Tensor.device_id(opts.device, 'empty')
  local nd = fill_shape(shape, 'empty')
  local p = lib.gl_empty(dt, dev, nd, shape_buf)
  if p == nil and ffi.string(lib.gl_last_error()):find('out of', 1, true) then
    -- the engine already emptied its cache; tensors the Lua GC has not yet
    -- collected may still hold memory: collect them and retry once
    collectgarbage('collect'); collectgarbage('collect')
    p = lib.gl_empty(dt, dev, nd, shape_buf)
  end
  return Tensor.wrap(p)
end

-- ---------------------------------------------------------------- views --
local function norm_dim(t, d, what, extra)
  local nd = #t.shape + (extra or 0)
  if type(d) ~= 'number' then error(('%s: dim must be a number, got %s'):format(what, type(d)), 4) end
  local r = d < 0 and nd + d + 1 or d
  if r < 1 or r > nd then
    error(('%s: dim %d out of range for a %d-d tensor (expected %d..%d)'):format(what, d, #t.shape, -nd, nd), 4)
  end
  return r
end
Tensor.norm_dim = norm_dim

-- stride(dim): the step in elements along dim, or every dim's as a table
function Tensor:stride(d)
  local p = self.c
  if d then return tonumber(p.stride[norm_dim(self, d, 'stride') - 1]) end
  local s = {}
  for i = 0, p.ndim - 1 do s[i + 1] = tonumber(p.stride[i]) end
  return s
end
-- storage_offset(): where the first element is in the storage, in elements
function Tensor:storage_offset() return tonumber(self.c.offset) end

-- raw view (no autograd): shape/stride tables, element offset
function Tensor:_as_strided(shape, stride, offset)
  local nd = fill_shape(shape, 'as_strided')
  -- one integer stride per dim (the engine checks the range); a missing or
  -- fractional one would reach the FFI as nil or be truncated
  if #stride ~= nd then
    error(('as_strided: stride has %d entries, expected %d (one per dim of shape %s)'):format(#stride, nd,
      '{' .. table.concat(shape, ',') .. '}'), 2)
  end
  for i = 1, nd do
    local s = stride[i]
    if type(s) ~= 'number' or s ~= math.floor(s) or math.abs(s) >= 2 ^ 62 then
      error(('as_strided: stride of dim %d must be a finite integer, got %s'):format(i, describe(s)), 2)
    end
    stride_buf[i - 1] = s
  end
  local t = Tensor.wrap(lib.gl_as_strided(self.c, nd, shape_buf, stride_buf, offset or tonumber(self.c.offset)))
  t._version = versions.counter(self)  -- a view shares its base's version counter
  return t
end

-- the same bytes as another dtype and shape (a reinterpreting view)
function Tensor:view_dtype(dtype, shape)
  if not self:is_contiguous() then error('view_dtype: tensor must be contiguous', 2) end
  local dt = Tensor.dtype_id(dtype, 'view_dtype')
  local nd = fill_shape(shape, 'view_dtype')
  local t = Tensor.wrap(lib.gl_view_dtype(self.c, dt, nd, shape_buf, 0))
  t._version = versions.counter(self)
  return t
end

-- is_contiguous(), numel(), dim(): row-major layout?, element count, number of dims
function Tensor:is_contiguous() return lib.gl_is_contiguous(self.c) == 1 end
function Tensor:numel() return tonumber(self.c.numel) end
function Tensor:dim() return #self.shape end
-- size(dim): the size of dim, or a copy of the shape
function Tensor:size(d)
  if d == nil then local s = {} for i, n in ipairs(self.shape) do s[i] = n end return s end
  return self.shape[norm_dim(self, d, 'size')]
end
-- is_floating(): a floating dtype?  data_ptr(): the first element's address
function Tensor:is_floating() return FLOATING[self.dtype] == true end
-- (an error for a tensor without data: freed, or a meta tensor)
function Tensor:data_ptr()
  local p = lib.gl_data_ptr(self.c)
  if p == nil then error(ffi.string(lib.gl_last_error()), 2) end
  return p
end

-- Contiguous strides of a shape.
local function contiguous_strides(shape)
  local st, n = {}, 1
  for i = #shape, 1, -1 do st[i] = n; n = n * shape[i] end
  return st
end
Tensor.contiguous_strides = contiguous_strides

-- Resolves a -1 entry and checks the element count.
function Tensor.infer_shape(shape, numel, what)
  local out, neg, known = {}, nil, 1
  for i, n in ipairs(shape) do
    out[i] = n
    if n == -1 then
      if neg then error(what .. ': only one dim can be -1', 3) end
      neg = i
    elseif type(n) ~= 'number' or n < 0 or n ~= math.floor(n) then
      error(('%s: invalid size %s in dim %d'):format(what, tostring(n), i), 3)
    else known = known * n end
  end
  if neg then
    if known == 0 or numel % known ~= 0 then
      error(('%s: shape {%s} cannot hold %d elements'):format(what, table.concat(shape, ','), numel), 3)
    end
    out[neg] = numel / known
    known = numel
  end
  if known ~= numel then
    error(('%s: shape {%s} has %d elements, tensor has %d'):format(what, table.concat(out, ','), known, numel), 3)
  end
  return out
end

-- -------------------------------------------------------- element access --
local dbl1 = ffi.new('double[1]')

-- linear element offset of 1-based indices
local function elem_offset(t, idx, what)
  if #idx ~= #t.shape then
    error(('%s: expected %d indices for a %d-d tensor, got %d'):format(what, #t.shape, #t.shape, #idx), 3)
  end
  local off, p = 0, t.c
  for d, i in ipairs(idx) do
    local n = t.shape[d]
    if type(i) ~= 'number' then error(('%s: index %d must be a number'):format(what, d), 3) end
    if i < 0 then i = n + i + 1 end
    if i < 1 or i > n or i ~= math.floor(i) then
      error(('%s: index %s out of range for dim %d of size %d'):format(what, tostring(idx[d]), d, n), 3)
    end
    off = off + (i - 1) * tonumber(p.stride[d - 1])
  end
  return off
end

-- t:get(i, j, ...) with 1-based indices
function Tensor:get(...)
  local t = self
  if self.device ~= 'cpu' then t = self:to('cpu') end
  check(lib.gl_get_item(t.c, elem_offset(t, { ... }, 'get'), dbl1), 2)
  return dbl1[0]
end
-- t:set(value, i, j, ...)
function Tensor:set(v, ...)
  if self.device ~= 'cpu' then error('set: element assignment needs a cpu tensor, this one is on ' .. self.device, 2) end
  check(lib.gl_set_item(self.c, elem_offset(self, { ... }, 'set'), v), 2)
  return self
end

-- item(): the value of a one-element tensor as a Lua number
function Tensor:item()
  if self:numel() ~= 1 then
    error(('item: tensor has %d elements, expected exactly 1'):format(self:numel()), 2)
  end
  local t = self.device == 'cpu' and self or self:to('cpu')
  local idx = {}
  for i = 1, #t.shape do idx[i] = 1 end
  check(lib.gl_get_item(t.c, elem_offset(t, idx, 'item'), dbl1), 2)
  return dbl1[0]
end

-- flat Lua array of all values in row-major order
function Tensor:tolist()
  local t = self.device == 'cpu' and self or self:to('cpu')
  local n = t:numel()
  local buf = ffi.new('double[?]', math.max(n, 1))
  check(lib.gl_to_doubles(t.c, buf), 2)
  local out = {}
  for i = 1, n do out[i] = buf[i - 1] end
  return out
end

-- nested Lua tables (a number for a 0-d tensor)
function Tensor:totable()
  local flat = self:tolist()
  local shape = self.shape
  if #shape == 0 then return flat[1] end
  local pos = 0
  local function build(d)
    local r = {}
    for i = 1, shape[d] do
      if d == #shape then pos = pos + 1; r[i] = flat[pos] else r[i] = build(d + 1) end
    end
    return r
  end
  return build(1)
end

-- from nested Lua tables
function Tensor.from_table(tbl, opts)
  opts = opts or {}
  local shape, flat = {}, {}
  if type(tbl) == 'number' or type(tbl) == 'boolean' then
    flat[1] = tbl == true and 1 or (tbl == false and 0 or tbl)
  else
    local probe = tbl
    while type(probe) == 'table' do shape[#shape + 1] = #probe; probe = probe[1] end
    local function walk(x, d)
      if d > #shape then
        if type(x) == 'boolean' then x = x and 1 or 0 end
        if type(x) ~= 'number' then error(('tensor: expected a number at depth %d, got %s'):format(d, type(x)), 4) end
        flat[#flat + 1] = x
        return
      end
      if type(x) ~= 'table' or #x ~= shape[d] then
        error(('tensor: ragged nested table: dim %d expected %d entries, got %s'):format(d, shape[d],
          type(x) == 'table' and #x or type(x)), 4)
      end
      for i = 1, #x do walk(x[i], d + 1) end
    end
    walk(tbl, 1)
  end
  local dev = opts.device
  local t = Tensor.empty(shape, { dtype = opts.dtype, device = 'cpu' })
  local buf = ffi.new('double[?]', math.max(#flat, 1))
  for i = 1, #flat do buf[i - 1] = flat[i] end
  check(lib.gl_from_doubles(t.c, buf), 2)
  if dev and dev ~= 'cpu' then t = t:to(dev) end
  return t
end

-- ------------------------------------------------------------ printing --
-- Torch/PyTorch style: values right-aligned to a common width, elided in
-- the middle beyond 1000 elements; floats switch to scientific notation
-- when their magnitudes span too much for a fixed format.
function Tensor:__tostring() return Tensor.format(self) end

-- th's footer: "[float32 tensor of size 3x4]" (device and requires_grad when
-- they say something), what the REPL prints under a tensor's values
function Tensor.footer(t)
  local size = #t.shape == 0 and 'with no dimension' or ('of size ' .. table.concat(t.shape, 'x'))
  return ('[%s tensor %s%s%s]'):format(t.dtype, size, t.device ~= 'cpu' and (' on ' .. t.device) or '',
    t.requires_grad and ', requires_grad' or '')
end

-- the values as tostring(x) shows them, followed by shape and dtype; with
-- opts.footer the values alone and th's footer on the next line (the REPL)
function Tensor.format(self, opts)
  if freed(self) then error('tostring: tensor was freed', 3) end
  local t = self.device == 'cpu' and self or self:to('cpu')
  local shape, isf = t.shape, FLOATING[t.dtype]
  local summarize = t:numel() > 1000
  local edge = 3
  -- only the shown elements are read (a huge tensor is never copied whole)
  local st = t:stride()
  local function shown(n) return summarize and n > 2 * edge end
  local values, flat = {}, {}
  local function collect(d, off)
    if d > #shape then
      check(lib.gl_get_item(t.c, off, dbl1), 3)
      flat[#flat + 1] = dbl1[0]; values[off] = dbl1[0]
      return
    end
    local n = shape[d]
    for i = 1, n do
      if not (shown(n) and i > edge and i <= n - edge) then collect(d + 1, off + (i - 1) * st[d]) end
    end
  end
  if t:numel() > 0 then collect(1, 0) end
  -- the elements that will be shown, to choose one format for all of them
  local lo, hi = math.huge, 0
  for _, v in ipairs(flat) do
    local a = math.abs(v)
    if a == a and a ~= math.huge and a ~= 0 then lo = math.min(lo, a); hi = math.max(hi, a) end
  end
  local sci = isf and hi > 0 and (hi >= 1e8 or lo < 1e-4 or hi / lo >= 1e6)
  local function fmt(v)
    if not isf then return string.format('%d', v) end
    if v ~= v then return 'nan' end
    if v == math.huge then return 'inf' elseif v == -math.huge then return '-inf' end
    return string.format(sci and '%.4e' or '%.4f', v)
  end
  local width = 0
  for _, v in ipairs(flat) do width = math.max(width, #fmt(v)) end
  local cell = '%' .. width .. 's'
  local parts = {}
  local function emit(x) parts[#parts + 1] = x end
  local function rec(d, off, indent)
    if d > #shape then emit(cell:format(fmt(values[off]))) return end
    local n = shape[d]
    emit('[')
    local i = 1
    while i <= n do
      if shown(n) and i == edge + 1 then
        emit('...')
        emit(d == #shape and ', ' or (',\n' .. string.rep(' ', indent + 1)))
        i = n - edge + 1
      end
      rec(d + 1, off + (i - 1) * st[d], indent + 1)
      if i < n then emit(d == #shape and ', ' or (',' .. string.rep('\n', #shape - d) .. string.rep(' ', indent + 1))) end
      i = i + 1
    end
    emit(']')
  end
  if #shape == 0 then emit(fmt(flat[1])) else rec(1, 0, 7) end
  if t:numel() == 0 then parts = { '[]' } end
  if opts and opts.footer then return 'tensor(' .. table.concat(parts) .. ')\n' .. Tensor.footer(self) end
  local extra = {}
  extra[#extra + 1] = 'shape={' .. table.concat(shape, ',') .. '}'
  extra[#extra + 1] = 'dtype=' .. self.dtype
  if self.device ~= 'cpu' then extra[#extra + 1] = 'device=' .. self.device end
  if self.requires_grad then extra[#extra + 1] = 'requires_grad=true' end
  return 'tensor(' .. table.concat(parts) .. ', ' .. table.concat(extra, ', ') .. ')'
end

return Tensor
