/* optim.cu — optimizer updates on the GPU: AdamW and (Muon-style) momentum,
 * each one pass over a slice [start, start + len) of flat contiguous
 * tensors, one thread per element.
 *
 * Twin of engine/cpu/optim.c: AdamW computes in the parameter's precision
 * (float, double for float64) with the bias corrections taken in double on
 * the host; momentum in the buffer's.  Grads (and buffers) of another float
 * dtype, e.g. bfloat16 grads of fp32 master weights, are read through the
 * run-time accessor.
 *
 * cuda_adamw_update_multi updates every parameter of a step in one launch:
 * a segment table (pointers, sizes, dtypes; cached on the device by content,
 * cu_table) and, as kernel arguments, the few distinct (lr*wd, lr/bc1) pairs
 * of the parameter groups.  It also writes the rounded bfloat16 weights of
 * an fp32 master copy, which was a copy launch per parameter.  Specs:
 * spec/cuda_multi_spec.lua.
 *
 * The step block's kernels (engine/ops_step.c, gl_ops.h "The step block")
 * read their rates, the clip scale and the skip flag from device memory, so
 * a CUDA graph replays each step's values: AdamW over the segment table,
 * Muon's momentum, an axpy for Muon's update and NorMuon's moment, and the
 * step's finalize and block copies.  Specs: spec/cuda_train_graph_optim_spec.lua. */
#include "common.cuh"
#include <vector>

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

/* ---- multi-tensor AdamW ---------------------------------------------------- */
enum { ADAMW_CLASSES = 16 };
struct AdamwSeg {
  float *p, *m, *v;
  const void *g;  /* float32 or bfloat16 */
  void *out;      /* NULL, float32 or bfloat16: the parameter the master copy is rounded into */
  int64_t n, block0;
  int cls, g_bf16, out_kind; /* out_kind 0 none, 1 float32, 2 bfloat16 */
  int pad;
};
struct AdamwClasses { float decay[ADAMW_CLASSES], step[ADAMW_CLASSES]; };

/* one element of segment s: AdamW in float (adamw_kernel's order), then the
   rounded copy into the parameter of a master */
__device__ __forceinline__ void adamw_seg_element(const AdamwSeg &s, int64_t i, float g, float decay, float step,
                                                  float inv_bc2, float eps, float b1, float b2, float cb1,
                                                  float cb2) {
  float p = s.p[i];
  float mm = b1 * s.m[i] + cb1 * g;
  float vv = b2 * s.v[i] + cb2 * g * g;
  p -= decay * p;
  p -= step * mm / (cu_sqrt(vv * inv_bc2) + eps);
  s.p[i] = p;
  s.m[i] = mm;
  s.v[i] = vv;
  if (s.out_kind == 1) ((float *)s.out)[i] = p;
  else if (s.out_kind == 2) ((bf16 *)s.out)[i] = __float2bfloat16(p);
}

__global__ void __launch_bounds__(CU_MT_THREADS)
adamw_multi_kernel(const AdamwSeg *segs, int nseg, AdamwClasses cls, float inv_bc2, float eps, float b1, float b2,
                   float cb1, float cb2) {
  const AdamwSeg &s = segs[cu_mt_segment(segs, nseg)];
  int64_t lo = ((int64_t)blockIdx.x - s.block0) * CU_MT_CHUNK;
  int64_t hi = lo + CU_MT_CHUNK < s.n ? lo + CU_MT_CHUNK : s.n;
  float decay = cls.decay[s.cls], step = cls.step[s.cls];
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float g = s.g_bf16 ? __bfloat162float(((const bf16 *)s.g)[i]) : ((const float *)s.g)[i];
    adamw_seg_element(s, i, g, decay, step, inv_bc2, eps, b1, b2, cb1, cb2);
  }
}

/* one launch when every parameter, m and v is float32 (grads float32 or
   bfloat16, outs bfloat16 / float32) and the groups give at most
   ADAMW_CLASSES distinct rates; otherwise the single update per parameter */
