/* loss.cu — fused cross-entropy on the GPU, forward and backward.
 *
 * Twin of engine/cpu/loss.c:
 *   z = softcap > 0 ? softcap * tanh(logits / softcap) : logits,
 *   lse = log sum exp z, loss = lse - z[target]; ignored rows: loss = lse = 0;
 *   dlogits = scale * (exp(z - lse) - onehot) * (1 - (z / softcap)^2),
 *   scale times scale_by[0] when given: a factor that lives on the device
 *   (the upstream gradient over the count of kept targets), read by every
 *   block so the host never waits for it.
 * One block per row streams the vocabulary in one pass (an online max / sum
 * per thread, merged across the block), so no softmax matrix is ever
 * materialised; the backward recomputes the probabilities from lse and may
 * overwrite the logits in place.  Targets are range-checked on the device
 * (cu_check_ids, reported at the next host wait); a bad target's row gets a
 * NaN loss and no one-hot term, never a read out of bounds.
 *
 * 16-byte rows (issue 13): a typed launch whose rows are contiguous reads
 * (and the backward writes) CuVec16<S>::N logits per access (8 bfloat16, 4
 * float) in every row that starts 16-byte aligned, element by element in the
 * others and past the last whole vector (kernels/row_walk.cuh; V = 50304 or
 * 65536 in bfloat16 is aligned in every row, V = 1001 in every other at
 * best).  Spec: spec/cuda_rows_spec.lua ("16-byte rows: cross-entropy"). */
#include "row_walk.cuh"


template <class T> __device__ __forceinline__ T capped(T z, T cap) { return cap > (T)0 ? cap * cu_tanh(z / cap) : z; }

/* VEC (a typed launch, the logits' rows contiguous): rows that start 16-byte
   aligned read their logits CuVec16<S>::N at a time (row_walk, kernels/row_walk.cuh);
   the others, and the tail past the last whole vector, element by element. */
template <class P, class T, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) ce_forward_kernel(AnyPtr losses, int64_t lss, AnyPtr lse, int64_t ess, P logits, int64_t s0,
                                  int64_t s1, IdxPtr targets, int64_t ts, int64_t N, int64_t V, int64_t ignore,
                                  T cap) {
  typedef CuVec16<typename RowStore<P>::S> Vec;
  CU_ROW_LOOP(r, N) {
    int64_t tg = targets.get(r * ts);
    if (tg == ignore || tg < 0 || tg >= V) {  /* uniform over the block */
      if (threadIdx.x == 0) {  /* a bad target (reported by the check): NaN */
        T v = tg == ignore ? (T)0 : cu_nan<T>();
        losses.set(r * lss, v);
        if (!lse.null()) lse.set(r * ess, v);
      }
      continue;
    }
    int64_t base = r * s0;
    T m = -cu_inf<T>(), s = 0;
    auto add = [&](T x) {  /* the thread's online max and sum of exp */
      T z = capped(x, cap);
      if (z > m) { s = s * cu_exp(m - z) + (T)1; m = z; }
      else if (m != -cu_inf<T>()) s += cu_exp(z - m);
    };
    row_walk<Vec::N>(V, VEC && row_aligned(logits, base), [&](int64_t c) {
      Vec xv = Vec::load(row_at(logits, base + c));
#pragma unroll
      for (int k = 0; k < Vec::N; k++) add(xv.template get<T>(k));
    }, [&](int64_t c) { add(logits.template get<T>(base + c * s1)); });
    T M = cu_block_reduce(m, CuMax(), -cu_inf<T>());
    s = m == -cu_inf<T>() ? (T)0 : s * cu_exp(m - M);
    T S = cu_block_reduce(s, CuSum(), (T)0);
    if (threadIdx.x == 0) {
      T l = M + cu_log(S);
      losses.set(r * lss, l - capped(logits.template get<T>(base + tg * s1), cap));
      if (!lse.null()) lse.set(r * ess, l);
    }
  }
}

/* VEC as in the forward: a row whose logits and dlogits both start 16-byte
   aligned moves CuVec16<S>::N elements per load and store (dlogits may be
   the logits: each vector is read before it is written, by one thread). */
