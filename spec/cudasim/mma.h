/* mma.h — the CUDA simulator's warp matrix multiply-accumulate API
 * (namespace nvcuda::wmma) on the CPU.
 *
 * Part of the CUDA simulator (spec/cudasim/): the kernels/ sources compile
 * unchanged with the host C++ compiler against these headers instead of the
 * toolkit's.
 *
 * Shapes M x N x K: 16x16x16, 32x8x16 and 8x32x16; matrix_a / matrix_b of
 * __nv_bfloat16 or __half (row_major or col_major), accumulators of float
 * or __half.  Each lane's fragment holds its own share of the tile,
 * num_elements values as on the hardware (a 16x16 float accumulator: 8 per
 * lane; half A / B fragments hold 16, each element on two lanes, as Volta's
 * layout that the toolkit keeps).  Which tile element sits in which slot is
 * unspecified, as on the hardware, so only elementwise code over x[i],
 * i < num_elements, is portable.
 *
 * load_matrix_sync, store_matrix_sync and mma_sync are warp-collective:
 * every lane of the warp calls them with the same pointer, ldm and layout;
 * they meet in gl_sim_warp_collective (sim.h) and the last lane to arrive
 * moves the whole tile once.  The hardware's requirements are checked and a
 * violation stops the kernel (gl_sim_abort_kernel) with a message naming
 * the operation and the value: the pointer 256-bit (32-byte) aligned, ldm a
 * multiple of 8 elements for 16-bit types and of 4 for float (16 bytes),
 * every lane passing the same arguments; load and store take the caller's
 * file and line as hidden default arguments for that message (as device.h's
 * collectives do).  fill_fragment is per lane.
 *
 * mma_sync computes D = A B + C with each product of two bf16 / half values
 * exact and the sum accumulated in fp32, one rounding per step, in k order
 * starting from C (then rounded once to half for half accumulators).  The
 * hardware's accumulation order and intermediate rounding are unspecified
 * and can differ from this by an ulp or so of fp32. */
#ifndef GL_SIM_MMA_H
#define GL_SIM_MMA_H
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <type_traits>
#include "cuda_bf16.h"
#include "sim.h"

