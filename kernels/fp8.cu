/* fp8.cu — the FP8 scaled product on the GPU: current-scaling quantization
 * and the product of two float8 matrices through cuBLASLt.  Twin of
 * engine/cpu/fp8.c; gl_ops.h states the formulas.
 *
 * Quantization never waits for the host: the scale is computed on the
 * device from amax.  Rowwise is one kernel, one block per row: the row's
 * amax (a block reduction), its scale, then the row cast, so the cast is
 * fused with its amax.  Tensorwise needs the whole tensor's amax before
 * any element is cast: a first kernel folds |x| into one word with
 * atomicMax on the float bit patterns (non-negative floats order as their
 * bits, a NaN above every number, so the result is order-independent), and
 * the cast kernel computes the scale itself from that word.  Both write
 * scale_inv = 1 / s for the product.
 *
 * The product out (M, N) = a (M, K) b (N, K)^T is cuBLASLt's "TN" FP8
 * problem, the only operand order FP8 products take on sm_89 / sm_90: in
 * column-major terms D (N x M) = op(A) op(B) with A = b's bytes (K x N,
 * transposed) and B = a's (K x M).  Tensorwise: A_SCALE_POINTER and
 * B_SCALE_POINTER are the two scale_inv scalars on the device (D = scaleA
 * scaleB acc), float32 accumulation (no FAST_ACCUM), D of out's dtype.
 * Rowwise (cuBLASLt on sm_90 has no per-row scale vectors): the same
 * product unscaled into a float32 temporary, then one pass multiplying
 * acc by a_scale_inv[m] * b_scale_inv[n] into out.  A shape cuBLASLt takes
 * no algorithm for (K or the leading dims not multiples of 16) runs a plain
 * kernel (one thread per output, float32 accumulation in K order), said once
 * per shape on stderr. */
#include "common.cuh"
#include <mutex>
#include <map>
#include <array>
#include <set>

enum { FP8_THREADS = 256 };

/* ---- quantization ---------------------------------------------------------- */
/* (memcpy, not __float_as_uint: the simulator's device has no bit-cast intrinsics; nvcc makes it a move) */
static __device__ __forceinline__ unsigned cu_abs_bits(float v) { unsigned u; memcpy(&u, &v, 4); return u & 0x7fffffffu; }
static __device__ __forceinline__ float cu_bits_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }

template <class S>
__global__ void fp8_amax_kernel(TPtr<S> x, int64_t R, int64_t C, int64_t s0, int64_t s1, unsigned *amax) {
  unsigned m = 0;
  CU_GRID_LOOP(i, R * C) {
    unsigned b = cu_abs_bits(x.template get<float>((i / C) * s0 + (i % C) * s1));
    m = b > m ? b : m;
  }
  m = cu_block_reduce(m, CuMax(), 0u);
  if (threadIdx.x == 0) atomicMax(amax, m);
}

/* q (R, C) row-major from x with one scale (amax: one word, step 0), one per
   row given (amax: R words, step 1) or one per row computed (amax NULL: each
   block computes its row's); a given word is a float's bits, its sign cleared */
template <class S>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) fp8_cast_kernel(uint8_t *q, float *scale_inv, TPtr<S> x, int64_t R, int64_t C, int64_t s0, int64_t s1,
                                const unsigned *amax, int64_t step, __nv_fp8_interpretation_t k, float fmax) {
  CU_ROW_LOOP(r, R) {
    unsigned m;
    if (amax) m = amax[r * step] & 0x7fffffffu;
    else {
      m = 0;
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        unsigned b = cu_abs_bits(x.template get<float>(r * s0 + c * s1));
        m = b > m ? b : m;
      }
      m = cu_block_reduce(m, CuMax(), 0u);
    }
    const float s = gl_fp8_scale(cu_bits_float(m), fmax);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      q[r * C + c] = cu_f8_store(x.template get<float>(r * s0 + c * s1) * s, k);
    const bool one = amax && step == 0;
    if (threadIdx.x == 0 && (!one || r == 0)) scale_inv[one ? 0 : r] = 1.0f / s;
  }
}

__global__ void fp8_scale_of_kernel(float *scale_inv, const unsigned *amax, float fmax) {
  scale_inv[0] = 1.0f / gl_fp8_scale(cu_bits_float(amax[0] & 0x7fffffffu), fmax);
}

/* the cast of x with amax computed (given NULL: tensorwise by a first
   kernel, rowwise in the cast) or given (its words, step 0 or 1) */
