-- gptlua.dist.ring_attention — causal attention over a sequence split in
-- zig-zag chunks across a ring of ranks (context parallel, cp_mode 'ring').
--
--   local y = RA.attention(q, k, v, comm)   -- (B, H, Tl, D) views, as gl.scaled_dot_product_attention
--
-- Layout: the sequence of T = 2 n c positions (n ranks) is cut in 2n chunks
-- of c; rank r holds chunks r and 2n-1-r, in that order (RA.rows), so every
-- rank has as much causal work: chunk r sees r+1 chunks, chunk 2n-1-r
-- 2n-r, 2n+1 in all.  Its q, k, v are (B, H|Hkv, 2c, D): grouped-query
-- heads (Hkv < H) pass around the ring at their own size.
--
-- Forward: n steps; at step s the rank holds the K/V block of rank
-- src = r - s (mod n) and sends it on to r+1 while it attends (an async
-- send/recv pair, waited after the step's kernels: the transfer hides
-- behind the compute).  Which (query chunk, key chunk) pairs are visible:
--   s = 0     its own block: the two local chunks in increasing order, so
--             plain causal attention over the 2c rows
--   src < r   both query chunks see chunk src whole, neither sees
--             2n-1-src: every query over the first c keys, unmasked
--   src > r   chunk r sees neither; chunk 2n-1-r sees both whole: the
--             second c queries over all 2c keys, unmasked
-- Each block's kernel (gl_attention_forward; window < 0 is unmasked)
-- returns its out and log-sum-exp; they merge into the running pair:
-- lse = log(e^lse_a + e^lse_b), out = out_a e^(lse_a-lse) + out_b
-- e^(lse_b-lse), accumulated in float32 (float64 for float64).
--
-- Backward: the same n steps with the merged out and lse (the kernels'
-- backward takes Di = rowsum(dout * out) and P = exp(s - lse), so a block
-- gives its part of the whole attention's gradients): dQ accumulates
-- locally; each block's dK/dV accumulator travels with it, one hop behind
-- (received for the block it arrived with, added to, sent on), and after n
-- hops it is home.  K/V move n-1 hops in each direction of the step.
--
-- Bytes per rank per layer and micro-step: forward (n-1) K/V blocks,
-- backward (n-1) K/V blocks and n dK/dV blocks (float32 unless float64),
-- a block being 2 B Hkv 2c D elements (counted by recipes/tools/bench_parallel.lua
-- in the communicator and by the planner's fake world: spec/plan_spec.lua).
-- A sliding window is refused (its visible pairs would need a per-block
-- offset the kernels do not take).  The merges and the accumulators'
-- conversions allocate per block (small next to the kernels' work; a GPU
-- step would want them fused into the attention kernel's epilogue).
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local G = require 'gptlua.ffi'
local Tensor = gl.Tensor
local lib = G.lib

local RA = {}

local function fail(msg) error('ring attention: ' .. msg, 0) end
local function stat_dtype(x) return x.dtype == 'float64' and 'float64' or 'float32' end
local function release(list) for _, t in pairs(list) do Tensor.release(t) end end  -- (nils skipped)

-- The positions rank r of n holds, as (start, length) pairs of a sequence
-- of T: chunks r and 2n-1-r of 2n.
function RA.rows(T, r, n)
  local c = T / (2 * n)
  return { { r * c, c }, { (2 * n - 1 - r) * c, c } }
end

-- rank r's positions of t along dim (a (B, T, ...) tensor, or (T, ...)
-- with dim 1), in the ring's order; differentiable (narrow + cat)
function RA.my_rows(t, dim, r, n)
  local parts = {}
  for i, p in ipairs(RA.rows(t.shape[dim], r, n)) do parts[i] = t:narrow(dim, p[1] + 1, p[2]) end
  return gl.cat(parts, dim)
end

-- (B, H, T, D) view of a fresh (B, T, H, D) buffer, as the kernels write
local function heads_buffer(B, H, T, D, dtype, device)
  local buf = Tensor.empty({ B, T, H, D }, { dtype = dtype, device = device })
  local view = buf:transpose(2, 3)
  require('gptlua.ops').drop_view(buf)  -- the view now holds the only reference
  return view
end

-- the block computed at a step: which query rows (first, count) against
-- which keys (first, count) of the block held, masked or not
local function block(step_src, r, c)
  if step_src == r then return 0, 2 * c, 0, 2 * c, 0 end
  if step_src < r then return 0, 2 * c, 0, c, -1 end
  return c, c, 0, 2 * c, -1
end

-- the K/V block travels as one contiguous (2, B, Hkv, 2c, D) buffer
local function pack_kv(k, v)
  local s = k.shape
  local buf = gl.empty({ 2, s[1], s[2], s[3], s[4] }, { dtype = k.dtype, device = k.device })
  for i, t in ipairs({ k, v }) do
    local dst = buf:select(1, i)
    dst:copy_(t)
    Tensor.release(dst)
  end
  return buf
end

-- (first, count) rows of the K and V halves of a packed buffer
local function kv_rows(buf, first, count)
  local k, v = buf:select(1, 1), buf:select(1, 2)
  local kk, vv = k:narrow(3, first + 1, count), v:narrow(3, first + 1, count)
  release({ k, v })
  return kk, vv
end

-- the ring's neighbours' exchange: send `send` to r+1, receive `recv` from r-1
local function shift(comm, send, recv)
  local n, r = comm.size, comm.rank
  local a = comm:send_async(send, (r + 1) % n)
  local b = comm:recv_async(recv, (r - 1) % n)
  return { a, b }
end
local function wait(works) for _, w in ipairs(works or {}) do w:wait() end end

-- out_a, lse_a (the running pair, float32 / float64) merged with a block's
-- out_b (the kernel's dtype), lse_b, in place over the same rows
local function merge(out_a, lse_a, out_b, lse_b)
  local ob = out_b.dtype == out_a.dtype and out_b or out_b:to(out_a.dtype)
  local m = gl.maximum(lse_a, lse_b)
  local lse = m + gl.log(gl.exp(lse_a - m) + gl.exp(lse_b - m))
  local wa, wb = gl.exp(lse_a - lse):unsqueeze(4), gl.exp(lse_b - lse):unsqueeze(4)
  out_a:mul_(wa)
  out_a:add_(ob * wb)
  lse_a:copy_(lse)
  release({ m, lse, wa, wb })
  if ob ~= out_b then Tensor.release(ob) end
end

local function forward(q, k, v, comm, scale)
  local B, H, Tl, D = q.shape[1], q.shape[2], q.shape[3], q.shape[4]
  local n, r, c = comm.size, comm.rank, Tl / 2
  local sdt = stat_dtype(q)
  local acc = gl.zeros({ B, H, Tl, D }, { dtype = sdt, device = q.device })
  local lse = gl.empty({ B, H, Tl }, { dtype = sdt, device = q.device })
  local cur = pack_kv(k, v)
  local nxt = n > 1 and gl.empty(cur.shape, { dtype = cur.dtype, device = cur.device }) or nil
  for s = 0, n - 1 do
    local src = (r - s) % n
    local works = s < n - 1 and shift(comm, cur, nxt) or nil
    local q0, qn, k0, kn, window = block(src, r, c)
    local qb = q:narrow(3, q0 + 1, qn)
    local kb, vb = kv_rows(cur, k0, kn)
    local ob = heads_buffer(B, H, qn, D, q.dtype, q.device)
    local lb = gl.empty({ B, H, qn }, { dtype = sdt, device = q.device })
    G.check(lib.gl_attention_forward(ob.c, lb.c, qb.c, kb.c, vb.c, scale, window), 2)
    local acc_b, lse_b = acc:narrow(3, q0 + 1, qn), lse:narrow(3, q0 + 1, qn)
    if s == 0 then acc_b:copy_(ob); lse_b:copy_(lb) else merge(acc_b, lse_b, ob, lb) end
    release({ qb, kb, vb, ob, lb, acc_b, lse_b })
    wait(works)
    cur, nxt = nxt, cur
  end
  release({ cur, nxt })
  local out = heads_buffer(B, H, Tl, D, q.dtype, q.device)
  out:copy_(acc)
  Tensor.release(acc)
  return out, lse
end

local function backward(g, q, k, v, out, lse, comm, scale)
  local B, H, Tl, D = q.shape[1], q.shape[2], q.shape[3], q.shape[4]
  local Hkv = k.shape[2]
  local n, r, c = comm.size, comm.rank, Tl / 2
  local sdt = stat_dtype(q)
  local opts = { dtype = sdt, device = q.device }
  local dq = gl.zeros({ B, H, Tl, D }, opts)
  local cur = pack_kv(k, v)
  local nxt = n > 1 and gl.empty(cur.shape, { dtype = cur.dtype, device = cur.device }) or nil
  -- the dK/dV accumulators: the one of the block held, and the one on its way in
  local dcur = gl.empty({ 2, B, Hkv, Tl, D }, opts)
  local dnxt = n > 1 and gl.empty(dcur.shape, opts) or nil
  local dsend, drecv  -- the accumulator sends / receives in flight
  for s = 0, n - 1 do
    local src = (r - s) % n
    local works = s < n - 1 and shift(comm, cur, nxt) or nil
    local q0, qn, k0, kn, window = block(src, r, c)
    local qb, gb, ob, lb = q:narrow(3, q0 + 1, qn), g:narrow(3, q0 + 1, qn), out:narrow(3, q0 + 1, qn),
      lse:narrow(3, q0 + 1, qn)
    local kb, vb = kv_rows(cur, k0, kn)
    local dqb = heads_buffer(B, H, qn, D, q.dtype, q.device)
    local dkb, dvb = heads_buffer(B, Hkv, kn, D, q.dtype, q.device), heads_buffer(B, Hkv, kn, D, q.dtype, q.device)
    G.check(lib.gl_attention_backward(dqb.c, dkb.c, dvb.c, gb.c, qb.c, kb.c, vb.c, ob.c, lb.c, scale, window), 2)
    local dq_b = dq:narrow(3, q0 + 1, qn)
    dq_b:add_(dqb.dtype == sdt and dqb or dqb:to(sdt))
    -- this block's accumulator: arrived from r-1 (s > 0), or fresh
    if s > 0 then wait(drecv); dcur, dnxt = dnxt, dcur else dcur:zero_() end
    local dk_acc, dv_acc = kv_rows(dcur, k0, kn)
    dk_acc:add_(dkb.dtype == sdt and dkb or dkb:to(sdt))
    dv_acc:add_(dvb.dtype == sdt and dvb or dvb:to(sdt))
    release({ qb, gb, ob, lb, kb, vb, dqb, dkb, dvb, dq_b, dk_acc, dv_acc })
    if n > 1 then
      wait(dsend)  -- dnxt was the previous step's accumulator, on its way out
      local w = shift(comm, dcur, dnxt)
      dsend, drecv = { w[1] }, { w[2] }
    end
    wait(works)
    cur, nxt = nxt, cur
  end
  -- after n hops this rank's own block's accumulator is home
  wait(dsend); wait(drecv)
  local home = n > 1 and dnxt or dcur
  local dk, dv = heads_buffer(B, Hkv, Tl, D, q.dtype, q.device), heads_buffer(B, Hkv, Tl, D, q.dtype, q.device)
  local hk, hv = home:select(1, 1), home:select(1, 2)
  dk:copy_(hk); dv:copy_(hv)
  local dqo = heads_buffer(B, H, Tl, D, q.dtype, q.device)
  dqo:copy_(dq)
  release({ hk, hv, cur, nxt, dcur, dnxt, dq })
  return dqo, dk, dv
end

-- Causal attention of this rank's rows (q (B, H, 2c, D), k/v (B, Hkv, 2c,
-- D): the zig-zag chunks of RA.rows) against the whole sequence's keys, over
-- comm (the mesh's cp group).  opts.scale (1/sqrt(D)); opts.window refused.
function RA.attention(q, k, v, comm, opts)
  opts = opts or {}
  if opts.window and opts.window > 0 then
    fail(('a sliding window (%d) is not supported'):format(opts.window))
  end
  if q.shape[3] % 2 ~= 0 then fail(('a rank holds two chunks of equal length, got %d rows'):format(q.shape[3])) end
  local scale = opts.scale or 1 / math.sqrt(q.shape[4])
  local out, lse = gl.no_grad(forward, q, k, v, comm, scale)
  return A.record(out, { q, k, v }, function(_, g)
    return backward(g, q, k, v, out, lse, comm, scale)
  end, { q, k, v, out }, 'ring_attention', { lse })
end

return RA
