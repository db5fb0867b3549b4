/* attention_flash.cuh — what kernels/attention.cu calls of the FlashAttention-2
 * path in kernels/attention_flash.cu (include after common.cuh).  The
 * *_fits tests say whether the operands suit it (bfloat16 rows of unit
 * stride, 16-byte aligned, head dim 64 or 128, the device's shared memory);
 * the calls then run it on stream st.  segments (B, T) or null; window < 0:
 * no mask, every query at S - 1 + t. */
#pragma once

bool flash_attention_forward_fits(int dev, const gl_tensor *out, const gl_tensor *q, const gl_tensor *k,
                                  const gl_tensor *v);
bool flash_attention_backward_fits(int dev, const gl_tensor *dq, const gl_tensor *dk, const gl_tensor *dv,
                                   const gl_tensor *dout, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                                   const gl_tensor *out);
int flash_attention_forward(cudaStream_t st, int dev, gl_tensor *out, gl_tensor *lse, const gl_tensor *q,
                            const gl_tensor *k, const gl_tensor *v, const gl_tensor *segments, double scale,
                            int64_t window);
/* di: rowsum(dout * out), (B, H, T) contiguous float32 */
int flash_attention_backward(cudaStream_t st, int dev, gl_tensor *dq, gl_tensor *dk, gl_tensor *dv,
                             const gl_tensor *dout, const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                             const gl_tensor *lse, const gl_tensor *segments, const float *di, double scale,
                             int64_t window);
