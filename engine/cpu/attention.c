/* attention.c — causal scaled-dot-product attention on the CPU, forward
 * and backward, with grouped-query heads, a KV cache offset (T <= S, query t
 * at position S - T + t) and an optional sliding window; window < 0 masks
 * nothing (ring attention's blocks of earlier chunks): every query then
 * sits at position S - 1 + t, past every key.
 *
 * Both directions work on tiles of up to TM queries, so that every product
 * is a small matrix product computed in register blocks (R(micro): MR rows
 * x NV vectors of accumulators, each loaded vector feeding MR FMAs); one
 * query row at a time, as matrix-vector products, each load fed one FMA.
 * R(micro) broadcasts A's elements one at a time, so a transposed A is the
 * same kernel with its strides swapped; B's rows are read as whole vectors.
 *
 * A tile's scores are kept key-major, Pt[key][query], with the queries in
 * the vector lanes: the softmax statistics of a query (max, sum, and in the
 * backward sum(P * dP)) are then lane-wise accumulations over the key rows,
 * not a horizontal reduction per row, and the exp runs once over the whole
 * tile.  For that layout the tile's queries (and dO) are transposed, in
 * VL x VL register blocks.  A tile holds at most S x TM scores, so memory
 * stays bounded for long sequences: no T x S matrix is kept.  K and V are
 * read in place when they already are reals the products can read, else
 * packed row-major (S x Dp, zero padded) once per task.
 *
 * Forward, one task per (b, h), with K and V of kv head h / (H / Hkv):
 * Pt = K Q^T, per query scale, max m, Pt = exp(Pt - m), l = sum Pt;
 * O = (P V) / l, lse = m + log l.
 *
 * Backward, one task per (b, kv head), looping over the query heads of its
 * group so dK and dV accumulate in the task's own buffers without races:
 * per tile, Pt = exp(scale K Q^T - lse) recomputed, dPt = V dO^T,
 * D = rowsum(dO * O) per query (as the GPU's: lse and O may be a larger
 * attention's, merged over several key blocks, of which these keys are
 * one), dSt = scale P (dP - D), then dQ = dS K,
 * dK += dS^T Q, dV += P^T dO.
 *
 * Segments (document masking, or a batch's left padding; ids (B, S) per
 * position, a query taking its position's): a query sees a key only when
 * both carry the same id (compared as 32-bit integers).  The register blocks
 * skip by causality and the window alone; the segment test joins the
 * visibility mask inside the tile, so keys of other documents get P = 0
 * and dS = 0 like the ones above the diagonal.  A query always sees itself,
 * so no row is wholly masked.
 *
 * Causality and the window are handled per register block: a block of
 * keys only computes the query lanes that see one of them, a block of
 * queries only reduces over the keys one of them sees, so masked work is
 * skipped at MR x vector granularity.  Inside the tile every invisible
 * score is set to -inf before the exp (P = 0 there, and dS = 0), so the
 * softmax passes and the reductions run over plain rectangles.
 * OpenMP over tasks; BLAS is not called from inside the parallel region.
 * Compiled as a template over real = float / double (generic section below). */
#ifndef real
#include "cpu.h"
#include <tgmath.h>
#ifdef _OPENMP
#include <omp.h>
#endif



/* storage offset of row (b, h, t) of a (B, H, T, D) tensor */
static inline int64_t row_offset(const gl_tensor *t, int64_t b, int64_t h, int64_t i) {
  return t->offset + b * t->stride[0] + h * t->stride[1] + i * t->stride[2];
}

/* storage offset of element (b, h, t) of the (B, H, T) log-sum-exp */
static inline int64_t lse_offset(const gl_tensor *lse, int64_t b, int64_t h, int64_t t) {
  return lse->offset + b * lse->stride[0] + h * lse->stride[1] + t * lse->stride[2];
}

