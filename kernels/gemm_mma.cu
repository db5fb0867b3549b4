/* gemm_mma.cu — a bf16 GEMM of our own on the tensor cores, for the two
 * products of nanochat's ReLU² MLP whose activation cuBLASLt cannot fuse
 * (kernels/README.md):
 *   GL_EPI_RELU2   h    = relu(x W1^T + b1)^2          (the forward; pre is never stored)
 *   GL_EPI_DRELU2  dpre = (g W2) * 2 sqrt(h)           (the backward's dx product of the
 *                                                      second layer; relu(pre) = sqrt(h))
 * out (M, N) = a (M, K) @ b (K, N), b stored either as (N, K) row-major (a
 * weight read through its transposed view: the forward, "TN") or as (K, N)
 * row-major (W2 itself: the backward, "NN", read with ldmatrix.trans).
 *
 * Tiles: 128 x 128 outputs per block, K in steps of 32, 256 threads = 8
 * warps as 2 (rows) x 4 (columns), each warp owning a 64 x 32 sub-tile:
 * 4 x 4 mma.sync m16n8k16 per 16 of K, 64 fp32 accumulators per thread in
 * registers.  Why this shape: a block reads (128 + 128) x 32 bf16 = 16 KiB
 * per K-step for 2 x 128 x 128 x 32 = 1 MFLOP, 64 FLOP per byte from L2;
 * with each A row block read by every column block (and vice versa) from
 * L2, DRAM sees each operand about once, far above the H100's ridge point
 * (about 295 FLOP/B); a 64 x 32 warp tile reuses each A fragment 4 times
 * and each B fragment 4 times; 2 blocks of 8 warps per SM hide latency.
 * Smaller tiles (64 x 64) double the L2 traffic per FLOP; 256-wide ones need
 * more than 128 registers a thread for the accumulators.
 * Operands come in with 16-byte cp.async (commit / wait groups) into a
 * 3-stage ring, so two K-steps are in flight while the third is multiplied.
 * Shared tiles are rows padded by 8 bf16 (16 bytes) so the 8 row addresses
 * of an ldmatrix matrix fall on different banks: A 128 x 40, B 128 x 40
 * (TN) or 32 x 136 (NN); 3 stages: 61,440 B (TN) / 56,832 B (NN) of dynamic
 * shared memory (past the 48 KiB default: opted in).  Occupancy on an H100
 * (64K registers, 228 KiB shared per SM): 256 threads at up to 128 registers
 * allow 2 blocks (16 warps) per SM, and 2 x 60 KiB of shared memory fits.
 * Tile edges: rows, columns and K-chunks past the matrix are zero-filled by
 * cp.async (src-size 0), so M, N and K need not be multiples of the tile;
 * K and N must be multiples of 8 (whole 16-byte chunks) and every row
 * 16-byte aligned (cuda_gemm_mma_fits).
 * The epilogue rounds once to bf16: the fp32 accumulator (+ bias), relu and
 * square, or times 2 sqrt(h) with h read from the bf16 tile it multiplies.
 *
 * The grouped forms are moe.cu's grouped products with no epilogue: a
 * block's tile rows and its b are one expert's (GM_ROWS), or a block's
 * reduction runs over one expert's rows, A transposed (GM_WGRAD).
 * CPU twin: gl_epilogue_product / gl_epilogue_finish (engine/unfused.c),
 * the product and then the elementwise passes, which the GPU also runs when
 * this kernel cannot take the operands (kernels/matmul.cu).  Specs:
 * spec/cuda_gemm_mma_spec.lua (against the twin over tile edges, race mode
 * in RACE_SPECS), spec/account_spec.lua (one launch, bytes and FLOPs). */
#include "common.cuh"
#include "mma_sync.cuh"

enum { GM_BM = 128, GM_BN = 128, GM_BK = 32, GM_THREADS = 256, GM_STAGES = 3 };
enum { GM_LDK = GM_BK + 8,  /* row length (bf16) of a K-contiguous tile: A, and B stored (N, K) */
       GM_LDN = GM_BN + 8 }; /* row length of B stored (K, N) */
