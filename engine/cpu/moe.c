/* moe.c — CPU kernels of the mixture-of-experts ops (the twin of
 * kernels/moe.cu): the routing plan (per-expert counts and each
 * assignment's row in expert order), the permutation of token rows into
 * that order and the weighted combine back, with the combine's weight
 * gradient, and the grouped products over every expert's rows.
 *
 * The permuted buffer holds the experts' rows one expert after another:
 * expert e owns rows [off_e, off_e + counts[e]), off_e the sum of the
 * counts before it; an expert's rows keep token order (assignment (n, k)
 * before (n', k') when n < n', or n == n' and k < k'), and with a capacity
 * the first `capacity` assignments of an expert are kept, the rest dropped
 * (slot -1).  Rows past the last expert's (the buffer is sized by the upper
 * bound N K) are zero, so an activation with act(0) = 0 keeps them zero.
 *
 * Compiled as a template: the generic section at the bottom is included
 * with real = float and real = double (template.h). */
#ifndef real
#include "cpu.h"
#include <stdlib.h>

#define GL_TEMPLATE "moe.c"
#include "template.h"

int cpu_moe_route(gl_tensor *slots, gl_tensor *counts, gl_tensor *load, const gl_tensor *experts, int64_t capacity) {
  const char *fn = "gl_moe_route";
  int64_t E = counts->shape[0], N = experts->shape[0], K = experts->shape[1];
  GL_TRY(cpu_check_ids(fn, "experts", experts, E, "experts: the size of counts", 0, 0));
  int64_t *seen = (int64_t *)cpu_scratch(1, (size_t)(2 * E) * sizeof(int64_t));
  if (!seen) return gl_error("%s: out of memory for the per-expert counts", fn);
  int64_t *off = seen + E;
  for (int64_t e = 0; e < E; e++) seen[e] = 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++)
      seen[load_id(experts, experts->offset + n * experts->stride[0] + k * experts->stride[1])]++;
  int64_t *cd = (int64_t *)counts->storage->data, *ld = (int64_t *)load->storage->data;
  int64_t total = 0;
  for (int64_t e = 0; e < E; e++) {
    int64_t kept = capacity > 0 && seen[e] > capacity ? capacity : seen[e];
    ld[load->offset + e * load->stride[0]] = seen[e];
    cd[counts->offset + e * counts->stride[0]] = kept;
    off[e] = total;
    total += kept;
    seen[e] = 0;  /* from here: assignments of e placed so far */
  }
  int64_t *sd = (int64_t *)slots->storage->data;
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) {
      int64_t e = load_id(experts, experts->offset + n * experts->stride[0] + k * experts->stride[1]);
      int64_t i = seen[e]++;
      sd[slots->offset + n * slots->stride[0] + k * slots->stride[1]] =
        capacity > 0 && i >= capacity ? -1 : off[e] + i;
    }
  return GL_OK;
}

/* Every slot in [-1, rows) and no row named twice (the permutation writes
   each named row once, the combine's backward relies on it). */
static int check_slots(const char *fn, const gl_tensor *slots, int64_t rows) {
  int64_t N = slots->shape[0], K = slots->shape[1];
  unsigned char *mark = (unsigned char *)cpu_scratch(1, (size_t)(rows > 0 ? rows : 1));
  if (!mark) return gl_error("%s: out of memory for the slot check", fn);
  memset(mark, 0, (size_t)rows);
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) {
      int64_t s = load_id(slots, slots->offset + n * slots->stride[0] + k * slots->stride[1]);
      if (s < -1 || s >= rows)
        return gl_error("%s: slots[%lld][%lld] is %lld, expected -1 (dropped) or 0 <= slot < %lld (rows of the "
                        "expert-ordered buffer)", fn, (long long)n, (long long)k, (long long)s, (long long)rows);
      if (s >= 0 && mark[s]++)
        return gl_error("%s: slots[%lld][%lld] is %lld, a row another assignment already names, expected each "
                        "row at most once (slots from gl_moe_route)", fn, (long long)n, (long long)k, (long long)s);
    }
  return GL_OK;
}

int cpu_moe_permute(gl_tensor *out, const gl_tensor *x, const gl_tensor *slots, const gl_tensor *weights) {
  GL_TRY(check_slots("gl_moe_permute", slots, out->shape[0]));
  return CPU_CALL(cpu_wide(out) || cpu_wide(x), moe_permute, out, x, slots, weights);
}
int cpu_moe_combine(gl_tensor *out, const gl_tensor *y, const gl_tensor *slots, const gl_tensor *weights) {
  GL_TRY(check_slots("gl_moe_combine", slots, y->shape[0]));
  return CPU_CALL(cpu_wide(out) || cpu_wide(y), moe_combine, out, y, slots, weights);
}
int cpu_moe_combine_wgrad(gl_tensor *dweights, const gl_tensor *dout, const gl_tensor *y, const gl_tensor *slots) {
  GL_TRY(check_slots("gl_moe_combine_wgrad", slots, y->shape[0]));
  return CPU_CALL(cpu_wide(dweights) || cpu_wide(y), moe_combine_wgrad, dweights, dout, y, slots);
}

