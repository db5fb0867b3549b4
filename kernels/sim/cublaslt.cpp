/* cublaslt.cpp — cuBLASLt for the CUDA simulator, over OpenBLAS.
 *
 * Part of the CUDA simulator (kernels/sim/, seams in sim.h).  Implements the
 * functions declared in cublasLt.h with the real library's statuses, and
 * refuses what the real library refuses (or what the simulator does not
 * model) with a one-line reason printed to stderr ("gptlua cuda-sim: ...")
 * and kept for gl_sim_cublaslt_last_message().
 *
 * How a call maps onto the real library:
 *  - cublasLtMatmulAlgoGetHeuristic validates the problem (below) and
 *    answers with one algorithm.  The algorithm records what it assumes:
 *    the data and compute types, the epilogue, the alignment of each matrix
 *    pointer and of the bias / aux pointers, and its workspace size.
 *  - cublasLtMatmul validates again (it may be given another algorithm, or
 *    none), checks the host-visible arguments (workspace size, pointer
 *    alignment against the algorithm, C/D aliasing), reads alpha and beta
 *    (host pointer mode) and queues the product as stream work
 *    (gl_sim_submit).  The work checks that every matrix lies inside one
 *    live device allocation and that the bias / aux pointers are as aligned
 *    as the algorithm assumed (on a GPU those fault inside the kernel:
 *    cudaErrorIllegalAddress / cudaErrorMisalignedAddress, sticky), then
 *    computes.
 *
 * Numerics: operands are copied from device memory into host buffers
 * (column-major, widened to the compute type: bf16 / fp16 -> fp32 exactly),
 * one cblas_sgemm (or cblas_dgemm for 64F) computes alpha op(A) op(B) +
 * beta C, the epilogue runs in the compute type, and each result is rounded
 * once to its storage type with round-to-nearest-even (the tensor cores
 * accumulate in fp32 and round on the store).  The 32F_FAST modes first
 * round the fp32 inputs to the narrower type the real library is allowed to
 * use (fp16, bf16: nearest-even; tf32: nearest, ties away, as PTX
 * cvt.rna.tf32.f32), so code that needs full fp32 products shows it.
 * beta == 0 never reads C (as BLAS and cuBLAS), so C may be NULL then.
 *
 * Choices where the real library leaves room (so that code that passes
 * here runs on a GPU):
 *  - Alignment.  MIN_ALIGNMENT_X_BYTES (default 256) is a promise about the
 *    pointers the matmul will get.  The algorithm assumes
 *    min(promise, 16 bytes: the widest vector load, alignment of ld * size,
 *    alignment of the batch stride * size); a promise below the element
 *    size finds no algorithm (NOT_SUPPORTED).  cublasLtMatmul refuses a
 *    pointer less aligned than its algorithm assumes with
 *    CUBLAS_STATUS_NOT_SUPPORTED, what the real library returns for that
 *    (see pytorch/pytorch#92201 and #97205, where under-aligned operands on
 *    sm80 / sm90 gave CUBLAS_STATUS_NOT_SUPPORTED from cublasLtMatmul).
 *    The bias and aux pointers are not covered by the preferences: the
 *    heuristic reads their values from the descriptor (as the real header
 *    says it does); a later, less aligned pointer faults with
 *    cudaErrorMisalignedAddress in the work, as the kernel would.
 *  - Workspace.  The algorithm needs min(MAX_WORKSPACE_BYTES, 4 MiB) (split-K
 *    kernels on Hopper use workspace), so a matmul given less workspace than
 *    the preference allowed fails with CUBLAS_STATUS_INVALID_VALUE (the
 *    real status for "workspaceSizeInBytes is less than workspace required
 *    by configured algo").  The work scribbles over the ends of that
 *    workspace, so data kept in it, or a workspace shared by work on
 *    unordered streams (the runtime's stream-order check), shows up.
 *  - Type combinations (cuBLASLt's table for regular types): 16BF x 16BF ->
 *    16BF or 32F and 16F x 16F -> 16F or 32F with 32F compute, 32F with 32F
 *    compute or a FAST mode, 64F with 64F compute; scale type 32F / 64F to
 *    match.  16F and integer compute types are not simulated (refused).
 *  - Epilogues: BIAS adds bias[row] (length m) before RELU / GELU; GELU is
 *    the tanh approximation; GELU_AUX* also store the GELU input (ld
 *    EPILOGUE_AUX_LD: >= m and a multiple of 8, batch stride a multiple of
 *    8); DGELU multiplies by GELU'(aux); DGELU_BGRAD also stores the row sums
 *    of the result; BGRADA / BGRADB store the sums over k of op(A)'s rows /
 *    op(B)'s columns (unscaled) in the bias vector.  The bias vector is of
 *    D's type or, for 16-bit D, float (BIAS_DATA_TYPE); aux is of D's type.
 *    With 64F only DEFAULT, RELU, BIAS and RELU_BIAS are accepted (the GELU
 *    and gradient epilogues are tensor-core kernels' features).  Bias
 *    gradients of a batch need a BIAS_BATCH_STRIDE that keeps the batches'
 *    vectors apart.
 *  - Stricter than a GPU, which would silently race: D (and a GELU_AUX
 *    output) whose batches share elements is refused with
 *    CUBLAS_STATUS_INVALID_VALUE; C == D needs identical C and D layouts.
 *
 * GL_SIM_CUBLASLT_NO_ALGO=1 in the environment makes every heuristic query
 * answer "no algorithm" (status SUCCESS, count 0): it exercises the
 * callers' fallbacks (kernels/matmul.cu's GEMM kernel). */
