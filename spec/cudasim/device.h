/* device.h — the device side of the CUDA simulator: what the kernel sources
 * (kernels/NAME.cu) need so that the host C++ compiler accepts them and they run on CPU fibers.
 *
 * Included by spec/cudasim/cuda_runtime.h after sim_types.h and sim.h (C++
 * only).  Provides the CUDA keywords, the built-in variables (threadIdx,
 * blockIdx, blockDim, gridDim, warpSize), barriers, warp shuffles and votes,
 * bit intrinsics, atomics, fences, fast math, and the machinery behind
 * GL_LAUNCH / GL_SHARED / GL_DYNAMIC_SHARED (kernels/common.cuh).  The
 * out-of-line parts live in spec/cudasim/exec.cpp.
 *
 * `__shared__` is deliberately NOT defined: kernels declare shared memory
 * with GL_SHARED so the simulator can poison it at every block start, and a
 * stray `__shared__` fails to compile here instead of silently becoming a
 * per-thread variable.
 *
 * Barriers and warp collectives take the caller's file and line as hidden
 * default arguments (__builtin_FILE / __builtin_LINE, evaluated at the call
 * site) so errors can say where each thread waits. */
#ifndef GL_SIM_DEVICE_H
#define GL_SIM_DEVICE_H
#ifndef __cplusplus
#error "spec/cudasim/device.h is C++ only"
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <functional>
#include <memory> /* before __noinline__ below: libstdc++ spells __attribute__((__noinline__)) */
#include <tuple>
#include <type_traits>
#include <utility>
#include "sim_types.h"
#include "sim.h"

/* ---- keywords ------------------------------------------------------------ */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
/* __restrict__ is a GNU keyword already. */

/* ---- built-in variables ------------------------------------------------- */
/* What device code can read about the simulated thread that is running and
   its block.  The scheduler points gl_sim_self at the running thread's
   record at every fiber switch and gl_sim_block at the block's at every
   block start.  Plain globals, not thread-locals: one kernel runs at a time
   in the process (exec.cpp serializes them), and libgptlua.so's thread-local
   block is too large for the initial-exec model a dlopen'd library would
   need to make a thread-local read cheap. */
struct gl_sim_thread_ctx {
  uint3 thread_idx;
};
struct gl_sim_block_ctx {
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
extern const gl_sim_thread_ctx *gl_sim_self;
extern const gl_sim_block_ctx *gl_sim_block;
/* Kernels read them through calls into exec_block.cpp, which is not
   compiled with the sanitizer's instrumentation: read in place, every
   threadIdx.x would be two instrumented loads (the pointer and the field),
   reloaded after every other access's hook.  Constant for the whole of a
   kernel invocation (one simulated thread), hence attribute const: the
   compiler reads each once per function. */
uint3 gl_sim_thread_idx(void) __attribute__((const));
uint3 gl_sim_block_idx(void) __attribute__((const));
dim3 gl_sim_block_dim(void) __attribute__((const));
dim3 gl_sim_grid_dim(void) __attribute__((const));
#define threadIdx (gl_sim_thread_idx())
#define blockIdx (gl_sim_block_idx())
#define blockDim (gl_sim_block_dim())
#define gridDim (gl_sim_grid_dim())
static constexpr int warpSize = 32;

/* ---- barriers ------------------------------------------------------------ */
/* Out of line (exec_block.cpp).  A barrier is identified by its call's file
   and line, so threads of a block waiting at different __syncthreads are
   reported as barrier divergence, while a call the compiler duplicated is
   still one barrier. */
void __syncthreads(const char *file = __builtin_FILE(), int line = __builtin_LINE());
int __syncthreads_count(int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE());
int __syncthreads_and(int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE());
int __syncthreads_or(int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE());

/* ---- warp collectives ---------------------------------------------------- */
/* Every lane named in mask must call the same collective with the same mask;
   the simulator stops the kernel otherwise (see exec.cpp). */
void __syncwarp(unsigned mask = 0xffffffffu, const char *file = __builtin_FILE(), int line = __builtin_LINE());
unsigned __ballot_sync(unsigned mask, int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE());
int __any_sync(unsigned mask, int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE());
int __all_sync(unsigned mask, int pred, const char *file = __builtin_FILE(), int line = __builtin_LINE());
/* The lanes of the caller's warp that exist and have not exited (the
   simulator does not model divergence within a warp). */
unsigned __activemask(void);

/* Shuffles: `bits` is the caller's value (up to 8 bytes), `b` the source
   lane / delta / lane mask, width a power of two <= 32.  Returns the source
   lane's bits as the hardware picks it (PTX shfl.sync rules); a source
   outside the caller's segment, or a lane not in mask, gives the caller's
   own value. */
enum { GL_SIM_SHFL_IDX, GL_SIM_SHFL_UP, GL_SIM_SHFL_DOWN, GL_SIM_SHFL_XOR };
uint64_t gl_sim_shfl(int mode, unsigned mask, uint64_t bits, int b, int width, const char *file, int line);

template <class T> static inline T gl_sim_shfl_typed(int mode, unsigned mask, T var, int b, int width,
                                                     const char *file, int line) {
  uint64_t bits = 0;
  memcpy(&bits, &var, sizeof(T));
  bits = gl_sim_shfl(mode, mask, bits, b, width, file, line);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}
/* the overloads CUDA declares (a 2-byte float type gets its own in cuda_bf16.h) */
#define GL_SIM_SHFL_OVERLOADS(T)                                                                          \
  static inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,                        \
                              const char *file = __builtin_FILE(), int line = __builtin_LINE()) {        \
    return gl_sim_shfl_typed<T>(GL_SIM_SHFL_IDX, mask, var, src_lane, width, file, line);                 \
  }                                                                                                       \
  static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,                   \
                                 const char *file = __builtin_FILE(), int line = __builtin_LINE()) {     \
    return gl_sim_shfl_typed<T>(GL_SIM_SHFL_UP, mask, var, (int)delta, width, file, line);                \
  }                                                                                                       \
  static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,                 \
                                   const char *file = __builtin_FILE(), int line = __builtin_LINE()) {   \
    return gl_sim_shfl_typed<T>(GL_SIM_SHFL_DOWN, mask, var, (int)delta, width, file, line);              \
  }                                                                                                       \
  static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,                   \
                                  const char *file = __builtin_FILE(), int line = __builtin_LINE()) {    \
    return gl_sim_shfl_typed<T>(GL_SIM_SHFL_XOR, mask, var, lane_mask, width, file, line);                \
  }
