/* runtime_api.h — the CUDA runtime API (the cuda* host functions) as the
 * simulator provides it, implemented in runtime.cpp, runtime_memory.cpp and runtime_streams.cpp.
 *
 * Part of the CUDA simulator (spec/cudasim/): the kernels' .cu files and the engine's C
 * sources compile against these headers instead of the toolkit's and run on
 * the CPU.  C-compatible, because engine/mpi/nccl.c is C and includes
 * <cuda_runtime.h>.  Every function the project calls is declared here with
 * the real runtime's signature and semantics; the simulator's additions
 * (device heap with guard pages, host access and stream-order checks) are
 * described in sim.h and runtime.cpp (which lists its sibling files). */
#ifndef GL_SIM_RUNTIME_API_H
#define GL_SIM_RUNTIME_API_H
#include "sim_types.h"

/* cudaPointerGetAttributes (memory kinds as the real runtime numbers them) */
enum cudaMemoryType {
  cudaMemoryTypeUnregistered = 0, cudaMemoryTypeHost = 1, cudaMemoryTypeDevice = 2, cudaMemoryTypeManaged = 3
};
struct cudaPointerAttributes {
  enum cudaMemoryType type;
  int device;
  void *devicePointer;
  void *hostPointer;
};
/* the host-allocation flag the real runtime also accepts */
enum { cudaHostAllocWriteCombined = 4 };
/* cudaStreamWaitEvent's only flag value */
enum { cudaEventWaitDefault = 0 };

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ------------------------------------------------------------- */
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);

/* ---- devices -------------------------------------------------------------- */
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value);

/* ---- memory ------------------------------------------------------------- */
cudaError_t cudaMalloc(void **dev_ptr, size_t size);
cudaError_t cudaFree(void *dev_ptr);
cudaError_t cudaHostAlloc(void **host_ptr, size_t size, unsigned int flags);
cudaError_t cudaMallocHost(void **host_ptr, size_t size);
cudaError_t cudaFreeHost(void *host_ptr);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemcpyPeer(void *dst, int dst_device, const void *src, int src_device, size_t count);
cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_device, const void *src, int src_device, size_t count,
                                cudaStream_t stream);
cudaError_t cudaMemset(void *dev_ptr, int value, size_t count);
cudaError_t cudaMemsetAsync(void *dev_ptr, int value, size_t count, cudaStream_t stream);

/* ---- streams ------------------------------------------------------------ */
cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamGetFlags(cudaStream_t stream, unsigned int *flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);

/* ---- events ------------------------------------------------------------- */
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t event);

/* ---- graphs (runtime_graphs.cpp) ----------------------------------------
   Stream capture records the work queued on a stream (and on streams that
   join it through events) into a graph instead of running it; a launch of
   the instantiated graph queues the recorded work, with its recorded
   arguments, on one stream.  Calls that would make the host wait for a
   capturing stream, or use memory that cannot be captured, fail with the
   real runtime's codes and invalidate the capture (runtime_graphs.cpp). */
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status);
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode);
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *num_nodes);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

#ifdef __cplusplus
}

/* The C++ conveniences of the real cuda_runtime.h: typed pointers for the
   allocators, a kernel (function) pointer for cudaFuncSetAttribute, and
   cudaEventCreate with flags. */
template <class T> static inline cudaError_t cudaMalloc(T **dev_ptr, size_t size) {
  return cudaMalloc((void **)dev_ptr, size);
}
template <class T> static inline cudaError_t cudaMallocHost(T **host_ptr, size_t size) {
  return cudaMallocHost((void **)host_ptr, size);
}
static inline cudaError_t cudaMallocHost(void **host_ptr, size_t size, unsigned int flags) {
  return cudaHostAlloc(host_ptr, size, flags);
}
template <class T> static inline cudaError_t cudaHostAlloc(T **host_ptr, size_t size, unsigned int flags) {
  return cudaHostAlloc((void **)host_ptr, size, flags);
}
template <class T> static inline cudaError_t cudaFuncSetAttribute(T *entry, enum cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute((const void *)entry, attr, value);
}
static inline cudaError_t cudaEventCreate(cudaEvent_t *event, unsigned int flags) {
  return cudaEventCreateWithFlags(event, flags);
}
#endif

#endif