#include "cublasLt.h"
#include "sim.h"
#include <cblas.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <cmath>
#include <mutex>
#include <unordered_map>
#include <vector>

/* ---- messages -------------------------------------------------------------- */
static thread_local char last_message[512];

extern "C" const char *gl_sim_cublaslt_last_message(void) { return last_message; }

/* Records and prints why a call was refused; returns st. */
static cublasStatus_t refuse(cublasStatus_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static cublasStatus_t refuse(cublasStatus_t st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_message, sizeof last_message, fmt, ap);
  va_end(ap);
  fprintf(stderr, "gptlua cuda-sim: %s\n", last_message);
  return st;
}

/* ---- names --------------------------------------------------------------- */
extern "C" const char *cublasLtGetStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "<unknown>";
}

extern "C" const char *cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
  }
  return "<unknown>";
}

static const char *type_name(int t) {
  switch (t) {
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_8I: return "CUDA_R_8I";
    case CUDA_R_32I: return "CUDA_R_32I";
    case CUDA_R_8U: return "CUDA_R_8U";
  }
  return "an unknown cudaDataType";
}

/* bytes per element of the floating types the simulator computes with; 0 otherwise */
static int type_size(int t) {
  switch (t) {
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    case CUDA_R_32F: return 4;
    case CUDA_R_64F: return 8;
  }
  return 0;
}

static const char *compute_name(int c) {
  switch (c) {
    case CUBLAS_COMPUTE_16F: return "CUBLAS_COMPUTE_16F";
    case CUBLAS_COMPUTE_16F_PEDANTIC: return "CUBLAS_COMPUTE_16F_PEDANTIC";
    case CUBLAS_COMPUTE_32F: return "CUBLAS_COMPUTE_32F";
    case CUBLAS_COMPUTE_32F_PEDANTIC: return "CUBLAS_COMPUTE_32F_PEDANTIC";
    case CUBLAS_COMPUTE_32F_FAST_16F: return "CUBLAS_COMPUTE_32F_FAST_16F";
    case CUBLAS_COMPUTE_32F_FAST_16BF: return "CUBLAS_COMPUTE_32F_FAST_16BF";
    case CUBLAS_COMPUTE_32F_FAST_TF32: return "CUBLAS_COMPUTE_32F_FAST_TF32";
    case CUBLAS_COMPUTE_64F: return "CUBLAS_COMPUTE_64F";
    case CUBLAS_COMPUTE_64F_PEDANTIC: return "CUBLAS_COMPUTE_64F_PEDANTIC";
    case CUBLAS_COMPUTE_32I: return "CUBLAS_COMPUTE_32I";
    case CUBLAS_COMPUTE_32I_PEDANTIC: return "CUBLAS_COMPUTE_32I_PEDANTIC";
  }
  return "an unknown cublasComputeType_t";
}

static const char *epilogue_name(uint32_t e) {
  switch (e) {
    case CUBLASLT_EPILOGUE_DEFAULT: return "CUBLASLT_EPILOGUE_DEFAULT";
    case CUBLASLT_EPILOGUE_RELU: return "CUBLASLT_EPILOGUE_RELU";
    case CUBLASLT_EPILOGUE_RELU_AUX: return "CUBLASLT_EPILOGUE_RELU_AUX";
    case CUBLASLT_EPILOGUE_BIAS: return "CUBLASLT_EPILOGUE_BIAS";
    case CUBLASLT_EPILOGUE_RELU_BIAS: return "CUBLASLT_EPILOGUE_RELU_BIAS";
    case CUBLASLT_EPILOGUE_RELU_AUX_BIAS: return "CUBLASLT_EPILOGUE_RELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DRELU: return "CUBLASLT_EPILOGUE_DRELU";
    case CUBLASLT_EPILOGUE_DRELU_BGRAD: return "CUBLASLT_EPILOGUE_DRELU_BGRAD";
    case CUBLASLT_EPILOGUE_GELU: return "CUBLASLT_EPILOGUE_GELU";
    case CUBLASLT_EPILOGUE_GELU_AUX: return "CUBLASLT_EPILOGUE_GELU_AUX";
    case CUBLASLT_EPILOGUE_GELU_BIAS: return "CUBLASLT_EPILOGUE_GELU_BIAS";
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS: return "CUBLASLT_EPILOGUE_GELU_AUX_BIAS";
    case CUBLASLT_EPILOGUE_DGELU: return "CUBLASLT_EPILOGUE_DGELU";
    case CUBLASLT_EPILOGUE_DGELU_BGRAD: return "CUBLASLT_EPILOGUE_DGELU_BGRAD";
    case CUBLASLT_EPILOGUE_BGRADA: return "CUBLASLT_EPILOGUE_BGRADA";
    case CUBLASLT_EPILOGUE_BGRADB: return "CUBLASLT_EPILOGUE_BGRADB";
  }
  return NULL;
}

