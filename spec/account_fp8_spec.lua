-- The FP8 account (recipes/tools/account_fp8.lua): the work FP8 moves, by
-- hand for tiny shapes (FLOPs of the three products, bytes of each
-- operand's quantization and of the products, the unfused epilogues), the
-- policy's layers and FLOP share for GPT-2 124M (built on the meta device),
-- the step-time arithmetic against an independent sum, and the table.
local gl = require 'gptlua'

local F = dofile(gl.root .. '/recipes/tools/account_fp8.lua')
local acc = dofile(gl.root .. '/recipes/tools/account.lua')

local function sum(rows, pattern, field)
  local s = 0
  for _, r in ipairs(rows) do if r.name:match(pattern) then s = s + r[field] end end
  return s
end

describe('FP8 account: the work by hand', function()
  it('quantizes an operand: tensorwise reads it twice (amax, cast), rowwise once; FP8 bytes and scales written', function()
    -- 4 x 8 bf16: 64 bytes in, 32 FP8 bytes out
    assert.same({ read = 2 * 64 + 8, written = 4 + 4 + 32 + 4, launches = 3 }, F.quantize(4, 8, 'tensorwise'))
    assert.same({ read = 64, written = 32 + 4 * 4, launches = 1 }, F.quantize(4, 8, 'rowwise'))
  end)

  it('moves a layer\'s three products to FP8 with two quantized operands each, and unfuses bias and activation', function()
    -- K = 16 in, P = 32 out, N = 8 tokens, a bias and a GELU after it
    local layer = { n_in = 16, n_out = 32, bias = true, activation = 'gelu' }
    local flops = 3 * 2 * 8 * 16 * 32
    -- operands: forward x 8x16, W 32x16; input gradient dy 8x32, W^T 16x32;
    -- weight gradient dy^T 32x8, x^T 16x8: 1792 elements, 112 rows
    local elems, rows = 128 + 512 + 256 + 512 + 256 + 128, 8 + 32 + 8 + 16 + 32 + 16
    -- results: 8x32, 8x16, 32x16 = 896 elements
    local results = 256 + 128 + 512
    local t = F.layer_work(layer, 8, 'tensorwise')
    assert.equal(flops, sum(t.removed, '^bf16', 'flops'))
    assert.equal(flops, sum(t.added, '^fp8', 'flops'))
    assert.equal(2 * elems, sum(t.removed, '^bf16', 'read'))  -- each product's operands once, bf16
    assert.equal(2 * results, sum(t.removed, '^bf16', 'written'))
    assert.equal(4 * elems + 6 * 8, sum(t.added, '^quantize', 'read'))
    assert.equal(elems + 6 * 12, sum(t.added, '^quantize', 'written'))
    assert.equal(18, sum(t.added, '^quantize', 'launches'))
    assert.equal(elems, sum(t.added, '^fp8', 'read'))  -- the operands once, in FP8
    assert.equal(2 * results, sum(t.added, '^fp8', 'written'))
    assert.equal(0, sum(t.added, '^scale pass', 'launches'))
    -- bias: add (read y and b, write y), its gradient (read dy, write P in bf16)
    assert.equal(2 * (256 + 32) + 2 * 256, sum(t.added, '^bias', 'read'))
    assert.equal(2 * 256 + 2 * 32, sum(t.added, '^bias', 'written'))
    -- GELU on the 8x32 output: forward read + write, backward two reads + a write
    assert.equal(2 * 256 + 4 * 256, sum(t.added, '^gelu', 'read'))
    assert.equal(2 * 256 + 2 * 256, sum(t.added, '^gelu', 'written'))

    local r = F.layer_work(layer, 8, 'rowwise')
    assert.equal(flops, sum(r.added, '^fp8', 'flops'))
    assert.equal(2 * elems, sum(r.added, '^quantize', 'read'))
    assert.equal(elems + 4 * rows, sum(r.added, '^quantize', 'written'))
    assert.equal(6, sum(r.added, '^quantize', 'launches'))
    -- unscaled products into float32, then a pass scaling them into bf16
    assert.equal(elems, sum(r.added, '^fp8', 'read'))
    assert.equal(4 * results, sum(r.added, '^fp8', 'written'))
    assert.equal(4 * results + 4 * rows, sum(r.added, '^scale pass', 'read'))
    assert.equal(2 * results, sum(r.added, '^scale pass', 'written'))
    assert.equal(3, sum(r.added, '^scale pass', 'launches'))
  end)

  it('runs the policy\'s layers for GPT-2 124M: blocks 2-11, four matrices each, half the model\'s FLOPs', function()
    local f = F.model_facts('gpt2_124m')
    assert.equal(40, #f.layers)
    assert.equal(2, f.first); assert.equal(11, f.last)
    assert.equal(10 * (768 * 2304 + 768 * 768 + 768 * 3072 + 3072 * 768), f.fp8_weights)
    assert.equal(65536, f.N)
    local acts, biased = 0, 0
    for _, l in ipairs(f.layers) do
      if l.activation then acts = acts + 1; assert.equal('gelu', l.activation); assert.equal(3072, l.n_out) end
      if l.bias then biased = biased + 1 end
      assert.is_nil(l.engines)  -- GPT-2's bf16 products are all cuBLASLt's
    end
    assert.equal(10, acts); assert.equal(40, biased)
    -- train.lua's FLOPs per token: 6 x non-lookup parameters + 12 L C T
    assert.near(6 * f.fp8_weights / f.flops_per_token, F.fp8_flops_share(f), 1e-15)
    assert.is_true(F.fp8_flops_share(f) > 0.49 and F.fp8_flops_share(f) < 0.50, F.fp8_flops_share(f))
  end)

  it('marks nanochat\'s gemm_mma products (ReLU^2 fused) as our own kernels in bf16', function()
    local f = F.model_facts('nanochat_d20')
    assert.equal(108, #f.layers)
    local own = {}
    for _, l in ipairs(f.layers) do
      for p, e in pairs(l.engines or {}) do own[('%dx%d %s %s'):format(l.n_in, l.n_out, p, e)] = true end
    end
    assert.same({ ['1280x5120 forward own'] = true, ['5120x1280 input gradient own'] = true }, own)
  end)
end)

describe('FP8 account: the step', function()
  it('is the bf16 step less the bf16 products plus the FP8 work, each launch at its roofline', function()
    local e, H = acc.EFFICIENCY.central, acc.H100
    local K, N = 1024, 4096
    local facts = { N = N, flops_per_token = 1e9, layers = { { n_in = K, n_out = K } } }
    local F2 = 2 * N * K * K
    local function t(flops, peak, eff, bytes) return math.max(flops / (peak * eff), bytes / (H.bw * e.mem)) end
    -- the three bf16 products: (read, written) bytes
    local removed = t(F2, H.flops, e.cublaslt, 2 * (N * K + K * K) + 2 * N * K)
                  + t(F2, H.flops, e.cublaslt, 2 * (N * K + K * K) + 2 * N * K)
                  + t(F2, H.flops, e.cublaslt, 2 * (K * N + K * N) + 2 * K * K) + 3 * e.gap_us * 1e-6
    local added = t(F2, H.fp8_flops, e.cublaslt, (N * K + K * K) + 2 * N * K)
                + t(F2, H.fp8_flops, e.cublaslt, (N * K + K * K) + 2 * N * K)
                + t(F2, H.fp8_flops, e.cublaslt, (K * N + K * N) + 2 * K * K) + 3 * e.gap_us * 1e-6
    -- six operands, tensorwise: four N x K sized, two K x K
    for _, n in ipairs({ N * K, K * K, N * K, K * K, K * N, K * N }) do
      added = added + (5 * n + 20) / (H.bw * e.mem) + 3 * e.gap_us * 1e-6
    end
    local p = F.predict(facts, 1e-3, 'tensorwise', e)
    assert.near(1e-3 - removed + added, p.step_s, 1e-15)
    assert.near(N / p.step_s, p.tps, 1e-6)
    assert.near(p.tps * 1e9 / H.flops, p.mfu, 1e-12)
    assert.equal(18, p.launches)
    -- the bound: the FP8 products alone
    local b = F.predict(facts, 1e-3, 'tensorwise', e, nil, true)
    assert.equal(0, b.launches)
    assert.is_true(b.step_s < 1e-3 and b.step_s < p.step_s)
  end)

  it('prints the before/after table from the kept bf16 prediction, marked as a prediction', function()
    local lines = {}
    local all = F.report({ 'gpt2_124m' }, function(s) lines[#lines + 1] = s end)
    local text = table.concat(lines, '\n')
    assert.matches('predicted, not measured', text, 1, true)
    local kept = acc.load_prediction('gpt2_124m')
    local rows = all.gpt2_124m.rows
    assert.same({ 'bf16', 'fp8 tensorwise', 'fp8 rowwise', 'fp8 products alone (bound)' },
                { rows[1].precision, rows[2].precision, rows[3].precision, rows[4].precision })
    assert.equal(kept.tokens_per_s.central, rows[1].range.central.tps)
    for _, r in ipairs(rows) do
      assert.is_true(r.range.pessimistic.tps < r.range.central.tps and r.range.central.tps < r.range.optimistic.tps,
                     r.precision)
    end
    assert.matches('| GPT-2 124M, B 64 x T 1024 | fp8 rowwise | ', text, 1, true)
    assert.matches('what stays bf16, and why: the first and last blocks and the head', text, 1, true)
  end)

  it('refuses an unknown model or argument with one line', function()
    local ok, err = pcall(F.main, { '--model=gpt3' }, function() end)
    assert.is_false(ok)
    assert.equal('account_fp8: --model expected gpt2_124m, nanochat_d20 or all, got gpt3', err)
    ok, err = pcall(F.main, { '--fast' }, function() end)
    assert.is_false(ok)
    assert.equal('account_fp8: unknown argument --fast (--model=gpt2_124m|nanochat_d20|all)', err)
  end)
end)
