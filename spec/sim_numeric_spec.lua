-- The CUDA simulator's numeric types and WMMA (spec/cudasim/cuda_bf16.h,
-- cuda_fp16.h, mma.h).
--
-- Conversions are compared, bit for bit, with a reference in
-- spec/cudasim/cases/numeric.cu written independently of the headers (each
-- format's values decoded field by field, inputs rounded against exact
-- midpoints): every bfloat16 / half pattern to float, ~2^24 floats (every
-- rounding boundary of both formats with its neighbours, the specials, and
-- random bit patterns) in all four rounding modes, doubles off every
-- midpoint, integers of every length, and + - * / with every operator and
-- intrinsic.  During development the conversions also matched ml_dtypes'
-- bfloat16 and numpy's float16 on 16,777,216 floats (0 mismatches; NaN
-- inputs give CUDA's canonical 0x7fff there).
--
-- WMMA (spec/cudasim/cases/wmma.cu) runs as a kernel would (GL_LAUNCH, device memory, two warps over
-- several tiles) for every shape, input type and layout, with and without
-- accumulating into C (row- and column-major), and is compared with a
-- double-precision host loop: |error| <= (depth + 1) 2^-24 sum |terms| for
-- fp32 accumulators (sequential fp32 sums of exact products), plus
-- (depth / 16) 2^-11 sum |terms| for half accumulators (one rounding to
-- half per mma_sync).  Padding around every matrix is NaN, so a read
-- outside a tile spoils the result and a write outside one is seen.
--
-- Planted misuse (misaligned pointer, bad ldm, lanes disagreeing) must stop
-- the kernel with a message naming the operation and the value; the error
-- is sticky, so each runs in its own process (spec/sim/run.lua num planted).
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local ffi = require 'ffi'
local S = require 'support.sim'
local simtest = S.lib

-- a fixed seed, so that every run checks the same inputs; GL_CUDA_SPEC_SEED=N
-- draws others (make test-seeds), printed on failure
local SEED = (tonumber(os.getenv('GL_CUDA_SPEC_SEED') or '') or 1000) % 100000
local function seeded(what) return ('%s (seed %d; details on stderr)'):format(what, SEED) end

describe('CUDA simulator bfloat16 / half conversions #cuda #sim', function()
  it('turns every bfloat16 and half pattern into its exact float', function()
    assert.equal(0, tonumber(simtest().gl_simtest_num_16_to_float()), 'mismatches (details on stderr)')
  end)

  it('rounds ~2^24 floats as the hardware does, in every rounding mode', function()
    local checked = ffi.new('long[1]')
    -- 2^24 - 2^21 random inputs after the ~1.9 million boundary ones
    local bad = simtest().gl_simtest_num_float_to_16(2 ^ 24 - 2 ^ 21, SEED, checked)
    assert.equal(0, tonumber(bad), seeded('float -> bfloat16 / half mismatches'))
    assert.is_true(tonumber(checked[0]) > 2 ^ 24 - 2 ^ 20)
  end)

  it('rounds doubles once (not through float), integers exactly, and back to integers', function()
    local checked = ffi.new('long[1]')
    assert.equal(0, tonumber(simtest().gl_simtest_num_double_to_16(2 ^ 20, SEED, checked)),
                 seeded('double -> 16-bit mismatches'))
    assert.is_true(tonumber(checked[0]) > 2 ^ 20)
    assert.equal(0, tonumber(simtest().gl_simtest_num_int_16(SEED, checked)), seeded('integer mismatches'))
  end)

  it('computes + - * / rounded once, and compares, like the CUDA headers on sm_90', function()
    assert.equal(0, tonumber(simtest().gl_simtest_num_arith(2 ^ 19, SEED)), seeded('arithmetic mismatches'))
  end)

  it('has pair types, raw structs and unions that behave as the toolkit\'s', function()
    assert.equal(0, tonumber(simtest().gl_simtest_num_pairs()), 'mismatches (details on stderr)')
  end)

  it('shuffles, adds atomically and lives in static shared arrays inside kernels', function()
    assert.equal(0, tonumber(simtest().gl_simtest_num_device()), 'mismatches (details on stderr)')
  end)
end)

