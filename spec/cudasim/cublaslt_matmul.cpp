/* cublaslt_matmul.cpp — the simulated cuBLASLt's cublasLtMatmul: its checks,
 * and the product as stream work, over OpenBLAS.
 *
 * Part of the simulator's cuBLASLt (cublaslt.cpp: the overview, with the
 * numerics and every choice made where the real library leaves room, and
 * the objects; cublaslt_heuristic.cpp: the validation and the algorithm;
 * shared declarations in cublaslt_internal.h).  cublasLtMatmul validates
 * the problem again (make_problem), holds the host-visible arguments against
 * its algorithm and queues a Job on the stream; run_job checks the device
 * extents and the bias / aux alignment there (the faults a kernel would
 * raise), then widens the operands into host buffers, calls cblas_sgemm /
 * cblas_dgemm, runs the epilogue and rounds once on the store. */
#include "cublaslt_internal.h"
#include "cuda_fp8.h"
#include <cblas.h>
#include <stdio.h>
#include <string.h>
#include <algorithm>
#include <cmath>
#include <vector>

using namespace gl_sim_lt;

/* ---- numbers: bit-level conversions ------------------------------------- */
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
/* round to nearest even; NaN stays a (quiet) NaN */
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  /* inf, NaN */
  if (exp == 0) {  /* zero and subnormals: man * 2^-24, exact in float */
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}
/* drops `shift` low bits of v rounding to nearest even */
static inline uint32_t shift_rne(uint32_t v, int shift) {
  uint32_t kept = v >> shift, rest = v & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1))) kept++;
  return kept;
}
/* round to nearest even, overflow to infinity, subnormals kept */
static inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((u >> 13) & 0x3ff));  /* NaN */
  if (u >= 0x47800000u) return (uint16_t)(sign | 0x7c00);  /* >= 65536 and inf */
  int exp = (int)(u >> 23) - 127;
  uint32_t man = (u & 0x7fffffu) | 0x800000u;
  if (exp < -14) {  /* a half subnormal: units of 2^-24 */
    int shift = -1 - exp;  /* float value = man * 2^(exp - 23) */
    if (shift > 24) return (uint16_t)sign;
    return (uint16_t)(sign | shift_rne(man, shift));  /* may round up into the smallest normal */
  }
  /* normal: 13 fraction bits dropped; a carry moves into the exponent (and
     from 65520 up into infinity) */
  uint32_t h = ((uint32_t)(exp + 15) << 10) + (shift_rne(man, 13) - 0x400);
  return (uint16_t)(sign | h);
}

/* tf32: 10 fraction bits, nearest with ties away from zero (cvt.rna.tf32.f32) */
static inline float round_tf32(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  u = (u + 0x1000u) & 0xffffe000u;
  return bits_f32(u);
}

/* element i of a matrix of `type` as the compute type */
template <class T> static inline T load_elem(const char *p, int type, int64_t i) {
  switch (type) {
    case CUDA_R_32F: return (T)((const float *)p)[i];
    case CUDA_R_64F: return (T)((const double *)p)[i];
    case CUDA_R_16BF: return (T)bf16_to_f32(((const uint16_t *)p)[i]);
    case CUDA_R_16F: return (T)f16_to_f32(((const uint16_t *)p)[i]);
    case CUDA_R_8F_E4M3: return (T)gl_sim_num::fp8_value(((const uint8_t *)p)[i], __NV_E4M3);
    case CUDA_R_8F_E5M2: return (T)gl_sim_num::fp8_value(((const uint8_t *)p)[i], __NV_E5M2);
  }
  return (T)0;
}
/* stores v rounded once to `type` (from double only for 64F: no double rounding) */
template <class T> static inline void store_elem(char *p, int type, int64_t i, T v) {
  switch (type) {
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    case CUDA_R_64F: ((double *)p)[i] = (double)v; break;
    case CUDA_R_16BF: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    case CUDA_R_16F: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
  }
}

