/* warp_mma.h — the CUDA simulator's emulation of the warp-level PTX that
 * kernels/mma_sync.cuh wraps: mma.sync m16n8k16 bf16 -> fp32, ldmatrix x4
 * (plain and .trans) and cp.async with its commit / wait groups.
 *
 * Part of the CUDA simulator (spec/cudasim/); included by kernels/mma_sync.cuh
 * under GL_SIM only.  Unlike mma.h's WMMA, whose fragment layout is
 * unspecified, these instructions have the per-lane layouts the PTX ISA
 * documents ("Matrix Fragments for mma.m16n8k16", "ldmatrix"), and the
 * emulation honours them exactly: a kernel that puts a value in the wrong
 * lane or register gets wrong numbers here as it would on a GPU.
 *
 *  - mma and ldmatrix are warp-collective: every lane calls them, they meet
 *    in gl_sim_warp_collective (sim.h) and the last lane to arrive does the
 *    whole warp's work from every lane's operands.
 *  - mma accumulates as mma.h's WMMA does: each bf16 x bf16 product exact,
 *    added to the fp32 sum with one rounding per step, in k order from C.
 *  - cp.async is per thread.  The source is read at issue time (a copy may
 *    happen at any moment between issue and the wait that covers it, so
 *    reading then is a legal schedule) and the destination is poisoned
 *    (0xFF bytes: bf16 / float NaN) until cp_async_wait retires its group,
 *    which writes the bytes read at issue.  A kernel that reads shared
 *    memory before waiting sees NaN, as a missing wait_group would give it
 *    on a GPU some of the time. */
#ifndef GL_SIM_WARP_MMA_H
#define GL_SIM_WARP_MMA_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include "cuda_bf16.h"
#include "device.h"

namespace gl_sim_ptx {

/* (b16 pair) register <-> two floats: the lower index sits in the low half */
inline float lo_bf16(uint32_t r) { return __bfloat162float(__ushort_as_bfloat16((unsigned short)(r & 0xffff))); }
inline float hi_bf16(uint32_t r) { return __bfloat162float(__ushort_as_bfloat16((unsigned short)(r >> 16))); }

[[noreturn]] inline void fail(const char *op, const char *what) {
  char msg[512];
  const char *where = gl_sim_where();
  snprintf(msg, sizeof msg, "%s%s%s: %s", where ? where : "", where ? ": " : "", op, what);
  gl_sim_abort_kernel(cudaErrorMisalignedAddress, msg);
  fprintf(stderr, "gptlua cuda-sim: %s (called outside a kernel)\n", msg);
  abort();
}

/* ---- mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ----------------- */
/* Lane l, g = l / 4, t = l % 4 (PTX ISA, m16n8k16 fragments for .bf16):
     A (16 x 16): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
                  a[3] = (g+8, 2t+8..)
     B (16 x 8):  b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
     C, D (16 x 8 fp32): c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1) */
struct MmaOperands {
  float *d;
  const uint32_t *a, *b;
  const float *c;
};
inline void mma_m16n8k16_bf16(float *d, const uint32_t *a, const uint32_t *b, const float *c) {
  MmaOperands mine = {d, a, b, c};
  gl_sim_warp_collective(0xffffffffu, "mma.sync.m16n8k16.bf16", 16816, &mine, [](void **lanes, int) {
    gl_sim_account_add(nullptr, 2.0 * 16 * 8 * 16, 0, 0);  /* the account's tensor-core FLOPs */
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; l++) {
      const MmaOperands *o = (const MmaOperands *)lanes[l];
      const int g = l >> 2, t = l & 3;
      for (int i = 0; i < 4; i++) {
        const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
        A[row][col] = lo_bf16(o->a[i]);
        A[row][col + 1] = hi_bf16(o->a[i]);
      }
      for (int i = 0; i < 2; i++) {
        B[2 * t + 8 * i][g] = lo_bf16(o->b[i]);
        B[2 * t + 8 * i + 1][g] = hi_bf16(o->b[i]);
      }
      for (int i = 0; i < 4; i++) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = o->c[i];
    }
    for (int m = 0; m < 16; m++)
      for (int n = 0; n < 8; n++) {
        float acc = C[m][n];
        for (int k = 0; k < 16; k++) acc = (float)((double)acc + (double)A[m][k] * (double)B[k][n]);
        C[m][n] = acc;
      }
    for (int l = 0; l < 32; l++) {  /* after every C was read: d may be c */
      float *dx = ((const MmaOperands *)lanes[l])->d;
      const int g = l >> 2, t = l & 3;
      for (int i = 0; i < 4; i++) dx[i] = C[g + 8 * (i >> 1)][2 * t + (i & 1)];
    }
  });
}

