-- Run on every rank by spec/dist_nccl_spec.lua (#cuda): spec/dist/fsdp_equiv.lua
-- (its arguments, its outputs) in a world whose CUDA tensors travel over
-- NCCL.  fsdp_equiv.lua asks dist.init for backend 'mpi'; dist.init returns
-- the world that already exists, so making it here with backend 'nccl'
-- routes every collective of a run with device=cuda through NCCL.
local dist = require 'gptlua.dist'
local gl = require 'gptlua'

local world = dist.init { backend = 'nccl', timeout = 300 }
assert(world.nccl, 'dist.init: the world does not use NCCL')
dofile(gl.root .. '/spec/dist/fsdp_equiv.lua')
-- every run's CUDA collectives made (and used) the world's NCCL communicator
if world._nccl_c ~= nil then print(('rank %d: CUDA collectives went through NCCL'):format(world.rank)) end
