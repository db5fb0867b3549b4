-- Helpers the multi-rank specs share: run a shell command from the project
-- root with a time limit, launch a worker on N ranks (mpirun, or gptlua's
-- own TCP launcher), temp dirs, JSON files, and comparing parameter sets.
local cjson = require 'cjson'
local launch = require 'gptlua.dist.launch'

local M = {}
M.ROOT, M.EXE = GPTLUA.root, GPTLUA.exe
M.MPIRUN = launch.which('mpirun')

-- output (exit status stripped), exit status and wall seconds of cmd, run
-- from the root within limit seconds
function M.sh(cmd, limit)
  local now = require('gptlua.cli').now
  local t0 = now()
  local p = io.popen(('cd %s && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout %d %s 2>&1; echo "__rc=$?"')
    :format(M.ROOT, limit or 120, cmd))
  local out = p:read('*a')
  p:close()
  return (out:gsub('__rc=%d+%s*$', '')), tonumber(out:match('__rc=(%d+)%s*$')), now() - t0
end

-- script on n ranks (oversubscribed: the CI machine has 2 cores)
function M.mpirun(n, script, args, limit)
  return M.sh(('%s -np %d --oversubscribe --allow-run-as-root %s %s %s'):format(M.MPIRUN, n, M.EXE, script, args or ''),
    limit)
end

-- script on n ranks started by gptlua itself over TCP (torchrun-style
-- variables, the rendezvous and Gloo; no MPI).  Worker scripts that call
-- dist.init with a backend take it from GPTLUA_SPEC_BACKEND ('gloo' here,
-- 'mpi' by default), so one script runs under both launchers.
function M.tcprun(n, script, args, limit, env)
  return M.sh(('env GPTLUA_SPEC_BACKEND=gloo %s %s -n %d --launcher=tcp %s %s'):format(env or '', M.EXE, n, script,
    args or ''), limit)
end

-- a worker run exited 0 and every one of its n ranks printed "OK rank R of N"
-- (followed by suffix, when given)
function M.assert_ranks_ok(out, rc, n, suffix)
  local assert = require 'luassert'  -- busted's, not the global of this module's environment
  assert.equal(0, rc, out)
  for r = 0, n - 1 do
    assert.truthy(out:find(('OK rank %d of %d%s'):format(r, n, suffix or ''), 1, true), out)
  end
end

-- A failing job ended by itself (non-zero status) rather than by M.sh's
-- limit (timeout's 124, or 137 after its KILL).  The specs that use it give
-- M.sh a limit (60 s) shorter than every wait a missed abort would leave:
-- the collectives' default timeout (600 s) and the sleeping ranks' 300 s, so
-- a rank the abort did not reach shows as the limit, on a loaded machine as
-- on an idle one, where a bound on the wall time would not (it measures the
-- machine's load as much as the abort).
function M.assert_ended_by_itself(out, rc, secs)
  local assert = require 'luassert'
  assert.is_true(rc ~= 0, out)
  assert.is_true(rc ~= 124 and rc ~= 137,
    ('the job ran into its time limit (%.1f s, status %d): a rank kept waiting after the failure\n%s'):format(secs, rc, out))
end

function M.tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

function M.read_json(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return cjson.decode(s)
end

-- name -> parameter of a model
function M.params_of(model)
  local out = {}
  for _, np in ipairs(model:named_parameters()) do out[np[1]] = np[2] end
  return out
end

-- relative L2 error of the whole parameter set b against a
function M.rel_error(a, b)
  local gl = require 'gptlua'
  local num, den = 0, 0
  for k, v in pairs(a) do
    assert(b[k] ~= nil, 'missing ' .. k)
    num = num + gl.global_norm({ v - b[k] }) ^ 2
    den = den + gl.global_norm({ v }) ^ 2
  end
  return math.sqrt(num / den)
end

return M
