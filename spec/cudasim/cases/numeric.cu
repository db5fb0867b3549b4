/* numeric.cu — the CUDA simulator's own checks of its numeric types
 * (cuda_bf16.h, cuda_fp16.h); wmma.cu checks its WMMA (mma.h).
 *
 * Built into build/sim/libgptlua_simtest.so; spec/sim_numeric_spec.lua
 * calls the extern "C" entry points below through LuaJIT's ffi.
 *
 *  - Conversions are compared with a reference written independently of
 *    the headers: every finite value of a 16-bit format is decoded field by
 *    field into a table (long double, exact), an input is placed between
 *    two neighbours by binary search and rounded by comparing it with their
 *    exact midpoint.  The headers round with bit arithmetic instead.
 * Failures are printed to stderr, prefixed "gptlua cuda-sim: test_numeric: ". */
#include "common.cuh"
#include "simtest.h"
#include "numeric_harness.h"
#include <stdlib.h>
#include <algorithm>
#include <limits>

/* ---- layout of the types -------------------------------------------------- */
static_assert(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat16) == 2, "bfloat16: 2 bytes, 2-aligned");
static_assert(sizeof(__half) == 2 && alignof(__half) == 2, "half: 2 bytes, 2-aligned");
static_assert(sizeof(__nv_bfloat162) == 4 && alignof(__nv_bfloat162) == 4, "bfloat162: 4 bytes, 4-aligned");
static_assert(sizeof(__half2) == 4 && alignof(__half2) == 4, "half2: 4 bytes, 4-aligned");
static_assert(std::is_trivial<__nv_bfloat16>::value && std::is_standard_layout<__nv_bfloat16>::value,
              "bfloat16 must be trivial and standard-layout (shared arrays, unions)");
static_assert(std::is_trivial<__half>::value && std::is_standard_layout<__half>::value,
              "half must be trivial and standard-layout");
static_assert(std::is_trivial<__nv_bfloat162>::value && std::is_trivial<__half2>::value, "pairs must be trivial");

namespace {

/* a union with the types, as kernels reinterpret 16-byte chunks */
union bf16_chunk { uint4 raw; __nv_bfloat16 h[8]; __half f[8]; };
static_assert(sizeof(bf16_chunk) == 16, "union of 16-bit types");

/* ---- the reference: a 16-bit format as a table of its values ------------- */
enum Mode { RN, RZ, RD, RU, NMODES };
const char *const MODE_NAME[NMODES] = {"rn", "rz", "rd", "ru"};

struct Format {
  const char *name;
  int ebits, mbits;
  unsigned inf_bits;             /* the pattern of +inf */
  std::vector<long double> v;    /* v[p]: the value of pattern p, p in [0, inf_bits); v[inf_bits] = 2^(emax+1) */
  std::vector<double> vd;        /* the same in double (exact), for float inputs */
  std::vector<float> vf;         /* and in float (exact; bfloat16's 2^128 becomes inf), to search */
  std::vector<unsigned> first;   /* first[i]: how many vf are below the float with bits i << 16 (i <= 0x7f81) */

  Format(const char *n, int e, int m) : name(n), ebits(e), mbits(m) {
    inf_bits = ((1u << ebits) - 1) << mbits;
    int bias = (1 << (ebits - 1)) - 1;
    v.resize(inf_bits + 1);
    for (unsigned p = 0; p < inf_bits; p++) {
      unsigned e = p >> mbits, frac = p & ((1u << mbits) - 1);
      v[p] = e == 0 ? ldexpl((long double)frac, 1 - bias - mbits)
                    : ldexpl((long double)(frac + (1u << mbits)), (int)e - bias - mbits);
    }
    v[inf_bits] = ldexpl(1.0L, bias + 1);  /* where rounding to nearest starts to overflow */
    vd.assign(v.begin(), v.end());
    vf.assign(v.begin(), v.end());
    for (uint32_t i = 0; i <= 0x7f81; i++) {
      float bucket_start = i <= 0x7f80 ? float_of(i << 16) : INFINITY;
      first.push_back((unsigned)(std::lower_bound(vf.begin(), vf.end(), bucket_start) - vf.begin()));
    }
  }

