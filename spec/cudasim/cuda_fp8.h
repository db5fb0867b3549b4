/* cuda_fp8.h — the CUDA simulator's float8 conversions (the subset of the
 * toolkit's cuda_fp8.h the kernels use): __nv_fp8_storage_t, the
 * interpretations __NV_E4M3 / __NV_E5M2 (OCP FP8 e4m3fn: no inf, largest
 * 448, NaN S.1111.111; e5m2: IEEE-like, largest 57344, inf and NaNs), the
 * saturation modes and the conversions to and from them.
 *
 * Part of the CUDA simulator (spec/cudasim/).  Written from the formats'
 * definitions with the rounding core of cuda_fp16.h, not from the engine's
 * CPU conversion (engine/util.c), so the twin specs compare two
 * implementations:
 *  - float / double -> fp8: one rounding of the exact value to nearest even;
 *    a result beyond the largest finite value is that value under
 *    __NV_SATFINITE (inf inputs too) and inf (e5m2) or NaN (e4m3) under
 *    __NV_NOSAT; every NaN becomes the canonical 0x7f (sign dropped, as PTX
 *    cvt's canonical NaN).
 *  - fp8 -> half (__half_raw) is exact: every fp8 value is a half. */
#ifndef GL_SIM_CUDA_FP8_H
#define GL_SIM_CUDA_FP8_H
#include "cuda_fp16.h"

typedef unsigned char __nv_fp8_storage_t;
typedef enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 } __nv_fp8_interpretation_t;
typedef enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE } __nv_saturation_t;

namespace gl_sim_num {
/* e4m3 as a format with 5 exponent bits (bias 15) and 3 mantissa bits,
   scaled by 2^-8: its smallest normal (2^-6) lands on that format's (2^-14)
   with the same spacing, so the rounding core's field bits are e4m3's, and
   every pattern above 0x7e (480 and up, where e4m3 has only its NaN) is
   past the largest finite value.  e5m2 is the core's (5, 2) format as it is. */
inline __nv_fp8_storage_t double_to_fp8(double d, __nv_saturation_t sat, __nv_fp8_interpretation_t k) {
  uint64_t u;
  memcpy(&u, &d, 8);
  uint64_t ef = (u >> 52) & 0x7ff, m = u & 0xfffffffffffffull;
  bool neg = (u >> 63) != 0;
  const unsigned sign = neg ? 0x80u : 0u;
  const unsigned maxfin = k == __NV_E4M3 ? 0x7eu : 0x7bu, over = k == __NV_E4M3 ? 0x7fu : 0x7cu;
  if (ef == 0x7ff) {
    if (m) return 0x7f;
    return (__nv_fp8_storage_t)(sign | (sat == __NV_SATFINITE ? maxfin : over));
  }
  uint64_t mag = ef ? (m | (1ull << 52)) : m;
  int exp = ef ? (int)ef - 1075 : -1074;
  unsigned bits = k == __NV_E4M3 ? round_to_16(neg, mag, exp - 8, 5, 3, ROUND_NEAREST_EVEN) & 0x7fffu
                                 : round_to_16(neg, mag, exp, 5, 2, ROUND_NEAREST_EVEN) & 0x7fffu;
  if (bits > maxfin) bits = sat == __NV_SATFINITE ? maxfin : over;
  return (__nv_fp8_storage_t)(sign | bits);
}
/* the exact value of an fp8 pattern, as a double */
inline double fp8_value(__nv_fp8_storage_t b, __nv_fp8_interpretation_t k) {
  const int mbits = k == __NV_E4M3 ? 3 : 2, bias = k == __NV_E4M3 ? 7 : 15;
  const unsigned e = (b & 0x7fu) >> mbits, m = b & ((1u << mbits) - 1);
  const double s = (b & 0x80u) ? -1.0 : 1.0;
  if (k == __NV_E4M3 && (b & 0x7fu) == 0x7fu) return NAN;
  if (k == __NV_E5M2 && e == 31) return m ? NAN : s * INFINITY;
  if (e == 0) return s * ldexp((double)m, 1 - bias - mbits);
  return s * ldexp((double)((1u << mbits) | m), (int)e - bias - mbits);
}
}  // namespace gl_sim_num

inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t sat, __nv_fp8_interpretation_t k) {
  return gl_sim_num::double_to_fp8(x, sat, k);
}
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t k) {
  return gl_sim_num::double_to_fp8((double)x, sat, k);  /* float -> double is exact */
}
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t b, __nv_fp8_interpretation_t k) {
  return __half_raw{gl_sim_num::double_to_16(gl_sim_num::fp8_value(b, k), 5, 10, gl_sim_num::ROUND_NEAREST_EVEN)};
}

#endif
