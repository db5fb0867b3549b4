/* wmma.cu — the CUDA simulator's own checks of WMMA (mma.h).
 *
 * Built into build/sim/libgptlua_simtest.so; spec/sim_numeric_spec.lua
 * calls the extern "C" entry points below through LuaJIT's ffi.
 *
 *  - WMMA runs as kernels do (GL_LAUNCH, device memory, whole warps) and is
 *    compared with a double-precision host loop.
 *  - Planted bugs (misaligned pointer, bad ldm, lanes disagreeing) stop the
 *    kernel; the spec runs them in a subprocess and reads the error.
 * Failures are printed to stderr, prefixed "gptlua cuda-sim: test_numeric: ". */
#include "common.cuh"
#include "simtest.h"
#include "numeric_harness.h"
#include <mma.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

using namespace nvcuda;

/* fragments are plain data, as kernels keep them in arrays */
static_assert(std::is_trivial<wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>>::value &&
                  std::is_trivial<wmma::fragment<wmma::accumulator, 16, 16, 16, float>>::value,
              "fragments must be trivial");
/* the toolkit's per-lane element counts */
static_assert(wmma::fragment<wmma::accumulator, 16, 16, 16, float>::num_elements == 8, "16x16 float acc: 8");
static_assert(wmma::fragment<wmma::accumulator, 16, 16, 16, __half>::num_elements == 8, "16x16 half acc: 8");
static_assert(wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>::num_elements == 8,
              "16x16x16 bf16 A: 8");
static_assert(wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major>::num_elements == 16,
              "16x16x16 half B: 16");
static_assert(wmma::fragment<wmma::matrix_a, 32, 8, 16, __nv_bfloat16, wmma::row_major>::num_elements == 16 &&
                  wmma::fragment<wmma::matrix_b, 32, 8, 16, __nv_bfloat16, wmma::row_major>::num_elements == 4,
              "32x8x16 bf16: A 16, B 4");
static_assert(wmma::fragment<wmma::matrix_a, 8, 32, 16, __nv_bfloat16, wmma::col_major>::num_elements == 4 &&
                  wmma::fragment<wmma::matrix_b, 8, 32, 16, __nv_bfloat16, wmma::col_major>::num_elements == 16,
              "8x32x16 bf16: A 4, B 16");

/* ---- WMMA GEMM ------------------------------------------------------------- */
/* C[rows x cols] (+)= (scale_a ? 2 : 1) A[rows x depth] B[depth x cols], one
   MxN tile per warp at a time (warps stride over the tiles), accumulating
   over depth in steps of K.  A and B are stored in their fragments'
   layouts, C as c_col_major says; every leading dimension is padded. */
