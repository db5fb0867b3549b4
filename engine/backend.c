/* backend.c — the compute backends' tables (backend.h): the CPU's, the
 * GPU's, the meta device's, and the stand-in for the GPU's in a build without
 * CUDA.  ops.c calls gl_backend_of(device)->NAME after validating.  A new op
 * is a line in backend.h's GL_BACKEND_OPS, a cpu_NAME (engine/cpu/) and a
 * cuda_NAME (kernels/), and an entry in the two tables written out below;
 * the library refuses to load with a table that misses one. */
#include "backend.h"
#include <stdio.h>
#include <stdlib.h>

const gl_backend gl_cpu_backend = {
  .name = "cpu",
  /* elementwise (engine/cpu/elementwise.c, kernels/elementwise.cu) */
  .unary                  = cpu_unary,
  .unary_backward         = cpu_unary_backward,
  .binary                 = cpu_binary,
  .where                  = cpu_where,
  .dropout                = cpu_dropout,
  .copy                   = cpu_copy,
  .fill                   = cpu_fill,
  .rand_uniform           = cpu_rand_uniform,
  .rand_normal            = cpu_rand_normal,
  /* reductions (reduce.c, reduce.cu) */
  .reduce                 = cpu_reduce,
  .reduce_max_dim         = cpu_reduce_max_dim,
  .sumsq                  = cpu_sumsq,
  .sumsq_multi            = cpu_sumsq_multi,
  /* products (matmul.c, matmul.cu; the epilogues: engine/unfused.c on the CPU) */
  .matmul_bias            = cpu_matmul_bias,
  .matmul                 = cpu_matmul,
  .matmul_add             = cpu_matmul_add,
  .matmul_epilogue        = cpu_matmul_epilogue,
  /* FP8 scaled products (fp8.c, fp8.cu) */
  .fp8_quantize           = cpu_fp8_quantize,
  .fp8_quantize_amax      = cpu_fp8_quantize_amax,
  .fp8_matmul             = cpu_fp8_matmul,
  /* rows (rows.c, rows.cu; the fused add + norm: engine/unfused.c on the CPU) */
  .softmax                = cpu_softmax,
  .softmax_backward       = cpu_softmax_backward,
  .layernorm_forward      = cpu_layernorm_forward,
  .layernorm_backward     = cpu_layernorm_backward,
  .rmsnorm_forward        = cpu_rmsnorm_forward,
  .rmsnorm_backward       = cpu_rmsnorm_backward,
  .add_norm_forward       = cpu_add_norm_forward,
  .norm_backward_add      = cpu_norm_backward_add,
  /* ids (index.c, index.cu) */
  .embedding_forward      = cpu_embedding_forward,
  .embedding_backward     = cpu_embedding_backward,
  .index_select           = cpu_index_select,
  .gather                 = cpu_gather,
  .scatter_add            = cpu_scatter_add,
  .index_add              = cpu_index_add,
  /* mixture of experts (moe.c, moe.cu) */
  .moe_route              = cpu_moe_route,
  .moe_permute            = cpu_moe_permute,
  .moe_combine            = cpu_moe_combine,
  .moe_combine_wgrad      = cpu_moe_combine_wgrad,
  .grouped_matmul         = cpu_grouped_matmul,
  .grouped_matmul_wgrad   = cpu_grouped_matmul_wgrad,
  /* attention (attention.c, attention.cu) */
  .attention_forward      = cpu_attention_forward,
  .attention_backward     = cpu_attention_backward,
  /* rotary embedding (rope_norm.c, rope_norm.cu) */
  .rope                   = cpu_rope,
  .rope_rmsnorm_forward   = cpu_rope_rmsnorm_forward,
  .rope_rmsnorm_backward  = cpu_rope_rmsnorm_backward,
  /* loss (loss.c, loss.cu) */
  .cross_entropy_forward  = cpu_cross_entropy_forward,
  .cross_entropy_backward = cpu_cross_entropy_backward,
  /* optimizers and the step block (optim.c, optim.cu) */
  .adamw_update           = cpu_adamw_update,
  .momentum_update        = cpu_momentum_update,
  .adamw_update_multi     = cpu_adamw_update_multi,
  .step_block_copy        = cpu_step_block_copy,
  .step_sumsq             = cpu_step_sumsq,
  .step_finalize          = cpu_step_finalize,
  .adamw_update_block     = cpu_adamw_update_block,
  .momentum_update_block  = cpu_momentum_update_block,
  .axpy_block             = cpu_axpy_block,
};

