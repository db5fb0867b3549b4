-- One cuBLASLt misuse that faults inside the stream work (an operand outside
-- device memory, a bias pointer less aligned than its algorithm assumed):
-- runs kernels/sim/test_cublaslt.cu's gl_simtest_lt_fault(NAME), prints the
-- cudaError the stream reported and exits 0 when it is EXPECTED, 3 if not.
-- spec/sim_cublaslt_spec.lua runs it in a process of its own, because the
-- sticky error leaves the device context unusable.
--   usage: gptlua spec/sim/cublaslt_fault.lua NAME EXPECTED
local ffi = require 'ffi'
ffi.cdef 'int gl_simtest_lt_fault(const char *name);'
local T = ffi.load(GPTLUA.libdir .. '/libgptlua_simtest.so')
local code = T.gl_simtest_lt_fault(arg[1])
io.write(('cudaError %d\n'):format(code))
io.stdout:flush()
os.exit(code == tonumber(arg[2]) and 0 or 3)
