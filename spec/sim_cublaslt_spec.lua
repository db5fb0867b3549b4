-- The CUDA simulator's cuBLASLt (spec/cudasim/cublaslt.cpp, over OpenBLAS).
--
-- Through spec/cudasim/cases/cublaslt.cu and cublaslt_misuse.cu (build/sim/libgptlua_simtest.so):
-- every dtype / compute type, transpose, batch, leading dimension, offset,
-- alpha / beta and epilogue combination against a double-precision host
-- loop (the error relative to a bound from the operands' magnitudes must be
-- <= 1; with small-integer inputs the outputs must be the correctly rounded
-- values, bit for bit), writes outside D's layout, the refusals with their
-- status codes and messages, the attributes, and the faults the work
-- detects (in processes of their own: a sticky error ends the context).
-- Through the engine: with GL_SIM_CUBLASLT_NO_ALGO=1 the heuristic finds no
-- algorithm and kernels/matmul.cu's fallback GEMM kernel must take over
-- (spec/cuda_spec.lua covers the normal cuBLASLt path).
-- Runs only in the simulator build: `build/sim/gptlua spec/run.lua --tags=cuda spec/sim_cublaslt_spec.lua`.
local ffi = require 'ffi'
local S = require 'support.sim'
local simtest = S.lib

local sim_it = S.available() and it
  or function(name) pending(name .. ' (not a simulator build: no ' .. S.PATH .. ')') end

-- the real library's numbers
local R32F, R64F, R16F, R16BF = 0, 1, 2, 14
local C32F, C64F, FAST16F, FAST16BF, FASTTF32 = 68, 70, 74, 75, 77
local E = { DEFAULT = 1, RELU = 2, BIAS = 4, RELU_BIAS = 6, GELU = 32, GELU_AUX = 160, GELU_BIAS = 36,
            GELU_AUX_BIAS = 164, DGELU = 192, DGELU_BGRAD = 208, BGRADA = 256, BGRADB = 512 }
local OK, NOT_INITIALIZED, INVALID_VALUE, NOT_SUPPORTED = 0, 1, 7, 15
local TYPE_NAME = { [R32F] = 'f32', [R64F] = 'f64', [R16F] = 'f16', [R16BF] = 'bf16' }

-- one product; fields override the defaults
local function run(fields)
  local lib = simtest()  -- declares the structs
  local c = ffi.new('gl_simtest_lt_case')
  c.m, c.n, c.k, c.batch, c.bias_type, c.alpha, c.beta, c.seed, c.epilogue = 13, 7, 9, 1, -1, 1, 0, 1, E.DEFAULT
  for key, v in pairs(fields) do c[key] = v end
  local r = ffi.new('gl_simtest_lt_result')
  local rc = lib.gl_simtest_lt_run(c, r)
  return r, rc
end

