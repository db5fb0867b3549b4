/* cpu_attention.c — causal scaled-dot-product attention on the CPU, forward
 * and backward, with grouped-query heads, a KV cache offset (T <= S, query t
 * at position S - T + t) and an optional sliding window.
 *
 * Forward, one task per (b, h): K and V of kv head h / (H / Hkv) are packed
 * into contiguous reals (used in place when they already are), then for each
 * query the scores of its visible keys go into a row buffer, are
 * exponentiated against their max and summed: out = P V / l, lse = m + log l.
 *
 * Backward, one task per (b, kv head), looping over the query heads of its
 * group so dK and dV accumulate without races: the probabilities of a query
 * row are recomputed from lse (no T x S matrix is kept between forward and
 * backward), then with dP = dout V^T and D = sum(P * dP),
 * dS = P * (dP - D), dq = scale dS K, dk += scale dS^T q, dv += P^T dout.
 *
 * K (and V for dP) are also packed transposed, D x S, so the scores of one
 * query against all its keys are D axpys along contiguous rows, and every
 * other product is an axpy over D: all vectorize.  OpenMP over tasks; BLAS
 * is not called from inside the parallel region.
 * Compiled as a template over real = float / double (generic section below). */
#ifndef real
#include "backend.h"
#include <tgmath.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void *cpu_scratch(int slot, size_t bytes);

static inline int thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* storage offset of row (b, h, t) of a (B, H, T, D) tensor */
static inline int64_t row_offset(const gl_tensor *t, int64_t b, int64_t h, int64_t i) {
  return t->offset + b * t->stride[0] + h * t->stride[1] + i * t->stride[2];
}

/* keys visible from query position pos: [lo, pos] */
static inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

#define real float
#define RDT GL_F32
#define R(name) name##_f32
#include "cpu_attention.c"
#define real double
#define RDT GL_F64
#define R(name) name##_f64
#include "cpu_attention.c"

int cpu_attention_forward(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                          const gl_tensor *v, double scale, int64_t window) {
  if (q->dtype == GL_F64) return attention_forward_f64(out, lse, q, k, v, scale, window);
  return attention_forward_f32(out, lse, q, k, v, scale, window);
}

