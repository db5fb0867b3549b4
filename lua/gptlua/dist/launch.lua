-- gptlua.dist.launch — `gptlua -n N [--launcher=mpi|tcp|auto] script.lua args...`.
--   mpi: replaces this process with `mpirun -np N --oversubscribe <gptlua>
--        script.lua args...`, so N local ranks run the script and mpirun's
--        exit status is gptlua's.  Extra mpirun options (a host file for
--        several nodes, say) come from GPTLUA_MPIRUN_ARGS; another launcher
--        binary from GPTLUA_MPIRUN.
--   tcp: starts the N ranks itself, as torchrun does, with RANK, WORLD_SIZE,
--        LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (default 127.0.0.1) and
--        MASTER_PORT (default: a free port) set, so they meet at the TCP
--        rendezvous and talk through Gloo; no MPI needed.  When a rank fails
--        the others are ended; the status is the first failing rank's.
--   auto (default, or GPTLUA_LAUNCHER): mpi when mpirun is on PATH, else tcp.
local ffi = require 'ffi'

local M = {}

local function cdef_once(name, decl)
  if not pcall(function() return ffi.C[name] end) then ffi.cdef(decl) end
end
cdef_once('execvp', 'int execvp(const char *file, char *const argv[]);')
cdef_once('getuid', 'unsigned int getuid(void);')
cdef_once('access', 'int access(const char *path, int mode);')
cdef_once('strerror', 'char *strerror(int errnum);')
cdef_once('fork', 'int fork(void);')
cdef_once('setenv', 'int setenv(const char *name, const char *value, int overwrite);')
cdef_once('waitpid', 'int waitpid(int pid, int *status, int options);')
cdef_once('kill', 'int kill(int pid, int sig);')
cdef_once('_exit', 'void _exit(int status);')
cdef_once('poll', 'int poll(void *fds, unsigned long nfds, int timeout);')
cdef_once('socket', 'int socket(int domain, int type, int protocol);')
cdef_once('bind', 'int bind(int fd, const void *addr, unsigned int len);')
cdef_once('getsockname', 'int getsockname(int fd, void *addr, unsigned int *len);')
cdef_once('close', 'int close(int fd);')

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

