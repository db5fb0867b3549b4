/* gl_ops.h — forward and backward kernels for every op GPT training needs.
 *
 * Contract shared by all ops (see gl_core.h for the general conventions):
 *  - The caller (Lua) allocates every output with its final shape and dtype;
 *    the op validates shapes, dtypes and devices, then dispatches to the CPU
 *    kernel (engine/cpu/NAME.c, the twin of kernels/NAME.cu) or the CUDA kernel (kernels/) by device.
 *  - Outputs are overwritten, never accumulated, unless the name says
 *    otherwise (beta in gl_matmul, gl_index_add).
 *  - Inputs may be arbitrary strided views, including 0-stride (broadcast)
 *    dims; outputs may be strided views but never have 0 strides.
 *    Broadcasting is done by the caller: it passes inputs already expanded
 *    to the output shape.
 *  - Floating dtypes: float32 and float64 compute in their own precision;
 *    bfloat16/float16 are storage types computed in float32.
 *  - Elementwise ops allow out to alias an input exactly (in-place).
 */
#ifndef GL_OPS_H
#define GL_OPS_H
#include "gl_core.h"

typedef enum gl_unary_op {
  GL_U_NEG = 0, GL_U_EXP, GL_U_LOG, GL_U_SQRT, GL_U_RSQRT, GL_U_TANH,
  GL_U_ABS, GL_U_RELU, GL_U_RELU2, GL_U_GELU_TANH, GL_U_SILU, GL_U_SIGMOID,
  GL_U_SIN, GL_U_COS, GL_U_SQUARE, GL_U_RECIPROCAL,
  GL_U_CLAMP,       /* clamp(x, p0, p1) */
  GL_U_POW,         /* x ^ p0 */
  GL_U_ADD_SCALAR,  /* x + p0 */
  GL_U_MUL_SCALAR,  /* x * p0 */
  GL_U_AFFINE,      /* x * p0 + p1 */
  GL_U_RSUB_SCALAR, /* p0 - x */
  GL_U_RDIV_SCALAR, /* p0 / x */
  GL_U_SOFTCAP,     /* p0 * tanh(x / p0) */
  GL_U_COUNT
} gl_unary_op;

typedef enum gl_binary_op {
  GL_B_ADD = 0, GL_B_SUB, GL_B_MUL, GL_B_DIV, GL_B_POW, GL_B_MAXIMUM,
  GL_B_MINIMUM, GL_B_EQ, GL_B_NE, GL_B_LT, GL_B_LE, GL_B_GT, GL_B_GE,
  GL_B_COUNT
} gl_binary_op;

typedef enum gl_reduce_op {
  GL_R_SUM = 0, GL_R_MEAN, GL_R_MAX, GL_R_MIN, GL_R_SUMSQ, GL_R_NORM2,
  GL_R_COUNT
} gl_reduce_op;

/* out = f(x).  Comparison results and outputs may have any dtype. */
int gl_unary(int op, gl_tensor *out, const gl_tensor *x, double p0, double p1);
/* dx = dy * f'(x) for the differentiable unary ops (same p0, p1 as forward) */
int gl_unary_backward(int op, gl_tensor *dx, const gl_tensor *dy,
                      const gl_tensor *x, double p0, double p1);
/* out = a (op) b, all of out's shape */
int gl_binary(int op, gl_tensor *out, const gl_tensor *a, const gl_tensor *b);
/* out = cond != 0 ? a : b */
int gl_where(gl_tensor *out, const gl_tensor *cond, const gl_tensor *a, const gl_tensor *b);

/* Reduce x over the dims whose bit is set in dims_mask (bit d = dim d).
   out has x's ndim with the reduced dims of size 1 (keepdim layout).
   Accumulation is in float64 for float64 input, float32 otherwise. */
int gl_reduce(int op, gl_tensor *out, const gl_tensor *x, uint32_t dims_mask);
/* max over one dim with argmax indices (int64), keepdim layout */
int gl_reduce_max_dim(gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim);
/* sum of squares of all elements in float64 (for global grad norms) */
int gl_sumsq(const gl_tensor *x, double *out);
/* *out = the float64 sum of squares of every element of n tensors on one
   device (a global gradient norm): on a GPU one pass over all of them, one
   launch and one host wait however many tensors there are. */
