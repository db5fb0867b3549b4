/* cublaslt_heuristic.cpp — the simulated cuBLASLt's validation of a problem,
 * and cublasLtMatmulAlgoGetHeuristic.
 *
 * Part of the simulator's cuBLASLt (cublaslt.cpp: the overview and the
 * objects; cublaslt_matmul.cpp: the product; shared declarations in
 * cublaslt_internal.h).  make_problem turns a descriptor and four layouts
 * into a Problem, refusing what the real library refuses; both the heuristic
 * and cublasLtMatmul call it, since the matmul may be given another
 * algorithm, or none.  The algorithm the heuristic answers with records what
 * it assumes (types, epilogue, alignments, workspace: SimAlgo, packed into
 * cublasLtMatmulAlgo_t), for cublasLtMatmul to hold the call against. */
#include "cublaslt_internal.h"
#include <stdlib.h>
#include <string.h>
#include <algorithm>

using namespace gl_sim_lt;

/* ---- the problem ----------------------------------------------------------- */
/* (Mat, Problem and the limits WORKSPACE_NEED, MAX_VECTOR_ALIGN: cublaslt_internal.h) */
int64_t gl_sim_lt::lowest_pow2(uint64_t v, int64_t cap) {
  if (v == 0) return cap;
  int64_t a = (int64_t)(v & (~v + 1));
  return a < cap ? a : cap;
}

/* Whether two different batches of a rows x cols column-major layout share
   an element: batch offsets s = db * stride collide when s + di + dj * ld ==
   0 for some |di| < rows, |dj| < cols (within a batch ld >= rows keeps
   elements apart). */
static bool batches_overlap(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
  if (batch <= 1 || rows == 0 || cols == 0) return false;
  if (stride == 0) return true;
  const int64_t span = (cols - 1) * ld + rows;  /* elements a batch reaches */
  for (int64_t db = 1; db < batch; db++) {
    if (stride > span / db) break;  /* db * stride >= span: this and later batches lie beyond */
    const int64_t s = db * stride, q = s / ld, r = s % ld;
    if (q < cols && r < rows) return true;               /* dj = -q leaves r */
    if (q + 1 < cols && ld - r < rows) return true;      /* dj = -(q + 1) leaves r - ld */
  }
  return false;
}

/* Checks one layout on its own. */
static cublasStatus_t check_layout(const char *fn, const char *name, const gl_sim_lt_layout *l) {
  if (l->order != CUBLASLT_ORDER_COL)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s: CUBLASLT_MATRIX_LAYOUT_ORDER %d is not simulated (only CUBLASLT_ORDER_COL)",
                  fn, name, l->order);
  if (l->rows > 2147483647u || l->cols > 2147483647u)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s is %llu x %llu, beyond the int32 range the library supports",
                  fn, name, (unsigned long long)l->rows, (unsigned long long)l->cols);
  int64_t need = l->rows > 1 ? (int64_t)l->rows : 1;
  if (l->ld < need)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: ld %lld, expected >= %lld (its rows)", fn, name,
                  (long long)l->ld, (long long)need);
  if (l->batch < 1)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT %d, expected >= 1", fn, name,
                  l->batch);
  if (l->stride < 0)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET %lld, expected >= 0",
                  fn, name, (long long)l->stride);
  return CUBLAS_STATUS_SUCCESS;
}

/* FP8 operands, as cuBLASLt takes them on sm_89 / sm_90: both A and B FP8,
   not both E5M2; CUBLAS_COMPUTE_32F with 32F scale; the "TN" problem (A
   transposed, B not); k and the lds of A and B multiples of 16; C and D of
   one type among 16BF, 16F, 32F (FP8 D, with its D scale and amax, is not
   simulated); no epilogue (the FP8 bias epilogues are not simulated).  The
   A and B scale pointers (device floats) multiply the product: D = alpha
   scaleA scaleB op(A) op(B). */