static int quantize(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise, const unsigned *given) {
  const int64_t R = x->shape[0], C = x->shape[1];
  cudaStream_t st;
  GL_TRY(cu_begin(x->device, &st));
  const __nv_fp8_interpretation_t k = q->dtype == GL_F8E4M3 ? __NV_E4M3 : __NV_E5M2;
  const float fmax = q->dtype == GL_F8E4M3 ? GL_FP8_E4M3_MAX : GL_FP8_E5M2_MAX;
  uint8_t *qp = (uint8_t *)cu_ptr(q);
  float *sp = (float *)cu_ptr(scale_inv);
  CuTemp amax;
  const bool compute_whole = !rowwise && !given;
  if (compute_whole) {
    if (R == 0) return cuda_fill(scale_inv, (double)(1.0f / gl_fp8_scale(0.0f, fmax)));  /* no rows: amax 0, as the CPU */
    GL_TRY(amax.make(GL_I32, x->device, 1));
    GL_CU_CHECK(cudaMemsetAsync(cu_ptr(amax.t), 0, sizeof(unsigned), st));
  }
  const unsigned *ap = compute_whole ? (const unsigned *)cu_ptr(amax.t) : given;
  const int64_t step = given && rowwise ? 1 : 0;
  const int threads = rowwise && !given ? cu_row_threads(C) : FP8_THREADS;
  const unsigned rows = cu_row_grid(R > 0 ? R : 1);
  auto run = [&](auto s) -> int {
    using S = decltype(s);
    TPtr<S> xp = TPtr<S>::from(x);
    if (compute_whole) {
      GL_LAUNCH(cu_blocks(x->device, R * C, FP8_THREADS), FP8_THREADS, 0, st, fp8_amax_kernel<S>)(
          xp, R, C, x->stride[0], x->stride[1], (unsigned *)cu_ptr(amax.t));
      GL_CU_LAUNCHED();
    }
    if (R > 0) {
      GL_LAUNCH(rows, threads, 0, st, fp8_cast_kernel<S>)(qp, sp, xp, R, C, x->stride[0], x->stride[1], ap, step, k, fmax);
    } else {  /* no rows, one given amax: its scale_inv, as the CPU */
      GL_LAUNCH(1, 1, 0, st, fp8_scale_of_kernel)(sp, ap, fmax);
    }
    GL_CU_LAUNCHED();
    return GL_OK;
  };
  return x->dtype == GL_BF16 ? run(bf16()) : run(float());
}

extern "C" int cuda_fp8_quantize(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise) {
  return quantize(q, scale_inv, x, rowwise, nullptr);
}

extern "C" int cuda_fp8_quantize_amax(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, const gl_tensor *amax) {
  return quantize(q, scale_inv, x, amax->shape[0] != 1, (const unsigned *)cu_ptr(amax));
}

/* ---- the product ------------------------------------------------------------ */
/* out[m, n] = acc[m * N + n] * (sa[m * ia] * sb[n * ib]) in out's dtype */
__global__ void fp8_scale_kernel(AnyPtr out, int64_t o0, int64_t o1, const float *acc, const float *sa, int64_t ia,
                                 const float *sb, int64_t ib, int64_t M, int64_t N) {
  CU_GRID_LOOP(i, M * N) {
    int64_t m = i / N, n = i % N;
    out.set(m * o0 + n * o1, acc[i] * (sa[m * ia] * sb[n * ib]));
  }
}

/* acc (M, N) row-major = a b^T, where cuBLASLt takes no algorithm */
__global__ void fp8_gemm_plain_kernel(float *acc, const uint8_t *a, __nv_fp8_interpretation_t ka, const uint8_t *b,
                                      __nv_fp8_interpretation_t kb, int64_t M, int64_t N, int64_t K) {
  CU_GRID_LOOP(i, M * N) {
    int64_t m = i / N, n = i % N;
    float s = 0.0f;
    for (int64_t j = 0; j < K; j++) s = fmaf(cu_f8_load(a[m * K + j], ka), cu_f8_load(b[n * K + j], kb), s);
    acc[i] = s;
  }
}

struct Fp8Plan {
  int usable = 0;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  cublasLtMatmulAlgo_t algo;
};
typedef std::array<int64_t, 7> Fp8Key;  /* M, N, K, a dtype, b dtype, D dtype, scaled */
static std::mutex fp8_mu;
static std::map<Fp8Key, Fp8Plan> fp8_plans[CU_MAX_DEVICES];

static cudaDataType_t fp8_type(int dtype) {
  switch (dtype) {
    case GL_F8E4M3: return CUDA_R_8F_E4M3;
    case GL_F8E5M2: return CUDA_R_8F_E5M2;
    case GL_BF16: return CUDA_R_16BF;
  }
  return CUDA_R_32F;
}

static void fp8_plan_free(Fp8Plan *p) {
  if (p->desc) cublasLtMatmulDescDestroy(p->desc);
  if (p->la) cublasLtMatrixLayoutDestroy(p->la);
  if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
  *p = Fp8Plan();
}

/* the plan for D (N x M) = op(A = b) op(B = a), or usable 0 when cuBLASLt
   has no algorithm for it */