int gl_sumsq_multi(int n, const gl_tensor **xs, double *out);

/* Batched matrix product out = alpha * a @ b + beta * out over the last two
   dims: a (..., M, K), b (..., K, N), out (..., M, N); batch dims already
   broadcast to out's.  A transposed operand is passed as a transposed view
   (stride[-2] == 1); other layouts are copied internally.  BLAS on CPU. */
int gl_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta);
/* FP8 scaled products (engine/ops_fp8.c), current scaling as torchao's
   float8 recipes.  gl_fp8_quantize: q (R, C) row-major float8 (e4m3fn or
   e5m2) from a 2-D float32 / bfloat16 x of any strides, with amax = max |x|
   over x (rowwise 0) or over each row (rowwise 1), s = fp8_max /
   max(amax, 1e-12) and q = x * s rounded to nearest even, saturating (all
   float32 operations); scale_inv ({1} or {R}, float32) = 1 / s.  Computed
   on the device: the host never waits.  A NaN in x makes its scale NaN.
   gl_fp8_matmul: out (M, N) = (a * a_scale_inv) @ (b * b_scale_inv)^T for
   row-major float8 a (M, K) and b (N, K) (not both e5m2), each scale {1}
   or one per row; the products accumulate in float32, then acc *
   (a_scale_inv[m] * b_scale_inv[n]) is rounded once to out (float32 or
   bfloat16). */
int gl_fp8_quantize(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise);
/* gl_fp8_quantize_amax: the same cast with amax given (float32, contiguous:
   {1} for one scale, {R} for one per row), as a layout that splits x over
   ranks needs: the amax each rank computes of its part, max-reduced over
   the ranks, gives every rank one process's scale.  |amax| is taken (its
   bits with the sign cleared), so x's own amax gives gl_fp8_quantize's
   q and scale_inv bit for bit; an amax below x's saturates. */
int gl_fp8_quantize_amax(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, const gl_tensor *amax);
int gl_fp8_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *a_scale_inv, const gl_tensor *b,
                  const gl_tensor *b_scale_inv);
/* out = a @ b + bias: bias (N) added to every row of out (..., M, N), a
   linear layer's forward.  On a GPU the bias rides in cuBLASLt's epilogue
   (CUBLASLT_EPILOGUE_BIAS) where the layout allows; otherwise, and on the
   CPU, bias is copied into out and the product accumulates onto it. */
int gl_matmul_bias(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *bias);
/* out = a @ b + c with c of out's shape (a residual added in the product:
   nanochat's x + mlp(x)).  On a GPU c is cuBLASLt's C and out its D (C != D),
   so the add has no pass of its own where c has out's dtype and strides;
   otherwise, and on the CPU, c is copied into out and the product
   accumulates onto it.  c must not overlap out. */
int gl_matmul_add(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c);
/* out1 = alpha a1 @ b1 + beta out1 and out2 = alpha a2 @ b2 + beta out2, the
   two products run side by side on the CPU (one thread each) */
int gl_matmul_pair(gl_tensor *out1, const gl_tensor *a1, const gl_tensor *b1, gl_tensor *out2,
                   const gl_tensor *a2, const gl_tensor *b2, double alpha, double beta);

/* What happens to a product on its way out (gl_matmul_epilogue).  On a GPU
   each is a cuBLASLt epilogue (ReLU²'s: our own GEMM, kernels/gemm_mma.cu),
   so the activation or the bias gradient costs no pass over memory of its own; on the CPU, and where cuBLASLt cannot take
   the layout, the same kernels as the unfused ops run after the product. */
