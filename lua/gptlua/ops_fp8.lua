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
--
-- A layer whose operands are split over ranks (tensor parallelism cuts W's
-- rows or columns, context parallelism the tokens) quantizes each operand
-- with one process's scales: an amax over a quantization axis that the
-- ranks split (rowwise: the row's inner dim; tensorwise: any dim) is each
-- rank's part's amax max-reduced over the group that split it (a scalar or
-- a vector per product, all-reduced on the device), so every rank's FP8
-- operands are exactly the parts of the ones a single process quantizes.
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

local F8 = { float8_e4m3fn = lib.GL_F8E4M3, float8_e5m2 = lib.GL_F8E5M2 }

-- fp8_amax(x, recipe): x's amax as fp8_quantize takes it (float32; rowwise:
-- {R}, one per row; else {1}) for a 2-D x of any strides (gl_fp8_amax)
function O.fp8_amax(x, recipe)
  local rw = RECIPES[recipe or 'tensorwise']
  if rw == nil then error(("fp8_amax: recipe is '%s', expected 'tensorwise' or 'rowwise'"):format(tostring(recipe)), 2) end
  if #x.shape ~= 2 then error(('fp8_amax: x has shape %s, expected 2 dims'):format(shape_str(x.shape)), 2) end
  local m = Tensor.empty({ rw == 1 and x.shape[1] or 1 }, { dtype = 'float32', device = x.device })
  G.check(lib.gl_fp8_amax(m.c, x.c, rw), 2)
  return m
end

-- fp8_quantize_amax(x, dtype, amax): q and scale_inv for a 2-D x with amax
-- given (float32 {1}: one scale, or {R}: one per row), as fp8_quantize
-- computes them from x's own amax (gl_fp8_cast, gl_fp8_scale_inv)
function O.fp8_quantize_amax(x, dtype, amax)
  if #x.shape ~= 2 then error(('fp8_quantize_amax: x has shape %s, expected 2 dims'):format(shape_str(x.shape)), 2) end
  if not F8[dtype] then
    error(("fp8_quantize_amax: dtype is '%s', expected float8_e4m3fn or float8_e5m2"):format(tostring(dtype)), 2)
  end
  local q = Tensor.empty(x.shape, { dtype = dtype, device = x.device })
  local s = Tensor.empty({ amax:numel() }, { dtype = 'float32', device = x.device })
  G.check(lib.gl_fp8_cast(q.c, x.c, amax.c), 2)
  G.check(lib.gl_fp8_scale_inv(s.c, amax.c, F8[dtype]), 2)
  return q, s
end

-- x's amax as fp8_quantize takes it, max-reduced over each comm of groups
-- (on the device: no host wait over NCCL)
local function amax_over(x, recipe, groups)
  local m = O.fp8_amax(x, recipe)
  for _, comm in ipairs(groups) do comm:all_reduce_async(m, 'max'):wait() end
  return m
end

