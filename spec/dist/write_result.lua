-- Rank 0's result file for the multi-rank trainer scripts (tp_train.lua,
-- pp_seq_train.lua, nanochat_v2.lua): path gets {losses, checkpoint} with
-- every loss to 17 significant digits, every bit of a double (lua-cjson
-- writes 14, a unit in the 14th digit that the specs' rule, which holds a
-- step's loss to the rounding of its own sums, 1e-14, would read as an error).
local cjson = require 'cjson'
return function(path, res)
  local losses = {}
  for i, l in ipairs(res.losses) do losses[i] = ('%.17g'):format(l) end
  local f = assert(io.open(path, 'wb'))
  f:write(('{"losses":[%s],"checkpoint":%s}'):format(table.concat(losses, ','), cjson.encode(res.checkpoint)))
  assert(f:close())
end
