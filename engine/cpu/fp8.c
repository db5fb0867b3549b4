/* fp8.c — the FP8 scaled product on the CPU: current-scaling quantization
 * and the product of two float8 matrices with float32 accumulation; the
 * twin of kernels/fp8.cu, emulating it exactly where the GPU's arithmetic
 * is fixed (gl_ops.h states the formulas):
 *  - quantize: amax is the largest |x| compared as float32 bit patterns (so a
 *    NaN anywhere makes it NaN, and no order can change it), the scale
 *    s = fp8_max / max(amax, 1e-12) and each x * s are float32 operations,
 *    and the float32 product is rounded once to float8 (nearest even,
 *    saturating: engine/util.c).  The GPU does the same operations, so q and
 *    scale_inv agree bit for bit.
 *  - product: the float8 operands decoded exactly to float32, one
 *    cblas_sgemm (float32 accumulation, in BLAS's order, which is where the
 *    GPU's tensor cores may differ), then acc * (a_scale_inv[m] *
 *    b_scale_inv[n]) in float32, rounded once to out's dtype. */
#include "cpu.h"
#include <cblas.h>
#include <stdlib.h>

static inline uint32_t abs_bits(float v) { uint32_t u; memcpy(&u, &v, 4); return u & 0x7fffffffu; }
static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* the cast; given: amax's data (one word, or one per row with rowwise), or
   NULL to compute it from x */
static int quantize(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise, const float *given) {
  const int64_t R = x->shape[0], C = x->shape[1];
  const double fmax = q->dtype == GL_F8E4M3 ? GL_FP8_E4M3_MAX : GL_FP8_E5M2_MAX;
  uint8_t (*enc)(double) = q->dtype == GL_F8E4M3 ? gl_f64_to_f8e4m3 : gl_f64_to_f8e5m2;
  float *row = malloc((size_t)(C > 0 ? C : 1) * sizeof *row);
  if (!row) return gl_error("cpu_fp8_quantize: out of memory for a row of %lld", (long long)C);
  uint32_t whole = given && !rowwise ? abs_bits(given[0]) : 0;
  if (!rowwise && !given)
    for (int64_t r = 0; r < R; r++) {
      const float *p = cpu_span_load_f32(x, x->offset + r * x->stride[0], x->stride[1], C, row);
      for (int64_t c = 0; c < C; c++) { uint32_t b = abs_bits(p[c]); if (b > whole) whole = b; }
    }
  uint8_t *qd = (uint8_t *)q->storage->data + q->offset;
  float *sd = (float *)scale_inv->storage->data + scale_inv->offset;
  for (int64_t r = 0; r < R; r++) {
    const float *p = cpu_span_load_f32(x, x->offset + r * x->stride[0], x->stride[1], C, row);
    uint32_t m = whole;
    if (rowwise && given) m = abs_bits(given[r]);
    else if (rowwise) { m = 0; for (int64_t c = 0; c < C; c++) { uint32_t b = abs_bits(p[c]); if (b > m) m = b; } }
    float s = gl_fp8_scale(bits_float(m), (float)fmax);
    for (int64_t c = 0; c < C; c++) qd[r * q->stride[0] + c * q->stride[1]] = enc((double)(p[c] * s));
    if (rowwise || r == 0) sd[rowwise ? r * scale_inv->stride[0] : 0] = 1.0f / s;
  }
  if (R == 0) sd[0] = 1.0f / gl_fp8_scale(bits_float(whole), (float)fmax);
  free(row);
  return GL_OK;
}

int cpu_fp8_quantize(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, int rowwise) {
  return quantize(q, scale_inv, x, rowwise, NULL);
}

int cpu_fp8_quantize_amax(gl_tensor *q, gl_tensor *scale_inv, const gl_tensor *x, const gl_tensor *amax) {
  return quantize(q, scale_inv, x, amax->shape[0] != 1, (const float *)amax->storage->data + amax->offset);
}

static void decode(const gl_tensor *t, float *dst) {
  const int64_t R = t->shape[0], C = t->shape[1];
  float table[256];
  for (int b = 0; b < 256; b++) table[b] = t->dtype == GL_F8E4M3 ? gl_f8e4m3_to_f32((uint8_t)b) : gl_f8e5m2_to_f32((uint8_t)b);
  const uint8_t *p = (const uint8_t *)t->storage->data + t->offset;
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) dst[r * C + c] = table[p[r * t->stride[0] + c * t->stride[1]]];
}

int cpu_fp8_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *a_scale_inv, const gl_tensor *b,
                   const gl_tensor *b_scale_inv) {
  const int64_t M = a->shape[0], K = a->shape[1], N = b->shape[0];
  float *fa = malloc((size_t)(M * K + N * K + M * N + 1) * sizeof(float));
  if (!fa) return gl_error("cpu_fp8_matmul: out of memory for a %lldx%lldx%lld product", (long long)M, (long long)N, (long long)K);
  float *fb = fa + M * K, *acc = fb + N * K;
  decode(a, fa);
  decode(b, fb);
  if (K > 0) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f, fa, (int)K, fb, (int)K,
                         0.0f, acc, (int)(N > 0 ? N : 1));
  else memset(acc, 0, (size_t)(M * N) * sizeof(float));
  const float *sa = (const float *)a_scale_inv->storage->data + a_scale_inv->offset;
  const float *sb = (const float *)b_scale_inv->storage->data + b_scale_inv->offset;
  const int64_t ia = a_scale_inv->numel > 1 ? a_scale_inv->stride[0] : 0, ib = b_scale_inv->numel > 1 ? b_scale_inv->stride[0] : 0;
  for (int64_t m = 0; m < M; m++) {
    float *row = acc + m * N;
    for (int64_t n = 0; n < N; n++) row[n] = row[n] * (sa[m * ia] * sb[n * ib]);
    cpu_span_store_f32(out, out->offset + m * out->stride[0], out->stride[1], N, row);
  }
  free(fa);
  return GL_OK;
}
