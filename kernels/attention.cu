/* attention.cu — causal scaled-dot-product attention on the GPU, forward and
 * backward: grouped-query heads, the KV-cache offset (T <= S, query t at
 * position S - T + t) and an optional sliding window, as engine/cpu_attention.c.
 *
 * Fast path (bfloat16, head dim 64 or 128, unit stride along D, 16-byte
 * aligned rows): flash-attention kernels on the tensor cores (WMMA 16x16x16
 * bf16 -> fp32).  Every block stages tiles of BR query rows / BC key rows in
 * shared memory and runs its products as a sequence of block-wide phases
 * (smem_gemm), each warp taking 16x16 output tiles; accumulators live in
 * shared memory in fp32, so no fragment layout is assumed anywhere.
 *  - forward, one block per (query tile, head, batch): S = Q K^T, an online
 *    softmax per row (running max m and sum l), O = O * alpha + P V; at the
 *    end out = O / l and lse = m + log l.  No T x S matrix is ever stored.
 *  - backward, FA2 style from lse, with Di = rowsum(dout * out):
 *      one block per (key tile, kv head, batch) loops over the query heads of
 *      its group and the query tiles that see its keys:
 *        P = exp(S scale - lse), dP = dout V^T, dS = P (dP - Di),
 *        dV += P^T dout, dK += dS^T Q (scaled at the end);
 *      one block per (query tile, head, batch) recomputes the same and adds
 *      dQ += dS K.  Both are deterministic: no atomics anywhere.
 * Fallback (any dtype, head dim or layout, float32 / float64 for exactness
 * against the CPU): one block per query row (per key row for dK / dV),
 * streaming keys (queries) in chunks of FB_THREADS. */
#include "common.cuh"
#include <mma.h>
#include <type_traits>

using namespace nvcuda;

/* which keys a query sees: key position s is visible from query position
   qpos when s <= qpos and (window <= 0 or s > qpos - window) */
__device__ __forceinline__ bool attn_visible(int64_t s, int64_t qpos, int64_t window) {
  return s <= qpos && (window <= 0 || s > qpos - window);
}

/* ---- Di = rowsum(dout * out), one warp per (b, h, t) row --------------------- */
struct Str4 { int64_t s[4]; };
static Str4 str4(const gl_tensor *t) {
  Str4 r;
  for (int d = 0; d < 4; d++) r.s[d] = t->stride[d];
  return r;
}

template <class P, class T>
__global__ void attn_di_kernel(T *di, P dout, Str4 ds, P out, Str4 os, int64_t H, int64_t T_, int64_t D,
                               int64_t rows) {
  int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (r >= rows) return;  /* whole warps leave together */
  int64_t t = r % T_, h = (r / T_) % H, b = r / (T_ * H);
  int64_t go = b * ds.s[0] + h * ds.s[1] + t * ds.s[2], oo = b * os.s[0] + h * os.s[1] + t * os.s[2];
  T acc = 0;
  for (int64_t d = lane; d < D; d += 32)
    acc += dout.template get<T>(go + d * ds.s[3]) * out.template get<T>(oo + d * os.s[3]);
  acc = cu_warp_reduce(acc, CuSum());
  if (lane == 0) di[r] = acc;
}

/* ================================ fast path ===================================== */
enum { FA_BR = 64, FA_BC = 64, FA_THREADS = 256, FA_WARPS = FA_THREADS / 32 };

struct FlashParams {
  const bf16 *q, *k, *v, *out, *dout;
  bf16 *o, *dq, *dk, *dv;
  float *lse;             /* forward output (may be NULL) */
  const float *lse_in;    /* backward input */
  const float *di;        /* (B, H, T) contiguous */
  int64_t qs[3], ks[3], vs[3], os[3], ls[3], dos[3], dqs[3], dks[3], dvs[3];  /* (b, h, t) strides */
  int64_t H, Hkv, T, S, window;
  float scale;
};

/* shared-memory leading dims (elements): padded so consecutive rows start
   on different banks; all keep WMMA's 32-byte pointer alignment */
template <int D> struct FaLd {
  static constexpr int Q = D + 8;        /* bf16 tiles of D columns */
  static constexpr int S = FA_BC + 4;    /* fp32 score tiles */
  static constexpr int P = FA_BC + 8;    /* bf16 probability tiles */
  static constexpr int O = D + 4;        /* fp32 accumulators of D columns */
};

