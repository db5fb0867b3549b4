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
 * Each task packs its K and V once into zero-padded blocks of reals: K^T
 * and V^T (D x Sp) for the products of one query row with all keys, K and V
 * (S x Dp) for the sums over keys.  Those products run in register blocks
 * of BLK outputs (one vector register for float) accumulated over the
 * whole reduction before a single store; the remaining updates (dK and dV
 * rows) are axpys over D.  All loops vectorize.  OpenMP over tasks; BLAS
 * is not called from inside the parallel region.
 * Compiled as a template over real = float / double (generic section below). */
#ifndef real
#include "cpu_kernels.h"
#include <tgmath.h>
#ifdef _OPENMP
#include <omp.h>
#endif


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

enum { BLK = 16 };
static inline int64_t round_up(int64_t n) { return (n + BLK - 1) / BLK * BLK; }

/* keys visible from query position pos: [lo, pos] */
static inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

#define GL_TEMPLATE "cpu_attention.c"
#include "cpu_template.h"

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


/* Head (b, h) of t, S x D, packed as reals into buf: row-major with row
   stride Dp (rows) or transposed with row stride Sp (cols); the padding is
   zero.  tmp holds one row of D. */
static void R(pack_head)(const gl_tensor *t, int64_t b, int64_t h, int64_t S, int64_t D, int64_t Sp, int64_t Dp,
                         int transposed, real *buf, real *tmp) {
  int64_t n = transposed ? D * Sp : S * Dp;
  for (int64_t i = 0; i < n; i++) buf[i] = 0;
  for (int64_t j = 0; j < S; j++) {
    const real *p = R(cpu_span_load)(t, row_offset(t, b, h, j), t->stride[3], D, tmp);
    if (transposed) for (int64_t d = 0; d < D; d++) buf[d * Sp + j] = p[d];
    else for (int64_t d = 0; d < D; d++) buf[j * Dp + d] = p[d];
  }
}

/* BLK reals as one GCC vector (a register for float on AVX-512, two on
   AVX2): the accumulators below stay in registers whatever the compiler's
   auto-vectorizer decides */
typedef real R(vblk) __attribute__((vector_size(BLK * sizeof(real))));
static inline R(vblk) R(vload)(const real *p) { R(vblk) v; memcpy(&v, p, sizeof v); return v; }

/* s[j] = scale * (x . rows j of M) for j in [lo, hi], with M given
   transposed as Mt (D x Sp): blocks of BLK keys accumulate over d */
static inline void R(row_products)(real *s, const real *x, const real *Mt, int64_t Sp, int64_t D, int64_t lo,
                                   int64_t hi, real scale) {
  for (int64_t j0 = lo / BLK * BLK; j0 <= hi; j0 += BLK) {
    R(vblk) acc = {0};
    for (int64_t d = 0; d < D; d++) acc += x[d] * R(vload)(Mt + d * Sp + j0);
    real r[BLK];
    memcpy(r, &acc, sizeof r);
    int64_t a = j0 < lo ? lo : j0, e = j0 + BLK - 1 < hi ? j0 + BLK - 1 : hi;
    for (int64_t j = a; j <= e; j++) s[j] = scale * r[j - j0];
  }
}

/* y[d] = scale * sum over j in [lo, hi] of w[j] * M[j][d], M row-major
   (S x Dp): blocks of BLK columns accumulate over j */
static inline void R(weighted_rows)(real *y, const real *w, const real *M, int64_t Dp, int64_t D, int64_t lo,
                                    int64_t hi, real scale) {
  for (int64_t d0 = 0; d0 < D; d0 += BLK) {
    R(vblk) acc = {0};
    for (int64_t j = lo; j <= hi; j++) acc += w[j] * R(vload)(M + j * Dp + d0);
    real r[BLK];
    memcpy(r, &acc, sizeof r);
    for (int64_t d = d0; d < D && d < d0 + BLK; d++) y[d] = scale * r[d - d0];
  }
}

