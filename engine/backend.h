/* backend.h — the compute backends: a table of functions per device, like
 * the collectives' (gl_dist.h).
 *
 * engine/ops.c validates arguments once, then calls the table of the
 * tensor's device: gl_backend_of(out->device)->softmax(out, x, log).  The
 * tables (engine/backend.c) are
 *   gl_cpu_backend   cpu_NAME, in engine/cpu/FILE.c, the twin of kernels/FILE.cu
 *   gl_cuda_backend  cuda_NAME, in kernels/FILE.cu (CUDA builds)
 *   gl_meta_backend  while planning (gl_meta_active): no kernel runs, the op
 *                    has validated and allocated as it would, and returns
 *   and, in a build without CUDA, a table whose every entry refuses a device
 *   tensor in one line.
 * Every entry has the signature listed once below (GL_BACKEND_OPS), which
 * declares cpu_NAME and cuda_NAME too, so the backends can never drift apart
 * from the table or from each other. */
#ifndef GL_BACKEND_H
#define GL_BACKEND_H
#include "internal.h"

/* Matrix layouts, shared by the CPU (BLAS) and CUDA (cuBLASLt) products.
   gl_blas_layout: a rows x cols matrix with strides (sr, sc) is row-major
   (returns 0, sc == 1, ld = sr >= cols) or a transposed view (returns 1,
   sr == 1, ld = sc >= rows), or neither (-1, needs a copy).  Strides of
   size-1 dims never matter, so they are chosen to fit. */
static inline int gl_blas_layout(int64_t rows, int64_t cols, int64_t sr, int64_t sc, int64_t *ld) {
  if (cols == 1) sc = 1;
  if (rows == 1) sr = sc == 1 ? cols : 1;
  if (sc == 1 && sr >= cols && sr >= 1 && sr <= 2147483647) { *ld = sr; return 0; }
  if (sr == 1 && sc >= rows && sc >= 1 && sc <= 2147483647) { *ld = sc; return 1; }
  return -1;
}
/* bias (N) as a view broadcast over out's rows (..., M, N), by value: the
   CPU twin of a bias epilogue copies it into out (engine/cpu/matmul.c) */
gl_tensor gl_bias_rows(const gl_tensor *bias, const gl_tensor *out);
/* The epilogues of gl_matmul_epilogue as separate passes (engine/unfused.c),
   dispatched by device: the CPU's implementation, and the GPU's for what
   cuBLASLt cannot fuse.  gl_epilogue_product runs the product (GELU: into
   aux, or out when aux is NULL, with the bias), gl_epilogue_finish the
   passes after it (GELU, GELU', ReLU², ReLU²' from its output, the bias
   gradient's sum). */
int gl_epilogue_product(int epi, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias,
                        gl_tensor *aux);
int gl_epilogue_finish(int epi, gl_tensor *out, const gl_tensor *a, gl_tensor *bias, gl_tensor *aux);
/* the bias gradient part of gl_epilogue_finish alone (GL_EPI_DGELU and
   GL_EPI_DRELU2: out's sums over its rows; GL_EPI_BGRAD: a's over K), for a
   kernel that fused the rest (kernels/gemm_mma.cu); bias NULL: nothing */
int gl_epilogue_bgrad(int epi, gl_tensor *out, const gl_tensor *a, gl_tensor *bias);
/* gl_add_norm_forward and gl_norm_backward_add as the unfused ops
   (engine/unfused.c): the CPU's, and the GPU's for rows its fused kernels
   do not take */
int gl_add_norm_unfused(gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                        const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps, int center);
int gl_norm_backward_add_unfused(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy,
                                 const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean,
                                 const gl_tensor *rstd, const gl_tensor *dres, int center);
/* gl_matmul_add as a copy of c into out and a product accumulated onto it
   (engine/cpu/matmul.c): the CPU's, and the GPU's where cuBLASLt cannot
   take c as its C */
int gl_matmul_add_unfused(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c);
/* Whether t's dims [0, nd-1) step through rows with a single stride (*sr):
   then a batch of products with a shared right operand folds into one. */
static inline int gl_fold_rows(const gl_tensor *t, int64_t *sr) {
  int64_t expect = -1;
  *sr = 0;
  for (int d = t->ndim - 2; d >= 0; d--) {
    if (t->shape[d] == 1) continue;
    if (expect < 0) { *sr = t->stride[d]; expect = t->stride[d] * t->shape[d]; }
    else if (t->stride[d] != expect) return 0;
    else expect *= t->shape[d];
  }
  return 1;
}

