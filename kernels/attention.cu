/* attention.cu — causal scaled-dot-product attention on the GPU, forward and
 * backward: grouped-query heads (kv head h / (H / Hkv)), the KV-cache offset
 * (T <= S, query t at position S - T + t), an optional sliding window
 * (window < 0: no mask, every query at S - 1 + t, past every key; ring
 * attention's blocks) and segment ids (document masking: a query sees only
 * keys of its own segment), with the semantics of its CPU twin
 * engine/cpu/attention.c; specs in spec/cuda_attention_spec.lua.
 *
 * Two paths: FlashAttention-2 on the tensor cores (bfloat16, head dim 64 or
 * 128, unit stride along D, 16-byte aligned rows; kernels/attention_flash.cu)
 * and, for everything else, the fallback here (any dtype, head dim or
 * layout, float32 / float64 for exactness against the CPU): one block per
 * query row (per key row for dK / dV), streaming keys (queries) in chunks of
 * FB_THREADS.  Di = rowsum(dout * out), which both backwards take, is here.
 * Tile sizes, shared memory, occupancy and the FLOPs / bytes per call:
 * kernels/README.md. */
#include "common.cuh"
#include "row_walk.cuh"
#include "attention_flash.cuh"

/* ---- Di = rowsum(dout * out), one warp per (b, h, t) row --------------------- */
struct Str4 { int64_t s[4]; };
static Str4 str4(const gl_tensor *t) {
  Str4 r;
  for (int d = 0; d < 4; d++) r.s[d] = t->stride[d];
  return r;
}

/* VEC: the fast path's rows (bfloat16, unit stride, every row 16-byte
   aligned, D a multiple of 8: fa_tensor_ok), read as 16-byte vectors, lane l
   taking elements 8l .. 8l + 7 */
template <class P, class T, bool VEC>
__global__ void attn_di_kernel(T *di, P dout, Str4 ds, P out, Str4 os, int64_t H, int64_t T_, int64_t D,
                               int64_t rows) {
  int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (r >= rows) return;  /* whole warps leave together */
  int64_t t = r % T_, h = (r / T_) % H, b = r / (T_ * H);
  int64_t go = b * ds.s[0] + h * ds.s[1] + t * ds.s[2], oo = b * os.s[0] + h * os.s[1] + t * os.s[2];
  T acc = 0;
  if constexpr (VEC) {
    typedef CuVec16<typename RowStore<P>::S> V;
    for (int64_t d = (int64_t)lane * V::N; d < D; d += 32 * V::N) {
      V g = V::load(row_at(dout, go + d)), o = V::load(row_at(out, oo + d));
#pragma unroll
      for (int k = 0; k < V::N; k++) acc += g.template get<T>(k) * o.template get<T>(k);
    }
  } else {
    for (int64_t d = lane; d < D; d += 32)
      acc += dout.template get<T>(go + d * ds.s[3]) * out.template get<T>(oo + d * os.s[3]);
  }
  acc = cu_warp_reduce(acc, CuSum());
  if (lane == 0) di[r] = acc;
}

/* ================================ fallback ====================================== */
enum { FB_THREADS = 128 };

struct AttnDims { int64_t H, G, T, S, D, window, off; };  /* off: position of query 0 */

/* segment ids (B, T) for document masking, or none (p null): positions i
   and j of row b see each other only with equal ids, compared as 32-bit
   integers as the CPU kernel does */
struct SegIds {
  AnyPtr p;
  int64_t s0, s1;
  static SegIds from(const gl_tensor *t) {
    return SegIds{AnyPtr::from(t), t ? t->stride[0] : 0, t ? t->stride[1] : 0};
  }
  __device__ __forceinline__ bool same(int64_t b, int64_t i, int64_t j) const {
    return p.null() || (int32_t)p.get<int64_t>(b * s0 + i * s1) == (int32_t)p.get<int64_t>(b * s0 + j * s1);
  }
};

template <class P, class T>
__device__ __forceinline__ T fb_dot(const T *a, P x, int64_t off, int64_t st, int64_t D) {
  T s = 0;
  for (int64_t d = 0; d < D; d++) s += a[d] * x.template get<T>(off + d * st);
  return s;
}

