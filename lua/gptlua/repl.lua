-- gptlua.repl — the interactive prompt: readline editing with a persisted
-- history, multi-line statements, values printed without `=`, tensors
-- pretty-printed, errors with a short traceback, and the wall time of any
-- statement slower than `repl.time_threshold` seconds (as Torch7's th).
-- With stdin not a terminal (a pipe) it reads lines quietly, no prompts.
local cli = require 'gptlua.cli'

local M = { time_threshold = 0.5 }

local function is_tensor(v)
  local mt = getmetatable(v)
  return mt and mt.__name == 'Tensor'
end

-- a short, readable rendering of a value
local function render(v, depth)
  depth = depth or 0
  local tv = type(v)
  if tv == 'string' then return depth == 0 and v or string.format('%q', v) end
  if tv ~= 'table' or is_tensor(v) or depth > 2 then return tostring(v) end
  local mt = getmetatable(v)
  if mt and mt.__tostring then return tostring(v) end
  local parts, n = {}, 0
  for k, x in pairs(v) do
    n = n + 1
    if n > 20 then parts[#parts + 1] = '...'; break end
    local key = type(k) == 'string' and k:match('^[%a_][%w_]*$') and k or ('[' .. render(k, depth + 1) .. ']')
    parts[#parts + 1] = key .. ' = ' .. render(x, depth + 1)
  end
  return '{' .. table.concat(parts, ', ') .. '}'
end
M.render = render

local function history_path()
  local home = os.getenv('HOME')
  return os.getenv('GPTLUA_HISTORY') or (home and home .. '/.gptlua_history')
end

function M.run()
  local tty = GPTLUA and GPTLUA.isatty and GPTLUA.isatty(0)
  local read
  if tty then
    local hist = history_path()
    if hist then GPTLUA.read_history(hist) end
    io.write('gptlua ', GPTLUA.version, ' — Lua REPL on the gptlua engine. `gl` is loaded; Ctrl-D exits.\n')
    read = function(prompt) return GPTLUA.readline(prompt) end
    -- a whole statement (all its lines) is one history entry
    M.remember = function(src) if src:match('%S') then GPTLUA.add_history(src) end end
    M.save_history = function() if hist then GPTLUA.write_history(hist, 1000) end end
  else
    read = function() return io.read('*l') end
    M.save_history = function() end
    M.remember = function() end
  end
  if rawget(_G, 'gl') == nil then
    local ok, gl = pcall(require, 'gptlua')
    if ok then _G.gl = gl else io.stderr:write('gptlua: could not load the library: ', tostring(gl), '\n') end
  end

  local buffer = nil
  while true do
    local line = read(buffer and '>> ' or '> ')
    if line == nil then break end
    local src = buffer and (buffer .. '\n' .. line) or line
    -- an expression first (so `x` prints x), then a statement
    local f, err = loadstring('return ' .. src, '=stdin')
    if not f then f, err = loadstring(src, '=stdin') end
    if not f then
      -- only an error *at* the end of input means "unfinished" ("... near '<eof>'")
      if err:sub(-7) == "'<eof>'" then
        buffer = src  -- unfinished statement: keep reading
      else
        io.stderr:write(err, '\n')
        M.remember(src)
        buffer = nil
      end
    else
      buffer = nil
      M.remember(src)
      local t0 = cli.now()
      local res = { xpcall(f, cli.traceback) }
      local dt = cli.now() - t0
      if res[1] then
        local n = table.maxn(res)
        if n > 1 then
          local out = {}
          for k = 2, n do out[#out + 1] = render(res[k]) end
          io.write(table.concat(out, '\t'), '\n')
        end
      else
        io.stderr:write(res[2], '\n')
      end
      if dt > M.time_threshold then io.write(string.format('(%.3f s)\n', dt)) end
      io.stdout:flush()
    end
  end
  if buffer then io.stderr:write('gptlua: input ended inside an unfinished statement\n') end
  M.save_history()
  if tty then io.write('\n') end
  return 0
end

return M
