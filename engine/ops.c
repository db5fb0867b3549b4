/* ops.c — the public gl_* ops of gl_ops.h: validate every argument once,
 * then dispatch to the CPU (engine/cpu/NAME.c) or CUDA kernel (kernels/, .cu files).
 *
 * Validation order for each op: tensor handles (live struct and storage),
 * outputs without 0 strides, one device for all tensors, dtypes, shapes,
 * then scalars.  Messages name the function, the argument and expected vs
 * got, e.g. "gl_matmul: b has shape {4,5}, expected {3,*} (K of a is 3)".
 * Checks that need tensor values (ids in range) live in the kernels.  The
 * checks themselves are in ops_check.h, the matrix products in ops_matmul.c. */
#include "ops_check.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- elementwise ------------------------------------------------------ */

int gl_unary(int op, gl_tensor *out, const gl_tensor *x, double p0, double p1) {
  const char *fn = "gl_unary";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {x, "x", A_IN})));
  GL_TRY(check_op(fn, op, GL_U_COUNT));
  GL_TRY(gl_check_same_shape(out, x, fn, "out", "x"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->unary(op, out, x, p0, p1);
}

int gl_unary_backward(int op, gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, double p0, double p1) {
  const char *fn = "gl_unary_backward";
  GL_TRY(check_args(fn, ARGS({dx, "dx", A_OUT | A_FLOAT}, {dy, "dy", A_FLOAT}, {x, "x", A_FLOAT})));
  GL_TRY(check_op(fn, op, GL_U_COUNT));
  GL_TRY(gl_check_same_shape(dx, dy, fn, "dx", "dy"));
  GL_TRY(gl_check_same_shape(dx, x, fn, "dx", "x"));
  if (dx->numel == 0) return GL_OK;
  return gl_backend_of(dx->device)->unary_backward(op, dx, dy, x, p0, p1);
}

int gl_binary(int op, gl_tensor *out, const gl_tensor *a, const gl_tensor *b) {
  const char *fn = "gl_binary";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {a, "a", A_IN}, {b, "b", A_IN})));
  GL_TRY(check_op(fn, op, GL_B_COUNT));
  GL_TRY(gl_check_same_shape(out, a, fn, "out", "a"));
  GL_TRY(gl_check_same_shape(out, b, fn, "out", "b"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->binary(op, out, a, b);
}

int gl_where(gl_tensor *out, const gl_tensor *cond, const gl_tensor *a, const gl_tensor *b) {
  const char *fn = "gl_where";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {cond, "cond", A_IN}, {a, "a", A_IN}, {b, "b", A_IN})));
  GL_TRY(gl_check_same_shape(out, cond, fn, "out", "cond"));
  GL_TRY(gl_check_same_shape(out, a, fn, "out", "a"));
  GL_TRY(gl_check_same_shape(out, b, fn, "out", "b"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->where(out, cond, a, b);
}

/* ---- reductions --------------------------------------------------------- */

int gl_reduce(int op, gl_tensor *out, const gl_tensor *x, uint32_t dims_mask) {
  const char *fn = "gl_reduce";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {x, "x", A_IN})));
  GL_TRY(check_op(fn, op, GL_R_COUNT));
  if (x->ndim < 32 && (dims_mask >> x->ndim) != 0)
    return gl_error("%s: dims_mask 0x%x names dims beyond the %d dims of x", fn, dims_mask, x->ndim);
  int64_t want[GL_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) {
    want[d] = (dims_mask >> d) & 1 ? 1 : x->shape[d];
    if (((dims_mask >> d) & 1) && x->shape[d] == 0 && (op == GL_R_MAX || op == GL_R_MIN))
      return gl_error("%s: cannot take the %s over dim %d of x, which has size 0", fn,
                      op == GL_R_MAX ? "max" : "min", d + 1);
  }
  char xs[160];
  GL_TRY(check_shape(out, fn, "out", x->ndim, want, "x %s reduced over dims_mask 0x%x keeps them as size 1",
                     gl_shape_str(x, xs, sizeof xs), dims_mask));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->reduce(op, out, x, dims_mask);
}

int gl_reduce_max_dim(gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim) {
  const char *fn = "gl_reduce_max_dim";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {indices, "indices", A_OUT}, {x, "x", A_IN})));
  GL_TRY(check_dim(fn, "dim", &dim, x->ndim));
  GL_TRY(check_dtype(indices, fn, "indices", GL_I64, NULL));
  if (x->shape[dim] == 0)
    return gl_error("%s: cannot take the max over dim %d of x, which has size 0", fn, dim + 1);
  int64_t want[GL_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) want[d] = d == dim ? 1 : x->shape[d];
  GL_TRY(check_shape(out, fn, "out", x->ndim, want, "x reduced over dim %d, kept as size 1", dim + 1));
  GL_TRY(check_shape(indices, fn, "indices", x->ndim, want, "x reduced over dim %d, kept as size 1", dim + 1));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->reduce_max_dim(out, indices, x, dim);
}

