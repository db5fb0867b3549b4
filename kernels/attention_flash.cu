/* attention_flash.cu — the FlashAttention-2 path of kernels/attention.cu
 * (bfloat16, head dim D = 64 or 128, unit stride along D, 16-byte aligned
 * rows; sm_80+), on the tensor cores through kernels/mma_sync.cuh (mma.sync
 * m16n8k16 bf16 -> fp32, ldmatrix, cp.async).  Same semantics as the
 * fallback kernels and the CPU twin engine/cpu/attention.c: grouped-query
 * heads, the KV-cache offset, a sliding window, no mask (window < 0) and
 * segment ids (document masking).  Specs: spec/cuda_attention_spec.lua.
 *
 * Tiles of 64 query rows and 64 key rows, 4 warps per block, each warp
 * owning a 16-row stripe; shared tiles are 64 x D bf16 rows padded by 16
 * bytes; the next tile's cp.async overlaps the products on the current one
 * (two stages).  All accumulators live in registers.
 *  - forward, one block per (query tile, head, batch): the warp's Q
 *    fragments stay in registers; for each key tile S = Q K^T, masked where
 *    the tile pair is not wholly visible, an online softmax per row in the
 *    log2 domain (row max and sum over the 4 lanes of a quad with shuffles;
 *    m, l kept per row), O = O alpha + P V with P taken straight from the S
 *    registers as the A operand.  out = O / l, lse = (m + log2 l) ln 2.
 *    Key tiles wholly above the diagonal or below the window are skipped.
 *  - backward, Di = rowsum(dout * out) first (attn_di_kernel in
 *    attention.cu), then one block per (key tile, kv head, batch), warp w
 *    owning 16 key rows: it walks the (query head of the group, query tile
 *    that sees its keys) pairs and accumulates in registers
 *      P^T = exp(K Q^T scale - lse), dP^T = V dO^T, dS^T = P^T (dP^T - Di),
 *      dV += P^T dO, dK += dS^T Q (scaled once at the end);
 *    dS goes through shared memory, and warp w adds rows 16w.. of dQ = dS K
 *    to an fp32 (B, H, T, D) buffer with atomics, converted to bf16 (times
 *    scale) by flash_dq_convert_kernel.  Nothing is recomputed for dQ; the
 *    price is that the order of the fp32 additions into dQ (one per key
 *    tile) varies from run to run on a GPU: dQ is reproducible to about an
 *    ulp of fp32 before its rounding to bf16, not bit for bit.
 *  - segment ids (T == S, window >= 0, as the API demands): a first kernel
 *    copies them as 32-bit ids (B, T) and takes the [lowest, highest] id of
 *    every 64-position tile.  A tile pair whose ranges do not meet shares no
 *    document and is skipped (forward: the key tile; backward: the work
 *    item), so a packed row costs about the sum of its documents' squares,
 *    not the square of its length; a pair within one document takes no
 *    test; every other pair compares ids per element, the query tile's and
 *    key tile's ids read from registers and a shared stage. */
#include "common.cuh"
#include "mma_sync.cuh"
#include "row_walk.cuh"
#include "attention_flash.cuh"

/* which keys a query sees: key position s is visible from query position
   qpos when s <= qpos and (window <= 0 or s > qpos - window) */
__device__ __forceinline__ bool attn_visible(int64_t s, int64_t qpos, int64_t window) {
  return s <= qpos && (window <= 0 || s > qpos - window);
}

enum { FA_BR = 64, FA_BC = 64, FA_THREADS = 128, FA_WARPS = FA_THREADS / 32 };
static_assert(FA_BR == 16 * FA_WARPS && FA_BC == FA_BR,
              "each warp owns a 16-row stripe of a 64-row tile: query rows forward, key rows backward");
enum { FA_LDS = FA_BC + 8 };  /* row length of the backward's dS tile (bf16) */
static constexpr float FA_LOG2E = 1.4426950408889634f;

/* the lowest and highest segment id of a tile */
struct FaIds { int32_t lo, hi; };

struct FlashParams {
  const bf16 *q, *k, *v, *dout;
  bf16 *o, *dq, *dk, *dv;
  float *lse;             /* forward output (may be NULL) */
  const float *lse_in;    /* backward input */
  const float *di;        /* (B, H, T) contiguous */
  float *dq_acc;          /* backward: (B, H, T, D) contiguous fp32, zeroed */
  int64_t qs[3], ks[3], vs[3], os[3], ls[3], dos[3], dqs[3], dks[3], dvs[3];  /* (b, h, t) strides */
  int64_t H, Hkv, T, S, window, off;  /* off: position of query 0 */
  float scale;
  /* document masking (T == S, off = 0), or seg null: the ids (B, T) as
     int32, and the [lo, hi] of the ids of each 64-position tile (B, tiles) */
  const int32_t *seg;
  const FaIds *seg_tiles;
  int64_t ntiles;
};

