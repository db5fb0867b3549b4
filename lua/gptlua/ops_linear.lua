-- gptlua.ops_linear — differentiable matrix products: matmul (batched,
-- broadcast), linear (x W^T + b, with cuBLASLt epilogues where they apply)
-- and the fused MLP (linear, activation, linear in one op), each with its
-- backward; under autograd's deferred mode (pipeline ZB-H1) the weight
-- gradients are queued for the W pass.  Functions land in gptlua.ops (gl.*).
local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local ffi, lib = G.ffi, G.lib
local record = A.record
local empty_like = O.empty_like
local broadcast_shape, bview, drop, sum_to = O.broadcast_shape, O.broadcast_view, O.drop_view, O.sum_to
local raw_contiguous = O.raw_contiguous
local NULL = nil

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end

-- ------------------------------------------------------------ matrix products
-- the operands of a raw batched product with broadcast batch dims, as
-- views over the batch shape, and its output (given or new)
local function matmul_operands(a, b, out)
  local na, nb = #a.shape, #b.shape
  if na < 2 or nb < 2 then
    error(('matmul: expected operands with at least 2 dims, got %s and %s'):format(shape_str(a.shape),
      shape_str(b.shape)), 4)
  end
  local M, Ka, Kb, N = a.shape[na - 1], a.shape[na], b.shape[nb - 1], b.shape[nb]
  if Ka ~= Kb then
    error(('matmul: shapes %s and %s do not match (inner dims %d and %d)'):format(shape_str(a.shape),
      shape_str(b.shape), Ka, Kb), 4)
  end
  local ba, bb = {}, {}
  for i = 1, na - 2 do ba[i] = a.shape[i] end
  for i = 1, nb - 2 do bb[i] = b.shape[i] end
  local batch = broadcast_shape(ba, bb, 'matmul')
  local sa, sb, so = {}, {}, {}
  for i, n in ipairs(batch) do sa[i], sb[i], so[i] = n, n, n end
  sa[#batch + 1], sa[#batch + 2] = M, Ka
  sb[#batch + 1], sb[#batch + 2] = Kb, N
  so[#batch + 1], so[#batch + 2] = M, N
  if not out then out = Tensor.empty(so, { dtype = a.dtype, device = a.device }) end
  return out, bview(a, sa), bview(b, sb)
end

-- raw batched product with broadcast batch dims; out = a @ b (+ beta*out)
local function matmul_raw(a, b, out, beta, alpha)
  local va, vb
  out, va, vb = matmul_operands(a, b, out)
  G.check(lib.gl_matmul(out.c, va.c, vb.c, alpha or 1, beta or 0), 2)
  drop(va, a); drop(vb, b)
  return out
end
-- two independent raw products a1 @ b1 and a2 @ b2 side by side (one thread
-- each on the CPU): the two gradients of a backward step
function O.matmul_pair_raw(a1, b1, a2, b2)
  local out1, va1, vb1 = matmul_operands(a1, b1)
  local out2, va2, vb2 = matmul_operands(a2, b2)
  G.check(lib.gl_matmul_pair(out1.c, va1.c, vb1.c, out2.c, va2.c, vb2.c, 1, 0), 2)
  drop(va1, a1); drop(vb1, b1); drop(va2, a2); drop(vb2, b2)
  return out1, out2
end
O.matmul_raw = matmul_raw

-- matmul(a, b): matrix product a @ b; 1-D operands are vectors, leading dims
-- batch and broadcast (as torch.matmul)
function O.matmul(a, b)
  local x, y = a, b
  -- vectors as in numpy: (K) @ (K, N) and (M, K) @ (K)
  if #a.shape == 1 then x = a:unsqueeze(1) end
  if #b.shape == 1 then y = b:unsqueeze(2) end
  if x ~= a or y ~= b then
    local r = O.matmul(x, y)
    if #a.shape == 1 then r = r:squeeze(-2) end
    if #b.shape == 1 then r = r:squeeze(-1) end
    return r
  end
  local out = O.matmul_raw(a, b)
  return record(out, { a, b }, function(_, g)
    local ga, gb
    if a.requires_grad and b.requires_grad then
      ga, gb = O.matmul_pair_raw(g, b:transpose(-1, -2), a:transpose(-1, -2), g)
    else
      ga = a.requires_grad and O.matmul_raw(g, b:transpose(-1, -2)) or nil
      gb = b.requires_grad and O.matmul_raw(a:transpose(-1, -2), g) or nil
    end
    return ga and sum_to(ga, a.shape), gb and sum_to(gb, b.shape)
  end, { b.requires_grad and a or nil, a.requires_grad and b or nil }, 'matmul')
end
Tensor.matmul = O.matmul

-- linear(x, W, b): y = x W^T + b with W (out, in) as in PyTorch/GPT-2
-- raw helpers outside autograd: a transposed view of a 2-d tensor, and a
-- contiguous copy
local function raw_t(m)
  return m:_as_strided({ m.shape[2], m.shape[1] }, { m:stride(2), m:stride(1) }, m:storage_offset())
end

-- The gradient of x that a node took over (autograd's adds_into), if the
-- node may add into it in place: no other gradient is that tensor
-- (taken_alone), no other tensor views its storage, and it is one dense
-- run of x's shape and dtype; else nil (the node adds it as autograd would).
local function accumulable(node, x)
  local t = node.taken_grad
  if t == nil or not node.taken_alone or t.dtype ~= x.dtype or not t:is_contiguous() then return nil end
  if #t.shape ~= #x.shape then return nil end
  for i = 1, #x.shape do if t.shape[i] ~= x.shape[i] then return nil end end
  if t.c.storage.refcount ~= 1 or t.device ~= x.device then return nil end
  return t
end

-- A linear layer's x (..., in) as rows: checks weight (out, in) against x
-- (the error names the op, what), and returns the rows' count, in, out, x
-- made contiguous, its (rows, in) view and the output's shape (..., out)
local function linear_rows(what, x, W)
  local nx = #x.shape
  if #W.shape ~= 2 or W.shape[2] ~= x.shape[nx] then
    error(('%s: weight has shape %s, expected {*,%d} (in_features of x %s)'):format(what, shape_str(W.shape),
      x.shape[nx], shape_str(x.shape)), 3)
  end
  local n_in, n_out = W.shape[2], W.shape[1]
  local lead = 1
  for i = 1, nx - 1 do lead = lead * x.shape[i] end
  local xc = raw_contiguous(x)
  local x2 = xc:_as_strided({ lead, n_in }, { n_in, 1 }, xc:storage_offset())
  local oshape = x:size(); oshape[nx] = n_out
  return lead, n_in, n_out, xc, x2, oshape
end
O._raw = O._raw or {}
O._raw.linear_rows = linear_rows   -- (gl.fp8_linear's too)

-- linear(x, weight, bias, residual): x @ weight^T + bias, weight (out, in)
-- as nn.Linear's; residual (optional, of the output's shape) is added in the
-- product (gl_matmul_add: cuBLASLt's C, no pass of its own; with a bias the
-- add is a pass after it) and gets the output's gradient, passed through
function O.linear(x, W, bias, residual)
  local lead, n_in, n_out, xc, x2, oshape = linear_rows('linear', x, W)
  if residual and not O.same_shape(residual.shape, oshape) then
    error(('linear: residual has shape %s, expected %s'):format(shape_str(residual.shape), shape_str(oshape)), 2)
  end
  local out = Tensor.empty(oshape, { dtype = x.dtype, device = x.device })
  local out2 = out:_as_strided({ lead, n_out }, { n_out, 1 }, 0)
  local Wt = raw_t(W)
  if bias then  -- on a GPU the bias rides in cuBLASLt's epilogue
    if #bias.shape ~= 1 or bias.shape[1] ~= n_out then
      error(('linear: bias has shape %s, expected {%d}'):format(shape_str(bias.shape), n_out), 2)
    end
    G.check(lib.gl_matmul_bias(out2.c, x2.c, Wt.c, bias.c), 2)
    if residual then G.check(lib.gl_binary(lib.GL_B_ADD, out.c, out.c, residual.c), 2) end
  elseif residual then
    local rc = raw_contiguous(residual)
    local r2 = rc:_as_strided({ lead, n_out }, { n_out, 1 }, rc:storage_offset())
    G.check(lib.gl_matmul_add(out2.c, x2.c, Wt.c, r2.c), 2)
    drop(r2); drop(rc, residual)
  else
    O.matmul_raw(x2, Wt, out2, 0)
  end
  drop(Wt); drop(out2)
  local inputs = bias and { x, W, bias } or { x, W }
  if residual then inputs[#inputs + 1] = residual end
  local y = record(out, inputs, function(_, g, node)
    local gc = raw_contiguous(g)
    local g2 = gc:_as_strided({ lead, n_out }, { n_out, 1 }, gc:storage_offset())
    -- the gradient x already has (taken over: adds_into), when the dx
    -- product can add into it in place (beta 1)
    local acc = x.requires_grad and accumulable(node, x) or nil
    -- dx and dW side by side on the CPU; on a GPU db rides in dW's epilogue
    local rawx = x.requires_grad and not acc and empty_like(x2, { lead, n_in }) or nil
    local wants = {}
    if W.requires_grad then wants[#wants + 1] = W end
    if bias and bias.requires_grad then wants[#wants + 1] = bias end
    -- deferred (a zero-bubble pipeline's W): dW and db later, from g2 and x2 (views: they hold the storage)
    local later = A.deferrable(wants, node) and A.defer(wants, function()
      local gW = W.requires_grad and empty_like(W) or nil
      local gb = bias and bias.requires_grad and empty_like(bias) or nil
      G.check(lib.gl_linear_backward(NULL, gW and gW.c, gb and gb.c, NULL, g2.c, x2.c, W.c, NULL), 2)
      drop(g2); drop(gc, g); drop(x2); drop(xc, x)
      if gW then return gW, gb end
      return gb
    end)
    local gW = not later and W.requires_grad and empty_like(W) or nil
    local gb = not later and bias and bias.requires_grad and empty_like(bias) or nil
    if rawx or gW or gb then
      G.check(lib.gl_linear_backward(rawx and rawx.c, gW and gW.c, gb and gb.c, NULL, g2.c, x2.c, W.c, NULL), 2)
    end
    local gx
    local gr = residual and residual.requires_grad and g or nil  -- (returned after the others)
    if rawx then
      gx = rawx:_as_strided(x.shape, Tensor.contiguous_strides(x.shape), 0)
      drop(rawx)
      if node.taken_grad then gx = node.taken_grad:add(gx) end  -- taken but not addable in place: as autograd adds
    elseif acc then
      local a2 = acc:_as_strided({ lead, n_in }, { n_in, 1 }, acc:storage_offset())
      G.check(lib.gl_matmul(a2.c, g2.c, W.c, 1, 1), 2)
      drop(a2)
      gx = acc
    end
    if later then gW, gb = nil, nil
    else
      drop(g2); drop(gc, g)
      if not node.retaining then drop(x2); drop(xc, x) end
    end
    if bias then return gx, gW, gb, gr end
    return gx, gW, gr
  end, { W.requires_grad and x2 or nil, x.requires_grad and W or nil }, 'linear')
  -- x's gradient so far (another consumer's: nanochat's c_q, c_k and c_v
  -- read one x) is taken over, so that dx = dy W adds into it in the
  -- product (beta 1) instead of autograd adding the two in a pass of its own
  if y.grad_fn then y.grad_fn.adds_into = 1 end
  return y
end

local MLP_ACTS = { gelu = true, relu2 = true }
-- mlp(x, fc_weight, fc_bias, proj_weight, proj_bias, activation): a
-- transformer's MLP, act(x fc_weight^T + fc_bias) proj_weight^T + proj_bias,
-- as one op so that its passes over the (..., 4C) activations fuse: with
-- 'gelu' (tanh) the GELU rides in the first product's epilogue (the GELU
-- input kept for the backward) and, backward, GELU' and the first bias's
-- gradient in the epilogue of the product that makes dx of the second
-- layer (gl_matmul_epilogue, gl_linear_backward; cuBLASLt's GELU_AUX_BIAS
-- and DGELU_BGRAD on a GPU).  'relu2' (nanochat's relu(x)^2) keeps only
-- its output h, never the product: h = relu(x W1^T + b1)^2 in the first
-- product's epilogue (GL_EPI_RELU2) and, backward, dpre = (g W2) * 2 sqrt(h)
-- in the epilogue of the dx product of the second layer (GL_EPI_DRELU2;
-- relu(pre) = sqrt(h)); on a GPU both are kernels/gemm_mma.cu, a bf16 GEMM
-- of our own (cuBLASLt has no ReLU² epilogue), on the CPU and for operands
-- that kernel cannot take the product and then the passes.  Biases may be nil.  residual
-- (optional, of the output's shape): returns residual + mlp(x), the block's
-- closing add in the second product (gl_matmul_add: cuBLASLt's C, no pass
-- of its own; with a proj_bias the add is a pass after the product); its
-- gradient is the output's, passed through.
function O.mlp(x, W1, b1, W2, b2, act, residual)
  if not MLP_ACTS[act] then
    error(('mlp: activation is %s, expected \'gelu\' or \'relu2\''):format(tostring(act)), 2)
  end
  local nx = #x.shape
  local C, H = x.shape[nx], W1.shape[1]
  if #W1.shape ~= 2 or W1.shape[2] ~= C then
    error(('mlp: fc_weight has shape %s, expected {*,%d} (the last dim of x %s)'):format(shape_str(W1.shape), C,
      shape_str(x.shape)), 2)
  end
  if #W2.shape ~= 2 or W2.shape[2] ~= H then
    error(('mlp: proj_weight has shape %s, expected {*,%d} (the rows of fc_weight)'):format(shape_str(W2.shape), H), 2)
  end
  local n_out = W2.shape[1]
  for _, b in ipairs({ { b1, H, 'fc_bias' }, { b2, n_out, 'proj_bias' } }) do
    if b[1] and (#b[1].shape ~= 1 or b[1].shape[1] ~= b[2]) then
      error(('mlp: %s has shape %s, expected {%d}'):format(b[3], shape_str(b[1].shape), b[2]), 2)
    end
  end
  local lead = 1
  for i = 1, nx - 1 do lead = lead * x.shape[i] end
  local oshape = x:size(); oshape[nx] = n_out
  if residual and (#residual.shape ~= nx or not O.same_shape(residual.shape, oshape)) then
    error(('mlp: residual has shape %s, expected %s'):format(shape_str(residual.shape), shape_str(oshape)), 2)
  end
  local xc = raw_contiguous(x)
  local x2 = xc:_as_strided({ lead, C }, { C, 1 }, xc:storage_offset())
  local opts = { dtype = x.dtype, device = x.device }
  -- the activation's input, kept for GELU's backward (ReLU²'s reads h)
  local pre = act == 'gelu' and Tensor.empty({ lead, H }, opts) or nil
  local h = Tensor.empty({ lead, H }, opts)    -- its output, the second product's input
  local W1t, W2t = raw_t(W1), raw_t(W2)
  if act == 'gelu' then
    G.check(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, h.c, x2.c, W1t.c, b1 and b1.c, pre.c), 2)
  else
    G.check(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, h.c, x2.c, W1t.c, b1 and b1.c, NULL), 2)
  end
  local out = Tensor.empty(oshape, opts)
  local out2 = out:_as_strided({ lead, n_out }, { n_out, 1 }, 0)
  if residual and not b2 then
    local rc = raw_contiguous(residual)
    local r2 = rc:_as_strided({ lead, n_out }, { n_out, 1 }, rc:storage_offset())
    G.check(lib.gl_matmul_add(out2.c, h.c, W2t.c, r2.c), 2)
    drop(r2); drop(rc, residual)
  else
    if b2 then G.check(lib.gl_matmul_bias(out2.c, h.c, W2t.c, b2.c), 2) else O.matmul_raw(h, W2t, out2, 0) end
    if residual then G.check(lib.gl_binary(lib.GL_B_ADD, out.c, out.c, residual.c), 2) end
  end
  drop(W1t); drop(W2t); drop(out2)
  local inputs = { x, W1, b1 or false, W2, b2 or false, residual or false }
  local rec_inputs, slot = {}, {}
  for i, t in ipairs(inputs) do if t then rec_inputs[#rec_inputs + 1] = t; slot[i] = #rec_inputs end end
  out = record(out, rec_inputs, function(_, g, node)
    local gc = raw_contiguous(g)
    local g2 = gc:_as_strided({ lead, n_out }, { n_out, 1 }, gc:storage_offset())
    local function want(t) return t and t.requires_grad and empty_like(t) or nil end
    local gb1 = want(b1)
    local need_pre = x.requires_grad or W1.requires_grad or (b1 and b1.requires_grad)
    local dpre = need_pre and empty_like(h) or nil
    local gelu = act == 'gelu'
    -- deferred (a zero-bubble pipeline's W): dW2, db2 and dW1 later, from
    -- g2, h, dpre and x2 (h and dpre through views: the node releases its
    -- own); db1 stays here, in the epilogue or pass that makes dpre
    local wants = {}
    for _, t in ipairs({ W1, W2, b2 or false }) do if t and t.requires_grad then wants[#wants + 1] = t end end
    local later = false
    if A.deferrable(wants, node) then
      local hv = h:_as_strided({ lead, H }, { H, 1 }, 0)
      local dv = dpre and dpre:_as_strided({ lead, H }, { H, 1 }, 0)
      later = A.defer(wants, function()
        local gW1, gW2, gb2 = want(W1), want(W2), want(b2)
        G.check(lib.gl_linear_backward(NULL, gW2 and gW2.c, gb2 and gb2.c, NULL, g2.c, hv.c, W2.c, NULL), 2)
        if gW1 then G.check(lib.gl_linear_backward(NULL, gW1.c, NULL, NULL, dv.c, x2.c, W1.c, NULL), 2) end
        drop(hv); drop(dv); drop(g2); drop(gc, g); drop(x2); drop(xc, x)
        local r = {}
        for _, t in ipairs({ { W1, gW1 }, { W2, gW2 }, { b2, gb2 } }) do if t[2] then r[#r + 1] = t[2] end end
        return unpack(r)
      end)
      if not later then drop(hv); drop(dv) end
    end
    local gW1 = not later and want(W1) or nil
    local gW2, gb2 = not later and want(W2) or nil, not later and want(b2) or nil
    -- second layer: dW2, db2, and the gradient of the activation's input
    -- (GELU' or ReLU²' from h, and db1, in the product's epilogue)
    if gelu then
      G.check(lib.gl_linear_backward(dpre and dpre.c, gW2 and gW2.c, gb2 and gb2.c, gb1 and gb1.c or NULL,
        g2.c, h.c, W2.c, pre.c), 2)
    else
      if gW2 or gb2 then G.check(lib.gl_linear_backward(NULL, gW2 and gW2.c, gb2 and gb2.c, NULL, g2.c, h.c, W2.c, NULL), 2) end
      if dpre then G.check(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dpre.c, g2.c, W2.c, gb1 and gb1.c, h.c), 2) end
    end
    local gx
    if dpre then  -- first layer: dx, dW1 (db1 is done)
      local rawx = x.requires_grad and empty_like(x2, { lead, C }) or nil
      if rawx or gW1 then
        G.check(lib.gl_linear_backward(rawx and rawx.c, gW1 and gW1.c, NULL, NULL, dpre.c, x2.c, W1.c, NULL), 2)
      end
      if rawx then
        gx = rawx:_as_strided(x.shape, Tensor.contiguous_strides(x.shape), 0)
        drop(rawx)
      end
      drop(dpre)
    end
    if not later then
      drop(g2); drop(gc, g)
      if not node.retaining then drop(x2); drop(xc, x) end
    end
    local grads = { gx, gW1, gb1, gW2, gb2, residual and residual.requires_grad and g or nil }
    local r = {}
    for i = 1, 6 do if slot[i] then r[slot[i]] = grads[i] end end
    return unpack(r, 1, #rec_inputs)
  end, { x2, W1, W2, pre, h }, 'mlp', pre and { pre, h } or { h })
  if not out.grad_fn then  -- nothing will read them
    if pre then Tensor.release(pre) end
    Tensor.release(h); drop(x2); drop(xc, x)
  end
  return out
end

return O
