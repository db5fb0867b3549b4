/* common.cuh — what every CUDA source in kernels/ shares: the one check macro,
 * per-device state (compute stream, SM count, deferred id checks), dtype accessors,
 * strided index maps, block reductions and scratch tensors.
 *
 * Conventions for the .cu files in kernels/
 *  - Every cuda_X entry point is extern "C", has exactly the signature listed
 *    in engine/backend.h and the semantics of its CPU twin (engine/cpu/NAME.c).
 *    Arguments were validated by engine/ops.c (shapes, dtypes, devices).
 *  - All work goes to the device's compute stream (cu_begin).  Temporaries
 *    come from the caching allocator (CuTemp) and are released right after
 *    the launches: the allocator hands blocks out again in stream order, and
 *    everything here runs on that one stream.
 *  - Every CUDA / cuBLAS call goes through GL_CU_CHECK; every launch is
 *    followed by GL_CU_LAUNCHED() (a cudaGetLastError check).
 *  - Storage types are read through accessors: TPtr<S> for a known storage
 *    type (the fast paths: float, bfloat16, double) and AnyPtr for anything
 *    else (mixed dtypes, integers), both converting to the compute type T
 *    (float, or double for float64 / 32- and 64-bit integer operands). */
#ifndef GL_KERNELS_COMMON_CUH
#define GL_KERNELS_COMMON_CUH

/* system headers first, so that the extern "C" block below only sees the
   engine's own declarations (glibc's math.h has C++ templates) */
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cublasLt.h>
#include <initializer_list>
#include <type_traits>
#include <algorithm>

extern "C" {
#include "backend.h"
}

/* ---- the forms both compilers accept ------------------------------------- */
/* kernels/NAME.cu build unchanged with nvcc for a GPU and with the host C++
   compiler for the CUDA simulator (spec/cudasim/, `make sim`), whose headers
   stand in for the toolkit's and define GL_SIM.  Three constructs differ
   between the two, so kernels write them only through these macros:
     GL_LAUNCH(grid, block, smem, stream, kernel<T>)(args...);   a launch
     GL_SHARED(T, name, [dims]);        a static __shared__ array
     GL_DYNAMIC_SHARED(T, name, align); the extern __shared__ buffer
   In the simulator a launch runs the grid on CPU fibers and shared memory
   lives in a per-block arena that is poisoned (0xFF) at every block start. */
