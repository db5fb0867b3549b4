-- recipes/tools/account.lua — the byte-and-FLOP account of one training step
-- on the CUDA backend, counted by the simulator (`recipes/tools/bench_cuda.lua
-- --account`; recipes/tools/ACCOUNT.md reads it).
--
-- What is counted (spec/cudasim/account.cpp): for every work item of a step,
-- its global-memory bytes read and written as unique 32-byte sectors per
-- launch (the account flavour's kernels have every load and store
-- instrumented: `make sim-account`), its tensor-core FLOPs (WMMA, cuBLASLt
-- 2mnk + epilogue; cuBLASLt's bytes are its operands, each once), and every
-- host wait on the device.  Nothing is estimated by hand.
--
-- A full-size step cannot run in the simulator on a CPU, so it is counted at
-- small sizes at the real width and vocabulary and extrapolated, per kernel:
-- with L layers, N = B*T tokens and context T, every count is
--     out(B, T) + L * layer(B, T),   each  a + b*N + c*N*T + d*T
-- (c: attention's T^2 work; d: per-position work, GPT-2's position table).
-- Eight counted steps give the eight coefficients: L = 1 and 2, at (B, T) =
-- (1, T0), (2, T0), (1, 2*T0), (2, 2*T0).  A model with `Vs` (nanochat d20,
-- whose 168M embedding and head parameters made each counted step take
-- minutes: the simulated AdamW over them) is counted at two small
-- vocabularies V1, V2 instead of its own: the layers do not depend on V and
-- the rest is linear in it (tables, head GEMMs, cross-entropy rows, their
-- optimizer state), so each coefficient of `out` becomes p + q*V, from the
-- eight steps at V1 and four more (L = 1) at V2, evaluated at the real V.
-- Each counted step is its forward, backward and clip, plus the
-- optimizer's update counted separately once per depth, vocabulary and
-- context (it does not depend on the batch) and added row by row: the
-- simulated update (Muon's Newton-Schulz over every matrix) is most of a
-- step's time.  check() counts whole steps, so it checks the split too.  check() compares the extrapolation
-- with a direct count at another size (spec/account_spec.lua).  Exact while
-- every kernel's launch configuration scales with the size; the one known
-- exception is a reduction whose block count saturates (kernels/reduce.cu
-- splits a column sum into at most 4*SMs*256/columns pieces, reached at a few
-- thousand tokens): its partial sums are over-counted at full size.
--
-- The roofline of a launch is max(FLOPs / peak, bytes / bandwidth) on an H100
-- SXM (989 TFLOP/s dense bf16, 3.35 TB/s).  The prediction is a range, one
-- step time per efficiency table of M.EFFICIENCY (pessimistic, central,
-- optimistic; edit them, or pass your own to M.report): cuBLASLt's products
-- at `cublaslt` of peak, our own tensor-core kernels (flash attention,
-- gemm_mma.cu) at `own` of peak, memory-bound work at `mem` of bandwidth,
-- plus `gap_us` per launch (the GPU's back-to-back launch gap).  It assumes
-- each kernel overlaps its own compute and memory traffic perfectly, no
-- tail effects and no host time on the critical path; every line it prints
-- says so.  Step times become tokens/s and MFU with the model's FLOPs/token
-- (train.lua's, as bench.lua's MFU: the attention term 12*L*C*T whole) and
-- with the attention term halved for the causal mask (llm.c's convention).
local gl = require 'gptlua'
local ffi = require 'ffi'
local train = require 'gptlua.train'
local data = require 'gptlua.data'
local now = require('gptlua.cli').now

local M = {}

-- fp8_flops: the FP8 tensor-core peak (dense), which cuBLASLt's FP8
-- products (rows 'cublasLt 8F_...', --fp8) are timed against; MFU stays
-- against the bf16 peak, the model's FLOPs being the same
M.H100 = { name = 'H100 SXM', flops = 989e12, fp8_flops = 1979e12, bw = 3.35e12 }
-- The simulated GPU's multiprocessor count while counting (GL_SIM_SMS).
-- Some kernels size their grid by it and keep per-block partial sums (norm
-- backward: min(rows, 2*SMs) blocks; kernels/reduce.cu's column sums), so
-- their bytes stop growing with the size at a few hundred to a few thousand
-- tokens on 132 SMs, beyond what the simulator can count.  With 2 SMs they
-- are in that regime at the counted sizes already, and the extrapolation
-- stays exact; the partial sums are then under-counted (by at most about
-- 0.1% of a full-size step's bytes: 132 SMs' worth is a few MB per layer).
M.SMS = 2
-- Efficiencies, as fractions of the H100's peak FLOP/s and bandwidth, and
-- the gap per launch.  Published figures for cuBLASLt's bf16 GEMMs at these
-- shapes are 60-75% of peak; our own attention and GEMM have never run on a
-- GPU, so they get ~40% until measured (make gpu-check measures them);
-- elementwise and row kernels ~75% of bandwidth; 2 us between launches.
M.EFFICIENCY = {
  pessimistic = { cublaslt = 0.55, own = 0.30, mem = 0.65, gap_us = 3.0 },
  central = { cublaslt = 0.65, own = 0.40, mem = 0.75, gap_us = 2.0 },
  optimistic = { cublaslt = 0.75, own = 0.55, mem = 0.85, gap_us = 1.0 },
}
M.EFFICIENCY_ORDER = { 'pessimistic', 'central', 'optimistic' }
-- a launch whose bytes are a GEMM's operands, not activation passes:
-- cuBLASLt's, and our own bf16 GEMM with the ReLU² epilogues
-- (kernels/gemm_mma.cu; its reads of h in the backward are its epilogue's)
function M.is_gemm(name) return name:match('^cublasLt') ~= nil or name:match('^gemm_mma') ~= nil end

if not pcall(ffi.typeof, 'gl_sim_account_row') then ffi.cdef [[
typedef struct { const char *name; double launches, flops, bytes_read, bytes_written; } gl_sim_account_row;
int gl_sim_account_counts_bytes(void);
int gl_sim_account_start(char *err, int errlen);
void gl_sim_account_stop(void);
double gl_sim_account_item_seconds(void);
int gl_sim_account_get(int syncs, int i, gl_sim_account_row *out);
int gl_sim_account_skip_products(int on);
]] end

-- the library if it can count (the account flavour), else nil and why
function M.library()
  local lib = gl.lib
  local ok, counts = pcall(function() return lib.gl_sim_account_counts_bytes() end)
  if not ok then return nil, 'this engine is not the CUDA simulator' end
  if counts ~= 1 then return nil, 'this simulator build does not count memory traffic (make sim-account)' end
  return lib
end

M.SYNC = 'host sync: '

-- The row a kernel counts in.  An element-wise op's 16-byte path
-- (kernels/elementwise.cu: unary_vec_kernel, ...) counts with its
-- element-wise kernel: the same op and the same bytes, and which one runs
-- depends on the operands' alignment, which in the simulator depends on the
-- sizes (its allocator ends each tensor at its block's end, where a GPU's
-- starts it 256-byte aligned), so separate rows would not extrapolate.
function M.row_name(name)
  return (name:gsub('^(.-)_vec_kernel<S,T>$', '%1_kernel<P,T>'))
end

-- Counts fn() (work already queued is flushed first): returns
-- { rows = { name -> { launches, flops, read, written } }, order = { names },
--   host_s = wall seconds of fn outside the device's work }; host syncs
-- are rows named M.SYNC .. API with launches = times.
function M.count(fn)
  local lib = assert(M.library())
  local cuda = require 'gptlua.cuda'
  cuda.synchronize()
  local err = ffi.new('char[256]')
  if lib.gl_sim_account_start(err, 256) ~= 0 then error('account: ' .. ffi.string(err), 0) end
  local t0 = now()
  local ok, e = pcall(fn)
  local wall = now() - t0
  lib.gl_sim_account_stop()
  if not ok then error(e, 0) end
  -- host time: what the step spent outside the simulated device's work
  local res = { rows = {}, order = {}, host_s = wall - lib.gl_sim_account_item_seconds() }
  local r = ffi.new('gl_sim_account_row')
  local i = 0
  while lib.gl_sim_account_get(0, i, r) == 0 do
    local name = M.row_name(ffi.string(r.name))
    local x = res.rows[name]
    if not x then
      x = { launches = 0, flops = 0, read = 0, written = 0 }
      res.rows[name] = x
      res.order[#res.order + 1] = name
    end
    x.launches, x.flops = x.launches + r.launches, x.flops + r.flops
    x.read, x.written = x.read + r.bytes_read, x.written + r.bytes_written
    i = i + 1
  end
  i = 0  -- host syncs are rows too ("host sync: API"), so that they are extrapolated alike
  while lib.gl_sim_account_get(1, i, r) == 0 do
    local name = M.SYNC .. ffi.string(r.name)
    res.rows[name] = { launches = r.launches, flops = 0, read = 0, written = 0 }
    res.order[#res.order + 1] = name
    i = i + 1
  end
  return res
end

-- ------------------------------------------------------------------ models
-- The two models of the issue's goals, and how a layer count, batch and
-- context are set on each (nanochat's depth dial also sets the width, so
-- its width is pinned and n_layer varied).
M.MODELS = {
  gpt2_124m = { recipe = 'gpt2_124m', B = 64, T = 1024, layers = 12, C = 768, T0 = 64, opt_by_context = true,
                args = function(L) return { '--n_layer=' .. L } end },
  nanochat_d20 = { recipe = 'nanochat_d20', B = 32, T = 2048, layers = 20, C = 1280, T0 = 64, V = 65536,
                   Vs = { 1024, 2048 },
                   args = function(L) return { '--depth=0', '--n_layer=' .. L, '--n_embd=1280', '--n_head=10' } end },
}

local function trainer(model, L, B, T, extra)
  -- a gradient clip so small that every step takes it: the step always
  -- includes the scaling pass (the larger account of the two paths)
  local args = { '--data=random', '--device=cuda', '--dtype=bfloat16', '--total_batch_size=0', '--quiet=true',
                 '--eval_interval=0', '--sample_length=0', '--max_iters=10', '--batch_size=' .. B,
                 '--block_size=' .. T, '--grad_clip=1e-6',
                 -- op by op: the counted step is the launches themselves (a graph
                 -- replays the same kernels; its capture step would count once)
                 '--cuda_graph=off' }
  for _, a in ipairs(model.args(L)) do args[#args + 1] = a end
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  local recipe = dofile(gl.root .. '/recipes/' .. model.recipe .. '.lua')
  local t = train.new(recipe, args)
  -- every step's batch: B*T tokens that do not repeat (M.distinct_tokens),
  -- through a loader as the trainer's own (pinned, copied on its stream)
  local V = t.cfg.vocab_size
  t.data.train:close()
  t.data.train = data.loader({ tokens = M.distinct_tokens(B * T + 1, V), batch_size = B, block_size = T,
                               sampling = 'sequential', device = t.cfg.device, vocab_size = V })
  return t
end

-- n different token ids of [0, V) in a random order (the first n of a
-- seeded Fisher-Yates shuffle of the vocabulary).  The counted steps read
-- these, n = B*T + 1 (x, and y = x shifted by one): no token repeats in a
-- batch, so an embedding lookup reads one table row per token and every
-- row's count is a function of the sizes alone, which the fit extrapolates
-- exactly.  The account of a step is then its no-repeat count: an upper
-- bound on a real batch's, whose repeated tokens share their rows (at most
-- B*T rows, where random tokens extrapolated from a few hundred per step
-- bent below zero at nanochat d20's 65,536).
function M.distinct_tokens(n, V, seed)
  if n > V then
    error(('account: %d tokens (B*T + 1) cannot all differ in a vocabulary of %d'):format(n, V), 0)
  end
  local state = seed or 1
  local function below(k)  -- a uniform integer in [0, k) (Park and Miller's generator: exact in doubles)
    state = state * 16807 % 2147483647
    return math.floor(state / 2147483647 * k)
  end
  local swapped, ids = {}, {}
  for i = 0, n - 1 do
    local j = i + below(V - i)
    local a, b = swapped[i] or i, swapped[j] or j
    swapped[i], swapped[j] = b, a
    ids[i + 1] = b
  end
  return ids
end

-- One training step (micro-batch B x T, backward, clip, optimizer update)
-- counted after one warm-up step (optimizer state, cached plans).  part:
-- nil (the whole step), 'no optimizer' (the step without the optimizer's
-- update, in the warm-up too) or 'optimizer' (only the update, after a
-- whole warm-up step: the state exists and the gradients are there).
function M.count_step(model, L, B, T, extra, part)
  local t = trainer(model, L, B, T, extra)
  if part == 'no optimizer' then t.policy.step = function() end end
  t:train_step()
  local res
  if part == 'optimizer' then
    res = M.count(function() gl.scope(function() t.policy:step() end) end)  -- as Trainer:train_step runs it
  else
    res = M.count(function() t:train_step() end)
  end
  res.flops_per_token, res.tokens = t.flops_per_token, B * T
  res.params = t.model:num_params()
  t = nil
  collectgarbage(); collectgarbage()
  return res
end

-- ------------------------------------------------------------------ the fit
local FIELDS = { 'launches', 'flops', 'read', 'written' }

-- the basis every count is a combination of, at N = B*T tokens, context T:
-- fixed work, per-token work, attention's T^2 work, per-position work
-- (GPT-2's position table and its gradient and optimizer state)
local function basis(B, T) local N = B * T; return { 1, N, N * T, T } end
M.basis = basis

-- solves A x = y (Gaussian elimination with partial pivoting)
local function solve(A, y)
  local n, m = #A, {}
  for i = 1, n do m[i] = { unpack(A[i]) }; m[i][n + 1] = y[i] end
  for c = 1, n do
    local p = c
    for r = c + 1, n do if math.abs(m[r][c]) > math.abs(m[p][c]) then p = r end end
    m[c], m[p] = m[p], m[c]
    for r = c + 1, n do
      local f = m[r][c] / m[c][c]
      for k = c, n + 1 do m[r][k] = m[r][k] - f * m[c][k] end
    end
  end
  local x = {}
  for r = n, 1, -1 do
    local v = m[r][n + 1]
    for k = r + 1, n do v = v - m[r][k] * x[k] end
    x[r] = v / m[r][r]
  end
  return x
end

-- Fits every row's counts as out(B,T) + L*layer(B,T), each a combination of
-- basis(B, T), from counted steps at L = 1 and 2 and the sizes {B, T}
-- (runs[L][s]).  With `vocab` = { V1, V2, runs = L = 1 steps at V2 } (runs
-- being at V1), out's coefficients are linear in the vocabulary.  Returns
-- the fit: fit.predict(L, B, T [, part [, V]]) -> rows.
function M.fit(sizes, runs, vocab)
  local A = {}
  for s, bt in ipairs(sizes) do A[s] = basis(bt[1], bt[2]) end
  local names, seen = {}, {}
  local all = { runs[1], runs[2], vocab and vocab.runs }
  for _, rs in ipairs(all) do
    for s = 1, #sizes do
      for _, n in ipairs(rs[s].order) do if not seen[n] then seen[n] = true; names[#names + 1] = n end end
    end
  end
  local coef = {}
  for _, n in ipairs(names) do
    coef[n] = {}
    for _, f in ipairs(FIELDS) do
      local out, layer = {}, {}
      for s = 1, #sizes do
        local r1, r2 = runs[1][s].rows[n], runs[2][s].rows[n]
        local v1, v2 = r1 and r1[f] or 0, r2 and r2[f] or 0
        layer[s], out[s] = v2 - v1, 2 * v1 - v2
      end
      coef[n][f] = { out = solve(A, out), layer = solve(A, layer) }
      if vocab then  -- out at V2 (the L = 1 step less one layer): out = p + q*V per coefficient
        local out2 = {}
        for s = 1, #sizes do
          local r = vocab.runs[s].rows[n]
          out2[s] = (r and r[f] or 0) - layer[s]
        end
        local x1, x2, p, q = coef[n][f].out, solve(A, out2), {}, {}
        for i = 1, #x1 do
          q[i] = (x2[i] - x1[i]) / (vocab.V2 - vocab.V1)
          p[i] = x1[i] - q[i] * vocab.V1
        end
        -- (an embedding lookup too: with no token repeated, M.distinct_tokens,
        -- it reads one row per token at either vocabulary, so its slope is 0)
        coef[n][f].out, coef[n][f].outV = p, q
      end
    end
  end
  local fit = { names = names, coef = coef, vocab = vocab }
  -- counts at (L, B, T); part 'layer': one layer's; 'layer tokens': one
  -- layer's work that grows with the tokens (no optimizer, no zeroing)
  function fit.predict(L, B, T, part, V)
    if vocab and not V then error('account: the fit is linear in the vocabulary; predict needs V', 2) end
    local x = basis(B, T)
    local rows = {}
    for _, n in ipairs(names) do
      local r = {}
      for _, f in ipairs(FIELDS) do
        local c, lay, out = coef[n][f], 0, 0
        for i = 1, #x do
          lay, out = lay + c.layer[i] * x[i], out + c.out[i] * x[i]
          if c.outV then out = out + c.outV[i] * x[i] * V end
        end
        if part == 'layer tokens' then lay = lay - c.layer[1] end  -- without the fixed (parameter-sized) part
        r[f] = part and lay or out + L * lay
      end
      rows[n] = r
    end
    return rows
  end
  return fit
end

-- The eight counted steps of a model: L = 1, 2 at (B, T) = (1, T0), (2, T0),
-- (1, 2*T0), (2, 2*T0), at the real width and vocabulary (and `extra`
-- arguments).  T0 (a multiple of the attention tile, 64) must put every
-- kernel in its full-size regime (see M.SMS): the column reductions of
-- kernels/reduce.cu split a sum of more than 64 rows over blocks when the
-- sum has fewer than 256*SMs columns, in a number of pieces that grows with
-- the rows up to 4*SMs*256/columns: a model whose bias vectors are narrower
-- than 512 would be counted in a different regime at each size (the spec's
-- tiny model has no biases; GPT-2's narrowest is 768 wide).
function M.measure(model, extra, log)
  local sms = require('gptlua.cuda').get_device_properties(0).multiprocessor_count
  if sms ~= M.SMS then
    error(('account: the simulated GPU has %d SMs, expected %d: run with GL_SIM_SMS=%d'):format(sms, M.SMS, M.SMS), 0)
  end
  local T0 = model.T0
  local sizes = { { 1, T0 }, { 2, T0 }, { 1, 2 * T0 }, { 2, 2 * T0 } }
  local V1, V2 = model.Vs and model.Vs[1], model.Vs and model.Vs[2]
  -- The optimizer's update does not depend on the batch (the parameters'
  -- shapes do not), only on the context where a parameter is sized by it
  -- (GPT-2's position table, `opt_by_context`): it is counted once per
  -- depth, vocabulary and context (at B = 1; nanochat: once per depth and
  -- vocabulary) and added to the steps counted without it, which saves
  -- where the time goes (nanochat's Newton-Schulz over every matrix, simulated).
  local function counted(L, bt, V, part)
    local t0 = now()
    local r = M.count_step(model, L, bt[1], bt[2], M.with_vocab(extra, V), part)
    if log then
      log(('  counted L=%d B=%d T=%d%s%s in %.0f s'):format(L, bt[1], bt[2], V and (' V=' .. V) or '',
        part and (' (' .. part .. ')') or '', now() - t0))
    end
    return r
  end
  local function step(L, bt, V, opt)
    local T = bt[2]
    local key = model.opt_by_context and T or 0  -- (nanochat's parameters do not depend on T)
    opt[key] = opt[key] or counted(L, { 1, T }, V, 'optimizer')
    return M.merge(counted(L, bt, V, 'no optimizer'), opt[key])
  end
  local runs = { {}, {} }
  for L = 1, 2 do
    local opt = {}
    for s, bt in ipairs(sizes) do runs[L][s] = step(L, bt, V1, opt) end
  end
  local vocab
  if V2 then
    vocab = { V1 = V1, V2 = V2, runs = {} }
    local opt = {}
    for s, bt in ipairs(sizes) do vocab.runs[s] = step(1, bt, V2, opt) end
  end
  local fit = M.fit(sizes, runs, vocab)
  fit.sizes, fit.runs = sizes, runs
  return fit
end

-- a + b, row by row (counts of two parts of one step)
function M.merge(a, b)
  local res = { rows = {}, order = {}, host_s = a.host_s + b.host_s, flops_per_token = a.flops_per_token,
                tokens = a.tokens, params = a.params }
  for _, r in ipairs({ a, b }) do
    for _, n in ipairs(r.order) do
      local x = res.rows[n]
      if not x then
        x = { launches = 0, flops = 0, read = 0, written = 0 }
        res.rows[n] = x
        res.order[#res.order + 1] = n
      end
      for _, f in ipairs(FIELDS) do x[f] = x[f] + r.rows[n][f] end
    end
  end
  return res
end

-- the trainer's extra arguments with the vocabulary V (nil: the recipe's)
function M.with_vocab(extra, V)
  if not V then return extra end
  local e = { '--vocab_size=' .. V }
  for _, a in ipairs(extra or {}) do e[#e + 1] = a end
  return e
end

-- Multi-tensor kernels (one launch over a table of every parameter: AdamW,
-- the gradient norm's partial sums) round each tensor's share to blocks and
-- the table and partial-sum buffers to 32-byte sectors, so their bytes are
-- linear in the sizes only to within a sector or two; the check allows them
-- that much (SEGMENT_SLACK bytes) and nothing more.
M.SEGMENT_ROUNDED = { '^adamw_multi', '^sumsq_multi', '^sumsq_final' }
M.SEGMENT_SLACK = 64
local function segment_rounded(name)
  for _, p in ipairs(M.SEGMENT_ROUNDED) do if name:match(p) then return true end end
  return false
end

-- Largest relative difference between the fit's prediction at (L, B, T) and
-- a direct count there, over every row and field (0 when exact), and where;
-- and the direct count.
function M.check(model, fit, L, B, T, extra, V)
  local direct = M.count_step(model, L, B, T, M.with_vocab(extra, V))
  local pred = fit.predict(L, B, T, nil, V)
  local worst, where = 0, 'none'
  local names = {}
  for _, n in ipairs(fit.names) do names[n] = true end
  for _, n in ipairs(direct.order) do names[n] = true end
  for n in pairs(names) do
    for _, f in ipairs(FIELDS) do
      local d = direct.rows[n] and direct.rows[n][f] or 0
      local p = pred[n] and pred[n][f] or 0
      local rel = math.abs(d - p) / math.max(math.abs(d), 1)
      if segment_rounded(n) and (f == 'read' or f == 'written') and math.abs(d - p) <= M.SEGMENT_SLACK then rel = 0 end
      if rel > worst then worst, where = rel, ('%s %s: counted %.0f, extrapolated %.0f'):format(n, f, d, p) end
    end
  end
  return worst, where, direct
end

-- ------------------------------------------------------------------ the table
-- time of a row's work: roofline (efficiency 1) or predicted
local function row_time(r, dev, eff, name)
  local ceff = 1
  if eff then ceff = name and name:match('^cublasLt') and eff.cublaslt or eff.own end
  local peak = name and name:match('^cublasLt 8F_') and (dev.fp8_flops or dev.flops) or dev.flops
  local tc = r.flops / (peak * ceff)
  local tm = (r.read + r.written) / (dev.bw * (eff and eff.mem or 1))
  return math.max(tc, tm), tc >= tm and 'compute' or 'memory'
end

-- "cuBLASLt 65% of peak, own tensor-core kernels 40%, memory-bound 75% of bandwidth, 2.0 us per launch"
function M.describe_efficiency(e)
  return ('cuBLASLt %.0f%% of peak, own tensor-core kernels %.0f%%, memory-bound %.0f%% of bandwidth, %.1f us per '
          .. 'launch'):format(e.cublaslt * 100, e.own * 100, e.mem * 100, e.gap_us)
end

-- Predicted step time, tokens/s, MFU (full attention term) and MFU (causal
-- half) of rows under one efficiency table.  info: tokens, flops_per_token,
-- attn_flops_per_token (the 12*L*C*T term of flops_per_token; 0 if unknown).
function M.predict(rows, names, info, eff, dev)
  dev = dev or M.H100
  local t, launches = 0, 0
  for _, n in ipairs(names) do
    local r = rows[n]
    if r and r.launches > 0.5 and n:sub(1, #M.SYNC) ~= M.SYNC then
      t = t + row_time(r, dev, eff, n)
      launches = launches + r.launches
    end
  end
  local step = t + launches * eff.gap_us * 1e-6
  local tps = info.tokens / step
  local causal = info.flops_per_token - (info.attn_flops_per_token or 0) / 2
  return { step_s = step, tps = tps, mfu = tps * info.flops_per_token / dev.flops, mfu_causal = tps * causal / dev.flops }
end

local function short(name, w)
  if #name <= w then return name end
  return name:sub(1, w - 3) .. '...'
end

-- Prints the table and the summary for rows (name -> counts); returns the
-- summary numbers.  info: { tokens, flops_per_token, layer_rows (one
-- layer's rows, for the activation passes), act_bytes (one (B,T,C) bf16
-- activation), host_s, host_note }
function M.report(rows, order, info, out)
  out = out or print
  local dev = M.H100
  local tables = info.efficiency or M.EFFICIENCY
  local eff = tables.central
  out(('%-58s %8s %10s %10s %10s %8s %11s %s'):format('kernel', 'launches', 'GFLOP', 'MB read', 'MB written',
                                                   'FLOP/B', 'roofline us', 'bound'))
  local tot = { launches = 0, flops = 0, read = 0, written = 0, roof = 0, pred = 0 }
  local list = {}
  for _, n in ipairs(order) do
    local r = rows[n]
    if r and r.launches > 0.5 and n:sub(1, #M.SYNC) ~= M.SYNC then list[#list + 1] = n end
  end
  table.sort(list, function(a, b) return row_time(rows[a], dev) > row_time(rows[b], dev) end)
  for _, n in ipairs(list) do
    local r = rows[n]
    local roof, bound = row_time(r, dev)
    local pred = row_time(r, dev, eff, n)
    tot.launches, tot.flops = tot.launches + r.launches, tot.flops + r.flops
    tot.read, tot.written = tot.read + r.read, tot.written + r.written
    tot.roof, tot.pred = tot.roof + roof, tot.pred + pred
    local bytes = r.read + r.written
    out(('%-58s %8.0f %10.2f %10.2f %10.2f %8.1f %11.1f %s'):format(short(n, 58), r.launches, r.flops / 1e9,
      r.read / 1e6, r.written / 1e6, bytes > 0 and r.flops / bytes or 0, roof * 1e6, bound))
  end
  out(('%-58s %8.0f %10.2f %10.2f %10.2f %8.1f %11.1f'):format('total', tot.launches, tot.flops / 1e9,
    tot.read / 1e6, tot.written / 1e6, tot.flops / math.max(tot.read + tot.written, 1), tot.roof * 1e6))
  local c = M.predict(rows, list, info, eff, dev)
  local step, tps, mfu = c.step_s, c.tps, c.mfu
  local s = { roof_s = tot.roof, step_s = step, tps = tps, mfu = mfu, mfu_causal = c.mfu_causal,
              launches = tot.launches, flops = tot.flops, bytes = tot.read + tot.written, range = {} }
  out(('lower bound (every launch at its roofline on an %s, %.0f TFLOP/s, %.2f TB/s): %.2f ms/step'):format(
    dev.name, dev.flops / 1e12, dev.bw / 1e12, tot.roof * 1e3))
  out('prediction (not a measurement) assumes: each kernel overlaps its compute and memory traffic perfectly, no '
      .. 'tail effects, no host time on the critical path; efficiencies (recipes/tools/account.lua, M.EFFICIENCY):')
  for _, k in ipairs(M.EFFICIENCY_ORDER) do
    local e = tables[k]
    local p = M.predict(rows, list, info, e, dev)
    s.range[k] = p
    out(('  %-11s %s: %.2f ms/step, %.0f tokens/s, MFU %.1f%% (causal half %.1f%%)'):format(k, M.describe_efficiency(e),
      p.step_s * 1e3, p.tps, p.mfu * 100, p.mfu_causal * 100))
  end
  out(('model FLOPs/token %.3g (train.lua), counted FLOPs/token %.3g (GEMMs and tensor-core kernels)'):format(
    info.flops_per_token, tot.flops / info.tokens))
  if info.layer_rows then
    local lb = 0
    for n, r in pairs(info.layer_rows) do if not M.is_gemm(n) then lb = lb + r.read + r.written end end
    s.passes = lb / info.act_bytes
    out(('activation passes per layer: %.1f (one layer\'s bytes in kernels other than the GEMMs (cuBLASLt, gemm_mma) that grow with the '
         .. 'tokens, forward and backward, / one (B,T,C) bf16 activation of %.1f MB)'):format(s.passes,
         info.act_bytes / 1e6))
  end
  local nsync, parts = 0, {}
  for _, k in ipairs(order) do
    local r = rows[k]
    if k:sub(1, #M.SYNC) == M.SYNC and r and r.launches > 0.5 then
      nsync = nsync + r.launches
      parts[#parts + 1] = ('%s %.0f'):format(k:sub(#M.SYNC + 1), r.launches)
    end
  end
  s.syncs = nsync
  out(('host syncs per step: %.0f (%s)'):format(nsync, #parts > 0 and table.concat(parts, ', ') or 'none'))
  out(('launches per step: %.0f'):format(tot.launches))
  if info.host_s then
    s.host_s = info.host_s
    out(('host time per step: %.1f ms (%s)'):format(info.host_s * 1e3, info.host_note or 'outside device work'))
  end
  local lo, hi = s.range.pessimistic, s.range.optimistic
  out(('predicted (central; range pessimistic..optimistic): %.0f tokens/s (%.0f..%.0f), MFU %.1f%% (%.1f..%.1f%%) '
       .. 'with the full attention term, %.1f%% (%.1f..%.1f%%) with the causal half as llm.c counts')
      :format(tps, lo.tps, hi.tps, mfu * 100, lo.mfu * 100, hi.mfu * 100, c.mfu_causal * 100, lo.mfu_causal * 100,
              hi.mfu_causal * 100))
  return s
end

-- ------------------------------------------------------------------ the command
-- `bench_cuda.lua --account [--model=NAME] [--check=1]`: the eight counted
-- steps, the table at the model's full size, and (check) the extrapolation
-- against a direct count at L=3, B=3, T=3*T0.
function M.main(opts, out)
  out = out or print
  io.stdout:setvbuf('line')  -- the counting takes minutes: show each step as it is counted
  if opts.decode == 1 then return dofile(gl.root .. '/recipes/tools/account_decode.lua').main(opts, out) end
  local model = M.MODELS[opts.model]
  if not model then
    local names = {}
    for k in pairs(M.MODELS) do names[#names + 1] = k end
    table.sort(names)
    error(('account: --model expected one of %s, got %s'):format(table.concat(names, ', '), tostring(opts.model)), 0)
  end
  local recipe = dofile(gl.root .. '/recipes/' .. model.recipe .. '.lua')
  out(('account: %s, one training step (B=%d, T=%d, %d layers, AdamW%s, bf16 with fp32 master weights and '
       .. 'optimizer state), counted by the CUDA simulator'):format(opts.model, model.B, model.T, model.layers,
       recipe.optimizer == 'nanochat' and ' + Muon' or ''))
  if model.Vs then
    out(('counting L=1,2 layers at (B,T) = (1,%d), (2,%d), (1,%d), (2,%d), real width, vocabulary %d, and L=1 at '
         .. 'the same sizes with vocabulary %d; each kernel\'s counts fitted as out + L*layer, each a + b*N + c*N*T '
         .. '+ d*T (N = B*T), out\'s coefficients linear in the vocabulary, and evaluated at the full size and '
         .. 'vocabulary %d (every count is the simulator\'s; only the vocabulary and the size are extrapolated)')
        :format(model.T0, model.T0, 2 * model.T0, 2 * model.T0, model.Vs[1], model.Vs[2], model.V))
  else
    out(('counting L=1,2 layers at (B,T) = (1,%d), (2,%d), (1,%d), (2,%d), real width and vocabulary; each '
         .. 'kernel\'s counts fitted as out + L*layer, each a + b*N + c*N*T + d*T (N = B*T), and evaluated at the '
         .. 'full size'):format(model.T0, model.T0, 2 * model.T0, 2 * model.T0))
  end
  -- the quick mode: cuBLASLt products counted from their descriptors and
  -- not computed (spec/cudasim/account.cpp); the counts are the same
  -- (spec/account_spec.lua), the run many times shorter
  if opts.quick ~= 0 then assert(M.library()).gl_sim_account_skip_products(1) end
  local fit = M.measure(model, nil, out)
  if opts.check == 1 then
    -- (a multiple of the attention tile, 64: flash attention computes its
    -- diagonal tiles whole, so its work is the fit's polynomial only there)
    local T = 3 * model.T0
    local V = model.Vs and (model.Vs[1] + model.Vs[2]) * 3 / 4 or nil  -- a third vocabulary between them
    local worst, where = M.check(model, fit, 3, 3, T, nil, V)
    out(('extrapolation check at L=3 B=3 T=%d%s against a direct count: largest relative difference %.2g (%s)')
        :format(T, V and (' V=' .. V) or '', worst, where))
  end
  local ref = fit.runs[2][4]
  local rows = fit.predict(model.layers, model.B, model.T, nil, model.V)
  local summary = M.report(rows, fit.names, {
    tokens = model.B * model.T, flops_per_token = M.flops_per_token(model, fit),
    attn_flops_per_token = 12 * model.layers * model.C * model.T,
    layer_rows = fit.predict(model.layers, model.B, model.T, 'layer tokens', model.V),
    act_bytes = model.B * model.T * model.C * 2,
    host_s = ref.host_s,
    host_note = ('measured in the simulator at L=2 B=2 T=%d: Lua, engine and the simulated runtime\'s API calls, '
                 .. 'device work excluded'):format(2 * model.T0) }, out)
  if opts.save == 1 then
    M.save_prediction(opts.model, model, summary)
    out('saved the prediction in ' .. M.PREDICTIONS)
  end
  return summary
end

-- ------------------------------------------------------------------ kept predictions
-- `--save=1` keeps a model's predicted range (tokens/s and MFU, each
-- pessimistic, central, optimistic) in M.PREDICTIONS, with the
-- configuration and the commit it was counted at; `make gpu-check`
-- (recipes/tools/gpu_check.lua) compares what a GPU measures with it, since
-- counting takes longer than the check may.
M.PREDICTIONS = gl.root .. '/recipes/tools/account_predictions.json'

local function read_predictions()
  local f = io.open(M.PREDICTIONS, 'rb')
  if not f then return {} end
  local s = f:read('*a')
  f:close()
  local ok, t = pcall(require('cjson').decode, s)
  if not ok or type(t) ~= 'table' then error('account: ' .. M.PREDICTIONS .. ' is not JSON: ' .. tostring(t), 0) end
  return t
end

function M.save_prediction(name, model, s)
  local all = read_predictions()
  local p = io.popen('cd ' .. gl.root .. ' && git rev-parse --short HEAD 2>/dev/null')
  local commit = p:read('*l')
  p:close()
  local e = { B = model.B, T = model.T, layers = model.layers, device = M.H100.name, commit = commit,
              tokens_per_s = {}, mfu = {} }
  for _, k in ipairs(M.EFFICIENCY_ORDER) do
    e.tokens_per_s[k], e.mfu[k] = s.range[k].tps, s.range[k].mfu
  end
  all[name] = e
  local tmp = M.PREDICTIONS .. '.tmp'
  local f = assert(io.open(tmp, 'wb'))
  f:write(require('cjson').encode(all), '\n')
  f:close()
  assert(os.rename(tmp, M.PREDICTIONS))
end

-- a model's kept prediction, or nil and why
function M.load_prediction(name)
  local e = read_predictions()[name]
  if not e then return nil, ('no prediction for %s in %s (bench_cuda.lua --account --model=%s --save=1)'):format(
    name, M.PREDICTIONS, name) end
  return e
end

-- The full-size model's FLOPs per token (as bench.lua's MFU uses), from the
-- counted models' (models/common.lua: 6 * non-lookup parameters + 12 *
-- n_layer * n_embd * T; each layer adds the same parameters; counted at a
-- vocabulary V1, the head adds C parameters per token of the real V more).
function M.flops_per_token(model, fit)
  local r1, r2, C, T0 = fit.runs[1][1], fit.runs[2][1], model.C, fit.sizes[1][2]
  local np1 = (r1.flops_per_token - 12 * 1 * C * T0) / 6
  local np2 = (r2.flops_per_token - 12 * 2 * C * T0) / 6
  local head = fit.vocab and (model.V - fit.vocab.V1) * C or 0
  return 6 * (np1 + (model.layers - 1) * (np2 - np1) + head) + 12 * model.layers * C * model.T
end

return M
