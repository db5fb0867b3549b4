-- Runs one case of the CUDA simulator's own checks (spec/cudasim/cases/*.cu)
-- in a process of its own, for spec/sim_*_spec.lua (spec/support/sim.lua's
-- subprocess): planted bugs leave a sticky error or abort the process, and
-- the GL_SIM_* settings (race mode, stream threads, devices, memory, no
-- cuBLASLt algorithm) are read when the process starts.
-- Prints "result <code> <message>" and exits 0.
--   run.lua exec planted NAME   a buggy kernel of cases/exec_faults.cu: the error the next synchronize reports
--   run.lua exec correct        every correct cases/exec.cu case (0 when all pass)
--   run.lua exec scenario NAME  gl_simtest_NAME() of cases/exec.cu or exec_faults.cu
--   run.lua rt planted NAME     a planted bug of cases/runtime.cu (or its fixed twin)
--   run.lua rt scenario NAME    gl_simtest_rt_NAME()
--   run.lua rt engine           the engine's runtime (spec/sim/runtime_engine.lua), then the sticky error
--   run.lua rt oom              a 4 MiB tensor on cuda:0 (GL_SIM_MEMORY_MB bounds the device)
--   run.lua num planted WHICH   WMMA misuse WHICH (0..4, see cases/numeric.cu's wmma_planted_kernel):
--                               the status and its text
--   run.lua lt fault NAME       a cuBLASLt fault of cases/cublaslt.cu: the cudaError the stream reports
--   run.lua san planted NAME OPT  the planted bug NAME of cases/sanitize.cu, built at -O<OPT>:
--                               the error the next synchronize reports
--   run.lua san correct OPT     every correct twin of cases/sanitize.cu at -O<OPT> (0 when all are silent)
--   run.lua lt matmul           the engine's matmul against the CPU (spec/sim/cublaslt_matmul.lua):
--                               the number of cases off
package.path = GPTLUA.root .. '/spec/?.lua;' .. package.path
local ffi = require 'ffi'
local gl = require 'gptlua'
local S = require 'support.sim'
local T = S.lib()
local ROOT = GPTLUA.root

local CASES = {
  exec = {
    planted = function(name) return T.gl_simtest_fault_planted(name), S.message('fault') end,
    -- a check that reads what initcheck or racecheck report, run with them off
    scenario = function(name) return T['gl_simtest_' .. name](), S.message(name:match('^exec') and 'exec' or 'fault') end,
    correct = function()
      -- atomicExch hands out values in thread order, which the race mode
      -- rightly reports as order-dependent: left out here
      local cases = {
        { 'block_reduce float', function() return T.gl_simtest_exec_block_reduce(7, 1000, 256, 0) end },
        { 'block_reduce double', function() return T.gl_simtest_exec_block_reduce(3, 3000, 1024, 1) end },
        { 'shuffles', function() return T.gl_simtest_exec_shuffles() end },
        { 'votes', function() return T.gl_simtest_exec_votes() end },
        { 'grid3d', function() return T.gl_simtest_exec_grid3d(3, 2, 2, 8, 4, 2) end },
        { 'dynamic_smem', function() return T.gl_simtest_exec_dynamic_smem(100000, 1) end },
        { 'collective', function() return T.gl_simtest_exec_collective() end },
      }
      for _, c in ipairs(cases) do
        local r = c[2]()
        if r ~= 0 then return r, c[1] .. ': ' .. S.message('exec') end
      end
      return 0, 'all passed'
    end,
  },
  rt = {
    planted = function(name) return T.gl_simtest_rt_planted(name), S.message('rt') end,
    scenario = function(name) return T['gl_simtest_rt_' .. name](), S.message('rt') end,
    engine = function()
      local ok, err = pcall(dofile(ROOT .. '/spec/sim/runtime_engine.lua'))
      return ok and T.gl_simtest_rt_sticky() or -1, ok and '' or tostring(err)
    end,
    oom = function()
      -- a 4 MiB tensor on a 1 MiB device (GL_SIM_MEMORY_MB=1)
      local ok, err = pcall(gl.empty, { 1024 * 1024 }, { device = 'cuda:0' })
      return ok and 0 or 2, ok and 'allocated' or tostring(err)
    end,
  },
  num = {
    planted = function(which)
      local n = tonumber(which)
      if not n then error('run.lua num planted: expected a planted bug number, got ' .. tostring(which)) end
      local msg = ffi.new('char[512]')
      local code = T.gl_simtest_num_wmma_planted(n, msg, 512)
      return code, ffi.string(msg)
    end,
  },
  lt = {
    fault = function(name) return T.gl_simtest_lt_fault(name), name end,
    matmul = function()
      local failed = dofile(ROOT .. '/spec/sim/cublaslt_matmul.lua')()
      return failed, ('%d case(s) off'):format(failed)
    end,
  },
}

-- cases/sanitize.cu built at one optimisation level (build/sim/libgptlua_sanitize_O<opt>.so)
local function sanitize_lib(opt)
  if not (opt == '0' or opt == '2' or opt == '3') then
    error('run.lua san: expected the optimisation level 0, 2 or 3, got ' .. tostring(opt))
  end
  pcall(ffi.cdef, [[
    const char *gl_simtest_san_message(void);
    int gl_simtest_san_run(const char *name, int planted);
    const char *gl_simtest_san_names(void);
  ]])
  return ffi.load(GPTLUA.libdir .. '/libgptlua_sanitize_O' .. opt .. '.so')
end

CASES.san = {
  planted = function(name)
    local lib = sanitize_lib(arg[4])
    return lib.gl_simtest_san_run(name, 1), ffi.string(lib.gl_simtest_san_message())
  end,
  correct = function(opt)
    local lib = sanitize_lib(opt)
    for case in ffi.string(lib.gl_simtest_san_names()):gmatch('%S+') do
      local r = lib.gl_simtest_san_run(case, 0)
      if r ~= 0 then return r, case .. ': ' .. ffi.string(lib.gl_simtest_san_message()) end
    end
    return 0, 'all silent'
  end,
}

local suite, kind, name = arg[1], arg[2], arg[3]
local run = CASES[suite] and CASES[suite][kind]
if not run then
  error(('run.lua: expected exec planted|correct, rt planted|scenario|engine|oom, num planted, san planted|correct or lt fault|matmul, '
         .. 'got %s %s'):format(tostring(suite), tostring(kind)))
end
S.result(run(name))