#ifdef GL_WITH_CUDA
const gl_backend gl_cuda_backend = {
  .name = "cuda",
  /* elementwise (engine/cpu/elementwise.c, kernels/elementwise.cu) */
  .unary                  = cuda_unary,
  .unary_backward         = cuda_unary_backward,
  .binary                 = cuda_binary,
  .where                  = cuda_where,
  .dropout                = cuda_dropout,
  .copy                   = cuda_copy,
  .fill                   = cuda_fill,
  .rand_uniform           = cuda_rand_uniform,
  .rand_normal            = cuda_rand_normal,
  /* reductions (reduce.c, reduce.cu) */
  .reduce                 = cuda_reduce,
  .reduce_max_dim         = cuda_reduce_max_dim,
  .sumsq                  = cuda_sumsq,
  .sumsq_multi            = cuda_sumsq_multi,
  /* products (matmul.c, matmul.cu; the epilogues: engine/unfused.c on the CPU) */
  .matmul_bias            = cuda_matmul_bias,
  .matmul                 = cuda_matmul,
  .matmul_add             = cuda_matmul_add,
  .matmul_epilogue        = cuda_matmul_epilogue,
  /* FP8 scaled products (fp8.c, fp8.cu) */
  .fp8_quantize           = cuda_fp8_quantize,
  .fp8_quantize_amax      = cuda_fp8_quantize_amax,
  .fp8_matmul             = cuda_fp8_matmul,
  /* rows (rows.c, rows.cu; the fused add + norm: engine/unfused.c on the CPU) */
  .softmax                = cuda_softmax,
  .softmax_backward       = cuda_softmax_backward,
  .layernorm_forward      = cuda_layernorm_forward,
  .layernorm_backward     = cuda_layernorm_backward,
  .rmsnorm_forward        = cuda_rmsnorm_forward,
  .rmsnorm_backward       = cuda_rmsnorm_backward,
  .add_norm_forward       = cuda_add_norm_forward,
  .norm_backward_add      = cuda_norm_backward_add,
  /* ids (index.c, index.cu) */
  .embedding_forward      = cuda_embedding_forward,
  .embedding_backward     = cuda_embedding_backward,
  .index_select           = cuda_index_select,
  .gather                 = cuda_gather,
  .scatter_add            = cuda_scatter_add,
  .index_add              = cuda_index_add,
  /* mixture of experts (moe.c, moe.cu) */
  .moe_route              = cuda_moe_route,
  .moe_permute            = cuda_moe_permute,
  .moe_combine            = cuda_moe_combine,
  .moe_combine_wgrad      = cuda_moe_combine_wgrad,
  .grouped_matmul         = cuda_grouped_matmul,
  .grouped_matmul_wgrad   = cuda_grouped_matmul_wgrad,
  /* attention (attention.c, attention.cu) */
  .attention_forward      = cuda_attention_forward,
  .attention_backward     = cuda_attention_backward,
  /* rotary embedding (rope_norm.c, rope_norm.cu) */
  .rope                   = cuda_rope,
  .rope_rmsnorm_forward   = cuda_rope_rmsnorm_forward,
  .rope_rmsnorm_backward  = cuda_rope_rmsnorm_backward,
  /* loss (loss.c, loss.cu) */
  .cross_entropy_forward  = cuda_cross_entropy_forward,
  .cross_entropy_backward = cuda_cross_entropy_backward,
  /* optimizers and the step block (optim.c, optim.cu) */
  .adamw_update           = cuda_adamw_update,
  .momentum_update        = cuda_momentum_update,
  .adamw_update_multi     = cuda_adamw_update_multi,
  .step_block_copy        = cuda_step_block_copy,
  .step_sumsq             = cuda_step_sumsq,
  .step_finalize          = cuda_step_finalize,
  .adamw_update_block     = cuda_adamw_update_block,
  .momentum_update_block  = cuda_momentum_update_block,
  .axpy_block             = cuda_axpy_block,
};
#else
/* without CUDA every entry refuses a device tensor in one line, naming the op */
#define GL_NO_CUDA(name, args) \
  static int none_##name args { return gl_error("gl_%s: this engine was built without CUDA", #name); }
GL_BACKEND_OPS(GL_NO_CUDA)
#undef GL_NO_CUDA
#define GL_NO_CUDA_ENTRY(name, args) .name = none_##name,
const gl_backend gl_cuda_backend = { .name = "none", GL_BACKEND_OPS(GL_NO_CUDA_ENTRY) };
#undef GL_NO_CUDA_ENTRY
#endif

/* while planning: the op has validated and allocated as it would; no kernel runs */
#define GL_META(name, args) static int meta_##name args { return GL_OK; }
GL_BACKEND_OPS(GL_META)
#undef GL_META
#define GL_META_ENTRY(name, args) .name = meta_##name,
const gl_backend gl_meta_backend = { .name = "meta", GL_BACKEND_OPS(GL_META_ENTRY) };
#undef GL_META_ENTRY

/* every entry of every table is set: checked once as the library loads, so a
   table that misses a new op fails at once instead of calling NULL later */
__attribute__((constructor)) static void check_tables(void) {
  const gl_backend *tables[] = {&gl_cpu_backend, &gl_cuda_backend, &gl_meta_backend};
  for (int t = 0; t < 3; t++) {
#define GL_CHECK_ENTRY(op, args) \
    if (!tables[t]->op) { fprintf(stderr, "gptlua: backend %s has no %s\n", tables[t]->name, #op); abort(); }
    GL_BACKEND_OPS(GL_CHECK_ENTRY)
#undef GL_CHECK_ENTRY
  }
}
