-- gptlua.ops — every differentiable op: allocate the output, call the engine
-- kernel, record the backward.  Installed as Tensor methods and as gptlua.*
-- functions.  Each backward is written with the same ops, so it reads like
-- the math; broadcasting is resolved here (inputs are passed to the engine
-- as 0-stride views) and undone in backward by sum_to.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local C = require 'gptlua.check'
local ffi, lib, check = G.ffi, G.lib, G.check
local record = A.record

-- Every index, dim and size a view op takes passes the shared integer check
-- (gptlua.check) first, so 2.5, NaN, inf and 2^70 are refused by name
-- instead of being truncated or overflowing in the engine.
-- norm_dim(t, d, what[, extra]): d checked, then made positive (1-based)
local function norm_dim(t, d, what, extra)
  C.integer(d, what, 'dim', nil, nil, 4)
  return Tensor.norm_dim(t, d, what, extra)
end

local O = {}
local T = Tensor
O.norm_dim = norm_dim

-- shape_of(what, ...): a shape argument ({2, 3} or 2, 3) whose every size is
-- an integer >= -1 (-1: inferred by view/reshape, kept by expand)
local function shape_of(what, ...)
  local shape = Tensor.shape_arg(...)
  for i, n in ipairs(shape) do C.integer(n, what, 'size of dim ' .. i, -1, nil, 4) end
  return shape
end
O.shape_of = shape_of


local function is_tensor(x) return getmetatable(x) == Tensor end
O.is_tensor = is_tensor

-- empty_like(t, shape, dtype): an uninitialised tensor on t's device (t's
-- shape and dtype unless given)
local function empty_like(t, shape, dtype)
  return Tensor.empty(shape or t.shape, { dtype = dtype or t.dtype, device = t.device })
end
O.empty_like = empty_like

-- same_shape(a, b): whether two shapes (tables of sizes) are equal
local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end
O.same_shape = same_shape

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end

-- ---------------------------------------------------------------- creation
-- full(shape, value, {dtype=, device=}): a new tensor filled with value
function O.full(shape, v, opts)
  local t = Tensor.empty(shape, opts)
  G.check(lib.gl_fill(t.c, v), 2)
  return t
end
Tensor.full = O.full
-- zeros(shape, opts), ones(shape, opts): filled with 0 / 1; zeros_like(t),
-- ones_like(t): the shape, dtype and device of t
function O.zeros(shape, opts) return O.full(shape, 0, opts) end
function O.ones(shape, opts) return O.full(shape, 1, opts) end
function O.zeros_like(t) return O.full(t.shape, 0, { dtype = t.dtype, device = t.device }) end
function O.ones_like(t) return O.full(t.shape, 1, { dtype = t.dtype, device = t.device }) end
-- arange(stop), arange(start, stop, step, opts): start, start + step, ...
-- below stop (int64 unless opts.dtype)
function O.arange(a, b, step, opts)
  if type(b) == 'table' then opts, b, step = b, nil, nil end
  if type(step) == 'table' then opts, step = step, nil end
  local start, stop = b and a or 0, b or a
  step = step or 1
  if step == 0 then error('arange: step must not be 0', 2) end
  local n = math.max(0, math.ceil((stop - start) / step))
  opts = opts or {}
  local t = Tensor.empty({ n }, { dtype = opts.dtype or 'int64', device = opts.device })
  G.check(lib.gl_arange(t.c, start, step), 2)
  return t
end

-- ------------------------------------------------------------------- RNG
-- One global counter-based stream: a seed plus an offset that advances by
-- the number of values drawn, so a seed and the sequence of shapes give the
-- same numbers on every device and process.
local rng = { seed = 1337, offset = 0 }
-- manual_seed(seed): restart the random stream (same seed, same numbers)
function O.manual_seed(s)
  if type(s) ~= 'number' or s < 0 then error('manual_seed: seed must be a non-negative number', 2) end
  rng.seed, rng.offset = s, 0
end
-- get_rng_state(), set_rng_state(state): the random stream's position
-- ({seed, offset}), to save and restore
function O.get_rng_state() return { seed = rng.seed, offset = rng.offset } end
function O.set_rng_state(st) rng.seed, rng.offset = st.seed, st.offset end
A.get_rng_state, A.set_rng_state = O.get_rng_state, O.set_rng_state
-- reserves n counters: returns seed, offset
function O.rng_take(n)
  local off = rng.offset
  rng.offset = rng.offset + n
  return rng.seed, off