/* rows x cols (leading dimension ld) of device memory -> packed column-major host buffer */
template <class T> static void load_matrix(std::vector<T> &dst, const char *src, int type, int64_t rows, int64_t cols,
                                           int64_t ld, int rounding) {
  dst.resize((size_t)(rows * cols));
  for (int64_t j = 0; j < cols; j++)
    for (int64_t i = 0; i < rows; i++) dst[(size_t)(i + j * rows)] = load_elem<T>(src, type, i + j * ld);
  if (rounding == ROUND_NONE) return;
  for (T &v : dst) {
    float f = (float)v;
    if (rounding == ROUND_TF32) f = round_tf32(f);
    else if (rounding == ROUND_BF16) f = bf16_to_f32(f32_to_bf16(f));
    else f = f16_to_f32(f32_to_f16(f));
    v = (T)f;
  }
}

static void gemm(int ta, int tb, int m, int n, int k, float alpha, const float *A, int lda, const float *B, int ldb,
                 float beta, float *C, int ldc) {
  cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A, lda, B,
              ldb, beta, C, ldc);
}
static void gemm(int ta, int tb, int m, int n, int k, double alpha, const double *A, int lda, const double *B, int ldb,
                 double beta, double *C, int ldc) {
  cblas_dgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A, lda, B,
              ldb, beta, C, ldc);
}

/* GELU, tanh approximation, and its derivative */
template <class T> static inline T gelu(T x) {
  const T c = (T)0.7978845608028654, a = (T)0.044715;
  return (T)0.5 * x * ((T)1 + std::tanh(c * (x + a * x * x * x)));
}
template <class T> static inline T gelu_grad(T x) {
  const T c = (T)0.7978845608028654, a = (T)0.044715;
  T t = std::tanh(c * (x + a * x * x * x));
  return (T)0.5 * ((T)1 + t) + (T)0.5 * x * ((T)1 - t * t) * c * ((T)1 + (T)3 * a * x * x);
}

/* ---- the work -------------------------------------------------------------- */
struct Job {
  Problem q;
  SimAlgo algo;
  const char *A, *B, *C;
  char *D;
  double alpha, beta;
  char *workspace;
};

static int64_t mat_bytes(const Mat &x, int64_t batch) {
  if (x.rows == 0 || x.cols == 0) return 0;
  int64_t last = (batch - 1) * x.stride + (x.cols - 1) * x.ld + (x.rows - 1);
  return (last + 1) * type_size(x.type);
}

/* Whether [p, p + bytes) lies inside one live device allocation; records
   the sticky error a GPU would raise (the kernel's access faults) if not. */
static bool check_extent(const char *what, const void *p, int64_t bytes) {
  if (bytes <= 0) return true;
  void *base = NULL;
  size_t size = 0;
  int dev = 0;
  if (!gl_sim_find_alloc(p, &base, &size, &dev)) {
    gl_sim_fail(cudaErrorIllegalAddress, "cublasLtMatmul: %s at %p is not device memory", what, p);
    return false;
  }
  const char *end = (const char *)p + bytes, *alloc_end = (const char *)base + size;
  if (end > alloc_end) {
    gl_sim_fail(cudaErrorIllegalAddress,
                "cublasLtMatmul: %s at %p spans %lld bytes, %lld past the end of its %zu-byte allocation at %p", what,
                p, (long long)bytes, (long long)(end - alloc_end), size, base);
    return false;
  }
  return true;
}

