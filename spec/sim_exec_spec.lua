-- The CUDA simulator's execution core (spec/cudasim/exec.cpp, device.h):
-- correct kernels using every device primitive (block reductions through
-- GL_SHARED, every shuffle kind / width / type, votes, atomics, 2-D and 3-D
-- geometry, dynamic shared memory with opt-in) agree with plain host loops;
-- launch configurations over the H100's limits are refused with the codes
-- CUDA uses; and each checker fires on a planted bug: a missing barrier
-- (race mode), a bad shuffle mask, barrier divergence, a deadlock, lanes
-- that exited or do not exist, unwritten shared memory (poison), static and
-- dynamic shared memory out of bounds, static + dynamic over the limit.
--
-- The kernels live in spec/cudasim/cases/exec.cu and, for the launch
-- configurations and planted bugs, cases/exec_faults.cu (build/sim/
-- libgptlua_simtest.so).  Planted bugs leave a sticky error, so they run
-- in a subprocess (spec/sim/run.lua exec) and the spec reads its output.
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local ffi = require 'ffi'
local S = require 'support.sim'
local simtest, E = S.lib, S.E
local message, passes = S.checks('exec')
local fault_message = S.checks('fault')

describe('cuda-sim execution: correct kernels against host loops #cuda #sim', function()
  it('block reductions (GL_SHARED, barriers, xor shuffles) with 32 to 1024 threads, float and double', function()
    local t = simtest()
    passes('block_reduce 9x10/32', t.gl_simtest_exec_block_reduce(9, 10, 32, 0))
    passes('block_reduce 37x1000/256', t.gl_simtest_exec_block_reduce(37, 1000, 256, 0))
    passes('block_reduce 5x3000/1024 double', t.gl_simtest_exec_block_reduce(5, 3000, 1024, 1))
  end)

  it('every shuffle kind at every width for int, unsigned, long, long long and both floats; partial masks', function()
    passes('shuffles', simtest().gl_simtest_exec_shuffles())
  end)

  it('ballot / any / all / activemask, __syncthreads_count / _and / _or, bit intrinsics', function()
    passes('votes', simtest().gl_simtest_exec_votes())
  end)

  it('atomics of every kind and type from 1024 threads, compare-and-swap loops', function()
    passes('atomics', simtest().gl_simtest_exec_atomics())
  end)

  it('2-D and 3-D grids and blocks; every thread owns its copy of the parameters', function()
    local t = simtest()
    passes('grid3d (3,2,2)x(8,4,2)', t.gl_simtest_exec_grid3d(3, 2, 2, 8, 4, 2))
    passes('grid3d (2,3,1)x(5,7,3)', t.gl_simtest_exec_grid3d(2, 3, 1, 5, 7, 3))
    passes('grid3d (1,1,4)x(1,1,64)', t.gl_simtest_exec_grid3d(1, 1, 4, 1, 1, 64))
  end)

  it('dynamic shared memory: up to 48 KiB as is, up to 227 KiB after opting in', function()
    local t = simtest()
    passes('dynamic 16000', t.gl_simtest_exec_dynamic_smem(16000, 0))
    passes('dynamic 49152', t.gl_simtest_exec_dynamic_smem(49152, 0))
    assert.are.equal(-E.InvalidValue, t.gl_simtest_exec_dynamic_smem(100000, 0))
    assert.matches('cudaFuncAttributeMaxDynamicSharedMemorySize', message(), 1, true)
    passes('dynamic 100000 opted in', t.gl_simtest_exec_dynamic_smem(100000, 1))
    passes('dynamic 227 KiB opted in', t.gl_simtest_exec_dynamic_smem(227 * 1024, 1))
  end)

  it('shared memory nobody wrote reads as 0xFF (NaN), poisoned again at every block start (initcheck off)', function()
    -- with initcheck on, the first such read stops the kernel (spec/sim_sanitize_spec.lua)
    S.expect('GL_SIM_CHECKS=memcheck,racecheck,synccheck', 'exec scenario exec_poison', 0)
  end)

  it('__syncwarp on half warps, then a warp collective over the whole warp', function()
    passes('collective', simtest().gl_simtest_exec_collective())
  end)

  it('a missing barrier, the checks off: in natural order the reads of unwritten slots get poison (NaN)', function()
    -- 2 blocks of 128 threads, thread t reads slot t+1: all but the last of each block
    S.expect('GL_SIM_CHECKS=none', 'exec scenario fault_race_natural', 254)
  end)

  it('runs a 4224 x 256 grid-stride launch well under 100 ms of CPU time (timings printed)', function()
    local res = ffi.new('double[4]')
    passes('bench', simtest().gl_simtest_exec_bench(res))
    io.write(('\n    cuda-sim (CPU time): 4224x256 elementwise %.1f ms, %.0f launches/s, 1024x256 block reduce %.1f ms, ' ..
              '%.1f M fiber switches/s\n'):format(res[0], res[1], res[2], res[3] / 1e6))
    -- the thread's CPU time, so the load of a shared CI machine does not count;
    -- typically 10-40 ms
    assert.is_true(res[0] < 400, ('elementwise launch took %.1f ms'):format(res[0]))
  end)
end)