static int fp8_plan_build(cublasLtHandle_t h, size_t ws, const Fp8Key &key, Fp8Plan *p) {
  const int64_t M = key[0], N = key[1], K = key[2];
  GL_CU_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  GL_CU_CHECK(cublasLtMatrixLayoutCreate(&p->la, fp8_type((int)key[4]), (uint64_t)K, (uint64_t)N, K));
  GL_CU_CHECK(cublasLtMatrixLayoutCreate(&p->lb, fp8_type((int)key[3]), (uint64_t)K, (uint64_t)M, K));
  GL_CU_CHECK(cublasLtMatrixLayoutCreate(&p->ld, fp8_type((int)key[5]), (uint64_t)N, (uint64_t)M, N));
  cublasLtMatmulPreference_t pref;
  GL_CU_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsb = ws;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb);
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(h, p->desc, p->la, p->lb, p->ld, p->ld, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && found < 1)) return GL_OK;
  GL_CU_CHECK(s);
  p->algo = res.algo;
  p->usable = 1;
  return GL_OK;
}

extern "C" int cuda_fp8_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *a_scale_inv, const gl_tensor *b,
                               const gl_tensor *b_scale_inv) {
  const int dev = out->device;
  const int64_t M = a->shape[0], K = a->shape[1], N = b->shape[0];
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  const int scaled = a_scale_inv->numel == 1 && b_scale_inv->numel == 1;
  /* cuBLASLt writes D straight into out when the scales are scalars and out is row-major */
  const int direct = scaled && out->stride[1] == 1 && (M == 1 || out->stride[0] == N);
  cublasLtHandle_t h;
  void *ws;
  size_t wsb;
  GL_TRY(cu_lt_context(dev, &h, &ws, &wsb));
  Fp8Key key = {M, N, K, a->dtype, b->dtype, direct ? out->dtype : GL_F32, direct};
  Fp8Plan plan;
  if (K > 0) {  /* (K = 0: no layout to give cuBLASLt; the plain kernel writes zeros) */
    std::lock_guard<std::mutex> g(fp8_mu);
    auto it = fp8_plans[dev].find(key);
    if (it != fp8_plans[dev].end()) plan = it->second;
    else {
      if (fp8_plan_build(h, wsb, key, &plan) != GL_OK) { fp8_plan_free(&plan); return GL_ERR; }
      if (!plan.usable) {
        fp8_plan_free(&plan);
        fprintf(stderr, "gptlua: cuda:%d: cuBLASLt has no FP8 algorithm for m=%lld n=%lld k=%lld (%s x %s); "
                "this shape runs on the slow plain FP8 kernel\n", dev, (long long)M, (long long)N, (long long)K,
                gl_dtype_name(a->dtype), gl_dtype_name(b->dtype));
      }
      fp8_plans[dev][key] = plan;
    }
  }
  const float *sa = (const float *)cu_ptr(a_scale_inv), *sb = (const float *)cu_ptr(b_scale_inv);
  CuTemp acc;
  float *accp = nullptr;
  if (!(direct && plan.usable)) {
    GL_TRY(acc.make(GL_F32, dev, M * N));
    accp = (float *)cu_ptr(acc.t);
  }
  if (plan.usable) {
    if (direct) {
      GL_CU_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb, sizeof sb));
      GL_CU_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa, sizeof sa));
    }
    float one = 1.0f, zero = 0.0f;
    void *D = direct ? (void *)cu_ptr(out) : (void *)accp;
    GL_CU_CHECK(cublasLtMatmul(h, plan.desc, &one, cu_ptr(b), plan.la, cu_ptr(a), plan.lb, &zero, D, plan.ld, D,
                               plan.ld, &plan.algo, ws, wsb, st));
    if (direct) return GL_OK;
  } else {
    GL_LAUNCH(cu_blocks(dev, M * N, FP8_THREADS), FP8_THREADS, 0, st, fp8_gemm_plain_kernel)(
        accp, (const uint8_t *)cu_ptr(a), a->dtype == GL_F8E4M3 ? __NV_E4M3 : __NV_E5M2, (const uint8_t *)cu_ptr(b),
        b->dtype == GL_F8E4M3 ? __NV_E4M3 : __NV_E5M2, M, N, K);
    GL_CU_LAUNCHED();
  }
  GL_LAUNCH(cu_blocks(dev, M * N, FP8_THREADS), FP8_THREADS, 0, st, fp8_scale_kernel)(
      AnyPtr::from(out), out->stride[0], out->stride[1], accp, sa, a_scale_inv->numel > 1 ? a_scale_inv->stride[0] : 0,
      sb, b_scale_inv->numel > 1 ? b_scale_inv->stride[0] : 0, M, N);
  GL_CU_LAUNCHED();
  return GL_OK;
}