template <class T> static void compute(const Job &j) {
  const Problem &q = j.q;
  const int64_t m = q.m, n = q.n, k = q.k;
  const int ea = type_size(q.a.type), eb = type_size(q.b.type), ec = type_size(q.c.type), ed = type_size(q.d.type);
  const int eaux = q.aux ? type_size(q.aux_type) : 0, ebias = q.bias ? type_size(q.bias_type) : 0;
  const T alpha = (T)j.alpha, beta = (T)j.beta;
  std::vector<T> a, b, acc, bias, aux;
  std::vector<T> grad;  /* bias gradients, accumulated in the compute type */
  for (int64_t bi = 0; bi < q.batch; bi++) {
    load_matrix(a, j.A + bi * q.a.stride * ea, q.a.type, q.a.rows, q.a.cols, q.a.ld, q.rounding);
    load_matrix(b, j.B + bi * q.b.stride * eb, q.b.type, q.b.rows, q.b.cols, q.b.ld, q.rounding);
    if (j.beta != 0) load_matrix(acc, j.C + bi * q.c.stride * ec, q.c.type, m, n, q.c.ld, ROUND_NONE);
    else acc.assign((size_t)(m * n), (T)0);
    if (k > 0)
      gemm(q.ta, q.tb, (int)m, (int)n, (int)k, alpha, a.data(), (int)std::max<int64_t>(1, q.a.rows), b.data(),
           (int)std::max<int64_t>(1, q.b.rows), beta, acc.data(), (int)std::max<int64_t>(1, m));
    else
      for (T &v : acc) v *= beta;

    const char *bias_p = q.bias ? (const char *)q.bias + bi * q.bias_stride * ebias : NULL;
    char *aux_p = q.aux ? (char *)q.aux + bi * q.aux_stride * eaux : NULL;
    if (q.bias_in) {
      bias.resize((size_t)m);
      for (int64_t i = 0; i < m; i++) bias[(size_t)i] = load_elem<T>(bias_p, q.bias_type, i);
    }
    if (q.dgelu) load_matrix(aux, aux_p, q.aux_type, m, n, q.aux_ld, ROUND_NONE);
    if (q.bgrad_rows) grad.assign((size_t)m, (T)0);
    for (int64_t c = 0; c < n; c++)
      for (int64_t r = 0; r < m; r++) {
        T x = acc[(size_t)(r + c * m)];
        if (q.bias_in) x += bias[(size_t)r];
        if (q.aux_out) store_elem<T>(aux_p, q.aux_type, r + c * q.aux_ld, x);
        if (q.relu) x = std::fmax(x, (T)0);
        if (q.gelu) x = gelu(x);
        if (q.dgelu) x *= gelu_grad(aux[(size_t)(r + c * m)]);
        if (q.bgrad_rows) grad[(size_t)r] += x;
        acc[(size_t)(r + c * m)] = x;
      }
    char *d = j.D + bi * q.d.stride * ed;
    for (int64_t c = 0; c < n; c++)
      for (int64_t r = 0; r < m; r++) store_elem<T>(d, q.d.type, r + c * q.d.ld, acc[(size_t)(r + c * m)]);

    /* bias gradients: sums over k of op(A)'s rows or op(B)'s columns */
    if (q.bgrada) {
      grad.assign((size_t)m, (T)0);
      for (int64_t r = 0; r < m; r++)
        for (int64_t kk = 0; kk < k; kk++) grad[(size_t)r] += q.ta ? a[(size_t)(kk + r * k)] : a[(size_t)(r + kk * m)];
    }
    if (q.bgradb) {
      grad.assign((size_t)n, (T)0);
      for (int64_t c = 0; c < n; c++)
        for (int64_t kk = 0; kk < k; kk++) grad[(size_t)c] += q.tb ? b[(size_t)(c + kk * n)] : b[(size_t)(kk + c * k)];
    }
    if (q.bgrad_rows || q.bgrada || q.bgradb)
      for (size_t i = 0; i < grad.size(); i++) store_elem<T>((char *)bias_p, q.bias_type, (int64_t)i, grad[i]);
  }
}

/* The account's quick mode (account.cpp, gl_sim_account_skip_products):
   what the product writes — D, the epilogue's aux matrix and bias gradient
   — gets a fixed pattern instead of the product's values: small finite
   numbers in [-1/32, 1/32), never zero, so that whatever reads them
   (norms, softmax, the gradient clip, Newton-Schulz's normalisation) sees
   ordinary values and takes the path a real step takes.  O(mn) per batch
   where the product is O(mnk). */
