-- gptlua.help — help() in the REPL, read from the source itself: a
-- function's signature (the checked one from gl.signatures, else its
-- parameter names) and the comment block above its definition; a module's
-- opening comment and its members grouped by the section header
-- ("-- ------- creation") they are defined under.  Nothing is generated or
-- stored, so the help cannot drift from the code.
local M = {}

local lines_cache = {}
local function source_lines(path)
  if lines_cache[path] == nil then
    local f = io.open(path, 'r')
    local t = false
    if f then
      t = {}
      for l in f:lines() do t[#t + 1] = l end
      f:close()
    end
    lines_cache[path] = t
  end
  return lines_cache[path] or nil
end

local function upvalue(f, want)
  for i = 1, 60 do
    local name, v = debug.getupvalue(f, i)
    if name == nil then return nil end
    if name == want then return v end
  end
end

-- the function a checking wrapper calls: check.wrap's (upvalues f and fn)
-- and tensor.lua's in-place and operator wrappers (f and what)
function M.unwrap(f)
  for _ = 1, 8 do
    local inner = upvalue(f, 'f')
    local label = upvalue(f, 'fn') or upvalue(f, 'what')
    if type(inner) ~= 'function' or type(label) ~= 'string' then break end
    f = inner
  end
  return f
end

-- file path and line where f is defined (nil for C functions)
local function where(f)
  local info = debug.getinfo(M.unwrap(f), 'S')
  if not info or info.source:sub(1, 1) ~= '@' or info.linedefined <= 0 then return nil end
  return info.source:sub(2), info.linedefined
end

-- the comment block right above line n (the doc of what is defined there)
local function comment_above(lines, n)
  local out = {}
  local i = n - 1
  while i >= 1 and lines[i]:match('^%s*%-%-') and not lines[i]:match('^%s*%-%- %-%-%-') do
    table.insert(out, 1, (lines[i]:gsub('^%s*%-%-%s?', '')))
    i = i - 1
  end
  return out
end

-- the section header ("-- ------------ creation") above line n, or nil
local function section_of(lines, n)
  for i = n, 1, -1 do
    local s = lines[i]:match('^%-%- %-%-%-+%s+(.-)%s*%-*$')
    if s and s ~= '' then return s end
  end
end

local function short_path(p)
  local root = GPTLUA and GPTLUA.root
  if root and p:sub(1, #root + 1) == root .. '/' then return p:sub(#root + 2) end
  return p
end

-- where a value lives: 'gl.NAME', 'Tensor:NAME', or the module path
local function gl_lib() return package.loaded['gptlua'] end
function M.name_of(v)
  local gl = gl_lib()
  if gl then
    for k, x in pairs(gl) do if x == v then return 'gl.' .. k, k, 'ops' end end
    for k, x in pairs(gl.Tensor) do if x == v then return 'Tensor:' .. k, k, 'methods' end end
  end
  for mod, t in pairs(package.loaded) do
    if type(t) == 'table' and t ~= _G then
      if t == v then return mod, nil, 'module' end
    end
  end
  if type(v) == 'function' then
    -- a module's function (gptlua.optim.clip_grad_norm) or a method of a class in it (Trainer:run)
    for mod, t in pairs(package.loaded) do
      if type(t) == 'table' and t ~= _G and type(mod) == 'string' and mod:match('^gptlua') then
        for k, x in pairs(t) do
          if x == v and type(k) == 'string' then return mod .. '.' .. k end
          if type(x) == 'table' and type(k) == 'string' and k:match('^%u') then
            for k2, x2 in pairs(x) do
              if x2 == v and type(k2) == 'string' then
                return k .. (debug.getlocal(v, 1) == 'self' and ':' or '.') .. k2
              end
            end
          end
        end
      end
    end
    -- a global, or a function of a standard library (string.format)
    for k, x in pairs(_G) do if x == v and type(k) == 'string' then return k end end
    for _, lib in ipairs({ 'string', 'table', 'math', 'io', 'os', 'debug', 'coroutine', 'package', 'jit', 'bit' }) do
      local t = rawget(_G, lib)
      if type(t) == 'table' then for k, x in pairs(t) do if x == v then return lib .. '.' .. k end end end
    end
  end
end

-- "matmul(a: tensor, b: tensor)" from a check signature string
local function format_sig(label, sig)
  local args = {}
  for _, e in ipairs(require('gptlua.check').signature_items(sig)) do
    if e.name and e.name ~= 'self' then args[#args + 1] = ('%s: %s%s'):format(e.name, e.kind, e.opt and '?' or '') end
  end
  return label .. '(' .. table.concat(args, ', ') .. ')'
end

-- parameter names of a Lua function, "..." for a vararg one
local function params_of(f)
  local info = debug.getinfo(f, 'u')
  local names = {}
  for i = 1, (info and info.nparams) or 0 do
    local n = debug.getlocal(f, i)
    if n and n ~= 'self' then names[#names + 1] = n end
  end
  if info and info.isvararg then names[#names + 1] = '...' end
  return names
end

-- the signature line of a function value
function M.signature(f, label)
  local _, short, kind = M.name_of(f)
  local gl = gl_lib()
  label = M.name_of(f) or label or 'function'
  local sigs = gl and gl.signatures
  local sig = sigs and short and (kind == 'methods' and (sigs.methods[short] or sigs.ops[short]) or sigs.ops[short])
  if sig then return format_sig(label, sig) end
  return label .. '(' .. table.concat(params_of(M.unwrap(f)), ', ') .. ')'
end

-- the doc lines of a function: its comment block (empty when it has none)
function M.doc(f)
  local path, line = where(f)
  local lines = path and source_lines(path)
  if not lines then return {} end
  local doc = comment_above(lines, line)
  -- a function a factory returns (`local function unary(...) return
  -- function(x) ...`): the factory's comment
  -- (or made in a loop: `for _, name in ipairs(...) do O[name] = function`)
  if #doc == 0 and line > 2 and (lines[line - 1]:match('^%s*local function') or lines[line - 1]:match('^%s*for ')) then
    doc = comment_above(lines, line - 1)
  end
  -- one of a run of one-line definitions under one comment (zeros, ones, ...)
  if #doc == 0 then
    local i = line - 1
    while i >= 1 and lines[i]:match('^%s*function .*%send%s*$') do i = i - 1 end
    if i < line - 1 then doc = comment_above(lines, i + 1) end
  end
  -- `function O.x(...)` under `O.x = check.wrap(...)`-style one-liners: the
  -- line itself may carry the comment after the code
  if #doc == 0 then
    local tail = lines[line]:match('%s%-%-%s*(.+)$')
    if tail then doc = { tail } end
  end
  return doc
end

-- members of a table grouped: functions by the section they are defined
-- in, then tables, then other values; each group sorted
function M.groups(t)
  local by, order = {}, {}
  local function add(group, name)
    if not by[group] then by[group] = {}; order[#order + 1] = group end
    table.insert(by[group], name)
  end
  local names = {}
  for k in pairs(t) do if type(k) == 'string' then names[#names + 1] = k end end
  table.sort(names)
  local sections = {}  -- section -> first line seen, to order groups as the source does
  for _, k in ipairs(names) do
    local v = t[k]
    if type(v) == 'function' then
      local path, line = where(v)
      local lines = path and source_lines(path)
      local sec = lines and section_of(lines, line)
      local group = sec or (path and path:match('([^/]+)%.lua$') .. '.lua') or 'other functions'
      if path and not sections[group] then
        sections[group] = { short_path(path), sec and line or math.huge }
      elseif path and sec and sections[group][1] == short_path(path) then
        sections[group][2] = math.min(sections[group][2], line)
      end
      add(group, k)
    end
  end
  table.sort(order, function(a, b)
    local sa, sb = sections[a] or { '~', math.huge }, sections[b] or { '~', math.huge }
    if (sa[2] == math.huge) ~= (sb[2] == math.huge) then return sb[2] == math.huge end  -- sections first
    if sa[1] ~= sb[1] then return sa[1] < sb[1] end
    return sa[2] < sb[2]
  end)
  local result = {}
  for _, g in ipairs(order) do result[#result + 1] = { name = g, members = by[g] } end
  local classes, tabs, vals = {}, {}, {}
  for _, k in ipairs(names) do
    local v = t[k]
    if type(v) == 'table' and type(rawget(v, '__name')) == 'string' and rawget(v, '__index') == v then
      classes[#classes + 1] = k   -- a class: Linear(...) makes one
    elseif type(v) == 'table' then tabs[#tabs + 1] = k
    elseif type(v) ~= 'function' then
      vals[#vals + 1] = type(v) == 'string' and ('%s = %q'):format(k, #v > 40 and v:sub(1, 37) .. '...' or v)
        or type(v) == 'number' and ('%s = %s'):format(k, tostring(v)) or k
    end
  end
  if #classes > 0 then result[#result + 1] = { name = 'classes', members = classes } end
  if #tabs > 0 then result[#result + 1] = { name = 'tables', members = tabs } end
  if #vals > 0 then result[#result + 1] = { name = 'values', members = vals } end
  return result
end

-- one group per line, members wrapped to `width` columns
function M.listing(t, label, width)
  width = width or 100
  local groups = M.groups(t)
  local n = 0
  for k in pairs(t) do if type(k) == 'string' then n = n + 1 end end
  local pad = 0
  for _, g in ipairs(groups) do pad = math.max(pad, #g.name) end
  pad = math.min(pad, 24)
  local out = { ('%s: %d members'):format(label or 'table', n) }
  for _, g in ipairs(groups) do
    local line = '  ' .. g.name .. string.rep(' ', pad - #g.name) .. '  '
    local indent = string.rep(' ', #line)
    local cur = line
    for i, m in ipairs(g.members) do
      local item = m .. (i < #g.members and ',' or '')
      if #cur + #item + 1 > width and cur ~= line then out[#out + 1] = cur; cur = indent end
      cur = cur .. (cur:sub(-1) == ' ' and '' or ' ') .. item
    end
    out[#out + 1] = cur
  end
  return table.concat(out, '\n')
end

-- the opening comment of a module's file
local function module_header(modname)
  local path = package.searchpath and package.searchpath(modname, package.path)
  local lines = path and source_lines(path)
  if not lines then return {} end
  local out = {}
  for _, l in ipairs(lines) do
    if not l:match('^%-%-') then break end
    out[#out + 1] = (l:gsub('^%-%-%s?', ''))
  end
  return out
end

local OVERVIEW = [[
gptlua REPL — LuaJIT with the gptlua library loaded as `gl`.
  help(x), ?x, x?    signature and doc of a function, members of a module (help(gl), help(gl.Tensor))
  gl                 the library's members by group; gl.<Tab> completes them
  Tab                completes names, fields and methods (gl.ra, x:nar, cfg.lea); file names inside strings
  Ctrl-C             stops the running statement, or clears the line being typed
  Ctrl-D             exits; every statement is appended to ~/.gptlua_history (GPTLUA_HISTORY) as it runs
  expressions print their value (no `=` needed); statements slower than 0.5 s print their time
  gptlua -i RECIPE   trains, then opens the REPL with trainer, model, cfg and data as globals]]

-- the text help(v) prints
function M.text(v, label, overview)
  local gl = gl_lib()
  if overview then
    return OVERVIEW .. (gl and ('\n\n' .. M.listing(gl, 'gl')) or '')
  end
  if type(v) == 'string' and gl and (gl[v] ~= nil or gl.Tensor[v] ~= nil) then
    return M.text(gl[v] ~= nil and gl[v] or gl.Tensor[v])
  end
  if type(v) == 'function' then
    local out = { M.signature(v, label) }
    local doc = M.doc(v)
    for _, l in ipairs(doc) do out[#out + 1] = '  ' .. l end
    local what = debug.getinfo(M.unwrap(v), 'S').what
    if #doc == 0 then
      out[#out + 1] = what == 'C' and '  (a built-in function: see the Lua 5.1 and LuaJIT manuals)'
        or '  (no doc comment in the source)'
    end
    local path, line = where(v)
    if path then out[#out + 1] = ('  defined at %s:%d'):format(short_path(path), line) end
    return table.concat(out, '\n')
  end
  local mt = type(v) == 'table' and getmetatable(v)
  if mt and mt.__name == 'Tensor' then
    return tostring(v) .. '\n' .. M.listing(gl.Tensor, 'Tensor methods')
  end
  if type(v) == 'table' then
    local name, _, kind = M.name_of(v)
    local out = {}
    if kind == 'module' and name ~= 'gptlua' then
      for _, l in ipairs(module_header(name)) do out[#out + 1] = l end
    elseif name == 'gptlua' then
      for _, l in ipairs(module_header('gptlua.init')) do out[#out + 1] = l end
      if #out == 0 then out = module_header('gptlua') end
    end
    out[#out + 1] = M.listing(v, label or (name == 'gptlua' and 'gl') or name or 'table')
    return table.concat(out, '\n')
  end
  return ('%s (a %s)'):format(tostring(v), type(v))
end

-- help() the overview; help(x) about x
function M.help(...)
  local v, label = ...
  io.write(M.text(v, label, select('#', ...) == 0), '\n')
end

return M
