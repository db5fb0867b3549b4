/* cublaslt.cu — checks of the simulator's cuBLASLt (spec/cudasim/cublaslt*.cpp),
 * called from spec/sim_cublaslt_spec.lua through LuaJIT's ffi
 * (build/sim/libgptlua_simtest.so).
 *
 *  gl_simtest_lt_run       one product (types, ops, batch, lds, offsets,
 *                          alpha / beta, epilogue) through the public API on
 *                          device memory, against a double-precision host
 *                          loop: the error relative to a bound derived from
 *                          the operands' magnitudes, and in "exact" mode
 *                          (small integers: every fp32 sum exact) the
 *                          output bits against the correctly rounded value;
 *                          writes outside D's layout are counted.
 *
 * The misuses (gl_simtest_lt_refusal, _attributes, _fault) are
 * cublaslt_misuse.cu's.
 *
 * The rounding and bf16 / fp16 encoding here are written independently of
 * cublaslt_matmul.cpp's bit-level helpers (frexp / ldexp / nearbyint), so the two
 * check each other. */
#include "simtest.h"
#include <cublasLt.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>

extern "C" {
typedef struct gl_simtest_lt_case {
  int atype, dtype, compute;        /* cudaDataType of A/B and C/D, cublasComputeType_t */
  int opa, opb;                     /* cublasOperation_t */
  int m, n, k, batch;
  int pad_a, pad_b, pad_c, pad_d;   /* ld = rows + pad */
  int gap;                          /* extra elements between batches */
  int offset;                       /* elements every matrix starts past its allocation's start */
  int a_shared;                     /* A's batch stride 0 (one A for every batch) */
  int interleave_d;                 /* D (and C) batches interleaved: ld = m * batch, stride m */
  int in_place;                     /* C == D */
  int epilogue;                     /* cublasLtEpilogue_t */
  int bias_type;                    /* -1: D's type */
  int bias_batched;                 /* bias input with its own vector per batch */
  int exact;                        /* small-integer inputs: outputs must be correctly rounded */
  int no_algo;                      /* pass algo = NULL to cublasLtMatmul */
  double alpha, beta;
  unsigned seed;
} gl_simtest_lt_case;

typedef struct gl_simtest_lt_result {
  int heuristic_status, found, matmul_status, sync_error;
  double err;            /* max |got - ref| / bound over D (<= 1 passes) */
  double aux_err;        /* the same for the GELU_AUX output */
  double bias_err;       /* the same for a bias gradient */
  long long mismatches;  /* exact mode: elements not equal to the correctly rounded value */
  long long outside;     /* elements outside D's layout (or the aux / bias extents) that changed */
  double fast_dev;       /* FAST modes: max |got - exact fp32-input product| / magnitude */
  char message[256];
} gl_simtest_lt_result;

int gl_simtest_lt_run(const gl_simtest_lt_case *c, gl_simtest_lt_result *r);
}

/* ---- numbers, independent of cublaslt_matmul.cpp --------------------------- */
static int tsize(int t) { return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2; }

/* significand bits, smallest normal exponent, largest finite of a type */
static void type_format(int t, int *p, int *emin, double *maxv) {
  switch (t) {
    case CUDA_R_16BF: *p = 8; *emin = -126; *maxv = ldexp(255.0, 120); break;
    case CUDA_R_16F: *p = 11; *emin = -14; *maxv = 65504.0; break;
    case CUDA_R_32F: *p = 24; *emin = -126; *maxv = (double)3.4028234663852886e38; break;
    default: *p = 53; *emin = -1022; *maxv = 1.7976931348623157e308; break;
  }
}

/* x rounded to p significand bits (exponent >= emin, subnormals below),
   ties to even (ties away when `away`), overflow to infinity */
static double round_bits(double x, int p, int emin, double maxv, bool away) {
  if (x == 0 || !isfinite(x)) return x;
  int e;
  frexp(x, &e);
  int lead = std::max(e - 1, emin);
  double q = ldexp(1.0, lead - (p - 1));
  double v = x / q;
  double r = (away ? round(v) : nearbyint(v)) * q;
  if (fabs(r) > maxv) return copysign(INFINITY, x);
  return r;
}
static double round_to(double x, int t) {
  int p, emin;
  double maxv;
  type_format(t, &p, &emin, &maxv);
  return p == 53 ? x : round_bits(x, p, emin, maxv, false);
}