static inline double pattern(int64_t i) {
  return (double)((int)(((uint64_t)i * 2654435761u) >> 24 & 255) - 128) / 4096.0 + 1.0 / 8192.0;
}
template <class T> static void fill_pattern(const Job &j) {
  const Problem &q = j.q;
  const int ed = type_size(q.d.type), eaux = q.aux ? type_size(q.aux_type) : 0;
  const int ebias = q.bias ? type_size(q.bias_type) : 0;
  for (int64_t bi = 0; bi < q.batch; bi++) {
    char *d = j.D + bi * q.d.stride * ed;
    for (int64_t c = 0; c < q.n; c++)
      for (int64_t r = 0; r < q.m; r++) store_elem<T>(d, q.d.type, r + c * q.d.ld, (T)pattern(r + c * q.m));
    if (q.aux_out) {
      char *aux_p = (char *)q.aux + bi * q.aux_stride * eaux;
      for (int64_t c = 0; c < q.n; c++)
        for (int64_t r = 0; r < q.m; r++) store_elem<T>(aux_p, q.aux_type, r + c * q.aux_ld, (T)pattern(r + c * q.m + 1));
    }
    if (q.bgrad_rows || q.bgrada || q.bgradb) {
      char *bias_p = (char *)q.bias + bi * q.bias_stride * ebias;
      for (int64_t i = 0, len = q.bgradb ? q.n : q.m; i < len; i++) store_elem<T>(bias_p, q.bias_type, i, (T)pattern(i + 2));
    }
  }
}

/* The account's figures for one matmul (account.cpp): 2mnk per batch plus
   one FLOP per output element for each epilogue step; each operand moved
   once (a batch-shared operand, stride 0, once), which is the least the
   library can move.  Named by types, transposes and epilogue, not shapes,
   so that a kernel's row is the same at every problem size. */
static void account_job(const Job &j) {
  const Problem &q = j.q;
  auto bytes = [&](const Mat &x) {
    return (double)x.rows * (double)x.cols * (x.stride == 0 ? 1.0 : (double)q.batch) * type_size(x.type);
  };
  double mn = (double)q.m * (double)q.n * (double)q.batch, vec = (double)q.batch * type_size(q.bias_type);
  double flops = 2.0 * mn * (double)q.k, read = bytes(q.a) + bytes(q.b), written = bytes(q.d);
  if (j.beta != 0) { read += bytes(q.c); flops += mn; }
  if (q.bias_in) { read += (double)q.m * vec; flops += mn; }
  if (q.relu || q.gelu) flops += mn;
  if (q.aux_out) written += mn * type_size(q.aux_type);
  if (q.dgelu) { read += mn * type_size(q.aux_type); flops += mn; }
  if (q.bgrad_rows) { written += (double)q.m * vec; flops += mn; }
  if (q.bgrada) { written += (double)q.m * vec; flops += (double)q.m * (double)q.k * (double)q.batch; }
  if (q.bgradb) { written += (double)q.n * vec; flops += (double)q.n * (double)q.k * (double)q.batch; }
  const char *epi = epilogue_name(q.epilogue);
  const char *prefix = "CUBLASLT_EPILOGUE_";
  if (epi && !strncmp(epi, prefix, strlen(prefix))) epi += strlen(prefix);
  char name[128];
  snprintf(name, sizeof name, "cublasLt %s %c%c%s%s", type_name(q.a.type) + strlen("CUDA_R_"), q.ta ? 'T' : 'N',
           q.tb ? 'T' : 'N', q.epilogue == CUBLASLT_EPILOGUE_DEFAULT ? "" : " ",
           q.epilogue == CUBLASLT_EPILOGUE_DEFAULT ? "" : epi);
  gl_sim_account_add(name, flops, read, written);
}

