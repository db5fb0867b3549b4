-- gptlua.ops_attention — differentiable attention and rotary embeddings:
-- scaled_dot_product_attention (causal, optional sliding window, GQA),
-- attention straight from a fused qkv projection, rope, and rope fused with
-- the QK RMSNorm after it.  Each is the
-- engine's attention kernel forward (keeping the log-sum-exp) plus its
-- backward kernel; functions land in gptlua.ops (gl.*).

local G = require 'gptlua.ffi'
local Tensor = require 'gptlua.tensor'
local A = require 'gptlua.autograd'
local O = require 'gptlua.ops'
local ffi, lib = G.ffi, G.lib
local record = A.record
local empty_like = O.empty_like

local function shape_str(s) return '{' .. table.concat(s, ',') .. '}' end
local raw_contiguous, drop = O.raw_contiguous, O.drop_view
local function stat_dtype(x) return x.dtype == 'float64' and 'float64' or 'float32' end

-- ---------------------------------------------------------------- attention
-- scaled_dot_product_attention(q, k, v, {scale=, window=}): causal,
-- q (B,H,T,D), k/v (B,Hkv,S,D); grouped-query when Hkv < H.  The kernels
-- take strided views, so nothing is copied: the output (and the input
-- gradients) are (B,H,T,D) views of (B,T,H,D) buffers, which makes the
-- usual transpose(2,3):reshape(B,T,C) that follows a free view.
local function heads_view(t)  -- (B,T,H,D) contiguous -> (B,H,T,D) view
  local B, T, H, D = t.shape[1], t.shape[2], t.shape[3], t.shape[4]
  return t:_as_strided({ B, H, T, D }, { T * H * D, D, H * D, 1 }, t:storage_offset())
end
local function heads_buffer(like)  -- a (B,T,H,D) buffer for a (B,H,T,D) tensor
  local s = like.shape
  local buf = Tensor.empty({ s[1], s[3], s[2], s[4] }, { dtype = like.dtype, device = like.device })
  local v = heads_view(buf)
  drop(buf)  -- the view now holds the only reference
  return v
end

local current_segments = nil  -- gl.with_segments's, while its function runs
-- with_segments(seg, f, ...): f(...) with every attention it runs masked by
-- the document (segment) ids seg (B, T) int, one per position: a query
-- sees a key only when both carry the same id, so packed documents never
-- attend across their boundaries (a packed batch's forward, without the
-- model passing them down; opts.segments gives them to one call).
-- Recomputing a block in backward (activation checkpointing) runs outside
-- f, so the two do not mix.
function O.with_segments(seg, f, ...)
  local prev = current_segments
  current_segments = seg
  local res = { pcall(f, ...) }
  current_segments = prev
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end
local function segments_of(opts)
  local seg = opts.segments or current_segments
  if seg and seg.dtype ~= 'int64' and seg.dtype ~= 'int32' then
    error(('attention: segments must be int32 or int64 ids, got %s'):format(seg.dtype), 3)
  end
  return seg
end

local function attention_raw(q, k, v, out, lse, scale, window, seg)
  if seg then G.check(lib.gl_attention_forward_seg(out.c, lse.c, q.c, k.c, v.c, seg.c, scale, window), 3)
  else G.check(lib.gl_attention_forward(out.c, lse.c, q.c, k.c, v.c, scale, window), 3) end
end
local function attention_backward_raw(dq, dk, dv, g, q, k, v, out, lse, scale, window, seg)
  if seg then G.check(lib.gl_attention_backward_seg(dq.c, dk.c, dv.c, g.c, q.c, k.c, v.c, out.c, lse.c, seg.c, scale, window), 3)
  else G.check(lib.gl_attention_backward(dq.c, dk.c, dv.c, g.c, q.c, k.c, v.c, out.c, lse.c, scale, window), 3) end
end

