-- What the CUDA simulator's own specs (spec/sim_*_spec.lua) and the script
-- they run in processes of their own (spec/sim/run.lua) share: the test
-- library build/sim/libgptlua_simtest.so (spec/cudasim/cases/*.cu) with every
-- gl_simtest_* function declared, once per process; the message of a
-- suite's last check; running spec/sim/run.lua in a subprocess and
-- printing its result; the cudaError_t numbers.
local ffi = require 'ffi'

local M = {}
M.ROOT, M.EXE = GPTLUA.root, GPTLUA.exe
M.PATH = GPTLUA.libdir .. '/libgptlua_simtest.so'

-- cudaError_t values (spec/cudasim/sim_types.h: the real runtime's numbers)
M.E = { InvalidValue = 1, MemoryAllocation = 2, InvalidConfiguration = 9, InvalidMemcpyDirection = 21,
        InvalidDevice = 101, InvalidResourceHandle = 400, IllegalAddress = 700, LaunchOutOfResources = 701,
        LaunchTimeout = 702, IllegalInstruction = 715, MisalignedAddress = 716, LaunchFailure = 719,
        IllegalState = 401, StreamCaptureUnsupported = 900, StreamCaptureInvalidated = 901,
        StreamCaptureMerge = 902, StreamCaptureUnmatched = 903, StreamCaptureUnjoined = 904,
        StreamCaptureIsolation = 905, StreamCaptureImplicit = 906, CapturedEvent = 907 }

-- the test library is there (a simulator build; absent from CPU and GPU builds)
function M.available()
  local f = io.open(M.PATH)
  if f then f:close() end
  return f ~= nil
end

local function declare()
  if pcall(ffi.typeof, 'gl_simtest_lt_case') then return end  -- declared already
  ffi.cdef [[
    /* cases/exec.cu */
    const char *gl_simtest_exec_message(void);
    int gl_simtest_exec_block_reduce(int rows, int cols, int threads, int is_double);
    int gl_simtest_exec_shuffles(void);
    int gl_simtest_exec_votes(void);
    int gl_simtest_exec_atomics(void);
    int gl_simtest_exec_grid3d(int gx, int gy, int gz, int bx, int by, int bz);
    int gl_simtest_exec_dynamic_smem(int bytes, int optin);
    int gl_simtest_exec_poison(void);
    int gl_simtest_exec_collective(void);
    int gl_simtest_exec_bench(double res[4]);

    /* cases/exec_faults.cu */
    const char *gl_simtest_fault_message(void);
    int gl_simtest_fault_race_natural(void);
    int gl_simtest_fault_launch_config(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                       unsigned bz, long smem, int optin);
    int gl_simtest_fault_planted(const char *name);

    /* cases/runtime.cu */
    const char *gl_simtest_rt_message(void);
    int gl_simtest_rt_sticky(void);
    int gl_simtest_rt_copies(void);
    int gl_simtest_rt_peer(void);
    int gl_simtest_rt_streams(void);
    int gl_simtest_rt_concurrent(void);
    int gl_simtest_rt_func_attribute(void);
    int gl_simtest_rt_bad_arg(const char *name);
    int gl_simtest_rt_planted(const char *name);

    /* cases/graphs.cu */
    const char *gl_simtest_graph_message(void);
    int gl_simtest_graph_replay(void);
    int gl_simtest_graph_fork_join(void);
    int gl_simtest_graph_misuse(const char *name, int *end);
    int gl_simtest_graph_destroyed_exec(void);

    /* cases/numeric.cu */
    long gl_simtest_num_16_to_float(void);
    long gl_simtest_num_float_to_16(long n_random, unsigned seed, long *checked);
    long gl_simtest_num_double_to_16(long n_random, unsigned seed, long *checked);
    long gl_simtest_num_int_16(unsigned seed, long *checked);
    long gl_simtest_num_arith(long n_pairs, unsigned seed);
    long gl_simtest_num_pairs(void);
    long gl_simtest_num_device(void);

    /* cases/wmma.cu */
    long gl_simtest_num_wmma_gemm(int shape, int dtype, int a_col, int b_col, int half_acc, int accumulate,
                                  int c_col_major, int scale_a, unsigned seed, double *worst);
    int gl_simtest_num_wmma_planted(int which, char *msg, int msg_len);

    /* cases/cublaslt.cu */
    typedef struct gl_simtest_lt_case {
      int atype, dtype, compute;
      int opa, opb;
      int m, n, k, batch;
      int pad_a, pad_b, pad_c, pad_d;
      int gap;
      int offset;
      int a_shared;
      int interleave_d;
      int in_place;
      int epilogue;
      int bias_type;
      int bias_batched;
      int exact;
      int no_algo;
      double alpha, beta;
      unsigned seed;
    } gl_simtest_lt_case;
    typedef struct gl_simtest_lt_result {
      int heuristic_status, found, matmul_status, sync_error;
      double err, aux_err, bias_err;
      long long mismatches, outside;
      double fast_dev;
      char message[256];
    } gl_simtest_lt_result;
    int gl_simtest_lt_run(const gl_simtest_lt_case *c, gl_simtest_lt_result *r);

    /* cases/cublaslt_misuse.cu */
    int gl_simtest_lt_refusal(const char *name, char *msg, int cap);
    int gl_simtest_lt_attributes(char *msg, int cap);
    int gl_simtest_lt_fault(const char *name);
  ]]
end

local T
-- the test library, loaded on first use
function M.lib()
  if not T then
    require 'gptlua'  -- libgptlua.so first: the test library links against it
    declare()
    T = ffi.load(M.PATH)
  end
  return T
end

-- the first problem the last check of `suite` met (exec: cases/exec.cu, rt:
-- cases/runtime.cu, graph: cases/graphs.cu)
function M.message(suite)
  return ffi.string(M.lib()['gl_simtest_' .. suite .. '_message']())
end

-- message() and passes(name, r) for the checks of `suite`: passes fails
-- with the description unless the check returned 0 (no mismatch, no CUDA
-- error)
function M.checks(suite)
  local function message() return M.message(suite) end
  local function passes(name, r)
    assert(r == 0, ('%s returned %d: %s'):format(name, r, message()))
  end
  return message, passes
end

-- runs `spec/sim/run.lua args` in a process of its own with the settings
-- `env` ('' or e.g. 'GL_SIM_STREAMS=threads'); returns its exit status, the
-- code and message of the "result CODE MESSAGE" line it printed (nil when
-- none) and its whole output (stdout and stderr)
-- (through the specs' one shell runner, spec/support/mpi.lua's sh, whose
-- time limit keeps a simulated hang from hanging the suite)
function M.subprocess(env, args)
  local out, rc = require('support.mpi').sh(('env %s %s spec/sim/run.lua %s'):format(env or '', M.EXE, args), 300)
  local code, msg = out:match('result (%-?%d+) ([^\n]*)')
  return rc, tonumber(code), msg, out
end

-- runs as subprocess does and requires exit status 0 and the result code
-- `code` (or fails showing the whole output); returns the result message
-- and the output
function M.expect(env, args, code)
  local rc, got, msg, out = M.subprocess(env, args)
  assert(rc == 0 and got == code, ('%srun.lua %s: exit %s, result %s, expected 0 and %d:\n%s')
         :format(env and env ~= '' and env .. ' ' or '', args, tostring(rc), tostring(got), code, out))
  return msg, out
end

-- spec/sim/run.lua's answer: prints "result CODE MESSAGE" and exits 0
function M.result(code, msg)
  io.write(('result %d %s\n'):format(code, msg))
  io.stdout:flush()
  os.exit(0)
end

return M
