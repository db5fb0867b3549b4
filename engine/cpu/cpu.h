/* cpu.h — what the CPU kernels (engine/cpu/NAME.c, the twin of kernels/NAME.cu)
 * share: per-thread scratch memory, strided span load/store in the compute
 * type and the vectorised exp/tanh (defined in elementwise.c; each for float
 * (_f32) and double (_f64), named R(cpu_span_load) in template files), the
 * row walk and id helpers of the row and index kernels, and the choice of
 * compute type. */
#ifndef GL_CPU_H
#define GL_CPU_H
#include "backend.h"

/* Thread-local scratch buffer `slot` of at least bytes (kept for the
   thread's life); NULL when out of memory. */
void *cpu_scratch(int slot, size_t bytes);

#define GL_CPU_SPAN_DECLS(real, sfx)                                                                 \
  const real *cpu_span_load_##sfx(const gl_tensor *t, int64_t off, int64_t st, int64_t n, real *buf); \
  void cpu_span_store_##sfx(gl_tensor *t, int64_t off, int64_t st, int64_t n, const real *src);       \
  void cpu_vexp_##sfx(real *y, const real *x, int64_t n);                                             \
  void cpu_vtanh_##sfx(real *y, const real *x, int64_t n);
GL_CPU_SPAN_DECLS(float, f32)
GL_CPU_SPAN_DECLS(double, f64)
#undef GL_CPU_SPAN_DECLS

#ifdef _OPENMP
#include <omp.h>
#endif

/* rows are cut into chunks of at most CPU_CHUNK elements (stack buffers) */
enum { CPU_CHUNK = 512 };

/* Storage offset of position r of a row-major walk over `shape` (nd dims),
   with t's strides, leaving out dim `skip` (-1: none). */
static inline int64_t walk_offset(const gl_tensor *t, const int64_t *shape, int nd, int skip, int64_t r) {
  int64_t off = t->offset;
  for (int d = nd - 1; d >= 0; d--) {
    if (d == skip) continue;
    off += (r % shape[d]) * t->stride[d];
    r /= shape[d];
  }
  return off;
}

static inline int64_t load_id(const gl_tensor *t, int64_t off) {
  return t->dtype == GL_I32 ? ((const int32_t *)t->storage->data)[off] : ((const int64_t *)t->storage->data)[off];
}

/* Every id in [0, limit), or == ignore when has_ignore; else an error naming
   the first offending value, its position and the limit (engine/cpu/index.c). */
int cpu_check_ids(const char *fn, const char *arg, const gl_tensor *ids, int64_t limit, const char *what,
                  int has_ignore, int64_t ignore);

/* compute in double for float64 (or wide integer) data, float otherwise */
static inline int cpu_wide(const gl_tensor *t) { return t && (t->dtype == GL_F64 || t->dtype == GL_I32 || t->dtype == GL_I64); }
#define CPU_CALL(use_double, name, ...) ((use_double) ? name##_f64(__VA_ARGS__) : name##_f32(__VA_ARGS__))
#endif
