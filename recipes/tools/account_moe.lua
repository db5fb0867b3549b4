-- recipes/tools/account_moe.lua — the predicted speed of a mixture-of-experts
-- training step on one H100, for OLMoE-1B-7B's shape: a prediction from the
-- step's work written out pass by pass, under the same pessimistic..
-- optimistic efficiency tables as the dense account (recipes/tools/
-- account.lua, whose counts come from the CUDA simulator: the MoE kernels
-- cannot be counted there yet, so this account is arithmetic).
--
--   build/gptlua recipes/tools/account_moe.lua [--B=1] [--gpus=8] [--accumulation=128] [--capacity_factor=0]
--
-- The model is gptlua's nanochat block (rotary, RMSNorm, QK-norm, ReLU^2,
-- untied head) with OLMoE-1B-7B's sizes: 16 layers, width 2048, 16 heads, 64
-- experts, top-8, vocabulary 50304, context 4096.  OLMoE's experts are
-- SwiGLU with hidden 1024 (three 2048 x 1024 matrices); gptlua's have two
-- matrices, so the expert hidden here is 1536: the same parameters and
-- FLOPs per expert (6.29M), 6.92B in all and 1.28B a token uses.  Counts
-- of parameters and FLOPs per token are the model's own, built on the meta
-- device (no memory); memory is the planner's (gptlua --plan) on one GPU,
-- and per GPU with ZeRO-1 over 8 (the states do not fit one H100).
--
-- A step's time is the sum over its rows of max(FLOPs / (efficiency x
-- peak), bytes / (efficiency x bandwidth)) plus a gap per launch; rows are
-- cuBLASLt products, our own tensor-core kernels (flash attention), the
-- grouped expert products (their own efficiency, M.GROUPED: the rows per
-- expert are few), and memory-bound passes (the dispatch, permute and
-- combine, the activation, the block's norms and rotary, cross-entropy,
-- the optimizer).  MFU counts the active parameters: 6 x N_active (less
-- the embedding lookup) + 12 L C T FLOPs per token.
local gl = require 'gptlua'
local meta = require 'gptlua.meta'
local account = dofile(gl.root .. '/recipes/tools/account.lua')

local M = {}

