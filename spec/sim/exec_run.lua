-- Runs one case of kernels/sim/test_exec.cu in its own process, for
-- spec/sim_exec_spec.lua: planted bugs leave a sticky error (the process
-- is unusable afterwards), and the race mode is switched on by the
-- environment (GL_SIM_RACECHECK=1) when the process starts.
-- Prints "result <code> <message>".
--   exec_run.lua planted NAME     a deliberately buggy kernel
--   exec_run.lua correct          every correct case (0 when all pass)
local ffi = require 'ffi'
require 'gptlua'
ffi.cdef [[
const char *gl_simtest_exec_message(void);
int gl_simtest_exec_planted(const char *name);
int gl_simtest_exec_block_reduce(int rows, int cols, int threads, int is_double);
int gl_simtest_exec_shuffles(void);
int gl_simtest_exec_votes(void);
int gl_simtest_exec_grid3d(int gx, int gy, int gz, int bx, int by, int bz);
int gl_simtest_exec_dynamic_smem(int bytes, int optin);
int gl_simtest_exec_poison(void);
int gl_simtest_exec_collective(void);
]]
local T = ffi.load(GPTLUA.libdir .. '/libgptlua_simtest.so')
local kind, name = arg[1], arg[2]
local code, msg
if kind == 'planted' then
  code = T.gl_simtest_exec_planted(name)
  msg = ffi.string(T.gl_simtest_exec_message())
elseif kind == 'correct' then
  -- atomicExch hands out values in thread order, which the race mode
  -- rightly reports as order-dependent: left out here
  local cases = {
    { 'block_reduce float', function() return T.gl_simtest_exec_block_reduce(7, 1000, 256, 0) end },
    { 'block_reduce double', function() return T.gl_simtest_exec_block_reduce(3, 3000, 1024, 1) end },
    { 'shuffles', function() return T.gl_simtest_exec_shuffles() end },
    { 'votes', function() return T.gl_simtest_exec_votes() end },
    { 'grid3d', function() return T.gl_simtest_exec_grid3d(3, 2, 2, 8, 4, 2) end },
    { 'dynamic_smem', function() return T.gl_simtest_exec_dynamic_smem(100000, 1) end },
    { 'poison', function() return T.gl_simtest_exec_poison() end },
    { 'collective', function() return T.gl_simtest_exec_collective() end },
  }
  code, msg = 0, 'all passed'
  for _, c in ipairs(cases) do
    local r = c[2]()
    if r ~= 0 then
      code, msg = r, c[1] .. ': ' .. ffi.string(T.gl_simtest_exec_message())
      break
    end
  end
else
  error('exec_run.lua: expected planted|correct, got ' .. tostring(kind))
end
io.write(('result %d %s\n'):format(code, msg))
io.stdout:flush()
os.exit(0)
