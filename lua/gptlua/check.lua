-- gptlua.check — argument checks shared by every public Lua function, so a
-- bad argument raises one line naming the function, the argument and what
-- was expected instead of a Lua internal ("attempt to index a nil value").
-- Each check returns its value, so it can wrap the use:
--   local n = check.integer(n, 'narrow', 'length', 0)
-- Errors are raised at `level` (default: the caller of the public function).
local M = {}

local MAX_SIZE = 2 ^ 62

-- control characters are escaped (\n, \0): a message quoting a value from a
-- file or the command line stays one line
local function escape(c) return c == '\n' and '\\n' or ('\\%d'):format(c:byte()) end
-- tostring(v), cut at 40 bytes and with control characters escaped
local function printable(v)
  local s = tostring(v)
  return ((#s > 40 and s:sub(1, 40) .. '...' or s):gsub('%c', escape))
end
M.printable = printable
local function describe(v)
  local t = type(v)
  if t == 'string' then return ("the string '%s'"):format(printable(v)) end
  if t == 'number' or t == 'boolean' then return tostring(v) end
  if t == 'table' and getmetatable(v) and getmetatable(v).__name then return getmetatable(v).__name end
  return t
end
M.describe = describe

local function fail(fn, what, expected, v, level)
  error(('%s: %s must be %s, got %s'):format(fn, what, expected, describe(v)), (level or 3) + 1)
end
-- the same with the got-part already described ('a 0-d tensor')
local function fail_as(fn, what, expected, got, level)
  error(('%s: %s must be %s, got %s'):format(fn, what, expected, got), (level or 3) + 1)
end
M.fail_as = fail_as
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

-- ------------------------------------------------------------ signatures
-- M.wrap(fn, sig, f) returns f behind a check of its arguments against sig,
-- a comma-separated list of `name:kind` (a trailing `?` allows nil), e.g.
--   O.softmax = check.wrap('softmax', 'x:tensor, dim:integer?', O.softmax)
-- so every public function declares its arguments in one line and a bad one
-- raises "softmax: dim must be a finite integer < 2^62, got the string 'a'"
-- at the caller's line.  Arguments past the signature are passed through
-- unchecked.  Kinds are the entries of M.kinds (each kind(v, fn, what, level)).
local function is_tensor(v)
  local mt = type(v) == 'table' and getmetatable(v)
  return mt and mt.__name == 'Tensor' or false
end

local kinds = {}
M.kinds = kinds
kinds.any = function() end
kinds.tensor = function(v, fn, what, level) M.tensor(v, fn, what, level + 1) end
-- a Tensor with at least one dim (the ops that work along a last dim:
-- features, classes); a 0-d tensor has none
kinds.tensor1 = function(v, fn, what, level)
  M.tensor(v, fn, what, level + 1)
  if #v.shape < 1 then fail_as(fn, what, 'a Tensor with at least 1 dim (..., features)', 'a 0-d tensor', level) end
end
kinds.number = function(v, fn, what, level) M.number(v, fn, what, level + 1) end
kinds.integer = function(v, fn, what, level) M.integer(v, fn, what, nil, nil, level + 1) end
kinds.count = function(v, fn, what, level) M.integer(v, fn, what, 1, nil, level + 1) end
kinds.size = function(v, fn, what, level) M.size(v, fn, what, level + 1) end
-- any Lua number, infinities and NaN included (fill values, clamp bounds)
kinds.real = function(v, fn, what, level) if type(v) ~= 'number' then fail(fn, what, 'a number', v, level) end end
-- a Tensor or a number (the operands of arithmetic)
kinds.scalar = function(v, fn, what, level)
  if type(v) ~= 'number' and not is_tensor(v) then fail(fn, what, 'a Tensor or a number', v, level) end
end
for _, t in ipairs({ 'table', 'function', 'string', 'boolean' }) do
  kinds[t] = function(v, fn, what, level) if type(v) ~= t then fail(fn, what, 'a ' .. t, v, level) end end
end
-- a function or a table with a __call metamethod (a module)
kinds.callable = function(v, fn, what, level)
  local mt = type(v) == 'table' and getmetatable(v)
  if type(v) ~= 'function' and not (mt and mt.__call) then fail(fn, what, 'a function', v, level) end
end
-- a gptlua.nn module (self of a module method: m:forward(x), not m.forward(x))
kinds.module = function(v, fn, what, level)
  if not (type(v) == 'table' and type(rawget(v, '_params')) == 'table' and getmetatable(v)) then
    fail(fn, what, 'a module', v, level)
  end
end
-- a plain table (not a Tensor): options, lists, state dicts
kinds.opts = function(v, fn, what, level)
  if type(v) ~= 'table' or is_tensor(v) then fail(fn, what, 'a table', v, level) end
end
-- a shape: a table of sizes (not a Tensor); the sizes are checked where it is used
kinds.shape = function(v, fn, what, level)
  if type(v) ~= 'table' or is_tensor(v) then fail(fn, what, 'a shape (a table of sizes)', v, level) end
end
-- token ids of a language model: a (B, T) int32 or int64 Tensor, T >= 1
kinds.ids = function(v, fn, what, level)
  M.tensor(v, fn, what, level + 1)
  local expected = 'a (B, T) int32 or int64 Tensor of token ids with T >= 1'
  if #v.shape ~= 2 or v.shape[2] < 1 then
    fail_as(fn, what, expected, ('a tensor of shape {%s}'):format(table.concat(v.shape, ',')), level)
  end
  if v.dtype ~= 'int32' and v.dtype ~= 'int64' then fail_as(fn, what, expected, 'dtype ' .. v.dtype, level) end
end
-- a list of Tensors
kinds.tensors = function(v, fn, what, level)
  if type(v) ~= 'table' or is_tensor(v) then fail(fn, what, 'a list of Tensors', v, level) end
  for i = 1, #v do
    if not is_tensor(v[i]) then fail(fn, ('%s[%d]'):format(what, i), 'a Tensor', v[i], level) end
  end
end
-- named tensors (a state dict, a safetensors file's contents): a table
-- of string names to Tensors
kinds.tensor_dict = function(v, fn, what, level)
  if type(v) ~= 'table' or is_tensor(v) then fail(fn, what, 'a table of names to Tensors', v, level) end
  local names = {}
  for k in pairs(v) do names[#names + 1] = k end
  table.sort(names, function(a, b) return tostring(a) < tostring(b) end)  -- the first bad entry, always the same
  for _, k in ipairs(names) do
    if type(k) ~= 'string' then fail(fn, what .. ' key', 'a string (a tensor name)', k, level) end
    if not is_tensor(v[k]) then fail(fn, ("%s['%s']"):format(what, printable(k)), 'a Tensor', v[k], level) end
  end
end
-- dims of a reduction: an integer or a list of integers
kinds.dims = function(v, fn, what, level)
  if type(v) == 'number' then M.integer(v, fn, what, nil, nil, level + 1); return end
  if type(v) ~= 'table' or is_tensor(v) then fail(fn, what, 'an integer or a list of integers', v, level) end
  for i = 1, #v do M.integer(v[i], fn, ('%s[%d]'):format(what, i), nil, nil, level + 1) end
end
-- a device: 'cpu', 'cuda', 'cuda:N' (the name is checked where it is used)
kinds.device = function(v, fn, what, level)
  if type(v) ~= 'string' then fail(fn, what, "a device name ('cpu', 'cuda' or 'cuda:N')", v, level) end
end

-- M.options(name, fields) declares the kind `name`: a table of options
-- (not a Tensor) whose fields, where set, are of the given kinds, e.g.
--   check.options('loader_opts', { batch_size = 'count', seed = 'size?' })
-- then 'opts:loader_opts' in a signature refuses {batch_size = 0} with
-- "data.loader: batch_size must be an integer >= 1, got 0".  A field without
-- `?` is required.  Fields not listed pass unchecked.
function M.options(name, fields)
  local list = {}
  for field, kind in pairs(fields) do
    local k, opt = kind:match('^([%w_]+)(%??)$')
    if not k or not kinds[k] then error(('check.options: bad kind %q for %s.%s'):format(kind, name, field), 2) end
    list[#list + 1] = { field = field, kind = kinds[k], opt = opt == '?' }
  end
  table.sort(list, function(a, b) return a.field < b.field end)  -- the first bad field, always the same
  kinds[name] = function(v, fn, what, level)
    if type(v) ~= 'table' or is_tensor(v) then fail(fn, what, 'a table of options', v, level) end
    for _, f in ipairs(list) do
      local x = v[f.field]
      if x ~= nil or not f.opt then f.kind(x, fn, f.field, level + 1) end
    end
  end
end

-- The entries of a signature string "a: tensor, dim: int?" as
-- { item, name, kind (its name), opt }; name is nil for an entry that does
-- not parse.  Read here and by gptlua.help.
function M.signature_items(sig)
  local items = {}
  for item in sig:gmatch('[^,]+') do
    local name, kind, opt = item:match('^%s*([%w_%.%[%]]+)%s*:%s*([%w_]+)(%??)%s*$')
    items[#items + 1] = { item = item, name = name, kind = kind, opt = opt == '?' }
  end
  return items
end

local function parse(fn, sig)
  local list = {}
  for _, e in ipairs(M.signature_items(sig)) do
    if not e.name or not kinds[e.kind] then error(('check.wrap: bad signature entry %q for %s'):format(e.item, fn), 3) end
    list[#list + 1] = { name = e.name, kind = kinds[e.kind], opt = e.opt }
  end
  return list
end

-- The wrapper is generated for the signature's arity (one local per
-- argument, no select() loop), so LuaJIT compiles it like a direct call:
--   function(a1, a2, ...) <check a1>; <check a2>; return f(a1, a2, ...) end
-- (level: whom the error blames, 2 = the wrapper's caller; a constructor
-- called through a class's __call passes 3)
function M.wrap(fn, sig, f, level)
  if type(f) ~= 'function' then error('check.wrap: ' .. fn .. ' is not a function', 2) end
  local list = parse(fn, sig)
  local params, body = {}, {}
  for i, s in ipairs(list) do
    params[i] = 'a' .. i
    body[i] = ('  %sK[%d](a%d, fn, N[%d], L)'):format(s.opt and ('if a%d ~= nil then '):format(i) or '', i, i, i)
      .. (s.opt and ' end' or '')
  end
  params[#params + 1] = '...'
  local p = table.concat(params, ', ')
  local src = ('local f, fn, K, N, L = ...\nreturn function(%s)\n%s\n  return f(%s)\nend'):format(p,
    table.concat(body, '\n'), p)
  local K, N = {}, {}
  for i, s in ipairs(list) do K[i], N[i] = s.kind, s.name end
  return assert(loadstring(src, '=check.wrap(' .. fn .. ')'))(f, fn, K, N, (level or 2) + 1)
end

-- M.wrap_table(t, sigs, prefix): replaces t[name] by its checked version for
-- every name = sig in sigs (the function is named prefix .. name); returns a
-- map from the original functions to the wrapped ones
function M.wrap_table(t, sigs, prefix)
  local map = {}
  for name, sig in pairs(sigs) do
    local f = t[name]
    if f == nil then error('check.wrap_table: no function ' .. name, 2) end
    if map[f] == nil then map[f] = M.wrap((prefix or '') .. name, sig, f) end
    t[name] = map[f]
  end
  return map
end

return M
