/* mma_sync.cuh — the warp-level PTX the tensor-core kernels use, as device
 * functions: mma.sync m16n8k16 (bf16 x bf16 -> fp32), ldmatrix x4 (plain
 * and .trans) and 16-byte cp.async with commit / wait groups (sm_80+).
 *
 * Under nvcc each is one inline PTX instruction; under the CUDA simulator
 * (GL_SIM) each is spec/cudasim/warp_mma.h's emulation, which honours every
 * lane's fragment layout as the PTX ISA documents it, so a wrong lane
 * mapping in a kernel gives wrong numbers in the simulator's specs too.
 *
 * Fragments (lane l, g = l / 4, t = l % 4; a uint32_t holds two bf16, the
 * lower column / row index in the low half):
 *   A 16x16 row-major: a[0] (g, 2t..2t+1)  a[1] (g+8, 2t..)  a[2] (g, 2t+8..)  a[3] (g+8, 2t+8..)
 *   B 16x8 (k x n):    b[0] (k 2t..2t+1, n g)  b[1] (k 2t+8.., n g)
 *   C/D 16x8 fp32:     c[0..1] (g, 2t..2t+1)  c[2..3] (g+8, 2t..2t+1)
 * ldmatrix x4: lanes 8i..8i+7 pass the row addresses of 8x8 matrix i (16
 * bytes each); r[i] gets (row g, cols 2t..2t+1) of matrix i, or with .trans
 * (rows 2t..2t+1, col g).  Hence, for a 16x16 bf16 block at (r0, c0) of a
 * row-major shared tile:
 *   - lane row r0 + l % 16, column c0 + (l / 16) * 8, plain: an A fragment;
 *     with .trans: B fragments of that block read as (k x n), n-tiles c0
 *     (r[0], r[1]) and c0 + 8 (r[2], r[3])  (ldm_rows_a below);
 *   - lane row r0 + l % 8 + (l / 16) * 8, column c0 + (l / 8 % 2) * 8, plain:
 *     B fragments of its transpose, n-tiles r0 (r[0], r[1]) and r0 + 8
 *     (r[2], r[3])  (ldm_rows_bt below).
 * spec/sim_warp_mma_spec.lua checks all of them against plain products. */
#ifndef GL_KERNELS_MMA_SYNC_CUH
#define GL_KERNELS_MMA_SYNC_CUH
#include <stdint.h>
#include <cuda_bf16.h>
#ifdef GL_SIM
#include "warp_mma.h"
#endif

/* two floats -> a bf16 pair register (round to nearest even) */
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16(lo)) |
         (uint32_t)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16;
}

/* d = a b + c on a 16x8x16 tile; d may be c */
__device__ __forceinline__ void mma_bf16_16816(float *d, const uint32_t *a, const uint32_t *b, const float *c) {
#ifdef GL_SIM
  gl_sim_ptx::mma_m16n8k16_bf16(d, a, b, c);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
        "f"(c[3]));
#endif
}

/* four 8x8 b16 matrices from shared memory; `row` is this lane's row address */
__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *row) {
#ifdef GL_SIM
  gl_sim_ptx::ldmatrix_x4(r, row, false);
#else
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, const void *row) {
#ifdef GL_SIM
  gl_sim_ptx::ldmatrix_x4(r, row, true);
#else
  const unsigned a = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#endif
}

/* this lane's (row, column) offsets in the two address patterns above */
__device__ __forceinline__ int ldm_rows_a_row(int lane) { return lane & 15; }
__device__ __forceinline__ int ldm_rows_a_col(int lane) { return (lane >> 4) << 3; }
__device__ __forceinline__ int ldm_rows_bt_row(int lane) { return (lane & 7) + ((lane >> 4) << 3); }
__device__ __forceinline__ int ldm_rows_bt_col(int lane) { return ((lane >> 3) & 1) << 3; }

/* 16 bytes global -> shared, asynchronously (L2 only); valid == false fills
   the 16 bytes with zeros and reads nothing (src must still be a pointer) */
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid) {
#ifdef GL_SIM
  gl_sim_ptx::cp_async_16(dst, src, valid ? 16 : 0);
#else
  const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(valid ? 16 : 0));
#endif
}
/* closes the group of the copies issued since the last commit */
__device__ __forceinline__ void cp_async_commit() {
#ifdef GL_SIM
  gl_sim_ptx::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
/* waits until at most N of this thread's committed groups are in flight
   (their copies visible to this thread; a barrier shares them) */
template <int N> __device__ __forceinline__ void cp_async_wait() {
#ifdef GL_SIM
  gl_sim_ptx::cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

#endif
