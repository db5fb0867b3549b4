/* matmul.c — batched out = alpha * a @ b + beta * out on the CPU with
 * OpenBLAS (cblas_sgemm / cblas_dgemm).
 *
 * Every matrix is handed to BLAS in place when its layout allows: row-major
 * (stride[-1] == 1) or a transposed view (stride[-2] == 1), each with its
 * leading dimension; an out that is a transposed view is computed as
 * out^T = b^T a^T.  Other layouts (and bfloat16/float16, computed in float32)
 * go through contiguous copies in thread-local scratch.  When b is the same
 * matrix for every batch (0 batch strides, e.g. a weight expanded over
 * (B, T)) and a and out walk their batch rows with one stride, the batch is
 * folded into M: one large GEMM instead of many small ones.
 *
 * A large enough row-major product is split by rows over the threads, one
 * single-threaded BLAS call per slice (gemm_split); otherwise BLAS runs its
 * own threads. */
#include "cpu.h"
#include <cblas.h>
#include <limits.h>
#ifdef _OPENMP
#include <omp.h>
#endif


/* One operand as BLAS sees it: rows x cols with strides (sr, sc). */
typedef struct {
  gl_tensor *t;
  int64_t rows, cols, sr, sc;
  int trans;     /* 0 row-major, 1 transposed view, -1 needs a copy */
  int64_t ld;
  int copy;      /* goes through a contiguous buffer of the work dtype */
} operand;

static void describe(operand *o, gl_tensor *t, int64_t rows, int64_t sr, int work_dtype) {
  int nd = t->ndim;
  o->t = t; o->rows = rows; o->cols = t->shape[nd - 1];
  o->sr = sr; o->sc = t->stride[nd - 1];
  o->trans = gl_blas_layout(o->rows, o->cols, o->sr, o->sc, &o->ld);
  o->copy = o->trans < 0 || t->dtype != work_dtype;
  if (o->copy) { o->trans = 0; o->ld = o->cols > 1 ? o->cols : 1; }
}

/* rows x cols of o at storage offset off <-> contiguous work-dtype buffer */
static void pack(const operand *o, int64_t off, void *buf, int wd) {
  for (int64_t i = 0; i < o->rows; i++) {
    int64_t ro = off + i * o->sr;
    if (wd == GL_F64) {
      double *dst = (double *)buf + i * o->cols;
      const double *p = cpu_span_load_f64(o->t, ro, o->sc, o->cols, dst);
      if (p != dst) memcpy(dst, p, (size_t)o->cols * sizeof *dst);
    } else {
      float *dst = (float *)buf + i * o->cols;
      const float *p = cpu_span_load_f32(o->t, ro, o->sc, o->cols, dst);
      if (p != dst) memcpy(dst, p, (size_t)o->cols * sizeof *dst);
    }
  }
}
static void unpack(const operand *o, int64_t off, const void *buf, int wd) {
  for (int64_t i = 0; i < o->rows; i++) {
    if (wd == GL_F64) cpu_span_store_f64(o->t, off + i * o->sr, o->sc, o->cols, (const double *)buf + i * o->cols);
    else cpu_span_store_f32(o->t, off + i * o->sr, o->sc, o->cols, (const float *)buf + i * o->cols);
  }
}

/* C (M x N, row stride ldc) = alpha op(A) op(B) + beta C.  beta = 0 is
   done as a memset and beta = 1: OpenBLAS clears C with its generic
   gemm_beta, one scalar store per element (11 GB/s here, 4% of the default
   recipe's step), and the kernel adds into C either way, so the bits are
   the same. */
