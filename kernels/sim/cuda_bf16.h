/* cuda_bf16.h — the CUDA simulator's bfloat16 type (__nv_bfloat16,
 * __nv_bfloat162).
 *
 * Part of the CUDA simulator (kernels/sim/): the kernels/ sources compile unchanged
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
#include "cuda_fp16.h"

/* the raw bits, as the toolkit's __nv_bfloat16_raw */
struct __nv_bfloat16_raw { unsigned short x; };
struct __nv_bfloat162_raw { unsigned short x, y; };

struct __nv_bfloat16;
inline __nv_bfloat16 __float2bfloat16_rn(float f);
inline __nv_bfloat16 __double2bfloat16(double d);
inline float __bfloat162float(__nv_bfloat16 h);
inline __nv_bfloat16 __ll2bfloat16_rn(long long v);
inline __nv_bfloat16 __ull2bfloat16_rn(unsigned long long v);

struct alignas(2) __nv_bfloat16 {
 protected:
  unsigned short __x;

 public:
  __nv_bfloat16() = default;  /* trivial: usable in shared arrays and unions */
  __nv_bfloat16(const __nv_bfloat16_raw &r) { __x = r.x; }
  __nv_bfloat16 &operator=(const __nv_bfloat16_raw &r) { __x = r.x; return *this; }
  operator __nv_bfloat16_raw() const { __nv_bfloat16_raw r; r.x = __x; return r; }
  /* construction from numbers rounds to nearest even */
  __nv_bfloat16(float f) { *this = __float2bfloat16_rn(f); }
  __nv_bfloat16(double d) { *this = __double2bfloat16(d); }
  __nv_bfloat16(short v) { *this = __ll2bfloat16_rn(v); }
  __nv_bfloat16(unsigned short v) { *this = __ull2bfloat16_rn(v); }
  __nv_bfloat16(int v) { *this = __ll2bfloat16_rn(v); }
  __nv_bfloat16(unsigned int v) { *this = __ull2bfloat16_rn(v); }
  __nv_bfloat16(long v) { *this = __ll2bfloat16_rn(v); }
  __nv_bfloat16(unsigned long v) { *this = __ull2bfloat16_rn(v); }
  __nv_bfloat16(long long v) { *this = __ll2bfloat16_rn(v); }
  __nv_bfloat16(unsigned long long v) { *this = __ull2bfloat16_rn(v); }
  operator float() const { return __bfloat162float(*this); }
  /* to integers: toward zero, saturating, NaN -> 0 */
  explicit operator short() const { return gl_sim_num::float_to_int_rz<short>(__bfloat162float(*this)); }
  explicit operator unsigned short() const {
    return gl_sim_num::float_to_int_rz<unsigned short>(__bfloat162float(*this));
  }
  explicit operator int() const { return gl_sim_num::float_to_int_rz<int>(__bfloat162float(*this)); }
  explicit operator unsigned int() const { return gl_sim_num::float_to_int_rz<unsigned int>(__bfloat162float(*this)); }
  explicit operator long long() const { return gl_sim_num::float_to_int_rz<long long>(__bfloat162float(*this)); }
  explicit operator unsigned long long() const {
    return gl_sim_num::float_to_int_rz<unsigned long long>(__bfloat162float(*this));
  }
  explicit operator bool() const { return (__x & 0x7fff) != 0; }
};
typedef __nv_bfloat16 nv_bfloat16;

struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  __nv_bfloat162(const __nv_bfloat16 &a, const __nv_bfloat16 &b) : x(a), y(b) {}
  __nv_bfloat162(const __nv_bfloat162_raw &r) { x = __nv_bfloat16_raw{r.x}; y = __nv_bfloat16_raw{r.y}; }
  operator __nv_bfloat162_raw() const { return __nv_bfloat162_raw{__nv_bfloat16_raw(x).x, __nv_bfloat16_raw(y).x}; }
};
typedef __nv_bfloat162 nv_bfloat162;

/* bits <-> bfloat16 */
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return __nv_bfloat16_raw(h).x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16(__nv_bfloat16_raw{u}); }
inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)__nv_bfloat16_raw(h).x; }
inline __nv_bfloat16 __short_as_bfloat16(short s) { return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)s}); }

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
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  return __ushort_as_bfloat16(gl_sim_num::float_to_16(f, 8, 7, gl_sim_num::ROUND_TOWARD_ZERO));
}
inline __nv_bfloat16 __float2bfloat16_rd(float f) {
  return __ushort_as_bfloat16(gl_sim_num::float_to_16(f, 8, 7, gl_sim_num::ROUND_DOWN));
}
inline __nv_bfloat16 __float2bfloat16_ru(float f) {
  return __ushort_as_bfloat16(gl_sim_num::float_to_16(f, 8, 7, gl_sim_num::ROUND_UP));
}
inline __nv_bfloat16 __double2bfloat16(double d) {
  return __ushort_as_bfloat16(gl_sim_num::double_to_16(d, 8, 7, gl_sim_num::ROUND_NEAREST_EVEN));
}