int gl_sumsq(const gl_tensor *x, double *out) {
  const char *fn = "gl_sumsq";
  GL_TRY(check_args(fn, ARGS({x, "x", A_IN})));
  if (!out) return gl_error("%s: out is NULL, expected a pointer to a double", fn);
  *out = 0;
  if (gl_meta_read(x, fn, "x") == GL_ERR) return GL_ERR;
  if (x->numel == 0) return GL_OK;
  return gl_backend_of(x->device)->sumsq(x, out);
}

int gl_sumsq_multi(int n, const gl_tensor **xs, double *out) {
  const char *fn = "gl_sumsq_multi";
  if (!out) return gl_error("%s: out is NULL, expected a pointer to a double", fn);
  *out = 0;
  if (n < 0) return gl_error("%s: n is %d, expected >= 0", fn, n);
  if (n == 0) return GL_OK;
  if (!xs) return gl_error("%s: xs is NULL, expected an array of %d tensors", fn, n);
  for (int i = 0; i < n; i++) {
    char name[32];
    snprintf(name, sizeof name, "xs[%d]", i);
    GL_TRY(check_args(fn, ARGS({xs[0], "xs[0]", A_IN}, {xs[i], name, A_IN})));
    if (gl_meta_read(xs[i], fn, name) == GL_ERR) return GL_ERR;
  }
  return gl_backend_of(xs[0]->device)->sumsq_multi(n, xs, out);
}

/* ---- softmax ------------------------------------------------------------ */

int gl_softmax(gl_tensor *out, const gl_tensor *x, int log) {
  const char *fn = "gl_softmax";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {x, "x", A_FLOAT})));
  GL_TRY(check_ndim(x, fn, "x", 1, GL_MAX_DIMS));
  GL_TRY(gl_check_same_shape(x, out, fn, "x", "out"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->softmax(out, x, log != 0);
}

int gl_softmax_backward(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int log) {
  const char *fn = "gl_softmax_backward";
  GL_TRY(check_args(fn, ARGS({dx, "dx", A_OUT | A_FLOAT}, {y, "y", A_FLOAT}, {dy, "dy", A_FLOAT})));
  GL_TRY(check_ndim(y, fn, "y", 1, GL_MAX_DIMS));
  GL_TRY(gl_check_same_shape(y, dy, fn, "y", "dy"));
  GL_TRY(gl_check_same_shape(y, dx, fn, "y", "dx"));
  if (dx->numel == 0) return GL_OK;
  return gl_backend_of(dx->device)->softmax_backward(dx, y, dy, log != 0);
}

/* ---- layernorm / rmsnorm ------------------------------------------------ */

/* x (..., C) with C > 0; each named per-row statistic of shape x[:-1] and
   dtype stat_dtype(x); each named per-channel vector of shape (C) */
static int check_norm(const char *fn, const gl_tensor *x, const gl_tensor *const *stats, const char *const *snames,
                      int nstats, const gl_tensor *const *vecs, const char *const *vnames, int nvecs) {
  GL_TRY(check_ndim(x, fn, "x", 1, GL_MAX_DIMS));
  int64_t C = x->shape[x->ndim - 1], lead[GL_MAX_DIMS];
  if (C == 0) return gl_error("%s: x has an empty last dim (C = 0), expected C >= 1", fn);
  lead_shape(x, lead);
  for (int i = 0; i < nstats; i++) {
    GL_TRY(check_dtype(stats[i], fn, snames[i], stat_dtype(x->dtype), "statistics of x are float32, float64 for float64 x"));
    GL_TRY(check_shape(stats[i], fn, snames[i], x->ndim - 1, lead, "the shape of x without its last dim"));
  }
  /* the kernels read weight and bias as x's dtype: another one would be
     reinterpreted, not converted */
  for (int i = 0; i < nvecs; i++) {
    GL_TRY(check_dtype(vecs[i], fn, vnames[i], x->dtype, "the dtype of x"));
    GL_TRY(check_shape(vecs[i], fn, vnames[i], 1, &C, "C, the last dim of x"));
  }
  return GL_OK;
}

int gl_layernorm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *bias, double eps) {
  const char *fn = "gl_layernorm_forward";
  GL_TRY(check_args(fn, ARGS({y, "y", A_OUT | A_FLOAT}, {mean, "mean", A_OUT | A_OPT | A_FLOAT},
                             {rstd, "rstd", A_OUT | A_OPT | A_FLOAT}, {x, "x", A_FLOAT},
                             {weight, "weight", A_OPT | A_FLOAT}, {bias, "bias", A_OPT | A_FLOAT})));
  GL_TRY(check_norm(fn, x, (const gl_tensor *[]){mean, rstd}, (const char *[]){"mean", "rstd"}, 2,
                    (const gl_tensor *[]){weight, bias}, (const char *[]){"weight", "bias"}, 2));
  GL_TRY(gl_check_same_shape(x, y, fn, "x", "y"));
  if (!(eps >= 0)) return gl_error("%s: eps is %g, expected >= 0", fn, eps);
  if (y->numel == 0) return GL_OK;
  return gl_backend_of(y->device)->layernorm_forward(y, mean, rstd, x, weight, bias, eps);
}

