-- Communication on its own stream, overlapped with compute, waited for on
-- the device (issue 13, "Communication"): a tiny GPT-2 trained under DDP,
-- FSDP and tensor parallelism (tp 2: its all-reduces in forward and
-- backward, which are not overlapped) on 2 ranks of the CUDA simulator (NCCL over MPI, GL_SIM_DEVICES=2),
-- by recipes/tools/host_syncs.lua, which reads the simulator's stream trace
-- (spec/cudasim/trace.cpp).  Checked: the results equal a one-rank run of
-- the same global batches; inside the step the host never waits for the
-- device (the gradient norm's read, which clipping needs, apart), every
-- NCCL call runs on the communicator's stream after the compute that made
-- its input, compute queued after a collective is not ordered after it
-- (overlap), and the compute stream waits for the collectives on the
-- device; with one device wait left out (the tool's test hook), the
-- simulator's stream check reports the missing wait.
local H = require 'support.mpi'
local cuda = require 'gptlua.cuda'
local ckpt_load = require('gptlua.checkpoint').load_safetensors

local SIM = cuda.device_count() > 0 and cuda.get_device_name(0):find('cuda-sim', 1, true) ~= nil
local TOL = 1e-5

describe('collectives on their own stream, waited for on the device #cuda', function()
  if not SIM then
    pending('runs in the CUDA simulator (make test-sim): its stream trace is the evidence')
    return
  end
  if not H.MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)
  local TOOL = 'recipes/tools/host_syncs.lua --policies=ddp,fsdp,tp --steps=2'

  it('DDP, FSDP and tp on 2 ranks: the 1-rank results, no host wait inside the step, collectives overlapped', function()
    os.execute(('mkdir -p %s/one %s/two'):format(out, out))
    local o, rc = H.sh(('%s %s --waits=device --out=%s/one'):format(H.EXE, TOOL, out), 300)
    H.assert_ranks_ok(o, rc, 1)
    o, rc = H.sh(('env GL_SIM_DEVICES=2 %s -np 2 --oversubscribe --allow-run-as-root %s %s --waits=host,device --out=%s/two')
      :format(H.MPIRUN, H.EXE, TOOL, out), 600)
    H.assert_ranks_ok(o, rc, 2)
    for _, p in ipairs({ 'ddp', 'fsdp', 'tp' }) do
      local want = H.read_json(('%s/one/%s-device.json'):format(out, p))
      local before = H.read_json(('%s/two/%s-host.json'):format(out, p))
      local got = H.read_json(('%s/two/%s-device.json'):format(out, p))
      assert.equal(#want.losses, #got.losses)
      for i = 1, #want.losses do
        local rel = math.abs(got.losses[i] - want.losses[i]) / math.abs(want.losses[i])
        assert.is_true(rel < TOL, ('%s step %d: loss %.9g on 2 ranks, %.9g on 1'):format(p, i, got.losses[i], want.losses[i]))
      end
      local e = H.rel_error(ckpt_load(('%s/one/%s-device.safetensors'):format(out, p)),
        ckpt_load(('%s/two/%s-device.safetensors'):format(out, p)))
      assert.is_true(e < TOL, ('%s: final parameters differ by %.3g (relative) from the 1-rank run'):format(p, e))
      for i, s in ipairs(got.steps) do
        local what = ('%s step %d'):format(p, i)
        assert.equal(0, s.host_syncs, what .. ': host syncs inside the step ' .. o)
        assert.is_true(s.collectives > 0, what .. ': no NCCL call traced')
        assert.equal(0, s.collectives_on_compute, what .. ': NCCL calls on the compute stream')
        assert.equal(s.collectives, s.after_input, what .. ': a collective not ordered after the compute before it')
        -- tensor parallelism's collectives are on the critical path (the next
        -- product needs the sum): nothing to overlap, but no host waits either
        if p ~= 'tp' then assert.is_true(s.overlapped > 0, what .. ': no compute ran beside a collective') end
        assert.is_true(s.device_waits > 0, what .. ': the compute stream never waited for the communicator')
        -- the host-waiting form, which the device waits replace, did wait
        assert.is_true(before.steps[i].host_syncs > 0, what .. ': host waits (before) ' .. o)
      end
    end
  end)

  -- one bucket, so its wait is the only one between the all-reduce and the
  -- gradient norm's kernel that reads it (a later wait on the same stream
  -- would order it too)
  it('reports a device wait left out (race and stream checks on)', function()
    local o, rc = H.sh(('env GL_SIM_DEVICES=2 GL_SIM_RACECHECK=1 %s -np 2 --oversubscribe --allow-run-as-root %s ' ..
      'recipes/tools/host_syncs.lua --policies=ddp --bucket_mb=25 --waits=device --steps=1 --skip_waits=1'):format(H.MPIRUN, H.EXE), 300)
    assert.is_true(rc ~= 0, o)
    assert.truthy(o:find('missing stream wait', 1, true), o)
    assert.truthy(o:find('ncclAllReduce', 1, true), o)
  end)
end)
