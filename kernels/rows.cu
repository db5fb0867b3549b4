/* rows.cu — CUDA kernels for the ops that work on rows of the last dim:
 * softmax / log_softmax (forward and backward), layernorm and rmsnorm
 * (forward and backward).
 *
 * Twin of engine/cpu/rows.c: compute in float (double for
 * float64 data); mean / rstd are float32 (float64) arrays.  One block per
 * row, the row walked by the block's threads, statistics through block
 * reductions.  Layernorm and rmsnorm share one kernel per direction
 * (CENTER = subtract the mean, as the CPU's `center`).
 *
 * The weight / bias gradients of the norms are deterministic: each of a
 * fixed number of blocks sums its rows' contributions per column into its
 * own row of a scratch matrix, and a second kernel adds those rows per
 * column in block order.
 *
 * Fused with the residual stream (issue 13): gl_add_norm_forward computes
 * s = x + r and y = norm(s) in one pass (add_norm_forward_kernel: the row of
 * s in shared memory, so x and r are read once and s and y written once;
 * bfloat16 rows move in 16-byte vectors), and the norm's backward adds the
 * residual gradient dres into dx in its own pass (gl_norm_backward_add).
 * Twin: engine/unfused.c; spec/cuda_rows_spec.lua ("residual add + norm").
 *
 * 16-byte rows (issue 13): softmax, the norms forward and backward move
 * CuVec16<S>::N elements (8 bfloat16, 4 float, 2 double) per load and store
 * when the launch is typed and every operand's elements are contiguous
 * (VEC, checked on the host) and the row's operands all start 16-byte
 * aligned (checked per row on the device: with C % N != 0 the rows of one
 * tensor alternate between aligned and not); the last C % N elements, the
 * misaligned rows and mixed-dtype launches go element by element (row_walk).
 * Same formulas either way, so the two paths differ only in the order of
 * the per-thread partial sums.  Spec: spec/cuda_rows_spec.lua ("16-byte
 * rows"). */
#include "row_walk.cuh"

/* outer dims of a (rows, C) view: x.shape[:-1] with each tensor's strides
   (per-row statistics have exactly those dims, so their strides fit too) */
template <int N> static CuIdx<N> row_idx(const gl_tensor *x, std::initializer_list<const gl_tensor *> ts) {
  const int64_t *st[N];
  int k = 0;
  for (const gl_tensor *t : ts) st[k++] = t ? t->stride : NULL;
  return cu_idx<N>(x->ndim - 1, x->shape, st);
}
static inline int64_t last_stride(const gl_tensor *t) { return t ? t->stride[t->ndim - 1] : 0; }
/* Threads for a one-block-per-row kernel sized to the row: about 8
   elements (a 16-byte bf16 vector) per thread, so C = 768 gets 128 threads,
   not 512 that mostly idle between barriers.  (The norms' backward keeps
   cu_row_threads: its grid is a fixed 2 blocks per SM, so its blocks must
   be wide.) */
static inline int row_threads_sized(int64_t C) { return cu_row_threads((C + 7) / 8 * 2); }


