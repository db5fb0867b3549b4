/* elementwise.c — CPU kernels for the elementwise ops (unary forward and
 * backward, binary, where), copy with dtype conversion, fill, the Philox
 * random fills and dropout (the twin of kernels/elementwise.cu), plus the
 * helpers the other CPU kernels share (declared in cpu.h): cpu_scratch (thread-local buffers),
 * cpu_span_load_f32/_f64 and cpu_span_store_f32/_f64 (strided elements of
 * any dtype <-> contiguous reals), cpu_vexp_f32/_f64 and cpu_vtanh_f32/_f64
 * (vectorized exp and tanh over arrays).
 *
 * An elementwise op walks a gl_iter of its operands in chunks of at most
 * CPU_CHUNK elements of the inner dim; (outer index, chunk) pairs are the
 * parallel tasks.  A chunk is computed on contiguous arrays of the compute
 * type `real`: float, or double when an operand is float64 or a 32/64-bit
 * integer (exact there).  Operands that already are contiguous arrays of
 * that type are used in place; others are converted through stack buffers
 * (cpu_span_load / cpu_span_store).
 *
 * The file is compiled as a template: the generic section at the bottom is
 * included twice, once with real = float and once with real = double. */
#ifndef real
/* No code here traps on floating-point exceptions; telling GCC so lets it
   if-convert the clamps of exp/tanh below and vectorize their loops. */
#pragma GCC optimize("no-trapping-math")
#include "cpu.h"
#include <stdlib.h>
#include <tgmath.h>

enum { K_UNARY, K_UNARY_BACKWARD, K_BINARY, K_WHERE };

/* Op tables: the value of each op as an expression of its inputs (x, p0, p1
   for unary; x, dy for the unary backward; a, b for binary), in `real`.
   Fractional constants carry a (real) cast so float stays float. */
#define GL_UNARY_FORWARD(X) \
  X(GL_U_NEG, -x) \
  X(GL_U_EXP, R(exp)(x)) \
  X(GL_U_LOG, log(x)) \
  X(GL_U_SQRT, sqrt(x)) \
  X(GL_U_RSQRT, 1 / sqrt(x)) \
  X(GL_U_TANH, R(tanh)(x)) \
  X(GL_U_ABS, fabs(x)) \
  X(GL_U_RELU, x > 0 ? x : 0) \
  X(GL_U_RELU2, x > 0 ? x * x : 0) \
  X(GL_U_GELU_TANH, (real)0.5 * x * (1 + R(tanh)(GELU_K * (x + GELU_C * x * x * x)))) \
  X(GL_U_SILU, x / (1 + R(exp)(-x))) \
  X(GL_U_SIGMOID, 1 / (1 + R(exp)(-x))) \
  X(GL_U_SIN, sin(x)) \
  X(GL_U_COS, cos(x)) \
  X(GL_U_SQUARE, x * x) \
  X(GL_U_RECIPROCAL, 1 / x) \
  X(GL_U_CLAMP, x < p0 ? p0 : (x > p1 ? p1 : x)) \
  X(GL_U_POW, pow(x, p0)) \
  X(GL_U_ADD_SCALAR, x + p0) \
  X(GL_U_MUL_SCALAR, x * p0) \
  X(GL_U_AFFINE, x * p0 + p1) \
  X(GL_U_RSUB_SCALAR, p0 - x) \
  X(GL_U_RDIV_SCALAR, p0 / x) \
  X(GL_U_SOFTCAP, p0 * R(tanh)(x / p0))