static_assert(GM_THREADS == 256 && GM_BM == 2 * 64 && GM_BN == 4 * 32, "8 warps as 2 x 4, each 64 x 32");
static constexpr int GM_A_ELEMS = GM_BM * GM_LDK;
template <bool KN> static constexpr int gm_b_elems() { return KN ? GM_BK * GM_LDN : GM_BN * GM_LDK; }
template <bool KN> static constexpr size_t gm_smem() {
  return (size_t)GM_STAGES * (GM_A_ELEMS + gm_b_elems<KN>()) * sizeof(bf16);
}

struct GemmMmaParams {
  const bf16 *a;     /* (M, K), row stride lda */
  const bf16 *b;     /* (N, K) row stride ldb, or with KN (K, N) row stride ldb */
  bf16 *out;         /* (M, N), row stride ldo */
  const bf16 *bias;  /* (N) or NULL: GL_EPI_RELU2 only */
  const bf16 *aux;   /* (M, N) row stride ldx: h, GL_EPI_DRELU2 only */
  int64_t M, N, K, lda, ldb, ldo, ldx;
  int epi;
};
/* The kernel's three forms: the fused epilogues above (GM_PLAIN), and the
   grouped products of kernels/moe.cu: an expert's rows times its b
   (GM_ROWS, cuda_gemm_mma_grouped), and an expert's weight gradient x_e^T
   y_e (GM_WGRAD, cuda_gemm_mma_grouped_wgrad: A = x^T, read from x's rows
   with ldmatrix.trans; the reduction runs over the expert's rows). */
enum { GM_PLAIN = 0, GM_ROWS = 1, GM_WGRAD = 2 };
/* the experts of one grouped launch, by value */
enum { GM_MMA_GROUP = 32 };
struct GemmMmaGroups {
  const bf16 *b[GM_MMA_GROUP];   /* GM_ROWS: each expert's b, laid out as p.b (KN or not) */
  int64_t ldb[GM_MMA_GROUP];
  bf16 *out[GM_MMA_GROUP];       /* GM_WGRAD: each expert's (M, N) result, strides os0, os1 */
  int64_t os0[GM_MMA_GROUP], os1[GM_MMA_GROUP];
  IdxPtr counts;                 /* every expert's row count */
  int64_t cs, rows;              /* rows: the buffer's (the counts are clamped to it) */
  int e0, ng;
};
/* expert e's rows, clamped to [0, M - off) */
__device__ __forceinline__ int64_t gm_group_rows(const GemmMmaGroups &gq, int64_t e, int64_t off) {
  const int64_t M = gq.rows;
  int64_t c = gq.counts.get(e * gq.cs);
  if (c < 0) c = 0;
  return c < M - off ? c : M - off;
}

/* one K-step's tiles, global -> shared with cp.async (this thread's share;
   the caller commits the group); what lies past the matrix is zero-filled */
template <bool KN, bool TA>
__device__ __forceinline__ void gm_load(bf16 *As, bf16 *Bs, const GemmMmaParams &p, const bf16 *b, int64_t ldb,
                                        int64_t m0, int64_t mend, int64_t n0, int64_t k0, int64_t kend) {
  if (TA) {  /* A^T: 32 k-rows of 128 m (x's rows), stored k-major as B (K, N) is */
    for (int i = threadIdx.x; i < GM_BK * (GM_BM / 8); i += GM_THREADS) {
      const int r = i >> 4, c = (i & 15) * 8;
      const bool ok = k0 + r < kend && m0 + c < mend;
      cp_async_16(As + r * GM_LDN + c, ok ? p.a + (k0 + r) * p.lda + m0 + c : p.a, ok);
    }
  } else {
    for (int i = threadIdx.x; i < GM_BM * (GM_BK / 8); i += GM_THREADS) {  /* 128 rows x 4 chunks */
      const int r = i >> 2, c = (i & 3) * 8;
      const bool ok = m0 + r < mend && k0 + c < kend;
      cp_async_16(As + r * GM_LDK + c, ok ? p.a + (m0 + r) * p.lda + k0 + c : p.a, ok);
    }
  }
  if (KN) {
    for (int i = threadIdx.x; i < GM_BK * (GM_BN / 8); i += GM_THREADS) {  /* 32 k-rows x 16 chunks */
      const int r = i >> 4, c = (i & 15) * 8;
      const bool ok = k0 + r < kend && n0 + c < p.N;
      cp_async_16(Bs + r * GM_LDN + c, ok ? b + (k0 + r) * ldb + n0 + c : b, ok);
    }
  } else {
    for (int i = threadIdx.x; i < GM_BN * (GM_BK / 8); i += GM_THREADS) {  /* 128 n-rows x 4 chunks */
      const int r = i >> 2, c = (i & 3) * 8;
      const bool ok = n0 + r < p.N && k0 + c < kend;
      cp_async_16(Bs + r * GM_LDK + c, ok ? b + (n0 + r) * ldb + k0 + c : b, ok);
    }
  }
}

