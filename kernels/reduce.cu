/* reduce.cu — CUDA reductions: gl_reduce over a set of dims, max with
 * argmax over one dim, and the float64 sum of squares (grad norms).
 *
 * Twin of engine/cpu/reduce.c: accumulation in double when x or out is
 * float64 / a wide integer, float otherwise; NaN wins in max / min; argmax
 * returns the first maximal (or first NaN) position.
 *
 * x splits into kept dims (one output each) and reduced dims.  Two shapes of
 * work, chosen so that loads stay coalesced:
 *  - the reduced dims are the inner ones (a row sum): one block per output
 *    walks its reduction;
 *  - the kept dims are the inner ones (a column sum, e.g. a bias gradient):
 *    one thread per output, neighbouring threads reading neighbouring
 *    columns.
 * When outputs are too few to fill the GPU the reduction is cut into a fixed
 * number of splits whose partials a second kernel combines in order, so the
 * result never depends on scheduling. */
#include "common.cuh"
#include <vector>

enum { RED_THREADS = 256 };

template <class T> __device__ __forceinline__ T red_identity(int op) {
  return op == GL_R_MAX ? -cu_inf<T>() : (op == GL_R_MIN ? cu_inf<T>() : (T)0);
}
template <class T> __device__ __forceinline__ T red_combine(int op, T a, T b) {
  switch (op) {
    case GL_R_MAX: return (a != a) ? a : ((b > a || b != b) ? b : a);
    case GL_R_MIN: return (a != a) ? a : ((b < a || b != b) ? b : a);
    default: return a + b;
  }
}
template <class T> __device__ __forceinline__ T red_elem(int op, T v) {
  return (op == GL_R_SUMSQ || op == GL_R_NORM2) ? v * v : v;
}
template <class T> __device__ __forceinline__ T red_finish(int op, T acc, int64_t n) {
  switch (op) {
    case GL_R_MEAN: return acc / (T)n;
    case GL_R_NORM2: return cu_sqrt(acc);
    case GL_R_MAX: case GL_R_MIN: return n == 0 ? (T)0 : acc;
  }
  return acc;
}
template <class T> struct RedCombine {
  int op;
  __device__ __forceinline__ T operator()(T a, T b) const { return red_combine(op, a, b); }
};

/* thread per output o = blockIdx.x * blockDim.x + threadIdx.x, split blockIdx.y */
template <class P, class T>
__global__ void reduce_thread_kernel(int op, AnyPtr out, T *partial, P x, CuIdx<2> kept, CuIdx<1> red,
                                     int64_t nout, int64_t rlen, int64_t chunk) {
  int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= nout) return;
  int64_t off[2];
  kept.offsets(o, off);
  int64_t r0 = (int64_t)blockIdx.y * chunk, r1 = r0 + chunk < rlen ? r0 + chunk : rlen;
  T acc = red_identity<T>(op);
  for (int64_t r = r0; r < r1; r++) acc = red_combine(op, acc, red_elem(op, x.template get<T>(off[0] + red.offset(r, 0))));
  if (gridDim.y == 1) out.set(off[1], red_finish(op, acc, rlen));
  else partial[o * gridDim.y + blockIdx.y] = acc;
}

/* block per output o = blockIdx.x, split blockIdx.y */
template <class P, class T>
__global__ void reduce_block_kernel(int op, AnyPtr out, T *partial, P x, CuIdx<2> kept, CuIdx<1> red,
                                    int64_t rlen, int64_t chunk) {
  int64_t o = blockIdx.x;
  int64_t off[2];
  kept.offsets(o, off);
  int64_t r0 = (int64_t)blockIdx.y * chunk, r1 = r0 + chunk < rlen ? r0 + chunk : rlen;
  T acc = red_identity<T>(op);
  for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x)
    acc = red_combine(op, acc, red_elem(op, x.template get<T>(off[0] + red.offset(r, 0))));
  acc = cu_block_reduce(acc, RedCombine<T>{op}, red_identity<T>(op));
  if (threadIdx.x != 0) return;
  if (gridDim.y == 1) out.set(off[1], red_finish(op, acc, rlen));
  else partial[o * gridDim.y + blockIdx.y] = acc;
}

