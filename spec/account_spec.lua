-- The byte-and-FLOP account (spec/cudasim/account.cpp, recipes/tools/account.lua,
-- `recipes/tools/bench_cuda.lua --account`): what the simulator counts equals an
-- independent count (kernels' bytes = the sizes of the tensors they read and
-- write; the GEMMs' FLOPs = 2mnk from the model's shapes), and the
-- extrapolation from small counted steps equals a direct count at another
-- size.  The counting runs in the account flavour (build/sim-account/gptlua,
-- `make sim-account`) with GL_SIM_SMS=2, in a subprocess (spec/sim/account.lua).
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local S = require 'support.mpi'

local EXE = S.ROOT .. '/build/sim-account/gptlua'

-- runs the worker; returns { key = { counted, expected } } and the output
local function worker(what, limit)
  local out, rc = S.sh(('env GL_SIM_SMS=2 %s spec/sim/account.lua %s'):format(EXE, what), limit)
  assert(rc == 0, ('spec/sim/account.lua %s exited %s:\n%s'):format(what, tostring(rc), out))
  local got = {}
  for key, c, e in out:gmatch('([%w_%.]+) (%S+) (%S+)\n') do got[key] = { tonumber(c), tonumber(e) } end
  return got, out
end

local function expect_all(got, out, keys)
  for _, k in ipairs(keys) do
    assert(got[k], 'no ' .. k .. ' in the output:\n' .. out)
    assert.are.equal(got[k][2], got[k][1], k)
  end
end

