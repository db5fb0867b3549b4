-- gptlua.ops_math — differentiable arithmetic, reductions, softmax, norms
-- and losses, each a forward kernel call plus a backward written in terms of
-- other ops or the op's backward kernel (matrix products: ops_linear;
-- attention and rotary: ops_attention; lookups and shape ops: ops_shape).
-- Functions land in gptlua.ops (gl.*) and as Tensor methods.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local check = require 'gptlua.check'
local ffi, lib = G.ffi, G.lib
local record = A.record
local empty_like, same_shape, is_tensor = O.empty_like, O.same_shape, O.is_tensor
local norm_dim = O.norm_dim  -- checks that the dim is an integer
local C = ffi.C
local _ = C

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end
local NULL = nil

-- enums straight from the header
local U = {
  neg = lib.GL_U_NEG, exp = lib.GL_U_EXP, log = lib.GL_U_LOG, sqrt = lib.GL_U_SQRT, rsqrt = lib.GL_U_RSQRT,
  tanh = lib.GL_U_TANH, abs = lib.GL_U_ABS, relu = lib.GL_U_RELU, relu2 = lib.GL_U_RELU2,
  gelu = lib.GL_U_GELU_TANH, silu = lib.GL_U_SILU, sigmoid = lib.GL_U_SIGMOID, sin = lib.GL_U_SIN,
  cos = lib.GL_U_COS, square = lib.GL_U_SQUARE, reciprocal = lib.GL_U_RECIPROCAL, clamp = lib.GL_U_CLAMP,
  pow = lib.GL_U_POW, add_scalar = lib.GL_U_ADD_SCALAR, mul_scalar = lib.GL_U_MUL_SCALAR,
  affine = lib.GL_U_AFFINE, rsub_scalar = lib.GL_U_RSUB_SCALAR, rdiv_scalar = lib.GL_U_RDIV_SCALAR,
  softcap = lib.GL_U_SOFTCAP,
}
O.unary_ops = U  -- (ops_linear's activations)
local B = {
  add = lib.GL_B_ADD, sub = lib.GL_B_SUB, mul = lib.GL_B_MUL, div = lib.GL_B_DIV, pow = lib.GL_B_POW,
  maximum = lib.GL_B_MAXIMUM, minimum = lib.GL_B_MINIMUM, eq = lib.GL_B_EQ, ne = lib.GL_B_NE,
  lt = lib.GL_B_LT, le = lib.GL_B_LE, gt = lib.GL_B_GT, ge = lib.GL_B_GE,
}
local R = { sum = lib.GL_R_SUM, mean = lib.GL_R_MEAN, max = lib.GL_R_MAX, min = lib.GL_R_MIN,
            sumsq = lib.GL_R_SUMSQ, norm = lib.GL_R_NORM2 }

-- ----------------------------------------------------------- unary ops
-- raw (no autograd) application of unary op `op`
local function unary_raw(op, x, p0, p1, out)
  out = out or empty_like(x)
  G.check(lib.gl_unary(op, out.c, x.c, p0 or 0, p1 or 0), 2)
  return out
end
O.unary_raw = unary_raw

-- differentiable unary op through gl_unary_backward
-- (saves x unless the derivative is a constant: keeps_x = false)
local function unary(name, op, keeps_x)
  return function(x, p0, p1)
    if not is_tensor(x) then error(name .. ': expected a tensor, got ' .. type(x), 2) end
    local out = unary_raw(op, x, p0, p1)
    return record(out, { x }, function(_, g)
      local dx = empty_like(x)
      G.check(lib.gl_unary_backward(op, dx.c, g.c, x.c, p0 or 0, p1 or 0), 2)
      return dx
    end, keeps_x ~= false and { x } or nil, name)
  end
end

for _, name in ipairs({ 'exp', 'log', 'sqrt', 'rsqrt', 'tanh', 'abs', 'relu', 'relu2', 'gelu', 'silu',
                        'sigmoid', 'sin', 'cos', 'square', 'reciprocal' }) do
  O[name] = unary(name, U[name])
  Tensor[name] = O[name]
end
local neg = unary('neg', U.neg, false)
O.neg = neg; Tensor.neg = neg; Tensor.__unm = neg
local clamp_u = unary('clamp', U.clamp)
-- clamp(x, lo, hi): x limited to [lo, hi] (either bound may be nil)
function O.clamp(x, lo, hi) return clamp_u(x, lo or -math.huge, hi or math.huge) end
Tensor.clamp = O.clamp
local softcap_u = unary('softcap', U.softcap)
-- softcap(x, cap): cap * tanh(x / cap), a smooth limit to (-cap, cap)
function O.softcap(x, cap)
  if not (cap and cap > 0) then error('softcap: cap must be > 0, got ' .. tostring(cap), 2) end
  return softcap_u(x, cap)
end
Tensor.softcap = O.softcap
local pow_u = unary('pow', U.pow)
local add_s = unary('add', U.add_scalar, false)
local mul_s = unary('mul', U.mul_scalar, false)
local rsub_s = unary('sub', U.rsub_scalar, false)
local rdiv_s = unary('div', U.rdiv_scalar)

-- ----------------------------------------------------------- broadcasting
-- broadcast_shape(a, b, what): the shape two shapes broadcast to (numpy
-- rules), or an error naming what
local function broadcast_shape(a, b, what)
  local na, nb = #a, #b
  local n = math.max(na, nb)
  local out = {}
  for i = 1, n do
    local x = a[i - (n - na)] or 1
    local y = b[i - (n - nb)] or 1
    if x == y or y == 1 then out[i] = x
    elseif x == 1 then out[i] = y
    else
      error(('%s: shapes %s and %s are not broadcastable (dim %d: %d vs %d)'):format(what, shape_str(a),
        shape_str(b), i, x, y), 4)
    end
  end
  return out
end
O.broadcast_shape = broadcast_shape

local function bview(t, shape) -- raw broadcast view for kernel inputs
  if same_shape(t.shape, shape) then return t end
  return O.expand_raw(t, shape, 'broadcast')
end
O.broadcast_view = bview

-- Releases temporary views made inside an op as soon as the kernel has run:
-- a view holds a reference to its base's storage, and one left to the end
-- of the step's scope would keep that memory alive (activations, logits).
-- `base`: a view equal to it is the tensor itself and is left alone.
local function drop(v, base)
  if v ~= nil and v ~= base then Tensor.release(v) end
end
O.drop_view = drop

local function result_dtype(a, b)
  if a.dtype == b.dtype then return a.dtype end
  local fa, fb = Tensor.FLOATING[a.dtype], Tensor.FLOATING[b.dtype]
  if fa and not fb then return a.dtype end
  if fb and not fa then return b.dtype end
  if a.dtype == 'float64' or b.dtype == 'float64' then return 'float64' end
  if fa and fb then return 'float32' end
  return 'int64'
end

-- binary_raw(op, a, b, what, out_dtype): elementwise op of two broadcast
-- tensors, no autograd
local function binary_raw(op, a, b, what, out_dtype)
  if a.device ~= b.device then
    error(('%s: operands are on %s and %s, expected one device'):format(what, a.device, b.device), 4)
  end
  local shape = broadcast_shape(a.shape, b.shape, what)
  local out = Tensor.empty(shape, { dtype = out_dtype or result_dtype(a, b), device = a.device })
  local va, vb = bview(a, shape), bview(b, shape)
  G.check(lib.gl_binary(op, out.c, va.c, vb.c), 2)
  drop(va, a); drop(vb, b)
  return out
end
O.binary_raw = binary_raw

local sum_to = O.sum_to
-- add(a, b) = a + b, sub(a, b) = a - b, mul(a, b) = a * b, div(a, b) = a / b,
-- pow(a, b) = a ^ b: elementwise, tensors broadcast (numpy rules), either
-- side may be a number
local function add(a, b)
  if type(b) == 'number' then return add_s(a, b) end
  if type(a) == 'number' then return add_s(b, a) end
  local out = binary_raw(B.add, a, b, 'add')
  return record(out, { a, b }, function(_, g) return sum_to(g, a.shape), sum_to(g, b.shape) end, nil, 'add')
end
-- sub(a, b): a - b elementwise, broadcast (see add)
local function sub(a, b)
  if type(b) == 'number' then return add_s(a, -b) end
  if type(a) == 'number' then return rsub_s(b, a) end
  local out = binary_raw(B.sub, a, b, 'sub')
  return record(out, { a, b }, function(_, g) return sum_to(g, a.shape), sum_to(neg(g), b.shape) end, nil, 'sub')
end
-- mul(a, b): a * b elementwise, broadcast (see add)
local function mul(a, b)
  if type(b) == 'number' then return mul_s(a, b) end
  if type(a) == 'number' then return mul_s(b, a) end
  local out = binary_raw(B.mul, a, b, 'mul')
  return record(out, { a, b }, function(_, g)
    return a.requires_grad and sum_to(g * b, a.shape) or nil, b.requires_grad and sum_to(g * a, b.shape) or nil
  end, { a.requires_grad and b or nil, b.requires_grad and a or nil }, 'mul')
end
-- div(a, b): a / b elementwise, broadcast (see add)
local function div(a, b)
  if type(b) == 'number' then return mul_s(a, 1 / b) end
  if type(a) == 'number' then return rdiv_s(b, a) end
  local out = binary_raw(B.div, a, b, 'div')
  return record(out, { a, b }, function(_, g)
    local ga = a.requires_grad and sum_to(g / b, a.shape) or nil
    local gb = b.requires_grad and sum_to(neg(g * out / b), b.shape) or nil
    return ga, gb
  end, { b, b.requires_grad and out or nil }, 'div')
end
-- pow(a, b): a ^ b elementwise, broadcast (see add)
local function pow(a, b)
  if type(b) == 'number' then return pow_u(a, b) end
  if type(a) == 'number' then return O.exp(mul_s(b, math.log(a))) end
  local out = binary_raw(B.pow, a, b, 'pow')
  return record(out, { a, b }, function(_, g)
    local ga = a.requires_grad and sum_to(g * b * pow(a, b - 1), a.shape) or nil
    local gb = b.requires_grad and sum_to(g * out * O.log(a), b.shape) or nil
    return ga, gb
  end, { a, b, out }, 'pow')
end
-- maximum(a, b), minimum(a, b): elementwise larger / smaller, broadcast
local function minmax(op, name, pick_a_when)
  return function(a, b)
    local out = binary_raw(op, a, b, name)
    return record(out, { a, b }, function(_, g)
      local mask = binary_raw(pick_a_when, a, b, name, g.dtype)  -- 1 where a wins
      local ga = a.requires_grad and sum_to(g * mask, a.shape) or nil
      local gb = b.requires_grad and sum_to(g * (1 - mask), b.shape) or nil
      return ga, gb
    end, { a, b }, name)
  end
end
O.add, O.sub, O.mul, O.div, O.pow = add, sub, mul, div, pow
O.maximum = minmax(B.maximum, 'maximum', B.ge)
O.minimum = minmax(B.minimum, 'minimum', B.le)
Tensor.add, Tensor.sub, Tensor.mul, Tensor.div, Tensor.pow = add, sub, mul, div, pow
Tensor.maximum, Tensor.minimum = O.maximum, O.minimum
Tensor.__add, Tensor.__sub, Tensor.__mul, Tensor.__div, Tensor.__pow = add, sub, mul, div, pow

-- comparisons give bool tensors (no gradient)
for _, name in ipairs({ 'eq', 'ne', 'lt', 'le', 'gt', 'ge' }) do
  O[name] = function(a, b)
    if type(b) == 'number' then b = O.full({}, b, { dtype = a.dtype, device = a.device }) end
    return binary_raw(B[name], a, b, name, 'bool')
  end
  Tensor[name] = O[name]
end

-- in-place (no autograd): for optimizer and gradient bookkeeping; the
-- checks against tensors that require grad and the version counters are
-- shared by every in-place method (tensor.lua, autograd.lua)
function Tensor:add_(b, alpha)
  if type(b) == 'number' then G.check(lib.gl_unary(U.add_scalar, self.c, self.c, b, 0), 2) return self end
  local scaled = alpha and alpha ~= 1 and unary_raw(U.mul_scalar, b, alpha) or nil
  local src = scaled or b
  local v = bview(src, self.shape)
  G.check(lib.gl_binary(B.add, self.c, self.c, v.c), 2)
  drop(v, src); drop(scaled)
  return self
end
-- mul_(b): self *= b in place (a number, or a tensor broadcast to self)
function Tensor:mul_(b)
  if type(b) == 'number' then G.check(lib.gl_unary(U.mul_scalar, self.c, self.c, b, 0), 2) return self end
  local v = bview(b, self.shape)
  G.check(lib.gl_binary(B.mul, self.c, self.c, v.c), 2)
  drop(v, b)
  return self
end
-- clamp_(lo, hi): self limited to [lo, hi] in place
function Tensor:clamp_(lo, hi)
  G.check(lib.gl_unary(U.clamp, self.c, self.c, lo or -math.huge, hi or math.huge), 2); return self
end

-- where(cond, a, b) and masked_fill(mask, value)
function O.where(cond, a, b)
  if type(a) == 'number' then a = O.full({}, a, { dtype = b.dtype, device = b.device }) end
  if type(b) == 'number' then b = O.full({}, b, { dtype = a.dtype, device = a.device }) end
  local shape = broadcast_shape(broadcast_shape(cond.shape, a.shape, 'where'), b.shape, 'where')
  local out = Tensor.empty(shape, { dtype = result_dtype(a, b), device = a.device })
  local vc, va, vb = bview(cond, shape), bview(a, shape), bview(b, shape)
  G.check(lib.gl_where(out.c, vc.c, va.c, vb.c), 2)
  drop(vc, cond); drop(va, a); drop(vb, b)
  return record(out, { a, b }, function(_, g)
    local z = O.zeros({}, { dtype = g.dtype, device = g.device })
    local ga = a.requires_grad and sum_to(O.where(cond, g, z), a.shape) or nil
    local gb = b.requires_grad and sum_to(O.where(cond, z, g), b.shape) or nil
    return ga, gb
  end, { cond }, 'where')
end
-- masked_fill(mask, value): value where mask is true, self elsewhere (a new tensor)
function Tensor:masked_fill(mask, value) return O.where(mask, value, self) end

-- ------------------------------------------------------------ reductions
-- dims: nil (all), a number, or a list; keepdim keeps size-1 dims
local function reduce_dims(x, dims, what)
  local mask, set = 0, {}
  if dims == nil then
    for d = 1, #x.shape do set[d] = true end
  else
    if type(dims) == 'number' then dims = { dims } end
    for _, d in ipairs(dims) do set[norm_dim(x, d, what)] = true end
  end
  local kshape, oshape = {}, {}
  for d = 1, #x.shape do
    if set[d] then mask = bit.bor(mask, bit.lshift(1, d - 1)); kshape[d] = 1
    else kshape[d] = x.shape[d]; oshape[#oshape + 1] = x.shape[d] end
  end
  return mask, kshape, oshape
end

local function reduce_raw(op, x, dims, keepdim, what)
  local mask, kshape, oshape = reduce_dims(x, dims, what)
  local out = empty_like(x, kshape)
  G.check(lib.gl_reduce(op, out.c, x.c, mask), 2)
  if not keepdim then
    local v = out:_as_strided(oshape, Tensor.contiguous_strides(oshape), out:storage_offset())
    drop(out)
    out = v
  end
  return out, kshape
end

-- sum(x, dim, keepdim): sum over all elements, or over dim (an integer or
-- a list; negative counts from the end); keepdim keeps the reduced dims as 1
function O.sum(x, dims, keepdim)
  local out, kshape = reduce_raw(R.sum, x, dims, keepdim, 'sum')
  return record(out, { x }, function(_, g)
    local r = g:reshape(kshape)
    local e = O.expand_raw(r, x.shape)
    local gx = e:contiguous()
    drop(e, gx); drop(r, g)
    return gx
  end, nil, 'sum')
end
-- mean(x, dim, keepdim): mean over all elements or over dim, as sum
function O.mean(x, dims, keepdim)
  local out, kshape = reduce_raw(R.mean, x, dims, keepdim, 'mean')
  local n = x:numel() / math.max(out:numel(), 1)
  return record(out, { x }, function(_, g)
    local r = g:reshape(kshape)
    local e = O.expand_raw(r, x.shape)
    local gx = unary_raw(U.mul_scalar, e, 1 / n)
    drop(e); drop(r, g)
    return gx
  end, nil, 'mean')
end
-- max/min: over all elements (value only) or over one dim (values, indices)
local function extreme(op, name)
  return function(x, dim, keepdim)
    if dim == nil then
      local out = reduce_raw(op, x, nil, false, name)
      return record(out, { x }, function(_, g)
        local mask = binary_raw(B.eq, x, out, name, g.dtype)
        local cnt = reduce_raw(R.sum, mask, nil, false, name)
        return mask * (g / cnt)
      end, { x, out }, name)
    end
    local d = norm_dim(x, dim, name)
    local kshape = x:size(); kshape[d] = 1
    local vals = empty_like(x, kshape)
    local idx = Tensor.empty(kshape, { dtype = 'int64', device = x.device })
    local src = op == R.max and x or unary_raw(U.neg, x)
    G.check(lib.gl_reduce_max_dim(vals.c, idx.c, src.c, d - 1), 2)
    if op ~= R.max then vals = unary_raw(U.neg, vals) end
    local kidx = idx
    vals = record(vals, { x }, function(_, g)
      local gx = O.zeros(x.shape, { dtype = g.dtype, device = g.device })
      G.check(lib.gl_scatter_add(gx.c, d - 1, kidx.c, g:reshape(kshape):contiguous().c), 2)
      return gx
    end, { kidx }, name)
    if not keepdim then vals, idx = vals:squeeze(d), idx:squeeze(d) end
    return vals, idx
  end
end
O.max = extreme(R.max, 'max')
O.min = extreme(R.min, 'min')
-- argmax(x, dim): the indices of the largest values along dim (default the last)
function O.argmax(x, dim) local _, i = O.max(x, dim or -1); return i end
-- L2 norm (over all, or dims)
function O.norm(x, dims, keepdim)
  return O.sqrt(O.sum(O.square(x), dims, keepdim))
end
local norm_buf = ffi.new('double[1]')
-- The float64 sum of squares of every tensor of list: one gl_sumsq_multi
-- call per device (on a GPU one launch and one host wait however many
-- tensors); the policies' gradient norms use it too.
function O.sumsq_list(list)
  local by_dev, order = {}, {}
  for _, t in ipairs(list) do
    local l = by_dev[t.device]
    if not l then l = {}; by_dev[t.device] = l; order[#order + 1] = l end
    l[#l + 1] = t.c
  end
  local acc = 0
  for _, l in ipairs(order) do
    G.check(lib.gl_sumsq_multi(#l, ffi.new('const gl_tensor *[?]', #l, l), norm_buf), 2)
    acc = acc + norm_buf[0]
  end
  return acc
end
-- global L2 norm of a list of tensors, as a Lua number (float64 sums)
function O.global_norm(list) return math.sqrt(O.sumsq_list(list)) end
for _, n in ipairs({ 'sum', 'mean', 'max', 'min', 'argmax', 'norm' }) do Tensor[n] = O[n] end

-- raw_contiguous(t): t if contiguous, else a contiguous copy (no autograd)
local function raw_contiguous(t)
  if t:is_contiguous() then return t end
  local c = empty_like(t)
  G.check(lib.gl_copy(c.c, t.c), 2)
  return c
end
O.raw_contiguous = raw_contiguous

-- ----------------------------------------------------------- softmax family
local function softmax_impl(x, dim, log, name)
  local d = norm_dim(x, dim or -1, name)
  local xt = d == #x.shape and x or x:transpose(d, -1)
  local y = empty_like(xt)
  G.check(lib.gl_softmax(y.c, xt.c, log and 1 or 0), 2)
  y = record(y, { xt }, function(_, g)
    local dx = empty_like(y)
    G.check(lib.gl_softmax_backward(dx.c, y.c, g.c, log and 1 or 0), 2)
    return dx
  end, { y }, name)
  if d ~= #x.shape then return y:transpose(d, -1) end
  return y
end
-- softmax(x, dim): exp(x) / sum(exp(x)) along dim (default the last)
function O.softmax(x, dim) return softmax_impl(x, dim, false, 'softmax') end
-- log_softmax(x, dim): log(softmax(x, dim)), computed stably
function O.log_softmax(x, dim) return softmax_impl(x, dim, true, 'log_softmax') end
Tensor.softmax, Tensor.log_softmax = O.softmax, O.log_softmax

-- ----------------------------------------------------------- normalisation
local function stat_dtype(x) return x.dtype == 'float64' and 'float64' or 'float32' end
local function lead_shape(x) local s = x:size(); s[#s] = nil; return s end

-- A norm's backward adds the gradient its input already has (the residual
-- stream's, when the norm reads a block's input: nanochat's and GPT-2's
-- first norm of a block, the final norm) into dx in its own pass
-- (gl_norm_backward_add), instead of autograd adding the two afterwards (a
-- binary pass: read 2, write 1).  The node takes that gradient over
-- (autograd's adds_into); if it is not there yet, nothing is taken and
-- autograd adds what comes later as usual.
local function takes_residual(y)
  if y.grad_fn then y.grad_fn.adds_into = 1 end
  return y
end
-- the taken gradient if the kernel can add it (dx's shape and dtype), else nil
local function residual_grad(node, dx)
  local t = node.taken_grad
  if t and t.dtype == dx.dtype and same_shape(t.shape, dx.shape) then return t end
  return nil
end
-- dx plus a taken gradient the kernel could not add
local function add_rest(node, dx, dres)
  local t = node.taken_grad
  if t == nil or dres ~= nil then return dx end
  return dx:add(t)
end

-- layer_norm(x, weight, bias, eps): (x - mean) / sqrt(var + eps) over the
-- last dim, then * weight + bias (both optional; eps 1e-5)
function O.layer_norm(x, weight, bias, eps)
  eps = eps or 1e-5
  local xc = x:is_contiguous() and x or x:contiguous()
  local y = empty_like(xc)
  local sopt = { dtype = stat_dtype(x), device = x.device }
  local mean, rstd = Tensor.empty(lead_shape(x), sopt), Tensor.empty(lead_shape(x), sopt)
  G.check(lib.gl_layernorm_forward(y.c, mean.c, rstd.c, xc.c, weight and weight.c or NULL, bias and bias.c or NULL, eps), 2)
  local inputs = { xc }
  if weight then inputs[#inputs + 1] = weight end
  if bias then inputs[#inputs + 1] = bias end
  return takes_residual(record(y, inputs, function(_, g, node)
    local gc = g:is_contiguous() and g or g:contiguous()
    local dx = empty_like(xc)
    local dw = weight and empty_like(weight) or nil
    local db = bias and empty_like(bias) or nil
    local dres = residual_grad(node, dx)
    G.check(lib.gl_norm_backward_add(dx.c, dw and dw.c, db and db.c, gc.c, xc.c, weight and weight.c, mean.c, rstd.c,
      dres and dres.c, 1), 2)
    dx = add_rest(node, dx, dres)
    if weight and bias then return dx, dw, db elseif weight then return dx, dw elseif bias then return dx, db end
    return dx
  end, { xc, weight }, 'layer_norm', { mean, rstd }))
end

-- rms_norm(x, weight, eps): x / sqrt(mean(x^2) + eps) over the last dim,
-- then * weight (optional)
function O.rms_norm(x, weight, eps)
  eps = eps or 1e-6
  local xc = x:is_contiguous() and x or x:contiguous()
  local y = empty_like(xc)
  local rstd = Tensor.empty(lead_shape(x), { dtype = stat_dtype(x), device = x.device })
  G.check(lib.gl_rmsnorm_forward(y.c, rstd.c, xc.c, weight and weight.c or NULL, eps), 2)
  local inputs = weight and { xc, weight } or { xc }
  return takes_residual(record(y, inputs, function(_, g, node)
    local gc = g:is_contiguous() and g or g:contiguous()
    local dx = empty_like(xc)
    local dw = weight and empty_like(weight) or nil
    local dres = residual_grad(node, dx)
    G.check(lib.gl_norm_backward_add(dx.c, dw and dw.c, NULL, gc.c, xc.c, weight and weight.c, NULL, rstd.c,
      dres and dres.c, 0), 2)
    return add_rest(node, dx, dres), dw
  end, { xc, weight }, 'rms_norm', { rstd }))
end

-- A residual add and the norm after it, fused (a block's x = x + f(x);
-- h = norm(x)): one pass computes s = x + r and y = norm(s) on a GPU, and
-- backward the norm's gradient and the one s already has from the
-- residual stream are added in the norm backward's pass (the autograd node
-- takes that gradient over: adds_into).  Returns s, y.
local function add_norm(x, r, weight, bias, eps, center, name)
  if not same_shape(x.shape, r.shape) then
    error(('%s: r has shape %s, expected %s (the shape of x)'):format(name, shape_str(r.shape), shape_str(x.shape)), 3)
  end
  local xc = x:is_contiguous() and x or x:contiguous()
  local rc = r:is_contiguous() and r or r:contiguous()
  local s, y = empty_like(xc), empty_like(xc)
  local sopt = { dtype = stat_dtype(x), device = x.device }
  local mean = center and Tensor.empty(lead_shape(x), sopt) or nil
  local rstd = Tensor.empty(lead_shape(x), sopt)
  G.check(lib.gl_add_norm_forward(s.c, y.c, mean and mean.c, rstd.c, xc.c, rc.c, weight and weight.c, bias and bias.c,
    eps, center and 1 or 0), 2)
  s = record(s, { x, r }, function(_, g) return g, g end, nil, 'add')
  local inputs = { s }
  if weight then inputs[#inputs + 1] = weight end
  if bias then inputs[#inputs + 1] = bias end
  y = record(y, inputs, function(_, g, node)
    local gc = g:is_contiguous() and g or g:contiguous()
    local dres = node.taken_grad
    local dx = empty_like(s)
    local dw = weight and weight.requires_grad and empty_like(weight) or nil
    local db = bias and bias.requires_grad and empty_like(bias) or nil
    G.check(lib.gl_norm_backward_add(dx.c, dw and dw.c, db and db.c, gc.c, s.c, weight and weight.c, mean and mean.c,
      rstd.c, dres and dres.c, center and 1 or 0), 2)
    drop(gc, g)
    if weight and bias then return dx, dw, db elseif weight then return dx, dw elseif bias then return dx, db end
    return dx
  end, { s, weight }, name, center and { mean, rstd } or { rstd })
  if y.grad_fn then y.grad_fn.adds_into = 1 end
  return s, y
end

-- add_layer_norm(x, r, weight, bias, eps): s = x + r and layer_norm(s,
-- weight, bias, eps), fused; returns s, layer_norm(s)
function O.add_layer_norm(x, r, weight, bias, eps)
  return add_norm(x, r, weight, bias, eps or 1e-5, true, 'add_layer_norm')
end
-- add_rms_norm(x, r, weight, eps): s = x + r and rms_norm(s, weight, eps),
-- fused; returns s, rms_norm(s)
function O.add_rms_norm(x, r, weight, eps)
  return add_norm(x, r, weight, nil, eps or 1e-6, false, 'add_rms_norm')
end

-- ---------------------------------------------------------------- losses
-- The mean's divisor of a cross-entropy over targets t2 (N): with an
-- ignore_index, 1 / max(count of kept targets, 1) as a one-element tensor of
-- dtype `dt` on t2's device, computed there (nobody waits for the count);
-- without one, the number 1 / max(N, 1).
local function ce_inverse_count(t2, ignore_index, dt)
  if not ignore_index then return nil, 1 / math.max(t2:numel(), 1) end
  local ig = O.full({}, ignore_index, { dtype = t2.dtype, device = t2.device })
  local ne = binary_raw(B.ne, t2, ig, 'cross_entropy', dt)
  local cnt = reduce_raw(R.sum, ne, nil, false, 'cross_entropy')
  local clamped = unary_raw(U.clamp, cnt, 1, math.huge)
  local inv = unary_raw(U.rdiv_scalar, clamped, 1)
  drop(ig); drop(ne); drop(cnt); drop(clamped)
  return inv, 1
end

-- the backward's factor for the rows' gradients: g * inv * k, as a device
-- scalar (scale_by) and a number; the caller releases the tensor
local function ce_grad_scale(g, inv, k)
  if inv == nil then return g, k, false end
  return binary_raw(B.mul, g, inv, 'cross_entropy'), k, true
end

-- cross_entropy(logits (N, V) or (..., V), targets (N) or (...), opts):
-- mean over targets ~= ignore_index; optional tanh soft-capping.  No host
-- wait: the count of kept targets and the upstream gradient stay on the
-- device (the backward kernel reads their product).
function O.cross_entropy(logits, targets, opts)
  opts = opts or {}
  local ignore = opts.ignore_index or -100
  local softcap = opts.softcap or 0
  local V = logits.shape[#logits.shape]
  local N = logits:numel() / V
  if targets:numel() ~= N then
    error(('cross_entropy: targets have %d elements, expected %d (one per row of logits %s)'):format(
      targets:numel(), N, shape_str(logits.shape)), 2)
  end
  local lc = raw_contiguous(logits)
  local l2 = lc:_as_strided({ N, V }, { V, 1 }, lc:storage_offset())
  local tc = raw_contiguous(targets)
  local t2 = tc:_as_strided({ N }, { 1 }, tc:storage_offset())
  local sopt = { dtype = stat_dtype(logits), device = logits.device }
  local losses, lse = Tensor.empty({ N }, sopt), Tensor.empty({ N }, sopt)
  G.check(lib.gl_cross_entropy_forward(losses.c, lse.c, l2.c, t2.c, ignore, softcap), 2)
  local inv, k = ce_inverse_count(t2, opts.ignore_index, sopt.dtype)
  local total = reduce_raw(R.sum, losses, nil, false, 'cross_entropy')
  local loss = inv and binary_raw(B.mul, total, inv, 'cross_entropy') or unary_raw(U.mul_scalar, total, k)
  drop(total); drop(losses)
  return record(loss, { logits }, function(_, g, node)
    local dl = empty_like(l2)
    local by, kk, made = ce_grad_scale(g, inv, k)
    G.check(lib.gl_cross_entropy_backward(dl.c, l2.c, t2.c, lse.c, ignore, softcap, kk, by.c), 2)
    if made then drop(by) end
    local out = dl:_as_strided(logits.shape, Tensor.contiguous_strides(logits.shape), 0)
    drop(dl)
    if not node.retaining then drop(l2); drop(lc, logits); drop(t2); drop(tc, targets); drop(inv) end
    return out
  end, { l2, t2 }, 'cross_entropy', { lse })
end

-- raw helpers other modules share (ops_head.lua's fused head, optim's Newton-Schulz); not gl.* functions
O._raw = O._raw or {}
O._raw.inverse_count, O._raw.reduce_raw = ce_inverse_count, reduce_raw

-- dropout(x, p, training): a fresh mask per call from the global RNG
function O.dropout(x, p, training)
  check.number(p, 'dropout', 'p')
  if not (p >= 0 and p < 1) then error('dropout: p must be in [0, 1), got ' .. tostring(p), 2) end
  if not training or p == 0 then return x end
  local seed, off = O.rng_take(x:numel())
  local out = empty_like(x)
  G.check(lib.gl_dropout(out.c, x.c, p, seed, off), 2)
  return record(out, { x }, function(_, g)
    local dx = empty_like(g)
    G.check(lib.gl_dropout(dx.c, g.c, p, seed, off), 2)
    return dx
  end, nil, 'dropout')
end

return O
