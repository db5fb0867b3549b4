/* reduce.c — CPU reductions: gl_reduce over a set of dims,
 * gl_reduce_max_dim (max with argmax) and gl_sumsq (float64 sum of squares).
 *
 * x is split into its kept dims (one output element each) and its reduced
 * dims (walked with a gl_iter of their own, offset 0, added to each output's
 * base offset).  Many outputs: parallel over outputs.  Few outputs with a
 * large reduction (a full sum, a grad norm): each output's reduction is cut
 * into per-thread ranges whose partial results are combined in thread order,
 * so results do not depend on scheduling.
 *
 * Compiled as a template over the accumulation type: the generic section at
 * the bottom is included with real = float and real = double. */
#ifndef real
#include "cpu.h"
#include <tgmath.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { CHUNK = 512, MAX_THREADS = 256 };

/* The kept-dims and reduced-dims views of x for dims_mask. */
static void split_dims(const gl_tensor *x, uint32_t mask, gl_tensor *kept, gl_tensor *red) {
  *kept = *x; *red = *x;
  kept->ndim = red->ndim = 0; kept->numel = red->numel = 1; red->offset = 0;
  for (int d = 0; d < x->ndim; d++) {
    gl_tensor *v = (mask >> d) & 1 ? red : kept;
    v->shape[v->ndim] = x->shape[d]; v->stride[v->ndim] = x->stride[d]; v->ndim++;
    v->numel *= x->shape[d];
  }
}

/* storage offset of t's r-th element in row-major order */
static int64_t elem_offset(const gl_tensor *t, int64_t r) {
  int64_t off = t->offset;
  for (int d = t->ndim - 1; d >= 0; d--) { off += (r % t->shape[d]) * t->stride[d]; r /= t->shape[d]; }
  return off;
}

static int is_wide(int dtype) { return dtype == GL_F64 || dtype == GL_I32 || dtype == GL_I64; }

#define GL_TEMPLATE "reduce.c"
#include "template.h"

int cpu_reduce(int op, gl_tensor *out, const gl_tensor *x, uint32_t dims_mask) {
  if (is_wide(x->dtype) || is_wide(out->dtype)) reduce_f64(op, out, x, dims_mask);
  else reduce_f32(op, out, x, dims_mask);
  return GL_OK;
}

int cpu_reduce_max_dim(gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim) {
  if (is_wide(x->dtype)) reduce_max_dim_f64(out, indices, x, dim);
  else reduce_max_dim_f32(out, indices, x, dim);
  return GL_OK;
}

int cpu_sumsq(const gl_tensor *x, double *out) {
  gl_tensor kept, red;
  split_dims(x, (uint32_t)((1ull << x->ndim) - 1), &kept, &red);
  *out = reduce_one_f64(GL_R_SUMSQ, x, x->offset, &red);
  return GL_OK;
}