-- an operand quantized along its rows' inner dim; rows, inner: the comms
-- that split its rows and its inner dim (lists, maybe empty).  Rowwise
-- scales cross only the inner dim's split, tensorwise ones both.
local function quantize_split(a, dtype, recipe, rows, inner)
  local groups = {}
  for _, c in ipairs(inner) do groups[#groups + 1] = c end
  if recipe == 'tensorwise' then for _, c in ipairs(rows) do groups[#groups + 1] = c end end
  if #groups == 0 then return quantize(a, dtype, recipe) end
  local m = amax_over(a, recipe, groups)
  local q, s = O.fp8_quantize_amax(a, dtype, m)
  m:free()
  return q, s
end

local NONE = {}

-- one product of the layer: (a @ b^T) with both operands quantized along
-- their rows (K), freed as soon as the product has run; ra, ia, rb, ib: the
-- comms splitting a's and b's rows and inner dims
local function scaled(a, da, b, db, recipe, dtype, ra, ia, rb, ib)
  local qa, sa = quantize_split(a, da, recipe, ra or NONE, ia or NONE)
  local qb, sb = quantize_split(b, db, recipe, rb or NONE, ib or NONE)
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

-- W's operands: (n_out, n_in) scaled along its rows for the forward, and
-- W^T (n_in, n_out) scaled along W's columns for the input gradient; each
-- returns q, s and whether they are the caller's to free.  pre =
-- rawget(W, 'fp8_gathered'): FSDP gathered them already quantized,
-- {recipe, q, s, qc, sc}: q and its scale_inv s as fp8_quantize(W) makes
-- them, qc and sc W's columns' codes and scales as fp8_quantize(W^T) makes
-- them, in W's layout (tensorwise, qc is q); W's own values are not read.
-- Otherwise quantized here, n and k the comms cutting W's rows and columns.
local function weight_rows(W, recipe, pre, n, k)
  if pre then return pre.q, pre.s, false end
  local q, sc = quantize_split(W, 'float8_e4m3fn', recipe, n, k)
  return q, sc, true
end
local function weight_columns(W, n_in, n_out, recipe, pre, n, k)
  if pre then return gathered_transposed(pre, n_in, n_out), pre.sc, false end
  local Wt = W:_as_strided({ n_in, n_out }, { 1, n_in }, W:storage_offset())
  local q, sc = quantize_split(Wt, 'float8_e4m3fn', recipe, k, n)
  drop(Wt)
  return q, sc, true
end

local function list(c) return c and { c } or NONE end

-- fp8_linear(x, W, recipe, split): x W^T (no bias: add one after) with FP8
-- products; split (optional): the comms of the ranks that split the layer,
-- split.tokens (x's rows: context parallelism), split.k (W's columns and
-- x's: a row-parallel layer), split.n (W's rows: a column-parallel layer)
function O.fp8_linear(x, W, recipe, split)
  if RECIPES[recipe] == nil then
    error(("fp8_linear: recipe is '%s', expected 'tensorwise' or 'rowwise'"):format(tostring(recipe)), 2)
  end
  split = split or NONE
  local tok, k, n = list(split.tokens), list(split.k), list(split.n)
  local pre = rawget(W, 'fp8_gathered')
  if pre then
    if pre.recipe ~= recipe then
      error(("fp8_linear: the weight was gathered in FP8 for recipe '%s', the layer runs '%s'"):format(pre.recipe,
        recipe), 2)
    end
    -- (FSDP gathers whole nn.Linear weights: tp's cut layers gather in their dtype)
    assert(#k == 0 and #n == 0, 'fp8_linear: a weight gathered in FP8 is whole, not cut over tp')
  end
  local lead, n_in, n_out, xc, x2, oshape = O._raw.linear_rows('fp8_linear', x, W)
  local qx, sx = quantize_split(x2, 'float8_e4m3fn', recipe, tok, k)
  local qw, sw, own = weight_rows(W, recipe, pre, n, k)
  local out2 = product(qx, sx, qw, sw, x.dtype)
  qx:free(); sx:free()
  if own then qw:free(); sw:free() end
  local out = out2:_as_strided(oshape, Tensor.contiguous_strides(oshape), 0)
  drop(out2)
  return A.record(out, { x, W }, function(_, g)
    local gc = raw_contiguous(g)
    local g2 = gc:_as_strided({ lead, n_out }, { n_out, 1 }, gc:storage_offset())
    local gx, gW
    if x.requires_grad then  -- dx = dy W: dy's rows, W^T's rows (W's columns)
      local qg, sg = quantize_split(g2, 'float8_e5m2', recipe, tok, n)
      local qt, st, own_t = weight_columns(W, n_in, n_out, recipe, pre, n, k)
      local d2 = product(qg, sg, qt, st, x.dtype)
      qg:free(); sg:free(); qt:free()
      if own_t then st:free() end
      gx = d2:_as_strided(x.shape, Tensor.contiguous_strides(x.shape), 0)
      drop(d2)
    end
    if W.requires_grad then  -- dW = dy^T x: dy's columns, x's columns
      local gt = g2:_as_strided({ n_out, lead }, { 1, n_out }, g2:storage_offset())
      local xt = x2:_as_strided({ n_in, lead }, { 1, n_in }, x2:storage_offset())
      gW = scaled(gt, 'float8_e5m2', xt, 'float8_e4m3fn', recipe, W.dtype, n, tok, k, tok)
      drop(gt); drop(xt)
    end
    drop(g2); drop(gc, g); drop(x2); drop(xc, x)
    return gx, gW
  end, pre and { x2 } or { x2, W }, 'fp8_linear')
end