/* ---- softmax ---------------------------------------------------------------- */
template <class P, class T, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) softmax_kernel(P out, P x, CuIdx<2> ix, int64_t rows, int64_t C, int64_t os, int64_t xs,
                               int is_log) {
  typedef CuVec16<typename RowStore<P>::S> V;
  CU_ROW_LOOP(r, rows) {
    int64_t off[2];
    ix.offsets(r, off);
    bool vec = VEC && row_aligned(out, off[0]) && row_aligned(x, off[1]);
    T m = -cu_inf<T>();
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V xv = V::load(row_at(x, off[1] + c));
#pragma unroll
      for (int k = 0; k < V::N; k++) m = xv.template get<T>(k) > m ? xv.template get<T>(k) : m;
    }, [&](int64_t c) {
      T v = x.template get<T>(off[1] + c * xs);
      m = v > m ? v : m;
    });
    m = cu_block_reduce(m, CuMax(), -cu_inf<T>());
    T s = 0;
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V xv = V::load(row_at(x, off[1] + c));
#pragma unroll
      for (int k = 0; k < V::N; k++) s += cu_exp(xv.template get<T>(k) - m);
    }, [&](int64_t c) { s += cu_exp(x.template get<T>(off[1] + c * xs) - m); });
    s = cu_block_reduce(s, CuSum(), (T)0);
    T lse = m + cu_log(s), inv = (T)1 / s;
    auto value = [&](T v) -> T { return is_log ? v - lse : cu_exp(v - m) * inv; };
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V xv = V::load(row_at(x, off[1] + c)), ov;
#pragma unroll
      for (int k = 0; k < V::N; k++) ov.set(k, value(xv.template get<T>(k)));
      ov.store(row_at(out, off[0] + c));
    }, [&](int64_t c) { out.set(off[0] + c * os, value(x.template get<T>(off[1] + c * xs))); });
  }
}

/* softmax: dx = y (dy - sum(dy y));  log_softmax: dx = dy - exp(y) sum(dy) */
template <class P, class T, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) softmax_backward_kernel(P dx, P y, P dy, CuIdx<3> ix, int64_t rows, int64_t C, int64_t dxs,
                                        int64_t ys, int64_t dys, int is_log) {
  typedef CuVec16<typename RowStore<P>::S> V;
  CU_ROW_LOOP(r, rows) {
    int64_t off[3];
    ix.offsets(r, off);
    bool vec = VEC && row_aligned(dx, off[0]) && row_aligned(y, off[1]) && row_aligned(dy, off[2]);
    T s = 0;
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V gv = V::load(row_at(dy, off[2] + c)), yv = V::load(row_at(y, off[1] + c));
#pragma unroll
      for (int k = 0; k < V::N; k++) s += is_log ? gv.template get<T>(k) : gv.template get<T>(k) * yv.template get<T>(k);
    }, [&](int64_t c) {
      T g = dy.template get<T>(off[2] + c * dys);
      s += is_log ? g : g * y.template get<T>(off[1] + c * ys);
    });
    s = cu_block_reduce(s, CuSum(), (T)0);
    auto grad = [&](T g, T yv) -> T { return is_log ? g - cu_exp(yv) * s : yv * (g - s); };
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V gv = V::load(row_at(dy, off[2] + c)), yv = V::load(row_at(y, off[1] + c)), dv;
#pragma unroll
      for (int k = 0; k < V::N; k++) dv.set(k, grad(gv.template get<T>(k), yv.template get<T>(k)));
      dv.store(row_at(dx, off[0] + c));
    }, [&](int64_t c) {
      dx.set(off[0] + c * dxs, grad(dy.template get<T>(off[2] + c * dys), y.template get<T>(off[1] + c * ys)));
    });
  }
}

static int64_t row_count(const gl_tensor *x) {
  int64_t C = x->shape[x->ndim - 1];
  return C ? x->numel / C : 0;
}

