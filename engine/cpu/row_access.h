/* row_access.h — helpers of the CPU row kernels' generic sections (rows.c,
 * index.c, rope_norm.c, loss.c, elementwise.c's dropout): included inside a
 * template's generic section, so once per compute type `real`.  No include
 * guard for that reason. */

/* nt per-thread blocks of n reals (64-byte aligned) in scratch slot 0 */
static inline real *R(thread_blocks)(int nt, int64_t n, int64_t *stride) {
  *stride = (n + 15) & ~(int64_t)15;
  return (real *)cpu_scratch(0, (size_t)(nt * *stride) * sizeof(real));
}

/* a row of n reals to write t's elements at off, stride st: t's memory or buf */
static inline real *R(row_out)(gl_tensor *t, int64_t off, int64_t st, real *buf) {
  return (t->dtype == RDT && st == 1) ? (real *)t->storage->data + off : buf;
}

/* t's elements as one dense array of real, or NULL: the row kernels' fast
   path (every tensor the ops layer hands them), which walks rows by pointer
   instead of a per-row offset walk and span copy; on rows of 32 (QK-norm,
   rope over heads) that walk cost 5-8x the arithmetic */
static inline real *R(dense)(const gl_tensor *t) {
  return (t->dtype == RDT && gl_is_contiguous(t)) ? (real *)t->storage->data + t->offset : NULL;
}

static inline real R(ld)(const gl_tensor *t, int64_t i) {
  return t->dtype == RDT ? ((const real *)t->storage->data)[i] : (real)gl_load(t->storage->data, t->dtype, i);
}
static inline void R(st)(gl_tensor *t, int64_t i, real v) {
  if (t->dtype == RDT) ((real *)t->storage->data)[i] = v;
  else gl_store(t->storage->data, t->dtype, i, (double)v);
}

#define OOM(fn, what) gl_error("%s: out of memory for %s", fn, what)