typedef enum gl_epilogue {
  GL_EPI_GELU = 1, /* aux = a @ b + bias (bias (N) or NULL); out = gelu_tanh(aux); aux NULL: not kept
                      (CUBLASLT_EPILOGUE_GELU_AUX_BIAS) */
  GL_EPI_DGELU,    /* out = (a @ b) * gelu_tanh'(aux); bias (N) or NULL = sum of out over its rows
                      (CUBLASLT_EPILOGUE_DGELU_BGRAD) */
  GL_EPI_BGRAD,    /* out = a @ b; bias (M) or NULL = sum of a over K (CUBLASLT_EPILOGUE_BGRADA/B) */
  GL_EPI_RELU2,    /* out = relu(a @ b + bias)^2 (bias (N) or NULL); aux must be NULL: the input is not
                      kept (kernels/gemm_mma.cu on a GPU: cuBLASLt has no ReLU² epilogue) */
  GL_EPI_DRELU2,   /* out = (a @ b) * 2 sqrt(aux), aux = the GL_EPI_RELU2 output h (relu(pre) = sqrt(h));
                      bias (N) or NULL = sum of out over its rows (kernels/gemm_mma.cu, then a sum) */
  GL_EPI_COUNT
} gl_epilogue;
/* One 2-D product out (M, N) = a (M, K) @ b (K, N) with an epilogue; bias
   and aux are of out's dtype, aux (M, N) and contiguous, bias contiguous. */
int gl_matmul_epilogue(int epilogue, gl_tensor *out, const gl_tensor *a, const gl_tensor *b, gl_tensor *bias,
                       gl_tensor *aux);
/* A linear layer's backward, y (M, N) = x (M, K) @ weight^T + bias with
   weight (N, K): dx = dy @ weight, dweight = dy^T @ x, dbias = the sum of dy
   over its rows.  With pre_gelu (M, K), x was gelu_tanh(pre_gelu) and dx is
   the gradient of pre_gelu instead (dx_bias, or NULL: its sum over rows,
   the gradient of the bias that went into pre_gelu).  Any output may be NULL
   (not wanted).  The two products run side by side on the CPU (one thread
   each); on a GPU the gradients of the biases and GELU ride in the products'
   epilogues.  The nanoGPT MLP's backward is two calls, with no pass of its
   own over the activations (llm.c's matmul_backward does the same). */
int gl_linear_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, gl_tensor *dx_bias,
                       const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight, const gl_tensor *pre_gelu);

/* softmax / log_softmax over the last dim; backward takes the forward output */
int gl_softmax(gl_tensor *out, const gl_tensor *x, int log);
int gl_softmax_backward(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int log);

/* Normalisation over the last dim C.  weight/bias (C) may be NULL.
   mean/rstd have x's shape without the last dim, float32 (float64 for f64);
   in the forwards they may be NULL (statistics not kept). */
int gl_layernorm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *bias, double eps);
int gl_layernorm_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias,
                          const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight,
                          const gl_tensor *mean, const gl_tensor *rstd);
int gl_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x,
                       const gl_tensor *weight, double eps);
int gl_rmsnorm_backward(gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy,
                        const gl_tensor *x, const gl_tensor *weight, const gl_tensor *rstd);
/* A residual add fused with the norm after it (a block's x = x + f(x);
   h = norm(x)): s = x + r, then y = norm(s) as gl_layernorm_forward
   (center 1) or gl_rmsnorm_forward (center 0: mean and bias NULL).  On a
   GPU one pass reads x and r and writes s and y. */
int gl_add_norm_forward(gl_tensor *s, gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                        const gl_tensor *r, const gl_tensor *weight, const gl_tensor *bias, double eps, int center);
/* The norm's backward with the gradient that reached its input by the
   residual stream added in the same pass: dx = norm'(dy) + dres (dres NULL:
   nothing added), otherwise as gl_layernorm_backward (center 1) or
   gl_rmsnorm_backward (center 0: mean and dbias NULL). */
int gl_norm_backward_add(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias, const gl_tensor *dy, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *mean, const gl_tensor *rstd, const gl_tensor *dres,
                         int center);

/* out (ids.shape..., C) = table[ids]; ids int32/int64 checked against rows. */
int gl_embedding_forward(gl_tensor *out, const gl_tensor *table, const gl_tensor *ids);
/* dtable (V, C) = scatter-add of dout rows at ids (overwrites dtable) */
int gl_embedding_backward(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids);

