-- gptlua.dist: rank discovery, the launcher, the world of one (in this
-- process), and every collective over 2 and 3 MPI ranks (spec/dist/*.lua
-- run by build/gptlua under mpirun, oversubscribed on small machines),
-- plus the two failure modes: a rank that raises, a rank that never joins.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local launch = require 'gptlua.dist.launch'

local H = require 'support.mpi'
local EXE, MPIRUN = H.EXE, H.MPIRUN
local function sh(cmd) return H.sh(cmd, 60) end
local function mpirun(n, script, args) return H.mpirun(n, script, args, 60) end
local assert_ranks_ok = H.assert_ranks_ok

describe('gptlua.dist rank discovery', function()
  local function env(t) return function(k) return t[k] end end

  it('reads torchrun, Open MPI, PMI or SLURM variables', function()
    assert.same({ launcher = 'torchrun', rank = 3, size = 8, local_rank = 1, local_size = 4,
      launchers = { torchrun = true } }, dist.discover(env({ RANK = '3', WORLD_SIZE = '8', LOCAL_RANK = '1', LOCAL_WORLD_SIZE = '4' })))
    local d = dist.discover(env({ OMPI_COMM_WORLD_RANK = '5', OMPI_COMM_WORLD_SIZE = '6' }))
    assert.same({ 'openmpi', 5, 6 }, { d.launcher, d.rank, d.size })
    d = dist.discover(env({ PMI_RANK = '0', PMI_SIZE = '2' }))
    assert.same({ 'pmi', 0, 2 }, { d.launcher, d.rank, d.size })
    assert.same({ launcher = 'slurm', rank = 7, size = 9, local_rank = 2, local_size = 3,
      launchers = { slurm = true } }, dist.discover(env({ SLURM_PROCID = '7', SLURM_NTASKS = '9', SLURM_LOCALID = '2',
        SLURM_NTASKS_PER_NODE = '3(x3)' })))
    assert.is_nil(dist.discover(env({})))
    -- sources that agree: the first names the launcher
    d = dist.discover(env({ RANK = '1', WORLD_SIZE = '2', OMPI_COMM_WORLD_RANK = '1', OMPI_COMM_WORLD_SIZE = '2' }))
    assert.same({ 'torchrun', 1, 2 }, { d.launcher, d.rank, d.size })
    -- the host backend: Gloo over TCP for torchrun-style variables alone,
    -- MPI as soon as an MPI launcher's are there too
    assert.equal('mpi', dist.host_backend('auto', d))
    assert.equal('gloo', dist.host_backend('auto', dist.discover(env({ RANK = '1', WORLD_SIZE = '2' }))))
    assert.equal('gloo', dist.host_backend('nccl', dist.discover(env({ RANK = '1', WORLD_SIZE = '2' }))))
    assert.equal('mpi', dist.host_backend('auto', dist.discover(env({ PMI_RANK = '1', PMI_SIZE = '2' }))))
    assert.equal('gloo', dist.host_backend('gloo', nil))
  end)

  it('needs MASTER_ADDR and MASTER_PORT for a torchrun-style launch', function()
    assert.same({ 'node0', 29500 }, { dist.master(env({ MASTER_ADDR = 'node0', MASTER_PORT = '29500' })) })
    local ok, e = pcall(dist.master, env({ MASTER_PORT = '29500' }))
    assert.is_false(ok)
    assert.truthy(tostring(e):find('also needs MASTER_ADDR and MASTER_PORT', 1, true), e)
    ok, e = pcall(dist.master, env({ MASTER_ADDR = 'node0', MASTER_PORT = '70000' }))
    assert.is_false(ok)
    assert.equal('dist: MASTER_PORT expected a port number 1..65535, got "70000"', e)
  end)

  it('shares the cores among the ranks of a node', function()
    assert.equal(1, dist.default_threads(2, 3))
    assert.equal(1, dist.default_threads(2, 2))
    assert.equal(2, dist.default_threads(2, 1))
    assert.equal(4, dist.default_threads(16, 4))
  end)
end)

describe('gptlua.dist launcher', function()
  it('builds the mpirun command line', function()
    assert.same({ '/usr/bin/mpirun', '-np', '4', '--oversubscribe', '--allow-run-as-root', '--hostfile', 'hosts',
                  '/opt/gptlua', 'train.lua', '--steps=5', 'x' },
      launch.command(4, 'train.lua', { '--steps=5', 'x' },
        { mpirun = '/usr/bin/mpirun', exe = '/opt/gptlua', uid = 0, extra = '--hostfile  hosts' }))
    assert.same({ 'mpirun', '-np', '2', '--oversubscribe', '/opt/gptlua', 'a.lua' },
      launch.command(2, 'a.lua', {}, { exe = '/opt/gptlua', uid = 1000, extra = '' }))
  end)

  it('finds executables on PATH', function()
    assert.equal('/bin/sh', launch.which('sh', '/nonexistent:/bin'))
    assert.is_nil(launch.which('no-such-program-here', '/bin:/usr/bin'))
  end)

  it('fails clearly without mpirun or with a bad rank count', function()
    local out, rc = sh('env GPTLUA_MPIRUN=/nonexistent/mpirun ' .. EXE .. ' -n 2 --launcher=mpi spec/dist/collectives.lua')
    assert.equal(1, rc)
    assert.truthy(out:find('/nonexistent/mpirun was not found', 1, true), out)
    local real, said = io.stderr, {}
    io.stderr = { write = function(_, ...) for _, s in ipairs({ ... }) do said[#said + 1] = tostring(s) end end }
    local status = launch.main(0, 'x.lua', {})
    io.stderr = real
    assert.equal(1, status)
    assert.equal('gptlua -n: expected a positive number of ranks, got 0\n', table.concat(said))
  end)
end)

describe('gptlua.dist world of one', function()
  local world = dist.init()

  it('needs no launcher and loads no MPI', function()
    assert.equal(0, world.rank); assert.equal(1, world.size)
    assert.equal(0, world.local_rank); assert.equal(1, world.local_size); assert.equal(0, world.node)
    assert.equal('local', world.backend)
    assert.equal(world, dist.init { timeout = 30 })
    assert.is_nil(dist.backend_lib())
    for line in io.lines('/proc/self/maps') do assert.falsy(line:find('libmpi'), line) end
  end)

  it('makes every collective a copy', function()
    local t = gl.tensor({ 1, 2, 3 })
    assert.equal(t, world:all_reduce(t, 'avg'))
    assert.same({ 1, 2, 3 }, t:totable())
    local out = gl.zeros({ 2, 2 }, { dtype = 'int64' })
    world:all_gather(out, gl.tensor({ 4, 5, 6, 7 }, { dtype = 'int64' }))
    assert.same({ { 4, 5 }, { 6, 7 } }, out:totable())
    local list = { gl.zeros({ 3 }) }
    world:all_to_all(list, { gl.tensor({ 1, 2, 3 }) })
    assert.same({ 1, 2, 3 }, list[1]:totable())
    local h = world:reduce_scatter_async(gl.zeros({ 2 }), gl.tensor({ { 8 }, { 9 } }))
    assert.is_true(h:test())
    assert.same({ 8, 9 }, h:wait():totable())
    world:barrier()
    local sub = world:split(5)
    assert.equal(1, sub.size)
    assert.is_nil(world:split(-1))
  end)

  it('checks arguments like the MPI backend', function()
    assert.has_error(function() world:send(gl.zeros({ 1 }), 0) end, 'send: peer expected a rank other than this one (0)')
    assert.has_error(function() world:all_reduce(gl.zeros({ 1 }, { dtype = 'int32' }), 'avg') end,
      'all_reduce: avg expected a floating dtype, got int32 (use sum)')
    assert.has_error(function() world:all_gather(gl.zeros({ 3 }), gl.zeros({ 2 })) end,
      "all_gather: send expected 3 elements (recv's numel / ranks), got 2")
    assert.has_error(function() world:broadcast(gl.zeros({ 1 }), 1) end,
      'broadcast: root expected a rank in 0..0, got 1')
    assert.has_error(function() world:all_gather({ gl.zeros({ 1 }), gl.zeros({ 1 }) }, gl.zeros({ 1 })) end,
      'all_gather: out expected a list of 1 tensors (one per rank), got 2')
  end)
end)

describe('gptlua.dist over MPI ranks', function()
  if not MPIRUN then
    pending('mpirun is not installed (make deps)')
    return
  end

  it('runs every collective on 2 ranks started by gptlua -n 2', function()
    local out, rc = sh(EXE .. ' -n 2 spec/dist/collectives.lua')
    assert_ranks_ok(out, rc, 2)
  end)

  it('runs every collective on 3 ranks started by mpirun', function()
    local out, rc = mpirun(3, 'spec/dist/collectives.lua')
    assert_ranks_ok(out, rc, 3)
  end)

  it('runs the same checks in a world of one without a launcher', function()
    local out, rc = sh(EXE .. ' spec/dist/collectives.lua auto')
    assert_ranks_ok(out, rc, 1)
  end)

  it('finalises by itself when the ranks exit normally', function()
    local out, rc = mpirun(2, 'spec/dist/clean_exit.lua')
    assert.equal(0, rc, out)
    assert.truthy(out:find('rank 0 done, sub-communicator of 2', 1, true), out)
  end)

  it('brings every rank down promptly when one raises an error', function()
    local out, rc, secs = mpirun(3, 'spec/dist/error.lua')
    H.assert_ended_by_itself(out, rc, secs)
    assert.truthy(out:find('deliberate failure on the last rank', 1, true), out)
    assert.truthy(out:find('[rank 2]', 1, true), out)
    assert.falsy(out:find('unreachable', 1, true), out)
  end)

  it('prefixes a reported error with the rank and aborts every rank', function()
    local out, rc, secs = mpirun(2, 'spec/dist/error.lua', 'on_error')
    H.assert_ended_by_itself(out, rc, secs)
    assert.truthy(out:find('[rank 1] deliberate failure on the last rank\n[rank 1] second line', 1, true), out)
    assert.falsy(out:find('unreachable', 1, true), out)
  end)

  it('aborts every rank when one never joins, naming op, group, sequence and rank', function()
    local out, rc, secs = mpirun(3, 'spec/dist/timeout.lua')
    H.assert_ended_by_itself(out, rc, secs)
    assert.truthy(out:find("timeout: all_reduce on group 'world' (seq 1, 3 ranks) did not complete within 2.0 s",
      1, true), out)
    assert.truthy(out:find('Missing: rank 2 did not answer', 1, true), out)
    assert.falsy(out:find('unreachable', 1, true), out)
  end)

  it('names group and world ranks when a sub-communicator times out', function()
    local out, rc = mpirun(2, 'spec/dist/timeout.lua', 'split')
    assert.is_true(rc ~= 0, out)
    assert.truthy(out:find("all_reduce on group 'world.1[0]' (seq 1, 2 ranks)", 1, true), out)
    assert.truthy(out:find('Missing: rank 0 (world rank 1) did not answer', 1, true), out)
  end)
end)
