/* cublaslt.cpp — cuBLASLt for the CUDA simulator, over OpenBLAS: how it maps
 * onto the real library, and its objects.
 *
 * Part of the CUDA simulator (spec/cudasim/, seams in sim.h).  Implements the
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
 *    FP8 (cublaslt_heuristic.cpp's fp8_problem): E4M3 / E5M2 A and B (not
 *    both E5M2), 32F compute, the TN problem only, k and the A / B lds
 *    multiples of 16, C = D of 16BF, 16F or 32F, no epilogue; the A and B
 *    scale pointers (device floats, read in the work) multiply alpha.
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
 * callers' fallbacks (kernels/matmul.cu's GEMM kernel).
 *
 * The implementation is three files (their shared declarations in
 * cublaslt_internal.h): this one, the objects (handles, descriptors,
 * layouts, preferences, their attributes) and names and refusals;
 * cublaslt_heuristic.cpp, the validation and the heuristic;
 * cublaslt_matmul.cpp, cublasLtMatmul and its numerics. */
#include "cublaslt_internal.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <mutex>
#include <unordered_map>

using namespace gl_sim_lt;

/* ---- messages -------------------------------------------------------------- */
static thread_local char last_message[512];

extern "C" const char *gl_sim_cublaslt_last_message(void) { return last_message; }

/* Records and prints why a call was refused; returns st. */
cublasStatus_t gl_sim_lt::refuse(cublasStatus_t st, const char *fmt, ...) {
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

const char *gl_sim_lt::type_name(int t) {
  switch (t) {
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_64F: return "CUDA_R_64F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_8I: return "CUDA_R_8I";
    case CUDA_R_32I: return "CUDA_R_32I";
    case CUDA_R_8U: return "CUDA_R_8U";
    case CUDA_R_8F_E4M3: return "CUDA_R_8F_E4M3";
    case CUDA_R_8F_E5M2: return "CUDA_R_8F_E5M2";
  }
  return "an unknown cudaDataType";
}

/* bytes per element of the floating types the simulator computes with; 0 otherwise */
int gl_sim_lt::type_size(int t) {
  switch (t) {
    case CUDA_R_8F_E4M3: case CUDA_R_8F_E5M2: return 1;
    case CUDA_R_16F: case CUDA_R_16BF: return 2;
    case CUDA_R_32F: return 4;
    case CUDA_R_64F: return 8;
  }
  return 0;
}

const char *gl_sim_lt::compute_name(int c) {
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

const char *gl_sim_lt::epilogue_name(uint32_t e) {
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
/* The structs, ObjKind and the CHECK_ macros are in cublaslt_internal.h:
   the heuristic and the matmul read the objects and check their arguments too.
   The registry of live objects, by address: */
static std::mutex registry_mu;
static std::unordered_map<const void *, int> registry;

static void reg_add(const void *p, int kind) {
  std::lock_guard<std::mutex> g(registry_mu);
  registry[p] = kind;
}
bool gl_sim_lt::reg_is(const void *p, int kind) {
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
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return {"CUBLASLT_MATMUL_DESC_A_SCALE_POINTER", &d->a_scale, sizeof(void *)};
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return {"CUBLASLT_MATMUL_DESC_B_SCALE_POINTER", &d->b_scale, sizeof(void *)};
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
