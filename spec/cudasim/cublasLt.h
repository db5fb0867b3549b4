/* cublasLt.h — the cuBLASLt API as the CUDA simulator provides it: the
 * subset of the real library the engine calls (kernels/matmul.cu) and will
 * call (fused epilogues), implemented over OpenBLAS in cublaslt*.cpp.
 *
 * Part of the CUDA simulator (spec/cudasim/): the sim build puts spec/cudasim/
 * first on the include path, so the kernels/ .cu files compile unchanged against this
 * header instead of the toolkit's.  Names, signatures and NUMERIC VALUES are
 * the real library's (CUDA 12/13 cublas_api.h and cublasLt.h), so a status
 * printed by the simulator means what it means on a GPU.  C-compatible.
 *
 * What is simulated (each choice and its reason: cublaslt.cpp's header comment):
 *  - handles and descriptors (matmul desc, matrix layouts, preferences) with
 *    the real Get/Set attribute size checks;
 *  - cublasLtMatmulAlgoGetHeuristic validating dimensions, leading
 *    dimensions, type combinations, epilogues and alignment promises, and
 *    answering with one algorithm;
 *  - cublasLtMatmul: D = epilogue(alpha op(A) op(B) + beta C) as stream work,
 *    fp32 through cblas_sgemm, fp64 through cblas_dgemm, bf16 / fp16 widened
 *    exactly to fp32 and the result rounded once (round to nearest even).
 * Attributes and values outside that subset are refused with
 * CUBLAS_STATUS_NOT_SUPPORTED and a message naming them, never ignored. */
