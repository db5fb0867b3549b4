/* ops_fp8.c — the FP8 scaled product's ops (gl_ops.h): current-scaling
 * quantization and the product of two quantized matrices.  Checked as every
 * op is (ops_check.h), then dispatched to engine/cpu/fp8.c or kernels/fp8.cu. */
#include "ops_check.h"

static int check_fp8(const char *fn, const char *name, const gl_tensor *t) {
  if (gl_is_fp8(t->dtype)) return GL_OK;
  return gl_error("%s: %s has dtype %s, expected float8_e4m3fn or float8_e5m2", fn, name, gl_dtype_name(t->dtype));
}
static int check_row_major(const char *fn, const char *name, const gl_tensor *t) {
  if (t->stride[1] == 1 && (t->shape[0] <= 1 || t->stride[0] == t->shape[1])) return GL_OK;
  return gl_error("%s: %s must be contiguous (row-major, its K dim innermost)", fn, name);
}
static int check_scale(const char *fn, const char *name, const gl_tensor *s, int64_t rows, int out) {
  if (s->dtype != GL_F32) return gl_error("%s: %s has dtype %s, expected float32", fn, name, gl_dtype_name(s->dtype));
  if (s->ndim != 1 || (s->shape[0] != 1 && s->shape[0] != rows))
    return gl_error("%s: %s has %d dims of %lld, expected {1} (tensorwise) or {%lld} (rowwise)", fn, name, s->ndim,
                    (long long)(s->ndim ? s->shape[0] : 0), (long long)rows);
  if (out && s->shape[0] > 1 && s->stride[0] != 1) return gl_error("%s: %s must be contiguous", fn, name);
  return GL_OK;
}

/* a cast's operands: x 2-D float32 / bfloat16, q a row-major float8 of its shape */
static int check_cast(const char *fn, const gl_tensor *q, const gl_tensor *x) {
  if (x->dtype != GL_F32 && x->dtype != GL_BF16)
    return gl_error("%s: x has dtype %s, expected float32 or bfloat16", fn, gl_dtype_name(x->dtype));
  GL_TRY(check_fp8(fn, "q", q));
  GL_TRY(check_ndim(x, fn, "x", 2, 2));
  GL_TRY(check_shape(q, fn, "q", 2, x->shape, "the shape of x"));
  return check_row_major(fn, "q", q);
}

int gl_fp8_quantize(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise) {
  const char *fn = "gl_fp8_quantize";
  GL_NONNULL(fn, q, scale_inv, x);
  GL_TRY(check_args(fn, ARGS({q, "q", A_OUT}, {scale_inv, "scale_inv", A_OUT}, {x, "x", A_FLOAT})));
  GL_TRY(check_cast(fn, q, x));
  if (rowwise != 0 && rowwise != 1) return gl_error("%s: rowwise must be 0 or 1, got %d", fn, rowwise);
  GL_TRY(check_scale(fn, "scale_inv", scale_inv, x->shape[0], 1));
  if (scale_inv->shape[0] != (rowwise ? x->shape[0] : 1))
    return gl_error("%s: scale_inv has %lld elements, expected %lld (%s)", fn, (long long)scale_inv->shape[0],
                    (long long)(rowwise ? x->shape[0] : 1), rowwise ? "one per row of x" : "tensorwise: one");
  GL_TRY(check_no_overlap(fn, q, "q", x, "x"));
  GL_TRY(check_no_overlap(fn, scale_inv, "scale_inv", x, "x"));
  if (scale_inv->numel == 0) return GL_OK;
  return gl_backend_of(x->device)->fp8_quantize(q, scale_inv, x, rowwise);
}