/* ---- objects --------------------------------------------------------------- */
struct cublasLtContext {
  int unused;  /* a handle carries no state: the stream comes with each call */
};
struct gl_sim_lt_matmul_desc {
  int32_t compute, scale, pointer_mode, transa, transb, transc;
  uint32_t epilogue;
  const void *bias;
  int64_t bias_stride;
  void *aux;
  int64_t aux_ld, aux_stride;
  int32_t aux_type, bias_type;
};
struct gl_sim_lt_layout {
  uint32_t type;
  int32_t order;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch;
  int64_t stride;
};
struct gl_sim_lt_preference {
  uint64_t max_workspace;
  uint32_t align[4];  /* A, B, C, D */
};

/* Live objects by address, so that a NULL, destroyed or foreign pointer is
   reported instead of dereferenced. */
enum ObjKind { OBJ_HANDLE = 1, OBJ_DESC, OBJ_LAYOUT, OBJ_PREF };
static std::mutex registry_mu;
static std::unordered_map<const void *, int> registry;

static void reg_add(const void *p, int kind) {
  std::lock_guard<std::mutex> g(registry_mu);
  registry[p] = kind;
}
static bool reg_is(const void *p, int kind) {
  if (!p) return false;
  std::lock_guard<std::mutex> g(registry_mu);
  auto it = registry.find(p);
  return it != registry.end() && it->second == kind;
}
static bool reg_remove(const void *p, int kind) {
  std::lock_guard<std::mutex> g(registry_mu);
  auto it = registry.find(p);
  if (it == registry.end() || it->second != kind) return false;
  registry.erase(it);
  return true;
}

/* handles: NULL or unknown -> NOT_INITIALIZED, as the real library */
#define CHECK_HANDLE(fn, h)                                                                   \
  do {                                                                                        \
    if (!reg_is((h), OBJ_HANDLE))                                                             \
      return refuse(CUBLAS_STATUS_NOT_INITIALIZED, "%s: handle %p is not a live cublasLtHandle_t", fn, (const void *)(h)); \
  } while (0)
#define CHECK_OBJ(fn, what, p, kind)                                                          \
  do {                                                                                        \
    if (!reg_is((p), (kind)))                                                                 \
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s %p is not a live descriptor", fn, what, (const void *)(p)); \
  } while (0)

extern "C" cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle) {
  if (!handle) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtCreate: handle pointer is NULL");
  cublasLtContext *h = new cublasLtContext();
  reg_add(h, OBJ_HANDLE);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  if (!reg_remove(h, OBJ_HANDLE))
    return refuse(CUBLAS_STATUS_NOT_INITIALIZED, "cublasLtDestroy: handle %p is not a live cublasLtHandle_t",
                  (const void *)h);
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                                   cudaDataType_t scale) {
  if (!desc) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescCreate: descriptor pointer is NULL");
  gl_sim_lt_matmul_desc *d = new gl_sim_lt_matmul_desc();
  d->compute = compute;
  d->scale = scale;
  d->pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  d->transa = d->transb = d->transc = CUBLAS_OP_N;
  d->epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  d->aux_type = d->bias_type = -1;
  reg_add(d, OBJ_DESC);
  *desc = d;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  if (!d) return CUBLAS_STATUS_SUCCESS;
  if (!reg_remove(d, OBJ_DESC))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulDescDestroy: %p is not a live descriptor", (void *)d);
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType type,
                                                     uint64_t rows, uint64_t cols, int64_t ld) {
  if (!layout) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatrixLayoutCreate: layout pointer is NULL");
  gl_sim_lt_layout *l = new gl_sim_lt_layout();
  l->type = (uint32_t)type;
  l->order = CUBLASLT_ORDER_COL;
  l->rows = rows;
  l->cols = cols;
  l->ld = ld;
  l->batch = 1;
  l->stride = 0;
  reg_add(l, OBJ_LAYOUT);
  *layout = l;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  if (!l) return CUBLAS_STATUS_SUCCESS;
  if (!reg_remove(l, OBJ_LAYOUT))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatrixLayoutDestroy: %p is not a live layout", (void *)l);
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
  if (!pref) return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceCreate: pointer is NULL");
  gl_sim_lt_preference *p = new gl_sim_lt_preference();
  p->max_workspace = 0;
  for (int i = 0; i < 4; i++) p->align[i] = 256;
  reg_add(p, OBJ_PREF);
  *pref = p;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  if (!p) return CUBLAS_STATUS_SUCCESS;
  if (!reg_remove(p, OBJ_PREF))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "cublasLtMatmulPreferenceDestroy: %p is not a live preference",
                  (void *)p);
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

/* ---- attributes ------------------------------------------------------------ */
/* An attribute's storage in its object: name, address, size. */
struct Field {
  const char *name;
  void *p;
  size_t size;
};

