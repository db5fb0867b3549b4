-- gptlua.dist.launch — `gptlua -n N script.lua args...`: runs
-- `mpirun -np N --oversubscribe <gptlua> script.lua args...` as a child and
-- exits with its status, so N local ranks run the script.  Extra mpirun
-- options (a host file for several nodes, say) come from GPTLUA_MPIRUN_ARGS;
-- another launcher binary from GPTLUA_MPIRUN.
--
-- Ctrl-C (issue 14).  Open MPI 4's mpirun kills the whole job on SIGINT or
-- SIGTERM (SIGTERM to every rank, SIGKILL a few seconds later), so a rank
-- never gets to save; it forwards SIGUSR1 and SIGUSR2 to every rank
-- ("mpirun: Forwarding signal 10 to job").  So gptlua stays the parent:
-- mpirun runs in its own process group (the terminal's Ctrl-C reaches
-- gptlua alone; Open MPI already puts each rank in a group of its own), the
-- first SIGINT becomes a SIGUSR1 to mpirun, which the trainer on every rank
-- treats as its Ctrl-C (the ranks agree to stop at the next step boundary,
-- save one checkpoint and exit 0), and a second SIGINT, or a SIGTERM, is
-- passed on as is: mpirun kills the job.  SIGHUP (the terminal closed)
-- reaches mpirun as SIGTERM: in its own group it would not get it, and the
-- job would go on without anyone to read its output.
local ffi = require 'ffi'

local M = {}

local function cdef_once(name, decl)
  if not pcall(function() return ffi.C[name] end) then ffi.cdef(decl) end
end
cdef_once('getuid', 'unsigned int getuid(void);')
cdef_once('access', 'int access(const char *path, int mode);')
cdef_once('strerror', 'char *strerror(int errnum);')
cdef_once('kill', 'int kill(int pid, int sig);')
cdef_once('waitpid', 'int waitpid(int pid, int *status, int options);')
cdef_once('poll', 'int poll(void *fds, unsigned long nfds, int timeout);')
cdef_once('getpid', 'int getpid(void);')
-- glibc's posix_spawnattr_t is 336 bytes; an opaque block larger than that
cdef_once('posix_spawnp', [[
typedef struct { long opaque_[64]; } gl_spawnattr_t;
int posix_spawnattr_init(gl_spawnattr_t *attr);
int posix_spawnattr_destroy(gl_spawnattr_t *attr);
int posix_spawnattr_setflags(gl_spawnattr_t *attr, short flags);
int posix_spawnattr_setpgroup(gl_spawnattr_t *attr, int pgroup);
int posix_spawnp(int *pid, const char *file, const void *file_actions, const gl_spawnattr_t *attrp,
                 char *const argv[], char *const envp[]);
]])
pcall(ffi.cdef, 'extern char **environ;')

local X_OK, WNOHANG, EINTR = 1, 1, 4
local SIGHUP, SIGINT, SIGUSR1, SIGTERM = 1, 2, 10, 15
local POSIX_SPAWN_SETPGROUP = 0x02
M.STOP_SIGNAL = SIGUSR1   -- what a rank receives for the launcher's first Ctrl-C

function M.getpid() return ffi.C.getpid() end

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

-- Starts argv[1] (PATH search) in a process group of its own; returns its
-- pid, or nil and the reason.
function M.spawn(argv)
  local cargv = ffi.new('char*[?]', #argv + 1)
  local keep = {}
  for i, a in ipairs(argv) do
    keep[i] = ffi.new('char[?]', #a + 1, a)
    cargv[i - 1] = keep[i]
  end
  cargv[#argv] = nil
  local attr = ffi.new('gl_spawnattr_t[1]')
  ffi.C.posix_spawnattr_init(attr)
  ffi.C.posix_spawnattr_setflags(attr, POSIX_SPAWN_SETPGROUP)
  ffi.C.posix_spawnattr_setpgroup(attr, 0)   -- 0: a new group led by the child
  local pid = ffi.new('int[1]')
  io.stdout:flush()
  io.stderr:flush()
  local rc = ffi.C.posix_spawnp(pid, argv[1], nil, attr, cargv, ffi.C.environ)
  ffi.C.posix_spawnattr_destroy(attr)
  if rc ~= 0 then return nil, ffi.string(ffi.C.strerror(rc)) end
  return pid[0]
end

-- Waits for child pid, forwarding signals as the header says; returns its
-- exit status (128 + the signal when a signal ended it, as a shell says).
function M.wait(pid)
  local lib = require('gptlua').lib
  for _, sig in ipairs({ SIGHUP, SIGINT, SIGTERM }) do lib.gl_signal_catch(sig) end
  local status, interrupts = ffi.new('int[1]'), 0
  while true do
    local r = ffi.C.waitpid(pid, status, WNOHANG)
    if r == pid then break end
    if r < 0 and ffi.errno() ~= EINTR then break end
    local ints, terms = lib.gl_signal_take(SIGINT), lib.gl_signal_take(SIGTERM) + lib.gl_signal_take(SIGHUP)
    for _ = 1, ints do
      interrupts = interrupts + 1
      if interrupts == 1 then
        io.stderr:write('gptlua -n: interrupted; the ranks stop at the next step and save a checkpoint ',
          '(Ctrl-C again to kill them)\n')
        ffi.C.kill(pid, SIGUSR1)
      else
        ffi.C.kill(pid, SIGINT)
      end
    end
    if terms > 0 then ffi.C.kill(pid, SIGTERM) end
    ffi.C.poll(nil, 0, 50)   -- a signal cuts this short
  end
  for _, sig in ipairs({ SIGHUP, SIGINT, SIGTERM }) do lib.gl_signal_restore(sig) end
  local s = status[0]
  if bit.band(s, 0x7f) == 0 then return bit.band(bit.rshift(s, 8), 0xff) end  -- WIFEXITED: WEXITSTATUS
  return 128 + bit.band(s, 0x7f)                                               -- WTERMSIG
end

-- Called by gptlua.cli for `-n N`; returns the exit status.
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
  local pid, err = M.spawn(M.command(n, script, args, { mpirun = mpirun }))
  if not pid then
    io.stderr:write('gptlua -n: cannot run ', mpirun, ': ', err, '\n')
    return 1
  end
  return M.wait(pid)
end

return M
