-- gptlua.ops_fp8 — the FP8 linear layer: y = x W^T with each of its three
-- products (forward, the input's gradient, the weight's) run on float8
-- operands with current scaling (gl_fp8_quantize, gl_fp8_matmul: the scale
-- s = fp8_max / amax computed on the device, float32 accumulation, the
-- result in the input's dtype).  x and W are cast to float8_e4m3fn, the
-- output's gradient to float8_e5m2 (its wider range), as torchao's float8
-- tensorwise recipe does; 'rowwise' scales each row of every operand along
-- the product's inner dim (one scale per row of x, of W, of dy, and per
-- column for the transposed operands of the backward) instead of one per
-- tensor.  The backward treats the quantization as the identity (a
-- straight-through estimator, as torchao does): dx = Q(dy) Q(W) and
-- dW = Q(dy)^T Q(x), each operand quantized afresh along its own inner dim,
-- so the gradients are those of x W^T up to FP8 rounding of the operands.
-- Functions land in gptlua.ops (gl.*).
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local lib = G.lib
local raw_contiguous, drop = O.raw_contiguous, O.drop_view

local RECIPES = { tensorwise = 0, rowwise = 1 }

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end

-- fp8_quantize(x, dtype, recipe): q (x's shape, float8 dtype) and its
-- float32 scale_inv ({1}, or one per row for 'rowwise') for a 2-D float32 /
-- bfloat16 x of any strides, with x ~= q * scale_inv
function O.fp8_quantize(x, dtype, recipe)
  local rw = RECIPES[recipe or 'tensorwise']
  if rw == nil then error(("fp8_quantize: recipe is '%s', expected 'tensorwise' or 'rowwise'"):format(tostring(recipe)), 2) end
  if #x.shape ~= 2 then error(('fp8_quantize: x has shape %s, expected 2 dims'):format(shape_str(x.shape)), 2) end
  local q = Tensor.empty(x.shape, { dtype = dtype, device = x.device })
  local s = Tensor.empty({ rw == 1 and x.shape[1] or 1 }, { dtype = 'float32', device = x.device })
  G.check(lib.gl_fp8_quantize(q.c, s.c, x.c, rw), 2)
  return q, s
end
local quantize = O.fp8_quantize

-- fp8_matmul(a, a_scale_inv, b, b_scale_inv, dtype): (a * a_scale_inv) @ (b * b_scale_inv)^T
-- for float8 a (M, K) and b (N, K), in dtype (float32 or bfloat16)
function O.fp8_matmul(a, sa, b, sb, dtype)
  local out = Tensor.empty({ a.shape[1], b.shape[1] }, { dtype = dtype or 'float32', device = a.device })
  G.check(lib.gl_fp8_matmul(out.c, a.c, sa.c, b.c, sb.c), 2)
  return out
end
local product = O.fp8_matmul

-- one product of the layer: (a @ b^T) with both operands quantized along
-- their rows (K), freed as soon as the product has run
local function scaled(a, da, b, db, recipe, dtype)
  local qa, sa = quantize(a, da, recipe)
  local qb, sb = quantize(b, db, recipe)
  local out = product(qa, sa, qb, sb, dtype)
  qa:free(); sa:free(); qb:free(); sb:free()
  return out
end

-- the transposed weight's operand of the input gradient from a gathered
-- FP8 weight (see fp8_linear): its column-scaled codes (R, C), transposed
-- to the row-major (C, R) the product takes (bytes moved, not re-rounded)
local function gathered_transposed(pre, n_in, n_out)
  if not pre.qc then
    error('fp8_linear: the gathered FP8 weight has no column-scaled form for the input gradient '
      .. '(gathered for a forward without gradients)', 3)
  end
  local qt = Tensor.empty({ n_in, n_out }, { dtype = pre.qc.dtype, device = pre.qc.device })
  local v = pre.qc:_as_strided({ n_in, n_out }, { 1, n_in }, pre.qc:storage_offset())
  G.check(lib.gl_copy(qt.c, v.c), 3)
  drop(v)
  return qt
end

-- fp8_linear with W's FP8 operands given (pre = rawget(W, 'fp8_gathered'):
-- FSDP gathered them already quantized, {recipe, q, s, qc, sc}: q (R, C)
-- and its scale_inv s as fp8_quantize(W) makes them, qc and sc W's
-- columns' codes and scales as fp8_quantize(W^T) makes them, in W's
-- layout; tensorwise, qc is q).  W's own values are not read: it only
-- receives the gradient.
local function linear_pregathered(x, W, recipe, pre)
  local lead, n_in, n_out, xc, x2, oshape = O._raw.linear_rows('fp8_linear', x, W)
  local qx, sx = quantize(x2, 'float8_e4m3fn', recipe)
  local out2 = product(qx, sx, pre.q, pre.s, x.dtype)
  qx:free(); sx:free()
  local out = out2:_as_strided(oshape, Tensor.contiguous_strides(oshape), 0)
  drop(out2)
  return A.record(out, { x, W }, function(_, g)
    local gc = raw_contiguous(g)
    local g2 = gc:_as_strided({ lead, n_out }, { n_out, 1 }, gc:storage_offset())
    local gx, gW
    if x.requires_grad then
      local qg, sg = quantize(g2, 'float8_e5m2', recipe)
      local qt = gathered_transposed(pre, n_in, n_out)
      local d2 = product(qg, sg, qt, pre.sc, x.dtype)
      qg:free(); sg:free(); qt:free()
      gx = d2:_as_strided(x.shape, Tensor.contiguous_strides(x.shape), 0)
      drop(d2)
    end
    if W.requires_grad then
      local gt = g2:_as_strided({ n_out, lead }, { 1, n_out }, g2:storage_offset())
      local xt = x2:_as_strided({ n_in, lead }, { 1, n_in }, x2:storage_offset())
      gW = scaled(gt, 'float8_e5m2', xt, 'float8_e4m3fn', recipe, W.dtype)
      drop(gt); drop(xt)
    end
    drop(g2); drop(gc, g); drop(x2); drop(xc, x)
    return gx, gW
  end, { x2 }, 'fp8_linear')
