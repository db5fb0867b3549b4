-- gptlua.config — recipe configs: defaults, command-line overrides
-- (--key=value or --key value, --nested.key=value, --flag), validation that
-- names the bad key and the nearest valid one ("did you mean
-- --learning_rate?"), and the key listing `gptlua RECIPE --help` prints.
-- Every error is one line raised without a position (a user error, printed
-- without a traceback by gptlua.cli).
local check = require 'gptlua.check'
local M = {}

-- string keys that also take a boolean (--resume alone means 'latest')
local TAKES_BOOLEAN = { resume = true, cuda_graph = true,
  value_embeds = true, smear = true, backout = true, lambdas = true }  -- nanochat.* ('auto' or a flag)

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

M.sorted_keys = sorted_keys

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

-- Optimal string alignment distance (edits, with a swap of two neighbours
-- counted as one): how far a mistyped key is from a valid one.
local function distance(a, b)
  local d = {}
  for i = 0, #a do d[i] = { [0] = i } end
  for j = 0, #b do d[0][j] = j end
  for i = 1, #a do
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local v = math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        v = math.min(v, d[i - 2][j - 2] + 1)
      end
      d[i][j] = v
    end
  end
  return d[#a][#b]
end
M.distance = distance

-- every key of defaults, nested ones as "a.b"
local function key_paths(defaults, prefix, out)
  out = out or {}
  for _, k in ipairs(sorted_keys(defaults)) do
    local v = defaults[k]
    if type(k) == 'string' then
      out[#out + 1] = (prefix or '') .. k
      if type(v) == 'table' and next(v) ~= nil and v[1] == nil then key_paths(v, (prefix or '') .. k .. '.', out) end
    end
  end
  return out
end
M.key_paths = key_paths

-- the valid key nearest to a mistyped one, or nil when none is near: a few
-- edits away (a third of its length), or the only key it is a part of
-- Other tools' names for keys (PyTorch's optimizers, Lightning, HF
-- Trainer, llm.c): suggested as they are, however far the spelling is.
M.ALIASES = { lr = 'learning_rate', wd = 'weight_decay', bs = 'batch_size', warmup = 'warmup_iters',
  warmup_steps = 'warmup_iters', steps = 'max_iters', max_steps = 'max_iters', num_iterations = 'max_iters',
  seq_len = 'block_size', context_length = 'block_size', grad_accum = 'gradient_accumulation_steps',
  accumulate_grad_batches = 'gradient_accumulation_steps', gradient_clip_val = 'grad_clip',
  max_grad_norm = 'grad_clip', val_check_interval = 'eval_interval' }

function M.suggest(key, defaults)
  local alias = M.ALIASES[key]
  if alias and defaults[alias] ~= nil then return alias end
  local best, best_d
  local within = {}
  for _, k in ipairs(key_paths(defaults)) do
    local d = distance(key, k)
    if d <= math.max(1, math.floor(#key / 3)) and (not best_d or d < best_d) then best, best_d = k, d end
    if #key >= 3 and k:find(key, 1, true) then within[#within + 1] = k end
  end
  if best then return best end
  if #within == 1 then return within[1] end
end

-- who reports a command-line error, and where the keys are listed: the
-- trainer's by default; a script's own flags (recipes/sample.lua) name it
local TOOL = { prefix = 'config', hint = 'gptlua RECIPE --help lists the keys' }

local function unknown(key, defaults, dashes, tool)
  tool = tool or TOOL
  local near = M.suggest(key, defaults)
  local function shown(k) return tool.dashes and k:gsub('_', '-') or k end
  local tail = near and ('did you mean %s%s?'):format(dashes, shown(near)) or tool.hint
  return ('%s: unknown key %s%s (%s)'):format(tool.prefix, dashes, shown(key), tail)
end

-- sets cfg[a][b]... = value for "a.b", checking the path exists in defaults
local function set_path(cfg, defaults, key, raw, tool)
  local shown = tool and tool.dashes and key:gsub('_', '-') or key  -- as the user wrote it
  local parts = {}
  for p in key:gmatch('[^%.]+') do parts[#parts + 1] = p end
  local c, d = cfg, defaults
  for i = 1, #parts - 1 do
    local p = parts[i]
    if type(d[p]) ~= 'table' then error(unknown(key, defaults, '--', tool), 0) end
    c[p] = c[p] or {}
    c, d = c[p], d[p]
  end
  local last = parts[#parts]
  if d[last] == nil then error(unknown(key, defaults, '--', tool), 0) end
  if raw == nil and type(d[last]) ~= 'boolean' and not TAKES_BOOLEAN[last] then
    error(('%s: --%s needs a value (--%s=%s)'):format((tool or TOOL).prefix, shown, shown,
      type(d[last]) == 'number' and 'N' or 'VALUE'), 0)
  end
  if raw == nil then c[last] = true; return end
  local ok, v = pcall(coerce, shown, raw, d[last])
  if not ok then error(tool and (tostring(v):gsub('^config:', tool.prefix .. ':')) or v, 0) end
  c[last] = v
end

-- the default a key path names (nil when there is none)
local function default_of(defaults, key)
  local d = defaults
  for p in key:gmatch('[^%.]+') do
    if type(d) ~= 'table' then return nil end
    d = d[p]
  end
  return d
end

local BOOLEAN_WORDS = { ['true'] = true, ['false'] = true, yes = true, no = true, ['1'] = true, ['0'] = true }
M.BOOLEAN_WORDS = BOOLEAN_WORDS  -- (gptlua.journal reads arguments as parse_args does)

-- parse_args(args, defaults) -> overrides table, or an error (a string
-- raised at level 0).  --key=value and --key value; a boolean key alone is
-- true and takes a following true/false/yes/no/1/0; positional args are
-- refused.  Pure: reads only its arguments.  tool = {prefix =, hint =,
-- dashes =} names a script's own flags in its errors (default: the
-- trainer's config); with dashes its keys are shown --with-dashes.
function M.parse_args(args, defaults, tool)
  local out = {}
  args = args or {}
  if type(args) ~= 'table' then error(('config: arguments must be a list of strings, got a %s'):format(type(args)), 0) end
  local i = 1
  while args[i] ~= nil do
    local a = args[i]
    if type(a) ~= 'string' then error(('config: argument %d is a %s, expected a string'):format(i, type(a)), 0) end
    local k, v = a:match('^%-%-([%w_%.%-]+)=(.*)$')
    if not k then k = a:match('^%-%-([%w_%.%-]+)$') end
    if not k then
      error(('%s: cannot parse argument "%s" (expected --key=value or --key value)'):format((tool or TOOL).prefix,
        check.printable(a)), 0)
    end
    k = k:gsub('%-', '_')
    if v == nil then
      -- --key value: the next argument, unless it is the next option
      local nxt, d = args[i + 1], default_of(defaults, k)
      local takes = type(nxt) == 'string' and nxt:sub(1, 2) ~= '--'
      if type(d) == 'boolean' then takes = takes and BOOLEAN_WORDS[nxt] ~= nil end
      if d ~= nil and takes then v = nxt; i = i + 1 end
    end
    set_path(out, defaults, k, v, tool)
    i = i + 1
  end
  return out
end

-- the same, as a value: overrides, or nil and the message
function M.try_parse_args(args, defaults, tool)
  local ok, r = pcall(M.parse_args, args, defaults, tool)
  if ok then return r end
  return nil, tostring(r)
end

-- checks a recipe/override table against defaults (keys and types; numbers
-- finite)
function M.validate(cfg, defaults, prefix)
  prefix = prefix or ''
  for k, v in pairs(cfg) do
    local d = defaults[k]
    if d == nil then
      local near = type(k) == 'string' and M.suggest(k, defaults)
      error(('config: unknown key %s%s in the recipe (%s)'):format(prefix, check.printable(k),
        near and ('did you mean %s%s?'):format(prefix, near) or 'gptlua RECIPE --help lists the keys'), 0)
    end
    if type(d) ~= type(v) and not (type(d) == 'string' and type(v) == 'boolean' and TAKES_BOOLEAN[k]) then
      -- a value as text only where it has one (a table's is an address)
      local shown = (type(v) == 'string' or type(v) == 'number' or type(v) == 'boolean')
        and ('%s (%s)'):format(type(v), check.printable(v)) or 'a ' .. type(v)
      error(('config: %s%s must be a %s, got %s'):format(prefix, k, type(d), shown), 0)
    end
    finite(prefix .. tostring(k), v)
    if type(v) == 'table' and v[1] ~= nil then
      for i, x in ipairs(v) do finite(('%s%s[%d]'):format(prefix, tostring(k), i), x) end
    end
    if type(d) == 'table' and next(d) ~= nil and d[1] == nil then M.validate(v, d, prefix .. k .. '.') end
  end
end

local function show(v)
  if type(v) == 'string' then return ("'%s'"):format(v) end
  if type(v) == 'table' then
    local parts = {}
    for i, x in ipairs(v) do parts[i] = tostring(x) end
    return '{' .. table.concat(parts, ',') .. '}'
  end
  return tostring(v)
end

-- usage(defaults, recipe, docs, name): the key listing of `gptlua RECIPE
-- --help`: each key with its type, its value in this recipe (else the
-- default) and docs[key], a one-line description
function M.usage(defaults, recipe, docs, name)
  recipe = recipe or {}
  local rows, w1, w2, w3 = {}, 0, 0, 0
  for _, k in ipairs(key_paths(defaults)) do
    local d = default_of(defaults, k)
    if not (type(d) == 'table' and next(d) ~= nil and d[1] == nil) then
      local v = default_of(recipe, k)
      if v == nil or type(v) == 'function' then v = d end
      local ty = type(d) == 'table' and 'list' or type(d)
      if TAKES_BOOLEAN[k] then ty = ty .. '|flag' end
      local row = { '--' .. k, ty, show(v), docs and docs[k] or '' }
      w1, w2, w3 = math.max(w1, #row[1]), math.max(w2, #row[2]), math.max(w3, math.min(#row[3], 16))
      rows[#rows + 1] = row
    end
  end
  local out = { ('usage: gptlua %s [--key=value | --key value | --flag]...'):format(name or 'RECIPE'),
    'keys (type, value in this recipe or the default, description):' }
  for _, r in ipairs(rows) do
    out[#out + 1] = ('  %-' .. w1 .. 's  %-' .. w2 .. 's  %-' .. w3 .. 's%s'):format(r[1], r[2], r[3],
      r[4] ~= '' and ('  ' .. r[4]) or '')
  end
  local hooks = {}
  for k, v in pairs(recipe) do if type(v) == 'function' then hooks[#hooks + 1] = k end end
  table.sort(hooks)
  if #hooks > 0 then out[#out + 1] = 'hooks in this recipe: ' .. table.concat(hooks, ', ') end
  return table.concat(out, '\n') .. '\n'
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
