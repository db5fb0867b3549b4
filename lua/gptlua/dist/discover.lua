-- gptlua.dist.discover — where a process sits in its launch: rank, size and
-- node-local rank from the launcher's variables (torchrun, OpenMPI, PMI,
-- Slurm), the host backend that fits the launch, MASTER_ADDR/PORT, CPU
-- threads per rank, the GPU of a rank and whether NCCL can carry its tensors.
-- Pure functions of the environment: gptlua.dist re-exports each of them.

local dist = {}

-- ------------------------------------------------------------ discovery --
-- Launchers, in the order their variables are trusted.
dist.LAUNCHERS = {
  { name = 'torchrun', rank = 'RANK', size = 'WORLD_SIZE', local_rank = 'LOCAL_RANK',
    local_size = 'LOCAL_WORLD_SIZE' },
  { name = 'openmpi', rank = 'OMPI_COMM_WORLD_RANK', size = 'OMPI_COMM_WORLD_SIZE',
    local_rank = 'OMPI_COMM_WORLD_LOCAL_RANK', local_size = 'OMPI_COMM_WORLD_LOCAL_SIZE' },
  { name = 'pmi', rank = 'PMI_RANK', size = 'PMI_SIZE', local_rank = 'MPI_LOCALRANKID',
    local_size = 'MPI_LOCALNRANKS' },
  { name = 'slurm', rank = 'SLURM_PROCID', size = 'SLURM_NTASKS', local_rank = 'SLURM_LOCALID',
    local_size = 'SLURM_NTASKS_PER_NODE' },
}

-- a launcher variable as an integer; nil when unset or empty, an error
-- naming the variable when set to something else
local function env_int(getenv, name)
  local v = name and getenv(name)
  if v == nil or v:match('^%s*$') then return nil end
  local n = tonumber(v:match('^%s*(%d+)'))   -- SLURM writes "2(x3)"
  if not n then error(('dist: %s expected an integer, got %q'):format(name, v), 0) end
  return n
end

local function describe_source(w)
  return ('%s (%s=%d, %s=%d: rank %d of %d)'):format(w.launcher, w.rank_var, w.rank, w.size_var, w.size,
    w.rank, w.size)
end

-- Rank and size of this process from the launcher variables, or nil when
-- none are set.  Every launcher whose rank and size variables are set is a
-- source; they must agree on rank and size, else the error names both
-- sources and their values (a stale RANK=0 WORLD_SIZE=1 under mpirun would
-- otherwise split the job into single-rank runs).  SLURM's variables count
-- only when no launcher's are set: a Slurm step that runs a launcher
-- (mpirun's daemons, torchrun per node) has one Slurm task per node, not
-- per rank.  getenv (default os.getenv) lets specs pass a fake environment.
function dist.discover(getenv)
  getenv = getenv or os.getenv
  local found = {}
  for _, l in ipairs(dist.LAUNCHERS) do
    local rank, size = env_int(getenv, l.rank), env_int(getenv, l.size)
    if rank and size and not (l.name == 'slurm' and #found > 0) then
      local w = { launcher = l.name, rank = rank, size = size, rank_var = l.rank, size_var = l.size,
        local_rank = env_int(getenv, l.local_rank), local_size = env_int(getenv, l.local_size) }
      if size < 1 or rank >= size then
        error(('dist: %s expected a rank in 0..size-1 and a size >= 1'):format(describe_source(w)), 0)
      end
      for _, o in ipairs(found) do
        if o.rank ~= rank or o.size ~= size then
          error(('dist: the launcher variables disagree: %s but %s; unset the stale ones'):format(
            describe_source(o), describe_source(w)), 0)
        end
      end
      found[#found + 1] = w
    end
  end
  local w = found[1]
  if not w then return nil end
  local launchers = {}
  for _, o in ipairs(found) do launchers[o.launcher] = true end
  return { launcher = w.launcher, rank = w.rank, size = w.size, local_rank = w.local_rank, local_size = w.local_size,
    launchers = launchers }
end

-- The host backend of a launched world: 'gloo' (TCP rendezvous) when only
-- torchrun-style variables started it, 'mpi' under an MPI launcher (or
-- when asked for).  backend: dist.init's option.
function dist.host_backend(backend, found)
  if backend == 'mpi' or backend == 'gloo' then return backend end
  local l = found and found.launchers or {}
  if l.torchrun and not (l.openmpi or l.pmi) then return 'gloo' end
  return 'mpi'
end

-- MASTER_ADDR and MASTER_PORT of a torchrun-style launch, checked.
function dist.master(getenv)
  getenv = getenv or os.getenv
  local addr, port = getenv('MASTER_ADDR'), getenv('MASTER_PORT')
  if addr == nil or addr == '' or port == nil or port == '' then
    error('dist: a torchrun-style launch (RANK, WORLD_SIZE) also needs MASTER_ADDR and MASTER_PORT, the address '
      .. "of rank 0 and a free port there (gptlua -n N --launcher=tcp sets them); got MASTER_ADDR="
      .. tostring(addr) .. ' MASTER_PORT=' .. tostring(port), 0)
  end
  local p = tonumber(port)
  if not p or p ~= math.floor(p) or p < 1 or p > 65535 then
    error(('dist: MASTER_PORT expected a port number 1..65535, got %q'):format(port), 0)
  end
  return addr, p
end

-- CPU threads per rank: the node's cores shared by its ranks.
function dist.default_threads(cores, local_size)
  return math.max(1, math.floor(cores / math.max(1, local_size)))
end

-- The GPU of the rank local_rank of a node with device_count GPUs (nil
-- without any): ranks beyond the GPUs share them round-robin.
function dist.gpu_for(local_rank, device_count)
  if not device_count or device_count < 1 then return nil end
  return local_rank % device_count
end

-- Whether this rank's CUDA tensors can travel over NCCL, else false and
-- why.  o: backend ('auto' | 'mpi' | 'gloo' | 'nccl'), host (the world's
-- host backend, 'mpi' or 'gloo'), nccl_version (0: built without NCCL),
-- device (bound GPU or nil), local_size, device_count.
-- dist.init asks every rank and uses NCCL only if all of them can.
function dist.nccl_plan(o)
  if o.backend == 'mpi' or o.backend == 'gloo' then return false, ("backend '%s' was requested"):format(o.backend) end
  if (o.nccl_version or 0) == 0 then
    if o.host == 'gloo' then
      return false, 'libgptlua_gloo.so was built without NCCL (nccl.h not found, a CPU-only build, or the CUDA '
        .. 'simulator, whose NCCL runs over MPI only: start the ranks with mpirun to use it)'
    end
    return false, 'libgptlua_mpi.so was built without NCCL (nccl.h not found, or a CPU-only build)'
  end
  if not o.device then return false, 'no CUDA device is available' end
  if o.local_size > o.device_count then
    return false, ('%d ranks on this node share %d GPU%s and NCCL needs a GPU per rank '
      .. "(backend = 'mpi' lets ranks share GPUs)"):format(o.local_size, o.device_count,
      o.device_count == 1 and '' or 's')
  end
  return true
end


return dist
