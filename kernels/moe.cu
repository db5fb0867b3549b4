/* moe.cu — the mixture-of-experts ops on a GPU (the twin of
 * engine/cpu/moe.c): the routing plan, the permutation of token rows into
 * expert order and the weighted combine back (with its weight gradient),
 * and the grouped products over every expert's rows.
 *
 * Nothing here waits for the device or reads a count on the host, so a
 * step with MoE layers is captured and replayed as one CUDA graph: the
 * expert-ordered buffer has an upper bound of rows (N K, or E capacity),
 * the per-expert counts stay in device memory, and each kernel of the
 * grouped products finds its expert's rows from them.  Value checks are
 * the deferred id checks (cu_check_ids: expert ids in [0, E), slots in
 * [-1, rows), counts in [0, rows]), reported at the next host wait with
 * the CPU's wording; every kernel stays in bounds whatever the values (a
 * bad id or slot is skipped, counts are clamped to the buffer).  The CPU
 * also refuses a row named by two slots; here such slots (never made by
 * moe_route) race in the permutation's inverse map, in bounds.
 *
 * Every result is deterministic, with no atomics: each output element is
 * written by one thread that sums its terms in a fixed order.
 *  - route: two kernels of one block per expert.  The first counts the
 *    expert's assignments (a block sum), the second walks the assignments
 *    in token order with a block-wide prefix sum of "is mine", giving each
 *    its rank among the expert's, hence its slot (-1 past the capacity).
 *    Each block reads all N K ids: E N K reads, a few microseconds at the
 *    sizes MoE layers have (E <= 256, N K <= a million).
 *  - permute: the inverse map (row -> assignment, -1 for none) first, then
 *    one thread per output element gathers its row (zero when unnamed).
 *  - combine: one thread per output element, its K terms in order;
 *    combine_wgrad: one warp per assignment, a dot product of C terms.
 *  - grouped products: in bfloat16, where the operands suit it (rows
 *    16-byte aligned, widths multiples of 8), gemm_mma.cu's tensor-core
 *    GEMM in its grouped forms (128 x 128 tiles, cuda_gemm_mma_grouped and
 *    _wgrad); otherwise 16 x 16 output tiles on the CUDA cores.  Either way a tile
 *    belongs to one expert, found by walking the counts (tiles of expert 0,
 *    then 1, ...) over a grid sized by the bound ceil(M / tile) + experts
 *    (+ 1), so no count is needed on the host; the experts' matrices travel
 *    by value in the launch's parameters (GM_GROUP experts a launch, so a
 *    captured graph holds its own copy and no device table must outlive
 *    it).  A last launch zeroes the rows past the last expert's (the twin's
 *    rule).  The weight gradient has one block per tile of each expert's
 *    matrix, walking that expert's rows in order. */
#include "common.cuh"

/* Calls f(S{}) with the storage type of a float dtype. */
template <class F> static int moe_float_type(int dtype, F &&f) {
  switch (dtype) {
    case GL_F32: return f(float());
    case GL_BF16: return f(bf16());
    case GL_F16: return f(__half());
    case GL_F64: return f(double());
  }
  return gl_error("moe: dtype %d is not a float dtype", dtype);
}
/* the compute type of a storage type: double for float64, float otherwise */
template <class S> struct MoeAcc { typedef float T; };
template <> struct MoeAcc<double> { typedef double T; };

/* ---- routing plan ----------------------------------------------------------- */
enum { ROUTE_THREADS = 256 };

/* block e: load[e] = the assignments routed to e, counts[e] = those kept */
__global__ void __launch_bounds__(ROUTE_THREADS)
moe_count_kernel(int64_t *counts, int64_t cs, int64_t *load, int64_t ls, IdxPtr experts, CuIdx<1> ix, int64_t nk,
                 int64_t capacity) {
  int64_t e = blockIdx.x, c = 0;
  for (int64_t i = threadIdx.x; i < nk; i += blockDim.x) c += experts.get(ix.offset(i, 0)) == e;
  c = cu_block_reduce(c, CuSum(), (int64_t)0);
  if (threadIdx.x == 0) {
    load[e * ls] = c;
    counts[e * cs] = capacity > 0 && c > capacity ? capacity : c;
  }
}

