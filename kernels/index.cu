/* index.cu — CUDA kernels for the id-driven ops: embedding (forward and
 * backward), index_select, gather, scatter_add, index_add, and the id range
 * check they (and cross-entropy) run first.
 *
 * Twin of engine/cpu/index.c.  Ids are checked on the device with nothing
 * waiting (cu_check_ids: the CPU's message, reported at the next host wait);
 * a bad id is skipped or gives NaN, never an access out of bounds.  Gathers are
 * byte copies, one thread per output element (the embedding forward's
 * aligned rows: one per 16-byte vector).  The accumulating ops are
 * deterministic, with no float atomics:
 *  - scatter_add / index_add: one thread per output line (a position over
 *    the dims other than `dim`), walking the line's sources in order, as
 *    the CPU does;
 *  - embedding backward: the ids sorted with their positions once (a stable
 *    radix sort), then each block sums its rows' dout rows in position
 *    order; every table row is written exactly once (below). */
#include "common.cuh"
#include <limits.h>
#include <string.h>

/* ---- id range check --------------------------------------------------------- */
/* One block: the first bad position is a block minimum (no atomics, so the
   reported position and id are deterministic), and thread 0 writes the slot.
   The ids of one step are B*T values; one block reads them in microseconds. */
enum { CHECK_THREADS = 1024 };
__global__ void __launch_bounds__(CHECK_THREADS)
check_ids_kernel(IdxPtr ids, CuIdx<1> ix, int64_t n, int64_t limit, int has_ignore, int64_t ignore,
                 long long *slot, int32_t *packed) {
  int64_t first = n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int64_t v = ids.get(ix.offset(i, 0));
    bool ok = (v >= 0 && v < limit) || (has_ignore && v == ignore);
    if (!ok && first == n) first = i;
    if (packed) packed[i] = ok ? (int32_t)v : -1;
  }
  first = cu_block_reduce(first, CuMin(), n);
  if (threadIdx.x == 0) {
    slot[0] = first < n ? (long long)first : -1LL;
    slot[1] = first < n ? (long long)ids.get(ix.offset(first, 0)) : 0LL;
  }
}