int gl_layernorm_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                          const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd) {
  const char *fn = "gl_layernorm_backward";
  GL_TRY(check_args(fn, ARGS({dx, "dx", A_OUT | A_FLOAT}, {dweight, "dweight", A_OUT | A_OPT | A_FLOAT},
                             {dbias, "dbias", A_OUT | A_OPT | A_FLOAT}, {dy, "dy", A_FLOAT}, {x, "x", A_FLOAT},
                             {weight, "weight", A_OPT | A_FLOAT}, {mean, "mean", A_FLOAT}, {rstd, "rstd", A_FLOAT})));
  GL_TRY(check_norm(fn, x, (const gl_tensor *[]){mean, rstd}, (const char *[]){"mean", "rstd"}, 2,
                    (const gl_tensor *[]){weight, dweight, dbias}, (const char *[]){"weight", "dweight", "dbias"}, 3));
  GL_TRY(gl_check_same_shape(x, dy, fn, "x", "dy"));
  GL_TRY(gl_check_same_shape(x, dx, fn, "x", "dx"));
  if (x->numel == 0) return GL_OK;
  return gl_backend_of(dx->device)->layernorm_backward(dx, dweight, dbias, dy, x, weight, mean, rstd);
}

int gl_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *weight, double eps) {
  const char *fn = "gl_rmsnorm_forward";
  GL_TRY(check_args(fn, ARGS({y, "y", A_OUT | A_FLOAT}, {rstd, "rstd", A_OUT | A_OPT | A_FLOAT},
                             {x, "x", A_FLOAT}, {weight, "weight", A_OPT | A_FLOAT})));
  GL_TRY(check_norm(fn, x, (const gl_tensor *[]){rstd}, (const char *[]){"rstd"}, 1,
                    (const gl_tensor *[]){weight}, (const char *[]){"weight"}, 1));
  GL_TRY(gl_check_same_shape(x, y, fn, "x", "y"));
  if (!(eps >= 0)) return gl_error("%s: eps is %g, expected >= 0", fn, eps);
  if (y->numel == 0) return GL_OK;
  return gl_backend_of(y->device)->rmsnorm_forward(y, rstd, x, weight, eps);
}

int gl_rmsnorm_backward(gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy, const gl_tensor *x,
                        const gl_tensor *weight, const gl_tensor *rstd) {
  const char *fn = "gl_rmsnorm_backward";
  GL_TRY(check_args(fn, ARGS({dx, "dx", A_OUT | A_FLOAT}, {dweight, "dweight", A_OUT | A_OPT | A_FLOAT},
                             {dy, "dy", A_FLOAT}, {x, "x", A_FLOAT}, {weight, "weight", A_OPT | A_FLOAT},
                             {rstd, "rstd", A_FLOAT})));
  GL_TRY(check_norm(fn, x, (const gl_tensor *[]){rstd}, (const char *[]){"rstd"}, 1,
                    (const gl_tensor *[]){weight, dweight}, (const char *[]){"weight", "dweight"}, 2));
  GL_TRY(gl_check_same_shape(x, dy, fn, "x", "dy"));
  GL_TRY(gl_check_same_shape(x, dx, fn, "x", "dx"));
  if (x->numel == 0) return GL_OK;
  return gl_backend_of(dx->device)->rmsnorm_backward(dx, dweight, dy, x, weight, rstd);
}

int gl_add_norm_forward(gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                        const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps, int center) {
  const char *fn = "gl_add_norm_forward";
  GL_TRY(check_args(fn, ARGS({s, "s", A_OUT | A_FLOAT}, {y, "y", A_OUT | A_FLOAT}, {mean, "mean", A_OUT | A_OPT | A_FLOAT},
                             {rstd, "rstd", A_OUT | A_OPT | A_FLOAT}, {x, "x", A_FLOAT}, {r, "r", A_FLOAT},
                             {weight, "weight", A_OPT | A_FLOAT}, {bias, "bias", A_OPT | A_FLOAT})));
  if (!center && (mean || bias))
    return gl_error("%s: %s given with center 0 (rmsnorm), expected NULL", fn, mean ? "mean" : "bias");
  GL_TRY(check_norm(fn, x, (const gl_tensor *[]){mean, rstd}, (const char *[]){"mean", "rstd"}, 2,
                    (const gl_tensor *[]){weight, bias}, (const char *[]){"weight", "bias"}, 2));
  GL_TRY(gl_check_same_shape(x, r, fn, "x", "r"));
  GL_TRY(gl_check_same_shape(x, s, fn, "x", "s"));
  GL_TRY(gl_check_same_shape(x, y, fn, "x", "y"));
  GL_TRY(check_dtype(r, fn, "r", x->dtype, "the dtype of x"));
  GL_TRY(check_dtype(s, fn, "s", x->dtype, "the dtype of x"));
  GL_TRY(check_no_overlap(fn, s, "s", y, "y"));
  GL_TRY(check_no_overlap(fn, y, "y", x, "x"));
  GL_TRY(check_no_overlap(fn, y, "y", r, "r"));
  if (!(eps >= 0)) return gl_error("%s: eps is %g, expected >= 0", fn, eps);
  if (y->numel == 0) return GL_OK;
  return gl_backend_of(y->device)->add_norm_forward(s, y, mean, rstd, x, r, weight, bias, eps, center ? 1 : 0);
}

