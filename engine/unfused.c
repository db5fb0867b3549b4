/* unfused.c — the fused ops (gl_ops.h: gl_matmul_epilogue,
 * gl_linear_backward's epilogues, gl_matmul_add, gl_add_norm_forward,
 * gl_norm_backward_add) as the unfused ops' kernels in sequence, dispatched
 * by device.  It is the CPU's implementation of them (so the results are bit
 * for bit the unfused ops' and the cost is theirs, never more), and the GPU's
 * where cuBLASLt cannot take a layout (kernels/matmul.cu) or a row does not
 * fit its fused kernel (kernels/rows.cu).  Both devices call this file, so it
 * lives in engine/, not engine/cpu/.
 * Specs: spec/fused_spec.lua; the GPU twins in spec/cuda_spec.lua (epilogues,
 * MLP) and spec/cuda_rows_spec.lua (add + norm). */
#include "backend.h"
#include <math.h>

/* ---- a product's epilogue: the product, then the unfused ops' kernels ---- */
int gl_epilogue_product(int epi, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias,
                        gl_tensor *aux) {
  gl_tensor *dst = epi == GL_EPI_GELU && aux ? aux : out;
  if ((epi == GL_EPI_GELU || epi == GL_EPI_RELU2) && bias) return gl_backend_of(out->device)->matmul_bias(dst, a, b, bias);
  return gl_backend_of(out->device)->matmul(dst, a, b, 1, 0);
}

/* ReLU²'s gradient from its output h (the input is not kept): dpre = dy *
   2 relu(pre) with relu(pre) = s = sqrt(h), computed as relu2's own
   backward on s (s > 0 ? 2 s dy : 0), s rounded to out's dtype first:
   since sqrt(fl(p^2)) = |p| in binary floating point rounded to nearest,
   this is bit for bit relu2's backward from pre.  On the CPU (f32, f64,
   bf16, contiguous out) one pass with no temporary, so that a plan (which
   runs no kernel, engine/alloc.c's meta twin) sees every allocation; other
   cases, and the GPU's fallback (kernels/matmul.cu), sqrt into a temporary
   of h's shape and the elementwise backward: two passes. */
static int drelu2_finish(gl_tensor *out, const gl_tensor *h) {
  if (out->device < 0 && gl_is_contiguous(out) && gl_is_contiguous(h) && out->dtype == h->dtype &&
      (out->dtype == GL_F32 || out->dtype == GL_F64 || out->dtype == GL_BF16)) {
    const int64_t n = out->numel;
    void *po = gl_data_ptr(out);
    const void *ph = gl_data_ptr(h);
    const int nt = gl_threads_for(n, 4);
    if (out->dtype == GL_F64) {
      double *o = po; const double *x = ph;
      GL_PAR_FOR(nt, i, n, { double r = sqrt(x[i]); o[i] = r > 0 ? 2 * r * o[i] : 0; });
    } else if (out->dtype == GL_F32) {
      float *o = po; const float *x = ph;
      GL_PAR_FOR(nt, i, n, { float r = sqrtf(x[i]); o[i] = r > 0 ? 2 * r * o[i] : 0; });
    } else {
      uint16_t *o = po; const uint16_t *x = ph;
      GL_PAR_FOR(nt, i, n, {
        float r = gl_bf16_to_f32(gl_f32_to_bf16(sqrtf(gl_bf16_to_f32(x[i]))));
        o[i] = gl_f32_to_bf16(r > 0 ? 2 * r * gl_bf16_to_f32(o[i]) : 0);
      });
    }
    return GL_OK;
  }
  gl_tensor *s = gl_empty(h->dtype, h->device, h->ndim, h->shape);
  if (!s) return GL_ERR;
  int rc = gl_backend_of(h->device)->unary(GL_U_SQRT, s, h, 0, 0);
  if (rc == GL_OK) rc = gl_backend_of(out->device)->unary_backward(GL_U_RELU2, out, out, s, 0, 0);
  gl_tensor_free(s);
  return rc;
}