/* one block per query row (t, h, b); shared: q[D], acc[D], p[FB_THREADS] */
template <class P, class T>
__global__ void attn_fwd_fallback_kernel(P q, Str4 qs, P k, Str4 ks, P v, Str4 vs, P o, Str4 os, AnyPtr lse,
                                         Str4 lss, SegIds seg, AttnDims a, T scale) {
  GL_DYNAMIC_SHARED(unsigned char, fb_smem, 16);
  T *qv = (T *)fb_smem, *acc = qv + a.D, *pr = acc + a.D;
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / a.G;
  const int64_t qo = b * qs.s[0] + h * qs.s[1] + t * qs.s[2];
  const int64_t kb = b * ks.s[0] + hk * ks.s[1], vb = b * vs.s[0] + hk * vs.s[1];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) { qv[d] = q.template get<T>(qo + d * qs.s[3]); acc[d] = 0; }
  __syncthreads();
  const int64_t pos = a.off + t, hi = pos + 1 < a.S ? pos + 1 : a.S;
  const int64_t lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  T m = -cu_inf<T>(), l = 0;
  for (int64_t s = lo + threadIdx.x; s < hi; s += blockDim.x) {
    if (!seg.same(b, pos, s)) continue;
    T sc = scale * fb_dot<P, T>(qv, k, kb + s * ks.s[2], ks.s[3], a.D);
    if (sc > m) { l = l * cu_exp(m - sc) + (T)1; m = sc; }
    else l += cu_exp(sc - m);
  }
  const T M = cu_block_reduce(m, CuMax(), -cu_inf<T>());
  l = m == -cu_inf<T>() ? (T)0 : l * cu_exp(m - M);
  const T Lsum = cu_block_reduce(l, CuSum(), (T)0);
  for (int64_t base = lo; base < hi; base += blockDim.x) {
    const int64_t s = base + threadIdx.x;
    pr[threadIdx.x] = s < hi && seg.same(b, pos, s) ? cu_exp(scale * fb_dot<P, T>(qv, k, kb + s * ks.s[2], ks.s[3], a.D) - M)
                                                    : (T)0;
    __syncthreads();
    const int64_t n = hi - base < (int64_t)blockDim.x ? hi - base : (int64_t)blockDim.x;
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
      T x = acc[d];
      for (int64_t j = 0; j < n; j++) x += pr[j] * v.template get<T>(vb + (base + j) * vs.s[2] + d * vs.s[3]);
      acc[d] = x;
    }
    __syncthreads();
  }
  const T inv = (T)1 / Lsum;
  const int64_t oo = b * os.s[0] + h * os.s[1] + t * os.s[2];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) o.set(oo + d * os.s[3], acc[d] * inv);
  if (threadIdx.x == 0 && !lse.null()) lse.set(b * lss.s[0] + h * lss.s[1] + t * lss.s[2], M + cu_log(Lsum));
}

/* one block per query row: dq = scale sum_s P (dP - Di) k_s;
   shared: q[D], g[D], dq[D], ds[FB_THREADS] */
template <class P, class T>
__global__ void attn_dq_fallback_kernel(P dq, Str4 dqs, P dout, Str4 dos, P q, Str4 qs, P k, Str4 ks, P v, Str4 vs,
                                        AnyPtr lse, Str4 lss, const T *di, SegIds seg, AttnDims a, T scale) {
  GL_DYNAMIC_SHARED(unsigned char, fb_smem, 16);
  T *qv = (T *)fb_smem, *gv = qv + a.D, *acc = gv + a.D, *dsv = acc + a.D;
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / a.G;
  const int64_t qo = b * qs.s[0] + h * qs.s[1] + t * qs.s[2], go = b * dos.s[0] + h * dos.s[1] + t * dos.s[2];
  const int64_t kb = b * ks.s[0] + hk * ks.s[1], vb = b * vs.s[0] + hk * vs.s[1];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
    qv[d] = q.template get<T>(qo + d * qs.s[3]);
    gv[d] = dout.template get<T>(go + d * dos.s[3]);
    acc[d] = 0;
  }
  __syncthreads();
  const T l = lse.get<T>(b * lss.s[0] + h * lss.s[1] + t * lss.s[2]), Dt = di[(b * a.H + h) * a.T + t];
  const int64_t pos = a.off + t, hi = pos + 1 < a.S ? pos + 1 : a.S;
  const int64_t lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  for (int64_t base = lo; base < hi; base += blockDim.x) {
    const int64_t s = base + threadIdx.x;
    T ds = 0;
    if (s < hi && seg.same(b, pos, s)) {
      T pv = cu_exp(scale * fb_dot<P, T>(qv, k, kb + s * ks.s[2], ks.s[3], a.D) - l);
      T dp = fb_dot<P, T>(gv, v, vb + s * vs.s[2], vs.s[3], a.D);
      ds = pv * (dp - Dt) * scale;
    }
    dsv[threadIdx.x] = ds;
    __syncthreads();
    const int64_t n = hi - base < (int64_t)blockDim.x ? hi - base : (int64_t)blockDim.x;
    for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
      T x = acc[d];
      for (int64_t j = 0; j < n; j++) x += dsv[j] * k.template get<T>(kb + (base + j) * ks.s[2] + d * ks.s[3]);
      acc[d] = x;
    }
    __syncthreads();
  }
  const int64_t qo2 = b * dqs.s[0] + h * dqs.s[1] + t * dqs.s[2];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) dq.set(qo2 + d * dqs.s[3], acc[d]);
}