/* dx = dy * f'(x) */
#define GL_UNARY_BACKWARD(X) \
  X(GL_U_NEG, -dy) \
  X(GL_U_EXP, dy * R(exp)(x)) \
  X(GL_U_LOG, dy / x) \
  X(GL_U_SQRT, dy * (real)0.5 / sqrt(x)) \
  X(GL_U_RSQRT, dy * (real)-0.5 / (x * sqrt(x))) \
  X(GL_U_TANH, dy * (1 - R(tanh)(x) * R(tanh)(x))) \
  X(GL_U_ABS, x > 0 ? dy : (x < 0 ? -dy : 0)) \
  X(GL_U_RELU, x > 0 ? dy : 0) \
  X(GL_U_RELU2, x > 0 ? 2 * x * dy : 0) \
  X(GL_U_GELU_TANH, dy * R(gelu_tanh_grad)(x)) \
  X(GL_U_SILU, dy * (1 + x * (1 - R(sigmoid)(x))) * R(sigmoid)(x)) \
  X(GL_U_SIGMOID, dy * (1 - R(sigmoid)(x)) * R(sigmoid)(x)) \
  X(GL_U_SIN, dy * cos(x)) \
  X(GL_U_COS, -dy * sin(x)) \
  X(GL_U_SQUARE, 2 * x * dy) \
  X(GL_U_RECIPROCAL, -dy / (x * x)) \
  X(GL_U_CLAMP, (x >= p0 && x <= p1) ? dy : 0) \
  X(GL_U_POW, p0 == 0 ? 0 : dy * p0 * pow(x, p0 - 1)) \
  X(GL_U_ADD_SCALAR, dy) \
  X(GL_U_MUL_SCALAR, dy * p0) \
  X(GL_U_AFFINE, dy * p0) \
  X(GL_U_RSUB_SCALAR, -dy) \
  X(GL_U_RDIV_SCALAR, -dy * p0 / (x * x)) \
  X(GL_U_SOFTCAP, dy * (1 - R(tanh)(x / p0) * R(tanh)(x / p0)))

#define GL_BINARY(X) \
  X(GL_B_ADD, a + b) \
  X(GL_B_SUB, a - b) \
  X(GL_B_MUL, a * b) \
  X(GL_B_DIV, a / b) \
  X(GL_B_POW, pow(a, b)) \
  X(GL_B_MAXIMUM, (a > b || a != a) ? a : b) \
  X(GL_B_MINIMUM, (a < b || a != a) ? a : b) \
  X(GL_B_EQ, a == b) \
  X(GL_B_NE, a != b) \
  X(GL_B_LT, a < b) \
  X(GL_B_LE, a <= b) \
  X(GL_B_GT, a > b) \
  X(GL_B_GE, a >= b)

#define GELU_K ((real)0.7978845608028654) /* sqrt(2/pi) */
#define GELU_C ((real)0.044715)

/* Thread-local scratch memory, a few independent slots per thread, grown on
   demand and kept for the thread's life: hot kernels allocate once, not per
   call.  NULL when out of memory. */
enum { SCRATCH_SLOTS = 4 };
static __thread struct { void *p; size_t n; } scratch[SCRATCH_SLOTS];
void *cpu_scratch(int slot, size_t bytes) {
  if (slot < 0 || slot >= SCRATCH_SLOTS) gl_panic("cpu_scratch: slot %d", slot);
  if (bytes <= scratch[slot].n && scratch[slot].p) return scratch[slot].p;
  size_t n = (bytes + bytes / 2 + 4095) & ~(size_t)4095; /* geometric growth */
  void *p = NULL;
  if (posix_memalign(&p, 64, n)) return NULL;
  free(scratch[slot].p);
  scratch[slot].p = p; scratch[slot].n = n;
  return p;
}

/* a compute type wide enough for every operand */
static int needs_double(const gl_tensor *const *ts, int n) {
  for (int k = 0; k < n; k++)
    if (ts[k] && (ts[k]->dtype == GL_F64 || ts[k]->dtype == GL_I32 || ts[k]->dtype == GL_I64)) return 1;
  return 0;
}

#define GL_TEMPLATE "elementwise.c"
#include "template.h"

static void elementwise(int kind, int op, int nops, gl_tensor *const *ts, double p0, double p1) {
  if (needs_double((const gl_tensor *const *)ts, nops)) elementwise_f64(kind, op, nops, ts, p0, p1);
  else elementwise_f32(kind, op, nops, ts, p0, p1);
}

