/* ops_moe.c — the mixture-of-experts ops of gl_ops.h: the routing plan, the
 * permutation into expert order and the weighted combine back, the grouped
 * products over every expert's rows.  Each validates its arguments (as
 * ops.c does), then calls its device's backend.  Checks that need values
 * (expert ids, slots, counts) run in the kernels. */
#include "ops_check.h"

static int check_2d(const char *fn, const gl_tensor *t, const char *name) { return check_ndim(t, fn, name, 2, 2); }

int gl_moe_route(gl_tensor *slots, gl_tensor *counts, gl_tensor *load, const gl_tensor *experts, int64_t capacity) {
  const char *fn = "gl_moe_route";
  GL_TRY(check_args(fn, ARGS({slots, "slots", A_OUT}, {counts, "counts", A_OUT}, {load, "load", A_OUT},
                             {experts, "experts", A_INDEX})));
  GL_TRY(check_2d(fn, experts, "experts"));
  GL_TRY(check_dtype(slots, fn, "slots", GL_I64, NULL));
  GL_TRY(check_dtype(counts, fn, "counts", GL_I64, NULL));
  GL_TRY(check_dtype(load, fn, "load", GL_I64, NULL));
  GL_TRY(gl_check_same_shape(slots, experts, fn, "slots", "experts"));
  GL_TRY(check_ndim(counts, fn, "counts", 1, 1));
  if (counts->shape[0] < 1) return gl_error("%s: counts has 0 experts, expected at least 1", fn);
  GL_TRY(gl_check_same_shape(load, counts, fn, "load", "counts"));
  if (capacity < 0) return gl_error("%s: capacity is %lld, expected >= 0 (0: dropless)", fn, (long long)capacity);
  GL_TRY(check_no_overlap(fn, slots, "slots", counts, "counts"));
  GL_TRY(check_no_overlap(fn, slots, "slots", load, "load"));
  GL_TRY(check_no_overlap(fn, counts, "counts", load, "load"));
  return gl_backend_of(counts->device)->moe_route(slots, counts, load, experts, capacity);
}

/* rows (N, C) and buffer (M, C) in one float dtype; slots (N, K) int64;
   weights (N, K) float or NULL */
static int check_rows(const char *fn, const gl_tensor *rows, const char *rn, const gl_tensor *buf, const char *bn,
                      const gl_tensor *slots, const gl_tensor *weights) {
  GL_TRY(check_2d(fn, rows, rn));
  GL_TRY(check_2d(fn, buf, bn));
  GL_TRY(check_2d(fn, slots, "slots"));
  GL_TRY(check_dtype(slots, fn, "slots", GL_I64, "from gl_moe_route"));
  GL_TRY(check_dtype(buf, fn, bn, rows->dtype, NULL));
  int64_t want[2] = {slots->shape[0], buf->shape[1]};
  GL_TRY(check_shape(rows, fn, rn, 2, want, "the tokens of slots, the width of %s", bn));
  if (weights) {
    int64_t w[2] = {slots->shape[0], slots->shape[1]};
    GL_TRY(check_shape(weights, fn, "weights", 2, w, "the shape of slots"));
  }
  return GL_OK;
}

