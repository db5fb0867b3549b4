-- Helpers the multi-rank specs share: run a shell command from the project
-- root with a time limit, launch a worker on N ranks, temp dirs, JSON files.
local cjson = require 'cjson'
local launch = require 'gptlua.dist.launch'

local M = {}
M.ROOT, M.EXE = GPTLUA.root, GPTLUA.exe
M.MPIRUN = launch.which('mpirun')

-- output (exit status stripped) and exit status of cmd, run from the root
function M.sh(cmd, limit)
  local p = io.popen(('cd %s && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout %d %s 2>&1; echo "__rc=$?"')
    :format(M.ROOT, limit or 120, cmd))
  local out = p:read('*a')
  p:close()
  return out:gsub('__rc=%d+%s*$', ''), tonumber(out:match('__rc=(%d+)%s*$'))
end

-- script on n ranks (oversubscribed: the CI machine has 2 cores)
function M.mpirun(n, script, args)
  return M.sh(('%s -np %d --oversubscribe --allow-run-as-root %s %s %s'):format(M.MPIRUN, n, M.EXE, script, args or ''))
end

function M.tmpdir() local d = os.tmpname(); os.remove(d); os.execute('mkdir -p ' .. d); return d end

function M.read_json(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return cjson.decode(s)
end

return M
