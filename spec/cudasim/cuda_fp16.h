/* cuda_fp16.h — the CUDA simulator's IEEE half precision type (__half,
 * __half2), the rounding core it shares with cuda_bf16.h and the macro
 * (GL_SIM_16BIT) that defines both types and their functions.
 *
 * Part of the CUDA simulator (spec/cudasim/): the kernels/ sources compile unchanged
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

/* bit patterns of +inf and of 1 in a 16-bit format */
constexpr uint16_t inf_bits(int ebits, int mbits) { return (uint16_t)(((1u << ebits) - 1) << mbits); }
constexpr uint16_t one_bits(int ebits, int mbits) { return (uint16_t)(((1u << (ebits - 1)) - 1) << mbits); }

}  // namespace gl_sim_num

/* ---- GL_SIM_16BIT: what __half and __nv_bfloat16 share ----------------- */
/* GL_SIM_16BIT(T, N, EBITS, MBITS) defines the 16-bit type T (its name in the
   toolkit: __half, __nv_bfloat16) with EBITS exponent and MBITS mantissa
   bits, its raw structs T_raw / T2_raw, its pair T2 and every function the
   two types share, named as the toolkit names them after N (half,
   bfloat16): __N_as_ushort, __float2N_rz / _rd / _ru, __double2N,
   __ll2N_rn ..., __N2int_rz ..., __halves2N2, __hadd ..., __hmax, the
   comparisons, the operators (as the toolkit defines them for sm_53 (half)
   and sm_80 (bfloat16) and later), the shuffles and atomicAdd.  Each header
   then defines the two conversions that differ: __float2N_rn and __N2float.
   Arithmetic computes in float and rounds once to T.  Shuffles move the
   bits unchanged (rules as device.h's); atomicAdd is a plain
   read-modify-write, atomic because simulated threads switch only at
   barriers and collectives (as device.h's atomics). */
