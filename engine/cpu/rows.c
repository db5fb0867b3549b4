/* rows.c — CPU kernels of the ops on rows of the last dim: softmax /
 * log_softmax and layernorm / rmsnorm, forward and backward (the twin of
 * kernels/rows.cu).
 *
 * Rows are independent and run in parallel.  A row is computed on
 * contiguous arrays of the compute type `real` (float, or double for
 * float64): in place when the tensor already is such an array, else
 * converted through per-thread scratch (cpu_span_load / cpu_span_store,
 * cpu_scratch in elementwise.c).
 *
 * Compiled as a template: the generic section at the bottom is included
 * with real = float and real = double (template.h). */
#ifndef real
#include "cpu.h"
#include <tgmath.h>

#define GL_TEMPLATE "rows.c"
#include "template.h"

int cpu_softmax(gl_tensor *out, const gl_tensor *x, int is_log) {
  return CPU_CALL(cpu_wide(x), softmax, out, x, is_log);
}
int cpu_softmax_backward(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int is_log) {
  return CPU_CALL(cpu_wide(y), softmax_backward, dx, y, dy, is_log);
}
int cpu_layernorm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                          const gl_tensor *weight, const gl_tensor *bias, double eps) {
  return CPU_CALL(cpu_wide(x), norm_forward, "gl_layernorm_forward", y, mean, rstd, x, weight, bias, eps, 1);
}
int cpu_layernorm_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                           const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd) {
  return CPU_CALL(cpu_wide(x), norm_backward, "gl_layernorm_backward", dx, dweight, dbias, dy, x, weight, mean, rstd, 1);
}
int cpu_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *weight, double eps) {
  return CPU_CALL(cpu_wide(x), norm_forward, "gl_rmsnorm_forward", y, NULL, rstd, x, weight, NULL, eps, 0);
}
int cpu_rmsnorm_backward(gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *rstd) {
  return CPU_CALL(cpu_wide(x), norm_backward, "gl_rmsnorm_backward", dx, dweight, NULL, dy, x, weight, NULL, rstd, 0);
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */
#include "row_access.h"

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

#undef OOM
#undef real
#undef RDT
#undef R
#endif
