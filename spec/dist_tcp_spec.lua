-- gptlua.dist without MPI (issue 14): ranks started torchrun-style (RANK,
-- WORLD_SIZE, MASTER_ADDR, MASTER_PORT) by `gptlua -n N --launcher=tcp`
-- meet at the TCP rendezvous and talk through Gloo (engine/gloo/).  The
-- same worker scripts as under mpirun (spec/dist/*.lua, backend from
-- GPTLUA_SPEC_BACKEND): every collective, timeouts naming the missing rank,
-- errors ending the job, clean exits, and DDP and FSDP training equal to
-- one process; plus the rendezvous' own failures.
local train = require 'gptlua.train'
local ckpt = require 'gptlua.checkpoint'
local launch = require 'gptlua.dist.launch'
local H = require 'support.mpi'
local EXE = H.EXE
local recipe = dofile(H.ROOT .. '/spec/dist/policy_recipe.lua')

local function has(s, part) assert.truthy(s:find(part, 1, true), s) end

if not io.open(require('gptlua.ffi').libdir .. '/libgptlua_gloo.so') then
  describe('gptlua.dist over TCP', function() pending('libgptlua_gloo.so was not built (make deps: libgloo-dev)') end)
  return
end

describe('gptlua -n N --launcher=tcp', function()
  it('runs every collective on 2 ranks, started over TCP by itself when mpirun is missing, with no MPI loaded', function()
    local out, rc = H.sh('env GPTLUA_MPIRUN=/nonexistent/mpirun ' .. EXE .. ' -n 2 spec/dist/collectives.lua gloo', 90)
    H.assert_ranks_ok(out, rc, 2)
  end)

  it('runs every collective on 3 ranks', function()
    local out, rc = H.tcprun(3, 'spec/dist/collectives.lua', 'gloo', 90)
    H.assert_ranks_ok(out, rc, 3)
  end)

  it('sets the torchrun variables of each rank and refuses an unknown launcher', function()
    assert.same({ RANK = '2', WORLD_SIZE = '4', LOCAL_RANK = '2', LOCAL_WORLD_SIZE = '4', MASTER_ADDR = '127.0.0.1',
      MASTER_PORT = '29500' }, launch.tcp_env(2, 4, '127.0.0.1', 29500))
    local p = launch.free_port()
    assert.is_true(p > 0 and p < 65536)
    local out, rc = H.sh(EXE .. ' -n 2 --launcher=ssh spec/dist/clean_exit.lua', 10)
    assert.equal(1, rc)
    has(out, "gptlua -n: --launcher expected 'mpi', 'tcp' or 'auto', got 'ssh'")
    out, rc = H.sh(EXE .. ' --launcher=tcp spec/dist/clean_exit.lua', 10)
    assert.equal(1, rc)
    has(out, 'gptlua: --launcher goes with -n N')
  end)

  it('gives each node of NNODES its share of the ranks and refuses a NODE_RANK or NNODES out of range', function()
    assert.same({ RANK = '5', WORLD_SIZE = '8', LOCAL_RANK = '1', LOCAL_WORLD_SIZE = '4', MASTER_ADDR = 'node0',
      MASTER_PORT = '29500' }, launch.tcp_env(1, 4, 'node0', 29500, 1, 2))
    local base = 'MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 '
    local cases = {
      { base .. 'NNODES=2 NODE_RANK=2', 'gptlua -n: NODE_RANK expected an integer in 0..1 (this node of NNODES=2), got 2' },
      { base .. 'NNODES=0', 'gptlua -n: NNODES expected a positive integer (the nodes of the job), got 0' },
      { 'NNODES=2 NODE_RANK=1', "gptlua -n: NNODES=2 needs MASTER_ADDR and MASTER_PORT (node 0's address and a port" },
    }
    for _, c in ipairs(cases) do
      local out, rc = H.sh(('env -u MASTER_ADDR -u MASTER_PORT %s %s -n 1 --launcher=tcp spec/dist/clean_exit.lua')
        :format(c[1], EXE), 10)
      assert.equal(1, rc, out)
      has(out, c[2])
    end
  end)

  it('takes the rendezvous port from GPTLUA_PORTS when set (make test gives each suite its own range)', function()
    local script = os.tmpname()
    local f = assert(io.open(script, 'wb'))
    f:write("print('PORT ' .. tostring(require('gptlua.dist.launch').free_port()))\n")
    f:close()
    -- this suite's own range, if make test set one, is not this spec's to take
    local out, rc = H.sh(('env GPTLUA_PORTS=47301-47303 %s %s'):format(EXE, script), 10)
    assert.equal(0, rc, out)
    local p = tonumber(out:match('PORT (%d+)'))
    assert.is_true(p ~= nil and p >= 47301 and p <= 47303, out)
    out, rc = H.sh(('env GPTLUA_PORTS=%d-%d %s %s'):format(p, p, EXE, script), 10)
    assert.equal(0, rc, out)
    has(out, 'PORT ' .. p)
    out, rc = H.sh(('env GPTLUA_PORTS=70000-70001 %s %s'):format(EXE, script), 10)
    os.remove(script)
    assert.not_equal(0, rc)
    has(out, 'GPTLUA_PORTS expected a port range LO-HI within 1-65535, got 70000-70001')
  end)

  it('refuses a recv whose size differs from the send, naming both', function()
    for n, want in pairs({ [3] = 'rank 0 sent 4 elements, expected 3', [8] = 'rank 0 sent 4 elements, expected 8' }) do
      local out, rc = H.tcprun(2, 'spec/dist/recv_size.lua', tostring(n), 30)
      assert.is_true(rc ~= 0, out)
      has(out, "[rank 1] ")
      has(out, "recv on group 'world' (seq 0) failed: " .. want)
    end
    local out, rc = H.tcprun(2, 'spec/dist/recv_size.lua', '4', 30)
    H.assert_ranks_ok(out, rc, 2)
  end)

  it('finalises by itself when the ranks exit normally', function()
    local out, rc = H.tcprun(2, 'spec/dist/clean_exit.lua', '', 60)
    assert.equal(0, rc, out)
    has(out, 'rank 0 done, sub-communicator of 2')
  end)

  it('brings every rank down promptly when one raises an error, with its status', function()
    local out, rc, secs = H.tcprun(3, 'spec/dist/error.lua', '', 60)
    assert.equal(1, rc, out)  -- (not timeout's 124: the job ended by itself, see H.assert_ended_by_itself)
    has(out, '[rank 2] ')
    has(out, 'deliberate failure on the last rank')
    assert.falsy(out:find('unreachable', 1, true), out)
    out, rc, secs = H.tcprun(2, 'spec/dist/error.lua', 'on_error', 60)
    H.assert_ended_by_itself(out, rc, secs)
    has(out, '[rank 1] deliberate failure on the last rank\n[rank 1] second line')
    assert.falsy(out:find('unreachable', 1, true), out)
  end)

  it('aborts every rank when one never joins a collective, naming op, group, sequence and rank', function()
    local out, rc, secs = H.tcprun(3, 'spec/dist/timeout.lua', '', 60)
    H.assert_ended_by_itself(out, rc, secs)
    -- rank 0 or 1, whichever reports first (the launcher then ends the rest)
    assert.truthy(out:find("gptlua.dist: timeout: all_reduce on group 'world' %(seq 1, 3 ranks%) did not complete "
      .. 'within 2.0 s on rank [01]%. Missing: rank 2 has not been blocked in any collective'), out)
    out, rc = H.tcprun(2, 'spec/dist/timeout.lua', 'split', 60)
    assert.is_true(rc ~= 0, out)
    has(out, "timeout: all_reduce on group 'world.1[0]' (seq 1, 2 ranks) did not complete within 2.0 s on rank 1 "
      .. '(world rank 0). Missing: rank 0 (world rank 1)')
  end)
end)

describe('gptlua -n 2 --launcher=tcp recipe', function()
  it('trains with ddp by default, rank 0 printing and writing once', function()
    local dir = H.tmpdir()
    local out, rc = H.sh(('%s -n 2 --launcher=tcp spec/dist/launch_recipe.lua --out_dir=%s'):format(EXE, dir), 90)
    assert.equal(0, rc, out)
    local _, n = out:gsub('dist: ddp %(default for 2 ranks%), collective timeout 600 s', '')
    assert.equal(1, n, out)
    has(out, 'step     2/2')
    assert.truthy(io.open(dir .. '/launch/metrics.jsonl'), 'no metrics written')
    os.execute('rm -rf ' .. dir)
  end)
end)

describe('the TCP rendezvous', function()
  -- timeout: 1 s where the timeout is what is tested; else long enough for
  -- a loaded machine to start the other rank
  local function rank(r, size, port, timeout)
    return ('env RANK=%d WORLD_SIZE=%d MASTER_ADDR=127.0.0.1 MASTER_PORT=%d %s spec/dist/rendezvous.lua %g')
      :format(r, size, port, EXE, timeout or 1)
  end

  -- The wall seconds of the same script in a world of one (it joins at
  -- once): what the machine's load makes of a start-up now.  A rank that
  -- waits out the 1 s timeout must end within 3 x (that + 1 s), a bound that
  -- stretches with the load as the run itself does; a timeout that never
  -- fires runs into H.sh's limit.
  local function within_timeout(out, rc, secs)
    local _, _, alone = H.sh(rank(0, 1, launch.free_port()), 20)
    H.assert_ended_by_itself(out, rc, secs)
    assert.is_true(secs < 3 * (alone + 1),
      ('took %.1f s, where the same script alone took %.1f s and the timeout is 1 s'):format(secs, alone))
  end

  it('names the ranks that never joined when the timeout passes', function()
    local port = launch.free_port()
    local out, rc, secs = H.sh(rank(0, 3, port), 20)
    within_timeout(out, rc, secs)
    has(out, ('rendezvous at 127.0.0.1:%d timed out after 1.0 s: ranks 1, 2 of 3 did not join (each rank needs '
      .. 'the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and its own RANK)'):format(port))
  end)

  it('says rank 0 cannot be reached when it never serves', function()
    local port = launch.free_port()
    local out, rc, secs = H.sh(rank(1, 2, port), 20)
    within_timeout(out, rc, secs)
    has(out, ('rendezvous: cannot reach 127.0.0.1:%d (MASTER_ADDR:MASTER_PORT, served by rank 0) within 1.0 s')
      :format(port))
  end)

  it('refuses ranks started with different world sizes', function()
    local port = launch.free_port()
    local out = H.sh(("sh -c '%s & %s; wait'"):format(rank(0, 2, port, 60), rank(1, 3, port, 60)), 90)
    has(out, 'rank 1 was started with WORLD_SIZE=3 but rank 0 with 2; start every rank with the same WORLD_SIZE')
    assert.falsy(out:find('joined', 1, true), out)
  end)

  it('refuses a launch without MASTER_ADDR', function()
    local out, rc = H.sh(('env RANK=0 WORLD_SIZE=2 %s -e "require(\'gptlua.dist\').init{}"'):format(EXE), 20)
    assert.is_true(rc ~= 0, out)
    has(out, 'dist: a torchrun-style launch (RANK, WORLD_SIZE) also needs MASTER_ADDR and MASTER_PORT')
  end)
end)

describe('training over TCP equals one process', function()
  local out = H.tmpdir()
  teardown(function() os.execute('rm -rf ' .. out) end)

  local function close(want, got, what, tol)
    assert.equal(#want, #got, what)
    for i = 1, #want do
      local rel = math.abs(want[i] - got[i]) / math.abs(want[i])
      assert.is_true(rel < tol, ('%s: step %d loss %.9g, expected %.9g'):format(what, i, got[i], want[i]))
    end
  end

  local function reference(over)
    local t = train.new(recipe(over), {})
    return t:run().losses, H.params_of(t.model)
  end

  it('DDP on 2 ranks (2 micro-steps each) matches 1 rank with 4', function()
    local o, rc = H.tcprun(2, 'spec/dist/policy_equiv.lua', out .. ' 2 0.01 adamw:ddp', 120)
    H.assert_ranks_ok(o, rc, 2)
    local losses, params = reference({ optimizer = 'adamw', gradient_accumulation_steps = 4, out_dir = out .. '/r1' })
    close(losses, H.read_json(out .. '/adamw_ddp.json').losses, 'ddp over TCP', 1e-5)
    local e = H.rel_error(params, ckpt.load_safetensors(out .. '/adamw_ddp.safetensors'))
    assert.is_true(e < 1e-5, ('ddp over TCP: final parameters differ, relative error %.3g'):format(e))
  end)

  it('FSDP on 2 ranks (2 micro-steps each) matches 1 rank with 4', function()
    local o, rc = H.tcprun(2, 'spec/dist/fsdp_equiv.lua', out .. ' 2 f=adamw,fsdp', 120)
    H.assert_ranks_ok(o, rc, 2)
    local losses, params = reference({ optimizer = 'adamw', gradient_accumulation_steps = 4, max_iters = 12,
      out_dir = out .. '/r2' })
    close(losses, H.read_json(out .. '/f.json').losses, 'fsdp over TCP', 1e-5)
    local e = H.rel_error(params, ckpt.load_safetensors(out .. '/f.safetensors'))
    assert.is_true(e < 1e-5, ('fsdp over TCP: final parameters differ, relative error %.3g'):format(e))
  end)
end)

describe('NCCL over a TCP world #cuda #sim', function()
  local cuda = require 'gptlua.cuda'
  local SIM = cuda.device_count() > 0 and cuda.get_device_name(0):find('cuda-sim', 1, true) ~= nil
  if not SIM then
    pending('runs in the CUDA simulator (make test-sim)')
    return
  end

  it('says the simulated NCCL needs MPI, and moves CUDA tensors over Gloo', function()
    local out, rc = H.tcprun(2, 'spec/dist/tcp_nccl.lua', '', 120, 'GL_SIM_DEVICES=2')
    H.assert_ranks_ok(out, rc, 2)
  end)
end)
