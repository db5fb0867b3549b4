/* elementwise.cu — CUDA kernels for unary (forward and backward), binary,
 * where, copy, fill, the Philox random fills and dropout.
 *
 * Twin of engine/cpu/elementwise.c: the same op
 * formulas in the same compute type (float, or double when an operand is
 * float64 or a 32/64-bit integer), the same random stream layout.  Every
 * kernel is a grid-stride loop over the output's row-major elements with a
 * CuIdx map per operand (contiguous operands collapse to one multiply);
 * unary, its backward and binary move 16-byte vectors when every operand is
 * one contiguous aligned run of one float type (ew_vec_body).  Specs:
 * spec/cuda_spec.lua ("unary ...", "binary ...", "16-byte vectors"). */
#include "common.cuh"
#include <type_traits>

/* ---- op formulas (mirror the tables in engine/cpu/elementwise.c) -------- */
#define GELU_K ((T)0.7978845608028654) /* sqrt(2/pi) */
#define GELU_C ((T)0.044715)

template <class T> __device__ __forceinline__ T unary_forward(int op, T x, T p0, T p1) {
  switch (op) {
    case GL_U_NEG: return -x;
    case GL_U_EXP: return cu_exp(x);
    case GL_U_LOG: return cu_log(x);
    case GL_U_SQRT: return cu_sqrt(x);
    case GL_U_RSQRT: return (T)1 / cu_sqrt(x);
    case GL_U_TANH: return cu_tanh(x);
    case GL_U_ABS: return cu_abs(x);
    case GL_U_RELU: return x > (T)0 ? x : (T)0;
    case GL_U_RELU2: return x > (T)0 ? x * x : (T)0;
    case GL_U_GELU_TANH: return (T)0.5 * x * ((T)1 + cu_tanh(GELU_K * (x + GELU_C * x * x * x)));
    case GL_U_SILU: return x / ((T)1 + cu_exp(-x));
    case GL_U_SIGMOID: return (T)1 / ((T)1 + cu_exp(-x));
    case GL_U_SIN: return cu_sin(x);
    case GL_U_COS: return cu_cos(x);
    case GL_U_SQUARE: return x * x;
    case GL_U_RECIPROCAL: return (T)1 / x;
    case GL_U_CLAMP: return x < p0 ? p0 : (x > p1 ? p1 : x);
    case GL_U_POW: return cu_pow(x, p0);
    case GL_U_ADD_SCALAR: return x + p0;
    case GL_U_MUL_SCALAR: return x * p0;
    case GL_U_AFFINE: return x * p0 + p1;
    case GL_U_RSUB_SCALAR: return p0 - x;
    case GL_U_RDIV_SCALAR: return p0 / x;
    case GL_U_SOFTCAP: return p0 * cu_tanh(x / p0);
  }
  return x;
}

// 1 - tanh^2 as (1 - t)(1 + t): 1 - |t| is exact for |t| >= 1/2, where
// 1 - t * t would cancel and magnify the product's rounding (up to 1 / (1 - t^2)
// times; a compiler that fuses it into an FMA avoids that, one without does not)
template <class T> __device__ __forceinline__ T one_minus_sq(T t) { return ((T)1 - t) * ((T)1 + t); }

template <class T> __device__ __forceinline__ T gelu_tanh_grad(T x) {
  T t = cu_tanh(GELU_K * (x + GELU_C * x * x * x));
  return (T)0.5 * ((T)1 + t) + (T)0.5 * x * one_minus_sq(t) * GELU_K * ((T)1 + (T)3 * GELU_C * x * x);
}

