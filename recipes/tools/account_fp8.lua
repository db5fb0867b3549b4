-- recipes/tools/account_fp8.lua — what FP8 products are worth: the dense
-- account's bf16 prediction for GPT-2 124M and nanochat d20 on one H100 SXM
-- (recipes/tools/account.lua, counted by the simulator, kept in
-- account_predictions.json) turned into an FP8 one by arithmetic, for
-- --fp8=tensorwise and --fp8=rowwise as gptlua runs them:
--
--   build/gptlua recipes/tools/account_fp8.lua [--model=gpt2_124m|nanochat_d20|all]
--
-- The layers are the precision policy's (gptlua.fp8, the model built on the
-- meta device): every nn.Linear of the blocks but the first and the last.
-- For each such layer (n_in K, n_out P, N = B*T tokens) the step loses its
-- three bf16 products (forward x W^T, input gradient dy W, weight gradient
-- dy^T x: 2 N K P FLOPs each, bf16 operands and result) and gains what
-- ops_fp8.lua and kernels/fp8.cu run instead:
--   - the three products on FP8 operands (1 byte an element) at the FP8
--     tensor-core peak (1979 TFLOP/s dense, account.lua's H100), result in
--     bf16 (tensorwise: cuBLASLt scales it itself) or in a float32
--     temporary that a scale pass reads and writes as bf16 (rowwise: sm_90's
--     cuBLASLt takes no per-row scales);
--   - two quantizations per product, one per operand, each reading the bf16
--     operand and writing its FP8 copy and scales: tensorwise a zeroed amax
--     word, an amax pass and a cast pass (three launches, the operand read
--     twice), rowwise one pass per row (one launch, read once);
--   - the epilogues the bf16 products fuse and FP8 products do not: the
--     bias (added after the product, its gradient a column sum) and the
--     activation after the MLP's first matrix (GPT-2's GELU on cuBLASLt's
--     epilogue, nanochat's ReLU^2 in gemm_mma.cu), forward and backward, as
--     separate passes.  The bf16 side is charged nothing for them (its
--     epilogue's extra reads are small), so FP8 is charged slightly more than
--     it costs.
-- Each of these is timed as the dense account times a launch: max(FLOPs /
-- (efficiency x peak), bytes / (efficiency x bandwidth)) plus the gap per
-- launch, under the same pessimistic, central and optimistic tables
-- (account.lua's M.EFFICIENCY); the FP8 products get cuBLASLt's efficiency.
-- MFU stays against the bf16 peak (the model's FLOPs are the same).
-- A prediction, not a measurement.
local gl = require 'gptlua'
local meta = require 'gptlua.meta'
local account = dofile(gl.root .. '/recipes/tools/account.lua')

local M = {}

M.RECIPES = { 'tensorwise', 'rowwise' }
M.S = 2  -- bytes of a bf16 element: activations, weights and gradients
-- how each family's bf16 MLP fuses its activation into its products, and
-- which engine runs them there: GPT-2's GELU on cuBLASLt's epilogue (the
-- first matrix's forward, the second's input gradient); nanochat's ReLU^2
-- on gemm_mma.cu (the same two products, "our own" efficiency)
M.FUSED = {
  gpt2 = { activation = 'gelu', engine = 'cublaslt' },
  nanochat = { activation = 'relu2', engine = 'own' },
}

-- ------------------------------------------------------------------ work by hand
-- One operand's quantization (R x C, bf16 in): { read, written, launches }.
-- tensorwise: cudaMemsetAsync of the amax word (4 bytes), the amax pass
-- (reads the operand, folds into the word with atomicMax: reads and writes
-- it) and the cast pass (reads the operand and the word, writes R*C bytes
-- and one scale); rowwise: one pass (reads the operand, writes R*C bytes
-- and one scale per row).  The simulator's count of kernels/fp8.cu is the
-- same, but for rounding each 4-byte word up to its 32-byte sector.
function M.quantize(R, C, recipe)
  local n = R * C
  if recipe == 'tensorwise' then
    return { read = 2 * M.S * n + 8, written = 4 + 4 + n + 4, launches = 3 }
  end
  return { read = M.S * n, written = n + 4 * R, launches = 1 }
end

-- One FP8 product out (m x n) = a (m x k) b (n x k)^T: the product row
-- { flops, read, written, launches } (its operands once, as the account
-- counts cuBLASLt's) and, rowwise, the scale pass's
local function fp8_product(m, n, k, recipe)
  local prod = { kind = 'fp8', flops = 2 * m * n * k, read = m * k + n * k, written = M.S * m * n, launches = 1 }
  if recipe == 'tensorwise' then return prod end
  prod.written = 4 * m * n
  local scale = { kind = 'mem', flops = 0, read = 4 * m * n + 4 * m + 4 * n, written = M.S * m * n, launches = 1 }
  return prod, scale
end

-- the three products of a linear layer (K in, P out, N tokens) as
-- { name, m, n, k, a = {R, C}, b = {R, C} }: the operands FP8 quantizes
local function products(K, P, N)
  return {
    { name = 'forward', m = N, n = P, k = K, a = { N, K }, b = { P, K } },
    { name = 'input gradient', m = N, n = K, k = P, a = { N, P }, b = { K, P } },
    { name = 'weight gradient', m = P, n = K, k = N, a = { P, N }, b = { K, N } },
  }
end

-- The work one chosen layer takes out of the bf16 step and adds to the FP8
-- one: { removed = rows, added = rows }, rows { name, kind, flops, read,
-- written, launches }; kind: 'cublaslt' / 'own' (bf16 products), 'fp8',
-- 'mem'.  layer: { n_in, n_out, bias, activation (after this layer, or
-- nil), engines = { forward = , ['input gradient'] = } (bf16 engine where
-- not cuBLASLt) }.
function M.layer_work(layer, N, recipe)
  local K, P = layer.n_in, layer.n_out
  local removed, added = {}, {}
  for _, p in ipairs(products(K, P, N)) do
    removed[#removed + 1] = { name = 'bf16 ' .. p.name, kind = (layer.engines or {})[p.name] or 'cublaslt',
                              flops = 2 * p.m * p.n * p.k, read = M.S * (p.m * p.k + p.n * p.k),
                              written = M.S * p.m * p.n, launches = 1 }
    local prod, scale = fp8_product(p.m, p.n, p.k, recipe)
    prod.name = 'fp8 ' .. p.name
    added[#added + 1] = prod
    if scale then scale.name = 'scale pass ' .. p.name; added[#added + 1] = scale end
    for _, op in ipairs({ p.a, p.b }) do
      local q = M.quantize(op[1], op[2], recipe)
      added[#added + 1] = { name = 'quantize', kind = 'mem', flops = 0, read = q.read, written = q.written,
                            launches = q.launches }
    end
  end
  if layer.bias then
    -- y + bias (read y and the bias, write y); its gradient: dy's column sum
    added[#added + 1] = { name = 'bias add', kind = 'mem', flops = 0, read = M.S * (N * P + P), written = M.S * N * P,
                          launches = 1 }
    added[#added + 1] = { name = 'bias gradient', kind = 'mem', flops = 0, read = M.S * N * P, written = M.S * P,
                          launches = 1 }
  end
  if layer.activation then
    -- forward: read the pre-activation, write the activation; backward:
    -- read the pre-activation and the gradient, write the gradient
    added[#added + 1] = { name = layer.activation .. ' forward', kind = 'mem', flops = 0, read = M.S * N * P,
                          written = M.S * N * P, launches = 1 }
    added[#added + 1] = { name = layer.activation .. ' backward', kind = 'mem', flops = 0, read = 2 * M.S * N * P,
                          written = M.S * N * P, launches = 1 }
  end
  return { removed = removed, added = added }
end

-- a row's time: account.lua's roofline of one launch under an efficiency table
function M.row_time(r, eff, dev)
  dev = dev or account.H100
  local tc = 0
  if r.flops > 0 then
    local peak = r.kind == 'fp8' and dev.fp8_flops or dev.flops
    tc = r.flops / (peak * (r.kind == 'own' and eff.own or eff.cublaslt))
  end
  return math.max(tc, (r.read + r.written) / (dev.bw * eff.mem))
end

local function sum_time(rows, eff, dev)
  local t, launches = 0, 0
  for _, r in ipairs(rows) do t, launches = t + M.row_time(r, eff, dev), launches + r.launches end
  return t + launches * eff.gap_us * 1e-6, launches
end

-- ------------------------------------------------------------------ the models
-- The model of account.MODELS[name] at its full size, built on the meta
-- device: the precision policy's layers (n_in, n_out, bias, the MLP's
-- activation and bf16 engines) and FLOPs per token (train.lua's)
function M.model_facts(name)
  local m = account.MODELS[name]
  local args = { '--device=cpu', '--dtype=bfloat16', '--block_size=' .. m.T }
  for _, a in ipairs(m.args(m.layers)) do args[#args + 1] = a end
  return meta.run(function()
    local tc = require 'gptlua.train_config'
    local cfg = tc.resolve_config(dofile(gl.root .. '/recipes/' .. m.recipe .. '.lua'), args)
    local model = tc.build_model(cfg)
    local fused = M.FUSED[cfg.model]
    if not fused then error(('account_fp8: no fused epilogues known for model family %s'):format(cfg.model), 0) end
    local chosen, first, last = require('gptlua.fp8').choose(model)
    if not chosen then error('account_fp8: ' .. first, 0) end
    -- the MLP's two matrices: its activation follows c_fc, whose forward
    -- (and c_proj's input gradient, the activation's backward) fuse it in bf16
    local role = {}
    for i = first, last do
      local mlp = model.transformer.h[i].mlp
      role[mlp.c_fc], role[mlp.c_proj] = 'fc', 'proj'
    end
    local layers, fp8_weights = {}, 0
    for _, l in ipairs(chosen) do
      local layer = { n_in = l.n_in, n_out = l.n_out, bias = l.bias ~= nil }
      if role[l] == 'fc' then
        layer.activation = fused.activation
        if fused.engine ~= 'cublaslt' then layer.engines = { forward = fused.engine } end
      elseif role[l] == 'proj' and fused.engine ~= 'cublaslt' then
        layer.engines = { ['input gradient'] = fused.engine }
      end
      layers[#layers + 1] = layer
      fp8_weights = fp8_weights + l.n_in * l.n_out
    end
    return { name = name, family = cfg.model, B = m.B, T = m.T, N = m.B * m.T, n_layer = cfg.n_layer, C = cfg.n_embd,
             vocab = cfg.vocab_size, layers = layers, first = first, last = last, fp8_weights = fp8_weights,
             flops_per_token = model:flops_per_token(m.T) }
  end)
end

-- The FP8 prediction under one efficiency table from the bf16 step time:
-- { step_s, tps, mfu, products_s (the bf16 products' time saved, net of the
-- FP8 products'), passes_s (quantize, scale, unfused epilogues), launches }.
-- products_only: the bound where every added pass is fused away (the FP8
-- products alone replace the bf16 ones).
function M.predict(facts, bf16_step_s, recipe, eff, dev, products_only)
  dev = dev or account.H100
  local removed, added = {}, {}
  for _, l in ipairs(facts.layers) do
    local w = M.layer_work(l, facts.N, recipe)
    for _, r in ipairs(w.removed) do removed[#removed + 1] = r end
    for _, r in ipairs(w.added) do
      if r.kind == 'fp8' or not products_only then added[#added + 1] = r end
    end
  end
  local t_removed, l_removed = sum_time(removed, eff, dev)
  local t_added, l_added = sum_time(added, eff, dev)
  local prods, passes = {}, {}
  for _, r in ipairs(added) do if r.kind == 'fp8' then prods[#prods + 1] = r else passes[#passes + 1] = r end end
  local step = bf16_step_s - t_removed + t_added
  local tps = facts.N / step
  return { step_s = step, tps = tps, mfu = tps * facts.flops_per_token / dev.flops,
           products_s = t_removed - sum_time(prods, eff, dev), passes_s = sum_time(passes, eff, dev),
           launches = l_added - l_removed }
end

-- the FP8 products' share of the model's FLOPs: 6 N K P per chosen layer
function M.fp8_flops_share(facts)
  return 6 * facts.fp8_weights / facts.flops_per_token
end

-- ------------------------------------------------------------------ the table
local function fmt_int(v)
  local s = ('%.0f'):format(v)
  return (s:reverse():gsub('(%d%d%d)', '%1,'):reverse():gsub('^,', ''))
end

-- one model's rows: bf16 (the kept counted prediction) and each recipe
function M.rows(name)
  local pred, why = account.load_prediction(name)
  if not pred then error('account_fp8: ' .. why, 0) end
  local facts = M.model_facts(name)
  local rows = { { precision = 'bf16', range = {} } }
  for _, k in ipairs(account.EFFICIENCY_ORDER) do
    local tps = pred.tokens_per_s[k]
    rows[1].range[k] = { tps = tps, mfu = tps * facts.flops_per_token / account.H100.flops, step_s = facts.N / tps }
  end
  for _, recipe in ipairs(M.RECIPES) do
    local row = { precision = 'fp8 ' .. recipe, range = {} }
    for _, k in ipairs(account.EFFICIENCY_ORDER) do
      row.range[k] = M.predict(facts, rows[1].range[k].step_s, recipe, account.EFFICIENCY[k])
    end
    rows[#rows + 1] = row
  end
  local bound = { precision = 'fp8 products alone (bound)', range = {} }
  for _, k in ipairs(account.EFFICIENCY_ORDER) do
    bound.range[k] = M.predict(facts, rows[1].range[k].step_s, 'tensorwise', account.EFFICIENCY[k], nil, true)
  end
  rows[#rows + 1] = bound
  return rows, facts, pred
end

-- Per distinct layer shape: the central time one layer's FP8 products save
-- and the time its added passes take (ms), for a recipe
function M.by_shape(facts, recipe)
  local eff, seen, out = account.EFFICIENCY.central, {}, {}
  for _, l in ipairs(facts.layers) do
    local key = ('%dx%d'):format(l.n_in, l.n_out)
    if not seen[key] then
      seen[key] = true
      local w = M.layer_work(l, facts.N, recipe)
      local prods, passes = {}, {}
      for _, r in ipairs(w.added) do if r.kind == 'fp8' then prods[#prods + 1] = r else passes[#passes + 1] = r end end
      out[#out + 1] = { shape = key, layer = l, saved_s = sum_time(w.removed, eff) - sum_time(prods, eff),
                        passes_s = sum_time(passes, eff) }
    end
  end
  return out
end

M.TITLES = { gpt2_124m = 'GPT-2 124M', nanochat_d20 = 'nanochat d20' }

function M.report(names, out)
  out = out or print
  local dev = account.H100
  out(('FP8 account: predicted, not measured; one %s (bf16 %.0f, FP8 %.0f TFLOP/s dense, %.2f TB/s); the bf16 rows are '
       .. 'the counted account\'s kept prediction (recipes/tools/account_predictions.json), the FP8 rows that step with '
       .. 'the policy\'s layers moved to FP8 by arithmetic (recipes/tools/account_fp8.lua says how); ranges are '
       .. 'account.lua\'s pessimistic..optimistic efficiency tables; MFU against the bf16 peak'):format(dev.name,
       dev.flops / 1e12, dev.fp8_flops / 1e12, dev.bw / 1e12))
  out('')
  out('| model, step | precision | predicted tokens/s: central (range) | predicted MFU: central (range) | vs bf16 (central) |')
  out('| --- | --- | --- | --- | --- |')
  local all = {}
  for _, name in ipairs(names) do
    local rows, facts = M.rows(name)
    all[name] = { rows = rows, facts = facts }
    local base = rows[1].range.central.tps
    for _, r in ipairs(rows) do
      local lo, c, hi = r.range.pessimistic, r.range.central, r.range.optimistic
      out(('| %s, B %d x T %d | %s | %s (%s..%s) | %.1f%% (%.1f..%.1f%%) | %.2fx |'):format(M.TITLES[name] or name,
        facts.B, facts.T, r.precision, fmt_int(c.tps), fmt_int(lo.tps), fmt_int(hi.tps), 100 * c.mfu, 100 * lo.mfu,
        100 * hi.mfu, c.tps / base))
    end
  end
  out('')
  for _, name in ipairs(names) do
    local a = all[name]
    local f = a.facts
    out(('%s: FP8 runs %d linear layers (blocks %d-%d of %d, %.1fM weights), %.1f%% of the model\'s FLOPs; '
         .. 'bf16 keeps blocks 1 and %d\'s %d linear layers, the head, the embeddings, the norms and attention\'s '
         .. 'products'):format(M.TITLES[name] or name, #f.layers, f.first, f.last, f.n_layer, f.fp8_weights / 1e6,
              100 * M.fp8_flops_share(f), f.n_layer, 2 * #f.layers / (f.last - f.first + 1)))
    for _, recipe in ipairs(M.RECIPES) do
      local parts = {}
      for _, x in ipairs(M.by_shape(f, recipe)) do
        parts[#parts + 1] = ('%s%s %.3f - %.3f = %+.3f ms'):format(x.shape,
          x.layer.activation and (' + ' .. x.layer.activation) or '', x.saved_s * 1e3, x.passes_s * 1e3,
          (x.saved_s - x.passes_s) * 1e3)
      end
      out(('  per layer, %s (central; products\' saving - added passes): %s'):format(recipe, table.concat(parts, '; ')))
    end
    for i = 2, #a.rows - 1 do
      local c = a.rows[i].range.central
      out(('  %-15s central: products %.2f ms faster, quantize/scale/epilogue passes %.2f ms, %+d launches, step %.2f '
           .. 'ms (bf16 %.2f ms)'):format(a.rows[i].precision, c.products_s * 1e3, c.passes_s * 1e3, c.launches,
           c.step_s * 1e3, a.rows[1].range.central.step_s * 1e3))
    end
  end
  out('what stays bf16, and why: the first and last blocks and the head, where FP8 rounding costs the most loss '
      .. '(the policy\'s choice, torchtitan\'s and modded-nanogpt\'s habit); attention\'s score and value products '
      .. '(flash attention, our own kernel, has no FP8 path); the embeddings (lookups) and the norms (no products)')
  out('assumes: the bf16 prediction\'s own assumptions (account.lua), FP8 products at cuBLASLt\'s efficiency of the FP8 '
      .. 'peak, the bf16 epilogues\' fused bytes free, every added pass at the memory efficiency')
  return all
end

function M.main(argv, out)
  local model = 'all'
  for _, a in ipairs(argv or {}) do
    local v = a:match('^%-%-model=(.+)$')
    if not v then error('account_fp8: unknown argument ' .. a .. ' (--model=gpt2_124m|nanochat_d20|all)', 0) end
    model = v
  end
  local names = { 'gpt2_124m', 'nanochat_d20' }
  if model ~= 'all' then
    if not account.MODELS[model] then
      error(('account_fp8: --model expected gpt2_124m, nanochat_d20 or all, got %s'):format(model), 0)
    end
    names = { model }
  end
  M.report(names, out)
  return 0
end

if arg and arg[0] and arg[0]:match('account_fp8%.lua$') then
  local argv = {}
  for i = 1, #arg do argv[i] = arg[i] end
  return M.main(argv)   -- (an exit status: a table would be trained as a recipe)
end

return M