/* C[R x C] (+)= A[R x K] B[K x C]: A and B bf16 in shared memory with WMMA
   layouts LA / LB, C fp32 row-major in shared memory.  Warp w computes the
   16x16 tiles w, w + nwarps, ... (one tile at a time, accumulating over K). */
template <int R, int C, int K, class LA, class LB, bool ACC>
__device__ __forceinline__ void smem_gemm(const bf16 *A, int lda, const bf16 *B, int ldb, float *Cm, int ldc) {
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  constexpr int TC = C / 16;
  for (int tile = warp; tile < (R / 16) * TC; tile += nw) {
    const int tr = tile / TC, tc = tile % TC;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    float *cp = Cm + tr * 16 * ldc + tc * 16;
    if (ACC) wmma::load_matrix_sync(acc, cp, ldc, wmma::mem_row_major);
    else wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int k0 = 0; k0 < K; k0 += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB> b;
      const bf16 *pa = std::is_same<LA, wmma::row_major>::value ? A + tr * 16 * lda + k0 : A + k0 * lda + tr * 16;
      const bf16 *pb = std::is_same<LB, wmma::row_major>::value ? B + k0 * ldb + tc * 16 : B + tc * 16 * ldb + k0;
      wmma::load_matrix_sync(a, pa, lda);
      wmma::load_matrix_sync(b, pb, ldb);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(cp, acc, ldc, wmma::mem_row_major);
  }
}

/* ROWS rows of D bf16 from src (row stride rs, rows [row0, row0 + ROWS))
   into dst (leading dim ld); rows at or past nvalid become zeros so padded
   rows never feed NaN garbage into the products */
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(bf16 *dst, int ld, const bf16 *src, int64_t rs, int64_t row0,
                                          int64_t nvalid) {
  constexpr int CH = D / 8;  /* 16-byte chunks per row */
  for (int i = threadIdx.x; i < ROWS * CH; i += blockDim.x) {
    const int r = i / CH, c = i % CH;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < nvalid) v = *(const uint4 *)(src + (row0 + r) * rs + c * 8);
    *(uint4 *)(dst + r * ld + c * 8) = v;
  }
}

template <int D> static constexpr size_t fa_fwd_smem() {
  return (size_t)(FA_BR + 2 * FA_BC) * FaLd<D>::Q * 2 + (size_t)FA_BR * FaLd<D>::S * 4 +
         (size_t)FA_BR * FaLd<D>::P * 2 + (size_t)FA_BR * FaLd<D>::O * 4 + 2 * FA_BR * 4;
}
template <int D> static constexpr size_t fa_dkdv_smem() {
  return (size_t)(2 * FA_BC + 2 * FA_BR) * FaLd<D>::Q * 2 + 2 * (size_t)FA_BR * FaLd<D>::S * 4 +
         2 * (size_t)FA_BR * FaLd<D>::P * 2 + 2 * (size_t)FA_BC * FaLd<D>::O * 4 + 2 * FA_BR * 4;
}
template <int D> static constexpr size_t fa_dq_smem() {
  return (size_t)(2 * FA_BR + 2 * FA_BC) * FaLd<D>::Q * 2 + 2 * (size_t)FA_BR * FaLd<D>::S * 4 +
         (size_t)FA_BR * FaLd<D>::P * 2 + (size_t)FA_BR * FaLd<D>::O * 4 + 2 * FA_BR * 4;
}

/* first key tile a query tile [qt0, qt0 + FA_BR) can see, and one past the last key */
__device__ __forceinline__ void fa_key_range(const FlashParams &p, int64_t qt0, int64_t *kv_begin, int64_t *kv_end) {
  int64_t off = p.S - p.T, last_t = (qt0 + FA_BR < p.T ? qt0 + FA_BR : p.T) - 1;
  *kv_end = off + last_t + 1;
  int64_t lo = 0;
  if (p.window > 0) { lo = off + qt0 - p.window + 1; if (lo < 0) lo = 0; }
  *kv_begin = lo / FA_BC * FA_BC;
}