static cublasStatus_t fp8_problem(const char *fn, const gl_sim_lt_matmul_desc *dsc, Problem *q) {
  const int at = q->a.type, bt = q->b.type, dt = q->d.type;
  const bool a8 = at == CUDA_R_8F_E4M3 || at == CUDA_R_8F_E5M2, b8 = bt == CUDA_R_8F_E4M3 || bt == CUDA_R_8F_E5M2;
  if (!a8 || !b8 || (at == CUDA_R_8F_E5M2 && bt == CUDA_R_8F_E5M2))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: FP8 %s x %s: both A and B FP8, not both CUDA_R_8F_E5M2", fn,
                  type_name(at), type_name(bt));
  if (q->compute != CUBLAS_COMPUTE_32F || dsc->scale != CUDA_R_32F)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: FP8 products need CUBLAS_COMPUTE_32F and a CUDA_R_32F scale, got %s",
                  fn, compute_name(q->compute));
  if (!q->ta || q->tb)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: FP8 products take only the TN problem (TRANSA T, TRANSB N), got %c%c",
                  fn, q->ta ? 'T' : 'N', q->tb ? 'T' : 'N');
  if (q->k % 16 || q->a.ld % 16 || q->b.ld % 16)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: FP8 products need k and the lds of A and B multiples of 16, got k %lld, "
                  "lda %lld, ldb %lld", fn, (long long)q->k, (long long)q->a.ld, (long long)q->b.ld);
  if (q->c.type != dt || !(dt == CUDA_R_16BF || dt == CUDA_R_16F || dt == CUDA_R_32F))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: FP8 product with C %s and D %s: the simulator takes one of 16BF, 16F, 32F",
                  fn, type_name(q->c.type), type_name(dt));
  if (dsc->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: FP8 products with an epilogue are not simulated", fn);
  q->fp8 = 1;
  q->a_scale = dsc->a_scale;
  q->b_scale = dsc->b_scale;
  return CUBLAS_STATUS_SUCCESS;
}

/* Validates descriptor + layouts as the real library does (dimensions, lds,
   types, epilogue) and fills q.  Pointers and alignment are checked by the
   callers. */
