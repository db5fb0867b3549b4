/* cuda_fp16.h — the CUDA simulator's IEEE half precision type (__half,
 * __half2) and the rounding core it shares with cuda_bf16.h.
 *
 * Part of the CUDA simulator (kernels/sim/): the kernels/ sources compile unchanged
 * with the host C++ compiler against these headers instead of the toolkit's.
 * Values are bit-exact with the hardware format (1 sign, 5 exponent, 10
 * mantissa bits, subnormals, inf, NaN) and conversions round as CUDA's do:
 *  - float / double / integer -> half: one rounding of the exact value in
 *    the named mode (_rn nearest-even, _rz toward zero, _rd down, _ru up);
 *    overflow goes to inf or to the largest finite value as the mode says;
 *    every NaN becomes CUDA's canonical NaN 0x7fff (quiet, sign dropped, as
 *    the toolkit's own host conversion does).
 *  - half -> float is exact; a NaN becomes the canonical float NaN
 *    0x7fffffff (the toolkit's host conversion again).
 *  - half -> integer (_rz) truncates and saturates; NaN gives 0 (PTX cvt).
 *  - arithmetic computes in float and rounds once to half: since float has
 *    24 >= 2 * 11 + 2 bits, the float result rounded again is the correctly
 *    rounded half result, which is what the hardware's half ops return.
 * The types are trivial and standard-layout (they sit in shared arrays and
 * unions), 2 bytes, 2-byte aligned; __half2 is 4 bytes, 4-byte aligned. */
#ifndef GL_SIM_CUDA_FP16_H
#define GL_SIM_CUDA_FP16_H
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <limits>
#include "sim_types.h"
#include "device.h" /* gl_sim_shfl, for the shuffles below */