/* ---- ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 -------------------- */
/* Lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16 bytes
   each, 16-byte aligned).  Lane l, g = l / 4, t = l % 4, receives in r[i]:
   plain  (row g, cols 2t, 2t+1) of matrix i;
   .trans (rows 2t, 2t+1, col g) of matrix i. */
struct LdmArgs {
  const void *row;
  uint32_t *r;
};
inline void ldmatrix_x4(uint32_t *r, const void *row, bool trans) {
  const char *op = trans ? "ldmatrix.x4.trans" : "ldmatrix.x4";
  if ((uintptr_t)row % 16) {
    char what[96];
    snprintf(what, sizeof what, "row address %p is not 16-byte aligned", row);
    fail(op, what);
  }
  LdmArgs mine = {row, r};
  gl_sim_warp_collective(0xffffffffu, op, trans, &mine, [trans](void **lanes, int) {
    uint16_t m[4][8][8];
    for (int i = 0; i < 4; i++)
      for (int row = 0; row < 8; row++) memcpy(m[i][row], ((const LdmArgs *)lanes[8 * i + row])->row, 16);
    for (int l = 0; l < 32; l++) {
      const int g = l >> 2, t = l & 3;
      uint32_t *out = ((const LdmArgs *)lanes[l])->r;
      for (int i = 0; i < 4; i++) {
        const uint16_t lo = trans ? m[i][2 * t][g] : m[i][g][2 * t];
        const uint16_t hi = trans ? m[i][2 * t + 1][g] : m[i][g][2 * t + 1];
        out[i] = (uint32_t)lo | (uint32_t)hi << 16;
      }
    }
  });
}

/* ---- cp.async.cg.shared.global (16 bytes) + commit / wait groups --------- */
struct CpAsyncCopy {
  void *dst;
  unsigned char bytes[16];
  uint64_t group;
};
struct CpAsyncThread {
  uint64_t block;                   /* the block these copies belong to */
  uint64_t committed;               /* groups committed so far */
  std::vector<CpAsyncCopy> pending; /* issued, not yet retired, in issue order */
};
/* the calling simulated thread's copies; the state of a thread of an earlier
   block (one that exited without waiting) is dropped.  The block is told
   apart by a GL_SHARED-style slot, which the simulator stamps with the block
   generation the first time each block touches it. */
inline CpAsyncThread &cp_async_self() {
  static CpAsyncThread threads[GL_SIM_MAX_THREADS_PER_BLOCK];
  static gl_sim_shared_slot stamp;
  gl_sim_static_shared(&stamp, 1, 1);
  const unsigned linear =
      threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  CpAsyncThread &t = threads[linear];
  if (t.block != stamp.block) {
    t.block = stamp.block;
    t.committed = 0;
    t.pending.clear();
  }
  return t;
}
/* src_bytes 16 copies, 0 fills the destination with zeros (PTX src-size) */
inline void cp_async_16(void *dst, const void *src, int src_bytes) {
  if ((uintptr_t)dst % 16 || (src_bytes && (uintptr_t)src % 16)) {
    char what[128];
    snprintf(what, sizeof what, "addresses %p <- %p are not 16-byte aligned", dst, src);
    fail("cp.async.cg", what);
  }
  CpAsyncThread &t = cp_async_self();
  CpAsyncCopy c;
  c.dst = dst;
  c.group = t.committed;  /* the group the next commit closes */
  if (src_bytes) memcpy(c.bytes, src, 16);
  else memset(c.bytes, 0, 16);
  memset(dst, 0xff, 16);
  t.pending.push_back(c);
}
inline void cp_async_commit() { cp_async_self().committed++; }
/* retires every group but the newest n committed (uncommitted copies stay) */
inline void cp_async_wait(int n) {
  CpAsyncThread &t = cp_async_self();
  const uint64_t done = t.committed > (uint64_t)n ? t.committed - n : 0;
  size_t keep = 0;
  for (size_t i = 0; i < t.pending.size(); i++) {
    CpAsyncCopy &c = t.pending[i];
    if (c.group < done) memcpy(c.dst, c.bytes, 16);
    else t.pending[keep++] = c;
  }
  t.pending.resize(keep);
}

}  // namespace gl_sim_ptx

#endif
