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
 * (j, j + D/2), (j + 32, j + 32 + D/2), ...; the row's sum is a warp
 * shuffle reduction, so no shared memory and no block barriers.  The
 * backward reads dy twice (the second time from L1/L2: the account counts
 * each sector once, as DRAM would move it).  Rows address every tensor
 * through its own strides (B, T, H, D), the tables through theirs (T, D/2).
 *
 * Twin: engine/cpu_nn.c (R(rope_rmsnorm)).  Spec: spec/layer_fusion_spec.lua
 * (the CPU op against the unfused ops and float64 differences; the GPU
 * against the CPU in float32 and bfloat16, also in race mode). */
#include "common.cuh"

struct RopeNormStrides {
  int64_t o[4], x[4], g[4], c[2], s[2], st[3];
};

enum { RN_THREADS = 128, RN_ROWS = RN_THREADS / 32 };  /* 4 rows (warps) per block */

/* out = y (dy null) or dx; st = rstd, written forward, read backward */
template <class P, class T>
__global__ void rope_rmsnorm_kernel(P out, P x, P dy, P cs, P sn, AnyPtr st, RopeNormStrides sd, int64_t rows,
                                    int64_t T_, int64_t H, int64_t half, T eps) {
  int lane = threadIdx.x & 31;
  /* r is the same for the whole warp, so every lane reaches the shuffles */
  for (int64_t r = (int64_t)blockIdx.x * RN_ROWS + (threadIdx.x >> 5); r < rows; r += (int64_t)gridDim.x * RN_ROWS) {
    int64_t h = r % H, t = (r / H) % T_, b = r / H / T_;
    int64_t xo = b * sd.x[0] + t * sd.x[1] + h * sd.x[2], oo = b * sd.o[0] + t * sd.o[1] + h * sd.o[2];
    int64_t so = b * sd.st[0] + t * sd.st[1] + h * sd.st[2];
    auto xat = [&](int64_t i) -> T { return x.template get<T>(xo + i * sd.x[3]); };
    auto cat = [&](int64_t j) -> T { return cs.template get<T>(t * sd.c[0] + j * sd.c[1]); };
    auto sat = [&](int64_t j) -> T { return sn.template get<T>(t * sd.s[0] + j * sd.s[1]); };
    T D = (T)(2 * half);
    if (dy.null()) {
      T v = 0;
      for (int64_t j = lane; j < half; j += 32) {
        T x1 = xat(j), x2 = xat(j + half);
        v += x1 * x1 + x2 * x2;
      }
      v = cu_warp_reduce(v, CuSum());
      T rs = (T)1 / cu_sqrt(v / D + eps);
      for (int64_t j = lane; j < half; j += 32) {
        T x1 = xat(j), x2 = xat(j + half), c = cat(j), s = sat(j);
        out.set(oo + j * sd.o[3], (x1 * c + x2 * s) * rs);
        out.set(oo + (j + half) * sd.o[3], (x2 * c - x1 * s) * rs);
      }
      if (lane == 0 && !st.null()) st.set(so, rs);
    } else {
      int64_t go = b * sd.g[0] + t * sd.g[1] + h * sd.g[2];
      T rs = st.get<T>(so), sgx = 0;
      /* g = rope^T(dy), pair j */
      auto grot = [&](int64_t j, T &g1, T &g2) {
        T d1 = dy.template get<T>(go + j * sd.g[3]), d2 = dy.template get<T>(go + (j + half) * sd.g[3]);
        T c = cat(j), s = sat(j);
        g1 = d1 * c - d2 * s;
        g2 = d2 * c + d1 * s;
      };
      for (int64_t j = lane; j < half; j += 32) {
        T g1, g2;
        grot(j, g1, g2);
        sgx += g1 * xat(j) + g2 * xat(j + half);
      }
      sgx = cu_warp_reduce(sgx, CuSum()) * rs / D;
      for (int64_t j = lane; j < half; j += 32) {
        T g1, g2;
        grot(j, g1, g2);
        out.set(oo + j * sd.o[3], rs * (g1 - xat(j) * rs * sgx));
        out.set(oo + (j + half) * sd.o[3], rs * (g2 - xat(j + half) * rs * sgx));
      }
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
  return cu_dispatch({out, x, dy, cos, sin}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(blocks, RN_THREADS, 0, stream, rope_rmsnorm_kernel<P, T>)(
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
