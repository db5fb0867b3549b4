/* rope_norm.c — CPU kernels of the rotary embedding, alone and fused with a
 * parameter-free RMSNorm over the head dim (nanochat's q and k), forward and
 * backward (the twin of kernels/rope_norm.cu).
 *
 * Compiled as a template: the generic section at the bottom is included
 * with real = float and real = double (template.h). */
#ifndef real
#include "cpu.h"
#include <tgmath.h>

#define GL_TEMPLATE "rope_norm.c"
#include "template.h"

int cpu_rope(gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse) {
  return CPU_CALL(cpu_wide(x), rope, out, x, cos, sin, inverse);
}
int cpu_rope_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *cos,
                             const gl_tensor *sin, double eps) {
  return CPU_CALL(cpu_wide(x), rope_rmsnorm, y, rstd, NULL, x, cos, sin, eps);
}
int cpu_rope_rmsnorm_backward(gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *cos,
                              const gl_tensor *sin, const gl_tensor *rstd) {
  return CPU_CALL(cpu_wide(x), rope_rmsnorm, dx, (gl_tensor *)rstd, dy, x, cos, sin, 0);
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */
#include "row_access.h"

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

#undef OOM
#undef real
#undef RDT
#undef R
#endif