  /* the value of any pattern (NaN patterns: NaN) */
  long double decode(unsigned bits) const {
    unsigned mag = bits & 0x7fff;
    long double x = mag < inf_bits ? v[mag] : mag == inf_bits ? INFINITY : NAN;
    return (bits & 0x8000) ? -x : x;
  }
  bool is_nan(unsigned bits) const { return (bits & 0x7fff) > inf_bits; }

  /* x rounded in every mode (out[RN..RU]); NaN -> 0x7fff */
  void round(long double x, unsigned out[NMODES]) const {
    if (x != x) {
      for (int m = 0; m < NMODES; m++) out[m] = 0x7fff;
      return;
    }
    /* p: the largest pattern whose value is <= |x|, searched from the
       buckets around |x| rounded to float (at most one bucket away) */
    const long double a = fabsl(x);
    const uint32_t i = bits_of((float)a) >> 16;
    const unsigned lo = i > 0 && first[i - 1] > 0 ? first[i - 1] - 1 : 0;
    const unsigned hi = i + 2 < first.size() && first[i + 2] + 1 < v.size() ? first[i + 2] + 1 : v.size();
    unsigned p = (unsigned)(std::upper_bound(v.begin() + lo, v.begin() + hi, a) - v.begin()) - 1;
    round_at(signbit(x) ? 0x8000 : 0, a, p, v, out);
  }
  /* the same for a float input, searching the float table */
  void round(float x, unsigned out[NMODES]) const {
    if (x != x) {
      for (int m = 0; m < NMODES; m++) out[m] = 0x7fff;
      return;
    }
    const float a = fabsf(x);
    /* only the patterns from just below a's bucket (the floats sharing its
       top 16 bits) to its end can be the answer */
    const uint32_t i = bits_of(a) >> 16;
    const unsigned lo = first[i] > 0 ? first[i] - 1 : 0, hi = first[i + 1] + 1 < vf.size() ? first[i + 1] + 1 : vf.size();
    unsigned p = (unsigned)(std::upper_bound(vf.begin() + lo, vf.begin() + hi, a) - vf.begin()) - 1;
    round_at(signbit(x) ? 0x8000 : 0, (double)a, p, vd, out);
  }
  /* |x| = a lies in [tab[p], tab[p + 1]) (tab: v or vd, exact either way) */
  template <class R>
  void round_at(unsigned sign, R a, unsigned p, const std::vector<R> &tab, unsigned out[NMODES]) const {
    const unsigned max_finite = inf_bits - 1;
    if (p == inf_bits) {  /* at or past 2^(emax+1) (inf included): overflow */
      const bool is_inf = a == INFINITY;
      out[RN] = sign | inf_bits;
      out[RZ] = sign | (is_inf ? inf_bits : max_finite);
      out[RU] = sign | (is_inf || !sign ? inf_bits : max_finite);
      out[RD] = sign | (is_inf || sign ? inf_bits : max_finite);
      return;
    }
    if (tab[p] == a) {
      for (int m = 0; m < NMODES; m++) out[m] = sign | p;
      return;
    }
    const unsigned lo = p, hi = p + 1;  /* hi may be inf's pattern: the overflow side */
    const R mid = (tab[lo] + tab[hi]) / 2;
    out[RN] = sign | (a < mid ? lo : a > mid ? hi : (lo % 2 == 0 ? lo : hi));
    out[RZ] = sign | lo;
    out[RU] = sign | (sign ? lo : hi);
    out[RD] = sign | (sign ? hi : lo);
  }
};

const Format &bf16_format() { static const Format f("bfloat16", 8, 7); return f; }
const Format &half_format() { static const Format f("half", 5, 10); return f; }

/* ---- the inputs ---------------------------------------------------------- */
/* Floats on and around every rounding boundary of both formats: each
   finite value, its float neighbours, each midpoint between neighbours and
   its float neighbours (both signs); the specials; then n_random random bit
   patterns (every other one with an exponent in half's range). */
std::vector<float> float_inputs(long n_random, uint64_t seed) {
  std::vector<float> in;
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                               0x7f800001u, 0xff800001u, 0x7fffffffu, 0xffffffffu, 0x7fbfffffu, 0x00000001u,
                               0x80000001u, 0x007fffffu, 0x807fffffu, 0x00800000u, 0x7f7fffffu, 0xff7fffffu};
  for (uint32_t s : specials) in.push_back(float_of(s));
  for (const Format *f : {&bf16_format(), &half_format()}) {
    for (unsigned p = 0; p < f->inf_bits; p++) {
      float lo = (float)f->v[p], mid = (float)((f->v[p] + f->v[p + 1]) / 2);  /* both exact in float */
      for (float c : {lo, mid}) {
        float down = nextafterf(c, -INFINITY), up = nextafterf(c, INFINITY);
        for (float x : {c, down, up, nextafterf(down, -INFINITY), nextafterf(up, INFINITY)}) {
          in.push_back(x);
          in.push_back(-x);
        }
      }
    }
  }
  uint64_t state = seed;
  for (long i = 0; i < n_random; i++) {
    uint32_t u = (uint32_t)next_random(state);
    if (i & 1) u = (u & 0x807fffffu) | ((100u + (uint32_t)(next_random(state) % 46)) << 23);
    in.push_back(float_of(u));
  }
  return in;
}