/* out = x.index_select(dim, idx);  gather: out[i][j] = x[i][idx[i][j]] (dim);
   index_add: out.index_add_(dim, idx, src) accumulates. idx int32/int64. */
int gl_index_select(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx);
int gl_gather(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx);
int gl_scatter_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src);
int gl_index_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src);

/* Mixture of experts (engine/ops_moe.c; engine/cpu/moe.c, kernels/moe.cu).
   The expert-ordered buffer holds expert e's rows at [off_e, off_e +
   counts[e]), off_e the sum of the counts before e, each expert's rows in
   token order; rows past the last expert's are zero.
   gl_moe_route: experts (N, K) int32/int64 ids in [0, E), E the size of
   counts; counts (E) int64 = assignments each expert keeps, load (E) int64 =
   assignments routed to it, slots (N, K) int64 = each assignment's row, -1
   when dropped.  capacity > 0 keeps an expert's first `capacity`
   assignments in token order; 0 keeps all (dropless).
   gl_moe_permute: out (M, C) with out[slots[n][k]] = weights[n][k] x[n]
   (weights NULL: 1), zero rows elsewhere.  gl_moe_combine: out (N, C) with
   out[n] = sum over k of weights[n][k] y[slots[n][k]] (dropped: nothing).
   gl_moe_combine_wgrad: dweights[n][k] = dout[n] . y[slots[n][k]] (0 when
   dropped).  Slots must name each row at most once.
   gl_grouped_matmul: out (M, N) rows of expert e = a's rows of e @ bs[e]
   (K, N), n experts, counts (n) int64 summing to at most M, zero rows past
   them.  gl_grouped_matmul_wgrad: dbs[e] (K, N) = x_e^T y_e, x (M, K) and
   y (M, N) the rows of e (zero when e has none). */
int gl_moe_route(gl_tensor *slots, gl_tensor *counts, gl_tensor *load, const gl_tensor *experts, int64_t capacity);
int gl_moe_permute(gl_tensor *out, const gl_tensor *x, const gl_tensor *slots, const gl_tensor *weights);
int gl_moe_combine(gl_tensor *out, const gl_tensor *y, const gl_tensor *slots, const gl_tensor *weights);
int gl_moe_combine_wgrad(gl_tensor *dweights, const gl_tensor *dout, const gl_tensor *y, const gl_tensor *slots);
int gl_grouped_matmul(gl_tensor *out, const gl_tensor *a, int n, const gl_tensor **bs, const gl_tensor *counts);
int gl_grouped_matmul_wgrad(int n, gl_tensor **dbs, const gl_tensor *x, const gl_tensor *y, const gl_tensor *counts);

/* Causal scaled-dot-product attention.  q (B, H, T, D), k/v (B, Hkv, S, D)
   with H % Hkv == 0 (grouped-query) and T <= S: query t sits at position
   S - T + t (KV cache).  window > 0 keeps keys with pos > qpos - window;
   window < 0 masks nothing (every query sees every key, any T and S: ring
   attention's blocks of earlier chunks).  out (B, H, T, D); lse (B, H, T)
   float32 (float64 for f64) log-sum-exp, or NULL in the forward (not
   kept).  The backward takes the forward's out and lse, which may be a
   larger attention's (merged over several key blocks): it uses
   Di = rowsum(dout * out) and P = exp(scores - lse), so the gradients are
   that attention's restricted to these keys. */
int gl_attention_forward(gl_tensor *out, gl_tensor *lse, const gl_tensor *q,
                         const gl_tensor *k, const gl_tensor *v, double scale, int64_t window);
int gl_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                          const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                          const gl_tensor *out, const gl_tensor *lse, double scale, int64_t window);
/* The same with document masking: segments (B, S) int32 or int64 ids, one
   per key position (window >= 0; query t, at position S - T + t, carries
   that position's id); a query sees a key only when both carry the same
   id, so attention never crosses a boundary of documents packed into one
   row, nor reaches the left padding of a batch of prompts. */