#ifdef GL_SIM
#define GL_LAUNCH(grid, block, smem, stream, ...) \
  gl_sim_launcher(#__VA_ARGS__, __VA_ARGS__, grid, block, smem, stream)
#define GL_SHARED(T, name, dims)                                                  \
  static gl_sim_shared_slot gl_sim_slot_##name;                                 \
  T(&name) dims = *reinterpret_cast<T(*) dims>(                                  \
      gl_sim_static_shared(&gl_sim_slot_##name, sizeof(T dims), alignof(T)))
#define GL_DYNAMIC_SHARED(T, name, align) T *name = (T *)gl_sim_dynamic_shared(align)
#else
#define GL_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#define GL_SHARED(T, name, dims) __shared__ T name dims
#define GL_DYNAMIC_SHARED(T, name, align) extern __shared__ __align__(align) T name[]
#endif

/* ---- the check macro ---------------------------------------------------- */
static inline bool cu_ok(cudaError_t e) { return e == cudaSuccess; }
static inline bool cu_ok(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
static inline const char *cu_status_str(cudaError_t e) { return cudaGetErrorString(e); }
static inline const char *cu_status_str(cublasStatus_t s) { return cublasLtGetStatusString(s); }

/* Runs a CUDA runtime or cuBLAS(Lt) call; on failure records
   "<call>: <reason> at file:line" and returns GL_ERR from the caller.  The
   runtime's last-error slot is cleared so the next launch check sees only
   its own launch. */
#define GL_CU_CHECK(call)                                                         \
  do {                                                                            \
    auto gl_cu_st_ = (call);                                                      \
    if (!cu_ok(gl_cu_st_)) {                                                      \
      (void)cudaGetLastError();                                                   \
      return gl_error("%s: %s at %s:%d", #call, cu_status_str(gl_cu_st_),         \
                      __FILE__, __LINE__);                                        \
    }                                                                             \
  } while (0)
/* after every <<<...>>> launch */
#define GL_CU_LAUNCHED() GL_CU_CHECK(cudaGetLastError())

/* ---- per-device state (runtime.cu) ------------------------------------- */
enum { CU_MAX_DEVICES = 16 };
/* Makes dev current and returns its compute stream (created on first use). */
int cu_begin(int dev, cudaStream_t *stream);
/* number of SMs of dev (cached); 0 if unknown */
int cu_sm_count(int dev);
/* max dynamic shared memory per block (opt-in), bytes */
int cu_smem_optin(int dev);
/* Deferred id checks (runtime.cu): a check kernel writes its slot — two
   words, the first bad position (-1 when none) and the id there — and the
   host reads every queued slot where it waits for the device anyway
   (cu_report_checks: a copy to the host, gl_cuda_synchronize,
   gl_cuda_check_flags), turning the first bad one into the op's message.
   fn / arg / what must be string literals (they outlive the call).  A
   captured CUDA graph cannot empty a full table (that is a host wait), so
   the table holds a whole graphed step's checks: a MoE layer's forward and
   backward queue about twenty. */
enum { CU_CHECK_SLOTS = 1024 };
struct CuIdCheck {
  const char *fn, *arg, *what;
  int64_t limit, ignore;
  int has_ignore;
};
int cu_check_slot(int dev, const CuIdCheck *meta, long long **slot);
int cu_report_checks(int dev);
/* Queues the check of every id of ids (int32 / int64) against [0, limit)
   (or == ignore when has_ignore), reported later as above with the CPU's
   message.  Kernels that take ids must stay in bounds for a bad id (skip
   it, or write NaN).  packed (optional, n int32) receives
   the ids in row-major order, -1 for a bad one. */
int cu_check_ids(const char *fn, const char *arg, const gl_tensor *ids, int64_t limit, const char *what,
                 int has_ignore, int64_t ignore, cudaStream_t st, int32_t *packed);

/* A device copy of a small host table (a multi-tensor kernel's segment
   list), cached by content (runtime.cu): valid for work queued on st. */
int cu_table(int dev, cudaStream_t st, const void *host, size_t nbytes, const void **out);
/* Multi-tensor kernels: each segment (one tensor) is cut into chunks of
   CU_MT_CHUNK elements, one block each; a block finds its segment by a
   binary search over the segments' first blocks. */
enum { CU_MT_CHUNK = 4096, CU_MT_THREADS = 256 };
template <class Seg> __device__ __forceinline__ int cu_mt_segment(const Seg *segs, int nseg) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (segs[mid].block0 <= (int64_t)blockIdx.x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

/* ---- tensors ------------------------------------------------------------ */
/* address of element 0 of t (storage data + offset) */
static inline char *cu_ptr(const gl_tensor *t) {
  return t ? (char *)t->storage->data + t->offset * (int64_t)gl_dtype_size(t->dtype) : NULL;
}

/* A temporary tensor from the caching allocator, freed with the scope. */
struct CuTemp {
  gl_tensor *t = nullptr;
  CuTemp() = default;
  CuTemp(const CuTemp &) = delete;
  CuTemp &operator=(const CuTemp &) = delete;
  ~CuTemp() { if (t) gl_tensor_free(t); }
  /* contiguous (n) elements of dtype on dev */
  int make(int dtype, int dev, int64_t n) {
    int64_t shape[1] = {n > 0 ? n : 1};
    t = gl_empty(dtype, dev, 1, shape);
    return t ? GL_OK : GL_ERR;
  }
  /* contiguous tensor with like's shape */
  int make_like(int dtype, const gl_tensor *like) {
    t = gl_empty(dtype, like->device, like->ndim, like->shape);
    return t ? GL_OK : GL_ERR;
  }
  template <class T> T *ptr() const { return (T *)cu_ptr(t); }
};

/* ---- storage types and accessors --------------------------------------- */
typedef __nv_bfloat16 bf16;

template <class S> struct CuStore {  /* plain arithmetic storage */
  template <class T> static __device__ __forceinline__ T load(S v) { return (T)v; }
  template <class T> static __device__ __forceinline__ S store(T v) { return (S)v; }
};
template <> struct CuStore<bf16> {
  template <class T> static __device__ __forceinline__ T load(bf16 v) { return (T)__bfloat162float(v); }
  template <class T> static __device__ __forceinline__ bf16 store(T v) { return __float2bfloat16((float)v); }
};
template <> struct CuStore<__half> {
  template <class T> static __device__ __forceinline__ T load(__half v) { return (T)__half2float(v); }
  template <class T> static __device__ __forceinline__ __half store(T v) { return __float2half((float)v); }
};

/* float8 (engine/util.c's twin): decoding is exact (every e4m3 / e5m2 value
   is a half); encoding rounds once to nearest even and saturates to the
   largest finite value (__NV_SATFINITE), as the CPU does */
static __device__ __forceinline__ float cu_f8_load(uint8_t b, __nv_fp8_interpretation_t k) {
  return __half2float(__ushort_as_half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, k).x));
}
template <class T> static __device__ __forceinline__ uint8_t cu_f8_store(T v, __nv_fp8_interpretation_t k) {
  if constexpr (std::is_same<T, double>::value) return (uint8_t)__nv_cvt_double_to_fp8(v, __NV_SATFINITE, k);
  else return (uint8_t)__nv_cvt_float_to_fp8((float)v, __NV_SATFINITE, k);
}

/* the device's cuBLASLt handle and workspace (kernels/matmul.cu), which
   kernels/fp8.cu's products share */
int cu_lt_context(int dev, cublasLtHandle_t *handle, void **workspace, size_t *bytes);

/* typed accessor: element i of a known storage type */
template <class S> struct TPtr {
  typedef S storage;
  S *p;
  static TPtr from(const gl_tensor *t) { return TPtr{(S *)cu_ptr(t)}; }
  template <class T> __device__ __forceinline__ T get(int64_t i) const { return CuStore<S>::template load<T>(p[i]); }
  template <class T> __device__ __forceinline__ void set(int64_t i, T v) const { p[i] = CuStore<S>::template store<T>(v); }
  __device__ __forceinline__ bool null() const { return p == nullptr; }
};

/* accessor for a dtype known only at run time (uniform per launch, so the
   switch costs a few instructions, never divergence) */
struct AnyPtr {
  char *p;
  int dt;
  static AnyPtr from(const gl_tensor *t) { return AnyPtr{cu_ptr(t), t ? t->dtype : GL_F32}; }
  template <class T> __device__ __forceinline__ T get(int64_t i) const {
    switch (dt) {
      case GL_F32: return (T)((const float *)p)[i];
      case GL_F64: return (T)((const double *)p)[i];
      case GL_BF16: return (T)__bfloat162float(((const bf16 *)p)[i]);
      case GL_F16: return (T)__half2float(((const __half *)p)[i]);
      case GL_I32: return (T)((const int32_t *)p)[i];
      case GL_I64: return (T)((const int64_t *)p)[i];
      case GL_U16: return (T)((const uint16_t *)p)[i];
      case GL_U8: return (T)((const uint8_t *)p)[i];
      case GL_BOOL: return (T)(((const uint8_t *)p)[i] != 0);
      case GL_F8E4M3: return (T)cu_f8_load(((const uint8_t *)p)[i], __NV_E4M3);
      case GL_F8E5M2: return (T)cu_f8_load(((const uint8_t *)p)[i], __NV_E5M2);
    }
    return (T)0;
  }
  template <class T> __device__ __forceinline__ void set(int64_t i, T v) const {
    switch (dt) {
      case GL_F32: ((float *)p)[i] = (float)v; break;
      case GL_F64: ((double *)p)[i] = (double)v; break;
      case GL_BF16: ((bf16 *)p)[i] = __float2bfloat16((float)v); break;
      case GL_F16: ((__half *)p)[i] = __float2half((float)v); break;
      case GL_I32: ((int32_t *)p)[i] = (int32_t)v; break;
      case GL_I64: ((int64_t *)p)[i] = (int64_t)v; break;
      case GL_U16: ((uint16_t *)p)[i] = (uint16_t)v; break;
      case GL_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
      case GL_BOOL: ((uint8_t *)p)[i] = (v != (T)0); break;
      case GL_F8E4M3: ((uint8_t *)p)[i] = cu_f8_store(v, __NV_E4M3); break;
      case GL_F8E5M2: ((uint8_t *)p)[i] = cu_f8_store(v, __NV_E5M2); break;
    }
  }
  __device__ __forceinline__ bool null() const { return p == nullptr; }
};

/* Integer index tensors (int32 / int64) read as int64. */
struct IdxPtr {
  const char *p;
  int is64;
  static IdxPtr from(const gl_tensor *t) { return IdxPtr{cu_ptr(t), t->dtype == GL_I64}; }
  __device__ __forceinline__ int64_t get(int64_t i) const {
    return is64 ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
  }
};

/* ---- 16-byte vectors ---------------------------------------------------- */
/* CuVec16<S>::N elements of storage type S moved as one 16-byte load or
   store (8 bfloat16, 4 float, 2 double): a quarter to an eighth of the
   memory instructions of element-wise access.  Used where every operand is
   one contiguous, 16-byte aligned run (cu_vec16); the tail past the last
   whole vector, and any other layout, take the element-wise path. */
template <class S> struct CuVec16 {
  enum { N = 16 / (int)sizeof(S) };
  uint4 raw;
  static __device__ __forceinline__ CuVec16 load(const S *p) { CuVec16 v; v.raw = *(const uint4 *)p; return v; }
  __device__ __forceinline__ void store(S *p) const { *(uint4 *)p = raw; }
  template <class T> __device__ __forceinline__ T get(int k) const {
    return CuStore<S>::template load<T>(((const S *)&raw)[k]);
  }
  template <class T> __device__ __forceinline__ void set(int k, T v) {
    ((S *)&raw)[k] = CuStore<S>::template store<T>(v);
  }
};

static inline int cu_is_wide(int dt) { return dt == GL_F64 || dt == GL_I32 || dt == GL_I64; }

/* Calls f(P{}, T{}) with the accessor type P and compute type T for the
   float tensors in ts (NULL entries ignored): one shared storage type among
   float32 / bfloat16 / float64 gets the typed accessor, anything else the
   run-time one, computing in double when any operand is float64 or a wide
   integer and in float otherwise.  One template body then serves every
   dtype. */
template <class F> static int cu_dispatch(std::initializer_list<const gl_tensor *> ts, F &&f) {
  int dt = -1, same = 1, wide = 0;
  for (const gl_tensor *t : ts) {
    if (!t) continue;
    if (dt < 0) dt = t->dtype;
    else if (t->dtype != dt) same = 0;
    if (cu_is_wide(t->dtype)) wide = 1;
  }
  if (same && dt == GL_F32) return f(TPtr<float>(), float());
  if (same && dt == GL_BF16) return f(TPtr<bf16>(), float());
  if (same && dt == GL_F64) return f(TPtr<double>(), double());
  if (wide) return f(AnyPtr(), double());
  return f(AnyPtr(), float());
}

/* Calls f(U{}) with the unsigned integer type of a dtype's element size:
   same-dtype copies and fills move raw element bits. */
template <class F> static int cu_with_bits(int dtype, F &&f) {
  switch (gl_dtype_size(dtype)) {
    case 1: return f(uint8_t());
    case 2: return f(uint16_t());
    case 4: return f(uint32_t());
    case 8: return f(uint64_t());
  }
  return gl_error("cuda: dtype %d has no element size", dtype);
}

/* ---- strided index maps ------------------------------------------------- */
/* Maps a linear (row-major) index over a shape to element offsets in N
   tensors.  Built on the host with size-1 dims dropped and adjacent dims
   merged where every operand allows it, so contiguous operands become a
   single dim and the map a multiply. */
template <int N> struct CuIdx {
  int ndim;
  int64_t shape[GL_MAX_DIMS];
  int64_t stride[N][GL_MAX_DIMS];
  __host__ __device__ __forceinline__ void offsets(int64_t i, int64_t *off) const {
    if (ndim == 1) {
      for (int k = 0; k < N; k++) off[k] = i * stride[k][0];
      return;
    }
    for (int k = 0; k < N; k++) off[k] = 0;
    for (int d = ndim - 1; d >= 0; d--) {
      int64_t s = shape[d], c = i % s;
      i /= s;
      for (int k = 0; k < N; k++) off[k] += c * stride[k][d];
    }
  }
  __host__ __device__ __forceinline__ int64_t offset(int64_t i, int k) const {
    int64_t off[N];
    offsets(i, off);
    return off[k];
  }
};

/* strides[k] may be NULL (an operand that does not move: stride 0) */
template <int N> static CuIdx<N> cu_idx(int ndim, const int64_t *shape, const int64_t *const *strides) {
  CuIdx<N> ix;
  memset(&ix, 0, sizeof ix);
  int nd = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] == 1) continue;
    if (nd > 0) {  /* merge into the previous kept dim if all operands allow */
      int ok = 1;
      for (int k = 0; k < N; k++) {
        int64_t s = strides[k] ? strides[k][d] : 0;
        if (ix.stride[k][nd - 1] != s * shape[d]) { ok = 0; break; }
      }
      if (ok) {
        ix.shape[nd - 1] *= shape[d];
        for (int k = 0; k < N; k++) ix.stride[k][nd - 1] = strides[k] ? strides[k][d] : 0;
        continue;
      }
    }
    ix.shape[nd] = shape[d];
    for (int k = 0; k < N; k++) ix.stride[k][nd] = strides[k] ? strides[k][d] : 0;
    nd++;
  }
  if (nd == 0) { ix.shape[0] = 1; nd = 1; }
  ix.ndim = nd;
  return ix;
}
/* whether the operands of ix (the tensors ts, in its order) are each one
   contiguous run starting 16-byte aligned: the map collapsed to one dim of
   unit strides (a broadcast operand has stride 0 and does not qualify) */