/* tiles whose id ranges do not meet share no document */
__device__ __forceinline__ bool fa_ids_meet(FaIds a, FaIds c) { return a.lo <= c.hi && c.lo <= a.hi; }
/* one document over both tiles: no element needs the id test */
__device__ __forceinline__ bool fa_one_doc(FaIds a, FaIds c) { return a.lo == a.hi && c.lo == c.hi && a.lo == c.lo; }
__device__ __forceinline__ FaIds fa_tile_ids(const FlashParams &p, int64_t b, int64_t tile) {
  return p.seg_tiles[b * p.ntiles + tile];
}

/* A shared tile: 64 rows of D bf16, each padded by 8 elements (16 bytes) so
   the 8 row addresses of one ldmatrix matrix fall on different banks. */
template <int D> struct FaTile {
  static constexpr int LD = D + 8;
  static constexpr int ELEMS = 64 * LD;
};
template <int D> static constexpr size_t fa_fwd_smem() {  /* Q, K x 2, V x 2, the key ids x 2 */
  return (size_t)5 * FaTile<D>::ELEMS * 2 + (size_t)2 * FA_BC * 4;
}
/* K, V, Q x 2, dO x 2, dS, lse / Di / the query ids x 2 */
template <int D> static constexpr size_t fa_bwd_smem() {
  return (size_t)6 * FaTile<D>::ELEMS * 2 + (size_t)FA_BR * FA_LDS * 2 + (size_t)6 * FA_BR * 4;
}

/* rows [row0, row0 + 64) of D bf16 (row stride rs) into a shared tile with
   cp.async (this thread's share; the caller commits the group); rows at or
   past nvalid are zero-filled, so padded rows feed zeros, never garbage,
   into the products */
template <int D>
__device__ __forceinline__ void fa_load_tile(bf16 *dst, const bf16 *src, int64_t rs, int64_t row0, int64_t nvalid) {
  constexpr int CH = D / 8;  /* 16-byte chunks per row */
  for (int i = threadIdx.x; i < 64 * CH; i += FA_THREADS) {
    const int r = i / CH, c = i % CH;
    const bool ok = row0 + r < nvalid;
    cp_async_16(dst + r * FaTile<D>::LD + c * 8, ok ? src + (row0 + r) * rs + c * 8 : src, ok);
  }
}

/* the segment ids of rows [row0, row0 + 64) of row b into dst (plain
   stores: the barrier that follows publishes them); past T: -1, never read
   unmasked */
__device__ __forceinline__ void fa_load_ids(int32_t *dst, const FlashParams &p, int64_t b, int64_t row0) {
  for (int r = threadIdx.x; r < 64; r += FA_THREADS) dst[r] = row0 + r < p.T ? p.seg[b * p.T + row0 + r] : -1;
}

/* first key tile a query tile [qt0, qt0 + FA_BR) can see, and one past the
   last key it sees: causal block skipping, and the window's lower edge */
__device__ __forceinline__ void fa_key_range(const FlashParams &p, int64_t qt0, int64_t *kv_begin, int64_t *kv_end) {
  int64_t off = p.off, last_t = (qt0 + FA_BR < p.T ? qt0 + FA_BR : p.T) - 1;
  *kv_end = off + last_t + 1 < p.S ? off + last_t + 1 : p.S;
  int64_t lo = 0;
  if (p.window > 0) { lo = off + qt0 - p.window + 1; if (lo < 0) lo = 0; }
  *kv_begin = lo / FA_BC * FA_BC;
}

/* every (query, key) of the tile pair exists and is visible: no masking */
__device__ __forceinline__ bool fa_tile_full(const FlashParams &p, int64_t qt0, int64_t kv0) {
  const int64_t q_lo = p.off + qt0, q_hi = q_lo + FA_BR - 1;
  return qt0 + FA_BR <= p.T && kv0 + FA_BC <= p.S && kv0 + FA_BC - 1 <= q_lo &&
         (p.window <= 0 || q_hi - p.window < kv0);
}

/* the query row of accumulator slot i of lane (g, tq) in a warp's 16-row
   stripe: g or g + 8; its column within an 8-wide n-tile: 2 tq or 2 tq + 1 */
#define FA_ROW(g, i) ((g) + 8 * ((i) >> 1))
#define FA_COL(tq, i) (2 * (tq) + ((i) & 1))

/* accumulator tiles 2j, 2j + 1 (16 x 16, fp32) -> an A fragment (bf16) */
__device__ __forceinline__ void fa_acc_to_a(uint32_t *a, const float *c0, const float *c1) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

/* Forward, one block per (query tile, head, batch), warp w owning query rows
   16w..16w+15 of the tile.  Its Q fragments stay in registers; K / V tiles
   stream through two shared stages (cp.async of tile j + 1 overlaps the
   products on tile j); S, P and the O accumulator live in registers; the
   online softmax keeps m and l per row in the log2 domain.  SEG: segment
   ids given (the id tests compiled in only then). */
