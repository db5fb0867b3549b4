/* optim.cu — optimizer updates on the GPU: AdamW and (Muon-style) momentum,
 * each one pass over a slice [start, start + len) of flat contiguous
 * tensors, one thread per element.
 *
 * Twin of engine/cpu_optim.c: AdamW computes in the parameter's precision
 * (float, double for float64) with the bias corrections taken in double on
 * the host; momentum in the buffer's.  Grads (and buffers) of another float
 * dtype, e.g. bfloat16 grads of fp32 master weights, are read through the
 * run-time accessor. */
#include "common.cuh"

/* p -= lr*wd*p;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
   p -= lr/bc1 * m / (sqrt(v / bc2) + eps) */
template <class P, class T>
__global__ void adamw_kernel(P param, P grad, P m, P v, int64_t start, int64_t len, T decay, T step, T inv_bc2,
                             T eps, T b1, T b2, T cb1, T cb2) {
  CU_GRID_LOOP(k, len) {
    int64_t i = start + k;
    T p = param.template get<T>(i), g = grad.template get<T>(i);
    T mm = b1 * m.template get<T>(i) + cb1 * g;
    T vv = b2 * v.template get<T>(i) + cb2 * g * g;
    p -= decay * p;
    p -= step * mm / (cu_sqrt(vv * inv_bc2) + eps);
    param.set(i, p);
    m.set(i, mm);
    v.set(i, vv);
  }
}

extern "C" int cuda_adamw_update(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v, int64_t start,
                                 int64_t len, double lr, double beta1, double beta2, double eps, double weight_decay,
                                 int64_t step) {
  if (len <= 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(param->device, &st));
  double bc1 = 1 - pow(beta1, (double)step), bc2 = 1 - pow(beta2, (double)step);
  return cu_dispatch({param, grad, m, v}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(cu_blocks(param->device, len, 256), 256, 0, st, adamw_kernel<P, T>)(
        P::from(param), P::from(grad), P::from(m), P::from(v), start, len, (T)(lr * weight_decay), (T)(lr / bc1),
        (T)(1 / bc2), (T)eps, (T)beta1, (T)beta2, (T)(1 - beta1), (T)(1 - beta2));
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* buf = lerp(buf, g, 1 - mu);  out = nesterov ? lerp(g, buf, mu) : buf.
   g is read before out is written, so out may alias grad. */
template <class P, class T>
__global__ void momentum_kernel(P out, P buf, P grad, int64_t start, int64_t len, T mu, T cmu, int nesterov) {
  CU_GRID_LOOP(k, len) {
    int64_t i = start + k;
    T g = grad.template get<T>(i), bv = buf.template get<T>(i);
    T b = bv + cmu * (g - bv);
    buf.set(i, b);
    out.set(i, nesterov ? g + mu * (b - g) : b);
  }
}

extern "C" int cuda_momentum_update(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, int64_t start,
                                    int64_t len, double mu, int nesterov) {
  if (len <= 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(buf->device, &st));
  return cu_dispatch({out, buf, grad}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(cu_blocks(buf->device, len, 256), 256, 0, st, momentum_kernel<P, T>)(
        P::from(out), P::from(buf), P::from(grad), start, len, (T)mu, (T)(1 - mu), nesterov);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}