template <int N> static bool cu_vec16(const CuIdx<N> &ix, std::initializer_list<const gl_tensor *> ts) {
  if (ix.ndim != 1) return false;
  for (int k = 0; k < N; k++)
    if (ix.stride[k][0] != 1) return false;
  for (const gl_tensor *t : ts)
    if ((uintptr_t)cu_ptr(t) & 15) return false;
  return true;
}

/* N tensors of ts[0]'s shape */
template <int N> static CuIdx<N> cu_idx_of(std::initializer_list<const gl_tensor *> ts) {
  const int64_t *st[N];
  const gl_tensor *first = *ts.begin();
  int k = 0;
  for (const gl_tensor *t : ts) st[k++] = t ? t->stride : NULL;
  return cu_idx<N>(first->ndim, first->shape, st);
}

/* ---- launch geometry ---------------------------------------------------- */
/* Dynamic shared memory a launch may ask without opting in: the 48 KiB every
   GPU allows a block, less 1 KiB kept for the kernel's own static arrays
   (block reductions' partials), which count against the same 48 KiB.
   recipes/tools/cuda_resources.lua checks that every kernel launched under
   this bound has at most the 1 KiB of static shared memory on every arch. */
enum { CU_SHARED_STATIC_RESERVE = 1 << 10, CU_SHARED_DYNAMIC_MAX = (48 << 10) - CU_SHARED_STATIC_RESERVE };
/* blocks for a grid-stride loop over n items */
static inline unsigned cu_blocks(int dev, int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  int64_t cap = (int64_t)(cu_sm_count(dev) > 0 ? cu_sm_count(dev) : 80) * 32;
  if (b > cap) b = cap;
  return (unsigned)(b < 1 ? 1 : b);
}
#define CU_GRID_LOOP(i, n)                                                        \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);       \
       i += (int64_t)gridDim.x * blockDim.x)
