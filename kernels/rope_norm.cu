/* rope_norm.cu — rotary embedding fused with a parameter-free RMSNorm over
 * the head dim, forward and backward (gl_rope_rmsnorm_forward / _backward:
 * nanochat's q and k, `rms_norm(rope(q))`).
 *
 * Unfused, q and k went through two kernels each way: rope (read, write)
 * and the norm (read, write) forward, the norm's backward (read dy and x,
 * write) and rope's inverse (read, write) backward: 10 passes over each of
 * q and k per layer.  Fused, 2 forward and 3 backward.  The rotation keeps
 * each pair's x1^2 + x2^2, so a row's statistics are those of x itself:
 *   forward   rs = 1 / sqrt(mean(x^2) + eps),  y = rope(x) rs
 *   backward  g = rope^T(dy),  dx = rs (g - x rs mean(g x rs))
 * and the backward needs only x (the rope's input, which autograd keeps
 * anyway) and rs, not the rotated row.
 *
 * One warp per row (b, t, h) of D elements: lane j takes the pairs
 * (j, j + D/2), (j + 32, j + 32 + D/2), ..., or, on the vector path, 8
 * bf16 (4 float) pairs at once from 16-byte loads; the row's sum is a warp
 * shuffle reduction, so no shared memory and no block barriers.  The
 * backward reads dy twice (the second time from L1/L2: the account counts
 * each sector once, as DRAM would move it).  Rows address every tensor
 * through its own strides (B, T, H, D), the tables through theirs (T, D/2).
 *
 * Twin: engine/cpu/rope_norm.c (R(rope_rmsnorm)).  Spec: spec/layer_fusion_spec.lua
 * (the CPU op against the unfused ops and float64 differences; the GPU
 * against the CPU in float32 and bfloat16, also in race mode). */
#include "row_walk.cuh"

struct RopeNormStrides {
  int64_t o[4], x[4], g[4], c[2], s[2], st[3];
};

enum { RN_THREADS = 128, RN_ROWS = RN_THREADS / 32 };  /* 4 rows (warps) per block */

/* The vector path (VEC: one storage type S for every operand, the last dim
   of x, out, dy and the tables contiguous, D/2 a multiple of N = 16 /
   sizeof(S); checked on the host) takes a row whose operands all start
   16-byte aligned (checked per row: the same for the whole warp) N pairs at
   a time: lane l the pairs j = N l .. N l + N - 1, (j, j + D/2), as four
   16-byte loads (x1, x2, cos, sin) and two stores.  Any other row walks one
   pair at a time (pair_walk's scalar body).  Both bodies compute each pair
   the same way in T; only the order in which a lane adds its pairs into the
   row's sums differs. */
template <class P, bool VEC, class FV, class FS>
__device__ __forceinline__ void pair_walk(int64_t half, bool vec, int lane, FV &&fv, FS &&fs) {
  if (VEC && vec) {
    const int64_t N = CuVec16<typename RowStore<P>::S>::N;
    for (int64_t j = (int64_t)lane * N; j < half; j += 32 * N) fv(j);
  } else {
    for (int64_t j = lane; j < half; j += 32) fs(j);
  }
}

