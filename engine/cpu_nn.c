/* cpu_nn.c — CPU kernels for the neural-net ops: softmax, layernorm and
 * rmsnorm, embedding, index_select / gather / scatter_add / index_add,
 * rotary embedding, fused cross-entropy and dropout (each forward and
 * backward).
 *
 * Row ops (softmax, norms, cross-entropy, rope) treat a tensor as rows of
 * its last dim; rows are independent and run in parallel.  A row is
 * computed on contiguous arrays of the compute type `real` (float, or double
 * for float64): in place when the tensor already is such an array, else
 * converted through per-thread scratch (cpu_span_load / cpu_span_store,
 * cpu_scratch in cpu_elementwise.c).
 *
 * Index ops walk "lines" along the indexed dim: every position over the
 * other dims owns one line of the output, so lines run in parallel without
 * races.  index_select is gather and index_add is scatter_add with the 1-D
 * index expanded (0 strides) to the full shape.  Ids are checked against
 * their limit before anything is written.
 *
 * Compiled as a template: the generic section at the bottom is included
 * with real = float and real = double. */
#ifndef real
#include "cpu_kernels.h"
#include <tgmath.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { CHUNK = 512 };



/* Storage offset of position r of a row-major walk over `shape` (nd dims),
   with t's strides, leaving out dim `skip` (-1: none). */
static inline int64_t walk_offset(const gl_tensor *t, const int64_t *shape, int nd, int skip, int64_t r) {
  int64_t off = t->offset;
  for (int d = nd - 1; d >= 0; d--) {
    if (d == skip) continue;
    off += (r % shape[d]) * t->stride[d];
    r /= shape[d];
  }
  return off;
}

static inline int64_t load_id(const gl_tensor *t, int64_t off) {
  return t->dtype == GL_I32 ? ((const int32_t *)t->storage->data)[off] : ((const int64_t *)t->storage->data)[off];
}

/* Every id in [0, limit), or == ignore when has_ignore; else an error naming
   the first offending value, its position and the limit. */
static int check_ids(const char *fn, const char *arg, const gl_tensor *ids, int64_t limit, const char *what,
                     int has_ignore, int64_t ignore) {
  gl_iter it;
  gl_iter_init(&it, 1, (const gl_tensor *[]){ids});
  for (int64_t o = 0; o < it.outer; o++) {
    int64_t off[GL_ITER_MAX_OPS];
    gl_iter_offsets(&it, o, off);
    for (int64_t i = 0; i < it.inner; i++) {
      int64_t v = load_id(ids, off[0] + i * it.istride[0]);
      if ((v < 0 || v >= limit) && !(has_ignore && v == ignore)) {
        if (has_ignore)
          return gl_error("%s: %s[%lld] is %lld, expected 0 <= %s < %lld (%s) or ignore_index %lld", fn, arg,
                          (long long)(o * it.inner + i), (long long)v, arg, (long long)limit, what,
                          (long long)ignore);
        return gl_error("%s: %s[%lld] is %lld, expected 0 <= %s < %lld (%s)", fn, arg,
                        (long long)(o * it.inner + i), (long long)v, arg, (long long)limit, what);
      }
    }
  }
  return GL_OK;
}

/* the 1-D index idx as a view of `like`'s shape: idx[j] along dim, 0 strides elsewhere */
static gl_tensor expand_index(const gl_tensor *idx, const gl_tensor *like, int dim) {
  gl_tensor v = *idx;
  v.ndim = like->ndim; v.numel = like->numel;
  for (int d = 0; d < like->ndim; d++) { v.shape[d] = like->shape[d]; v.stride[d] = d == dim ? idx->stride[0] : 0; }
  return v;
}

static inline void copy_elem(char *dst, const char *src, int esz) {
  switch (esz) {
  case 1: *dst = *src; break;
  case 2: memcpy(dst, src, 2); break;
  case 4: memcpy(dst, src, 4); break;
  default: memcpy(dst, src, 8); break;
  }
}

/* out[pos, j] = x[pos, idx[pos, j]] along dim; idx has out's shape (any
   strides, 0 allowed); a byte copy, so any dtype */
static void gather_lines(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  int nd = out->ndim, esz = gl_dtype_size(x->dtype);
  int64_t L = out->shape[dim], npos = L ? out->numel / L : 0;
  const char *xb = (const char *)x->storage->data;
  char *ob = (char *)out->storage->data;
  int nt = gl_threads_for(npos, L);
  GL_PAR_FOR(nt, p, npos, 
    int64_t oo = walk_offset(out, out->shape, nd, dim, p), io = walk_offset(idx, out->shape, nd, dim, p);
    int64_t xo = walk_offset(x, out->shape, nd, dim, p);
    for (int64_t j = 0; j < L; j++) {
      int64_t id = load_id(idx, io + j * idx->stride[dim]);
      copy_elem(ob + (oo + j * out->stride[dim]) * esz, xb + (xo + id * x->stride[dim]) * esz, esz);
    }
  );
}