/* one block per key row (s, kv head, b), looping over its group's heads:
   dv = sum_t P dout_t, dk = scale sum_t P (dP - Di) q_t;
   shared: k[D], v[D], dk[D], dv[D], p[FB_THREADS], ds[FB_THREADS] */
template <class P, class T>
__global__ void attn_dkdv_fallback_kernel(P dk, Str4 dks, P dv, Str4 dvs, P dout, Str4 dos, P q, Str4 qs, P k,
                                          Str4 ks, P v, Str4 vs, AnyPtr lse, Str4 lss, const T *di, SegIds seg,
                                          AttnDims a, T scale) {
  GL_DYNAMIC_SHARED(unsigned char, fb_smem, 16);
  T *kv = (T *)fb_smem, *vv = kv + a.D, *dka = vv + a.D, *dva = dka + a.D, *pv = dva + a.D, *dsv = pv + blockDim.x;
  const int64_t s = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int64_t ko = b * ks.s[0] + hk * ks.s[1] + s * ks.s[2], vo = b * vs.s[0] + hk * vs.s[1] + s * vs.s[2];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
    kv[d] = k.template get<T>(ko + d * ks.s[3]);
    vv[d] = v.template get<T>(vo + d * vs.s[3]);
    dka[d] = 0;
    dva[d] = 0;
  }
  __syncthreads();
  const int64_t off = a.off;
  /* queries seeing key s: qpos >= s, and qpos < s + window with a window */
  const int64_t t_lo = s - off > 0 ? s - off : 0;
  int64_t t_hi = a.T;
  if (a.window > 0 && s + a.window - off < t_hi) t_hi = s + a.window - off;
  for (int64_t h = hk * a.G; h < (hk + 1) * a.G; h++) {
    const int64_t qb = b * qs.s[0] + h * qs.s[1], gb = b * dos.s[0] + h * dos.s[1];
    for (int64_t base = t_lo; base < t_hi; base += blockDim.x) {
      const int64_t t = base + threadIdx.x;
      T p = 0, ds = 0;
      if (t < t_hi && seg.same(b, off + t, s)) {
        const T l = lse.get<T>(b * lss.s[0] + h * lss.s[1] + t * lss.s[2]), Dt = di[(b * a.H + h) * a.T + t];
        p = cu_exp(scale * fb_dot<P, T>(kv, q, qb + t * qs.s[2], qs.s[3], a.D) - l);
        const T dp = fb_dot<P, T>(vv, dout, gb + t * dos.s[2], dos.s[3], a.D);
        ds = p * (dp - Dt) * scale;
      }
      pv[threadIdx.x] = p;
      dsv[threadIdx.x] = ds;
      __syncthreads();
      const int64_t n = t_hi - base < (int64_t)blockDim.x ? t_hi - base : (int64_t)blockDim.x;
      for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
        T xv = dva[d], xk = dka[d];
        for (int64_t j = 0; j < n; j++) {
          xv += pv[j] * dout.template get<T>(gb + (base + j) * dos.s[2] + d * dos.s[3]);
          xk += dsv[j] * q.template get<T>(qb + (base + j) * qs.s[2] + d * qs.s[3]);
        }
        dva[d] = xv;
        dka[d] = xk;
      }
      __syncthreads();
    }
  }
  const int64_t ko2 = b * dks.s[0] + hk * dks.s[1] + s * dks.s[2], vo2 = b * dvs.s[0] + hk * dvs.s[1] + s * dvs.s[2];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) {
    dk.set(ko2 + d * dks.s[3], dka[d]);
    dv.set(vo2 + d * dvs.s[3], dva[d]);
  }
}

static Str4 lse_str(const gl_tensor *lse) {
  Str4 r = {{0, 0, 0, 0}};
  if (lse) for (int d = 0; d < 3; d++) r.s[d] = lse->stride[d];
  return r;
}

static int grid_check(const char *fn, int64_t x, int64_t y, int64_t z) {
  if (x > 0x7fffffffLL || y > 65535 || z > 65535)
    return gl_error("%s: grid %lld x %lld x %lld exceeds the CUDA limits", fn, (long long)x, (long long)y,
                    (long long)z);
  return GL_OK;
}

