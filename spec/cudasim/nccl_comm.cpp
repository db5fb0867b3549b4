/* nccl_comm.cpp — the simulator's NCCL communicators: the unique id, the
 * init handshake, split, destroy / abort, the queries, and the error
 * reporting both halves use.  Its sibling nccl_ops.cpp runs the operations
 * and groups on them; what the two share is in nccl_internal.h, which also
 * says what the simulated NCCL is as a whole.
 *
 * How it works
 *  - A unique id names the MPI_COMM_WORLD rank that made it and a counter.
 *    ncclCommInitRank: every member sends that process a report (rank,
 *    nranks, world rank, host, device); it checks them (one nranks, every
 *    rank once, no GPU twice) and answers everyone with the verdict and the
 *    world ranks ordered by rank; the members then build an MPI
 *    communicator of exactly themselves (MPI_Comm_create_group, collective
 *    over the group only) plus a duplicate for host-side control
 *    (ncclCommSplit), so splits never race the data traffic of the stream.
 *  - A communicator is reference counted: the user's handle plus every
 *    queued work item, so ncclCommDestroy / ncclCommAbort never wait and a
 *    work item never sees a freed communicator.
 *
 * MPI thread level: in the default 'sync' stream mode work runs on the
 * calling thread (gptlua calls NCCL from the thread that initialised MPI:
 * MPI_THREAD_FUNNELED is enough).  With GL_SIM_STREAMS=threads the work runs
 * on stream threads while the main thread polls its own MPI requests, so
 * MPI must provide MPI_THREAD_MULTIPLE; ncclCommInitRank checks it. */
#include <mpi.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <vector>
#include "sim_types.h"
#include "runtime_api.h"
#include "sim.h"
#include "nccl.h"
#include "nccl_internal.h"

using namespace gl_sim_nccl;

namespace gl_sim_nccl {

/* ---- errors ------------------------------------------------------------- */
thread_local char last_error[1024];

ncclResult_t fail(ncclResult_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return r;
}

/* ---- configuration (environment, read once) ------------------------------ */
/* seconds a member waits for its peers before the simulator reports a hang */
double wait_limit_s() {
  static double limit = [] {
    const char *s = getenv("GL_SIM_NCCL_TIMEOUT");
    double v = s ? atof(s) : 0;
    return v > 0 ? v : 600.0;
  }();
  return limit;
}

double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Between polls of MPI: spin briefly (a collective between ranks that are
   all ready takes microseconds), then yield, then sleep, so a waiting rank
   leaves the (shared, oversubscribed) cores to ranks that still compute. */
void pause_after(double waited) {
  if (waited < 1e-4) return;
  if (waited < 5e-3) { sched_yield(); return; }
  struct timespec ts = {0, 50 * 1000};
  nanosleep(&ts, nullptr);
}

}  // namespace gl_sim_nccl

namespace {

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

/* ---- communicators -------------------------------------------------------- */
std::mutex registry_lock;
std::set<ncclComm *> live;   /* handles the user may pass */

}  // namespace

namespace gl_sim_nccl {

bool is_live(ncclComm *c) {
  std::lock_guard<std::mutex> g(registry_lock);
  return c && live.count(c) && c->magic == COMM_MAGIC;
}

ncclResult_t check_comm(ncclComm *c, const char *fn) {
  if (!c) return fail(ncclInvalidArgument, "%s: comm is NULL", fn);
  if (!is_live(c)) return fail(ncclInvalidArgument, "%s: comm %p is not a live communicator (destroyed, or never made)", fn, (void *)c);
  return ncclSuccess;
}

void comm_release(ncclComm *c) {
  if (--c->refs > 0) return;
  /* an aborted communicator may have transfers MPI never finished: its MPI
     communicators are left alone rather than freed under them */
  if (!c->aborted && mpi_usable()) {
    if (c->ctrl != MPI_COMM_NULL) MPI_Comm_free(&c->ctrl);
    if (c->data != MPI_COMM_NULL) MPI_Comm_free(&c->data);
  }
  c->magic = 0;
  delete c;
}

}  // namespace gl_sim_nccl