int gl_norm_backward_add(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd, const gl_tensor *dres,
                         int center) {
  const char *fn = "gl_norm_backward_add";
  GL_TRY(check_args(fn, ARGS({dx, "dx", A_OUT | A_FLOAT}, {dweight, "dweight", A_OUT | A_OPT | A_FLOAT},
                             {dbias, "dbias", A_OUT | A_OPT | A_FLOAT}, {dy, "dy", A_FLOAT}, {x, "x", A_FLOAT},
                             {weight, "weight", A_OPT | A_FLOAT}, {mean, "mean", A_OPT | A_FLOAT}, {rstd, "rstd", A_FLOAT},
                             {dres, "dres", A_OPT | A_FLOAT})));
  if (center && !mean) return gl_error("%s: mean is NULL, expected the forward's mean (center 1)", fn);
  if (!center && (mean || dbias))
    return gl_error("%s: %s given with center 0 (rmsnorm), expected NULL", fn, mean ? "mean" : "dbias");
  GL_TRY(check_norm(fn, x, (const gl_tensor *[]){mean, rstd}, (const char *[]){"mean", "rstd"}, 2,
                    (const gl_tensor *[]){weight, dweight, dbias}, (const char *[]){"weight", "dweight", "dbias"}, 3));
  GL_TRY(gl_check_same_shape(x, dy, fn, "x", "dy"));
  GL_TRY(gl_check_same_shape(x, dx, fn, "x", "dx"));
  if (dres) {
    GL_TRY(gl_check_same_shape(x, dres, fn, "x", "dres"));
    GL_TRY(check_dtype(dres, fn, "dres", dx->dtype, "the dtype of dx"));
  }
  GL_TRY(check_no_overlap(fn, dx, "dx", dy, "dy"));
  GL_TRY(check_no_overlap(fn, dx, "dx", x, "x"));
  if (dres) GL_TRY(check_no_overlap(fn, dx, "dx", dres, "dres"));
  if (x->numel == 0) return GL_OK;
  return gl_backend_of(dx->device)->norm_backward_add(dx, dweight, dbias, dy, x, weight, mean, rstd, dres, center ? 1 : 0);
}

/* ---- embedding and index ops ---------------------------------------------- */

/* ids.shape ++ {C} */
static void ids_rows_shape(const gl_tensor *ids, int64_t C, int64_t *dims) {
  for (int d = 0; d < ids->ndim; d++) dims[d] = ids->shape[d];
  dims[ids->ndim] = C;
}

int gl_embedding_forward(gl_tensor *out, const gl_tensor *table, const gl_tensor *ids) {
  const char *fn = "gl_embedding_forward";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {table, "table", A_IN}, {ids, "ids", A_INDEX})));
  GL_TRY(check_ndim(table, fn, "table", 2, 2));
  GL_TRY(check_ndim(ids, fn, "ids", 0, GL_MAX_DIMS - 1));
  GL_TRY(check_dtype(out, fn, "out", table->dtype, "the dtype of table"));
  int64_t want[GL_MAX_DIMS];
  ids_rows_shape(ids, table->shape[1], want);
  GL_TRY(check_shape(out, fn, "out", ids->ndim + 1, want, "ids.shape followed by C = %lld of table",
                     (long long)table->shape[1]));
  GL_TRY(check_no_overlap(fn, out, "out", table, "table"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->embedding_forward(out, table, ids);
}

int gl_embedding_backward(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids) {
  const char *fn = "gl_embedding_backward";
  GL_TRY(check_args(fn, ARGS({dtable, "dtable", A_OUT | A_FLOAT}, {dout, "dout", A_FLOAT}, {ids, "ids", A_INDEX})));
  GL_TRY(check_ndim(dtable, fn, "dtable", 2, 2));
  GL_TRY(check_ndim(ids, fn, "ids", 0, GL_MAX_DIMS - 1));
  int64_t want[GL_MAX_DIMS];
  ids_rows_shape(ids, dtable->shape[1], want);
  GL_TRY(check_shape(dout, fn, "dout", ids->ndim + 1, want, "ids.shape followed by C = %lld of dtable",
                     (long long)dtable->shape[1]));
  if (dtable->numel == 0) return GL_OK;
  return gl_backend_of(dtable->device)->embedding_backward(dtable, dout, ids);
}

int gl_index_select(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  const char *fn = "gl_index_select";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {x, "x", A_IN}, {idx, "idx", A_INDEX})));
  GL_TRY(check_dim(fn, "dim", &dim, x->ndim));
  GL_TRY(check_ndim(idx, fn, "idx", 1, 1));
  GL_TRY(check_dtype(out, fn, "out", x->dtype, "the dtype of x"));
  int64_t want[GL_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) want[d] = d == dim ? idx->shape[0] : x->shape[d];
  GL_TRY(check_shape(out, fn, "out", x->ndim, want, "x's shape with dim %d of size #idx = %lld", dim + 1,
                     (long long)idx->shape[0]));
  GL_TRY(check_no_overlap(fn, out, "out", x, "x"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->index_select(out, x, dim, idx);
}

/* idx has the dims of `big` and sizes no larger except along dim */
static int check_index_fits(const char *fn, const gl_tensor *idx, const gl_tensor *big, const char *bn, int dim) {
  if (idx->ndim != big->ndim)
    return gl_error("%s: idx has %d dims, expected %d (the dims of %s)", fn, idx->ndim, big->ndim, bn);
  for (int d = 0; d < idx->ndim; d++)
    if (d != dim && idx->shape[d] > big->shape[d])
      return gl_error("%s: idx has size %lld in dim %d, expected <= %lld (the size of %s there)", fn,
                      (long long)idx->shape[d], d + 1, (long long)big->shape[d], bn);
  return GL_OK;
}

int gl_gather(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  const char *fn = "gl_gather";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {x, "x", A_IN}, {idx, "idx", A_INDEX})));
  GL_TRY(check_dim(fn, "dim", &dim, x->ndim));
  GL_TRY(check_dtype(out, fn, "out", x->dtype, "the dtype of x"));
  GL_TRY(check_index_fits(fn, idx, x, "x", dim));
  GL_TRY(gl_check_same_shape(idx, out, fn, "idx", "out"));
  GL_TRY(check_no_overlap(fn, out, "out", x, "x"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->gather(out, x, dim, idx);
}

int gl_scatter_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  const char *fn = "gl_scatter_add";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {idx, "idx", A_INDEX}, {src, "src", A_IN})));
  GL_TRY(check_dim(fn, "dim", &dim, out->ndim));
  GL_TRY(check_index_fits(fn, idx, out, "out", dim));
  GL_TRY(gl_check_same_shape(idx, src, fn, "idx", "src"));
  GL_TRY(check_no_overlap(fn, out, "out", src, "src"));
  if (src->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->scatter_add(out, dim, idx, src);
}

