/* exec_faults.cu — the simulator's execution core refusing what CUDA
 * refuses and catching what it cannot run correctly (spec/cudasim/exec.cpp,
 * device.h), built into build/sim/libgptlua_simtest.so with the other
 * test_*.cu and driven by spec/sim_exec_spec.lua through LuaJIT's ffi.
 * The correct kernels and the speed check are in cases/exec.cu.
 *
 *   gl_simtest_fault_launch_config  the error a launch configuration gets
 *   gl_simtest_fault_planted(name)  runs a deliberately buggy kernel (a missing
 *                                   barrier, a bad shuffle mask, ...) and returns
 *                                   the error the next synchronize reports; these
 *                                   errors are sticky, so the spec runs them in a
 *                                   subprocess
 *   gl_simtest_fault_race_natural   the missing barrier without the race mode
 * gl_simtest_fault_message() describes the last check's problem. */
#include "common.cuh"
#include "simtest_dev.h"

SIMTEST_MESSAGE(fault)

/* ---- launch configurations ------------------------------------------------ */
namespace {
__global__ void k_noop(int *p) {
  if (p) p[threadIdx.x] = 1;
}
__global__ void k_noop_optin(int *p) {
  GL_DYNAMIC_SHARED(unsigned char, smem, 16);
  if (p) p[0] = smem[0];
}

/* The error cudaGetLastError reports after launching with this
   configuration (0: it ran); optin > 0 first raises the kernel's limit. */
}  // namespace

extern "C" int gl_simtest_fault_launch_config(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                        long smem, int optin) {
  begin();
  if (optin > 0) TRY(cudaFuncSetAttribute(k_noop_optin, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  if (optin > 0) GL_LAUNCH(dim3(gx, gy, gz), dim3(bx, by, bz), (size_t)smem, 0, k_noop_optin)(nullptr);
  else GL_LAUNCH(dim3(gx, gy, gz), dim3(bx, by, bz), (size_t)smem, 0, k_noop)(nullptr);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) note("%s", cudaGetErrorString(e));
  TRY(cudaDeviceSynchronize());
  return (int)e;
}

/* ---- planted bugs ----------------------------------------------------------- */
namespace {
/* each returns the error the next synchronize reports */
__global__ void p_race(float *out) { /* reads a neighbour's slot without a barrier */
  GL_SHARED(float, s, [128]);
  int t = threadIdx.x;
  s[t] = (float)t;
  out[blockIdx.x * blockDim.x + t] = s[(t + 1) % blockDim.x];
}
__global__ void p_race_random_only(float *out) { /* writes only where a neighbour ran first: never in order */
  GL_SHARED(float, s, [128]);
  int t = threadIdx.x;
  s[t] = (float)t;
  if (t + 1 < (int)blockDim.x && s[t + 1] == s[t + 1]) out[blockIdx.x * blockDim.x + t] = 1.0f;
}
__global__ void p_shuffle_mask(int *out) { /* the halves disagree on the mask */
  int lane = threadIdx.x & 31;
  unsigned mask = lane < 16 ? 0xffffffffu : 0xffff0000u;
  out[threadIdx.x] = __shfl_xor_sync(mask, lane, 1);
}
__global__ void p_divergence(int *out) { /* two barriers for one block */
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}
__global__ void p_deadlock(int *out) { /* thread 0 waits for lane 1, lane 1 for thread 0 */
  if (threadIdx.x == 0) __syncwarp(0x3u);
  __syncthreads();
  if (threadIdx.x == 1) __syncwarp(0x3u);
  out[threadIdx.x] = 1;
}
__global__ void p_exited_lane(int *out) { /* half the warp returned before the shuffle */
  int lane = threadIdx.x & 31;
  if (lane >= 16) return;
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, lane, 1);
}
__global__ void p_missing_lane(int *out) { /* 48 threads: warp 1 has no lanes 16..31 */
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ void p_lane_not_in_mask(int *out) {
  out[threadIdx.x] = __shfl_sync(0xfffffffeu, (int)threadIdx.x, 1);
}
__global__ void p_bad_width(int *out) { out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 1, 3); }
__global__ void p_static_oob(float *out) { /* 33 threads into a [32] array */
  GL_SHARED(float, partial, [32]);
  partial[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = partial[threadIdx.x & 31];
}
__global__ void p_dynamic_oob(float *out) { /* 1024 bytes = 256 floats; thread 0 writes float 256 */
  GL_DYNAMIC_SHARED(float, buf, 16);
  buf[threadIdx.x + 1] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x];
}
__global__ void p_static_over_limit(char *out) { /* 40000 static + 10000 dynamic > 48 KiB */
  GL_SHARED(char, big, [40000]);
  big[threadIdx.x] = 1;
  out[threadIdx.x] = big[threadIdx.x];
}

}  // namespace

extern "C" int gl_simtest_fault_planted(const char *name) {
  begin();
  ALLOC(out, float, 1024);
  std::string n = name;
  if (n == "race") GL_LAUNCH(2, 128, 0, 0, p_race)(out.p);
  else if (n == "race_random_only") GL_LAUNCH(2, 128, 0, 0, p_race_random_only)(out.p);
  else if (n == "shuffle_mask") GL_LAUNCH(1, 32, 0, 0, p_shuffle_mask)((int *)out.p);
  else if (n == "divergence") GL_LAUNCH(1, 64, 0, 0, p_divergence)((int *)out.p);
  else if (n == "deadlock") GL_LAUNCH(1, 64, 0, 0, p_deadlock)((int *)out.p);
  else if (n == "exited_lane") GL_LAUNCH(1, 32, 0, 0, p_exited_lane)((int *)out.p);
  else if (n == "missing_lane") GL_LAUNCH(1, 48, 0, 0, p_missing_lane)((int *)out.p);
  else if (n == "lane_not_in_mask") GL_LAUNCH(1, 32, 0, 0, p_lane_not_in_mask)((int *)out.p);
  else if (n == "bad_width") GL_LAUNCH(1, 32, 0, 0, p_bad_width)((int *)out.p);
  else if (n == "static_oob") GL_LAUNCH(1, 33, 0, 0, p_static_oob)(out.p);
  else if (n == "dynamic_oob") GL_LAUNCH(1, 256, 1024, 0, p_dynamic_oob)(out.p);
  else if (n == "static_over_limit") GL_LAUNCH(1, 32, 10000, 0, p_static_over_limit)((char *)out.p);
  else {
    note("no planted bug named '%s'", name);
    return -1;
  }
  cudaError_t launch = cudaGetLastError(), sync = cudaDeviceSynchronize();
  /* the error is sticky: a correct launch afterwards reports it too */
  GL_LAUNCH(1, 32, 0, 0, k_noop)((int *)out.p);
  cudaError_t after = cudaDeviceSynchronize();
  note("launch %d sync %d after %d", (int)launch, (int)sync, (int)after);
  return launch != cudaSuccess ? (int)launch : (int)sync;
}

/* the race kernel without the race mode: the natural order makes thread t
   read slot t+1 before thread t+1 wrote it, so poison (NaN) reaches the
   output; returns the number of NaN outputs */
extern "C" int gl_simtest_fault_race_natural(void) {
  begin();
  ALLOC(out, float, 256);
  GL_LAUNCH(2, 128, 0, 0, p_race)(out.p);
  TRY_LAUNCH();
  std::vector<float> h;
  TRY(out.get(h));
  int nan = 0;
  for (float v : h) nan += v != v;
  return nan;
}
