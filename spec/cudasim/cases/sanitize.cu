/* sanitize.cu — planted bugs for each class the simulator's sanitizer
 * reports (spec/cudasim/sanitize.cpp, exec_block.cpp), each beside a correct
 * twin of the same shape.  Built apart from the other cases, once per
 * optimisation level (build/sim/libgptlua_sanitize_O0.so, _O2, _O3), so
 * that the twins are shown silent whatever the compiler does to them
 * (duplicated barrier calls, merged or reordered accesses); driven by
 * spec/sim_sanitize_spec.lua through spec/sim/run.lua in processes of their
 * own (the errors are sticky).
 *
 *   gl_simtest_san_run(name, planted)  runs case `name`, its planted bug
 *                                      (1) or its correct twin (0); returns
 *                                      the error the next synchronize
 *                                      reports (0: none) or -1 for an
 *                                      unknown name
 *   gl_simtest_san_names()             the case names, space-separated */
#include "common.cuh"
#include "simtest_dev.h"

SIMTEST_MESSAGE(san)

namespace {
enum { N = 1000 }; /* floats: 4000 bytes, not a multiple of 256, so the allocation has slack after it */

/* ---- memcheck ------------------------------------------------------------------ */
/* a store one past the end whose value is the allocation's fill pattern
   (0xFFFFFFFF): the bytes after the kernel look untouched */
__global__ void oob_store_poison(unsigned *p, int n, int planted) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  int limit = planted ? n + 1 : n;
  if (i < limit) p[i] = 0xFFFFFFFFu;
}
/* a read one past the end */
__global__ void oob_read(const float *in, float *out, int n, int planted) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float next = planted ? in[i + 1] : 0.0f; /* in[n] for the last thread */
  out[i] = in[i] + next * 0.0f;
}
/* a 4-byte read at an address 2 bytes into a float */
__global__ void misaligned_global(const float *in, float *out, int planted) {
  int i = threadIdx.x;
  const char *base = (const char *)in + (planted ? 2 : 0);
  out[i] = *(const float *)(base + 4 * i);
}
/* pointer arithmetic one past a GL_SHARED array (no index for -fsanitize=bounds to see) */
__global__ void shared_oob(float *out, int planted) {
  GL_SHARED(float, s, [128]);
  int t = threadIdx.x;
  float *p = s + (planted ? 1 : 0);
  p[t] = (float)t;
  __syncthreads();
  out[t] = s[t > 0 ? t - 1 : 0] * 0.0f + 1.0f;
}
/* a 4-byte shared store at an odd address */
__global__ void misaligned_shared(float *out, int planted) {
  GL_SHARED(float, s, [64]);
  int t = threadIdx.x;
  char *base = (char *)s + (planted && t == 5 ? 1 : 0);
  *(float *)(base + 4 * t) = 1.0f;
  __syncthreads();
  out[t] = s[t];
}
/* the dynamic buffer read one float past its end, still on the buffer's page */
__global__ void dynamic_oob(float *out, int planted) {
  GL_DYNAMIC_SHARED(float, d, 16);
  int t = threadIdx.x;
  d[t] = 1.0f;
  __syncthreads();
  int j = planted && t == 0 ? -1 : t;
  out[t] = d[j];
}

/* ---- initcheck ------------------------------------------------------------------ */
/* half the block writes its slot, every thread reads its own */
__global__ void uninit_shared(float *out, int planted) {
  GL_SHARED(float, s, [128]);
  int t = threadIdx.x;
  if (!planted || t < 64) s[t] = (float)t;
  __syncthreads();
  out[t] = s[t];
}
/* a freshly allocated buffer read before anything wrote it (the twin sets it first) */
__global__ void uninit_global(const float *in, float *out) {
  int i = threadIdx.x;
  out[i] = in[i] + 1.0f;
}