int cpu_unary(int op, gl_tensor *out, const gl_tensor *x, double p0, double p1) {
  elementwise(K_UNARY, op, 2, (gl_tensor *[]){out, (gl_tensor *)x}, p0, p1);
  return GL_OK;
}
int cpu_unary_backward(int op, gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, double p0, double p1) {
  elementwise(K_UNARY_BACKWARD, op, 3, (gl_tensor *[]){dx, (gl_tensor *)dy, (gl_tensor *)x}, p0, p1);
  return GL_OK;
}
int cpu_binary(int op, gl_tensor *out, const gl_tensor *a, const gl_tensor *b) {
  elementwise(K_BINARY, op, 3, (gl_tensor *[]){out, (gl_tensor *)a, (gl_tensor *)b}, 0, 0);
  return GL_OK;
}
int cpu_where(gl_tensor *out, const gl_tensor *cond, const gl_tensor *a, const gl_tensor *b) {
  elementwise(K_WHERE, 0, 4, (gl_tensor *[]){out, (gl_tensor *)cond, (gl_tensor *)a, (gl_tensor *)b}, 0, 0);
  return GL_OK;
}

int cpu_dropout(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset) {
  CPU_CALL(cpu_wide(x), dropout, out, x, p, seed, offset);
  return GL_OK;
}

/* ---- copy (with dtype conversion), fill and the Philox random fills -------- */

/* Copy one inner run with conversion.  Same-dtype float32 runs are the hot
   case (contiguous() of transposed activations) and get a typed loop. */