namespace nvcuda {
namespace wmma {

/* fragment uses and layouts */
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
/* the memory layout of an accumulator tile, chosen at run time */
enum layout_t { mem_row_major, mem_col_major };

namespace detail {

template <int M, int N, int K> struct shape_ok {
  static constexpr bool value = (M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) ||
                                (M == 8 && N == 32 && K == 16);
};
/* the tile a fragment holds: rows x cols of the logical matrix */
template <class Use, int M, int N, int K> struct tile;
template <int M, int N, int K> struct tile<matrix_a, M, N, K> { enum { rows = M, cols = K }; };
template <int M, int N, int K> struct tile<matrix_b, M, N, K> { enum { rows = K, cols = N }; };
template <int M, int N, int K> struct tile<accumulator, M, N, K> { enum { rows = M, cols = N }; };

/* values per lane: a 32nd of the tile, except half A / B fragments, which
   hold 16 (the toolkit's layout, with each element on several lanes) */
template <class Use, int M, int N, int K, class T> struct per_lane {
  enum {
    value = (!std::is_same<Use, accumulator>::value && std::is_same<T, __half>::value)
                ? 16
                : tile<Use, M, N, K>::rows * tile<Use, M, N, K>::cols / 32
  };
};

template <class Use, class T> struct type_ok {
  static constexpr bool value = std::is_same<Use, accumulator>::value
                                    ? (std::is_same<T, float>::value || std::is_same<T, __half>::value)
                                    : (std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value);
};
template <class Use, class Layout> struct layout_ok {
  static constexpr bool value = std::is_same<Use, accumulator>::value
                                    ? std::is_same<Layout, void>::value
                                    : (std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value);
};

/* element values as float and back (half accumulators round to nearest) */
inline float to_float(float v) { return v; }
inline float to_float(__half v) { return __half2float(v); }
inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline __half from_float<__half>(float v) { return __float2half_rn(v); }

/* Stops the kernel: "kernel K block (..) thread (..): wmma::OP at FILE:LINE:
   <what>" (the simulated thread, the caller's line). */
[[noreturn]] inline void fail(cudaError_t code, const char *op, const char *file, int line, const char *what) {
  char msg[640];
  const char *where = gl_sim_where();
  snprintf(msg, sizeof msg, "%s%s%s at %s:%d: %s", where ? where : "", where ? ": " : "", op, file, line, what);
  gl_sim_abort_kernel(code, msg);
  /* outside a kernel there is nothing to abandon: the misuse is fatal */
  fprintf(stderr, "gptlua cuda-sim: %s (called outside a kernel)\n", msg);
  abort();
}

/* The checks the hardware's load / store instructions require. */
template <class T> inline void check_args(const char *op, const char *file, int line, const void *p, unsigned ldm) {
  char what[200];
  if ((uintptr_t)p % 32 != 0) {
    snprintf(what, sizeof what, "pointer %p is not 256-bit (32-byte) aligned", p);
    fail(cudaErrorMisalignedAddress, op, file, line, what);
  }
  const unsigned multiple = 16 / sizeof(T);  /* 8 for 16-bit types, 4 for float */
  if (ldm % multiple != 0) {
    snprintf(what, sizeof what, "ldm %u is not a multiple of %u (%zu-byte elements)", ldm, multiple, sizeof(T));
    fail(cudaErrorMisalignedAddress, op, file, line, what);
  }
}

/* One lane's operands of a load or store. */
struct mem_args {
  void *frag;       /* the lane's fragment elements */
  const void *ptr;  /* the tile in memory */
  unsigned ldm;
  int col_major;    /* 1: element (r, c) at ptr[c * ldm + r]; 0: ptr[r * ldm + c] */
};

/* The leader's check that every lane passed lane 0's arguments (the
   collective's key covers the pointer; this also covers ldm and layout). */
inline void check_lanes_agree(const char *op, const char *file, int line, void **lanes) {
  const mem_args *first = (const mem_args *)lanes[0];
  for (int l = 1; l < 32; l++) {
    const mem_args *a = (const mem_args *)lanes[l];
    char what[240];
    if (a->ptr != first->ptr) {
      snprintf(what, sizeof what, "lanes disagree on the pointer: lane 0 passed %p, lane %d %p", first->ptr, l, a->ptr);
      fail(cudaErrorIllegalInstruction, op, file, line, what);
    }
    if (a->ldm != first->ldm) {
      snprintf(what, sizeof what, "lanes disagree on ldm: lane 0 passed %u, lane %d %u", first->ldm, l, a->ldm);
      fail(cudaErrorIllegalInstruction, op, file, line, what);
    }
    if (a->col_major != first->col_major) {
      snprintf(what, sizeof what, "lanes disagree on the layout: lane 0 passed %s, lane %d %s",
               first->col_major ? "col_major" : "row_major", l, a->col_major ? "col_major" : "row_major");
      fail(cudaErrorIllegalInstruction, op, file, line, what);
    }
  }
}

/* Slot i of lane l holds tile element (l * NE + i) mod (rows * cols), taken
   row-major: every element has a slot, replicated fragments repeat them. */
template <int ROWS, int COLS, int NE> inline int element_of(int lane, int i) { return (lane * NE + i) % (ROWS * COLS); }

/* Memory -> every lane's fragment (load: the leader's work). */
template <int ROWS, int COLS, int NE, class T> inline void gather_tile(void **lanes) {
  const mem_args *first = (const mem_args *)lanes[0];
  const T *p = (const T *)first->ptr;
  for (int l = 0; l < 32; l++) {
    T *x = (T *)((const mem_args *)lanes[l])->frag;
    for (int i = 0; i < NE; i++) {
      int e = element_of<ROWS, COLS, NE>(l, i), r = e / COLS, c = e % COLS;
      x[i] = first->col_major ? p[(size_t)c * first->ldm + r] : p[(size_t)r * first->ldm + c];
    }
  }
}

/* Every lane's fragment -> memory (store).  Replicated slots carry the same
   value, so writing each element once from its first slot is enough. */
template <int ROWS, int COLS, int NE, class T> inline void scatter_tile(void **lanes) {
  const mem_args *first = (const mem_args *)lanes[0];
  T *p = (T *)first->ptr;
  for (int l = 0; l < 32; l++) {
    const T *x = (const T *)((const mem_args *)lanes[l])->frag;
    for (int i = 0; i < NE; i++) {
      int e = element_of<ROWS, COLS, NE>(l, i), r = e / COLS, c = e % COLS;
      if (l * NE + i >= ROWS * COLS) continue;  /* a replica */
      if (first->col_major) p[(size_t)c * first->ldm + r] = x[i];
      else p[(size_t)r * first->ldm + c] = x[i];
    }
  }
}

/* One lane's part of a load or store: its own checks, then the rendezvous;
   the last lane to arrive checks that all agree and moves the tile. */
template <class T> inline void load_store(const char *op, const char *file, int line, void *frag, const void *p,
                                          unsigned ldm, int col_major, void (*move)(void **)) {
  check_args<T>(op, file, line, p, ldm);
  mem_args mine = {frag, p, ldm, col_major};
  gl_sim_warp_collective(0xffffffffu, op, (uint64_t)(uintptr_t)p, &mine, [&](void **lanes, int) {
    check_lanes_agree(op, file, line, lanes);
    move(lanes);
  });
}

}  // namespace detail

/* A lane's share of a tile (the toolkit's public members: x, num_elements,
   element_type, storage_element_type).  Trivial, so it can live anywhere. */
template <class Use, int M, int N, int K, class T, class Layout = void> class fragment {
  static_assert(detail::shape_ok<M, N, K>::value, "wmma: unsupported shape (16x16x16, 32x8x16, 8x32x16)");
  static_assert(detail::type_ok<Use, T>::value,
                "wmma: matrix_a / matrix_b hold __nv_bfloat16 or __half, accumulators float or __half");
  static_assert(detail::layout_ok<Use, Layout>::value,
                "wmma: matrix_a / matrix_b need row_major or col_major, accumulators no layout");

 public:
  typedef T element_type;
  typedef T storage_element_type;
  enum { num_elements = detail::per_lane<Use, M, N, K, T>::value };
  T x[num_elements];
};

/* every element of the lane's share set to v */
template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout> &f,
                          const typename fragment<Use, M, N, K, T, Layout>::element_type &v) {
  for (int i = 0; i < fragment<Use, M, N, K, T, Layout>::num_elements; i++) f.x[i] = v;
}

/* A or B tile from memory; the layout is the fragment's */
template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout> &f, const T *p, unsigned ldm,
                             const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(!std::is_same<Use, accumulator>::value, "wmma::load_matrix_sync: an accumulator needs a layout_t");
  typedef detail::tile<Use, M, N, K> Tile;
  enum { NE = fragment<Use, M, N, K, T, Layout>::num_elements };
  detail::load_store<T>("wmma::load_matrix_sync", file, line, f.x, p, ldm, std::is_same<Layout, col_major>::value,
                        &detail::gather_tile<Tile::rows, Tile::cols, NE, T>);
}