extern "C" int cuda_softmax(gl_tensor *out, const gl_tensor *x, int log) {
  int64_t C = x->shape[x->ndim - 1], rows = row_count(x);
  if (rows == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  CuIdx<2> ix = row_idx<2>(x, {out, x});
  int threads = row_threads_sized(C);
  bool contiguous = rows_contiguous({out, x});
  return cu_dispatch({out, x}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if (row_typed<P>() && contiguous)
      GL_LAUNCH(cu_row_grid(rows), threads, 0, st, softmax_kernel<P, T, row_typed<P>()>)(
          P::from(out), P::from(x), ix, rows, C, last_stride(out), last_stride(x), log);
    else
      GL_LAUNCH(cu_row_grid(rows), threads, 0, st, softmax_kernel<P, T, false>)(
          P::from(out), P::from(x), ix, rows, C, last_stride(out), last_stride(x), log);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_softmax_backward(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int log) {
  int64_t C = y->shape[y->ndim - 1], rows = row_count(y);
  if (rows == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(dx->device, &st));
  CuIdx<3> ix = row_idx<3>(y, {dx, y, dy});
  int threads = row_threads_sized(C);
  bool contiguous = rows_contiguous({dx, y, dy});
  return cu_dispatch({dx, y, dy}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if (row_typed<P>() && contiguous)
      GL_LAUNCH(cu_row_grid(rows), threads, 0, st, softmax_backward_kernel<P, T, row_typed<P>()>)(
          P::from(dx), P::from(y), P::from(dy), ix, rows, C, last_stride(dx), last_stride(y), last_stride(dy), log);
    else
      GL_LAUNCH(cu_row_grid(rows), threads, 0, st, softmax_backward_kernel<P, T, false>)(
          P::from(dx), P::from(y), P::from(dy), ix, rows, C, last_stride(dx), last_stride(y), last_stride(dy), log);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* ---- layernorm / rmsnorm ------------------------------------------------------ */
/* y = (x - mean) rstd w + b with rstd = 1 / sqrt(mean((x - mean)^2) + eps);
   CENTER = false is rmsnorm (mean 0, no bias).  ix: y, x, mean, rstd.  The
   statistics are read and written through AnyPtr (float32 / float64 arrays,
   one element per row). */
template <class P, class T, bool CENTER, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) norm_forward_kernel(P y, P x, P w, P b, AnyPtr mean, AnyPtr rstd, CuIdx<4> ix, int64_t rows,
                                    int64_t C, int64_t ys, int64_t xs, int64_t ws, int64_t bs, T eps) {
  typedef CuVec16<typename RowStore<P>::S> V;
  bool wwhole = row_vec_whole(w, ws), bwhole = row_vec_whole(b, bs);
  CU_ROW_LOOP(r, rows) {
    int64_t off[4];
    ix.offsets(r, off);
    bool vec = VEC && row_aligned(y, off[0]) && row_aligned(x, off[1]);
    T m = 0;
    if (CENTER) {
      row_walk<V::N>(C, vec, [&](int64_t c) {
        V xv = V::load(row_at(x, off[1] + c));
#pragma unroll
        for (int k = 0; k < V::N; k++) m += xv.template get<T>(k);
      }, [&](int64_t c) { m += x.template get<T>(off[1] + c * xs); });
      m = cu_block_reduce(m, CuSum(), (T)0) / (T)C;
    }
    T v = 0;
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V xv = V::load(row_at(x, off[1] + c));
#pragma unroll
      for (int k = 0; k < V::N; k++) {
        T d = xv.template get<T>(k) - m;
        v += d * d;
      }
    }, [&](int64_t c) {
      T d = x.template get<T>(off[1] + c * xs) - m;
      v += d * d;
    });
    v = cu_block_reduce(v, CuSum(), (T)0);
    T rs = (T)1 / cu_sqrt(v / (T)C + eps);
    auto value = [&](T xv, T wv, T bv) -> T { return (xv - m) * rs * wv + bv; };
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V xv = V::load(row_at(x, off[1] + c)), yv, wv, bv;  /* the weight and bias as vectors too */
      if (!w.null()) wv = row_vec(w, c, ws, wwhole);
      if (CENTER && !b.null()) bv = row_vec(b, c, bs, bwhole);
#pragma unroll
      for (int k = 0; k < V::N; k++)
        yv.set(k, value(xv.template get<T>(k), w.null() ? (T)1 : wv.template get<T>(k),
                        (!CENTER || b.null()) ? (T)0 : bv.template get<T>(k)));
      yv.store(row_at(y, off[0] + c));
    }, [&](int64_t c) {
      y.set(off[0] + c * ys, value(x.template get<T>(off[1] + c * xs), w.null() ? (T)1 : w.template get<T>(c * ws),
                                   (!CENTER || b.null()) ? (T)0 : b.template get<T>(c * bs)));
    });
    if (threadIdx.x == 0) {
      if (CENTER && !mean.null()) mean.set(off[2], m);
      if (!rstd.null()) rstd.set(off[3], rs);
    }
  }
}