/* A vector register's bytes (vectors of two registers would double the
   accumulators and spill them), and the register block: MR rows x NV
   vectors of accumulators, enough independent FMA chains to cover the FMA
   latency while they and the operands fit the register file (16 of the
   32 AVX-512 registers; 8 of 16 otherwise).  TM queries per tile: 32
   rather than 64 wastes less of the softmax passes and the exp on the
   masked triangle of a tile (5% faster at T = 64, the same at 256). */
#if defined(__AVX512F__)
enum { VBYTES = 64, NV = 2 };
#elif defined(__AVX__)
enum { VBYTES = 32, NV = 1 };
#else
enum { VBYTES = 16, NV = 1 };
#endif
enum { MR = 8, TM = 32 };
#define VL ((int64_t)(VBYTES / sizeof(real))) /* reals per vector */
typedef int32_t ilane_f32;                     /* integer lanes as wide as real */
typedef int64_t ilane_f64;

/* fully unrolls the loop that follows (constant trip count, at most 16) */
#ifdef __clang__
#define GL_UNROLL _Pragma("unroll")
#else
#define GL_UNROLL _Pragma("GCC unroll 16")
#endif

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* keys visible from query position pos: [lo, pos] */
static inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* A tile: queries t0 + i for i in [0, n), at positions p0 + i; together
   they see keys [klo, khi]; seg (or NULL): the segment id of each position
   of the row */
typedef struct { int64_t t0, n, p0, klo, khi; const int32_t *seg; } tile;

static inline tile make_tile(int64_t T, int64_t S, int64_t off, int64_t window, int64_t t0, int64_t tm,
                             const int32_t *seg) {
  tile c = {t0, min64(tm, T - t0), off + t0, 0, 0, seg};
  c.klo = first_key(c.p0, window);
  c.khi = min64(c.p0 + c.n - 1, S - 1);
  return c;
}

/* the tile's queries that see some key of [j0, j1]: [*ia, *ib] */
static inline void seeing(const tile *c, int64_t window, int64_t j0, int64_t j1, int64_t *ia, int64_t *ib) {
  *ia = max64(0, j0 - c->p0);
  *ib = window > 0 ? min64(c->n - 1, j1 + window - 1 - c->p0) : c->n - 1;
}

/* row b of the (B, S) segment ids as 32-bit integers into dst (NULL: none) */
static const int32_t *segment_row(const gl_tensor *seg, int64_t b, int32_t *dst) {
  if (!seg) return NULL;
  for (int64_t j = 0; j < seg->shape[1]; j++)
    dst[j] = (int32_t)load_id(seg, seg->offset + b * seg->stride[0] + j * seg->stride[1]);
  return dst;
}

#define GL_TEMPLATE "attention.c"
#include "template.h"

/* a window of S keys or more hides none (and S bounds the arithmetic on it);
   a negative one (no mask) is kept: R(geom_of) reads it */
static inline int64_t effective_window(int64_t window, int64_t S) {
  return window < 0 ? -1 : window > 0 && window < S ? window : 0;
}

int cpu_attention_forward(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                          const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window) {
  window = effective_window(window, k->shape[2]);
  if (q->dtype == GL_F64) return attention_forward_f64(out, lse, q, k, v, segments, scale, window);
  return attention_forward_f32(out, lse, q, k, v, segments, scale, window);
}