static void run_job(const Job &j) {
  const Problem &q = j.q;
  if (q.m == 0 || q.n == 0) return;
  account_job(j);
  if (!check_extent("A", j.A, mat_bytes(q.a, q.batch)) || !check_extent("B", j.B, mat_bytes(q.b, q.batch)) ||
      (j.beta != 0 && !check_extent("C", j.C, mat_bytes(q.c, q.batch))) ||
      !check_extent("D", j.D, mat_bytes(q.d, q.batch)))
    return;
  if (q.bias) {
    Mat v = {q.bias_type, q.bias_len, 1, q.bias_len, q.bias_stride};
    if (!check_extent("the bias vector", q.bias, mat_bytes(v, q.batch))) return;
    if ((uintptr_t)q.bias % j.algo.bias_align) {
      gl_sim_fail(cudaErrorMisalignedAddress,
                  "cublasLtMatmul: bias vector at %p is not %u-byte aligned as it was when the algorithm was chosen",
                  q.bias, j.algo.bias_align);
      return;
    }
  }
  if (q.aux) {
    Mat v = {q.aux_type, q.m, q.n, q.aux_ld, q.aux_stride};
    if (!check_extent("the epilogue aux matrix", q.aux, mat_bytes(v, q.batch))) return;
    if ((uintptr_t)q.aux % j.algo.aux_align) {
      gl_sim_fail(cudaErrorMisalignedAddress,
                  "cublasLtMatmul: aux matrix at %p is not %u-byte aligned as it was when the algorithm was chosen",
                  q.aux, j.algo.aux_align);
      return;
    }
  }
  if (j.algo.workspace > 0) {
    if (!check_extent("the workspace", j.workspace, (int64_t)j.algo.workspace)) return;
    /* the algorithm's scratch: its first and last 4 KiB are overwritten
       (not all of it: every page touched costs a fault in the runtime's
       access checks), enough for data kept there, or a workspace shared
       by unordered streams, to show */
    size_t ws = (size_t)j.algo.workspace, part = std::min<size_t>(ws, 4096);
    memset(j.workspace, 0xcb, part);
    memset(j.workspace + ws - part, 0xcb, part);
  }
  if (gl_sim_account_skips_products()) {
    if (q.f64) fill_pattern<double>(j);
    else fill_pattern<float>(j);
  } else if (q.f64) compute<double>(j);
  else if (q.fp8) {  /* the scales, read on the device as the kernel would, fold into alpha (float) */
    Job s = j;
    float alpha = (float)j.alpha;
    const void *scales[2] = {q.a_scale, q.b_scale};
    for (const void *p : scales) {
      if (!p) continue;
      if (!check_extent("an FP8 scale", p, 4)) return;
      alpha *= *(const float *)p;
    }
    s.alpha = alpha;
    compute<float>(s);
  } else compute<float>(j);
}

static bool same_layout(const Mat &x, const Mat &y) {
  return x.type == y.type && x.rows == y.rows && x.cols == y.cols && x.ld == y.ld && x.stride == y.stride;
}