/* bfloat16 -> float: exact */
inline float __bfloat162float(__nv_bfloat16 h) {
  return gl_sim_num::bits_float((uint32_t)__bfloat16_as_ushort(h) << 16);
}

/* integers <-> bfloat16 */
inline __nv_bfloat16 __ll2bfloat16_rn(long long v) {
  return __ushort_as_bfloat16(gl_sim_num::int_to_16(v, 8, 7, gl_sim_num::ROUND_NEAREST_EVEN));
}
inline __nv_bfloat16 __ull2bfloat16_rn(unsigned long long v) {
  return __ushort_as_bfloat16(gl_sim_num::uint_to_16(v, 8, 7, gl_sim_num::ROUND_NEAREST_EVEN));
}
inline __nv_bfloat16 __int2bfloat16_rn(int v) { return __ll2bfloat16_rn(v); }
inline __nv_bfloat16 __uint2bfloat16_rn(unsigned int v) { return __ull2bfloat16_rn(v); }
inline __nv_bfloat16 __short2bfloat16_rn(short v) { return __ll2bfloat16_rn(v); }
inline __nv_bfloat16 __ushort2bfloat16_rn(unsigned short v) { return __ull2bfloat16_rn(v); }
inline int __bfloat162int_rz(__nv_bfloat16 h) { return gl_sim_num::float_to_int_rz<int>(__bfloat162float(h)); }
inline unsigned int __bfloat162uint_rz(__nv_bfloat16 h) {
  return gl_sim_num::float_to_int_rz<unsigned int>(__bfloat162float(h));
}
inline long long __bfloat162ll_rz(__nv_bfloat16 h) {
  return gl_sim_num::float_to_int_rz<long long>(__bfloat162float(h));
}
inline unsigned long long __bfloat162ull_rz(__nv_bfloat16 h) {
  return gl_sim_num::float_to_int_rz<unsigned long long>(__bfloat162float(h));
}
inline short __bfloat162short_rz(__nv_bfloat16 h) { return gl_sim_num::float_to_int_rz<short>(__bfloat162float(h)); }
inline unsigned short __bfloat162ushort_rz(__nv_bfloat16 h) {
  return gl_sim_num::float_to_int_rz<unsigned short>(__bfloat162float(h));
}

/* pairs */
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat162(a, b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return make_float2(__bfloat162float(v.x), __bfloat162float(v.y)); }
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }

/* arithmetic: computed in float, rounded once to bfloat16 */
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
}
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) - __bfloat162float(b));
}
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) * __bfloat162float(b));
}
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(__bfloat162float(a) / __bfloat162float(b));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __ushort_as_bfloat16(__bfloat16_as_ushort(a) ^ 0x8000); }
inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __ushort_as_bfloat16(__bfloat16_as_ushort(a) & 0x7fff); }
inline bool __hisnan(__nv_bfloat16 a) { return (__bfloat16_as_ushort(a) & 0x7fff) > 0x7f80; }
/* -1 for -inf, 1 for +inf, else 0 */
inline int __hisinf(__nv_bfloat16 a) {
  unsigned short b = __bfloat16_as_ushort(a);
  return b == 0xff80 ? -1 : b == 0x7f80 ? 1 : 0;
}
/* max / min: a NaN operand yields the other one (two NaNs: the canonical
   NaN); +0 counts as larger than -0 */
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) {
  if (__hisnan(a)) return __hisnan(b) ? __ushort_as_bfloat16(0x7fff) : b;
  if (__hisnan(b)) return a;
  float fa = __bfloat162float(a), fb = __bfloat162float(b);
  if (fa == fb) return (__bfloat16_as_ushort(a) & 0x8000) ? b : a;
  return fa > fb ? a : b;
}
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) {
  if (__hisnan(a)) return __hisnan(b) ? __ushort_as_bfloat16(0x7fff) : b;
  if (__hisnan(b)) return a;
  float fa = __bfloat162float(a), fb = __bfloat162float(b);
  if (fa == fb) return (__bfloat16_as_ushort(a) & 0x8000) ? a : b;
  return fa < fb ? a : b;
}
/* comparisons: the ordered ones are false when either is NaN; __hneu is true */
inline bool __heq(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) == __bfloat162float(b); }
inline bool __hne(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __bfloat162float(a) < __bfloat162float(b) || __bfloat162float(a) > __bfloat162float(b);
}
inline bool __hneu(__nv_bfloat16 a, __nv_bfloat16 b) { return !(__bfloat162float(a) == __bfloat162float(b)); }
inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) < __bfloat162float(b); }
inline bool __hle(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) <= __bfloat162float(b); }
inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) > __bfloat162float(b); }
inline bool __hge(__nv_bfloat16 a, __nv_bfloat16 b) { return __bfloat162float(a) >= __bfloat162float(b); }

