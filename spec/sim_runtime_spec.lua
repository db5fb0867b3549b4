-- The CUDA simulator's runtime (spec/cudasim/runtime*.cpp): copies, sets,
-- streams and events behave as the real runtime's (values, ordering, error
-- codes for bad arguments), and each of its checkers fires on a planted
-- bug: an out-of-bounds store from a kernel, host code touching device
-- memory, a missing stream wait (kernel or copy on one stream reading what
-- another wrote with no event between), a block the caching allocator
-- reuses across streams without a wait.  GL_SIM_STREAMS=threads runs the
-- correct programs correctly with streams really running unordered, and the
-- engine's own runtime (kernels/runtime.cu) runs cleanly under every check.
--
-- The scenarios live in spec/cudasim/cases/runtime.cu (build/sim/
-- libgptlua_simtest.so); bugs leave a sticky error or abort, so they run in
-- a subprocess (spec/sim/run.lua rt) and the spec reads its output.
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local S = require 'support.sim'
local simtest, E = S.lib, S.E
local message, passes = S.checks('rt')

-- spec/sim/run.lua rt ARGS in a subprocess with `env` (e.g.
-- 'GL_SIM_STREAMS=threads'): exit status, result code, result message,
-- whole output; or require exit status 0 and result `code`
local function subprocess(env, args) return S.subprocess(env, 'rt ' .. args) end
local function expect(env, args, code) return S.expect(env, 'rt ' .. args, code) end

describe('cuda-sim runtime: devices, copies, streams, events #cuda #sim', function()
  local gl = require 'gptlua'
  local cuda = require 'gptlua.cuda'

  it('simulates one H100 by default', function()
    assert.are.equal(1, cuda.device_count())
    local p = cuda.get_device_properties(0)
    assert.are.equal('gptlua cuda-sim (H100 limits)', p.name)
    assert.are.equal(9, p.major)
    assert.are.equal(0, p.minor)
    assert.are.equal(132, p.multiprocessor_count)
    assert.are.equal(1024, p.max_threads_per_block)
    assert.are.equal(227 * 1024, tonumber(p.shared_memory_per_block_optin))
    assert.are.equal(80 * 2 ^ 30, tonumber(p.total_memory))
  end)

  it('copies and sets in every direction, sync and async, pageable and pinned', function()
    passes('copies', simtest().gl_simtest_rt_copies())
  end)

  it('orders work through events, host synchronizations and the legacy stream; times events', function()
    passes('streams', simtest().gl_simtest_rt_streams())
  end)

  it('records cudaFuncSetAttribute opt-ins per function', function()
    passes('func_attribute', simtest().gl_simtest_rt_func_attribute())
  end)

  it('answers misuse with the real error code and a message naming the problem', function()
    local cases = {
      { 'copy_past_end', E.InvalidValue, 'runs 512 bytes past the end of its 1024%-byte allocation of cuda:0' },
      { 'copy_kind_host_dst', E.InvalidValue, 'dst 0x%x+ is host memory, expected device memory for cudaMemcpyHostToDevice' },
      { 'copy_kind_device_src', E.InvalidValue, 'src 0x%x+ is device memory %(cuda:0%), expected host memory' },
      { 'copy_direction', E.InvalidMemcpyDirection, 'kind 7, expected 0..4' },
      { 'copy_null', E.InvalidValue, 'dst is NULL' },
      { 'copy_freed', E.InvalidValue, 'byte 0 of a 64%-byte allocation of cuda:0 that was freed' },
      { 'memset_past_end', E.InvalidValue, 'runs 76 bytes past the end' },
      { 'memset_host', E.InvalidValue, 'is host memory, expected device memory' },
      { 'free_interior', E.InvalidValue, 'is byte 8 of a 1024%-byte allocation of cuda:0, expected its start' },
      { 'free_host', E.InvalidValue, 'is not device memory' },
      { 'double_free', E.InvalidValue, 'was already freed' },
      { 'out_of_memory', E.MemoryAllocation, 'out of memory: cudaMalloc: 1125899906842624 bytes requested' },
      { 'free_host_not_pinned', E.InvalidValue, 'is not a block of cudaHostAlloc' },
      { 'host_alloc_flags', E.InvalidValue, 'flags 0x100' },
      { 'set_device', E.InvalidDevice, 'device 99 requested but 1 simulated device%(s%) exist' },
      { 'device_attribute', E.InvalidDevice, 'device %-1 requested' },
      { 'stream_flags', E.InvalidValue, 'flags 0x4, expected 0 or 1' },
      { 'stream_destroyed', E.InvalidResourceHandle, 'is not a live stream' },
      { 'destroy_default_stream', E.InvalidResourceHandle, 'the default stream cannot be destroyed' },
      { 'event_flags', E.InvalidValue, 'flags 0x40' },
      { 'event_destroyed', E.InvalidResourceHandle, 'is not a live event' },
      { 'elapsed_disable_timing', E.InvalidResourceHandle, 'created with cudaEventDisableTiming' },
      { 'elapsed_unrecorded', E.InvalidResourceHandle, 'the start event was never recorded' },
      { 'wait_event_flags', E.InvalidValue, 'flags 0x3, expected 0' },
      { 'func_smem_over_limit', E.InvalidValue, '233472, expected 0..232448' },
    }
    for _, c in ipairs(cases) do
      local r = simtest().gl_simtest_rt_bad_arg(c[1])
      local msg = message()
      assert(r == c[2], ('%s returned %d (%s), expected %d'):format(c[1], r, msg, c[2]))
      assert(msg:find(c[3]), ('%s: message "%s" lacks "%s"'):format(c[1], msg, c[3]))
    end
    assert.are.equal(0, simtest().gl_simtest_rt_sticky())
  end)

  it('runs the correct twins of the planted bugs without complaint', function()
    for _, name in ipairs({ 'event_wait_copy', 'event_wait_kernel', 'blocking_vs_legacy', 'reuse_with_wait',
                            'unrelated_streams' }) do
      passes(name, simtest().gl_simtest_rt_planted(name))
    end
    assert.are.equal(0, simtest().gl_simtest_rt_sticky())
  end)

  it('copies between two simulated devices (GL_SIM_DEVICES=2)', function()
    expect('GL_SIM_DEVICES=2', 'scenario peer', 0)
  end)

  it('bounds device memory by GL_SIM_MEMORY_MB', function()
    local msg, out = expect('GL_SIM_MEMORY_MB=1', 'oom', 2)
    assert(msg:find('out of memory allocating 4194304 bytes', 1, true), out)
    assert(msg:find('which has 1048576 bytes', 1, true), out)
  end)

  it("runs the engine's runtime (transfers, caching allocator, copy_async, events, waits) under every check", function()
    dofile(S.ROOT .. '/spec/sim/runtime_engine.lua')()
    assert.are.equal(0, simtest().gl_simtest_rt_sticky())
  end)
end)