cublasStatus_t gl_sim_lt::make_problem(const char *fn, const gl_sim_lt_matmul_desc *dsc, const gl_sim_lt_layout *A,
                                       const gl_sim_lt_layout *B, const gl_sim_lt_layout *C,
                                       const gl_sim_lt_layout *D, Problem *q) {
  memset(q, 0, sizeof *q);
  cublasStatus_t st;
  if ((st = check_layout(fn, "Adesc", A)) || (st = check_layout(fn, "Bdesc", B)) ||
      (st = check_layout(fn, "Cdesc", C)) || (st = check_layout(fn, "Ddesc", D)))
    return st;
  if (dsc->pointer_mode != CUBLASLT_POINTER_MODE_HOST)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: CUBLASLT_MATMUL_DESC_POINTER_MODE %d is not simulated (only HOST)",
                  fn, dsc->pointer_mode);
  if (dsc->transc != CUBLAS_OP_N)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: CUBLASLT_MATMUL_DESC_TRANSC must be CUBLAS_OP_N, got %d", fn,
                  dsc->transc);

  /* dimensions: op(A) m x k, op(B) k x n, C and D m x n, one batch count */
  q->ta = dsc->transa != CUBLAS_OP_N;
  q->tb = dsc->transb != CUBLAS_OP_N;
  q->m = (int64_t)D->rows;
  q->n = (int64_t)D->cols;
  int64_t am = q->ta ? A->cols : A->rows, ak = q->ta ? A->rows : A->cols;
  int64_t bk = q->tb ? B->cols : B->rows, bn = q->tb ? B->rows : B->cols;
  q->k = ak;
  if ((int64_t)C->rows != q->m || (int64_t)C->cols != q->n)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: C is %llu x %llu but D is %lld x %lld", fn,
                  (unsigned long long)C->rows, (unsigned long long)C->cols, (long long)q->m, (long long)q->n);
  if (am != q->m || bn != q->n || bk != ak)
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: op(A) is %lld x %lld and op(B) %lld x %lld, expected %lld x k and k x %lld for D %lld x %lld",
                  fn, (long long)am, (long long)ak, (long long)bk, (long long)bn, (long long)q->m, (long long)q->n,
                  (long long)q->m, (long long)q->n);
  if (A->batch != D->batch || B->batch != D->batch || C->batch != D->batch)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: batch counts A %d, B %d, C %d, D %d, expected all equal", fn,
                  A->batch, B->batch, C->batch, D->batch);
  q->batch = D->batch;
  const gl_sim_lt_layout *ls[4] = {A, B, C, D};
  Mat *ms[4] = {&q->a, &q->b, &q->c, &q->d};
  for (int i = 0; i < 4; i++)
    *ms[i] = Mat{(int)ls[i]->type, (int64_t)ls[i]->rows, (int64_t)ls[i]->cols, ls[i]->ld,
                 q->batch > 1 ? ls[i]->stride : 0};

  /* types: cuBLASLt's table for regular (non-fp8, non-integer) types */
  q->compute = dsc->compute;
  q->scale = dsc->scale;
  int at = q->a.type, bt = q->b.type, ct = q->c.type, dt = q->d.type;
  const bool a8 = at == CUDA_R_8F_E4M3 || at == CUDA_R_8F_E5M2, b8 = bt == CUDA_R_8F_E4M3 || bt == CUDA_R_8F_E5M2;
  if ((dsc->a_scale || dsc->b_scale) && !(a8 && b8))
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: A/B scale pointers with %s x %s: scaling is for FP8 operands", fn,
                  type_name(at), type_name(bt));
  if (a8 || b8) {
    st = fp8_problem(fn, dsc, q);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
  } else if (at != bt || ct != dt)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: A %s and B %s (C %s and D %s) must have one type", fn,
                  type_name(at), type_name(bt), type_name(ct), type_name(dt));
  if (!q->fp8) switch (q->compute) {
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
      if (!((at == CUDA_R_32F && dt == CUDA_R_32F) || (at == CUDA_R_16BF && (dt == CUDA_R_16BF || dt == CUDA_R_32F)) ||
            (at == CUDA_R_16F && (dt == CUDA_R_16F || dt == CUDA_R_32F))))
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s inputs with %s output have no %s algorithm", fn,
                      type_name(at), type_name(dt), compute_name(q->compute));
      break;
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
      if (at != CUDA_R_32F || dt != CUDA_R_32F)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s takes CUDA_R_32F matrices, got %s inputs and %s output", fn,
                      compute_name(q->compute), type_name(at), type_name(dt));
      q->rounding = q->compute == CUBLAS_COMPUTE_32F_FAST_TF32   ? ROUND_TF32
                    : q->compute == CUBLAS_COMPUTE_32F_FAST_16BF ? ROUND_BF16
                                                                 : ROUND_FP16;
      break;
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
      if (at != CUDA_R_64F || dt != CUDA_R_64F)
        return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s takes CUDA_R_64F matrices, got %s inputs and %s output", fn,
                      compute_name(q->compute), type_name(at), type_name(dt));
      q->f64 = 1;
      break;
    default:
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: compute type %s (%d) is not simulated", fn,
                    compute_name(q->compute), q->compute);
  }
  int want_scale = q->f64 ? CUDA_R_64F : CUDA_R_32F;
  if (q->scale != want_scale)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: scale type %s with %s, expected %s", fn, type_name(q->scale),
                  compute_name(q->compute), type_name(want_scale));

  /* outputs must not share elements between batches */
  if (batches_overlap(q->m, q->n, q->d.ld, q->d.stride, q->batch))
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: D's %lld batches overlap (%lld x %lld, ld %lld, batch stride %lld): elements written twice", fn,
                  (long long)q->batch, (long long)q->m, (long long)q->n, (long long)q->d.ld, (long long)q->d.stride);

  /* epilogue */
  q->epilogue = dsc->epilogue;
  const char *en = epilogue_name(q->epilogue);
  if (!en) return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %u is not a cublasLtEpilogue_t", fn, q->epilogue);
  switch (q->epilogue) {
    case CUBLASLT_EPILOGUE_DEFAULT: break;
    case CUBLASLT_EPILOGUE_RELU: q->relu = 1; break;
    case CUBLASLT_EPILOGUE_BIAS: q->bias_in = 1; break;
    case CUBLASLT_EPILOGUE_RELU_BIAS: q->bias_in = q->relu = 1; break;
    case CUBLASLT_EPILOGUE_GELU: q->gelu = 1; break;
    case CUBLASLT_EPILOGUE_GELU_AUX: q->gelu = q->aux_out = 1; break;
    case CUBLASLT_EPILOGUE_GELU_BIAS: q->gelu = q->bias_in = 1; break;
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: q->gelu = q->aux_out = q->bias_in = 1; break;
    case CUBLASLT_EPILOGUE_DGELU: q->dgelu = 1; break;
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: q->dgelu = q->bgrad_rows = 1; break;
    case CUBLASLT_EPILOGUE_BGRADA: q->bgrada = 1; break;
    case CUBLASLT_EPILOGUE_BGRADB: q->bgradb = 1; break;
    default:
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s (the ReLU bit-mask epilogues) is not simulated", fn, en);
  }
  int simple = q->epilogue == CUBLASLT_EPILOGUE_DEFAULT || q->epilogue == CUBLASLT_EPILOGUE_RELU ||
               q->epilogue == CUBLASLT_EPILOGUE_BIAS || q->epilogue == CUBLASLT_EPILOGUE_RELU_BIAS;
  if (q->f64 && !simple)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s with %s: only DEFAULT, RELU, BIAS and RELU_BIAS in fp64", fn,
                  en, compute_name(q->compute));
  int uses_bias = q->bias_in || q->bgrad_rows || q->bgrada || q->bgradb;
  if (uses_bias) {
    q->bias = dsc->bias;
    q->bias_type = dsc->bias_type == -1 ? dt : dsc->bias_type;
    int ok = q->bias_type == dt || (q->bias_type == CUDA_R_32F && (dt == CUDA_R_16BF || dt == CUDA_R_16F));
    if (!ok)
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s: bias of type %s with D %s, expected D's type%s", fn, en,
                    type_name(q->bias_type), type_name(dt), dt == CUDA_R_16BF || dt == CUDA_R_16F ? " or CUDA_R_32F" : "");
    q->bias_len = q->bgradb ? q->n : q->m;
    q->bias_stride = q->batch > 1 ? dsc->bias_stride : 0;
    if (q->bias_stride < 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE %lld, expected >= 0", fn,
                    (long long)q->bias_stride);
    int writes_bias = q->bgrad_rows || q->bgrada || q->bgradb;
    if (writes_bias && batches_overlap(q->bias_len, 1, q->bias_len, q->bias_stride, q->batch))
      return refuse(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: %s over %lld batches: CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE %lld, expected >= %lld (the "
                    "gradient's length) so that batches do not overwrite each other",
                    fn, en, (long long)q->batch, (long long)q->bias_stride, (long long)q->bias_len);
  }
  if (q->aux_out || q->dgelu) {
    q->aux = dsc->aux;
    q->aux_type = dsc->aux_type == -1 ? dt : dsc->aux_type;
    if (q->aux_type != dt)
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: %s: aux of type %s, expected D's type %s", fn, en,
                    type_name(q->aux_type), type_name(dt));
    q->aux_ld = dsc->aux_ld;
    q->aux_stride = q->batch > 1 ? dsc->aux_stride : 0;
    if (q->aux_ld < q->m || q->aux_ld < 1 || q->aux_ld % 8 != 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: %s: CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD %lld, expected a multiple of 8 >= %lld (D's rows)",
                    fn, en, (long long)q->aux_ld, (long long)q->m);
    if (q->aux_stride < 0 || q->aux_stride % 8 != 0)
      return refuse(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: %s: CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE %lld, expected a multiple of 8 >= 0", fn,
                    en, (long long)q->aux_stride);
    if (q->aux_out && batches_overlap(q->m, q->n, q->aux_ld, q->aux_stride, q->batch))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: the aux output's %lld batches overlap (batch stride %lld)", fn,
                    en, (long long)q->batch, (long long)q->aux_stride);
  }
  return CUBLAS_STATUS_SUCCESS;
}

