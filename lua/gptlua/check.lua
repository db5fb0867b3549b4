-- gptlua.check — argument checks shared by every public Lua function, so a
-- bad argument raises one line naming the function, the argument and what
-- was expected instead of a Lua internal ("attempt to index a nil value").
-- Each check returns its value, so it can wrap the use:
--   local n = check.integer(n, 'narrow', 'length', 0)
-- Errors are raised at `level` (default: the caller of the public function).
local M = {}

local MAX_SIZE = 2 ^ 62

local function describe(v)
  local t = type(v)
  if t == 'string' then return ("the string '%s'"):format(#v > 40 and v:sub(1, 40) .. '...' or v) end
  if t == 'number' or t == 'boolean' then return tostring(v) end
  if t == 'table' and getmetatable(v) and getmetatable(v).__name then return getmetatable(v).__name end
  return t
end
M.describe = describe

local function fail(fn, what, expected, v, level)
  error(('%s: %s must be %s, got %s'):format(fn, what, expected, describe(v)), (level or 3) + 1)
end
M.fail = fail

-- a finite number
function M.number(v, fn, what, level)
  if type(v) ~= 'number' or v ~= v or v == math.huge or v == -math.huge then
    fail(fn, what, 'a finite number', v, level)
  end
  return v
end

-- an integer in [lo, hi] (bounds optional), finite and below 2^62
function M.integer(v, fn, what, lo, hi, level)
  if type(v) ~= 'number' or v ~= v or math.abs(v) >= MAX_SIZE or v ~= math.floor(v) then
    fail(fn, what, 'a finite integer < 2^62', v, level)
  end
  if (lo and v < lo) or (hi and v > hi) then
    local range = lo and hi and ('in [%d, %d]'):format(lo, hi) or lo and ('>= %d'):format(lo) or ('<= %d'):format(hi)
    fail(fn, what, 'an integer ' .. range, v, level)
  end
  return v
end

-- a size: an integer >= 0 and < 2^62
function M.size(v, fn, what, level)
  if type(v) ~= 'number' or v ~= v or v < 0 or v >= MAX_SIZE or v ~= math.floor(v) then
    fail(fn, what, 'a finite integer size in [0, 2^62)', v, level)
  end
  return v
end

-- a gptlua Tensor
function M.tensor(v, fn, what, level)
  local mt = type(v) == 'table' and getmetatable(v)
  if not (mt and mt.__name == 'Tensor') then fail(fn, what, 'a Tensor', v, level) end
  return v
end

-- a value of Lua type `t` ('table', 'function', 'string', ...)
function M.type(v, t, fn, what, level)
  if type(v) ~= t then fail(fn, what, 'a ' .. t, v, level) end
  return v
end

-- one of the strings in `choices`
function M.one_of(v, choices, fn, what, level)
  for _, c in ipairs(choices) do if v == c then return v end end
  fail(fn, what, 'one of ' .. table.concat(choices, ', '), v, level)
end

return M