/* combines the splits of each output in split order */
template <class T>
__global__ void reduce_finish_kernel(int op, AnyPtr out, const T *partial, CuIdx<2> kept, int64_t nout,
                                     int64_t rlen, int splits) {
  CU_GRID_LOOP(o, nout) {
    T acc = red_identity<T>(op);
    for (int s = 0; s < splits; s++) acc = red_combine(op, acc, partial[o * splits + s]);
    out.set(kept.offset(o, 1), red_finish(op, acc, rlen));
  }
}

/* x's dims split by mask into kept (with out's strides) and reduced maps */
static void split_dims(const gl_tensor *x, const gl_tensor *out, uint32_t mask, CuIdx<2> *kept, CuIdx<1> *red,
                       int64_t *nout, int64_t *rlen) {
  int64_t ks[GL_MAX_DIMS], kx[GL_MAX_DIMS], ko[GL_MAX_DIMS], rs[GL_MAX_DIMS], rx[GL_MAX_DIMS];
  int nk = 0, nr = 0;
  *nout = 1; *rlen = 1;
  for (int d = 0; d < x->ndim; d++) {
    if ((mask >> d) & 1) { rs[nr] = x->shape[d]; rx[nr] = x->stride[d]; nr++; *rlen *= x->shape[d]; }
    else { ks[nk] = x->shape[d]; kx[nk] = x->stride[d]; ko[nk] = out->stride[d]; nk++; *nout *= x->shape[d]; }
  }
  const int64_t *kst[2] = {kx, ko};
  const int64_t *rst[1] = {rx};
  *kept = cu_idx<2>(nk, ks, kst);
  *red = cu_idx<1>(nr, rs, rst);
}

static inline int64_t iabs64(int64_t v) { return v < 0 ? -v : v; }
static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

