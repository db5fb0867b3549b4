/* ops_matmul.c — the matrix products of gl_ops.h: plain, with a bias, with a
 * cuBLASLt-style epilogue (GELU, GELU's gradient, bias gradients), two
 * independent products at once, and a linear layer's whole backward.
 * Checked as every op is (ops_check.h), then dispatched. */
#include "ops_check.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- matmul ------------------------------------------------------------- */

static int check_matmul(const char *fn, const gl_tensor *out, const gl_tensor *a, const gl_tensor *b) {
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {a, "a", A_FLOAT}, {b, "b", A_FLOAT})));
  GL_TRY(check_dtype(a, fn, "a", out->dtype, "the dtype of out"));
  GL_TRY(check_dtype(b, fn, "b", out->dtype, "the dtype of out"));
  GL_TRY(check_ndim(a, fn, "a", 2, GL_MAX_DIMS));
  int nd = a->ndim;
  int64_t M = a->shape[nd - 2], K = a->shape[nd - 1], want[GL_MAX_DIMS];
  for (int d = 0; d < nd - 2; d++) want[d] = a->shape[d];
  want[nd - 2] = K; want[nd - 1] = -1;
  GL_TRY(check_shape(b, fn, "b", nd, want, "K of a is %lld", (long long)K));
  want[nd - 2] = M; want[nd - 1] = b->shape[nd - 1];
  GL_TRY(check_shape(out, fn, "out", nd, want, "M of a is %lld, N of b is %lld", (long long)M,
                     (long long)b->shape[nd - 1]));
  GL_TRY(check_no_overlap(fn, out, "out", a, "a"));
  GL_TRY(check_no_overlap(fn, out, "out", b, "b"));
  return GL_OK;
}

int gl_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta) {
  GL_TRY(check_matmul("gl_matmul", out, a, b));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->matmul(out, a, b, alpha, beta);
}

int gl_matmul_bias(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *bias) {
  const char *fn = "gl_matmul_bias";
  GL_NONNULL(fn, out, a, b, bias);
  GL_TRY(check_matmul(fn, out, a, b));
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {bias, "bias", A_FLOAT})));
  int64_t N = out->shape[out->ndim - 1];
  GL_TRY(check_shape(bias, fn, "bias", 1, (int64_t[]){N}, "N of out is %lld", (long long)N));
  GL_TRY(check_no_overlap(fn, out, "out", bias, "bias"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->matmul_bias(out, a, b, bias);
}

int gl_matmul_add(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c) {
  const char *fn = "gl_matmul_add";
  GL_NONNULL(fn, out, a, b, c);
  GL_TRY(check_matmul(fn, out, a, b));
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {c, "c", A_FLOAT})));
  GL_TRY(gl_check_same_shape(out, c, fn, "out", "c"));
  GL_TRY(check_no_overlap(fn, out, "out", c, "c"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->matmul_add(out, a, b, c);
}

/* ---- products with epilogues, and pairs of products ------------------- */

/* one product of a pair: out = alpha a @ b + beta out (epi 0), or a
   gl_matmul_epilogue; out NULL: not wanted */
typedef struct {
  int epi;
  gl_tensor *out;
  const gl_tensor *a, *b;
  gl_tensor *bias, *aux;
  double alpha, beta;
} product;

static int run_one(const product *p) {
  if (!p->out) return GL_OK;
  if (p->out->numel == 0)  /* no product to run; a bias gradient of no rows is 0 */
    return p->epi && p->bias && p->bias->numel ? gl_backend_of(p->bias->device)->fill(p->bias, 0) : GL_OK;
  if (p->epi) return gl_backend_of(p->out->device)->matmul_epilogue(p->epi, p->out, p->a, p->b, p->bias, p->aux);
  return gl_backend_of(p->out->device)->matmul(p->out, p->a, p->b, p->alpha, p->beta);
}

/* Two independent products at once.  On the CPU with two or more threads
   each runs single-threaded on its own thread (OpenBLAS's OpenMP build uses
   one thread inside a parallel region): for the small matrices of a
   backward pass (dX and dW of one linear layer) that beats two calls each
   split over the threads, whose halves are too small to keep BLAS busy.
   The epilogues' passes after the products run outside that region, on
   every thread. */
static int run_pair(const product p[2]) {
  int sequential = !p[0].out || !p[1].out || p[0].out->device >= 0 || p[1].out->device >= 0 ||
                   gl_get_num_threads() < 2 || p[0].out->numel == 0 || p[1].out->numel == 0 ||
                   gl_meta_active();  /* (gl_backend_of: a plan runs no kernel) */
#ifndef _OPENMP
  sequential = 1;
#endif
  if (sequential) {
    GL_TRY(run_one(&p[0]));
    return run_one(&p[1]);
  }
#ifdef _OPENMP
  /* error messages are per thread: the worker's is carried back */
  int rc[2] = {GL_OK, GL_OK};
  char msg[2][512] = {"", ""};
  GL_PAR_REGION(2,
    int i = gl_thread_id();
    if (i < 2) {
      const product *q = &p[i];
      rc[i] = q->epi ? gl_epilogue_product(q->epi, q->out, q->a, q->b, q->bias, q->aux)
                     : cpu_matmul(q->out, q->a, q->b, q->alpha, q->beta);
      if (rc[i] != GL_OK) snprintf(msg[i], sizeof msg[i], "%s", gl_last_error());
    }
  );
  for (int i = 0; i < 2; i++)
    if (rc[i] != GL_OK) return gl_error("%s", msg[i]);
  for (int i = 0; i < 2; i++)
    if (p[i].epi) GL_TRY(gl_epilogue_finish(p[i].epi, p[i].out, p[i].a, p[i].bias, p[i].aux));
#endif
  return GL_OK;
}

int gl_matmul_pair(gl_tensor *out1, const gl_tensor *a1, const gl_tensor *b1, gl_tensor *out2,
                   const gl_tensor *a2, const gl_tensor *b2, double alpha, double beta) {
  GL_NONNULL("gl_matmul_pair", out1, a1, b1, out2, a2, b2);
  GL_TRY(check_matmul("gl_matmul_pair (first product)", out1, a1, b1));
  GL_TRY(check_matmul("gl_matmul_pair (second product)", out2, a2, b2));
  GL_TRY(check_no_overlap("gl_matmul_pair", out1, "out1", out2, "out2"));
  GL_TRY(check_no_overlap("gl_matmul_pair", out1, "out1", a2, "a2"));
  GL_TRY(check_no_overlap("gl_matmul_pair", out1, "out1", b2, "b2"));
  GL_TRY(check_no_overlap("gl_matmul_pair", out2, "out2", a1, "a1"));
  GL_TRY(check_no_overlap("gl_matmul_pair", out2, "out2", b1, "b1"));
  product p[2] = {{0, out1, a1, b1, NULL, NULL, alpha, beta}, {0, out2, a2, b2, NULL, NULL, alpha, beta}};
  return run_pair(p);
}

/* the bias / aux arguments of an epilogue: dtype of out, contiguous, the
   expected length / shape, no overlap with the product's operands */
static int check_epilogue_vec(const char *fn, const char *name, const gl_tensor *v, const gl_tensor *out, int64_t n,
                              const char *why, const gl_tensor *a, const gl_tensor *b) {
  if (!v) return GL_OK;
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT}, {v, name, A_FLOAT})));
  GL_TRY(check_dtype(v, fn, name, out->dtype, "the dtype of out"));
  if (v->ndim == 1) GL_TRY(check_shape(v, fn, name, 1, (int64_t[]){n}, "%s", why));
  else GL_TRY(check_shape(v, fn, name, 2, out->shape, "the shape of out"));
  if (!gl_is_contiguous(v)) return gl_error("%s: %s is not contiguous, expected a contiguous tensor", fn, name);
  GL_TRY(check_no_overlap(fn, v, name, out, "out"));
  GL_TRY(check_no_overlap(fn, v, name, a, "a"));
  return check_no_overlap(fn, v, name, b, "b");
}