local function argv_of(list)
  local cargv = ffi.new('char*[?]', #list + 1)
  local keep = {}
  for i, a in ipairs(list) do
    keep[i] = ffi.new('char[?]', #a + 1, a)
    cargv[i - 1] = keep[i]
  end
  cargv[#list] = nil
  return cargv, keep
end

-- A TCP port free on this host now (the kernel picks it; rank 0 binds it
-- again a moment later, SO_REUSEADDR), or nil.
function M.free_port()
  local fd = ffi.C.socket(2, 1, 0)   -- AF_INET, SOCK_STREAM
  if fd < 0 then return nil end
  local addr = ffi.new('uint8_t[16]')
  addr[0] = 2                        -- sin_family AF_INET (little-endian), port 0, INADDR_ANY
  local len = ffi.new('unsigned int[1]', 16)
  local port
  if ffi.C.bind(fd, addr, 16) == 0 and ffi.C.getsockname(fd, addr, len) == 0 then
    port = addr[2] * 256 + addr[3]   -- sin_port, network order
  end
  ffi.C.close(fd)
  return port
end

-- The environment of rank r of n under the TCP launcher.
function M.tcp_env(r, n, addr, port)
  return { RANK = tostring(r), WORLD_SIZE = tostring(n), LOCAL_RANK = tostring(r), LOCAL_WORLD_SIZE = tostring(n),
    MASTER_ADDR = addr, MASTER_PORT = tostring(port) }
end

local function exit_status(st)
  local sig = bit.band(st, 0x7f)
  if sig == 0 then return bit.band(bit.rshift(st, 8), 0xff) end
  return 128 + sig
end

-- Starts n ranks of script on this host over TCP, waits for them, and
-- returns the exit status: 0, or the first failing rank's (the others are
-- sent SIGTERM then, and SIGKILL 5 s later).
function M.tcp(n, script, args)
  local addr = os.getenv('MASTER_ADDR') or '127.0.0.1'
  local port = tonumber(os.getenv('MASTER_PORT') or '') or M.free_port()
  if not port then io.stderr:write('gptlua -n: no free TCP port for the rendezvous (set MASTER_PORT)\n') return 1 end
  local exe = M.exe()
  local list = { exe, script }
  for _, a in ipairs(args or {}) do list[#list + 1] = tostring(a) end
  local cargv, keep = argv_of(list)
  io.stdout:flush()
  io.stderr:flush()
  local pids, alive = {}, 0
  for r = 0, n - 1 do
    local pid = ffi.C.fork()
    if pid == 0 then
      for k, v in pairs(M.tcp_env(r, n, addr, port)) do ffi.C.setenv(k, v, 1) end
      ffi.C.execvp(exe, cargv)
      io.stderr:write('gptlua -n: cannot run ', exe, ': ', ffi.string(ffi.C.strerror(ffi.errno())), '\n')
      io.stderr:flush()
      ffi.C._exit(127)
    elseif pid < 0 then
      io.stderr:write('gptlua -n: fork failed: ', ffi.string(ffi.C.strerror(ffi.errno())), '\n')
      for _, p in pairs(pids) do ffi.C.kill(p, 9) end
      return 1
    end
    pids[r] = pid
    alive = alive + 1
  end
  local _ = keep
  local status, failed_at = 0, nil
  local st = ffi.new('int[1]')
  while alive > 0 do
    local got = false
    for r, pid in pairs(pids) do
      if ffi.C.waitpid(pid, st, 1) == pid then   -- WNOHANG
        pids[r], alive, got = nil, alive - 1, true
        local code = exit_status(st[0])
        if code ~= 0 and status == 0 then
          status, failed_at = code, os.time()
          for _, p in pairs(pids) do ffi.C.kill(p, 15) end   -- SIGTERM the rest
        end
      end
    end
    if failed_at and alive > 0 and os.time() - failed_at > 5 then
      for _, p in pairs(pids) do ffi.C.kill(p, 9) end
    end
    if not got then ffi.C.poll(nil, 0, 20) end
  end
  return status
end

-- Called by gptlua.cli for `-n N`.  Returns only on failure (exit status),
-- except under the TCP launcher, which returns the ranks' status.
function M.main(n, script, args, launcher)
  if type(n) ~= 'number' or n < 1 or n ~= math.floor(n) then
    io.stderr:write('gptlua -n: expected a positive number of ranks, got ', tostring(n), '\n')
    return 1
  end
  launcher = launcher or os.getenv('GPTLUA_LAUNCHER') or 'auto'
  if launcher ~= 'auto' and launcher ~= 'mpi' and launcher ~= 'tcp' then
    io.stderr:write("gptlua -n: --launcher expected 'mpi', 'tcp' or 'auto', got '", launcher, "'\n")
    return 1
  end
  if launcher == 'auto' then
    launcher = M.which(os.getenv('GPTLUA_MPIRUN') or 'mpirun') and 'mpi' or 'tcp'
  end
  if launcher == 'tcp' then return M.tcp(n, script, args) end
  local name = os.getenv('GPTLUA_MPIRUN') or 'mpirun'
  local mpirun = M.which(name)
  if not mpirun then
    io.stderr:write('gptlua -n: ', name, ' was not found on PATH; install Open MPI (make deps installs ',
      'openmpi-bin), use --launcher=tcp, or start the ranks with your own launcher (srun, mpiexec, ',
      'torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables)\n')
    return 1
  end
  local argv = M.command(n, script, args, { mpirun = mpirun })
  local cargv, keep = argv_of(argv)
  local _ = keep
  io.stdout:flush()
  io.stderr:flush()
  ffi.C.execvp(mpirun, cargv)
  io.stderr:write('gptlua -n: cannot run ', mpirun, ': ', ffi.string(ffi.C.strerror(ffi.errno())), '\n')
  return 1
end

return M
