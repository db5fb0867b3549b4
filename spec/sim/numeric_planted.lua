-- Runs one planted WMMA misuse of kernels/sim/test_numeric.cu in its own
-- process, for spec/sim_numeric_spec.lua: the kernel stops and the context
-- keeps a sticky error, so each needs a fresh process.  Prints
-- "result <status> <cudaGetErrorString text>".
--   numeric_planted.lua WHICH    (0..4, see wmma_planted_kernel)
local ffi = require 'ffi'
require 'gptlua'
ffi.cdef [[ int gl_simtest_num_wmma_planted(int which, char *msg, int msg_len); ]]
local T = ffi.load(GPTLUA.libdir .. '/libgptlua_simtest.so')
local which = tonumber(arg[1])
if not which then error('numeric_planted.lua: expected a planted bug number, got ' .. tostring(arg[1])) end
local msg = ffi.new('char[512]')
local code = T.gl_simtest_num_wmma_planted(which, msg, 512)
io.write(('result %d %s\n'):format(code, ffi.string(msg)))
io.stdout:flush()
os.exit(0)