GL_SIM_SHFL_OVERLOADS(int)
GL_SIM_SHFL_OVERLOADS(unsigned int)
GL_SIM_SHFL_OVERLOADS(long)
GL_SIM_SHFL_OVERLOADS(unsigned long)
GL_SIM_SHFL_OVERLOADS(long long)
GL_SIM_SHFL_OVERLOADS(unsigned long long)
GL_SIM_SHFL_OVERLOADS(float)
GL_SIM_SHFL_OVERLOADS(double)
#undef GL_SIM_SHFL_OVERLOADS

/* ---- bit intrinsics ------------------------------------------------------ */
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}

/* ---- atomics ------------------------------------------------------------- */
/* Simulated threads are fibers switched only at barriers and collectives,
   and kernels run one at a time, so a plain read-modify-write is atomic.
   gl_sim_in_atomic tells the sanitizer (sanitize.cpp) that the access is
   an atomic's: bounds and initcheck apply, racecheck does not. */
extern int gl_sim_in_atomic;
#define GL_SIM_ATOMIC(NAME, T, EXPR)                        \
  static inline T NAME(T *address, T val) {                 \
    gl_sim_in_atomic = 1;                                   \
    T old = *address;                                       \
    *address = (EXPR);                                      \
    gl_sim_in_atomic = 0;                                   \
    return old;                                             \
  }
GL_SIM_ATOMIC(atomicAdd, int, old + val)
GL_SIM_ATOMIC(atomicAdd, unsigned int, old + val)
GL_SIM_ATOMIC(atomicAdd, unsigned long long, old + val)
GL_SIM_ATOMIC(atomicAdd, float, old + val)
GL_SIM_ATOMIC(atomicAdd, double, old + val)
GL_SIM_ATOMIC(atomicSub, int, old - val)
GL_SIM_ATOMIC(atomicSub, unsigned int, old - val)
GL_SIM_ATOMIC(atomicMin, int, val < old ? val : old)
GL_SIM_ATOMIC(atomicMin, unsigned int, val < old ? val : old)
GL_SIM_ATOMIC(atomicMin, long long, val < old ? val : old)
GL_SIM_ATOMIC(atomicMin, unsigned long long, val < old ? val : old)
GL_SIM_ATOMIC(atomicMax, int, val > old ? val : old)
GL_SIM_ATOMIC(atomicMax, unsigned int, val > old ? val : old)
GL_SIM_ATOMIC(atomicMax, long long, val > old ? val : old)
GL_SIM_ATOMIC(atomicMax, unsigned long long, val > old ? val : old)
GL_SIM_ATOMIC(atomicExch, int, val)
GL_SIM_ATOMIC(atomicExch, unsigned int, val)
GL_SIM_ATOMIC(atomicExch, unsigned long long, val)
GL_SIM_ATOMIC(atomicExch, float, val)
GL_SIM_ATOMIC(atomicAnd, int, old & val)
GL_SIM_ATOMIC(atomicAnd, unsigned int, old & val)
GL_SIM_ATOMIC(atomicAnd, unsigned long long, old & val)
GL_SIM_ATOMIC(atomicOr, int, old | val)
GL_SIM_ATOMIC(atomicOr, unsigned int, old | val)
GL_SIM_ATOMIC(atomicOr, unsigned long long, old | val)
GL_SIM_ATOMIC(atomicXor, int, old ^ val)
GL_SIM_ATOMIC(atomicXor, unsigned int, old ^ val)
GL_SIM_ATOMIC(atomicXor, unsigned long long, old ^ val)
#undef GL_SIM_ATOMIC
#define GL_SIM_ATOMIC_CAS(T)                                          \
  static inline T atomicCAS(T *address, T compare, T val) {           \
    gl_sim_in_atomic = 1;                                             \
    T old = *address;                                                 \
    if (old == compare) *address = val;                               \
    gl_sim_in_atomic = 0;                                             \
    return old;                                                       \
  }