describe('cuda-sim account: bytes, FLOPs, syncs of each launch #cuda #sim', function()
  it('is built (make sim-account)', function()
    local f = io.open(EXE, 'rb')
    assert(f, EXE .. ' is missing: make sim-account')
    f:close()
  end)

  it('counts a kernel\'s bytes as the sizes of the tensors it reads and writes, a GEMM as 2mnk', function()
    local got, out = worker('ops', 120)
    expect_all(got, out, { 'add.launches', 'add.read', 'add.written', 'gelu.read', 'gelu.written',
                           'layernorm.read', 'layernorm.written', 'matmul.flops', 'matmul.read', 'matmul.written',
                           'item.syncs_at_least', 'epilogue_gelu.gemm_launches', 'epilogue_gelu.other_launches',
                           'epilogue_dgelu.gemm_launches', 'epilogue_dgelu.other_launches',
                           'epilogue_bgrad.gemm_launches', 'epilogue_bgrad.other_launches', 'add_norm.launches',
                           'add_norm.all_launches', 'add_norm.read', 'add_norm.written',
                           'matmul_add.gemm_launches', 'matmul_add.all_launches', 'matmul_add.read',
                           'rope_norm.all_launches', 'rope_norm.read', 'rope_norm.written',
                           'rope_norm_backward.read', 'rope_norm_backward.written',
                           'relu2.all_launches', 'relu2.launches', 'relu2.flops', 'relu2.read', 'relu2.written',
                           'drelu2.all_launches', 'drelu2.launches', 'drelu2.flops', 'drelu2.read', 'drelu2.written',
                           'drelu2_quick.flops', 'drelu2_quick.read', 'drelu2_quick.written',
                           'relu2_edges.launches', 'relu2_edges.flops', 'relu2_edges_quick.flops' })
  end)

  it('counts a training step\'s GEMM FLOPs as the model\'s shapes give them', function()
    local got, out = worker('step', 300)
    expect_all(got, out, { 'gemm.flops_2mnk_plus_epilogue', 'gemm.launches', 'rows_with_partial_sectors' })
  end)

  it('extrapolates exactly: the fit of eight small steps equals a direct count at a ninth size', function()
    local got, out = worker('extrapolation', 600)
    assert(got['extrapolation.max_rel_error'], out)
    assert(got['extrapolation.max_rel_error'][1] < 1e-9, out)
    -- the embedding lookup included: no token repeats in a counted batch
    expect_all(got, out, { 'extrapolation.lookup_no_repeat_read' })
  end)

  it('counts the same with the products skipped (the quick mode) as with them computed', function()
    local got, out = worker('quick', 300)
    expect_all(got, out, { 'quick.gpt2.differing_counts', 'quick.gpt2.has_products',
                           'quick.nanochat.differing_counts', 'quick.nanochat.has_products' })
  end)

  it('counts an FP8 layer\'s quantize passes, products and scale passes as account_fp8.lua writes them', function()
    local got, out = worker('fp8', 120)
    local keys = {}
    for _, recipe in ipairs({ 'tensorwise', 'rowwise' }) do
      for _, f in ipairs({ 'launches', 'flops', 'read', 'written' }) do keys[#keys + 1] = ('fp8.%s.%s'):format(recipe, f) end
    end
    expect_all(got, out, keys)
  end)

  it('is one command from any engine, which hands it to the account flavour', function()
    local out, rc = S.sh(S.EXE .. ' recipes/tools/bench_cuda.lua --account --model=gpt3', 120)
    assert.are_not.equal(0, rc)
    assert.matches('account: %-%-model expected one of gpt2_124m, nanochat_d20, got gpt3', out)
  end)

  it('counts a decode step\'s launches in the trace: a fixed number per layer, any width', function()
    local gl = require 'gptlua'
    local dec = dofile(gl.root .. '/recipes/tools/account_decode.lua')
    for _, B in ipairs({ 1, 8 }) do
      local n1, n2, n3 = dec.count_decode_launches(1, B), dec.count_decode_launches(2, B), dec.count_decode_launches(3, B)
      assert.is_true(n2 - n1 > 0, ('batch %d: %d, %d'):format(B, n1, n2))
      assert.are.equal(n2 - n1, n3 - n2, ('batch %d: %d, %d, %d launches at 1, 2, 3 layers'):format(B, n1, n2, n3))
    end
  end)

  it('refuses to count in a build whose kernels are not instrumented', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    local lib, why = acc.library()
    assert.is_nil(lib)
    assert.matches('make sim%-account', why)
  end)
end)

-- The fit's arithmetic alone (no simulator): counts made up from known
-- coefficients come back exactly, including the vocabulary-linear part
-- that nanochat d20's account uses (counted at V = 1024 and 2048,
-- evaluated at 65536).
describe('account fit: out + L*layer over (B, T), out linear in the vocabulary', function()
  it('recovers made-up counts exactly at another size, depth and vocabulary', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    -- a kernel whose bytes are out = (5 + 3N + 0.5NT + 7T) + V (11 + 2N), layer = 13 + 17N + 0.25NT + 19T
    -- and an embedding lookup at its no-repeat count (a 64-byte row and an
    -- 8-byte id per token, the same at every V: acc.distinct_tokens)
    local EMB = 'embedding_forward_kernel<U>'
    local function count(L, B, T, V)
      local N = B * T
      local v = (5 + 3 * N + 0.5 * N * T + 7 * T) + V * (11 + 2 * N) + L * (13 + 17 * N + 0.25 * N * T + 19 * T)
      local e = 72 * N
      return { rows = { k = { launches = L + 1, flops = 0, read = v, written = 2 * v },
                        [EMB] = { launches = 1, flops = 0, read = e, written = 0 } }, order = { 'k', EMB } }
    end
    local sizes = { { 1, 64 }, { 2, 64 }, { 1, 128 }, { 2, 128 } }
    local runs, vocab = { {}, {} }, { V1 = 1024, V2 = 2048, runs = {} }
    for L = 1, 2 do for s, bt in ipairs(sizes) do runs[L][s] = count(L, bt[1], bt[2], 1024) end end
    for s, bt in ipairs(sizes) do vocab.runs[s] = count(1, bt[1], bt[2], 2048) end
    local fit = acc.fit(sizes, runs, vocab)
    local want = count(20, 32, 2048, 65536).rows.k
    local got = fit.predict(20, 32, 2048, nil, 65536).k
    for _, f in ipairs({ 'launches', 'read', 'written' }) do
      assert.is_true(math.abs(got[f] - want[f]) <= 1e-9 * want[f], ('%s: %.17g vs %.17g'):format(f, got[f], want[f]))
    end
    assert.has_error(function() fit.predict(20, 32, 2048) end, 'account: the fit is linear in the vocabulary; predict needs V')
    local emb = fit.predict(20, 32, 2048, nil, 65536)[EMB].read
    assert.is_true(math.abs(emb - 72 * 32 * 2048) <= 1e-6 * emb, 'embedding: ' .. emb)
    -- without a vocabulary the fit is the eight-step one (V fixed at the counted 1024)
    local fixed = acc.fit(sizes, runs).predict(20, 32, 2048).k
    assert.is_true(math.abs(fixed.read - count(20, 32, 2048, 1024).rows.k.read) <= 1e-9 * fixed.read)
  end)

  -- Random tokens repeat (384 of 512 share about a third of their rows), so
  -- an embedding lookup's count was not a function of the sizes, and its
  -- fit from a few hundred tokens per step bent to -78 MB at nanochat d20's
  -- 65,536.  The counted steps read tokens that do not repeat: the lookup
  -- is counted at its no-repeat bound, B*T rows.
  it('counts batches whose tokens do not repeat (the embedding lookup at its no-repeat bound)', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    for _, c in ipairs({ { 1, 1 }, { 385, 512 }, { 2305, 2305 }, { 577, 2304 } }) do
      local n, V = c[1], c[2]
      local ids, seen = acc.distinct_tokens(n, V), {}
      assert.are.equal(n, #ids)
      for _, id in ipairs(ids) do
        assert.is_true(id >= 0 and id < V and id == math.floor(id), ('id %s of %d'):format(tostring(id), V))
        assert.is_nil(seen[id], ('id %d repeats (n %d, V %d)'):format(id, n, V))
        seen[id] = true
      end
      assert.are.same(ids, acc.distinct_tokens(n, V))  -- reproducible
    end
    -- spread over the vocabulary, not its first n ids
    local high = 0
    for _, id in ipairs(acc.distinct_tokens(100, 65536)) do if id >= 32768 then high = high + 1 end end
    assert.is_true(high > 25 and high < 75, 'ids in the upper half: ' .. high)
    assert.has_error(function() acc.distinct_tokens(65537, 65536) end,
                     'account: 65537 tokens (B*T + 1) cannot all differ in a vocabulary of 65536')
  end)
end)

-- The prediction (no simulator): a range from the three named efficiency
-- tables, each computed by hand here from made-up rows, the assumptions
-- printed with it, MFU with the attention term whole and halved.
describe('account prediction: a range from named efficiency tables, assumptions printed', function()
  it('computes each table\'s step time as roofline / efficiency + launches * gap, and both MFUs', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    local H = acc.H100
    -- a cuBLASLt product (compute-bound), our flash attention (compute-bound), a norm (memory-bound)
    local rows = {
      ['cublasLt bf16 NT'] = { launches = 10, flops = 2e12, read = 1e8, written = 1e8 },
      ['flash_attention_forward<bf16>'] = { launches = 5, flops = 5e11, read = 1e7, written = 1e7 },
      ['layernorm_forward<bf16>'] = { launches = 20, flops = 0, read = 3e9, written = 1e9 },
    }
    local names = { 'cublasLt bf16 NT', 'flash_attention_forward<bf16>', 'layernorm_forward<bf16>' }
    local info = { tokens = 4096, flops_per_token = 7e8, attn_flops_per_token = 1e8 }
    local lines = {}
    local s = acc.report(rows, names, info, function(l) lines[#lines + 1] = l end)
    local text = table.concat(lines, '\n')
    for _, k in ipairs({ 'pessimistic', 'central', 'optimistic' }) do
      local e = acc.EFFICIENCY[k]
      local step = 2e12 / (H.flops * e.cublaslt) + 5e11 / (H.flops * e.own) + 4e9 / (H.bw * e.mem) + 35 * e.gap_us * 1e-6
      local p = s.range[k]
      assert.is_true(math.abs(p.step_s - step) < 1e-12 * step, k .. ': ' .. p.step_s .. ' vs ' .. step)
      assert.is_true(math.abs(p.mfu - 4096 / step * 7e8 / H.flops) < 1e-12, k)
      assert.is_true(math.abs(p.mfu_causal - 4096 / step * 6.5e8 / H.flops) < 1e-12, k)
      assert.matches(k .. ' +' .. acc.describe_efficiency(e):gsub('%p', '%%%0'), text)
    end
    assert.is_true(s.range.pessimistic.tps < s.tps and s.tps < s.range.optimistic.tps)
    assert.are.equal(s.range.central.tps, s.tps)
    assert.matches('prediction (not a measurement) assumes', text, 1, true)
    assert.matches('no tail effects, no host time', text, 1, true)
    assert.matches('with the causal half as llm.c counts', text, 1, true)
  end)

  it('times cuBLASLt\'s FP8 products against the FP8 peak (1979 TFLOP/s dense), MFU against bf16\'s', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    local H = acc.H100
    assert.are.equal(1979e12, H.fp8_flops)
    local rows = {
      ['cublasLt 8F_E4M3 TN'] = { launches = 4, flops = 4e12, read = 1e7, written = 1e7 },
      ['cublasLt 16BF NT'] = { launches = 2, flops = 1e12, read = 1e7, written = 1e7 },
    }
    local names = { 'cublasLt 8F_E4M3 TN', 'cublasLt 16BF NT' }
    local info = { tokens = 1024, flops_per_token = 5e9 }
    local e = acc.EFFICIENCY.central
    local p = acc.predict(rows, names, info, e)
    local step = 4e12 / (H.fp8_flops * e.cublaslt) + 1e12 / (H.flops * e.cublaslt) + 6 * e.gap_us * 1e-6
    assert.is_true(math.abs(p.step_s - step) < 1e-12 * step, p.step_s .. ' vs ' .. step)
    assert.is_true(math.abs(p.mfu - 1024 / step * 5e9 / H.flops) < 1e-12)
  end)

  it('the central table is the published efficiencies: cuBLASLt 65%, our own kernels 40%, memory 75%, 2 us', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    assert.are.same({ cublaslt = 0.65, own = 0.40, mem = 0.75, gap_us = 2.0 }, acc.EFFICIENCY.central)
  end)
end)

-- The decode figure (recipes/tools/account_decode.lua; no simulator): GPT-2
-- 124M's bytes per step from its shapes, worked out here by hand, and the
-- step time per efficiency table as bytes / bandwidth + launches x gap.
describe('account decode prediction: memory-bound, a range from the efficiency tables', function()
  it('reads every weight once and each row\'s KV cache; tokens/s = B / (bytes / bandwidth + launches x gap)', function()
    local gl = require 'gptlua'
    local acc = dofile(gl.root .. '/recipes/tools/account.lua')
    local dec = dofile(gl.root .. '/recipes/tools/account_decode.lua')
    local m = dec.DECODE_MODELS.gpt2_124m
    -- 12 layers of 12 * 768^2 + 13 * 768 = 7,087,872 parameters, the tied head 50257 x 768, ln_f 2 x 768:
    -- 123,653,376 bf16 parameters
    local b1 = dec.decode_bytes(m, 1, 1024)
    assert.are.equal(2 * 123653376, b1.weights)
    assert.are.equal(2 * 2 * 12 * 1024 * 768, b1.kv_read)          -- K and V, 12 layers, 1024 positions, bf16
    local b8 = dec.decode_bytes(m, 8, 1024)
    assert.are.equal(b1.weights, b8.weights)                        -- the weights once per step, whatever the batch
    assert.are.equal(8 * b1.kv_read, b8.kv_read)
    assert.are.equal(8 * (b1.total - b1.weights), b8.total - b8.weights)
    local lines = {}
    local res = dec.decode_report('gpt2_124m', { 1, 8 }, { 1024 }, function(B) return B == 1 and 130 or 166 end,
      function(l) lines[#lines + 1] = l end)
    local text = table.concat(lines, '\n')
    for _, r in ipairs(res) do
      for _, k in ipairs(acc.EFFICIENCY_ORDER) do
        local e = acc.EFFICIENCY[k]
        local step = dec.decode_bytes(m, r.B, r.ctx).total / (acc.H100.bw * e.mem) + r.launches * e.gap_us * 1e-6
        assert.is_true(math.abs(r.p[k].step_s - step) <= 1e-12 * step, k)
        assert.is_true(math.abs(r.p[k].tps - r.B / step) <= 1e-9 * r.p[k].tps, k)
      end
      assert.is_true(r.p.pessimistic.tps < r.p.central.tps and r.p.central.tps < r.p.optimistic.tps)
    end
    -- batch 8 shares the weights' read: more tokens per second than batch 1, fewer than 8 times
    assert.is_true(res[2].p.central.tps > res[1].p.central.tps and res[2].p.central.tps < 8 * res[1].p.central.tps)
    assert.matches('prediction (not a measurement), memory-bound', text, 1, true)
    assert.matches('assumes no host time on the critical path', text, 1, true)
    assert.matches(('batch 1, context 1024: %.1f MB and 130 launches per step; predicted %.0f tokens/s (range %.0f..%.0f)')
      :format(b1.total / 1e6, res[1].p.central.tps, res[1].p.pessimistic.tps, res[1].p.optimistic.tps), text, 1, true)
  end)
end)
