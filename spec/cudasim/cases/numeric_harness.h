/* numeric_harness.h — what numeric.cu and wmma.cu share: failures printed
 * with the prefix spec/sim_numeric_spec.lua reads, a seeded generator, and
 * a float's bits. */
#ifndef GL_SIM_NUMERIC_HARNESS_H
#define GL_SIM_NUMERIC_HARNESS_H
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define TEST_FAIL_PREFIX "gptlua cuda-sim: test_numeric: "
/* prints the first few failures of a check, counts all */
struct Failures {
  const char *check;
  long count = 0;
  explicit Failures(const char *c) : check(c) {}
  template <class... A> void add(const char *fmt, A... args) {
    if (count++ < 5) {
      fprintf(stderr, TEST_FAIL_PREFIX "%s: ", check);
      if (sizeof...(A) == 0) fputs(fmt, stderr);
      else fprintf(stderr, fmt, args...);
      fputc('\n', stderr);
    }
  }
};

inline uint64_t next_random(uint64_t &state) {  /* splitmix64 */
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#endif