int gl_index_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  const char *fn = "gl_index_add";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {idx, "idx", A_INDEX}, {src, "src", A_IN})));
  GL_TRY(check_dim(fn, "dim", &dim, out->ndim));
  GL_TRY(check_ndim(idx, fn, "idx", 1, 1));
  int64_t want[GL_MAX_DIMS];
  for (int d = 0; d < out->ndim; d++) want[d] = d == dim ? idx->shape[0] : out->shape[d];
  GL_TRY(check_shape(src, fn, "src", out->ndim, want, "out's shape with dim %d of size #idx = %lld", dim + 1,
                     (long long)idx->shape[0]));
  GL_TRY(check_no_overlap(fn, out, "out", src, "src"));
  if (src->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->index_add(out, dim, idx, src);
}

/* ---- attention ------------------------------------------------------------ */

/* q (B,H,T,D), k and v (B,Hkv,S,D), H % Hkv == 0, T <= S; the lse shape */
static int check_attention(const char *fn, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                           int64_t window) {
  GL_TRY(check_ndim(q, fn, "q", 4, 4));
  GL_TRY(check_dtype(k, fn, "k", q->dtype, "the dtype of q"));
  GL_TRY(check_dtype(v, fn, "v", q->dtype, "the dtype of q"));
  int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  GL_TRY(check_shape(k, fn, "k", 4, (int64_t[]){B, -1, -1, D}, "(B, Hkv, S, D) with B = %lld, D = %lld of q",
                     (long long)B, (long long)D));
  int64_t Hkv = k->shape[1], S = k->shape[2];
  GL_TRY(check_shape(v, fn, "v", 4, k->shape, "the shape of k"));
  if (Hkv == 0 || H % Hkv != 0)
    return gl_error("%s: q has %lld heads and k %lld, expected H to be a multiple of Hkv >= 1", fn,
                    (long long)H, (long long)Hkv);
  if (T > S && window >= 0) /* (window < 0: no causal mask, any T and S) */
    return gl_error("%s: q has T = %lld queries and k S = %lld keys, expected T <= S", fn, (long long)T, (long long)S);
  return GL_OK;
}

/* segments (optional): (B, S) ids of the key positions on q's device and a
   causal mask; query t (at position S - T + t) carries its position's id */
static int check_segments(const char *fn, const gl_tensor *segments, const gl_tensor *q, const gl_tensor *k,
                          int64_t window) {
  if (!segments) return GL_OK;
  if (window < 0) return gl_error("%s: segments need a causal mask (window >= 0), got window %lld", fn, (long long)window);
  GL_TRY(check_shape(segments, fn, "segments", 2, (int64_t[]){q->shape[0], k->shape[2]},
                     "(B, S) = (%lld, %lld): q's batch, k's positions", (long long)q->shape[0],
                     (long long)k->shape[2]));
  if (segments->device != q->device)
    return gl_error("%s: segments are on device %d, expected q's device %d", fn, segments->device, q->device);
  return GL_OK;
}