extern "C" cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha,
                                         const void *A, cublasLtMatrixLayout_t Adesc, const void *B,
                                         cublasLtMatrixLayout_t Bdesc, const void *beta, const void *C,
                                         cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
                                         const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspace_bytes,
                                         cudaStream_t stream) {
  const char *fn = "cublasLtMatmul";
  CHECK_HANDLE(fn, h);
  CHECK_OBJ(fn, "computeDesc", desc, OBJ_DESC);
  CHECK_OBJ(fn, "Adesc", Adesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Bdesc", Bdesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Cdesc", Cdesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Ddesc", Ddesc, OBJ_LAYOUT);
  Job j;
  cublasStatus_t st = make_problem(fn, desc, Adesc, Bdesc, Cdesc, Ddesc, &j.q);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const Problem &q = j.q;
  if (!alpha || !beta) return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: alpha or beta is NULL", fn);
  /* host pointer mode: read now, as the real library does */
  if (q.f64) { j.alpha = *(const double *)alpha; j.beta = *(const double *)beta; }
  else { j.alpha = *(const float *)alpha; j.beta = *(const float *)beta; }
  bool empty = q.m == 0 || q.n == 0;
  if (!empty && (!A || !B || !D || (j.beta != 0 && !C)))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: A %p, B %p, C %p, D %p: a matrix the product reads is NULL", fn, A,
                  B, C, (void *)D);
  if (C == D && C && !same_layout(q.c, q.d))
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: C == D (in place) with different layouts (ld %lld vs %lld, batch stride %lld vs %lld)", fn,
                  (long long)q.c.ld, (long long)q.d.ld, (long long)q.c.stride, (long long)q.d.stride);
  if ((q.bias_in || q.bgrad_rows || q.bgrada || q.bgradb) && !q.bias && !empty)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s needs CUBLASLT_MATMUL_DESC_BIAS_POINTER", fn,
                  epilogue_name(q.epilogue));
  if ((q.aux_out || q.dgelu) && !q.aux && !empty)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s needs CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", fn,
                  epilogue_name(q.epilogue));

  /* the algorithm: the heuristic's, or (NULL) the one the library would pick
     for these pointers and this workspace */
  const Mat *ms[4] = {&q.a, &q.b, &q.c, &q.d};
  const void *ptrs[4] = {A, B, C, D};
  if (algo) {
    if (!algo_unpack(algo, &j.algo))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: algo was not returned by cublasLtMatmulAlgoGetHeuristic", fn);
    if (j.algo.atype != q.a.type || j.algo.dtype != q.d.type || j.algo.compute != q.compute ||
        j.algo.epilogue != q.epilogue)
      return refuse(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: algo was found for %s x %s -> %s with %s, called with %s x %s -> %s with %s", fn,
                    type_name(j.algo.atype), type_name(j.algo.atype), type_name(j.algo.dtype),
                    epilogue_name(j.algo.epilogue) ? epilogue_name(j.algo.epilogue) : "?", type_name(q.a.type),
                    type_name(q.b.type), type_name(q.d.type), epilogue_name(q.epilogue));
  } else {
    memset(&j.algo, 0, sizeof j.algo);
    for (int i = 0; i < 4; i++) j.algo.align[i] = matrix_align((uint64_t)(uintptr_t)ptrs[i], *ms[i], q.batch);
    j.algo.bias_align = (uint32_t)lowest_pow2((uint64_t)(uintptr_t)q.bias, MAX_VECTOR_ALIGN);
    j.algo.aux_align = (uint32_t)lowest_pow2((uint64_t)(uintptr_t)q.aux, MAX_VECTOR_ALIGN);
    j.algo.workspace = std::min<uint64_t>(workspace_bytes, WORKSPACE_NEED);
  }
  if (workspace_bytes < j.algo.workspace)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: workspaceSizeInBytes %zu, the algorithm needs %llu", fn,
                  workspace_bytes, (unsigned long long)j.algo.workspace);
  if (j.algo.workspace > 0 && !workspace)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: workspace is NULL, the algorithm needs %llu bytes", fn,
                  (unsigned long long)j.algo.workspace);
  const char *names = "ABCD";
  for (int i = 0; i < 4; i++) {
    if (!ptrs[i] || j.algo.align[i] == 0) continue;
    if ((uintptr_t)ptrs[i] % j.algo.align[i])
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED,
                    "%s: %c at %p is not %u-byte aligned, the alignment its algorithm was chosen for "
                    "(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES)",
                    fn, names[i], ptrs[i], j.algo.align[i], names[i]);
  }
  /* a context with a sticky error runs nothing more */
  if (gl_sim_sticky() != cudaSuccess)
    return refuse(CUBLAS_STATUS_EXECUTION_FAILED, "%s: the device context has a sticky error (%d)", fn,
                  (int)gl_sim_sticky());
  j.A = (const char *)A;
  j.B = (const char *)B;
  j.C = (const char *)C;
  j.D = (char *)D;
  j.workspace = (char *)workspace;
  gl_sim_submit(stream, "cublasLtMatmul", [j] { run_job(j); });
  return CUBLAS_STATUS_SUCCESS;
}