template <int D>
__global__ void __launch_bounds__(FA_THREADS) flash_fwd_kernel(FlashParams p) {
  typedef FaLd<D> L;
  GL_DYNAMIC_SHARED(unsigned char, smem, 128);
  bf16 *Qs = (bf16 *)smem;
  bf16 *Ks = Qs + FA_BR * L::Q;
  bf16 *Vs = Ks + FA_BC * L::Q;
  float *Ss = (float *)(Vs + FA_BC * L::Q);
  bf16 *Ps = (bf16 *)(Ss + FA_BR * L::S);
  float *Os = (float *)(Ps + FA_BR * L::P);
  float *ms = Os + FA_BR * L::O, *ls = ms + FA_BR;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t qt0 = (int64_t)blockIdx.x * FA_BR, h = blockIdx.y, b = blockIdx.z, hk = h / (p.H / p.Hkv);
  const int64_t off = p.S - p.T;
  const bf16 *q = p.q + b * p.qs[0] + h * p.qs[1];
  const bf16 *k = p.k + b * p.ks[0] + hk * p.ks[1];
  const bf16 *v = p.v + b * p.vs[0] + hk * p.vs[1];

  load_tile<D, FA_BR>(Qs, L::Q, q, p.qs[2], qt0, p.T);
  for (int i = threadIdx.x; i < FA_BR * L::O; i += blockDim.x) Os[i] = 0.f;
  for (int i = threadIdx.x; i < FA_BR; i += blockDim.x) { ms[i] = -INFINITY; ls[i] = 0.f; }

  int64_t kv_begin, kv_end;
  fa_key_range(p, qt0, &kv_begin, &kv_end);
  for (int64_t kv0 = kv_begin; kv0 < kv_end; kv0 += FA_BC) {
    __syncthreads();  /* previous tile's products are done with Ks / Vs */
    load_tile<D, FA_BC>(Ks, L::Q, k, p.ks[2], kv0, p.S);
    load_tile<D, FA_BC>(Vs, L::Q, v, p.vs[2], kv0, p.S);
    __syncthreads();
    smem_gemm<FA_BR, FA_BC, D, wmma::row_major, wmma::col_major, false>(Qs, L::Q, Ks, L::Q, Ss, L::S);
    __syncthreads();
    /* online softmax, one warp per row, two columns per lane */
    for (int r = warp; r < FA_BR; r += FA_WARPS) {
      const int64_t t = qt0 + r, qpos = off + t;
      float sv[FA_BC / 32], mloc = -INFINITY;
#pragma unroll
      for (int j = 0; j < FA_BC / 32; j++) {
        const int c = lane + 32 * j;
        const int64_t kpos = kv0 + c;
        const bool ok = t < p.T && kpos < p.S && attn_visible(kpos, qpos, p.window);
        sv[j] = ok ? Ss[r * L::S + c] * p.scale : -INFINITY;
        mloc = fmaxf(mloc, sv[j]);
      }
      const float mt = cu_warp_reduce(mloc, CuMax());
      const float m_old = ms[r], m_new = fmaxf(m_old, mt);
      float psum = 0.f;
#pragma unroll
      for (int j = 0; j < FA_BC / 32; j++) {
        const float pj = m_new == -INFINITY ? 0.f : __expf(sv[j] - m_new);
        Ps[r * L::P + lane + 32 * j] = __float2bfloat16(pj);
        psum += pj;
      }
      psum = cu_warp_reduce(psum, CuSum());
      const float alpha = m_new == -INFINITY ? 1.f : __expf(m_old - m_new);
      for (int d = lane; d < D; d += 32) Os[r * L::O + d] *= alpha;
      __syncwarp();
      if (lane == 0) { ms[r] = m_new; ls[r] = ls[r] * alpha + psum; }
    }
    __syncthreads();
    smem_gemm<FA_BR, D, FA_BC, wmma::row_major, wmma::row_major, true>(Ps, L::P, Vs, L::Q, Os, L::O);
  }
  __syncthreads();
  bf16 *o = p.o + b * p.os[0] + h * p.os[1];
  for (int r = warp; r < FA_BR; r += FA_WARPS) {
    const int64_t t = qt0 + r;
    if (t >= p.T) continue;
    const float l = ls[r], inv = 1.f / l;
    for (int d = lane; d < D; d += 32) o[t * p.os[2] + d] = __float2bfloat16(Os[r * L::O + d] * inv);
    if (lane == 0 && p.lse) p.lse[b * p.ls[0] + h * p.ls[1] + t * p.ls[2]] = ms[r] + logf(l);
  }
}