-- OLMoE-1B-7B's shape in gptlua's block (the header says why hidden 1536).
-- B: micro-batch per GPU; gpus: the data-parallel GPUs whose ZeRO-1 shards
-- hold the master weights and AdamW state (one H100 cannot hold them all:
-- M.memory); accumulation: micro-steps per optimizer step (8 GPUs x 128 x
-- 4096 tokens = 4.2M tokens, about OLMoE's 4M-token batch), over which the
-- optimizer and ZeRO-1's collectives are shared; activation_checkpointing
-- 1 runs each layer's forward twice (0: it fits without).
M.OLMOE = { name = 'olmoe_1b7b', n_layer = 16, n_embd = 2048, n_head = 16, experts = 64, top_k = 8, hidden = 1536,
            vocab = 50304, T = 4096, B = 1, gpus = 8, accumulation = 128, capacity_factor = 0,
            activation_checkpointing = 0 }

-- The grouped expert products' efficiency, a fraction of the dense bf16
-- peak: below cuBLASLt's 55..75% for large products (M.EFFICIENCY of the
-- dense account), because each expert's product has few rows (B T K / E =
-- 512 at B = 1 with balanced routing) and routing is uneven, so tiles are
-- partly empty and the most loaded expert sets the tail.  An assumption
-- until a GPU measures kernels/moe.cu.
M.GROUPED = { pessimistic = 0.30, central = 0.45, optimistic = 0.60 }
-- The block's memory-bound passes outside the MLP (norms, rotary + QK-norm,
-- residual adds, their backward), in (B, T, C) bf16 activations per layer:
-- the dense account counts 43 for nanochat d20's whole layer (kernels/
-- README.md), its MLP's few passes included, so this is an upper bound.
-- A third of them are the forward's (what activation checkpointing repeats).
M.BLOCK_PASSES, M.BLOCK_LAUNCHES = 43, 40
-- cross-entropy over the (N, V) logits: passes in float32 (read the logits,
-- the softmax's row sums, write the gradient)
M.CE_PASSES = 3
-- AdamW's bytes per parameter of the shard: bf16 gradient read, fp32 master,
-- m and v read and written, bf16 parameter written
M.ADAMW_BYTES = 2 + 8 + 8 + 8 + 2
-- NVLink per direction on an H100 SXM (for the communication this
-- prediction leaves out: M.report says how much)
M.NVLINK = 450e9

local function fail(msg) error('account_moe: ' .. msg, 0) end

-- The model's counts, built on the meta device: total and active
-- parameters, the embedding lookup, FLOPs per token (the model's own).
function M.model_facts(c)
  return meta.run(function()
    local moe = require 'gptlua.moe'
    local m = require('gptlua.models.nanochat').GPT({ n_layer = c.n_layer, n_embd = c.n_embd, n_head = c.n_head,
      vocab_size = c.vocab, block_size = c.T, moe = { experts = c.experts, top_k = c.top_k, hidden = c.hidden } })
    local total, inactive = m:num_params(), moe.inactive_params(m)
    return { total = total, active = total - inactive, lookup = m.transformer.wte.weight:numel(),
             flops_per_token = m:flops_per_token(c.T), padded_vocab = m.config.padded_vocab_size }
  end)
end

-- FLOPs per token by active parameters: 6 per weight a token passes
-- through (the embedding is looked up), 12 L C T for attention's scores
-- and values (the causal mask halves that term as llm.c counts)
function M.flops_per_token(f, c)
  return 6 * (f.active - f.lookup) + 12 * c.n_layer * c.n_embd * c.T
end

-- The rows each expert product gets: N K dropless, E x capacity with one
function M.dispatch_rows(c)
  local N, K, E = c.B * c.T, c.top_k, c.experts
  if c.capacity_factor > 0 then return math.min(N * K, E * math.max(1, math.ceil(c.capacity_factor * N * K / E))) end
  return N * K
end

-- One micro-step's work (the whole model, forward and backward, the
-- forward again under activation checkpointing) and the optimizer's share,
-- as rows { name, kind = cublaslt | own | grouped | mem, launches, flops,
-- bytes }.  bf16 activations and weights (s = 2 bytes).
function M.rows(c, f)
  local L, C, E, H, V, T = c.n_layer, c.n_embd, c.experts, c.hidden, f.padded_vocab or c.vocab, c.T
  local N, s = c.B * T, 2
  local R = M.dispatch_rows(c)
  local fw = 1 + c.activation_checkpointing   -- forward passes of each layer
  local rows = {}
  local function row(name, kind, launches, flops, bytes)
    rows[#rows + 1] = { name = name, kind = kind, launches = launches, flops = flops, bytes = bytes }
  end
  -- attention's four C x C products: forward 2 N C^2 each, backward twice that
  local proj_fwd = { flops = 4 * 2 * N * C * C, bytes = (8 * N * C + 4 * C * C) * s }
  row('attention projections q, k, v, o (cuBLASLt)', 'cublaslt', L * (4 * fw + 8),
    L * (fw + 2) * proj_fwd.flops, L * (fw + 2) * proj_fwd.bytes)
  row('router logits x W_r^T (cuBLASLt)', 'cublaslt', L * (fw + 2), L * (fw + 2) * 2 * N * C * E,
    L * (fw + 2) * (N * C + C * E + N * E) * s)
  -- flash attention, causal: forward QK^T and PV over half the (T, T)
  -- square, 2 N T C; backward five products (the scores recomputed), 5 N T C
  row('flash attention (own tensor-core kernel, causal)', 'own', L * (fw + 2), L * (fw * 2 + 5) * N * T * C,
    L * (fw * 4 + 8) * N * C * s)
  row(('block norms, rotary, QK-norm, residuals (%d passes, memory-bound)'):format(M.BLOCK_PASSES), 'mem',
    L * M.BLOCK_LAUNCHES, 0, L * M.BLOCK_PASSES * (1 + (fw - 1) / 3) * N * C * s)
  -- the router's choice (gptlua.moe.top_k: K rounds of max and mask over
  -- the (N, E) scores), route, permute, activation, combine
  row(('router scores, top-%d, weights (memory-bound)'):format(c.top_k), 'mem', L * (fw * (2 * c.top_k + 6) + 6), 0,
    L * (fw * (2 * c.top_k + 4) + 4) * N * E * s)
  row('dispatch: route, permute rows into expert order (memory-bound)', 'mem', L * (fw * 2 + 1), 0,
    L * (fw * (16 * N * c.top_k + 2 * R * C * s) + (R + N) * C * s))
  row('combine: weighted sum back to tokens, its backward (memory-bound)', 'mem', L * (fw + 2), 0,
    L * (fw * (R + N) * C * s + 4 * R * C * s))
  row('expert activation ReLU^2 (memory-bound)', 'mem', L * (fw + 1), 0, L * (fw * 2 + 3) * R * H * s)
  -- the two grouped products (C -> H, H -> C) over all E experts: forward
  -- 2 R C H FLOPs each, reading every expert's matrix; backward the input
  -- gradient (reads them again) and the weight gradient (writes them); each
  -- of the three reads or writes the rows on both sides, R (C + H)
  local gw = E * C * H * s
  row('grouped expert products (2 per layer, all experts in one launch each)', 'grouped', L * 2 * (fw + 2),
    L * 2 * (fw + 2) * 2 * R * C * H, L * 2 * (fw + 2) * (gw + R * (C + H) * s))
  row('embedding lookup and its gradient (memory-bound)', 'mem', 3, 0, 3 * N * C * s)
  row('lm_head (cuBLASLt)', 'cublaslt', 3, 6 * N * C * V, (3 * V * C + 3 * N * V + 3 * N * C) * s)
  row(('cross-entropy over the logits (%d fp32 passes, memory-bound)'):format(M.CE_PASSES), 'mem', 3, 0,
    M.CE_PASSES * N * V * 4)
  row(('AdamW over this GPU\'s 1/%d of the parameters, 1/%d per micro-step'):format(c.gpus, c.accumulation), 'mem',
    4 / c.accumulation, 0, f.total / c.gpus * M.ADAMW_BYTES / c.accumulation)
  return rows
end

local function eff_of(kind, e, g)
  if kind == 'cublaslt' then return e.cublaslt elseif kind == 'own' then return e.own
  elseif kind == 'grouped' then return g end
end

-- one row's time under an efficiency table (nil: the roofline) and
-- whether compute or memory bounds it
function M.row_time(r, e, g, dev)
  dev = dev or account.H100
  local ce = e and eff_of(r.kind, e, g) or 1
  local tc = r.flops > 0 and r.flops / (dev.flops * (ce or 1)) or 0
  local tm = r.bytes / (dev.bw * (e and e.mem or 1))
  return math.max(tc, tm) + (e and r.launches * e.gap_us * 1e-6 or 0), tc >= tm and 'compute' or 'memory'
end

-- Predicted micro-step time, tokens/s and MFU (active parameters; causal
-- half) under efficiency table e and grouped efficiency g
function M.predict(rows, c, fpt, e, g, dev)
  dev = dev or account.H100
  local t = 0
  for _, r in ipairs(rows) do t = t + M.row_time(r, e, g, dev) end
  local tps = c.B * c.T / t
  local causal = fpt - 12 * c.n_layer * c.n_embd * c.T / 2
  return { step_s = t, tps = tps, mfu = tps * fpt / dev.flops, mfu_causal = tps * causal / dev.flops }
end

-- The memory a run needs: the states by arithmetic (bf16 parameters and
-- gradients, fp32 master weights, AdamW's m and v: 16 bytes a parameter);
-- the planner's peak on one H100 (gptlua --plan, micro-batch B x T, AdamW,
-- bf16); and per GPU with ZeRO-1 over c.gpus: that plan less the share of
-- master weights and optimizer state the other GPUs hold, (gpus-1)/gpus.
M.DEVICE_MEMORY = 80e9
M.MARGIN = 0.10   -- the planner's default margin
function M.memory(c, f)
  local plan = require 'gptlua.plan'
  local r = { name = c.name, model = 'nanochat', optimizer = 'adamw', data = 'random', n_layer = c.n_layer,
    n_head = c.n_head, n_embd = c.n_embd, block_size = c.T, vocab_size = c.vocab, batch_size = c.B,
    total_batch_size = 0, max_iters = 10, eval_interval = 0, sample_length = 0, quiet = true, dtype = 'bfloat16',
    dist = 'none', activation_checkpointing = c.activation_checkpointing == 1,
    moe = { experts = c.experts, top_k = c.top_k, hidden = c.hidden, capacity_factor = c.capacity_factor } }
  local p = plan.plan(r, { device_memory = M.DEVICE_MEMORY, margin = M.MARGIN })
  local P, g = f.total, p.groups
  local sharded = p.peak - ((g['master weights'] or 0) + (g['optimizer state'] or 0)) * (c.gpus - 1) / c.gpus
  return { states = 16 * P, params = 2 * P, master = 4 * P, adam = 8 * P, grads = 2 * P, one = p.peak,
           activations = g.activations or 0, usable = p.usable, sharded = sharded, fits = sharded <= p.usable }
end

local function gb(b) return ('%.1f GB'):format(b / 1e9) end

-- Prints the account of configuration c (M.OLMOE with changes); returns
-- the summary { range = { pessimistic|central|optimistic -> prediction },
-- facts, flops_per_token, rows, limit, memory }.
function M.report(c, out, opts)
  out = out or print
  opts = opts or {}
  local dev = account.H100
  local f = M.model_facts(c)
  local fpt = M.flops_per_token(f, c)
  local N, R = c.B * c.T, M.dispatch_rows(c)
  out(('MoE account: %s shape in gptlua\'s nanochat block: %d layers, width %d, %d heads, %d experts of hidden %d '
    .. '(two matrices: the parameters and FLOPs of OLMoE\'s SwiGLU 1024), top-%d, vocabulary %d, context %d')
    :format(c.name, c.n_layer, c.n_embd, c.n_head, c.experts, c.hidden, c.top_k, c.vocab, c.T))
  out(('parameters (the model built on the meta device): %.3fB with every expert, %.3fB active per token (%.3fB '
    .. 'of them the embedding lookup); FLOPs per token by active parameters 6 x %.3fB + 12 L C T = %.4g (the model\'s '
    .. 'own count: %.4g)'):format(f.total / 1e9, f.active / 1e9, f.lookup / 1e9, (f.active - f.lookup) / 1e9, fpt,
    f.flops_per_token))
  local mem = opts.memory ~= false and M.memory(c, f) or nil
  if mem then
    out(('memory: bf16 parameters %s + fp32 master weights %s + AdamW m and v %s + bf16 gradients %s = %s of '
      .. 'states: %s one 80 GB H100 (planned by gptlua --plan at micro-batch %d x %d%s: %s, activations %s)')
      :format(gb(mem.params), gb(mem.master), gb(mem.adam), gb(mem.grads), gb(mem.states),
              mem.one <= mem.usable and 'fits' or 'does NOT fit', c.B, c.T,
              c.activation_checkpointing == 1 and ', activation checkpointing' or '', gb(mem.one), gb(mem.activations)))
    out(('  so the figure is per GPU of %d H100s training data-parallel with ZeRO-1 (master weights and AdamW state '
      .. 'in %d shards): %s per GPU, %s %s usable (80 GB less a %.0f%% margin)'):format(c.gpus, c.gpus,
      gb(mem.sharded), mem.fits and 'fits in' or 'does NOT fit in', gb(mem.usable), 100 * M.MARGIN))
  end
  out(('micro-step: %d x %d = %d tokens per GPU, dispatch %s = %d rows, %.0f per expert with balanced routing'):format(
    c.B, c.T, N, c.capacity_factor > 0 and ('E x capacity (factor %g)'):format(c.capacity_factor) or 'N K', R,
    R / c.experts))
  local rows = M.rows(c, f)
  local e, g = account.EFFICIENCY.central, M.GROUPED.central
  local total = M.predict(rows, c, fpt, e, g, dev).step_s
  out(('%-72s %8s %9s %9s %8s %8s %s'):format('work (one micro-step, whole model)', 'launches', 'GFLOP', 'GB', 'ms',
    'share', 'bound'))
  local sorted = {}
  for i, r in ipairs(rows) do sorted[i] = r end
  table.sort(sorted, function(a, b) return M.row_time(a, e, g, dev) > M.row_time(b, e, g, dev) end)
  for _, r in ipairs(sorted) do
    local t, bound = M.row_time(r, e, g, dev)
    out(('%-72s %8.0f %9.1f %9.2f %8.2f %7.1f%% %s'):format(r.name, r.launches, r.flops / 1e9, r.bytes / 1e9,
      t * 1e3, 100 * t / total, bound))
  end
  out('prediction (not a measurement) for one H100 SXM (989 TFLOP/s dense bf16, 3.35 TB/s) assumes: each pass '
    .. 'overlaps its compute and memory traffic perfectly, no tail effects, no host time on the critical path, '
    .. ('balanced routing, ZeRO-1\'s communication hidden behind compute; the work of a step is the '
    .. 'arithmetic of recipes/tools/account_moe.lua (the block\'s non-MoE passes: %d per layer, the dense '
    .. 'account\'s nanochat count); efficiencies:'):format(M.BLOCK_PASSES))
  local res = { range = {}, facts = f, flops_per_token = fpt, rows = rows, memory = mem }
  for _, k in ipairs(account.EFFICIENCY_ORDER) do
    local p = M.predict(rows, c, fpt, account.EFFICIENCY[k], M.GROUPED[k], dev)
    p.efficiency = { grouped = M.GROUPED[k] }
    for key, v in pairs(account.EFFICIENCY[k]) do p.efficiency[key] = v end
    res.range[k] = p
    out(('  %-11s %s, grouped expert products %.0f%% of peak: %.1f ms/micro-step, %.0f tokens/s, MFU %.1f%% (causal '
      .. 'half %.1f%%)'):format(k, account.describe_efficiency(account.EFFICIENCY[k]), 100 * M.GROUPED[k],
      p.step_s * 1e3, p.tps, 100 * p.mfu, 100 * p.mfu_causal))
  end
  local lo, mid, hi = res.range.pessimistic, res.range.central, res.range.optimistic
  out(('predicted (central; range pessimistic..optimistic): %.0f tokens/s per GPU (%.0f..%.0f), MFU by active '
    .. 'parameters %.1f%% (%.1f..%.1f%%), %.1f%% (%.1f..%.1f%%) with the causal half'):format(mid.tps, lo.tps, hi.tps,
    100 * mid.mfu, 100 * lo.mfu, 100 * hi.mfu, 100 * mid.mfu_causal, 100 * lo.mfu_causal, 100 * hi.mfu_causal))
  -- what limits it: the largest row, the grouped products' regime, and the
  -- communication the figure leaves out
  local top = sorted[1]
  local share = M.row_time(top, e, g, dev) / total
  local cross = dev.flops * g / (dev.bw * e.mem)   -- rows per expert where weight reads equal the FLOPs' time
  res.limit = top.name
  out(('limited by: %s, %.0f%% of the central micro-step (the expert products are %s at %.0f rows per expert; below '
    .. 'about %.0f rows per expert, B T K / E, reading every expert\'s weights takes longer than their FLOPs)')
    :format(top.name, 100 * share, R / c.experts >= cross and 'compute-bound' or 'bound by reading the weights',
    R / c.experts, cross))
  -- ZeRO-1 per optimizer step: the bf16 gradients reduce-scattered, the
  -- bf16 parameters all-gathered, (gpus-1)/gpus of 2P bytes each
  local zero1 = 2 * 2 * f.total * (c.gpus - 1) / c.gpus / c.accumulation
  local a2a = 4 * c.n_layer * R * c.n_embd * 2 * (c.gpus - 1) / c.gpus
  res.comm_bytes = zero1
  out(('not in the figure: ZeRO-1\'s collectives, %.2f GB per micro-step per GPU (the gradients\' reduce-scatter and '
    .. 'the parameters\' all-gather once per %d micro-steps), %.1f ms at %.0f GB/s NVLink; expert parallelism over '
    .. '%d would move tokens instead (dispatch and combine, forward and backward: %.1f GB, %.0f ms a micro-step)')
    :format(zero1 / 1e9, c.accumulation, zero1 / M.NVLINK * 1e3, M.NVLINK / 1e9, c.gpus, a2a / 1e9,
            a2a / M.NVLINK * 1e3))
  return res
end

-- `build/gptlua recipes/tools/account_moe.lua [--key=value]`: M.OLMOE with
-- B, gpus, accumulation, capacity_factor, activation_checkpointing changed
function M.main(args)
  local c = {}
  for k, v in pairs(M.OLMOE) do c[k] = v end
  for _, a in ipairs(args or {}) do
    local k, v = tostring(a):match('^%-%-([%w_]+)=(.+)$')
    if not k or type(M.OLMOE[k]) ~= 'number' then
      fail(('expected --B=, --gpus=, --accumulation=, --capacity_factor= or --activation_checkpointing= with a '
        .. 'number, got %s'):format(tostring(a)))
    end
    local n = tonumber(v)
    local want = k == 'capacity_factor' and 'a number >= 0' or k == 'activation_checkpointing' and '0 or 1'
      or 'a positive integer'
    if not n or n < 0 or (k == 'activation_checkpointing' and n ~= 0 and n ~= 1)
      or (k ~= 'capacity_factor' and k ~= 'activation_checkpointing' and (n < 1 or n ~= math.floor(n))) then
      fail(('--%s must be %s, got %s'):format(k, want, v))
    end
    c[k] = n
  end
  M.report(c)
  return 0
end

if arg and arg[0] and arg[0]:match('account_moe%.lua$') then
  local args = {}
  for i = 1, #arg do args[i] = arg[i] end
  return M.main(args)   -- (an exit status: a table would be trained as a recipe)
end

return M