extern "C" int cuda_adamw_update_multi(int n, gl_tensor **params, const gl_tensor **grads,
                                       gl_tensor **ms, gl_tensor **vs, gl_tensor **outs,
                                       const double *lrs, const double *wds, double beta1, double beta2,
                                       double eps, int64_t step) {
  int dev = params[0]->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  double bc1 = 1 - pow(beta1, (double)step), bc2 = 1 - pow(beta2, (double)step);
  std::vector<AdamwSeg> segs;
  segs.reserve((size_t)n);
  AdamwClasses cls;
  memset(&cls, 0, sizeof cls);
  int ncls = 0, fast = 1;
  int64_t blocks = 0;
  for (int i = 0; i < n && fast; i++) {
    const gl_tensor *g = grads[i];
    const gl_tensor *o = outs ? outs[i] : nullptr;
    fast = params[i]->dtype == GL_F32 && ms[i]->dtype == GL_F32 && vs[i]->dtype == GL_F32 &&
           (g->dtype == GL_F32 || g->dtype == GL_BF16) && (!o || o->dtype == GL_F32 || o->dtype == GL_BF16);
    float decay = (float)(lrs[i] * wds[i]), stepsz = (float)(lrs[i] / bc1);
    int c = 0;
    while (c < ncls && !(cls.decay[c] == decay && cls.step[c] == stepsz)) c++;
    if (c == ncls) {
      if (ncls == ADAMW_CLASSES) { fast = 0; break; }
      cls.decay[c] = decay; cls.step[c] = stepsz; ncls++;
    }
    int64_t len = params[i]->numel;
    if (len == 0) continue;
    AdamwSeg sg;
    memset(&sg, 0, sizeof sg);
    sg.p = (float *)cu_ptr(params[i]); sg.m = (float *)cu_ptr(ms[i]); sg.v = (float *)cu_ptr(vs[i]);
    sg.g = cu_ptr(g); sg.g_bf16 = g->dtype == GL_BF16;
    sg.out = o ? cu_ptr(o) : nullptr; sg.out_kind = !o ? 0 : o->dtype == GL_F32 ? 1 : 2;
    sg.n = len; sg.block0 = blocks; sg.cls = c;
    blocks += (len + CU_MT_CHUNK - 1) / CU_MT_CHUNK;
    segs.push_back(sg);
  }
  if (!fast || blocks > 0x7fffffffLL) {
    for (int i = 0; i < n; i++) {
      GL_TRY(cuda_adamw_update(params[i], grads[i], ms[i], vs[i], 0, params[i]->numel, lrs[i], beta1, beta2, eps,
                               wds[i], step));
      if (outs && outs[i]) GL_TRY(cuda_copy(outs[i], params[i]));
    }
    return GL_OK;
  }
  if (segs.empty()) return GL_OK;
  const void *table = nullptr;
  GL_TRY(cu_table(dev, st, segs.data(), segs.size() * sizeof(AdamwSeg), &table));
  GL_LAUNCH((unsigned)blocks, CU_MT_THREADS, 0, st, adamw_multi_kernel)(
      (const AdamwSeg *)table, (int)segs.size(), cls, (float)(1 / bc2), (float)eps, (float)beta1, (float)beta2,
      (float)(1 - beta1), (float)(1 - beta2));
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* ---- the step block (engine/ops_step.c, gl_ops.h) ---------------------------
   AdamW as adamw_multi_kernel, its rates read from the step block (so a CUDA
   graph replays this step's learning rate, not its capture's): segment s's
   cls is the block slot of its group's GL_STEP_ADAMW_SLOTS values; each
   gradient is multiplied by the clip scale and rounded to its dtype as mul_
   would leave it; a set skip flag writes nothing. */
__global__ void __launch_bounds__(CU_MT_THREADS)
adamw_block_kernel(const AdamwSeg *segs, int nseg, const double *blk) {
  if (blk[GL_STEP_SKIP] != 0) return;
  const AdamwSeg &s = segs[cu_mt_segment(segs, nseg)];
  int64_t lo = ((int64_t)blockIdx.x - s.block0) * CU_MT_CHUNK;
  int64_t hi = lo + CU_MT_CHUNK < s.n ? lo + CU_MT_CHUNK : s.n;
  const double *h = blk + s.cls;  /* the group's GL_STEP_ADAMW_SLOTS */
  float decay = (float)h[0], step = (float)h[1], scale = (float)blk[GL_STEP_CLIP_SCALE];
  float b1 = (float)h[2], b2 = (float)h[3], cb1 = (float)h[4], cb2 = (float)h[5], eps = (float)h[6];
  float inv_bc2 = (float)h[7];
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float g = s.g_bf16 ? __bfloat162float(__float2bfloat16(__bfloat162float(((const bf16 *)s.g)[i]) * scale))
                       : ((const float *)s.g)[i] * scale;
    adamw_seg_element(s, i, g, decay, step, inv_bc2, eps, b1, b2, cb1, cb2);
  }
}

