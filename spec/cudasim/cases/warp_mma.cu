/* warp_mma.cu — the CUDA simulator's checks of kernels/mma_sync.cuh
 * (mma.sync m16n8k16, ldmatrix x4 / .trans, cp.async; emulated by
 * spec/cudasim/warp_mma.h).
 *
 * Built into build/sim/libgptlua_simtest.so; spec/sim_warp_mma_spec.lua
 * calls the extern "C" entry points below through LuaJIT's ffi.
 *
 *  - gemm: a 32x32x32 bf16 product by four warps, operands brought into
 *    shared memory with cp.async and into fragments with ldmatrix, against
 *    a double-precision host loop.  B comes either as B^T rows (plain
 *    ldmatrix) or as B rows (.trans); a third variant reads B rows with the
 *    plain instruction, a lane-mapping bug that must give wrong numbers.
 *  - cp.async: zero fill, wait_group N leaving the newest N groups in
 *    flight (their destinations still poisoned), and a read with no wait at
 *    all seeing the poison. */
#include "common.cuh"
#include "mma_sync.cuh"
#include "simtest.h"
#include <math.h>
#include <vector>

namespace {

enum { N = 32, LDS = N + 8 };  /* the operands' size; padded shared row length */
enum { B_TRANSPOSED = 0, B_ROWS_TRANS = 1, B_ROWS_PLAIN_BUG = 2 };

/* C (N x N fp32) = A (N x N) B, A row-major, B given as B^T rows (variant 0)
   or B rows (1, 2); warp w computes the 16x16 block (w / 2, w % 2) */
__global__ void ptx_gemm_kernel(float *c, const bf16 *a, const bf16 *b, int variant) {
  GL_SHARED(bf16, as, [N * LDS]);
  GL_SHARED(bf16, bs, [N * LDS]);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < N * N / 8; i += blockDim.x) {
    const int r = i / (N / 8), c8 = i % (N / 8) * 8;
    cp_async_16(&as[r * LDS + c8], a + r * N + c8, true);
    cp_async_16(&bs[r * LDS + c8], b + r * N + c8, true);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int m0 = (warp >> 1) * 16, n0 = (warp & 1) * 16;
  float acc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
  for (int k0 = 0; k0 < N; k0 += 16) {
    uint32_t af[4], bf[4];
    ldmatrix_x4(af, &as[(m0 + ldm_rows_a_row(lane)) * LDS + k0 + ldm_rows_a_col(lane)]);
    if (variant == B_TRANSPOSED)  /* bs holds B^T: rows are n */
      ldmatrix_x4(bf, &bs[(n0 + ldm_rows_bt_row(lane)) * LDS + k0 + ldm_rows_bt_col(lane)]);
    else if (variant == B_ROWS_TRANS)  /* bs holds B: rows are k */
      ldmatrix_x4_trans(bf, &bs[(k0 + ldm_rows_a_row(lane)) * LDS + n0 + ldm_rows_a_col(lane)]);
    else
      ldmatrix_x4(bf, &bs[(k0 + ldm_rows_a_row(lane)) * LDS + n0 + ldm_rows_a_col(lane)]);
    mma_bf16_16816(acc[0], af, bf, acc[0]);
    mma_bf16_16816(acc[1], af, bf + 2, acc[1]);
  }
  const int g = lane >> 2, t = lane & 3;
  for (int j = 0; j < 2; j++)
    for (int i = 0; i < 4; i++) c[(m0 + g + 8 * (i >> 1)) * N + n0 + 8 * j + 2 * t + (i & 1)] = acc[j][i];
}

/* cp.async's groups: out[0..7] after zero fill + wait<0>, out[8..15] group
   0 after wait<1> (landed), out[16..23] group 1 then (still in flight),
   out[24..31] a copy read with no wait at all; the destinations held -1
   before, so a copy that landed early or never shows */
__global__ void cp_async_groups_kernel(bf16 *out, const bf16 *src) {
  GL_SHARED(bf16, s, [32]);
  if (threadIdx.x != 0) return;
  cp_async_16(&s[0], src, false);
  cp_async_commit();
  cp_async_wait<0>();
  for (int i = 0; i < 8; i++) out[i] = s[i];
  for (int i = 8; i < 32; i++) s[i] = __float2bfloat16(-1.f);  /* neither poison nor the source */
  cp_async_16(&s[8], src, true);
  cp_async_commit();
  cp_async_16(&s[16], src + 8, true);
  cp_async_commit();
  cp_async_wait<1>();
  for (int i = 0; i < 16; i++) out[8 + i] = s[8 + i];
  cp_async_16(&s[24], src + 16, true);
  for (int i = 0; i < 8; i++) out[24 + i] = s[24 + i];
  cp_async_wait<0>();
}

uint64_t next_random(uint64_t &state) {  /* splitmix64 */
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

SIMTEST_MESSAGE(ptx)

/* the gemm in `variant`; returns the number of entries off by more than
   1e-5 of the result's scale (-cudaError_t on a CUDA error) and the worst
   relative error in *worst */
extern "C" int gl_simtest_ptx_gemm(int variant, unsigned seed, double *worst) {
  begin();
  uint64_t st = seed;
  std::vector<bf16> a(N * N), b(N * N);
  for (auto &x : a) x = __float2bfloat16((float)((int)(next_random(st) % 2001) - 1000) / 250.f);
  for (auto &x : b) x = __float2bfloat16((float)((int)(next_random(st) % 2001) - 1000) / 250.f);
  std::vector<double> ref(N * N);
  double scale = 0;
  for (int m = 0; m < N; m++)
    for (int n = 0; n < N; n++) {
      double s = 0;
      for (int k = 0; k < N; k++) {
        const double bv = variant == B_TRANSPOSED ? __bfloat162float(b[n * N + k]) : __bfloat162float(b[k * N + n]);
        s += (double)__bfloat162float(a[m * N + k]) * bv;
      }
      ref[m * N + n] = s;
      scale = fmax(scale, fabs(s));
    }
  bf16 *da, *db;
  float *dc;
  TRY(cudaMalloc((void **)&da, N * N * sizeof(bf16)));
  TRY(cudaMalloc((void **)&db, N * N * sizeof(bf16)));
  TRY(cudaMalloc((void **)&dc, N * N * sizeof(float)));
  TRY(cudaMemcpy(da, a.data(), N * N * sizeof(bf16), cudaMemcpyHostToDevice));
  TRY(cudaMemcpy(db, b.data(), N * N * sizeof(bf16), cudaMemcpyHostToDevice));
  GL_LAUNCH(1, 128, 0, 0, ptx_gemm_kernel)(dc, da, db, variant);
  TRY(cudaGetLastError());
  std::vector<float> c(N * N);
  TRY(cudaMemcpy(c.data(), dc, N * N * sizeof(float), cudaMemcpyDeviceToHost));
  TRY(cudaFree(da));
  TRY(cudaFree(db));
  TRY(cudaFree(dc));
  int off = 0;
  *worst = 0;
  for (int i = 0; i < N * N; i++) {
    const double e = fabs(c[i] - ref[i]) / scale;
    if (!(e <= 1e-5)) {
      if (!off) note("C[%d][%d] = %g, expected %g", i / N, i % N, c[i], ref[i]);
      off++;
    }
    if (!(e <= *worst)) *worst = e;
  }
  return off;
}

/* cp.async's groups as cp_async_groups_kernel describes them; returns the
   number of values that are not what they should be */
extern "C" int gl_simtest_ptx_cp_async(void) {
  begin();
  std::vector<bf16> src(24);
  for (int i = 0; i < 24; i++) src[i] = __float2bfloat16((float)(i + 1));
  bf16 *ds, *dout;
  TRY(cudaMalloc((void **)&ds, 24 * sizeof(bf16)));
  TRY(cudaMalloc((void **)&dout, 32 * sizeof(bf16)));
  TRY(cudaMemcpy(ds, src.data(), 24 * sizeof(bf16), cudaMemcpyHostToDevice));
  GL_LAUNCH(1, 32, 0, 0, cp_async_groups_kernel)(dout, ds);
  TRY(cudaGetLastError());
  std::vector<bf16> out(32);
  TRY(cudaMemcpy(out.data(), dout, 32 * sizeof(bf16), cudaMemcpyDeviceToHost));
  TRY(cudaFree(ds));
  TRY(cudaFree(dout));
  int bad = 0;
  for (int i = 0; i < 32; i++) {
    const float v = __bfloat162float(out[i]);
    const char *want = i < 8 ? "0" : i < 16 ? "the source" : "poison (NaN)";
    const bool ok = i < 8 ? v == 0.f : i < 16 ? v == (float)(i - 7) : isnan(v);
    if (!ok) {
      if (!bad) note("out[%d] = %g, expected %s", i, v, want);
      bad++;
    }
  }
  return bad;
}