/* ---- the rounding core (shared with cuda_bf16.h) ------------------------ */
namespace gl_sim_num {

enum round_mode { ROUND_NEAREST_EVEN, ROUND_TOWARD_ZERO, ROUND_DOWN, ROUND_UP };

/* Rounds the exact value (-1)^neg * mag * 2^exp to a 16-bit binary format
   with `ebits` exponent bits and `mbits` stored mantissa bits (half: 5, 10;
   bfloat16: 8, 7) and returns its bit pattern.  The caller handles NaN and
   inf inputs; every finite value comes through here. */
inline uint16_t round_to_16(bool neg, uint64_t mag, int exp, int ebits, int mbits, round_mode mode) {
  const uint16_t sign = neg ? 0x8000 : 0;
  if (mag == 0) return sign;
  const int bias = (1 << (ebits - 1)) - 1, emin = 1 - bias;
  const int64_t inf_bits = (int64_t)((1 << ebits) - 1) << mbits;
  int msb = 63 - __builtin_clzll(mag);
  int e = msb + exp;                        /* the value's unbiased exponent */
  int quantum = (e < emin ? emin : e) - mbits;  /* log2 of the spacing of representable values there */
  int shift = quantum - exp;                /* bits of mag below the spacing */
  unsigned __int128 n = mag, rem = 0, halfway = 0;
  if (shift > 0) {
    if (shift > 100) shift = 100;           /* far below the smallest subnormal: all bits are remainder */
    unsigned __int128 one = 1;
    rem = n & ((one << shift) - 1);
    halfway = one << (shift - 1);
    n >>= shift;
  } else {
    n <<= -shift;                           /* exact: the value sits on the grid */
  }
  bool up = false;
  switch (mode) {
    case ROUND_NEAREST_EVEN: up = rem > halfway || (rem == halfway && rem != 0 && (n & 1)); break;
    case ROUND_TOWARD_ZERO: up = false; break;
    case ROUND_UP: up = !neg && rem != 0; break;
    case ROUND_DOWN: up = neg && rem != 0; break;
  }
  n += up;
  /* n counts spacings: subnormals are n itself; normals add the exponent
     field (a carry out of the mantissa bumps the exponent by itself) */
  int64_t bits;
  if (e < emin) bits = (int64_t)n;
  else bits = ((int64_t)(e - emin + 1) << mbits) + (int64_t)n - ((int64_t)1 << mbits);
  if (bits >= inf_bits) {  /* beyond the largest finite value */
    bool to_inf = mode == ROUND_NEAREST_EVEN || (mode == ROUND_UP && !neg) || (mode == ROUND_DOWN && neg);
    bits = to_inf ? inf_bits : inf_bits - 1;
  }
  return (uint16_t)(sign | bits);
}

inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float -> 16-bit format; NaN -> the canonical 0x7fff */
inline uint16_t float_to_16(float f, int ebits, int mbits, round_mode mode) {
  uint32_t u = float_bits(f), ef = (u >> 23) & 0xff, m = u & 0x7fffff;
  bool neg = (u >> 31) != 0;
  if (ef == 0xff) return m ? (uint16_t)0x7fff : (uint16_t)((neg ? 0x8000 : 0) | (((1 << ebits) - 1) << mbits));
  if (ef == 0) return round_to_16(neg, m, -149, ebits, mbits, mode);
  return round_to_16(neg, m | 0x800000u, (int)ef - 150, ebits, mbits, mode);
}

/* double -> 16-bit format, one rounding; NaN -> 0x7fff */
inline uint16_t double_to_16(double d, int ebits, int mbits, round_mode mode) {
  uint64_t u;
  memcpy(&u, &d, 8);
  uint64_t ef = (u >> 52) & 0x7ff, m = u & 0xfffffffffffffull;
  bool neg = (u >> 63) != 0;
  if (ef == 0x7ff) return m ? (uint16_t)0x7fff : (uint16_t)((neg ? 0x8000 : 0) | (((1 << ebits) - 1) << mbits));
  if (ef == 0) return round_to_16(neg, m, -1074, ebits, mbits, mode);
  return round_to_16(neg, m | (1ull << 52), (int)ef - 1075, ebits, mbits, mode);
}

/* integers -> 16-bit format, one rounding */
inline uint16_t int_to_16(int64_t v, int ebits, int mbits, round_mode mode) {
  uint64_t mag = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
  return round_to_16(v < 0, mag, 0, ebits, mbits, mode);
}
inline uint16_t uint_to_16(uint64_t v, int ebits, int mbits, round_mode mode) {
  return round_to_16(false, v, 0, ebits, mbits, mode);
}

/* float -> integer toward zero as PTX cvt.rzi does: saturating, NaN -> 0 */
template <class I> inline I float_to_int_rz(float f) {
  if (f != f) return 0;
  const double lo = (double)std::numeric_limits<I>::min(), hi = (double)std::numeric_limits<I>::max();
  double t = trunc((double)f);
  if (t <= lo) return std::numeric_limits<I>::min();
  if (t >= hi) return std::numeric_limits<I>::max();
  return (I)t;
}

}  // namespace gl_sim_num

/* ---- __half -------------------------------------------------------------- */
/* the raw bits, as the toolkit's __half_raw */
struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };

struct __half;
inline __half __float2half_rn(float f);
inline __half __double2half(double d);
inline float __half2float(__half h);
inline __half __ll2half_rn(long long v);
inline __half __ull2half_rn(unsigned long long v);

struct alignas(2) __half {
 protected:
  unsigned short __x;