bool same_result(const Format &f, unsigned got, unsigned want) {
  return got == want || (f.is_nan(got) && f.is_nan(want) && got == 0x7fff);
}

}  // namespace

extern "C" {

/* ---- 16-bit -> float: every pattern -------------------------------------- */
/* bfloat16: exact, NaN payloads kept (the bits shifted up); half: exact,
   NaN -> 0x7fffffff.  Returns the mismatches. */
long gl_simtest_num_16_to_float(void) {
  Failures bad("16-bit -> float");
  for (unsigned b = 0; b < 65536; b++) {
    float got = __bfloat162float(__ushort_as_bfloat16((unsigned short)b));
    float want = bf16_format().is_nan(b) ? float_of(b << 16) : (float)bf16_format().decode(b);
    if (bits_of(got) != bits_of(want)) bad.add("bfloat16 0x%04x -> 0x%08x, expected 0x%08x", b, bits_of(got), bits_of(want));
    float implicit = __ushort_as_bfloat16((unsigned short)b);  /* operator float */
    if (bits_of(implicit) != bits_of(got)) bad.add("bfloat16 0x%04x: operator float differs", b);

    got = __half2float(__ushort_as_half((unsigned short)b));
    want = half_format().is_nan(b) ? float_of(0x7fffffffu) : (float)half_format().decode(b);
    if (bits_of(got) != bits_of(want)) bad.add("half 0x%04x -> 0x%08x, expected 0x%08x", b, bits_of(got), bits_of(want));
    implicit = __ushort_as_half((unsigned short)b);
    if (bits_of(implicit) != bits_of(got)) bad.add("half 0x%04x: operator float differs", b);
  }
  return bad.count;
}

/* ---- float -> 16-bit: boundaries, specials and n_random samples ---------- */
/* Every conversion function and constructor in every mode, against the
   reference.  *checked receives the number of float inputs. */
long gl_simtest_num_float_to_16(long n_random, unsigned seed, long *checked) {
  Failures bad("float -> 16-bit");
  std::vector<float> in = float_inputs(n_random, seed);
  const Format &B = bf16_format(), &H = half_format();
  for (float x : in) {
    unsigned want[NMODES], got[NMODES];
    B.round(x, want);
    got[RN] = __bfloat16_as_ushort(__float2bfloat16(x));
    got[RZ] = __bfloat16_as_ushort(__float2bfloat16_rz(x));
    got[RD] = __bfloat16_as_ushort(__float2bfloat16_rd(x));
    got[RU] = __bfloat16_as_ushort(__float2bfloat16_ru(x));
    for (int m = 0; m < NMODES; m++)
      if (!same_result(B, got[m], want[m]))
        bad.add("bfloat16 %s of 0x%08x (%.9g): 0x%04x, expected 0x%04x", MODE_NAME[m], bits_of(x), x, got[m], want[m]);
    unsigned rn = __bfloat16_as_ushort(__float2bfloat16_rn(x)), ctor = __bfloat16_as_ushort(__nv_bfloat16(x));
    if (rn != got[RN] || ctor != got[RN]) bad.add("bfloat16 of 0x%08x: _rn / constructor differ from __float2bfloat16", bits_of(x));

    H.round(x, want);
    got[RN] = __half_as_ushort(__float2half(x));
    got[RZ] = __half_as_ushort(__float2half_rz(x));
    got[RD] = __half_as_ushort(__float2half_rd(x));
    got[RU] = __half_as_ushort(__float2half_ru(x));
    for (int m = 0; m < NMODES; m++)
      if (!same_result(H, got[m], want[m]))
        bad.add("half %s of 0x%08x (%.9g): 0x%04x, expected 0x%04x", MODE_NAME[m], bits_of(x), x, got[m], want[m]);
    rn = __half_as_ushort(__float2half_rn(x));
    ctor = __half_as_ushort(__half(x));
    if (rn != got[RN] || ctor != got[RN]) bad.add("half of 0x%08x: _rn / constructor differ from __float2half", bits_of(x));
  }
  *checked = (long)in.size();
  return bad.count;
}

/* ---- double -> 16-bit: one rounding ------------------------------------- */
/* Doubles just off every midpoint (where rounding through float first
   would land on the midpoint and round the wrong way), on and around every
   value, and n_random random ones.  *checked receives the count. */
long gl_simtest_num_double_to_16(long n_random, unsigned seed, long *checked) {
  Failures bad("double -> 16-bit");
  long n = 0;
  auto check = [&](double x) {
    for (const Format *f : {&bf16_format(), &half_format()}) {
      unsigned want[NMODES];
      f->round((long double)x, want);
      bool is_b = f == &bf16_format();
      unsigned got = is_b ? __bfloat16_as_ushort(__double2bfloat16(x)) : __half_as_ushort(__double2half(x));
      unsigned ctor = is_b ? __bfloat16_as_ushort(__nv_bfloat16(x)) : __half_as_ushort(__half(x));
      if (!same_result(*f, got, want[RN]) || ctor != got)
        bad.add("%s of double %.17g: 0x%04x (constructor 0x%04x), expected 0x%04x", f->name, x, got, ctor, want[RN]);
    }
    n++;
  };
  for (double s : {0.0, -0.0, (double)INFINITY, -(double)INFINITY, (double)NAN, 1e-300, -1e-300, 1e300, 4.9e-324})
    check(s);
  for (const Format *f : {&bf16_format(), &half_format()}) {
    for (unsigned p = 0; p < f->inf_bits; p++) {
      double lo = (double)f->v[p], mid = (double)((f->v[p] + f->v[p + 1]) / 2);
      for (double x : {lo, mid, nextafter(mid, -INFINITY), nextafter(mid, INFINITY), mid * (1 + 0x1p-30),
                       mid * (1 - 0x1p-30), nextafter(lo, INFINITY)}) {
        check(x);
        check(-x);
      }
    }
  }
  uint64_t state = seed;
  for (long i = 0; i < n_random; i++) {
    uint64_t u = next_random(state);
    /* exponents within float's range and a little beyond */
    u = (u & 0x800fffffffffffffull) | ((uint64_t)(1023 - 160 + next_random(state) % 300) << 52);
    double x;
    memcpy(&x, &u, 8);
    check(x);
  }
  *checked = n;
  return bad.count;
}

/* ---- integers <-> 16-bit -------------------------------------------------- */
/* integer -> 16-bit (_rn): every 16-bit integer, then 2^k +- small and
   midpoint-plus-one values at every scale, and random ones of every length.
   16-bit -> integer (_rz, saturating, NaN -> 0): every pattern. */
long gl_simtest_num_int_16(unsigned seed, long *checked) {
  Failures bad("integer <-> 16-bit");
  long n = 0;
  auto check_signed = [&](long long x) {
    for (const Format *f : {&bf16_format(), &half_format()}) {
      unsigned want[NMODES];
      f->round((long double)x, want);  /* exact: long double holds 64 bits */
      bool is_b = f == &bf16_format();
      unsigned got[4] = {
          is_b ? __bfloat16_as_ushort(__ll2bfloat16_rn(x)) : __half_as_ushort(__ll2half_rn(x)),
          is_b ? __bfloat16_as_ushort(__nv_bfloat16(x)) : __half_as_ushort(__half(x)),
          x == (int)x ? (is_b ? __bfloat16_as_ushort(__int2bfloat16_rn((int)x)) : __half_as_ushort(__int2half_rn((int)x)))
                      : want[RN],
          x == (short)x ? (is_b ? __bfloat16_as_ushort(__short2bfloat16_rn((short)x))
                                : __half_as_ushort(__short2half_rn((short)x)))
                        : want[RN]};
      for (unsigned g : got)
        if (g != want[RN]) bad.add("%s of integer %lld: 0x%04x, expected 0x%04x", f->name, x, g, want[RN]);
    }
    n++;
  };
  auto check_unsigned = [&](unsigned long long x) {
    for (const Format *f : {&bf16_format(), &half_format()}) {
      unsigned want[NMODES];
      f->round((long double)x, want);
      bool is_b = f == &bf16_format();
      unsigned got[3] = {
          is_b ? __bfloat16_as_ushort(__ull2bfloat16_rn(x)) : __half_as_ushort(__ull2half_rn(x)),
          x == (unsigned)x ? (is_b ? __bfloat16_as_ushort(__uint2bfloat16_rn((unsigned)x))
                                   : __half_as_ushort(__uint2half_rn((unsigned)x)))
                           : want[RN],
          x == (unsigned short)x ? (is_b ? __bfloat16_as_ushort(__ushort2bfloat16_rn((unsigned short)x))
                                         : __half_as_ushort(__ushort2half_rn((unsigned short)x)))
                                 : want[RN]};
      for (unsigned g : got)
        if (g != want[RN]) bad.add("%s of unsigned %llu: 0x%04x, expected 0x%04x", f->name, x, g, want[RN]);
    }
    n++;
  };
  for (long long x = -70000; x <= 70000; x++) check_signed(x);
  /* powers of two, and the midpoints of each format (2^8 + 1 and 2^11 + 1
     scaled: one bit more than bfloat16 / half hold) with neighbours, which
     a conversion through float would round twice */
  for (int k = 0; k < 62; k++)
    for (long long base : {1LL << k, 3LL << (k < 61 ? k : 60), 257LL << (k < 54 ? k : 53), 2049LL << (k < 51 ? k : 50)})
      for (long long d = -2; d <= 2; d++) {
        check_signed(base + d);
        check_signed(-(base + d));
        check_unsigned((unsigned long long)(base + d) << 1);
      }
  check_signed(std::numeric_limits<long long>::min());
  check_signed(std::numeric_limits<long long>::max());
  check_unsigned(~0ull);
  uint64_t state = seed;
  for (int i = 0; i < 200000; i++) {
    uint64_t u = next_random(state) >> (next_random(state) % 64);
    check_signed((long long)u);
    check_unsigned(u);
  }

  /* 16-bit -> integers */
  auto want_int = [](long double v, long double lo, long double hi) -> long double {
    if (v != v) return 0;
    long double t = truncl(v);
    return t < lo ? lo : t > hi ? hi : t;
  };
  for (unsigned b = 0; b < 65536; b++) {
    for (const Format *f : {&bf16_format(), &half_format()}) {
      long double v = f->decode(b);
      bool is_b = f == &bf16_format();
      __nv_bfloat16 hb = __ushort_as_bfloat16((unsigned short)b);
      __half hh = __ushort_as_half((unsigned short)b);
      long double got[6] = {
          (long double)(is_b ? __bfloat162int_rz(hb) : __half2int_rz(hh)),
          (long double)(is_b ? __bfloat162uint_rz(hb) : __half2uint_rz(hh)),
          (long double)(is_b ? __bfloat162ll_rz(hb) : __half2ll_rz(hh)),
          (long double)(is_b ? __bfloat162ull_rz(hb) : __half2ull_rz(hh)),
          (long double)(is_b ? __bfloat162short_rz(hb) : __half2short_rz(hh)),
          (long double)(is_b ? __bfloat162ushort_rz(hb) : __half2ushort_rz(hh))};
      long double want[6] = {
          want_int(v, INT32_MIN, INT32_MAX), want_int(v, 0, UINT32_MAX),
          want_int(v, (long double)INT64_MIN, (long double)INT64_MAX), want_int(v, 0, (long double)UINT64_MAX),
          want_int(v, INT16_MIN, INT16_MAX), want_int(v, 0, UINT16_MAX)};
      for (int i = 0; i < 6; i++)
        if (got[i] != want[i]) bad.add("%s 0x%04x to integer type %d: %Lg, expected %Lg", f->name, b, i, got[i], want[i]);
      int via_operator = is_b ? (int)hb : (int)hh;  /* explicit operator int */
      if (via_operator != (int)got[0]) bad.add("%s 0x%04x: (int) cast differs from _rz", f->name, b);
    }
    n++;
  }
  *checked = n;
  return bad.count;
}

/* ---- arithmetic and comparisons ------------------------------------------ */
}  // extern "C"