#define GL_SIM_16BIT(T, N, EBITS, MBITS)                                                                      \
  /* the raw bits, as the toolkit's T_raw */                                                                  \
  struct T##_raw { unsigned short x; };                                                                       \
  struct T##2_raw { unsigned short x, y; };                                                                   \
                                                                                                              \
  struct T;                                                                                                   \
  inline T __float2##N##_rn(float f);                                                                         \
  inline T __double2##N(double d);                                                                            \
  inline float __##N##2float(T h);                                                                            \
  inline T __ll2##N##_rn(long long v);                                                                        \
  inline T __ull2##N##_rn(unsigned long long v);                                                              \
                                                                                                              \
  struct alignas(2) T {                                                                                       \
   protected:                                                                                                 \
    unsigned short __x;                                                                                       \
                                                                                                              \
   public:                                                                                                    \
    T() = default; /* trivial: usable in shared arrays and unions */                                          \
    T(const T##_raw &r) { __x = r.x; }                                                                        \
    T &operator=(const T##_raw &r) { __x = r.x; return *this; }                                               \
    operator T##_raw() const { T##_raw r; r.x = __x; return r; }                                              \
    /* construction from numbers rounds to nearest even */                                                    \
    T(float f) { *this = __float2##N##_rn(f); }                                                               \
    T(double d) { *this = __double2##N(d); }                                                                  \
    T(short v) { *this = __ll2##N##_rn(v); }                                                                  \
    T(unsigned short v) { *this = __ull2##N##_rn(v); }                                                        \
    T(int v) { *this = __ll2##N##_rn(v); }                                                                    \
    T(unsigned int v) { *this = __ull2##N##_rn(v); }                                                          \
    T(long v) { *this = __ll2##N##_rn(v); }                                                                   \
    T(unsigned long v) { *this = __ull2##N##_rn(v); }                                                         \
    T(long long v) { *this = __ll2##N##_rn(v); }                                                              \
    T(unsigned long long v) { *this = __ull2##N##_rn(v); }                                                    \
    operator float() const { return __##N##2float(*this); }                                                   \
    /* to integers: toward zero, saturating, NaN -> 0 */                                                      \
    explicit operator short() const { return gl_sim_num::float_to_int_rz<short>(__##N##2float(*this)); }      \
    explicit operator unsigned short() const {                                                                \
      return gl_sim_num::float_to_int_rz<unsigned short>(__##N##2float(*this));                               \
    }                                                                                                         \
    explicit operator int() const { return gl_sim_num::float_to_int_rz<int>(__##N##2float(*this)); }          \
    explicit operator unsigned int() const {                                                                  \
      return gl_sim_num::float_to_int_rz<unsigned int>(__##N##2float(*this));                                 \
    }                                                                                                         \
    explicit operator long long() const { return gl_sim_num::float_to_int_rz<long long>(__##N##2float(*this)); } \
    explicit operator unsigned long long() const {                                                            \
      return gl_sim_num::float_to_int_rz<unsigned long long>(__##N##2float(*this));                           \
    }                                                                                                         \
    explicit operator bool() const { return (__x & 0x7fff) != 0; }                                           \
  };                                                                                                          \
                                                                                                              \
  struct alignas(4) T##2 {                                                                                    \
    T x, y;                                                                                                   \
    T##2() = default;                                                                                         \
    T##2(const T &a, const T &b) : x(a), y(b) {}                                                              \
    T##2(const T##2_raw &r) { x = T##_raw{r.x}; y = T##_raw{r.y}; }                                           \
    operator T##2_raw() const { return T##2_raw{T##_raw(x).x, T##_raw(y).x}; }                                \
  };                                                                                                          \
                                                                                                              \
  /* bits <-> T */                                                                                            \
  inline unsigned short __##N##_as_ushort(T h) { return T##_raw(h).x; }                                       \
  inline T __ushort_as_##N(unsigned short u) { return T(T##_raw{u}); }                                        \
  inline short __##N##_as_short(T h) { return (short)T##_raw(h).x; }                                         \
  inline T __short_as_##N(short s) { return T(T##_raw{(unsigned short)s}); }                                  \
                                                                                                              \
  /* float / double -> T in the other rounding modes */                                                       \
  inline T __float2##N(float f) { return __float2##N##_rn(f); }                                               \
  inline T __float2##N##_rz(float f) {                                                                        \
    return __ushort_as_##N(gl_sim_num::float_to_16(f, EBITS, MBITS, gl_sim_num::ROUND_TOWARD_ZERO));          \
  }                                                                                                           \
  inline T __float2##N##_rd(float f) {                                                                        \
    return __ushort_as_##N(gl_sim_num::float_to_16(f, EBITS, MBITS, gl_sim_num::ROUND_DOWN));                 \
  }                                                                                                           \
  inline T __float2##N##_ru(float f) {                                                                        \
    return __ushort_as_##N(gl_sim_num::float_to_16(f, EBITS, MBITS, gl_sim_num::ROUND_UP));                   \
  }                                                                                                           \
  inline T __double2##N(double d) {                                                                           \
    return __ushort_as_##N(gl_sim_num::double_to_16(d, EBITS, MBITS, gl_sim_num::ROUND_NEAREST_EVEN));        \
  }                                                                                                           \
                                                                                                              \
  /* integers <-> T */                                                                                        \
  inline T __ll2##N##_rn(long long v) {                                                                       \
    return __ushort_as_##N(gl_sim_num::int_to_16(v, EBITS, MBITS, gl_sim_num::ROUND_NEAREST_EVEN));           \
  }                                                                                                           \
  inline T __ull2##N##_rn(unsigned long long v) {                                                             \
    return __ushort_as_##N(gl_sim_num::uint_to_16(v, EBITS, MBITS, gl_sim_num::ROUND_NEAREST_EVEN));          \
  }                                                                                                           \
  inline T __int2##N##_rn(int v) { return __ll2##N##_rn(v); }                                                 \
  inline T __uint2##N##_rn(unsigned int v) { return __ull2##N##_rn(v); }                                      \
  inline T __short2##N##_rn(short v) { return __ll2##N##_rn(v); }                                             \
  inline T __ushort2##N##_rn(unsigned short v) { return __ull2##N##_rn(v); }                                  \
  inline int __##N##2int_rz(T h) { return gl_sim_num::float_to_int_rz<int>(__##N##2float(h)); }               \
  inline unsigned int __##N##2uint_rz(T h) {                                                                  \
    return gl_sim_num::float_to_int_rz<unsigned int>(__##N##2float(h));                                      \
  }                                                                                                           \
  inline long long __##N##2ll_rz(T h) { return gl_sim_num::float_to_int_rz<long long>(__##N##2float(h)); }    \
  inline unsigned long long __##N##2ull_rz(T h) {                                                             \
    return gl_sim_num::float_to_int_rz<unsigned long long>(__##N##2float(h));                                 \
  }                                                                                                           \
  inline short __##N##2short_rz(T h) { return gl_sim_num::float_to_int_rz<short>(__##N##2float(h)); }         \
  inline unsigned short __##N##2ushort_rz(T h) {                                                              \
    return gl_sim_num::float_to_int_rz<unsigned short>(__##N##2float(h));                                    \
  }                                                                                                           \
                                                                                                              \
  /* pairs */                                                                                                 \
  inline T##2 __halves2##N##2(T a, T b) { return T##2(a, b); }                                                \
  inline T##2 __floats2##N##2_rn(float a, float b) { return T##2(__float2##N##_rn(a), __float2##N##_rn(b)); } \
  inline T##2 __float22##N##2_rn(float2 v) { return __floats2##N##2_rn(v.x, v.y); }                           \
  inline float2 __##N##22float2(T##2 v) { return make_float2(__##N##2float(v.x), __##N##2float(v.y)); }       \
  inline float __low2float(T##2 v) { return __##N##2float(v.x); }                                             \
  inline float __high2float(T##2 v) { return __##N##2float(v.y); }                                            \
  inline T __low2##N(T##2 v) { return v.x; }                                                                  \
  inline T __high2##N(T##2 v) { return v.y; }                                                                 \
                                                                                                              \
  /* arithmetic: computed in float, rounded once to T */                                                      \
  inline T __hadd(T a, T b) { return __float2##N##_rn(__##N##2float(a) + __##N##2float(b)); }                 \
  inline T __hsub(T a, T b) { return __float2##N##_rn(__##N##2float(a) - __##N##2float(b)); }                 \
  inline T __hmul(T a, T b) { return __float2##N##_rn(__##N##2float(a) * __##N##2float(b)); }                 \
  inline T __hdiv(T a, T b) { return __float2##N##_rn(__##N##2float(a) / __##N##2float(b)); }                 \
  inline T __hneg(T a) { return __ushort_as_##N(__##N##_as_ushort(a) ^ 0x8000); }                             \
  inline T __habs(T a) { return __ushort_as_##N(__##N##_as_ushort(a) & 0x7fff); }                             \
  inline bool __hisnan(T a) { return (__##N##_as_ushort(a) & 0x7fff) > gl_sim_num::inf_bits(EBITS, MBITS); }  \
  /* -1 for -inf, 1 for +inf, else 0 */                                                                       \
  inline int __hisinf(T a) {                                                                                  \
    unsigned short b = __##N##_as_ushort(a);                                                                  \
    return b == (0x8000 | gl_sim_num::inf_bits(EBITS, MBITS)) ? -1 : b == gl_sim_num::inf_bits(EBITS, MBITS) ? 1 : 0; \
  }                                                                                                           \
  /* max / min: a NaN operand yields the other one (two NaNs: the canonical                                   \
     NaN); +0 counts as larger than -0 */                                                                     \
  inline T __hmax(T a, T b) {                                                                                 \
    if (__hisnan(a)) return __hisnan(b) ? __ushort_as_##N(0x7fff) : b;                                        \
    if (__hisnan(b)) return a;                                                                                \
    float fa = __##N##2float(a), fb = __##N##2float(b);                                                       \
    if (fa == fb) return (__##N##_as_ushort(a) & 0x8000) ? b : a;                                             \
    return fa > fb ? a : b;                                                                                   \
  }                                                                                                           \
  inline T __hmin(T a, T b) {                                                                                 \
    if (__hisnan(a)) return __hisnan(b) ? __ushort_as_##N(0x7fff) : b;                                        \
    if (__hisnan(b)) return a;                                                                                \
    float fa = __##N##2float(a), fb = __##N##2float(b);                                                       \
    if (fa == fb) return (__##N##_as_ushort(a) & 0x8000) ? a : b;                                             \
    return fa < fb ? a : b;                                                                                   \
  }                                                                                                           \
  /* comparisons: the ordered ones are false when either is NaN; __hneu is true */                            \
  inline bool __heq(T a, T b) { return __##N##2float(a) == __##N##2float(b); }                                \
  inline bool __hne(T a, T b) { return __##N##2float(a) < __##N##2float(b) || __##N##2float(a) > __##N##2float(b); } \
  inline bool __hneu(T a, T b) { return !(__##N##2float(a) == __##N##2float(b)); }                            \
  inline bool __hlt(T a, T b) { return __##N##2float(a) < __##N##2float(b); }                                 \
  inline bool __hle(T a, T b) { return __##N##2float(a) <= __##N##2float(b); }                                \
  inline bool __hgt(T a, T b) { return __##N##2float(a) > __##N##2float(b); }                                 \
  inline bool __hge(T a, T b) { return __##N##2float(a) >= __##N##2float(b); }                                \
                                                                                                              \
  /* operators */                                                                                             \
  inline T operator+(const T &a, const T &b) { return __hadd(a, b); }                                         \
  inline T operator-(const T &a, const T &b) { return __hsub(a, b); }                                         \
  inline T operator*(const T &a, const T &b) { return __hmul(a, b); }                                         \
  inline T operator/(const T &a, const T &b) { return __hdiv(a, b); }                                         \
  inline T &operator+=(T &a, const T &b) { a = __hadd(a, b); return a; }                                      \
  inline T &operator-=(T &a, const T &b) { a = __hsub(a, b); return a; }                                      \
  inline T &operator*=(T &a, const T &b) { a = __hmul(a, b); return a; }                                      \
  inline T &operator/=(T &a, const T &b) { a = __hdiv(a, b); return a; }                                      \
  inline T operator+(const T &a) { return a; }                                                                \
  inline T operator-(const T &a) { return __hneg(a); }                                                        \
  inline T &operator++(T &a) { a = __hadd(a, __ushort_as_##N(gl_sim_num::one_bits(EBITS, MBITS))); return a; } \
  inline T &operator--(T &a) { a = __hsub(a, __ushort_as_##N(gl_sim_num::one_bits(EBITS, MBITS))); return a; } \
  inline T operator++(T &a, int) { T old = a; ++a; return old; }                                              \
  inline T operator--(T &a, int) { T old = a; --a; return old; }                                              \
  inline bool operator==(const T &a, const T &b) { return __heq(a, b); }                                      \
  inline bool operator!=(const T &a, const T &b) { return __hneu(a, b); }                                     \
  inline bool operator<(const T &a, const T &b) { return __hlt(a, b); }                                       \
  inline bool operator<=(const T &a, const T &b) { return __hle(a, b); }                                      \
  inline bool operator>(const T &a, const T &b) { return __hgt(a, b); }                                       \
  inline bool operator>=(const T &a, const T &b) { return __hge(a, b); }                                      \
                                                                                                              \
  /* device functions: warp shuffles, atomicAdd */                                                            \
  inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32, const char *file = __builtin_FILE(), \
                       int line = __builtin_LINE()) {                                                         \
    uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_IDX, mask, __##N##_as_ushort(var), src_lane, width, file, line);  \
    return __ushort_as_##N((unsigned short)bits);                                                             \
  }                                                                                                           \
  inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,                               \
                          const char *file = __builtin_FILE(), int line = __builtin_LINE()) {                 \
    uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_UP, mask, __##N##_as_ushort(var), (int)delta, width, file, line); \
    return __ushort_as_##N((unsigned short)bits);                                                             \
  }                                                                                                           \
  inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,                             \
                            const char *file = __builtin_FILE(), int line = __builtin_LINE()) {               \
    uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_DOWN, mask, __##N##_as_ushort(var), (int)delta, width, file, line); \
    return __ushort_as_##N((unsigned short)bits);                                                             \
  }                                                                                                           \
  inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,                               \
                           const char *file = __builtin_FILE(), int line = __builtin_LINE()) {                \
    uint64_t bits = gl_sim_shfl(GL_SIM_SHFL_XOR, mask, __##N##_as_ushort(var), lane_mask, width, file, line); \
    return __ushort_as_##N((unsigned short)bits);                                                             \
  }                                                                                                           \
  inline T atomicAdd(T *address, T val) {                                                                     \
    T old = *address;                                                                                         \
    *address = __hadd(old, val);                                                                              \
    return old;                                                                                               \
  }

/* ---- __half -------------------------------------------------------------- */
GL_SIM_16BIT(__half, half, 5, 10)
typedef __half half;
typedef __half2 half2;

/* float -> half, nearest even */
inline __half __float2half_rn(float f) {
  return __ushort_as_half(gl_sim_num::float_to_16(f, 5, 10, gl_sim_num::ROUND_NEAREST_EVEN));
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

#endif