namespace {

/* A new communicator around data (ordered by rank), with its control
   duplicate, bound to device; registered as live. */
ncclResult_t make_comm(MPI_Comm data, int device, const char *fn, ncclComm **out) {
  auto *c = new ncclComm;
  c->data = data;
  c->device = device;
  MPI_Comm_set_errhandler(data, MPI_ERRORS_RETURN);
  MPI_Comm_rank(data, &c->rank);
  MPI_Comm_size(data, &c->nranks);
  cudaError_t e;
  {
    DeviceGuard on(device);
    e = cudaEventCreateWithFlags(&c->last_done, cudaEventDisableTiming);
  }
  if (MPI_Comm_dup(data, &c->ctrl) != MPI_SUCCESS || e != cudaSuccess) {
    ncclResult_t r = e != cudaSuccess ? fail(ncclUnhandledCudaError, "%s: cudaEventCreateWithFlags: %s", fn, cudaGetErrorString(e))
                                      : fail(ncclSystemError, "%s: MPI_Comm_dup of the new communicator failed", fn);
    if (c->last_done) cudaEventDestroy(c->last_done);
    comm_release(c);
    return r;
  }
  MPI_Comm_set_errhandler(c->ctrl, MPI_ERRORS_RETURN);
  std::lock_guard<std::mutex> g(registry_lock);
  live.insert(c);
  *out = c;
  return ncclSuccess;
}

/* Takes the handle out of the registry; the communicator goes once the work
   items holding it have run. */
ncclResult_t drop_comm(ncclComm *c, const char *fn, bool abort) {
  {
    std::lock_guard<std::mutex> g(registry_lock);
    if (!c) return fail(ncclInvalidArgument, "%s: comm is NULL", fn);
    if (!live.count(c)) return fail(ncclInvalidArgument, "%s: comm %p is not a live communicator", fn, (void *)c);
    live.erase(c);
  }
  if (abort) c->aborted = true;   /* queued and running work items give up */
  if (c->last_done) {
    DeviceGuard on(c->device);
    cudaEventDestroy(c->last_done);   /* deferred by the runtime while pending */
  }
  c->last_done = nullptr;
  comm_release(c);
  return ncclSuccess;
}

/* ---- the unique id and the init handshake ------------------------------- */
struct SimId {
  char magic[8];          /* "glsimid" */
  int32_t root;           /* MPI_COMM_WORLD rank that made it and answers the members */
  int32_t world_size;
  uint64_t counter;       /* ids made by root so far */
};
static_assert(sizeof(SimId) <= NCCL_UNIQUE_ID_BYTES, "the id must fit ncclUniqueId");
const char ID_MAGIC[8] = "glsimid";

/* MPI_COMM_WORLD tags of the handshake, per id (a root's ids in flight at
   once never collide) */
enum { TAG_REPORT = 20000, TAG_REPLY = 25000, TAG_GROUP = 30000, TAG_SPAN = 2000 };

struct Report {
  int32_t rank, nranks, world_rank, device;
  char host[64];
};
struct ReplyHead {
  int32_t status;         /* ncclResult_t */
  int32_t nranks;
  char msg[480];
};

std::atomic<uint64_t> ids_made{0};

/* Waits for req; false after the wait limit (the request is cancelled). */
bool wait_request(MPI_Request *req, MPI_Status *st) {
  double t0 = now_s();
  for (;;) {
    int flag = 0;
    if (MPI_Test(req, &flag, st) != MPI_SUCCESS) return false;
    if (flag) return true;
    double waited = now_s() - t0;
    if (waited > wait_limit_s()) {
      MPI_Cancel(req);
      MPI_Request_free(req);
      return false;
    }
    pause_after(waited);
  }
}

/* this process's host, truncated to n - 1 characters */
void host_name(char *out, size_t n) {
  char name[MPI_MAX_PROCESSOR_NAME + 1];
  int len = 0;
  if (MPI_Get_processor_name(name, &len) != MPI_SUCCESS) len = 0;
  size_t k = std::min((size_t)len, n - 1);
  memcpy(out, name, k);
  out[k] = 0;
}

/* On the id's root: collects the members' reports and decides.  Fills
   world (world ranks ordered by rank) on success. */
ncclResult_t root_collect(const SimId &id, const Report &mine, std::vector<Report> &reps, std::vector<int> &world,
                          char *msg, size_t msgn) {
  int tag = TAG_REPORT + (int)(id.counter % TAG_SPAN);
  reps.assign(1, mine);
  for (int k = 1; k < mine.nranks; k++) {
    Report r;
    MPI_Request req;
    MPI_Status st;
    if (MPI_Irecv(&r, sizeof r, MPI_BYTE, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &req) != MPI_SUCCESS ||
        !wait_request(&req, &st)) {
      snprintf(msg, msgn, "ncclCommInitRank: %d of %d ranks reported to world rank %d (the id's maker) within %g s "
               "(GL_SIM_NCCL_TIMEOUT)", k, mine.nranks, id.root, wait_limit_s());
      return ncclSystemError;
    }
    reps.push_back(r);
  }
  std::vector<int> by_rank(mine.nranks, -1);
  for (size_t i = 0; i < reps.size(); i++) {
    const Report &r = reps[i];
    if (r.nranks != mine.nranks) {
      snprintf(msg, msgn, "ncclCommInitRank: world rank %d passed nranks %d, world rank %d passed %d", r.world_rank,
               r.nranks, mine.world_rank, mine.nranks);
      return ncclInvalidUsage;
    }
    if (r.rank < 0 || r.rank >= mine.nranks) {
      snprintf(msg, msgn, "ncclCommInitRank: world rank %d passed rank %d, expected 0..%d", r.world_rank, r.rank,
               mine.nranks - 1);
      return ncclInvalidUsage;
    }
    if (by_rank[r.rank] >= 0) {
      snprintf(msg, msgn, "ncclCommInitRank: world ranks %d and %d both passed rank %d",
               reps[by_rank[r.rank]].world_rank, r.world_rank, r.rank);
      return ncclInvalidUsage;
    }
    by_rank[r.rank] = (int)i;
  }
  for (size_t i = 0; i < reps.size(); i++)
    for (size_t j = 0; j < i; j++)
      if (reps[i].device == reps[j].device && strncmp(reps[i].host, reps[j].host, sizeof reps[i].host) == 0) {
        int a = std::min(reps[i].rank, reps[j].rank), b = std::max(reps[i].rank, reps[j].rank);
        snprintf(msg, msgn, "Duplicate GPU detected: rank %d and rank %d both on cuda:%d of host %s "
                 "(one GPU per rank: GL_SIM_DEVICES sets how many the simulator offers)", a, b, reps[i].device,
                 reps[i].host);
        return ncclInvalidUsage;
      }
  world.assign(mine.nranks, 0);
  for (int r = 0; r < mine.nranks; r++) world[r] = reps[by_rank[r]].world_rank;
  return ncclSuccess;
}

}  // namespace