/* exclusive prefix sum of v over the block (blockDim.x a multiple of 32);
   *total receives the block's sum */
__device__ __forceinline__ int64_t moe_block_scan(int64_t v, int64_t *total) {
  GL_SHARED(int64_t, warp_sums, [32]);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int64_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int64_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  __syncthreads();  /* the previous call's readers are done */
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  int64_t before = 0, all = 0;
  for (int w = 0; w < nwarps; w++) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  *total = all;
  return before + x - v;
}

/* block e: the slots of e's assignments in token order (off_e + rank, -1
   past the capacity); block 0 also writes -1 for an id outside [0, E) */
__global__ void __launch_bounds__(ROUTE_THREADS)
moe_slots_kernel(int64_t *slots, IdxPtr experts, CuIdx<2> ix, const int64_t *counts, int64_t cs, int64_t nk,
                 int64_t E, int64_t capacity) {
  int64_t e = blockIdx.x, off = 0, total = 0;
  for (int64_t f = threadIdx.x; f < e; f += blockDim.x) off += counts[f * cs];
  off = cu_block_reduce(off, CuSum(), (int64_t)0);
  for (int64_t base = 0; base < nk; base += blockDim.x) {
    int64_t i = base + threadIdx.x, o[2] = {0, 0}, id = -1;
    if (i < nk) {
      ix.offsets(i, o);
      id = experts.get(o[0]);
    }
    int64_t mine = id == e, chunk = 0;
    int64_t rank = total + moe_block_scan(mine, &chunk);
    total += chunk;
    if (mine) slots[o[1]] = capacity > 0 && rank >= capacity ? -1 : off + rank;
    if (i < nk && e == 0 && (id < 0 || id >= E)) slots[o[1]] = -1;
  }
}