end
local function rand_fill(kind, shape, opts, a, b)
  opts = opts or {}
  local t = Tensor.empty(shape, opts)
  local seed, off
  if opts.seed then seed, off = opts.seed, opts.offset or 0 else seed, off = O.rng_take(t:numel()) end
  if kind == 'normal' then G.check(lib.gl_rand_normal(t.c, seed, off, a, b), 2)
  else G.check(lib.gl_rand_uniform(t.c, seed, off, a, b), 2) end
  return t
end
-- randn(shape, opts): standard normal; rand: uniform in [0, 1); normal(shape,
-- mean, std, opts); uniform(shape, lo, hi, opts).  opts.seed draws outside the stream
function O.randn(shape, opts) return rand_fill('normal', shape, opts, 0, 1) end
function O.rand(shape, opts) return rand_fill('uniform', shape, opts, 0, 1) end
function O.normal(shape, mean, std, opts) return rand_fill('normal', shape, opts, mean, std) end
function O.uniform(shape, lo, hi, opts) return rand_fill('uniform', shape, opts, lo, hi) end
function Tensor:normal_(mean, std, opts)
  local seed, off = O.rng_take(self:numel())
  if opts and opts.seed then seed, off = opts.seed, opts.offset or 0 end
  G.check(lib.gl_rand_normal(self.c, seed, off, mean or 0, std or 1), 2); return self
end
-- uniform_(lo, hi): fill in place from uniform [lo, hi) (default [0, 1))
function Tensor:uniform_(lo, hi)
  local seed, off = O.rng_take(self:numel())
  G.check(lib.gl_rand_uniform(self.c, seed, off, lo or 0, hi or 1), 2); return self
end

-- ------------------------------------------------------------ in-place, raw
-- fill_(value), zero_(): set every element in place
function Tensor:fill_(v) G.check(lib.gl_fill(self.c, v), 2); return self end
function Tensor:zero_() G.check(lib.gl_fill(self.c, 0), 2); return self end
-- copy_(src): src's values into self in place (src broadcast to self's shape)
function Tensor:copy_(src)
  if not is_tensor(src) then error('copy_: src must be a tensor', 2) end
  local v = same_shape(self.shape, src.shape) and src or O.expand_raw(src, self.shape, 'copy_')
  G.check(lib.gl_copy(self.c, v.c), 2)
  if v ~= src then Tensor.release(v) end
  return self
end
-- detach(): the same storage, cut from the autograd graph
function Tensor:detach()
  local t = self:_as_strided(self.shape, self:stride(), self:storage_offset())
  return t
end
-- Releases the storage now (deterministic memory release; GPU memory
-- never waits for the Lua GC).  Later use raises "has been freed".
function Tensor:free() Tensor.release(self); self.grad_fn = nil end
function Tensor:is_freed() return self.c.storage == nil end
-- requires_grad_(flag): mark a leaf so backward fills its .grad (flag default true)
function Tensor:requires_grad_(flag)
  if flag == nil then flag = true end
  if flag and not self:is_floating() then
    error('requires_grad_: only floating tensors can require gradients, this one is ' .. self.dtype, 2)
  end
  self.requires_grad = flag
  return self