int cpu_sumsq_multi(int n, const gl_tensor **xs, double *out) {
  double acc = 0, one = 0;
  for (int i = 0; i < n; i++) {
    GL_TRY(cpu_sumsq(xs[i], &one));
    acc += one;
  }
  *out = acc;
  return GL_OK;
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */


/* running state of a reduction */
typedef struct { real acc; int64_t n; } R(red_state);

static inline int R(better)(int op, real v, real m) { /* v replaces m; NaN wins */
  return op == GL_R_MAX ? (v > m || v != v) : (v < m || v != v);
}

static void R(accumulate)(int op, R(red_state) *s, const real *x, int64_t n) {
  real acc = 0;
  switch (op) {
  case GL_R_SUM: case GL_R_MEAN:
    #pragma omp simd reduction(+:acc)
    for (int64_t i = 0; i < n; i++) acc += x[i];
    s->acc += acc; break;
  case GL_R_SUMSQ: case GL_R_NORM2:
    #pragma omp simd reduction(+:acc)
    for (int64_t i = 0; i < n; i++) acc += x[i] * x[i];
    s->acc += acc; break;
  case GL_R_MAX: case GL_R_MIN:
    for (int64_t i = 0; i < n; i++)
      if ((s->n == 0 && i == 0) || R(better)(op, x[i], s->acc)) s->acc = x[i];
    break;
  }
  s->n += n;
}

static void R(combine)(int op, R(red_state) *s, const R(red_state) *p) {
  if (p->n == 0) return;
  if (op == GL_R_MAX || op == GL_R_MIN) { if (s->n == 0 || R(better)(op, p->acc, s->acc)) s->acc = p->acc; }
  else s->acc += p->acc;
  s->n += p->n;
}

/* tasks [t0, t1) of the reduced view red (chunks of CHUNK along its inner
   dim) starting from storage offset base */
static void R(reduce_range)(int op, R(red_state) *s, const gl_tensor *x, int64_t base, const gl_iter *it,
                            int64_t nchunk, int64_t t0, int64_t t1) {
  real buf[CHUNK];
  int64_t off[GL_ITER_MAX_OPS];
  for (int64_t task = t0; task < t1; task++) {
    int64_t i0 = (task % nchunk) * CHUNK, n = it->inner - i0 < CHUNK ? it->inner - i0 : CHUNK;
    gl_iter_offsets(it, task / nchunk, off);
    const real *p = R(cpu_span_load)(x, base + off[0] + i0 * it->istride[0], it->istride[0], n, buf);
    R(accumulate)(op, s, p, n);
  }
}

static real R(finish)(int op, const R(red_state) *s) {
  switch (op) {
  case GL_R_MEAN: return s->acc / (real)s->n;
  case GL_R_NORM2: return sqrt(s->acc);
  default: return s->acc;
  }
}

/* one output: reduce red (x's reduced dims) from storage offset base, in
   parallel when it is large */
static real R(reduce_one)(int op, const gl_tensor *x, int64_t base, const gl_tensor *red) {
  gl_iter it;
  gl_iter_init(&it, 1, (const gl_tensor *[]){red});
  int64_t nchunk = (it.inner + CHUNK - 1) / CHUNK, ntask = it.outer * nchunk;
  int nt = gl_threads_for(ntask, CHUNK);
  if (nt > MAX_THREADS) nt = MAX_THREADS;
  R(red_state) part[MAX_THREADS] = {{0}};
  GL_PAR_REGION(nt, 
#ifdef _OPENMP
    int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
    int tid = 0, nth = 1;
#endif
    R(reduce_range)(op, &part[tid], x, base, &it, nchunk, ntask * tid / nth, ntask * (tid + 1) / nth);
  );
  R(red_state) s = {0};
  for (int k = 0; k < nt; k++) R(combine)(op, &s, &part[k]);
  return R(finish)(op, &s);
}

static void R(reduce)(int op, gl_tensor *out, const gl_tensor *x, uint32_t mask) {
  gl_tensor kept, red;
  split_dims(x, mask, &kept, &red);
  int64_t nout = out->numel;
  int nt = gl_threads_for(nout, red.numel);
  if (nt <= 1) { /* few outputs: parallel inside each */
    for (int64_t r = 0; r < nout; r++)
      gl_store(out->storage->data, out->dtype, elem_offset(out, r),
               (double)R(reduce_one)(op, x, elem_offset(&kept, r), &red));
    return;
  }
  gl_iter it;
  gl_iter_init(&it, 1, (const gl_tensor *[]){&red});
  int64_t nchunk = (it.inner + CHUNK - 1) / CHUNK, ntask = it.outer * nchunk;
  GL_PAR_FOR(nt, r, nout, 
    R(red_state) s = {0};
    R(reduce_range)(op, &s, x, elem_offset(&kept, r), &it, nchunk, 0, ntask);
    gl_store(out->storage->data, out->dtype, elem_offset(out, r), (double)R(finish)(op, &s));
  );
}

static void R(reduce_max_dim)(gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim) {
  gl_tensor kept, red;
  split_dims(x, 1u << dim, &kept, &red);
  int64_t nout = out->numel, L = x->shape[dim], xs = x->stride[dim];
  int64_t *idx = (int64_t *)indices->storage->data;
  int nt = gl_threads_for(nout, L);
  GL_PAR_FOR(nt, r, nout, 
    real buf[CHUNK];
    int64_t base = elem_offset(&kept, r), best = 0;
    real m = 0;
    for (int64_t j0 = 0; j0 < L; j0 += CHUNK) {
      int64_t n = L - j0 < CHUNK ? L - j0 : CHUNK;
      const real *p = R(cpu_span_load)(x, base + j0 * xs, xs, n, buf);
      for (int64_t j = 0; j < n; j++)
        if ((j0 == 0 && j == 0) || (m == m && R(better)(GL_R_MAX, p[j], m))) { m = p[j]; best = j0 + j; }
    }
    gl_store(out->storage->data, out->dtype, elem_offset(out, r), (double)m);
    idx[elem_offset(indices, r)] = best;
  );
}

#undef real
#undef RDT
#undef R
#endif