/* out = y (dy null) or dx; st = rstd, written forward, read backward */
template <class P, class T, bool VEC>
__global__ void rope_rmsnorm_kernel(P out, P x, P dy, P cs, P sn, AnyPtr st, RopeNormStrides sd, int64_t rows,
                                    int64_t T_, int64_t H, int64_t half, T eps) {
  typedef typename RowStore<P>::S S;
  typedef CuVec16<S> V;
  int lane = threadIdx.x & 31;
  /* r is the same for the whole warp, so every lane reaches the shuffles */
  for (int64_t r = (int64_t)blockIdx.x * RN_ROWS + (threadIdx.x >> 5); r < rows; r += (int64_t)gridDim.x * RN_ROWS) {
    int64_t h = r % H, t = (r / H) % T_, b = r / H / T_;
    int64_t xo = b * sd.x[0] + t * sd.x[1] + h * sd.x[2], oo = b * sd.o[0] + t * sd.o[1] + h * sd.o[2];
    int64_t go = b * sd.g[0] + t * sd.g[1] + h * sd.g[2];
    int64_t so = b * sd.st[0] + t * sd.st[1] + h * sd.st[2];
    auto xat = [&](int64_t i) -> T { return x.template get<T>(xo + i * sd.x[3]); };
    auto cat = [&](int64_t j) -> T { return cs.template get<T>(t * sd.c[0] + j * sd.c[1]); };
    auto sat = [&](int64_t j) -> T { return sn.template get<T>(t * sd.s[0] + j * sd.s[1]); };
    bool vec = VEC && row_aligned(x, xo) && row_aligned(out, oo) && (dy.null() || row_aligned(dy, go)) &&
               row_aligned(cs, t * sd.c[0]) && row_aligned(sn, t * sd.s[0]);
    /* N pairs from j: x1, x2 (and dy's d1, d2), cos, sin as vectors */
    auto vload = [&](P p, int64_t i) { return V::load(row_at(p, i)); };
    T D = (T)(2 * half);
    if (dy.null()) {
      T v = 0;
      pair_walk<P, VEC>(half, vec, lane, [&](int64_t j) {
        V a = vload(x, xo + j), c = vload(x, xo + j + half);
#pragma unroll
        for (int k = 0; k < V::N; k++) {
          T x1 = a.template get<T>(k), x2 = c.template get<T>(k);
          v += x1 * x1 + x2 * x2;
        }
      }, [&](int64_t j) {
        T x1 = xat(j), x2 = xat(j + half);
        v += x1 * x1 + x2 * x2;
      });
      v = cu_warp_reduce(v, CuSum());
      T rs = (T)1 / cu_sqrt(v / D + eps);
      pair_walk<P, VEC>(half, vec, lane, [&](int64_t j) {
        V a = vload(x, xo + j), e = vload(x, xo + j + half), c = vload(cs, t * sd.c[0] + j),
          s = vload(sn, t * sd.s[0] + j), y1, y2;
#pragma unroll
        for (int k = 0; k < V::N; k++) {
          T x1 = a.template get<T>(k), x2 = e.template get<T>(k), ck = c.template get<T>(k), sk = s.template get<T>(k);
          y1.set(k, (x1 * ck + x2 * sk) * rs);
          y2.set(k, (x2 * ck - x1 * sk) * rs);
        }
        y1.store(row_at(out, oo + j));
        y2.store(row_at(out, oo + j + half));
      }, [&](int64_t j) {
        T x1 = xat(j), x2 = xat(j + half), c = cat(j), s = sat(j);
        out.set(oo + j * sd.o[3], (x1 * c + x2 * s) * rs);
        out.set(oo + (j + half) * sd.o[3], (x2 * c - x1 * s) * rs);
      });
      if (lane == 0 && !st.null()) st.set(so, rs);
    } else {
      T rs = st.get<T>(so), sgx = 0;
      /* g = rope^T(dy), pair j */
      auto grot = [&](int64_t j, T &g1, T &g2) {
        T d1 = dy.template get<T>(go + j * sd.g[3]), d2 = dy.template get<T>(go + (j + half) * sd.g[3]);
        T c = cat(j), s = sat(j);
        g1 = d1 * c - d2 * s;
        g2 = d2 * c + d1 * s;
      };
      /* the same for N pairs from j, from vectors */
      auto grot_v = [&](int64_t j, T *g1, T *g2) {
        V d1 = vload(dy, go + j), d2 = vload(dy, go + j + half), c = vload(cs, t * sd.c[0] + j),
          s = vload(sn, t * sd.s[0] + j);
#pragma unroll
        for (int k = 0; k < V::N; k++) {
          T a = d1.template get<T>(k), e = d2.template get<T>(k), ck = c.template get<T>(k), sk = s.template get<T>(k);
          g1[k] = a * ck - e * sk;
          g2[k] = e * ck + a * sk;
        }
      };
      pair_walk<P, VEC>(half, vec, lane, [&](int64_t j) {
        T g1[V::N], g2[V::N];
        grot_v(j, g1, g2);
        V a = vload(x, xo + j), e = vload(x, xo + j + half);
#pragma unroll
        for (int k = 0; k < V::N; k++) sgx += g1[k] * a.template get<T>(k) + g2[k] * e.template get<T>(k);
      }, [&](int64_t j) {
        T g1, g2;
        grot(j, g1, g2);
        sgx += g1 * xat(j) + g2 * xat(j + half);
      });
      sgx = cu_warp_reduce(sgx, CuSum()) * rs / D;
      pair_walk<P, VEC>(half, vec, lane, [&](int64_t j) {
        T g1[V::N], g2[V::N];
        grot_v(j, g1, g2);
        V a = vload(x, xo + j), e = vload(x, xo + j + half), o1, o2;
#pragma unroll
        for (int k = 0; k < V::N; k++) {
          o1.set(k, rs * (g1[k] - a.template get<T>(k) * rs * sgx));
          o2.set(k, rs * (g2[k] - e.template get<T>(k) * rs * sgx));
        }
        o1.store(row_at(out, oo + j));
        o2.store(row_at(out, oo + j + half));
      }, [&](int64_t j) {
        T g1, g2;
        grot(j, g1, g2);
        out.set(oo + j * sd.o[3], rs * (g1 - xat(j) * rs * sgx));
        out.set(oo + (j + half) * sd.o[3], rs * (g2 - xat(j + half) * rs * sgx));
      });
    }
  }
}