template <class P, class T, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) ce_backward_kernel(P dlogits, int64_t d0, int64_t d1, P logits, int64_t s0, int64_t s1,
                                   IdxPtr targets, int64_t ts, AnyPtr lse, int64_t ess, int64_t N, int64_t V,
                                   int64_t ignore, T cap, T scale, AnyPtr scale_by) {
  typedef CuVec16<typename RowStore<P>::S> Vec;
  if (!scale_by.null()) scale *= scale_by.get<T>(0);
  CU_ROW_LOOP(r, N) {
    int64_t tg = targets.get(r * ts);
    bool vec = VEC && row_aligned(dlogits, r * d0) && row_aligned(logits, r * s0);
    if (tg == ignore) {
      row_walk<Vec::N>(V, vec, [&](int64_t c) {
        Vec z;
#pragma unroll
        for (int k = 0; k < Vec::N; k++) z.set(k, (T)0);
        z.store(row_at(dlogits, r * d0 + c));
      }, [&](int64_t c) { dlogits.set(r * d0 + c * d1, (T)0); });
      continue;
    }
    T l = lse.get<T>(r * ess);
    auto grad = [&](int64_t c, T x) -> T {
      T hot = c == tg ? (T)1 : (T)0;
      if (cap > (T)0) {
        T th = cu_tanh(x / cap);
        // 1 - th^2 as (1 - th)(1 + th): no cancellation near |th| = 1 (kernels/elementwise.cu)
        return scale * (cu_exp(cap * th - l) - hot) * (((T)1 - th) * ((T)1 + th));
      }
      return scale * (cu_exp(x - l) - hot);
    };
    row_walk<Vec::N>(V, vec, [&](int64_t c) {
      Vec xv = Vec::load(row_at(logits, r * s0 + c)), dv;
#pragma unroll
      for (int k = 0; k < Vec::N; k++) dv.set(k, grad(c + k, xv.template get<T>(k)));
      dv.store(row_at(dlogits, r * d0 + c));
    }, [&](int64_t c) { dlogits.set(r * d0 + c * d1, grad(c, logits.template get<T>(r * s0 + c * s1))); });
  }
}

/* (one launch expression per kernel, so the account's row is named
   ce_*_kernel<P,T,VEC> whichever path the launch takes) */
template <class P, class T, bool VEC>
static void launch_ce_forward(cudaStream_t st, int threads, gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                              const gl_tensor *targets, int64_t ignore_index, double softcap) {
  int64_t N = logits->shape[0], V = logits->shape[1];
  GL_LAUNCH(cu_row_grid(N), threads, 0, st, ce_forward_kernel<P, T, VEC>)(
      AnyPtr::from(losses), losses->stride[0], AnyPtr::from(lse), lse ? lse->stride[0] : 0, P::from(logits),
      logits->stride[0], logits->stride[1], IdxPtr::from(targets), targets->stride[0], N, V, ignore_index,
      (T)softcap);
}

template <class P, class T, bool VEC>
static void launch_ce_backward(cudaStream_t st, int threads, gl_tensor *dlogits, const gl_tensor *logits,
                               const gl_tensor *targets, const gl_tensor *lse, int64_t ignore_index, double softcap,
                               double scale, const gl_tensor *scale_by) {
  int64_t N = logits->shape[0], V = logits->shape[1];
  GL_LAUNCH(cu_row_grid(N), threads, 0, st, ce_backward_kernel<P, T, VEC>)(
      P::from(dlogits), dlogits->stride[0], dlogits->stride[1], P::from(logits), logits->stride[0],
      logits->stride[1], IdxPtr::from(targets), targets->stride[0], AnyPtr::from(lse), lse->stride[0], N, V,
      ignore_index, (T)softcap, (T)scale, AnyPtr::from(scale_by));
}

extern "C" int cuda_cross_entropy_forward(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                                          const gl_tensor *targets, int64_t ignore_index, double softcap) {
  int64_t N = logits->shape[0], V = logits->shape[1];
  if (N == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(logits->device, &st));
  GL_TRY(cu_check_ids("gl_cross_entropy_forward", "targets", targets, V, "vocab size of logits", 1, ignore_index, st,
                      NULL));
  int threads = cu_row_threads(V);
  bool contiguous = rows_contiguous({logits});
  return cu_dispatch({logits}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if (row_typed<P>() && contiguous)
      launch_ce_forward<P, T, row_typed<P>()>(st, threads, losses, lse, logits, targets, ignore_index, softcap);
    else
      launch_ce_forward<P, T, false>(st, threads, losses, lse, logits, targets, ignore_index, softcap);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_cross_entropy_backward(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                                           const gl_tensor *lse, int64_t ignore_index, double softcap, double scale,
                                           const gl_tensor *scale_by) {
  int64_t N = logits->shape[0], V = logits->shape[1];
  if (N == 0 || V == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(logits->device, &st));
  GL_TRY(cu_check_ids("gl_cross_entropy_backward", "targets", targets, V, "vocab size of logits", 1, ignore_index,
                      st, NULL));
  int threads = cu_row_threads(V);
  bool contiguous = rows_contiguous({dlogits, logits});
  return cu_dispatch({dlogits, logits}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if (row_typed<P>() && contiguous)
      launch_ce_backward<P, T, row_typed<P>()>(st, threads, dlogits, logits, targets, lse, ignore_index, softcap,
                                               scale, scale_by);
    else
      launch_ce_backward<P, T, false>(st, threads, dlogits, logits, targets, lse, ignore_index, softcap, scale,
                                      scale_by);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}
