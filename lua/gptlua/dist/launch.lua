-- gptlua.dist.launch — `gptlua -n N script.lua args...`: replaces this
-- process with `mpirun -np N --oversubscribe <gptlua> script.lua args...`,
-- so N local ranks run the script and mpirun's exit status is gptlua's.
-- Extra mpirun options (a host file for several nodes, say) come from
-- GPTLUA_MPIRUN_ARGS; another launcher binary from GPTLUA_MPIRUN.
local ffi = require 'ffi'

local M = {}

local function cdef_once(name, decl)
  if not pcall(function() return ffi.C[name] end) then ffi.cdef(decl) end
end
cdef_once('execvp', 'int execvp(const char *file, char *const argv[]);')
cdef_once('getuid', 'unsigned int getuid(void);')
cdef_once('access', 'int access(const char *path, int mode);')
cdef_once('strerror', 'char *strerror(int errnum);')

local X_OK = 1

local function executable(p) return ffi.C.access(p, X_OK) == 0 end

-- Full path of an executable name (PATH search) or nil.
function M.which(name, path)
  if name:find('/', 1, true) then return executable(name) and name or nil end
  for dir in (path or os.getenv('PATH') or ''):gmatch('[^:]+') do
    local p = dir .. '/' .. name
    if executable(p) then return p end
  end
  return nil
end

-- The gptlua executable that runs every rank.
function M.exe()
  return (GPTLUA and GPTLUA.exe) or 'gptlua'
end

-- The launch command as an argv list.  opts (for specs): mpirun, exe, uid,
-- extra (a string of extra mpirun options).
function M.command(n, script, args, opts)
  opts = opts or {}
  local argv = { opts.mpirun or 'mpirun', '-np', tostring(n), '--oversubscribe' }
  local uid = opts.uid or ffi.C.getuid()
  if uid == 0 then argv[#argv + 1] = '--allow-run-as-root' end
  for word in (opts.extra or os.getenv('GPTLUA_MPIRUN_ARGS') or ''):gmatch('%S+') do argv[#argv + 1] = word end
  argv[#argv + 1] = opts.exe or M.exe()
  argv[#argv + 1] = script
  for _, a in ipairs(args or {}) do argv[#argv + 1] = tostring(a) end
  return argv
end

-- Called by gptlua.cli for `-n N`.  Returns only on failure (exit status).
function M.main(n, script, args)
  if type(n) ~= 'number' or n < 1 or n ~= math.floor(n) then
    io.stderr:write('gptlua -n: expected a positive number of ranks, got ', tostring(n), '\n')
    return 1
  end
  local name = os.getenv('GPTLUA_MPIRUN') or 'mpirun'
  local mpirun = M.which(name)
  if not mpirun then
    io.stderr:write('gptlua -n: ', name, ' was not found on PATH; install Open MPI (make deps installs ',
      'openmpi-bin), or start the ranks with your own launcher (srun, mpiexec, torchrun-style ',
      'RANK/WORLD_SIZE/LOCAL_RANK variables)\n')
    return 1
  end
  local argv = M.command(n, script, args, { mpirun = mpirun })
  local cargv = ffi.new('char*[?]', #argv + 1)
  local keep = {}
  for i, a in ipairs(argv) do
    keep[i] = ffi.new('char[?]', #a + 1, a)
    cargv[i - 1] = keep[i]
  end
  cargv[#argv] = nil
  io.stdout:flush()
  io.stderr:flush()
  ffi.C.execvp(mpirun, cargv)
  io.stderr:write('gptlua -n: cannot run ', mpirun, ': ', ffi.string(ffi.C.strerror(ffi.errno())), '\n')
  return 1
end

return M