int gl_matmul_epilogue(int epilogue, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias,
                       gl_tensor *aux) {
  const char *fn = "gl_matmul_epilogue";
  GL_NONNULL(fn, out, a, b);
  if (epilogue < 1 || epilogue >= GL_EPI_COUNT)
    return gl_error("%s: epilogue is %d, expected GL_EPI_GELU, GL_EPI_DGELU, GL_EPI_BGRAD, GL_EPI_RELU2 or "
                    "GL_EPI_DRELU2 (1..%d)", fn, epilogue, GL_EPI_COUNT - 1);
  GL_TRY(check_matmul(fn, out, a, b));
  GL_TRY(check_ndim(out, fn, "out", 2, 2));
  if (epilogue == GL_EPI_DGELU && !aux) return gl_error("%s: aux is NULL, expected the GELU input (GL_EPI_DGELU)", fn);
  if (epilogue == GL_EPI_BGRAD && aux) return gl_error("%s: aux is given, expected NULL with GL_EPI_BGRAD", fn);
  if (epilogue == GL_EPI_RELU2 && aux)
    return gl_error("%s: aux is given, expected NULL with GL_EPI_RELU2 (the product is not kept)", fn);
  if (epilogue == GL_EPI_DRELU2 && !aux)
    return gl_error("%s: aux is NULL, expected the ReLU² output h (GL_EPI_DRELU2)", fn);
  int64_t M = out->shape[0], N = out->shape[1];
  if (bias && bias->ndim != 1) return gl_error("%s: bias has %d dims, expected 1", fn, bias->ndim);
  if (aux && aux->ndim != 2) return gl_error("%s: aux has %d dims, expected 2 (the shape of out)", fn, aux->ndim);
  GL_TRY(check_epilogue_vec(fn, "bias", bias, out, epilogue == GL_EPI_BGRAD ? M : N,
                            epilogue == GL_EPI_BGRAD ? "M, the rows of out" : "N, the columns of out", a, b));
  GL_TRY(check_epilogue_vec(fn, "aux", aux, out, 0, NULL, a, b));
  if (bias && aux) GL_TRY(check_no_overlap(fn, bias, "bias", aux, "aux"));
  product p = {epilogue, out, a, b, bias, aux, 1, 0};
  return run_one(&p);
}