int gl_attention_forward_seg(gl_tensor *out, gl_tensor *lse, const gl_tensor *q, const gl_tensor *k,
                             const gl_tensor *v, const gl_tensor *segments, double scale, int64_t window);
int gl_attention_backward_seg(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                              const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                              const gl_tensor *out, const gl_tensor *lse, const gl_tensor *segments,
                              double scale, int64_t window);

/* Rotary embedding on x (B, T, H, D), D even, halves rotated as nanochat:
   y1 = x1*cos + x2*sin, y2 = -x1*sin + x2*cos with cos/sin (T, D/2).
   inverse = 1 applies the transposed rotation (the backward). */
int gl_rope(gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse);

/* Rotary embedding fused with a parameter-free RMSNorm over the head dim
   (nanochat's q and k): y = rope(x) * rstd, rstd = 1 / sqrt(mean(x^2) + eps)
   over D.  The rotation keeps every row's sum of squares, so the statistics
   are x's own and the result is rms_norm(rope(x)), rounded once.  x, y
   (B, T, H, D) with D even, cos/sin (T, D/2) as gl_rope; rstd (B, T, H)
   float32 (float64 for float64 x), NULL in the forward when not kept.
   Backward: g = rope^T(dy), xhat = x rstd, dx = rstd (g - xhat mean(g xhat)):
   dy and x read once, dx written once.  On a GPU one pass each way. */
int gl_rope_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x, const gl_tensor *cos,
                            const gl_tensor *sin, double eps);
int gl_rope_rmsnorm_backward(gl_tensor *dx, const gl_tensor *dy, const gl_tensor *x, const gl_tensor *cos,
                             const gl_tensor *sin, const gl_tensor *rstd);

/* Cross-entropy per row: logits (N, V), targets (N) int32/int64.  With
   softcap > 0 logits are first capped: z = softcap * tanh(logits / softcap).
   losses (N) and lse (N) float32 (float64 for f64); ignored rows get 0;
   lse may be NULL in the forward.
   Targets outside [0, V) other than ignore_index are an error. */
int gl_cross_entropy_forward(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                             const gl_tensor *targets, int64_t ignore_index, double softcap);
/* dlogits = scale * scale_by[0] * (softmax(z) - onehot(target)) * dz/dlogits;
   ignored rows 0.  scale_by (one float element, on logits' device) may be
   NULL (1): a factor known only on the device (the upstream gradient over
   the count of kept targets), read by the kernel so the host never waits. */
int gl_cross_entropy_backward(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                              const gl_tensor *lse, int64_t ignore_index, double softcap, double scale,
                              const gl_tensor *scale_by);

/* out = x * mask / (1 - p), mask ~ Bernoulli(1 - p) from Philox(seed, offset + i).
   The backward is the same call on dy with the same seed and offset. */
int gl_dropout(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset);

/* Optimizer updates on a slice [start, start + len) of flat contiguous
   float tensors of equal numel (a shard is just a smaller slice).
   AdamW: decoupled weight decay p -= lr*wd*p, bias corrections for step>=1. */
int gl_adamw_update(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v,
                    int64_t start, int64_t len, double lr, double beta1, double beta2,
                    double eps, double weight_decay, int64_t step);
/* Muon momentum as nanochat: buf = lerp(buf, g, 1-mu);
   out = nesterov ? lerp(g, buf, mu) : buf.  out may alias grad. */
int gl_momentum_update(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad,
                       int64_t start, int64_t len, double mu, int nesterov);
/* AdamW over n whole parameters on one device in one call (on a GPU one
   launch for all of them): for each i, gl_adamw_update(params[i], grads[i],
   ms[i], vs[i], 0, numel, lrs[i], beta1, beta2, eps, wds[i], step); then,
   when outs (and outs[i]) is not NULL, outs[i] = params[i] in outs[i]'s
   dtype (the bfloat16 weights of an fp32 master copy). */
int gl_adamw_update_multi(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms,
                          gl_tensor **vs, gl_tensor **outs, const double *lrs, const double *wds,
                          double beta1, double beta2, double eps, int64_t step);