/* p[0 .. n) += v[0 .. n) (a vector row's columns of a norm backward's
   partial sums, owned by one thread): CuVec16<T> loads and stores when p is
   16-byte aligned, else element by element */
template <int n, class T> __device__ __forceinline__ void part_add(T *p, const T *v, bool vec) {
  typedef CuVec16<T> PV;
  static_assert(n % PV::N == 0, "a row vector holds whole partial-sum vectors");
  if (vec) {
#pragma unroll
    for (int j = 0; j < n; j += PV::N) {
      PV a = PV::load(p + j);
#pragma unroll
      for (int k = 0; k < PV::N; k++) a.set(k, a.template get<T>(k) + v[j + k]);
      a.store(p + j);
    }
  } else {
#pragma unroll
    for (int k = 0; k < n; k++) p[k] += v[k];
  }
}

/* xhat = (x - mean) rstd, g = dy w:
   dx = rstd (g - mean(g) - xhat mean(g xhat))   (mean(g) only when centering);
   block k adds dy xhat and dy of its rows into part[k][c] and part[k][C + c]
   (each column owned by one thread, so no races).  dres (or null): the
   gradient reaching x by the residual stream, added to dx.  ix: dx, dy, x,
   mean, rstd, dres. */
template <class P, class T, bool CENTER, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) norm_backward_kernel(P dx, P dy, P x, P w, AnyPtr mean, AnyPtr rstd, T *part, P dres, CuIdx<6> ix,
                                     int64_t rows, int64_t C, int64_t dxs, int64_t dys, int64_t xs, int64_t ws,
                                     int64_t drs) {
  typedef CuVec16<typename RowStore<P>::S> V;
  T *pw = part ? part + (int64_t)blockIdx.x * 2 * C : nullptr;
  bool wwhole = row_vec_whole(w, ws);
  /* the partials as 16-byte vectors too: both halves of pw aligned */
  bool pvec = pw && ((uintptr_t)pw & 15) == 0 && (C * (int64_t)sizeof(T)) % 16 == 0;
  if (pw) {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) { pw[c] = 0; pw[C + c] = 0; }
    __syncthreads();  /* a vector row gives the columns to other threads than the zeroing */
  }
  CU_ROW_LOOP(r, rows) {
    int64_t off[6];
    ix.offsets(r, off);
    bool vec = VEC && row_aligned(dx, off[0]) && row_aligned(dy, off[1]) && row_aligned(x, off[2]) &&
               row_aligned(dres, off[5]);
    T m = CENTER ? mean.get<T>(off[3]) : (T)0;
    T rs = rstd.get<T>(off[4]);
    T sg = 0, sgx = 0;
    auto wat = [&](int64_t c) -> T { return w.null() ? (T)1 : w.template get<T>(c * ws); };
    auto wvec = [&](int64_t c) -> V { V wv; if (!w.null()) wv = row_vec(w, c, ws, wwhole); return wv; };
    auto wk = [&](const V &wv, int k) -> T { return w.null() ? (T)1 : wv.template get<T>(k); };
    auto sums = [&](T g, T xv, T wv) -> T {  /* returns xhat */
      T xh = (xv - m) * rs, gw = g * wv;
      sg += gw;
      sgx += gw * xh;
      return xh;
    };
    row_walk<V::N>(C, vec, [&](int64_t c) {
      V gv = V::load(row_at(dy, off[1] + c)), xv = V::load(row_at(x, off[2] + c)), wv = wvec(c);
      T gx[V::N], gs[V::N];
#pragma unroll
      for (int k = 0; k < V::N; k++) {
        gs[k] = gv.template get<T>(k);
        gx[k] = gs[k] * sums(gs[k], xv.template get<T>(k), wk(wv, k));
      }
      if (pw) { part_add<V::N>(pw + c, gx, pvec); part_add<V::N>(pw + C + c, gs, pvec); }
    }, [&](int64_t c) {
      T g = dy.template get<T>(off[1] + c * dys);
      T xh = sums(g, x.template get<T>(off[2] + c * xs), wat(c));
      if (pw) { pw[c] += g * xh; pw[C + c] += g; }
    });
    sg = CENTER ? cu_block_reduce(sg, CuSum(), (T)0) / (T)C : (T)0;
    sgx = cu_block_reduce(sgx, CuSum(), (T)0) / (T)C;
    auto grad = [&](T g, T xv, T wv) -> T { return rs * (g * wv - sg - (xv - m) * rs * sgx); };
    if (!dx.null())
      row_walk<V::N>(C, vec, [&](int64_t c) {
        V gv = V::load(row_at(dy, off[1] + c)), xv = V::load(row_at(x, off[2] + c)), wv = wvec(c), dv, rv;
        if (!dres.null()) rv = V::load(row_at(dres, off[5] + c));
#pragma unroll
        for (int k = 0; k < V::N; k++) {
          T d = grad(gv.template get<T>(k), xv.template get<T>(k), wk(wv, k));
          dv.set(k, dres.null() ? d : d + rv.template get<T>(k));
        }
        dv.store(row_at(dx, off[0] + c));
      }, [&](int64_t c) {
        T d = grad(dy.template get<T>(off[1] + c * dys), x.template get<T>(off[2] + c * xs), wat(c));
        dx.set(off[0] + c * dxs, dres.null() ? d : d + dres.template get<T>(off[5] + c * drs));
      });
  }
}

