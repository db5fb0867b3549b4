-- gptlua.ffi — loads libgptlua.so and declares its API from the header text
-- embedded in the library at build time (engine/gptlua.h is the only place
-- the C/Lua boundary is written down).
local ffi = require 'ffi'

local M = { ffi = ffi }

-- where the engine library lives: next to the executable (build/ or lib/),
-- or found from this file's location when run by a plain luajit
local function libdir()
  if GPTLUA and GPTLUA.libdir then return GPTLUA.libdir end
  local src = debug.getinfo(1, 'S').source:gsub('^@', '')
  local root = src:match('^(.*)/lua/gptlua/ffi%.lua$') or '.'
  return root .. '/build'
end

M.libdir = libdir()
-- installed by luarocks (gptlua-dev-1.rockspec): beside the tree's C modules, on package.cpath
local function readable(p) local f = io.open(p, 'rb'); if f then f:close() end; return f ~= nil end
if not (GPTLUA and GPTLUA.libdir) and not readable(M.libdir .. '/libgptlua.so') then
  for template in package.cpath:gmatch('[^;]+') do
    local candidate = template:gsub('%?', 'libgptlua')
    if readable(candidate) then M.libdir = candidate:match('^(.*)/[^/]+$') or '.'; break end
  end
end
local path = M.libdir .. '/libgptlua.so'
local ok, lib = pcall(ffi.load, path)
if not ok then
  error(("gptlua: cannot load the engine library %s (%s); run `make` first"):format(path, tostring(lib)), 0)
end
ffi.cdef 'const char *gl_cdef(void);'
ffi.cdef(ffi.string(lib.gl_cdef()))
M.lib = lib

-- Turns an engine status into a Lua error at the caller's caller's line.
function M.check(rc, level)
  if rc ~= 0 then error(ffi.string(lib.gl_last_error()), (level or 1) + 1) end
  return rc
end

-- For functions returning pointers: NULL becomes an error.
function M.check_ptr(p, level)
  if p == nil then error(ffi.string(lib.gl_last_error()), (level or 1) + 1) end
  return p
end

return M