describe('cuda-sim execution: launch configurations over the limits #cuda #sim', function()
  -- gx gy gz bx by bz smem optin -> the error cudaGetLastError reports
  local cases = {
    { 'a full 1024-thread block', { 1, 1, 1, 32, 32, 1, 0, 0 }, 0 },
    { '1025 threads', { 1, 1, 1, 1025, 1, 1, 0, 0 }, E.InvalidConfiguration },
    { '2048 threads as 32x32x2', { 1, 1, 1, 32, 32, 2, 0, 0 }, E.InvalidConfiguration },
    { 'block z 65', { 1, 1, 1, 1, 1, 65, 0, 0 }, E.InvalidConfiguration },
    { 'grid y 65536', { 1, 65536, 1, 1, 1, 1, 0, 0 }, E.InvalidConfiguration },
    { 'grid z 65536', { 1, 1, 65536, 1, 1, 1, 0, 0 }, E.InvalidConfiguration },
    { 'a zero grid dimension', { 0, 1, 1, 32, 1, 1, 0, 0 }, E.InvalidConfiguration },
    { 'a zero block dimension', { 1, 1, 1, 32, 0, 1, 0, 0 }, E.InvalidConfiguration },
    { '48 KiB dynamic', { 1, 1, 1, 32, 1, 1, 49152, 0 }, 0 },
    { '48 KiB + 1 dynamic without opting in', { 1, 1, 1, 32, 1, 1, 49153, 0 }, E.InvalidValue },
    { '200000 dynamic, opted in to 227 KiB', { 1, 1, 1, 32, 1, 1, 200000, 232448 }, 0 },
    { 'more than opted in', { 1, 1, 1, 32, 1, 1, 200000, 100000 }, E.InvalidValue },
    { 'over 227 KiB', { 1, 1, 1, 32, 1, 1, 232449, 232448 }, E.InvalidValue },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. (c[3] == 0 and ' runs' or ' is refused'), function()
      local a = c[2]
      local r = simtest().gl_simtest_fault_launch_config(a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8])
      assert.are.equal(c[3], r, fault_message())
    end)
  end

  it('the error names the kernel and the limit', function()
    assert.are.equal(E.InvalidConfiguration, simtest().gl_simtest_fault_launch_config(1, 1, 1, 1025, 1, 1, 0, 0))
    local m = fault_message()
    assert.matches('k_noop', m, 1, true)
    assert.matches('block (1025,1,1): block dimensions are at most (1024,1024,64)', m, 1, true)
    assert.are.equal(E.InvalidConfiguration, simtest().gl_simtest_fault_launch_config(1, 1, 1, 32, 32, 2, 0, 0))
    assert.matches('block (32,32,2) has 2048 threads, at most 1024', fault_message(), 1, true)
  end)
end)