namespace {

/* the bit casts of each type, so one template checks both */
unsigned bits16(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
unsigned bits16(__half x) { return __half_as_ushort(x); }
template <class T> T from_bits16(unsigned b);
template <> __nv_bfloat16 from_bits16<__nv_bfloat16>(unsigned b) { return __ushort_as_bfloat16((unsigned short)b); }
template <> __half from_bits16<__half>(unsigned b) { return __ushort_as_half((unsigned short)b); }

/* every operator and intrinsic on the pair of patterns (ab, bb) */
template <class T> void check_arith(const Format &f, unsigned ab, unsigned bb, Failures &bad) {
  const T x = from_bits16<T>(ab), y = from_bits16<T>(bb);
  const long double a = f.decode(ab), b = f.decode(bb);
  /* + - * / against the reference rounding of the exact result */
  const long double exact[4] = {a + b, a - b, a * b, a / b};
  const unsigned ops[4] = {bits16(x + y), bits16(x - y), bits16(x * y), bits16(x / y)};
  for (int i = 0; i < 4; i++) {
    unsigned want[NMODES];
    f.round(exact[i], want);
    if (!same_result(f, ops[i], want[RN]))
      bad.add("%s 0x%04x %c 0x%04x: 0x%04x, expected 0x%04x", f.name, ab, "+-*/"[i], bb, ops[i], want[RN]);
  }
  /* the intrinsics and compound assignments agree with the operators */
  T z[4] = {x, x, x, x};
  z[0] += y;
  z[1] -= y;
  z[2] *= y;
  z[3] /= y;
  const unsigned intr[4] = {bits16(__hadd(x, y)), bits16(__hsub(x, y)), bits16(__hmul(x, y)), bits16(__hdiv(x, y))};
  for (int i = 0; i < 4; i++)
    if (bits16(z[i]) != ops[i] || intr[i] != ops[i])
      bad.add("%s 0x%04x %c 0x%04x: compound / intrinsic differ from the operator", f.name, ab, "+-*/"[i], bb);
  /* comparisons: ordered, except != (and __hneu) */
  const bool cmp[9] = {x == y, x != y, x < y, x <= y, x > y, x >= y, __hne(x, y), __heq(x, y), __hneu(x, y)};
  const bool ref[9] = {a == b, !(a == b), a < b, a <= b, a > b, a >= b, a < b || a > b, a == b, !(a == b)};
  for (int i = 0; i < 9; i++)
    if (cmp[i] != ref[i]) bad.add("%s comparison %d of 0x%04x, 0x%04x: %d", f.name, i, ab, bb, (int)cmp[i]);
  /* max / min: NaN gives the other operand (two NaNs: 0x7fff), +0 > -0 */
  unsigned want_max, want_min;
  const bool na = f.is_nan(ab), nb = f.is_nan(bb);
  if (na || nb) {
    want_max = want_min = na && nb ? 0x7fff : na ? bb : ab;
  } else if (a == b) {
    want_max = (ab & 0x8000) ? bb : ab;
    want_min = (ab & 0x8000) ? ab : bb;
  } else {
    want_max = a > b ? ab : bb;
    want_min = a < b ? ab : bb;
  }
  if (bits16(__hmax(x, y)) != want_max || bits16(__hmin(x, y)) != want_min)
    bad.add("%s max / min of 0x%04x, 0x%04x", f.name, ab, bb);
  if (bits16(-x) != (ab ^ 0x8000) || bits16(__hneg(x)) != (ab ^ 0x8000) || bits16(__habs(x)) != (ab & 0x7fff) ||
      bits16(+x) != ab)
    bad.add("%s neg / abs of 0x%04x", f.name, ab);
  if (__hisnan(x) != (a != a) || __hisinf(x) != (a == INFINITY ? 1 : a == -INFINITY ? -1 : 0))
    bad.add("%s isnan / isinf of 0x%04x", f.name, ab);
}

}  // namespace

extern "C" {

/* n_pairs random operand pairs of each type, and every pattern against a
   few fixed ones and itself: + - * / against the reference rounding of the
   exact (long double) result, the compound, unary and increment operators,
   the intrinsics, comparisons, max / min, abs / neg, isnan / isinf. */
long gl_simtest_num_arith(long n_pairs, unsigned seed) {
  Failures bad("arithmetic");
  uint64_t state = seed;
  for (unsigned b = 0; b < 65536; b++)
    for (unsigned other : {0x0000u, 0x8000u, 0x3c00u, 0x3f80u, 0x7fffu, b ^ 0x8000u, b}) {
      check_arith<__nv_bfloat16>(bf16_format(), b, other, bad);
      check_arith<__half>(half_format(), b, other, bad);
    }
  for (long i = 0; i < n_pairs; i++) {
    uint64_t r = next_random(state);
    check_arith<__nv_bfloat16>(bf16_format(), (unsigned)(r & 0xffff), (unsigned)((r >> 16) & 0xffff), bad);
    check_arith<__half>(half_format(), (unsigned)((r >> 32) & 0xffff), (unsigned)(r >> 48), bad);
  }
  __nv_bfloat16 xb = 1.0f;
  __half xh = 1.0f;
  if ((float)(xb++) != 1.0f || (float)(++xb) != 3.0f || (float)(xh++) != 1.0f || (float)(++xh) != 3.0f)
    bad.add("++ gives %g / %g, expected 3", (float)xb, (float)xh);
  if ((float)(xb--) != 3.0f || (float)(--xh) != 2.0f || (float)xb != 2.0f)
    bad.add("-- gives %g / %g, expected 2", (float)xb, (float)xh);
  return bad.count;
}

/* ---- pairs and raw structs ----------------------------------------------- */
long gl_simtest_num_pairs(void) {
  Failures bad("pairs");
  __nv_bfloat162 b2 = __floats2bfloat162_rn(1.5f, -3.0f);
  float2 f2 = __bfloat1622float2(b2);
  if (f2.x != 1.5f || f2.y != -3.0f || __low2float(b2) != 1.5f || __high2float(b2) != -3.0f)
    bad.add("bfloat162 round trip: %g %g", f2.x, f2.y);
  b2 = __float22bfloat162_rn(make_float2(0.25f, 1e20f));
  if ((float)__low2bfloat16(b2) != 0.25f || __bfloat16_as_ushort(__high2bfloat16(b2)) != __bfloat16_as_ushort(__float2bfloat16(1e20f)))
    bad.add("__float22bfloat162_rn");
  b2 = __halves2bfloat162(__float2bfloat16(2.0f), __float2bfloat16(4.0f));
  __nv_bfloat162_raw r2 = b2;
  if (r2.x != 0x4000 || r2.y != 0x4080) bad.add("bfloat162 raw: 0x%04x 0x%04x", r2.x, r2.y);
  __half2 h2 = __floats2half2_rn(1.5f, -3.0f);
  f2 = __half22float2(h2);
  if (f2.x != 1.5f || f2.y != -3.0f || __low2float(h2) != 1.5f || __high2float(h2) != -3.0f)
    bad.add("half2 round trip: %g %g", f2.x, f2.y);
  h2 = __float22half2_rn(make_float2(0.25f, 1e20f));
  if ((float)__low2half(h2) != 0.25f || __half_as_ushort(__high2half(h2)) != 0x7c00) bad.add("__float22half2_rn");
  h2 = __halves2half2(__float2half(2.0f), __float2half(4.0f));
  __half2_raw hr2 = h2;
  if (hr2.x != 0x4000 || hr2.y != 0x4400) bad.add("half2 raw: 0x%04x 0x%04x", hr2.x, hr2.y);
  __half2 back = hr2;
  if (__half_as_ushort(back.y) != 0x4400) bad.add("half2 from raw");
  __nv_bfloat16_raw raw = {0x3f80};
  __nv_bfloat16 one = raw;
  __half_raw hraw = {0x3c00};
  __half hone = hraw;
  if ((float)one != 1.0f || (float)hone != 1.0f) bad.add("from raw: %g %g", (float)one, (float)hone);
  if (__bfloat16_as_short(__short_as_bfloat16(-1)) != -1 || __half_as_short(__short_as_half(-2)) != -2)
    bad.add("short bit casts");
  if (!(bool)__float2bfloat16(0.5f) || (bool)__float2bfloat16(-0.0f) || !(bool)__float2half(0.5f) || (bool)__float2half(-0.0f))
    bad.add("explicit bool");
  bf16_chunk c;
  c.raw = make_uint4(0x3f803f80u, 0, 0, 0x3c003c00u);
  if ((float)c.h[0] != 1.0f || (float)c.f[7] != 1.0f) bad.add("union access");
  return bad.count;
}

}  // extern "C"

/* ---- device-side use: shuffles, atomics, static shared arrays ------------ */
/* 64 threads; err[i] counts thread i's wrong results */
static __global__ void device_numeric_kernel(int *err, __nv_bfloat16 *sum_b, __half *sum_h) {
  GL_SHARED(__nv_bfloat16, tile_b, [64]);
  GL_SHARED(__half, tile_h, [64]);
  const int t = threadIdx.x, lane = t & 31;
  int e = 0;
  __nv_bfloat16 vb = __float2bfloat16((float)lane + 0.5f);
  __half vh = __float2half((float)lane + 0.25f);
  if ((float)__shfl_xor_sync(0xffffffffu, vb, 1) != (float)(lane ^ 1) + 0.5f) e++;
  if ((float)__shfl_sync(0xffffffffu, vb, 3) != 3.5f) e++;
  if ((float)__shfl_down_sync(0xffffffffu, vb, 1) != (float)(lane < 31 ? lane + 1 : lane) + 0.5f) e++;
  if ((float)__shfl_up_sync(0xffffffffu, vb, 2) != (float)(lane >= 2 ? lane - 2 : lane) + 0.5f) e++;
  if ((float)__shfl_xor_sync(0xffffffffu, vh, 4) != (float)(lane ^ 4) + 0.25f) e++;
  if ((float)__shfl_sync(0xffffffffu, vh, 30) != 30.25f) e++;
  if ((float)__shfl_down_sync(0xffffffffu, vh, 3) != (float)(lane < 29 ? lane + 3 : lane) + 0.25f) e++;
  if ((float)__shfl_up_sync(0xffffffffu, vh, 1) != (float)(lane >= 1 ? lane - 1 : lane) + 0.25f) e++;
  tile_b[t] = __float2bfloat16((float)t * 2.0f);
  tile_h[t] = __float2half((float)t * 3.0f);
  __syncthreads();
  if ((float)tile_b[63 - t] != (float)(63 - t) * 2.0f || (float)tile_h[(t + 1) % 64] != (float)((t + 1) % 64) * 3.0f) e++;
  atomicAdd(sum_b, __float2bfloat16(1.0f));
  atomicAdd(sum_h, __float2half(0.5f));
  err[t] = e;
}

extern "C" long gl_simtest_num_device(void) {
  Failures bad("device numeric");
  int *err;
  __nv_bfloat16 *sum_b;
  __half *sum_h;
  if (cudaMalloc(&err, 64 * sizeof(int)) != cudaSuccess || cudaMalloc(&sum_b, 2) != cudaSuccess ||
      cudaMalloc(&sum_h, 2) != cudaSuccess) {
    bad.add("cudaMalloc failed");
    return bad.count;
  }
  __nv_bfloat16 zb = 0.0f;
  __half zh = 0.0f;
  cudaMemcpy(sum_b, &zb, 2, cudaMemcpyHostToDevice);
  cudaMemcpy(sum_h, &zh, 2, cudaMemcpyHostToDevice);
  GL_LAUNCH(dim3(1), dim3(64), 0, 0, device_numeric_kernel)(err, sum_b, sum_h);
  cudaError_t st = cudaGetLastError();
  if (st == cudaSuccess) st = cudaDeviceSynchronize();
  int host_err[64];
  __nv_bfloat16 hb;
  __half hh;
  if (st == cudaSuccess) st = cudaMemcpy(host_err, err, sizeof host_err, cudaMemcpyDeviceToHost);
  if (st == cudaSuccess) st = cudaMemcpy(&hb, sum_b, 2, cudaMemcpyDeviceToHost);
  if (st == cudaSuccess) st = cudaMemcpy(&hh, sum_h, 2, cudaMemcpyDeviceToHost);
  if (st != cudaSuccess) {
    bad.add("%s", cudaGetErrorString(st));
  } else {
    for (int i = 0; i < 64; i++)
      if (host_err[i]) bad.add("thread %d: %d wrong shuffles / shared reads", i, host_err[i]);
    if ((float)hb != 64.0f || (float)hh != 32.0f) bad.add("atomicAdd sums %g / %g, expected 64 / 32", (float)hb, (float)hh);
  }
  cudaFree(err);
  cudaFree(sum_b);
  cudaFree(sum_h);
  return bad.count;
}
