/* internal.h — engine-private helpers: error reporting, dtype conversion,
 * strided iteration and device dispatch.  Not part of the FFI boundary. */
#ifndef GL_INTERNAL_H
#define GL_INTERNAL_H
#include "gptlua.h"
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Sets the thread-local error message and returns GL_ERR. */
int gl_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Same, for functions that return pointers. */
void *gl_error_null(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* An engine bug, never bad input: prints and aborts. */
void gl_panic(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

#define GL_TRY(expr) do { if ((expr) != GL_OK) return GL_ERR; } while (0)

/* Pointer arguments: every exported function names the pointers it needs
   at its top, before anything reads them:
     GL_NONNULL(fn, t, out);              returns GL_ERR (int, int64_t)
     GL_NONNULL_OR(NULL, fn, path);       returns the given error value
   The first NULL one sets "fn: out is NULL, expected a valid pointer".
   Pointers whose contract allows NULL (optional outputs, destructors) are
   not listed; gl_*.h says so at their declarations. */
int gl_check_nonnull(const char *fn, const char *names, int n, const void *const *ptrs);
#define GL_NARGS_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, N, ...) N
#define GL_NARGS(...) GL_NARGS_(__VA_ARGS__, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define GL_NONNULL_OR(err, fn, ...)                                                       \
  do {                                                                                    \
    if (gl_check_nonnull((fn), #__VA_ARGS__, GL_NARGS(__VA_ARGS__),                      \
                         (const void *const[]){__VA_ARGS__}) != GL_OK) return (err);      \
  } while (0)
#define GL_NONNULL(fn, ...) GL_NONNULL_OR(GL_ERR, fn, __VA_ARGS__)

/* Validates a tensor argument: live struct, live storage.  fn/arg name it. */
#define GL_CHECK_T(t, fn, arg) GL_TRY(gl_tensor_check((t), (fn), (arg)))

/* "{3,5}" into buf; returns buf */
const char *gl_shape_str(const gl_tensor *t, char *buf, size_t n);
int gl_same_shape(const gl_tensor *a, const gl_tensor *b);
int gl_is_float(int dtype);
int gl_is_int(int dtype);
int gl_is_fp8(int dtype);  /* float8_e4m3fn or float8_e5m2: storage and conversions, and the scaled product */
/* Checks a and b have the same shape; error names fn, arg names. */
int gl_check_same_shape(const gl_tensor *a, const gl_tensor *b, const char *fn,
                        const char *an, const char *bn);
int gl_check_same_device(const gl_tensor *a, const gl_tensor *b, const char *fn,
                         const char *an, const char *bn);
int gl_check_dtype_float(const gl_tensor *t, const char *fn, const char *arg);
int gl_check_no_zero_stride(const gl_tensor *t, const char *fn, const char *arg);

/* bfloat16 / float16 conversions (round to nearest even) */
static inline float gl_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t gl_f32_to_bf16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
float gl_f16_to_f32(uint16_t h);
uint16_t gl_f32_to_f16(float f);
/* float8 (engine/util.c): exact decode; encode rounds once to nearest even,
   saturating to the largest finite value, NaN -> 0x7f */
float gl_f8e4m3_to_f32(uint8_t b);
float gl_f8e5m2_to_f32(uint8_t b);
uint8_t gl_f64_to_f8e4m3(double x);
uint8_t gl_f64_to_f8e5m2(double x);

/* Element i (in elements from base) of any dtype, as double and back. */
double gl_load(const void *base, int dtype, int64_t i);
void gl_store(void *base, int dtype, int64_t i, double v);

/* Strided iteration over up to GL_ITER_MAX_OPS tensors of one shape (op 0's).
   Dims are coalesced where every operand allows it; the last dim is the
   inner loop.  Usage:
     gl_iter it; gl_iter_init(&it, 2, (const gl_tensor*[]){out, x});
     for (int64_t o = 0; o < it.outer; o++) {
       int64_t off[GL_ITER_MAX_OPS]; gl_iter_offsets(&it, o, off);
       for (int64_t i = 0; i < it.inner; i++) ... base0[off[0] + i*it.istride[0]] ...
     }
   Outer iterations are independent and may run in parallel. */
enum { GL_ITER_MAX_OPS = 4 };
typedef struct gl_iter {
  int nops, ndim;              /* ndim counts the outer dims only */
  int64_t outer, inner;
  int64_t shape[GL_MAX_DIMS];  /* outer dims */
  int64_t stride[GL_ITER_MAX_OPS][GL_MAX_DIMS];
  int64_t istride[GL_ITER_MAX_OPS];
  int64_t base[GL_ITER_MAX_OPS]; /* each tensor's offset */
} gl_iter;
void gl_iter_init(gl_iter *it, int nops, const gl_tensor *const *ts);
void gl_iter_offsets(const gl_iter *it, int64_t outer_index, int64_t *off);

/* Parallel loops: OpenMP if enabled, sized by gl_set_num_threads. Use only
   when n * work_per_item is large enough to pay for the fork. */
int gl_threads_for(int64_t n, int64_t work_per_item);

/* for (int64_t VAR = 0; VAR < N; VAR++) { BODY } on NT threads.  NT <= 1
   runs the loop inline: entering an OpenMP region, even with one thread,
   costs microseconds and futex calls (thousands per training step).
   Pragmas inside BODY must be written _Pragma("..."). */
#define GL_PAR_FOR(NT, VAR, N, ...)                                          \
  do {                                                                       \
    const int64_t gl_n_ = (N);                                               \
    const int gl_nt_ = (NT);                                                 \
    if (gl_nt_ > 1) {                                                        \
      _Pragma("omp parallel for num_threads(gl_nt_) schedule(static)")       \
      for (int64_t VAR = 0; VAR < gl_n_; VAR++) { __VA_ARGS__ }              \
    } else {                                                                 \
      for (int64_t VAR = 0; VAR < gl_n_; VAR++) { __VA_ARGS__ }              \
    }                                                                        \
  } while (0)
/* The calling thread's number inside GL_PAR_FOR / GL_PAR_REGION (0 outside
   them, or without OpenMP): the index of its slice of per-thread scratch. */
static inline int gl_thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}
/* { BODY } run by each of NT threads (gl_thread_id() tells which);
   NT <= 1 runs it inline once, where gl_thread_id() is 0. */
#define GL_PAR_REGION(NT, ...)                                               \
  do {                                                                       \
    const int gl_nt_ = (NT);                                                 \
    if (gl_nt_ > 1) {                                                        \
      _Pragma("omp parallel num_threads(gl_nt_)")                            \
      { __VA_ARGS__ }                                                        \
    } else {                                                                 \
      { __VA_ARGS__ }                                                        \
    }                                                                        \
  } while (0)

/* For the distributed backends' diagnose (engine/mpi/comm.c): printf onto
   the end of buf (n bytes, never past it), and the one-line verdict on who
   has not joined w: why[g] is what is known of group member g (text that
   follows "rank g"), NULL when it has joined; this rank and, for send and
   recv, every rank but the peer are left out. */
void gl_dist_appendf(char *buf, int n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void gl_dist_verdict(const gl_work *w, const char *const *why, char *buf, int n);
/* gl_dist_abort's message, the same under every backend: msg on stderr,
   prefixed "[rank R] " once this process has a world rank (>= 0). */
void gl_dist_print_abort(int world_rank, const char *msg);

/* gl_safetensors_save's writer, arguments already checked: the checkpoint
   writer's thread calls it on host copies (engine/ckpt_writer.c);
   after_tensor (may be NULL) runs after each tensor's bytes are written. */
int gl_st_write(const char *path, int n, const char **names, const gl_tensor **ts, const char *metadata_json,
                void (*after_tensor)(void *arg, int i), void *arg);

/* what a storage made now is (gl_storage.meta) */
int gl_meta_kind(void);
/* Before reading t's values on the host: GL_OK when it has data; for a
   meta tensor 1 under GL_META_ZEROS (read zeros) and otherwise an error
   "fn: arg is a meta tensor {shape} dtype (a shape without data): ...". */
int gl_meta_read(const gl_tensor *t, const char *fn, const char *arg);
/* gl_empty on the CPU, real even while planning: for values the engine
   writes itself (tokenizer output, loader batches, shard reads) */
gl_tensor *gl_empty_host(int dtype, int ndim, const int64_t *shape);
static inline int gl_is_meta(const gl_tensor *t) { return t && t->storage && t->storage->meta == 1; }
/* Graph pools of the caching allocator (engine/alloc.c, used by
   kernels/runtime.cu's CUDA graphs): while a device's pool is open every
   allocation there comes from it and every block freed there joins it; its
   blocks go back to the shared cache at release (live ones when freed). */
typedef struct gl_alloc_pool gl_alloc_pool;
gl_alloc_pool *gl_alloc_pool_open(int device);  /* NULL + error if one is open */
void gl_alloc_pool_close(int device);           /* stops serving from the open pool */
void gl_alloc_pool_release(gl_alloc_pool *pool);
int64_t gl_alloc_pool_bytes(const gl_alloc_pool *pool);  /* its blocks, live or free (mutex not taken) */

/* Device memory hooks used by the allocator and copies (kernels/runtime.cu). */
#ifdef GL_WITH_CUDA
int cuda_malloc(int device, int64_t nbytes, void **out);
int cuda_free(int device, void *ptr);
int cuda_memcpy(void *dst, int dst_device, const void *src, int src_device, int64_t nbytes);
int cuda_device_count(void);
#endif

#endif
