-- The CUDA simulator's stream capture and graphs (spec/cudasim/runtime_graphs.cpp):
-- captured work runs only when the graph is launched, every launch re-runs
-- it on the recorded addresses (reading pinned inputs anew), a second
-- stream forks from and joins back into a capture through events, and each
-- call a capture forbids fails with the real runtime's code, invalidating
-- the capture so that cudaStreamEndCapture names the call that broke it.
--
-- The scenarios live in spec/cudasim/cases/graphs.cu (build/sim/libgptlua_simtest.so).
-- Tagged #cuda #sim: only under the simulator (make test-sim).
local S = require 'support.sim'
local simtest, E = S.lib, S.E
local message, passes = S.checks('graph')
local ffi = require 'ffi'

describe('cuda-sim graphs: stream capture, instantiate, launch #cuda #sim', function()
  it('records a capture without running it and replays it on every launch', function()
    passes('replay', simtest().gl_simtest_graph_replay())
  end)

  it('captures a second stream forked and joined through events', function()
    passes('fork_join', simtest().gl_simtest_graph_fork_join())
  end)

  it('answers what a capture forbids with the real error codes', function()
    local ok, inval = 0, E.StreamCaptureInvalidated
    -- { case, the call's code, cudaStreamEndCapture's code, a part of the message }
    local cases = {
      { 'stream_sync', E.StreamCaptureUnsupported, inval, 'cudaStreamSynchronize %(the host would wait for stream' },
      { 'stream_query', E.StreamCaptureUnsupported, inval, 'cudaStreamQuery' },
      { 'device_sync', E.StreamCaptureUnsupported, inval, 'capture was invalidated by cudaDeviceSynchronize' },
      { 'malloc', E.StreamCaptureUnsupported, inval, 'cudaMalloc %(not permitted while stream 0x%x+ is being captured in cudaStreamCaptureModeGlobal' },
      { 'malloc_thread_local', E.StreamCaptureUnsupported, inval, 'cudaStreamCaptureModeThreadLocal' },
      { 'malloc_relaxed', ok, ok, 'no error' },
      { 'malloc_other_thread', E.StreamCaptureUnsupported, inval, 'cudaMalloc' },
      { 'malloc_thread_local_other_thread', ok, ok, 'no error' },
      { 'free', E.StreamCaptureUnsupported, inval, 'cudaFree' },
      { 'pageable_to_device', E.StreamCaptureUnsupported, inval, 'pageable host memory cannot be captured' },
      { 'device_to_pageable', E.StreamCaptureUnsupported, inval, 'the host would wait' },
      { 'pinned_to_device', ok, ok, 'no error' },
      { 'sync_copy', E.StreamCaptureImplicit, inval, 'legacy default stream' },
      { 'legacy_stream', E.StreamCaptureImplicit, inval, 'cudaMemsetAsync on the legacy default stream' },
      { 'isolation_setup', E.StreamCaptureIsolation, inval, 'recorded outside the capture' },
      { 'captured_event_query', E.CapturedEvent, ok, 'last recorded in a capturing stream' },
      { 'captured_event_sync', E.CapturedEvent, ok, 'last recorded in a capturing stream' },
      { 'double_begin', E.IllegalState, ok, 'already capturing' },
      { 'unjoined', ok, E.StreamCaptureUnjoined, 'was not waited for' },
      { 'unmatched', E.StreamCaptureUnmatched, inval, 'joined the capture begun on stream' },
      { 'after_invalidation', inval, inval, 'invalidated earlier by cudaStreamSynchronize' },
      { 'legacy_capture', E.StreamCaptureUnsupported, ok, 'the legacy default stream cannot be captured' },
      { 'not_capturing', E.IllegalState, ok, 'is not capturing' },
      { 'bad_mode', E.InvalidValue, ok, 'mode 7, expected 0..2' },
    }
    local endc = ffi.new('int[1]')
    for _, c in ipairs(cases) do
      local r = simtest().gl_simtest_graph_misuse(c[1], endc)
      local msg = message()
      assert(r == c[2], ('%s returned %d (%s), expected %d'):format(c[1], r, msg, c[2]))
      assert(endc[0] == c[3], ('%s: cudaStreamEndCapture returned %d (%s), expected %d'):format(c[1], endc[0], msg, c[3]))
      assert(msg:find(c[4]), ('%s: message "%s" lacks "%s"'):format(c[1], msg, c[4]))
    end
  end)

  it('refuses to launch a destroyed executable graph', function()
    local r = simtest().gl_simtest_graph_destroyed_exec()
    assert(r == E.InvalidValue, ('returned %d (%s)'):format(r, message()))
    assert(message():find('is not a live executable graph'), message())
  end)
end)