template <int M, int N, int K, class T, class LA, class LB, class TC>
static __global__ void wmma_gemm_kernel(const T *A, int lda, const T *B, int ldb, TC *C, int ldc, int rows, int cols,
                                 int depth, int accumulate, int c_col_major, int scale_a) {
  const int warp = (int)((blockIdx.x * blockDim.x + threadIdx.x) / 32), nwarps = (int)(gridDim.x * blockDim.x / 32);
  const int tiles_n = cols / N, tiles = rows / M * tiles_n;
  const wmma::layout_t lc = c_col_major ? wmma::mem_col_major : wmma::mem_row_major;
  const bool a_row = std::is_same<LA, wmma::row_major>::value, b_row = std::is_same<LB, wmma::row_major>::value;
  for (int t = warp; t < tiles; t += nwarps) {
    const int tr = t / tiles_n, tc = t % tiles_n;
    TC *cp = c_col_major ? C + (size_t)tc * N * ldc + tr * M : C + (size_t)tr * M * ldc + tc * N;
    wmma::fragment<wmma::accumulator, M, N, K, TC> acc;
    if (accumulate) wmma::load_matrix_sync(acc, cp, ldc, lc);
    else wmma::fill_fragment(acc, 0.0f);
    for (int k0 = 0; k0 < depth; k0 += K) {
      wmma::fragment<wmma::matrix_a, M, N, K, T, LA> a;
      wmma::fragment<wmma::matrix_b, M, N, K, T, LB> b;
      wmma::load_matrix_sync(a, a_row ? A + (size_t)tr * M * lda + k0 : A + (size_t)k0 * lda + tr * M, lda);
      wmma::load_matrix_sync(b, b_row ? B + (size_t)k0 * ldb + tc * N : B + (size_t)tc * N * ldb + k0, ldb);
      if (scale_a)  /* elementwise over the lane's share: portable whatever the mapping */
        for (int i = 0; i < a.num_elements; i++) a.x[i] = a.x[i] * T(2.0f);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(cp, acc, ldc, lc);
  }
}

namespace {

/* host copy of a matrix in a layout with padded leading dimension; padding
   is NaN so a read outside the tile shows up in the result, and a write
   outside it in the padding */
template <class T> struct HostMatrix {
  int rows, cols, ld;
  bool col_major;
  std::vector<T> data;
  HostMatrix(int r, int c, bool cm, int pad) : rows(r), cols(c), ld((cm ? r : c) + pad), col_major(cm) {
    data.assign((size_t)ld * (cm ? c : r), T(NAN));
  }
  T &at(int r, int c) { return col_major ? data[(size_t)c * ld + r] : data[(size_t)r * ld + c]; }
  bool is_pad(size_t i) const { return (int)(i % ld) >= (col_major ? rows : cols); }
};

template <class T> T *to_device(const std::vector<T> &h) {
  T *d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  if (cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) return nullptr;
  return d;
}

/* Runs one GEMM configuration; returns the elements outside the bound (plus
   any padding written) and the worst error / bound in *worst.  Bound for a
   float accumulator: (depth + 1) 2^-24 sum |terms| (sequential fp32
   summation of exact products); a half accumulator adds half a half ulp of
   the result (its final rounding).  -1 if a CUDA call failed. */
template <int M, int N, int K, class T, class LA, class LB, class TC>
long run_gemm(int rows, int cols, int depth, int accumulate, int c_col_major, int scale_a, unsigned seed,
              double *worst) {
  Failures bad("wmma gemm");
  const bool a_col = std::is_same<LA, wmma::col_major>::value, b_col = std::is_same<LB, wmma::col_major>::value;
  HostMatrix<T> A(rows, depth, a_col, 8), B(depth, cols, b_col, 8);
  HostMatrix<TC> C(rows, cols, c_col_major != 0, 8);
  uint64_t state = seed;
  auto uniform = [&]() { return (float)((double)(next_random(state) >> 11) * 0x1p-53 * 4.0 - 2.0); };
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < depth; c++) A.at(r, c) = T(uniform());
  for (int r = 0; r < depth; r++)
    for (int c = 0; c < cols; c++) B.at(r, c) = T(uniform());
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) C.at(r, c) = TC(uniform() * 8.0f);
  T *dA = to_device(A.data), *dB = to_device(B.data);
  TC *dC = to_device(C.data);
  std::vector<TC> out(C.data.size());
  cudaError_t st = dA && dB && dC ? cudaSuccess : cudaErrorMemoryAllocation;
  if (st == cudaSuccess) {
    GL_LAUNCH(dim3(1), dim3(64), 0, 0, wmma_gemm_kernel<M, N, K, T, LA, LB, TC>)(
        dA, A.ld, dB, B.ld, dC, C.ld, rows, cols, depth, accumulate, c_col_major, scale_a);
    st = cudaGetLastError();
  }
  if (st == cudaSuccess) st = cudaDeviceSynchronize();
  if (st == cudaSuccess) st = cudaMemcpy(out.data(), dC, out.size() * sizeof(TC), cudaMemcpyDeviceToHost);
  cudaFree(dA);
  cudaFree(dB);
  cudaFree(dC);
  if (st != cudaSuccess) {
    bad.add("%s", cudaGetErrorString(st));
    return -1;
  }
  const bool half_acc = std::is_same<TC, __half>::value;
  *worst = 0;
  HostMatrix<TC> G(rows, cols, c_col_major != 0, 8);
  G.data = out;
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) {
      double ref = accumulate ? (double)(float)C.at(r, c) : 0.0, mag = fabs(ref);
      for (int k = 0; k < depth; k++) {
        double term = (scale_a ? 2.0 : 1.0) * (double)(float)A.at(r, k) * (double)(float)B.at(k, c);
        ref += term;
        mag += fabs(term);
      }
      /* a half accumulator is rounded to half after each of the depth / K
         mma_sync calls: up to half a half ulp (2^-11 relative) each */
      double bound = (depth + 1) * 0x1p-24 * mag + (half_acc ? (depth / K) * 0x1p-11 * mag : 0.0) + 1e-30;
      double got = (double)(float)G.at(r, c), err = fabs(got - ref);
      if (!(err <= bound)) bad.add("C[%d][%d] = %.9g, expected %.9g (bound %.3g)", r, c, got, ref, bound);
      if (err / bound > *worst || got != got) *worst = got != got ? INFINITY : err / bound;
    }
  for (size_t i = 0; i < out.size(); i++)
    if (G.is_pad(i) && (float)out[i] == (float)out[i]) bad.add("padding element %zu written", i);
  return bad.count;
}

/* the configurations: dims multi-tile where the shape keeps every tile's
   start 32-byte aligned (an 8-row tile of a column-major A at an odd tile
   row would not be, and the hardware requires it) */
