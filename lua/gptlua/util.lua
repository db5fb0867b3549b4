-- gptlua.util — small helpers shared by the library's modules.
local M = {}

-- whole file as a string; errors name the caller's `what` and the path
function M.read_file(path, what, level)
  local f, err = io.open(path, 'rb')
  if not f then error(('%s: cannot open %s'):format(what, err), (level or 2) + 1) end
  local s, rerr = f:read('*a')
  f:close()
  if not s then error(('%s: cannot read %s: %s'):format(what, path, tostring(rerr)), (level or 2) + 1) end
  return s
end

return M
