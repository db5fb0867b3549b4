-- Runs one scenario of kernels/sim/test_runtime.cu (or the engine exercise)
-- in its own process, for spec/sim_runtime_spec.lua: planted bugs leave a
-- sticky error or abort the process.  Prints "result <code> <message>".
--   runtime_run.lua planted NAME | scenario NAME | engine | oom
local ffi = require 'ffi'
local gl = require 'gptlua'
ffi.cdef [[
const char *gl_simtest_rt_message(void);
int gl_simtest_rt_sticky(void);
int gl_simtest_rt_copies(void);
int gl_simtest_rt_peer(void);
int gl_simtest_rt_streams(void);
int gl_simtest_rt_concurrent(void);
int gl_simtest_rt_planted(const char *name);
]]
local T = ffi.load(GPTLUA.libdir .. '/libgptlua_simtest.so')
local kind, name = arg[1], arg[2]
local code, msg
if kind == 'planted' then
  code = T.gl_simtest_rt_planted(name)
  msg = ffi.string(T.gl_simtest_rt_message())
elseif kind == 'scenario' then
  code = T['gl_simtest_rt_' .. name]()
  msg = ffi.string(T.gl_simtest_rt_message())
elseif kind == 'engine' then
  local ok, err = pcall(dofile(GPTLUA.root .. '/spec/sim/runtime_engine.lua'))
  code, msg = ok and T.gl_simtest_rt_sticky() or -1, ok and '' or tostring(err)
elseif kind == 'oom' then
  -- GL_SIM_MEMORY_MB bounds the device: a 4 MiB tensor on a 1 MiB device
  local ok, err = pcall(gl.empty, { 1024 * 1024 }, { device = 'cuda:0' })
  code, msg = ok and 0 or 2, ok and 'allocated' or tostring(err)
else
  error('runtime_run.lua: expected planted|scenario|engine|oom, got ' .. tostring(kind))
end
io.write(('result %d %s\n'):format(code, msg))
io.stdout:flush()
os.exit(0)