-- scaled_dot_product_attention(q, k, v, opts): causal softmax(q k^T * scale) v
-- per head; q (B,H,T,D), k/v (B,Hkv,S,D); opts.scale (1/sqrt(D)), opts.window,
-- opts.segments (B,S) document ids of the key positions (query t at
-- position S - T + t carries its position's)
function O.scaled_dot_product_attention(q, k, v, opts)
  opts = opts or {}
  local seg = segments_of(opts)
  if #q.shape ~= 4 then error(('scaled_dot_product_attention: q has shape %s, expected (B,H,T,D)'):format(shape_str(q.shape)), 2) end
  local scale = opts.scale or 1 / math.sqrt(q.shape[4])
  local window = opts.window or 0
  local out = heads_buffer(q)
  local lse = Tensor.empty({ q.shape[1], q.shape[2], q.shape[3] }, { dtype = stat_dtype(q), device = q.device })
  attention_raw(q, k, v, out, lse, scale, window, seg)
  return record(out, { q, k, v }, function(_, g)
    local dq, dk, dv = heads_buffer(q), heads_buffer(k), heads_buffer(v)
    attention_backward_raw(dq, dk, dv, g, q, k, v, out, lse, scale, window, seg)
    return dq, dk, dv
  end, { q, k, v, out, seg }, 'attention', { lse })
end

-- attention_qkv(qkv (B,T,3C), n_head, opts) -> y (B,T,C): causal attention
-- straight from the fused projection's output (GPT-2's c_attn) with no
-- split/transpose copies; the backward writes dq, dk, dv into one dqkv.
function O.attention_qkv(qkv, H, opts)
  opts = opts or {}
  local seg = segments_of(opts)
  local B, T, C3 = qkv.shape[1], qkv.shape[2], qkv.shape[3]
  if #qkv.shape ~= 3 or C3 % (3 * H) ~= 0 then
    error(('attention_qkv: qkv has shape %s, expected (B,T,3*C) with C divisible by n_head %d'):format(
      shape_str(qkv.shape), H), 2)
  end
  local C = C3 / 3
  local D = C / H
  local scale = opts.scale or 1 / math.sqrt(D)
  local window = opts.window or 0
  local x = qkv:is_contiguous() and qkv or qkv:contiguous()
  local function part(t, i)  -- (B,H,T,D) view of q, k or v inside a (B,T,3C) tensor
    return t:_as_strided({ B, H, T, D }, { T * C3, D, C3, 1 }, t:storage_offset() + (i - 1) * C)
  end
  local y = Tensor.empty({ B, T, C }, { dtype = qkv.dtype, device = qkv.device })
  local y4 = y:_as_strided({ B, T, H, D }, { T * C, H * D, D, 1 }, 0)
  local yv = heads_view(y4)
  drop(y4)
  local lse = Tensor.empty({ B, H, T }, { dtype = stat_dtype(qkv), device = qkv.device })
  local q, k, v = part(x, 1), part(x, 2), part(x, 3)
  attention_raw(q, k, v, yv, lse, scale, window, seg)
  drop(q); drop(k); drop(v)
  return record(y, { x }, function(_, g, node)
    local gc = raw_contiguous(g)
    local g4 = gc:_as_strided({ B, T, H, D }, { T * C, H * D, D, 1 }, gc:storage_offset())
    local gv = heads_view(g4)
    local dx = Tensor.empty(x.shape, { dtype = x.dtype, device = x.device })
    local v6 = { part(dx, 1), part(dx, 2), part(dx, 3), part(x, 1), part(x, 2), part(x, 3) }
    attention_backward_raw(v6[1], v6[2], v6[3], gv, v6[4], v6[5], v6[6], yv, lse, scale, window, seg)
    for _, t in ipairs(v6) do drop(t) end
    drop(gv); drop(g4); drop(gc, g)
    if not node.retaining then drop(yv) end
    return dx
  end, { x, y, seg }, 'attention_qkv', { lse })
end

-- rotary embedding on x (B, T, H, D) with cos/sin (T, D/2)
function O.rope(x, cos, sin)
  local xc = x:is_contiguous() and x or x:contiguous()
  local out = empty_like(xc)
  G.check(lib.gl_rope(out.c, xc.c, cos.c, sin.c, 0), 2)
  return record(out, { xc }, function(_, g)
    local dx = empty_like(xc)
    local gc = g:is_contiguous() and g or g:contiguous()
    G.check(lib.gl_rope(dx.c, gc.c, cos.c, sin.c, 1), 2)
    return dx
  end, { cos, sin }, 'rope')
end

-- rope_rms_norm(x, cos, sin, eps): rms_norm(rope(x, cos, sin), nil, eps)
-- as one op (nanochat's QK-norm after the rotary embedding): one pass each
-- way on a GPU instead of two (gl_rope_rmsnorm_forward / _backward; the
-- rotation keeps each row's sum of squares, so the statistics are x's own).
-- x (B, T, H, D) in any layout; the backward keeps x and the per-row rstd.
function O.rope_rms_norm(x, cos, sin, eps)
  eps = eps or 1e-6
  local y = empty_like(x)
  local s = x.shape
  local rstd = Tensor.empty({ s[1], s[2], s[3] }, { dtype = stat_dtype(x), device = x.device })
  G.check(lib.gl_rope_rmsnorm_forward(y.c, rstd.c, x.c, cos.c, sin.c, eps), 2)
  return record(y, { x }, function(_, g)
    local dx = empty_like(x)
    G.check(lib.gl_rope_rmsnorm_backward(dx.c, g.c, x.c, cos.c, sin.c, rstd.c), 2)
    return dx
  end, { x, cos, sin }, 'rope_rms_norm', { rstd })
end


return O