static int attention_forward(const char *fn, gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                             const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window) {
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {lse, "lse", A_OUT | A_OPT | A_FLOAT},
                             {q, "q", A_FLOAT}, {k, "k", A_FLOAT}, {v, "v", A_FLOAT},
                             {segments, "segments", A_OPT | A_INDEX})));
  GL_TRY(check_attention(fn, q, k, v, window));
  GL_TRY(check_segments(fn, segments, q, k, window));
  GL_TRY(check_dtype(out, fn, "out", q->dtype, "the dtype of q"));
  GL_TRY(gl_check_same_shape(q, out, fn, "q", "out"));
  GL_TRY(check_dtype(lse, fn, "lse", stat_dtype(q->dtype), "float32, float64 for float64 q"));
  GL_TRY(check_shape(lse, fn, "lse", 3, q->shape, "(B, H, T) of q"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->attention_forward(out, lse, q, k, v, segments, scale, window);
}

int gl_attention_forward(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                         const gl_tensor *v, double scale, int64_t window) {
  return attention_forward("gl_attention_forward", out, lse, q, k, v, NULL, scale, window);
}

int gl_attention_forward_seg(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                             const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window) {
  const char *fn = "gl_attention_forward_seg";
  if (!segments) return gl_error("%s: segments is NULL (gl_attention_forward takes none)", fn);
  return attention_forward(fn, out, lse, q, k, v, segments, scale, window);
}

static int attention_backward(const char *fn, gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                              const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                              const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments,
                              double scale, int64_t window) {
  GL_TRY(check_args(fn, ARGS({dq, "dq", A_OUT | A_FLOAT}, {dk, "dk", A_OUT | A_FLOAT}, {dv, "dv", A_OUT | A_FLOAT},
                             {dout, "dout", A_FLOAT}, {q, "q", A_FLOAT}, {k, "k", A_FLOAT}, {v, "v", A_FLOAT},
                             {out, "out", A_FLOAT}, {lse, "lse", A_FLOAT}, {segments, "segments", A_OPT | A_INDEX})));
  GL_TRY(check_attention(fn, q, k, v, window));
  GL_TRY(check_segments(fn, segments, q, k, window));
  const gl_tensor *like_q[] = {dq, dout, out}, *like_k[] = {dk, dv};
  const char *nq[] = {"dq", "dout", "out"}, *nk[] = {"dk", "dv"};
  for (int i = 0; i < 3; i++) {
    GL_TRY(check_dtype(like_q[i], fn, nq[i], q->dtype, "the dtype of q"));
    GL_TRY(gl_check_same_shape(q, like_q[i], fn, "q", nq[i]));
  }
  for (int i = 0; i < 2; i++) {
    GL_TRY(check_dtype(like_k[i], fn, nk[i], q->dtype, "the dtype of q"));
    GL_TRY(gl_check_same_shape(k, like_k[i], fn, "k", nk[i]));
  }
  GL_TRY(check_dtype(lse, fn, "lse", stat_dtype(q->dtype), "float32, float64 for float64 q"));
  GL_TRY(check_shape(lse, fn, "lse", 3, q->shape, "(B, H, T) of q"));
  if (dk->numel == 0) return GL_OK;
  return gl_backend_of(dq->device)->attention_backward(dq, dk, dv, dout, q, k, v, out, lse, segments, scale, window);
}

int gl_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                          const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                          const gl_tensor *out, const gl_tensor *lse, double scale, int64_t window) {
  return attention_backward("gl_attention_backward", dq, dk, dv, dout, q, k, v, out, lse, NULL, scale, window);
}

int gl_attention_backward_seg(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                              const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                              const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments,
                              double scale, int64_t window) {
  const char *fn = "gl_attention_backward_seg";
  if (!segments) return gl_error("%s: segments is NULL (gl_attention_backward takes none)", fn);
  return attention_backward(fn, dq, dk, dv, dout, q, k, v, out, lse, segments, scale, window);
}

/* ---- rope ------------------------------------------------------------------- */

/* x (B, T, H, D) with D even and the rotary tables cos, sin (T, D/2) */
static int check_rope_tables(const char *fn, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin) {
  GL_TRY(check_ndim(x, fn, "x", 4, 4));
  int64_t T = x->shape[1], D = x->shape[3];
  if (D % 2) return gl_error("%s: x has head dim D = %lld, expected an even D", fn, (long long)D);
  GL_TRY(check_shape(cos, fn, "cos", 2, (int64_t[]){T, D / 2}, "(T, D/2) for x (B, T, H, D) = %lld, %lld",
                     (long long)T, (long long)D));
  return check_shape(sin, fn, "sin", 2, (int64_t[]){T, D / 2}, "(T, D/2) for x (B, T, H, D) = %lld, %lld",
                     (long long)T, (long long)D);
}

int gl_rope(gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse) {
  const char *fn = "gl_rope";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {x, "x", A_FLOAT}, {cos, "cos", A_FLOAT},
                             {sin, "sin", A_FLOAT})));
  GL_TRY(check_rope_tables(fn, x, cos, sin));
  GL_TRY(gl_check_same_shape(x, out, fn, "x", "out"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->rope(out, x, cos, sin, inverse != 0);
}

/* as gl_rope's arguments, and rstd the per-row statistic (B, T, H) as the norms' */
static int check_rope_rows(const char *fn, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin,
                           const gl_tensor *rstd) {
  GL_TRY(check_rope_tables(fn, x, cos, sin));
  return check_norm(fn, x, (const gl_tensor *[]){rstd}, (const char *[]){"rstd"}, 1, NULL, NULL, 0);
}

int gl_rope_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *cos,
                            const gl_tensor *sin, double eps) {
  const char *fn = "gl_rope_rmsnorm_forward";
  GL_TRY(check_args(fn, ARGS({y, "y", A_OUT | A_FLOAT}, {rstd, "rstd", A_OUT | A_OPT | A_FLOAT}, {x, "x", A_FLOAT},
                             {cos, "cos", A_FLOAT}, {sin, "sin", A_FLOAT})));
  GL_TRY(check_rope_rows(fn, x, cos, sin, rstd));
  GL_TRY(gl_check_same_shape(x, y, fn, "x", "y"));
  if (!(eps >= 0)) return gl_error("%s: eps is %g, expected >= 0", fn, eps);
  if (y->numel == 0) return GL_OK;
  return gl_backend_of(y->device)->rope_rmsnorm_forward(y, rstd, x, cos, sin, eps);
}

