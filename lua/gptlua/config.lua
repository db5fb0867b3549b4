-- gptlua.config — recipe configs: defaults, command-line overrides
-- (--key=value, --nested.key=value, --flag), and validation that names the
-- bad key and lists the valid ones.
local check = require 'gptlua.check'
local M = {}

-- string keys that also take a boolean (--resume alone means 'latest')
local TAKES_BOOLEAN = { resume = true }

-- Config errors carry no file:line (level 0): check.* at level -1.
M.NO_POSITION = -1

-- every number in a config is finite: NaN, inf and 1e400 (which parses as
-- inf) are refused by key; integer keys are checked by their user
-- (check.integer, e.g. gptlua.train)
local function finite(key, v)
  if type(v) == 'number' then check.number(v, 'config', key, M.NO_POSITION) end
  return v
end
M.finite = finite

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

-- parses a string value into the type of the default
local function coerce(key, s, default)
  local ty = type(default)
  if ty == 'number' then
    local v = tonumber(s)
    if v == nil or v ~= v or v == math.huge or v == -math.huge then
      error(('config: --%s expects a finite number, got "%s"'):format(key, check.printable(s)), 0)
    end
    return v
  elseif ty == 'boolean' then
    if s == 'true' or s == '1' or s == 'yes' then return true end
    if s == 'false' or s == '0' or s == 'no' then return false end
    error(('config: --%s expects true or false, got "%s"'):format(key, check.printable(s)), 0)
  elseif ty == 'table' then
    local out = {}
    for item in s:gmatch('[^,]+') do out[#out + 1] = finite(key, tonumber(item)) or item end
    return out
  end
  return s
end

-- sets cfg[a][b]... = value for "a.b", checking the path exists in defaults
local function set_path(cfg, defaults, key, raw)
  local parts = {}
  for p in key:gmatch('[^%.]+') do parts[#parts + 1] = p end
  local c, d = cfg, defaults
  for i = 1, #parts - 1 do
    local p = parts[i]
    if type(d[p]) ~= 'table' then
      error(('config: unknown key --%s (valid keys: %s)'):format(key, table.concat(sorted_keys(defaults), ', ')), 0)
    end
    c[p] = c[p] or {}
    c, d = c[p], d[p]
  end
  local last = parts[#parts]
  if d[last] == nil then
    error(('config: unknown key --%s (valid keys: %s)'):format(key, table.concat(sorted_keys(d), ', ')), 0)
  end
  if raw == nil and type(d[last]) ~= 'boolean' and not TAKES_BOOLEAN[last] then
    error(('config: --%s needs a value (--%s=%s)'):format(key, key, type(d[last]) == 'number' and 'N' or 'VALUE'), 0)
  end
  c[last] = raw == nil and true or coerce(key, raw, d[last])
end

-- parse_args(args, defaults) -> overrides table; positional args rejected
function M.parse_args(args, defaults)
  local out = {}
  for _, a in ipairs(args or {}) do
    local k, v = a:match('^%-%-([%w_%.%-]+)=(.*)$')
    if not k then k = a:match('^%-%-([%w_%.%-]+)$') end
    if not k then error(('config: cannot parse argument "%s" (expected --key=value)'):format(check.printable(a)), 0) end
    k = k:gsub('%-', '_')
    set_path(out, defaults, k, v)
  end
  return out
end

-- checks a recipe/override table against defaults (keys and types; numbers
-- finite)
function M.validate(cfg, defaults, prefix)
  prefix = prefix or ''
  for k, v in pairs(cfg) do
    local d = defaults[k]
    if d == nil then
      error(('config: unknown key %s%s (valid keys: %s)'):format(prefix, check.printable(k),
        table.concat(sorted_keys(defaults), ', ')), 0)
    end
    if type(d) ~= type(v) and not (type(d) == 'string' and type(v) == 'boolean' and TAKES_BOOLEAN[k]) then
      error(('config: %s%s must be a %s, got %s (%s)'):format(prefix, k, type(d), type(v), check.printable(v)), 0)
    end
    finite(prefix .. tostring(k), v)
    if type(v) == 'table' and v[1] ~= nil then
      for i, x in ipairs(v) do finite(('%s%s[%d]'):format(prefix, tostring(k), i), x) end
    end
    if type(d) == 'table' and next(d) ~= nil and d[1] == nil then M.validate(v, d, prefix .. k .. '.') end
  end
end

-- deep merge: later tables win
function M.merge(...)
  local out = {}
  for i = 1, select('#', ...) do
    local t = select(i, ...)
    for k, v in pairs(t or {}) do
      if type(v) == 'table' and type(out[k]) == 'table' and v[1] == nil and next(v) ~= nil then
        out[k] = M.merge(out[k], v)
      elseif type(v) == 'table' then
        out[k] = M.merge(v)
      else
        out[k] = v
      end
    end
  end
  return out
end

return M