int cpu_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                           const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                           const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments,
                           double scale, int64_t window) {
  window = effective_window(window, k->shape[2]);
  if (q->dtype == GL_F64) return attention_backward_f64(dq, dk, dv, dout, q, k, v, out, lse, segments, scale, window);
  return attention_backward_f32(dq, dk, dv, dout, q, k, v, out, lse, segments, scale, window);
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */

/* One register as a GCC vector (and its integer twin for lane masks): the
   accumulators below stay in registers whatever the auto-vectorizer
   decides. */
typedef real R(vec) __attribute__((vector_size(VBYTES)));
typedef R(ilane) R(ivec) __attribute__((vector_size(VBYTES)));
static inline R(vec) R(vload)(const real *p) { R(vec) v; memcpy(&v, p, sizeof v); return v; }
static inline void R(vstore)(real *p, R(vec) v) { memcpy(p, &v, sizeof v); }
static inline R(vec) R(vsplat)(real x) { return (R(vec)){0} + x; }
/* lanes of a where m is set, else of b */
static inline R(vec) R(vsel)(R(ivec) m, R(vec) a, R(vec) b) {
  return (R(vec))(((R(ivec))a & m) | ((R(ivec))b & ~m));
}
/* lane numbers 0 .. VL - 1 */
static inline R(ivec) R(iota)(void) {
  R(ivec) x;
  for (int i = 0; i < VL; i++) x[i] = (R(ilane))i;
  return x;
}

/* Shapes of one call, shared by its tasks; ld is the row stride of the
   query-major tile buffers (TM or fewer queries, padded to whole vectors). */
typedef struct {
  int64_t T, S, D, Dp, ld, tm, window, off; /* off: position of query 0 */
  real scale;
} R(geom);

/* window < 0 (no mask): every query past every key, no window */
static R(geom) R(geom_of)(int64_t T, int64_t S, int64_t D, int64_t window, double scale) {
  int64_t tm = min64(T, TM);
  return (R(geom)){T, S, D, round_up(D, VL), round_up(tm, VL), tm, window < 0 ? 0 : window,
                   window < 0 ? S - 1 : S - T, (real)scale};
}

/* D reals into row (b, h, i) of t: a plain copy when that is contiguous
   reals (R(cpu_span_store) converts element by element at any stride) */
static inline void R(store_row)(gl_tensor *t, int64_t b, int64_t h, int64_t i, int64_t D, const real *src) {
  int64_t off = row_offset(t, b, h, i);
  if (t->dtype == RDT && t->stride[3] == 1) {
    real *dst = (real *)t->storage->data + off;
    for (int64_t d = 0; d < D; d++) dst[d] = src[d];
  } else {
    R(cpu_span_store)(t, off, t->stride[3], D, src);
  }
}

/* n rows of D from head (b, h) of t, from row i0, row-major into buf with
   row stride Dp, zero padded (padded columns are read by whole-vector
   loads) */
static void R(load_rows)(const R(geom) *g, const gl_tensor *t, int64_t b, int64_t h, int64_t i0, int64_t n,
                         real *buf) {
  int64_t D = g->D, Dp = g->Dp;
  for (int64_t i = 0; i < n; i++) {
    real *dst = buf + i * Dp;
    const real *p = R(cpu_span_load)(t, row_offset(t, b, h, i0 + i), t->stride[3], D, dst);
    if (p != dst)
      for (int64_t d = 0; d < D; d++) dst[d] = p[d];
    for (int64_t d = D; d < Dp; d++) dst[d] = 0;
  }
}

/* S x D rows: element (j, d) at p[j * rs + d * cs] */
typedef struct { const real *p; int64_t rs, cs; } R(mat);

/* Head (b, h) of t as such rows: in place when t holds reals, shares no
   storage with the call's outputs out1..3 (written while it is read) and,
   where its rows are read as whole vectors (vec), they are contiguous and
   D is a whole number of vectors; else packed into buf. */
static R(mat) R(head_rows)(const R(geom) *g, const gl_tensor *t, int64_t b, int64_t h, int vec,
                           const gl_tensor *out1, const gl_tensor *out2, const gl_tensor *out3, real *buf) {
  int shared = (out1 && out1->storage == t->storage) || (out2 && out2->storage == t->storage) ||
               (out3 && out3->storage == t->storage);
  if (t->dtype == RDT && !shared && (!vec || (t->stride[3] == 1 && g->D == g->Dp)))
    return (R(mat)){(const real *)t->storage->data + row_offset(t, b, h, 0), t->stride[2], t->stride[3]};
  R(load_rows)(g, t, b, h, 0, g->S, buf);
  return (R(mat)){buf, g->Dp, 1};
}

/* The VL x VL block at x (row stride lx) transposed into y (row stride ly).
   Element by element a transpose is a strided access per element (5% of
   the whole kernel at T = 64); with GCC's two-source shuffles it is
   log2 VL rounds in registers, each swapping the off-diagonal b x b
   sub-blocks of every 2b x 2b block.  Other compilers copy elements. */
static inline void R(transpose_block)(real *y, int64_t ly, const real *x, int64_t lx) {
#if defined(__GNUC__) && !defined(__clang__)
  R(vec) r[VL];
  GL_UNROLL
  for (int i = 0; i < VL; i++) r[i] = R(vload)(x + i * lx);
  GL_UNROLL
  for (int b = VL / 2; b > 0; b /= 2) {
    R(ivec) lo, hi;
    GL_UNROLL
    for (int i = 0; i < VL; i++) {
      lo[i] = (R(ilane))(i & b ? i - b + VL : i);
      hi[i] = (R(ilane))(i & b ? i + VL : i + b);
    }
    GL_UNROLL
    for (int i = 0; i < VL; i++)
      if (!(i & b)) {
        R(vec) u = r[i], v = r[i + b];
        r[i] = __builtin_shuffle(u, v, lo);
        r[i + b] = __builtin_shuffle(u, v, hi);
      }
  }
  GL_UNROLL
  for (int i = 0; i < VL; i++) R(vstore)(y + i * ly, r[i]);
#else
  for (int64_t d = 0; d < VL; d++)
    for (int64_t i = 0; i < VL; i++) y[d * ly + i] = x[i * lx + d];
#endif
}

/* The tile's rows of head (b, h) of t, row-major into rows (ld x Dp: the
   padding, rows and columns, zero), and transposed into cols (Dp x ld). */
static void R(load_tile)(const R(geom) *g, const tile *c, const gl_tensor *t, int64_t b, int64_t h, real *rows,
                         real *cols) {
  int64_t Dp = g->Dp, ld = g->ld;
  R(load_rows)(g, t, b, h, c->t0, c->n, rows);
  for (int64_t i = c->n * Dp; i < ld * Dp; i++) rows[i] = 0;
  for (int64_t i0 = 0; i0 < ld; i0 += VL)
    for (int64_t d0 = 0; d0 < Dp; d0 += VL) R(transpose_block)(cols + d0 * ld + i0, ld, rows + i0 * Dp + d0, Dp);
}

/* C (mr rows x nv vectors, row stride ldc) = (add ? C : 0) + A B over
   k < kn, with A[r][k] at A[r * ars + k * aks] and B row-major, row stride
   ldb.  Called only with constant mr and nv (R(gemm_rows)), so the loops
   unroll fully and acc is held in registers. */
static inline __attribute__((always_inline)) void R(micro)(int mr, int nv, int add, real *C, int64_t ldc,
                                                           const real *A, int64_t ars, int64_t aks,
                                                           const real *B, int64_t ldb, int64_t kn) {
  R(vec) acc[MR][NV];
  GL_UNROLL
  for (int r = 0; r < mr; r++)
    GL_UNROLL
    for (int c = 0; c < nv; c++) acc[r][c] = (R(vec)){0};
  for (int64_t k = 0; k < kn; k++) {
    R(vec) bv[NV];
    GL_UNROLL
    for (int c = 0; c < nv; c++) bv[c] = R(vload)(B + k * ldb + c * VL);
    GL_UNROLL
    for (int r = 0; r < mr; r++) {
      real a = A[r * ars + k * aks];
      GL_UNROLL
      for (int c = 0; c < nv; c++) acc[r][c] += a * bv[c];
    }
  }
  GL_UNROLL
  for (int r = 0; r < mr; r++)
    GL_UNROLL
    for (int c = 0; c < nv; c++) {
      real *p = C + r * ldc + c * VL;
      R(vstore)(p, add ? acc[r][c] + R(vload)(p) : acc[r][c]);
    }
}

/* R(micro) over nvec vectors of columns, in blocks of NV, for mr <= MR rows */
static void R(gemm_rows)(int mr, int64_t nvec, int add, real *C, int64_t ldc, const real *A, int64_t ars,
                         int64_t aks, const real *B, int64_t ldb, int64_t kn) {
  for (int64_t c = 0; c < nvec; c += NV) {
    int nv = nvec - c < NV ? (int)(nvec - c) : NV;
    real *Cc = C + c * VL;
    const real *Bc = B + c * VL;
#define GL_ATT_CASE(m)                                                            \
  case m:                                                                         \
    if (nv == NV) R(micro)(m, NV, add, Cc, ldc, A, ars, aks, Bc, ldb, kn);        \
    else R(micro)(m, 1, add, Cc, ldc, A, ars, aks, Bc, ldb, kn);                  \
    break;
    switch (mr) {
      GL_ATT_CASE(1) GL_ATT_CASE(2) GL_ATT_CASE(3) GL_ATT_CASE(4)
      GL_ATT_CASE(5) GL_ATT_CASE(6) GL_ATT_CASE(7) GL_ATT_CASE(8)
    }
#undef GL_ATT_CASE
  }
}
_Static_assert(MR == 8 && NV <= 2, "R(gemm_rows) enumerates mr = 1..8 and nv = 1, 2");

/* Ct[j - klo][i] = M[j] . X[i] for the tile's keys j and the query lanes
   that see them, X given transposed as Xt (D x ld) */
static void R(key_rows)(const R(geom) *g, const tile *c, real *Ct, R(mat) M, const real *Xt) {
  for (int64_t j0 = c->klo; j0 <= c->khi; j0 += MR) {
    int mr = (int)min64(MR, c->khi - j0 + 1);
    int64_t ia, ib;
    seeing(c, g->window, j0, j0 + mr - 1, &ia, &ib);
    int64_t c0 = ia / VL * VL;
    R(gemm_rows)(mr, (ib - c0) / VL + 1, 0, Ct + (j0 - c->klo) * g->ld + c0, g->ld, M.p + j0 * M.rs, M.rs, M.cs,
                 Xt + c0, g->ld, g->D);
  }
}

/* Y[i] = sum over keys j of Wt[j - klo][i] M[j] for the tile's queries
   (Y n x Dp; M's rows contiguous whole vectors), each block of queries
   reducing over the keys they see */
static void R(query_sums)(const R(geom) *g, const tile *c, real *Y, const real *Wt, R(mat) M) {
  for (int64_t r0 = 0; r0 < c->n; r0 += MR) {
    int mr = (int)min64(MR, c->n - r0);
    int64_t lo = first_key(c->p0 + r0, g->window), hi = min64(c->p0 + r0 + mr - 1, g->S - 1);
    R(gemm_rows)(mr, g->Dp / VL, 0, Y + r0 * g->Dp, g->Dp, Wt + (lo - c->klo) * g->ld + r0, 1, g->ld,
                 M.p + lo * M.rs, M.rs, hi - lo + 1);
  }
}

/* Y[j] += sum over queries i of Wt[j - klo][i] X[i] for the tile's keys
   (X n x Dp), each block of keys reducing over the queries that see them */
static void R(key_sums)(const R(geom) *g, const tile *c, real *Y, const real *Wt, const real *X) {
  for (int64_t j0 = c->klo; j0 <= c->khi; j0 += MR) {
    int mr = (int)min64(MR, c->khi - j0 + 1);
    int64_t ia, ib;
    seeing(c, g->window, j0, j0 + mr - 1, &ia, &ib);
    R(gemm_rows)(mr, g->Dp / VL, 1, Y + j0 * g->Dp, g->Dp, Wt + (j0 - c->klo) * g->ld + ia, g->ld, 1,
                 X + ia * g->Dp, g->Dp, ib - ia + 1);
  }
}

/* lanes [c, c + VL) of key row j that are visible queries of the tile
   (iota: R(iota)()) */
static inline R(ivec) R(visible)(const R(geom) *g, const tile *t, R(ivec) iota, int64_t j, int64_t c) {
  int64_t hi = g->window > 0 ? min64(t->n - 1, j + g->window - 1 - t->p0) : t->n - 1;
  R(ivec) idx = iota + (R(ilane))c;
  R(ivec) m = (idx >= (R(ilane))(j - t->p0)) & (idx <= (R(ilane))hi);
  if (t->seg) { /* and the same document: lanes past the tile's queries are masked above */
    R(ivec) qs;
    for (int i = 0; i < VL; i++) qs[i] = c + i < t->n ? (R(ilane))t->seg[t->p0 + c + i] : (R(ilane))0;
    m &= qs == (R(ilane))t->seg[j];
  }
  return m;
}

/* The tile's probabilities from its scores Pt (key rows [0, khi - klo],
   query lanes): scaled, -inf where invisible, m = max over keys per query,
   Pt = exp(Pt - m) (0 where invisible), l = sum over keys per query. */
static void R(tile_softmax)(const R(geom) *g, const tile *c, R(ivec) iota, real *Pt, real *m_out, real *l_out) {
  int64_t ld = g->ld, nu = ld / VL, rows = c->khi - c->klo + 1;
  R(vec) m[TM / VL], l[TM / VL];
  for (int64_t u = 0; u < nu; u++) m[u] = R(vsplat)(-INFINITY), l[u] = (R(vec)){0};
  for (int64_t j = 0; j < rows; j++)
    for (int64_t u = 0; u < nu; u++) {
      real *p = Pt + j * ld + u * VL;
      R(vec) x = R(vsel)(R(visible)(g, c, iota, c->klo + j, u * VL), R(vload)(p) * g->scale, R(vsplat)(-INFINITY));
      R(vstore)(p, x);
      m[u] = R(vsel)(x > m[u], x, m[u]);
    }
  for (int64_t u = 0; u < nu; u++) /* padded lanes: exp(-inf - 0) = 0, not NaN */
    m[u] = R(vsel)(iota + (R(ilane))(u * VL) < (R(ilane))c->n, m[u], (R(vec)){0});
  for (int64_t j = 0; j < rows; j++)
    for (int64_t u = 0; u < nu; u++) R(vstore)(Pt + j * ld + u * VL, R(vload)(Pt + j * ld + u * VL) - m[u]);
  R(cpu_vexp)(Pt, Pt, rows * ld);
  for (int64_t j = 0; j < rows; j++)
    for (int64_t u = 0; u < nu; u++) l[u] += R(vload)(Pt + j * ld + u * VL);
  memcpy(m_out, m, (size_t)ld * sizeof(real));
  memcpy(l_out, l, (size_t)ld * sizeof(real));
}

/* The tile's probabilities and score gradients from its scores Pt and dSt
   holding dP = dO V^T: Pt = exp(scale Pt - lse) (0 where invisible),
   dSt = scale P (dP - D) with D = rowsum(dO * O) per query (di).  dP is
   set to 0 where invisible first: there it is unset memory, and 0 times
   that need not be 0. */
static void R(tile_dscores)(const R(geom) *g, const tile *c, R(ivec) iota, real *Pt, real *dSt, const real *lse,
                            const real *di) {
  int64_t ld = g->ld, nu = ld / VL, rows = c->khi - c->klo + 1;
  R(vec) L[TM / VL], Dt[TM / VL];
  for (int64_t u = 0; u < nu; u++) L[u] = R(vload)(lse + u * VL), Dt[u] = R(vload)(di + u * VL);
  for (int64_t j = 0; j < rows; j++)
    for (int64_t u = 0; u < nu; u++) {
      real *p = Pt + j * ld + u * VL, *dp = dSt + j * ld + u * VL;
      R(ivec) vis = R(visible)(g, c, iota, c->klo + j, u * VL);
      R(vstore)(p, R(vsel)(vis, R(vload)(p) * g->scale - L[u], R(vsplat)(-INFINITY)));
      R(vstore)(dp, R(vsel)(vis, R(vload)(dp), (R(vec)){0}));
    }
  R(cpu_vexp)(Pt, Pt, rows * ld);
  for (int64_t j = 0; j < rows; j++)
    for (int64_t u = 0; u < nu; u++) {
      real *dp = dSt + j * ld + u * VL;
      R(vstore)(dp, R(vload)(Pt + j * ld + u * VL) * (R(vload)(dp) - Dt[u]) * g->scale);
    }
}

/* per-thread scratch of the forward: K, V (unless used in place), the
   tile's Q^T, O and Pt */
static int64_t R(forward_scratch)(const R(geom) *g) {
  return 2 * g->S * g->Dp + 2 * g->Dp * g->ld + g->S * g->ld + g->S; /* + the row's segment ids */
}

static void R(forward_task)(const R(geom) *g, gl_tensor *out, gl_tensor *lse, const gl_tensor *q,
                            const gl_tensor *k, const gl_tensor *v, const gl_tensor *segments, int64_t b, int64_t h,
                            int64_t hk, real *ws) {
  int64_t S = g->S, D = g->D, Dp = g->Dp, ld = g->ld;
  real *Kb = ws, *Vb = Kb + S * Dp, *Qt = Vb + S * Dp, *Ob = Qt + Dp * ld, *Pt = Ob + ld * Dp;
  const int32_t *seg = segment_row(segments, b, (int32_t *)(Pt + S * ld));
  R(ivec) iota = R(iota)();
  R(mat) K = R(head_rows)(g, k, b, hk, 0, out, lse, NULL, Kb), V = R(head_rows)(g, v, b, hk, 1, out, lse, NULL, Vb);
  for (int64_t t0 = 0; t0 < g->T; t0 += g->tm) {
    tile c = make_tile(g->T, S, g->off, g->window, t0, g->tm, seg);
    real m[TM], l[TM];
    R(load_tile)(g, &c, q, b, h, Ob, Qt); /* Ob holds Q's rows until P V */
    R(key_rows)(g, &c, Pt, K, Qt);
    R(tile_softmax)(g, &c, iota, Pt, m, l);
    R(query_sums)(g, &c, Ob, Pt, V);
    for (int64_t i = 0; i < c.n; i++) {
      real *o = Ob + i * Dp, inv = 1 / l[i];
      for (int64_t d = 0; d < D; d++) o[d] *= inv;
      R(store_row)(out, b, h, t0 + i, D, o);
      if (lse) ((real *)lse->storage->data)[lse_offset(lse, b, h, t0 + i)] = m[i] + log(l[i]);
    }
  }
}

static int R(attention_forward)(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                                const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window) {
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  int64_t Hkv = k->shape[1], S = k->shape[2], G = H / Hkv, ntask = B * H;
  R(geom) g = R(geom_of)(T, S, D, window, scale);
  int64_t per = R(forward_scratch)(&g);
  int nt = gl_threads_for(ntask, T * S * D);
  real *ws = (real *)cpu_scratch(0, (size_t)(nt * per) * sizeof(real));
  if (!ws) return gl_error("gl_attention_forward: out of memory for per-thread buffers (S=%lld, D=%lld)",
                           (long long)S, (long long)D);
  GL_PAR_FOR(nt, task, ntask,
    int64_t b = task / H, h = task % H;
    R(forward_task)(&g, out, lse, q, k, v, segments, b, h, h / G, ws + gl_thread_id() * per);
  );
  return GL_OK;
}

/* per-thread scratch of the backward: K, V (unless used in place), dK,
   dV, the tile's Q, dO and dQ (row-major), Q^T and dO^T, Pt and dSt */
static int64_t R(backward_scratch)(const R(geom) *g) {
  return 4 * g->S * g->Dp + 5 * g->ld * g->Dp + 2 * g->S * g->ld + g->S; /* + the row's segment ids */
}

static void R(backward_task)(const R(geom) *g, gl_tensor *dq, gl_tensor *dk, gl_tensor *dv,
                             const gl_tensor *dout, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                             const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments, int64_t b,
                             int64_t hk, int64_t G, real *ws) {
  int64_t S = g->S, D = g->D, Dp = g->Dp, ld = g->ld, tm = g->tm;
  real *Kb = ws, *Vb = Kb + S * Dp, *dK = Vb + S * Dp, *dV = dK + S * Dp;
  real *Qb = dV + S * Dp, *Gb = Qb + ld * Dp, *dQb = Gb + ld * Dp, *Qt = dQb + ld * Dp, *Gt = Qt + Dp * ld;
  real *Pt = Gt + Dp * ld, *dSt = Pt + S * ld;
  const int32_t *seg = segment_row(segments, b, (int32_t *)(dSt + S * ld));
  R(ivec) iota = R(iota)();
  R(mat) K = R(head_rows)(g, k, b, hk, 1, dq, dk, dv, Kb), V = R(head_rows)(g, v, b, hk, 0, dq, dk, dv, Vb);
  for (int64_t i = 0; i < 2 * S * Dp; i++) dK[i] = 0; /* dK and dV */
  for (int64_t h = hk * G; h < (hk + 1) * G; h++) {
    for (int64_t t0 = 0; t0 < g->T; t0 += tm) {
      tile c = make_tile(g->T, S, g->off, g->window, t0, tm, seg);
      real l[TM] = {0}, di[TM] = {0};
      for (int64_t i = 0; i < c.n; i++) l[i] = ((const real *)lse->storage->data)[lse_offset(lse, b, h, t0 + i)];
      R(load_tile)(g, &c, q, b, h, Qb, Qt);
      R(load_tile)(g, &c, dout, b, h, Gb, Gt);
      R(load_rows)(g, out, b, h, t0, c.n, dQb); /* O's rows (dQb is free until dQ) */
      for (int64_t i = 0; i < c.n; i++)
        for (int64_t d = 0; d < D; d++) di[i] += Gb[i * Dp + d] * dQb[i * Dp + d];
      R(key_rows)(g, &c, Pt, K, Qt);
      R(key_rows)(g, &c, dSt, V, Gt);
      R(tile_dscores)(g, &c, iota, Pt, dSt, l, di);
      R(query_sums)(g, &c, dQb, dSt, K);
      for (int64_t i = 0; i < c.n; i++) R(store_row)(dq, b, h, t0 + i, D, dQb + i * Dp);
      R(key_sums)(g, &c, dK, dSt, Qb);
      R(key_sums)(g, &c, dV, Pt, Gb);
    }
  }
  for (int64_t j = 0; j < S; j++) {
    R(store_row)(dk, b, hk, j, D, dK + j * Dp);
    R(store_row)(dv, b, hk, j, D, dV + j * Dp);
  }
}

static int R(attention_backward)(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                                 const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                 const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments, double scale,
                                 int64_t window) {
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  int64_t Hkv = k->shape[1], S = k->shape[2], G = H / Hkv, ntask = B * Hkv;
  R(geom) g = R(geom_of)(T, S, D, window, scale);
  int64_t per = R(backward_scratch)(&g);
  int nt = gl_threads_for(ntask, 2 * G * T * S * D);
  real *ws = (real *)cpu_scratch(0, (size_t)(nt * per) * sizeof(real));
  if (!ws) return gl_error("gl_attention_backward: out of memory for per-thread buffers (S=%lld, D=%lld)",
                           (long long)S, (long long)D);
  GL_PAR_FOR(nt, task, ntask,
    R(backward_task)(&g, dq, dk, dv, dout, q, k, v, out, lse, segments, task / Hkv, task % Hkv, G,
                     ws + gl_thread_id() * per);
  );
  return GL_OK;
}

#undef real
#undef RDT
#undef R
#endif