/* one block per row: block b takes rows b, b + gridDim.x, ... */
#define CU_ROW_LOOP(r, rows) for (int64_t r = blockIdx.x; r < (rows); r += gridDim.x)
/* blocks for a one-block-per-row launch */
static inline unsigned cu_row_grid(int64_t rows) { return (unsigned)(rows < 0x7fffffffLL ? rows : 0x7fffffffLL); }
/* the most threads a one-block-per-row launch takes: the row kernels
   declare it in __launch_bounds__, so the compiler keeps them within the
   64 registers a thread that such a block allows (65536 per SM), and a
   future compiler spills instead of leaving a launch that fails */
enum { CU_ROW_MAX_THREADS = 1024 };
/* threads for a block that walks one row of n elements */
static inline int cu_row_threads(int64_t n) {
  int t = 32;
  while (t < CU_ROW_MAX_THREADS && t < n / 2) t *= 2;
  return t;
}

/* ---- reductions ---------------------------------------------------------- */
struct CuSum { template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; } };
struct CuMax { template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; } };
struct CuMin { template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; } };

template <class T, class Op> __device__ __forceinline__ T cu_warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
/* Reduces v over the block (blockDim.x a multiple of 32, at most 1024); every
   thread gets the result.  Safe to call repeatedly: the first barrier keeps
   a new call from overwriting partials the previous one is still reading. */
