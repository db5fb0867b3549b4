/* loss.c — CPU kernels of the fused cross-entropy (optional logit softcap),
 * forward and backward (the twin of kernels/loss.cu).
 *
 * Compiled as a template: the generic section at the bottom is included
 * with real = float and real = double (template.h). */
#ifndef real
#include "cpu.h"
#include <tgmath.h>

#define GL_TEMPLATE "loss.c"
#include "template.h"

int cpu_cross_entropy_forward(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                              const gl_tensor *targets, int64_t ignore_index, double softcap) {
  GL_TRY(cpu_check_ids("gl_cross_entropy_forward", "targets", targets, logits->shape[1], "vocab size of logits", 1,
                   ignore_index));
  return CPU_CALL(cpu_wide(logits), ce_forward, losses, lse, logits, targets, ignore_index, softcap);
}
int cpu_cross_entropy_backward(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                               const gl_tensor *lse, int64_t ignore_index, double softcap, double scale,
                               const gl_tensor *scale_by) {
  GL_TRY(cpu_check_ids("gl_cross_entropy_backward", "targets", targets, logits->shape[1], "vocab size of logits", 1,
                   ignore_index));
  if (scale_by) scale *= gl_load(scale_by->storage->data, scale_by->dtype, scale_by->offset);
  return CPU_CALL(cpu_wide(logits), ce_backward, dlogits, logits, targets, lse, ignore_index, softcap, scale);
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */
#include "row_access.h"

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

#undef OOM
#undef real
#undef RDT
#undef R
#endif