#define GL_TEMPLATE "cpu_nn.c"
#include "cpu_template.h"

/* compute in double for float64 (or wide integer) data, float otherwise */
static int wide(const gl_tensor *t) { return t && (t->dtype == GL_F64 || t->dtype == GL_I32 || t->dtype == GL_I64); }
#define CALL(use_double, name, ...) ((use_double) ? name##_f64(__VA_ARGS__) : name##_f32(__VA_ARGS__))

int cpu_softmax(gl_tensor *out, const gl_tensor *x, int is_log) {
  return CALL(wide(x), softmax, out, x, is_log);
}
int cpu_softmax_backward(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int is_log) {
  return CALL(wide(y), softmax_backward, dx, y, dy, is_log);
}
int cpu_layernorm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                          const gl_tensor *weight, const gl_tensor *bias, double eps) {
  return CALL(wide(x), norm_forward, "gl_layernorm_forward", y, mean, rstd, x, weight, bias, eps, 1);
}
int cpu_layernorm_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                           const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd) {
  return CALL(wide(x), norm_backward, "gl_layernorm_backward", dx, dweight, dbias, dy, x, weight, mean, rstd, 1);
}
int cpu_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *weight, double eps) {
  return CALL(wide(x), norm_forward, "gl_rmsnorm_forward", y, NULL, rstd, x, weight, NULL, eps, 0);
}
int cpu_rmsnorm_backward(gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *rstd) {
  return CALL(wide(x), norm_backward, "gl_rmsnorm_backward", dx, dweight, NULL, dy, x, weight, NULL, rstd, 0);
}

int cpu_embedding_forward(gl_tensor *out, const gl_tensor *table, const gl_tensor *ids) {
  GL_TRY(check_ids("gl_embedding_forward", "ids", ids, table->shape[0], "rows of table", 0, 0));
  int nd = ids->ndim, esz = gl_dtype_size(table->dtype);
  int64_t C = table->shape[1], n = ids->numel, tcs = table->stride[1], ocs = out->stride[nd];
  const char *tb = (const char *)table->storage->data;
  char *ob = (char *)out->storage->data;
  int nt = gl_threads_for(n, C);
  GL_PAR_FOR(nt, r, n, 
    int64_t id = load_id(ids, walk_offset(ids, ids->shape, nd, -1, r));
    const char *src = tb + (table->offset + id * table->stride[0]) * esz;
    char *dst = ob + walk_offset(out, out->shape, nd, -1, r) * esz;
    if (tcs == 1 && ocs == 1) memcpy(dst, src, (size_t)(C * esz));
    else for (int64_t c = 0; c < C; c++) copy_elem(dst + c * ocs * esz, src + c * tcs * esz, esz);
  );
  return GL_OK;
}
int cpu_embedding_backward(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids) {
  GL_TRY(check_ids("gl_embedding_backward", "ids", ids, dtable->shape[0], "rows of dtable", 0, 0));
  return CALL(wide(dtable), embedding_backward, dtable, dout, ids);
}

int cpu_index_select(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  GL_TRY(check_ids("gl_index_select", "idx", idx, x->shape[dim], "size of x in dim", 0, 0));
  gl_tensor full = expand_index(idx, out, dim);
  gather_lines(out, x, dim, &full);
  return GL_OK;
}
int cpu_gather(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  GL_TRY(check_ids("gl_gather", "idx", idx, x->shape[dim], "size of x in dim", 0, 0));
  gather_lines(out, x, dim, idx);
  return GL_OK;
}
int cpu_scatter_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  GL_TRY(check_ids("gl_scatter_add", "idx", idx, out->shape[dim], "size of out in dim", 0, 0));
  CALL(wide(out) || wide(src), scatter_lines, out, dim, idx, src);
  return GL_OK;
}
int cpu_index_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  GL_TRY(check_ids("gl_index_add", "idx", idx, out->shape[dim], "size of out in dim", 0, 0));
  gl_tensor full = expand_index(idx, src, dim);
  CALL(wide(out) || wide(src), scatter_lines, out, dim, &full, src);
  return GL_OK;
}

int cpu_rope(gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse) {
  return CALL(wide(x), rope, out, x, cos, sin, inverse);
}
int cpu_rope_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *cos,
                             const gl_tensor *sin, double eps) {
  return CALL(wide(x), rope_rmsnorm, y, rstd, NULL, x, cos, sin, eps);
}
int cpu_rope_rmsnorm_backward(gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *cos,
                              const gl_tensor *sin, const gl_tensor *rstd) {
  return CALL(wide(x), rope_rmsnorm, dx, (gl_tensor *)rstd, dy, x, cos, sin, 0);
}

