-- The CUDA simulator's emulation of the warp-level PTX in kernels/mma_sync.cuh
-- (spec/cudasim/warp_mma.h): mma.sync m16n8k16 bf16, ldmatrix x4 plain and
-- .trans, cp.async with commit / wait groups.  The kernels live in
-- spec/cudasim/cases/warp_mma.cu (build/sim/libgptlua_simtest.so).
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local ffi = require 'ffi'
local S = require 'support.sim'

local function lib()
  if not pcall(ffi.typeof, 'struct gl_simtest_ptx_declared') then
    ffi.cdef [[
      struct gl_simtest_ptx_declared { int unused; };
      const char *gl_simtest_ptx_message(void);
      int gl_simtest_ptx_gemm(int variant, unsigned seed, double *worst);
      int gl_simtest_ptx_cp_async(void);
    ]]
  end
  return S.lib()
end
local function message() return ffi.string(lib().gl_simtest_ptx_message()) end

describe('cuda-sim warp PTX: mma.sync, ldmatrix, cp.async #cuda #sim', function()
  it('a 32x32x32 bf16 product through cp.async, ldmatrix and mma.sync matches a host loop', function()
    local worst = ffi.new('double[1]')
    for _, variant in ipairs({ 0, 1 }) do  -- B^T rows with plain ldmatrix, B rows with .trans
      for seed = 1, 3 do
        local off = lib().gl_simtest_ptx_gemm(variant, seed, worst)
        assert(off == 0, ('variant %d seed %d: %d entries off: %s'):format(variant, seed, off, message()))
        assert(worst[0] <= 1e-5, ('variant %d: worst error %g'):format(variant, worst[0]))
      end
    end
  end)

  it('a wrong lane mapping (B rows read without .trans) gives wrong numbers', function()
    local worst = ffi.new('double[1]')
    local off = lib().gl_simtest_ptx_gemm(2, 1, worst)
    assert(off > 500, ('only %d of 1024 entries off'):format(off))
  end)

  it('cp.async: zero fill, wait_group N leaves the newest N groups poisoned, no wait reads poison', function()
    local bad = lib().gl_simtest_ptx_cp_async()
    assert(bad == 0, ('%d values wrong: %s'):format(bad, message()))
  end)
end)