 public:
  __half() = default;  /* trivial: usable in shared arrays and unions */
  __half(const __half_raw &r) { __x = r.x; }
  __half &operator=(const __half_raw &r) { __x = r.x; return *this; }
  operator __half_raw() const { __half_raw r; r.x = __x; return r; }
  /* construction from numbers rounds to nearest even */
  __half(float f) { *this = __float2half_rn(f); }
  __half(double d) { *this = __double2half(d); }
  __half(short v) { *this = __ll2half_rn(v); }
  __half(unsigned short v) { *this = __ull2half_rn(v); }
  __half(int v) { *this = __ll2half_rn(v); }
  __half(unsigned int v) { *this = __ull2half_rn(v); }
  __half(long v) { *this = __ll2half_rn(v); }
  __half(unsigned long v) { *this = __ull2half_rn(v); }
  __half(long long v) { *this = __ll2half_rn(v); }
  __half(unsigned long long v) { *this = __ull2half_rn(v); }
  operator float() const { return __half2float(*this); }
  /* to integers: toward zero, saturating, NaN -> 0 */
  explicit operator short() const { return gl_sim_num::float_to_int_rz<short>(__half2float(*this)); }
  explicit operator unsigned short() const { return gl_sim_num::float_to_int_rz<unsigned short>(__half2float(*this)); }
  explicit operator int() const { return gl_sim_num::float_to_int_rz<int>(__half2float(*this)); }
  explicit operator unsigned int() const { return gl_sim_num::float_to_int_rz<unsigned int>(__half2float(*this)); }
  explicit operator long long() const { return gl_sim_num::float_to_int_rz<long long>(__half2float(*this)); }
  explicit operator unsigned long long() const {
    return gl_sim_num::float_to_int_rz<unsigned long long>(__half2float(*this));
  }
  explicit operator bool() const { return (__x & 0x7fff) != 0; }
};
typedef __half half;

struct alignas(4) __half2 {
  __half x, y;
  __half2() = default;
  __half2(const __half &a, const __half &b) : x(a), y(b) {}
  __half2(const __half2_raw &r) { x = __half_raw{r.x}; y = __half_raw{r.y}; }
  operator __half2_raw() const { return __half2_raw{__half_raw(x).x, __half_raw(y).x}; }
};
typedef __half2 half2;

/* bits <-> __half */
inline unsigned short __half_as_ushort(__half h) { return __half_raw(h).x; }
inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
inline short __half_as_short(__half h) { return (short)__half_raw(h).x; }
inline __half __short_as_half(short s) { return __half(__half_raw{(unsigned short)s}); }