template <class T, class Op> __device__ __forceinline__ T cu_block_reduce(T v, Op op, T identity) {
  GL_SHARED(T, partial, [32]);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = cu_warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < nwarps ? partial[lane] : identity;
  return cu_warp_reduce(v, op);
}

/* ---- math in the compute type ------------------------------------------- */
__device__ __forceinline__ float cu_exp(float x) { return expf(x); }
__device__ __forceinline__ double cu_exp(double x) { return exp(x); }
__device__ __forceinline__ float cu_log(float x) { return logf(x); }
__device__ __forceinline__ double cu_log(double x) { return log(x); }
__device__ __forceinline__ float cu_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double cu_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float cu_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double cu_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float cu_sin(float x) { return sinf(x); }
__device__ __forceinline__ double cu_sin(double x) { return sin(x); }
__device__ __forceinline__ float cu_cos(float x) { return cosf(x); }
__device__ __forceinline__ double cu_cos(double x) { return cos(x); }
__device__ __forceinline__ float cu_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double cu_abs(double x) { return fabs(x); }
__device__ __forceinline__ float cu_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double cu_pow(double x, double y) { return pow(x, y); }
template <class T> __device__ __forceinline__ T cu_inf() { return (T)INFINITY; }
template <class T> __device__ __forceinline__ T cu_nan() { return (T)NAN; }

#endif
