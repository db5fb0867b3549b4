/* cpu_tensor.c — CPU kernels for copy (with dtype conversion), fill and the
 * Philox random fills.  These are also the reference twins of the CUDA ones. */
#include "backend.h"

/* Copy one inner run with conversion.  Same-dtype float32 runs are the hot
   case (contiguous() of transposed activations) and get a typed loop. */
static void copy_run(char *db, int dt, int64_t doff, int64_t ds,
                     const char *sb, int st, int64_t soff, int64_t ss, int64_t n) {
  if (dt == st && ds == 1 && ss == 1) {
    int es = gl_dtype_size(dt);
    memcpy(db + doff * es, sb + soff * es, (size_t)(n * es));
  } else if (dt == GL_F32 && st == GL_F32) {
    float *d = (float *)db + doff; const float *s = (const float *)sb + soff;
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else if (dt == GL_F64 && st == GL_F64) {
    double *d = (double *)db + doff; const double *s = (const double *)sb + soff;
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else if (dt == GL_I64 && st == GL_I64) {
    int64_t *d = (int64_t *)db + doff; const int64_t *s = (const int64_t *)sb + soff;
    for (int64_t i = 0; i < n; i++) d[i * ds] = s[i * ss];
  } else {
    for (int64_t i = 0; i < n; i++) gl_store(db, dt, doff + i * ds, gl_load(sb, st, soff + i * ss));
  }
}

int cpu_copy(gl_tensor *dst, const gl_tensor *src) {
  gl_iter it; gl_iter_init(&it, 2, (const gl_tensor *[]){dst, src});
  char *db = dst->storage->data; const char *sb = src->storage->data;
  int nt = gl_threads_for(it.outer, it.inner);
  GL_PAR_FOR(nt, o, it.outer, 
    int64_t off[GL_ITER_MAX_OPS]; gl_iter_offsets(&it, o, off);
    copy_run(db, dst->dtype, off[0], it.istride[0], sb, src->dtype, off[1], it.istride[1], it.inner);
  );
  return GL_OK;
}

int cpu_fill(gl_tensor *t, double v) {
  gl_iter it; gl_iter_init(&it, 1, (const gl_tensor *[]){t});
  char *b = t->storage->data;
  for (int64_t o = 0; o < it.outer; o++) {
    int64_t off[GL_ITER_MAX_OPS]; gl_iter_offsets(&it, o, off);
    if (t->dtype == GL_F32) {
      float *p = (float *)b + off[0]; float f = (float)v;
      for (int64_t i = 0; i < it.inner; i++) p[i * it.istride[0]] = f;
    } else {
      for (int64_t i = 0; i < it.inner; i++) gl_store(b, t->dtype, off[0] + i * it.istride[0], v);
    }
  }
  return GL_OK;
}

/* Element k (row-major index) takes stream element offset + k.  Normal
   samples use Box-Muller on two words: counter 2*(offset+k) and +1. */
static int rand_fill(gl_tensor *t, uint64_t seed, uint64_t offset, double a, double b, int normal) {
  int64_t idx[GL_MAX_DIMS] = {0};
  char *base = t->storage->data;
  for (int64_t k = 0; k < t->numel; k++) {
    int64_t off = t->offset;
    for (int d = 0; d < t->ndim; d++) off += idx[d] * t->stride[d];
    uint64_t c = offset + (uint64_t)k;
    double v;
    if (normal) {
      double u1 = gl_u32_to_unit(gl_philox_word(seed, 2 * c));
      double u2 = gl_u32_to_unit(gl_philox_word(seed, 2 * c + 1));
      v = a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
    } else {
      v = a + (b - a) * (1.0 - gl_u32_to_unit(gl_philox_word(seed, c)));  /* [lo, hi) */
    }
    gl_store(base, t->dtype, off, v);
    for (int d = t->ndim - 1; d >= 0; d--) { if (++idx[d] < t->shape[d]) break; idx[d] = 0; }
  }
  return GL_OK;
}
int cpu_rand_uniform(gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi) {
  return rand_fill(t, seed, offset, lo, hi, 0);
}
int cpu_rand_normal(gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
  return rand_fill(t, seed, offset, mean, std, 1);
}