int cpu_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                           const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                           const gl_tensor *out, const gl_tensor *lse, double scale, int64_t window) {
  if (q->dtype == GL_F64) return attention_backward_f64(dq, dk, dv, dout, q, k, v, lse, scale, window);
  return attention_backward_f32(dq, dk, dv, dout, q, k, v, lse, scale, window);
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */

const real *R(cpu_span_load)(const gl_tensor *t, int64_t off, int64_t st, int64_t n, real *buf);
void R(cpu_span_store)(gl_tensor *t, int64_t off, int64_t st, int64_t n, const real *src);
void R(cpu_vexp)(real *y, const real *x, int64_t n);

/* the S x D block of head (b, h) as contiguous reals: in place or packed into buf */
static const real *R(pack_head)(const gl_tensor *t, int64_t b, int64_t h, int64_t S, int64_t D, real *buf) {
  if (t->dtype == RDT && t->stride[3] == 1 && (t->stride[2] == D || S == 1))
    return (const real *)t->storage->data + row_offset(t, b, h, 0);
  for (int64_t j = 0; j < S; j++) {
    const real *p = R(cpu_span_load)(t, row_offset(t, b, h, j), t->stride[3], D, buf + j * D);
    if (p != buf + j * D) memcpy(buf + j * D, p, (size_t)D * sizeof(real));
  }
  return buf;
}

/* the same block transposed, D x S, so that the products of one query with
   all keys run along contiguous rows (tmp holds one row of D) */
static void R(pack_head_t)(const gl_tensor *t, int64_t b, int64_t h, int64_t S, int64_t D, real *buf, real *tmp) {
  for (int64_t j = 0; j < S; j++) {
    const real *p = R(cpu_span_load)(t, row_offset(t, b, h, j), t->stride[3], D, tmp);
    for (int64_t d = 0; d < D; d++) buf[d * S + j] = p[d];
  }
}

static inline void R(axpy)(real *y, real a, const real *x, int64_t n) {
  #pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* s[j] = scale * q . K[j] for j in [lo, hi], K given transposed (D x S) */
static inline void R(scores)(real *s, const real *q, const real *Kt, int64_t S, int64_t D, int64_t lo, int64_t hi,
                             real scale) {
  for (int64_t j = lo; j <= hi; j++) s[j] = 0;
  for (int64_t d = 0; d < D; d++) R(axpy)(s + lo, scale * q[d], Kt + d * S + lo, hi - lo + 1);
}

static int R(attention_forward)(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                                const gl_tensor *v, double scale, int64_t window) {
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  int64_t Hkv = k->shape[1], S = k->shape[2], G = H / Hkv, ntask = B * H;
  int64_t per = (2 * S * D + 3 * D + S + 15) & ~(int64_t)15;
  int nt = gl_threads_for(ntask, T * S * D);
  real *ws = (real *)cpu_scratch(0, (size_t)(nt * per) * sizeof(real));
  if (!ws) return gl_error("gl_attention_forward: out of memory for per-thread K/V buffers (S=%lld, D=%lld)",
                           (long long)S, (long long)D);
  real sc = (real)scale;
  #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t task = 0; task < ntask; task++) {
    real *Kt = ws + thread_id() * per, *vb = Kt + S * D, *qb = vb + S * D, *acc = qb + D, *tmp = acc + D, *p = tmp + D;
    int64_t b = task / H, h = task % H, hk = h / G;
    R(pack_head_t)(k, b, hk, S, D, Kt, tmp);
    const real *V = R(pack_head)(v, b, hk, S, D, vb);
    for (int64_t t = 0; t < T; t++) {
      int64_t pos = S - T + t, lo = first_key(pos, window);
      const real *qr = R(cpu_span_load)(q, row_offset(q, b, h, t), q->stride[3], D, qb);
      R(scores)(p, qr, Kt, S, D, lo, pos, sc);
      real m = -INFINITY, l = 0;
      for (int64_t j = lo; j <= pos; j++) m = p[j] > m ? p[j] : m;
      for (int64_t j = lo; j <= pos; j++) p[j] -= m;
      R(cpu_vexp)(p + lo, p + lo, pos - lo + 1);
      for (int64_t j = lo; j <= pos; j++) l += p[j];
      for (int64_t d = 0; d < D; d++) acc[d] = 0;
      for (int64_t j = lo; j <= pos; j++) R(axpy)(acc, p[j], V + j * D, D);
      real inv = 1 / l;
      for (int64_t d = 0; d < D; d++) acc[d] *= inv;
      R(cpu_span_store)(out, row_offset(out, b, h, t), out->stride[3], D, acc);
      if (lse) ((real *)lse->storage->data)[lse->offset + b * lse->stride[0] + h * lse->stride[1] + t * lse->stride[2]] =
          m + log(l);
    }
  }
  return GL_OK;
}

static int R(attention_backward)(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                                 const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                 const gl_tensor *lse, double scale, int64_t window) {
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  int64_t Hkv = k->shape[1], S = k->shape[2], G = H / Hkv, ntask = B * Hkv;
  int64_t per = (6 * S * D + 4 * D + 2 * S + 15) & ~(int64_t)15;
  int nt = gl_threads_for(ntask, 2 * G * T * S * D);
  real *ws = (real *)cpu_scratch(0, (size_t)(nt * per) * sizeof(real));
  if (!ws) return gl_error("gl_attention_backward: out of memory for per-thread K/V buffers (S=%lld, D=%lld)",
                           (long long)S, (long long)D);
  real sc = (real)scale;
  const real *lp = (const real *)lse->storage->data;
  #pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int64_t task = 0; task < ntask; task++) {
    real *Kt = ws + thread_id() * per, *Vt = Kt + S * D, *kb = Vt + S * D, *vb = kb + S * D;
    real *dK = vb + S * D, *dV = dK + S * D, *qb = dV + S * D, *gb = qb + D, *dqa = gb + D, *tmp = dqa + D;
    real *p = tmp + D, *dp = p + S;
    int64_t b = task / Hkv, hk = task % Hkv;
    R(pack_head_t)(k, b, hk, S, D, Kt, tmp);
    R(pack_head_t)(v, b, hk, S, D, Vt, tmp);
    const real *K = R(pack_head)(k, b, hk, S, D, kb);
    for (int64_t i = 0; i < 2 * S * D; i++) dK[i] = 0; /* dK and dV */
    for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
      for (int64_t t = 0; t < T; t++) {
        int64_t pos = S - T + t, lo = first_key(pos, window);
        const real *qr = R(cpu_span_load)(q, row_offset(q, b, h, t), q->stride[3], D, qb);
        const real *g = R(cpu_span_load)(dout, row_offset(dout, b, h, t), dout->stride[3], D, gb);
        real l = lp[lse->offset + b * lse->stride[0] + h * lse->stride[1] + t * lse->stride[2]], Dt = 0;
        R(scores)(p, qr, Kt, S, D, lo, pos, sc);
        R(scores)(dp, g, Vt, S, D, lo, pos, 1);
        for (int64_t j = lo; j <= pos; j++) p[j] -= l;
        R(cpu_vexp)(p + lo, p + lo, pos - lo + 1);
        for (int64_t j = lo; j <= pos; j++) Dt += p[j] * dp[j];
        for (int64_t d = 0; d < D; d++) dqa[d] = 0;
        for (int64_t j = lo; j <= pos; j++) {
          real ds = p[j] * (dp[j] - Dt) * sc;
          R(axpy)(dV + j * D, p[j], g, D);
          R(axpy)(dqa, ds, K + j * D, D);
          R(axpy)(dK + j * D, ds, qr, D);
        }
        R(cpu_span_store)(dq, row_offset(dq, b, h, t), dq->stride[3], D, dqa);
      }
    }
    for (int64_t j = 0; j < S; j++) {
      R(cpu_span_store)(dk, row_offset(dk, b, hk, j), dk->stride[3], D, dK + j * D);
      R(cpu_span_store)(dv, row_offset(dv, b, hk, j), dv->stride[3], D, dV + j * D);
    }
  }
  return GL_OK;
}

#undef real
#undef RDT
#undef R
#endif