/* P = exp(S scale - lse) on visible entries, dS = P (dP - Di), both to bf16 */
template <int D>
__device__ __forceinline__ void fa_probs(const FlashParams &p, int64_t qt0, int64_t kv0, const float *Ss,
                                         const float *dPs, const float *lse_s, const float *di_s, bf16 *Pb,
                                         bf16 *dSb) {
  typedef FaLd<D> L;
  const int64_t off = p.S - p.T;
  for (int e = threadIdx.x; e < FA_BR * FA_BC; e += blockDim.x) {
    const int r = e / FA_BC, c = e % FA_BC;
    const int64_t t = qt0 + r, kpos = kv0 + c;
    const bool ok = t < p.T && kpos < p.S && attn_visible(kpos, off + t, p.window);
    const float pv = ok ? __expf(Ss[r * L::S + c] * p.scale - lse_s[r]) : 0.f;
    const float ds = pv * (dPs[r * L::S + c] - di_s[r]);
    if (Pb) Pb[r * L::P + c] = __float2bfloat16(pv);
    dSb[r * L::P + c] = __float2bfloat16(ds);
  }
}

/* lse and Di of query rows [qt0, qt0 + FA_BR) of head (b, h); padded rows
   get lse = +inf (P = 0) */
__device__ __forceinline__ void fa_row_stats(const FlashParams &p, int64_t b, int64_t h, int64_t qt0, float *lse_s,
                                             float *di_s) {
  for (int r = threadIdx.x; r < FA_BR; r += blockDim.x) {
    const int64_t t = qt0 + r;
    const bool ok = t < p.T;
    lse_s[r] = ok ? p.lse_in[b * p.ls[0] + h * p.ls[1] + t * p.ls[2]] : INFINITY;
    di_s[r] = ok ? p.di[(b * p.H + h) * p.T + t] : 0.f;
  }
}

template <int D>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dkdv_kernel(FlashParams p) {
  typedef FaLd<D> L;
  GL_DYNAMIC_SHARED(unsigned char, smem, 128);
  bf16 *Ks = (bf16 *)smem;
  bf16 *Vs = Ks + FA_BC * L::Q;
  bf16 *Qs = Vs + FA_BC * L::Q;
  bf16 *dOs = Qs + FA_BR * L::Q;
  float *Ss = (float *)(dOs + FA_BR * L::Q);
  float *dPs = Ss + FA_BR * L::S;
  bf16 *Pb = (bf16 *)(dPs + FA_BR * L::S);
  bf16 *dSb = Pb + FA_BR * L::P;
  float *dKs = (float *)(dSb + FA_BR * L::P);
  float *dVs = dKs + FA_BC * L::O;
  float *lse_s = dVs + FA_BC * L::O, *di_s = lse_s + FA_BR;

  const int64_t kv0 = (int64_t)blockIdx.x * FA_BC, hk = blockIdx.y, b = blockIdx.z;
  const int64_t group = p.H / p.Hkv, off = p.S - p.T;
  load_tile<D, FA_BC>(Ks, L::Q, p.k + b * p.ks[0] + hk * p.ks[1], p.ks[2], kv0, p.S);
  load_tile<D, FA_BC>(Vs, L::Q, p.v + b * p.vs[0] + hk * p.vs[1], p.vs[2], kv0, p.S);
  for (int i = threadIdx.x; i < FA_BC * L::O; i += blockDim.x) { dKs[i] = 0.f; dVs[i] = 0.f; }

  /* queries that see a key of [kv0, kv0 + FA_BC): qpos >= kv0, and with a
     window qpos < kv0 + FA_BC - 1 + window */
  int64_t t_lo = kv0 - off < 0 ? 0 : kv0 - off;
  t_lo = t_lo / FA_BR * FA_BR;
  int64_t t_hi = p.T;
  if (p.window > 0 && kv0 + FA_BC - 1 + p.window - off < t_hi) t_hi = kv0 + FA_BC - 1 + p.window - off;

  for (int64_t g = 0; g < group; g++) {
    const int64_t h = hk * group + g;
    const bf16 *q = p.q + b * p.qs[0] + h * p.qs[1];
    const bf16 *dout = p.dout + b * p.dos[0] + h * p.dos[1];
    for (int64_t qt0 = t_lo; qt0 < t_hi; qt0 += FA_BR) {
      __syncthreads();  /* the previous tile's products are done with Qs, dOs, Pb, dSb */
      load_tile<D, FA_BR>(Qs, L::Q, q, p.qs[2], qt0, p.T);
      load_tile<D, FA_BR>(dOs, L::Q, dout, p.dos[2], qt0, p.T);
      fa_row_stats(p, b, h, qt0, lse_s, di_s);
      __syncthreads();
      smem_gemm<FA_BR, FA_BC, D, wmma::row_major, wmma::col_major, false>(Qs, L::Q, Ks, L::Q, Ss, L::S);
      smem_gemm<FA_BR, FA_BC, D, wmma::row_major, wmma::col_major, false>(dOs, L::Q, Vs, L::Q, dPs, L::S);
      __syncthreads();
      fa_probs<D>(p, qt0, kv0, Ss, dPs, lse_s, di_s, Pb, dSb);
      __syncthreads();
      /* dV += P^T dout, dK += dS^T Q: P^T is P read column-major */
      smem_gemm<FA_BC, D, FA_BR, wmma::col_major, wmma::row_major, true>(Pb, L::P, dOs, L::Q, dVs, L::O);
      smem_gemm<FA_BC, D, FA_BR, wmma::col_major, wmma::row_major, true>(dSb, L::P, Qs, L::Q, dKs, L::O);
    }
  }
  __syncthreads();
  bf16 *dk = p.dk + b * p.dks[0] + hk * p.dks[1], *dv = p.dv + b * p.dvs[0] + hk * p.dvs[1];
  for (int i = threadIdx.x; i < FA_BC * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    if (kv0 + r >= p.S) continue;
    dk[(kv0 + r) * p.dks[2] + d] = __float2bfloat16(dKs[r * L::O + d] * p.scale);
    dv[(kv0 + r) * p.dvs[2] + d] = __float2bfloat16(dVs[r * L::O + d]);
  }
}

