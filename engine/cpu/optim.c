/* optim.c — CPU optimizer updates on a slice [start, start + len) of
 * flat contiguous tensors: AdamW and (Muon-style) momentum.
 *
 * The slice is cut into CHUNK-element tasks run in parallel.  Each task
 * works on contiguous arrays of the compute type (the parameter's precision
 * for AdamW, the momentum buffer's for momentum): a tensor of that dtype is
 * updated in place, any other float dtype (a bfloat16 grad, say) goes
 * through a stack buffer.  Compiled as a template over real = float / double
 * (generic section below).  The step block's twins (engine/ops_step.c:
 * AdamW, momentum and axpy with their factors, clip scale and skip flag read
 * from a float64 block) are float32 only, as on the GPU. */
#ifndef real
#include "cpu.h"
#include <tgmath.h>

enum { CHUNK = 1024 };

#define GL_TEMPLATE "optim.c"
#include "template.h"

int cpu_adamw_update(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v, int64_t start,
                     int64_t len, double lr, double beta1, double beta2, double eps, double weight_decay,
                     int64_t step) {
  /* bias corrections in double whatever the parameter precision */
  double bc1 = 1 - pow(beta1, (double)step), bc2 = 1 - pow(beta2, (double)step);
  if (param->dtype == GL_F64) adamw_f64(param, grad, m, v, start, len, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
  else adamw_f32(param, grad, m, v, start, len, lr, beta1, beta2, eps, weight_decay, bc1, bc2);
  return GL_OK;
}

/* the multi-tensor call is the single one in a loop on the CPU (each
   update is already parallel over its chunks) */
int cpu_adamw_update_multi(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms,
                           gl_tensor **vs, gl_tensor **outs, const double *lrs, const double *wds,
                           double beta1, double beta2, double eps, int64_t step) {
  for (int i = 0; i < n; i++) {
    GL_TRY(cpu_adamw_update(params[i], grads[i], ms[i], vs[i], 0, params[i]->numel, lrs[i], beta1, beta2, eps,
                            wds[i], step));
    if (outs && outs[i]) GL_TRY(gl_copy(outs[i], params[i]));
  }
  return GL_OK;
}

int cpu_momentum_update(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, int64_t start, int64_t len,
                        double mu, int nesterov) {
  if (buf->dtype == GL_F64) momentum_f64(out, buf, grad, start, len, mu, nesterov);
  else momentum_f32(out, buf, grad, start, len, mu, nesterov);
  return GL_OK;
}

/* ---- the step block (engine/ops_step.c): the CPU twins of kernels/optim.cu's */
static double *block_values(const gl_tensor *b) { return (double *)b->storage->data + b->offset; }

int cpu_step_block_copy(gl_tensor *dst, const gl_tensor *src) {
  memmove(block_values(dst), block_values(src), (size_t)dst->numel * sizeof(double));
  return GL_OK;
}

int cpu_step_sumsq(gl_tensor *block, int n, const gl_tensor **xs) {
  double s = 0;
  GL_TRY(cpu_sumsq_multi(n, xs, &s));
  block_values(block)[GL_STEP_SUMSQ] = s;
  return GL_OK;
}

int cpu_step_finalize(gl_tensor *block, int64_t loss_at, int nloss) {
  gl_step_finalize_values(block_values(block), loss_at, nloss);
  return GL_OK;
}

/* AdamW of one float32 parameter with float rates r (lr*wd, lr/bc1, b1,
   b2, 1-b1, 1-b2, eps, 1/bc2), its gradient times the clip scale rounded to
   the gradient's dtype (as mul_ leaves it), in the order of adamw_kernel */
static void adamw_block_one(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v, gl_tensor *out,
                            const float r[8], float scale) {
  float *P = (float *)param->storage->data + param->offset, *M = (float *)m->storage->data + m->offset;
  float *V = (float *)v->storage->data + v->offset;
  const float *gf = grad->dtype == GL_F32 ? (const float *)grad->storage->data + grad->offset : NULL;
  const uint16_t *gh = grad->dtype == GL_BF16 ? (const uint16_t *)grad->storage->data + grad->offset : NULL;
  float *of = out && out->dtype == GL_F32 ? (float *)out->storage->data + out->offset : NULL;
  uint16_t *oh = out && out->dtype == GL_BF16 ? (uint16_t *)out->storage->data + out->offset : NULL;
  int64_t len = param->numel, ntask = (len + CHUNK - 1) / CHUNK;
  int nt = gl_threads_for(ntask, 8 * CHUNK);
  GL_PAR_FOR(nt, task, ntask,
    int64_t i0 = task * CHUNK, i1 = len - i0 < CHUNK ? len : i0 + CHUNK;
    for (int64_t i = i0; i < i1; i++) {
      float g = gf ? gf[i] * scale : gl_bf16_to_f32(gl_f32_to_bf16(gl_bf16_to_f32(gh[i]) * scale));
      float p = P[i];
      float mm = r[2] * M[i] + r[4] * g;
      float vv = r[3] * V[i] + r[5] * g * g;
      p -= r[0] * p;
      p -= r[1] * mm / (sqrtf(vv * r[7]) + r[6]);
      P[i] = p;
      M[i] = mm;
      V[i] = vv;
      if (of) of[i] = p;
      else if (oh) oh[i] = gl_f32_to_bf16(p);
    }
  );
}

int cpu_adamw_update_block(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms, gl_tensor **vs,
                           gl_tensor **outs, const gl_tensor *block, const int64_t *slots) {
  const double *b = block_values(block);
  if (b[GL_STEP_SKIP] != 0) return GL_OK;  /* a non-finite loss or norm: the step is skipped */
  float scale = (float)b[GL_STEP_CLIP_SCALE];
  for (int i = 0; i < n; i++) {
    float r[GL_STEP_ADAMW_SLOTS];
    for (int k = 0; k < GL_STEP_ADAMW_SLOTS; k++) r[k] = (float)b[slots[i] + k];
    adamw_block_one(params[i], grads[i], ms[i], vs[i], outs ? outs[i] : NULL, r, scale);
  }
  return GL_OK;
}

int cpu_momentum_update_block(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, const gl_tensor *block,
                              int64_t slot, int nesterov) {
  const double *b = block_values(block);
  float *O = (float *)out->storage->data + out->offset, *B = (float *)buf->storage->data + buf->offset;
  if (b[GL_STEP_SKIP] != 0) {  /* buf kept; out zeroed: the Newton-Schulz after it reads it */
    memset(O, 0, (size_t)buf->numel * sizeof(float));
    return GL_OK;
  }
  float mu = (float)b[slot], cmu = (float)b[slot + 1], scale = (float)b[GL_STEP_CLIP_SCALE];
  const float *gf = grad->dtype == GL_F32 ? (const float *)grad->storage->data + grad->offset : NULL;
  const uint16_t *gh = grad->dtype == GL_BF16 ? (const uint16_t *)grad->storage->data + grad->offset : NULL;
  int64_t len = buf->numel, ntask = (len + CHUNK - 1) / CHUNK;
  int nt = gl_threads_for(ntask, 4 * CHUNK);
  GL_PAR_FOR(nt, task, ntask,
    int64_t i0 = task * CHUNK, i1 = len - i0 < CHUNK ? len : i0 + CHUNK;
    for (int64_t i = i0; i < i1; i++) {
      float g = gf ? gf[i] * scale : gl_bf16_to_f32(gl_f32_to_bf16(gl_bf16_to_f32(gh[i]) * scale));
      float bv = B[i], nb = bv + cmu * (g - bv);
      B[i] = nb;
      O[i] = nesterov ? g + mu * (nb - g) : nb;
    }
  );
  return GL_OK;
}

int cpu_axpy_block(gl_tensor *y, const gl_tensor *x, const gl_tensor *block, int64_t slot) {
  const double *b = block_values(block);
  if (b[GL_STEP_SKIP] != 0) return GL_OK;
  float a = (float)b[slot];
  float *Y = (float *)y->storage->data + y->offset;
  const float *X = (const float *)x->storage->data + x->offset;
  int64_t len = y->numel, ntask = (len + CHUNK - 1) / CHUNK;
  int nt = gl_threads_for(ntask, 2 * CHUNK);
  GL_PAR_FOR(nt, task, ntask,
    int64_t i0 = task * CHUNK, i1 = len - i0 < CHUNK ? len : i0 + CHUNK;
    for (int64_t i = i0; i < i1; i++) {
      float ax = a * X[i];  /* rounded first, as add_(x, a) scales x in its own pass */
      Y[i] = Y[i] + ax;
    }
  );
  return GL_OK;
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */


/* a writable contiguous view of n elements of t at off: t's memory when it
   holds reals, else buf filled with the current values */
static inline real *R(span_rw)(gl_tensor *t, int64_t off, int64_t n, real *buf) {
  if (t->dtype == RDT) return (real *)t->storage->data + off;
  R(cpu_span_load)(t, off, 1, n, buf);
  return buf;
}

/* p -= lr*wd*p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
   p -= lr * (m / bc1) / (sqrt(v / bc2) + eps) */
static void R(adamw)(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v, int64_t start,
                     int64_t len, double lr, double b1, double b2, double eps, double wd, double bc1, double bc2) {
  real decay = (real)(lr * wd), step = (real)(lr / bc1), inv_bc2 = (real)(1 / bc2), e = (real)eps;
  real rb1 = (real)b1, rb2 = (real)b2, cb1 = (real)(1 - b1), cb2 = (real)(1 - b2);
  int64_t ntask = (len + CHUNK - 1) / CHUNK;
  int nt = gl_threads_for(ntask, 8 * CHUNK);
  GL_PAR_FOR(nt, task, ntask, 
    real pb[CHUNK], gb[CHUNK], mb[CHUNK], vb[CHUNK];
    int64_t i0 = start + task * CHUNK, n = start + len - i0 < CHUNK ? start + len - i0 : CHUNK;
    real *P = R(span_rw)(param, param->offset + i0, n, pb), *M = R(span_rw)(m, m->offset + i0, n, mb);
    real *Vv = R(span_rw)(v, v->offset + i0, n, vb);
    const real *g = R(cpu_span_load)(grad, grad->offset + i0, 1, n, gb);
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; i++) {
      P[i] -= decay * P[i];
      M[i] = rb1 * M[i] + cb1 * g[i];
      Vv[i] = rb2 * Vv[i] + cb2 * g[i] * g[i];
      P[i] -= step * M[i] / (sqrt(Vv[i] * inv_bc2) + e);
    }
    R(cpu_span_store)(param, param->offset + i0, 1, n, P);
    R(cpu_span_store)(m, m->offset + i0, 1, n, M);
    R(cpu_span_store)(v, v->offset + i0, 1, n, Vv);
  );
}

/* buf = lerp(buf, g, 1 - mu);  out = nesterov ? lerp(g, buf, mu) : buf */
static void R(momentum)(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, int64_t start, int64_t len,
                        double mu, int nesterov) {
  real rmu = (real)mu, cmu = (real)(1 - mu);
  int64_t ntask = (len + CHUNK - 1) / CHUNK;
  int nt = gl_threads_for(ntask, 4 * CHUNK);
  GL_PAR_FOR(nt, task, ntask, 
    real bb[CHUNK], gb[CHUNK], ob[CHUNK];
    int64_t i0 = start + task * CHUNK, n = start + len - i0 < CHUNK ? start + len - i0 : CHUNK;
    real *Bf = R(span_rw)(buf, buf->offset + i0, n, bb);
    const real *g = R(cpu_span_load)(grad, grad->offset + i0, 1, n, gb);
    real *o = out->dtype == RDT ? (real *)out->storage->data + out->offset + i0 : ob;
    for (int64_t i = 0; i < n; i++) {
      real gi = g[i], b = Bf[i] + cmu * (gi - Bf[i]);
      Bf[i] = b;
      o[i] = nesterov ? gi + rmu * (b - gi) : b;
    }
    R(cpu_span_store)(buf, buf->offset + i0, 1, n, Bf);
    R(cpu_span_store)(out, out->offset + i0, 1, n, o);
  );
}

#undef real
#undef RDT
#undef R
#endif