int gl_linear_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, gl_tensor *dx_bias,
                       const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight, const gl_tensor *pre_gelu) {
  const char *fn = "gl_linear_backward";
  GL_NONNULL(fn, dy, x, weight);
  GL_TRY(check_args(fn, ARGS({dy, "dy", A_FLOAT}, {x, "x", A_FLOAT}, {weight, "weight", A_FLOAT},
                             {pre_gelu, "pre_gelu", A_OPT | A_FLOAT}, {dx, "dx", A_OPT | A_OUT},
                             {dweight, "dweight", A_OPT | A_OUT}, {dbias, "dbias", A_OPT | A_OUT},
                             {dx_bias, "dx_bias", A_OPT | A_OUT})));
  GL_TRY(check_ndim(dy, fn, "dy", 2, 2));
  int64_t M = dy->shape[0], N = dy->shape[1];
  GL_TRY(check_ndim(x, fn, "x", 2, 2));
  int64_t K = x->shape[1];
  GL_TRY(check_shape(x, fn, "x", 2, (int64_t[]){M, -1}, "M, the rows of dy, is %lld", (long long)M));
  GL_TRY(check_shape(weight, fn, "weight", 2, (int64_t[]){N, K}, "N of dy is %lld, K of x is %lld", (long long)N,
                     (long long)K));
  const gl_tensor *ins[3] = {x, weight, pre_gelu};
  const char *in_names[3] = {"x", "weight", "pre_gelu"};
  for (int i = 0; i < 3; i++) GL_TRY(check_dtype(ins[i], fn, in_names[i], dy->dtype, "the dtype of dy"));
  GL_TRY(check_shape(pre_gelu, fn, "pre_gelu", 2, x->shape, "the shape of x"));
  if (dx_bias && !pre_gelu) return gl_error("%s: dx_bias is given without pre_gelu, expected NULL", fn);
  if (dx_bias && !dx) return gl_error("%s: dx_bias is given without dx, expected dx as well", fn);
  if (pre_gelu && !gl_is_contiguous(pre_gelu))
    return gl_error("%s: pre_gelu is not contiguous, expected a contiguous tensor", fn);
  /* dweight = dy^T x: dy read as a transposed view (N, M) */
  gl_tensor dyt = *dy;
  dyt.shape[0] = N; dyt.shape[1] = M; dyt.stride[0] = dy->stride[1]; dyt.stride[1] = dy->stride[0];
  gl_tensor *outs[4] = {dx, dweight, dbias, dx_bias};
  const char *names[4] = {"dx", "dweight", "dbias", "dx_bias"};
  for (int i = 0; i < 4; i++) {
    if (!outs[i]) continue;
    GL_TRY(check_dtype(outs[i], fn, names[i], dy->dtype, "the dtype of dy"));
    for (int j = 0; j < 3; j++) if (ins[j]) GL_TRY(check_no_overlap(fn, outs[i], names[i], ins[j], in_names[j]));
    GL_TRY(check_no_overlap(fn, outs[i], names[i], dy, "dy"));
    for (int j = 0; j < i; j++) if (outs[j]) GL_TRY(check_no_overlap(fn, outs[i], names[i], outs[j], names[j]));
  }
  GL_TRY(check_shape(dx, fn, "dx", 2, x->shape, "the shape of x"));
  GL_TRY(check_shape(dweight, fn, "dweight", 2, weight->shape, "the shape of weight"));
  if (dbias) GL_TRY(check_shape(dbias, fn, "dbias", 1, (int64_t[]){N}, "N, the columns of dy"));
  if (dx_bias) GL_TRY(check_shape(dx_bias, fn, "dx_bias", 1, (int64_t[]){K}, "K, the columns of x"));
  if (dbias && !gl_is_contiguous(dbias)) return gl_error("%s: dbias is not contiguous, expected a contiguous tensor", fn);
  if (dx_bias && !gl_is_contiguous(dx_bias))
    return gl_error("%s: dx_bias is not contiguous, expected a contiguous tensor", fn);
  if (dbias && !dweight) {  /* the bias gradient alone: a sum over dy's rows */
    gl_tensor row = *dbias;
    row.ndim = 2; row.shape[0] = 1; row.shape[1] = N; row.stride[0] = N; row.stride[1] = 1;
    if (row.numel) GL_TRY(gl_backend_of(dy->device)->reduce(GL_R_SUM, &row, dy, 1u));
  }
  product p[2] = {{pre_gelu ? GL_EPI_DGELU : 0, dx, dy, weight, dx_bias, (gl_tensor *)pre_gelu, 1, 0},
                  {GL_EPI_BGRAD, dweight, &dyt, x, dweight ? dbias : NULL, NULL, 1, 0}};
  if (!dbias) p[1].epi = 0;
  return run_pair(p);
}