/* ======================================================================== */
extern "C" {

ncclResult_t ncclGetVersion(int *version) {
  if (!version) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error";
  case ncclSystemError: return "unhandled system error";
  case ncclInternalError: return "internal error";
  case ncclInvalidArgument: return "invalid argument";
  case ncclInvalidUsage: return "invalid usage";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  default: return "unknown result code";
  }
}

const char *ncclGetLastError(ncclComm_t) { return last_error; }

ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  if (!uniqueId) return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  if (!mpi_usable())
    return fail(ncclInvalidUsage, "ncclGetUniqueId: MPI is not initialised (the simulated NCCL runs over MPI)");
  SimId id;
  memset(&id, 0, sizeof id);
  memcpy(id.magic, ID_MAGIC, sizeof id.magic);
  MPI_Comm_rank(MPI_COMM_WORLD, &id.root);
  MPI_Comm_size(MPI_COMM_WORLD, &id.world_size);
  id.counter = ids_made++;
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, &id, sizeof id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  const char *fn = "ncclCommInitRank";
  if (!comm) return fail(ncclInvalidArgument, "%s: comm is NULL", fn);
  *comm = nullptr;
  if (nranks < 1) return fail(ncclInvalidArgument, "%s: nranks expected >= 1, got %d", fn, nranks);
  if (rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "%s: rank expected 0..%d, got %d", fn, nranks - 1, rank);
  if (!mpi_usable()) return fail(ncclInvalidUsage, "%s: MPI is not initialised (the simulated NCCL runs over MPI)", fn);
  SimId id;
  memcpy(&id, commId.internal, sizeof id);
  int wrank = 0, wsize = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &wrank);
  MPI_Comm_size(MPI_COMM_WORLD, &wsize);
  if (memcmp(id.magic, ID_MAGIC, sizeof id.magic) != 0 || id.world_size != wsize || id.root < 0 || id.root >= wsize)
    return fail(ncclInvalidArgument, "%s: commId was not made by ncclGetUniqueId in this MPI job", fn);
  if (gl_sim_streams_threaded()) {
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
      return fail(ncclInvalidUsage, "%s: GL_SIM_STREAMS=threads runs NCCL work on stream threads, which call MPI: "
                  "MPI must provide MPI_THREAD_MULTIPLE (it provides level %d)", fn, provided);
  }
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return fail(ncclUnhandledCudaError, "%s: cudaGetDevice: %s", fn, cudaGetErrorString(e));

  Report mine;
  memset(&mine, 0, sizeof mine);
  mine.rank = rank;
  mine.nranks = nranks;
  mine.world_rank = wrank;
  mine.device = device;
  host_name(mine.host, sizeof mine.host);

  /* the verdict: decided on the root, sent to every other member */
  int slot = (int)(id.counter % TAG_SPAN);
  std::vector<char> reply(sizeof(ReplyHead) + sizeof(int32_t) * (size_t)nranks, 0);
  ReplyHead *head = (ReplyHead *)reply.data();
  int32_t *world = (int32_t *)(reply.data() + sizeof(ReplyHead));
  if (wrank == id.root) {
    std::vector<Report> reps;
    std::vector<int> order;
    head->status = root_collect(id, mine, reps, order, head->msg, sizeof head->msg);
    head->nranks = nranks;
    for (int r = 0; head->status == ncclSuccess && r < nranks; r++) world[r] = order[r];
    size_t bytes = head->status == ncclSuccess ? reply.size() : sizeof(ReplyHead);
    for (size_t i = 1; i < reps.size(); i++)
      MPI_Send(reply.data(), (int)bytes, MPI_BYTE, reps[i].world_rank, TAG_REPLY + slot, MPI_COMM_WORLD);
  } else {
    MPI_Request req;
    MPI_Status st;
    if (MPI_Send(&mine, sizeof mine, MPI_BYTE, id.root, TAG_REPORT + slot, MPI_COMM_WORLD) != MPI_SUCCESS ||
        MPI_Irecv(reply.data(), (int)reply.size(), MPI_BYTE, id.root, TAG_REPLY + slot, MPI_COMM_WORLD, &req) !=
            MPI_SUCCESS)
      return fail(ncclSystemError, "%s: sending the report to world rank %d failed", fn, id.root);
    if (!wait_request(&req, &st))
      return fail(ncclSystemError, "%s: no answer from world rank %d (the id's maker, which must call %s with it "
                  "too) within %g s (GL_SIM_NCCL_TIMEOUT)", fn, id.root, fn, wait_limit_s());
  }
  if (head->status != ncclSuccess) return fail((ncclResult_t)head->status, "%s", head->msg);

  MPI_Group all, members;
  MPI_Comm data = MPI_COMM_NULL;
  MPI_Comm_group(MPI_COMM_WORLD, &all);
  MPI_Group_incl(all, nranks, world, &members);
  int rc = MPI_Comm_create_group(MPI_COMM_WORLD, members, TAG_GROUP + slot, &data);
  MPI_Group_free(&members);
  MPI_Group_free(&all);
  if (rc != MPI_SUCCESS || data == MPI_COMM_NULL)
    return fail(ncclSystemError, "%s: MPI_Comm_create_group of the %d members failed", fn, nranks);
  return make_comm(data, device, fn, comm);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  const char *fn = "ncclCommSplit";
  if (newcomm) *newcomm = nullptr;
  ncclResult_t r = check_comm(comm, fn);
  if (r != ncclSuccess) return r;
  if (!newcomm) return fail(ncclInvalidArgument, "%s: newcomm is NULL", fn);
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR)
    return fail(ncclInvalidArgument, "%s: color expected >= 0 or NCCL_SPLIT_NOCOLOR, got %d", fn, color);
  if (config && (config->size != sizeof(ncclConfig_t) || config->magic != 0xcafebeef))
    return fail(ncclInvalidArgument, "%s: config was not set up with NCCL_CONFIG_INITIALIZER", fn);
  if (!mpi_usable()) return fail(ncclInvalidUsage, "%s: MPI is not initialised (or already finalised)", fn);
  MPI_Comm nc = MPI_COMM_NULL;
  if (MPI_Comm_split(comm->ctrl, color < 0 ? MPI_UNDEFINED : color, key, &nc) != MPI_SUCCESS)
    return fail(ncclSystemError, "%s: MPI_Comm_split failed", fn);
  if (nc == MPI_COMM_NULL) return ncclSuccess;   /* NCCL_SPLIT_NOCOLOR: no new communicator */
  return make_comm(nc, comm->device, fn, newcomm);
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return drop_comm(comm, "ncclCommDestroy", false); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return drop_comm(comm, "ncclCommAbort", true); }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  ncclResult_t r = check_comm(comm, "ncclCommGetAsyncError");
  if (r != ncclSuccess) return r;
  if (!asyncError) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
  *asyncError = (ncclResult_t)comm->async_error.load();
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  ncclResult_t r = check_comm(comm, "ncclCommCount");
  if (r != ncclSuccess) return r;
  if (!count) return fail(ncclInvalidArgument, "ncclCommCount: count is NULL");
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  ncclResult_t r = check_comm(comm, "ncclCommCuDevice");
  if (r != ncclSuccess) return r;
  if (!device) return fail(ncclInvalidArgument, "ncclCommCuDevice: device is NULL");
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  ncclResult_t r = check_comm(comm, "ncclCommUserRank");
  if (r != ncclSuccess) return r;
  if (!rank) return fail(ncclInvalidArgument, "ncclCommUserRank: rank is NULL");
  *rank = comm->rank;
  return ncclSuccess;
}

}  // extern "C"