/* ---- the algorithm --------------------------------------------------------- */
/* (SimAlgo, what cublasLtMatmulAlgo_t carries: cublaslt_internal.h) */
static const uint64_t ALGO_MAGIC = 0x474c53494d414c47ull;  /* "GLSIMALG" */

static void algo_pack(const SimAlgo &s, cublasLtMatmulAlgo_t *a) {
  memset(a, 0, sizeof *a);
  a->data[0] = ALGO_MAGIC;
  a->data[1] = (uint64_t)(uint32_t)s.atype | (uint64_t)(uint32_t)s.dtype << 16 | (uint64_t)(uint32_t)s.compute << 32;
  a->data[2] = s.epilogue;
  a->data[3] = (uint64_t)s.align[0] | (uint64_t)s.align[1] << 16 | (uint64_t)s.align[2] << 32 |
               (uint64_t)s.align[3] << 48;
  a->data[4] = (uint64_t)s.bias_align | (uint64_t)s.aux_align << 16;
  a->data[5] = s.workspace;
}

bool gl_sim_lt::algo_unpack(const cublasLtMatmulAlgo_t *a, SimAlgo *s) {
  if (a->data[0] != ALGO_MAGIC) return false;
  s->atype = (int)(a->data[1] & 0xffff);
  s->dtype = (int)((a->data[1] >> 16) & 0xffff);
  s->compute = (int)(a->data[1] >> 32);
  s->epilogue = (uint32_t)a->data[2];
  for (int i = 0; i < 4; i++) s->align[i] = (uint32_t)((a->data[3] >> (16 * i)) & 0xffff);
  s->bias_align = (uint32_t)(a->data[4] & 0xffff);
  s->aux_align = (uint32_t)((a->data[4] >> 16) & 0xffff);
  s->workspace = a->data[5];
  return true;
}

