/* cuda_bf16.h — the CUDA simulator's bfloat16 type (__nv_bfloat16,
 * __nv_bfloat162).
 *
 * Part of the CUDA simulator (spec/cudasim/): the kernels/ sources compile unchanged
 * with the host C++ compiler against these headers instead of the toolkit's.
 * Values are bit-exact with the hardware format (the top 16 bits of a float:
 * 1 sign, 8 exponent, 7 mantissa bits, subnormals, inf, NaN) and
 * conversions round as CUDA's do (see the rounding core in cuda_fp16.h,
 * which this header includes as the toolkit's does):
 *  - float / double / integer -> bfloat16: one rounding of the exact value
 *    in the named mode (_rn nearest-even, _rz, _rd, _ru); __float2bfloat16
 *    is _rn, so a float above the largest finite bfloat16 by half a unit or
 *    more becomes inf; every NaN becomes CUDA's canonical NaN 0x7fff (quiet,
 *    sign dropped, as the toolkit's own host conversion does).
 *  - bfloat16 -> float is exact (the bits shifted up, NaN payload kept).
 *  - bfloat16 -> integer (_rz) truncates and saturates; NaN gives 0.
 *  - arithmetic computes in float and rounds once: float's 24 >= 2 * 8 + 2
 *    bits make that the correctly rounded bfloat16 result, which is what
 *    sm_90's native bf16 add / mul return.
 * The types are trivial and standard-layout, 2 bytes, 2-byte aligned;
 * __nv_bfloat162 is 4 bytes, 4-byte aligned. */
#ifndef GL_SIM_CUDA_BF16_H
#define GL_SIM_CUDA_BF16_H
#include "cuda_fp16.h" /* the rounding core and GL_SIM_16BIT */

GL_SIM_16BIT(__nv_bfloat16, bfloat16, 8, 7)
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

/* float -> bfloat16, nearest even: the hot path of every simulated kernel,
   so the usual bit form: adding 0x7fff plus the kept part's lowest bit
   carries into the kept part exactly when the dropped half is above the
   midpoint, or on it with an odd kept part (and a carry out of the largest
   finite value lands on inf's pattern, as rounding demands) */
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = gl_sim_num::float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fff);
  u += 0x7fffu + ((u >> 16) & 1u);
  return __ushort_as_bfloat16((unsigned short)(u >> 16));
}

/* bfloat16 -> float: exact */
inline float __bfloat162float(__nv_bfloat16 h) {
  return gl_sim_num::bits_float((uint32_t)__bfloat16_as_ushort(h) << 16);
}

#endif