#ifndef GL_SIM_CUBLASLT_H
#define GL_SIM_CUBLASLT_H
#include <stddef.h>
#include <stdint.h>
#include "sim_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- cublas_api.h: status, operations, compute types ------------------- */
typedef enum {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
  CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;

typedef enum {
  CUBLAS_OP_N = 0,
  CUBLAS_OP_T = 1,
  CUBLAS_OP_C = 2,  /* on real data the same as CUBLAS_OP_T */
  CUBLAS_OP_HERMITAN = 2,
  CUBLAS_OP_CONJG = 3
} cublasOperation_t;

typedef enum {
  CUBLAS_POINTER_MODE_HOST = 0,
  CUBLAS_POINTER_MODE_DEVICE = 1
} cublasPointerMode_t;

/* Simulated: 32F (and _PEDANTIC), the three 32F_FAST modes (inputs rounded
   to fp16 / bf16 / tf32 first, the least precision the real library may
   use), 64F (and _PEDANTIC).  The others are refused. */
typedef enum {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73
} cublasComputeType_t;

/* ---- handles and descriptors (opaque; defined in cublaslt_internal.h) -- */
typedef struct cublasLtContext *cublasLtHandle_t;
typedef struct gl_sim_lt_matmul_desc cublasLtMatmulDescOpaque_t;
typedef cublasLtMatmulDescOpaque_t *cublasLtMatmulDesc_t;
typedef struct gl_sim_lt_layout cublasLtMatrixLayoutOpaque_t;
typedef cublasLtMatrixLayoutOpaque_t *cublasLtMatrixLayout_t;
typedef struct gl_sim_lt_preference cublasLtMatmulPreferenceOpaque_t;
typedef cublasLtMatmulPreferenceOpaque_t *cublasLtMatmulPreference_t;

/* Semi-opaque, copied by value as on the real library (what the simulator
   keeps in it: cublaslt_internal.h, struct SimAlgo). */
typedef struct {
  uint64_t data[8];
} cublasLtMatmulAlgo_t;

/* ---- enums ---------------------------------------------------------------- */
typedef enum {
  CUBLASLT_POINTER_MODE_HOST = CUBLAS_POINTER_MODE_HOST,
  CUBLASLT_POINTER_MODE_DEVICE = CUBLAS_POINTER_MODE_DEVICE,
  CUBLASLT_POINTER_MODE_DEVICE_VECTOR = 2,
  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO = 3,
  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST = 4
} cublasLtPointerMode_t;

/* only CUBLASLT_ORDER_COL is simulated */
typedef enum {
  CUBLASLT_ORDER_COL = 0,
  CUBLASLT_ORDER_ROW = 1,
  CUBLASLT_ORDER_COL32 = 2,
  CUBLASLT_ORDER_COL4_4R2_8C = 3,
  CUBLASLT_ORDER_COL32_2R_4R4 = 4
} cublasLtOrder_t;

/* The attributes the simulator implements, with the real values (the value
   type in the comment: Get/Set sizeInBytes must equal its size).  Any other
   attribute value is refused by Get/Set with CUBLAS_STATUS_NOT_SUPPORTED. */
typedef enum {
  CUBLASLT_MATRIX_LAYOUT_TYPE = 0,                  /* uint32_t, cudaDataType */
  CUBLASLT_MATRIX_LAYOUT_ORDER = 1,                 /* int32_t, default CUBLASLT_ORDER_COL */
  CUBLASLT_MATRIX_LAYOUT_ROWS = 2,                  /* uint64_t */
  CUBLASLT_MATRIX_LAYOUT_COLS = 3,                  /* uint64_t */
  CUBLASLT_MATRIX_LAYOUT_LD = 4,                    /* int64_t */
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,           /* int32_t, default 1 */
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6   /* int64_t elements, default 0 */
} cublasLtMatrixLayoutAttribute_t;

typedef enum {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,               /* int32_t */
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,                 /* int32_t, cudaDataType */
  CUBLASLT_MATMUL_DESC_POINTER_MODE = 2,               /* int32_t, only HOST simulated */
  CUBLASLT_MATMUL_DESC_TRANSA = 3,                     /* int32_t, cublasOperation_t */
  CUBLASLT_MATMUL_DESC_TRANSB = 4,                     /* int32_t */
  CUBLASLT_MATMUL_DESC_TRANSC = 5,                     /* int32_t, only CUBLAS_OP_N */
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,                   /* uint32_t, cublasLtEpilogue_t */
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,               /* void * */
  CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10,         /* int64_t elements */
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,      /* void * */
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,           /* int64_t */
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13, /* int64_t */
  CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,          /* const float * on the device, FP8 A only */
  CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,          /* const float * on the device, FP8 B only */
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22,    /* int32_t, default -1: D's type */
  CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26             /* int32_t, default -1: D's type */
} cublasLtMatmulDescAttributes_t;

/* Epilogues.  Simulated: DEFAULT, RELU, BIAS, RELU_BIAS, GELU, GELU_AUX,
   GELU_BIAS, GELU_AUX_BIAS, DGELU, DGELU_BGRAD, BGRADA, BGRADB; the ReLU
   bit-mask forms are refused. */
typedef enum {
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_RELU = 2,
  CUBLASLT_EPILOGUE_RELU_AUX = (CUBLASLT_EPILOGUE_RELU | 128),
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_RELU_BIAS = (CUBLASLT_EPILOGUE_RELU | CUBLASLT_EPILOGUE_BIAS),
  CUBLASLT_EPILOGUE_RELU_AUX_BIAS = (CUBLASLT_EPILOGUE_RELU_AUX | CUBLASLT_EPILOGUE_BIAS),
  CUBLASLT_EPILOGUE_DRELU = 8 | 128,
  CUBLASLT_EPILOGUE_DRELU_BGRAD = CUBLASLT_EPILOGUE_DRELU | 16,
  CUBLASLT_EPILOGUE_GELU = 32,
  CUBLASLT_EPILOGUE_GELU_AUX = (CUBLASLT_EPILOGUE_GELU | 128),
  CUBLASLT_EPILOGUE_GELU_BIAS = (CUBLASLT_EPILOGUE_GELU | CUBLASLT_EPILOGUE_BIAS),
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = (CUBLASLT_EPILOGUE_GELU_AUX | CUBLASLT_EPILOGUE_BIAS),
  CUBLASLT_EPILOGUE_DGELU = 64 | 128,
  CUBLASLT_EPILOGUE_DGELU_BGRAD = CUBLASLT_EPILOGUE_DGELU | 16,
  CUBLASLT_EPILOGUE_BGRADA = 256,
  CUBLASLT_EPILOGUE_BGRADB = 512
} cublasLtEpilogue_t;

typedef enum {
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,    /* uint64_t, default 0 */
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,  /* uint32_t, default 256 */
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,  /* uint32_t, default 256 */
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,  /* uint32_t, default 256 */
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8   /* uint32_t, default 256 */
} cublasLtMatmulPreferenceAttributes_t;

typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;   /* workspace the algorithm needs */
  cublasStatus_t state;
  float wavesCount;       /* output tiles / (SMs): an estimate in the simulator */
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;

/* ---- functions ------------------------------------------------------------ */
cublasStatus_t cublasLtCreate(cublasLtHandle_t *lightHandle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle);
const char *cublasLtGetStatusName(cublasStatus_t status);
const char *cublasLtGetStatusString(cublasStatus_t status);

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t sizeInBytes);
cublasStatus_t cublasLtMatmulDescGetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              void *buf, size_t sizeInBytes, size_t *sizeWritten);

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout);
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t matLayout,
                                                cublasLtMatrixLayoutAttribute_t attr, const void *buf,
                                                size_t sizeInBytes);
cublasStatus_t cublasLtMatrixLayoutGetAttribute(cublasLtMatrixLayout_t matLayout,
                                                cublasLtMatrixLayoutAttribute_t attr, void *buf,
                                                size_t sizeInBytes, size_t *sizeWritten);

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t sizeInBytes);
cublasStatus_t cublasLtMatmulPreferenceGetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, void *buf,
                                                    size_t sizeInBytes, size_t *sizeWritten);

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int *returnAlgoCount);

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t Adesc, const void *B,
                              cublasLtMatrixLayout_t Bdesc, const void *beta, const void *C,
                              cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspaceSizeInBytes,
                              cudaStream_t stream);

/* ---- simulator additions (not in the real library) ---------------------- */
/* The detail of the calling thread's last refused cuBLASLt call (the same
   line the simulator printed to stderr, without the "gptlua cuda-sim: "
   prefix), "" if none yet: for specs that check why a call was refused. */
const char *gl_sim_cublaslt_last_message(void);

#ifdef __cplusplus
}
#endif

#endif