/* dx = dy * f'(x) */
template <class T> __device__ __forceinline__ T unary_backward(int op, T dy, T x, T p0, T p1) {
  switch (op) {
    case GL_U_NEG: return -dy;
    case GL_U_EXP: return dy * cu_exp(x);
    case GL_U_LOG: return dy / x;
    case GL_U_SQRT: return dy * (T)0.5 / cu_sqrt(x);
    case GL_U_RSQRT: return dy * (T)-0.5 / (x * cu_sqrt(x));
    case GL_U_TANH: { T t = cu_tanh(x); return dy * one_minus_sq(t); }
    case GL_U_ABS: return x > (T)0 ? dy : (x < (T)0 ? -dy : (T)0);
    case GL_U_RELU: return x > (T)0 ? dy : (T)0;
    case GL_U_RELU2: return x > (T)0 ? (T)2 * x * dy : (T)0;
    case GL_U_GELU_TANH: return dy * gelu_tanh_grad(x);
    case GL_U_SILU: { T e = (T)1 + cu_exp(-x); return dy * ((T)1 + x * ((T)1 - (T)1 / e)) / e; }
    case GL_U_SIGMOID: { T e = (T)1 + cu_exp(-x); return dy * ((T)1 - (T)1 / e) / e; }
    case GL_U_SIN: return dy * cu_cos(x);
    case GL_U_COS: return -dy * cu_sin(x);
    case GL_U_SQUARE: return (T)2 * x * dy;
    case GL_U_RECIPROCAL: return -dy / (x * x);
    case GL_U_CLAMP: return (x >= p0 && x <= p1) ? dy : (T)0;
    case GL_U_POW: return p0 == (T)0 ? (T)0 : dy * p0 * cu_pow(x, p0 - (T)1);
    case GL_U_ADD_SCALAR: return dy;
    case GL_U_MUL_SCALAR: return dy * p0;
    case GL_U_AFFINE: return dy * p0;
    case GL_U_RSUB_SCALAR: return -dy;
    case GL_U_RDIV_SCALAR: return -dy * p0 / (x * x);
    case GL_U_SOFTCAP: { T t = cu_tanh(x / p0); return dy * one_minus_sq(t); }
  }
  return dy;
}

template <class T> __device__ __forceinline__ T binary_op(int op, T a, T b) {
  switch (op) {
    case GL_B_ADD: return a + b;
    case GL_B_SUB: return a - b;
    case GL_B_MUL: return a * b;
    case GL_B_DIV: return a / b;
    case GL_B_POW: return cu_pow(a, b);
    case GL_B_MAXIMUM: return (a > b || a != a) ? a : b;
    case GL_B_MINIMUM: return (a < b || a != a) ? a : b;
    case GL_B_EQ: return (T)(a == b);
    case GL_B_NE: return (T)(a != b);
    case GL_B_LT: return (T)(a < b);
    case GL_B_LE: return (T)(a <= b);
    case GL_B_GT: return (T)(a > b);
    case GL_B_GE: return (T)(a >= b);
  }
  return a;
}
#undef GELU_K
#undef GELU_C

/* ---- kernels -------------------------------------------------------------- */
enum { EW_THREADS = 256 };

template <class P, class T>
__global__ void unary_kernel(int op, P out, P x, CuIdx<2> ix, int64_t n, T p0, T p1) {
  CU_GRID_LOOP(i, n) {
    int64_t off[2];
    ix.offsets(i, off);
    out.set(off[0], unary_forward<T>(op, x.template get<T>(off[1]), p0, p1));
  }
}

template <class P, class T>
__global__ void unary_backward_kernel(int op, P dx, P dy, P x, CuIdx<3> ix, int64_t n, T p0, T p1) {
  CU_GRID_LOOP(i, n) {
    int64_t off[3];
    ix.offsets(i, off);
    dx.set(off[0], unary_backward<T>(op, dy.template get<T>(off[1]), x.template get<T>(off[2]), p0, p1));
  }
}

template <class P, class T>
__global__ void binary_kernel(int op, P out, P a, P b, CuIdx<3> ix, int64_t n) {
  CU_GRID_LOOP(i, n) {
    int64_t off[3];
    ix.offsets(i, off);
    out.set(off[0], binary_op<T>(op, a.template get<T>(off[1]), b.template get<T>(off[2])));
  }
}

/* The 16-byte path (cu_vec16: every operand one contiguous, 16-byte aligned
   run of the same storage type S): out[e] = f(in[0][e], ...) with
   CuVec16<S>::N elements per thread and step, then the tail past the last
   whole vector element by element.  The same formulas as the kernels above,
   so the results are bit for bit theirs. */