int gl_epilogue_finish(int epi, gl_tensor *out, const gl_tensor *a, gl_tensor *bias, gl_tensor *aux) {
  int dev = out->device;
  if (epi == GL_EPI_GELU) return gl_backend_of(dev)->unary(GL_U_GELU_TANH, out, aux ? aux : out, 0, 0);
  if (epi == GL_EPI_DGELU) GL_TRY(gl_backend_of(dev)->unary_backward(GL_U_GELU_TANH, out, out, aux, 0, 0));
  if (epi == GL_EPI_RELU2) return gl_backend_of(dev)->unary(GL_U_RELU2, out, out, 0, 0);
  if (epi == GL_EPI_DRELU2) GL_TRY(drelu2_finish(out, aux));
  return gl_epilogue_bgrad(epi, out, a, bias);
}

int gl_epilogue_bgrad(int epi, gl_tensor *out, const gl_tensor *a, gl_tensor *bias) {
  int dev = out->device;
  if (!bias || bias->numel == 0) return GL_OK;
  /* the bias gradient: (1, N) sums over out's rows, or (M, 1) sums of a over K */
  gl_tensor v = *bias;
  v.ndim = 2;
  if (epi == GL_EPI_DGELU || epi == GL_EPI_DRELU2) {
    v.shape[0] = 1; v.shape[1] = bias->shape[0]; v.stride[0] = bias->shape[0]; v.stride[1] = bias->stride[0];
    return gl_backend_of(dev)->reduce(GL_R_SUM, &v, out, 1u);
  }
  v.shape[0] = bias->shape[0]; v.shape[1] = 1; v.stride[0] = bias->stride[0]; v.stride[1] = 1;
  return gl_backend_of(dev)->reduce(GL_R_SUM, &v, a, 2u);
}

int cpu_matmul_epilogue(int epi, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias,
                        gl_tensor *aux) {
  GL_TRY(gl_epilogue_product(epi, out, a, b, bias, aux));
  return gl_epilogue_finish(epi, out, a, bias, aux);
}

/* ---- a product added to a tensor: a copy, then the product accumulated ---- */
/* a view of bias (N) broadcast over out's rows: a struct on the stack (no
   reference taken: it lives for the call) */
gl_tensor gl_bias_rows(const gl_tensor *bias, const gl_tensor *out) {
  gl_tensor v = *bias;
  v.ndim = out->ndim;
  v.numel = out->numel;
  for (int d = 0; d < out->ndim; d++) { v.shape[d] = out->shape[d]; v.stride[d] = 0; }
  v.stride[out->ndim - 1] = bias->stride[0];
  return v;
}

int gl_matmul_add_unfused(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c) {
  GL_TRY(gl_copy(out, c));
  return gl_backend_of(out->device)->matmul(out, a, b, 1, 1);
}


/* ---- a residual add and the norm after it ---------------------------------- */
int gl_add_norm_unfused(gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                        const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps, int center) {
  int dev = y->device;
  GL_TRY(gl_backend_of(dev)->binary(GL_B_ADD, s, x, r));
  if (center) return gl_backend_of(dev)->layernorm_forward(y, mean, rstd, s, weight, bias, eps);
  return gl_backend_of(dev)->rmsnorm_forward(y, rstd, s, weight, eps);
}

int gl_norm_backward_add_unfused(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                                 const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean,
                                 const gl_tensor *rstd, const gl_tensor *dres, int center) {
  int dev = dx->device;
  if (center) GL_TRY(gl_backend_of(dev)->layernorm_backward(dx, dweight, dbias, dy, x, weight, mean, rstd));
  else GL_TRY(gl_backend_of(dev)->rmsnorm_backward(dx, dweight, dy, x, weight, rstd));
  /* dx + dres, the order autograd's accumulation adds them in */
  return dres ? gl_backend_of(dev)->binary(GL_B_ADD, dx, dx, dres) : GL_OK;
}

int cpu_add_norm_forward(gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                         const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps, int center) {
  return gl_add_norm_unfused(s, y, mean, rstd, x, r, weight, bias, eps, center);
}

int cpu_norm_backward_add(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy, const gl_tensor *x,
                          const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd, const gl_tensor *dres,
                          int center) {
  return gl_norm_backward_add_unfused(dx, dweight, dbias, dy, x, weight, mean, rstd, dres, center);
}