end
-- register_hook(fn): fn(grad) runs when a leaf's gradient is ready
function Tensor:register_hook(fn)
  if self.grad_fn then error('register_hook: gradient-ready hooks are for leaf tensors', 2) end
  self._hooks = self._hooks or {}
  self._hooks[#self._hooks + 1] = fn
  return self
end
-- backward(grad, opts): gradients of this tensor (grad default 1 for a scalar)
-- into the .grad of every leaf that requires grad
function Tensor:backward(grad, opts) return A.backward(self, grad, opts) end
function Tensor:zero_grad() if self.grad then self.grad:zero_() end end

-- max_abs_diff(other): the largest |self - other| as a Lua number
function Tensor:max_abs_diff(other)
  local a, b = self, other
  if a.device ~= 'cpu' then a = a:to('cpu') end
  if b.device ~= 'cpu' then b = b:to('cpu') end
  local d = ffi.new('double[1]')
  G.check(lib.gl_max_abs_diff(a.c, b.c, d), 2)
  return d[0]
end
-- allclose(other, rtol, atol): |self - other| <= atol + rtol |other| everywhere
function Tensor:allclose(other, rtol, atol)
  rtol, atol = rtol or 1e-5, atol or 1e-8
  if not same_shape(self.shape, other.shape) then return false end
  local x, y = self:tolist(), other:tolist()
  for i = 1, #x do
    local d = math.abs(x[i] - y[i])
    if not (d <= atol + rtol * math.abs(y[i])) then return false end
  end
  return true
end

-- ------------------------------------------------------------------ views
-- a differentiable view remembers its base (the first non-view tensor):
-- an in-place change of a view of a leaf that requires grad is refused
local function view_record(out, x, backward, name)
  out._base = rawget(x, '_base') or x
  return record(out, { x }, backward, nil, name)
end

-- expand_raw(t, shape, what): a broadcast view of t to shape, no autograd
function O.expand_raw(t, shape, what)
  local nd, td = #shape, #t.shape
  if td > nd then
    error(('%s: cannot broadcast shape %s to %s'):format(what or 'expand', shape_str(t.shape), shape_str(shape)), 3)
  end
  local st, ts = {}, t:stride()
  local out = {}
  for i = 1, nd do
    local j = i - (nd - td)
    local n = shape[i] == -1 and t.shape[j] or shape[i]
    out[i] = n
    if j < 1 then st[i] = 0
    elseif t.shape[j] == n then st[i] = ts[j]
    elseif t.shape[j] == 1 then st[i] = 0
    else
      error(('%s: cannot broadcast shape %s to %s (dim %d: %d vs %d)'):format(what or 'expand',
        shape_str(t.shape), shape_str(shape), i, t.shape[j], n), 3)
    end
  end
  return t:_as_strided(out, st, t:storage_offset())
end

-- sum g over the dims that broadcasting added or stretched, back to shape
function O.sum_to(g, shape)
  if same_shape(g.shape, shape) then return g end
  local nd, sd = #g.shape, #shape
  local mask = 0
  local keep = {}
  for i = 1, nd do
    local j = i - (nd - sd)
    if j < 1 or (shape[j] == 1 and g.shape[i] ~= 1) then mask = bit.bor(mask, bit.lshift(1, i - 1)) end
    keep[i] = (j < 1 or shape[j] == 1) and 1 or g.shape[i]
  end
  local out = empty_like(g, keep)
  G.check(lib.gl_reduce(0, out.c, g.c, mask), 2)
  return out:_as_strided(shape, Tensor.contiguous_strides(shape), out:storage_offset())
end

-- expand(shape): a view with size-1 dims repeated to shape (no copy)
function Tensor:expand(...)
  local shape = shape_of('expand', ...)
  local x = self
  local out = O.expand_raw(x, shape, 'expand')
  return view_record(out, x, function(_, g) return O.sum_to(g, x.shape) end, 'expand')
end

-- contiguous(): self if its elements are in row-major order, else a copy that is
function Tensor:contiguous()
  if self:is_contiguous() then return self end
  local out = empty_like(self)
  G.check(lib.gl_copy(out.c, self.c), 2)
  return view_record(out, self, function(_, g) return g end, 'contiguous')
end

-- clone(): a copy with its own storage (differentiable)
function Tensor:clone()
  local out = empty_like(self)
  G.check(lib.gl_copy(out.c, self.c), 2)
  return view_record(out, self, function(_, g) return g end, 'clone')
end

-- view: needs a layout where the new shape maps onto existing strides; we
-- accept contiguous tensors (and report clearly otherwise)
function Tensor:view(...)
  local shape = Tensor.infer_shape(shape_of('view', ...), self:numel(), 'view')
  if not self:is_contiguous() then
    error(('view: tensor of shape %s is not contiguous; use reshape() or contiguous():view()'):format(
      shape_str(self.shape)), 2)
  end
  local x = self
  local out = x:_as_strided(shape, Tensor.contiguous_strides(shape), x:storage_offset())
  return view_record(out, x, function(_, g) return g:reshape(x.shape) end, 'view')
end
-- reshape(shape): view when the layout allows, else a copy; one size may be -1
function Tensor:reshape(...)
  local shape = Tensor.infer_shape(shape_of('reshape', ...), self:numel(), 'reshape')
  local src = self:is_contiguous() and self or self:contiguous()
  return src:view(shape)
end
-- flatten(): a 1-D reshape
function Tensor:flatten() return self:reshape({ self:numel() }) end

-- permute(d1, d2, ...): a view with the dims reordered
function Tensor:permute(...)
  local perm = Tensor.shape_arg(...)
  local nd = #self.shape
  if #perm ~= nd then error(('permute: expected %d dims, got %d'):format(nd, #perm), 2) end
  local seen, shape, stride, inv = {}, {}, {}, {}
  local st = self:stride()
  for i, d in ipairs(perm) do
    d = norm_dim(self, d, 'permute')
    if seen[d] then error('permute: dim ' .. d .. ' repeated', 2) end
    seen[d] = true
    shape[i], stride[i], inv[d] = self.shape[d], st[d], i
  end
  local out = self:_as_strided(shape, stride, self:storage_offset())
  return view_record(out, self, function(_, g) return g:permute(inv) end, 'permute')
end
-- transpose(d1, d2): a view with two dims swapped; t(): of a matrix
function Tensor:transpose(d1, d2)
  local nd = #self.shape
  d1, d2 = norm_dim(self, d1, 'transpose'), norm_dim(self, d2, 'transpose')
  local perm = {}
  for i = 1, nd do perm[i] = i end
  perm[d1], perm[d2] = d2, d1
  return self:permute(perm)
end
-- t(): the transpose of a matrix (a view)
function Tensor:t()
  if #self.shape ~= 2 then error(('t: expected a 2-d tensor, got %d dims'):format(#self.shape), 2) end
  return self:transpose(1, 2)
end

-- generic backward for sub-views: zeros of x's shape, g copied into the view
local function scatter_into_view(x, make_view)
  return function(_, g)
    local gx = O.zeros(x.shape, { dtype = g.dtype, device = g.device })
    make_view(gx):copy_(g)
    return gx
  end
end

-- narrow(dim, start, length): a view of length elements of dim from start
-- (1-based)
function Tensor:narrow(dim, start, len)
  local d = norm_dim(self, dim, 'narrow')
  local n = self.shape[d]
  C.integer(start, 'narrow', 'start'); C.integer(len, 'narrow', 'length')
  if start < 1 or len < 0 or start + len - 1 > n then
    error(('narrow: range start=%s len=%s outside dim %d of size %d'):format(tostring(start), tostring(len), d, n), 2)
  end
  local shape, st = self:size(), self:stride()
  shape[d] = len
  local x = self
  local out = x:_as_strided(shape, st, x:storage_offset() + (start - 1) * st[d])
  return view_record(out, x, scatter_into_view(x, function(gx) return gx:narrow(d, start, len) end), 'narrow')
end

-- select(dim, index): a view of one slice of dim (1-based; negative from the
-- end), with that dim removed
function Tensor:select(dim, i)
  local d = norm_dim(self, dim, 'select')
  local n = self.shape[d]
  C.integer(i, 'select', 'index')
  if i < 0 then i = n + i + 1 end
  if i < 1 or i > n then error(('select: index %d out of range for dim %d of size %d'):format(i, d, n), 2) end
  local shape, st = self:size(), self:stride()
  local off = self:storage_offset() + (i - 1) * st[d]
  table.remove(shape, d); table.remove(st, d)
  local x = self
  local out = x:_as_strided(shape, st, off)
  return view_record(out, x, scatter_into_view(x, function(gx) return gx:select(d, i) end), 'select')
end

-- unsqueeze(dim): a view with a new size-1 dim at dim
function Tensor:unsqueeze(dim)
  local d = norm_dim(self, dim, 'unsqueeze', 1)
  local shape, st = self:size(), self:stride()
  local inner = d <= #shape and shape[d] * st[d] or 1
  table.insert(shape, d, 1); table.insert(st, d, inner)
  local x = self
  local out = x:_as_strided(shape, st, x:storage_offset())
  return view_record(out, x, function(_, g) return g:reshape(x.shape) end, 'unsqueeze')
end
-- squeeze(dim): a view without size-1 dims (only dim when given)
function Tensor:squeeze(dim)
  local shape, st = {}, {}
  local ss = self:stride()
  local d = dim and norm_dim(self, dim, 'squeeze')
  for i, n in ipairs(self.shape) do
    if not (n == 1 and (d == nil or d == i)) then shape[#shape + 1] = n; st[#st + 1] = ss[i] end
  end
  local x = self
  local out = x:_as_strided(shape, st, x:storage_offset())
  return view_record(out, x, function(_, g) return g:reshape(x.shape) end, 'squeeze')
end

-- to(dtype) / to(device) / to{dtype=, device=}: differentiable cast/move
function Tensor:to(a, b)
  local dtype, device
  if type(a) == 'table' then dtype, device = a.dtype, a.device
  elseif a == 'cpu' or (type(a) == 'string' and a:match('^cuda')) then device, dtype = a, b
  else dtype, device = a, b end
  local _, dname = Tensor.dtype_id(dtype or self.dtype, 'to')
  local _, devname = Tensor.device_id(device or self.device, 'to')
  if dname == self.dtype and devname == self.device then return self end
  local out = Tensor.empty(self.shape, { dtype = dname, device = devname })
  G.check(lib.gl_copy(out.c, self.c), 2)
  local x = self
  if not Tensor.FLOATING[dname] then return out end
  return record(out, { x }, function(_, g) return g:to({ dtype = x.dtype, device = x.device }) end, nil, 'to')
end
-- float(), double(): to('float32'), to('float64'); cpu(), cuda(n): to('cpu'),
-- to('cuda:n')
function Tensor:float() return self:to('float32') end
function Tensor:double() return self:to('float64') end
function Tensor:cpu() return self:to('cpu') end
function Tensor:cuda(n) return self:to('cuda:' .. (n or 0)) end

return O