/* dweight[c] = sum_k part[k][c], dbias[c] = sum_k part[k][C + c], in k order */
template <class T>
__global__ void norm_param_grad_kernel(AnyPtr dw, int64_t dws, AnyPtr db, int64_t dbs, const T *part, int nparts,
                                       int64_t C) {
  CU_GRID_LOOP(c, C) {
    T sw = 0, sb = 0;
    for (int k = 0; k < nparts; k++) {
      sw += part[(int64_t)k * 2 * C + c];
      sb += part[(int64_t)k * 2 * C + C + c];
    }
    if (!dw.null()) dw.set(c * dws, sw);
    if (!db.null()) db.set(c * dbs, sb);
  }
}

template <class P, class T, bool CENTER, bool VEC>
static void launch_norm_forward(cudaStream_t st, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd,
                                const gl_tensor *x, const gl_tensor *w, const gl_tensor *b, double eps) {
  int64_t C = x->shape[x->ndim - 1], rows = row_count(x);
  CuIdx<4> ix = row_idx<4>(x, {y, x, mean, rstd});
  GL_LAUNCH(cu_row_grid(rows), row_threads_sized(C), 0, st, norm_forward_kernel<P, T, CENTER, VEC>)(
      P::from(y), P::from(x), P::from(w), P::from(b), AnyPtr::from(mean), AnyPtr::from(rstd), ix, rows, C,
      last_stride(y), last_stride(x), last_stride(w), last_stride(b), (T)eps);
}