/* The step block: a trainer's step scalars in one contiguous float64 tensor
   on the step's device, so a captured step (a CUDA graph) reads this step's
   values, not the ones of its capture.  The host writes the rates (each
   AdamW group's lr*wd and lr/bc1, each call's betas, eps and 1/bc2, the clip
   threshold) into a pinned copy and sends it with gl_step_block_copy; the
   device writes the rest (the gradient's sum of squares and norm, the clip
   scale, the losses, the skip flag), which the host reads once, after the
   step.  Slots below GL_STEP_HEADER: */
enum {
  GL_STEP_SKIP = 0,       /* device: 1 when the loss or the norm is not finite (nothing is updated) */
  GL_STEP_SUMSQ = 1,      /* device: float64 sum of squares of the gradients */
  GL_STEP_NORM = 2,       /* device: sqrt(SUMSQ) */
  GL_STEP_CLIP_SCALE = 3, /* device: MAX_NORM / (NORM + 1e-6) when MAX_NORM > 0 and NORM > MAX_NORM, else 1 */
  GL_STEP_LOSS = 4,       /* device: the mean of the step's micro-step losses */
  GL_STEP_MAX_NORM = 5,   /* host: the clip threshold (0: no clipping) */
  GL_STEP_HEADER = 8
};
/* An AdamW group's slots (gl_adamw_update_block): lr*wd, lr/bc1, beta1,
   beta2, 1 - beta1, 1 - beta2, eps, 1/bc2 */
enum { GL_STEP_ADAMW_SLOTS = 8 };
/* dst = src, one of them a pinned host tensor and the other on a CUDA
   device (or both on the CPU), float64, contiguous, same numel; queued on
   the device's compute stream and the host does not wait (so a CUDA graph
   can hold it): synchronise before reading a host dst or rewriting a host
   src. */
int gl_step_block_copy(gl_tensor *dst, const gl_tensor *src);
/* block[GL_STEP_SUMSQ] = the float64 sum of squares of every element of
   xs[0..n) (gl_sumsq_multi's sum, left on the device: no host wait) */
int gl_step_sumsq(gl_tensor *block, int n, const gl_tensor **xs);
/* From block[SUMSQ], block[MAX_NORM] and the nloss losses at
   block[loss_at..]: LOSS (their sum over nloss, in float64, in order), NORM,
   CLIP_SCALE and SKIP, as the trainer computed them on the host. */
int gl_step_finalize(gl_tensor *block, int64_t loss_at, int nloss);
/* gl_adamw_update_multi with its rates read from the step block: params,
   ms, vs float32, grads float32 or bfloat16, outs (optional) float32 or
   bfloat16; parameter i uses its group's GL_STEP_ADAMW_SLOTS values at
   block[slots[i]] (each rounded to float, as the kernels take them); each
   gradient is multiplied by block[CLIP_SCALE] (rounded to the gradient's dtype, as
   mul_ does) and nothing is written when block[SKIP] is not 0. */
int gl_adamw_update_block(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms, gl_tensor **vs,
                          gl_tensor **outs, const gl_tensor *block, const int64_t *slots);
/* Muon's momentum (gl_momentum_update) with its factors read from the step
   block: mu = block[slot], 1 - mu = block[slot + 1]; the gradient times
   block[CLIP_SCALE], rounded to its dtype.  When block[SKIP] is set buf is
   not written and out (the step's temporary update) is zeroed, so that the
   Newton-Schulz products after it, which run in a graph whatever the flag,
   read defined memory.  out and buf float32, grad float32 or bfloat16, all
   contiguous with one numel. */
int gl_momentum_update_block(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, const gl_tensor *block,
                             int64_t slot, int nesterov);
/* y += a x with a = block[slot] (as y:add_(x, a): a x rounded to float,
   then the sum), nothing written when block[SKIP] is set; y and x float32,
   contiguous, one numel (Muon's update and decay, NorMuon's second moment) */
int gl_axpy_block(gl_tensor *y, const gl_tensor *x, const gl_tensor *block, int64_t slot);

#endif