static void gemm(int wd, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha,
                 const void *A, int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc) {
  enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
  if (beta == 0) {
    size_t esz = (size_t)gl_dtype_size(wd), row = (size_t)N * esz;
    if (ldc == N) memset(C, 0, row * (size_t)M);
    else for (int64_t i = 0; i < M; i++) memset((char *)C + (size_t)(i * ldc) * esz, 0, row);
    beta = 1;
  }
  if (wd == GL_F64)
    cblas_dgemm(CblasRowMajor, TA, TB, (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
  else
    cblas_sgemm(CblasRowMajor, TA, TB, (int)M, (int)N, (int)K, (float)alpha, A, (int)lda, B, (int)ldb,
                (float)beta, C, (int)ldc);
}

/* A row-major product with its rows dealt out to the threads, each slice a
   single-threaded GEMM (OpenBLAS's OpenMP build runs one thread inside a
   parallel region).  For the products of small models (768 x 128 x 512,
   say) that is 1.4-2x faster than OpenBLAS splitting the product itself,
   and no slower on large ones; slices keep at least MIN_SLICE rows so each
   GEMM still amortises its packing of B.  Inside a parallel region (the
   pair of gl_matmul_pair) it is one plain call. */
enum { MIN_SLICE = 128 };
static void gemm_split(int wd, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const void *A,
                       int64_t lda, const void *B, int64_t ldb, double beta, void *C, int64_t ldc) {
#ifdef _OPENMP
  int nt = 1;
  if (!omp_in_parallel()) {
    int64_t most = M / MIN_SLICE, threads = gl_get_num_threads();
    nt = (int)(most < threads ? most : threads);
  }
  if (nt >= 2) {
    size_t esz = (size_t)gl_dtype_size(wd);
    GL_PAR_REGION(nt,
      int64_t i = gl_thread_id(), r0 = M * i / nt, r1 = M * (i + 1) / nt;
      /* row r0 of op(A): row r0 of A, or column r0 of A stored transposed */
      const char *Ai = (const char *)A + (size_t)(ta ? r0 : r0 * lda) * esz;
      gemm(wd, ta, tb, r1 - r0, N, K, alpha, Ai, lda, B, ldb, beta, (char *)C + (size_t)(r0 * ldc) * esz, ldc);
    );
    return;
  }
#endif
  gemm(wd, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* out *= beta (0 writes zeros, whatever out held): the K == 0 product */
static void scale_out(gl_tensor *out, double beta) {
  gl_iter it;
  gl_iter_init(&it, 1, (const gl_tensor *[]){out});
  for (int64_t o = 0; o < it.outer; o++) {
    int64_t off[GL_ITER_MAX_OPS];
    gl_iter_offsets(&it, o, off);
    for (int64_t i = 0; i < it.inner; i++) {
      int64_t e = off[0] + i * it.istride[0];
      gl_store(out->storage->data, out->dtype, e, beta == 0 ? 0 : beta * gl_load(out->storage->data, out->dtype, e));
    }
  }
}

int cpu_matmul_bias(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *bias) {
  gl_tensor rows = gl_bias_rows(bias, out);
  GL_TRY(gl_copy(out, &rows));
  return cpu_matmul(out, a, b, 1, 1);
}

int cpu_matmul_add(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, const gl_tensor *c) {
  return gl_matmul_add_unfused(out, a, b, c);
}

int cpu_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta) {
  int nd = out->ndim;
  int64_t M = out->shape[nd - 2], N = out->shape[nd - 1], K = a->shape[nd - 1], nbatch = 1;
  for (int d = 0; d < nd - 2; d++) nbatch *= out->shape[d];
  if (M == 0 || N == 0 || nbatch == 0) return GL_OK;
  if (K == 0) { scale_out(out, beta); return GL_OK; }
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
    return gl_error("gl_matmul: matrix sizes M=%lld N=%lld K=%lld exceed the BLAS int range",
                    (long long)M, (long long)N, (long long)K);
  int wd = out->dtype == GL_F64 ? GL_F64 : GL_F32, esz = gl_dtype_size(wd);

  /* fold the batch into M when b is shared by every batch */
  int64_t rows = M, batches = nbatch, sra = a->stride[nd - 2], sro = out->stride[nd - 2], fa, fo;
  int b_shared = 1;
  for (int d = 0; d < nd - 2; d++) if (out->shape[d] > 1 && b->stride[d] != 0) b_shared = 0;
  operand oa, ob, oc;
  if (nbatch > 1 && b_shared && M * nbatch <= INT_MAX && gl_fold_rows(a, &fa) && gl_fold_rows(out, &fo)) {
    describe(&oa, (gl_tensor *)a, M * nbatch, fa, wd);
    describe(&oc, out, M * nbatch, fo, wd);
    if (!oa.copy && oa.trans == 0 && !oc.copy && oc.trans == 0) {
      rows = M * nbatch; batches = 1; sra = fa; sro = fo;
    }
  }
  describe(&oa, (gl_tensor *)a, rows, sra, wd);
  describe(&ob, (gl_tensor *)b, K, b->stride[nd - 2], wd);
  describe(&oc, out, rows, sro, wd);

  void *bufa = NULL, *bufb = NULL, *bufc = NULL;
  if (oa.copy && !(bufa = cpu_scratch(1, (size_t)(rows * K * esz)))) goto oom;
  if (ob.copy && !(bufb = cpu_scratch(2, (size_t)(K * N * esz)))) goto oom;
  if (oc.copy && !(bufc = cpu_scratch(3, (size_t)(rows * N * esz)))) goto oom;

  int64_t packed_a = -1, packed_b = -1;
  for (int64_t bi = 0; bi < batches; bi++) {
    int64_t offa = a->offset, offb = b->offset, offc = out->offset, r = bi;
    for (int d = nd - 3; d >= 0; d--) {
      int64_t i = r % out->shape[d];
      r /= out->shape[d];
      offa += i * a->stride[d]; offb += i * b->stride[d]; offc += i * out->stride[d];
    }
    /* a copy is packed once for a run of batches sharing it (a broadcast weight) */
    if (oa.copy && offa != packed_a) { pack(&oa, offa, bufa, wd); packed_a = offa; }
    if (ob.copy && offb != packed_b) { pack(&ob, offb, bufb, wd); packed_b = offb; }
    if (oc.copy && beta != 0) pack(&oc, offc, bufc, wd);
    const void *A = oa.copy ? bufa : (const char *)a->storage->data + offa * esz;
    const void *B = ob.copy ? bufb : (const char *)b->storage->data + offb * esz;
    void *C = oc.copy ? bufc : (char *)out->storage->data + offc * esz;
    if (oc.trans == 0)
      gemm_split(wd, oa.trans, ob.trans, rows, N, K, alpha, A, oa.ld, B, ob.ld, beta, C, oc.ld);
    else /* out is a transposed view: out^T = b^T a^T */
      gemm(wd, !ob.trans, !oa.trans, N, rows, K, alpha, B, ob.ld, A, oa.ld, beta, C, oc.ld);
    if (oc.copy) unpack(&oc, offc, bufc, wd);
  }
  return GL_OK;
oom:
  return gl_error("gl_matmul: out of memory for the contiguous copies of a %lldx%lldx%lld product",
                  (long long)rows, (long long)K, (long long)N);
}
