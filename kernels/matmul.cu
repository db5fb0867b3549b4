/* matmul.cu — batched out = alpha * a @ b + beta * out through cuBLASLt.
 *
 * Twin of engine/cpu/matmul.c, with the same operand model: each matrix is
 * used in place when it is row-major (stride[-1] == 1) or a transposed view
 * (stride[-2] == 1), with its leading dimension; other layouts go through
 * contiguous copies.  bfloat16 / float16 run natively on the tensor cores
 * with float32 accumulation; float32 computes in true fp32 (CUBLAS_COMPUTE_32F,
 * never TF32) so it can be compared with the CPU; float64 in fp64.  Mixed
 * dtypes compute in float32 (float64 when out is float64) like the CPU.
 *
 * cuBLASLt is column-major: a row-major out is computed as
 * out^T = b^T a^T, a transposed-view out directly as a b.  Batches: when b
 * is shared by every batch (a weight expanded over (B, T)) and a and out walk
 * their rows with one stride, the batch folds into M (one large GEMM);
 * otherwise the innermost batch dim becomes a strided batch and any outer
 * batch dims a loop.  One handle, one 32 MiB workspace and a plan cache
 * (descriptors + heuristic algo per shape) per device, created once.
 * gl_matmul_bias adds a linear layer's bias in the epilogue
 * (CUBLASLT_EPILOGUE_BIAS: bias[m] per column of column-major D, i.e. per
 * feature of a row-major out); a layout the epilogue cannot take, or a
 * refusal, copies the bias into out and accumulates the product instead.
 * gl_matmul_epilogue (a 2-D product) fuses the MLP's activation and the
 * bias gradients: GL_EPI_GELU is CUBLASLT_EPILOGUE_GELU_AUX_BIAS (the GELU
 * input kept in aux, ld N, for the backward), GL_EPI_DGELU is
 * CUBLASLT_EPILOGUE_DGELU_BGRAD (D times GELU'(aux), and D's sums over its
 * columns, i.e. over out's rows, into the bias vector), GL_EPI_BGRAD is
 * BGRADB for a row-major out (cuBLASLt's B is our a, whose sums over K are
 * the bias gradient of a linear layer's dW = dy^T x) and BGRADA for a
 * transposed-view out.  Layouts an epilogue cannot take (fp64, a transposed
 * out for GELU, an aux ld not a multiple of 8), a refusal and the fallback
 * GEMM run the product and then the unfused ops (gl_epilogue_product /
 * gl_epilogue_finish, engine/unfused.c), as the CPU does.
 * GL_EPI_RELU2 / GL_EPI_DRELU2 (nanochat's ReLU² MLP) have no cuBLASLt
 * epilogue: they run kernels/gemm_mma.cu, our own bf16 GEMM with the
 * activation in its epilogue, where it takes the operands, and otherwise
 * the same unfused path (cuBLASLt's product, then the passes).
 * gl_matmul_add (out = a @ b + c) gives cuBLASLt c as its C and out as its
 * D (C != D, beta 1): a residual added in the product with no pass of its
 * own, where c has out's dtype and strides and out needs no temporary;
 * otherwise c is copied into out and the product accumulates onto it.
 * Specs: spec/cuda_spec.lua ("matmul with a bias", "matmul epilogues"),
 * spec/sim_cublaslt_spec.lua, spec/layer_fusion_spec.lua (gl_matmul_add). */
#include "common.cuh"
#include <mutex>
#include <map>
#include <array>
#include <limits.h>
#include <stdlib.h>

enum { LT_WORKSPACE = 32 << 20 };

enum { LT_NO_ALGO = 1 };  /* lt_run: cuBLASLt has no algorithm for this problem */

struct LtPlan {
  int usable = 1;          /* 0: cached "no algorithm" answer */
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo;
};
typedef std::array<int64_t, 22> LtKey;

