-- Run on every rank by spec/dist_nccl_spec.lua: how a world picks its
-- backend for CUDA tensors, GPU binding, and the NCCL entry points' errors,
-- on whatever machine runs it (no GPU, ranks sharing one GPU, a GPU each).
-- arg 1:
--   auto     dist.init{backend = 'auto'}: NCCL exactly when dist.nccl_plan
--            allows it on every rank; gl_nccl_comm_create's errors
--   nccl     dist.init{backend = 'nccl'}: a world, or the plan's reason as
--            the error; then backend 'mpi' still gets the world
--   timeout  (NCCL world of >= 2 ranks) the last rank never joins a CUDA
--            all_reduce: every rank is aborted naming the NCCL group
-- Prints "OK rank R of N" at the end.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local cuda = require 'gptlua.cuda'
local ffi = gl.ffi

local mode = arg and arg[1] or 'auto'
local found = dist.discover()
local R = found and found.rank or 0

local function fail(msg) error(('rank %d: %s'):format(R, msg), 2) end
local function check(cond, msg) if not cond then fail(msg) end end
local function has(s, pattern) return tostring(s):find(pattern, 1, true) ~= nil end

-- what this rank's plan says (the same inputs dist.init uses)
local function my_plan(world, backend)
  return dist.nccl_plan { backend = backend, nccl_version = dist.backend_lib().gl_nccl_version(),
    device = dist.gpu_for(world.local_rank, cuda.device_count()), local_size = world.local_size,
    device_count = cuda.device_count() }
end

local function cpu_all_reduce_works(world)
  local t = gl.full({ 3 }, world.rank + 1)
  check(world:route(t, t) == 'mpi', 'CPU tensors go over MPI')
  world:all_reduce(t, 'sum')
  for _, x in ipairs(t:tolist()) do check(x == world.size * (world.size + 1) / 2, 'CPU all_reduce') end
end

if mode == 'auto' then
  local world = dist.init { backend = 'auto', timeout = 60 }
  local ok = my_plan(world, 'auto')
  local all = world:all_reduce_number(ok and 1 or 0, 'min') == 1
  check(world.nccl == all, ('world.nccl is %s, the plans say %s'):format(tostring(world.nccl), tostring(all)))
  local ndev = cuda.device_count()
  check(dist.device() == (ndev > 0 and 'cuda:' .. (world.local_rank % ndev) or 'cpu'), 'bound to ' .. dist.device())
  check(tostring(world):find(world.nccl and 'mpi + nccl' or 'mpi)', 1, true), tostring(world))
  cpu_all_reduce_works(world)

  local mpi = dist.backend_lib()
  local out = ffi.new('gl_comm*[1]')
  local function create(parent, device, o)
    local rc = mpi.gl_nccl_comm_create(parent, device, o)
    return rc, ffi.string(gl.lib.gl_last_error())
  end
  local rc, err = create(nil, 0, out)
  check(rc ~= 0 and out[0] == nil, 'a NULL parent fails')
  local built = mpi.gl_nccl_version() > 0
  check(has(err, built and 'parent is not a live communicator' or 'has no NCCL'), err)
  rc, err = create(world.c, 0, nil)
  check(rc ~= 0 and has(err, built and 'out is NULL' or 'has no NCCL'), err)
  rc, err = create(world.c, -1, out)
  check(rc ~= 0 and has(err, built and 'cuda:-1 requested but' or 'has no NCCL'), err)
  if not built then
    check(not world.nccl, 'no NCCL without the library')
  elseif ndev == 0 then
    rc, err = create(world.c, 0, out)
    check(rc ~= 0 and has(err, 'cuda:0 requested but 0 CUDA device(s) are available'), err)
  elseif world.local_size > ndev then
    -- NCCL itself refuses ranks that share a GPU: every rank gets the error
    rc, err = create(world.c, dist.gpu_for(world.local_rank, ndev), out)
    check(rc ~= 0 and out[0] == nil and has(err, 'NCCL'), 'ranks sharing a GPU: ' .. err)
    cpu_all_reduce_works(world)   -- and the world is still usable
  end
elseif mode == 'nccl' then
  local ok, err = pcall(dist.init, { backend = 'nccl', timeout = 60 })
  check(not dist.is_initialized() == not ok, 'a failed init leaves no world')
  local world = dist.init { backend = 'mpi', timeout = 60 }
  check(not world.nccl, "backend 'mpi' after a failed 'nccl'")
  local mine, why = my_plan(world, 'nccl')
  local all = world:all_reduce_number(mine and 1 or 0, 'min') == 1
  check(ok == all, ('nccl init %s but the plans say %s: %s'):format(ok and 'worked' or 'failed', tostring(all),
    tostring(err)))
  if not ok then
    check(has(err, "dist.init: backend 'nccl': " .. (mine and 'another rank cannot use NCCL' or why)), err)
  end
  cpu_all_reduce_works(world)
elseif mode == 'timeout' then
  local world = dist.init { backend = 'nccl', timeout = 3 }
  local t = gl.full({ 1024 }, 1, { device = dist.device() })
  world:all_reduce(t, 'sum')    -- makes the NCCL communicator
  if world.rank == world.size - 1 then
    os.execute('sleep 30')
    io.write('unreachable\n')
  end
  world:all_reduce(t, 'sum')
  io.write('unreachable\n')
else
  fail('unknown mode ' .. tostring(mode))
end

dist.finalize()
io.write(('OK rank %d of %d\n'):format(R, found and found.size or 1))
