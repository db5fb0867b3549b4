-- gptlua.dist.launch — `gptlua -n N [--launcher=mpi|tcp|auto] script.lua args...`.
--   mpi: runs `mpirun -np N --oversubscribe <gptlua> script.lua args...` as a
--        child and exits with its status, so N local ranks run the script.
--        Extra mpirun options (a host file for several nodes, say) come from
--        GPTLUA_MPIRUN_ARGS; another launcher binary from GPTLUA_MPIRUN.
--   tcp: starts the N ranks itself, as torchrun does, with RANK, WORLD_SIZE,
--        LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (default 127.0.0.1) and
--        MASTER_PORT (default: a free port) set, so they meet at the TCP
--        rendezvous and talk through Gloo; no MPI needed.  When a rank fails
--        the others are ended; the status is the first failing rank's.  On
--        several nodes, one launcher a node with NNODES and NODE_RANK set
--        (and MASTER_ADDR, MASTER_PORT: node 0's), as torchrun's flags.
--   auto (default, or GPTLUA_LAUNCHER): mpi when mpirun is on PATH, else tcp.
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
-- job would go on without anyone to read its output.  Under the TCP launcher
-- gptlua is the ranks' parent and signals each rank itself.
local ffi = require 'ffi'

local M = {}

require 'gptlua.libc'   -- getuid, kill, waitpid, poll, posix_spawnp, environ, sockets

local X_OK, WNOHANG, EINTR = 1, 1, 4
local SIGHUP, SIGINT, SIGKILL, SIGUSR1, SIGTERM = 1, 2, 9, 10, 15
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

local function exit_status(st)
  if bit.band(st, 0x7f) == 0 then return bit.band(bit.rshift(st, 8), 0xff) end  -- WIFEXITED: WEXITSTATUS
  return 128 + bit.band(st, 0x7f)                                               -- WTERMSIG
end

-- Waits for the child processes in pids (one mpirun, or the ranks of the
-- TCP launcher), forwarding signals as the header says; returns the exit
-- status (128 + the signal when a signal ended it, as a shell says): 0, or
-- the first failing child's, after which the others get SIGTERM, and
-- SIGKILL 5 s later; and whether the launcher itself was told to stop
-- (Ctrl-C, SIGTERM, SIGHUP: no restart then, gptlua.dist.elastic).
function M.wait(pids)
  if type(pids) ~= 'table' then pids = { pids } end
  local lib = require('gptlua').lib
  for _, sig in ipairs({ SIGHUP, SIGINT, SIGTERM }) do lib.gl_signal_catch(sig) end
  local live, alive = {}, 0
  for _, p in ipairs(pids) do live[p], alive = true, alive + 1 end
  local function signal_all(sig) for p in pairs(live) do ffi.C.kill(p, sig) end end
  local st, interrupts, status, failed_at, stopped = ffi.new('int[1]'), 0, 0, nil, false
  while alive > 0 do
    for p in pairs(live) do
      local r = ffi.C.waitpid(p, st, WNOHANG)
      if r == p or (r < 0 and ffi.errno() ~= EINTR) then
        live[p], alive = nil, alive - 1
        local code = r == p and exit_status(st[0]) or 1
        if code ~= 0 and status == 0 then
          status, failed_at = code, os.time()
          signal_all(SIGTERM)
        end
      end
    end
    if failed_at and alive > 0 and os.time() - failed_at > 5 then signal_all(SIGKILL) end
    local ints, terms = lib.gl_signal_take(SIGINT), lib.gl_signal_take(SIGTERM) + lib.gl_signal_take(SIGHUP)
    for _ = 1, ints do
      interrupts = interrupts + 1
      if interrupts == 1 then
        io.stderr:write('gptlua -n: interrupted; the ranks stop at the next step and save a checkpoint ',
          '(Ctrl-C again to kill them)\n')
        signal_all(SIGUSR1)
      else
        signal_all(SIGINT)
      end
    end
    if terms > 0 then signal_all(SIGTERM); stopped = true end
    if alive > 0 then ffi.C.poll(nil, 0, 50) end   -- a signal cuts this short
  end
  for _, sig in ipairs({ SIGHUP, SIGINT, SIGTERM }) do lib.gl_signal_restore(sig) end
  return status, interrupts > 0 or stopped
end

-- A TCP port free on this host now (the kernel picks it; rank 0 binds it
-- again a moment later, SO_REUSEADDR), or nil.  GPTLUA_PORTS=LO-HI takes the
-- first free one in that range instead, from a start that varies by process
-- (`make test` gives the CPU and simulator suites, which run side by side,
-- ranges of their own, so their rendezvous never race for one port).
local function bind_port(port)
  local fd = ffi.C.socket(2, 1, 0)   -- AF_INET, SOCK_STREAM
  if fd < 0 then return nil end
  local addr = ffi.new('uint8_t[16]')
  addr[0] = 2                        -- sin_family AF_INET (little-endian), INADDR_ANY
  addr[2], addr[3] = math.floor(port / 256), port % 256   -- sin_port, network order (0: the kernel picks)
  local len = ffi.new('unsigned int[1]', 16)
  local got
  if ffi.C.bind(fd, addr, 16) == 0 and ffi.C.getsockname(fd, addr, len) == 0 then
    got = addr[2] * 256 + addr[3]
  end
  ffi.C.close(fd)
  return got
end

function M.free_port()
  local range = os.getenv('GPTLUA_PORTS')
  if not range or range == '' then return bind_port(0) end
  local lo, hi = range:match('^(%d+)%-(%d+)$')
  lo, hi = tonumber(lo), tonumber(hi)
  if not lo or lo < 1 or hi > 65535 or lo > hi then
    error(('GPTLUA_PORTS expected a port range LO-HI within 1-65535, got %s'):format(range), 0)
  end
  local n = hi - lo + 1
  local start = M.getpid() % n
  for i = 0, n - 1 do
    local port = bind_port(lo + (start + i) % n)
    if port then return port end
  end
  return nil
end

-- The environment of local rank r of n under the TCP launcher, on node
-- node of nnodes (each node runs n ranks; global ranks go node by node).
-- place (the launchers' rendezvous, gptlua.dist.rendezvous): this node's
-- first global rank and the world's size instead.
function M.tcp_env(r, n, addr, port, node, nnodes, place)
  node, nnodes = node or 0, nnodes or 1
  local first, world = node * n, nnodes * n
  if place then first, world = place.first_rank, place.world end
  return { RANK = tostring(first + r), WORLD_SIZE = tostring(world), LOCAL_RANK = tostring(r),
    LOCAL_WORLD_SIZE = tostring(n), MASTER_ADDR = addr, MASTER_PORT = tostring(port) }
end

-- NNODES and NODE_RANK (torchrun's --nnodes and --node_rank): this launcher
-- runs node NODE_RANK's n ranks of a job on NNODES nodes; nil and a line
-- saying what is wrong.
function M.nodes_of_env()
  local nn, nr = os.getenv('NNODES'), os.getenv('NODE_RANK')
  local nnodes, node = tonumber(nn or '1'), tonumber(nr or '0')
  if not nnodes or nnodes < 1 or nnodes ~= math.floor(nnodes) then
    return nil, nil, ('NNODES expected a positive integer (the nodes of the job), got %s'):format(nn)
  end
  if not node or node < 0 or node >= nnodes or node ~= math.floor(node) then
    return nil, nil, ('NODE_RANK expected an integer in 0..%d (this node of NNODES=%d), got %s'):format(nnodes - 1,
      nnodes, tostring(nr))
  end
  if nnodes > 1 and not (os.getenv('MASTER_ADDR') and tonumber(os.getenv('MASTER_PORT') or '')) then
    return nil, nil, ('NNODES=%d needs MASTER_ADDR and MASTER_PORT (node 0\'s address and a port every node '
      .. 'agrees on)'):format(nnodes)
  end
  return nnodes, node
end

-- Starts n ranks of script on this host over TCP (this node's share of
-- NNODES nodes, M.nodes_of_env), each in a process group of its own (Ctrl-C
-- reaches the launcher, which forwards it), waits for them and returns the
-- exit status.  place: where the launchers' rendezvous put this node's ranks
-- ({first_rank, world, port}: the ranks meet at MASTER_ADDR:port).
function M.tcp(n, script, args, place)
  local nnodes, node, why = M.nodes_of_env()
  if not nnodes then io.stderr:write('gptlua -n: ', why, '\n') return 1 end
  local addr = os.getenv('MASTER_ADDR') or '127.0.0.1'
  local port = place and place.port or tonumber(os.getenv('MASTER_PORT') or '') or M.free_port()
  if not port then io.stderr:write('gptlua -n: no free TCP port for the rendezvous (set MASTER_PORT)\n') return 1 end
  local argv = { M.exe(), script }
  for _, a in ipairs(args or {}) do argv[#argv + 1] = tostring(a) end
  local pids = {}
  for r = 0, n - 1 do
    -- the child takes a copy of this environment at spawn
    for k, v in pairs(M.tcp_env(r, n, addr, port, node, nnodes, place)) do ffi.C.setenv(k, v, 1) end
    local pid, err = M.spawn(argv)
    if not pid then
      io.stderr:write('gptlua -n: cannot run ', argv[1], ': ', err, '\n')
      for _, p in ipairs(pids) do ffi.C.kill(p, SIGKILL) end
      return 1
    end
    pids[#pids + 1] = pid
  end
  return M.wait(pids)
end

-- Called by gptlua.cli for `-n N`; returns the exit status.  opts:
-- max_restarts, min_ranks and rdzv_timeout (gptlua.dist.elastic restarts a
-- failed job).
function M.main(n, script, args, launcher, opts)
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
  if opts and (opts.max_restarts or opts.min_ranks or opts.rdzv_timeout) then
    return require('gptlua.dist.elastic').main(n, script, args, launcher, opts)
  end
  return (M.run_once(n, script, args, launcher))
end

-- One job of n ranks under launcher 'mpi' or 'tcp' (place: M.tcp's); returns
-- its status, whether the launcher was told to stop (M.wait), and whether
-- the job refused its configuration (a status that no restart changes).
function M.run_once(n, script, args, launcher, place)
  local mpirun
  if launcher ~= 'tcp' then
    local name = os.getenv('GPTLUA_MPIRUN') or 'mpirun'
    mpirun = M.which(name)
    if not mpirun then
      io.stderr:write('gptlua -n: ', name, ' was not found on PATH; install Open MPI (make deps installs ',
        'openmpi-bin), use --launcher=tcp, or start the ranks with your own launcher (srun, mpiexec, ',
        'torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables)\n')
      return 1
    end
  end
  -- a refusal every rank reached alike comes back through this file, the
  -- ranks exiting 0 (gptlua.dist.compose.exit_refused): mpirun adds no banner
  local status_file = os.tmpname()
  ffi.C.setenv('GPTLUA_LAUNCH_STATUS', status_file, 1)
  local status, stopped
  if launcher == 'tcp' then
    status, stopped = M.tcp(n, script, args, place)
  else
    local pid, err = M.spawn(M.command(n, script, args, { mpirun = mpirun }))
    if not pid then
      os.remove(status_file)
      io.stderr:write('gptlua -n: cannot run ', mpirun, ': ', err, '\n')
      return 1
    end
    status, stopped = M.wait(pid)
  end
  local f = io.open(status_file, 'rb')
  local refused = f and f:read('*a') or ''
  if f then f:close() end
  os.remove(status_file)
  refused = status == 0 and tonumber(refused:match('%d+'))
  return refused or status, stopped, refused and true or false
end

return M