static Field desc_field(gl_sim_lt_matmul_desc *d, int attr) {
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return {"CUBLASLT_MATMUL_DESC_COMPUTE_TYPE", &d->compute, 4};
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return {"CUBLASLT_MATMUL_DESC_SCALE_TYPE", &d->scale, 4};
    case CUBLASLT_MATMUL_DESC_POINTER_MODE: return {"CUBLASLT_MATMUL_DESC_POINTER_MODE", &d->pointer_mode, 4};
    case CUBLASLT_MATMUL_DESC_TRANSA: return {"CUBLASLT_MATMUL_DESC_TRANSA", &d->transa, 4};
    case CUBLASLT_MATMUL_DESC_TRANSB: return {"CUBLASLT_MATMUL_DESC_TRANSB", &d->transb, 4};
    case CUBLASLT_MATMUL_DESC_TRANSC: return {"CUBLASLT_MATMUL_DESC_TRANSC", &d->transc, 4};
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return {"CUBLASLT_MATMUL_DESC_EPILOGUE", &d->epilogue, 4};
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return {"CUBLASLT_MATMUL_DESC_BIAS_POINTER", &d->bias, sizeof(void *)};
    case CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE:
      return {"CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE", &d->bias_stride, 8};
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      return {"CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", &d->aux, sizeof(void *)};
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return {"CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD", &d->aux_ld, 8};
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE:
      return {"CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE", &d->aux_stride, 8};
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE:
      return {"CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE", &d->aux_type, 4};
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return {"CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", &d->bias_type, 4};
  }
  return {NULL, NULL, 0};
}

static Field layout_field(gl_sim_lt_layout *l, int attr) {
  switch (attr) {
    case CUBLASLT_MATRIX_LAYOUT_TYPE: return {"CUBLASLT_MATRIX_LAYOUT_TYPE", &l->type, 4};
    case CUBLASLT_MATRIX_LAYOUT_ORDER: return {"CUBLASLT_MATRIX_LAYOUT_ORDER", &l->order, 4};
    case CUBLASLT_MATRIX_LAYOUT_ROWS: return {"CUBLASLT_MATRIX_LAYOUT_ROWS", &l->rows, 8};
    case CUBLASLT_MATRIX_LAYOUT_COLS: return {"CUBLASLT_MATRIX_LAYOUT_COLS", &l->cols, 8};
    case CUBLASLT_MATRIX_LAYOUT_LD: return {"CUBLASLT_MATRIX_LAYOUT_LD", &l->ld, 8};
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: return {"CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT", &l->batch, 4};
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      return {"CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET", &l->stride, 8};
  }
  return {NULL, NULL, 0};
}

static Field pref_field(gl_sim_lt_preference *p, int attr) {
  switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return {"CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES", &p->max_workspace, 8};
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      return {"CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES", &p->align[0], 4};
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      return {"CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES", &p->align[1], 4};
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      return {"CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES", &p->align[2], 4};
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return {"CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES", &p->align[3], 4};
  }
  return {NULL, NULL, 0};
}

/* The real Set: buf non-NULL and sizeInBytes equal to the attribute's size,
   else CUBLAS_STATUS_INVALID_VALUE. */
static cublasStatus_t attr_set(const char *fn, int attr, Field f, const void *buf, size_t n) {
  if (!f.name) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: attribute %d is not simulated", fn, attr);
  if (!buf) return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: buf is NULL", fn, f.name);
  if (n != f.size)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: sizeInBytes %zu, expected %zu", fn, f.name, n, f.size);
  memcpy(f.p, buf, n);
  return CUBLAS_STATUS_SUCCESS;
}

/* The real Get: sizeInBytes 0 asks for the size (sizeWritten required);
   otherwise buf non-NULL and sizeInBytes equal to the attribute's size. */
static cublasStatus_t attr_get(const char *fn, int attr, Field f, void *buf, size_t n, size_t *written) {
  if (!f.name) return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: attribute %d is not simulated", fn, attr);
  if (n == 0) {
    if (!written) return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: sizeInBytes 0 and sizeWritten NULL", fn, f.name);
    *written = f.size;
    return CUBLAS_STATUS_SUCCESS;
  }
  if (!buf) return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: buf is NULL", fn, f.name);
  if (n != f.size)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: sizeInBytes %zu, expected %zu", fn, f.name, n, f.size);
  memcpy(buf, f.p, n);
  if (written) *written = f.size;
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                                         const void *buf, size_t n) {
  const char *fn = "cublasLtMatmulDescSetAttribute";
  CHECK_OBJ(fn, "matmulDesc", d, OBJ_DESC);
  Field f = desc_field(d, attr);
  if (f.name && buf && n == f.size &&
      (attr == CUBLASLT_MATMUL_DESC_TRANSA || attr == CUBLASLT_MATMUL_DESC_TRANSB ||
       attr == CUBLASLT_MATMUL_DESC_TRANSC)) {
    int32_t op;
    memcpy(&op, buf, 4);
    if (op < CUBLAS_OP_N || op > CUBLAS_OP_C)
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s: %d is not a cublasOperation_t (N, T or C)", fn, f.name, op);
  }
  return attr_set(fn, attr, f, buf, n);
}

extern "C" cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                                         void *buf, size_t n, size_t *written) {
  const char *fn = "cublasLtMatmulDescGetAttribute";
  CHECK_OBJ(fn, "matmulDesc", d, OBJ_DESC);
  return attr_get(fn, attr, desc_field(d, attr), buf, n, written);
}

extern "C" cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                           cublasLtMatrixLayoutAttribute_t attr, const void *buf,
                                                           size_t n) {
  const char *fn = "cublasLtMatrixLayoutSetAttribute";
  CHECK_OBJ(fn, "matLayout", l, OBJ_LAYOUT);
  return attr_set(fn, attr, layout_field(l, attr), buf, n);
}

