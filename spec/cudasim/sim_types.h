/* sim_types.h — the CUDA runtime's plain types and constants as the
 * simulator defines them (numeric values are the real runtime's, so a
 * status printed by the simulator means what it means on a GPU).
 *
 * Part of the CUDA simulator (spec/cudasim/): the kernels (kernels/NAME.cu) compile unchanged
 * with the host C++ compiler against these headers instead of the toolkit's
 * and run on the CPU.  Shared by every other header here. */
#ifndef GL_SIM_TYPES_H
#define GL_SIM_TYPES_H
#include <stddef.h>
#include <stdint.h>

#define GL_SIM 1

/* ---- status codes ------------------------------------------------------- */
typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidPitchValue = 12,
  cudaErrorInvalidSymbol = 13,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidKernelImage = 200,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchTimeout = 702,
  cudaErrorAssert = 710,
  cudaErrorIllegalInstruction = 715,
  cudaErrorMisalignedAddress = 716,
  cudaErrorLaunchFailure = 719,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureMerge = 902,
  cudaErrorStreamCaptureUnmatched = 903,
  cudaErrorStreamCaptureUnjoined = 904,
  cudaErrorStreamCaptureIsolation = 905,
  cudaErrorStreamCaptureImplicit = 906,
  cudaErrorCapturedEvent = 907,
  cudaErrorStreamCaptureWrongThread = 908,
  cudaErrorUnknown = 999
} cudaError_t;

/* ---- launch geometry and vector types ---------------------------------- */
struct dim3 {
  unsigned int x, y, z;
#ifdef __cplusplus
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
#endif
};
typedef struct dim3 dim3;
typedef struct uint3 { unsigned int x, y, z; } uint3;

typedef struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; } uint4;
typedef struct __attribute__((aligned(16))) int4 { int x, y, z, w; } int4;
typedef struct __attribute__((aligned(16))) float4 { float x, y, z, w; } float4;
typedef struct __attribute__((aligned(8))) float2 { float x, y; } float2;
typedef struct __attribute__((aligned(8))) uint2 { unsigned int x, y; } uint2;
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  uint4 v = {x, y, z, w};
  return v;
}
static inline int4 make_int4(int x, int y, int z, int w) { int4 v = {x, y, z, w}; return v; }
static inline float4 make_float4(float x, float y, float z, float w) { float4 v = {x, y, z, w}; return v; }
static inline float2 make_float2(float x, float y) { float2 v = {x, y}; return v; }
static inline uint2 make_uint2(unsigned int x, unsigned int y) { uint2 v = {x, y}; return v; }

/* ---- library data types (library_types.h) ------------------------------- */
typedef enum cudaDataType_t {
  CUDA_R_16F = 2, CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16BF = 14,
  CUDA_R_8I = 3, CUDA_R_32I = 10, CUDA_R_8U = 8,
  CUDA_R_8F_E4M3 = 28, CUDA_R_8F_E5M2 = 29
} cudaDataType_t, cudaDataType;

/* ---- handles ----------------------------------------------------------- */
typedef struct CUstream_st *cudaStream_t;  /* NULL: the legacy default stream */
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraph_st *cudaGraph_t;          /* a captured graph (runtime_graphs.cpp) */
typedef struct CUgraphExec_st *cudaGraphExec_t;  /* an instantiated graph */
typedef struct CUgraphNode_st *cudaGraphNode_t;  /* one node of a graph */

/* ---- flags and enums --------------------------------------------------- */
enum { cudaStreamDefault = 0, cudaStreamNonBlocking = 1 };
enum { cudaEventDefault = 0, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2 };
enum { cudaHostAllocDefault = 0, cudaHostAllocPortable = 1, cudaHostAllocMapped = 2 };
/* stream capture (CUDA graphs) */
typedef enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1, cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;
typedef enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1, cudaStreamCaptureStatusInvalidated = 2
} cudaStreamCaptureStatus;
typedef enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0, cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3, cudaMemcpyDefault = 4
} cudaMemcpyKind;
typedef enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxBlockDimX = 2, cudaDevAttrMaxBlockDimY = 3, cudaDevAttrMaxBlockDimZ = 4,
  cudaDevAttrMaxGridDimX = 5, cudaDevAttrMaxGridDimY = 6, cudaDevAttrMaxGridDimZ = 7,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrClockRate = 13,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMemoryClockRate = 36,
  cudaDevAttrGlobalMemoryBusWidth = 37,
  cudaDevAttrL2CacheSize = 38,
  cudaDevAttrComputeCapabilityMajor = 75, cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97
} cudaDeviceAttr;
typedef enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9
} cudaFuncAttribute;

/* the fields of cudaDeviceProp the engine reads */
typedef struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem;
  size_t sharedMemPerBlock;
  int regsPerBlock;
  int warpSize;
  int maxThreadsPerBlock;
  int maxThreadsDim[3];
  int maxGridSize[3];
  int major, minor;
  int multiProcessorCount;
  int memoryBusWidth;
  int l2CacheSize;
  size_t sharedMemPerBlockOptin;
  size_t sharedMemPerMultiprocessor;
} cudaDeviceProp;

/* ---- the simulated device: an H100 SXM's limits ------------------------ */
enum {
  GL_SIM_MAX_THREADS_PER_BLOCK = 1024,
  GL_SIM_MAX_BLOCK_Z = 64,
  GL_SIM_MAX_GRID_Y = 65535, GL_SIM_MAX_GRID_Z = 65535,
  GL_SIM_SMEM_DEFAULT = 48 * 1024,      /* dynamic + static without opting in */
  GL_SIM_SMEM_OPTIN = 227 * 1024,       /* most a block may opt into */
  GL_SIM_SM_COUNT = 132,
  GL_SIM_WARP = 32
};
#define GL_SIM_MAX_GRID_X 2147483647u

#endif
