/* simtest.h — the harness the simulator's own checks share (spec/cudasim/
 * test_*.cu, compiled together into build/sim/libgptlua_simtest.so and
 * driven by spec/sim_*_spec.lua through spec/support/sim.lua).
 *
 * A check describes the first problem it met in words for the spec to show:
 *  - note(fmt, ...) keeps it (later ones are dropped) until the next
 *    begin(); SIMTEST_MESSAGE(suite) defines the extern "C"
 *    gl_simtest_<suite>_message() that hands it to Lua.  Everything here is
 *    static: each test_*.cu has its own message.
 *  - TRY(call): a CUDA call that failed is noted and the check returns
 *    -cudaError_t.
 * (cases/numeric.cu and cases/cublaslt.cu write their messages into buffers
 * the caller passes instead.) */
#ifndef GL_SIM_SIMTEST_H
#define GL_SIM_SIMTEST_H
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <string>
#include <vector>

static std::string simtest_msg;

__attribute__((format(printf, 1, 2))) static void note(const char *fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (simtest_msg.empty()) simtest_msg = buf; /* the first problem is the one to read */
}

/* a new check: forget the last one's problem */
static void begin(void) { simtest_msg.clear(); }

#define SIMTEST_MESSAGE(suite) \
  extern "C" const char *gl_simtest_##suite##_message(void) { return simtest_msg.c_str(); }

#define TRY(call)                                                         \
  do {                                                                    \
    cudaError_t e_ = (call);                                              \
    if (e_ != cudaSuccess) {                                              \
      note("%s: %s (line %d)", #call, cudaGetErrorString(e_), __LINE__); \
      return -(int)e_;                                                    \
    }                                                                     \
  } while (0)

#endif