int gl_fp8_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *a_scale_inv, const gl_tensor *b,
                  const gl_tensor *b_scale_inv) {
  const char *fn = "gl_fp8_matmul";
  GL_NONNULL(fn, out, a, a_scale_inv, b, b_scale_inv);
  GL_TRY(check_args(fn, ARGS({out, "out", A_OUT | A_FLOAT}, {a, "a", A_IN}, {a_scale_inv, "a_scale_inv", A_IN},
                             {b, "b", A_IN}, {b_scale_inv, "b_scale_inv", A_IN})));
  if (out->dtype != GL_F32 && out->dtype != GL_BF16)
    return gl_error("%s: out has dtype %s, expected float32 or bfloat16", fn, gl_dtype_name(out->dtype));
  GL_TRY(check_fp8(fn, "a", a));
  GL_TRY(check_fp8(fn, "b", b));
  if (a->dtype == GL_F8E5M2 && b->dtype == GL_F8E5M2)
    return gl_error("%s: a and b are both float8_e5m2, expected at least one float8_e4m3fn (cuBLASLt has no e5m2 x e5m2 product)", fn);
  GL_TRY(check_ndim(a, fn, "a", 2, 2));
  GL_TRY(check_ndim(b, fn, "b", 2, 2));
  const int64_t M = a->shape[0], K = a->shape[1], N = b->shape[0];
  GL_TRY(check_shape(b, fn, "b", 2, (int64_t[]){-1, K}, "b is (N, K): K of a is %lld", (long long)K));
  GL_TRY(check_shape(out, fn, "out", 2, (int64_t[]){M, N}, "M of a, N of b"));
  GL_TRY(check_row_major(fn, "a", a));
  GL_TRY(check_row_major(fn, "b", b));
  GL_TRY(check_scale(fn, "a_scale_inv", a_scale_inv, M, 0));
  GL_TRY(check_scale(fn, "b_scale_inv", b_scale_inv, N, 0));
  GL_TRY(check_no_overlap(fn, out, "out", a, "a"));
  GL_TRY(check_no_overlap(fn, out, "out", b, "b"));
  if (out->numel == 0) return GL_OK;
  return gl_backend_of(out->device)->fp8_matmul(out, a, a_scale_inv, b, b_scale_inv);
}

int gl_fp8_amax(gl_tensor *amax, const gl_tensor *x, int rowwise) {
  const char *fn = "gl_fp8_amax";
  GL_NONNULL(fn, amax, x);
  GL_TRY(check_args(fn, ARGS({amax, "amax", A_OUT}, {x, "x", A_FLOAT})));
  if (x->dtype != GL_F32 && x->dtype != GL_BF16)
    return gl_error("%s: x has dtype %s, expected float32 or bfloat16", fn, gl_dtype_name(x->dtype));
  GL_TRY(check_ndim(x, fn, "x", 2, 2));
  if (rowwise != 0 && rowwise != 1) return gl_error("%s: rowwise must be 0 or 1, got %d", fn, rowwise);
  GL_TRY(check_scale(fn, "amax", amax, x->shape[0], 1));
  if (amax->shape[0] != (rowwise ? x->shape[0] : 1))
    return gl_error("%s: amax has %lld elements, expected %lld (%s)", fn, (long long)amax->shape[0],
                    (long long)(rowwise ? x->shape[0] : 1), rowwise ? "one per row of x" : "tensorwise: one");
  GL_TRY(check_no_overlap(fn, amax, "amax", x, "x"));
  if (amax->numel == 0) return GL_OK;
  return gl_backend_of(x->device)->fp8_amax(amax, x, rowwise);
}

int gl_fp8_cast(gl_tensor *q, const gl_tensor *x, const gl_tensor *amax) {
  const char *fn = "gl_fp8_cast";
  GL_NONNULL(fn, q, x, amax);
  GL_TRY(check_args(fn, ARGS({q, "q", A_OUT}, {x, "x", A_FLOAT}, {amax, "amax", A_IN})));
  GL_TRY(check_cast(fn, q, x));
  GL_TRY(check_scale(fn, "amax", amax, x->shape[0], 1));
  GL_TRY(check_no_overlap(fn, q, "q", x, "x"));
  if (q->numel == 0) return GL_OK;
  return gl_backend_of(x->device)->fp8_cast(q, x, amax);
}

int gl_fp8_scale_inv(gl_tensor *scale_inv, const gl_tensor *amax, int dtype) {
  const char *fn = "gl_fp8_scale_inv";
  GL_NONNULL(fn, scale_inv, amax);
  GL_TRY(check_args(fn, ARGS({scale_inv, "scale_inv", A_OUT}, {amax, "amax", A_IN})));
  if (dtype != GL_F8E4M3 && dtype != GL_F8E5M2)
    return gl_error("%s: dtype is %d, expected float8_e4m3fn (%d) or float8_e5m2 (%d)", fn, dtype, GL_F8E4M3, GL_F8E5M2);
  GL_TRY(check_scale(fn, "amax", amax, amax->ndim == 1 ? amax->shape[0] : 1, 1));
  GL_TRY(check_scale(fn, "scale_inv", scale_inv, amax->shape[0], 1));
  if (scale_inv->shape[0] != amax->shape[0])
    return gl_error("%s: scale_inv has %lld elements, expected %lld (one per amax)", fn,
                    (long long)scale_inv->shape[0], (long long)amax->shape[0]);
  GL_TRY(check_no_overlap(fn, scale_inv, "scale_inv", amax, "amax"));
  if (amax->numel == 0) return GL_OK;
  return gl_backend_of(amax->device)->fp8_scale_inv(scale_inv, amax, dtype);
}