extern "C" cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t l,
                                                           cublasLtMatrixLayoutAttribute_t attr, void *buf, size_t n,
                                                           size_t *written) {
  const char *fn = "cublasLtMatrixLayoutGetAttribute";
  CHECK_OBJ(fn, "matLayout", l, OBJ_LAYOUT);
  return attr_get(fn, attr, layout_field(l, attr), buf, n, written);
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                               cublasLtMatmulPreferenceAttributes_t attr,
                                                               const void *buf, size_t n) {
  const char *fn = "cublasLtMatmulPreferenceSetAttribute";
  CHECK_OBJ(fn, "pref", p, OBJ_PREF);
  return attr_set(fn, attr, pref_field(p, attr), buf, n);
}

extern "C" cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t p,
                                                               cublasLtMatmulPreferenceAttributes_t attr, void *buf,
                                                               size_t n, size_t *written) {
  const char *fn = "cublasLtMatmulPreferenceGetAttribute";
  CHECK_OBJ(fn, "pref", p, OBJ_PREF);
  return attr_get(fn, attr, pref_field(p, attr), buf, n, written);
}

/* ---- the problem ----------------------------------------------------------- */
enum { WORKSPACE_NEED = 4 << 20 };     /* what the simulated algorithm asks for, at most */
enum { MAX_VECTOR_ALIGN = 16 };        /* the widest load a kernel makes: 16 bytes */
enum { ROUND_NONE, ROUND_TF32, ROUND_BF16, ROUND_FP16 };  /* FAST modes' input rounding */

struct Mat {
  int type;
  int64_t rows, cols, ld, stride;
};

/* Everything a matmul needs, copied out of the descriptors. */
struct Problem {
  int compute, scale, f64, rounding;
  int ta, tb;
  int64_t m, n, k, batch;
  Mat a, b, c, d;
  uint32_t epilogue;
  /* what the epilogue does */
  int bias_in, relu, gelu, aux_out, dgelu, bgrad_rows, bgrada, bgradb;
  int bias_type, aux_type;
  int64_t bias_len, bias_stride, aux_ld, aux_stride;
  const void *bias;
  void *aux;
};

static int64_t lowest_pow2(uint64_t v, int64_t cap) {
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

/* Validates descriptor + layouts as the real library does (dimensions, lds,
   types, epilogue) and fills q.  Pointers and alignment are checked by the
   callers. */
static cublasStatus_t make_problem(const char *fn, const gl_sim_lt_matmul_desc *dsc, const gl_sim_lt_layout *A,
                                   const gl_sim_lt_layout *B, const gl_sim_lt_layout *C, const gl_sim_lt_layout *D,
                                   Problem *q) {
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
  if (at != bt || ct != dt)
    return refuse(CUBLAS_STATUS_NOT_SUPPORTED, "%s: A %s and B %s (C %s and D %s) must have one type", fn,
                  type_name(at), type_name(bt), type_name(ct), type_name(dt));
  switch (q->compute) {
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
/* What cublasLtMatmulAlgo_t carries in the simulator. */
struct SimAlgo {
  int atype, dtype, compute;
  uint32_t epilogue;
  uint32_t align[4];         /* bytes the A, B, C, D pointers must be aligned to */
  uint32_t bias_align, aux_align;
  uint64_t workspace;
};
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

static bool algo_unpack(const cublasLtMatmulAlgo_t *a, SimAlgo *s) {
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
static uint32_t matrix_align(uint64_t promise, const Mat &x, int64_t batch) {
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

/* ---- numbers: bit-level conversions ------------------------------------- */
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }
/* round to nearest even; NaN stays a (quiet) NaN */
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  /* inf, NaN */
  if (exp == 0) {  /* zero and subnormals: man * 2^-24, exact in float */
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}
/* drops `shift` low bits of v rounding to nearest even */
static inline uint32_t shift_rne(uint32_t v, int shift) {
  uint32_t kept = v >> shift, rest = v & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1))) kept++;
  return kept;
}
/* round to nearest even, overflow to infinity, subnormals kept */
static inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((u >> 13) & 0x3ff));  /* NaN */
  if (u >= 0x47800000u) return (uint16_t)(sign | 0x7c00);  /* >= 65536 and inf */
  int exp = (int)(u >> 23) - 127;
  uint32_t man = (u & 0x7fffffu) | 0x800000u;
  if (exp < -14) {  /* a half subnormal: units of 2^-24 */
    int shift = -1 - exp;  /* float value = man * 2^(exp - 23) */
    if (shift > 24) return (uint16_t)sign;
    return (uint16_t)(sign | shift_rne(man, shift));  /* may round up into the smallest normal */
  }
  /* normal: 13 fraction bits dropped; a carry moves into the exponent (and
     from 65520 up into infinity) */
  uint32_t h = ((uint32_t)(exp + 15) << 10) + (shift_rne(man, 13) - 0x400);
  return (uint16_t)(sign | h);
}

/* tf32: 10 fraction bits, nearest with ties away from zero (cvt.rna.tf32.f32) */
static inline float round_tf32(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;
  u = (u + 0x1000u) & 0xffffe000u;
  return bits_f32(u);
}

