-- Run by spec/dist_tcp_spec.lua with torchrun-style variables set by hand:
-- joins the TCP rendezvous with a timeout of arg 1 seconds and says so.
local dist = require 'gptlua.dist'
local world = dist.init { timeout = tonumber(arg[1]) or 1 }
print(('joined rank %d of %d'):format(world.rank, world.size))