int gl_rope_rmsnorm_backward(gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *cos,
                             const gl_tensor *sin, const gl_tensor *rstd) {
  const char *fn = "gl_rope_rmsnorm_backward";
  GL_TRY(check_args(fn, ARGS({dx, "dx", A_OUT | A_FLOAT}, {dy, "dy", A_FLOAT}, {x, "x", A_FLOAT},
                             {cos, "cos", A_FLOAT}, {sin, "sin", A_FLOAT}, {rstd, "rstd", A_FLOAT})));
  GL_TRY(check_rope_rows(fn, x, cos, sin, rstd));
  GL_TRY(gl_check_same_shape(x, dy, fn, "x", "dy"));
  GL_TRY(gl_check_same_shape(x, dx, fn, "x", "dx"));
  if (x->numel == 0) return GL_OK;
  return gl_backend_of(dx->device)->rope_rmsnorm_backward(dx, dy, x, cos, sin, rstd);
}

/* ---- cross-entropy ---------------------------------------------------------- */

static int check_ce(const char *fn, const gl_tensor *logits, const gl_tensor *targets, double softcap) {
  GL_TRY(check_ndim(logits, fn, "logits", 2, 2));
  GL_TRY(check_shape(targets, fn, "targets", 1, logits->shape, "N, the rows of logits"));
  if (!(softcap >= 0)) return gl_error("%s: softcap is %g, expected >= 0 (0 disables it)", fn, softcap);
  return GL_OK;
}

int gl_cross_entropy_forward(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                             const gl_tensor *targets, int64_t ignore_index, double softcap) {
  const char *fn = "gl_cross_entropy_forward";
  GL_TRY(check_args(fn, ARGS({losses, "losses", A_OUT | A_FLOAT}, {lse, "lse", A_OUT | A_OPT | A_FLOAT},
                             {logits, "logits", A_FLOAT}, {targets, "targets", A_INDEX})));
  GL_TRY(check_ce(fn, logits, targets, softcap));
  const char *why = "float32, float64 for float64 logits";
  GL_TRY(check_dtype(losses, fn, "losses", stat_dtype(logits->dtype), why));
  GL_TRY(check_dtype(lse, fn, "lse", stat_dtype(logits->dtype), why));
  GL_TRY(check_shape(losses, fn, "losses", 1, logits->shape, "N, the rows of logits"));
  GL_TRY(check_shape(lse, fn, "lse", 1, logits->shape, "N, the rows of logits"));
  if (logits->shape[0] == 0) return GL_OK;
  return gl_backend_of(logits->device)->cross_entropy_forward(losses, lse, logits, targets, ignore_index, softcap);
}

int gl_cross_entropy_backward(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                              const gl_tensor *lse, int64_t ignore_index, double softcap, double scale,
                              const gl_tensor *scale_by) {
  const char *fn = "gl_cross_entropy_backward";
  GL_TRY(check_args(fn, ARGS({dlogits, "dlogits", A_OUT | A_FLOAT}, {logits, "logits", A_FLOAT},
                             {targets, "targets", A_INDEX}, {lse, "lse", A_FLOAT},
                             {scale_by, "scale_by", A_OPT | A_FLOAT})));
  if (scale_by && scale_by->numel != 1)
    return gl_error("%s: scale_by has %lld elements, expected 1", fn, (long long)scale_by->numel);
  GL_TRY(check_ce(fn, logits, targets, softcap));
  GL_TRY(gl_check_same_shape(logits, dlogits, fn, "logits", "dlogits"));
  GL_TRY(check_dtype(lse, fn, "lse", stat_dtype(logits->dtype), "float32, float64 for float64 logits"));
  GL_TRY(check_shape(lse, fn, "lse", 1, logits->shape, "N, the rows of logits"));
  if (dlogits->numel == 0) return GL_OK;
  return gl_backend_of(logits->device)->cross_entropy_backward(dlogits, logits, targets, lse, ignore_index, softcap,
                     scale, scale_by);
}

/* ---- dropout ------------------------------------------------------------------ */

int gl_dropout(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset) {
  const char *fn = "gl_dropout";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {x, "x", A_FLOAT})));
  GL_TRY(gl_check_same_shape(x, out, fn, "x", "out"));
  /* p = 1 would scale the kept (none) by 1/(1-p) = inf: NaN, not zeros */
  if (!(p >= 0 && p < 1)) return gl_error("%s: p is %g, expected 0 <= p < 1", fn, p);
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->dropout(out, x, p, seed, offset);
}

/* ---- optimizers ------------------------------------------------------------- */