/* operators, as the toolkit defines them for sm_80 and later */
inline __nv_bfloat16 operator+(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hadd(a, b); }
inline __nv_bfloat16 operator-(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hsub(a, b); }
inline __nv_bfloat16 operator*(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hmul(a, b); }
inline __nv_bfloat16 operator/(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hdiv(a, b); }
inline __nv_bfloat16 &operator+=(__nv_bfloat16 &a, const __nv_bfloat16 &b) { a = __hadd(a, b); return a; }
inline __nv_bfloat16 &operator-=(__nv_bfloat16 &a, const __nv_bfloat16 &b) { a = __hsub(a, b); return a; }
inline __nv_bfloat16 &operator*=(__nv_bfloat16 &a, const __nv_bfloat16 &b) { a = __hmul(a, b); return a; }
inline __nv_bfloat16 &operator/=(__nv_bfloat16 &a, const __nv_bfloat16 &b) { a = __hdiv(a, b); return a; }
inline __nv_bfloat16 operator+(const __nv_bfloat16 &a) { return a; }
inline __nv_bfloat16 operator-(const __nv_bfloat16 &a) { return __hneg(a); }
inline __nv_bfloat16 &operator++(__nv_bfloat16 &a) { a = __hadd(a, __ushort_as_bfloat16(0x3f80)); return a; }
inline __nv_bfloat16 &operator--(__nv_bfloat16 &a) { a = __hsub(a, __ushort_as_bfloat16(0x3f80)); return a; }
inline __nv_bfloat16 operator++(__nv_bfloat16 &a, int) { __nv_bfloat16 old = a; ++a; return old; }
inline __nv_bfloat16 operator--(__nv_bfloat16 &a, int) { __nv_bfloat16 old = a; --a; return old; }
inline bool operator==(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __heq(a, b); }
inline bool operator!=(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hneu(a, b); }
inline bool operator<(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hlt(a, b); }
inline bool operator<=(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hle(a, b); }
inline bool operator>(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hgt(a, b); }
inline bool operator>=(const __nv_bfloat16 &a, const __nv_bfloat16 &b) { return __hge(a, b); }

/* ---- device functions on __nv_bfloat16 ---------------------------------- */
/* warp shuffles (the bits move unchanged; rules as device.h's) */
inline __nv_bfloat16 __shfl_sync(unsigned mask, __nv_bfloat16 var, int src_lane, int width = 32,
                                 const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_IDX, mask, __bfloat16_as_ushort(var), src_lane, width, file, line);
  return __ushort_as_bfloat16((unsigned short)bits);
}
inline __nv_bfloat16 __shfl_up_sync(unsigned mask, __nv_bfloat16 var, unsigned delta, int width = 32,
                                    const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_UP, mask, __bfloat16_as_ushort(var), (int)delta, width, file, line);
  return __ushort_as_bfloat16((unsigned short)bits);
}
inline __nv_bfloat16 __shfl_down_sync(unsigned mask, __nv_bfloat16 var, unsigned delta, int width = 32,
                                      const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_DOWN, mask, __bfloat16_as_ushort(var), (int)delta, width, file, line);
  return __ushort_as_bfloat16((unsigned short)bits);
}
inline __nv_bfloat16 __shfl_xor_sync(unsigned mask, __nv_bfloat16 var, int lane_mask, int width = 32,
                                     const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_XOR, mask, __bfloat16_as_ushort(var), lane_mask, width, file, line);
  return __ushort_as_bfloat16((unsigned short)bits);
}
/* atomicAdd (sm_80+): a plain read-modify-write is atomic in the simulator */
inline __nv_bfloat16 atomicAdd(__nv_bfloat16 *address, __nv_bfloat16 val) {
  __nv_bfloat16 old = *address;
  *address = __hadd(old, val);
  return old;
}

#endif