static int norm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *w,
                        const gl_tensor *b, double eps, bool center) {
  if (row_count(x) == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(y->device, &st));
  bool contiguous = rows_contiguous({y, x});
  return cu_dispatch({y, x, w, b}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    constexpr bool typed = row_typed<P>();
    if (typed && contiguous) {
      if (center) launch_norm_forward<P, T, true, typed>(st, y, mean, rstd, x, w, b, eps);
      else launch_norm_forward<P, T, false, typed>(st, y, mean, rstd, x, w, b, eps);
    } else {
      if (center) launch_norm_forward<P, T, true, false>(st, y, mean, rstd, x, w, b, eps);
      else launch_norm_forward<P, T, false, false>(st, y, mean, rstd, x, w, b, eps);
    }
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

template <class P, class T, bool CENTER, bool VEC>
static void launch_norm_backward(cudaStream_t st, unsigned blocks, T *part, gl_tensor *dx, const gl_tensor *dy,
                                 const gl_tensor *x, const gl_tensor *w, const gl_tensor *mean,
                                 const gl_tensor *rstd, const gl_tensor *dres) {
  int64_t C = x->shape[x->ndim - 1], rows = row_count(x);
  CuIdx<6> ix = row_idx<6>(x, {dx, dy, x, mean, rstd, dres});
  GL_LAUNCH(blocks, cu_row_threads(C), 0, st, norm_backward_kernel<P, T, CENTER, VEC>)(
      P::from(dx), P::from(dy), P::from(x), P::from(w), AnyPtr::from(mean), AnyPtr::from(rstd), part,
      P::from(dres), ix, rows, C, last_stride(dx), last_stride(dy), last_stride(x), last_stride(w), last_stride(dres));
}

static int norm_backward(gl_tensor *dx, gl_tensor *dw, gl_tensor *db, const gl_tensor *dy, const gl_tensor *x,
                         const gl_tensor *w, const gl_tensor *mean, const gl_tensor *rstd, bool center,
                         const gl_tensor *dres = NULL) {
  int64_t C = x->shape[x->ndim - 1], rows = row_count(x);
  if (rows == 0) return GL_OK;
  int dev = x->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  int sm = cu_sm_count(dev) > 0 ? cu_sm_count(dev) : 80;
  /* enough blocks to fill the GPU, few enough that the partials stay small */
  int64_t nb = std::min<int64_t>(rows, 2 * (int64_t)sm);
  unsigned blocks = (unsigned)(nb < 1 ? 1 : nb);
  bool need_params = dw || db;
  bool contiguous = rows_contiguous({dx, dy, x, dres});
  return cu_dispatch({dx, dy, x, w, dres}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    CuTemp part;
    if (need_params) GL_TRY(part.make(sizeof(T) == 8 ? GL_F64 : GL_F32, dev, (int64_t)blocks * 2 * C));
    T *pp = part.ptr<T>();
    constexpr bool typed = row_typed<P>();
    if (typed && contiguous) {
      if (center) launch_norm_backward<P, T, true, typed>(st, blocks, pp, dx, dy, x, w, mean, rstd, dres);
      else launch_norm_backward<P, T, false, typed>(st, blocks, pp, dx, dy, x, w, mean, rstd, dres);
    } else {
      if (center) launch_norm_backward<P, T, true, false>(st, blocks, pp, dx, dy, x, w, mean, rstd, dres);
      else launch_norm_backward<P, T, false, false>(st, blocks, pp, dx, dy, x, w, mean, rstd, dres);
    }
    GL_CU_LAUNCHED();
    if (need_params) {
      GL_LAUNCH(cu_blocks(dev, C, 256), 256, 0, st, norm_param_grad_kernel<T>)(
          AnyPtr::from(dw), dw ? dw->stride[0] : 0, AnyPtr::from(db), db ? db->stride[0] : 0, pp, (int)blocks, C);
      GL_CU_LAUNCHED();
    }
    return GL_OK;
  });
}

extern "C" int cuda_layernorm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                                      const gl_tensor *weight, const gl_tensor *bias, double eps) {
  return norm_forward(y, mean, rstd, x, weight, bias, eps, true);
}
extern "C" int cuda_layernorm_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                                       const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean,
                                       const gl_tensor *rstd) {
  return norm_backward(dx, dweight, dbias, dy, x, weight, mean, rstd, true);
}
extern "C" int cuda_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *weight,
                                    double eps) {
  return norm_forward(y, NULL, rstd, x, weight, NULL, eps, false);
}
extern "C" int cuda_rmsnorm_backward(gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy, const gl_tensor *x,
                                     const gl_tensor *weight, const gl_tensor *rstd) {
  return norm_backward(dx, dweight, NULL, dy, x, weight, NULL, rstd, false);
}

/* ---- residual add + norm ------------------------------------------------------ */
/* The value the storage type keeps of v (the unfused add stores s, and the
   norm reads it back: the statistics are of the rounded s). */