static int rope_rmsnorm(gl_tensor *out, const gl_tensor *st, const gl_tensor *dy, const gl_tensor *x,
                        const gl_tensor *cos, const gl_tensor *sin, double eps) {
  int64_t T_ = x->shape[1], H = x->shape[2], half = x->shape[3] / 2;
  int64_t rows = x->shape[0] * T_ * H;
  if (rows == 0 || half == 0) return GL_OK;
  cudaStream_t stream;
  GL_TRY(cu_begin(out->device, &stream));
  RopeNormStrides sd = {};
  for (int d = 0; d < 4; d++) {
    sd.o[d] = out->stride[d];
    sd.x[d] = x->stride[d];
    sd.g[d] = dy ? dy->stride[d] : 0;
  }
  for (int d = 0; d < 2; d++) { sd.c[d] = cos->stride[d]; sd.s[d] = sin->stride[d]; }
  for (int d = 0; d < 3 && st; d++) sd.st[d] = st->stride[d];
  unsigned blocks = cu_blocks(out->device, rows, RN_ROWS);
  bool contiguous = rows_contiguous({out, x, dy}) && (half == 1 || (cos->stride[1] == 1 && sin->stride[1] == 1));
  return cu_dispatch({out, x, dy, cos, sin}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if constexpr (row_typed<P>()) {
      if (contiguous && half % CuVec16<typename RowStore<P>::S>::N == 0) {
        GL_LAUNCH(blocks, RN_THREADS, 0, stream, rope_rmsnorm_kernel<P, T, true>)(
            P::from(out), P::from(x), P::from(dy), P::from(cos), P::from(sin), AnyPtr::from(st), sd, rows, T_, H,
            half, (T)eps);
        GL_CU_LAUNCHED();
        return GL_OK;
      }
    }
    GL_LAUNCH(blocks, RN_THREADS, 0, stream, rope_rmsnorm_kernel<P, T, false>)(
        P::from(out), P::from(x), P::from(dy), P::from(cos), P::from(sin), AnyPtr::from(st), sd, rows, T_, H, half,
        (T)eps);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_rope_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *cos,
                                         const gl_tensor *sin, double eps) {
  return rope_rmsnorm(y, rstd, NULL, x, cos, sin, eps);
}
extern "C" int cuda_rope_rmsnorm_backward(gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *cos,
                                          const gl_tensor *sin, const gl_tensor *rstd) {
  return rope_rmsnorm(dx, rstd, dy, x, cos, sin, 0);
}