/* The simulator's account in its quick mode (spec/cudasim/account.cpp,
   gl_sim_account_skip_products): as cuBLASLt's products there, the operands
   are loaded and the epilogue reads and writes as always (the bytes are
   counted), but the products are not computed (their emulation is nearly
   all of the simulator's time at nanochat d20's widths): each warp adds the
   FLOPs of its 2 x 16 mma per K-step, and the accumulators get small
   finite numbers, never zero (cublaslt_matmul.cpp's pattern), so the step
   takes the path a real one takes.  Never set outside the simulator. */
__device__ __forceinline__ bool gm_quick() {
#ifdef GL_SIM
  return gl_sim_account_skips_products();
#else
  return false;
#endif
}
__device__ __forceinline__ float gm_pattern(int64_t i) {
  return (float)((int)(((uint64_t)i * 2654435761u) >> 24 & 255) - 128) / 4096.0f + 1.0f / 8192.0f;
}

/* GM_ROWS: block y is the y-th 128-row tile of the walk over experts [e0,
   e0 + ng), each expert's rows following the ones before it (the counts,
   read here from device memory, clamped to the buffer); its b is the
   expert's matrix.  GM_WGRAD: block z is expert e0 + z, its K the expert's
   rows.  Both: the epilogue is the plain product rounded to bf16.  Every
   thread walks the counts (the same few cached words: no shared memory,
   which the opt-in guard does not count, and no barrier). */
