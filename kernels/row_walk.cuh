/* row_walk.cuh — 16-byte row walks shared by the one-block-per-row kernels
 * (kernels/rows.cu: softmax, the norms, add + norm; kernels/loss.cu: the
 * cross-entropy rows).
 *
 * Contract: a launch may take the vector path (VEC) when its accessors are
 * typed (one storage type S for every operand, row_typed) and every row
 * operand's last dim is contiguous (rows_contiguous, checked on the host).
 * Each row then checks on the device that all its operands start 16-byte
 * aligned (row_aligned; uniform per block, so no divergence: with
 * C % N != 0 the rows of one tensor alternate between aligned and not, and a
 * narrowed view is off by its offset).  A row that qualifies walks its whole
 * CuVec16<S> vectors (N = 8 bfloat16, 4 float, 2 double elements, one 16-byte
 * load or store each) and then its C % N tail element by element; any other
 * row walks element by element (row_walk).  A vector (weight, bias) read at
 * the row's columns comes as one load when it is contiguous and aligned, and
 * element by element into the same vector otherwise (row_vec), so a kernel
 * has one vector body. */
#pragma once
#include "common.cuh"
#include <type_traits>

/* The storage type a row kernel's vector path loads: TPtr<S>'s S.  AnyPtr
   launches never take the vector path (VEC is false for them); float only
   lets their (dead) vector code compile. */
template <class P> struct RowStore { typedef float S; };
template <class S_> struct RowStore<TPtr<S_>> { typedef S_ S; };
/* element i of p's row as the vector path addresses it */
template <class P> __device__ __forceinline__ typename RowStore<P>::S *row_at(P p, int64_t i) {
  return (typename RowStore<P>::S *)p.p + i;
}
template <class P> __device__ __forceinline__ bool row_aligned(P p, int64_t i) {
  return ((uintptr_t)row_at(p, i) & 15) == 0;
}

/* One pass of the block over a row of C elements: with vec, fv(c) for each
   whole 16-byte vector (elements c .. c + N - 1, thread t taking vectors t,
   t + blockDim.x, ...), then fs(c) for the C % N elements after the last;
   without, fs(c) for every element. */
template <int N, class FV, class FS>
__device__ __forceinline__ void row_walk(int64_t C, bool vec, FV &&fv, FS &&fs) {
  int64_t c0 = 0;
  if (vec) {
    int64_t nv = C / N;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) fv(v * N);
    c0 = nv * N;
  }
  for (int64_t c = c0 + threadIdx.x; c < C; c += blockDim.x) fs(c);
}

/* Elements c .. c + N - 1 (stride s) of a vector operand (a norm's weight or
   bias, the same for every row) as one CuVec16: a 16-byte load when `whole`
   (s == 1 and p 16-byte aligned: row_vec_whole; c is a multiple of N), else
   N element loads of the same bits. */
template <class P> __device__ __forceinline__ CuVec16<typename RowStore<P>::S> row_vec(P p, int64_t c, int64_t s,
                                                                                       bool whole) {
  typedef typename RowStore<P>::S S;
  typedef CuVec16<S> V;
  if (whole) return V::load(row_at(p, c));
  V v;
#pragma unroll
  for (int k = 0; k < V::N; k++) ((S *)&v.raw)[k] = row_at(p, 0)[(c + k) * s];
  return v;
}
template <class P> __device__ __forceinline__ bool row_vec_whole(P p, int64_t s) {
  return p.null() || (s == 1 && row_aligned(p, 0));
}

/* whether every (non-null) tensor has contiguous elements in its last dim */
static inline bool rows_contiguous(std::initializer_list<const gl_tensor *> ts) {
  for (const gl_tensor *t : ts)
    if (t && t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1) return false;
  return true;
}
/* the typed accessor types (one storage type for every operand) */
template <class P> constexpr bool row_typed() { return !std::is_same<P, AnyPtr>::value; }
