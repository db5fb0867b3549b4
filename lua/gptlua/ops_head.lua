-- gptlua.ops_head — the LM head fused with its loss: x W^T, optional tanh
-- soft-capping and cross-entropy, over chunks of rows, so that the (N, V)
-- logits and their gradient are never whole in memory (llm.c's fused
-- classifier, Liger-kernel's FusedLinearCrossEntropy).  Both models use it
-- when they are given targets (models/common.lua's head); sampling and
-- `forward` without targets still return the logits.
--
-- Forward, per chunk of R rows (x_c (R, C), targets t_c):
--   logits (R, V) = x_c W^T                          (cuBLASLt / BLAS)
--   loss rows, lse = cross-entropy forward(logits)   (softcap inside)
-- and when a gradient is wanted, at once:
--   dlogits (over the logits, in place) = (softmax(z) - onehot) dz/dx / count
--   dx_c = dlogits W,   dW += dlogits^T x_c          (dW: beta 0, then 1)
-- then the chunk's logits go.  count (the targets kept) lives on the device:
-- the kernel reads 1 / max(count, 1) from a tensor, so nothing waits.
-- Backward: the upstream gradient g (a device scalar) times dx and dW, in
-- place.  The loss is the same number as cross_entropy(linear(x, W)).
--
-- Why the gradients in the forward (as Liger) and not a recomputation of
-- each chunk's logits in the backward: recomputing costs the head's forward
-- GEMM again, 2 N V C FLOPs (5.1 TFLOP of a GPT-2 124M step at B=64, T=1024;
-- 11 TFLOP of nanochat d20's at B=32, T=2048), 4-5% of the step; keeping dx
-- (N, C) until the backward costs what keeping x for it would.  The price:
-- the forward of a graph whose backward never runs (evaluation with grad
-- on) does the backward's GEMMs too; under gl.no_grad it does not.
--
-- Memory: the unfused head holds logits (N, V) from forward to backward and
-- dlogits (N, V) in it: 4 N V bytes in bf16 (13.2 GB at GPT-2 124M's
-- B=64, T=1024, V=50304; 17.2 GB at nanochat d20's B=32, T=2048,
-- V=65536); fused, one chunk of R rows (R V activation bytes) at a time,
-- plus dx (N, C) and dW (V, C), which the unfused backward makes too.
--
-- Rounding: with more than one chunk, dW accumulates in W's dtype (each
-- chunk's product is summed in fp32 and rounded once into dW), so a
-- bfloat16 dW is rounded once per chunk instead of once.
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local check = require 'gptlua.check'
local ffi, lib = G.ffi, G.lib

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end
local drop = O.drop_view

-- rows per chunk: 8192 rows of a 50304 (65536) vocabulary in bf16 are
-- 824 MB (1.07 GB) of logits, and keep the chunk's GEMMs large enough
-- (8192 x V x C) to run at full speed
local CHUNK_ROWS = 8192
O.HEAD_CHUNK_ROWS = CHUNK_ROWS

local function rows_view(t, r0, n, C)  -- rows [r0, r0 + n) of a contiguous (N, C) tensor
  return t:_as_strided({ n, C }, { C, 1 }, t:storage_offset() + r0 * C)
end
local function raw_t(m)
  return m:_as_strided({ m.shape[2], m.shape[1] }, { m:stride(2), m:stride(1) }, m:storage_offset())
end

-- linear_cross_entropy(x (..., C), weight (V, C), targets (...), opts):
-- mean cross-entropy of x weight^T against targets, never holding the whole
-- logits.  opts: ignore_index (targets equal to it are left out of the
-- mean; default none), softcap (> 0: z = softcap tanh(logits / softcap)),
-- chunk_rows (rows per chunk, default 8192), reduction ('mean', or 'none':
-- each row's loss, shaped as targets, 0 where ignored; evaluation only, so
-- refused where a gradient is wanted).
function O.linear_cross_entropy(x, W, targets, opts)
  opts = opts or {}
  local per_row = opts.reduction == 'none'
  if opts.reduction ~= nil and opts.reduction ~= 'mean' and not per_row then
    error(("linear_cross_entropy: reduction must be 'mean' or 'none', got %s"):format(tostring(opts.reduction)), 2)
  end
  local nx = #x.shape
  local C = x.shape[nx]
  if #W.shape ~= 2 or W.shape[2] ~= C then
    error(('linear_cross_entropy: weight has shape %s, expected {*,%d} (features of x %s)'):format(
      shape_str(W.shape), C, shape_str(x.shape)), 2)
  end
  local V = W.shape[1]
  local N = C > 0 and x:numel() / C or 0
  if targets:numel() ~= N then
    error(('linear_cross_entropy: targets have %d elements, expected %d (one per row of x %s)'):format(
      targets:numel(), N, shape_str(x.shape)), 2)
  end
  local rows = opts.chunk_rows or CHUNK_ROWS
  check.integer(rows, 'linear_cross_entropy', 'chunk_rows', 1, nil, 2)
  local softcap = opts.softcap or 0
  if type(softcap) ~= 'number' or not (softcap >= 0) then
    error(('linear_cross_entropy: softcap must be a number >= 0 (0 disables it), got %s'):format(
      tostring(softcap)), 2)
  end
  local ignore = opts.ignore_index or -100
  local xc = O.raw_contiguous(x)
  local x2 = xc:_as_strided({ N, C }, { C, 1 }, xc:storage_offset())
  local tc = O.raw_contiguous(targets)
  local t2 = tc:_as_strided({ N }, { 1 }, tc:storage_offset())
  local sopt = { dtype = x.dtype == 'float64' and 'float64' or 'float32', device = x.device }
  local losses = Tensor.empty({ N }, sopt)
  local inv, k = O._raw.inverse_count(t2, opts.ignore_index, sopt.dtype)
  local want = A.is_grad_enabled() and (x.requires_grad or W.requires_grad)
  if per_row and want then
    error("linear_cross_entropy: reduction 'none' has no backward; call it under gl.no_grad", 2)
  end
  local dx = want and x.requires_grad and Tensor.empty({ N, C }, { dtype = x.dtype, device = x.device }) or nil
  local dW = want and W.requires_grad and O.empty_like(W) or nil
  if dW and N == 0 then dW:zero_() end  -- no chunk writes it
  local Wt = raw_t(W)
  local lse = want and Tensor.empty({ math.min(rows, N) }, sopt) or nil
  for r0 = 0, N - 1, rows do
    local n = math.min(rows, N - r0)
    local xr = rows_view(x2, r0, n, C)
    local tr = t2:_as_strided({ n }, { 1 }, t2:storage_offset() + r0)
    local lr = losses:_as_strided({ n }, { 1 }, r0)
    local lser = lse and lse:_as_strided({ n }, { 1 }, 0)
    local logits = Tensor.empty({ n, V }, { dtype = x.dtype, device = x.device })
    O.matmul_raw(xr, Wt, logits, 0)
    G.check(lib.gl_cross_entropy_forward(lr.c, lser and lser.c or nil, logits.c, tr.c, ignore, softcap), 2)
    if want then
      G.check(lib.gl_cross_entropy_backward(logits.c, logits.c, tr.c, lser.c, ignore, softcap, k, inv and inv.c or nil), 2)
      if dx then
        local dr = rows_view(dx, r0, n, C)
        O.matmul_raw(logits, W, dr, 0)
        drop(dr)
      end
      if dW then
        local lt = raw_t(logits)
        O.matmul_raw(lt, xr, dW, r0 == 0 and 0 or 1)
        drop(lt)
      end
    end
    Tensor.release(logits)
    drop(xr); drop(tr); drop(lr); drop(lser)
  end
  drop(Wt); drop(lse)
  if per_row then
    drop(x2); drop(xc, x); drop(t2); drop(tc, targets); drop(inv)
    local out = losses:_as_strided(targets.shape, Tensor.contiguous_strides(targets.shape), 0)
    drop(losses)  -- the view now holds the only reference
    return out
  end
  local total = O._raw.reduce_raw(lib.GL_R_SUM, losses, nil, false, 'linear_cross_entropy')
  local loss
  if inv then loss = O.binary_raw(lib.GL_B_MUL, total, inv, 'linear_cross_entropy')
  else loss = O.unary_raw(lib.GL_U_MUL_SCALAR, total, k) end
  Tensor.release(total); Tensor.release(losses)
  drop(x2); drop(xc, x); drop(t2); drop(tc, targets); drop(inv)
  if not want then return loss end
  -- dx and dW times the upstream gradient g (a device scalar broadcast: no
  -- host wait), in place unless the graph is kept for another backward
  local function times_g(d, g, keep)
    local gb = O.expand_raw(g, d.shape, 'linear_cross_entropy')
    local out = keep and O.empty_like(d) or d
    G.check(lib.gl_binary(lib.GL_B_MUL, out.c, d.c, gb.c), 2)
    drop(gb, g)
    return out
  end
  return A.record(loss, { x, W }, function(_, g, node)
    local gx, gW
    if dx then
      local s = times_g(dx, g, node.retaining)
      gx = s:_as_strided(x.shape, Tensor.contiguous_strides(x.shape), 0)
      drop(s)
    end
    if dW then gW = times_g(dW, g, node.retaining) end
    if not node.retaining then dx, dW = nil, nil end
    return gx, gW
  end, nil, 'linear_cross_entropy')
end

return O