int cpu_cross_entropy_forward(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                              const gl_tensor *targets, int64_t ignore_index, double softcap) {
  GL_TRY(check_ids("gl_cross_entropy_forward", "targets", targets, logits->shape[1], "vocab size of logits", 1,
                   ignore_index));
  return CALL(wide(logits), ce_forward, losses, lse, logits, targets, ignore_index, softcap);
}
int cpu_cross_entropy_backward(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                               const gl_tensor *lse, int64_t ignore_index, double softcap, double scale,
                               const gl_tensor *scale_by) {
  GL_TRY(check_ids("gl_cross_entropy_backward", "targets", targets, logits->shape[1], "vocab size of logits", 1,
                   ignore_index));
  if (scale_by) scale *= gl_load(scale_by->storage->data, scale_by->dtype, scale_by->offset);
  return CALL(wide(logits), ce_backward, dlogits, logits, targets, lse, ignore_index, softcap, scale);
}

int cpu_dropout(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset) {
  CALL(wide(x), dropout, out, x, p, seed, offset);
  return GL_OK;
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */


/* nt per-thread blocks of n reals (64-byte aligned) in scratch slot 0 */
static real *R(thread_blocks)(int nt, int64_t n, int64_t *stride) {
  *stride = (n + 15) & ~(int64_t)15;
  return (real *)cpu_scratch(0, (size_t)(nt * *stride) * sizeof(real));
}

/* a row of n reals to write t's elements at off, stride st: t's memory or buf */
static inline real *R(row_out)(gl_tensor *t, int64_t off, int64_t st, real *buf) {
  return (t->dtype == RDT && st == 1) ? (real *)t->storage->data + off : buf;
}

/* t's elements as one dense array of real, or NULL: the row kernels' fast
   path (every tensor the ops layer hands them), which walks rows by pointer
   instead of a per-row offset walk and span copy; on rows of 32 (QK-norm,
   rope over heads) that walk cost 5-8x the arithmetic */
static inline real *R(dense)(const gl_tensor *t) {
  return (t->dtype == RDT && gl_is_contiguous(t)) ? (real *)t->storage->data + t->offset : NULL;
}

static inline real R(ld)(const gl_tensor *t, int64_t i) {
  return t->dtype == RDT ? ((const real *)t->storage->data)[i] : (real)gl_load(t->storage->data, t->dtype, i);
}
static inline void R(st)(gl_tensor *t, int64_t i, real v) {
  if (t->dtype == RDT) ((real *)t->storage->data)[i] = v;
  else gl_store(t->storage->data, t->dtype, i, (double)v);
}

#define OOM(fn, what) gl_error("%s: out of memory for %s", fn, what)

/* ---- softmax ------------------------------------------------------------ */

static int R(softmax)(gl_tensor *out, const gl_tensor *x, int is_log) {
  int nd = x->ndim - 1;
  int64_t C = x->shape[nd], rows = C ? x->numel / C : 0, xs = x->stride[nd], ys = out->stride[nd], bs;
  int nt = gl_threads_for(rows, 4 * C);
  real *ws = R(thread_blocks)(nt, 3 * C, &bs);
  if (!ws) return OOM("gl_softmax", "row buffers");
  GL_PAR_FOR(nt, r, rows, 
    real *xb = ws + gl_thread_id() * bs, *yb = xb + C, *e = yb + C;
    int64_t yo = walk_offset(out, out->shape, nd, -1, r);
    const real *xr = R(cpu_span_load)(x, walk_offset(x, x->shape, nd, -1, r), xs, C, xb);
    real *y = R(row_out)(out, yo, ys, yb), m = xr[0], s = 0;
    _Pragma("omp simd reduction(max:m)")
    for (int64_t c = 0; c < C; c++) m = xr[c] > m ? xr[c] : m;
    for (int64_t c = 0; c < C; c++) e[c] = xr[c] - m;
    R(cpu_vexp)(e, e, C);
    _Pragma("omp simd reduction(+:s)")
    for (int64_t c = 0; c < C; c++) s += e[c];
    if (is_log) {
      real lse = m + log(s);
      for (int64_t c = 0; c < C; c++) y[c] = xr[c] - lse;
    } else {
      real inv = 1 / s;
      for (int64_t c = 0; c < C; c++) y[c] = e[c] * inv;
    }
    R(cpu_span_store)(out, yo, ys, C, y);
  );
  return GL_OK;
}

/* softmax: dx = y * (dy - sum(dy * y));  log_softmax: dx = dy - exp(y) * sum(dy) */
static int R(softmax_backward)(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int is_log) {
  int nd = y->ndim - 1;
  int64_t C = y->shape[nd], rows = C ? y->numel / C : 0, bs;
  int nt = gl_threads_for(rows, 4 * C);
  real *ws = R(thread_blocks)(nt, 4 * C, &bs);
  if (!ws) return OOM("gl_softmax_backward", "row buffers");
  GL_PAR_FOR(nt, r, rows, 
    real *yb = ws + gl_thread_id() * bs, *gb = yb + C, *xb = gb + C, *e = xb + C;
    int64_t xo = walk_offset(dx, dx->shape, nd, -1, r);
    const real *yr = R(cpu_span_load)(y, walk_offset(y, y->shape, nd, -1, r), y->stride[nd], C, yb);
    const real *g = R(cpu_span_load)(dy, walk_offset(dy, dy->shape, nd, -1, r), dy->stride[nd], C, gb);
    real *d = R(row_out)(dx, xo, dx->stride[nd], xb), s = 0;
    if (is_log) {
      _Pragma("omp simd reduction(+:s)")
      for (int64_t c = 0; c < C; c++) s += g[c];
      R(cpu_vexp)(e, yr, C);
      for (int64_t c = 0; c < C; c++) d[c] = g[c] - e[c] * s;
    } else {
      _Pragma("omp simd reduction(+:s)")
      for (int64_t c = 0; c < C; c++) s += g[c] * yr[c];
      for (int64_t c = 0; c < C; c++) d[c] = yr[c] * (g[c] - s);
    }
    R(cpu_span_store)(dx, xo, dx->stride[nd], C, d);
  );
  return GL_OK;
}

/* ---- layernorm / rmsnorm ---------------------------------------------------
   One kernel for both: center = 1 is layernorm (subtract the mean, optional
   bias), center = 0 is rmsnorm (mean taken as 0, no bias).  A NULL weight is
   1, a NULL bias 0.  mean/rstd are arrays of real (validated by ops.c). */

/* weight and bias as contiguous reals (ones / zeros when NULL) in slot 1 */
static int R(norm_params)(const char *fn, const gl_tensor *w, const gl_tensor *b, int64_t C,
                          const real **wr, const real **br) {
  real *ps = (real *)cpu_scratch(1, (size_t)(2 * C) * sizeof(real));
  if (!ps) return OOM(fn, "weight buffers");
  for (int64_t c = 0; c < C; c++) { ps[c] = 1; ps[C + c] = 0; }
  *wr = w ? R(cpu_span_load)(w, w->offset, w->stride[0], C, ps) : ps;
  *br = b ? R(cpu_span_load)(b, b->offset, b->stride[0], C, ps + C) : ps + C;
  return GL_OK;
}

static int R(norm_forward)(const char *fn, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                           const gl_tensor *w, const gl_tensor *b, double eps, int center) {
  int nd = x->ndim - 1;
  int64_t C = x->shape[nd], rows = x->numel / C, bs;
  const real *wr, *br;
  GL_TRY(R(norm_params)(fn, w, b, C, &wr, &br));
  int nt = gl_threads_for(rows, 4 * C);
  const real *xd = R(dense)(x);
  real *yd = R(dense)(y), *md = mean ? R(dense)(mean) : NULL, *rd = rstd ? R(dense)(rstd) : NULL;
  if (xd && yd && (!mean || md) && (!rstd || rd)) { /* dense: the same arithmetic, rows by pointer */
    GL_PAR_FOR(nt, part, nt, 
      for (int64_t r = rows * part / nt, r1 = rows * (part + 1) / nt; r < r1; r++) {
        const real *xr = xd + r * C;
        real *yr = yd + r * C, m = 0, v = 0;
        if (center) {
          _Pragma("omp simd reduction(+:m)")
          for (int64_t c = 0; c < C; c++) m += xr[c];
          m /= (real)C;
        }
        _Pragma("omp simd reduction(+:v)")
        for (int64_t c = 0; c < C; c++) v += (xr[c] - m) * (xr[c] - m);
        real rs = 1 / sqrt(v / (real)C + (real)eps);
        for (int64_t c = 0; c < C; c++) yr[c] = (xr[c] - m) * rs * wr[c] + br[c];
        if (md) md[r] = m;
        if (rd) rd[r] = rs;
      }
    );
    return GL_OK;
  }
  real *ws = R(thread_blocks)(nt, 2 * C, &bs);
  if (!ws) return OOM(fn, "row buffers");
  GL_PAR_FOR(nt, r, rows, 
    real *xb = ws + gl_thread_id() * bs, *yb = xb + C;
    int64_t yo = walk_offset(y, y->shape, nd, -1, r);
    const real *xr = R(cpu_span_load)(x, walk_offset(x, x->shape, nd, -1, r), x->stride[nd], C, xb);
    real m = 0, v = 0;
    if (center) {
      _Pragma("omp simd reduction(+:m)")
      for (int64_t c = 0; c < C; c++) m += xr[c];
      m /= (real)C;
    }
    _Pragma("omp simd reduction(+:v)")
    for (int64_t c = 0; c < C; c++) v += (xr[c] - m) * (xr[c] - m);
    real rs = 1 / sqrt(v / (real)C + (real)eps);
    real *yr = R(row_out)(y, yo, y->stride[nd], yb);
    for (int64_t c = 0; c < C; c++) yr[c] = (xr[c] - m) * rs * wr[c] + br[c];
    R(cpu_span_store)(y, yo, y->stride[nd], C, yr);
    if (mean) ((real *)mean->storage->data)[walk_offset(mean, x->shape, nd, -1, r)] = m;
    if (rstd) ((real *)rstd->storage->data)[walk_offset(rstd, x->shape, nd, -1, r)] = rs;
  );
  return GL_OK;
}

/* xhat = (x - mean) * rstd, g = dy * w:
   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))   (mean(g) term only when centering)
   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy,
   summed per thread and combined in thread order (deterministic). */
static int R(norm_backward)(const char *fn, gl_tensor *dx, gl_tensor *dw, gl_tensor *db, const gl_tensor *dy,
                            const gl_tensor *x, const gl_tensor *w, const gl_tensor *mean, const gl_tensor *rstd,
                            int center) {
  int nd = x->ndim - 1;
  int64_t C = x->shape[nd], rows = x->numel / C, bs;
  const real *wr, *unused;
  GL_TRY(R(norm_params)(fn, w, NULL, C, &wr, &unused));
  int nt = gl_threads_for(rows, 8 * C);
  real *ws = R(thread_blocks)(nt, 5 * C, &bs);
  if (!ws) return OOM(fn, "row buffers");
  for (int k = 0; k < nt; k++) memset(ws + k * bs + 3 * C, 0, (size_t)(2 * C) * sizeof(real));
  const real *mp = mean ? (const real *)mean->storage->data : NULL, *rp = (const real *)rstd->storage->data;
  const real *xd = R(dense)(x), *gd = R(dense)(dy), *md = mean ? R(dense)(mean) : NULL, *rd = R(dense)(rstd);
  real *dd = R(dense)(dx);
  if (xd && gd && dd && (!mean || md) && rd) { /* dense: the same arithmetic, rows by pointer */
    GL_PAR_FOR(nt, part, nt, 
      real *pw = ws + part * bs + 3 * C, *pb = pw + C;
      for (int64_t r = rows * part / nt, r1 = rows * (part + 1) / nt; r < r1; r++) {
        const real *xr = xd + r * C, *g = gd + r * C;
        real *d = dd + r * C, m = center ? md[r] : 0, rs = rd[r], sg = 0, sgx = 0;
        _Pragma("omp simd reduction(+:sg, sgx)")
        for (int64_t c = 0; c < C; c++) {
          real xh = (xr[c] - m) * rs, gw = g[c] * wr[c];
          sg += gw; sgx += gw * xh;
          pw[c] += g[c] * xh; pb[c] += g[c];
        }
        sg = center ? sg / (real)C : 0; sgx /= (real)C;
        for (int64_t c = 0; c < C; c++) d[c] = rs * (g[c] * wr[c] - sg - (xr[c] - m) * rs * sgx);
      }
    );
  } else GL_PAR_FOR(nt, r, rows, 
    real *xb = ws + gl_thread_id() * bs, *gb = xb + C, *db_ = gb + C, *pw = db_ + C, *pb = pw + C;
    int64_t xo = walk_offset(dx, dx->shape, nd, -1, r);
    const real *xr = R(cpu_span_load)(x, walk_offset(x, x->shape, nd, -1, r), x->stride[nd], C, xb);
    const real *g = R(cpu_span_load)(dy, walk_offset(dy, dy->shape, nd, -1, r), dy->stride[nd], C, gb);
    real m = center ? mp[walk_offset(mean, x->shape, nd, -1, r)] : 0;
    real rs = rp[walk_offset(rstd, x->shape, nd, -1, r)], sg = 0, sgx = 0;
    _Pragma("omp simd reduction(+:sg, sgx)")
    for (int64_t c = 0; c < C; c++) {
      real xh = (xr[c] - m) * rs, gw = g[c] * wr[c];
      sg += gw; sgx += gw * xh;
      pw[c] += g[c] * xh; pb[c] += g[c];
    }
    sg = center ? sg / (real)C : 0; sgx /= (real)C;
    real *d = R(row_out)(dx, xo, dx->stride[nd], db_);
    for (int64_t c = 0; c < C; c++) d[c] = rs * (g[c] * wr[c] - sg - (xr[c] - m) * rs * sgx);
    R(cpu_span_store)(dx, xo, dx->stride[nd], C, d);
  );
  real *sum = ws + 3 * C; /* thread 0's partials collect the others */
  for (int k = 1; k < nt; k++)
    for (int64_t c = 0; c < 2 * C; c++) sum[c] += ws[k * bs + 3 * C + c];
  if (dw) R(cpu_span_store)(dw, dw->offset, dw->stride[0], C, sum);
  if (db) R(cpu_span_store)(db, db->offset, db->stride[0], C, sum + C);
  return GL_OK;
}

/* ---- embedding backward ---------------------------------------------------
   dtable[v] = sum of dout rows r with ids[r] == v.  The rows of each v are
   found through a counting sort of ids (CSR, slot 1), so every table row is
   summed by one thread in row order: no races, deterministic, one rounding
   per output even for bfloat16. */
static int R(embedding_backward)(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids) {
  int nd = ids->ndim;
  int64_t V = dtable->shape[0], C = dtable->shape[1], n = ids->numel, bs;
  int64_t *start = (int64_t *)cpu_scratch(1, (size_t)(2 * V + 1 + n) * sizeof(int64_t));
  if (!start) return OOM("gl_embedding_backward", "the id index");
  int64_t *fill = start + V + 1, *order = fill + V;
  memset(start, 0, (size_t)(V + 1) * sizeof *start);
  for (int64_t r = 0; r < n; r++) start[load_id(ids, walk_offset(ids, ids->shape, nd, -1, r)) + 1]++;
  for (int64_t v = 0; v < V; v++) { start[v + 1] += start[v]; fill[v] = start[v]; }
  for (int64_t r = 0; r < n; r++) order[fill[load_id(ids, walk_offset(ids, ids->shape, nd, -1, r))]++] = r;
  int nt = gl_threads_for(V, C + C * n / (V ? V : 1));
  real *ws = R(thread_blocks)(nt, 2 * C, &bs);
  if (!ws) return OOM("gl_embedding_backward", "row buffers");
  GL_PAR_FOR(nt, v, V, 
    real *acc = ws + gl_thread_id() * bs, *rb = acc + C;
    for (int64_t c = 0; c < C; c++) acc[c] = 0;
    for (int64_t k = start[v]; k < start[v + 1]; k++) {
      const real *row = R(cpu_span_load)(dout, walk_offset(dout, dout->shape, nd, -1, order[k]), dout->stride[nd], C, rb);
      for (int64_t c = 0; c < C; c++) acc[c] += row[c];
    }
    R(cpu_span_store)(dtable, dtable->offset + v * dtable->stride[0], dtable->stride[1], C, acc);
  );
  return GL_OK;
}

/* ---- scatter_add / index_add ---------------------------------------------
   out[pos, idx[pos, j]] += src[pos, j] along dim; idx has src's shape. */
static void R(scatter_lines)(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  int nd = src->ndim;
  int64_t L = src->shape[dim], npos = L ? src->numel / L : 0;
  int nt = gl_threads_for(npos, L);
  GL_PAR_FOR(nt, p, npos, 
    int64_t oo = walk_offset(out, src->shape, nd, dim, p), io = walk_offset(idx, src->shape, nd, dim, p);
    int64_t so = walk_offset(src, src->shape, nd, dim, p);
    for (int64_t j = 0; j < L; j++) {
      int64_t e = oo + load_id(idx, io + j * idx->stride[dim]) * out->stride[dim];
      R(st)(out, e, R(ld)(out, e) + R(ld)(src, so + j * src->stride[dim]));
    }
  );
}

/* ---- rotary embedding -----------------------------------------------------
   x (B, T, H, D), halves x1 = x[:D/2], x2 = x[D/2:], cos/sin (T, D/2):
   forward  y1 = x1 c + x2 s,  y2 = -x1 s + x2 c;  inverse flips the sign of s. */
static int R(rope)(gl_tensor *out, const gl_tensor *x, const gl_tensor *cs, const gl_tensor *sn, int inverse) {
  int64_t T = x->shape[1], H = x->shape[2], D = x->shape[3], half = D / 2, rows = x->numel / (D ? D : 1), bs;
  real sg = inverse ? -1 : 1;
  int nt = gl_threads_for(rows, 2 * D);
  real *ws = R(thread_blocks)(nt, 3 * D, &bs);
  if (!ws) return OOM("gl_rope", "row buffers");
  if (D == 0) return GL_OK;
  const real *xd = R(dense)(x), *cd = R(dense)(cs), *sd = R(dense)(sn);
  real *yd = R(dense)(out);
  if (xd && yd && cd && sd) { /* dense: the same arithmetic, rows by pointer */
    GL_PAR_FOR(nt, part, nt, 
      for (int64_t r = rows * part / nt, r1 = rows * (part + 1) / nt; r < r1; r++) {
        int64_t t = (r / H) % T;
        const real *xr = xd + r * D, *c = cd + t * half, *s = sd + t * half;
        real *y = yd + r * D;
        for (int64_t i = 0; i < half; i++) {
          real x1 = xr[i], x2 = xr[i + half];
          y[i] = x1 * c[i] + sg * x2 * s[i];
          y[i + half] = x2 * c[i] - sg * x1 * s[i];
        }
      }
    );
    return GL_OK;
  }
  GL_PAR_FOR(nt, r, rows, 
    real *xb = ws + gl_thread_id() * bs, *yb = xb + D, *cb = yb + D, *sb = cb + half;
    int64_t t = (r / H) % T, yo = walk_offset(out, out->shape, 3, -1, r);
    const real *xr = R(cpu_span_load)(x, walk_offset(x, x->shape, 3, -1, r), x->stride[3], D, xb);
    const real *c = R(cpu_span_load)(cs, cs->offset + t * cs->stride[0], cs->stride[1], half, cb);
    const real *s = R(cpu_span_load)(sn, sn->offset + t * sn->stride[0], sn->stride[1], half, sb);
    real *y = R(row_out)(out, yo, out->stride[3], yb);
    for (int64_t i = 0; i < half; i++) {
      real x1 = xr[i], x2 = xr[i + half];
      y[i] = x1 * c[i] + sg * x2 * s[i];
      y[i + half] = x2 * c[i] - sg * x1 * s[i];
    }
    R(cpu_span_store)(out, yo, out->stride[3], D, y);
  );
  return GL_OK;
}

/* ---- rotary embedding + RMSNorm over the head dim (nanochat's q and k) -----
   Forward (dy NULL): rs = 1 / sqrt(mean(x^2) + eps), y = rope(x) rs, rs kept
   in st (or not: NULL).  Backward (dy given, st holds rs): g = rope^T(dy),
   dx = rs (g - x rs mean(g x rs)).  The rotation keeps the row's sum of
   squares, so the statistics are x's in both directions.  out is y or dx.
   Rows (b, t, h) address each tensor through its own strides.  dx must not
   alias x (the row of g is written over dx before x is read again). */
#define ROW_OFF(u) ((u)->offset + b * (u)->stride[0] + t * (u)->stride[1] + h * (u)->stride[2])
static int R(rope_rmsnorm)(gl_tensor *out, gl_tensor *st, const gl_tensor *dy, const gl_tensor *x,
                           const gl_tensor *cs, const gl_tensor *sn, double eps) {
  const char *fn = dy ? "gl_rope_rmsnorm_backward" : "gl_rope_rmsnorm_forward";
  int64_t T = x->shape[1], H = x->shape[2], D = x->shape[3], half = D / 2, rows = x->numel / D, bs;
  int nt = gl_threads_for(rows, 4 * D);
  real *ws = R(thread_blocks)(nt, 4 * D, &bs);
  if (!ws) return OOM(fn, "row buffers");
  GL_PAR_FOR(nt, r, rows, 
    real *xb = ws + gl_thread_id() * bs, *gb = xb + D, *ob = gb + D, *cb = ob + D, *sb = cb + half;
    int64_t h = r % H, t = (r / H) % T, b = r / H / T;
    int64_t oo = ROW_OFF(out);
    const real *xr = R(cpu_span_load)(x, ROW_OFF(x), x->stride[3], D, xb);
    const real *c = R(cpu_span_load)(cs, cs->offset + t * cs->stride[0], cs->stride[1], half, cb);
    const real *s = R(cpu_span_load)(sn, sn->offset + t * sn->stride[0], sn->stride[1], half, sb);
    int64_t so = st ? ROW_OFF(st) : 0;
    real *o = R(row_out)(out, oo, out->stride[3], ob);
    if (!dy) {
      real v = 0;
      _Pragma("omp simd reduction(+:v)")
      for (int64_t i = 0; i < D; i++) v += xr[i] * xr[i];
      real rs = 1 / sqrt(v / (real)D + (real)eps);
      for (int64_t i = 0; i < half; i++) {
        real x1 = xr[i], x2 = xr[i + half];
        o[i] = (x1 * c[i] + x2 * s[i]) * rs;
        o[i + half] = (x2 * c[i] - x1 * s[i]) * rs;
      }
      if (st) ((real *)st->storage->data)[so] = rs;
    } else {
      const real *d = R(cpu_span_load)(dy, ROW_OFF(dy), dy->stride[3], D, gb);
      real rs = ((const real *)st->storage->data)[so], sgx = 0;
      for (int64_t i = 0; i < half; i++) {  /* g = rope^T(dy) into o, then its product with x */
        real g1 = d[i] * c[i] - d[i + half] * s[i], g2 = d[i + half] * c[i] + d[i] * s[i];
        o[i] = g1; o[i + half] = g2;
        sgx += g1 * xr[i] + g2 * xr[i + half];
      }
      sgx = sgx * rs / (real)D;
      for (int64_t i = 0; i < D; i++) o[i] = rs * (o[i] - xr[i] * rs * sgx);
    }
    R(cpu_span_store)(out, oo, out->stride[3], D, o);
  );
  return GL_OK;
}
#undef ROW_OFF

/* ---- cross-entropy --------------------------------------------------------
   z = softcap > 0 ? softcap * tanh(logits / softcap) : logits
   lse = log sum exp z, loss = lse - z[target]; ignored rows: loss = lse = 0.
   backward: dlogits = scale * (exp(z - lse) - onehot) * dz/dlogits,
   dz/dlogits = 1 - (z / softcap)^2. */
static int R(ce_forward)(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits, const gl_tensor *targets,
                         int64_t ignore, double softcap) {
  int64_t N = logits->shape[0], V = logits->shape[1], bs;
  real sc = (real)softcap;
  int nt = gl_threads_for(N, 4 * V);
  real *ws = R(thread_blocks)(nt, 3 * V, &bs);
  if (!ws) return OOM("gl_cross_entropy_forward", "row buffers");
  real *lp = (real *)losses->storage->data, *ep = lse ? (real *)lse->storage->data : NULL;
  GL_PAR_FOR(nt, r, N, 
    real *xb = ws + gl_thread_id() * bs, *zb = xb + V, *e = zb + V, loss = 0, l = 0;
    int64_t tg = load_id(targets, targets->offset + r * targets->stride[0]);
    if (tg != ignore) {
      const real *z = R(cpu_span_load)(logits, logits->offset + r * logits->stride[0], logits->stride[1], V, xb);
      if (sc > 0) {
        for (int64_t c = 0; c < V; c++) zb[c] = z[c] / sc;
        R(cpu_vtanh)(zb, zb, V);
        for (int64_t c = 0; c < V; c++) zb[c] *= sc;
        z = zb;
      }
      real m = z[0], s = 0;
      _Pragma("omp simd reduction(max:m)")
      for (int64_t c = 0; c < V; c++) m = z[c] > m ? z[c] : m;
      for (int64_t c = 0; c < V; c++) e[c] = z[c] - m;
      R(cpu_vexp)(e, e, V);
      _Pragma("omp simd reduction(+:s)")
      for (int64_t c = 0; c < V; c++) s += e[c];
      l = m + log(s);
      loss = l - z[tg];
    }
    lp[losses->offset + r * losses->stride[0]] = loss;
    if (ep) ep[lse->offset + r * lse->stride[0]] = l;
  );
  return GL_OK;
}

static int R(ce_backward)(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                          const gl_tensor *lse, int64_t ignore, double softcap, double scale) {
  int64_t N = logits->shape[0], V = logits->shape[1], ds = dlogits->stride[1], bs;
  real sc = (real)softcap, k = (real)scale;
  int nt = gl_threads_for(N, 4 * V);
  real *ws = R(thread_blocks)(nt, 4 * V, &bs);
  if (!ws) return OOM("gl_cross_entropy_backward", "row buffers");
  const real *ep = (const real *)lse->storage->data;
  GL_PAR_FOR(nt, r, N, 
    real *xb = ws + gl_thread_id() * bs, *db = xb + V, *t = db + V, *e = t + V;
    int64_t tg = load_id(targets, targets->offset + r * targets->stride[0]);
    int64_t dof = dlogits->offset + r * dlogits->stride[0];
    real *d = R(row_out)(dlogits, dof, ds, db);
    if (tg == ignore) {
      for (int64_t c = 0; c < V; c++) d[c] = 0;
    } else {
      const real *x = R(cpu_span_load)(logits, logits->offset + r * logits->stride[0], logits->stride[1], V, xb);
      real l = ep[lse->offset + r * lse->stride[0]];
      if (sc > 0) { /* t = tanh(x / sc), z = sc t, dz/dx = 1 - t^2 */
        for (int64_t c = 0; c < V; c++) t[c] = x[c] / sc;
        R(cpu_vtanh)(t, t, V);
        for (int64_t c = 0; c < V; c++) e[c] = sc * t[c] - l;
        R(cpu_vexp)(e, e, V);
        for (int64_t c = 0; c < V; c++) d[c] = k * (e[c] - (c == tg)) * (1 - t[c] * t[c]);
      } else {
        for (int64_t c = 0; c < V; c++) e[c] = x[c] - l;
        R(cpu_vexp)(e, e, V);
        for (int64_t c = 0; c < V; c++) d[c] = k * (e[c] - (c == tg));
      }
    }
    R(cpu_span_store)(dlogits, dof, ds, V, d);
  );
  return GL_OK;
}

/* ---- dropout ---------------------------------------------------------------
   Element e (row-major index) is kept when the unit value of Philox word
   (offset + e) is < 1 - p; kept values are scaled by 1 / (1 - p).  p = 0
   keeps everything (a unit value can be exactly 1).  One Philox block
   yields 4 consecutive words, so each is computed once per 4 elements. */
static void R(dropout)(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset) {
  int nd = x->ndim, lead = nd > 0 ? nd - 1 : 0;
  int64_t L = nd > 0 ? x->shape[nd - 1] : 1, rows = L ? x->numel / L : 0;
  int64_t xs = nd > 0 ? x->stride[nd - 1] : 1, ys = nd > 0 ? out->stride[nd - 1] : 1;
  int64_t nchunk = (L + CHUNK - 1) / CHUNK, ntask = rows * nchunk;
  double keep = 1 - p;
  real scale = keep > 0 ? (real)(1 / keep) : 0;
  int nt = gl_threads_for(ntask, 4 * CHUNK);
  GL_PAR_FOR(nt, task, ntask, 
    real xb[CHUNK], yb[CHUNK];
    uint32_t words[4];
    int64_t r = task / nchunk, j0 = (task % nchunk) * CHUNK, n = L - j0 < CHUNK ? L - j0 : CHUNK;
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
