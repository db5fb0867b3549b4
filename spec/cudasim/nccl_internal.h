/* nccl_internal.h — what the two halves of the simulator's NCCL share
 * (private to spec/cudasim/nccl*.cpp; C++ only).
 *
 * NCCL in the CUDA simulator: the API of spec/cudasim/nccl.h implemented
 * over MPI between the processes of an MPI job, each process one simulated
 * GPU.  Linked into build/sim/libgptlua_mpi.so beside the engine's NCCL
 * backend (engine/mpi/nccl.c), which it serves unchanged.  Two files:
 *
 *   nccl_comm.cpp  communicators: the unique id, the init handshake, split,
 *                  destroy / abort, the queries, and the error reporting
 *                  (fail, ncclGetLastError) and configuration below
 *   nccl_ops.cpp   operations and groups: argument checks, staging device
 *                  buffers through host memory, posting the MPI transfers,
 *                  reductions of 16-bit floats, ordering on the streams
 *
 * The names below are in namespace gl_sim_nccl with hidden visibility: they
 * are shared by the two files, not exported from the library. */
#ifndef GL_SIM_NCCL_INTERNAL_H
#define GL_SIM_NCCL_INTERNAL_H
#include <mpi.h>
#include <stdint.h>
#include <atomic>
#include "sim_types.h"
#include "runtime_api.h"
#include "nccl.h"

namespace gl_sim_nccl __attribute__((visibility("hidden"))) {

/* ---- errors (nccl_comm.cpp) ---------------------------------------------- */
/* the calling thread's last failure, for ncclGetLastError */
extern thread_local char last_error[1024];
/* Records the message as the last error and returns r. */
ncclResult_t fail(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- configuration and waiting (nccl_comm.cpp) ---------------------------- */
/* seconds a member waits for its peers before the simulator reports a hang */
double wait_limit_s();
double now_s();
/* Between polls of MPI: spin briefly, then yield, then sleep. */
void pause_after(double waited);

/* ---- communicators (nccl_comm.cpp) ------------------------------------------ */
const uint64_t COMM_MAGIC = 0x6e63636c53494d31ull;   /* "ncclSIM1" */

}  // namespace gl_sim_nccl

struct ncclComm {
  uint64_t magic = gl_sim_nccl::COMM_MAGIC;
  int rank = 0, nranks = 0, device = 0;
  MPI_Comm data = MPI_COMM_NULL;   /* the stream work's transfers */
  MPI_Comm ctrl = MPI_COMM_NULL;   /* host-side collectives (split) */
  std::atomic<int> refs{1};        /* the user's handle + queued work items */
  std::atomic<int> async_error{ncclSuccess};
  std::atomic<bool> aborted{false};
  cudaEvent_t last_done = nullptr; /* recorded after the latest operation */
  cudaStream_t last_stream = nullptr;
  bool has_last = false;
};

namespace gl_sim_nccl __attribute__((visibility("hidden"))) {

/* c is a handle the user may pass (made, and not yet destroyed or aborted) */
bool is_live(ncclComm *c);
/* ncclSuccess, or fail's ncclInvalidArgument naming fn for a NULL or dead comm */
ncclResult_t check_comm(ncclComm *c, const char *fn);
/* Drops one reference (the handle's or a work item's); the last one frees c. */
void comm_release(ncclComm *c);

/* Makes device current for the guard's lifetime (events belong to the
   device current when they are made, and must match their streams'). */
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (prev >= 0 && cudaGetDevice(&now) == cudaSuccess && now != prev) cudaSetDevice(prev);
  }
};

}  // namespace gl_sim_nccl

#endif