template <class S, class T> __device__ __forceinline__ T cu_stored(TPtr<S>, T v) {
  return CuStore<S>::template load<T>(CuStore<S>::template store<T>(v));
}
template <class T> __device__ __forceinline__ T cu_stored(AnyPtr p, T v) {
  switch (p.dt) {
    case GL_BF16: return (T)__bfloat162float(__float2bfloat16((float)v));
    case GL_F16: return (T)__half2float(__float2half((float)v));
    case GL_F32: return (T)(float)v;
  }
  return v;
}

/* s = x + r; y = norm(s) (as norm_forward_kernel).  One block per row; the
   row of s, as stored, is kept in row[C] of shared memory for the
   statistics and y.  VEC: bfloat16 rows with contiguous, 16-byte aligned
   elements and C % 8 == 0 move 8 elements per 16-byte load or store.
   ix: s, y, x, r, mean, rstd. */
template <class P, class T, bool CENTER, bool VEC>
__global__ void __launch_bounds__(CU_ROW_MAX_THREADS) add_norm_forward_kernel(P s, P y, P x, P r, P w, P b, AnyPtr mean, AnyPtr rstd, CuIdx<6> ix,
                                        int64_t rows, int64_t C, int64_t ss, int64_t ys, int64_t xs, int64_t rs_,
                                        int64_t ws, int64_t bs, T eps) {
  GL_DYNAMIC_SHARED(unsigned char, add_norm_smem, 16);  /* one type for every instantiation (nvcc) */
  T *row = (T *)add_norm_smem;  /* (C) */
  bool wwhole = row_vec_whole(w, ws), bwhole = row_vec_whole(b, bs);
  CU_ROW_LOOP(rr, rows) {
    int64_t off[6];
    ix.offsets(rr, off);
    T sum = 0;
    if constexpr (VEC) {
      for (int64_t c = (int64_t)threadIdx.x * 8; c < C; c += (int64_t)blockDim.x * 8) {
        uint4 xv = *(const uint4 *)(x.p + off[2] + c), rv = *(const uint4 *)(r.p + off[3] + c), sv;
        const bf16 *xe = (const bf16 *)&xv, *re = (const bf16 *)&rv;
        bf16 *se = (bf16 *)&sv;
#pragma unroll
        for (int k = 0; k < 8; k++) {
          se[k] = __float2bfloat16(__bfloat162float(xe[k]) + __bfloat162float(re[k]));
          T v = (T)__bfloat162float(se[k]);
          row[c + k] = v;
          sum += v;
        }
        *(uint4 *)(s.p + off[0] + c) = sv;
      }
    } else {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        T v = cu_stored(s, x.template get<T>(off[2] + c * xs) + r.template get<T>(off[3] + c * rs_));
        s.set(off[0] + c * ss, v);
        row[c] = v;
        sum += v;
      }
    }
    T m = CENTER ? cu_block_reduce(sum, CuSum(), (T)0) / (T)C : (T)0;
    if (!CENTER) __syncthreads();  /* row[] complete (the reduction's barriers do it when centering) */
    T v = 0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      T d = row[c] - m;
      v += d * d;
    }
    v = cu_block_reduce(v, CuSum(), (T)0);
    T rs = (T)1 / cu_sqrt(v / (T)C + eps);
    if constexpr (VEC) {
      for (int64_t c = (int64_t)threadIdx.x * 8; c < C; c += (int64_t)blockDim.x * 8) {
        uint4 yv;
        bf16 *ye = (bf16 *)&yv;
        CuVec16<bf16> wv, bv;  /* the weight and bias as vectors too */
        if (!w.null()) wv = row_vec(w, c, ws, wwhole);
        if (CENTER && !b.null()) bv = row_vec(b, c, bs, bwhole);
#pragma unroll
        for (int k = 0; k < 8; k++) {
          T wk = w.null() ? (T)1 : wv.template get<T>(k);
          T bk = (!CENTER || b.null()) ? (T)0 : bv.template get<T>(k);
          ye[k] = __float2bfloat16((float)((row[c + k] - m) * rs * wk + bk));
        }
        *(uint4 *)(y.p + off[1] + c) = yv;
      }
    } else {
      for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        T wv = w.null() ? (T)1 : w.template get<T>(c * ws);
        T bv = (!CENTER || b.null()) ? (T)0 : b.template get<T>(c * bs);
        y.set(off[1] + c * ys, (row[c] - m) * rs * wv + bv);
      }
    }
    if (threadIdx.x == 0) {
      if (CENTER && !mean.null()) mean.set(off[4], m);
      if (!rstd.null()) rstd.set(off[5], rs);
    }
    __syncthreads();  /* row[] is read before the next row overwrites it */
  }
}