extern "C" int cuda_reduce(int op, gl_tensor *out, const gl_tensor *x, uint32_t dims_mask) {
  if (op < 0 || op >= GL_R_COUNT) return gl_error("cuda_reduce: op expected 0..%d, got %d", GL_R_COUNT - 1, op);
  CuIdx<2> kept;
  CuIdx<1> red;
  int64_t nout, rlen;
  split_dims(x, out, dims_mask, &kept, &red, &nout, &rlen);
  if (nout == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  int dev = out->device, sm = cu_sm_count(dev) > 0 ? cu_sm_count(dev) : 80;
  /* reduced dims inner (contiguous along r) or kept dims inner (along o)? */
  int64_t red_inner = iabs64(red.stride[0][red.ndim - 1]), kept_inner = iabs64(kept.stride[0][kept.ndim - 1]);
  int by_block = rlen > 32 && (nout == 1 || red_inner < kept_inner);
  int64_t splits = 1;
  if (by_block) {
    if (nout < 2 * sm && rlen > 8192) splits = std::min(cdiv(rlen, 4096), cdiv(4 * sm, nout));
  } else if (nout < (int64_t)sm * RED_THREADS && rlen > 64) {
    splits = std::min(cdiv(rlen, 32), cdiv((int64_t)4 * sm * RED_THREADS, nout));
  }
  if (splits > 65535) splits = 65535;
  if (splits < 1) splits = 1;
  int64_t chunk = cdiv(rlen > 0 ? rlen : 1, splits);
  splits = cdiv(rlen > 0 ? rlen : 1, chunk);  /* no empty splits */

  auto run = [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    CuTemp partial;
    if (splits > 1) GL_TRY(partial.make(sizeof(T) == 8 ? GL_F64 : GL_F32, dev, nout * splits));
    T *pp = partial.ptr<T>();
    dim3 grid;
    if (by_block) {
      grid = dim3((unsigned)nout, (unsigned)splits);
      GL_LAUNCH(grid, RED_THREADS, 0, st, reduce_block_kernel<P, T>)(op, AnyPtr::from(out), pp, P::from(x), kept, red,
                                                              rlen, chunk);
    } else {
      grid = dim3((unsigned)cdiv(nout, RED_THREADS), (unsigned)splits);
      GL_LAUNCH(grid, RED_THREADS, 0, st, reduce_thread_kernel<P, T>)(op, AnyPtr::from(out), pp, P::from(x), kept, red,
                                                               nout, rlen, chunk);
    }
    GL_CU_LAUNCHED();
    if (splits > 1) {
      GL_LAUNCH(cu_blocks(dev, nout, RED_THREADS), RED_THREADS, 0, st, reduce_finish_kernel<T>)(
          op, AnyPtr::from(out), pp, kept, nout, rlen, (int)splits);
      GL_CU_LAUNCHED();
    }
    return GL_OK;
  };
  if (by_block && nout > 0x7fffffffLL)
    return gl_error("cuda_reduce: %lld outputs exceed the grid limit", (long long)nout);
  if (cu_is_wide(out->dtype) && !cu_is_wide(x->dtype)) return run(AnyPtr(), double());
  return cu_dispatch({x}, run);
}

/* ---- max with argmax over one dim ------------------------------------------ */
/* (value, index) pairs: a NaN beats a number, then the larger value, then the
   smaller index — the sequential scan's first maximal (or first NaN) element */
template <class T> __device__ __forceinline__ bool arg_better(T v, int64_t i, T m, int64_t j) {
  bool vn = v != v, mn = m != m;
  if (vn || mn) return vn && (!mn || i < j);
  return v > m || (v == m && i < j);
}

template <class P, class T>
__global__ void max_dim_kernel(AnyPtr out, int64_t *indices, P x, CuIdx<3> kept, int64_t nout, int64_t L,
                               int64_t xs, int by_block) {
  GL_SHARED(T, sv, [32]);
  GL_SHARED(int64_t, si, [32]);
  int64_t o = by_block ? (int64_t)blockIdx.x : (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= nout) return;  /* uniform per block when by_block */
  int64_t off[3];
  kept.offsets(o, off);
  T m = -cu_inf<T>();
  int64_t best = INT64_MAX;
  int64_t j0 = by_block ? threadIdx.x : 0, step = by_block ? blockDim.x : 1;
  for (int64_t j = j0; j < L; j += step) {
    T v = x.template get<T>(off[0] + j * xs);
    if (arg_better(v, j, m, best)) { m = v; best = j; }
  }
  if (by_block) {
    for (int sh = 16; sh > 0; sh >>= 1) {
      T v = __shfl_xor_sync(0xffffffffu, m, sh);
      int64_t i = __shfl_xor_sync(0xffffffffu, best, sh);
      if (arg_better(v, i, m, best)) { m = v; best = i; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = m; si[warp] = best; }
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
      if (arg_better(sv[w], si[w], m, best)) { m = sv[w]; best = si[w]; }
  }
  if (L == 0) { m = 0; best = 0; }
  out.set(off[1], m);
  indices[off[2]] = best;
}

extern "C" int cuda_reduce_max_dim(gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim) {
  if (dim < 0) dim += x->ndim;
  if (dim < 0 || dim >= x->ndim) return gl_error("cuda_reduce_max_dim: dim %d out of range for %d dims", dim, x->ndim);
  if (indices->dtype != GL_I64)
    return gl_error("cuda_reduce_max_dim: indices has dtype %s, expected int64", gl_dtype_name(indices->dtype));
  int64_t ks[GL_MAX_DIMS], kx[GL_MAX_DIMS], ko[GL_MAX_DIMS], ki[GL_MAX_DIMS];
  int nk = 0;
  int64_t nout = 1;
  for (int d = 0; d < x->ndim; d++) {
    if (d == dim) continue;
    ks[nk] = x->shape[d]; kx[nk] = x->stride[d]; ko[nk] = out->stride[d]; ki[nk] = indices->stride[d]; nk++;
    nout *= x->shape[d];
  }
  if (nout == 0) return GL_OK;
  const int64_t *kst[3] = {kx, ko, ki};
  CuIdx<3> kept = cu_idx<3>(nk, ks, kst);
  int64_t L = x->shape[dim], xs = x->stride[dim];
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  int by_block = L > 32 && (nout == 1 || iabs64(xs) < iabs64(kept.stride[0][kept.ndim - 1]));
  if (by_block && nout > 0x7fffffffLL)
    return gl_error("cuda_reduce_max_dim: %lld outputs exceed the grid limit", (long long)nout);
  unsigned grid = by_block ? (unsigned)nout : (unsigned)cdiv(nout, RED_THREADS);
  auto run = [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(grid, RED_THREADS, 0, st, max_dim_kernel<P, T>)(AnyPtr::from(out), (int64_t *)cu_ptr(indices), P::from(x),
                                                       kept, nout, L, xs, by_block);
    GL_CU_LAUNCHED();
    return GL_OK;
  };
  return cu_dispatch({x}, run);
}

/* ---- sum of squares in float64 ------------------------------------------------ */
template <class P>
__global__ void sumsq_partial_kernel(double *partial, P x, CuIdx<1> ix, int64_t n) {
  double acc = 0;
  CU_GRID_LOOP(i, n) {
    double v = x.template get<double>(ix.offset(i, 0));
    acc += v * v;
  }
  acc = cu_block_reduce(acc, CuSum(), 0.0);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
__global__ void sumsq_final_kernel(double *partial, int nparts) {
  double acc = 0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += partial[i];
  acc = cu_block_reduce(acc, CuSum(), 0.0);
  if (threadIdx.x == 0) partial[0] = acc;
}

extern "C" int cuda_sumsq(const gl_tensor *x, double *out) {
  *out = 0;
  int64_t n = x->numel;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(x->device, &st));
  CuIdx<1> ix = cu_idx_of<1>({x});
  unsigned blocks = cu_blocks(x->device, n, RED_THREADS);
  if (blocks > 1024) blocks = 1024;
  CuTemp partial;
  GL_TRY(partial.make(GL_F64, x->device, blocks));
  double *pp = partial.ptr<double>();
  int rc = cu_dispatch({x}, [&](auto p, auto) -> int {
    using P = decltype(p);
    GL_LAUNCH(blocks, RED_THREADS, 0, st, sumsq_partial_kernel<P>)(pp, P::from(x), ix, n);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
  GL_TRY(rc);
  GL_LAUNCH(1, 1024, 0, st, sumsq_final_kernel)(pp, (int)blocks);
  GL_CU_LAUNCHED();
  GL_CU_CHECK(cudaMemcpyAsync(out, pp, sizeof(double), cudaMemcpyDeviceToHost, st));
  GL_CU_CHECK(cudaStreamSynchronize(st));
  return GL_OK;
}

/* ---- sum of squares over many tensors (the global gradient norm) -------------
   One launch over a segment table (cu_table): each block squares and sums
   its chunk of one contiguous tensor into partial[block] in double, the
   final kernel adds the partials in block order (deterministic), and the
   host waits once.  Tensors of another layout or dtype take cuda_sumsq. */
struct SumsqSeg {
  const void *x;
  int64_t n, block0;
  int dtype, pad;  /* GL_F32, GL_BF16 or GL_F64 */
};

__global__ void __launch_bounds__(CU_MT_THREADS)
sumsq_multi_kernel(double *partial, const SumsqSeg *segs, int nseg) {
  const SumsqSeg &s = segs[cu_mt_segment(segs, nseg)];
  int64_t lo = ((int64_t)blockIdx.x - s.block0) * CU_MT_CHUNK;
  int64_t hi = lo + CU_MT_CHUNK < s.n ? lo + CU_MT_CHUNK : s.n;
  double acc = 0;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    double v = s.dtype == GL_F32   ? (double)((const float *)s.x)[i]
               : s.dtype == GL_BF16 ? (double)__bfloat162float(((const bf16 *)s.x)[i])
                                    : ((const double *)s.x)[i];
    acc += v * v;
  }
  acc = cu_block_reduce(acc, CuSum(), 0.0);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

/* Queues the sum of squares of xs into partial[0] (table-able tensors) and
   adds the others' into *rest with cuda_sumsq, which waits; rest NULL
   refuses them instead (the step block's sum must not wait).  *queued: 0
   when no tensor went into partial. */
static int sumsq_multi_queue(const char *fn, int n, const gl_tensor **xs, CuTemp &partial, double *rest,
                             cudaStream_t *st, int *queued) {
  *queued = 0;
  int dev = xs[0]->device;
  GL_TRY(cu_begin(dev, st));
  std::vector<SumsqSeg> segs;
  int64_t blocks = 0;
  for (int i = 0; i < n; i++) {
    const gl_tensor *x = xs[i];
    if (x->numel == 0) continue;
    if (!gl_is_contiguous(x) || (x->dtype != GL_F32 && x->dtype != GL_BF16 && x->dtype != GL_F64)) {
      if (!rest)
        return gl_error("%s: xs[%d] is a %s %s tensor, expected a contiguous float32, bfloat16 or float64 one", fn,
                        i, gl_is_contiguous(x) ? "contiguous" : "strided", gl_dtype_name(x->dtype));
      double one = 0;
      GL_TRY(cuda_sumsq(x, &one));
      *rest += one;
      continue;
    }
    SumsqSeg sg = {cu_ptr(x), x->numel, blocks, x->dtype, 0};
    blocks += (x->numel + CU_MT_CHUNK - 1) / CU_MT_CHUNK;
    segs.push_back(sg);
  }
  if (segs.empty()) return GL_OK;
  if (blocks > 0x7fffffffLL) return gl_error("%s: %lld blocks exceed the grid limit", fn, (long long)blocks);
  const void *table = nullptr;
  GL_TRY(cu_table(dev, *st, segs.data(), segs.size() * sizeof(SumsqSeg), &table));
  GL_TRY(partial.make(GL_F64, dev, blocks));
  double *pp = partial.ptr<double>();
  GL_LAUNCH((unsigned)blocks, CU_MT_THREADS, 0, *st, sumsq_multi_kernel)(pp, (const SumsqSeg *)table, (int)segs.size());
  GL_CU_LAUNCHED();
  GL_LAUNCH(1, 1024, 0, *st, sumsq_final_kernel)(pp, (int)blocks);
  GL_CU_LAUNCHED();
  *queued = 1;
  return GL_OK;
}

extern "C" int cuda_sumsq_multi(int n, const gl_tensor **xs, double *out) {
  *out = 0;
  CuTemp partial;
  cudaStream_t st;
  double rest = 0;  /* tensors the table cannot take */
  int queued = 0;
  GL_TRY(sumsq_multi_queue("cuda_sumsq_multi", n, xs, partial, &rest, &st, &queued));
  if (!queued) { *out = rest; return GL_OK; }
  double h = 0;
  GL_CU_CHECK(cudaMemcpyAsync(&h, partial.ptr<double>(), sizeof(double), cudaMemcpyDeviceToHost, st));
  GL_CU_CHECK(cudaStreamSynchronize(st));
  *out = h + rest;
  return GL_OK;
}

/* the step block's GL_STEP_SUMSQ, left on the device (no host wait) */
extern "C" int cuda_step_sumsq(gl_tensor *block, int n, const gl_tensor **xs) {
  double *dst = (double *)cu_ptr(block) + GL_STEP_SUMSQ;
  cudaStream_t st;
  if (n == 0) {
    GL_TRY(cu_begin(block->device, &st));
    GL_CU_CHECK(cudaMemsetAsync(dst, 0, sizeof(double), st));
    return GL_OK;
  }
  CuTemp partial;
  int queued = 0;
  GL_TRY(sumsq_multi_queue("gl_step_sumsq", n, xs, partial, nullptr, &st, &queued));
  if (queued) GL_CU_CHECK(cudaMemcpyAsync(dst, partial.ptr<double>(), sizeof(double), cudaMemcpyDeviceToDevice, st));
  else GL_CU_CHECK(cudaMemsetAsync(dst, 0, sizeof(double), st));
  return GL_OK;
}