/* rows [r0, r0 + n) of a 2-D tensor, as a view */
static gl_tensor rows_of(const gl_tensor *t, int64_t r0, int64_t n) {
  gl_tensor v = *t;
  v.offset += r0 * t->stride[0];
  v.shape[0] = n;
  v.numel = n * t->shape[1];
  return v;
}
/* the transpose of a 2-D view */
static gl_tensor transposed(gl_tensor v) {
  int64_t s = v.shape[0], st = v.stride[0];
  v.shape[0] = v.shape[1]; v.stride[0] = v.stride[1];
  v.shape[1] = s; v.stride[1] = st;
  return v;
}

/* the experts' row counts (c) and first rows (off, n + 1 entries), checked to
   fit the buffer's rows */
static int read_counts(const char *fn, const gl_tensor *counts, int64_t rows, int64_t *c, int64_t *off) {
  int64_t total = 0;
  for (int64_t e = 0; e < counts->shape[0]; e++) {
    off[e] = total;
    c[e] = load_id(counts, counts->offset + e * counts->stride[0]);
    if (c[e] < 0) return gl_error("%s: counts[%lld] is %lld, expected >= 0", fn, (long long)e, (long long)c[e]);
    total += c[e];
    if (total > rows)
      return gl_error("%s: the counts sum to more than %lld, expected at most the %lld rows of the buffer", fn,
                      (long long)total - 1, (long long)rows);
  }
  off[counts->shape[0]] = total;
  return GL_OK;
}

/* The experts' products side by side: each thread takes whole experts, its
   BLAS calls single-threaded inside the region (a product of one expert's
   rows, a few hundred, is too small to split well).  An error message is
   the failing thread's own, so the first failed expert's product runs again
   on this thread to leave it here.  (The products use the matmul's scratch
   slots, so the counts live in malloc'd memory.) */
static int per_expert(int n, const int64_t *c, int (*product)(int e, void *ctx), void *ctx) {
  int *status = (int *)calloc((size_t)n, sizeof(int));
  if (!status) return gl_error("gl_grouped_matmul: out of memory for the experts' status");
  int64_t work = 0;
  for (int e = 0; e < n; e++) work += c[e];
  int nt = gl_threads_for(n, work / (n ? n : 1) * 4096);
  GL_PAR_FOR(nt, e, n, status[e] = product((int)e, ctx););
  int failed = -1;
  for (int e = 0; e < n && failed < 0; e++) if (status[e] != GL_OK) failed = e;
  free(status);
  return failed < 0 ? GL_OK : product(failed, ctx);
}

typedef struct {
  gl_tensor *out, **dbs;
  const gl_tensor *a, *x, *y, **bs;
  const int64_t *c, *off;
} grouped_ctx;

/* rows of expert e: out_e = a_e @ bs[e] */
static int forward_product(int e, void *p) {
  grouped_ctx *g = (grouped_ctx *)p;
  if (g->c[e] == 0) return GL_OK;
  gl_tensor o = rows_of(g->out, g->off[e], g->c[e]), x = rows_of(g->a, g->off[e], g->c[e]);
  return cpu_matmul(&o, &x, g->bs[e], 1.0, 0.0);
}
/* dbs[e] = x_e^T y_e, zero for an expert without rows (cpu_matmul with K = 0) */
static int weight_product(int e, void *p) {
  grouped_ctx *g = (grouped_ctx *)p;
  gl_tensor xt = transposed(rows_of(g->x, g->off[e], g->c[e])), ye = rows_of(g->y, g->off[e], g->c[e]);
  return cpu_matmul(g->dbs[e], &xt, &ye, 1.0, 0.0);
}

/* one BLAS product per expert with rows (cpu_matmul), then zeros past the last */
int cpu_grouped_matmul(gl_tensor *out, const gl_tensor *a, int n, const gl_tensor **bs, const gl_tensor *counts) {
  int64_t *c = (int64_t *)malloc((size_t)(2 * n + 1) * sizeof(int64_t)), M = out->shape[0];
  if (!c) return gl_error("gl_grouped_matmul: out of memory for the counts");
  grouped_ctx g = {.out = out, .a = a, .bs = bs, .c = c, .off = c + n};
  int rc = read_counts("gl_grouped_matmul", counts, M, c, c + n);
  if (rc == GL_OK) rc = per_expert(n, c, forward_product, &g);
  if (rc == GL_OK && c[2 * n] < M) {
    gl_tensor rest = rows_of(out, c[2 * n], M - c[2 * n]);
    rc = cpu_fill(&rest, 0.0);
  }
  free(c);
  return rc;
}