int gl_moe_permute(gl_tensor *out, const gl_tensor *x, const gl_tensor *slots, const gl_tensor *weights) {
  const char *fn = "gl_moe_permute";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {x, "x", A_FLOAT}, {slots, "slots", A_INDEX},
                             {weights, "weights", A_OPT | A_FLOAT})));
  GL_TRY(check_rows(fn, x, "x", out, "out", slots, weights));
  GL_TRY(check_no_overlap(fn, out, "out", x, "x"));
  GL_TRY(check_no_overlap(fn, out, "out", slots, "slots"));
  if (weights) GL_TRY(check_no_overlap(fn, out, "out", weights, "weights"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->moe_permute(out, x, slots, weights);
}

int gl_moe_combine(gl_tensor *out, const gl_tensor *y, const gl_tensor *slots, const gl_tensor *weights) {
  const char *fn = "gl_moe_combine";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {y, "y", A_FLOAT}, {slots, "slots", A_INDEX},
                             {weights, "weights", A_OPT | A_FLOAT})));
  GL_TRY(check_rows(fn, out, "out", y, "y", slots, weights));
  GL_TRY(check_no_overlap(fn, out, "out", y, "y"));
  GL_TRY(check_no_overlap(fn, out, "out", slots, "slots"));
  if (weights) GL_TRY(check_no_overlap(fn, out, "out", weights, "weights"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->moe_combine(out, y, slots, weights);
}

int gl_moe_combine_wgrad(gl_tensor *dweights, const gl_tensor *dout, const gl_tensor *y, const gl_tensor *slots) {
  const char *fn = "gl_moe_combine_wgrad";
  GL_TRY(check_args(fn, ARGS({dweights, "dweights", A_OUT | A_FLOAT}, {dout, "dout", A_FLOAT}, {y, "y", A_FLOAT},
                             {slots, "slots", A_INDEX})));
  GL_TRY(check_rows(fn, dout, "dout", y, "y", slots, dweights));
  GL_TRY(check_no_overlap(fn, dweights, "dweights", dout, "dout"));
  GL_TRY(check_no_overlap(fn, dweights, "dweights", y, "y"));
  GL_TRY(check_no_overlap(fn, dweights, "dweights", slots, "slots"));
  if (dweights->numel == 0) return GL_OK;
  return gl_backend_of(dweights->device)->moe_combine_wgrad(dweights, dout, y, slots);
}

/* n >= 1 experts; counts (n) int32/int64 on ref's device */
static int check_counts(const char *fn, int n, const void *list, const char *ln, const gl_tensor *counts,
                        const gl_tensor *ref, const char *refn) {
  if (n < 1) return gl_error("%s: n is %d, expected >= 1 (the experts)", fn, n);
  if (!list) return gl_error("%s: %s is NULL, expected an array of %d", fn, ln, n);
  GL_TRY(check_args(fn, ARGS({ref, refn, A_IN}, {counts, "counts", A_INDEX})));
  int64_t want[1] = {n};
  return check_shape(counts, fn, "counts", 1, want, "one per expert, n = %d", n);
}

int gl_grouped_matmul(gl_tensor *out, const gl_tensor *a, int n, const gl_tensor **bs, const gl_tensor *counts) {
  const char *fn = "gl_grouped_matmul";
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {a, "a", A_FLOAT})));
  GL_TRY(check_counts(fn, n, bs, "bs", counts, out, "out"));
  GL_TRY(check_2d(fn, a, "a"));
  GL_TRY(check_2d(fn, out, "out"));
  GL_TRY(check_dtype(out, fn, "out", a->dtype, "the dtype of a"));
  for (int e = 0; e < n; e++) {
    char name[32];
    snprintf(name, sizeof name, "bs[%d]", e);
    GL_TRY(check_args(fn, ARGS({a, "a", A_IN}, {bs[e], name, A_FLOAT})));
    GL_TRY(check_dtype(bs[e], fn, name, a->dtype, "the dtype of a"));
    int64_t want[2] = {a->shape[1], out->shape[1]};
    GL_TRY(check_shape(bs[e], fn, name, 2, want, "K of a, N of out"));
    GL_TRY(check_no_overlap(fn, out, "out", bs[e], name));
  }
  int64_t want[2] = {a->shape[0], out->shape[1]};
  GL_TRY(check_shape(out, fn, "out", 2, want, "the rows of a"));
  GL_TRY(check_no_overlap(fn, out, "out", a, "a"));
  GL_TRY(check_no_overlap(fn, out, "out", counts, "counts"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->grouped_matmul(out, a, n, bs, counts);
}

int gl_grouped_matmul_wgrad(int n, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y, const gl_tensor *counts) {
  const char *fn = "gl_grouped_matmul_wgrad";
  GL_TRY(check_args(fn, ARGS({x, "x", A_FLOAT}, {y, "y", A_FLOAT})));
  GL_TRY(check_counts(fn, n, dbs, "dbs", counts, x, "x"));
  GL_TRY(check_2d(fn, x, "x"));
  GL_TRY(check_2d(fn, y, "y"));
  GL_TRY(check_dtype(y, fn, "y", x->dtype, "the dtype of x"));
  int64_t rows[2] = {x->shape[0], -1};
  GL_TRY(check_shape(y, fn, "y", 2, rows, "the rows of x"));
  for (int e = 0; e < n; e++) {
    char name[32];
    snprintf(name, sizeof name, "dbs[%d]", e);
    GL_TRY(check_args(fn, ARGS({x, "x", A_IN}, {dbs[e], name, A_OUT | A_FLOAT})));
    GL_TRY(check_dtype(dbs[e], fn, name, x->dtype, "the dtype of x"));
    int64_t want[2] = {x->shape[1], y->shape[1]};
    GL_TRY(check_shape(dbs[e], fn, name, 2, want, "the widths of x and y"));
    GL_TRY(check_no_overlap(fn, dbs[e], name, x, "x"));
    GL_TRY(check_no_overlap(fn, dbs[e], name, y, "y"));
    for (int f = 0; f < e; f++) {
      char other[32];
      snprintf(other, sizeof other, "dbs[%d]", f);
      GL_TRY(check_no_overlap(fn, dbs[e], name, dbs[f], other));
    }
  }
  return gl_backend_of(x->device)->grouped_matmul_wgrad(n, dbs, x, y, counts);
}