template <class S, int NIN> struct EwIns { const S *p[NIN]; };
template <class T> struct UnaryF {
  int op;
  T p0, p1;
  __device__ __forceinline__ T operator()(const T *a) const { return unary_forward<T>(op, a[0], p0, p1); }
};
template <class T> struct UnaryBackwardF {  /* a: dy, x */
  int op;
  T p0, p1;
  __device__ __forceinline__ T operator()(const T *a) const { return unary_backward<T>(op, a[0], a[1], p0, p1); }
};
template <class T> struct BinaryF {
  int op;
  __device__ __forceinline__ T operator()(const T *a) const { return binary_op<T>(op, a[0], a[1]); }
};

template <class S, class T, int NIN, class F>
__device__ __forceinline__ void ew_vec_body(S *out, EwIns<S, NIN> in, int64_t n, F f) {
  typedef CuVec16<S> V;
  int64_t nv = n / V::N;
  CU_GRID_LOOP(i, nv) {
    V a[NIN], o;
#pragma unroll
    for (int k = 0; k < NIN; k++) a[k] = V::load(in.p[k] + i * V::N);
#pragma unroll
    for (int e = 0; e < V::N; e++) {
      T x[NIN];
#pragma unroll
      for (int k = 0; k < NIN; k++) x[k] = a[k].template get<T>(e);
      o.set(e, f(x));
    }
    o.store(out + i * V::N);
  }
  CU_GRID_LOOP(i, n - nv * V::N) {
    int64_t e = nv * V::N + i;
    T x[NIN];
#pragma unroll
    for (int k = 0; k < NIN; k++) x[k] = CuStore<S>::template load<T>(in.p[k][e]);
    out[e] = CuStore<S>::template store<T>(f(x));
  }
}
template <class S, class T> __global__ void unary_vec_kernel(S *out, EwIns<S, 1> in, int64_t n, UnaryF<T> f) {
  ew_vec_body<S, T>(out, in, n, f);
}
template <class S, class T>
__global__ void unary_backward_vec_kernel(S *dx, EwIns<S, 2> in, int64_t n, UnaryBackwardF<T> f) {
  ew_vec_body<S, T>(dx, in, n, f);
}
template <class S, class T> __global__ void binary_vec_kernel(S *out, EwIns<S, 2> in, int64_t n, BinaryF<T> f) {
  ew_vec_body<S, T>(out, in, n, f);
}
/* threads for the 16-byte path over n elements of S */
template <class S> static unsigned ew_vec_blocks(int dev, int64_t n) {
  int64_t nv = n / CuVec16<S>::N;
  return cu_blocks(dev, nv > 0 ? nv : n, EW_THREADS);
}

template <class P, class T>
__global__ void where_kernel(P out, P cond, P a, P b, CuIdx<4> ix, int64_t n) {
  CU_GRID_LOOP(i, n) {
    int64_t off[4];
    ix.offsets(i, off);
    T c = cond.template get<T>(off[1]);
    out.set(off[0], c != (T)0 ? a.template get<T>(off[2]) : b.template get<T>(off[3]));
  }
}

/* same-dtype copy and fill move raw element bits of U (1, 2, 4, 8 bytes) */
template <class U> __global__ void copy_bits_kernel(U *dst, const U *src, CuIdx<2> ix, int64_t n) {
  CU_GRID_LOOP(i, n) {
    int64_t off[2];
    ix.offsets(i, off);
    dst[off[0]] = src[off[1]];
  }
}
template <class U> __global__ void fill_bits_kernel(U *dst, U v, CuIdx<1> ix, int64_t n) {
  CU_GRID_LOOP(i, n) dst[ix.offset(i, 0)] = v;
}

/* copy with conversion: through double, as gl_load / gl_store do */
__global__ void copy_convert_kernel(AnyPtr dst, AnyPtr src, CuIdx<2> ix, int64_t n) {
  CU_GRID_LOOP(i, n) {
    int64_t off[2];
    ix.offsets(i, off);
    dst.set(off[0], src.get<double>(off[1]));
  }
}

/* element k (row-major) takes stream element offset + k; normals use
   Box-Muller on the words 2c and 2c + 1 (engine/cpu/elementwise.c) */