int cpu_grouped_matmul_wgrad(int n, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y,
                             const gl_tensor *counts) {
  int64_t *c = (int64_t *)malloc((size_t)(2 * n + 1) * sizeof(int64_t));
  if (!c) return gl_error("gl_grouped_matmul_wgrad: out of memory for the counts");
  grouped_ctx g = {.dbs = dbs, .x = x, .y = y, .c = c, .off = c + n};
  int rc = read_counts("gl_grouped_matmul_wgrad", counts, x->shape[0], c, c + n);
  if (rc == GL_OK) rc = per_expert(n, c, weight_product, &g);
  free(c);
  return rc;
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */
#include "row_access.h"

static inline int64_t R(slot_at)(const gl_tensor *slots, int64_t n, int64_t k) {
  return load_id(slots, slots->offset + n * slots->stride[0] + k * slots->stride[1]);
}
static inline real R(weight_at)(const gl_tensor *w, int64_t n, int64_t k) {
  return w ? R(ld)(w, w->offset + n * w->stride[0] + k * w->stride[1]) : (real)1;
}

/* out[slot(n, k)] = w(n, k) x[n]; rows no slot names are zero.  Each output
   row is written by the one assignment naming it. */
static int R(moe_permute)(gl_tensor *out, const gl_tensor *x, const gl_tensor *slots, const gl_tensor *w) {
  int64_t M = out->shape[0], C = out->shape[1], N = slots->shape[0], K = slots->shape[1];
  int64_t os0 = out->stride[0], os1 = out->stride[1], xs0 = x->stride[0], xs1 = x->stride[1];
  unsigned char *named = (unsigned char *)cpu_scratch(1, (size_t)(M > 0 ? M : 1));
  if (!named) return OOM("gl_moe_permute", "the row marks");
  memset(named, 0, (size_t)M);
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) {
      int64_t s = R(slot_at)(slots, n, k);
      if (s >= 0) named[s] = 1;
    }
  int nt = gl_threads_for(M, C);
  GL_PAR_FOR(nt, m, M,
    if (!named[m]) for (int64_t c = 0; c < C; c++) R(st)(out, out->offset + m * os0 + c * os1, 0);
  );
  nt = gl_threads_for(N, K * C);
  GL_PAR_FOR(nt, n, N,
    for (int64_t k = 0; k < K; k++) {
      int64_t s = R(slot_at)(slots, n, k);
      if (s < 0) continue;
      real wk = R(weight_at)(w, n, k);
      for (int64_t c = 0; c < C; c++)
        R(st)(out, out->offset + s * os0 + c * os1, wk * R(ld)(x, x->offset + n * xs0 + c * xs1));
    }
  );
  return GL_OK;
}

/* out[n] = sum over k, in order, of w(n, k) y[slot(n, k)] (dropped: nothing) */
static int R(moe_combine)(gl_tensor *out, const gl_tensor *y, const gl_tensor *slots, const gl_tensor *w) {
  int64_t C = out->shape[1], N = slots->shape[0], K = slots->shape[1];
  int64_t os0 = out->stride[0], os1 = out->stride[1], ys0 = y->stride[0], ys1 = y->stride[1];
  int nt = gl_threads_for(N, K * C);
  GL_PAR_FOR(nt, n, N,
    for (int64_t c = 0; c < C; c++) {
      real acc = 0;
      for (int64_t k = 0; k < K; k++) {
        int64_t s = R(slot_at)(slots, n, k);
        if (s >= 0) acc += R(weight_at)(w, n, k) * R(ld)(y, y->offset + s * ys0 + c * ys1);
      }
      R(st)(out, out->offset + n * os0 + c * os1, acc);
    }
  );
  return GL_OK;
}

/* dw(n, k) = dout[n] . y[slot(n, k)], 0 for a dropped assignment */
static int R(moe_combine_wgrad)(gl_tensor *dw, const gl_tensor *dout, const gl_tensor *y, const gl_tensor *slots) {
  int64_t C = dout->shape[1], N = slots->shape[0], K = slots->shape[1];
  int nt = gl_threads_for(N, K * C);
  GL_PAR_FOR(nt, n, N,
    for (int64_t k = 0; k < K; k++) {
      int64_t s = R(slot_at)(slots, n, k);
      real acc = 0;
      if (s >= 0)
        for (int64_t c = 0; c < C; c++)
          acc += R(ld)(dout, dout->offset + n * dout->stride[0] + c * dout->stride[1]) *
                 R(ld)(y, y->offset + s * y->stride[0] + c * y->stride[1]);
      R(st)(dw, dw->offset + n * dw->stride[0] + k * dw->stride[1], acc);
    }
  );
  return GL_OK;
}

#undef OOM
#undef real
#undef RDT
#undef R
#endif