struct LtDevice {
  std::once_flag once;
  int init_rc = GL_ERR;
  char init_err[512] = {0};
  cublasLtHandle_t handle = nullptr;
  void *workspace = nullptr;
  std::mutex mu;
  std::map<LtKey, LtPlan> plans;
};
static LtDevice lt_devices[CU_MAX_DEVICES];

static int lt_init(int dev, LtDevice *d) {
  GL_CU_CHECK(cublasLtCreate(&d->handle));
  GL_CU_CHECK(cudaMalloc(&d->workspace, LT_WORKSPACE));
  return GL_OK;
}
static int lt_device(int dev, LtDevice **out) {
  if (dev < 0 || dev >= CU_MAX_DEVICES) return gl_error("cuda_matmul: device %d out of range", dev);
  LtDevice *d = &lt_devices[dev];
  std::call_once(d->once, [&] {
    d->init_rc = lt_init(dev, d);
    if (d->init_rc != GL_OK) snprintf(d->init_err, sizeof d->init_err, "%s", gl_last_error());
  });
  if (d->init_rc != GL_OK) return gl_error("cuda_matmul: cuBLASLt setup on cuda:%d failed: %s", dev, d->init_err);
  *out = d;
  return GL_OK;
}

int cu_lt_context(int dev, cublasLtHandle_t *handle, void **workspace, size_t *bytes) {
  LtDevice *d = nullptr;
  GL_TRY(lt_device(dev, &d));
  *handle = d->handle;
  *workspace = d->workspace;
  *bytes = LT_WORKSPACE;
  return GL_OK;
}

/* One GEMM problem in cuBLASLt's column-major terms. */
struct LtProblem {
  int dtype;                        /* GL_F32 / GL_F64 / GL_BF16 / GL_F16: all of A, B, C */
  int opa, opb;                     /* 1: transpose */
  int64_t m, n, k;
  int64_t a_rows, a_cols, lda, b_rows, b_cols, ldb, ldc;  /* stored matrices */
  int64_t batch, sa, sb, sc;        /* strided batch */
  int align_a, align_b, align_c;    /* bytes */
  int epilogue;                     /* cublasLtEpilogue_t; 0: none (DEFAULT) */
  int align_bias;                   /* BIAS: bias[m] added to every column of D; *BGRAD*: the gradient */
  int64_t aux_ld;                   /* GELU_AUX / DGELU: the GELU input, m x n column-major */
  int align_aux;
};

static cudaDataType_t lt_type(int dtype) {
  switch (dtype) {
    case GL_F64: return CUDA_R_64F;
    case GL_BF16: return CUDA_R_16BF;
    case GL_F16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

static int lt_layout(cublasLtMatrixLayout_t *l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                     int64_t batch, int64_t stride) {
  GL_CU_CHECK(cublasLtMatrixLayoutCreate(l, t, (uint64_t)rows, (uint64_t)cols, ld));
  if (batch > 1) {
    int32_t bc = (int32_t)batch;
    GL_CU_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof bc));
    GL_CU_CHECK(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                 sizeof stride));
  }
  return GL_OK;
}

static void lt_plan_destroy(LtPlan *p) {
  if (p->desc) cublasLtMatmulDescDestroy(p->desc);
  if (p->la) cublasLtMatrixLayoutDestroy(p->la);
  if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
  *p = LtPlan();
}