end

-- fp8_linear(x, W, recipe): x W^T (no bias: add one after) with FP8 products
function O.fp8_linear(x, W, recipe)
  if RECIPES[recipe] == nil then
    error(("fp8_linear: recipe is '%s', expected 'tensorwise' or 'rowwise'"):format(tostring(recipe)), 2)
  end
  local pre = rawget(W, 'fp8_gathered')
  if pre then
    if pre.recipe ~= recipe then
      error(("fp8_linear: the weight was gathered in FP8 for recipe '%s', the layer runs '%s'"):format(pre.recipe,
        recipe), 2)
    end
    return linear_pregathered(x, W, recipe, pre)
  end
  local lead, n_in, n_out, xc, x2, oshape = O._raw.linear_rows('fp8_linear', x, W)
  local out2 = scaled(x2, 'float8_e4m3fn', W, 'float8_e4m3fn', recipe, x.dtype)
  local out = out2:_as_strided(oshape, Tensor.contiguous_strides(oshape), 0)
  drop(out2)
  return A.record(out, { x, W }, function(_, g)
    local gc = raw_contiguous(g)
    local g2 = gc:_as_strided({ lead, n_out }, { n_out, 1 }, gc:storage_offset())
    local gx, gW
    if x.requires_grad then  -- dx = dy W: dy's rows, W^T's rows (W's columns)
      local Wt = W:_as_strided({ n_in, n_out }, { 1, n_in }, W:storage_offset())
      local d2 = scaled(g2, 'float8_e5m2', Wt, 'float8_e4m3fn', recipe, x.dtype)
      gx = d2:_as_strided(x.shape, Tensor.contiguous_strides(x.shape), 0)
      drop(Wt); drop(d2)
    end
    if W.requires_grad then  -- dW = dy^T x: dy's columns, x's columns
      local gt = g2:_as_strided({ n_out, lead }, { 1, n_out }, g2:storage_offset())
      local xt = x2:_as_strided({ n_in, lead }, { 1, n_in }, x2:storage_offset())
      gW = scaled(gt, 'float8_e5m2', xt, 'float8_e4m3fn', recipe, W.dtype)
      drop(gt); drop(xt)
    end
    drop(g2); drop(gc, g); drop(x2); drop(xc, x)
    return gx, gW
  end, { x2, W }, 'fp8_linear')
end