describe('cuda-sim runtime: planted bugs, each checker fires #cuda #sim', function()
  -- (name, error code, what the message says) for bugs that leave a sticky error
  local sticky = {
    { 'oob_store', E.IllegalAddress,
      'out%-of%-bounds write at 0x%x+: 0 bytes past the end of a 256%-byte allocation of cuda:0 %(in kernel k_store_past_end block %(0,0,0%) thread %(64,0,0%)%)' },
    -- inside the allocation's last page: the sanitizer's memcheck sees the store itself; with it off
    -- the runtime finds the slack's poison changed when the kernel ends
    { 'oob_slack', E.IllegalAddress,
      'kernel k_store_past_end block %(0,0,0%) thread %(%d+,0,0%): memcheck: out%-of%-bounds global write of 4 bytes at 0x%x+: 0 bytes past the end of a 40%-byte allocation, at [^ ]*runtime%.cu:%d+' },
    { 'oob_slack', E.IllegalAddress,
      'out%-of%-bounds write at 0x%x+: 0 bytes past the end of a 40%-byte allocation of cuda:0 %(in kernel k_store_past_end%)',
      env = 'GL_SIM_CHECKS=none' },
    { 'oob_before_start', E.IllegalAddress,
      'out%-of%-bounds write at 0x%x+: 4 bytes before the start of a 16384%-byte allocation of cuda:0 %(in kernel k_store_before_start' },
    { 'use_after_free', E.IllegalAddress,
      'out%-of%-bounds write at 0x%x+: byte 0 of a 1024%-byte allocation of cuda:0 that was freed %(in kernel k_fill' },
    { 'missing_wait_copy', E.LaunchFailure,
      'missing stream wait: cudaMemcpy device to host on stream %d+ of cuda:0 reads 0x%x+ %(byte 0 of a 16384%-byte allocation of cuda:0%) which kernel k_fill on stream %d+ of cuda:0 wrote, with no event ordering them' },
    { 'missing_wait_kernel', E.LaunchFailure,
      'missing stream wait: kernel k_double on stream %d+ of cuda:0 reads 0x%x+ .* which kernel k_fill on stream %d+ of cuda:0 wrote, with no event ordering them %(in kernel k_double block' },
    { 'overlapping_missing_wait', E.LaunchFailure,
      'missing stream wait: read x on stream %d+ of cuda:0 reads 0x%x+ .* which write x and linger on stream %d+ of cuda:0 wrote, with no event ordering them' },
    { 'missing_wait_war', E.LaunchFailure,
      'missing stream wait: kernel k_fill on stream %d+ of cuda:0 writes 0x%x+ .* which kernel k_double on stream %d+ of cuda:0 read, with no event ordering them' },
    { 'nonblocking_vs_legacy', E.LaunchFailure,
      'missing stream wait: cudaMemcpy device to host on the default stream of cuda:0 reads 0x%x+ .* which kernel k_fill on stream %d+ of cuda:0 wrote' },
    { 'reuse_across_streams', E.LaunchFailure,
      'missing stream wait: kernel k_fill on stream %d+ of cuda:0 writes 0x%x+ .* which kernel k_fill on stream %d+ of cuda:0 wrote, with no event ordering them' },
  }
  for _, mode in ipairs({ 'sync', 'threads' }) do
    for _, c in ipairs(sticky) do
      it(('%s (GL_SIM_STREAMS=%s%s): %s'):format(c[1], mode, c.env and ' ' .. c.env or '',
                                                  mode == 'sync' and 'reported' or 'still reported'), function()
        local rc, code, msg, out = subprocess('GL_SIM_STREAMS=' .. mode .. (c.env and ' ' .. c.env or ''), 'planted ' .. c[1])
        assert(rc == 0, out)
        -- a copy's own call may be the first to see it (code < 0: -cudaError_t of that call)
        assert(code == c[2] or code == -c[2], ('%s: result %s, expected %d:\n%s'):format(c[1], tostring(code), c[2], out))
        -- with stream threads the two sides may run in either order, so
        -- either may be the one found unordered: any missing-wait report
        local want = c[3]
        if mode == 'threads' and c[2] == E.LaunchFailure then
          want = 'missing stream wait: .- on .- of cuda:0 %a+ 0x%x+ .- which .- on .- of cuda:0 %a+, with no event ordering them'
        end
        assert(msg:find(want), ('%s: result message lacks "%s":\n%s'):format(c[1], want, out))
        -- printed once to stderr when it happened, with the simulator's prefix
        assert(out:find('gptlua cuda%-sim: ' .. want), out)
      end)
    end
  end

  for _, c in ipairs({
    { 'host_read', 'host code read device memory at 0x%x+ %(a 16384%-byte allocation of cuda:0%): copy it to the host first' },
    { 'host_write', 'host code wrote device memory at 0x%x+ %(a 16384%-byte allocation of cuda:0%)' },
  }) do
    it(c[1] .. ': the process stops with the address and the allocation', function()
      local rc, code, _, out = subprocess('', 'planted ' .. c[1])
      assert(rc ~= 0 and code == nil, 'expected the process to abort:\n' .. out)
      assert(out:find('gptlua cuda%-sim: ' .. c[2]), out)
    end)
  end

  it('GL_SIM_STREAMCHECK=0 turns the stream-order check off', function()
    expect('GL_SIM_STREAMCHECK=0', 'planted missing_wait_kernel', 0)
  end)

  it('does not count the race mode\'s snapshots as accesses of the kernel (GL_SIM_RACECHECK=1)', function()
    expect('GL_SIM_RACECHECK=1', 'planted unrelated_streams', 0)
    expect('GL_SIM_RACECHECK=1', 'planted missing_wait_kernel', E.LaunchFailure)
  end)

  it('GL_SIM_HOSTCHECK=0 leaves device memory readable by host code', function()
    expect('GL_SIM_HOSTCHECK=0', 'planted host_read', 0)
  end)
end)

describe('cuda-sim runtime: GL_SIM_STREAMS=threads #cuda #sim', function()
  it('runs streams concurrently: an item waits for a later item of another stream', function()
    expect('GL_SIM_STREAMS=threads', 'scenario concurrent', 0)
  end)

  for _, name in ipairs({ 'copies', 'streams' }) do
    it('runs the correct ' .. name .. ' scenario correctly', function()
      expect('GL_SIM_STREAMS=threads', 'scenario ' .. name, 0)
    end)
  end

  for _, name in ipairs({ 'event_wait_copy', 'event_wait_kernel', 'blocking_vs_legacy', 'reuse_with_wait' }) do
    it('runs the fixed twin ' .. name .. ' without complaint', function()
      expect('GL_SIM_STREAMS=threads', 'planted ' .. name, 0)
    end)
  end

  it("runs the engine's runtime cleanly under every check", function()
    expect('GL_SIM_STREAMS=threads', 'engine', 0)
  end)
end)
