/* cpu_kernels.h — helpers shared by the CPU kernels (defined in
 * cpu_elementwise.c): per-thread scratch memory, strided span load/store in
 * the compute type, and the vectorised exp/tanh.  Each exists for float
 * (_f32) and double (_f64); template files name them R(cpu_span_load). */
#ifndef GL_CPU_KERNELS_H
#define GL_CPU_KERNELS_H
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

#endif
