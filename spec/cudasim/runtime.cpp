/* runtime.cpp — the CUDA simulator's runtime: simulated devices, the device
 * heap with guard pages, host access checks, copies and sets, streams,
 * events, errors (runtime_api.h and the runtime half of sim.h).  Three
 * files, sharing runtime_internal.h:
 *
 *   runtime.cpp          (this file) configuration and initialisation,
 *                        messages, errors (the sticky error, each thread's
 *                        last error, the error strings), the simulated
 *                        devices and their properties, function attributes
 *   runtime_memory.cpp   device memory: the heap with guard pages, slack
 *                        checks and quarantine, the SIGSEGV handler and the
 *                        host access and stream-order checks it makes,
 *                        pinned host memory, what a pointer is
 *   runtime_streams.cpp  streams and events: running and queueing work
 *                        (sync or threads mode), host synchronisation,
 *                        copies and sets
 *
 * Every runtime call starts with rt(), which initialises the runtime once
 * from the environment (GL_SIM_DEVICES, GL_SIM_MEMORY_MB, the switches
 * listed in sim.h) and makes each device's legacy default stream. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "runtime_internal.h"

using namespace gl_sim_rt;

/* ---- configuration --------------------------------------------------------- */
namespace gl_sim_rt {
Config config;
}  // namespace gl_sim_rt

static long env_long(const char *name, long dflt, long lo, long hi) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end = nullptr;
  long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi) {
    fprintf(stderr, "gptlua cuda-sim: %s expected an integer in [%ld, %ld], got '%s'; using %ld\n", name, lo, hi,
            v, dflt);
    return dflt;
  }
  return x;
}

/* ---- messages ------------------------------------------------------------ */
/* One line "gptlua cuda-sim: <msg>" to stderr in one write (no stdio lock,
   so it is usable from the fault handler). */
namespace gl_sim_rt {
void say_raw(const char *msg) {
  char line[2048];
  int n = snprintf(line, sizeof line, "gptlua cuda-sim: %s\n", msg);
  if (n < 0) return;
  if (n >= (int)sizeof line) { n = (int)sizeof line - 1; line[n - 1] = '\n'; }
  ssize_t w = write(2, line, (size_t)n);
  (void)w;
}
}  // namespace gl_sim_rt