static int lt_plan_build(LtDevice *d, const LtProblem &q, const void *bias, const void *aux, LtPlan *p) {
  cudaDataType_t t = lt_type(q.dtype);
  cublasComputeType_t ct = q.dtype == GL_F64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  cudaDataType_t scale_t = q.dtype == GL_F64 ? CUDA_R_64F : CUDA_R_32F;
  GL_CU_CHECK(cublasLtMatmulDescCreate(&p->desc, ct, scale_t));
  cublasOperation_t ta = q.opa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = q.opb ? CUBLAS_OP_T : CUBLAS_OP_N;
  GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (q.epilogue) {  /* the heuristic reads the bias / aux pointers (their alignment) from the descriptor */
    cublasLtEpilogue_t ep = (cublasLtEpilogue_t)q.epilogue;
    GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
    if (bias)
      GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    if (aux) {
      GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
      GL_CU_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &q.aux_ld,
                                                 sizeof q.aux_ld));
    }
  }
  GL_TRY(lt_layout(&p->la, t, q.a_rows, q.a_cols, q.lda, q.batch, q.sa));
  GL_TRY(lt_layout(&p->lb, t, q.b_rows, q.b_cols, q.ldb, q.batch, q.sb));
  GL_TRY(lt_layout(&p->lc, t, q.m, q.n, q.ldc, q.batch, q.sc));
  cublasLtMatmulPreference_t pref;
  GL_CU_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = LT_WORKSPACE;
  uint32_t aa = (uint32_t)q.align_a, ab = (uint32_t)q.align_b, ac = (uint32_t)q.align_c;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(d->handle, p->desc, p->la, p->lb, p->lc, p->lc, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && found < 1)) return LT_NO_ALGO;
  GL_CU_CHECK(s);
  p->algo = res.algo;
  return GL_OK;
}

/* A problem cuBLASLt has no algorithm for runs on the fallback GEMM, far
   slower: say so on stderr, once per problem, with what the heuristic saw. */
static void lt_report_refusal(int dev, const LtProblem &q) {
  fprintf(stderr,
          "gptlua: cuda:%d: cuBLASLt has no algorithm for the %s GEMM m=%lld n=%lld k=%lld (op %c%c, ld %lld/%lld/%lld, "
          "batch %lld, alignment %d/%d/%d bytes%s); %s\n",
          dev, gl_dtype_name(q.dtype), (long long)q.m, (long long)q.n, (long long)q.k, q.opa ? 'T' : 'N',
          q.opb ? 'T' : 'N', (long long)q.lda, (long long)q.ldb, (long long)q.ldc, (long long)q.batch, q.align_a,
          q.align_b, q.align_c, q.epilogue ? ", with an epilogue" : "",
          q.epilogue ? "the epilogue runs as separate passes instead" : "this shape runs on the slow fallback GEMM");
}

/* Runs one (strided-batched) GEMM: D = alpha op(A) op(B) + beta Cin, Cin == D
   unless a residual is read from elsewhere (gl_matmul_add: Cin of D's layout). */
static int lt_run(int dev, cudaStream_t st, const LtProblem &q, const void *A, const void *B, void *C,
                  double alpha, double beta, const void *bias, const void *aux, const void *Cin = nullptr) {
  LtDevice *d = nullptr;
  GL_TRY(lt_device(dev, &d));
  LtKey key = {q.dtype, q.opa, q.opb, q.m, q.n, q.k, q.a_rows, q.lda, q.b_rows, q.ldb, q.ldc, q.batch, q.sa, q.sb,
               q.sc, q.align_a, q.align_b, q.align_c, q.epilogue, q.align_bias, q.aux_ld, q.align_aux};
  LtPlan plan;
  {
    std::lock_guard<std::mutex> g(d->mu);
    auto it = d->plans.find(key);
    if (it != d->plans.end()) plan = it->second;
    else {
      int rc = lt_plan_build(d, q, bias, aux, &plan);
      if (rc == LT_NO_ALGO) {  /* said once per problem (the plan cache remembers), never hidden */
        lt_plan_destroy(&plan);
        plan.usable = 0;
        lt_report_refusal(dev, q);
      }
      else if (rc != GL_OK) { lt_plan_destroy(&plan); return GL_ERR; }
      d->plans[key] = plan;
    }
  }
  if (!plan.usable) return LT_NO_ALGO;
  /* this call's vectors (the plan is shared by every bias / aux of the shape and alignment) */
  if (bias) GL_CU_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  if (aux)
    GL_CU_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
  float af = (float)alpha, bf = (float)beta;
  const void *pa = q.dtype == GL_F64 ? (const void *)&alpha : (const void *)&af;
  const void *pb = q.dtype == GL_F64 ? (const void *)&beta : (const void *)&bf;
  GL_CU_CHECK(cublasLtMatmul(d->handle, plan.desc, pa, A, plan.la, B, plan.lb, pb, Cin ? Cin : C, plan.lc, C, plan.lc,
                             &plan.algo, d->workspace, LT_WORKSPACE, st));
  return GL_OK;
}