/* element i of a matrix of `type` as the compute type */
template <class T> static inline T load_elem(const char *p, int type, int64_t i) {
  switch (type) {
    case CUDA_R_32F: return (T)((const float *)p)[i];
    case CUDA_R_64F: return (T)((const double *)p)[i];
    case CUDA_R_16BF: return (T)bf16_to_f32(((const uint16_t *)p)[i]);
    case CUDA_R_16F: return (T)f16_to_f32(((const uint16_t *)p)[i]);
  }
  return (T)0;
}
/* stores v rounded once to `type` (from double only for 64F: no double rounding) */
template <class T> static inline void store_elem(char *p, int type, int64_t i, T v) {
  switch (type) {
    case CUDA_R_32F: ((float *)p)[i] = (float)v; break;
    case CUDA_R_64F: ((double *)p)[i] = (double)v; break;
    case CUDA_R_16BF: ((uint16_t *)p)[i] = f32_to_bf16((float)v); break;
    case CUDA_R_16F: ((uint16_t *)p)[i] = f32_to_f16((float)v); break;
  }
}

/* rows x cols (leading dimension ld) of device memory -> packed column-major host buffer */
template <class T> static void load_matrix(std::vector<T> &dst, const char *src, int type, int64_t rows, int64_t cols,
                                           int64_t ld, int rounding) {
  dst.resize((size_t)(rows * cols));
  for (int64_t j = 0; j < cols; j++)
    for (int64_t i = 0; i < rows; i++) dst[(size_t)(i + j * rows)] = load_elem<T>(src, type, i + j * ld);
  if (rounding == ROUND_NONE) return;
  for (T &v : dst) {
    float f = (float)v;
    if (rounding == ROUND_TF32) f = round_tf32(f);
    else if (rounding == ROUND_BF16) f = bf16_to_f32(f32_to_bf16(f));
    else f = f16_to_f32(f32_to_f16(f));
    v = (T)f;
  }
}

static void gemm(int ta, int tb, int m, int n, int k, float alpha, const float *A, int lda, const float *B, int ldb,
                 float beta, float *C, int ldc) {
  cblas_sgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A, lda, B,
              ldb, beta, C, ldc);
}
static void gemm(int ta, int tb, int m, int n, int k, double alpha, const double *A, int lda, const double *B, int ldb,
                 double beta, double *C, int ldc) {
  cblas_dgemm(CblasColMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, A, lda, B,
              ldb, beta, C, ldc);
}

/* GELU, tanh approximation, and its derivative */
template <class T> static inline T gelu(T x) {
  const T c = (T)0.7978845608028654, a = (T)0.044715;
  return (T)0.5 * x * ((T)1 + std::tanh(c * (x + a * x * x * x)));
}
template <class T> static inline T gelu_grad(T x) {
  const T c = (T)0.7978845608028654, a = (T)0.044715;
  T t = std::tanh(c * (x + a * x * x * x));
  return (T)0.5 * ((T)1 + t) + (T)0.5 * x * ((T)1 - t * t) * c * ((T)1 + (T)3 * a * x * x);
}

/* ---- the work -------------------------------------------------------------- */
struct Job {
  Problem q;
  SimAlgo algo;
  const char *A, *B, *C;
  char *D;
  double alpha, beta;
  char *workspace;
};

static int64_t mat_bytes(const Mat &x, int64_t batch) {
  if (x.rows == 0 || x.cols == 0) return 0;
  int64_t last = (batch - 1) * x.stride + (x.cols - 1) * x.ld + (x.rows - 1);
  return (last + 1) * type_size(x.type);
}

/* Whether [p, p + bytes) lies inside one live device allocation; records
   the sticky error a GPU would raise (the kernel's access faults) if not. */
static bool check_extent(const char *what, const void *p, int64_t bytes) {
  if (bytes <= 0) return true;
  void *base = NULL;
  size_t size = 0;
  int dev = 0;
  if (!gl_sim_find_alloc(p, &base, &size, &dev)) {
    gl_sim_fail(cudaErrorIllegalAddress, "cublasLtMatmul: %s at %p is not device memory", what, p);
    return false;
  }
  const char *end = (const char *)p + bytes, *alloc_end = (const char *)base + size;
  if (end > alloc_end) {
    gl_sim_fail(cudaErrorIllegalAddress,
                "cublasLtMatmul: %s at %p spans %lld bytes, %lld past the end of its %zu-byte allocation at %p", what,
                p, (long long)bytes, (long long)(end - alloc_end), size, base);
    return false;
  }
  return true;
}