/* ================================ entry points ================================== */
extern "C" int cuda_attention_forward(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                                      const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window) {
  const int64_t B = q->shape[0], H = q->shape[1], T_ = q->shape[2], D = q->shape[3];
  const int64_t Hkv = k->shape[1], S = k->shape[2];
  if (B * H * T_ == 0) return GL_OK;
  int dev = out->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  /* segments with a KV cache (T < S): the fallback (the flash path's id tables tile T == S) */
  if ((!segments || T_ == S) && flash_attention_forward_fits(dev, out, q, k, v))
    return flash_attention_forward(st, dev, out, lse, q, k, v, segments, scale, window);
  GL_TRY(grid_check("cuda_attention_forward", T_, H, B));
  AttnDims a = {H, H / Hkv, T_, S, D, window < 0 ? 0 : window, window < 0 ? S - 1 : S - T_};
  return cu_dispatch({out, q, k, v}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    size_t sm = (size_t)(2 * D + FB_THREADS) * sizeof(T);
    if (sm > CU_SHARED_DYNAMIC_MAX) return gl_error("cuda_attention_forward: head dim %lld is too large", (long long)D);
    GL_LAUNCH(dim3((unsigned)T_, (unsigned)H, (unsigned)B), FB_THREADS, sm, st, attn_fwd_fallback_kernel<P, T>)(
        P::from(q), str4(q), P::from(k), str4(k), P::from(v), str4(v), P::from(out), str4(out), AnyPtr::from(lse),
        lse_str(lse), SegIds::from(segments), a, (T)scale);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                                       const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                       const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments,
                                       double scale, int64_t window) {
  const int64_t B = q->shape[0], H = q->shape[1], T_ = q->shape[2], D = q->shape[3];
  const int64_t Hkv = k->shape[1], S = k->shape[2], rows = B * H * T_;
  int dev = dq->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  if (rows == 0) {  /* no queries: nothing reaches the keys */
    GL_TRY(cuda_fill(dk, 0));
    return cuda_fill(dv, 0);
  }
  const bool fast = (!segments || T_ == S) && flash_attention_backward_fits(dev, dq, dk, dv, dout, q, k, v, out);
  int wide = q->dtype == GL_F64;
  CuTemp di;
  GL_TRY(di.make(wide ? GL_F64 : GL_F32, dev, rows));
  GL_TRY(cu_dispatch({dout, out}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    if (sizeof(T) != (wide ? 8u : 4u)) return gl_error("cuda_attention_backward: dout / out dtype mismatch");
    unsigned blocks = (unsigned)((rows * 32 + 255) / 256);
    if constexpr (std::is_same<P, TPtr<bf16>>::value) {
      if (fast) {  /* the flash path's rows: 16-byte vectors */
        GL_LAUNCH(blocks, 256, 0, st, attn_di_kernel<P, T, true>)(di.ptr<T>(), P::from(dout), str4(dout),
                                                                   P::from(out), str4(out), H, T_, D, rows);
        GL_CU_LAUNCHED();
        return GL_OK;
      }
    }
    GL_LAUNCH(blocks, 256, 0, st, attn_di_kernel<P, T, false>)(di.ptr<T>(), P::from(dout), str4(dout), P::from(out),
                                                                str4(out), H, T_, D, rows);
    GL_CU_LAUNCHED();
    return GL_OK;
  }));
  if (fast) return flash_attention_backward(st, dev, dq, dk, dv, dout, q, k, v, lse, segments, di.ptr<float>(), scale, window);
  GL_TRY(grid_check("cuda_attention_backward", T_ > S ? T_ : S, H, B));
  AttnDims a = {H, H / Hkv, T_, S, D, window < 0 ? 0 : window, window < 0 ? S - 1 : S - T_};
  return cu_dispatch({dq, dk, dv, dout, q, k, v}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    if (sizeof(T) != (wide ? 8u : 4u)) return gl_error("cuda_attention_backward: operands of mixed dtypes");
    size_t s1 = (size_t)(3 * D + FB_THREADS) * sizeof(T), s2 = (size_t)(4 * D + 2 * FB_THREADS) * sizeof(T);
    if (s2 > CU_SHARED_DYNAMIC_MAX) return gl_error("cuda_attention_backward: head dim %lld is too large", (long long)D);
    GL_LAUNCH(dim3((unsigned)T_, (unsigned)H, (unsigned)B), FB_THREADS, s1, st, attn_dq_fallback_kernel<P, T>)(
        P::from(dq), str4(dq), P::from(dout), str4(dout), P::from(q), str4(q), P::from(k), str4(k), P::from(v),
        str4(v), AnyPtr::from(lse), lse_str(lse), di.ptr<T>(), SegIds::from(segments), a, (T)scale);
    GL_CU_LAUNCHED();
    GL_LAUNCH(dim3((unsigned)S, (unsigned)Hkv, (unsigned)B), FB_THREADS, s2, st, attn_dkdv_fallback_kernel<P, T>)(
        P::from(dk), str4(dk), P::from(dv), str4(dv), P::from(dout), str4(dout), P::from(q), str4(q), P::from(k),
        str4(k), P::from(v), str4(v), AnyPtr::from(lse), lse_str(lse), di.ptr<T>(), SegIds::from(segments), a,
        (T)scale);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}