/* ---- operand layouts: gl_blas_layout / gl_fold_rows (engine/backend.h) ---- */
static int lowest_align(uint64_t v) {
  int a = 256;
  while (a > 1 && (v & (uint64_t)(a - 1))) a >>= 1;
  return a;
}

/* ---- fallback: a plain tiled GEMM for what cuBLASLt declines -------------- */
/* out[batch] = alpha a[batch] @ b[batch] + beta out[batch] for any strides and
   dtypes, one 16x16 output tile per block (16-deep K slices through shared
   memory), batches over blockIdx.z.  Slow but general: used only when
   cuBLASLt has no algorithm for a layout, or when GL_CUDA_MATMUL_FALLBACK is
   set in the environment (a debugging switch). */
enum { FB_TILE = 16 };
struct GemmStrides { int64_t a0, a1, b0, b1, o0, o1; };

template <class P, class T>
__global__ void gemm_fallback_kernel(P out, P a, P b, CuIdx<3> batch, int64_t nbatch, int64_t M, int64_t N,
                                     int64_t K, GemmStrides s, T alpha, T beta) {
  GL_SHARED(T, As, [FB_TILE][FB_TILE + 1]);
  GL_SHARED(T, Bs, [FB_TILE][FB_TILE + 1]);
  const int ty = threadIdx.x / FB_TILE, tx = threadIdx.x % FB_TILE;
  const int64_t row = (int64_t)blockIdx.y * FB_TILE + ty, col = (int64_t)blockIdx.x * FB_TILE + tx;
  for (int64_t bi = blockIdx.z; bi < nbatch; bi += gridDim.z) {
    int64_t off[3];
    batch.offsets(bi, off);
    T acc = 0;
    for (int64_t k0 = 0; k0 < K; k0 += FB_TILE) {
      __syncthreads();  /* the previous slice has been used */
      const int64_t ka = k0 + tx, kb = k0 + ty;
      As[ty][tx] = row < M && ka < K ? a.template get<T>(off[0] + row * s.a0 + ka * s.a1) : (T)0;
      Bs[ty][tx] = kb < K && col < N ? b.template get<T>(off[1] + kb * s.b0 + col * s.b1) : (T)0;
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < FB_TILE; kk++) acc += As[ty][kk] * Bs[kk][tx];
    }
    if (row < M && col < N) {
      const int64_t e = off[2] + row * s.o0 + col * s.o1;
      out.set(e, alpha * acc + (beta != (T)0 ? beta * out.template get<T>(e) : (T)0));
    }
  }
}

