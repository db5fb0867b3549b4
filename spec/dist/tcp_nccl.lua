-- Run on every rank by spec/dist_tcp_spec.lua under the CUDA simulator,
-- started by gptlua -n 2 --launcher=tcp: the simulator's NCCL runs over MPI
-- only, so a TCP world says so (backend 'nccl' and gl_nccl_comm_create
-- refuse, naming why) instead of hanging, and its CUDA tensors travel over
-- Gloo through host memory.  Prints "OK rank R of N" at the end.
local gl = require 'gptlua'
local dist = require 'gptlua.dist'
local ffi = gl.ffi

local found = assert(dist.discover(), 'expected torchrun-style variables')
local function check(cond, msg) if not cond then error(('rank %d: %s'):format(found.rank, msg), 2) end end
local function has(s, part) return tostring(s):find(part, 1, true) ~= nil end

local ok, err = pcall(dist.init, { backend = 'nccl', timeout = 60 })
check(not ok and has(err, "dist.init: backend 'nccl': libgptlua_gloo.so was built without NCCL")
  and has(err, 'the CUDA simulator, whose NCCL runs over MPI only'), 'backend nccl over TCP: ' .. tostring(err))

local world = dist.init { backend = 'auto', timeout = 60 }
check(world.backend == 'gloo' and world.nccl == false, 'auto over TCP: ' .. tostring(world))
local out = ffi.new('gl_comm*[1]')
check(dist.backend_lib().gl_nccl_comm_create(world.c, 0, out) ~= 0, 'gl_nccl_comm_create over Gloo succeeded')
local msg = ffi.string(gl.lib.gl_last_error())
check(has(msg, 'this build of the gloo backend has no NCCL') and has(msg, 'runs over MPI'), msg)

-- CUDA tensors over Gloo: staged through host memory
local t = gl.full({ 1000 }, world.rank + 1, { device = dist.device() })
check(t.device ~= 'cpu', 'expected a simulated GPU, got ' .. t.device)
world:all_reduce(t, 'sum')
for _, x in ipairs(t:cpu():tolist()) do check(x == 3, 'CUDA all_reduce over Gloo: ' .. x) end
print(('OK rank %d of %d'):format(world.rank, world.size))