/* contiguous tensors of param's numel, and a slice inside them */
static int check_slice(const char *fn, int n, const gl_tensor *const *ts, const char *const *names,
                       int64_t start, int64_t len) {
  for (int i = 0; i < n; i++) {
    if (!gl_is_contiguous(ts[i]))
      return gl_error("%s: %s is not contiguous, expected a flat contiguous tensor", fn, names[i]);
    if (ts[i]->numel != ts[0]->numel)
      return gl_error("%s: %s has %lld elements, expected %lld (the numel of %s)", fn, names[i],
                      (long long)ts[i]->numel, (long long)ts[0]->numel, names[0]);
  }
  if (start < 0 || len < 0 || start > ts[0]->numel - len)
    return gl_error("%s: slice [start=%lld, start+len=%lld) is outside [0, %lld), the numel of %s", fn,
                    (long long)start, (long long)(start + len), (long long)ts[0]->numel, names[0]);
  return GL_OK;
}

static int adamw_check(const char *fn, gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v,
                       const char *names[4], int64_t start, int64_t len, double beta1, double beta2, double eps,
                       int64_t step) {
  GL_TRY(check_args(fn, ARGS({param, names[0], A_OUT | A_FLOAT}, {grad, names[1], A_FLOAT},
                             {m, names[2], A_OUT | A_FLOAT}, {v, names[3], A_OUT | A_FLOAT})));
  if (param->dtype != GL_F32 && param->dtype != GL_F64)
    return gl_error("%s: %s has dtype %s, expected float32 or float64", fn, names[0], gl_dtype_name(param->dtype));
  GL_TRY(check_slice(fn, 4, (const gl_tensor *[]){param, grad, m, v}, names, start, len));
  if (step < 1) return gl_error("%s: step is %lld, expected >= 1 (bias corrections use 1 - beta^step)", fn,
                                (long long)step);
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    return gl_error("%s: betas are (%g, %g), expected each in [0, 1)", fn, beta1, beta2);
  if (!(eps >= 0)) return gl_error("%s: eps is %g, expected >= 0", fn, eps);
  return GL_OK;
}

int gl_adamw_update(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v,
                    int64_t start, int64_t len, double lr, double beta1, double beta2,
                    double eps, double weight_decay, int64_t step) {
  const char *fn = "gl_adamw_update";
  GL_TRY(adamw_check(fn, param, grad, m, v, (const char *[]){"param", "grad", "m", "v"}, start, len, beta1, beta2,
                     eps, step));
  if (len == 0) return GL_OK;
  return gl_backend_of(param->device)->adamw_update(param, grad, m, v, start, len, lr, beta1, beta2, eps,
                     weight_decay, step);
}

int gl_adamw_update_multi(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms,
                          gl_tensor **vs, gl_tensor **outs, const double *lrs, const double *wds,
                          double beta1, double beta2, double eps, int64_t step) {
  const char *fn = "gl_adamw_update_multi";
  if (n < 0) return gl_error("%s: n is %d, expected >= 0", fn, n);
  if (n == 0) return GL_OK;
  const void *arrays[6] = {params, grads, ms, vs, lrs, wds};
  const char *array_names[6] = {"params", "grads", "ms", "vs", "lrs", "wds"};
  for (int k = 0; k < 6; k++)
    if (!arrays[k]) return gl_error("%s: %s is NULL, expected an array of %d", fn, array_names[k], n);
  for (int i = 0; i < n; i++) {
    char np[32], ng[32], nm[32], nv[32], no[32];
    snprintf(np, sizeof np, "params[%d]", i); snprintf(ng, sizeof ng, "grads[%d]", i);
    snprintf(nm, sizeof nm, "ms[%d]", i); snprintf(nv, sizeof nv, "vs[%d]", i);
    GL_TRY(adamw_check(fn, params[i], grads[i], ms[i], vs[i], (const char *[]){np, ng, nm, nv}, 0, 0, beta1,
                       beta2, eps, step));
    GL_TRY(check_args(fn, ARGS({params[0], "params[0]", A_IN}, {params[i], np, A_IN})));
    const gl_tensor *o = outs ? outs[i] : NULL;
    if (!o) continue;
    snprintf(no, sizeof no, "outs[%d]", i);
    GL_TRY(check_args(fn, ARGS({params[i], np, A_IN}, {o, no, A_OUT | A_FLOAT})));
    GL_TRY(check_slice(fn, 2, (const gl_tensor *[]){params[i], o}, (const char *[]){np, no}, 0, 0));
  }
  return gl_backend_of(params[0]->device)->adamw_update_multi(n, params, grads, ms, vs, outs, lrs, wds, beta1, beta2,
                     eps, step);
}

int gl_momentum_update(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad,
                       int64_t start, int64_t len, double mu, int nesterov) {
  const char *fn = "gl_momentum_update";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {buf, "buf", A_OUT | A_FLOAT},
                             {grad, "grad", A_FLOAT})));
  GL_TRY(check_slice(fn, 3, (const gl_tensor *[]){buf, grad, out}, (const char *[]){"buf", "grad", "out"},
                     start, len));
  if (len == 0) return GL_OK;
  return gl_backend_of(buf->device)->momentum_update(out, buf, grad, start, len, mu, nesterov);
}