static uint16_t f16_encode(double x) {  /* x representable in fp16 */
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  double a = fabs(x);
  if (isnan(x)) return 0x7e00;
  if (isinf(x)) return sign | 0x7c00;
  if (a == 0) return sign;
  int e;
  double f = frexp(a, &e);  /* a = f 2^e, f in [0.5, 1) */
  int biased = e - 1 + 15;
  if (biased >= 1) return (uint16_t)(sign | biased << 10 | (int)((f * 2 - 1) * 1024));
  return (uint16_t)(sign | (int)(a / ldexp(1.0, -24)));
}
static double f16_decode(uint16_t h) {
  int e = (h >> 10) & 31, man = h & 1023;
  double v = e == 31 ? (man ? NAN : INFINITY) : e == 0 ? ldexp(man, -24) : ldexp(1024 + man, e - 25);
  return (h & 0x8000) ? -v : v;
}

static void put(void *buf, int t, int64_t i, double x) {  /* x representable in t */
  switch (t) {
    case CUDA_R_64F: ((double *)buf)[i] = x; break;
    case CUDA_R_32F: ((float *)buf)[i] = (float)x; break;
    case CUDA_R_16BF: {
      float f = (float)x;
      uint32_t u;
      memcpy(&u, &f, 4);
      ((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
      break;
    }
    case CUDA_R_16F: ((uint16_t *)buf)[i] = f16_encode(x); break;
  }
}
static double get(const void *buf, int t, int64_t i) {
  switch (t) {
    case CUDA_R_64F: return ((const double *)buf)[i];
    case CUDA_R_32F: return ((const float *)buf)[i];
    case CUDA_R_16BF: {
      uint32_t u = (uint32_t)((const uint16_t *)buf)[i] << 16;
      float f;
      memcpy(&f, &u, 4);
      return f;
    }
    case CUDA_R_16F: return f16_decode(((const uint16_t *)buf)[i]);
  }
  return 0;
}
static bool same_bits(const void *x, const void *y, int t, int64_t i) {
  return memcmp((const char *)x + i * tsize(t), (const char *)y + i * tsize(t), (size_t)tsize(t)) == 0;
}

struct Rng {
  uint64_t s;
  double uniform() {  /* [0, 1) */
    s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
    return (double)((s * 0x2545F4914F6CDD1Dull) >> 11) / 9007199254740992.0;
  }
  int integer(int lo, int hi) { return lo + (int)(uniform() * (hi - lo + 1)); }
};

static double gelu(double x) { return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double gelu_grad(double x) {
  double c = 0.7978845608028654, a = 0.044715, t = tanh(c * (x + a * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x);
}

/* ---- device buffers ---------------------------------------------------------- */
/* A matrix operand: host image of the whole allocation and its device copy. */
struct Buf {
  int type = CUDA_R_32F;
  int64_t elems = 0;       /* elements in the allocation */
  std::vector<char> host;
  void *dev = nullptr;
  char *at(int64_t off) const { return (char *)dev + off * tsize(type); }
  void init(int t, int64_t n) {
    type = t;
    elems = std::max<int64_t>(n, 1);
    host.assign((size_t)(elems * tsize(t)), (char)0xff);  /* 0xff..: NaN in every float type */
  }
  bool upload() {
    if (cudaMalloc(&dev, host.size()) != cudaSuccess) return false;
    return cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess;
  }
  bool download(std::vector<char> &out) const {
    out.resize(host.size());
    return cudaMemcpy(out.data(), dev, host.size(), cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  ~Buf() { if (dev) cudaFree(dev); }
};

static int64_t extent(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (rows == 0 || cols == 0) return 0;
  return (batch - 1) * stride + (cols - 1) * ld + rows;
}

static uint32_t pointer_align(const void *p) {
  uint32_t a = 256;
  while (a > 1 && ((uintptr_t)p & (a - 1))) a >>= 1;
  return a;
}

#define FAIL(...) do { snprintf(r->message, sizeof r->message, __VA_ARGS__); return 1; } while (0)

/* Runs one product through the public API: 0 when it ran and r holds the
   comparison, 1 (with r->message) when the harness itself failed. */
extern "C" int gl_simtest_lt_run(const gl_simtest_lt_case *c, gl_simtest_lt_result *r) {
  memset(r, 0, sizeof *r);
  const int64_t m = c->m, n = c->n, k = c->k, nb = std::max(1, c->batch);
  const int at = c->atype, dt = c->dtype;
  const bool f64 = c->compute == CUBLAS_COMPUTE_64F || c->compute == CUBLAS_COMPUTE_64F_PEDANTIC;
  const uint32_t ep = (uint32_t)c->epilogue;
  const bool bias_in = ep == CUBLASLT_EPILOGUE_BIAS || ep == CUBLASLT_EPILOGUE_RELU_BIAS ||
                       ep == CUBLASLT_EPILOGUE_GELU_BIAS || ep == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool relu = ep == CUBLASLT_EPILOGUE_RELU || ep == CUBLASLT_EPILOGUE_RELU_BIAS;
  const bool gel = ep == CUBLASLT_EPILOGUE_GELU || ep == CUBLASLT_EPILOGUE_GELU_BIAS ||
                   ep == CUBLASLT_EPILOGUE_GELU_AUX || ep == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool aux_out = ep == CUBLASLT_EPILOGUE_GELU_AUX || ep == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
  const bool dgelu = ep == CUBLASLT_EPILOGUE_DGELU || ep == CUBLASLT_EPILOGUE_DGELU_BGRAD;
  const bool bgrad_rows = ep == CUBLASLT_EPILOGUE_DGELU_BGRAD, bgrada = ep == CUBLASLT_EPILOGUE_BGRADA,
             bgradb = ep == CUBLASLT_EPILOGUE_BGRADB;
  const bool writes_bias = bgrad_rows || bgrada || bgradb;
  const int bias_t = c->bias_type == -1 ? dt : c->bias_type;
  /* FAST modes: the product of inputs rounded to the narrower type */
  const int in_round = c->compute == CUBLAS_COMPUTE_32F_FAST_16BF ? CUDA_R_16BF
                       : c->compute == CUBLAS_COMPUTE_32F_FAST_16F ? CUDA_R_16F
                                                                     : -1;
  const bool tf32 = c->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  auto input_value = [&](double v) {
    if (in_round >= 0) return round_to(v, in_round);
    if (tf32) return round_bits(v, 11, -126, 3.4e38, true);
    return v;
  };

  /* layouts (column-major, as cuBLASLt sees them) */
  const int64_t arows = c->opa ? k : m, acols = c->opa ? m : k, brows = c->opb ? n : k, bcols = c->opb ? k : n;
  const int64_t lda = std::max<int64_t>(arows, 1) + c->pad_a, ldb = std::max<int64_t>(brows, 1) + c->pad_b;
  int64_t ldc = std::max<int64_t>(m, 1) + c->pad_c, ldd = std::max<int64_t>(m, 1) + c->pad_d;
  int64_t sa = nb > 1 ? (c->a_shared ? 0 : lda * acols + c->gap) : 0, sb = nb > 1 ? ldb * bcols + c->gap : 0;
  int64_t sc = nb > 1 ? ldc * n + c->gap : 0, sd = nb > 1 ? ldd * n + c->gap : 0;
  if (c->interleave_d) { ldd = ldc = m * nb + c->pad_d; sd = sc = m; }
  if (c->in_place) { ldc = ldd; sc = sd; }
  const int64_t off = c->offset;

  Rng rng{0x9E3779B97F4A7C15ull ^ ((uint64_t)c->seed * 0x100000001B3ull) ^ 1};
  auto draw = [&](int t, bool wide) {
    if (c->exact) return (double)(wide ? rng.integer(-8, 8) : rng.integer(-4, 4));
    return round_to(rng.uniform() * 2 - 1, t);
  };

  Buf A, B, C, D, bias, aux, ws;
  A.init(at, off + extent(arows, acols, lda, sa, nb));
  B.init(at, off + extent(brows, bcols, ldb, sb, nb));
  D.init(dt, off + extent(m, n, ldd, sd, nb));
  if (!c->in_place) C.init(dt, off + extent(m, n, ldc, sc, nb));
  Buf &Cb = c->in_place ? D : C;
  for (int64_t bi = 0; bi < nb; bi++) {
    for (int64_t j = 0; j < acols; j++)
      for (int64_t i = 0; i < arows; i++) put(A.host.data(), at, off + bi * sa + i + j * lda, draw(at, false));
    for (int64_t j = 0; j < bcols; j++)
      for (int64_t i = 0; i < brows; i++) put(B.host.data(), at, off + bi * sb + i + j * ldb, draw(at, false));
    for (int64_t j = 0; j < n; j++)
      for (int64_t i = 0; i < m; i++) put(Cb.host.data(), dt, off + bi * sc + i + j * ldc, draw(dt, true));
  }
  /* the bias vector: an input (length m) or a gradient output (m or n) */
  const int64_t blen = bgradb ? n : m;
  const int64_t bstride = nb > 1 && (writes_bias || c->bias_batched) ? blen + 3 : 0;
  if (bias_in || writes_bias) {
    bias.init(bias_t, off + extent(blen, 1, blen, bstride, nb));
    if (bias_in)
      for (int64_t bi = 0; bi < (bstride ? nb : 1); bi++)
        for (int64_t i = 0; i < m; i++) put(bias.host.data(), bias_t, off + bi * bstride + i, draw(bias_t, false));
  }
  const int64_t aux_ld = (m + 7) / 8 * 8 + 8, aux_stride = nb > 1 ? aux_ld * n : 0;
  if (aux_out || dgelu) {
    aux.init(dt, off + extent(m, n, aux_ld, aux_stride, nb));
    if (dgelu)
      for (int64_t bi = 0; bi < nb; bi++)
        for (int64_t j = 0; j < n; j++)
          for (int64_t i = 0; i < m; i++)
            put(aux.host.data(), dt, off + bi * aux_stride + i + j * aux_ld, round_to(rng.uniform() * 6 - 3, dt));
  }
  const size_t ws_bytes = 1 << 20;
  ws.init(CUDA_R_32F, (int64_t)(ws_bytes / 4));
  for (Buf *b : {&A, &B, &C, &D, &bias, &aux, &ws})
    if (b->elems && !b->host.empty() && !b->upload()) FAIL("cudaMalloc / cudaMemcpy of an operand failed");

  /* the descriptors */
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc, ld;
  cublasLtMatmulPreference_t pref;
  cudaStream_t stream;
  if (cudaStreamCreate(&stream) != cudaSuccess) FAIL("cudaStreamCreate failed");
  cublasLtCreate(&h);
  cublasLtMatmulDescCreate(&desc, (cublasComputeType_t)c->compute, f64 ? CUDA_R_64F : CUDA_R_32F);
  int32_t opa = c->opa, opb = c->opb;
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep);
  if (bias.dev) {
    void *bp = bias.at(off);
    int32_t bt = c->bias_type;
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bstride, sizeof bstride);
  }
  if (aux.dev) {
    void *xp = aux.at(off);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &xp, sizeof xp);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof aux_ld);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &aux_stride,
                                   sizeof aux_stride);
  }
  auto layout = [&](cublasLtMatrixLayout_t *l, int t, int64_t rows, int64_t cols, int64_t ldx, int64_t stride) {
    cublasLtMatrixLayoutCreate(l, (cudaDataType)t, (uint64_t)rows, (uint64_t)cols, ldx);
    int32_t b32 = (int32_t)nb;
    cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &b32, sizeof b32);
    cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride);
  };
  layout(&la, at, arows, acols, lda, sa);
  layout(&lb, at, brows, bcols, ldb, sb);
  layout(&lc, dt, m, n, ldc, sc);
  layout(&ld, dt, m, n, ldd, sd);
  cublasLtMatmulPreferenceCreate(&pref);
  uint64_t max_ws = ws_bytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws);
  void *pa = A.at(off), *pb = B.at(off), *pc = Cb.at(off), *pd = D.at(off);
  const void *ptrs[4] = {pa, pb, pc, pd};
  for (int i = 0; i < 4; i++) {  /* promise what the pointers, lds and strides keep, as kernels/matmul.cu */
    uint32_t al = pointer_align(ptrs[i]);
    cublasLtMatmulPreferenceSetAttribute(pref, (cublasLtMatmulPreferenceAttributes_t)(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES + i),
                                         &al, sizeof al);
  }
  cublasLtMatmulHeuristicResult_t res;
  memset(&res, 0, sizeof res);
  r->heuristic_status = cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, ld, pref, 1, &res, &r->found);
  double alpha32 = 0, beta32 = 0;
  float af = (float)c->alpha, bf = (float)c->beta;
  alpha32 = c->alpha;
  beta32 = c->beta;
  const void *palpha = f64 ? (const void *)&alpha32 : (const void *)&af;
  const void *pbeta = f64 ? (const void *)&beta32 : (const void *)&bf;
  r->matmul_status = -1;
  if (r->heuristic_status == CUBLAS_STATUS_SUCCESS && r->found == 1)
    r->matmul_status = cublasLtMatmul(h, desc, palpha, pa, la, pb, lb, pbeta, pc, lc, pd, ld,
                                      c->no_algo ? NULL : &res.algo, ws.dev, ws_bytes, stream);
  r->sync_error = cudaStreamSynchronize(stream);
  snprintf(r->message, sizeof r->message, "%s", gl_sim_cublaslt_last_message());
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(h);
  cudaStreamDestroy(stream);
  if (r->matmul_status != CUBLAS_STATUS_SUCCESS || r->sync_error != cudaSuccess) return 0;

  std::vector<char> dout, auxout, biasout;
  if (!D.download(dout)) FAIL("cudaMemcpy of D failed");
  if (aux.dev && !aux.download(auxout)) FAIL("cudaMemcpy of aux failed");
  if (bias.dev && !bias.download(biasout)) FAIL("cudaMemcpy of the bias failed");

  /* the reference, per batch, in double */
  const double u_acc = f64 ? ldexp(1.0, -53) : ldexp(1.0, -24);
  int p_out, emin_out;
  double max_out;
  type_format(dt, &p_out, &emin_out, &max_out);
  const double u_out = ldexp(1.0, -p_out), tiny_out = ldexp(1.0, emin_out - p_out + 1);
  std::vector<char> owned_d(dout.size() / tsize(dt), 0), owned_aux(auxout.size() / std::max(1, tsize(dt)), 0);
  std::vector<char> want(16);
  for (int64_t bi = 0; bi < nb; bi++) {
    std::vector<double> grad((size_t)std::max<int64_t>(blen, 0), 0.0), grad_mag((size_t)std::max<int64_t>(blen, 0), 0.0);
    auto opA = [&](int64_t i, int64_t kk) {
      int64_t e = off + bi * sa + (c->opa ? kk + i * lda : i + kk * lda);
      return get(A.host.data(), at, e);
    };
    auto opB = [&](int64_t kk, int64_t j) {
      int64_t e = off + bi * sb + (c->opb ? j + kk * ldb : kk + j * ldb);
      return get(B.host.data(), at, e);
    };
    for (int64_t j = 0; j < n; j++)
      for (int64_t i = 0; i < m; i++) {
        double acc = 0, full = 0, mag = 0;
        for (int64_t kk = 0; kk < k; kk++) {
          double x = opA(i, kk), y = opB(kk, j);
          acc += input_value(x) * input_value(y);
          full += x * y;
          mag += fabs(x * y);
        }
        double cv = c->beta != 0 ? get(Cb.host.data(), dt, off + bi * sc + i + j * ldc) : 0;
        double x = c->alpha * acc + c->beta * cv, xfull = c->alpha * full + c->beta * cv;
        double S = fabs(c->alpha) * mag + fabs(c->beta * cv);
        if (bias_in) {
          double bv = get(bias.host.data(), bias_t, off + (bstride ? bi * bstride : 0) + i);
          x += bv;
          xfull += bv;
          S += fabs(bv);
        }
        const double bx = 2.0 * (double)(k + 4) * u_acc * S;
        int64_t de = off + bi * sd + i + j * ldd;
        owned_d[(size_t)de] = 1;
        if (aux_out) {
          int64_t xe = off + bi * aux_stride + i + j * aux_ld;
          owned_aux[(size_t)xe] = 1;
          double got = get(auxout.data(), dt, xe), bound = bx + u_out * fabs(x) + tiny_out;
          double e = fabs(got - x) / bound;
          r->aux_err = std::max(r->aux_err, e == e ? e : INFINITY);
        }
        double y = x, by = bx, gscale = 1;
        if (relu) y = std::max(x, 0.0);
        if (gel) { y = gelu(x); by = 1.2 * bx + 32 * u_acc * (fabs(x) + fabs(y)); }
        if (dgelu) {
          double g = gelu_grad(get(aux.host.data(), dt, off + bi * aux_stride + i + j * aux_ld));
          y = x * g;
          gscale = std::max(1.0, fabs(g));
          by = bx * gscale + 32 * u_acc * fabs(x) * gscale;
        }
        if (bgrad_rows) { grad[(size_t)i] += y; grad_mag[(size_t)i] += fabs(y) + by; }
        double got = get(dout.data(), dt, de);
        double bound = by + u_out * fabs(y) + tiny_out;
        double yr = round_to(y, dt);  /* an overflow to infinity is the correct rounding */
        double e = isinf(yr) && got == yr ? 0 : fabs(got - y) / bound;
        r->err = std::max(r->err, e == e ? e : INFINITY);
        if ((in_round >= 0 || tf32) && ep == CUBLASLT_EPILOGUE_DEFAULT)
          r->fast_dev = std::max(r->fast_dev, fabs(got - xfull) / std::max(S, 1e-300));
        if (c->exact) {
          put(want.data(), dt, 0, round_to(y, dt));
          if (!same_bits(want.data(), dout.data() + de * tsize(dt), dt, 0)) r->mismatches++;
        }
      }
    if (bgrada || bgradb)
      for (int64_t i = 0; i < blen; i++)
        for (int64_t kk = 0; kk < k; kk++) {
          double v = input_value(bgrada ? opA(i, kk) : opB(kk, i));
          grad[(size_t)i] += v;
          grad_mag[(size_t)i] += fabs(v);
        }
    if (writes_bias)
      for (int64_t i = 0; i < blen; i++) {
        int64_t e = off + bi * bstride + i;
        double got = get(biasout.data(), bias_t, e), want_v = grad[(size_t)i];
        int pb_, eb_;
        double mb_;
        type_format(bias_t, &pb_, &eb_, &mb_);
        double bound = 2.0 * (double)(std::max(k, n) + 4) * u_acc * grad_mag[(size_t)i] + ldexp(1.0, -pb_) * fabs(want_v) +
                       ldexp(1.0, eb_ - pb_ + 1);
        double er = fabs(got - want_v) / bound;
        r->bias_err = std::max(r->bias_err, er == er ? er : INFINITY);
        if (c->exact) {
          put(want.data(), bias_t, 0, round_to(want_v, bias_t));
          if (!same_bits(want.data(), biasout.data() + e * tsize(bias_t), bias_t, 0)) r->mismatches++;
        }
      }
  }
  /* nothing outside the layouts changed */
  for (size_t e = 0; e < owned_d.size(); e++)
    if (!owned_d[e] && !same_bits(dout.data(), D.host.data(), dt, (int64_t)e)) r->outside++;
  if (aux_out)
    for (size_t e = 0; e < owned_aux.size(); e++)
      if (!owned_aux[e] && !same_bits(auxout.data(), aux.host.data(), dt, (int64_t)e)) r->outside++;
  if (writes_bias)
    for (int64_t e = 0; e < (int64_t)(biasout.size() / tsize(bias_t)); e++) {
      bool own = e >= off && (e - off) % std::max<int64_t>(bstride, 1) < blen && (bstride || e - off < blen);
      if (!own && !same_bits(biasout.data(), bias.host.data(), bias_t, e)) r->outside++;
    }
  return 0;
}
