-- gptlua.dist.context_parallel — the sequence split over the mesh's cp
-- group, attention by Ulysses (DeepSpeed-Ulysses's all-to-all) or by ring
-- attention (gptlua.dist.ring_attention).
--
--   local CP = require 'gptlua.dist.context_parallel'
--   CP.parallelize(model, mesh.cp, {mode = 'ulysses' | 'ring'})  -- gpt2 or nanochat, in place
--
-- Ring (mode 'ring'): each rank keeps the zig-zag chunks r and 2cp-1-r of
-- the sequence (2cp chunks, so causal work balances; RA.rows), from the
-- token ids on (so the embedding, gpt2's positions, nanochat's rotary
-- rows and the targets are those positions'); attention passes K/V blocks
-- around the cp ring (see ring_attention.lua), so heads need not divide
-- by cp; the sequence must divide by 2 cp.  Composes with tensor
-- parallelism (applied after TP.parallelize: the embedding, positions
-- and head keep TP's forwards and get this rank's rows; attention's
-- projections are TP's, its heads H/tp).
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
-- nanochat v2: the value embeddings look up the rank's rows as the token
-- embedding does and join v before the all-to-all (Ulysses) or the ring;
-- Ulysses attends over the whole sequence, so sliding windows work as on
-- one rank, while ring attention refuses them (its blocks would need a
-- per-block window offset the kernels do not take: window_pattern 'L'
-- runs); the smear's first row of each of the rank's segments (one for
-- Ulysses, the two zig-zag chunks for ring) reads the position before it
-- from the rank that holds it (TP.shifted); lambdas and backout are
-- per-row.  Not composed with sequence parallelism (sp) yet.
--
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local RA = require 'gptlua.dist.ring_attention'
local TP = require 'gptlua.dist.tensor_parallel'
local common = require 'gptlua.models.common'

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

-- this rank's T/cp positions of a (B, T, ...) tensor (or (T, ...) with
-- dim 1): consecutive (Ulysses) or the two zig-zag chunks (ring)
local function my_rows(layout, t, dim)
  if layout.mode == 'ring' then return RA.my_rows(t, dim, layout.rank, layout.size) end
  local per = t.shape[dim] / layout.size
  return t:narrow(dim, layout.rank * per + 1, per)
end

-- the whole sequence's rows from every rank's (B, Tl, ...) rows (collective)
local function all_rows(layout, x)
  local comm, list = layout.comm, {}
  for r = 1, comm.size do list[r] = gl.empty(x.shape, { dtype = x.dtype, device = x.device }) end
  comm:all_gather(list, x:contiguous())
  if layout.mode ~= 'ring' then return gl.cat(list, 2) end
  local n, c = comm.size, x.shape[2] / 2
  local chunks = {}
  for j = 0, 2 * n - 1 do  -- chunk j: rank j's first, or rank 2n-1-j's second
    chunks[j + 1] = j < n and list[j + 1]:narrow(2, 1, c) or list[2 * n - j]:narrow(2, c + 1, c)
  end
  return gl.cat(chunks, 2)
end

-- whether this forward splits the sequence (decided at the embedding):
-- a forward that records gradients does, and needs T divisible by cp; one
-- without (evaluation, sampling with its KV caches) runs the whole sequence
-- on every rank, which computes the same
local function seq_mode(layout, T)
  local on = gl.is_grad_enabled()
  local parts = layout.mode == 'ring' and 2 * layout.size or layout.size
  if on and T % parts ~= 0 then
    fail(('a sequence of %d tokens is not divisible by %s %d'):format(T,
      layout.mode == 'ring' and '2 x cp' or 'cp', parts))
  end
  layout.seq_now = on
  return on
end
CP.seq_mode = seq_mode  -- (a pipeline stage without the embedding decides it so: policies/pp.lua)

-- mode 'ulysses' (default) or 'ring'; tp: the heads are cut over tp first
function CP.check(cfg, cp, mode, tp)
  mode, tp = mode or 'ulysses', tp or 1
  if mode ~= 'ulysses' and mode ~= 'ring' then
    fail(("cp_mode expected 'ulysses' or 'ring', got %s"):format(tostring(mode)))
  end
  local function divides(what, n, by, by_what)
    if n % by ~= 0 then fail(('%s %d is not divisible by %s %d'):format(what, n, by_what, by)) end
  end
  local heads = tp > 1 and 'n_head / tp' or 'n_head'
  if mode == 'ulysses' then
    divides(heads, cfg.n_head / tp, cp, 'cp')
    if cfg.n_kv_head and cfg.n_kv_head ~= false then
      divides(tp > 1 and 'n_kv_head / tp' or 'n_kv_head', cfg.n_kv_head / tp, cp, 'cp')
    end
    divides('block_size', cfg.block_size, cp, 'cp')
  else
    divides('block_size', cfg.block_size, 2 * cp, '2 x cp')
  end
  if (cfg.window or 0) > 0 or (cfg.sliding_window or 0) > 0 then
    fail('a sliding window is not supported with context parallelism')
  end
end

-- nanochat's features against cp's mode (cfg: the model's resolved config;
-- sp: tp's sequence parallelism is on)
function CP.check_nanochat(cfg, mode, sp)
  if mode == 'ring' then
    local nanochat = require 'gptlua.models.nanochat'
    for i = 1, cfg.n_layer do
      local left = nanochat.window_left(cfg, i)
      if left < cfg.block_size then
        fail(("ring attention does not take nanochat's sliding windows (layer %d sees %d keys); use cp_mode "
          .. "'ulysses' or nanochat.window_pattern = 'L'"):format(i, left + 1))
      end
    end
  end
  if cfg.smear and sp then fail("nanochat's smear with sequence parallelism (sp) is not composed yet") end
end

-- the runs {first, length} of runs (in order) that hold their rows [from, from + len)
function CP.sub_runs(runs, from, len)
  local out, at = {}, 0
  for _, r in ipairs(runs) do
    local lo, hi = math.max(from, at), math.min(from + len, at + r[2])
    if lo < hi then out[#out + 1] = { r[1] + lo - at, hi - lo } end
    at = at + r[2]
  end
  return out
end

-- Splits model's sequence over comm (the mesh's cp group); opts.mode
-- 'ulysses' (default) or 'ring'.  A model already cut by
-- TP.parallelize keeps its tp forwards (embedding, positions, head, the
-- attention's projections) inside these.  Returns the layout.
function CP.parallelize(model, comm, opts)
  local cfg = model.config
  local name = getmetatable(model).__name
  if name ~= 'GPT2' and name ~= 'Nanochat' then
    fail(('parallelize knows the gpt2 and nanochat models, got %s'):format(tostring(name)))
  end
  local mode = opts and opts.mode or 'ulysses'
  local tp = model.tp_layout and model.tp_layout.size or 1
  CP.check(cfg, comm.size, mode, tp)
  if name == 'Nanochat' then  -- nanochat v2's features (see the nanochat part below)
    CP.check_nanochat(cfg, mode, model.tp_layout and model.tp_layout.sequence_parallel)
  end
  local layout = { comm = comm, rank = comm.rank, size = comm.size, seq_now = false, model = model, mode = mode }
  local tr = model.transformer
  -- (the forwards in place before: the module's own, or tensor parallel's)
  local function forward_of(m) return rawget(m, 'forward') or getmetatable(m).forward end
  local wte_forward = forward_of(tr.wte)
  tr.wte.forward = function(self, ids)
    if seq_mode(layout, ids.shape[#ids.shape]) then ids = my_rows(layout, ids, 2):contiguous() end
    return wte_forward(self, ids)
  end
  if name == 'GPT2' then
    local wpe_forward = forward_of(tr.wpe)
    tr.wpe.forward = function(self, pos)
      if layout.seq_now then pos = my_rows(layout, pos, 1):contiguous() end
      return wpe_forward(self, pos)
    end
  end
  local ring = mode == 'ring'
  -- the FP8 policy's layers (gptlua.fp8) see this rank's tokens: their
  -- scales over the tokens are max-reduced over comm (gptlua.ops_fp8)
  local function tokens_now() return layout.seq_now and comm or nil end
  for _, m in ipairs(model:modules()) do
    if m.fp8 then m.fp8_tokens = tokens_now end
  end
  -- nanochat v2: the value embeddings look up this rank's rows as the
  -- token embedding does; the smear's first row of each of this rank's
  -- segments reads the previous position from the rank that holds it
  -- (TP.shifted: the segments' last rows all-gathered, B x 2 x C for ring,
  -- B x C for Ulysses, per rank; backward reduce-scatters them)
  if name == 'Nanochat' and model.value_embeds then
    for _, np in ipairs(model.value_embeds:named_parameters()) do
      local emb = model.value_embeds[np[1]:match('^(.*)%.weight$')]
      local emb_forward = forward_of(emb)
      emb.forward = function(self, ids)
        if layout.seq_now then ids = my_rows(layout, ids, 2):contiguous() end
        return emb_forward(self, ids)
      end
    end
  end
  if name == 'Nanochat' and cfg.smear then
    local smear = rawget(model, 'smear') or getmetatable(model).smear
    model.smear = function(self, x, caches)
      if not layout.seq_now then return smear(self, x, caches) end
      local n, Tl = comm.size, x.shape[2]
      local function segments(r)
        if ring then return RA.rows(n * Tl, r, n) end
        return { { r * Tl, Tl } }
      end
      return self:smear_shifted(x, TP.shifted(x, comm, segments))
    end
  end
  for i = 1, tr.h.n do
    local attn = tr.h[i].attn
    local whole = getmetatable(attn).forward
    if name == 'GPT2' then
      attn.forward = function(self, x, cache)
        if cache or not layout.seq_now then return whole(self, x, cache) end
        local y
        if ring then
          local qkv = self.c_attn(x)                               -- (B, Tl, 3C)
          local B, T, C = qkv.shape[1], qkv.shape[2], qkv.shape[3] / 3
          local H = self.n_head
          local function heads(j) return qkv:narrow(3, (j - 1) * C + 1, C):reshape(B, T, H, C / H):transpose(2, 3) end
          y = RA.attention(heads(1), heads(2), heads(3), comm):transpose(2, 3):reshape(B, T, C)
        else
          local qkv = CP.to_heads(self.c_attn(x), 3, comm)          -- (B, T, 3C/cp)
          y = CP.to_rows(gl.attention_qkv(qkv, self.n_head / comm.size), 1, comm)  -- (B, T/cp, C)
        end
        return gl.dropout(self.c_proj(y), self.dropout, self.training)
      end
    else
      -- (ve: this layer's value embedding of this rank's rows, or nil; eps the QK-norm's)
      attn.forward = function(self, x, cos, sin, cache, ve, eps, residual)
        if cache or not layout.seq_now then return whole(self, x, cos, sin, cache, ve, eps, residual) end
        local D = self.D
        eps = eps or 1e-6
        local sdpa_opts = { scale = self.scale, window = self.window }
        if ring then
          local H, Hkv = self.H, self.Hkv
          local q = self.c_q(x)
          local B, T = q.shape[1], q.shape[2]
          q = q:view(B, T, H, D)
          local k, v = self.c_k(x):view(B, T, Hkv, D), self:value(x, ve, B, T)
          cos, sin = my_rows(layout, cos, 1):contiguous(), my_rows(layout, sin, 1):contiguous()
          q, k = gl.rope_rms_norm(q, cos, sin, eps), gl.rope_rms_norm(k, cos, sin, eps)
          local y = RA.attention(q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3), comm, { scale = self.scale })
          return common.linear(self.c_proj, y:transpose(2, 3):reshape(B, T, H * D), residual)
        end
        local H, Hkv = self.H / comm.size, self.Hkv / comm.size
        local qr = self.c_q(x)
        local Bl, Tl = qr.shape[1], qr.shape[2]   -- (the cp rank's rows: under sp the projections gathered x's)
        local q = CP.to_heads(qr, 1, comm)
        local B, T = q.shape[1], q.shape[2]
        local k = CP.to_heads(self.c_k(x), 1, comm):view(B, T, Hkv, D)
        -- the values with their value residual on this rank's rows, then to heads
        local v = CP.to_heads(self:value(x, ve, Bl, Tl):view(Bl, Tl, self.Hkv * D), 1, comm):view(B, T, Hkv, D)
        q = q:view(B, T, H, D)
        q, k = gl.rope_rms_norm(q, cos, sin, eps), gl.rope_rms_norm(k, cos, sin, eps)
        local y = gl.scaled_dot_product_attention(q:transpose(2, 3), k:transpose(2, 3), v:transpose(2, 3), sdpa_opts)
        y = y:transpose(2, 3):reshape(B, T, H * D)
        return common.linear(self.c_proj, CP.to_rows(y, 1, comm), residual)
      end
    end
  end
  -- the head: the loss over this rank's rows (tensor parallel's vocabulary-
  -- parallel one when the model is cut); sampling gathers the rows
  local tp_head = model.tp_head
  model.tp_head = function(x, targets, weight, softcap)
    if targets == nil then
      local logits
      if tp_head then logits = tp_head(x, nil, weight, nil) else logits = gl.linear(x, weight) end
      if layout.seq_now then logits = all_rows(layout, logits) end
      if softcap and softcap > 0 then logits = gl.softcap(logits, softcap) end
      return logits, nil
    end
    if layout.seq_now then targets = my_rows(layout, targets, 2):contiguous() end
    if tp_head then return tp_head(x, targets, weight, softcap) end
    local logits = gl.linear(x, weight)
    return logits, gl.cross_entropy(logits, targets, { ignore_index = -1, softcap = softcap })
  end
  -- mixture-of-experts layers route this rank's rows, what they compute
  -- over the micro-batch reduced over cp (gptlua.moe's split sequence);
  -- under tp's sp too, over the cp x tp ranks (opts.sequence_group, rank
  -- c tp + t: tp rank t holds the t-th T/(cp tp) rows of cp rank c's)
  local function cp_runs(r, Tc)
    if ring then return RA.rows(comm.size * Tc, r, comm.size) end
    return { { r * Tc, Tc } }
  end
  local tpl = model.tp_layout
  if tpl and tpl.sequence_parallel and #require('gptlua.moe').layers(model) > 0 then
    local group = opts and opts.sequence_group
    if not group then fail('mixture-of-experts layers under sp need opts.sequence_group (the cp x tp ranks)') end
    local tp = tpl.size
    require('gptlua.moe').split_tokens(model, group, function() return layout.seq_now and tpl.seq_now end,
      function(q, Tl) return CP.sub_runs(cp_runs(math.floor(q / tp), Tl * tp), (q % tp) * Tl, Tl) end, tp)
  else
    require('gptlua.moe').split_tokens(model, comm, function() return layout.seq_now end, cp_runs, 1)
  end
  model.cp_layout = layout
  return layout
end

return CP
