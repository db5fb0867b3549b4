/* ops_check.h — the argument checks every gl_* op of engine/ops*.c makes
 * before it dispatches (see ops.c for the order and the messages). */
#ifndef GL_OPS_CHECK_H
#define GL_OPS_CHECK_H
#include "backend.h"
#include <stdarg.h>
#include <stdio.h>

/* ---- argument lists --------------------------------------------------- */

enum { A_IN = 0, A_OUT = 1, A_OPT = 2, A_FLOAT = 4, A_INDEX = 8 };
typedef struct { const gl_tensor *t; const char *name; int flags; } arg;

/* Handles, output strides, devices and dtype classes of n arguments.
   Optional (A_OPT) arguments may be NULL. */
static inline int check_args(const char *fn, int n, const arg *a) {
  const arg *ref = NULL;
  for (int i = 0; i < n; i++) {
    if (!a[i].t && (a[i].flags & A_OPT)) continue;
    GL_CHECK_T(a[i].t, fn, a[i].name);
    if (a[i].flags & A_OUT) GL_TRY(gl_check_no_zero_stride(a[i].t, fn, a[i].name));
    if (!ref) ref = &a[i];
    else GL_TRY(gl_check_same_device(ref->t, a[i].t, fn, ref->name, a[i].name));
    if (a[i].flags & A_FLOAT) GL_TRY(gl_check_dtype_float(a[i].t, fn, a[i].name));
    if ((a[i].flags & A_INDEX) && a[i].t->dtype != GL_I32 && a[i].t->dtype != GL_I64)
      return gl_error("%s: %s has dtype %s, expected int32 or int64", fn, a[i].name, gl_dtype_name(a[i].t->dtype));
  }
  return GL_OK;
}
#define ARGS(...) (int)(sizeof((arg[]){__VA_ARGS__}) / sizeof(arg)), (arg[]){__VA_ARGS__}

static inline int check_dtype(const gl_tensor *t, const char *fn, const char *name, int dtype, const char *why) {
  if (!t || t->dtype == dtype) return GL_OK;
  return gl_error("%s: %s has dtype %s, expected %s%s%s%s", fn, name, gl_dtype_name(t->dtype),
                  gl_dtype_name(dtype), why ? " (" : "", why ? why : "", why ? ")" : "");
}

/* dtype of saved statistics (mean, rstd, lse, losses) for float data */
static inline int stat_dtype(int dtype) { return dtype == GL_F64 ? GL_F64 : GL_F32; }

/* t must have shape dims[0..nd) (-1: any size); why, if not NULL, is a
   printf format explaining where the expectation comes from */
static inline int check_shape(const gl_tensor *t, const char *fn, const char *name, int nd, const int64_t *dims,
                       const char *why, ...) __attribute__((format(printf, 6, 7)));
static inline int check_shape(const gl_tensor *t, const char *fn, const char *name, int nd, const int64_t *dims,
                       const char *why, ...) {
  if (!t) return GL_OK;
  int ok = t->ndim == nd;
  for (int d = 0; ok && d < nd; d++) ok = dims[d] < 0 || dims[d] == t->shape[d];
  if (ok) return GL_OK;
  char got[160], want[160], because[200] = "";
  size_t k = 0;
  k += (size_t)snprintf(want + k, sizeof want - k, "{");
  for (int d = 0; d < nd && k < sizeof want; d++) {
    if (dims[d] < 0) k += (size_t)snprintf(want + k, sizeof want - k, d ? ",*" : "*");
    else k += (size_t)snprintf(want + k, sizeof want - k, d ? ",%lld" : "%lld", (long long)dims[d]);
  }
  if (k < sizeof want) snprintf(want + k, sizeof want - k, "}");
  if (why) {
    char w[180];
    va_list ap; va_start(ap, why); vsnprintf(w, sizeof w, why, ap); va_end(ap);
    snprintf(because, sizeof because, " (%s)", w);
  }
  return gl_error("%s: %s has shape %s, expected %s%s", fn, name, gl_shape_str(t, got, sizeof got), want, because);
}

static inline int check_ndim(const gl_tensor *t, const char *fn, const char *name, int lo, int hi) {
  if (t->ndim >= lo && t->ndim <= hi) return GL_OK;
  if (lo == hi) return gl_error("%s: %s has %d dims, expected %d", fn, name, t->ndim, lo);
  return gl_error("%s: %s has %d dims, expected %d to %d", fn, name, t->ndim, lo, hi);
}

static inline int check_op(const char *fn, int op, int count) {
  if (op >= 0 && op < count) return GL_OK;
  return gl_error("%s: op is %d, expected 0..%d", fn, op, count - 1);
}

/* a dim argument in [-ndim, ndim), normalised to [0, ndim) */
static inline int check_dim(const char *fn, const char *name, int *dim, int ndim) {
  if (*dim < -ndim || *dim >= ndim || ndim == 0)
    return gl_error("%s: %s is %d, expected -%d <= %s < %d", fn, name, *dim, ndim, name, ndim);
  if (*dim < 0) *dim += ndim;
  return GL_OK;
}

/* x's shape with the last dim dropped (the shape of per-row statistics) */
static inline void lead_shape(const gl_tensor *x, int64_t *dims) {
  for (int d = 0; d < x->ndim - 1; d++) dims[d] = x->shape[d];
}

/* element range [lo, hi] a view can touch (for overlap checks) */
static inline void elem_range(const gl_tensor *t, int64_t *lo, int64_t *hi) {
  *lo = *hi = t->offset;
  for (int d = 0; d < t->ndim; d++) if (t->shape[d] > 0) *hi += (t->shape[d] - 1) * t->stride[d];
}
static inline int check_no_overlap(const char *fn, const gl_tensor *out, const char *on, const gl_tensor *in,
                            const char *in_name) {
  if (!gl_same_storage(out, in) || out->numel == 0 || in->numel == 0) return GL_OK;
  int64_t a0, a1, b0, b1;
  elem_range(out, &a0, &a1); elem_range(in, &b0, &b1);
  if (a1 < b0 || b1 < a0) return GL_OK;
  return gl_error("%s: %s overlaps the memory of %s; the output must not alias this input", fn, on, in_name);
}


#endif