#define GL_BACKEND_OPS(X) \
  X(unary, (int op, gl_tensor *out, const gl_tensor *x, double p0, double p1)) \
  X(unary_backward, (int op, gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, double p0, double p1)) \
  X(binary, (int op, gl_tensor *out, const gl_tensor *a, const gl_tensor *b)) \
  X(where, (gl_tensor *out, const gl_tensor *cond, const gl_tensor *a, const gl_tensor *b)) \
  X(reduce, (int op, gl_tensor *out, const gl_tensor *x, uint32_t dims_mask)) \
  X(reduce_max_dim, (gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim)) \
  X(sumsq, (const gl_tensor *x, double *out)) \
  X(sumsq_multi, (int n, const gl_tensor **xs, double *out)) \
  X(matmul_bias, (gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *bias)) \
  X(matmul, (gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta)) \
  X(matmul_add, (gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c)) \
  X(matmul_epilogue, (int epilogue, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias, gl_tensor *aux)) \
  X(softmax, (gl_tensor *out, const gl_tensor *x, int log)) \
  X(softmax_backward, (gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int log)) \
  X(layernorm_forward, (gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *weight, const gl_tensor *bias, double eps)) \
  X(layernorm_backward, (gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd)) \
  X(rmsnorm_forward, (gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *weight, double eps)) \
  X(rmsnorm_backward, (gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight, const gl_tensor *rstd)) \
  X(add_norm_forward, (gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps, int center)) \
  X(norm_backward_add, (gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd, const gl_tensor *dres, int center)) \
  X(embedding_forward, (gl_tensor *out, const gl_tensor *table, const gl_tensor *ids)) \
  X(embedding_backward, (gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids)) \
  X(index_select, (gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx)) \
  X(gather, (gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx)) \
  X(scatter_add, (gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src)) \
  X(index_add, (gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src)) \
  X(moe_route, (gl_tensor *slots, gl_tensor *counts, gl_tensor *load, const gl_tensor *experts, int64_t capacity)) \
  X(moe_permute, (gl_tensor *out, const gl_tensor *x, const gl_tensor *slots, const gl_tensor *weights)) \
  X(moe_combine, (gl_tensor *out, const gl_tensor *y, const gl_tensor *slots, const gl_tensor *weights)) \
  X(moe_combine_wgrad, (gl_tensor *dweights, const gl_tensor *dout, const gl_tensor *y, const gl_tensor *slots)) \
  X(grouped_matmul, (gl_tensor *out, const gl_tensor *a, int n, const gl_tensor **bs, const gl_tensor *counts)) \
  X(grouped_matmul_wgrad, (int n, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y, const gl_tensor *counts)) \
  X(attention_forward, (gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window)) \
  X(attention_backward, (gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v, const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments, double scale, int64_t window)) \
  X(rope, (gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse)) \
  X(rope_rmsnorm_forward, (gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, double eps)) \
  X(rope_rmsnorm_backward, (gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, const gl_tensor *rstd)) \
  X(cross_entropy_forward, (gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits, const gl_tensor *targets, int64_t ignore_index, double softcap)) \
  X(cross_entropy_backward, (gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets, const gl_tensor *lse, int64_t ignore_index, double softcap, double scale, const gl_tensor *scale_by)) \
  X(dropout, (gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset)) \
  X(adamw_update, (gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v, int64_t start, int64_t len, double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step)) \
  X(momentum_update, (gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, int64_t start, int64_t len, double mu, int nesterov)) \
  X(adamw_update_multi, (int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms, gl_tensor **vs, gl_tensor **outs, const double *lrs, const double *wds, double beta1, double beta2, double eps, int64_t step)) \
  X(step_block_copy, (gl_tensor *dst, const gl_tensor *src)) \
  X(step_sumsq, (gl_tensor *block, int n, const gl_tensor **xs)) \
  X(step_finalize, (gl_tensor *block, int64_t loss_at, int nloss)) \
  X(adamw_update_block, (int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms, gl_tensor **vs, gl_tensor **outs, const gl_tensor *block, const int64_t *slots)) \
  X(momentum_update_block, (gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, const gl_tensor *block, int64_t slot, int nesterov)) \
  X(axpy_block, (gl_tensor *y, const gl_tensor *x, const gl_tensor *block, int64_t slot)) \
  X(fp8_quantize, (gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise)) \
  X(fp8_quantize_amax, (gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, const gl_tensor *amax)) \
  X(fp8_matmul, (gl_tensor *out, const gl_tensor *a, const gl_tensor *a_scale_inv, const gl_tensor *b, const gl_tensor *b_scale_inv)) \
  X(copy, (gl_tensor *dst, const gl_tensor *src)) \
  X(fill, (gl_tensor *t, double value)) \
  X(rand_uniform, (gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi)) \
  X(rand_normal, (gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std))