static inline void R(axpy)(real *y, real a, const real *x, int64_t n) {
  #pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* p[lo..hi] = exp(p - shift) in place; returns their sum */
static inline real R(exp_shifted)(real *p, int64_t lo, int64_t hi, real shift) {
  real l = 0;
  for (int64_t j = lo; j <= hi; j++) p[j] -= shift;
  R(cpu_vexp)(p + lo, p + lo, hi - lo + 1);
  for (int64_t j = lo; j <= hi; j++) l += p[j];
  return l;
}

static int R(attention_forward)(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                                const gl_tensor *v, double scale, int64_t window) {
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  int64_t Hkv = k->shape[1], S = k->shape[2], G = H / Hkv, ntask = B * H, Sp = round_up(S), Dp = round_up(D);
  int64_t per = D * Sp + S * Dp + 3 * Dp + Sp;
  int nt = gl_threads_for(ntask, T * S * D);
  real *ws = (real *)cpu_scratch(0, (size_t)(nt * per) * sizeof(real));
  if (!ws) return gl_error("gl_attention_forward: out of memory for per-thread K/V buffers (S=%lld, D=%lld)",
                           (long long)S, (long long)D);
  real sc = (real)scale;
  GL_PAR_FOR(nt, task, ntask, 
    real *Kt = ws + thread_id() * per, *V = Kt + D * Sp, *qb = V + S * Dp, *o = qb + Dp, *tmp = o + Dp, *p = tmp + Dp;
    int64_t b = task / H, h = task % H, hk = h / G;
    R(pack_head)(k, b, hk, S, D, Sp, Dp, 1, Kt, tmp);
    R(pack_head)(v, b, hk, S, D, Sp, Dp, 0, V, tmp);
    for (int64_t t = 0; t < T; t++) {
      int64_t pos = S - T + t, lo = first_key(pos, window);
      const real *qr = R(cpu_span_load)(q, row_offset(q, b, h, t), q->stride[3], D, qb);
      R(row_products)(p, qr, Kt, Sp, D, lo, pos, sc);
      real m = p[lo];
      for (int64_t j = lo; j <= pos; j++) m = p[j] > m ? p[j] : m;
      real l = R(exp_shifted)(p, lo, pos, m);
      R(weighted_rows)(o, p, V, Dp, D, lo, pos, 1 / l);
      R(cpu_span_store)(out, row_offset(out, b, h, t), out->stride[3], D, o);
      if (lse) ((real *)lse->storage->data)[lse->offset + b * lse->stride[0] + h * lse->stride[1] + t * lse->stride[2]] =
          m + log(l);
    }
  );
  return GL_OK;
}

static int R(attention_backward)(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                                 const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                 const gl_tensor *lse, double scale, int64_t window) {
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  int64_t Hkv = k->shape[1], S = k->shape[2], G = H / Hkv, ntask = B * Hkv, Sp = round_up(S), Dp = round_up(D);
  int64_t per = 2 * D * Sp + 3 * S * Dp + 4 * Dp + 2 * Sp;
  int nt = gl_threads_for(ntask, 2 * G * T * S * D);
  real *ws = (real *)cpu_scratch(0, (size_t)(nt * per) * sizeof(real));
  if (!ws) return gl_error("gl_attention_backward: out of memory for per-thread K/V buffers (S=%lld, D=%lld)",
                           (long long)S, (long long)D);
  real sc = (real)scale;
  const real *lp = (const real *)lse->storage->data;
  GL_PAR_FOR(nt, task, ntask, 
    real *Kt = ws + thread_id() * per, *Vt = Kt + D * Sp, *K = Vt + D * Sp, *dK = K + S * Dp, *dV = dK + S * Dp;
    real *qb = dV + S * Dp, *gb = qb + Dp, *dqa = gb + Dp, *tmp = dqa + Dp, *p = tmp + Dp, *dp = p + Sp;
    int64_t b = task / Hkv, hk = task % Hkv;
    R(pack_head)(k, b, hk, S, D, Sp, Dp, 1, Kt, tmp);
    R(pack_head)(v, b, hk, S, D, Sp, Dp, 1, Vt, tmp);
    R(pack_head)(k, b, hk, S, D, Sp, Dp, 0, K, tmp);
    for (int64_t i = 0; i < 2 * S * Dp; i++) dK[i] = 0; /* dK and dV */
    for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
      for (int64_t t = 0; t < T; t++) {
        int64_t pos = S - T + t, lo = first_key(pos, window);
        const real *qr = R(cpu_span_load)(q, row_offset(q, b, h, t), q->stride[3], D, qb);
        const real *g = R(cpu_span_load)(dout, row_offset(dout, b, h, t), dout->stride[3], D, gb);
        real l = lp[lse->offset + b * lse->stride[0] + h * lse->stride[1] + t * lse->stride[2]], Dt = 0;
        R(row_products)(p, qr, Kt, Sp, D, lo, pos, sc);
        R(row_products)(dp, g, Vt, Sp, D, lo, pos, 1);
        R(exp_shifted)(p, lo, pos, l);
        for (int64_t j = lo; j <= pos; j++) Dt += p[j] * dp[j];
        for (int64_t j = lo; j <= pos; j++) dp[j] = p[j] * (dp[j] - Dt) * sc; /* dS, scaled */
        R(weighted_rows)(dqa, dp, K, Dp, D, lo, pos, 1);
        for (int64_t j = lo; j <= pos; j++) {
          R(axpy)(dV + j * Dp, p[j], g, D);
          R(axpy)(dK + j * Dp, dp[j], qr, D);
        }
        R(cpu_span_store)(dq, row_offset(dq, b, h, t), dq->stride[3], D, dqa);
      }
    }
    for (int64_t j = 0; j < S; j++) {
      R(cpu_span_store)(dk, row_offset(dk, b, hk, j), dk->stride[3], D, dK + j * Dp);
      R(cpu_span_store)(dv, row_offset(dv, b, hk, j), dv->stride[3], D, dV + j * Dp);
    }
  );
  return GL_OK;
}

#undef real
#undef RDT
#undef R
#endif