template <int D>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dq_kernel(FlashParams p) {
  typedef FaLd<D> L;
  GL_DYNAMIC_SHARED(unsigned char, smem, 128);
  bf16 *Qs = (bf16 *)smem;
  bf16 *dOs = Qs + FA_BR * L::Q;
  bf16 *Ks = dOs + FA_BR * L::Q;
  bf16 *Vs = Ks + FA_BC * L::Q;
  float *Ss = (float *)(Vs + FA_BC * L::Q);
  float *dPs = Ss + FA_BR * L::S;
  bf16 *dSb = (bf16 *)(dPs + FA_BR * L::S);
  float *dQs = (float *)(dSb + FA_BR * L::P);
  float *lse_s = dQs + FA_BR * L::O, *di_s = lse_s + FA_BR;

  const int64_t qt0 = (int64_t)blockIdx.x * FA_BR, h = blockIdx.y, b = blockIdx.z, hk = h / (p.H / p.Hkv);
  load_tile<D, FA_BR>(Qs, L::Q, p.q + b * p.qs[0] + h * p.qs[1], p.qs[2], qt0, p.T);
  load_tile<D, FA_BR>(dOs, L::Q, p.dout + b * p.dos[0] + h * p.dos[1], p.dos[2], qt0, p.T);
  fa_row_stats(p, b, h, qt0, lse_s, di_s);
  for (int i = threadIdx.x; i < FA_BR * L::O; i += blockDim.x) dQs[i] = 0.f;
  const bf16 *k = p.k + b * p.ks[0] + hk * p.ks[1], *v = p.v + b * p.vs[0] + hk * p.vs[1];

  int64_t kv_begin, kv_end;
  fa_key_range(p, qt0, &kv_begin, &kv_end);
  for (int64_t kv0 = kv_begin; kv0 < kv_end; kv0 += FA_BC) {
    __syncthreads();
    load_tile<D, FA_BC>(Ks, L::Q, k, p.ks[2], kv0, p.S);
    load_tile<D, FA_BC>(Vs, L::Q, v, p.vs[2], kv0, p.S);
    __syncthreads();
    smem_gemm<FA_BR, FA_BC, D, wmma::row_major, wmma::col_major, false>(Qs, L::Q, Ks, L::Q, Ss, L::S);
    smem_gemm<FA_BR, FA_BC, D, wmma::row_major, wmma::col_major, false>(dOs, L::Q, Vs, L::Q, dPs, L::S);
    __syncthreads();
    fa_probs<D>(p, qt0, kv0, Ss, dPs, lse_s, di_s, nullptr, dSb);
    __syncthreads();
    smem_gemm<FA_BR, D, FA_BC, wmma::row_major, wmma::row_major, true>(dSb, L::P, Ks, L::Q, dQs, L::O);
  }
  __syncthreads();
  bf16 *dq = p.dq + b * p.dqs[0] + h * p.dqs[1];
  for (int i = threadIdx.x; i < FA_BR * D; i += blockDim.x) {
    const int r = i / D, d = i % D;
    if (qt0 + r >= p.T) continue;
    dq[(qt0 + r) * p.dqs[2] + d] = __float2bfloat16(dQs[r * L::O + d] * p.scale);
  }
}