/* float / double -> half */
inline __half __float2half_rn(float f) {
  return __ushort_as_half(gl_sim_num::float_to_16(f, 5, 10, gl_sim_num::ROUND_NEAREST_EVEN));
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline __half __float2half_rz(float f) {
  return __ushort_as_half(gl_sim_num::float_to_16(f, 5, 10, gl_sim_num::ROUND_TOWARD_ZERO));
}
inline __half __float2half_rd(float f) {
  return __ushort_as_half(gl_sim_num::float_to_16(f, 5, 10, gl_sim_num::ROUND_DOWN));
}
inline __half __float2half_ru(float f) {
  return __ushort_as_half(gl_sim_num::float_to_16(f, 5, 10, gl_sim_num::ROUND_UP));
}
inline __half __double2half(double d) {
  return __ushort_as_half(gl_sim_num::double_to_16(d, 5, 10, gl_sim_num::ROUND_NEAREST_EVEN));
}

/* half -> float: exact; NaN -> 0x7fffffff */
inline float __half2float(__half h) {
  uint32_t b = __half_as_ushort(h), sign = (b & 0x8000u) << 16, e = (b >> 10) & 0x1f, m = b & 0x3ff;
  if (e == 0x1f) return gl_sim_num::bits_float(m ? 0x7fffffffu : (sign | 0x7f800000u));
  if (e == 0) {  /* zero or subnormal: m * 2^-24, exact in float */
    float f = ldexpf((float)m, -24);
    return sign ? -f : f;
  }
  return gl_sim_num::bits_float(sign | ((e + 112) << 23) | (m << 13));
}

/* integers <-> half */
inline __half __ll2half_rn(long long v) {
  return __ushort_as_half(gl_sim_num::int_to_16(v, 5, 10, gl_sim_num::ROUND_NEAREST_EVEN));
}
inline __half __ull2half_rn(unsigned long long v) {
  return __ushort_as_half(gl_sim_num::uint_to_16(v, 5, 10, gl_sim_num::ROUND_NEAREST_EVEN));
}
inline __half __int2half_rn(int v) { return __ll2half_rn(v); }
inline __half __uint2half_rn(unsigned int v) { return __ull2half_rn(v); }
inline __half __short2half_rn(short v) { return __ll2half_rn(v); }
inline __half __ushort2half_rn(unsigned short v) { return __ull2half_rn(v); }
inline int __half2int_rz(__half h) { return gl_sim_num::float_to_int_rz<int>(__half2float(h)); }
inline unsigned int __half2uint_rz(__half h) { return gl_sim_num::float_to_int_rz<unsigned int>(__half2float(h)); }
inline long long __half2ll_rz(__half h) { return gl_sim_num::float_to_int_rz<long long>(__half2float(h)); }
inline unsigned long long __half2ull_rz(__half h) {
  return gl_sim_num::float_to_int_rz<unsigned long long>(__half2float(h));
}
inline short __half2short_rz(__half h) { return gl_sim_num::float_to_int_rz<short>(__half2float(h)); }
inline unsigned short __half2ushort_rz(__half h) {
  return gl_sim_num::float_to_int_rz<unsigned short>(__half2float(h));
}

/* pairs */
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__float2half_rn(a), __float2half_rn(b)); }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline float2 __half22float2(__half2 v) { return make_float2(__half2float(v.x), __half2float(v.y)); }
inline float __low2float(__half2 v) { return __half2float(v.x); }
inline float __high2float(__half2 v) { return __half2float(v.y); }
inline __half __low2half(__half2 v) { return v.x; }
inline __half __high2half(__half2 v) { return v.y; }

/* arithmetic: computed in float, rounded once to half */
inline __half __hadd(__half a, __half b) { return __float2half_rn(__half2float(a) + __half2float(b)); }
inline __half __hsub(__half a, __half b) { return __float2half_rn(__half2float(a) - __half2float(b)); }
inline __half __hmul(__half a, __half b) { return __float2half_rn(__half2float(a) * __half2float(b)); }
inline __half __hdiv(__half a, __half b) { return __float2half_rn(__half2float(a) / __half2float(b)); }
inline __half __hneg(__half a) { return __ushort_as_half(__half_as_ushort(a) ^ 0x8000); }
inline __half __habs(__half a) { return __ushort_as_half(__half_as_ushort(a) & 0x7fff); }
inline bool __hisnan(__half a) { return (__half_as_ushort(a) & 0x7fff) > 0x7c00; }
/* -1 for -inf, 1 for +inf, else 0 */
inline int __hisinf(__half a) {
  unsigned short b = __half_as_ushort(a);
  return b == 0xfc00 ? -1 : b == 0x7c00 ? 1 : 0;
}
/* max / min: a NaN operand yields the other one (two NaNs: the canonical
   NaN); +0 counts as larger than -0 */
inline __half __hmax(__half a, __half b) {
  if (__hisnan(a)) return __hisnan(b) ? __ushort_as_half(0x7fff) : b;
  if (__hisnan(b)) return a;
  float fa = __half2float(a), fb = __half2float(b);
  if (fa == fb) return (__half_as_ushort(a) & 0x8000) ? b : a;
  return fa > fb ? a : b;
}
inline __half __hmin(__half a, __half b) {
  if (__hisnan(a)) return __hisnan(b) ? __ushort_as_half(0x7fff) : b;
  if (__hisnan(b)) return a;
  float fa = __half2float(a), fb = __half2float(b);
  if (fa == fb) return (__half_as_ushort(a) & 0x8000) ? a : b;
  return fa < fb ? a : b;
}
/* comparisons: the ordered ones are false when either is NaN; __hneu is true */
inline bool __heq(__half a, __half b) { return __half2float(a) == __half2float(b); }
inline bool __hne(__half a, __half b) { return __half2float(a) < __half2float(b) || __half2float(a) > __half2float(b); }
inline bool __hneu(__half a, __half b) { return !(__half2float(a) == __half2float(b)); }
inline bool __hlt(__half a, __half b) { return __half2float(a) < __half2float(b); }
inline bool __hle(__half a, __half b) { return __half2float(a) <= __half2float(b); }
inline bool __hgt(__half a, __half b) { return __half2float(a) > __half2float(b); }
inline bool __hge(__half a, __half b) { return __half2float(a) >= __half2float(b); }