GL_SIM_ATOMIC_CAS(int)
GL_SIM_ATOMIC_CAS(unsigned int)
GL_SIM_ATOMIC_CAS(unsigned long long)
#undef GL_SIM_ATOMIC_CAS

/* ---- fences -------------------------------------------------------------- */
/* One kernel runs at a time on one host thread: ordering the compiler's
   accesses is all a fence has to do. */
static inline void __threadfence(void) { __asm__ __volatile__("" ::: "memory"); }
static inline void __threadfence_block(void) { __asm__ __volatile__("" ::: "memory"); }

/* ---- fast math (the host's correctly rounded functions) ----------------- */
/* glibc's math.h already declares __expf, __logf, __sinf and __cosf
   (extern "C", noexcept) without libm exporting them: these inline
   definitions complete those declarations. */
inline float __expf(float x) noexcept { return expf(x); }
inline float __logf(float x) noexcept { return logf(x); }
inline float __sinf(float x) noexcept { return sinf(x); }
inline float __cosf(float x) noexcept { return cosf(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); } /* NaN -> 0 */
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
template <class T> static inline T __ldg(const T *p) { return *p; }

/* ---- shared memory (GL_SHARED / GL_DYNAMIC_SHARED in kernels/common.cuh) -- */
/* One per GL_SHARED declaration (a function-local static, so zero-filled
   without a constructor).  exec.cpp gives it a fixed offset in the
   process's static-shared arena the first time it is seen, and poisons its
   bytes (0xFF) the first time each block touches it. */
struct gl_sim_shared_slot {
  size_t offset;  /* in the arena; valid once bytes != 0 */
  size_t bytes;
  uint64_t block; /* the block generation that last poisoned it */
};
void *gl_sim_static_shared(gl_sim_shared_slot *slot, size_t bytes, size_t align);
/* This block's dynamic shared buffer (the launch's dynamic size, right-
   aligned at `align` against an inaccessible guard page, so a read or write
   past the end faults).  A launch with no dynamic memory gets a pointer to
   the guard page itself. */
void *gl_sim_dynamic_shared(size_t align);

/* ---- launches (GL_LAUNCH in kernels/common.cuh) -------------------------- */
/* exec.cpp's counters since the process started, for benchmarks:
   out[0] launches run, out[1] blocks, out[2] simulated threads,
   out[3] fiber switches */
void gl_sim_exec_stats(uint64_t out[4]);

/* an argument converted to the kernel's parameter type, implicitly, as a
   real launch converts it */
template <class T> static inline T gl_sim_param(T v) { return v; }

template <class... KArgs> struct gl_sim_launch_op {
  const char *name;
  void (*kernel)(KArgs...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <class... Args> void operator()(Args &&...args) const {
    static_assert(sizeof...(Args) == sizeof...(KArgs), "GL_LAUNCH: wrong number of kernel arguments");
    std::tuple<KArgs...> params(gl_sim_param<KArgs>(std::forward<Args>(args))...);
    void (*k)(KArgs...) = kernel;
    /* std::apply passes the closure's copy, and the kernel takes its
       parameters by value: every simulated thread gets its own copy */
    gl_sim_launch(name, reinterpret_cast<const void *>(k), grid, block, smem, stream,
                  [params, k]() { std::apply(k, params); });
  }
};
/* GL_LAUNCH(grid, block, smem, stream, kernel<T>)(args...) expands to
   gl_sim_launcher("kernel<T>", kernel<T>, grid, block, smem, stream)(args...);
   the name is the kernel expression's text (exec.cpp strips its spaces). */
template <class... KArgs>
static inline gl_sim_launch_op<KArgs...> gl_sim_launcher(const char *name, void (*kernel)(KArgs...), dim3 grid,
                                                         dim3 block, size_t smem, cudaStream_t stream) {
  return gl_sim_launch_op<KArgs...>{name, kernel, grid, block, smem, stream};
}

#endif
