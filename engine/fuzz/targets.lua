-- engine/fuzz/targets.lua — the Lua side of the libFuzzer harness
-- engine/fuzz/fuzz_lua.c: one function per target, called with each input
-- (a string) under pcall.  A target returns normally when the code under
-- test accepted the input or refused it with a clean message; anything else
-- (an internal Lua error such as "attempt to index a nil value", a message
-- over several lines or with a traceback, a non-string error) is raised as
-- "fuzz finding: ..." and the C side aborts.
local root = GPTLUA.root
local T = {}

-- Lua's own runtime errors: a user must never see these from a parser.
-- They start the message, after the position Lua adds ("file.lua:12: "):
-- the same words quoted from the input later in a message are no finding.
local INTERNAL = { 'attempt to ', 'bad argument #', 'stack overflow', 'table index is ', 'invalid value %(at index',
  'invalid order function', 'string length overflow', 'stack traceback' }

local function judge(what, ok, err)
  if ok then return end
  if type(err) ~= 'string' then error(('fuzz finding: %s raised a %s, not a message'):format(what, type(err)), 0) end
  if err:find('\n', 1, true) then error(('fuzz finding: %s raised a multi-line error: %s'):format(what, err), 0) end
  for _, p in ipairs(INTERNAL) do
    if err:find('^' .. p) or err:find('^[^%s\'"]*:%d+: ' .. p) then error(('fuzz finding: %s raised an internal error: %s'):format(what, err), 0) end
  end
end

local function write(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end
local function read(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end

local ffi = require 'ffi'
ffi.cdef 'int getpid(void);'
local scratch
local function scratch_dir()
  if scratch then return scratch end
  local base = os.execute('test -w /dev/shm') == 0 and '/dev/shm' or (os.getenv('TMPDIR') or '/tmp')
  scratch = ('%s/gptlua-fuzz-%d'):format(base, ffi.C.getpid())
  assert(os.execute('mkdir -p ' .. scratch) == 0)
  return scratch
end

-- ---------------------------------------------------------- checkpoint_state
-- The input is a checkpoint's state.json, next to a real checkpoint's
-- model.safetensors and optim.safetensors (engine/fuzz/checkpoint/, written
-- by a 2-step run of the default recipe).  checkpoint.load validates it; a
-- state it accepts then goes where a resume sends it: the RNG state and the
-- data loader's position.
local ckpt_dir, loader, gl

-- removes the scratch directory (fuzz_lua.c calls it at exit, the spec after its replay)
function T.cleanup()
  if scratch then os.execute('rm -rf ' .. scratch); scratch = nil end
  ckpt_dir = nil
end
local function setup_checkpoint()
  gl = require 'gptlua'
  if loader then loader:close() end
  ckpt_dir = scratch_dir() .. '/step_0000002'
  assert(os.execute('mkdir -p ' .. ckpt_dir) == 0)
  for _, n in ipairs({ 'model.safetensors', 'optim.safetensors' }) do
    write(ckpt_dir .. '/' .. n, read(root .. '/engine/fuzz/checkpoint/' .. n))
  end
  -- a loader with the fixture run's stream (its data state matches this one)
  local data = require 'gptlua.data'
  loader = data.loader({ tokens = gl.zeros({ 1003854 }, { dtype = 'int32' }), batch_size = 2, block_size = 8,
    seed = 1337, sampling = 'random', prefetch = 2 })
end

function T.checkpoint_state(input)
  if not ckpt_dir then setup_checkpoint() end
  write(ckpt_dir .. '/state.json', input)
  local ok, c = pcall(require('gptlua.checkpoint').load, ckpt_dir)
  judge('checkpoint.load', ok, c)
  if not ok then return end
  local st = c.state
  local rng = gl.get_rng_state()
  judge('set_rng_state', pcall(gl.set_rng_state, st.rng))
  gl.set_rng_state(rng)
  local set, err = pcall(loader.set_state, loader, st.data)
  judge('Loader:set_state', set, err)
  if set then judge('Loader:next_batch', pcall(gl.scope, function() loader:next_batch() end)) end
end

-- --------------------------------------------------------------------- config
-- The input is a command line: its arguments separated by NUL bytes (as in
-- /proc/PID/cmdline; an argument may hold a newline), or by newlines when
-- there is no NUL, optionally after a first one holding a recipe as JSON (a
-- config table).  The entry point is the trainer's:
-- train.resolve_config(recipe, args) validates the recipe, parses the
-- overrides and checks every value.  (If it moves, the parser and validator
-- in gptlua.config are fuzzed directly.)
function T.config(input)
  local cjson = require 'cjson'
  local sep = input:find('\0', 1, true) and '\0' or '\n'
  local lines, at = {}, 1
  while true do
    local e = input:find(sep, at, true)
    lines[#lines + 1] = input:sub(at, (e or 0) - 1)
    if not e then break end
    at = e + 1
  end
  local recipe = {}
  if lines[1] and lines[1]:sub(1, 1) == '{' then
    local ok, r = pcall(cjson.decode, table.remove(lines, 1))
    if ok and type(r) == 'table' then recipe = r end
  end
  local train = require 'gptlua.train'
  if train.resolve_config then
    judge('train.resolve_config', pcall(train.resolve_config, recipe, lines))
  else
    local config = require 'gptlua.config'
    judge('config.validate', pcall(config.validate, recipe, train.defaults))
    judge('config.parse_args', pcall(config.parse_args, lines, train.defaults))
  end
end

return T