#define GL_DECLARE_BACKEND(name, args) int cpu_##name args; int cuda_##name args;
GL_BACKEND_OPS(GL_DECLARE_BACKEND)
#undef GL_DECLARE_BACKEND

/* One entry per op above: `int (*NAME)(ARGS)`. */
typedef struct gl_backend {
  const char *name; /* "cpu", "cuda", "meta", "none" */
#define GL_BACKEND_ENTRY(name, args) int(*name) args;
  GL_BACKEND_OPS(GL_BACKEND_ENTRY)
#undef GL_BACKEND_ENTRY
} gl_backend;

extern const gl_backend gl_cpu_backend, gl_cuda_backend, gl_meta_backend;

/* the table for a tensor on `device` (< 0: the CPU) */
static inline const gl_backend *gl_backend_of(int device) {
  if (gl_meta_active()) return &gl_meta_backend;
  return device < 0 ? &gl_cpu_backend : &gl_cuda_backend;
}

/* Philox-4x32-10, shared by CPU and CUDA so both draw the same numbers. */
#ifdef __CUDACC__
#define GL_HD __host__ __device__
#else
#define GL_HD
#endif
/* FP8 current scaling (engine/cpu/fp8.c and kernels/fp8.cu share it): the
   largest finite values, and s = fp8_max / max(amax, 1e-12) in float32, as
   torchao's float8 scaling; a NaN amax gives a NaN s (the comparison fails) */
#define GL_FP8_E4M3_MAX 448.0f
#define GL_FP8_E5M2_MAX 57344.0f
static inline GL_HD float gl_fp8_scale(float amax, float fmax) { return fmax / (amax < 1e-12f ? 1e-12f : amax); }

/* gl_step_finalize on the block's values b (engine/cpu/optim.c, and one
   thread of kernels/optim.cu): the same double arithmetic as the trainer's
   host code had (gptlua.train), so the flag and the clip agree with it. */
static inline GL_HD void gl_step_finalize_values(double *b, int64_t loss_at, int nloss) {
  double sum = 0;
  for (int i = 0; i < nloss; i++) sum += b[loss_at + i];
  double loss = sum / nloss, norm = sqrt(b[GL_STEP_SUMSQ]), max_norm = b[GL_STEP_MAX_NORM];
  int bad = loss != loss || loss > 1.7976931348623157e308 || norm != norm || norm > 1.7976931348623157e308;
  b[GL_STEP_LOSS] = loss;
  b[GL_STEP_NORM] = norm;
  b[GL_STEP_CLIP_SCALE] = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
  b[GL_STEP_SKIP] = bad ? 1.0 : 0.0;
}

static inline GL_HD void gl_philox4x32(uint32_t key0, uint32_t key1, uint32_t c0, uint32_t c1,
                                       uint32_t c2, uint32_t c3, uint32_t out[4]) {
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ key0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ key1;
    c1 = (uint32_t)p1; c3 = (uint32_t)p0; c0 = n0; c2 = n2;
    key0 += 0x9E3779B9u; key1 += 0xBB67AE85u;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}
/* uniform in (0, 1] from 32 random bits, 24-bit resolution for float */
static inline GL_HD double gl_u32_to_unit(uint32_t x) { return ((double)(x >> 8) + 1.0) / 16777216.0; }
/* Random stream element i for (seed, counter): 4 words per Philox call. */
static inline GL_HD uint32_t gl_philox_word(uint64_t seed, uint64_t i) {
  uint32_t out[4]; uint64_t blk = i >> 2;
  gl_philox4x32((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)blk, (uint32_t)(blk >> 32), 0, 0, out);
  return out[i & 3];
}
#endif