template <class T> static void compute(const Job &j) {
  const Problem &q = j.q;
  const int64_t m = q.m, n = q.n, k = q.k;
  const int ea = type_size(q.a.type), eb = type_size(q.b.type), ec = type_size(q.c.type), ed = type_size(q.d.type);
  const int eaux = q.aux ? type_size(q.aux_type) : 0, ebias = q.bias ? type_size(q.bias_type) : 0;
  const T alpha = (T)j.alpha, beta = (T)j.beta;
  std::vector<T> a, b, acc, bias, aux;
  std::vector<T> grad;  /* bias gradients, accumulated in the compute type */
  for (int64_t bi = 0; bi < q.batch; bi++) {
    load_matrix(a, j.A + bi * q.a.stride * ea, q.a.type, q.a.rows, q.a.cols, q.a.ld, q.rounding);
    load_matrix(b, j.B + bi * q.b.stride * eb, q.b.type, q.b.rows, q.b.cols, q.b.ld, q.rounding);
    if (j.beta != 0) load_matrix(acc, j.C + bi * q.c.stride * ec, q.c.type, m, n, q.c.ld, ROUND_NONE);
    else acc.assign((size_t)(m * n), (T)0);
    if (k > 0)
      gemm(q.ta, q.tb, (int)m, (int)n, (int)k, alpha, a.data(), (int)std::max<int64_t>(1, q.a.rows), b.data(),
           (int)std::max<int64_t>(1, q.b.rows), beta, acc.data(), (int)std::max<int64_t>(1, m));
    else
      for (T &v : acc) v *= beta;

    const char *bias_p = q.bias ? (const char *)q.bias + bi * q.bias_stride * ebias : NULL;
    char *aux_p = q.aux ? (char *)q.aux + bi * q.aux_stride * eaux : NULL;
    if (q.bias_in) {
      bias.resize((size_t)m);
      for (int64_t i = 0; i < m; i++) bias[(size_t)i] = load_elem<T>(bias_p, q.bias_type, i);
    }
    if (q.dgelu) load_matrix(aux, aux_p, q.aux_type, m, n, q.aux_ld, ROUND_NONE);
    if (q.bgrad_rows) grad.assign((size_t)m, (T)0);
    for (int64_t c = 0; c < n; c++)
      for (int64_t r = 0; r < m; r++) {
        T x = acc[(size_t)(r + c * m)];
        if (q.bias_in) x += bias[(size_t)r];
        if (q.aux_out) store_elem<T>(aux_p, q.aux_type, r + c * q.aux_ld, x);
        if (q.relu) x = std::fmax(x, (T)0);
        if (q.gelu) x = gelu(x);
        if (q.dgelu) x *= gelu_grad(aux[(size_t)(r + c * m)]);
        if (q.bgrad_rows) grad[(size_t)r] += x;
        acc[(size_t)(r + c * m)] = x;
      }
    char *d = j.D + bi * q.d.stride * ed;
    for (int64_t c = 0; c < n; c++)
      for (int64_t r = 0; r < m; r++) store_elem<T>(d, q.d.type, r + c * q.d.ld, acc[(size_t)(r + c * m)]);

    /* bias gradients: sums over k of op(A)'s rows or op(B)'s columns */
    if (q.bgrada) {
      grad.assign((size_t)m, (T)0);
      for (int64_t r = 0; r < m; r++)
        for (int64_t kk = 0; kk < k; kk++) grad[(size_t)r] += q.ta ? a[(size_t)(kk + r * k)] : a[(size_t)(r + kk * m)];
    }
    if (q.bgradb) {
      grad.assign((size_t)n, (T)0);
      for (int64_t c = 0; c < n; c++)
        for (int64_t kk = 0; kk < k; kk++) grad[(size_t)c] += q.tb ? b[(size_t)(c + kk * n)] : b[(size_t)(kk + c * k)];
    }
    if (q.bgrad_rows || q.bgrada || q.bgradb)
      for (size_t i = 0; i < grad.size(); i++) store_elem<T>((char *)bias_p, q.bias_type, (int64_t)i, grad[i]);
  }
}

static void run_job(const Job &j) {
  const Problem &q = j.q;
  if (q.m == 0 || q.n == 0) return;
  if (!check_extent("A", j.A, mat_bytes(q.a, q.batch)) || !check_extent("B", j.B, mat_bytes(q.b, q.batch)) ||
      (j.beta != 0 && !check_extent("C", j.C, mat_bytes(q.c, q.batch))) ||
      !check_extent("D", j.D, mat_bytes(q.d, q.batch)))
    return;
  if (q.bias) {
    Mat v = {q.bias_type, q.bias_len, 1, q.bias_len, q.bias_stride};
    if (!check_extent("the bias vector", q.bias, mat_bytes(v, q.batch))) return;
    if ((uintptr_t)q.bias % j.algo.bias_align) {
      gl_sim_fail(cudaErrorMisalignedAddress,
                  "cublasLtMatmul: bias vector at %p is not %u-byte aligned as it was when the algorithm was chosen",
                  q.bias, j.algo.bias_align);
      return;
    }
  }
  if (q.aux) {
    Mat v = {q.aux_type, q.m, q.n, q.aux_ld, q.aux_stride};
    if (!check_extent("the epilogue aux matrix", q.aux, mat_bytes(v, q.batch))) return;
    if ((uintptr_t)q.aux % j.algo.aux_align) {
      gl_sim_fail(cudaErrorMisalignedAddress,
                  "cublasLtMatmul: aux matrix at %p is not %u-byte aligned as it was when the algorithm was chosen",
                  q.aux, j.algo.aux_align);
      return;
    }
  }
  if (j.algo.workspace > 0) {
    if (!check_extent("the workspace", j.workspace, (int64_t)j.algo.workspace)) return;
    /* the algorithm's scratch: its first and last 4 KiB are overwritten
       (not all of it: every page touched costs a fault in the runtime's
       access checks), enough for data kept there, or a workspace shared
       by unordered streams, to show */
    size_t ws = (size_t)j.algo.workspace, part = std::min<size_t>(ws, 4096);
    memset(j.workspace, 0xcb, part);
    memset(j.workspace + ws - part, 0xcb, part);
  }
  if (q.f64) compute<double>(j);
  else compute<float>(j);
}

static bool same_layout(const Mat &x, const Mat &y) {
  return x.type == y.type && x.rows == y.rows && x.cols == y.cols && x.ld == y.ld && x.stride == y.stride;
}