/* whether every row of t starts 16-byte aligned with contiguous elements */
static bool rows_vec16(const gl_tensor *t) {
  if (t->stride[t->ndim - 1] != 1 || ((uintptr_t)cu_ptr(t) & 15)) return false;
  for (int d = 0; d < t->ndim - 1; d++)
    if (t->shape[d] > 1 && (t->stride[d] * gl_dtype_size(t->dtype)) % 16 != 0) return false;
  return true;
}

enum { ADD_NORM_MAX_SHARED = CU_SHARED_DYNAMIC_MAX };  /* the row in shared memory, without the opt-in */

template <class P, class T, bool CENTER, bool VEC>
static void launch_add_norm(cudaStream_t st, gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd,
                            const gl_tensor *x, const gl_tensor *r, const gl_tensor *w, const gl_tensor *b,
                            double eps) {
  int64_t C = x->shape[x->ndim - 1], rows = row_count(x);
  CuIdx<6> ix = row_idx<6>(x, {s, y, x, r, mean, rstd});
  /* sized to the row: one 16-byte vector (or 8 elements) per thread and pass */
  int threads = row_threads_sized(C);
  GL_LAUNCH(cu_row_grid(rows), threads, (size_t)C * sizeof(T), st, add_norm_forward_kernel<P, T, CENTER, VEC>)(
      P::from(s), P::from(y), P::from(x), P::from(r), P::from(w), P::from(b), AnyPtr::from(mean),
      AnyPtr::from(rstd), ix, rows, C, last_stride(s), last_stride(y), last_stride(x), last_stride(r),
      last_stride(w), last_stride(b), (T)eps);
}

extern "C" int cuda_add_norm_forward(gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                                     const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps,
                                     int center) {
  int64_t C = x->shape[x->ndim - 1];
  int wide = x->dtype == GL_F64;
  if (row_count(x) == 0) return GL_OK;
  if (C * (wide ? 8 : 4) > ADD_NORM_MAX_SHARED)  /* a row too wide for shared memory: the unfused ops */
    return gl_add_norm_unfused(s, y, mean, rstd, x, r, weight, bias, eps, center);
  cudaStream_t st;
  GL_TRY(cu_begin(y->device, &st));
  bool vec = x->dtype == GL_BF16 && C % 8 == 0 && rows_vec16(s) && rows_vec16(y) && rows_vec16(x) && rows_vec16(r);
  return cu_dispatch({s, y, x, r, weight, bias}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if constexpr (std::is_same<P, TPtr<bf16>>::value) {
      if (vec) {
        if (center) launch_add_norm<P, T, true, true>(st, s, y, mean, rstd, x, r, weight, bias, eps);
        else launch_add_norm<P, T, false, true>(st, s, y, mean, rstd, x, r, weight, bias, eps);
        GL_CU_LAUNCHED();
        return GL_OK;
      }
    }
    if (center) launch_add_norm<P, T, true, false>(st, s, y, mean, rstd, x, r, weight, bias, eps);
    else launch_add_norm<P, T, false, false>(st, s, y, mean, rstd, x, r, weight, bias, eps);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_norm_backward_add(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                                      const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean,
                                      const gl_tensor *rstd, const gl_tensor *dres, int center) {
  return norm_backward(dx, dweight, dbias, dy, x, weight, mean, rstd, center != 0, dres);
}
