-- gptlua.dist.tensor_parallel — Megatron-style tensor parallelism over the
-- mesh's tp group: one layer's matrices split over tp ranks.
--
--   local TP = require 'gptlua.dist.tensor_parallel'
--   local layout = TP.parallelize(model, mesh.tp)   -- gpt2 or nanochat, in place
--
-- Layout (rank r of tp ranks; the model is built whole with the run's seed
-- on every rank and then cut, so its weights are exactly one rank's):
--   attention   column-parallel q, k, v (heads r*H/tp .. ; KV heads
--               r*Hkv/tp .. under GQA; gpt2's fused c_attn is cut per q, k
--               and v block): each rank attends with its own heads, and
--               nanochat's QK-norm and rotary act per head, so per shard
--   attn proj   row-parallel: input columns of those heads; bias added once
--               after the all-reduce
--   MLP         column-parallel up (c_fc: 4C/tp rows), row-parallel down
--   embedding   vocabulary-parallel: rows [r*V/tp, (r+1)*V/tp); a token
--               outside the shard looks up zeros, the all-reduce sums
--   head        vocabulary-parallel cross-entropy on the V/tp logits of the
--               shard: max and sum-exp all-reduced (and the target's logit),
--               logits never gathered (gpt2's head is tied to the embedding
--               shard).  Without targets (sampling) the logits are gathered.
--   the rest    (norms, position embedding, row-parallel biases) replicated:
--               their inputs and output gradients are the same on every tp
--               rank, so their gradients are too and need no communication
--   nanochat v2 value embeddings (V, Hkv D) cut by columns, the KV heads of
--               the rank's c_v (looked up from every position's id: no
--               communication); their gates (one per KV head, reading
--               x[..., :12]) column-parallel; the vocabulary's padded rows
--               cut with the head and masked out of the loss (-1e30 added to
--               their logits); lambdas, smear and backout act on the
--               replicated residual stream (under sp on the shard, their
--               gradients summed as the norms' are; the smear's first row
--               reads the previous shard's last: TP.shifted, B C per rank)
--   vocabulary  the trainer pads it to a multiple of tp (the models'
--               pad_vocab_for_tp; Megatron-LM's make_vocab_size_divisible_by):
--               the padded rows are masked out of the loss as v2's are,
--               never sampled (the gathered logits are cut to vocab_size),
--               and left out of checkpoints (full_state keeps the stored
--               rows, local_state pads them with zeros again), so a
--               checkpoint loads under any tp, none included
--
-- Two autograd functions carry the communication (Megatron's f and g):
--   copy_to     identity forward; backward all-reduces the input gradient
--               (each rank's column shard contributed part of it)
--   reduce_from all-reduce forward (partial sums of a row-parallel product);
--               identity backward
-- Per block and micro-step: forward two all-reduces (attention, MLP) of
-- B*T*C elements each, backward two more, so 4 * 2(tp-1)/tp * B*T*C
-- elements sent per rank; embedding and head add one B*T*C all-reduce
-- forward and one backward, and the loss three of B*T numbers.  Sequence
-- parallel turns each all-reduce into an all-gather + reduce-scatter pair
-- (the same volume) and gathers each column-parallel input once more in
-- backward (it keeps only the T/tp shard: gathered_linear), (2L + 1)
-- (tp-1)/tp * B*T*C more elements.
--
-- The layout records, for every parameter cut, the dimension and the number
-- of blocks it was cut in (gpt2's c_attn: 3, q|k|v), so checkpoints gather
-- full tensors (TP.gather) and any tp size can cut them again (TP.slice).
local gl = require 'gptlua'
local A = require 'gptlua.autograd'
local G = require 'gptlua.ffi'
local Tensor = gl.Tensor

local TP = {}

-- The step's collectives are issued in their async form and waited for by
-- Work:wait(): over NCCL the compute stream waits for the collective's
-- event on the device and the host goes on queueing the step (issue 13;
-- dist.device_waits = false makes that wait the host's, to count what it
-- saves: recipes/tools/host_syncs.lua --policies=tp); over MPI (CPU
-- tensors) the host blocks, as the blocking form does.
local function waited(comm, name, ...) return comm[name .. '_async'](comm, ...):wait() end

local function fail(msg) error('tensor parallel: ' .. msg, 0) end

-- ------------------------------------------------------- f and g --
-- identity forward; backward: the gradient summed over the tp group
function TP.copy_to(x, comm)
  if comm.size == 1 then return x end
  local out = x:detach()
  return A.record(out, { x }, function(_, g)
    local r = g:contiguous():clone()
    waited(comm, 'all_reduce', r, 'sum')
    return r
  end, nil, 'tp_copy_to')
end

-- forward: x summed over the tp group; backward: identity
function TP.reduce_from(x, comm)
  if comm.size == 1 then return x end
  local out = gl.no_grad(function() return x:contiguous():clone() end)
  waited(comm, 'all_reduce', out, 'sum')
  return A.record(out, { x }, function(_, g) return g end, nil, 'tp_reduce_from')
end

-- Sequence parallel's pair, along dim 2 (T) of (B, T, C) activations:
--   gather_seq   forward all-gathers the T/tp shards; backward
--                reduce-scatters the gradient (sums the column shards'
--                contributions and leaves each rank its T/tp rows)
--   scatter_seq  forward reduce-scatters partial sums to T/tp shards;
--                backward all-gathers the gradient
-- The ranks' blocks are consecutive in T, so they travel through one
-- (tp, B, T/tp, ...) buffer (a copy each way), released as soon as the
-- collective is done, not at the end of the step's tensor scope.
local function stacked_shape(x, n)
  local shape = { n, x.shape[1], x.shape[2] / n }
  for d = 3, #x.shape do shape[d + 1] = x.shape[d] end
  return shape
end

local function all_gather_seq(x, comm)
  local n = comm.size
  local buf = gl.empty({ n, unpack(x.shape) }, { dtype = x.dtype, device = x.device })
  waited(comm, 'all_gather', buf, x:contiguous())
  local parts = {}
  for r = 1, n do parts[r] = buf:select(1, r) end
  local out = gl.cat(parts, 2)
  for _, v in ipairs(parts) do Tensor.release(v) end  -- views hold buf's storage too
  Tensor.release(buf)
  return out
end

local function reduce_scatter_seq(x, comm)
  local n = comm.size
  local shape = stacked_shape(x, n)
  local buf = gl.empty(shape, { dtype = x.dtype, device = x.device })
  local per = shape[3]
  for r = 1, n do
    local dst, src = buf:select(1, r), x:narrow(2, (r - 1) * per + 1, per)
    dst:copy_(src)
    Tensor.release(dst); Tensor.release(src)
  end
  table.remove(shape, 1)
  local out = gl.empty(shape, { dtype = x.dtype, device = x.device })
  waited(comm, 'reduce_scatter', out, buf, 'sum')
  Tensor.release(buf)
  return out
end

function TP.gather_seq(x, comm)
  if comm.size == 1 then return x end
  local out = gl.no_grad(all_gather_seq, x, comm)
  return A.record(out, { x }, function(_, g) return reduce_scatter_seq(g, comm) end, nil, 'sp_gather')
end

function TP.scatter_seq(x, comm)
  if comm.size == 1 then return x end
  local out = gl.no_grad(reduce_scatter_seq, x, comm)
  return A.record(out, { x }, function(_, g) return all_gather_seq(g, comm) end, nil, 'sp_scatter')
end

-- Each position's previous row when the sequence is cut over comm's ranks
-- (nanochat's smear: x[t] reads x[t-1]): x (B, Tl, C) is this rank's rows,
-- the segments {start, length} (0-based positions) segments_of(rank) gives,
-- in order, every rank as many.  Returns (B, Tl, C): row t holds position
-- t-1's row, zeros for position 0.  The last row of every segment is
-- all-gathered (gather_seq: B x segments x C per rank; its backward
-- reduce-scatters each row's gradient home); each rank builds the same
-- graph (position 0's row is a gathered one times 0), so every rank's
-- backward meets the collective.
function TP.shifted(x, comm, segments_of)
  local mine, k = segments_of(comm.rank), nil
  k = #mine
  local lasts, off = {}, 0
  for j, s in ipairs(mine) do off = off + s[2]; lasts[j] = x:narrow(2, off, 1) end
  local all = TP.gather_seq(k == 1 and lasts[1] or gl.cat(lasts, 2), comm)  -- (B, size * k, C)
  local where = {}  -- position -> its row in all (segments ending there)
  for q = 0, comm.size - 1 do
    for j, s in ipairs(segments_of(q)) do where[s[1] + s[2] - 1] = q * k + j end
  end
  local parts = {}
  off = 0
  for _, s in ipairs(mine) do
    local src = where[s[1] - 1]
    parts[#parts + 1] = all:narrow(2, src or 1, 1) * (src and 1 or 0)
    if s[2] > 1 then parts[#parts + 1] = x:narrow(2, off + 1, s[2] - 1) end
    off = off + s[2]
  end
  return gl.cat(parts, 2)
end

-- Under sequence parallelism the layers between the matrices see T/tp
-- rows; a forward decides once, at the embedding, whether it runs that way
-- (layout.seq_now): training needs T divisible by tp, a forward without
-- gradients (eval, sampling a few tokens) of another length runs as plain
-- tensor parallelism, which computes the same.
local function seq_mode(layout, T)
  local on = layout.sequence_parallel and T % layout.size == 0
  if layout.sequence_parallel and not on and gl.is_grad_enabled() then
    fail(('sequence parallel: a sequence of %d tokens is not divisible by tp %d'):format(T, layout.size))
  end
  layout.seq_now = on
  return on
end
TP.seq_mode = seq_mode  -- (a pipeline stage without the embedding decides it so: policies/pp.lua)

-- what feeds a column-parallel matrix: the whole sequence (gathered under
-- sequence parallelism), with the gradient summed over tp
local function into_columns(layout, x)
  if layout.seq_now then return TP.gather_seq(x, layout.comm) end
  return TP.copy_to(x, layout.comm)
end

-- Sequence parallel's column-parallel product, as Megatron-LM's: y = (the
-- T/tp shards of x gathered) W^T + b, keeping only the shard x for the
-- backward, which gathers the whole input again for dW and reduce-scatters
-- dx.  Gathered once and kept (as gather_seq then gl.linear would), the
-- (B, T, C) input of every column-parallel matrix stays live from forward
-- to backward: tp times the shard the norms and residuals hold.  The
-- price: one more all-gather per column-parallel matrix in backward.
local function gathered_linear(layout, x, W, bias)
  local comm = layout.comm
  local y = gl.no_grad(function()
    -- (the product on views released here: gl.linear's would keep the
    -- gathered input alive to the end of the step's scope)
    local full = all_gather_seq(x, comm)
    local n_in, n_out = W.shape[2], W.shape[1]
    local lead = full:numel() / n_in
    local shape = full:size()
    shape[#shape] = n_out
    local out = gl.empty(shape, { dtype = full.dtype, device = full.device })
    local x2, out2, Wt = full:view(lead, n_in), out:view(lead, n_out), W:transpose(1, 2)
    if bias then
      G.check(G.lib.gl_matmul_bias(out2.c, x2.c, Wt.c, bias.c))
    else
      gl.matmul_raw(x2, Wt, out2, 0)
    end
    for _, t in ipairs({ x2, out2, Wt, full }) do Tensor.release(t) end
    return out
  end)
  local inputs = bias and { x, W, bias } or { x, W }
  return A.record(y, inputs, function(_, g)
    return gl.no_grad(function()
      local full = all_gather_seq(x, comm)
      local n_in, n_out = W.shape[2], W.shape[1]
      local lead = full:numel() / n_in
      local g2 = g:contiguous():view(lead, n_out)
      local x2 = full:view(lead, n_in)
      local dfull = gl.empty(full.shape, { dtype = full.dtype, device = full.device })
      local gW = gl.empty(W.shape, { dtype = W.dtype, device = W.device })
      local gb = bias and gl.empty(bias.shape, { dtype = bias.dtype, device = bias.device }) or nil
      local d2 = dfull:view(lead, n_in)
      G.check(G.lib.gl_linear_backward(d2.c, gW.c, gb and gb.c or nil, nil, g2.c, x2.c, W.c, nil))
      for _, t in ipairs({ d2, x2, g2, full }) do Tensor.release(t) end
      local dx = reduce_scatter_seq(dfull, comm)
      Tensor.release(dfull)
      return dx, gW, gb
    end)
  end, { x, W }, 'sp_gathered_linear')
end

-- x W^T + b for a column-parallel matrix W (sequence parallel: the shard
-- kept, gathered again in backward)
local function column_linear(layout, x, W, bias)
  if layout.seq_now and layout.size > 1 then return gathered_linear(layout, x, W, bias) end
  return gl.linear(into_columns(layout, x), W, bias)
end

-- what leaves a row-parallel matrix: the partial sums added over tp (and
-- cut to this rank's T/tp rows under sequence parallelism)
local function out_of_rows(layout, y)
  if layout.seq_now then return TP.scatter_seq(y, layout.comm) end
  return TP.reduce_from(y, layout.comm)
end

-- ---------------------------------------------------- cutting tensors --
-- rank r's part of full: along dim, in `blocks` equal blocks each cut in n
function TP.slice(full, spec, r, n)
  local d, blocks = spec.dim, spec.blocks or 1
  local len = full.shape[d]
  local per = len / blocks / n
  local parts = {}
  for b = 0, blocks - 1 do parts[#parts + 1] = full:narrow(d, b * len / blocks + r * per + 1, per) end
  return gl.no_grad(function()
    local out = #parts == 1 and parts[1]:contiguous():clone() or gl.cat(parts, d)
    return out:contiguous()
  end)
end

-- the full tensor from every rank's part (collective over comm)
function TP.gather(part, spec, comm)
  local n = comm.size
  if n == 1 then return part end
  return gl.no_grad(function()
    local list = {}
    local src = part:contiguous()
    for i = 1, n do list[i] = gl.empty(part.shape, { dtype = part.dtype, device = part.device }) end
    comm:all_gather(list, src)
    local d, blocks = spec.dim, spec.blocks or 1
    local per = part.shape[d] / blocks
    local pieces = {}
    for b = 0, blocks - 1 do
      for i = 1, n do pieces[#pieces + 1] = list[i]:narrow(d, b * per + 1, per) end
    end
    return gl.cat(pieces, d)
  end)
end

-- replaces module[name] (a parameter) by rank r's part; returns the part
local function cut(layout, module, name, full_name, spec)
  local full = module[name]
  local part
  if rawget(full, 'held_by') then  -- another pipeline rank's parameter (gptlua.dist.pp_build): its part's shape only
    local shape = { unpack(full.shape) }
    shape[spec.dim] = shape[spec.dim] / layout.size
    part = require('gptlua.dist.pp_build').placeholder(shape, full)
  else
    part = TP.slice(full, spec, layout.rank, layout.size)
  end
  part.requires_grad = true
  module[name] = part
  layout.specs[full_name] = spec
  layout.full_shape[full_name] = full.shape
  layout.full_shape_of[part] = full.shape
  layout.sharded[part] = true
  return part
end

-- ---------------------------------------------------- parallel layers --
-- A layer the FP8 policy marked (lin.fp8, gptlua.fp8) runs its products
-- through gl.fp8_linear with the tp group named as the one that splits W's
-- rows (column-parallel: split.n) or columns (row-parallel: split.k), so
-- its scales are one process's (gptlua.ops_fp8), and context parallelism's
-- token group when it splits this forward (lin.fp8_tokens).  Under
-- sequence parallelism its input is gathered once and kept for the
-- backward (gather_seq), not gathered again as gathered_linear does.
local function fp8_split(lin, key, comm)
  local split = { [key] = comm }
  if lin.fp8_tokens then split.tokens = lin.fp8_tokens() end
  return split
end

local function column_parallel(layout, lin, prefix, blocks)
  cut(layout, lin, 'weight', prefix .. '.weight', { dim = 1, blocks = blocks })
  lin.tp_cut = 'n'   -- (W's rows: FSDP gathers such a weight in its dtype, gptlua.dist.fsdp_fp8)
  if lin.bias then cut(layout, lin, 'bias', prefix .. '.bias', { dim = 1, blocks = blocks }) end
  lin.forward = function(self, x)
    if not self.fp8 then return column_linear(layout, x, self.weight, self.bias) end
    local y = gl.fp8_linear(into_columns(layout, x), self.weight, self.fp8, fp8_split(self, 'n', layout.comm))
    if self.bias then y = y + self.bias end
    return y
  end
end

local function row_parallel(layout, lin, prefix)
  cut(layout, lin, 'weight', prefix .. '.weight', { dim = 2 })
  lin.tp_cut = 'k'   -- (W's columns)
  lin.forward = function(self, x)
    local y = self.fp8 and gl.fp8_linear(x, self.weight, self.fp8, fp8_split(self, 'k', layout.comm))
      or gl.linear(x, self.weight)
    y = out_of_rows(layout, y)
    if self.bias then y = y + self.bias end
    return y
  end
end

-- ids inside [lo, lo + n): local row and a mask of the inside ones
local function local_ids(ids, lo, n)
  local shifted = ids - lo
  local clamped = gl.clamp(shifted, 0, n - 1)
  return clamped, gl.eq(clamped, shifted)
end

local function vocab_embedding(layout, emb, prefix)
  local w = cut(layout, emb, 'weight', prefix .. '.weight', { dim = 1 })
  local lo, n = layout.rank * w.shape[1], w.shape[1]
  emb.forward = function(self, ids)
    seq_mode(layout, ids.shape[#ids.shape])  -- the first layer of every forward
    local row, inside = local_ids(ids, lo, n)
    local e = gl.embedding(row, self.weight)
    e = e * inside:to(e.dtype):unsqueeze(#e.shape)
    return out_of_rows(layout, e)
  end
  return w
end

-- Mean cross-entropy of vocabulary-sharded logits (..., V/tp) against
-- targets (...) in [0, V) (-1: ignored), softcap fused as gl.cross_entropy
-- does: loss = log sum_v exp(z_v - m) - (z_t - m), with m the global max,
-- the sum and z_t assembled by all-reduces over comm.  pad: a (V/tp)
-- tensor added to z (nanochat's padded rows: -1e30 beyond the vocabulary,
-- so they weigh exp(-1e30) = 0 and no product with 0 makes a NaN), or nil.
function TP.vocab_cross_entropy(logits, targets, comm, lo, softcap, pad)
  local V = logits.shape[#logits.shape]
  local z = (softcap and softcap > 0) and gl.softcap(logits, softcap) or logits
  if pad then z = z + pad end
  local last = #z.shape
  local m = gl.no_grad(function() return gl.max(z, last, true):contiguous():clone() end)
  waited(comm, 'all_reduce', m, 'max')
  local shifted = z - m
  local sum_exp = TP.reduce_from(gl.sum(gl.exp(shifted), last), comm)
  local row, inside = local_ids(targets, lo, V)
  local picked = gl.gather(shifted, last, row:unsqueeze(last)):squeeze(last)
  local target_logit = TP.reduce_from(picked * inside:to(picked.dtype), comm)
  local valid = gl.ne(targets, -1):to(logits.dtype)
  -- 1 / max(count, 1) stays on the device (as gl.cross_entropy's): no host read
  local inv = gl.no_grad(function() return 1 / gl.sum(valid):clamp(1, math.huge) end)
  local per_token = (gl.log(sum_exp) - target_logit) * valid
  return gl.sum(per_token) * inv
end

-- the model's head under tp (models/common.lua calls model.tp_head);
-- vocab: the real vocabulary when the weight's rows are padded beyond it
-- (nanochat's pad_vocab_to), whose padded logits never count
local function head(layout, vocab)
  local comm = layout.comm
  local pads = {}  -- by dtype: made once
  local function pad_of(weight)
    local n, lo = weight.shape[1], layout.rank * weight.shape[1]
    if not vocab or lo + n <= vocab then return nil end
    local key = weight.dtype .. weight.device
    if not pads[key] then
      local v = {}
      for i = 1, n do v[i] = lo + i <= vocab and 0 or -1e30 end
      pads[key] = gl.tensor(v, { dtype = weight.dtype, device = weight.device }):keep()
    end
    return pads[key]
  end
  return function(x, targets, weight, softcap)
    local logits = column_linear(layout, x, weight)
    if targets == nil then  -- sampling: whole rows of logits
      local full = TP.gather(logits, { dim = #logits.shape }, comm)
      if vocab and full.shape[#full.shape] > vocab then full = full:narrow(#full.shape, 1, vocab) end
      if softcap and softcap > 0 then full = gl.softcap(full, softcap) end
      return full, nil
    end
    return logits, TP.vocab_cross_entropy(logits, targets, comm, layout.rank * weight.shape[1], softcap,
      pad_of(weight))
  end
end

-- ------------------------------------------------------- the models --
local function divides(what, n, tp)
  if n % tp ~= 0 then
    fail(('%s %d is not divisible by tp %d'):format(what, n, tp))
  end
end

-- The model's sizes against tp (before anything is cut); sp: sequence parallel.
function TP.check(cfg, tp, sp)
  if sp then divides('block_size', cfg.block_size, tp) end
  divides('n_head', cfg.n_head, tp)
  if cfg.n_kv_head and cfg.n_kv_head ~= false then divides('n_kv_head', cfg.n_kv_head, tp) end
  divides('n_embd', cfg.n_embd, tp)
  if cfg.padded_vocab_size and cfg.padded_vocab_size ~= cfg.vocab_size then  -- nanochat's padded rows are cut
    if cfg.padded_vocab_size % tp ~= 0 then
      fail(('vocab_size %d padded to %d is not divisible by tp %d (set nanochat.pad_vocab_to to a multiple of %d)')
        :format(cfg.vocab_size, cfg.padded_vocab_size, tp, tp))
    end
  elseif cfg.vocab_size % tp ~= 0 then
    fail(('vocab_size %d is not divisible by tp %d (set --vocab_size to a multiple of %d, e.g. %d)'):format(
      cfg.vocab_size, tp, tp, math.ceil(cfg.vocab_size / tp) * tp))
  end
end

local function kind_of(model)
  local name = getmetatable(model).__name
  if name == 'GPT2' then return 'gpt2' elseif name == 'Nanochat' then return 'nanochat' end
  fail(('parallelize knows the gpt2 and nanochat models, got %s'):format(tostring(name)))
end

-- Cuts model (gpt2 or nanochat) in place over comm (the mesh's tp group)
-- and returns its layout: {comm, rank, size, specs = {name = {dim, blocks}},
-- full_shape = {name = shape}, sharded = {param = true}, model}.
function TP.parallelize(model, comm, opts)
  local cfg = model.config
  local tp = comm.size
  local kind = kind_of(model)
  local sp = opts and opts.sequence_parallel or false
  TP.check(cfg, tp, sp)
  local layout = { comm = comm, rank = comm.rank, size = tp, specs = {}, full_shape = {}, full_shape_of = {}, sharded = {}, model = model,
    sequence_parallel = sp }
  local tr = model.transformer
  for i = 1, tr.h.n do
    local b, p = tr.h[i], ('transformer.h.%d.'):format(i - 1)
    if kind == 'gpt2' then
      column_parallel(layout, b.attn.c_attn, p .. 'attn.c_attn', 3)
      b.attn.n_head = cfg.n_head / tp
    else
      column_parallel(layout, b.attn.c_q, p .. 'attn.c_q')
      column_parallel(layout, b.attn.c_k, p .. 'attn.c_k')
      column_parallel(layout, b.attn.c_v, p .. 'attn.c_v')
      -- v2's value-embedding gates (one per KV head): cut with their heads
      if b.attn.ve_gate then column_parallel(layout, b.attn.ve_gate, p .. 'attn.ve_gate') end
      b.attn.H, b.attn.Hkv = cfg.n_head / tp, cfg.n_kv_head / tp
    end
    row_parallel(layout, b.attn.c_proj, p .. 'attn.c_proj')
    if getmetatable(b.mlp) ~= require('gptlua.moe').MoE then
      column_parallel(layout, b.mlp.c_fc, p .. 'mlp.c_fc')
      row_parallel(layout, b.mlp.c_proj, p .. 'mlp.c_proj')
    end  -- (a mixture of experts stays whole on every tp rank: its input is the replicated residual)
  end
  -- sequence parallel: a mixture of experts stays whole on every tp rank
  -- and routes the rank's T/tp rows (the simplest cut: no exchange of
  -- tokens between tp ranks, the experts' gradients summed over tp as the
  -- norms' are), what it computes over the micro-batch reduced over tp
  -- (gptlua.moe's split sequence)
  if sp then
    require('gptlua.moe').split_tokens(model, comm, function() return layout.seq_now end,
      function(r, Tl) return { { r * Tl, Tl } } end, tp)
  end
  local wte = vocab_embedding(layout, tr.wte, 'transformer.wte')
  if kind == 'gpt2' then
    -- sequence parallel: each rank adds the positions of its own T/tp rows
    tr.wpe.forward = function(self, pos)
      if layout.seq_now then
        local per = pos:numel() / layout.size
        pos = pos:narrow(1, layout.rank * per + 1, per)
      end
      return gl.embedding(pos, self.weight)
    end
    model.lm_head_weight = wte  -- tied: the head uses the same shard
    local H = cfg.n_head / tp
    model.new_caches = function(self, B, S)
      return require('gptlua.models.common').new_caches(cfg.n_layer, B, H, S, cfg.n_embd / cfg.n_head, wte)
    end
  else
    cut(layout, model.lm_head, 'weight', 'lm_head.weight', { dim = 1 })
    -- v2: each value embedding (V, Hkv D) by columns, the KV heads of this rank's c_v
    -- (looked up from the whole sequence's ids: v has every position)
    if model.value_embeds then
      for _, np in ipairs(model.value_embeds:named_parameters()) do
        local name = np[1]:match('^(.*)%.weight$')
        cut(layout, model.value_embeds[name], 'weight', 'value_embeds.' .. np[1], { dim = 2 })
      end
    end
    -- v2's smear under sequence parallelism: a shard's first row reads the
    -- previous shard's last (TP.shifted); the KV caches' prefill gathers
    -- the whole sequence (no gradients there)
    if cfg.smear then
      local smear = getmetatable(model).smear
      model.smear = function(self, x, caches)
        if not layout.seq_now then return smear(self, x, caches) end
        local Tl = x.shape[2]
        if caches then
          local full = gl.no_grad(all_gather_seq, x, layout.comm)
          return smear(self, full, caches):narrow(2, layout.rank * Tl + 1, Tl):contiguous()
        end
        return self:smear_shifted(x, TP.shifted(x, layout.comm, function(r) return { { r * Tl, Tl } } end))
      end
    end
  end
  model.tp_head = head(layout, (kind == 'nanochat' or cfg.padded_vocab_size ~= cfg.vocab_size) and cfg.vocab_size or nil)
  -- rows padded for tp beyond the stored ones (pad_vocab_for_tp): checkpoints hold the stored rows
  if cfg.stored_vocab_size and cfg.padded_vocab_size ~= cfg.stored_vocab_size then
    layout.vocab_rows = { stored = cfg.stored_vocab_size, padded = cfg.padded_vocab_size,
      names = { ['transformer.wte.weight'] = true, ['lm_head.weight'] = kind == 'nanochat' or nil } }
    if model.value_embeds then
      for _, np in ipairs(model.value_embeds:named_parameters()) do layout.vocab_rows.names['value_embeds.' .. np[1]] = true end
    end
  end
  model.tp_layout = layout
  return layout
end

-- Sequence parallel: the replicated parameters (norms, biases after the
-- row-parallel matrices, gpt2's position embedding) saw only this rank's
-- T/tp rows, so their gradients are summed over tp (one all-reduce per
-- parameter; after the step's last backward, before the norm).
function TP.sum_replicated_grads(layout, params)
  if not layout.sequence_parallel or layout.size == 1 then return end
  for _, p in ipairs(params) do
    if p.grad and not layout.sharded[p] then waited(layout.comm, 'all_reduce', p.grad, 'sum') end
  end
end

-- name -> full tensor of a state dict whose sharded entries (by layout's
-- names; keys may carry a prefix and a suffix: optimizer state
-- "adamw.NAME.m") are gathered over the tp group.  Collective.
function TP.full_state(layout, sd, name_of)
  local out = {}
  local keys = {}
  for k in pairs(sd) do keys[#keys + 1] = k end
  table.sort(keys)  -- every rank gathers in the same order
  local rows = layout.vocab_rows
  for _, k in ipairs(keys) do
    local name = name_of and name_of(k) or k
    local spec = layout.specs[name]
    out[k] = spec and TP.gather(sd[k], spec, layout.comm) or sd[k]
    if rows and rows.names[name] then out[k] = out[k]:narrow(1, 1, rows.stored):contiguous() end  -- (tp's padding left out)
  end
  return out
end

-- this rank's part of a state dict of full tensors (tp's padded vocabulary
-- rows added, zero)
function TP.local_state(layout, sd, name_of)
  local out = {}
  local rows = layout.vocab_rows
  for k, t in pairs(sd) do
    local name = name_of and name_of(k) or k
    local spec = layout.specs[name]
    if rows and rows.names[name] and t.shape[1] == rows.stored then  -- tp's padding, zero (never read, masked)
      local shape = { unpack(t.shape) }
      shape[1] = rows.padded
      local padded = gl.zeros(shape, { dtype = t.dtype, device = t.device })
      padded:narrow(1, 1, rows.stored):copy_(t)
      t = padded
    end
    out[k] = spec and TP.slice(t, spec, layout.rank, layout.size) or t
  end
  return out
end

return TP