extern "C" int cuda_moe_route(gl_tensor *slots, gl_tensor *counts, gl_tensor *load, const gl_tensor *experts,
                              int64_t capacity) {
  int64_t E = counts->shape[0], nk = experts->numel;
  cudaStream_t st;
  GL_TRY(cu_begin(counts->device, &st));
  GL_TRY(cu_check_ids("gl_moe_route", "experts", experts, E, "experts: the size of counts", 0, 0, st, NULL));
  GL_LAUNCH((unsigned)E, ROUTE_THREADS, 0, st, moe_count_kernel)(
      (int64_t *)cu_ptr(counts), counts->stride[0], (int64_t *)cu_ptr(load), load->stride[0], IdxPtr::from(experts),
      cu_idx_of<1>({experts}), nk, capacity);
  GL_CU_LAUNCHED();
  if (nk == 0) return GL_OK;
  GL_LAUNCH((unsigned)E, ROUTE_THREADS, 0, st, moe_slots_kernel)(
      (int64_t *)cu_ptr(slots), IdxPtr::from(experts), cu_idx_of<2>({experts, slots}), (const int64_t *)cu_ptr(counts),
      counts->stride[0], nk, E, capacity);
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* ---- permutation and combine ---------------------------------------------------- */
/* slots' range, checked at the next host wait: -1 (dropped) or a row */
static int check_slots(const char *fn, const gl_tensor *slots, int64_t rows, cudaStream_t st) {
  return cu_check_ids(fn, "slots", slots, rows, "rows of the expert-ordered buffer; -1: dropped", 1, -1, st, NULL);
}

/* weights (N, K) of any float dtype, or none (1) */
struct MoeWeights {
  AnyPtr w;
  int64_t s0, s1;
  static MoeWeights from(const gl_tensor *t) {
    return MoeWeights{AnyPtr::from(t), t ? t->stride[0] : 0, t ? t->stride[1] : 0};
  }
  template <class T> __device__ __forceinline__ T at(int64_t n, int64_t k) const {
    return w.null() ? (T)1 : w.get<T>(n * s0 + k * s1);
  }
};

__global__ void moe_inverse_kernel(int64_t *inv, int64_t M, IdxPtr slots, int64_t K, int64_t ss0, int64_t ss1,
                                   int64_t nk) {
  CU_GRID_LOOP(m, M) inv[m] = -1;
  __syncthreads();
  /* one block: the fill above and the marks below in this order */
  for (int64_t i = threadIdx.x; i < nk; i += blockDim.x) {
    int64_t n = i / K, k = i - n * K, s = slots.get(n * ss0 + k * ss1);
    if (s >= 0 && s < M) inv[s] = i;
  }
}

template <class S>
__global__ void moe_permute_kernel(S *out, int64_t os0, int64_t os1, const S *x, int64_t xs0, int64_t xs1,
                                   const int64_t *inv, MoeWeights w, int64_t M, int64_t C, int64_t K) {
  typedef typename MoeAcc<S>::T T;
  CU_GRID_LOOP(i, M * C) {
    int64_t m = i / C, c = i - m * C, j = inv[m];
    T v = 0;
    if (j >= 0) {
      int64_t n = j / K, k = j - n * K;
      v = w.at<T>(n, k) * CuStore<S>::template load<T>(x[n * xs0 + c * xs1]);
    }
    out[m * os0 + c * os1] = CuStore<S>::template store<T>(v);
  }
}

extern "C" int cuda_moe_permute(gl_tensor *out, const gl_tensor *x, const gl_tensor *slots, const gl_tensor *weights) {
  int64_t M = out->shape[0], C = out->shape[1], N = slots->shape[0], K = slots->shape[1];
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GL_TRY(check_slots("gl_moe_permute", slots, M, st));
  CuTemp inv;
  GL_TRY(inv.make(GL_I64, out->device, M));
  GL_LAUNCH(1, 1024, 0, st, moe_inverse_kernel)(inv.ptr<int64_t>(), M, IdxPtr::from(slots), K, slots->stride[0],
                                                 slots->stride[1], N * K);
  GL_CU_LAUNCHED();
  return moe_float_type(out->dtype, [&](auto s) -> int {
    using S = decltype(s);
    GL_LAUNCH(cu_blocks(out->device, M * C, 256), 256, 0, st, moe_permute_kernel<S>)(
        (S *)cu_ptr(out), out->stride[0], out->stride[1], (const S *)cu_ptr(x), x->stride[0], x->stride[1],
        inv.ptr<int64_t>(), MoeWeights::from(weights), M, C, K);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

template <class S>
__global__ void moe_combine_kernel(S *out, int64_t os0, int64_t os1, const S *y, int64_t ys0, int64_t ys1,
                                   IdxPtr slots, int64_t ss0, int64_t ss1, MoeWeights w, int64_t M, int64_t N,
                                   int64_t C, int64_t K) {
  typedef typename MoeAcc<S>::T T;
  CU_GRID_LOOP(i, N * C) {
    int64_t n = i / C, c = i - n * C;
    T acc = 0;
    for (int64_t k = 0; k < K; k++) {
      int64_t s = slots.get(n * ss0 + k * ss1);
      if (s >= 0 && s < M) acc += w.at<T>(n, k) * CuStore<S>::template load<T>(y[s * ys0 + c * ys1]);
    }
    out[n * os0 + c * os1] = CuStore<S>::template store<T>(acc);
  }
}

extern "C" int cuda_moe_combine(gl_tensor *out, const gl_tensor *y, const gl_tensor *slots, const gl_tensor *weights) {
  int64_t M = y->shape[0], C = out->shape[1], N = slots->shape[0], K = slots->shape[1];
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GL_TRY(check_slots("gl_moe_combine", slots, M, st));
  return moe_float_type(out->dtype, [&](auto s) -> int {
    using S = decltype(s);
    GL_LAUNCH(cu_blocks(out->device, N * C, 256), 256, 0, st, moe_combine_kernel<S>)(
        (S *)cu_ptr(out), out->stride[0], out->stride[1], (const S *)cu_ptr(y), y->stride[0], y->stride[1],
        IdxPtr::from(slots), slots->stride[0], slots->stride[1], MoeWeights::from(weights), M, N, C, K);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* one warp per assignment (n, k): dw = dout[n] . y[slot], 0 when dropped */
enum { WGRAD_THREADS = 256 };
template <class S>
__global__ void __launch_bounds__(WGRAD_THREADS)
moe_combine_wgrad_kernel(AnyPtr dw, int64_t ws0, int64_t ws1, const S *dout, int64_t ds0, int64_t ds1, const S *y,
                         int64_t ys0, int64_t ys1, IdxPtr slots, int64_t ss0, int64_t ss1, int64_t M, int64_t N,
                         int64_t C, int64_t K) {
  typedef typename MoeAcc<S>::T T;
  int lane = threadIdx.x & 31;
  int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t j = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); j < N * K; j += warps) {
    int64_t n = j / K, k = j - n * K, s = slots.get(n * ss0 + k * ss1);
    T acc = 0;
    if (s >= 0 && s < M)
      for (int64_t c = lane; c < C; c += 32)
        acc += CuStore<S>::template load<T>(dout[n * ds0 + c * ds1]) * CuStore<S>::template load<T>(y[s * ys0 + c * ys1]);
    acc = cu_warp_reduce(acc, CuSum());
    if (lane == 0) dw.set<T>(n * ws0 + k * ws1, acc);
  }
}

extern "C" int cuda_moe_combine_wgrad(gl_tensor *dweights, const gl_tensor *dout, const gl_tensor *y,
                                      const gl_tensor *slots) {
  int64_t M = y->shape[0], C = y->shape[1], N = slots->shape[0], K = slots->shape[1];
  cudaStream_t st;
  GL_TRY(cu_begin(dweights->device, &st));
  GL_TRY(check_slots("gl_moe_combine_wgrad", slots, M, st));
  return moe_float_type(y->dtype, [&](auto s) -> int {
    using S = decltype(s);
    GL_LAUNCH(cu_blocks(y->device, N * K * 32, WGRAD_THREADS), WGRAD_THREADS, 0, st, moe_combine_wgrad_kernel<S>)(
        AnyPtr::from(dweights), dweights->stride[0], dweights->stride[1], (const S *)cu_ptr(dout), dout->stride[0],
        dout->stride[1], (const S *)cu_ptr(y), y->stride[0], y->stride[1], IdxPtr::from(slots), slots->stride[0],
        slots->stride[1], M, N, C, K);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* ---- grouped products -------------------------------------------------------------- */
/* gemm_mma.cu: the bf16 grouped product on the tensor cores, or 1 when it
   cannot take the operands */
extern "C" int cuda_gemm_mma_grouped(gl_tensor *out, const gl_tensor *a, int e0, int ng, const gl_tensor **bs,
                                     const gl_tensor *counts, cudaStream_t st);
extern "C" int cuda_gemm_mma_grouped_wgrad(int e0, int ng, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y,
                                           const gl_tensor *counts, cudaStream_t st);

enum { GM_TILE = 16, GM_GROUP = 32 };
/* the matrices of experts [e0, e0 + n) of one launch, by value */
struct GmMats {
  const char *p[GM_GROUP];
  int64_t s0[GM_GROUP], s1[GM_GROUP];
};
/* the table of experts [e0, e0 + ng) of ms (unused entries zero) */
static GmMats gm_mats(const gl_tensor *const *ms, int e0, int ng) {
  GmMats m;
  memset(&m, 0, sizeof m);
  for (int g = 0; g < ng; g++) {
    m.p[g] = cu_ptr(ms[e0 + g]);
    m.s0[g] = ms[e0 + g]->stride[0];
    m.s1[g] = ms[e0 + g]->stride[1];
  }
  return m;
}

/* expert e's row count, clamped so the experts' rows stay in [0, M) */
__device__ __forceinline__ int64_t gm_rows(IdxPtr counts, int64_t cs, int64_t e, int64_t off, int64_t M) {
  int64_t c = counts.get(e * cs);
  if (c < 0) c = 0;
  return c < M - off ? c : M - off;
}

/* out's rows of expert e = a's rows of e @ b_e; the last launch (tail) also
   zeroes rows past the last expert's.  Block x: the x-th tile of the walk
   over experts [e0, e0 + ng) (then the tail), block y: 16 columns. */
template <class S>
__global__ void __launch_bounds__(GM_TILE * GM_TILE)
grouped_matmul_kernel(S *out, int64_t os0, int64_t os1, const S *a, int64_t as0, int64_t as1, GmMats b,
                      IdxPtr counts, int64_t cs, int e0, int ng, int tail, int64_t M, int64_t K, int64_t Nout) {
  typedef typename MoeAcc<S>::T T;
  GL_SHARED(T, at, [GM_TILE][GM_TILE + 1]);
  GL_SHARED(T, bt, [GM_TILE][GM_TILE + 1]);
  GL_SHARED(int64_t, pick, [3]);  /* local expert (-1: tail, -2: none), first row, end row */
  int tx = threadIdx.x % GM_TILE, ty = threadIdx.x / GM_TILE;
  if (threadIdx.x == 0) {
    int64_t off = 0, slot = blockIdx.x;
    for (int64_t e = 0; e < e0; e++) off += gm_rows(counts, cs, e, off, M);
    pick[0] = -2;
    for (int g = 0; g < ng && pick[0] == -2; g++) {
      int64_t c = gm_rows(counts, cs, e0 + g, off, M), tiles = (c + GM_TILE - 1) / GM_TILE;
      if (slot < tiles) { pick[0] = g; pick[1] = off + slot * GM_TILE; pick[2] = off + c; }
      slot -= tiles;
      off += c;
    }
    if (pick[0] == -2 && tail && slot < (M - off + GM_TILE - 1) / GM_TILE) {
      pick[0] = -1; pick[1] = off + slot * GM_TILE; pick[2] = M;
    }
  }
  __syncthreads();
  int64_t g = pick[0];
  if (g == -2) return;  /* past the last tile (the grid is a bound) */
  int64_t r0 = pick[1], rend = pick[2];
  int64_t row = r0 + ty, col = (int64_t)blockIdx.y * GM_TILE + tx;
  T acc = 0;
  if (g >= 0) {
    const S *bp = (const S *)b.p[g];
    int64_t bs0 = b.s0[g], bs1 = b.s1[g];
    for (int64_t k0 = 0; k0 < K; k0 += GM_TILE) {
      at[ty][tx] = row < rend && k0 + tx < K ? CuStore<S>::template load<T>(a[row * as0 + (k0 + tx) * as1]) : (T)0;
      bt[ty][tx] = k0 + ty < K && col < Nout ? CuStore<S>::template load<T>(bp[(k0 + ty) * bs0 + col * bs1]) : (T)0;
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < GM_TILE; kk++) acc += at[ty][kk] * bt[kk][tx];
      __syncthreads();
    }
  }
  if (row < rend && col < Nout) out[row * os0 + col * os1] = CuStore<S>::template store<T>(acc);
}

extern "C" int cuda_grouped_matmul(gl_tensor *out, const gl_tensor *a, int n, const gl_tensor **bs,
                                   const gl_tensor *counts) {
  int64_t M = out->shape[0], Nout = out->shape[1], K = a->shape[1];
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GL_TRY(cu_check_ids("gl_grouped_matmul", "counts", counts, M + 1, "rows of the buffer, at most", 0, 0, st, NULL));
  return moe_float_type(out->dtype, [&](auto s) -> int {
    using S = decltype(s);
    /* GM_GROUP experts a launch; the last launch (e0 = n, ng 0) zeroes the
       rows past the last expert's */
    for (int e0 = 0, ng = 0; e0 <= n; e0 += ng > 0 ? ng : 1) {
      ng = n - e0 < GM_GROUP ? n - e0 : GM_GROUP;
      int tail = ng == 0;
      if (ng > 0 && out->dtype == GL_BF16) {  /* the tensor cores where they take the operands */
        int rc = cuda_gemm_mma_grouped(out, a, e0, ng, bs, counts, st);
        if (rc != 1) {
          GL_TRY(rc);
          continue;
        }
      }
      GmMats m = gm_mats(bs, e0, ng);
      dim3 grid((unsigned)((M + GM_TILE - 1) / GM_TILE + ng + 1), (unsigned)((Nout + GM_TILE - 1) / GM_TILE));
      GL_LAUNCH(grid, GM_TILE * GM_TILE, 0, st, grouped_matmul_kernel<S>)(
          (S *)cu_ptr(out), out->stride[0], out->stride[1], (const S *)cu_ptr(a), a->stride[0], a->stride[1], m,
          IdxPtr::from(counts), counts->stride[0], e0, ng, tail, M, K, Nout);
      GL_CU_LAUNCHED();
    }
    return GL_OK;
  });
}

/* dbs[e] (K, Nout) = x_e^T y_e: block (x, y, z) the 16 x 16 tile (y, x) of
   expert e0 + z's matrix, summing that expert's rows in order */
template <class S>
__global__ void __launch_bounds__(GM_TILE * GM_TILE)
grouped_matmul_wgrad_kernel(GmMats dbs, const S *x, int64_t xs0, int64_t xs1, const S *y, int64_t ys0, int64_t ys1,
                            IdxPtr counts, int64_t cs, int e0, int64_t M, int64_t K, int64_t Nout) {
  typedef typename MoeAcc<S>::T T;
  GL_SHARED(T, xt, [GM_TILE][GM_TILE + 1]);
  GL_SHARED(T, yt, [GM_TILE][GM_TILE + 1]);
  GL_SHARED(int64_t, span, [2]);
  int tx = threadIdx.x % GM_TILE, ty = threadIdx.x / GM_TILE;
  int g = blockIdx.z;
  if (threadIdx.x == 0) {
    int64_t off = 0;
    for (int64_t e = 0; e < e0 + g; e++) off += gm_rows(counts, cs, e, off, M);
    span[0] = off;
    span[1] = off + gm_rows(counts, cs, e0 + g, off, M);
  }
  __syncthreads();
  int64_t r0 = span[0], rend = span[1];
  int64_t kr = (int64_t)blockIdx.y * GM_TILE + ty, col = (int64_t)blockIdx.x * GM_TILE + tx;
  int64_t kload = (int64_t)blockIdx.y * GM_TILE + tx;  /* the x column this thread loads */
  T acc = 0;
  for (int64_t base = r0; base < rend; base += GM_TILE) {
    int64_t r = base + ty;
    xt[ty][tx] = r < rend && kload < K ? CuStore<S>::template load<T>(x[r * xs0 + kload * xs1]) : (T)0;
    yt[ty][tx] = r < rend && col < Nout ? CuStore<S>::template load<T>(y[r * ys0 + col * ys1]) : (T)0;
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < GM_TILE; rr++) acc += xt[rr][ty] * yt[rr][tx];
    __syncthreads();
  }
  if (kr < K && col < Nout) ((S *)dbs.p[g])[kr * dbs.s0[g] + col * dbs.s1[g]] = CuStore<S>::template store<T>(acc);
}

extern "C" int cuda_grouped_matmul_wgrad(int n, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y,
                                         const gl_tensor *counts) {
  int64_t M = x->shape[0], K = x->shape[1], Nout = y->shape[1];
  if (K == 0 || Nout == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(x->device, &st));
  GL_TRY(cu_check_ids("gl_grouped_matmul_wgrad", "counts", counts, M + 1, "rows of the buffer, at most", 0, 0, st,
                      NULL));
  return moe_float_type(x->dtype, [&](auto s) -> int {
    using S = decltype(s);
    for (int e0 = 0; e0 < n; e0 += GM_GROUP) {
      int ng = n - e0 < GM_GROUP ? n - e0 : GM_GROUP;
      if (x->dtype == GL_BF16) {  /* the tensor cores where they take the operands */
        int rc = cuda_gemm_mma_grouped_wgrad(e0, ng, dbs, x, y, counts, st);
        if (rc != 1) {
          GL_TRY(rc);
          continue;
        }
      }
      GmMats m = gm_mats(dbs, e0, ng);
      dim3 grid((unsigned)((Nout + GM_TILE - 1) / GM_TILE), (unsigned)((K + GM_TILE - 1) / GM_TILE), (unsigned)ng);
      GL_LAUNCH(grid, GM_TILE * GM_TILE, 0, st, grouped_matmul_wgrad_kernel<S>)(
          m, (const S *)cu_ptr(x), x->stride[0], x->stride[1], (const S *)cu_ptr(y), y->stride[0], y->stride[1],
          IdxPtr::from(counts), counts->stride[0], e0, M, K, Nout);
      GL_CU_LAUNCHED();
    }
    return GL_OK;
  });
}