template <bool KN, int MODE>
__global__ void __launch_bounds__(GM_THREADS) gemm_mma_kernel(GemmMmaParams p, GemmMmaGroups gq) {
  GL_DYNAMIC_SHARED(unsigned char, smem, 128);
  bf16 *sA = (bf16 *)smem, *sB = sA + GM_STAGES * GM_A_ELEMS;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 2, wn = warp & 3;  /* rows wm*64.., columns wn*32.. of the block's tile */
  const int64_t n0 = (int64_t)blockIdx.x * GM_BN;
  int64_t m0 = (int64_t)blockIdx.y * GM_BM, mend = p.M, ldb = p.ldb, kbeg = 0, kend = p.K;
  const bf16 *b = p.b;
  if (MODE == GM_ROWS) {
    int64_t off = 0, slot = blockIdx.y;
    int pick = -1;
    for (int64_t e = 0; e < gq.e0; e++) off += gm_group_rows(gq, e, off);
    for (int g = 0; g < gq.ng && pick < 0; g++) {
      const int64_t c = gm_group_rows(gq, gq.e0 + g, off), tiles = (c + GM_BM - 1) / GM_BM;
      if (slot < tiles) { pick = g; m0 = off + slot * GM_BM; mend = off + c; }
      slot -= tiles;
      off += c;
    }
    if (pick < 0) return;  /* past the last tile (the grid is a bound): the whole block */
    b = gq.b[pick]; ldb = gq.ldb[pick];
  }
  if (MODE == GM_WGRAD) {
    int64_t off = 0;
    for (int64_t e = 0; e < gq.e0 + (int64_t)blockIdx.z; e++) off += gm_group_rows(gq, e, off);
    kbeg = off;
    kend = off + gm_group_rows(gq, gq.e0 + blockIdx.z, off);
  }
  const int64_t nk = (kend - kbeg + GM_BK - 1) / GM_BK;
  const bool quick = gm_quick();

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

  /* the ring: stages 0 .. STAGES-2 in flight before the first product; a
     group is committed every step, empty past the last K-step, so that
     wait<STAGES-2> always retires exactly the step about to be used */
#pragma unroll
  for (int s = 0; s < GM_STAGES - 1; s++) {
    if (s < nk)
      gm_load<KN, MODE == GM_WGRAD>(sA + s * GM_A_ELEMS, sB + s * gm_b_elems<KN>(), p, b, ldb, m0, mend, n0,
                                    kbeg + (int64_t)s * GM_BK, kend);
    cp_async_commit();
  }
  for (int64_t kt = 0; kt < nk; kt++) {
    cp_async_wait<GM_STAGES - 2>();
    __syncthreads();  /* step kt is everyone's; step kt-1's stage is free to refill */
    const int64_t nt = kt + GM_STAGES - 1;
    if (nt < nk) {
      const int s = (int)(nt % GM_STAGES);
      gm_load<KN, MODE == GM_WGRAD>(sA + s * GM_A_ELEMS, sB + s * gm_b_elems<KN>(), p, b, ldb, m0, mend, n0,
                                    kbeg + nt * GM_BK, kend);
    }
    cp_async_commit();
    const int s = (int)(kt % GM_STAGES);
    const bf16 *As = sA + s * GM_A_ELEMS, *Bs = sB + s * gm_b_elems<KN>();
    if (quick) {
#ifdef GL_SIM
      if (lane == 0) gl_sim_account_add(nullptr, (GM_BK / 16) * 16 * 2.0 * 16 * 8 * 16, 0, 0);
#endif
      continue;
    }
#pragma unroll
    for (int kk = 0; kk < GM_BK; kk += 16) {
      uint32_t af[4][4], bfr[4][2];
#pragma unroll
      for (int i = 0; i < 4; i++) {
        if (MODE == GM_WGRAD)  /* A^T stored (k, m): the transposing load gives A's fragment (mma_sync.cuh) */
          ldmatrix_x4_trans(af[i], As + (kk + ldm_rows_bt_row(lane)) * GM_LDN + wm * 64 + i * 16 + ldm_rows_bt_col(lane));
        else
          ldmatrix_x4(af[i], As + (wm * 64 + i * 16 + ldm_rows_a_row(lane)) * GM_LDK + kk + ldm_rows_a_col(lane));
      }
#pragma unroll
      for (int j2 = 0; j2 < 2; j2++) {  /* 16 columns: two n-tiles of 8 */
        uint32_t r[4];
        if (KN)
          ldmatrix_x4_trans(r, Bs + (kk + ldm_rows_a_row(lane)) * GM_LDN + wn * 32 + j2 * 16 + ldm_rows_a_col(lane));
        else
          ldmatrix_x4(r, Bs + (wn * 32 + j2 * 16 + ldm_rows_bt_row(lane)) * GM_LDK + kk + ldm_rows_bt_col(lane));
        bfr[2 * j2][0] = r[0]; bfr[2 * j2][1] = r[1];
        bfr[2 * j2 + 1][0] = r[2]; bfr[2 * j2 + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) mma_bf16_16816(acc[i][j], af[i], bfr[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();  /* (only empty groups are left) */
#ifdef GL_SIM
  /* the account's FLOPs are the product's 2 M N K, as cuBLASLt's rows count
     them: the mma emulation (or the quick mode above) counted this block's
     whole padded tiles, so take back what lies past the matrix (a step
     function of M, N and K that the account's fit in B·T cannot follow) */
  if (threadIdx.x == 0) {
    const double vm = (double)(mend - m0 < GM_BM ? mend - m0 : GM_BM), vn = (double)(p.N - n0 < GM_BN ? p.N - n0 : GM_BN);
    gl_sim_account_add(nullptr, 2.0 * vm * vn * (double)(kend - kbeg) - 2.0 * GM_BM * GM_BN * (double)(nk * GM_BK), 0, 0);
  }
#endif

  /* epilogue: lane (g, t) holds rows g and g + 8, columns 2t, 2t + 1 of each
     16 x 8 tile; N is even, so a column pair is wholly in or out */
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int hf = 0; hf < 2; hf++) {
        const int64_t row = m0 + wm * 64 + i * 16 + g + hf * 8, col = n0 + wn * 32 + j * 8 + 2 * t;
        if (row >= mend || col >= p.N) continue;
        float v0 = acc[i][j][2 * hf], v1 = acc[i][j][2 * hf + 1];
        if (quick) { v0 = gm_pattern(row * p.N + col); v1 = gm_pattern(row * p.N + col + 1); }
        if (MODE == GM_WGRAD) {  /* any strides */
          bf16 *o = gq.out[blockIdx.z];
          o[row * gq.os0[blockIdx.z] + col * gq.os1[blockIdx.z]] = __float2bfloat16(v0);
          o[row * gq.os0[blockIdx.z] + (col + 1) * gq.os1[blockIdx.z]] = __float2bfloat16(v1);
          continue;
        }
        if (MODE == GM_ROWS) {
          /* the plain product */
        } else if (p.epi == GL_EPI_RELU2) {
          if (p.bias) { v0 += __bfloat162float(p.bias[col]); v1 += __bfloat162float(p.bias[col + 1]); }
          v0 = v0 > 0.f ? v0 * v0 : 0.f;
          v1 = v1 > 0.f ? v1 * v1 : 0.f;
        } else {  /* GL_EPI_DRELU2: relu(pre) = sqrt(h), h >= 0 */
          const float h0 = __bfloat162float(p.aux[row * p.ldx + col]);
          const float h1 = __bfloat162float(p.aux[row * p.ldx + col + 1]);
          v0 *= 2.f * sqrtf(h0 > 0.f ? h0 : 0.f);
          v1 *= 2.f * sqrtf(h1 > 0.f ? h1 : 0.f);
        }
        *(uint32_t *)(p.out + row * p.ldo + col) = pack_bf16x2(v0, v1);
      }
}

/* ---- when the kernel takes the operands, and its launch --------------------- */
/* a 2-D bf16 matrix with unit column stride, 16-byte aligned start and row
   stride (a multiple of 8 elements); rows of 1 need no stride */
static bool gm_rows_ok(const gl_tensor *t) {
  if (t->dtype != GL_BF16 || t->ndim != 2) return false;
  if (t->shape[1] > 1 && t->stride[1] != 1) return false;
  if ((uintptr_t)cu_ptr(t) % 16) return false;
  return t->shape[0] <= 1 || t->stride[0] % 8 == 0;
}

/* b (K, N) as the kernel reads it: row-major (NN, *kn), or the transposed
   view of a row-major (N, K) (TN), in *bt; false when neither */
static bool gm_b_layout(const gl_tensor *b, int64_t K, int64_t N, gl_tensor *bt, bool *kn) {
  *bt = *b;
  if (b->stride[1] == 1 || N == 1) *kn = true;
  else if (b->stride[0] == 1 || K == 1) {
    *kn = false;
    bt->shape[0] = N; bt->shape[1] = K; bt->stride[0] = b->stride[1]; bt->stride[1] = b->stride[0];
  } else return false;
  return gm_rows_ok(bt);
}
static int64_t gm_ldb(const gl_tensor *bt) { return bt->shape[0] > 1 ? bt->stride[0] : bt->shape[1]; }

/* the launch, either orientation of b */
template <int MODE>
static int gm_launch(bool kn, dim3 grid, size_t smem, cudaStream_t st, const GemmMmaParams &p, const GemmMmaGroups &gq) {
  if constexpr (MODE == GM_WGRAD) kn = true;  /* y (K, N) row-major: the one orientation (no other instance) */
  if (kn) {
    GL_CU_CHECK(cudaFuncSetAttribute(gemm_mma_kernel<true, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    GL_LAUNCH(grid, GM_THREADS, smem, st, gemm_mma_kernel<true, MODE>)(p, gq);
  } else if constexpr (MODE != GM_WGRAD) {
    GL_CU_CHECK(cudaFuncSetAttribute(gemm_mma_kernel<false, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)smem));
    GL_LAUNCH(grid, GM_THREADS, smem, st, gemm_mma_kernel<false, MODE>)(p, gq);
  }
  GL_CU_LAUNCHED();
  return GL_OK;
}

/* Runs out = a @ b with epilogue epi (GL_EPI_RELU2 / GL_EPI_DRELU2) and
   returns GL_OK, or returns 1 without launching anything when the kernel
   cannot take the operands (the caller runs the unfused path): every
   operand bf16, a and out row-major, b row-major or a transposed view of a
   row-major matrix, 16-byte aligned rows, K and N multiples of 8, bias
   contiguous, the shared memory opt-in of the device enough. */
extern "C" int cuda_gemm_mma_epilogue(int epi, gl_tensor *out, const gl_tensor *a, const gl_tensor *b,
                                      const gl_tensor *bias, const gl_tensor *aux) {
  if (out->ndim != 2 || a->ndim != 2 || b->ndim != 2) return 1;
  const int64_t M = out->shape[0], N = out->shape[1], K = a->shape[1];
  if (K % 8 || N % 8 || K == 0 || M == 0 || N == 0) return 1;
  if (M > (int64_t)65535 * GM_BM || N > (int64_t)0x7fffffff) return 1;
  if (!gm_rows_ok(a) || !gm_rows_ok(out) || (aux && !gm_rows_ok(aux))) return 1;
  if (bias && (bias->dtype != GL_BF16 || (N > 1 && bias->stride[0] != 1))) return 1;
  gl_tensor bt;
  bool kn;
  if (!gm_b_layout(b, K, N, &bt, &kn)) return 1;
  const size_t smem = kn ? gm_smem<true>() : gm_smem<false>();
  if ((size_t)cu_smem_optin(out->device) < smem) return 1;

  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  GemmMmaParams p;
  p.a = (const bf16 *)cu_ptr(a); p.b = (const bf16 *)cu_ptr(&bt); p.out = (bf16 *)cu_ptr(out);
  p.bias = bias ? (const bf16 *)cu_ptr(bias) : nullptr;
  p.aux = aux ? (const bf16 *)cu_ptr(aux) : nullptr;
  p.M = M; p.N = N; p.K = K;
  p.lda = M > 1 ? a->stride[0] : K; p.ldb = gm_ldb(&bt);
  p.ldo = M > 1 ? out->stride[0] : N; p.ldx = aux && M > 1 ? aux->stride[0] : N;
  p.epi = epi;
  dim3 grid((unsigned)((N + GM_BN - 1) / GM_BN), (unsigned)((M + GM_BM - 1) / GM_BM));
  GemmMmaGroups none;
  memset(&none, 0, sizeof none);
  return gm_launch<GM_PLAIN>(kn, grid, smem, st, p, none);
}

/* The grouped product of kernels/moe.cu on the tensor cores: out's rows of
   expert e = a's rows of e @ bs[e] for e in [e0, e0 + ng) (ng <=
   GM_MMA_GROUP), each expert's rows after those of the experts before it
   (counts, on the device).  Returns 1 without launching anything when the
   kernel cannot take the operands (the same rules as above, every b in the
   same orientation); rows past the last expert's are the caller's. */
extern "C" int cuda_gemm_mma_grouped(gl_tensor *out, const gl_tensor *a, int e0, int ng, const gl_tensor **bs,
                                     const gl_tensor *counts, cudaStream_t st) {
  const int64_t M = out->shape[0], N = out->shape[1], K = a->shape[1];
  if (ng < 1 || ng > GM_MMA_GROUP || K % 8 || N % 8 || K == 0 || M == 0 || N == 0) return 1;
  const int64_t ytiles = (M + GM_BM - 1) / GM_BM + ng;  /* each expert's last tile may be partial */
  if (ytiles > 65535 || N > (int64_t)0x7fffffff) return 1;
  if (!gm_rows_ok(a) || !gm_rows_ok(out)) return 1;
  GemmMmaGroups gq;
  memset(&gq, 0, sizeof gq);
  bool kn = false;
  for (int g = 0; g < ng; g++) {
    gl_tensor bt;
    bool kg;
    if (!gm_b_layout(bs[e0 + g], K, N, &bt, &kg) || (g > 0 && kg != kn)) return 1;
    kn = kg;
    gq.b[g] = (const bf16 *)cu_ptr(&bt);
    gq.ldb[g] = gm_ldb(&bt);
  }
  const size_t smem = kn ? gm_smem<true>() : gm_smem<false>();
  if ((size_t)cu_smem_optin(out->device) < smem) return 1;
  gq.counts = IdxPtr::from(counts);
  gq.cs = counts->stride[0];
  gq.rows = M;
  gq.e0 = e0;
  gq.ng = ng;
  GemmMmaParams p;
  memset(&p, 0, sizeof p);
  p.a = (const bf16 *)cu_ptr(a); p.b = gq.b[0]; p.out = (bf16 *)cu_ptr(out);
  p.M = M; p.N = N; p.K = K;
  p.lda = M > 1 ? a->stride[0] : K; p.ldb = gq.ldb[0]; p.ldo = M > 1 ? out->stride[0] : N; p.ldx = N;
  dim3 grid((unsigned)((N + GM_BN - 1) / GM_BN), (unsigned)ytiles);
  return gm_launch<GM_ROWS>(kn, grid, smem, st, p, gq);
}

/* The grouped weight gradient of kernels/moe.cu on the tensor cores: dbs[e]
   (K, N) = x_e^T y_e for e in [e0, e0 + ng), x (M, K) and y (M, N) holding
   the experts' rows one after another (counts, on the device).  Returns 1
   without launching anything when the kernel cannot take the operands
   (bf16, x and y row-major with 16-byte aligned rows, K and N multiples of
   8; the results may have any strides). */
extern "C" int cuda_gemm_mma_grouped_wgrad(int e0, int ng, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y,
                                           const gl_tensor *counts, cudaStream_t st) {
  const int64_t M = x->shape[0], K = x->shape[1], N = y->shape[1];
  if (ng < 1 || ng > GM_MMA_GROUP || K % 8 || N % 8 || K == 0 || N == 0) return 1;
  if ((K + GM_BM - 1) / GM_BM > 65535 || N > (int64_t)0x7fffffff) return 1;
  if (!gm_rows_ok(x) || !gm_rows_ok(y)) return 1;
  const size_t smem = gm_smem<true>();
  if ((size_t)cu_smem_optin(x->device) < smem) return 1;
  GemmMmaGroups gq;
  memset(&gq, 0, sizeof gq);
  for (int g = 0; g < ng; g++) {
    if (dbs[e0 + g]->dtype != GL_BF16) return 1;
    gq.out[g] = (bf16 *)cu_ptr(dbs[e0 + g]);
    gq.os0[g] = dbs[e0 + g]->stride[0];
    gq.os1[g] = dbs[e0 + g]->stride[1];
  }
  gq.counts = IdxPtr::from(counts);
  gq.cs = counts->stride[0];
  gq.rows = M;
  gq.e0 = e0;
  gq.ng = ng;
  GemmMmaParams p;
  memset(&p, 0, sizeof p);
  p.a = (const bf16 *)cu_ptr(x); p.b = (const bf16 *)cu_ptr(y);
  p.M = K; p.N = N; p.K = M;
  p.lda = M > 1 ? x->stride[0] : K; p.ldb = M > 1 ? y->stride[0] : N;
  dim3 grid((unsigned)((N + GM_BN - 1) / GM_BN), (unsigned)((K + GM_BM - 1) / GM_BM), (unsigned)ng);
  return gm_launch<GM_WGRAD>(true, grid, smem, st, p, gq);
}