/* accumulator tile from memory in the given layout */
template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T> &f, const T *p, unsigned ldm, layout_t layout,
                             const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  enum { NE = fragment<accumulator, M, N, K, T>::num_elements };
  detail::load_store<T>("wmma::load_matrix_sync", file, line, f.x, p, ldm, layout == mem_col_major,
                        &detail::gather_tile<M, N, NE, T>);
}

/* accumulator tile to memory in the given layout */
template <int M, int N, int K, class T>
inline void store_matrix_sync(T *p, const fragment<accumulator, M, N, K, T> &f, unsigned ldm, layout_t layout,
                              const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
  enum { NE = fragment<accumulator, M, N, K, T>::num_elements };
  detail::load_store<T>("wmma::store_matrix_sync", file, line, (void *)f.x, p, ldm, layout == mem_col_major,
                        &detail::scatter_tile<M, N, NE, T>);
}

/* D = A B + C (d may be c) */
template <int M, int N, int K, class Tab, class LA, class LB, class Td, class Tc>
inline void mma_sync(fragment<accumulator, M, N, K, Td> &d, const fragment<matrix_a, M, N, K, Tab, LA> &a,
                     const fragment<matrix_b, M, N, K, Tab, LB> &b, const fragment<accumulator, M, N, K, Tc> &c) {
  enum {
    NA = fragment<matrix_a, M, N, K, Tab, LA>::num_elements,
    NB = fragment<matrix_b, M, N, K, Tab, LB>::num_elements,
    NC = fragment<accumulator, M, N, K, Tc>::num_elements,
    ND = fragment<accumulator, M, N, K, Td>::num_elements
  };
  struct operands { Td *d; const Tab *a, *b; const Tc *c; };
  operands mine = {d.x, a.x, b.x, c.x};
  gl_sim_warp_collective(0xffffffffu, "wmma::mma_sync", (uint64_t)(M * 10000 + N * 100 + K), &mine,
                         [&](void **lanes, int) {
    gl_sim_account_add(nullptr, 2.0 * M * N * K, 0, 0);  /* the account's tensor-core FLOPs */
    float A[M][K], B[K][N], C[M][N];
    for (int l = 0; l < 32; l++) {  /* gather every lane's share (replicas agree) */
      const operands *o = (const operands *)lanes[l];
      for (int i = 0; i < NA; i++) {
        int e = detail::element_of<M, K, NA>(l, i);
        A[e / K][e % K] = detail::to_float(o->a[i]);
      }
      for (int i = 0; i < NB; i++) {
        int e = detail::element_of<K, N, NB>(l, i);
        B[e / N][e % N] = detail::to_float(o->b[i]);
      }
      for (int i = 0; i < NC; i++) {
        int e = detail::element_of<M, N, NC>(l, i);
        C[e / N][e % N] = detail::to_float(o->c[i]);
      }
    }
    /* fp32 accumulation in k order, each exact product added with one
       rounding: the product of two 8- or 11-bit significands is exact in
       double, and the double sum of it and a float rounded to float equals
       fmaf's result (53 >= 2 * 24 + 2 makes the double rounding harmless),
       without the libm call fmaf is on a baseline x86-64 build */
    for (int m = 0; m < M; m++)
      for (int n = 0; n < N; n++) {
        float acc = C[m][n];
        for (int k = 0; k < K; k++) acc = (float)((double)acc + (double)A[m][k] * (double)B[k][n]);
        C[m][n] = acc;
      }
    for (int l = 0; l < 32; l++) {  /* scatter D (after every C was read: d may be c) */
      Td *dx = ((const operands *)lanes[l])->d;
      for (int i = 0; i < ND; i++) {
        int e = detail::element_of<M, N, ND>(l, i);
        dx[i] = detail::from_float<Td>(C[e / N][e % N]);
      }
    }
  });
}

}  // namespace wmma
}  // namespace nvcuda

#endif