extern "C" int cuda_adamw_update_block(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms,
                                       gl_tensor **vs, gl_tensor **outs, const gl_tensor *block,
                                       const int64_t *slots) {
  int dev = block->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  std::vector<AdamwSeg> segs;
  segs.reserve((size_t)n);
  int64_t blocks = 0;
  for (int i = 0; i < n; i++) {
    int64_t len = params[i]->numel;
    if (len == 0) continue;
    const gl_tensor *o = outs ? outs[i] : nullptr;
    AdamwSeg sg;
    memset(&sg, 0, sizeof sg);
    sg.p = (float *)cu_ptr(params[i]); sg.m = (float *)cu_ptr(ms[i]); sg.v = (float *)cu_ptr(vs[i]);
    sg.g = cu_ptr(grads[i]); sg.g_bf16 = grads[i]->dtype == GL_BF16;
    sg.out = o ? cu_ptr(o) : nullptr; sg.out_kind = !o ? 0 : o->dtype == GL_F32 ? 1 : 2;
    sg.n = len; sg.block0 = blocks; sg.cls = (int)slots[i];
    blocks += (len + CU_MT_CHUNK - 1) / CU_MT_CHUNK;
    segs.push_back(sg);
  }
  if (segs.empty()) return GL_OK;
  if (blocks > 0x7fffffffLL)
    return gl_error("gl_adamw_update_block: %lld blocks exceed the grid limit", (long long)blocks);
  const void *table = nullptr;
  GL_TRY(cu_table(dev, st, segs.data(), segs.size() * sizeof(AdamwSeg), &table));
  GL_LAUNCH((unsigned)blocks, CU_MT_THREADS, 0, st, adamw_block_kernel)(
      (const AdamwSeg *)table, (int)segs.size(), (const double *)cu_ptr(block));
  GL_CU_LAUNCHED();
  return GL_OK;
}

__global__ void step_finalize_kernel(double *blk, int64_t loss_at, int nloss) {
  if (threadIdx.x == 0) gl_step_finalize_values(blk, loss_at, nloss);
}

extern "C" int cuda_step_finalize(gl_tensor *block, int64_t loss_at, int nloss) {
  cudaStream_t st;
  GL_TRY(cu_begin(block->device, &st));
  GL_LAUNCH(1, 32, 0, st, step_finalize_kernel)((double *)cu_ptr(block), loss_at, nloss);
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* between pinned host memory and the device, on the compute stream, no host
   wait: a copy node when captured */
extern "C" int cuda_step_block_copy(gl_tensor *dst, const gl_tensor *src) {
  cudaStream_t st;
  GL_TRY(cu_begin(dst->device >= 0 ? dst->device : src->device, &st));
  GL_CU_CHECK(cudaMemcpyAsync(cu_ptr(dst), cu_ptr(src), (size_t)dst->numel * sizeof(double), cudaMemcpyDefault, st));
  return GL_OK;
}

#ifdef GL_SIM
#define cu_mul_rn(a, b) ((a) * (b)) /* the simulator's C++ does not contract */
#else
#define cu_mul_rn(a, b) __fmul_rn(a, b)
#endif

/* Muon's momentum with mu and 1 - mu from the block, the gradient times the
   clip scale (rounded to its dtype); under the skip flag buf is kept and
   out zeroed (the graph's Newton-Schulz still reads it) */
__global__ void momentum_block_kernel(float *out, float *buf, const void *grad, int g_bf16, int64_t len,
                                      const double *blk, int64_t slot, int nesterov) {
  if (blk[GL_STEP_SKIP] != 0) {
    CU_GRID_LOOP(i, len) out[i] = 0.0f;
    return;
  }
  float mu = (float)blk[slot], cmu = (float)blk[slot + 1], scale = (float)blk[GL_STEP_CLIP_SCALE];
  CU_GRID_LOOP(i, len) {
    float g = g_bf16 ? __bfloat162float(__float2bfloat16(__bfloat162float(((const bf16 *)grad)[i]) * scale))
                     : ((const float *)grad)[i] * scale;
    float bv = buf[i], b = bv + cmu * (g - bv);
    buf[i] = b;
    out[i] = nesterov ? g + mu * (b - g) : b;
  }
}

extern "C" int cuda_momentum_update_block(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad,
                                          const gl_tensor *block, int64_t slot, int nesterov) {
  cudaStream_t st;
  GL_TRY(cu_begin(block->device, &st));
  int64_t len = buf->numel;
  GL_LAUNCH(cu_blocks(block->device, len, 256), 256, 0, st, momentum_block_kernel)(
      (float *)cu_ptr(out), (float *)cu_ptr(buf), cu_ptr(grad), grad->dtype == GL_BF16, len,
      (const double *)cu_ptr(block), slot, nesterov);
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* y += a x, a from the block (a x rounded first, as add_(x, a)); nothing
   written under the skip flag */
__global__ void axpy_block_kernel(float *y, const float *x, int64_t len, const double *blk, int64_t slot) {
  if (blk[GL_STEP_SKIP] != 0) return;
  float a = (float)blk[slot];
  CU_GRID_LOOP(i, len) {
    float ax = cu_mul_rn(a, x[i]);  /* not contracted into an fma: add_ rounds the product */
    y[i] = y[i] + ax;
  }
}

extern "C" int cuda_axpy_block(gl_tensor *y, const gl_tensor *x, const gl_tensor *block, int64_t slot) {
  cudaStream_t st;
  GL_TRY(cu_begin(block->device, &st));
  int64_t len = y->numel;
  GL_LAUNCH(cu_blocks(block->device, len, 256), 256, 0, st, axpy_block_kernel)(
      (float *)cu_ptr(y), (const float *)cu_ptr(x), len, (const double *)cu_ptr(block), slot);
  GL_CU_LAUNCHED();
  return GL_OK;
}