describe('cuda-sim execution: each checker fires on a planted bug #cuda #sim', function()
  -- name, environment, expected code, text the report contains
  local cases = {
    -- race mode by itself (racecheck and initcheck, which report these first, off)
    { 'race', 'GL_SIM_RACECHECK=1 GL_SIM_CHECKS=memcheck,synccheck', E.LaunchFailure,
      'kernel p_race: race: device allocation' },
    -- a block the in-order run leaves as it was (not copied again) and only the random order writes
    { 'race_random_only', 'GL_SIM_RACECHECK=1 GL_SIM_CHECKS=memcheck,synccheck', E.LaunchFailure,
      'kernel p_race_random_only: race: device allocation' },
    -- the sanitizer: in order, thread 0 reads slot 1 before thread 1 wrote it (initcheck), and
    -- thread 1 then writes the slot thread 0 read with no barrier between (racecheck)
    { 'race', '', E.LaunchFailure, 'kernel p_race block (0,0,0) thread (0,0,0): initcheck: read of 4 bytes' },
    { 'race', 'GL_SIM_CHECKS=racecheck', E.LaunchFailure,
      'kernel p_race block (0,0,0) thread (1,0,0): racecheck: write-after-read hazard' },
    { 'shuffle_mask', '', E.IllegalInstruction, 'bad shuffle mask: lanes disagree on the mask of __shfl_xor_sync' },
    { 'divergence', '', E.IllegalInstruction, 'barrier divergence' },
    { 'deadlock', '', E.LaunchTimeout,
      'deadlock: no thread can run and 64 of 64 have not exited: 1 thread(s) wait at __syncwarp mask 0x00000003' },
    { 'exited_lane', '', E.IllegalInstruction, 'exited while lanes 0x0000ffff wait for it at __shfl_down_sync' },
    { 'missing_lane', '', E.IllegalInstruction, 'names lanes 0xffff0000 that do not exist' },
    { 'lane_not_in_mask', '', E.IllegalInstruction, 'the calling lane 0 is not in mask 0xfffffffe' },
    { 'bad_width', '', E.IllegalInstruction, 'width 3 is not a power of two' },
    { 'static_oob', '', E.IllegalAddress, "index 32 out of bounds for type 'float [32]'" },
    -- the guard page after the buffer: runtime_memory.cpp's fault handler reports it,
    -- or exec.cpp's own when the runtime's host checks (and handler) are off
    { 'dynamic_oob', '', E.IllegalAddress, 'p_dynamic_oob block (0,0,0) thread (255,0,0)' },
    { 'dynamic_oob', 'GL_SIM_HOSTCHECK=0', E.IllegalAddress, "byte 1024 of the launch's 1024-byte buffer" },
    { 'static_over_limit', '', E.LaunchOutOfResources, 'static shared memory 40000 bytes + dynamic 10000 bytes' },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. (c[2] ~= '' and ' (' .. c[2] .. ')' or ''), function()
      local msg, out = S.expect(c[2], 'exec planted ' .. c[1], c[3])
      assert.matches(c[4], out, 1, true)
      assert.matches('gptlua cuda-sim: ', out, 1, true)
      -- the error is sticky: a correct launch afterwards reports it too
      assert.matches(('sync %d after %d'):format(c[3], c[3]), msg, 1, true)
    end)
  end

  it('names the kernel, block and thread', function()
    local _, _, _, out = S.subprocess('', 'exec planted divergence')
    assert.matches('kernel p_divergence block (0,0,0) thread (32,0,0): synccheck: barrier divergence', out, 1, true)
  end)

  it('without the race mode and the sanitizer the missing barrier is not reported as an error', function()
    S.expect('GL_SIM_CHECKS=none', 'exec planted race', 0)
  end)

  it('the correct kernels pass the race mode (identical memory in a random thread order)', function()
    for _, seed in ipairs({ 1, 7, 12345 }) do
      S.expect('GL_SIM_RACECHECK=1 GL_SIM_SEED=' .. seed, 'exec correct', 0)
    end
  end)
end)