static void copy_run(char *db, int dt, int64_t doff, int64_t ds,
                     const char *sb, int st, int64_t soff, int64_t ss, int64_t n) {
  if (dt == st && ds == 1 && ss == 1) {
    int es = gl_dtype_size(dt);
    memcpy(db + doff * es, sb + soff * es, (size_t)(n * es));
  } else if (dt == GL_F32 && st == GL_F32) {
    float *d = (float *)db + doff; const float *s = (const float *)sb + soff;
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else if (dt == GL_F64 && st == GL_F64) {
    double *d = (double *)db + doff; const double *s = (const double *)sb + soff;
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else if (dt == GL_I64 && st == GL_I64) {
    int64_t *d = (int64_t *)db + doff; const int64_t *s = (const int64_t *)sb + soff;
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else {
    for (int64_t i = 0; i < n; i++) gl_store(db, dt, doff + i * ds, gl_load(sb, st, soff + i * ss));
  }
}

int cpu_copy(gl_tensor *dst, const gl_tensor *src) {
  gl_iter it; gl_iter_init(&it, 2, (const gl_tensor *[]){dst, src});
  char *db = dst->storage->data; const char *sb = src->storage->data;
  int nt = gl_threads_for(it.outer, it.inner);
  GL_PAR_FOR(nt, o, it.outer, 
    int64_t off[GL_ITER_MAX_OPS]; gl_iter_offsets(&it, o, off);
    copy_run(db, dst->dtype, off[0], it.istride[0], sb, src->dtype, off[1], it.istride[1], it.inner);
  );
  return GL_OK;
}

int cpu_fill(gl_tensor *t, double v) {
  gl_iter it; gl_iter_init(&it, 1, (const gl_tensor *[]){t});
  char *b = t->storage->data;
  for (int64_t o = 0; o < it.outer; o++) {
    int64_t off[GL_ITER_MAX_OPS]; gl_iter_offsets(&it, o, off);
    if (t->dtype == GL_F32) {
      float *p = (float *)b + off[0]; float f = (float)v;
      for (int64_t i = 0; i < it.inner; i++) p[i * it.istride[0]] = f;
    } else {
      for (int64_t i = 0; i < it.inner; i++) gl_store(b, t->dtype, off[0] + i * it.istride[0], v);
    }
  }
  return GL_OK;
}

/* Element k (row-major index) takes stream element offset + k.  Normal
   samples use Box-Muller on two words: counter 2*(offset+k) and +1. */
static int rand_fill(gl_tensor *t, uint64_t seed, uint64_t offset, double a, double b, int normal) {
  int64_t idx[GL_MAX_DIMS] = {0};
  char *base = t->storage->data;
  for (int64_t k = 0; k < t->numel; k++) {
    int64_t off = t->offset;
    for (int d = 0; d < t->ndim; d++) off += idx[d] * t->stride[d];
    uint64_t c = offset + (uint64_t)k;
    double v;
    if (normal) {
      double u1 = gl_u32_to_unit(gl_philox_word(seed, 2 * c));
      double u2 = gl_u32_to_unit(gl_philox_word(seed, 2 * c + 1));
      v = a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    } else {
      v = a + (b - a) * (1.0 - gl_u32_to_unit(gl_philox_word(seed, c)));  /* [lo, hi) */
    }
    gl_store(base, t->dtype, off, v);
    for (int d = t->ndim - 1; d >= 0; d--) { if (++idx[d] < t->shape[d]) break; idx[d] = 0; }
  }
  return GL_OK;
}
int cpu_rand_uniform(gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi) {
  return rand_fill(t, seed, offset, lo, hi, 0);
}
int cpu_rand_normal(gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
  return rand_fill(t, seed, offset, mean, std, 1);
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */

/* n elements of t from storage element off, stride st, as contiguous reals:
   t's own memory when it already is that, else converted into buf. */
const real *R(cpu_span_load)(const gl_tensor *t, int64_t off, int64_t st, int64_t n, real *buf) {
  const void *base = t->storage->data;
  if (t->dtype == RDT && st == 1) return (const real *)base + off;
#define LOAD(T, CONV) { const T *p = (const T *)base + off; \
    for (int64_t i = 0; i < n; i++) buf[i] = (real)CONV(p[i * st]); } break;
  switch (t->dtype) {
  case GL_F32: LOAD(float, )
  case GL_F64: LOAD(double, )
  case GL_BF16: LOAD(uint16_t, gl_bf16_to_f32)
  default: for (int64_t i = 0; i < n; i++) buf[i] = (real)gl_load(base, t->dtype, off + i * st);
  }
#undef LOAD
  return buf;
}

/* writes n contiguous reals to t from storage element off, stride st;
   nothing to do when src already is t's memory */
void R(cpu_span_store)(gl_tensor *t, int64_t off, int64_t st, int64_t n, const real *src) {
  void *base = t->storage->data;
  if (t->dtype == RDT && st == 1 && src == (const real *)base + off) return;
#define STORE(T, CONV) { T *p = (T *)base + off; \
    for (int64_t i = 0; i < n; i++) p[i * st] = CONV(src[i]); } break;
  switch (t->dtype) {
  case GL_F32: STORE(float, (float))
  case GL_F64: STORE(double, (double))
  case GL_BF16: STORE(uint16_t, gl_f32_to_bf16)
  default: for (int64_t i = 0; i < n; i++) gl_store(base, t->dtype, off + i * st, (double)src[i]);
  }
#undef STORE
}

/* tanh: libm's in double; in float a rational minimax approximation (the
   one Eigen and XLA use, relative error < 3e-7, about 2 ulp) because it
   vectorizes, where glibc's tanhf is a scalar call that made GELU cost more
   than the GEMMs of a small GPT. */
static inline real R(tanh)(real x) {
  if (sizeof(real) != sizeof(float)) return tanh(x);
  const real c = (real)7.90531110763549805; /* tanh(c) rounds to 1 in float */
  x = x > c ? c : (x < -c ? -c : x);
  real x2 = x * x;
  real p = (real)-2.76076847742355e-16;
  p = p * x2 + (real)2.00018790482477e-13;
  p = p * x2 + (real)-8.60467152213735e-11;
  p = p * x2 + (real)5.12229709037114e-08;
  p = p * x2 + (real)1.48572235717979e-05;
  p = p * x2 + (real)6.37261928875436e-04;
  p = p * x2 + (real)4.89352455891786e-03;
  real q = (real)1.19825839466702e-06;
  q = q * x2 + (real)1.18534705686654e-04;
  q = q * x2 + (real)2.26843463243900e-03;
  q = q * x2 + (real)4.89352518554385e-03;
  return x * p / q;
}

/* exp: libm's in double; in float Cephes' expf (range reduction by ln 2 in
   two parts, degree-6 polynomial, about 1 ulp) written without calls or
   branches so loops over it vectorize.  Results below exp(-87), near the
   smallest normal float, flush to 0. */
static inline real R(exp)(real x) {
  if (sizeof(real) != sizeof(float)) return exp(x);
  const real hi = (real)88.72283935546875; /* ln of the largest float */
  real xc = x < -87 ? -87 : x;
  xc = xc > hi ? hi : xc;
  xc = x != x ? 0 : xc;
  real fn = floor(xc * (real)1.44269504088896341 + (real)0.5); /* n = round(x / ln 2) */
  real r = xc - fn * (real)0.693359375 - fn * (real)-2.12194440e-4;
  real p = (real)1.9875691500e-4;
  p = p * r + (real)1.3981999507e-3;
  p = p * r + (real)8.3334519073e-3;
  p = p * r + (real)4.1665795894e-2;
  p = p * r + (real)1.6666665459e-1;
  p = p * r + (real)5.0000001201e-1;
  p = p * r * r + r + 1;
  union { int32_t i; float f; } half_two_n = { .i = ((int32_t)fn + 126) << 23 }; /* 2^(n-1): n may be 128 */
  real y = p * half_two_n.f * 2;
  y = x < -87 ? 0 : y;
  y = x > hi ? (real)INFINITY : y;
  return x != x ? x : y;
}

static inline real R(sigmoid)(real x) { return 1 / (1 + R(exp)(-x)); }

/* y[i] = exp(x[i]) and y[i] = tanh(x[i]) over arrays (y may alias x): the
   vectorized forms for the row kernels in other files */
void R(cpu_vexp)(real *y, const real *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = R(exp)(x[i]);
}
void R(cpu_vtanh)(real *y, const real *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = R(tanh)(x[i]);
}

static inline real R(gelu_tanh_grad)(real x) {
  real t = R(tanh)(GELU_K * (x + GELU_C * x * x * x));
  return (real)0.5 * (1 + t) + (real)0.5 * x * (1 - t * t) * GELU_K * (1 + 3 * GELU_C * x * x);
}

/* one chunk of n contiguous elements: y = op(in[1], in[2], in[3]) */
static void R(chunk)(int kind, int op, real *y, const real *const *in, int64_t n, real p0, real p1) {
  switch (kind) {
  case K_UNARY: {
    const real *xs = in[1];
    switch (op) {
#define CASE(OP, EXPR) case OP: for (int64_t i = 0; i < n; i++) { real x = xs[i]; y[i] = (EXPR); } break;
    GL_UNARY_FORWARD(CASE)
#undef CASE
    }
    break;
  }
  case K_UNARY_BACKWARD: {
    const real *dys = in[1], *xs = in[2];
    switch (op) {
#define CASE(OP, EXPR) case OP: for (int64_t i = 0; i < n; i++) { real dy = dys[i], x = xs[i]; (void)x; y[i] = (EXPR); } break;
    GL_UNARY_BACKWARD(CASE)
#undef CASE
    }
    break;
  }
  case K_BINARY: {
    const real *as = in[1], *bs = in[2];
    switch (op) {
#define CASE(OP, EXPR) case OP: for (int64_t i = 0; i < n; i++) { real a = as[i], b = bs[i]; y[i] = (EXPR); } break;
    GL_BINARY(CASE)
#undef CASE
    }
    break;
  }
  case K_WHERE:
    for (int64_t i = 0; i < n; i++) y[i] = in[1][i] != 0 ? in[2][i] : in[3][i];
    break;
  }
}

/* one task: chunk `task % nchunk` of outer row `task / nchunk` */
static void R(elementwise_task)(int kind, int op, int nops, gl_tensor *const *ts, const gl_iter *it,
                                int64_t nchunk, int64_t task, double p0, double p1) {
  real buf[GL_ITER_MAX_OPS][CPU_CHUNK];
  const real *in[GL_ITER_MAX_OPS];
  int64_t off[GL_ITER_MAX_OPS];
  int64_t i0 = (task % nchunk) * CPU_CHUNK, n = it->inner - i0 < CPU_CHUNK ? it->inner - i0 : CPU_CHUNK;
  gl_iter_offsets(it, task / nchunk, off);
  for (int k = 0; k < nops; k++) off[k] += i0 * it->istride[k];
  for (int k = 1; k < nops; k++) in[k] = R(cpu_span_load)(ts[k], off[k], it->istride[k], n, buf[k]);
  gl_tensor *out = ts[0];
  real *y = (out->dtype == RDT && it->istride[0] == 1) ? (real *)out->storage->data + off[0] : buf[0];
  R(chunk)(kind, op, y, in, n, (real)p0, (real)p1);
  R(cpu_span_store)(out, off[0], it->istride[0], n, y);
}

/* ts[0] is the output, ts[1..nops-1] the inputs, all of ts[0]'s shape */
static void R(elementwise)(int kind, int op, int nops, gl_tensor *const *ts, double p0, double p1) {
  gl_iter it;
  gl_iter_init(&it, nops, (const gl_tensor *const *)ts);
  int64_t nchunk = (it.inner + CPU_CHUNK - 1) / CPU_CHUNK, ntask = it.outer * nchunk;
  int nt = gl_threads_for(ntask, CPU_CHUNK);
  if (nt <= 1) {  /* small tensors: no OpenMP region at all (entering one costs microseconds) */
    for (int64_t task = 0; task < ntask; task++) R(elementwise_task)(kind, op, nops, ts, &it, nchunk, task, p0, p1);
    return;
  }
  GL_PAR_FOR(nt, task, ntask,  R(elementwise_task)(kind, op, nops, ts, &it, nchunk, task, p0, p1); );
}

#include "row_access.h"

/* ---- dropout ---------------------------------------------------------------
   Element e (row-major index) is kept when the unit value of Philox word
   (offset + e) is < 1 - p; kept values are scaled by 1 / (1 - p).  p = 0
   keeps everything (a unit value can be exactly 1).  One Philox block
   yields 4 consecutive words, so each is computed once per 4 elements. */
static void R(dropout)(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset) {
  int nd = x->ndim, lead = nd > 0 ? nd - 1 : 0;
  int64_t L = nd > 0 ? x->shape[nd - 1] : 1, rows = L ? x->numel / L : 0;
  int64_t xs = nd > 0 ? x->stride[nd - 1] : 1, ys = nd > 0 ? out->stride[nd - 1] : 1;
  int64_t nchunk = (L + CPU_CHUNK - 1) / CPU_CHUNK, ntask = rows * nchunk;
  double keep = 1 - p;
  real scale = keep > 0 ? (real)(1 / keep) : 0;
  int nt = gl_threads_for(ntask, 4 * CPU_CHUNK);
  GL_PAR_FOR(nt, task, ntask, 
    real xb[CPU_CHUNK], yb[CPU_CHUNK];
    uint32_t words[4];
    int64_t r = task / nchunk, j0 = (task % nchunk) * CPU_CHUNK, n = L - j0 < CPU_CHUNK ? L - j0 : CPU_CHUNK;
    int64_t xo = walk_offset(x, x->shape, lead, -1, r) + j0 * xs, yo = walk_offset(out, out->shape, lead, -1, r) + j0 * ys;
    const real *xr = R(cpu_span_load)(x, xo, xs, n, xb);
    real *y = R(row_out)(out, yo, ys, yb);
    uint64_t e0 = offset + (uint64_t)(r * L + j0), blk = ~(uint64_t)0;
    for (int64_t j = 0; j < n; j++) {
      uint64_t c = e0 + (uint64_t)j;
      if (c >> 2 != blk) {
        blk = c >> 2;
        gl_philox4x32((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)blk, (uint32_t)(blk >> 32), 0, 0, words);
      }
      y[j] = (p == 0 || gl_u32_to_unit(words[c & 3]) < keep) ? xr[j] * scale : 0;
    }
    R(cpu_span_store)(out, yo, ys, n, y);
  );
}


#undef OOM
#undef real
#undef RDT
#undef R
#endif