local function describe_case(f)
  local parts = {}
  for key, v in pairs(f) do parts[#parts + 1] = key .. '=' .. tostring(v) end
  table.sort(parts)
  return '{' .. table.concat(parts, ' ') .. '}'
end

-- runs and requires: found, ran, within the bound, nothing outside written
local function check(fields)
  local r, rc = run(fields)
  local what = describe_case(fields)
  local msg = ffi.string(r.message)
  assert(rc == 0, what .. ': harness failed: ' .. msg)
  assert(r.heuristic_status == OK and r.found == 1,
         ('%s: heuristic status %d found %d: %s'):format(what, r.heuristic_status, r.found, msg))
  assert(r.matmul_status == OK, ('%s: cublasLtMatmul status %d: %s'):format(what, r.matmul_status, msg))
  assert(r.sync_error == 0, ('%s: stream error %d'):format(what, r.sync_error))
  assert(r.err <= 1, ('%s: D error %.3g times its bound'):format(what, r.err))
  assert(r.aux_err <= 1, ('%s: aux error %.3g times its bound'):format(what, r.aux_err))
  assert(r.bias_err <= 1, ('%s: bias gradient error %.3g times its bound'):format(what, r.bias_err))
  assert(r.outside == 0, ('%s: %d elements outside the layouts changed'):format(what, tonumber(r.outside)))
  assert(r.mismatches == 0, ('%s: %d outputs not correctly rounded'):format(what, tonumber(r.mismatches)))
  return r
end

-- A/B type, C/D type, compute type
local TYPES = {
  { R32F, R32F, C32F }, { R16BF, R16BF, C32F }, { R16BF, R32F, C32F }, { R16F, R16F, C32F }, { R16F, R32F, C32F },
  { R64F, R64F, C64F }, { R32F, R32F, FASTTF32 }, { R32F, R32F, FAST16BF }, { R32F, R32F, FAST16F },
}
local ALL_EPILOGUES = { 'DEFAULT', 'RELU', 'BIAS', 'RELU_BIAS', 'GELU', 'GELU_AUX', 'GELU_BIAS', 'GELU_AUX_BIAS',
                        'DGELU', 'DGELU_BGRAD', 'BGRADA', 'BGRADB' }
local F64_EPILOGUES = { 'DEFAULT', 'RELU', 'BIAS', 'RELU_BIAS' }

describe('simulated cuBLASLt: products against a double-precision loop #cuda #sim', function()
  sim_it('every type, transpose, batch, alpha / beta and epilogue', function()
    local n = 0
    for ti, t in ipairs(TYPES) do
      for _, en in ipairs(t[3] == C64F and F64_EPILOGUES or ALL_EPILOGUES) do
        for opa = 0, 1 do
          for opb = 0, 1 do
            for _, batch in ipairs({ 1, 3 }) do
              n = n + 1
              check { atype = t[1], dtype = t[2], compute = t[3], opa = opa, opb = opb, batch = batch,
                      m = 13, n = 7, k = 9 + ti, pad_a = 2, pad_b = 1, pad_c = 3, gap = batch > 1 and 5 or 0,
                      offset = n % 3, epilogue = E[en], alpha = n % 2 == 0 and 0.75 or -1.5,
                      beta = n % 4 < 2 and 0.5 or 0, bias_batched = n % 5 == 0 and 1 or 0, seed = n }
            end
          end
        end
      end
    end
  end)

  sim_it('16-bit outputs are the fp32 result rounded once to nearest even (bit exact)', function()
    -- small integers: every fp32 sum is exact, so the output must equal the
    -- correctly rounded exact value; large sums land on bf16 / fp16 ties,
    -- tiny alpha on fp16 subnormals, huge alpha on fp16 overflow
    for _, t in ipairs({ { R16BF, R16BF }, { R16F, R16F }, { R16BF, R32F }, { R16F, R32F }, { R32F, R32F }, { R64F, R64F } }) do
      local ct = t[1] == R64F and C64F or C32F
      for _, en in ipairs({ 'DEFAULT', 'RELU_BIAS', 'BGRADA', 'BGRADB' }) do
        if ct == C32F or en == 'DEFAULT' or en == 'RELU_BIAS' then
          for _, scale in ipairs({ { 2, 0.5 }, { 2 ^ -20, 0 }, { 4096, 1000 }, { 2 ^ -100, 0 } }) do
            check { atype = t[1], dtype = t[2], compute = ct, exact = 1, m = 11, n = 6, k = 40, batch = 2, opa = 1,
                    epilogue = E[en], alpha = scale[1], beta = scale[2], bias_batched = 1, seed = 7 }
          end
        end
      end
    end
  end)

  sim_it('FAST compute types round the fp32 inputs first', function()
    -- within the bound of the product of the rounded inputs, and visibly
    -- off the product of the fp32 inputs (fp32 itself is ~1e-7 off)
    for _, f in ipairs({ { FASTTF32, 1e-5 }, { FAST16BF, 1e-4 }, { FAST16F, 1e-5 } }) do
      local r = check { atype = R32F, dtype = R32F, compute = f[1], m = 20, n = 20, k = 64, seed = 3 }
      assert(r.fast_dev > f[2], ('compute type %d: deviation %.3g from the fp32-input product'):format(f[1], r.fast_dev))
    end
  end)

  sim_it('layouts: offsets, shared A, interleaved and in-place D, k = 0, m = 0, no algo, large', function()
    for _, t in ipairs(TYPES) do
      local base = { atype = t[1], dtype = t[2], compute = t[3] }
      local function with(extra)
        local f = {}
        for key, v in pairs(base) do f[key] = v end
        for key, v in pairs(extra) do f[key] = v end
        return f
      end
      for off = 1, 3 do check(with { offset = off, opb = 1, batch = 2, gap = 1 }) end  -- 2 / 4 / 8-byte aligned
      check(with { batch = 4, a_shared = 1, beta = 1 })             -- one A for every batch (stride 0)
      check(with { batch = 3, interleave_d = 1, beta = 1 })          -- (B, H, T, D) viewed as (B, T, H, D)
      check(with { batch = 3, in_place = 1, beta = -1, pad_d = 2 })  -- C == D
      check(with { k = 0, beta = 0.5 })                              -- D = beta C
      check(with { m = 0 })
      check(with { batch = 2, no_algo = 1, offset = 3, opa = 1 })   -- algo NULL: the library picks
      check(with { m = 130, n = 70, k = 200, opa = 1, beta = 0.25 })
    end
  end)
end)

describe('simulated cuBLASLt: refusals #cuda #sim', function()
  -- scenario, expected status, a fragment of the message
  local CASES = {
    { 'null_handle', NOT_INITIALIZED, 'is not a live cublasLtHandle_t' },
    { 'destroyed_handle', NOT_INITIALIZED, 'is not a live cublasLtHandle_t' },
    { 'null_desc', INVALID_VALUE, 'operationDesc (nil) is not a live descriptor' },
    { 'destroyed_layout', INVALID_VALUE, 'Bdesc' },
    { 'set_size', INVALID_VALUE, 'CUBLASLT_MATMUL_DESC_TRANSA: sizeInBytes 8, expected 4' },
    { 'get_size', INVALID_VALUE, 'CUBLASLT_MATRIX_LAYOUT_ROWS: sizeInBytes 4, expected 8' },
    { 'pref_size', INVALID_VALUE, 'CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: sizeInBytes 4, expected 8' },
    { 'bad_trans', INVALID_VALUE, '7 is not a cublasOperation_t' },
    { 'unknown_attr', NOT_SUPPORTED, 'attribute 6 is not simulated' },
    { 'dims', INVALID_VALUE, 'op(B) 3 x 5' },
    { 'dims_trans', INVALID_VALUE, 'op(A) is 4 x 6' },
    { 'ld_small', INVALID_VALUE, 'Adesc: ld 5, expected >= 6' },
    { 'batch_mismatch', INVALID_VALUE, 'batch counts A 2, B 1' },
    { 'types_mixed', NOT_SUPPORTED, 'CUDA_R_16BF inputs with CUDA_R_16F output' },
    { 'types_ab', NOT_SUPPORTED, 'must have one type' },
    { 'f64_with_32f_compute', NOT_SUPPORTED, 'CUDA_R_64F inputs with CUDA_R_64F output have no CUBLAS_COMPUTE_32F' },
    { 'f32_with_64f_compute', NOT_SUPPORTED, 'CUBLAS_COMPUTE_64F takes CUDA_R_64F matrices' },
    { 'compute_16f', NOT_SUPPORTED, 'CUBLAS_COMPUTE_16F (64) is not simulated' },
    { 'fast_bf16_inputs', NOT_SUPPORTED, 'CUBLAS_COMPUTE_32F_FAST_TF32 takes CUDA_R_32F' },
    { 'scale_type', NOT_SUPPORTED, 'scale type CUDA_R_64F' },
    { 'order_row', NOT_SUPPORTED, 'only CUBLASLT_ORDER_COL' },
    { 'pointer_mode', NOT_SUPPORTED, 'POINTER_MODE 1 is not simulated' },
    { 'requested_zero', INVALID_VALUE, 'requestedAlgoCount 0' },
    { 'align_promise', NOT_SUPPORTED, 'promised only 2-byte alignment' },
    { 'workspace_small', INVALID_VALUE, 'workspaceSizeInBytes 32768, the algorithm needs 65536' },
    { 'workspace_null', INVALID_VALUE, 'workspace is NULL' },
    { 'misaligned_a', NOT_SUPPORTED, 'is not 8-byte aligned' },
    { 'epilogue_64f', NOT_SUPPORTED, 'CUBLASLT_EPILOGUE_GELU with CUBLAS_COMPUTE_64F' },
    { 'epilogue_relu_aux', NOT_SUPPORTED, 'CUBLASLT_EPILOGUE_RELU_AUX' },
    { 'epilogue_unknown', INVALID_VALUE, '3 is not a cublasLtEpilogue_t' },
    { 'bias_type', NOT_SUPPORTED, 'bias of type CUDA_R_16BF with D CUDA_R_32F' },
    { 'bias_null', INVALID_VALUE, 'needs CUBLASLT_MATMUL_DESC_BIAS_POINTER' },
    { 'aux_ld', INVALID_VALUE, 'EPILOGUE_AUX_LD 12, expected a multiple of 8' },
    { 'bgrad_batch_stride', INVALID_VALUE, 'BIAS_BATCH_STRIDE 0, expected >= 5' },
    { 'd_overlap', INVALID_VALUE, "D's 3 batches overlap" },
    { 'inplace_layout', INVALID_VALUE, 'C == D (in place) with different layouts' },
    { 'algo_foreign', INVALID_VALUE, 'algo was not returned by cublasLtMatmulAlgoGetHeuristic' },
    { 'algo_other_types', INVALID_VALUE, 'algo was found for CUDA_R_32F' },
    { 'alpha_null', INVALID_VALUE, 'alpha or beta is NULL' },
    { 'c_null_with_beta', INVALID_VALUE, 'a matrix the product reads is NULL' },
  }
  sim_it('return the real library\'s status and say why', function()
    local buf = ffi.new('char[512]')
    for _, c in ipairs(CASES) do
      local st = simtest().gl_simtest_lt_refusal(c[1], buf, 512)
      local msg = ffi.string(buf)
      assert(st == c[2], ('%s: status %d, expected %d (%s)'):format(c[1], st, c[2], msg))
      assert(msg:find(c[3], 1, true), ('%s: message %q lacks %q'):format(c[1], msg, c[3]))
    end
  end)

  sim_it('attributes round-trip, report their sizes and defaults', function()
    local buf = ffi.new('char[512]')
    local rc = simtest().gl_simtest_lt_attributes(buf, 512)
    assert(rc == 0, ffi.string(buf))
  end)
end)

describe('simulated cuBLASLt: faults inside the work (sticky errors) #cuda #sim', function()
  local FAULTS = {
    { 'a_overrun', S.E.IllegalAddress, 'cublasLtMatmul: A at 0x', '728 past the end of its 4096-byte allocation' },
    { 'host_b', S.E.IllegalAddress, 'cublasLtMatmul: B at 0x', 'is not device memory' },
    { 'bias_misaligned', S.E.MisalignedAddress, 'cublasLtMatmul: bias vector at 0x', 'is not 16-byte aligned' },
    { 'workspace_host', S.E.IllegalAddress, 'cublasLtMatmul: the workspace at 0x', 'is not device memory' },
  }
  sim_it('report the operand and leave the error a GPU would', function()
    for _, f in ipairs(FAULTS) do
      local _, out = S.expect('', 'lt fault ' .. f[1], f[2])
      assert(out:find('gptlua cuda-sim: ' .. f[3], 1, true) and out:find(f[4], 1, true),
             ('%s: output %q'):format(f[1], out))
    end
  end)
end)

describe('simulated cuBLASLt: the engine\'s matmul #cuda #sim', function()
  sim_it('goes through cuBLASLt without a refusal', function()
    local _, out = S.expect('', 'lt matmul', 0)
    assert.equal(12, select(2, out:gsub(' ok\n', '')), out)
    assert(not out:find('gptlua cuda-sim', 1, true), out)
    assert(not out:find('cuBLASLt has no algorithm', 1, true), out)
  end)

  sim_it('falls back to matmul.cu\'s GEMM kernel when there is no algorithm, same results, said once per shape', function()
    local _, out = S.expect('GL_SIM_CUBLASLT_NO_ALGO=1', 'lt matmul', 0)
    local cases = select(2, out:gsub(' ok\n', ''))
    assert.equal(12, cases, out)
    -- 12 products of 9 distinct problems (alpha / beta are not part of one): one line each
    local said = {}
    for line in out:gmatch('[^\n]*cuBLASLt has no algorithm[^\n]*') do
      assert.is_nil(said[line], 'said twice: ' .. line)
      said[line] = true
    end
    assert.equal(9, select(2, out:gsub('gptlua: cuda:0: cuBLASLt has no algorithm for the ', '')), out)
    assert(out:find('cuBLASLt has no algorithm for the bfloat16 GEMM m=9 n=17 k=24 (op NN, ld 9/24/9, batch 3', 1, true), out)
    assert(out:find("with an epilogue); the epilogue runs as separate passes instead", 1, true), out)
    assert(out:find('gptlua cuda-sim: cublasLtMatmulAlgoGetHeuristic: no algorithm (GL_SIM_CUBLASLT_NO_ALGO is set)', 1,
                    true), out)
  end)
end)
