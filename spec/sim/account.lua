-- spec/sim/account.lua — the worker of spec/account_spec.lua: runs in the
-- simulator's account flavour (build/sim-account/gptlua, GL_SIM_SMS=2) and
-- prints what it counted next to an independent count, one "KEY counted
-- expected" line each, for the spec to compare.
--   build/sim-account/gptlua spec/sim/account.lua ops|step|extrapolation|quick|fp8
local gl = require 'gptlua'
local acc = dofile(gl.root .. '/recipes/tools/account.lua')
local lib = gl.lib
local what = ...

local function say(key, counted, expected) print(('%s %.17g %.17g'):format(key, counted, expected)) end
local function row(res, pattern)
  local r = { launches = 0, flops = 0, read = 0, written = 0 }
  for _, n in ipairs(res.order) do
    if n:match(pattern) then
      for k in pairs(r) do r[k] = r[k] + res.rows[n][k] end
    end
  end
  return r
end
local DEV = { device = 'cuda', dtype = 'bfloat16', seed = 1 }

if what == 'ops' then
  -- single kernels: their bytes are the sizes of the tensors they read and
  -- write (sizes multiples of 32 bytes, so sectors add nothing)
  local N, C = 96, 256
  local x, y = gl.randn({ N, C }, DEV), gl.randn({ N, C }, DEV)
  local out = gl.empty({ N, C }, DEV)
  local res = acc.count(function() gl.check(lib.gl_binary(lib.GL_B_ADD, out.c, x.c, y.c)) end)
  local r = row(res, '^binary')
  say('add.launches', r.launches, 1)
  say('add.read', r.read, 2 * N * C * 2)
  say('add.written', r.written, N * C * 2)
  res = acc.count(function() gl.check(lib.gl_unary(lib.GL_U_GELU_TANH, out.c, x.c, 0, 0)) end)
  r = row(res, '^unary')
  say('gelu.read', r.read, N * C * 2)
  say('gelu.written', r.written, N * C * 2)
  local w, b = gl.randn({ C }, DEV), gl.randn({ C }, DEV)
  local mean, rstd = gl.empty({ N }, { device = 'cuda', dtype = 'float32' }), gl.empty({ N }, { device = 'cuda', dtype = 'float32' })
  res = acc.count(function() gl.check(lib.gl_layernorm_forward(out.c, mean.c, rstd.c, x.c, w.c, b.c, 1e-5)) end)
  r = row(res, '^norm_forward')
  say('layernorm.read', r.read, N * C * 2 + 2 * C * 2)
  say('layernorm.written', r.written, N * C * 2 + 2 * N * 4)
  -- the residual add fused with the norm: x and r read once, s and y written once, one launch
  local s2 = gl.empty({ N, C }, DEV)
  res = acc.count(function()
    gl.check(lib.gl_add_norm_forward(s2.c, out.c, mean.c, rstd.c, x.c, y.c, w.c, b.c, 1e-5, 1))
  end)
  r = row(res, '^add_norm')
  say('add_norm.launches', r.launches, 1)
  say('add_norm.all_launches', row(res, '.').launches, 1)
  say('add_norm.read', r.read, 2 * N * C * 2 + 2 * C * 2)
  say('add_norm.written', r.written, 2 * N * C * 2 + 2 * N * 4)
  -- a matrix product: 2mnk, and each operand once
  local K, M2 = 128, 160
  local a, bm = gl.randn({ N, K }, DEV), gl.randn({ K, M2 }, DEV)
  local d = gl.empty({ N, M2 }, DEV)
  res = acc.count(function() gl.check(lib.gl_matmul(d.c, a.c, bm.c, 1, 0)) end)
  r = row(res, '^cublasLt')
  say('matmul.flops', r.flops, 2 * N * K * M2)
  say('matmul.read', r.read, (N * K + K * M2) * 2)
  say('matmul.written', r.written, N * M2 * 2)
  -- the MLP's fusions (gl_matmul_epilogue): GELU, GELU' with the bias
  -- gradient, and a bias gradient ride in the product: one cuBLASLt launch,
  -- no kernel of their own
  local aux, bv, bm2 = gl.empty({ N, M2 }, DEV), gl.empty({ M2 }, DEV), gl.empty({ K }, DEV)
  local dw = gl.empty({ K, M2 }, DEV)
  for _, e in ipairs({
    { 'gelu', function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_GELU, d.c, a.c, bm.c, bv.c, aux.c)) end },
    { 'dgelu', function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_DGELU, d.c, a.c, bm.c, bv.c, aux.c)) end },
    { 'bgrad', function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_BGRAD, dw.c, a:t().c, d.c, bm2.c, nil)) end },
  }) do
    res = acc.count(e[2])
    local other = 0
    for _, n in ipairs(res.order) do if not n:match('^cublasLt') then other = other + res.rows[n].launches end end
    say('epilogue_' .. e[1] .. '.gemm_launches', row(res, '^cublasLt').launches, 1)
    say('epilogue_' .. e[1] .. '.other_launches', other, 0)
  end
  -- nanochat's ReLU² MLP in our own GEMM (kernels/gemm_mma.cu): h =
  -- relu(x W1^T)^2 one launch reading x and W1 once and writing h once (pre
  -- never stored); dpre = (g W2) 2 sqrt(h) one launch reading g, W2 and h
  -- once and writing dpre once; 2mnk tensor-core FLOPs each (tile multiples:
  -- no padded work)
  local Mr, Cr, Hr = 128, 64, 256
  local xr, w1r = gl.randn({ Mr, Cr }, DEV), gl.randn({ Hr, Cr }, DEV)
  local hr, gr, w2r, dr = gl.empty({ Mr, Hr }, DEV), gl.randn({ Mr, Cr }, DEV), gl.randn({ Cr, Hr }, DEV),
    gl.empty({ Mr, Hr }, DEV)
  res = acc.count(function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, hr.c, xr.c, w1r:t().c, nil, nil)) end)
  r = row(res, '^gemm_mma')
  say('relu2.all_launches', row(res, '.').launches, 1)
  say('relu2.launches', r.launches, 1)
  say('relu2.flops', r.flops, 2 * Mr * Hr * Cr)
  say('relu2.read', r.read, (Mr * Cr + Hr * Cr) * 2)
  say('relu2.written', r.written, Mr * Hr * 2)
  res = acc.count(function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dr.c, gr.c, w2r.c, nil, hr.c)) end)
  r = row(res, '^gemm_mma')
  say('drelu2.all_launches', row(res, '.').launches, 1)
  say('drelu2.launches', r.launches, 1)
  say('drelu2.flops', r.flops, 2 * Mr * Hr * Cr)
  say('drelu2.read', r.read, (Mr * Cr + Cr * Hr + Mr * Hr) * 2)
  say('drelu2.written', r.written, Mr * Hr * 2)
  -- the account's quick mode (products not computed) counts the same
  local was = lib.gl_sim_account_skip_products(1)
  res = acc.count(function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_DRELU2, dr.c, gr.c, w2r.c, nil, hr.c)) end)
  lib.gl_sim_account_skip_products(was)
  local q = row(res, '^gemm_mma')
  say('drelu2_quick.flops', q.flops, r.flops)
  say('drelu2_quick.read', q.read, r.read)
  say('drelu2_quick.written', q.written, r.written)
  -- tile edges (M, N, K not multiples of 128, 128, 32): still 2mnk, not
  -- the padded tiles' work, so the account's fit in B·T stays exact
  local Me, Ce, He = 72, 40, 136
  local xe, w1e, he = gl.randn({ Me, Ce }, DEV), gl.randn({ He, Ce }, DEV), gl.empty({ Me, He }, DEV)
  res = acc.count(function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, he.c, xe.c, w1e:t().c, nil, nil)) end)
  say('relu2_edges.launches', row(res, '^gemm_mma').launches, 1)
  say('relu2_edges.flops', row(res, '^gemm_mma').flops, 2 * Me * He * Ce)
  was = lib.gl_sim_account_skip_products(1)
  res = acc.count(function() gl.check(lib.gl_matmul_epilogue(lib.GL_EPI_RELU2, he.c, xe.c, w1e:t().c, nil, nil)) end)
  lib.gl_sim_account_skip_products(was)
  say('relu2_edges_quick.flops', row(res, '^gemm_mma').flops, 2 * Me * He * Ce)
  -- a residual added in the product (gl_matmul_add: cuBLASLt's C != D): one
  -- launch reading a, b and c once, no kernel of its own
  local c = gl.randn({ N, M2 }, DEV)
  res = acc.count(function() gl.check(lib.gl_matmul_add(d.c, a.c, bm.c, c.c)) end)
  say('matmul_add.gemm_launches', row(res, '^cublasLt').launches, 1)
  say('matmul_add.all_launches', row(res, '.').launches, 1)
  say('matmul_add.read', row(res, '^cublasLt').read, (N * K + K * M2 + N * M2) * 2)
  -- rotary + QK-norm (gl_rope_rmsnorm_forward): x and the tables read once, y
  -- and the per-row rstd written once, one launch; its backward reads dy and x
  local H, D = 2, 128
  local q, qy = gl.randn({ 1, N, H, D }, DEV), gl.empty({ 1, N, H, D }, DEV)
  local cs, sn = gl.randn({ N, D / 2 }, DEV), gl.randn({ N, D / 2 }, DEV)
  local qr = gl.empty({ 1, N, H }, { device = 'cuda', dtype = 'float32' })
  res = acc.count(function() gl.check(lib.gl_rope_rmsnorm_forward(qy.c, qr.c, q.c, cs.c, sn.c, 1e-6)) end)
  say('rope_norm.all_launches', row(res, '.').launches, 1)
  say('rope_norm.read', row(res, '.').read, N * H * D * 2 + 2 * N * D / 2 * 2)
  say('rope_norm.written', row(res, '.').written, N * H * D * 2 + N * H * 4)
  res = acc.count(function() gl.check(lib.gl_rope_rmsnorm_backward(qy.c, q.c, x:view(1, N, H, D).c, cs.c, sn.c, qr.c)) end)
  say('rope_norm_backward.read', row(res, '.').read, 2 * N * H * D * 2 + 2 * N * D / 2 * 2 + N * H * 4)
  say('rope_norm_backward.written', row(res, '.').written, N * H * D * 2)
  -- a value read back: one copy to the host and the host's waits
  res = acc.count(function() return d:sum():item() end)
  r = row(res, '^' .. acc.SYNC)
  say('item.syncs_at_least', math.min(r.launches, 1), 1)
  return
end

-- a tiny GPT-2: width 64, one head of 64 (the flash attention path), 512
-- tokens, no biases (the bias gradients' column sums, narrower than 512,
-- would split over blocks differently at each counted size: see
-- recipes/tools/account.lua's M.measure)
local tiny = { recipe = 'gpt2_124m', B = 8, T = 256, layers = 4, C = 64, T0 = 64, opt_by_context = true,
               args = acc.MODELS.gpt2_124m.args }
local extra = { '--n_embd=64', '--n_head=1', '--vocab_size=512', '--bias=false' }

if what == 'step' then
  -- one training step: the GEMMs' FLOPs are 2mnk from the model's shapes,
  -- three products (forward, dX, dW) per linear layer (the lm_head is wte),
  -- plus at most one per output element (an epilogue: a product that
  -- accumulates into a gradient adds C)
  local L, B, T, C, V = 2, 2, 128, 64, 512
  local res = acc.count_step(tiny, L, B, T, extra)
  local N = B * T
  local linears = { { C, 3 * C, L }, { C, C, L }, { C, 4 * C, L }, { 4 * C, C, L }, { C, V, 1 } }
  local mnk, outputs = 0, 0
  for _, l in ipairs(linears) do
    local i, o, n = l[1], l[2], l[3]
    mnk = mnk + n * 3 * 2 * N * i * o
    outputs = outputs + n * (N * o + N * i + i * o)
  end
  local r = row(res, '^cublasLt')
  print(('gemm: counted %.0f FLOPs, 2mnk %.0f, output elements %.0f'):format(r.flops, mnk, outputs))
  say('gemm.flops_2mnk_plus_epilogue', (r.flops >= mnk and r.flops - mnk <= outputs) and 1 or 0, 1)
  say('gemm.launches', r.launches, 3 * (4 * L + 1))
  -- every counted row's bytes are whole sectors
  local odd = 0
  for _, n in ipairs(res.order) do
    local x = res.rows[n]
    if n:sub(1, #acc.SYNC) ~= acc.SYNC and not n:match('^cuda') and (x.read % 32 ~= 0 or x.written % 32 ~= 0) then
      odd = odd + 1
    end
  end
  say('rows_with_partial_sectors', odd, 0)
  return
end

if what == 'extrapolation' then
  local fit = acc.measure(tiny, extra)
  local worst, where, direct = acc.check(tiny, fit, 3, 3, 128, extra)
  print('worst ' .. where)
  local pred = fit.predict(3, 3, 128)
  for _, n in ipairs(direct.order) do
    for _, f in ipairs({ 'launches', 'flops', 'read', 'written' }) do
      local d, p = direct.rows[n][f], pred[n] and pred[n][f] or 0
      if math.abs(d - p) > 1e-9 * math.max(1, math.abs(d)) then print(('differs: %s %s %.0f %.0f'):format(n, f, d, p)) end
    end
  end
  -- every row, the embedding lookup's included (no token repeats in a
  -- counted batch: its rows read are the tokens')
  say('extrapolation.max_rel_error', worst, 0)
  -- at L=3 B=3 T=128: the token lookup reads N = 384 rows of 64 bf16 and
  -- their int64 ids, the position lookup T rows and T ids (random tokens,
  -- 384 drawn from 512, would share about a third of their rows)
  local lookup = row(direct, '^embedding_forward')
  local N, T, C = 3 * 128, 128, 64
  say('extrapolation.lookup_no_repeat_read', lookup.read, (N + T) * (C * 2 + 8))
  return
end

if what == 'quick' then
  -- the quick mode (products counted from their descriptors, not computed)
  -- counts what the computing mode counts, row for row, on a step of each
  -- optimizer: GPT-2 (AdamW) and nanochat (Muon's Newton-Schulz, whose
  -- normalisation and the clip read what the products wrote)
  local nano = { recipe = 'nanochat_d20', T0 = 64,
                 args = function(L) return { '--depth=0', '--n_layer=' .. L, '--n_embd=128', '--n_head=2' } end }
  for _, m in ipairs({ { 'gpt2', tiny, extra }, { 'nanochat', nano, { '--vocab_size=512' } } }) do
    local counts = {}
    for q = 0, 1 do
      lib.gl_sim_account_skip_products(q)
      counts[q] = acc.count_step(m[2], 2, 2, 64, m[3])
    end
    lib.gl_sim_account_skip_products(0)
    local differ, rows = 0, 0
    for _, n in ipairs(counts[0].order) do
      rows = rows + 1
      for _, f in ipairs({ 'launches', 'flops', 'read', 'written' }) do
        local a, b = counts[0].rows[n][f], counts[1].rows[n] and counts[1].rows[n][f]
        if a ~= b then differ = differ + 1; print(('differs: %s %s %s %.0f %s'):format(m[1], n, f, a, tostring(b))) end
      end
    end
    for _, n in ipairs(counts[1].order) do
      if not counts[0].rows[n] then differ = differ + 1; print(('only in the quick mode: %s %s'):format(m[1], n)) end
    end
    print(('%s: %d rows'):format(m[1], rows))
    say('quick.' .. m[1] .. '.differing_counts', differ, 0)
    say('quick.' .. m[1] .. '.has_products', counts[1].rows['cublasLt 16BF NN'] and 1 or 0, 1)
  end
  return
end

if what == 'fp8' then
  -- an FP8 linear layer forward and backward (gl.fp8_linear, kernels/fp8.cu)
  -- counted against recipes/tools/account_fp8.lua's work for the layer: the
  -- quantize passes, the FP8 products and (rowwise) the scale passes.  The
  -- account counts 4-byte words (amax, a scale) in 32-byte sectors; sizes
  -- here make every other size a whole number of sectors
  local F8 = dofile(gl.root .. '/recipes/tools/account_fp8.lua')
  local N, K, P = 64, 64, 96
  lib.gl_sim_account_skip_products(1)
  for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
    local x = gl.randn({ N, K }, DEV):requires_grad_()
    local W = gl.randn({ P, K }, DEV):requires_grad_()
    local g = gl.randn({ N, P }, DEV)
    local res = acc.count(function() gl.fp8_linear(x, W, recipe):backward(g) end)
    local work = F8.layer_work({ n_in = K, n_out = P }, N, recipe)
    local want = { read = 0, written = 0, launches = 0, flops = 0 }
    local function add(r, words_read, words_written)
      want.read = want.read + r.read + words_read * (32 - 4)
      want.written = want.written + r.written + words_written * (32 - 4)
      want.launches, want.flops = want.launches + r.launches, want.flops + r.flops
    end
    for _, r in ipairs(work.added) do
      -- tensorwise quantize: the amax word read twice, written by amax, the
      -- scale written by the cast (the memset's 4 bytes are counted as such)
      if r.name == 'quantize' then add(r, recipe == 'tensorwise' and 2 or 0, recipe == 'tensorwise' and 2 or 0)
      else add(r, 0, 0) end
    end
    local got = { read = 0, written = 0, launches = 0, flops = 0 }
    for _, n in ipairs(res.order) do
      if n:match('^fp8_') or n:match('^cublasLt 8F') or (recipe == 'tensorwise' and n == 'cudaMemsetAsync') then
        for k in pairs(got) do got[k] = got[k] + res.rows[n][k] end
      end
    end
    for _, k in ipairs({ 'launches', 'flops', 'read', 'written' }) do say(('fp8.%s.%s'):format(recipe, k), got[k], want[k]) end
  end
  return
end

error('spec/sim/account.lua: expected ops, step, extrapolation, quick or fp8, got ' .. tostring(what), 0)