/* The alignment an algorithm may assume for matrix x given a promise (or a
   pointer's actual alignment): at most 16 bytes, and no more than its ld and
   batch stride keep for every column and batch. */
uint32_t gl_sim_lt::matrix_align(uint64_t promise, const Mat &x, int64_t batch) {
  int esz = type_size(x.type);
  int64_t a = lowest_pow2(promise, MAX_VECTOR_ALIGN);
  a = lowest_pow2((uint64_t)(x.ld * esz), a);
  if (batch > 1 && x.stride > 0) a = lowest_pow2((uint64_t)(x.stride * esz), a);
  return (uint32_t)a;
}

static bool no_algo_forced(void) {
  static const bool forced = [] {
    const char *e = getenv("GL_SIM_CUBLASLT_NO_ALGO");
    return e && *e && strcmp(e, "0") != 0;
  }();
  return forced;
}

extern "C" cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t desc,
                                                         cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                                         cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                                         cublasLtMatmulPreference_t pref, int requested,
                                                         cublasLtMatmulHeuristicResult_t results[], int *count) {
  const char *fn = "cublasLtMatmulAlgoGetHeuristic";
  if (count) *count = 0;
  CHECK_HANDLE(fn, h);
  CHECK_OBJ(fn, "operationDesc", desc, OBJ_DESC);
  CHECK_OBJ(fn, "Adesc", Adesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Bdesc", Bdesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Cdesc", Cdesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Ddesc", Ddesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "preference", pref, OBJ_PREF);
  if (requested <= 0)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: requestedAlgoCount %d, expected >= 1", fn, requested);
  if (!results || !count)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: heuristicResultsArray or returnAlgoCount is NULL", fn);
  Problem q;
  cublasStatus_t st = make_problem(fn, desc, Adesc, Bdesc, Cdesc, Ddesc, &q);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  if (no_algo_forced()) {
    refuse(CUBLAS_STATUS_SUCCESS, "%s: no algorithm (GL_SIM_CUBLASLT_NO_ALGO is set)", fn);
    return CUBLAS_STATUS_SUCCESS;
  }
  SimAlgo s;
  memset(&s, 0, sizeof s);
  const Mat *ms[4] = {&q.a, &q.b, &q.c, &q.d};
  const char *names = "ABCD";
  for (int i = 0; i < 4; i++) {
    int esz = type_size(ms[i]->type);
    int64_t promise = lowest_pow2(pref->align[i], 1 << 30);
    if (pref->align[i] == 0) promise = 1;
    if (promise < esz)
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED,
                    "%s: no algorithm reads %c (%s) promised only %u-byte alignment: its elements need %d", fn,
                    names[i], type_name(ms[i]->type), pref->align[i], esz);
    s.align[i] = matrix_align((uint64_t)promise, *ms[i], q.batch);
  }
  /* bias / aux alignment: from the pointers in the descriptor (NULL: the
     widest, as a 0 address is aligned to everything) */
  s.bias_align = (uint32_t)lowest_pow2((uint64_t)(uintptr_t)q.bias, MAX_VECTOR_ALIGN);
  s.aux_align = (uint32_t)lowest_pow2((uint64_t)(uintptr_t)q.aux, MAX_VECTOR_ALIGN);
  s.atype = q.a.type;
  s.dtype = q.d.type;
  s.compute = q.compute;
  s.epilogue = q.epilogue;
  s.workspace = std::min<uint64_t>(pref->max_workspace, WORKSPACE_NEED);
  cublasLtMatmulHeuristicResult_t r;
  memset(&r, 0, sizeof r);
  algo_pack(s, &r.algo);
  r.workspaceSize = (size_t)s.workspace;
  r.state = CUBLAS_STATUS_SUCCESS;
  /* 128 x 128 output tiles over the H100's SMs */
  double tiles = (double)((q.m + 127) / 128) * (double)((q.n + 127) / 128) * (double)q.batch;
  r.wavesCount = (float)(tiles / GL_SIM_SM_COUNT);
  results[0] = r;
  *count = 1;
  return CUBLAS_STATUS_SUCCESS;
}