/* ---- racecheck ------------------------------------------------------------------ */
/* a tree reduction missing the barrier inside its loop */
__global__ void reduce_no_barrier(const float *in, float *out, int planted) {
  GL_SHARED(float, s, [256]);
  int t = threadIdx.x;
  s[t] = in[t];
  __syncthreads();
  for (int half = 128; half > 0; half >>= 1) {
    if (t < half) s[t] += s[t + half];
    if (!planted) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}
/* each thread reads its neighbour's slot, then overwrites its own, with no
   barrier between the read and the neighbour's write (write-after-read) */
__global__ void shift_no_barrier(float *out, int planted) {
  GL_SHARED(float, s, [128]);
  int t = threadIdx.x;
  s[t] = (float)t;
  __syncthreads();
  float v = s[(t + 1) % 128];
  if (!planted) __syncthreads();
  s[t] = v;
  __syncthreads();
  out[t] = s[t];
}
/* lanes of one warp exchange through shared memory: with __syncwarp (the
   twin) or without it */
__global__ void warp_exchange(float *out, int planted) {
  GL_SHARED(float, s, [32]);
  int t = threadIdx.x;
  s[t] = 0.0f;
  __syncthreads();
  s[t] = (float)t;
  if (!planted) __syncwarp();
  out[t] = s[t ^ 1];
}

/* ---- synccheck ------------------------------------------------------------------ */
/* threads past the end return before a barrier the others wait at */
__global__ void early_return_barrier(const float *in, float *out, int n, int planted) {
  GL_SHARED(float, s, [256]);
  int t = threadIdx.x;
  if (planted && t >= n) return;
  s[t] = t < n ? in[t] : 0.0f;
  __syncthreads();
  if (t < n) out[t] = s[(t + 1) % n];
}
/* correct only (no planted twin): a conditional store before one barrier.
   g++ -O2 may duplicate the call, one copy per path, and both are the same
   barrier (the false alarm of barriers told apart by return address) */
__global__ void cond_store_barrier(float *out, int unused) {
  GL_SHARED(float, s, [256]);
  int t = threadIdx.x;
  if (t < 128) s[t] = (float)t * 2.0f;
  __syncthreads();
  if (t < 128) out[t] = s[127 - t] + (float)unused * 0.0f;
}
/* a __syncwarp whose mask leaves out half of the lanes that call it */
__global__ void syncwarp_bad_mask(float *out, int planted) {
  int t = threadIdx.x;
  __syncwarp(planted ? 0x0000ffffu : 0xffffffffu);
  out[t] = 1.0f;
}
/* correct only: atomics on shared memory from every thread are no race */
__global__ void shared_atomics(float *out, int planted) {
  GL_SHARED(unsigned, count, [1]);
  int t = threadIdx.x;
  if (t == 0) count[0] = 0;
  __syncthreads();
  atomicAdd(&count[0], 1u);
  __syncthreads();
  if (t == 0) out[0] = (float)count[0] + (float)planted * 0.0f;
}

struct Case {
  const char *name;
  int (*run)(int planted);
};

#define SYNC_RESULT()                                                 \
  do {                                                                \
    cudaError_t launch = cudaGetLastError(), sync = cudaDeviceSynchronize(); \
    return launch != cudaSuccess ? (int)launch : (int)sync;           \
  } while (0)

int run_oob_store_poison(int planted) {
  ALLOC(p, unsigned, N);
  TRY(cudaMemset(p.p, 0, N * sizeof(unsigned)));
  GL_LAUNCH(4, 256, 0, 0, oob_store_poison)(p.p, (int)N, planted);
  SYNC_RESULT();
}
int run_oob_read(int planted) {
  ALLOC(in, float, N);
  ALLOC(out, float, N);
  TRY(cudaMemset(in.p, 0, N * sizeof(float)));
  GL_LAUNCH(4, 256, 0, 0, oob_read)(in.p, out.p, (int)N, planted);
  SYNC_RESULT();
}
int run_misaligned_global(int planted) {
  ALLOC(in, float, 129);
  ALLOC(out, float, 128);
  TRY(cudaMemset(in.p, 0, 129 * sizeof(float)));
  GL_LAUNCH(1, 128, 0, 0, misaligned_global)(in.p, out.p, planted);
  SYNC_RESULT();
}
int run_shared_oob(int planted) {
  ALLOC(out, float, 128);
  GL_LAUNCH(2, 128, 0, 0, shared_oob)(out.p, planted);
  SYNC_RESULT();
}
int run_misaligned_shared(int planted) {
  ALLOC(out, float, 64);
  GL_LAUNCH(1, 63, 0, 0, misaligned_shared)(out.p, planted);
  SYNC_RESULT();
}
int run_dynamic_oob(int planted) {
  ALLOC(out, float, 64);
  GL_LAUNCH(1, 64, 64 * sizeof(float), 0, dynamic_oob)(out.p, planted);
  SYNC_RESULT();
}
int run_uninit_shared(int planted) {
  ALLOC(out, float, 128);
  GL_LAUNCH(1, 128, 0, 0, uninit_shared)(out.p, planted);
  SYNC_RESULT();
}
int run_uninit_global(int planted) {
  ALLOC(in, float, 128);
  ALLOC(out, float, 128);
  if (!planted) TRY(cudaMemset(in.p, 0, 128 * sizeof(float)));
  GL_LAUNCH(1, 128, 0, 0, uninit_global)(in.p, out.p);
  SYNC_RESULT();
}
int run_reduce_no_barrier(int planted) {
  ALLOC(in, float, 256);
  ALLOC(out, float, 1);
  std::vector<float> h(256, 1.0f);
  TRY(in.put(h));
  GL_LAUNCH(1, 256, 0, 0, reduce_no_barrier)(in.p, out.p, planted);
  SYNC_RESULT();
}
int run_shift_no_barrier(int planted) {
  ALLOC(out, float, 128);
  GL_LAUNCH(1, 128, 0, 0, shift_no_barrier)(out.p, planted);
  SYNC_RESULT();
}
int run_warp_exchange(int planted) {
  ALLOC(out, float, 32);
  GL_LAUNCH(1, 32, 0, 0, warp_exchange)(out.p, planted);
  SYNC_RESULT();
}
int run_early_return_barrier(int planted) {
  ALLOC(in, float, 256);
  ALLOC(out, float, 256);
  TRY(cudaMemset(in.p, 0, 256 * sizeof(float)));
  GL_LAUNCH(1, 256, 0, 0, early_return_barrier)(in.p, out.p, 200, planted);
  SYNC_RESULT();
}
int run_cond_store_barrier(int planted) {
  ALLOC(out, float, 128);
  GL_LAUNCH(1, 256, 0, 0, cond_store_barrier)(out.p, planted);
  SYNC_RESULT();
}
int run_syncwarp_bad_mask(int planted) {
  ALLOC(out, float, 32);
  GL_LAUNCH(1, 32, 0, 0, syncwarp_bad_mask)(out.p, planted);
  SYNC_RESULT();
}
int run_shared_atomics(int planted) {
  ALLOC(out, float, 1);
  GL_LAUNCH(2, 256, 0, 0, shared_atomics)(out.p, planted);
  SYNC_RESULT();
}

const Case CASES[] = {
    {"oob_store_poison", run_oob_store_poison},   {"oob_read", run_oob_read},
    {"misaligned_global", run_misaligned_global}, {"shared_oob", run_shared_oob},
    {"misaligned_shared", run_misaligned_shared}, {"dynamic_oob", run_dynamic_oob},
    {"uninit_shared", run_uninit_shared},         {"uninit_global", run_uninit_global},
    {"reduce_no_barrier", run_reduce_no_barrier}, {"shift_no_barrier", run_shift_no_barrier},
    {"warp_exchange", run_warp_exchange},         {"early_return_barrier", run_early_return_barrier},
    {"cond_store_barrier", run_cond_store_barrier}, {"syncwarp_bad_mask", run_syncwarp_bad_mask},
    {"shared_atomics", run_shared_atomics},
};
}  // namespace

extern "C" int gl_simtest_san_run(const char *name, int planted) {
  begin();
  for (const Case &c : CASES)
    if (!strcmp(c.name, name)) return c.run(planted);
  note("no sanitizer case named '%s'", name);
  return -1;
}

extern "C" const char *gl_simtest_san_names(void) {
  static std::string names;
  if (names.empty())
    for (const Case &c : CASES) names += (names.empty() ? "" : " ") + std::string(c.name);
  return names.c_str();
}