template <int M, int N, int K, class T, class LA, class LB, class TC>
long gemm_shape(int accumulate, int c_col_major, int scale_a, unsigned seed, double *worst) {
  const int rows = M == 8 ? 8 : M * 3, cols = N == 8 ? 8 : N * 2, depth = K * 4;
  return run_gemm<M, N, K, T, LA, LB, TC>(rows, cols, depth, accumulate, c_col_major, scale_a, seed, worst);
}
template <int M, int N, int K, class T, class TC>
long gemm_layouts(int a_col, int b_col, int accumulate, int c_col_major, int scale_a, unsigned seed, double *worst) {
  typedef wmma::row_major R;
  typedef wmma::col_major Cm;
  if (!a_col && !b_col) return gemm_shape<M, N, K, T, R, R, TC>(accumulate, c_col_major, scale_a, seed, worst);
  if (!a_col && b_col) return gemm_shape<M, N, K, T, R, Cm, TC>(accumulate, c_col_major, scale_a, seed, worst);
  if (a_col && !b_col) return gemm_shape<M, N, K, T, Cm, R, TC>(accumulate, c_col_major, scale_a, seed, worst);
  return gemm_shape<M, N, K, T, Cm, Cm, TC>(accumulate, c_col_major, scale_a, seed, worst);
}

}  // namespace

/* shape: 0 16x16x16, 1 32x8x16, 2 8x32x16; dtype: 0 bfloat16, 1 half;
   half_acc: half accumulators (16x16x16 half only, as on the hardware).
   Returns the failures (-1: a CUDA call failed, -2: unsupported). */
extern "C" long gl_simtest_num_wmma_gemm(int shape, int dtype, int a_col, int b_col, int half_acc, int accumulate,
                                     int c_col_major, int scale_a, unsigned seed, double *worst) {
  typedef __nv_bfloat16 B;
  typedef __half H;
  if (half_acc) {
    if (shape != 0 || dtype != 1) return -2;
    return gemm_layouts<16, 16, 16, H, H>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
  }
  switch (shape * 2 + dtype) {
    case 0: return gemm_layouts<16, 16, 16, B, float>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
    case 1: return gemm_layouts<16, 16, 16, H, float>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
    case 2: return gemm_layouts<32, 8, 16, B, float>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
    case 3: return gemm_layouts<32, 8, 16, H, float>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
    case 4: return gemm_layouts<8, 32, 16, B, float>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
    case 5: return gemm_layouts<8, 32, 16, H, float>(a_col, b_col, accumulate, c_col_major, scale_a, seed, worst);
  }
  return -2;
}

/* ---- planted bugs ----------------------------------------------------------- */
/* One warp misusing WMMA the way `which` says:
     0  load_matrix_sync from a pointer 2 bytes past a 32-byte boundary
     1  load_matrix_sync with ldm 12 (bfloat16 needs a multiple of 8)
     2  lanes 16..31 load from a different (aligned) pointer than 0..15
     3  lane 5 stores with a different ldm than the others
     4  store_matrix_sync to a float pointer 16 bytes past a boundary
   Each must stop the kernel. */
static __global__ void wmma_planted_kernel(const __nv_bfloat16 *A, float *C, int which) {
  const int lane = threadIdx.x & 31;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 1.0f);
  switch (which) {
    case 0: wmma::load_matrix_sync(a, A + 1, 16); break;
    case 1: wmma::load_matrix_sync(a, A, 12); break;
    case 2: wmma::load_matrix_sync(a, A + (lane >= 16 ? 16 : 0), 32); break;
    case 3: wmma::store_matrix_sync(C, acc, lane == 5 ? 24 : 16, wmma::mem_row_major); break;
    case 4: wmma::store_matrix_sync(C + 4, acc, 16, wmma::mem_row_major); break;
  }
}

/* Runs planted bug `which`; returns the status the runtime reports after it
   (and its text in msg).  The context's error is sticky: one per process. */
extern "C" int gl_simtest_num_wmma_planted(int which, char *msg, int msg_len) {
  __nv_bfloat16 *A = nullptr;
  float *C = nullptr;
  cudaError_t st = cudaMalloc(&A, 64 * 64 * sizeof(__nv_bfloat16));
  if (st == cudaSuccess) st = cudaMalloc(&C, 64 * 64 * sizeof(float));
  if (st == cudaSuccess) st = cudaMemset(A, 0, 64 * 64 * sizeof(__nv_bfloat16));
  if (st == cudaSuccess) {
    GL_LAUNCH(dim3(1), dim3(32), 0, 0, wmma_planted_kernel)(A, C, which);
    st = cudaGetLastError();
    if (st == cudaSuccess) st = cudaDeviceSynchronize();
  }
  snprintf(msg, (size_t)msg_len, "%s", cudaGetErrorString(st));
  return (int)st;
}
