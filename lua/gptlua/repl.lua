-- gptlua.repl — the interactive prompt: readline editing, multi-line
-- statements, values printed without `=`, tensors pretty-printed, modules
-- listed by group, errors with a short traceback, help (help(x), ?x, x?),
-- Tab completion of names and fields, and the wall time of any statement
-- slower than `repl.time_threshold` seconds (as Torch7's th).
-- Ctrl-C stops the running statement or clears the line being typed
-- (engine/main.c); each statement is appended to the history file as it
-- runs.  Statements typed here run in LuaJIT's interpreter (jit.off) so
-- that Ctrl-C can reach them; the library they call stays compiled.
-- With stdin not a terminal (a pipe) it reads lines quietly, no prompts,
-- and exits 1 if any statement failed.
local cli = require 'gptlua.cli'
local help = require 'gptlua.help'

local M = { time_threshold = 0.5 }

local function is_tensor(v)
  local mt = getmetatable(v)
  return mt and mt.__name == 'Tensor'
end

-- a class (gptlua.nn.class and the like): a table that is its own __index, with a __name
local function is_class(v)
  return type(v) == 'table' and type(rawget(v, '__name')) == 'string' and rawget(v, '__index') == v
end

-- a module-like table: named members, some of them functions or classes (nn's)
local function is_module(t)
  local n, fns = 0, 0
  for k, v in pairs(t) do
    if type(k) ~= 'string' then return false end
    n = n + 1
    if type(v) == 'function' or is_class(v) then fns = fns + 1 end
  end
  return fns >= 4 and n > 8
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks, function(a, b)
    local ta, tb = type(a), type(b)
    if ta ~= tb then return ta == 'number' end
    if ta == 'number' or ta == 'string' then return a < b end
    return tostring(a) < tostring(b)
  end)
  return ks
end

-- a short, readable rendering of a value: a table on one line, or one
-- entry a line when that is long (at the top level, up to 200 entries)
local MAX_ENTRIES, MAX_TOP_ENTRIES, LINE = 20, 200, 100
local function render(v, depth)
  depth = depth or 0
  local tv = type(v)
  if tv == 'string' then return depth == 0 and v or string.format('%q', v) end
  if is_class(v) then return ('class %s'):format(v.__name) end
  if depth == 0 and is_tensor(v) then return require('gptlua.tensor').format(v, { footer = true }) end
  if tv ~= 'table' or is_tensor(v) or depth > 2 then return tostring(v) end
  local mt = getmetatable(v)
  if mt and mt.__tostring then return tostring(v) end
  if depth == 0 and is_module(v) then
    local name = help.name_of(v)
    return help.listing(v, name == 'gptlua' and 'gl' or name) ..
      '\n(help(x) or ?x for one member; help() for an overview)'
  end
  local keys = sorted_keys(v)
  local parts, n = {}, #v
  local max = depth == 0 and MAX_TOP_ENTRIES or MAX_ENTRIES
  for i, k in ipairs(keys) do
    if i > max then parts[#parts + 1] = ('... (%d more)'):format(#keys - max); break end
    if type(k) == 'number' and k >= 1 and k <= n and k == math.floor(k) then
      parts[#parts + 1] = render(v[k], depth + 1)
    else
      local key = type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or ('[' .. render(k, depth + 1) .. ']')
      parts[#parts + 1] = key .. ' = ' .. render(v[k], depth + 1)
    end
  end
  local flat = '{' .. table.concat(parts, ', ') .. '}'
  if depth > 0 or #flat <= LINE then return flat end
  return '{\n  ' .. table.concat(parts, ',\n  ') .. '\n}'
end
M.render = render

-- ------------------------------------------------------------ completion
local KEYWORDS = { 'and', 'break', 'do', 'else', 'elseif', 'end', 'false', 'for', 'function', 'goto', 'if',
  'in', 'local', 'nil', 'not', 'or', 'repeat', 'return', 'then', 'true', 'until', 'while' }

-- the names reachable from v by `.` (fields, class members) or `:` (methods)
local function members(v, methods_only)
  local out, seen = {}, {}
  local function add(t, skip_meta)
    if type(t) ~= 'table' or seen[t] then return end
    seen[t] = true
    for k, x in pairs(t) do
      if type(k) == 'string' and k:match('^[%a_][%w_]*$') and not (skip_meta and k:sub(1, 2) == '__')
         and (not methods_only or type(x) == 'function') and out[k] == nil then
        out[k] = x
      end
    end
  end
  if type(v) == 'table' then add(v) end
  if is_tensor(v) then   -- a tensor's methods: not the class's own functions (gl.Tensor.scope, .wrap, ...)
    local gl = require 'gptlua'
    for k, sig in pairs(gl.signatures.methods) do if out[k] == nil then out[k] = gl.Tensor[k] end end
    for k, sig in pairs(gl.signatures.ops) do
      if out[k] == nil and gl.Tensor[k] ~= nil and (sig:match('^[%w_]+:tensor') or sig:match('^[%w_]+:scalar')) then
        out[k] = gl.Tensor[k]
      end
    end
    return out
  end
  local mt = (type(v) == 'table' or type(v) == 'string') and getmetatable(v)
  local depth = 0
  while mt and depth < 8 do  -- the class chain: __index tables (a function __index: the metatable's own)
    local idx = rawget(mt, '__index')
    if type(idx) == 'table' then add(idx, true); mt = getmetatable(idx)
    else add(mt, true); mt = getmetatable(mt) end
    depth = depth + 1
  end
  return out
end

-- field lookup without running code: raw fields, then class tables
local function lookup(v, k)
  if type(v) ~= 'table' then
    return type(v) == 'string' and string[k] or nil
  end
  local x = rawget(v, k)
  if x ~= nil then return x end
  return members(v)[k]
end

-- complete(text, line, start) -> candidates for the word `text` (as
-- readline passes it): "gl.ra" -> {"gl.rand(", "gl.randn("}; functions get
-- "(", names starting with _ only when typed
function M.complete(text) return M.complete_in(_G, text) end

-- the same among the names reachable from root (gptlua attach: the job's environment)
function M.complete_in(root, text)
  local chain, sep, partial = text:match('^([%a_][%w_%.:]-)([%.:])([%w_]*)$')
  local cands = {}
  local function offer(prefix, name, v)
    if name:sub(1, #partial) == partial and (partial:sub(1, 1) == '_' or name:sub(1, 1) ~= '_') then
      cands[#cands + 1] = prefix .. name .. (type(v) == 'function' and '(' or '')
    end
  end
  if chain then
    if chain:find(':') then return {} end  -- a:b.c is a call's result, not a name
    local v = root
    for name in chain:gmatch('[^%.]+') do
      v = lookup(v, name)
      if v == nil then return {} end
    end
    for k, x in pairs(members(v, sep == ':')) do offer(chain .. sep, k, x) end
  else
    partial = text
    for k, x in pairs(members(root)) do offer('', k, x) end
    for _, k in ipairs(KEYWORDS) do offer('', k, nil) end
  end
  table.sort(cands)
  return cands
end

-- -------------------------------------------------------------- history
local function history_path()
  local home = os.getenv('HOME')
  return os.getenv('GPTLUA_HISTORY') or (home and home .. '/.gptlua_history')
end

-- `?x`, `x?`: the expression x to help with
local function help_request(src)
  local e = src:match('^%s*%?%s*(.-)%s*$') or src:match('^%s*(.-)%s*%?%s*$')
  if e and not e:find('\n') then
    -- ?x:narrow: the method, looked up as x.narrow
    local obj, method = e:match('^([%a_][%w_%.]*):([%a_][%w_]*)$')
    return obj and (obj .. '.' .. method) or e
  end
end

-- compiles a statement: an expression first (so `x` prints x), then a
-- statement; returns f, or nil and the error, or nil, nil when unfinished
local function compile(src)
  local f, err = loadstring('return ' .. src, '=stdin')
  if not f then f, err = loadstring(src, '=stdin') end
  if f then
    if jit then jit.off(f, true) end  -- interpreted: the Ctrl-C hook reaches it (engine/main.c)
    return f
  end
  -- only an error *at* the end of input means "unfinished" ("... near '<eof>'")
  if err:sub(-7) == "'<eof>'" then return nil, nil end
  return nil, err
end

-- runs f with Ctrl-C armed; returns xpcall's results
local function execute(f)
  local arm = GPTLUA and GPTLUA.interruptible
  if arm then arm(true) end
  local res = { xpcall(f, cli.traceback) }
  if arm then arm(false) end
  return res
end

-- run({globals = {names...}}): the loop; returns the exit status.
-- run({remote = function(src) return ok, text end, banner = line}): the
-- same line editing for statements that run elsewhere (gptlua attach)
function M.run(opts)
  opts = opts or {}
  local tty = GPTLUA and GPTLUA.isatty and GPTLUA.isatty(0) and GPTLUA.readline
  local read, hist
  if rawget(_G, 'gl') == nil then
    local ok, gl = pcall(require, 'gptlua')
    if ok then _G.gl = gl else io.stderr:write('gptlua: could not load the library: ', tostring(gl), '\n') end
  end
  _G.help = help.help
  if tty then
    hist = history_path()
    if hist then GPTLUA.read_history(hist, 1000) end
    GPTLUA.complete = opts.complete or M.complete
    local names = { '`gl`' }
    for _, g in ipairs(opts.globals or {}) do names[#names + 1] = '`' .. g .. '`' end
    if opts.banner then io.write(opts.banner, '\n')
    else
      io.write('gptlua ', GPTLUA.version, ' — Lua REPL on the gptlua engine. ',
        table.concat(names, ', '), #names > 1 and ' are loaded' or ' is loaded',
        '; help() for help, Tab completes, Ctrl-C interrupts, Ctrl-D exits.\n')
    end
    read = function(prompt) return GPTLUA.readline(prompt, opts.watch_fd) end
  else
    read = function() return io.read('*l') end
  end
  -- a whole statement (all its lines) is one history entry, saved as it runs
  local function remember(src)
    if tty and src:match('%S') then GPTLUA.add_history(src, hist) end
  end

  local failed = false
  local buffer = nil
  while true do
    local line, why = read(buffer and '>> ' or '> ')
    if line == nil and why == 'fd' then   -- attach: the job's socket closed while the user typed
      io.stderr:write('gptlua attach: the job ended; detached\n')
      failed = true
      break
    end
    if line == nil then break end
    if line == false then  -- Ctrl-C at the prompt: drop what was typed
      buffer = nil
    else
      local src = buffer and (buffer .. '\n' .. line) or line
      local helped = not buffer and help_request(src)
      if helped and opts.remote then   -- attach: help runs in the job, on its values
        src, helped = helped == '' and 'help()' or ('help(%s, %q)'):format(helped, helped), nil
      end
      local f, err
      if opts.remote and not buffer and src:match('^%s*:') then  -- attach's own commands (:ranks ...)
        f = function() return src end
      elseif helped then
        if helped == '' then f = function() help.help() end
        else
          local g = compile(helped)
          f = g and function() help.help(g(), helped) end
          err = not g and ('help: cannot read %q as an expression'):format(helped)
        end
      else
        f, err = compile(src)
      end
      if not f and not err then
        buffer = src  -- unfinished statement: keep reading
      elseif not f then
        io.stderr:write(err, '\n')
        failed = true
        remember(src)
        buffer = nil
      elseif opts.remote then  -- gptlua attach: the statement runs in a job, which answers with text
        buffer = nil
        remember(src)
        local ok, text, gone = opts.remote(src)
        if text and text ~= '' then (ok and io.stdout or io.stderr):write(text, '\n') end
        if not ok then failed = true end
        io.stdout:flush()
        if gone then break end   -- the job ended: nothing more can run there
      else
        buffer = nil
        remember(src)
        local t0 = cli.now()
        local res = execute(f)
        local dt = cli.now() - t0
        if res[1] then
          local n = table.maxn(res)
          if n > 1 then
            local out = {}
            for k = 2, n do out[#out + 1] = render(res[k]) end
            io.write(table.concat(out, '\t'), '\n')
          end
        else
          io.stderr:write(tostring(res[2]), '\n')
          failed = true
        end
        if dt > M.time_threshold then io.write(string.format('(%.3f s)\n', dt)) end
        io.stdout:flush()
      end
    end
  end
  if buffer then
    io.stderr:write('gptlua: input ended inside an unfinished statement\n')
    failed = true
  end
  if tty then io.write('\n'); return 0 end
  return failed and 1 or 0
end

return M
