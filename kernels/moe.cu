/* moe.cu — the mixture-of-experts ops on a GPU (the twin of
 * engine/cpu/moe.c).  Their CUDA kernels are not written yet: every entry
 * refuses a device tensor in one line, so a MoE model trains on the CPU
 * (--device=cpu) and a GPU run stops at its first MoE layer with this
 * message instead of computing anything wrong. */
#include "common.cuh"

#define MOE_NO_KERNEL(op) \
  gl_error("gl_%s: the mixture-of-experts ops have no CUDA kernels yet; train this model with --device=cpu", op)

extern "C" int cuda_moe_route(gl_tensor *, gl_tensor *, gl_tensor *, const gl_tensor *, int64_t) {
  return MOE_NO_KERNEL("moe_route");
}
extern "C" int cuda_moe_permute(gl_tensor *, const gl_tensor *, const gl_tensor *, const gl_tensor *) {
  return MOE_NO_KERNEL("moe_permute");
}
extern "C" int cuda_moe_combine(gl_tensor *, const gl_tensor *, const gl_tensor *, const gl_tensor *) {
  return MOE_NO_KERNEL("moe_combine");
}
extern "C" int cuda_moe_combine_wgrad(gl_tensor *, const gl_tensor *, const gl_tensor *, const gl_tensor *) {
  return MOE_NO_KERNEL("moe_combine_wgrad");
}
extern "C" int cuda_grouped_matmul(gl_tensor *, const gl_tensor *, int, const gl_tensor **, const gl_tensor *) {
  return MOE_NO_KERNEL("grouped_matmul");
}
extern "C" int cuda_grouped_matmul_wgrad(int, gl_tensor **, const gl_tensor *, const gl_tensor *, const gl_tensor *) {
  return MOE_NO_KERNEL("grouped_matmul_wgrad");
}