describe('CUDA simulator WMMA #cuda #sim', function()
  local SHAPES = { [0] = '16x16x16', '32x8x16', '8x32x16' }
  local TYPES = { [0] = 'bfloat16', 'half' }

  local function gemm(shape, dtype, a_col, b_col, half_acc, accumulate, c_col, scale_a)
    local worst = ffi.new('double[1]')
    local bad = simtest().gl_simtest_num_wmma_gemm(shape, dtype, a_col, b_col, half_acc, accumulate, c_col,
                                                   scale_a, SEED, worst)
    local what = ('%s %s A %s B %s%s%s C %s%s'):format(SHAPES[shape], TYPES[dtype], a_col == 1 and 'col' or 'row',
      b_col == 1 and 'col' or 'row', half_acc == 1 and ' half accumulator' or '',
      accumulate == 1 and ' accumulating into' or ' into', c_col == 1 and 'col-major' or 'row-major',
      scale_a == 1 and ', A fragment scaled elementwise' or '')
    assert.equal(0, tonumber(bad), seeded(what .. ': elements outside the bound'))
    assert.is_true(worst[0] <= 1, what .. ': worst error / bound ' .. worst[0])
  end

  it('multiplies every shape, input type and layout within fp32 accumulation error', function()
    for shape = 0, 2 do
      for dtype = 0, 1 do
        for a_col = 0, 1 do
          for b_col = 0, 1 do
            gemm(shape, dtype, a_col, b_col, 0, 0, 0, 0)
          end
        end
      end
    end
  end)

  it('accumulates into C loaded in either layout, and edits fragments elementwise', function()
    for shape = 0, 2 do
      for dtype = 0, 1 do
        for c_col = 0, 1 do
          gemm(shape, dtype, c_col, 1 - c_col, 0, 1, c_col, 1)
        end
      end
    end
  end)

  it('accumulates in half fragments (16x16x16 half inputs)', function()
    for a_col = 0, 1 do
      for b_col = 0, 1 do
        gemm(0, 1, a_col, b_col, 1, 1, b_col, a_col)
      end
    end
  end)

  -- runs planted bug `which` in its own process, which must report status
  -- `code`; returns the status's message and the whole output
  local function planted(which, code) return S.expect('', 'num planted ' .. which, code) end
  local MISALIGNED, ILLEGAL_INSTRUCTION = S.E.MisalignedAddress, S.E.IllegalInstruction

  it('stops a kernel whose pointer is not 256-bit aligned', function()
    local msg, out = planted(0, MISALIGNED)
    assert.truthy(msg:find('wmma::load_matrix_sync at .*cases/wmma.cu:%d+: pointer 0x%x+ is not 256%-bit %(32%-byte%) aligned'), out)
    assert.truthy(msg:find('kernel wmma_planted_kernel block (0,0,0) thread (', 1, true), out)
    assert.truthy(out:find('gptlua cuda-sim: ', 1, true), out)  -- also on stderr
    msg, out = planted(4, MISALIGNED)
    assert.truthy(msg:find('wmma::store_matrix_sync at .*: pointer 0x%x+ is not 256%-bit'), out)
  end)

  it('stops a kernel whose ldm is not a multiple of 16 bytes', function()
    local msg, out = planted(1, MISALIGNED)
    assert.truthy(msg:find('wmma::load_matrix_sync at .*: ldm 12 is not a multiple of 8 %(2%-byte elements%)'), out)
  end)

  it('stops a kernel whose lanes pass different pointers or ldm', function()
    local msg, out = planted(2, ILLEGAL_INSTRUCTION)
    assert.truthy(msg:find('wmma::load_matrix_sync', 1, true) and msg:find('disagree', 1, true), out)
    msg, out = planted(3, ILLEGAL_INSTRUCTION)
    assert.truthy(msg:find('wmma::store_matrix_sync at .*: lanes disagree on ldm: lane 0 passed 16, lane 5 24'), out)
  end)
end)