static int gemm_fallback(cudaStream_t st, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha,
                         double beta) {
  int nd = out->ndim;
  int64_t M = out->shape[nd - 2], N = out->shape[nd - 1], K = a->shape[nd - 1], nbatch = 1;
  for (int d = 0; d < nd - 2; d++) nbatch *= out->shape[d];
  const int64_t *bst[3] = {a->stride, b->stride, out->stride};
  CuIdx<3> batch = cu_idx<3>(nd - 2, out->shape, bst);
  GemmStrides s = {a->stride[nd - 2], a->stride[nd - 1], b->stride[nd - 2], b->stride[nd - 1],
                   out->stride[nd - 2], out->stride[nd - 1]};
  int64_t gx = (N + FB_TILE - 1) / FB_TILE, gy = (M + FB_TILE - 1) / FB_TILE;
  if (gx > 0x7fffffffLL || gy > 65535)
    return gl_error("cuda_matmul: %lld x %lld output exceeds the fallback kernel's grid", (long long)M, (long long)N);
  dim3 grid((unsigned)gx, (unsigned)gy, (unsigned)(nbatch < 65535 ? nbatch : 65535));
  return cu_dispatch({out, a, b}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(grid, FB_TILE * FB_TILE, 0, st, gemm_fallback_kernel<P, T>)(P::from(out), P::from(a), P::from(b), batch,
                                                                   nbatch, M, N, K, s, (T)alpha, (T)beta);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* kernels/gemm_mma.cu: out = a @ b with GL_EPI_RELU2 / GL_EPI_DRELU2 fused;
   returns 1, launching nothing, when it cannot take the operands */
extern "C" int cuda_gemm_mma_epilogue(int epi, gl_tensor *out, const gl_tensor *a, const gl_tensor *b,
                                      const gl_tensor *bias, const gl_tensor *aux);

/* What a product's epilogue is: none, gl_matmul_bias's bias, or a
   gl_matmul_epilogue (GL_EPI_*) with its bias and aux (either may be NULL). */
enum { EPI_NONE = 0, EPI_BIAS = -1 };
struct MatEpi {
  int kind = EPI_NONE;
  const gl_tensor *bias = nullptr;
  gl_tensor *aux = nullptr;
  const gl_tensor *resid = nullptr;  /* gl_matmul_add's c (kind EPI_NONE, beta 1) */
};
/* whether c can be cuBLASLt's C for D = out: out's dtype and strides */
static bool resid_fits(const gl_tensor *c, const gl_tensor *out, int wd) {
  if (c->dtype != wd) return false;
  for (int d = 0; d < out->ndim; d++)
    if (out->shape[d] > 1 && c->stride[d] != out->stride[d]) return false;
  return true;
}

static int matmul_impl(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta,
                       const MatEpi &e);
/* the epilogue without cuBLASLt's help: the bias copied into out's rows and
   the product added; GL_EPI_* as the CPU runs them, the product and then
   the unfused ops' kernels (engine/unfused.c) */
static int epilogue_unfused(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const MatEpi &e) {
  if (e.kind == EPI_BIAS) {
    gl_tensor rows = gl_bias_rows(e.bias, out);
    GL_TRY(cuda_copy(out, &rows));
    return matmul_impl(out, a, b, 1, 1, MatEpi());
  }
  gl_tensor *bias = (gl_tensor *)e.bias;
  GL_TRY(gl_epilogue_product(e.kind, out, a, b, bias, e.aux));
  return gl_epilogue_finish(e.kind, out, a, bias, e.aux);
}

static bool force_fallback() {
  static int v = -1;
  if (v < 0) { const char *e = getenv("GL_CUDA_MATMUL_FALLBACK"); v = e && *e && strcmp(e, "0") != 0; }
  return v == 1;
}

/* An epilogue goes into cuBLASLt when out is one product of its own dtype
   that the epilogue's layout fits (for EPI_BIAS, GL_EPI_GELU and
   GL_EPI_DGELU a row-major out); any other case runs it unfused. */
static int matmul_impl(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta,
                       const MatEpi &e) {
  int nd = out->ndim;
  if (nd < 2 || a->ndim != nd || b->ndim != nd)
    return gl_error("cuda_matmul: a, b and out expected the same ndim >= 2, got %d, %d, %d", a->ndim, b->ndim, nd);
  int64_t M = out->shape[nd - 2], N = out->shape[nd - 1], K = a->shape[nd - 1], nbatch = 1;
  for (int d = 0; d < nd - 2; d++) nbatch *= out->shape[d];
  if (M == 0 || N == 0 || nbatch == 0) return GL_OK;
  if (e.kind != EPI_NONE && (K == 0 || force_fallback() || (e.kind > 0 && out->dtype == GL_F64)))
    return epilogue_unfused(out, a, b, e);  /* (cuBLASLt has the GELU and gradient epilogues for 16/32-bit only) */
  if (e.resid && (K == 0 || force_fallback())) return gl_matmul_add_unfused(out, a, b, e.resid);
  if (K == 0) return beta == 0 ? cuda_fill(out, 0) : cuda_unary(GL_U_MUL_SCALAR, out, out, beta, 0);
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return gl_error("cuda_matmul: matrix sizes M=%lld N=%lld K=%lld exceed the int range",
                    (long long)M, (long long)N, (long long)K);
  int dev = out->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  if (force_fallback()) return gemm_fallback(st, out, a, b, alpha, beta);
  const gl_tensor *a0 = a, *b0 = b;

  /* the work dtype: native when all three agree, else float32 / float64 */
  int wd = out->dtype;
  if (!(a->dtype == wd && b->dtype == wd && gl_is_float(wd))) wd = out->dtype == GL_F64 ? GL_F64 : GL_F32;

  /* operands that cuBLASLt cannot take in place become contiguous copies */
  CuTemp ta, tb, tc;
  int64_t ld;
  if (a->dtype != wd || gl_blas_layout(M, K, a->stride[nd - 2], a->stride[nd - 1], &ld) < 0) {
    GL_TRY(ta.make_like(wd, a));
    GL_TRY(cuda_copy(ta.t, a));
    a = ta.t;
  }
  if (b->dtype != wd || gl_blas_layout(K, N, b->stride[nd - 2], b->stride[nd - 1], &ld) < 0) {
    GL_TRY(tb.make_like(wd, b));
    GL_TRY(cuda_copy(tb.t, b));
    b = tb.t;
  }
  gl_tensor *o = out;
  if (out->dtype != wd || gl_blas_layout(M, N, out->stride[nd - 2], out->stride[nd - 1], &ld) < 0) {
    GL_TRY(tc.make_like(wd, out));
    if (beta != 0) GL_TRY(cuda_copy(tc.t, out));
    o = tc.t;
  }

  if (e.kind != EPI_NONE && (o != out || (e.bias && (e.bias->dtype != wd || e.bias->stride[0] != 1))))
    return epilogue_unfused(out, a0, b0, e);
  if (e.resid && (o != out || !resid_fits(e.resid, out, wd))) return gl_matmul_add_unfused(out, a0, b0, e.resid);

  /* fold the batch into M when b is shared by every batch */
  int64_t rows = M, sra = a->stride[nd - 2], sro = o->stride[nd - 2];
  int folded = 0;
  int b_shared = 1;
  for (int d = 0; d < nd - 2; d++) if (out->shape[d] > 1 && b->stride[d] != 0) b_shared = 0;
  int64_t fa, fo, lda_f, ldo_f;
  if (nbatch > 1 && b_shared && M * nbatch <= INT_MAX && gl_fold_rows(a, &fa) && gl_fold_rows(o, &fo) &&
      gl_blas_layout(M * nbatch, K, fa, a->stride[nd - 1], &lda_f) == 0 &&
      gl_blas_layout(M * nbatch, N, fo, o->stride[nd - 1], &ldo_f) == 0) {
    rows = M * nbatch; sra = fa; sro = fo; folded = 1;
  }
  int64_t lda = 1, ldb = 1, ldc = 1;
  int tra = gl_blas_layout(rows, K, sra, a->stride[nd - 1], &lda);
  int trb = gl_blas_layout(K, N, b->stride[nd - 2], b->stride[nd - 1], &ldb);
  int trc = gl_blas_layout(rows, N, sro, o->stride[nd - 1], &ldc);
  if (tra < 0 || trb < 0 || trc < 0)  /* the copies above make every layout usable */
    gl_panic("cuda_matmul: operand layout %d %d %d after copies", tra, trb, trc);

  /* batch dims: innermost coalesced one strided-batched, the rest a loop */
  CuIdx<3> bix;
  memset(&bix, 0, sizeof bix);
  int64_t inner = 1, sa = 0, sb = 0, sc = 0, nouter = 1;
  if (!folded && nd > 2) {
    const int64_t *bst[3] = {a->stride, b->stride, o->stride};
    bix = cu_idx<3>(nd - 2, out->shape, bst);
    int last = bix.ndim - 1;
    if (bix.stride[0][last] >= 0 && bix.stride[1][last] >= 0 && bix.stride[2][last] > 0 &&
        bix.shape[last] <= INT_MAX) {
      inner = bix.shape[last];
      sa = bix.stride[0][last]; sb = bix.stride[1][last]; sc = bix.stride[2][last];
      bix.ndim = last;  /* the loop walks the remaining dims */
    }
    nouter = 1;
    for (int d = 0; d < bix.ndim; d++) nouter *= bix.shape[d];
  }
  if (inner == 1) sa = sb = sc = 0;

  int esz = gl_dtype_size(wd);
  const char *A0 = cu_ptr(a), *B0 = cu_ptr(b);
  char *C0 = cu_ptr(o);
  const char *R0 = e.resid ? cu_ptr(e.resid) : nullptr;  /* (strides of o: resid_fits) */
  /* the batch loop's pointers share the alignment of base and strides */
  uint64_t amask = (uint64_t)(uintptr_t)A0 | (uint64_t)(sa * esz) | (uint64_t)(lda * esz);
  uint64_t bmask = (uint64_t)(uintptr_t)B0 | (uint64_t)(sb * esz) | (uint64_t)(ldb * esz);
  uint64_t cmask = (uint64_t)(uintptr_t)C0 | (uint64_t)(uintptr_t)R0 | (uint64_t)(sc * esz) | (uint64_t)(ldc * esz);
  if (!folded && nd > 2)
    for (int d = 0; d < bix.ndim; d++) {
      amask |= (uint64_t)(bix.stride[0][d] * esz);
      bmask |= (uint64_t)(bix.stride[1][d] * esz);
      cmask |= (uint64_t)(bix.stride[2][d] * esz);
    }

  /* stored matrices: a transposed view is stored (rows x cols) column-major,
     a row-major one as its transpose (cols x rows) */
  LtProblem q;
  memset(&q, 0, sizeof q);
  q.dtype = wd; q.k = K; q.batch = inner;
  q.align_a = lowest_align(trc == 0 ? bmask : amask);
  q.align_b = lowest_align(trc == 0 ? amask : bmask);
  q.align_c = lowest_align(cmask);
  q.ldc = ldc;
  if (trc == 0) {  /* out^T (N x rows) = b^T a^T */
    q.m = N; q.n = rows;
    q.opa = trb == 1; q.a_rows = trb ? K : N; q.a_cols = trb ? N : K; q.lda = ldb; q.sa = sb;
    q.opb = tra == 1; q.b_rows = tra ? rows : K; q.b_cols = tra ? K : rows; q.ldb = lda; q.sb = sa;
  } else {         /* out (rows x N) = a b */
    q.m = rows; q.n = N;
    q.opa = tra == 0; q.a_rows = tra ? rows : K; q.a_cols = tra ? K : rows; q.lda = lda; q.sa = sa;
    q.opb = trb == 0; q.b_rows = trb ? K : N; q.b_cols = trb ? N : K; q.ldb = ldb; q.sb = sb;
  }
  q.sc = sc;
  if (e.kind != EPI_NONE) {
    /* bias[m] / the GELU input per element of column-major D (m = N, n = rows):
       out must be row-major, one product; the bias gradient of GL_EPI_BGRAD,
       a's sums over K, is cuBLASLt's BGRADB (row-major out: a is its B) or
       BGRADA (transposed out: a is its A) */
    if (inner != 1 || nouter != 1 || (trc != 0 && e.kind != GL_EPI_BGRAD)) return epilogue_unfused(out, a0, b0, e);
    const int has_bias = e.bias != nullptr, has_aux = e.aux != nullptr;
    switch (e.kind) {
      case EPI_BIAS: q.epilogue = CUBLASLT_EPILOGUE_BIAS; break;
      case GL_EPI_GELU:
        q.epilogue = has_bias ? (has_aux ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS)
                              : (has_aux ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU);
        break;
      case GL_EPI_DGELU: q.epilogue = has_bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU; break;
      case GL_EPI_BGRAD:
        if (!has_bias) return epilogue_unfused(out, a0, b0, e);  /* (gl_matmul_epilogue: a plain product then) */
        q.epilogue = trc == 0 ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_BGRADA;
        break;
      default: return gl_error("cuda_matmul: epilogue %d", e.kind);
    }
    if (has_bias) q.align_bias = lowest_align((uint64_t)(uintptr_t)cu_ptr(e.bias));
    if (has_aux) {  /* contiguous (M, N): ld N elements, which cuBLASLt wants a multiple of 8 */
      q.aux_ld = N;
      if (N % 8 != 0) return epilogue_unfused(out, a0, b0, e);
      q.align_aux = lowest_align((uint64_t)(uintptr_t)cu_ptr(e.aux));
    }
  }

  for (int64_t bi = 0; bi < nouter; bi++) {
    int64_t off[3] = {0, 0, 0};
    if (!folded && nd > 2 && bix.ndim > 0) bix.offsets(bi, off);
    const char *pa = A0 + off[0] * esz, *pb = B0 + off[1] * esz;
    const char *p1 = trc == 0 ? pb : pa, *p2 = trc == 0 ? pa : pb;  /* cuBLASLt's A, B */
    int rc = lt_run(dev, st, q, p1, p2, C0 + off[2] * esz, alpha, beta, e.bias ? cu_ptr(e.bias) : nullptr,
                    e.aux ? cu_ptr(e.aux) : nullptr, R0 ? R0 + off[2] * esz : nullptr);
    if (rc == LT_NO_ALGO) {  /* bi == 0: nothing written */
      if (e.kind != EPI_NONE) return epilogue_unfused(out, a0, b0, e);
      if (e.resid) return gl_matmul_add_unfused(out, a0, b0, e.resid);
      return gemm_fallback(st, out, a0, b0, alpha, beta);
    }
    GL_TRY(rc);
  }
  if (o != out) GL_TRY(cuda_copy(out, o));
  return GL_OK;
}

extern "C" int cuda_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta) {
  return matmul_impl(out, a, b, alpha, beta, MatEpi());
}

extern "C" int cuda_matmul_add(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c) {
  MatEpi e;
  e.resid = c;
  return matmul_impl(out, a, b, 1, 1, e);
}

extern "C" int cuda_matmul_bias(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *bias) {
  MatEpi e;
  e.kind = EPI_BIAS; e.bias = bias;
  return matmul_impl(out, a, b, 1, 0, e);
}

/* GL_CUDA_RELU2_GEMM=0: the ReLU² products on cuBLASLt and the passes,
   not kernels/gemm_mma.cu, for a GPU where our mma.sync GEMM turns out
   slower than cuBLASLt plus the passes (kernels/README.md: it must reach about
   46% of the dense peak to win).  Read at each call (a getenv is nothing
   beside a launch), so a process may switch. */
static bool relu2_gemm_on() {
  const char *e = getenv("GL_CUDA_RELU2_GEMM");
  return !(e && strcmp(e, "0") == 0);
}

extern "C" int cuda_matmul_epilogue(int epi, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias,
                                    gl_tensor *aux) {
  if (epi == GL_EPI_RELU2 || epi == GL_EPI_DRELU2) {
    /* cuBLASLt has no ReLU² epilogue: our own GEMM (kernels/gemm_mma.cu) where
       it takes the operands, else cuBLASLt's product and the passes after it */
    int rc = force_fallback() || !relu2_gemm_on() ? 1
           : cuda_gemm_mma_epilogue(epi, out, a, b, epi == GL_EPI_RELU2 ? bias : nullptr, aux);
    if (rc == 1) return epilogue_unfused(out, a, b, MatEpi{epi, bias, aux, nullptr});
    GL_TRY(rc);
    return epi == GL_EPI_DRELU2 ? gl_epilogue_bgrad(epi, out, a, bias) : GL_OK;
  }
  MatEpi e;
  e.kind = epi; e.bias = bias; e.aux = aux;
  return matmul_impl(out, a, b, 1, 0, e);
}