/* ---- fast path selection ------------------------------------------------------ */
/* bf16 rows of unit stride, 16-byte aligned starts and row strides */
static bool fa_tensor_ok(const gl_tensor *t) {
  if (t->dtype != GL_BF16 || t->stride[3] != 1) return false;
  if (((uintptr_t)cu_ptr(t)) % 16) return false;
  for (int d = 0; d < 3; d++)
    if (t->shape[d] > 1 && t->stride[d] % 8) return false;
  return true;
}
static bool fa_usable(int dev, int64_t D, size_t smem, std::initializer_list<const gl_tensor *> ts, int64_t H,
                      int64_t B) {
  if (D != 64 && D != 128) return false;
  if ((size_t)cu_smem_optin(dev) < smem) return false;
  if (H > 65535 || B > 65535) return false;
  for (const gl_tensor *t : ts) if (!fa_tensor_ok(t)) return false;
  return true;
}
static void fa_strides(int64_t *dst, const gl_tensor *t) {
  for (int d = 0; d < 3; d++) dst[d] = t ? t->stride[d] : 0;
}

template <int D> static int fa_forward(cudaStream_t st, FlashParams &p, int64_t B) {
  size_t smem = fa_fwd_smem<D>();
  GL_CU_CHECK(cudaFuncSetAttribute(flash_fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)((p.T + FA_BR - 1) / FA_BR), (unsigned)p.H, (unsigned)B);
  GL_LAUNCH(grid, FA_THREADS, smem, st, flash_fwd_kernel<D>)(p);
  GL_CU_LAUNCHED();
  return GL_OK;
}
template <int D> static int fa_backward(cudaStream_t st, FlashParams &p, int64_t B) {
  size_t s1 = fa_dkdv_smem<D>(), s2 = fa_dq_smem<D>();
  GL_CU_CHECK(cudaFuncSetAttribute(flash_bwd_dkdv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s1));
  GL_CU_CHECK(cudaFuncSetAttribute(flash_bwd_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)s2));
  dim3 g1((unsigned)((p.S + FA_BC - 1) / FA_BC), (unsigned)p.Hkv, (unsigned)B);
  GL_LAUNCH(g1, FA_THREADS, s1, st, flash_bwd_dkdv_kernel<D>)(p);
  GL_CU_LAUNCHED();
  dim3 g2((unsigned)((p.T + FA_BR - 1) / FA_BR), (unsigned)p.H, (unsigned)B);
  GL_LAUNCH(g2, FA_THREADS, s2, st, flash_bwd_dq_kernel<D>)(p);
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* ================================ fallback ====================================== */
enum { FB_THREADS = 128 };

struct AttnDims { int64_t H, G, T, S, D, window; };

template <class P, class T>
__device__ __forceinline__ T fb_dot(const T *a, P x, int64_t off, int64_t st, int64_t D) {
  T s = 0;
  for (int64_t d = 0; d < D; d++) s += a[d] * x.template get<T>(off + d * st);
  return s;
}