template <int D, bool SEG>
__global__ void __launch_bounds__(FA_THREADS) flash_fwd_kernel(FlashParams p) {
  constexpr int LD = FaTile<D>::LD, E = FaTile<D>::ELEMS, KD = D / 16, ND = D / 8, NS = FA_BC / 8;
  GL_DYNAMIC_SHARED(unsigned char, smem, 128);
  bf16 *Qs = (bf16 *)smem, *Ks = Qs + E, *Vs = Ks + 2 * E;  /* K, V: two stages each */
  int32_t *kid_s = (int32_t *)(Vs + 2 * E);                 /* the key tiles' segment ids, two stages */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int64_t qt0 = (int64_t)blockIdx.x * FA_BR, h = blockIdx.y, b = blockIdx.z, hk = h / (p.H / p.Hkv);
  const int64_t off = p.off;
  const bf16 *q = p.q + b * p.qs[0] + h * p.qs[1];
  const bf16 *k = p.k + b * p.ks[0] + hk * p.ks[1];
  const bf16 *v = p.v + b * p.vs[0] + hk * p.vs[1];
  int64_t kv_begin, kv_end;
  fa_key_range(p, qt0, &kv_begin, &kv_end);
  const int ntiles = (int)((kv_end - kv_begin + FA_BC - 1) / FA_BC);
  /* document masking: the query tile's id range, and its rows' ids (rows g, g + 8 of the stripe) */
  FaIds qids = {0, 0};
  int32_t qid[2] = {0, 0};
  if (SEG) {
    qids = fa_tile_ids(p, b, qt0 / FA_BR);
    for (int r = 0; r < 2; r++) {
      const int64_t t = qt0 + warp * 16 + g + 8 * r;
      qid[r] = t < p.T ? p.seg[b * p.T + t] : -1;
    }
  }
  /* the first key tile from j on that shares a document with the query tile */
  auto next_tile = [&](int j) {
    if (SEG)
      while (j < ntiles && !fa_ids_meet(qids, fa_tile_ids(p, b, kv_begin / FA_BC + j))) j++;
    return j;
  };
  auto load_kv = [&](int j, int st) {
    const int64_t kv0 = kv_begin + (int64_t)j * FA_BC;
    fa_load_tile<D>(Ks + st * E, k, p.ks[2], kv0, p.S);
    fa_load_tile<D>(Vs + st * E, v, p.vs[2], kv0, p.S);
    if (SEG) fa_load_ids(kid_s + st * FA_BC, p, b, kv0);
  };

  fa_load_tile<D>(Qs, q, p.qs[2], qt0, p.T);
  cp_async_commit();
  int j = next_tile(0);
  load_kv(j, 0);
  cp_async_commit();
  cp_async_wait<1>();  /* Q landed (K / V tile 0 may still be in flight) */
  __syncthreads();
  uint32_t qf[KD][4];
#pragma unroll
  for (int kk = 0; kk < KD; kk++)
    ldmatrix_x4(qf[kk], Qs + (warp * 16 + ldm_rows_a_row(lane)) * LD + kk * 16 + ldm_rows_a_col(lane));

  const float sl = p.scale * FA_LOG2E;
  float o[ND][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
  for (int dt = 0; dt < ND; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  for (int it = 0; j < ntiles; it++) {
    const int64_t kv0 = kv_begin + (int64_t)j * FA_BC;
    const int st = it & 1, jn = next_tile(j + 1);
    const bf16 *Kc = Ks + st * E, *Vc = Vs + st * E;
    const int32_t *kid = kid_s + st * FA_BC;
    if (jn < ntiles) {  /* the next tile into the other stage, freed by the last barrier */
      load_kv(jn, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    /* S = Q K^T (16 x FA_BC per warp) */
    float s[NS][4];
#pragma unroll
    for (int nt = 0; nt < NS; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
#pragma unroll
      for (int np = 0; np < NS / 2; np++) {
        uint32_t kf[4];
        ldmatrix_x4(kf, Kc + (np * 16 + ldm_rows_bt_row(lane)) * LD + kk * 16 + ldm_rows_bt_col(lane));
        mma_bf16_16816(s[2 * np], qf[kk], kf, s[2 * np]);
        mma_bf16_16816(s[2 * np + 1], qf[kk], kf + 2, s[2 * np + 1]);
      }
    /* online softmax: scaled scores (log2 domain), masked where needed */
    const bool full = fa_tile_full(p, qt0, kv0) && (!SEG || fa_one_doc(qids, fa_tile_ids(p, b, kv0 / FA_BC)));
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NS; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        float x = s[nt][i] * sl;
        if (!full) {
          const int64_t t = qt0 + warp * 16 + FA_ROW(g, i), kpos = kv0 + nt * 8 + FA_COL(tq, i);
          if (!(t < p.T && kpos < p.S && attn_visible(kpos, off + t, p.window)) ||
              (SEG && qid[i >> 1] != kid[nt * 8 + FA_COL(tq, i)]))
            x = -INFINITY;
        }
        s[nt][i] = x;
        mt[i >> 1] = fmaxf(mt[i >> 1], x);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {  /* the row's max over its quad (lanes 4g..4g+3) */
      mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
      mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
      const float mn = fmaxf(m[r], mt[r]);
      alpha[r] = mn == -INFINITY ? 1.f : exp2f(m[r] - mn);
      m[r] = mn;
      l[r] *= alpha[r];  /* l stays a per-lane partial sum until the end */
    }
#pragma unroll
    for (int nt = 0; nt < NS; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const float pv = m[i >> 1] == -INFINITY ? 0.f : exp2f(s[nt][i] - m[i >> 1]);
        s[nt][i] = pv;
        l[i >> 1] += pv;
      }
#pragma unroll
    for (int dt = 0; dt < ND; dt++)
#pragma unroll
      for (int i = 0; i < 4; i++) o[dt][i] *= alpha[i >> 1];
    /* O += P V, P straight from the S registers */
#pragma unroll
    for (int kk = 0; kk < NS / 2; kk++) {
      uint32_t pa[4];
      fa_acc_to_a(pa, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; dp++) {
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, Vc + (kk * 16 + ldm_rows_a_row(lane)) * LD + dp * 16 + ldm_rows_a_col(lane));
        mma_bf16_16816(o[2 * dp], pa, vf, o[2 * dp]);
        mma_bf16_16816(o[2 * dp + 1], pa, vf + 2, o[2 * dp + 1]);
      }
    }
    __syncthreads();  /* every warp is done with this stage before the copies after next land in it */
    j = jn;
  }
  bf16 *out = p.o + b * p.os[0] + h * p.os[1];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int64_t t = qt0 + warp * 16 + g + 8 * r;
    if (t >= p.T) continue;
    const float inv = 1.f / l[r];
#pragma unroll
    for (int dt = 0; dt < ND; dt++)
      *(uint32_t *)(out + t * p.os[2] + dt * 8 + 2 * tq) = pack_bf16x2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (tq == 0 && p.lse) p.lse[b * p.ls[0] + h * p.ls[1] + t * p.ls[2]] = (m[r] + log2f(l[r])) / FA_LOG2E;
  }
}

/* Backward, FA2: one block per (key tile, kv head, batch), warp w owning key
   rows 16w..16w+15.  It walks every (query head of the group, query tile
   that sees the keys) with Q / dO / lse / Di through two shared stages and,
   from the transposed scores, accumulates in registers
     P^T = exp(K Q^T scale - lse),  dP^T = V dO^T,  dS^T = P^T (dP^T - Di),
     dV += P^T dO,  dK += dS^T Q  (scaled once at the end);
   dS goes through shared memory so that warp w can add rows 16w.. of
   dQ = dS K into the fp32 buffer p.dq_acc with atomics: nothing is
   recomputed for dQ.  SEG: segment ids given. */
template <int D, bool SEG>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_kernel(FlashParams p) {
  constexpr int LD = FaTile<D>::LD, E = FaTile<D>::ELEMS, KD = D / 16, ND = D / 8, NQ = FA_BR / 8;
  GL_DYNAMIC_SHARED(unsigned char, smem, 128);
  bf16 *Ks = (bf16 *)smem, *Vs = Ks + E, *Qs = Vs + E, *dOs = Qs + 2 * E, *dSs = dOs + 2 * E;
  float *lse_s = (float *)(dSs + FA_BR * FA_LDS), *di_s = lse_s + 2 * FA_BR;  /* two stages each */
  int32_t *qid_s = (int32_t *)(di_s + 2 * FA_BR);                              /* the query ids, two stages */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3, kr = warp * 16;
  const int64_t kv0 = (int64_t)blockIdx.x * FA_BC, hk = blockIdx.y, b = blockIdx.z;
  const int64_t group = p.H / p.Hkv, off = p.off;
  /* the query tiles that see a key of [kv0, kv0 + FA_BC): qpos >= kv0 and,
     with a window, qpos < kv0 + FA_BC - 1 + window */
  int64_t t_lo = kv0 - off < 0 ? 0 : kv0 - off;
  t_lo = t_lo / FA_BR * FA_BR;
  int64_t t_hi = p.T;
  if (p.window > 0 && kv0 + FA_BC - 1 + p.window - off < t_hi) t_hi = kv0 + FA_BC - 1 + p.window - off;
  const int64_t nqt = t_hi > t_lo ? (t_hi - t_lo + FA_BR - 1) / FA_BR : 0, items = group * nqt;
  /* document masking: the key tile's id range, and its rows' ids (rows g, g + 8 of the stripe) */
  FaIds kids = {0, 0};
  int32_t kid[2] = {0, 0};
  if (SEG) {
    kids = fa_tile_ids(p, b, kv0 / FA_BC);
    for (int r = 0; r < 2; r++) {
      const int64_t s = kv0 + kr + g + 8 * r;
      kid[r] = s < p.S ? p.seg[b * p.T + s] : -1;
    }
  }
  /* the first work item from j on whose query tile shares a document with the key tile */
  auto next_item = [&](int64_t j) {
    if (SEG)
      while (j < items && !fa_ids_meet(kids, fa_tile_ids(p, b, t_lo / FA_BR + j % nqt))) j++;
    return j;
  };

  /* work item j (head hk * group + j / nqt, query tile j % nqt) into stage st */
  auto load_item = [&](int64_t j, int st) {
    const int64_t h = hk * group + j / nqt, qt0 = t_lo + j % nqt * FA_BR;
    fa_load_tile<D>(Qs + st * E, p.q + b * p.qs[0] + h * p.qs[1], p.qs[2], qt0, p.T);
    fa_load_tile<D>(dOs + st * E, p.dout + b * p.dos[0] + h * p.dos[1], p.dos[2], qt0, p.T);
    for (int r = threadIdx.x; r < FA_BR; r += FA_THREADS) {  /* padded rows: P = 0 */
      const int64_t t = qt0 + r;
      const bool ok = t < p.T;
      lse_s[st * FA_BR + r] = ok ? p.lse_in[b * p.ls[0] + h * p.ls[1] + t * p.ls[2]] * FA_LOG2E : INFINITY;
      di_s[st * FA_BR + r] = ok ? p.di[(b * p.H + h) * p.T + t] : 0.f;
    }
    if (SEG) fa_load_ids(qid_s + st * FA_BR, p, b, qt0);
  };
  fa_load_tile<D>(Ks, p.k + b * p.ks[0] + hk * p.ks[1], p.ks[2], kv0, p.S);
  fa_load_tile<D>(Vs, p.v + b * p.vs[0] + hk * p.vs[1], p.vs[2], kv0, p.S);
  int64_t j = next_item(0);
  if (j < items) load_item(j, 0);
  cp_async_commit();

  const float sl = p.scale * FA_LOG2E;
  float dk[ND][4], dv[ND][4];
#pragma unroll
  for (int dt = 0; dt < ND; dt++)
#pragma unroll
    for (int i = 0; i < 4; i++) dk[dt][i] = dv[dt][i] = 0.f;
  for (int64_t it = 0; j < items; it++) {
    const int st = (int)(it & 1);
    const int64_t h = hk * group + j / nqt, qt0 = t_lo + j % nqt * FA_BR, jn = next_item(j + 1);
    const int32_t *qid = qid_s + st * FA_BR;
    if (jn < items) {
      load_item(jn, st ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16 *Qc = Qs + st * E, *dOc = dOs + st * E;
    const float *lse_c = lse_s + st * FA_BR, *di_c = di_s + st * FA_BR;
    /* S^T = K Q^T and dP^T = V dO^T, 16 keys x FA_BR queries per warp */
    float sT[NQ][4], dpT[NQ][4];
#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) sT[nt][i] = dpT[nt][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KD; kk++) {
      uint32_t ka[4], va[4];
      ldmatrix_x4(ka, Ks + (kr + ldm_rows_a_row(lane)) * LD + kk * 16 + ldm_rows_a_col(lane));
      ldmatrix_x4(va, Vs + (kr + ldm_rows_a_row(lane)) * LD + kk * 16 + ldm_rows_a_col(lane));
#pragma unroll
      for (int np = 0; np < NQ / 2; np++) {
        uint32_t qb[4], ob[4];
        ldmatrix_x4(qb, Qc + (np * 16 + ldm_rows_bt_row(lane)) * LD + kk * 16 + ldm_rows_bt_col(lane));
        ldmatrix_x4(ob, dOc + (np * 16 + ldm_rows_bt_row(lane)) * LD + kk * 16 + ldm_rows_bt_col(lane));
        mma_bf16_16816(sT[2 * np], ka, qb, sT[2 * np]);
        mma_bf16_16816(sT[2 * np + 1], ka, qb + 2, sT[2 * np + 1]);
        mma_bf16_16816(dpT[2 * np], va, ob, dpT[2 * np]);
        mma_bf16_16816(dpT[2 * np + 1], va, ob + 2, dpT[2 * np + 1]);
      }
    }
    /* P^T and dS^T in place; dS (query-major) to shared memory for dQ */
    const bool full = fa_tile_full(p, qt0, kv0) && (!SEG || fa_one_doc(kids, fa_tile_ids(p, b, qt0 / FA_BR)));
#pragma unroll
    for (int nt = 0; nt < NQ; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int kl = kr + FA_ROW(g, i), ql = nt * 8 + FA_COL(tq, i);
        float pv = exp2f(sT[nt][i] * sl - lse_c[ql]);
        if (!full) {
          const int64_t t = qt0 + ql, kpos = kv0 + kl;
          if (!(t < p.T && kpos < p.S && attn_visible(kpos, off + t, p.window)) || (SEG && qid[ql] != kid[i >> 1]))
            pv = 0.f;
        }
        const float ds = pv * (dpT[nt][i] - di_c[ql]);
        sT[nt][i] = pv;
        dpT[nt][i] = ds;
        dSs[ql * FA_LDS + kl] = __float2bfloat16(ds);
      }
    /* dV += P^T dO, dK += dS^T Q over this tile's queries */
#pragma unroll
    for (int kq = 0; kq < NQ / 2; kq++) {
      uint32_t pa[4], da[4];
      fa_acc_to_a(pa, sT[2 * kq], sT[2 * kq + 1]);
      fa_acc_to_a(da, dpT[2 * kq], dpT[2 * kq + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; dp++) {
        uint32_t ob[4], qb[4];
        ldmatrix_x4_trans(ob, dOc + (kq * 16 + ldm_rows_a_row(lane)) * LD + dp * 16 + ldm_rows_a_col(lane));
        ldmatrix_x4_trans(qb, Qc + (kq * 16 + ldm_rows_a_row(lane)) * LD + dp * 16 + ldm_rows_a_col(lane));
        mma_bf16_16816(dv[2 * dp], pa, ob, dv[2 * dp]);
        mma_bf16_16816(dv[2 * dp + 1], pa, ob + 2, dv[2 * dp + 1]);
        mma_bf16_16816(dk[2 * dp], da, qb, dk[2 * dp]);
        mma_bf16_16816(dk[2 * dp + 1], da, qb + 2, dk[2 * dp + 1]);
      }
    }
    __syncthreads();  /* dS is whole */
    /* dQ rows 16w.. += dS K, added to the fp32 buffer 16 columns at a time
       (the dS fragments stay, the accumulators are only 8 registers) */
    {
      uint32_t sa[FA_BC / 16][4];
#pragma unroll
      for (int ks = 0; ks < FA_BC / 16; ks++)
        ldmatrix_x4(sa[ks], dSs + (warp * 16 + ldm_rows_a_row(lane)) * FA_LDS + ks * 16 + ldm_rows_a_col(lane));
      float *acc = p.dq_acc + (b * p.H + h) * p.T * D;
      const int64_t t0 = qt0 + warp * 16 + g;
#pragma unroll
      for (int dp = 0; dp < D / 16; dp++) {
        float dq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < FA_BC / 16; ks++) {
          uint32_t kb[4];
          ldmatrix_x4_trans(kb, Ks + (ks * 16 + ldm_rows_a_row(lane)) * LD + dp * 16 + ldm_rows_a_col(lane));
          mma_bf16_16816(dq[0], sa[ks], kb, dq[0]);
          mma_bf16_16816(dq[1], sa[ks], kb + 2, dq[1]);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const int64_t t = t0 + 8 * (i >> 1);
          if (t >= p.T) continue;
          atomicAdd(acc + t * D + dp * 16 + FA_COL(tq, i), dq[0][i]);
          atomicAdd(acc + t * D + dp * 16 + 8 + FA_COL(tq, i), dq[1][i]);
        }
      }
    }
    __syncthreads();  /* dS and this stage are free for the item after next */
    j = jn;
  }
  cp_async_wait<0>();  /* no copy outlives the block (K / V when no query sees these keys) */
  bf16 *dkp = p.dk + b * p.dks[0] + hk * p.dks[1], *dvp = p.dv + b * p.dvs[0] + hk * p.dvs[1];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int64_t s = kv0 + kr + g + 8 * r;
    if (s >= p.S) continue;
#pragma unroll
    for (int dt = 0; dt < ND; dt++) {
      *(uint32_t *)(dkp + s * p.dks[2] + dt * 8 + 2 * tq) =
          pack_bf16x2(dk[dt][2 * r] * p.scale, dk[dt][2 * r + 1] * p.scale);
      *(uint32_t *)(dvp + s * p.dvs[2] + dt * 8 + 2 * tq) = pack_bf16x2(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
}

/* dq = scale * dq_acc in bf16, (B, H, T, D) in dq's strides, 8 elements per
   thread: two 16-byte loads of the dense float accumulator, one 16-byte
   store into dq's row (the fast path's dq rows are 16-byte aligned, D a
   multiple of 8: fa_tensor_ok), n a multiple of 8 */
template <int D> __global__ void flash_dq_convert_kernel(FlashParams p, int64_t n) {
  static_assert(D % 8 == 0, "8 elements of one row per thread");
  for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < n; i += (int64_t)gridDim.x * blockDim.x * 8) {
    const int64_t d = i % D, t = i / D % p.T, h = i / (D * p.T) % p.H, b = i / (D * p.T * p.H);
    CuVec16<float> a = CuVec16<float>::load(p.dq_acc + i), c = CuVec16<float>::load(p.dq_acc + i + 4);
    CuVec16<bf16> o;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      o.set(k, a.get<float>(k) * p.scale);
      o.set(k + 4, c.get<float>(k) * p.scale);
    }
    o.store(p.dq + b * p.dqs[0] + h * p.dqs[1] + t * p.dqs[2] + d);
  }
}

/* document masking's tables: the ids of row b as int32 (B, T) and the
   [lo, hi] of each 64-position tile (B, tiles); one thread per (b, tile) */
__global__ void flash_seg_tiles_kernel(AnyPtr seg, int64_t s0, int64_t s1, int64_t B, int64_t T, int64_t ntiles,
                                       int32_t *ids, FaIds *tiles) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= B * ntiles) return;
  const int64_t b = i / ntiles, t0 = i % ntiles * FA_BR, t1 = t0 + FA_BR < T ? t0 + FA_BR : T;
  FaIds r = {INT32_MAX, INT32_MIN};
  for (int64_t t = t0; t < t1; t++) {  /* compared as 32-bit integers, as the CPU kernel does */
    const int32_t id = (int32_t)seg.get<int64_t>(b * s0 + t * s1);
    ids[b * T + t] = id;
    r.lo = id < r.lo ? id : r.lo;
    r.hi = id > r.hi ? id : r.hi;
  }
  tiles[i] = r;
}

/* ---- selection and launches --------------------------------------------------- */
/* bf16 rows of unit stride, 16-byte aligned starts and row strides */
static bool fa_tensor_ok(const gl_tensor *t) {
  if (t->dtype != GL_BF16 || t->stride[3] != 1) return false;
  if (((uintptr_t)cu_ptr(t)) % 16) return false;
  for (int d = 0; d < 3; d++)
    if (t->shape[d] > 1 && t->stride[d] % 8) return false;
  return true;
}
static bool fa_usable(int dev, size_t smem64, size_t smem128, std::initializer_list<const gl_tensor *> ts,
                      const gl_tensor *q) {
  const int64_t D = q->shape[3];
  if (D != 64 && D != 128) return false;
  const size_t smem = D == 128 ? smem128 : smem64;
  if ((size_t)cu_smem_optin(dev) < smem) return false;
  if (q->shape[1] > 65535 || q->shape[0] > 65535) return false;
  for (const gl_tensor *t : ts) if (!fa_tensor_ok(t)) return false;
  return true;
}
bool flash_attention_forward_fits(int dev, const gl_tensor *out, const gl_tensor *q, const gl_tensor *k,
                                  const gl_tensor *v) {
  return fa_usable(dev, fa_fwd_smem<64>(), fa_fwd_smem<128>(), {q, k, v, out}, q);
}
bool flash_attention_backward_fits(int dev, const gl_tensor *dq, const gl_tensor *dk, const gl_tensor *dv,
                                   const gl_tensor *dout, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                   const gl_tensor *out) {
  return fa_usable(dev, fa_bwd_smem<64>(), fa_bwd_smem<128>(), {dq, dk, dv, dout, q, k, v, out}, q);
}

static void fa_strides(int64_t *dst, const gl_tensor *t) {
  for (int d = 0; d < 3; d++) dst[d] = t ? t->stride[d] : 0;
}

/* the parameters every launch shares: q, k, v, the shape, the mask; with
   segments, their tables into ids (kept alive by the caller until the
   launches are queued: CuTemp's memory is stream-ordered) */
static int fa_params(FlashParams &p, cudaStream_t st, int dev, CuTemp &ids, const gl_tensor *q, const gl_tensor *k,
                     const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window) {
  memset(&p, 0, sizeof p);
  const int64_t B = q->shape[0], T_ = q->shape[2], S = k->shape[2];
  p.q = (const bf16 *)cu_ptr(q); p.k = (const bf16 *)cu_ptr(k); p.v = (const bf16 *)cu_ptr(v);
  fa_strides(p.qs, q); fa_strides(p.ks, k); fa_strides(p.vs, v);
  p.H = q->shape[1]; p.Hkv = k->shape[1]; p.T = T_; p.S = S; p.scale = (float)scale;
  p.window = window < 0 ? 0 : window; p.off = window < 0 ? S - 1 : S - T_;
  if (!segments) return GL_OK;
  if (window < 0 || T_ != S)  /* the API refuses window < 0, attention.cu takes T < S to the fallback */
    return gl_error("flash attention: segments need window >= 0 and T == S, got window %lld, T %lld, S %lld",
                    (long long)window, (long long)T_, (long long)S);
  p.ntiles = (T_ + FA_BR - 1) / FA_BR;
  static_assert(sizeof(FaIds) == 2 * sizeof(int32_t), "a tile's ids are two int32");
  GL_TRY(ids.make(GL_I32, dev, B * T_ + 2 * B * p.ntiles));
  p.seg = ids.ptr<int32_t>();
  p.seg_tiles = (const FaIds *)(ids.ptr<int32_t>() + B * T_);
  const int64_t n = B * p.ntiles;
  GL_LAUNCH((unsigned)((n + 127) / 128), 128, 0, st, flash_seg_tiles_kernel)(
      AnyPtr::from(segments), segments->stride[0], segments->stride[1], B, T_, p.ntiles, ids.ptr<int32_t>(),
      (FaIds *)(ids.ptr<int32_t>() + B * T_));
  GL_CU_LAUNCHED();
  return GL_OK;
}

template <int D, bool SEG> static int fa_forward(cudaStream_t st, FlashParams &p, int64_t B) {
  size_t smem = fa_fwd_smem<D>();
  GL_CU_CHECK(cudaFuncSetAttribute(flash_fwd_kernel<D, SEG>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((p.T + FA_BR - 1) / FA_BR), (unsigned)p.H, (unsigned)B);
  GL_LAUNCH(grid, FA_THREADS, smem, st, flash_fwd_kernel<D, SEG>)(p);
  GL_CU_LAUNCHED();
  return GL_OK;
}
template <int D, bool SEG> static int fa_backward(cudaStream_t st, FlashParams &p, int64_t B, int dev) {
  const int64_t n = B * p.H * p.T * D;
  CuTemp acc;
  GL_TRY(acc.make(GL_F32, dev, n));
  GL_CU_CHECK(cudaMemsetAsync(acc.ptr<float>(), 0, (size_t)n * sizeof(float), st));
  p.dq_acc = acc.ptr<float>();
  size_t smem = fa_bwd_smem<D>();
  GL_CU_CHECK(cudaFuncSetAttribute(flash_bwd_kernel<D, SEG>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((p.S + FA_BC - 1) / FA_BC), (unsigned)p.Hkv, (unsigned)B);
  GL_LAUNCH(grid, FA_THREADS, smem, st, flash_bwd_kernel<D, SEG>)(p);
  GL_CU_LAUNCHED();
  const unsigned blocks = (unsigned)std::min<int64_t>((n / 8 + 255) / 256, 1 << 20);
  GL_LAUNCH(blocks, 256, 0, st, flash_dq_convert_kernel<D>)(p, n);
  GL_CU_LAUNCHED();
  return GL_OK;
}

int flash_attention_forward(cudaStream_t st, int dev, gl_tensor *out, gl_tensor *lse, const gl_tensor *q,
                            const gl_tensor *k, const gl_tensor *v, const gl_tensor *segments, double scale,
                            int64_t window) {
  FlashParams p;
  CuTemp ids;
  GL_TRY(fa_params(p, st, dev, ids, q, k, v, segments, scale, window));
  p.o = (bf16 *)cu_ptr(out); p.lse = (float *)cu_ptr(lse);
  fa_strides(p.os, out); fa_strides(p.ls, lse);
  /* the segment test in its own instances: without it the kernels keep their registers */
  const int64_t B = q->shape[0];
  if (q->shape[3] == 128) return segments ? fa_forward<128, true>(st, p, B) : fa_forward<128, false>(st, p, B);
  return segments ? fa_forward<64, true>(st, p, B) : fa_forward<64, false>(st, p, B);
}

int flash_attention_backward(cudaStream_t st, int dev, gl_tensor *dq, gl_tensor *dk, gl_tensor *dv,
                             const gl_tensor *dout, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                             const gl_tensor *lse, const gl_tensor *segments, const float *di, double scale,
                             int64_t window) {
  FlashParams p;
  CuTemp ids;
  GL_TRY(fa_params(p, st, dev, ids, q, k, v, segments, scale, window));
  p.dout = (const bf16 *)cu_ptr(dout);
  p.dq = (bf16 *)cu_ptr(dq); p.dk = (bf16 *)cu_ptr(dk); p.dv = (bf16 *)cu_ptr(dv);
  p.lse_in = (const float *)cu_ptr(lse); p.di = di;
  fa_strides(p.ls, lse); fa_strides(p.dos, dout); fa_strides(p.dqs, dq); fa_strides(p.dks, dk); fa_strides(p.dvs, dv);
  const int64_t B = q->shape[0];
  if (q->shape[3] == 128)
    return segments ? fa_backward<128, true>(st, p, B, dev) : fa_backward<128, false>(st, p, B, dev);
  return segments ? fa_backward<64, true>(st, p, B, dev) : fa_backward<64, false>(st, p, B, dev);
}