__global__ void rand_kernel(AnyPtr t, CuIdx<1> ix, int64_t n, uint64_t seed, uint64_t offset,
                            double a, double b, int normal) {
  CU_GRID_LOOP(k, n) {
    uint64_t c = offset + (uint64_t)k;
    double v;
    if (normal) {
      double u1 = gl_u32_to_unit(gl_philox_word(seed, 2 * c));
      double u2 = gl_u32_to_unit(gl_philox_word(seed, 2 * c + 1));
      v = a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    } else {
      v = a + (b - a) * (1.0 - gl_u32_to_unit(gl_philox_word(seed, c)));
    }
    t.set(ix.offset(k, 0), v);
  }
}

/* ---- entry points --------------------------------------------------------- */
static inline int64_t numel_of(const gl_tensor *t) { return t->numel; }

extern "C" int cuda_unary(int op, gl_tensor *out, const gl_tensor *x, double p0, double p1) {
  if (op < 0 || op >= GL_U_COUNT) return gl_error("cuda_unary: op expected 0..%d, got %d", GL_U_COUNT - 1, op);
  int64_t n = numel_of(out);
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  CuIdx<2> ix = cu_idx_of<2>({out, x});
  bool vec = cu_vec16(ix, {out, x});
  return cu_dispatch({out, x}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if constexpr (!std::is_same<P, AnyPtr>::value) {
      using S = typename P::storage;
      if (vec) {
        GL_LAUNCH(ew_vec_blocks<S>(out->device, n), EW_THREADS, 0, st, unary_vec_kernel<S, T>)(
            (S *)cu_ptr(out), EwIns<S, 1>{{(const S *)cu_ptr(x)}}, n, UnaryF<T>{op, (T)p0, (T)p1});
        GL_CU_LAUNCHED();
        return GL_OK;
      }
    }
    GL_LAUNCH(cu_blocks(out->device, n, EW_THREADS), EW_THREADS, 0, st, unary_kernel<P, T>)(
        op, P::from(out), P::from(x), ix, n, (T)p0, (T)p1);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_unary_backward(int op, gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x,
                                   double p0, double p1) {
  if (op < 0 || op >= GL_U_COUNT)
    return gl_error("cuda_unary_backward: op expected 0..%d, got %d", GL_U_COUNT - 1, op);
  int64_t n = numel_of(dx);
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(dx->device, &st));
  CuIdx<3> ix = cu_idx_of<3>({dx, dy, x});
  bool vec = cu_vec16(ix, {dx, dy, x});
  return cu_dispatch({dx, dy, x}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if constexpr (!std::is_same<P, AnyPtr>::value) {
      using S = typename P::storage;
      if (vec) {
        GL_LAUNCH(ew_vec_blocks<S>(dx->device, n), EW_THREADS, 0, st, unary_backward_vec_kernel<S, T>)(
            (S *)cu_ptr(dx), EwIns<S, 2>{{(const S *)cu_ptr(dy), (const S *)cu_ptr(x)}}, n,
            UnaryBackwardF<T>{op, (T)p0, (T)p1});
        GL_CU_LAUNCHED();
        return GL_OK;
      }
    }
    GL_LAUNCH(cu_blocks(dx->device, n, EW_THREADS), EW_THREADS, 0, st, unary_backward_kernel<P, T>)(
        op, P::from(dx), P::from(dy), P::from(x), ix, n, (T)p0, (T)p1);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_binary(int op, gl_tensor *out, const gl_tensor *a, const gl_tensor *b) {
  if (op < 0 || op >= GL_B_COUNT) return gl_error("cuda_binary: op expected 0..%d, got %d", GL_B_COUNT - 1, op);
  int64_t n = numel_of(out);
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  CuIdx<3> ix = cu_idx_of<3>({out, a, b});
  bool vec = cu_vec16(ix, {out, a, b});
  return cu_dispatch({out, a, b}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    if constexpr (!std::is_same<P, AnyPtr>::value) {
      using S = typename P::storage;
      if (vec) {
        GL_LAUNCH(ew_vec_blocks<S>(out->device, n), EW_THREADS, 0, st, binary_vec_kernel<S, T>)(
            (S *)cu_ptr(out), EwIns<S, 2>{{(const S *)cu_ptr(a), (const S *)cu_ptr(b)}}, n, BinaryF<T>{op});
        GL_CU_LAUNCHED();
        return GL_OK;
      }
    }
    GL_LAUNCH(cu_blocks(out->device, n, EW_THREADS), EW_THREADS, 0, st, binary_kernel<P, T>)(
        op, P::from(out), P::from(a), P::from(b), ix, n);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

extern "C" int cuda_where(gl_tensor *out, const gl_tensor *cond, const gl_tensor *a, const gl_tensor *b) {
  int64_t n = numel_of(out);
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  CuIdx<4> ix = cu_idx_of<4>({out, cond, a, b});
  return cu_dispatch({out, cond, a, b}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(cu_blocks(out->device, n, EW_THREADS), EW_THREADS, 0, st, where_kernel<P, T>)(
        P::from(out), P::from(cond), P::from(a), P::from(b), ix, n);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

template <class U> static int copy_bits(gl_tensor *dst, const gl_tensor *src, cudaStream_t st) {
  int64_t n = dst->numel;
  CuIdx<2> ix = cu_idx_of<2>({dst, src});
  if (ix.ndim == 1 && ix.stride[0][0] == 1 && ix.stride[1][0] == 1) {
    GL_CU_CHECK(cudaMemcpyAsync(cu_ptr(dst), cu_ptr(src), (size_t)(n * (int64_t)sizeof(U)),
                                cudaMemcpyDeviceToDevice, st));
    return GL_OK;
  }
  GL_LAUNCH(cu_blocks(dst->device, n, EW_THREADS), EW_THREADS, 0, st, copy_bits_kernel<U>)(
      (U *)cu_ptr(dst), (const U *)cu_ptr(src), ix, n);
  GL_CU_LAUNCHED();
  return GL_OK;
}


extern "C" int cuda_copy(gl_tensor *dst, const gl_tensor *src) {
  if (dst->device != src->device)
    return gl_error("cuda_copy: dst is on device %d, src on %d, expected one device (gl_copy moves between devices)",
                    dst->device, src->device);
  int64_t n = dst->numel;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(dst->device, &st));
  if (dst->dtype == src->dtype)
    return cu_with_bits(dst->dtype, [&](auto u) -> int { return copy_bits<decltype(u)>(dst, src, st); });
  CuIdx<2> ix = cu_idx_of<2>({dst, src});
  GL_LAUNCH(cu_blocks(dst->device, n, EW_THREADS), EW_THREADS, 0, st, copy_convert_kernel)(
      AnyPtr::from(dst), AnyPtr::from(src), ix, n);
  GL_CU_LAUNCHED();
  return GL_OK;
}

extern "C" int cuda_fill(gl_tensor *t, double value) {
  int64_t n = t->numel;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(t->device, &st));
  uint64_t bits = 0;  /* the element as the CPU would store it */
  gl_store(&bits, t->dtype, 0, value);
  int es = gl_dtype_size(t->dtype);
  CuIdx<1> ix = cu_idx_of<1>({t});
  int contiguous = ix.ndim == 1 && ix.stride[0][0] == 1;
  if (contiguous && bits == 0) {
    GL_CU_CHECK(cudaMemsetAsync(cu_ptr(t), 0, (size_t)(n * es), st));
    return GL_OK;
  }
  return cu_with_bits(t->dtype, [&](auto u) -> int {
    using U = decltype(u);
    U v;
    memcpy(&v, &bits, sizeof v);
    GL_LAUNCH(cu_blocks(t->device, n, EW_THREADS), EW_THREADS, 0, st, fill_bits_kernel<U>)((U *)cu_ptr(t), v, ix, n);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

static int rand_fill(gl_tensor *t, uint64_t seed, uint64_t offset, double a, double b, int normal) {
  int64_t n = t->numel;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(t->device, &st));
  CuIdx<1> ix = cu_idx_of<1>({t});
  GL_LAUNCH(cu_blocks(t->device, n, EW_THREADS), EW_THREADS, 0, st, rand_kernel)(AnyPtr::from(t), ix, n, seed, offset,
                                                                         a, b, normal);
  GL_CU_LAUNCHED();
  return GL_OK;
}
extern "C" int cuda_rand_uniform(gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi) {
  return rand_fill(t, seed, offset, lo, hi, 0);
}
extern "C" int cuda_rand_normal(gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
  return rand_fill(t, seed, offset, mean, std, 1);
}

/* ---- dropout ----------------------------------------------------------------- */
/* element e (row-major) is kept when the unit value of Philox word
   (offset + e) is < 1 - p, and then scaled by 1 / (1 - p); p = 0 keeps
   everything (a unit value can be exactly 1) — as engine/cpu/elementwise.c */
template <class P, class T>
__global__ void dropout_kernel(P out, P x, CuIdx<2> ix, int64_t n, uint64_t seed, uint64_t offset, double p,
                               T scale) {
  const double keep = 1 - p;
  CU_GRID_LOOP(e, n) {
    int64_t off[2];
    ix.offsets(e, off);
    bool kept = p == 0 || gl_u32_to_unit(gl_philox_word(seed, offset + (uint64_t)e)) < keep;
    out.set(off[0], kept ? x.template get<T>(off[1]) * scale : (T)0);
  }
}

extern "C" int cuda_dropout(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset) {
  int64_t n = out->numel;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  CuIdx<2> ix = cu_idx_of<2>({out, x});
  double keep = 1 - p;
  return cu_dispatch({out, x}, [&](auto pp, auto t) -> int {
    using P = decltype(pp);
    using T = decltype(t);
    T scale = keep > 0 ? (T)(1 / keep) : (T)0;
    GL_LAUNCH(cu_blocks(out->device, n, EW_THREADS), EW_THREADS, 0, st, dropout_kernel<P, T>)(
        P::from(out), P::from(x), ix, n, seed, offset, p, scale);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}

/* ---- rotary embedding -------------------------------------------------------- */
/* x (B, T, H, D), halves x1 = x[:D/2], x2 = x[D/2:], cos / sin (T, D/2):
   y1 = x1 c + sg x2 s, y2 = x2 c - sg x1 s with sg = -1 for the inverse.
   One thread per (b, t, h, j) pair; it reads both halves before writing,
   so out may alias x. */
struct RopeStrides {
  int64_t o[4], x[4], c[2], s[2];
};

template <class P, class T>
__global__ void rope_kernel(P out, P x, P cs, P sn, RopeStrides sd, int64_t n, int64_t T_, int64_t H, int64_t half,
                            T sg) {
  CU_GRID_LOOP(i, n) {
    int64_t j = i % half, r = i / half;
    int64_t h = r % H, bt = r / H, t = bt % T_, b = bt / T_;
    int64_t xo = b * sd.x[0] + t * sd.x[1] + h * sd.x[2], oo = b * sd.o[0] + t * sd.o[1] + h * sd.o[2];
    T x1 = x.template get<T>(xo + j * sd.x[3]), x2 = x.template get<T>(xo + (j + half) * sd.x[3]);
    T c = cs.template get<T>(t * sd.c[0] + j * sd.c[1]), s = sn.template get<T>(t * sd.s[0] + j * sd.s[1]);
    out.set(oo + j * sd.o[3], x1 * c + sg * x2 * s);
    out.set(oo + (j + half) * sd.o[3], x2 * c - sg * x1 * s);
  }
}

extern "C" int cuda_rope(gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse) {
  if (x->ndim != 4) return gl_error("cuda_rope: x has %d dims, expected 4 (B, T, H, D)", x->ndim);
  int64_t T_ = x->shape[1], H = x->shape[2], half = x->shape[3] / 2;
  int64_t n = x->shape[0] * T_ * H * half;
  if (n == 0) return GL_OK;
  cudaStream_t st;
  GL_TRY(cu_begin(out->device, &st));
  RopeStrides sd;
  for (int d = 0; d < 4; d++) { sd.o[d] = out->stride[d]; sd.x[d] = x->stride[d]; }
  for (int d = 0; d < 2; d++) { sd.c[d] = cos->stride[d]; sd.s[d] = sin->stride[d]; }
  return cu_dispatch({out, x, cos, sin}, [&](auto p, auto t) -> int {
    using P = decltype(p);
    using T = decltype(t);
    GL_LAUNCH(cu_blocks(out->device, n, EW_THREADS), EW_THREADS, 0, st, rope_kernel<P, T>)(
        P::from(out), P::from(x), P::from(cos), P::from(sin), sd, n, T_, H, half, inverse ? (T)-1 : (T)1);
    GL_CU_LAUNCHED();
    return GL_OK;
  });
}
