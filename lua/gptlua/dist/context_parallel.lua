-- gptlua.dist.context_parallel — the sequence split over the mesh's cp
-- group, attention by Ulysses (DeepSpeed-Ulysses's all-to-all).
--
--   local CP = require 'gptlua.dist.context_parallel'
--   CP.parallelize(model, mesh.cp)       -- gpt2 or nanochat, in place
--
-- Layout (rank r of cp ranks): the model is whole on every rank; each
-- rank of a cp group reads the same rows and keeps the sequence's T/cp
-- consecutive positions [r*T/cp, (r+1)*T/cp) from the embedding on, so
-- norms, MLPs, residuals and the loss run on T/cp rows with no
-- communication.  Attention needs every earlier position: before it one
-- all-to-all turns (B, T/cp, all heads) into (B, T, H/cp heads) — rank j
-- gets heads j*H/cp.. of every rank's rows — the heads attend over the whole
-- causal sequence (gpt2's positions and nanochat's rotary tables are the
-- whole sequence's, so every position keeps its own), and a second
-- all-to-all returns (B, T/cp, all heads).  Backward runs the two in
-- reverse.  Heads (and KV heads) must divide by cp, and the sequence too.
-- The loss is the mean over the rank's rows; the parameters' gradients are
-- averaged over dp x cp by the data-parallel policy, which with the rows'
-- equal token counts is the gradient of the whole batch's mean.
--
-- Communication per micro-step and rank, per block: forward 2 all-to-alls
-- (q, k, v: 3 B T/cp C (cp-1)/cp elements out; the output: B T/cp C
-- (cp-1)/cp), backward the same again: 8 (cp-1)/cp B T/cp C elements per
-- block (nanochat with GQA: q + 2 KV heads' worth instead of 3C).
-- Forwards without gradients (evaluation, sampling) run whole on every rank.
--
-- Ring attention (K/V blocks passed around the ring, merged by log-sum-
-- exp) is not written yet: cp_mode = 'ulysses' is the only mode.
local gl = require 'gptlua'
local A = require 'gptlua.autograd'

local CP = {}

local function fail(msg) error('context parallel: ' .. msg, 0) end

-- (B, Tl, parts*W) rows of this rank -> (B, T, parts*W/n) heads of this
-- rank: chunk j of every part goes to rank j; rank i's rows come back in
-- rank order.
-- (through one (n, B, Tl, parts*w) buffer each way: chunk j of the send
-- buffer goes to rank j, chunk i of the receive buffer came from rank i)
local function exchange(send, comm)
  local recv = gl.empty(send.shape, { dtype = send.dtype, device = send.device })
  local counts = {}
  for i = 1, comm.size do counts[i] = send:numel() / comm.size end
  comm:all_to_all(recv, send, { send_counts = counts, recv_counts = counts })
  gl.Tensor.release(send)
  return recv
end

-- views hold their buffer's storage: released with it
local function release(list) for _, t in ipairs(list) do gl.Tensor.release(t) end end

local function to_heads(x, parts, comm)
  local n = comm.size
  local B, Tl, W = x.shape[1], x.shape[2], x.shape[3] / parts
  local w = W / n
  local send = gl.empty({ n, B, Tl, parts * w }, { dtype = x.dtype, device = x.device })
  for j = 0, n - 1 do
    local chunk = send:select(1, j + 1)
    for p = 0, parts - 1 do
      local dst, src = chunk:narrow(3, p * w + 1, w), x:narrow(3, p * W + j * w + 1, w)
      dst:copy_(src)
      release({ dst, src })
    end
    release({ chunk })
  end
  local recv = exchange(send, comm)
  local rows = {}
  for i = 1, n do rows[i] = recv:select(1, i) end
  local out = gl.cat(rows, 2)
  release(rows); release({ recv })
  return out
end

-- the inverse: (B, T, parts*W/n) heads -> (B, Tl, parts*W) rows
local function to_rows(y, parts, comm)
  local n = comm.size
  local B, Tl, w = y.shape[1], y.shape[2] / n, y.shape[3] / parts
  local send = gl.empty({ n, B, Tl, parts * w }, { dtype = y.dtype, device = y.device })
  for i = 0, n - 1 do
    local dst, src = send:select(1, i + 1), y:narrow(2, i * Tl + 1, Tl)
    dst:copy_(src)
    release({ dst, src })
  end
  local recv = exchange(send, comm)
  local rows, pieces = {}, {}
  for j = 1, n do rows[j] = recv:select(1, j) end
  for p = 0, parts - 1 do
    for j = 1, n do pieces[#pieces + 1] = rows[j]:narrow(3, p * w + 1, w) end
  end
  local out = gl.cat(pieces, 3)
  release(pieces); release(rows); release({ recv })
  return out
end

function CP.to_heads(x, parts, comm)
  local out = gl.no_grad(to_heads, x, parts, comm)
  return A.record(out, { x }, function(_, g) return to_rows(g, parts, comm) end, nil, 'cp_to_heads')
end

function CP.to_rows(y, parts, comm)
  local out = gl.no_grad(to_rows, y, parts, comm)
  return A.record(out, { y }, function(_, g) return to_heads(g, parts, comm) end, nil, 'cp_to_rows')
end

-- this rank's T/cp positions of a (B, T, ...) tensor (or (T, ...) with dim 1)
local function my_rows(layout, t, dim)
  local per = t.shape[dim] / layout.size
  return t:narrow(dim, layout.rank * per + 1, per)
end

-- whether this forward splits the sequence (decided at the embedding):
-- a forward that records gradients does, and needs T divisible by cp; one
-- without (evaluation, sampling with its KV caches) runs the whole sequence
-- on every rank, which computes the same
local function seq_mode(layout, T)
  local on = gl.is_grad_enabled()
  if on and T % layout.size ~= 0 then
    fail(('a sequence of %d tokens is not divisible by cp %d'):format(T, layout.size))
  end
  layout.seq_now = on
  return on
end

function CP.check(cfg, cp)
  local function divides(what, n)
    if n % cp ~= 0 then fail(('%s %d is not divisible by cp %d'):format(what, n, cp)) end
  end
  divides('n_head', cfg.n_head)
  if cfg.n_kv_head and cfg.n_kv_head ~= false then divides('n_kv_head', cfg.n_kv_head) end
  divides('block_size', cfg.block_size)
end

-- Splits model's sequence over comm (the mesh's cp group); returns the layout.
function CP.parallelize(model, comm)
  local cfg = model.config
  local name = getmetatable(model).__name
  if name ~= 'GPT2' and name ~= 'Nanochat' then
    fail(('parallelize knows the gpt2 and nanochat models, got %s'):format(tostring(name)))
  end
  if name == 'Nanochat' then require('gptlua.models.nanochat').check_layout(cfg, 'context parallelism') end
  CP.check(cfg, comm.size)
  local layout = { comm = comm, rank = comm.rank, size = comm.size, seq_now = false, model = model }
  local tr = model.transformer
  tr.wte.forward = function(self, ids)
    local e = gl.embedding(ids, self.weight)
    if seq_mode(layout, ids.shape[#ids.shape]) then e = my_rows(layout, e, 2) end
    return e
  end
  if name == 'GPT2' then
    tr.wpe.forward = function(self, pos)
      if layout.seq_now then pos = my_rows(layout, pos, 1) end
      return gl.embedding(pos, self.weight)
    end
  end
  for i = 1, tr.h.n do
    local attn = tr.h[i].attn
    local whole = getmetatable(attn).forward
    if name == 'GPT2' then
      attn.forward = function(self, x, cache)
        if cache or not layout.seq_now then return whole(self, x, cache) end
        local qkv = CP.to_heads(self.c_attn(x), 3, comm)          -- (B, T, 3C/cp)
        local y = gl.attention_qkv(qkv, self.n_head / comm.size)  -- (B, T, C/cp)
        return gl.dropout(self.c_proj(CP.to_rows(y, 1, comm)), self.dropout, self.training)
      end
    else
      attn.forward = function(self, x, cos, sin, cache)
        if cache or not layout.seq_now then return whole(self, x, cos, sin, cache) end
        local H, Hkv, D = self.H / comm.size, self.Hkv / comm.size, self.D
        local q = CP.to_heads(self.c_q(x), 1, comm)
        local B, T = q.shape[1], q.shape[2]
        local k = CP.to_heads(self.c_k(x), 1, comm):view(B, T, Hkv, D)
        local v = CP.to_heads(self.c_v(x), 1, comm):view(B, T, Hkv, D)
        q = q:view(B, T, H, D)
        q, k = gl.rms_norm(gl.rope(q, cos, sin), nil, 1e-6), gl.rms_norm(gl.rope(k, cos, sin), nil, 1e-6)
        local y = gl.scaled_dot_product_attention(q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3))
        y = y:transpose(2, 3):reshape(B, T, H * D)
        return self.c_proj(CP.to_rows(y, 1, comm))
      end
    end
  end
  -- the head: the loss over this rank's rows; sampling gathers the rows
  model.tp_head = function(x, targets, weight, softcap)
    local logits = gl.linear(x, weight)
    if targets == nil then
      if layout.seq_now then
        local list = {}
        for r = 1, comm.size do list[r] = gl.empty(logits.shape, { dtype = logits.dtype, device = logits.device }) end
        comm:all_gather(list, logits:contiguous())
        logits = gl.cat(list, 2)
      end
      if softcap and softcap > 0 then logits = gl.softcap(logits, softcap) end
      return logits, nil
    end
    if layout.seq_now then targets = my_rows(layout, targets, 2):contiguous() end
    return logits, gl.cross_entropy(logits, targets, { ignore_index = -1, softcap = softcap })
  end
  model.cp_layout = layout
  return layout
end

return CP