/* operators, as the toolkit defines them for sm_53 and later */
inline __half operator+(const __half &a, const __half &b) { return __hadd(a, b); }
inline __half operator-(const __half &a, const __half &b) { return __hsub(a, b); }
inline __half operator*(const __half &a, const __half &b) { return __hmul(a, b); }
inline __half operator/(const __half &a, const __half &b) { return __hdiv(a, b); }
inline __half &operator+=(__half &a, const __half &b) { a = __hadd(a, b); return a; }
inline __half &operator-=(__half &a, const __half &b) { a = __hsub(a, b); return a; }
inline __half &operator*=(__half &a, const __half &b) { a = __hmul(a, b); return a; }
inline __half &operator/=(__half &a, const __half &b) { a = __hdiv(a, b); return a; }
inline __half operator+(const __half &a) { return a; }
inline __half operator-(const __half &a) { return __hneg(a); }
inline __half &operator++(__half &a) { a = __hadd(a, __ushort_as_half(0x3c00)); return a; }
inline __half &operator--(__half &a) { a = __hsub(a, __ushort_as_half(0x3c00)); return a; }
inline __half operator++(__half &a, int) { __half old = a; ++a; return old; }
inline __half operator--(__half &a, int) { __half old = a; --a; return old; }
inline bool operator==(const __half &a, const __half &b) { return __heq(a, b); }
inline bool operator!=(const __half &a, const __half &b) { return __hneu(a, b); }
inline bool operator<(const __half &a, const __half &b) { return __hlt(a, b); }
inline bool operator<=(const __half &a, const __half &b) { return __hle(a, b); }
inline bool operator>(const __half &a, const __half &b) { return __hgt(a, b); }
inline bool operator>=(const __half &a, const __half &b) { return __hge(a, b); }

/* ---- device functions on __half ----------------------------------------- */
/* warp shuffles (the bits move unchanged; rules as device.h's) */
inline __half __shfl_sync(unsigned mask, __half var, int src_lane, int width = 32,
                          const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_IDX, mask, __half_as_ushort(var), src_lane, width, file, line);
  return __ushort_as_half((unsigned short)bits);
}
inline __half __shfl_up_sync(unsigned mask, __half var, unsigned delta, int width = 32,
                             const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_UP, mask, __half_as_ushort(var), (int)delta, width, file, line);
  return __ushort_as_half((unsigned short)bits);
}
inline __half __shfl_down_sync(unsigned mask, __half var, unsigned delta, int width = 32,
                               const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_DOWN, mask, __half_as_ushort(var), (int)delta, width, file, line);
  return __ushort_as_half((unsigned short)bits);
}
inline __half __shfl_xor_sync(unsigned mask, __half var, int lane_mask, int width = 32,
                              const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_XOR, mask, __half_as_ushort(var), lane_mask, width, file, line);
  return __ushort_as_half((unsigned short)bits);
}
/* atomicAdd: simulated threads switch only at barriers and collectives, so a
   plain read-modify-write is atomic (as device.h's atomics) */
inline __half atomicAdd(__half *address, __half val) {
  __half old = *address;
  *address = __hadd(old, val);
  return old;
}

#endif