int cu_check_ids(const char *fn, const char *arg, const gl_tensor *ids, int64_t limit, const char *what,
                 int has_ignore, int64_t ignore, cudaStream_t st, int32_t *packed) {
  int64_t n = ids->numel;
  if (n == 0) return GL_OK;
  if (packed && limit > INT_MAX)
    return gl_error("%s: %lld %s exceed the int32 range of the CUDA kernel", fn, (long long)limit, what);
  CuIdCheck meta = {fn, arg, what, limit, ignore, has_ignore};
  long long *slot = nullptr;
  GL_TRY(cu_check_slot(ids->device, &meta, &slot));
  CuIdx<1> ix = cu_idx_of<1>({ids});
  int threads = n >= CHECK_THREADS ? CHECK_THREADS : (int)((n + 31) / 32 * 32);
  GL_LAUNCH(1, threads, 0, st, check_ids_kernel)(IdxPtr::from(ids), ix, n, limit, has_ignore, ignore, slot, packed);
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* the bits a bad id's output gets: the dtype's canonical quiet NaN (the
   canonical one: LuaJIT reads some other NaN patterns as tagged values),
   0 for integers */
static uint64_t nan_bits(int dtype) {
  switch (dtype) {
    case GL_F32: return 0x7fc00000u;
    case GL_F64: return 0x7ff8000000000000ull;
    case GL_BF16: return 0x7fc0u;
    case GL_F16: return 0x7e00u;
  }
  return 0;
}

/* ---- embedding ------------------------------------------------------------------ */
/* ix walks ids' shape: ids' strides and out's leading strides */
template <class U>
__global__ void embedding_forward_kernel(U *out, const U *table, IdxPtr ids, CuIdx<2> ix, int64_t n, int64_t V,
                                         int64_t C, int64_t ocs, int64_t ts0, int64_t tcs, U bad) {
  CU_GRID_LOOP(i, n * C) {
    int64_t r = i / C, c = i - r * C, off[2];
    ix.offsets(r, off);
    int64_t id = ids.get(off[0]);  /* a bad id (reported by the check) gives NaN */
    out[off[1] + c * ocs] = id >= 0 && id < V ? table[id * ts0 + c * tcs] : bad;
  }
}

/* The 16-byte copy (issue 13): each row of C elements moves as nv 16-byte
   vectors when the table's and out's rows are contiguous, start 16-byte
   aligned and fill whole vectors (embedding_rows_vec16); other layouts take
   the element kernel above.  ix's out offsets are in elements of esize
   bytes; a bad id's row gets bad (the NaN bits) in every lane. */
__global__ void embedding_forward_vec16_kernel(char *out, const char *table, IdxPtr ids, CuIdx<2> ix, int64_t n,
                                               int64_t V, int64_t nv, int64_t ts0, int esize, uint4 bad) {
  CU_GRID_LOOP(i, n * nv) {
    int64_t r = i / nv, v = i - r * nv, off[2];
    ix.offsets(r, off);
    int64_t id = ids.get(off[0]);
    uint4 *o = (uint4 *)(out + off[1] * esize) + v;
    *o = id >= 0 && id < V ? ((const uint4 *)(table + id * ts0 * esize))[v] : bad;
  }
}

/* whether every row of table (V, C) and out (ids' shape, C) is a contiguous,
   16-byte aligned run of whole vectors */
static bool embedding_rows_vec16(const gl_tensor *out, const gl_tensor *table, const gl_tensor *ids) {
  int64_t es = gl_dtype_size(table->dtype), C = table->shape[1];
  if ((C * es) % 16 || table->stride[1] != 1 || out->stride[ids->ndim] != 1) return false;
  if (((uintptr_t)cu_ptr(table) & 15) || ((uintptr_t)cu_ptr(out) & 15)) return false;
  if (table->shape[0] > 1 && (table->stride[0] * es) % 16) return false;
  for (int d = 0; d < ids->ndim; d++)
    if (out->shape[d] > 1 && (out->stride[d] * es) % 16) return false;
  return true;
}

extern "C" int cuda_embedding_forward(gl_tensor *out, const gl_tensor *table, const gl_tensor *ids) {
  int64_t n = ids->numel, C = table->shape[1];
  if (n == 0 || C == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GL_TRY(cu_check_ids("gl_embedding_forward", "ids", ids, table->shape[0], "rows of table", 0, 0, st, NULL));
  const int64_t *strides[2] = {ids->stride, out->stride};
  CuIdx<2> ix = cu_idx<2>(ids->ndim, ids->shape, strides);
  int64_t ocs = out->stride[ids->ndim];
  if (embedding_rows_vec16(out, table, ids)) {
    int esize = gl_dtype_size(table->dtype);
    int64_t nv = C * esize / 16;
    uint64_t nan = nan_bits(table->dtype);
    uint4 bad;
    for (int k = 0; k < 16; k += esize) memcpy((char *)&bad + k, &nan, (size_t)esize);  /* little-endian */
    GL_LAUNCH(cu_blocks(out->device, n * nv, 256), 256, 0, st, embedding_forward_vec16_kernel)(
        cu_ptr(out), cu_ptr(table), IdxPtr::from(ids), ix, n, table->shape[0], nv, table->stride[0], esize, bad);
    GL_CU_LAUNCHED();
    return GL_OK;
  }
  return cu_with_bits(table->dtype, [&](auto u) -> int {
    using U = decltype(u);
    GL_LAUNCH(cu_blocks(out->device, n * C, 256), 256, 0, st, embedding_forward_kernel<U>)(
        (U *)cu_ptr(out), (const U *)cu_ptr(table), IdxPtr::from(ids), ix, n, table->shape[0], C, ocs, table->stride[0],
        table->stride[1], (U)nan_bits(table->dtype));
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* ---- embedding backward: the ids sorted once, then one pass per row -------------
   dtable[v] = the sum of dout's rows at the positions i with ids[i] == v, in
   position order (the CPU twin's order: engine/cpu/index.c counting-sorts too).
   1. The ids (packed int32 by the check, a bad id -1) are sorted with their
      positions by a stable LSD radix sort, 8 bits a pass (two passes for
      V <= 65536, one for V <= 256).  A pass: each block counts the digits of
      its tile of EMB_TILE positions (emb_digit_count: hist[digit][tile]);
      one block scans hist in that order (emb_digit_scan: each (digit, tile)
      gets its first slot); each block writes its tile's (id, position)
      pairs to their slots (emb_digit_scatter), in order within the tile
      (round, warp, lane), ranked among the warp's same-digit lanes by eight
      ballots.  A bad id sorts as row 0 with position -1 and is skipped.
   2. emb_rows_kernel: a block of (EMB_ROWS rows, a column chunk) finds its
      rows' run of the sorted ids by binary search and sums each row's dout
      rows in order, one column per thread; every table row is written once
      (0 for an id absent from the batch).
   The kernel this replaced had every (32-row bucket, column chunk) block scan
   all n ids: n * V/32 * C/256 id reads (2.7 GB of L2 traffic per step at
   nanochat d20: n = 65536, V = 65536, C = 1280).  Now the ids and positions
   move about 6n int32s per pass plus one read per column chunk in step 2;
   dout is read once and dtable written once either way.  Deterministic: no
   float atomics (the digit counts are integer shared-memory atomics). */
enum { EMB_ROWS = 32, EMB_THREADS = 256, EMB_SORT_THREADS = 256, EMB_TILE = 4 * EMB_SORT_THREADS };

/* a packed id's sort key: a bad id (-1) sorts with row 0 */
__device__ __forceinline__ int32_t emb_key(int32_t id) { return id < 0 ? 0 : id; }

/* grid (tiles); hist (256, tiles): hist[d * tiles + tile] = the tile's count of digit d */
__global__ void __launch_bounds__(EMB_SORT_THREADS)
emb_digit_count(const int32_t *keys, int64_t n, int shift, int *hist) {
  GL_SHARED(int, count, [256]);
  int tid = threadIdx.x;
  count[tid] = 0;
  __syncthreads();
  int64_t first = (int64_t)blockIdx.x * EMB_TILE;
  for (int r = 0; r < EMB_TILE / EMB_SORT_THREADS; r++) {
    int64_t i = first + r * EMB_SORT_THREADS + tid;
    if (i < n) atomicAdd(&count[(emb_key(keys[i]) >> shift) & 255], 1);
  }
  __syncthreads();
  hist[(int64_t)tid * gridDim.x + blockIdx.x] = count[tid];
}

/* one block (1024 threads): hist (len) becomes its exclusive prefix sums;
   each thread scans a contiguous chunk */
__global__ void __launch_bounds__(1024) emb_digit_scan(int *hist, int64_t len) {
  GL_SHARED(int, warp_sum, [32]);
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  int64_t per = (len + blockDim.x - 1) / blockDim.x, lo = tid * per, hi = lo + per < len ? lo + per : len;
  int sum = 0;
  for (int64_t i = lo; i < hi; i++) sum += hist[i];
  int incl = sum;  /* inclusive scan of the chunks' sums over the warp, then over the warps */
  for (int o = 1; o < 32; o <<= 1) {
    int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  int w = lane < nwarps ? warp_sum[lane] : 0;  /* every warp scans the warps' sums */
  for (int o = 1; o < 32; o <<= 1) {
    int v = __shfl_up_sync(0xffffffffu, w, o);
    if (lane >= o) w += v;
  }
  int before = __shfl_sync(0xffffffffu, w, warp > 0 ? warp - 1 : 0);
  int run = (warp > 0 ? before : 0) + incl - sum;
  for (int64_t i = lo; i < hi; i++) {
    int v = hist[i];
    hist[i] = run;
    run += v;
  }
}

/* grid (tiles): the tile's (key, position) pairs to their sorted slots.
   pos_in NULL: the first pass, positions are the indices (a bad id's -1) */
__global__ void __launch_bounds__(EMB_SORT_THREADS)
emb_digit_scatter(const int32_t *keys_in, const int32_t *pos_in, int32_t *keys_out, int32_t *pos_out, int64_t n,
                  int shift, const int *hist) {
  enum { WARPS = EMB_SORT_THREADS / 32 };
  GL_SHARED(int, slot, [256]);              /* the next free slot of each digit */
  GL_SHARED(int, warp_count, [WARPS][256]); /* this round's count of each digit per warp */
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  slot[tid] = hist[(int64_t)tid * gridDim.x + blockIdx.x];
  int64_t first = (int64_t)blockIdx.x * EMB_TILE;
  for (int r = 0; r < EMB_TILE / EMB_SORT_THREADS; r++) {
    for (int w = 0; w < WARPS; w++) warp_count[w][tid] = 0;
    __syncthreads();
    int64_t i = first + r * EMB_SORT_THREADS + tid;
    bool valid = i < n;
    int32_t key = 0, pos = 0;
    if (valid) {
      int32_t raw = keys_in[i];
      key = emb_key(raw);
      pos = pos_in ? pos_in[i] : (raw < 0 ? -1 : (int32_t)i);
    }
    int d = (key >> shift) & 255;
    unsigned peers = __ballot_sync(0xffffffffu, valid);  /* the lanes with this lane's digit */
    for (int b = 0; b < 8; b++) {
      unsigned set = __ballot_sync(0xffffffffu, (d >> b) & 1);
      peers &= ((d >> b) & 1) ? set : ~set;
    }
    int rank = __popc(peers & ((1u << lane) - 1u));
    /* (peers is 0 exactly for an invalid lane.  The two sides of the barrier
       test different conditions: g++ would otherwise thread the jump and
       duplicate the __syncthreads call, which the simulator, telling
       barriers apart by call site, reports as divergence.) */
    if (peers != 0 && rank == 0) warp_count[warp][d] = __popc(peers);
    __syncthreads();
    int at = slot[d] + rank;
    for (int w = 0; w < warp; w++) at += warp_count[w][d];
    if (valid) {
      keys_out[at] = key;
      pos_out[at] = pos;
    }
    __syncthreads();
    int total = 0;  /* thread tid advances digit tid's slot past this round */
    for (int w = 0; w < WARPS; w++) total += warp_count[w][tid];
    slot[tid] += total;
    __syncthreads();  /* before the next round clears the counts */
  }
}

/* grid (ceil(V / EMB_ROWS), ceil(C / blockDim.x)); keys sorted, pos[k] the
   position of keys[k] (-1: a bad id, skipped); drow maps a position to its
   dout row offset */
template <class P, class T>
__global__ void __launch_bounds__(EMB_THREADS)
emb_rows_kernel(P dtable, P dout, const int32_t *keys, const int32_t *pos, int64_t n, CuIdx<1> drow, int64_t V,
                int64_t C, int64_t ts0, int64_t tcs, int64_t dcs) {
  int64_t lo = (int64_t)blockIdx.x * EMB_ROWS, hi = lo + EMB_ROWS < V ? lo + EMB_ROWS : V;
  int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  int64_t k = 0, end = n;  /* the first k with keys[k] >= lo */
  while (k < end) {
    int64_t mid = k + (end - k) / 2;
    if (keys[mid] < lo) k = mid + 1;
    else end = mid;
  }
  for (int64_t v = lo; v < hi; v++) {
    T acc = 0;
    for (; k < n && keys[k] == v; k++) {
      int32_t p = pos[k];
      if (p >= 0) acc += dout.template get<T>(drow.offset(p, 0) + c * dcs);
    }
    dtable.set(v * ts0 + c * tcs, acc);
  }
}

extern "C" int cuda_embedding_backward(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids) {
  int64_t V = dtable->shape[0], C = dtable->shape[1], n = ids->numel;
  if (V == 0 || C == 0) return GL_OK;
  if (n > INT_MAX)
    return gl_error("gl_embedding_backward: %lld ids exceed the int32 positions of the CUDA kernel", (long long)n);
  int threads = C >= EMB_THREADS ? EMB_THREADS : (int)((C + 31) / 32 * 32);
  int64_t gy = (C + threads - 1) / threads, gx = (V + EMB_ROWS - 1) / EMB_ROWS;
  if (gy > 65535 || gx > 0x7fffffffLL)
    return gl_error("cuda_embedding_backward: table of %lld x %lld exceeds the grid limits", (long long)V,
                    (long long)C);
  int dev = dtable->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  int64_t tiles = (n + EMB_TILE - 1) / EMB_TILE;
  CuTemp packed, sorted, hist;  /* sorted: keys and positions, two of each (passes alternate) */
  GL_TRY(packed.make(GL_I32, dev, n));
  GL_TRY(sorted.make(GL_I32, dev, 4 * n));
  GL_TRY(hist.make(GL_I32, dev, 256 * tiles));
  GL_TRY(cu_check_ids("gl_embedding_backward", "ids", ids, V, "rows of dtable", 0, 0, st, packed.ptr<int32_t>()));
  int32_t *keys = packed.ptr<int32_t>(), *pos = NULL;
  if (n > 0) {
    int bits = 1;
    while (bits < 31 && ((V - 1) >> bits) > 0) bits++;
    for (int shift = 0, pass = 0; shift < bits; shift += 8, pass++) {
      int32_t *keys_out = sorted.ptr<int32_t>() + (pass & 1) * 2 * n, *pos_out = keys_out + n;
      GL_LAUNCH((unsigned)tiles, EMB_SORT_THREADS, 0, st, emb_digit_count)(keys, n, shift, hist.ptr<int>());
      GL_CU_LAUNCHED();
      GL_LAUNCH(1, 1024, 0, st, emb_digit_scan)(hist.ptr<int>(), 256 * tiles);
      GL_CU_LAUNCHED();
      GL_LAUNCH((unsigned)tiles, EMB_SORT_THREADS, 0, st, emb_digit_scatter)(keys, pos, keys_out, pos_out, n, shift,
                                                                             hist.ptr<int>());
      GL_CU_LAUNCHED();
      keys = keys_out;
      pos = pos_out;
    }
  }
  const int64_t *strides[1] = {dout->stride};
  CuIdx<1> drow = cu_idx<1>(ids->ndim, ids->shape, strides);
  int64_t dcs = dout->stride[ids->ndim];
  dim3 grid((unsigned)gx, (unsigned)gy);
  return cu_dispatch({dtable, dout}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(grid, threads, 0, st, emb_rows_kernel<P, T>)(P::from(dtable), P::from(dout), keys, pos, n, drow, V, C,
                                                           dtable->stride[0], dtable->stride[1], dcs);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* ---- gather / index_select / scatter_add / index_add -------------------------- */
/* A walk over `shape` with three stride sets; `dim` is the indexed dim. */
struct IndexGeo {
  int nd, dim;
  int64_t limit;                 /* size of `other` in dim: ids are in [0, limit) */
  int64_t shape[GL_MAX_DIMS];
  int64_t s_walk[GL_MAX_DIMS];   /* the tensor whose shape is walked */
  int64_t s_idx[GL_MAX_DIMS];    /* idx (0 strides off dim for a 1-d idx) */
  int64_t s_other[GL_MAX_DIMS];  /* the tensor addressed through the ids */
};

static IndexGeo index_geo(const gl_tensor *walk, const gl_tensor *idx, int idx_is_1d, const gl_tensor *other,
                          int dim) {
  IndexGeo g;
  memset(&g, 0, sizeof g);
  g.nd = walk->ndim;
  g.dim = dim;
  g.limit = other->shape[dim];
  for (int d = 0; d < walk->ndim; d++) {
    g.shape[d] = walk->shape[d];
    g.s_walk[d] = walk->stride[d];
    g.s_idx[d] = idx_is_1d ? (d == dim ? idx->stride[0] : 0) : idx->stride[d];
    g.s_other[d] = other->stride[d];
  }
  return g;
}

/* out[p] = x[p with coordinate dim replaced by idx[p]] (walk = out) */
template <class U>
__global__ void gather_kernel(U *out, const U *x, IdxPtr idx, IndexGeo g, int64_t n, U bad) {
  CU_GRID_LOOP(i, n) {
    int64_t r = i, oo = 0, io = 0, xo = 0;
    for (int d = g.nd - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      oo += c * g.s_walk[d];
      io += c * g.s_idx[d];
      if (d != g.dim) xo += c * g.s_other[d];
    }
    int64_t k = idx.get(io);  /* a bad id (reported by the check) gives NaN (0 for integers) */
    out[oo] = k >= 0 && k < g.limit ? x[xo + k * g.s_other[g.dim]] : bad;
  }
}

static int gather_common(const char *fn, gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx,
                         int idx_is_1d) {
  if (dim < 0) dim += x->ndim;
  int64_t n = out->numel;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GL_TRY(cu_check_ids(fn, "idx", idx, x->shape[dim], "size of x in dim", 0, 0, st, NULL));
  IndexGeo g = index_geo(out, idx, idx_is_1d, x, dim);
  return cu_with_bits(x->dtype, [&](auto u) -> int {
    using U = decltype(u);
    GL_LAUNCH(cu_blocks(out->device, n, 256), 256, 0, st, gather_kernel<U>)((U *)cu_ptr(out), (const U *)cu_ptr(x),
                                                                     IdxPtr::from(idx), g, n, (U)nan_bits(x->dtype));
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_index_select(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  return gather_common("gl_index_select", out, x, dim, idx, 1);
}
extern "C" int cuda_gather(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  return gather_common("gl_gather", out, x, dim, idx, 0);
}

/* out[line p, idx[p, j]] += src[p, j] for j in order (walk = src) */
template <class P, class T>
__global__ void scatter_lines_kernel(P out, P src, IdxPtr idx, IndexGeo g, int64_t npos) {
  CU_GRID_LOOP(p, npos) {
    int64_t r = p, so = 0, io = 0, oo = 0;
    for (int d = g.nd - 1; d >= 0; d--) {
      if (d == g.dim) continue;
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      so += c * g.s_walk[d];
      io += c * g.s_idx[d];
      oo += c * g.s_other[d];
    }
    int64_t L = g.shape[g.dim];
    for (int64_t j = 0; j < L; j++) {
      int64_t k = idx.get(io + j * g.s_idx[g.dim]);
      if (k < 0 || k >= g.limit) continue;  /* a bad id is reported by the check */
      int64_t e = oo + k * g.s_other[g.dim];
      out.set(e, out.template get<T>(e) + src.template get<T>(so + j * g.s_walk[g.dim]));
    }
  }
}

static int scatter_common(const char *fn, gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src,
                          int idx_is_1d) {
  if (dim < 0) dim += out->ndim;
  int64_t L = src->shape[dim], npos = L ? src->numel / L : 0;
  if (npos == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GL_TRY(cu_check_ids(fn, "idx", idx, out->shape[dim], "size of out in dim", 0, 0, st, NULL));
  IndexGeo g = index_geo(src, idx, idx_is_1d, out, dim);
  return cu_dispatch({out, src}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(cu_blocks(out->device, npos, 128), 128, 0, st, scatter_lines_kernel<P, T>)(P::from(out), P::from(src),
                                                                                IdxPtr::from(idx), g, npos);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_scatter_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  return scatter_common("gl_scatter_add", out, dim, idx, src, 0);
}
extern "C" int cuda_index_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  return scatter_common("gl_index_add", out, dim, idx, src, 1);
}
