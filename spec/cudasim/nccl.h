/* nccl.h — the CUDA simulator's stand-in for NCCL's header (the sim build
 * puts spec/cudasim/ first on the include path).  C-compatible: the engine's
 * NCCL backend (engine/mpi/nccl.c) is C.  Names, numeric values and
 * signatures are NCCL 2.18's, for the subset gptlua uses; spec/cudasim/
 * nccl_comm.cpp and nccl_ops.cpp implement them over MPI between the processes of an MPI job,
 * one simulated GPU per process.
 *
 * The contract, as NCCL's, with what the simulator adds:
 *  - ncclGetUniqueId needs MPI initialised (the id names this process's
 *    MPI_COMM_WORLD rank); the process that made an id must itself call
 *    ncclCommInitRank with it (it collects the members' reports).
 *  - ncclCommInitRank is collective over the nranks members only.  Every
 *    rank gets the same verdict: ranks that disagree on nranks, two ranks
 *    with one rank number, or two ranks on one GPU (same host, same device
 *    index: set GL_SIM_DEVICES so that each rank of a node has its own, as
 *    on real hardware) fail with ncclInvalidUsage.  The communicator is
 *    bound to the current device (cudaGetDevice).
 *  - Collectives and send/recv are stream work: nothing happens at the call
 *    but argument checks; the data moves when the stream reaches the work.
 *    Every buffer must be device memory of the communicator's device, lying
 *    inside one allocation (checked: ncclInvalidArgument).  Send and receive
 *    ranges that overlap are refused unless they are NCCL's in-place layout
 *    (recvbuff == sendbuff; for ncclAllGather sendbuff == recvbuff +
 *    rank * sendcount; for ncclReduceScatter recvbuff == sendbuff + rank *
 *    recvcount): on a GPU anything else is a race.
 *  - Reductions: float32 / float64 and the integer types in their own type;
 *    float16 / bfloat16 in float, rounded once to the type (round to nearest
 *    even).  ncclAvg is the sum times 1/nranks (floats; gptlua's MPI
 *    backend does the same) or the sum divided by nranks (integers,
 *    truncating); NCCL itself pre-multiplies each input by 1/nranks, which
 *    can differ from this in the last bit.
 *  - ncclGroupStart/End (nestable, per host thread): the operations of a
 *    group start together at the outermost ncclGroupEnd, so grouped
 *    send/recv pairs and grouped collectives never deadlock.  An argument
 *    error inside a group is returned at the call and again by
 *    ncclGroupEnd, which then starts nothing.
 *  - Operations on one communicator run in call order even when given
 *    different streams (each waits for the previous one), as in NCCL.
 *  - A receive whose matching send has a different size stops the
 *    simulated context (sticky CUDA error) with a message naming both
 *    sides; on a GPU it would hang or corrupt memory.
 *  - GL_SIM_STREAMS=sync (default): the stream work runs inside the call,
 *    so a collective returns once every member has joined it.  A member
 *    that never joins is reported after GL_SIM_NCCL_TIMEOUT seconds
 *    (default 600) as a sticky error.  GL_SIM_STREAMS=threads: the work
 *    runs on the stream's thread, truly asynchronous; it calls MPI from that
 *    thread, so MPI must provide MPI_THREAD_MULTIPLE (ncclCommInitRank
 *    refuses otherwise; gptlua.dist requests it in sim builds).
 *  - ncclCommAbort never waits for peers; ncclCommDestroy releases the
 *    communicator once its queued work has run. */
#ifndef GL_SIM_NCCL_H
#define GL_SIM_NCCL_H
#include <stddef.h>
#include "sim_types.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 18
#define NCCL_PATCH 3
#define NCCL_SUFFIX ""
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm *ncclComm_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
  ncclInt8 = 0, ncclChar = 0,
  ncclUint8 = 1,
  ncclInt32 = 2, ncclInt = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6, ncclHalf = 6,
  ncclFloat32 = 7, ncclFloat = 7,
  ncclFloat64 = 8, ncclDouble = 8,
  ncclBfloat16 = 9,
  ncclNumTypes = 10
} ncclDataType_t;

typedef enum {
  ncclSum = 0,
  ncclProd = 1,
  ncclMax = 2,
  ncclMin = 3,
  ncclAvg = 4,
  ncclNumOps = 5,
  ncclMaxRedOp = 0x7fffffff
} ncclRedOp_t;

/* ncclCommSplit's color for a rank that joins no new communicator */
#define NCCL_SPLIT_NOCOLOR -1

/* Communicator options (ncclCommSplit's config; NULL: the defaults).  The
   simulator checks size / magic / version and otherwise ignores the fields:
   they tune performance (CTAs, network), and a nonblocking communicator may
   return ncclSuccess from every call, which is what the simulator does. */
#define NCCL_CONFIG_UNDEF_INT (-2147483647 - 1)
#define NCCL_CONFIG_UNDEF_PTR NULL
typedef struct ncclConfig_v21700 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER                                                              \
  { sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),      \
    NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,                     \
    NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR, NCCL_CONFIG_UNDEF_INT }

/* ---- versions and errors ------------------------------------------------ */
ncclResult_t ncclGetVersion(int *version);
const char *ncclGetErrorString(ncclResult_t result);
/* the detail of the calling thread's last failed call ("" if none); comm
   is unused, as in NCCL */
const char *ncclGetLastError(ncclComm_t comm);

/* ---- communicators -------------------------------------------------------- */
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
/* ncclSuccess, or the error an operation of comm met while running on its
   stream (a failed transfer, a size mismatch, an abort) */
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);

/* ---- groups --------------------------------------------------------------- */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

/* ---- collectives and point-to-point (counts in elements) ---------------- */
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
/* sendbuff: nranks * recvcount elements; rank r receives block r reduced */
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
/* recvbuff: nranks * sendcount elements, rank r's block at r * sendcount */
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream);
/* sendbuff is read on root only */
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream);
/* recvbuff is written on root only */
ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);
ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