/* ---- error codes ------------------------------------------------------------- */
struct ErrorText { cudaError_t code; const char *name, *text; };
static const ErrorText error_texts[] = {
  {cudaSuccess, "cudaSuccess", "no error"},
  {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
  {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
  {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
  {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
  {cudaErrorInvalidPitchValue, "cudaErrorInvalidPitchValue", "invalid pitch argument"},
  {cudaErrorInvalidSymbol, "cudaErrorInvalidSymbol", "invalid device symbol"},
  {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
  {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
  {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
  {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
  {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage", "device kernel image is invalid"},
  {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
  {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
  {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
  {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
  {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources", "too many resources requested for launch"},
  {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout", "the launch timed out and was terminated"},
  {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
  {cudaErrorIllegalInstruction, "cudaErrorIllegalInstruction", "an illegal instruction was encountered"},
  {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
  {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
  {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
  {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
   "operation not permitted when stream is capturing"},
  {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
   "operation failed due to a previous error during capture"},
  {cudaErrorStreamCaptureMerge, "cudaErrorStreamCaptureMerge", "operation would result in a merge of separate capture sequences"},
  {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched", "capture was not ended in the same stream as it began"},
  {cudaErrorStreamCaptureUnjoined, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"},
  {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
   "dependency created on uncaptured work in another stream"},
  {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
   "operation would make the legacy stream depend on a capturing blocking stream"},
  {cudaErrorCapturedEvent, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"},
  {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread",
   "attempt to terminate a thread-local capture sequence from another thread"},
  {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
static const ErrorText *error_text(cudaError_t code) {
  for (const ErrorText &e : error_texts)
    if (e.code == code) return &e;
  return nullptr;
}

/* The sticky error: the first failure of the context wins. */
static std::mutex sticky_mu;
static std::atomic<int> sticky_code{0};
static char sticky_full[1200];  /* "<standard text>: <message>" */

/* The last error of each host thread, and the detail of its latest error
   (kept after cudaGetLastError resets the code, because GL_CU_CHECK resets
   before it asks cudaGetErrorString). */
static thread_local cudaError_t tls_last = cudaSuccess;
static thread_local cudaError_t tls_detail_code = cudaSuccess;
static thread_local char tls_detail_full[1200];

cudaError_t gl_sim_sticky(void) { return (cudaError_t)sticky_code.load(std::memory_order_acquire); }

/* the thread's last error, with its detail for cudaGetErrorString */
static void set_last(cudaError_t code, const char *msg) {
  const ErrorText *t = error_text(code);
  snprintf(tls_detail_full, sizeof tls_detail_full, "%s: %s", t ? t->text : "unrecognized error code", msg);
  tls_detail_code = code;
  tls_last = code;
}

namespace gl_sim_rt {
/* An API call's failure: the thread's last error with a detail, not printed
   (the caller gets the code; GL_CU_CHECK puts the text in its message). */
cudaError_t api_error(cudaError_t code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  set_last(code, msg);
  return code;
}

void fail_msg(cudaError_t code, const char *msg) {
  std::lock_guard<std::mutex> g(sticky_mu);
  if (sticky_code.load() != 0) return;
  const ErrorText *t = error_text(code);
  snprintf(sticky_full, sizeof sticky_full, "%s: %s", t ? t->text : "unrecognized error code", msg);
  sticky_code.store((int)code, std::memory_order_release);
  say_raw(msg);
}
}  // namespace gl_sim_rt

void gl_sim_fail(cudaError_t code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fail_msg(code, msg);
}

void gl_sim_set_last_error(cudaError_t code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  set_last(code, msg);
  say_raw(msg);
}

extern "C" cudaError_t cudaGetLastError(void) {
  cudaError_t s = gl_sim_sticky();
  if (s != cudaSuccess) return s;
  cudaError_t e = tls_last;
  tls_last = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) {
  cudaError_t s = gl_sim_sticky();
  return s != cudaSuccess ? s : tls_last;
}

extern "C" const char *cudaGetErrorString(cudaError_t error) {
  if (error != cudaSuccess && error == gl_sim_sticky()) return sticky_full;
  if (error != cudaSuccess && error == tls_detail_code) return tls_detail_full;
  const ErrorText *t = error_text(error);
  return t ? t->text : "unrecognized error code";
}

extern "C" const char *cudaGetErrorName(cudaError_t error) {
  const ErrorText *t = error_text(error);
  return t ? t->name : "unrecognized error code";
}

/* ---- the runtime's state ------------------------------------------------------- */
static std::once_flag rt_once;
static void init(void);

namespace gl_sim_rt {
Runtime *rt_state;
Runtime &rt() {
  std::call_once(rt_once, init);
  return *rt_state;
}

thread_local int tls_device = 0;
}  // namespace gl_sim_rt

/* ---- initialisation ----------------------------------------------------------- */
static void init(void) {
  Config c;
  c.devices = (int)env_long("GL_SIM_DEVICES", 1, 0, MAX_DEVICES);
  c.memory_bytes = (size_t)env_long("GL_SIM_MEMORY_MB", 81920, 1, 1L << 24) << 20;
  c.hostcheck = env_long("GL_SIM_HOSTCHECK", 1, 0, 1) != 0;
  c.streamcheck = env_long("GL_SIM_STREAMCHECK", 1, 0, 1) != 0;
  c.racecheck = env_long("GL_SIM_RACECHECK", 0, 0, 1) != 0;
  c.sms = (int)env_long("GL_SIM_SMS", GL_SIM_SM_COUNT, 1, GL_SIM_SM_COUNT);
  const char *seed = getenv("GL_SIM_SEED");
  if (seed && *seed) {
    char *end = nullptr;
    unsigned long long s = strtoull(seed, &end, 10);
    if (*end) fprintf(stderr, "gptlua cuda-sim: GL_SIM_SEED expected an integer, got '%s'; using 1\n", seed);
    else c.seed = s;
  }
  /* the GPU pretended: compute capability and opt-in shared memory per block
     (CUDA's table: sm_80 163 KiB, sm_86 and sm_89 99 KiB, sm_90 227 KiB) */
  const char *arch = getenv("GL_SIM_ARCH");
  if (arch && *arch) {
    static const struct { const char *name; int arch, smem; } archs[] = {
        {"80", 80, 163 * 1024}, {"86", 86, 99 * 1024}, {"89", 89, 99 * 1024}, {"90", 90, GL_SIM_SMEM_OPTIN}};
    bool found = false;
    for (const auto &a : archs)
      if (!strcmp(arch, a.name)) { c.arch = a.arch; c.smem_optin = a.smem; found = true; }
    if (!found) fprintf(stderr, "gptlua cuda-sim: GL_SIM_ARCH expected 80, 86, 89 or 90, got '%s'; using 90\n", arch);
  }
  const char *checks = getenv("GL_SIM_CHECKS");
  if (checks && *checks) {
    static const struct { const char *name; unsigned bit; } classes[] = {
        {"memcheck", GL_SIM_CHECK_MEM}, {"initcheck", GL_SIM_CHECK_INIT},
        {"racecheck", GL_SIM_CHECK_RACE}, {"synccheck", GL_SIM_CHECK_SYNC}};
    unsigned mask = 0;
    bool ok = true;
    for (const char *p = checks; *p && ok;) {
      const char *e = strchr(p, ',');
      size_t n = e ? (size_t)(e - p) : strlen(p);
      bool found = false;
      if (n == 3 && !strncmp(p, "all", 3)) { mask = GL_SIM_CHECK_MEM | GL_SIM_CHECK_INIT | GL_SIM_CHECK_RACE | GL_SIM_CHECK_SYNC; found = true; }
      else if (n == 4 && !strncmp(p, "none", 4)) found = true;
      for (const auto &k : classes)
        if (strlen(k.name) == n && !strncmp(p, k.name, n)) { mask |= k.bit; found = true; }
      ok = found;
      p = e ? e + 1 : p + n;
    }
    if (ok) c.checks = mask;
    else
      fprintf(stderr,
              "gptlua cuda-sim: GL_SIM_CHECKS expected a comma list of memcheck, initcheck, racecheck, synccheck, "
              "all or none, got '%s'; using all\n",
              checks);
  }
  const char *streams = getenv("GL_SIM_STREAMS");
  if (streams && *streams) {
    if (!strcmp(streams, "threads")) c.threaded = 1;
    else if (strcmp(streams, "sync") != 0)
      fprintf(stderr, "gptlua cuda-sim: GL_SIM_STREAMS expected 'sync' or 'threads', got '%s'; using 'sync'\n",
              streams);
  }
  config = c;
  Runtime *R = new Runtime();  /* never destroyed: stream threads may outlive static destructors */
  for (int d = 0; d < MAX_DEVICES; d++) R->in_use[d].store(0);
  rt_state = R;
  {
    std::lock_guard<std::mutex> g(R->mu);
    for (int d = 0; d < c.devices; d++) R->legacy[d] = new_stream_locked(*R, d, cudaStreamDefault, true);
  }
  if (c.hostcheck) install_handler();
}

int gl_sim_racecheck(void) { rt(); return config.racecheck; }
uint64_t gl_sim_seed(void) { rt(); return config.seed; }
int gl_sim_streams_threaded(void) { rt(); return config.threaded; }
unsigned gl_sim_checks(void) { rt(); return config.checks; }
int gl_sim_smem_optin(void) { rt(); return config.smem_optin; }

/* ---- devices ------------------------------------------------------------------- */
namespace gl_sim_rt {
cudaError_t check_device(const char *fn, int d) {
  rt();
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "%s: no simulated device (GL_SIM_DEVICES=0)", fn);
  if (d < 0 || d >= config.devices)
    return api_error(cudaErrorInvalidDevice, "%s: device %d requested but %d simulated device(s) exist (GL_SIM_DEVICES)",
                     fn, d, config.devices);
  return cudaSuccess;
}
}  // namespace gl_sim_rt

extern "C" cudaError_t cudaGetDeviceCount(int *count) {
  rt();
  if (!count) return api_error(cudaErrorInvalidValue, "cudaGetDeviceCount: count is NULL");
  *count = config.devices;
  return cudaSuccess;
}

extern "C" cudaError_t cudaSetDevice(int device) {
  cudaError_t e = check_device("cudaSetDevice", device);
  if (e != cudaSuccess) return e;
  tls_device = device;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetDevice(int *device) {
  rt();
  if (!device) return api_error(cudaErrorInvalidValue, "cudaGetDevice: device is NULL");
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaGetDevice: no simulated device (GL_SIM_DEVICES=0)");
  *device = tls_device;
  return cudaSuccess;
}

/* H100 SXM figures for what sim_types.h does not fix */
enum { SIM_CLOCK_KHZ = 1980000, SIM_MEM_CLOCK_KHZ = 2619000, SIM_BUS_WIDTH = 5120, SIM_L2_BYTES = 50 << 20,
       SIM_REGS_PER_BLOCK = 65536, SIM_SMEM_PER_SM = 228 * 1024 };

extern "C" cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  if (!prop) return api_error(cudaErrorInvalidValue, "cudaGetDeviceProperties: prop is NULL");
  cudaError_t e = check_device("cudaGetDeviceProperties", device);
  if (e != cudaSuccess) return e;
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "gptlua cuda-sim (H100 limits)");
  prop->totalGlobalMem = config.memory_bytes;
  prop->sharedMemPerBlock = GL_SIM_SMEM_DEFAULT;
  prop->regsPerBlock = SIM_REGS_PER_BLOCK;
  prop->warpSize = GL_SIM_WARP;
  prop->maxThreadsPerBlock = GL_SIM_MAX_THREADS_PER_BLOCK;
  prop->maxThreadsDim[0] = GL_SIM_MAX_THREADS_PER_BLOCK;
  prop->maxThreadsDim[1] = GL_SIM_MAX_THREADS_PER_BLOCK;
  prop->maxThreadsDim[2] = GL_SIM_MAX_BLOCK_Z;
  prop->maxGridSize[0] = (int)GL_SIM_MAX_GRID_X;
  prop->maxGridSize[1] = GL_SIM_MAX_GRID_Y;
  prop->maxGridSize[2] = GL_SIM_MAX_GRID_Z;
  prop->major = config.arch / 10;
  prop->minor = config.arch % 10;
  prop->multiProcessorCount = config.sms;
  prop->memoryBusWidth = SIM_BUS_WIDTH;
  prop->l2CacheSize = SIM_L2_BYTES;
  prop->sharedMemPerBlockOptin = (size_t)config.smem_optin;
  prop->sharedMemPerMultiprocessor = SIM_SMEM_PER_SM;
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
  if (!value) return api_error(cudaErrorInvalidValue, "cudaDeviceGetAttribute: value is NULL");
  cudaError_t e = check_device("cudaDeviceGetAttribute", device);
  if (e != cudaSuccess) return e;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = GL_SIM_MAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxBlockDimX: *value = GL_SIM_MAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxBlockDimY: *value = GL_SIM_MAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxBlockDimZ: *value = GL_SIM_MAX_BLOCK_Z; break;
    case cudaDevAttrMaxGridDimX: *value = (int)GL_SIM_MAX_GRID_X; break;
    case cudaDevAttrMaxGridDimY: *value = GL_SIM_MAX_GRID_Y; break;
    case cudaDevAttrMaxGridDimZ: *value = GL_SIM_MAX_GRID_Z; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = GL_SIM_SMEM_DEFAULT; break;
    case cudaDevAttrWarpSize: *value = GL_SIM_WARP; break;
    case cudaDevAttrClockRate: *value = SIM_CLOCK_KHZ; break;
    case cudaDevAttrMultiProcessorCount: *value = config.sms; break;
    case cudaDevAttrMemoryClockRate: *value = SIM_MEM_CLOCK_KHZ; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = SIM_BUS_WIDTH; break;
    case cudaDevAttrL2CacheSize: *value = SIM_L2_BYTES; break;
    case cudaDevAttrComputeCapabilityMajor: *value = config.arch / 10; break;
    case cudaDevAttrComputeCapabilityMinor: *value = config.arch % 10; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = config.smem_optin; break;
    default:
      return api_error(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d is not simulated", (int)attr);
  }
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceSynchronize(void) {
  rt();
  RETURN_IF_STICKY();
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaDeviceSynchronize: no simulated device");
  cudaError_t e = capture_unsafe_call("cudaDeviceSynchronize", true);
  if (e != cudaSuccess) return e;
  host_wait_device("cudaDeviceSynchronize", tls_device);
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  rt();
  RETURN_IF_STICKY();
  if (!free_bytes || !total_bytes) return api_error(cudaErrorInvalidValue, "cudaMemGetInfo: NULL argument");
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaMemGetInfo: no simulated device");
  size_t used = rt_state->in_use[tls_device].load();
  *total_bytes = config.memory_bytes;
  *free_bytes = used < config.memory_bytes ? config.memory_bytes - used : 0;
  return cudaSuccess;
}

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!func) return api_error(cudaErrorInvalidValue, "cudaFuncSetAttribute: func is NULL");
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > config.smem_optin)
      return api_error(cudaErrorInvalidValue,
                       "cudaFuncSetAttribute: cudaFuncAttributeMaxDynamicSharedMemorySize %d, expected 0..%d "
                       "(sm_%d's opt-in limit)",
                       value, config.smem_optin, config.arch);
    std::lock_guard<std::mutex> g(R.func_mu);
    R.func_smem[func] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {
    if (value < -1 || value > 100)
      return api_error(cudaErrorInvalidValue,
                       "cudaFuncSetAttribute: cudaFuncAttributePreferredSharedMemoryCarveout %d, expected -1..100",
                       value);
    return cudaSuccess;  /* a hint; nothing to simulate */
  }
  return api_error(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d is not simulated", (int)attr);
}

/* sim.h: what cudaFuncSetAttribute recorded for fn */
int gl_sim_func_smem_optin(const void *fn) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.func_mu);
  auto it = R.func_smem.find(fn);
  return it == R.func_smem.end() ? 0 : it->second;
}