/* one block per query row (t, h, b); shared: q[D], acc[D], p[FB_THREADS] */
template <class P, class T>
__global__ void attn_fwd_fallback_kernel(P q, Str4 qs, P k, Str4 ks, P v, Str4 vs, P o, Str4 os, AnyPtr lse,
                                         Str4 lss, AttnDims a, T scale) {
  GL_DYNAMIC_SHARED(unsigned char, fb_smem, 16);
  T *qv = (T *)fb_smem, *acc = qv + a.D, *pr = acc + a.D;
  const int64_t t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / a.G;
  const int64_t qo = b * qs.s[0] + h * qs.s[1] + t * qs.s[2];
  const int64_t kb = b * ks.s[0] + hk * ks.s[1], vb = b * vs.s[0] + hk * vs.s[1];
  for (int64_t d = threadIdx.x; d < a.D; d += blockDim.x) { qv[d] = q.template get<T>(qo + d * qs.s[3]); acc[d] = 0; }
  __syncthreads();
  const int64_t pos = a.S - a.T + t, hi = pos + 1;
  const int64_t lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  T m = -cu_inf<T>(), l = 0;
  for (int64_t s = lo + threadIdx.x; s < hi; s += blockDim.x) {
    T sc = scale * fb_dot<P, T>(qv, k, kb + s * ks.s[2], ks.s[3], a.D);
    if (sc > m) { l = l * cu_exp(m - sc) + (T)1; m = sc; }
    else l += cu_exp(sc - m);
  }
  const T M = cu_block_reduce(m, CuMax(), -cu_inf<T>());
  l = m == -cu_inf<T>() ? (T)0 : l * cu_exp(m - M);
  const T Lsum = cu_block_reduce(l, CuSum(), (T)0);
  for (int64_t base = lo; base < hi; base += blockDim.x) {
    const int64_t s = base + threadIdx.x;
    pr[threadIdx.x] = s < hi ? cu_exp(scale * fb_dot<P, T>(qv, k, kb + s * ks.s[2], ks.s[3], a.D) - M) : (T)0;
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
                                        AnyPtr lse, Str4 lss, const T *di, AttnDims a, T scale) {
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
  const int64_t pos = a.S - a.T + t, hi = pos + 1;
  const int64_t lo = a.window > 0 && pos - a.window + 1 > 0 ? pos - a.window + 1 : 0;
  for (int64_t base = lo; base < hi; base += blockDim.x) {
    const int64_t s = base + threadIdx.x;
    T ds = 0;
    if (s < hi) {
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
                                          Str4 ks, P v, Str4 vs, AnyPtr lse, Str4 lss, const T *di, AttnDims a,
                                          T scale) {
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
  const int64_t off = a.S - a.T;
  /* queries seeing key s: qpos >= s, and qpos < s + window with a window */
  const int64_t t_lo = s - off > 0 ? s - off : 0;
  int64_t t_hi = a.T;
  if (a.window > 0 && s + a.window - off < t_hi) t_hi = s + a.window - off;
  for (int64_t h = hk * a.G; h < (hk + 1) * a.G; h++) {
    const int64_t qb = b * qs.s[0] + h * qs.s[1], gb = b * dos.s[0] + h * dos.s[1];
    for (int64_t base = t_lo; base < t_hi; base += blockDim.x) {
      const int64_t t = base + threadIdx.x;
      T p = 0, ds = 0;
      if (t < t_hi) {
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
                                      const gl_tensor *v, double scale, int64_t window) {
  const int64_t B = q->shape[0], H = q->shape[1], T_ = q->shape[2], D = q->shape[3];
  const int64_t Hkv = k->shape[1], S = k->shape[2];
  if (B * H * T_ == 0) return GL_OK;
  int dev = out->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  size_t smem = D == 128 ? fa_fwd_smem<128>() : fa_fwd_smem<64>();
  if (fa_usable(dev, D, smem, {q, k, v, out}, H, B)) {
    FlashParams p;
    memset(&p, 0, sizeof p);
    p.q = (const bf16 *)cu_ptr(q); p.k = (const bf16 *)cu_ptr(k); p.v = (const bf16 *)cu_ptr(v);
    p.o = (bf16 *)cu_ptr(out); p.lse = (float *)cu_ptr(lse);
    fa_strides(p.qs, q); fa_strides(p.ks, k); fa_strides(p.vs, v); fa_strides(p.os, out); fa_strides(p.ls, lse);
    p.H = H; p.Hkv = Hkv; p.T = T_; p.S = S; p.window = window; p.scale = (float)scale;
    return D == 128 ? fa_forward<128>(st, p, B) : fa_forward<64>(st, p, B);
  }
  GL_TRY(grid_check("cuda_attention_forward", T_, H, B));
  AttnDims a = {H, H / Hkv, T_, S, D, window};
  return cu_dispatch({out, q, k, v}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    size_t sm = (size_t)(2 * D + FB_THREADS) * sizeof(T);
    if (sm > 48 * 1024) return gl_error("cuda_attention_forward: head dim %lld is too large", (long long)D);
    GL_LAUNCH(dim3((unsigned)T_, (unsigned)H, (unsigned)B), FB_THREADS, sm, st, attn_fwd_fallback_kernel<P, T>)(
        P::from(q), str4(q), P::from(k), str4(k), P::from(v), str4(v), P::from(out), str4(out), AnyPtr::from(lse),
        lse_str(lse), a, (T)scale);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                                       const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                       const gl_tensor *out, const gl_tensor *lse, double scale, int64_t window) {
  const int64_t B = q->shape[0], H = q->shape[1], T_ = q->shape[2], D = q->shape[3];
  const int64_t Hkv = k->shape[1], S = k->shape[2], rows = B * H * T_;
  int dev = dq->device;
  cudaStream_t st;
  GL_TRY(cu_begin(dev, &st));
  if (rows == 0) {  /* no queries: nothing reaches the keys */
    GL_TRY(cuda_fill(dk, 0));
    return cuda_fill(dv, 0);
  }
  size_t smem = D == 128 ? std::max(fa_dkdv_smem<128>(), fa_dq_smem<128>())
                         : std::max(fa_dkdv_smem<64>(), fa_dq_smem<64>());
  bool fast = fa_usable(dev, D, smem, {dq, dk, dv, dout, q, k, v, out}, H, B);
  int wide = q->dtype == GL_F64;
  CuTemp di;
  GL_TRY(di.make(wide ? GL_F64 : GL_F32, dev, rows));
  GL_TRY(cu_dispatch({dout, out}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    if (sizeof(T) != (wide ? 8u : 4u)) return gl_error("cuda_attention_backward: dout / out dtype mismatch");
    unsigned blocks = (unsigned)((rows * 32 + 255) / 256);
    GL_LAUNCH(blocks, 256, 0, st, attn_di_kernel<P, T>)(di.ptr<T>(), P::from(dout), str4(dout), P::from(out), str4(out), H,
                                                T_, D, rows);
    GL_CU_LAUNCHED();
    return GL_OK;
  }));
  if (fast) {
    FlashParams p;
    memset(&p, 0, sizeof p);
    p.q = (const bf16 *)cu_ptr(q); p.k = (const bf16 *)cu_ptr(k); p.v = (const bf16 *)cu_ptr(v);
    p.dout = (const bf16 *)cu_ptr(dout);
    p.dq = (bf16 *)cu_ptr(dq); p.dk = (bf16 *)cu_ptr(dk); p.dv = (bf16 *)cu_ptr(dv);
    p.lse_in = (const float *)cu_ptr(lse); p.di = di.ptr<float>();
    fa_strides(p.qs, q); fa_strides(p.ks, k); fa_strides(p.vs, v); fa_strides(p.ls, lse);
    fa_strides(p.dos, dout); fa_strides(p.dqs, dq); fa_strides(p.dks, dk); fa_strides(p.dvs, dv);
    p.H = H; p.Hkv = Hkv; p.T = T_; p.S = S; p.window = window; p.scale = (float)scale;
    return D == 128 ? fa_backward<128>(st, p, B) : fa_backward<64>(st, p, B);
  }
  GL_TRY(grid_check("cuda_attention_backward", T_ > S ? T_ : S, H, B));
  AttnDims a = {H, H / Hkv, T_, S, D, window};
  return cu_dispatch({dq, dk, dv, dout, q, k, v}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    if (sizeof(T) != (wide ? 8u : 4u)) return gl_error("cuda_attention_backward: operands of mixed dtypes");
    size_t s1 = (size_t)(3 * D + FB_THREADS) * sizeof(T), s2 = (size_t)(4 * D + 2 * FB_THREADS) * sizeof(T);
    if (s2 > 48 * 1024) return gl_error("cuda_attention_backward: head dim %lld is too large", (long long)D);
    GL_LAUNCH(dim3((unsigned)T_, (unsigned)H, (unsigned)B), FB_THREADS, s1, st, attn_dq_fallback_kernel<P, T>)(
        P::from(dq), str4(dq), P::from(dout), str4(dout), P::from(q), str4(q), P::from(k), str4(k), P::from(v),
        str4(v), AnyPtr::from(lse), lse_str(lse), di.ptr<T>(), a, (T)scale);
    GL_CU_LAUNCHED();
    GL_LAUNCH(dim3((unsigned)S, (unsigned)Hkv, (unsigned)B), FB_THREADS, s2, st, attn_dkdv_fallback_kernel<P, T>)(
        P::from(dk), str4(dk), P::from(dv), str4(dv), P::from(dout), str4(dout), P::from(q), str4(q), P::from(k),
        str4(k), P::from(v), str4(v), AnyPtr::from(lse), lse_str(lse), di.ptr<T>(), a, (T)scale);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}