extern "C" cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void *alpha,
                                         const void *A, cublasLtMatrixLayout_t Adesc, const void *B,
                                         cublasLtMatrixLayout_t Bdesc, const void *beta, const void *C,
                                         cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
                                         const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspace_bytes,
                                         cudaStream_t stream) {
  const char *fn = "cublasLtMatmul";
  CHECK_HANDLE(fn, h);
  CHECK_OBJ(fn, "computeDesc", desc, OBJ_DESC);
  CHECK_OBJ(fn, "Adesc", Adesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Bdesc", Bdesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Cdesc", Cdesc, OBJ_LAYOUT);
  CHECK_OBJ(fn, "Ddesc", Ddesc, OBJ_LAYOUT);
  Job j;
  cublasStatus_t st = make_problem(fn, desc, Adesc, Bdesc, Cdesc, Ddesc, &j.q);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const Problem &q = j.q;
  if (!alpha || !beta) return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: alpha or beta is NULL", fn);
  /* host pointer mode: read now, as the real library does */
  if (q.f64) { j.alpha = *(const double *)alpha; j.beta = *(const double *)beta; }
  else { j.alpha = *(const float *)alpha; j.beta = *(const float *)beta; }
  bool empty = q.m == 0 || q.n == 0;
  if (!empty && (!A || !B || !D || (j.beta != 0 && !C)))
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: A %p, B %p, C %p, D %p: a matrix the product reads is NULL", fn, A,
                  B, C, (void *)D);
  if (C == D && C && !same_layout(q.c, q.d))
    return refuse(CUBLAS_STATUS_INVALID_VALUE,
                  "%s: C == D (in place) with different layouts (ld %lld vs %lld, batch stride %lld vs %lld)", fn,
                  (long long)q.c.ld, (long long)q.d.ld, (long long)q.c.stride, (long long)q.d.stride);
  if ((q.bias_in || q.bgrad_rows || q.bgrada || q.bgradb) && !q.bias && !empty)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s needs CUBLASLT_MATMUL_DESC_BIAS_POINTER", fn,
                  epilogue_name(q.epilogue));
  if ((q.aux_out || q.dgelu) && !q.aux && !empty)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s needs CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", fn,
                  epilogue_name(q.epilogue));

  /* the algorithm: the heuristic's, or (NULL) the one the library would pick
     for these pointers and this workspace */
  const Mat *ms[4] = {&q.a, &q.b, &q.c, &q.d};
  const void *ptrs[4] = {A, B, C, D};
  if (algo) {
    if (!algo_unpack(algo, &j.algo))
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: algo was not returned by cublasLtMatmulAlgoGetHeuristic", fn);
    if (j.algo.atype != q.a.type || j.algo.dtype != q.d.type || j.algo.compute != q.compute ||
        j.algo.epilogue != q.epilogue)
      return refuse(CUBLAS_STATUS_INVALID_VALUE,
                    "%s: algo was found for %s x %s -> %s with %s, called with %s x %s -> %s with %s", fn,
                    type_name(j.algo.atype), type_name(j.algo.atype), type_name(j.algo.dtype),
                    epilogue_name(j.algo.epilogue) ? epilogue_name(j.algo.epilogue) : "?", type_name(q.a.type),
                    type_name(q.b.type), type_name(q.d.type), epilogue_name(q.epilogue));
  } else {
    memset(&j.algo, 0, sizeof j.algo);
    for (int i = 0; i < 4; i++) j.algo.align[i] = matrix_align((uint64_t)(uintptr_t)ptrs[i], *ms[i], q.batch);
    j.algo.bias_align = (uint32_t)lowest_pow2((uint64_t)(uintptr_t)q.bias, MAX_VECTOR_ALIGN);
    j.algo.aux_align = (uint32_t)lowest_pow2((uint64_t)(uintptr_t)q.aux, MAX_VECTOR_ALIGN);
    j.algo.workspace = std::min<uint64_t>(workspace_bytes, WORKSPACE_NEED);
  }
  if (workspace_bytes < j.algo.workspace)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: workspaceSizeInBytes %zu, the algorithm needs %llu", fn,
                  workspace_bytes, (unsigned long long)j.algo.workspace);
  if (j.algo.workspace > 0 && !workspace)
    return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: workspace is NULL, the algorithm needs %llu bytes", fn,
                  (unsigned long long)j.algo.workspace);
  const char *names = "ABCD";
  for (int i = 0; i < 4; i++) {
    if (!ptrs[i] || j.algo.align[i] == 0) continue;
    if ((uintptr_t)ptrs[i] % j.algo.align[i])
      return refuse(CUBLAS_STATUS_NOT_SUPPORTED,
                    "%s: %c at %p is not %u-byte aligned, the alignment its algorithm was chosen for "
                    "(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_%c_BYTES)",
                    fn, names[i], ptrs[i], j.algo.align[i], names[i]);
  }
  /* a context with a sticky error runs nothing more */
  if (gl_sim_sticky() != cudaSuccess)
    return refuse(CUBLAS_STATUS_EXECUTION_FAILED, "%s: the device context has a sticky error (%d)", fn,
                  (int)gl_sim_sticky());
  j.A = (const char *)A;
  j.B = (const char *)B;
  j.C = (const char *)C;
  j.D = (char *)D;
  j.workspace = (char *)workspace;
  gl_sim_submit(stream, "cublasLtMatmul", [j] { run_job(j); });
  return CUBLAS_STATUS_SUCCESS;
}
