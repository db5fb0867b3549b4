/* nccl.cpp — NCCL in the CUDA simulator: the API of kernels/sim/nccl.h
 * implemented over MPI between the processes of an MPI job, each process
 * one simulated GPU.  Linked into build/sim/libgptlua_mpi.so beside the
 * engine's NCCL backend (engine/mpi/nccl.c), which it serves unchanged.
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
 *  - A collective, or a whole group of operations, is one work item on the
 *    stream (gl_sim_submit).  The item copies every input from device
 *    memory into host buffers (MPI's shared-memory transport may read
 *    another process's pages, and the simulator keeps device pages
 *    protected), posts every transfer as a nonblocking MPI operation, polls
 *    them all to completion, then writes the results into device memory.
 *    Posting a group's operations together before waiting is what keeps
 *    grouped send/recv pairs and grouped uneven collectives deadlock-free.
 *    16-bit float reductions travel as float and are rounded once.
 *  - Operations of one communicator keep their call order across streams:
 *    each waits for an event recorded after the previous one.
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
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>
#include "sim_types.h"
#include "runtime_api.h"
#include "sim.h"
#include "nccl.h"

namespace {

/* ---- errors ------------------------------------------------------------- */
thread_local char last_error[1024];

ncclResult_t fail(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
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

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

/* ---- 16-bit floats (bit-exact, round to nearest even) ------------------- */
float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
uint32_t float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }
uint16_t float_to_bf16(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);   /* NaN stays a quiet NaN */
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

float f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {   /* zero or subnormal: mant * 2^-24, exact in float */
    float v = ldexpf((float)mant, -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}
uint16_t float_to_f16(float f) {
  uint32_t x = float_to_bits(f), ax = x & 0x7fffffffu;
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  /* 65520 and up round to inf */
  if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal */
    float v = bits_to_float(ax) * 16777216.0f;              /* exact: in units of 2^-24 */
    return (uint16_t)(sign | (uint16_t)nearbyintf(v));      /* 1024 becomes the smallest normal */
  }
  uint32_t e = ax - 0x38000000u;                            /* rebias 127 -> 15 */
  return (uint16_t)(sign | ((e + 0xfffu + ((e >> 13) & 1)) >> 13));
}

/* ---- data types and ops ------------------------------------------------- */
size_t type_size(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  default: return 0;
  }
}
bool is_16bit_float(ncclDataType_t t) { return t == ncclFloat16 || t == ncclBfloat16; }

/* the type MPI reduces in: 16-bit floats as float */
MPI_Datatype reduce_type(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: return MPI_INT8_T;
  case ncclUint8: return MPI_UINT8_T;
  case ncclInt32: return MPI_INT32_T;
  case ncclUint32: return MPI_UINT32_T;
  case ncclInt64: return MPI_INT64_T;
  case ncclUint64: return MPI_UINT64_T;
  case ncclFloat64: return MPI_DOUBLE;
  default: return MPI_FLOAT;
  }
}
size_t reduce_size(ncclDataType_t t) { return is_16bit_float(t) ? 4 : type_size(t); }

MPI_Op mpi_op(ncclRedOp_t op) {
  switch (op) {
  case ncclProd: return MPI_PROD;
  case ncclMax: return MPI_MAX;
  case ncclMin: return MPI_MIN;
  default: return MPI_SUM;   /* sum, and avg before its division */
  }
}

/* ---- communicators -------------------------------------------------------- */
const uint64_t COMM_MAGIC = 0x6e63636c53494d31ull;   /* "ncclSIM1" */

}  // namespace

struct ncclComm {
  uint64_t magic = COMM_MAGIC;
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

namespace {

std::mutex registry_lock;
std::set<ncclComm *> live;   /* handles the user may pass */

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

/* ======================================================================== */
/* ---- operations ----------------------------------------------------------- */
namespace {

enum class Kind { AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, Send, Recv };

/* One call, as passed, plus its host buffers while it runs. */
struct Op {
  Kind kind;
  const char *name;
  ncclComm *comm;
  cudaStream_t stream;
  const char *send;       /* device memory, or NULL where this rank reads none */
  char *recv;             /* device memory, or NULL where this rank writes none */
  size_t count;           /* as in the call's signature */
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;               /* root, or the peer of send / recv */
  /* while running */
  void *in = nullptr, *out = nullptr;   /* host buffers (reduction type for reductions, else raw bytes) */
  MPI_Request req = MPI_REQUEST_NULL;
};

bool is_reduction(Kind k) { return k == Kind::AllReduce || k == Kind::ReduceScatter || k == Kind::Reduce; }

/* elements this rank reads from send / writes to recv (0: none) */
size_t in_elems(const Op &o) {
  switch (o.kind) {
  case Kind::ReduceScatter: return o.count * (size_t)o.comm->nranks;
  case Kind::Broadcast: return o.comm->rank == o.root ? o.count : 0;
  case Kind::Recv: return 0;
  default: return o.count;
  }
}
size_t out_elems(const Op &o) {
  switch (o.kind) {
  case Kind::AllGather: return o.count * (size_t)o.comm->nranks;
  case Kind::Reduce: return o.comm->rank == o.root ? o.count : 0;
  case Kind::Send: return 0;
  default: return o.count;
  }
}

/* A device buffer argument: inside one allocation of the communicator's
   device (NULL only when nothing is read or written). */
ncclResult_t check_buffer(const Op &o, const void *p, size_t elems, const char *what) {
  if (elems == 0) return ncclSuccess;
  size_t bytes = elems * type_size(o.type);
  if (!p) return fail(ncclInvalidArgument, "%s: %s is NULL but %zu bytes are to be %s", o.name, what, bytes,
                      strcmp(what, "sendbuff") == 0 ? "read" : "written");
  void *base = nullptr;
  size_t size = 0;
  int dev = -1;
  if (!gl_sim_find_alloc(p, &base, &size, &dev))
    return fail(ncclInvalidArgument, "%s: %s %p is not device memory (NCCL moves device buffers only)", o.name, what, p);
  if (dev != o.comm->device)
    return fail(ncclInvalidArgument, "%s: %s %p is memory of cuda:%d but the communicator uses cuda:%d", o.name, what,
                p, dev, o.comm->device);
  size_t off = (size_t)((const char *)p - (const char *)base);
  if (off + bytes > size)
    return fail(ncclInvalidArgument, "%s: %s %p + %zu bytes leaves its %zu-byte allocation of cuda:%d by %zu bytes",
                o.name, what, p, bytes, size, dev, off + bytes - size);
  return ncclSuccess;
}

/* Overlapping send and recv ranges are a race on a GPU unless they are
   NCCL's in-place layout. */
ncclResult_t check_overlap(const Op &o) {
  size_t ib = in_elems(o) * type_size(o.type), ob = out_elems(o) * type_size(o.type);
  if (!ib || !ob || !o.send || !o.recv) return ncclSuccess;
  const char *s = o.send, *r = o.recv;
  if (s + ib <= r || r + ob <= s) return ncclSuccess;
  size_t blk = o.count * type_size(o.type) * (size_t)o.comm->rank;
  bool in_place = o.kind == Kind::AllGather ? s == r + blk : o.kind == Kind::ReduceScatter ? r == s + blk : s == r;
  if (in_place) return ncclSuccess;
  return fail(ncclInvalidArgument, "%s: sendbuff %p (%zu bytes) and recvbuff %p (%zu bytes) overlap but are not "
              "the in-place layout (%s)", o.name, (const void *)s, ib, (void *)r, ob,
              o.kind == Kind::AllGather ? "sendbuff == recvbuff + rank * sendcount"
              : o.kind == Kind::ReduceScatter ? "recvbuff == sendbuff + rank * recvcount" : "sendbuff == recvbuff");
}

ncclResult_t check_op(const Op &o) {
  ncclResult_t r = check_comm(o.comm, o.name);
  if (r != ncclSuccess) return r;
  if ((int)o.type < 0 || o.type >= ncclNumTypes)
    return fail(ncclInvalidArgument, "%s: datatype expected 0..%d, got %d", o.name, ncclNumTypes - 1, (int)o.type);
  if (is_reduction(o.kind) && ((int)o.op < 0 || o.op >= ncclNumOps))
    return fail(ncclInvalidArgument, "%s: op expected ncclSum, ncclProd, ncclMax, ncclMin or ncclAvg, got %d", o.name,
                (int)o.op);
  bool p2p = o.kind == Kind::Send || o.kind == Kind::Recv;
  if ((p2p || o.kind == Kind::Broadcast || o.kind == Kind::Reduce) && (o.root < 0 || o.root >= o.comm->nranks))
    return fail(ncclInvalidArgument, "%s: %s expected 0..%d, got %d", o.name, p2p ? "peer" : "root",
                o.comm->nranks - 1, o.root);
  if (o.comm->aborted) return fail(ncclInvalidUsage, "%s: the communicator was aborted", o.name);
  size_t most = std::max(in_elems(o), out_elems(o)) * (is_reduction(o.kind) ? reduce_size(o.type) : type_size(o.type));
  if (most > (size_t)0x7fffffff)
    return fail(ncclInvalidArgument, "%s: %zu bytes exceed the simulator's 2 GiB per operation (MPI int counts)",
                o.name, most);
  if ((r = check_buffer(o, o.send, in_elems(o), "sendbuff")) != ncclSuccess) return r;
  if ((r = check_buffer(o, o.recv, out_elems(o), "recvbuff")) != ncclSuccess) return r;
  if (gl_sim_sticky() != cudaSuccess)
    return fail(ncclUnhandledCudaError, "%s: the CUDA context is unusable: %s", o.name, cudaGetErrorString(gl_sim_sticky()));
  return check_overlap(o);
}

/* ---- running a batch (one call, or a group) on the stream ---------------- */
/* Host copies of the inputs; reductions of 16-bit floats convert to float. */
void stage_in(Op &o) {
  size_t n = in_elems(o), out_n = out_elems(o);
  bool red = is_reduction(o.kind);
  size_t es = red ? reduce_size(o.type) : type_size(o.type);
  o.in = malloc(n * es + 1);
  o.out = malloc(out_n * es + 1);
  if (!n) return;
  if (red && o.type == ncclBfloat16) {
    const uint16_t *s = (const uint16_t *)o.send;
    for (size_t i = 0; i < n; i++) ((float *)o.in)[i] = bf16_to_float(s[i]);
  } else if (red && o.type == ncclFloat16) {
    const uint16_t *s = (const uint16_t *)o.send;
    for (size_t i = 0; i < n; i++) ((float *)o.in)[i] = f16_to_float(s[i]);
  } else {
    memcpy(o.in, o.send, n * es);
  }
}

/* Posts the transfer; MPI_SUCCESS or MPI's error. */
int post(Op &o) {
  MPI_Comm c = o.comm->data;
  int n = (int)o.count, bytes = (int)(o.count * type_size(o.type));
  MPI_Datatype rt = reduce_type(o.type);
  MPI_Op op = mpi_op(o.op);
  switch (o.kind) {
  case Kind::AllReduce: return MPI_Iallreduce(o.in, o.out, n, rt, op, c, &o.req);
  case Kind::ReduceScatter: return MPI_Ireduce_scatter_block(o.in, o.out, n, rt, op, c, &o.req);
  case Kind::Reduce: return MPI_Ireduce(o.in, o.comm->rank == o.root ? o.out : nullptr, n, rt, op, o.root, c, &o.req);
  case Kind::AllGather: return MPI_Iallgather(o.in, bytes, MPI_BYTE, o.out, bytes, MPI_BYTE, c, &o.req);
  case Kind::Broadcast:
    if (o.comm->rank == o.root) memcpy(o.out, o.in, (size_t)bytes);
    return MPI_Ibcast(o.out, bytes, MPI_BYTE, o.root, c, &o.req);
  case Kind::Send: return MPI_Isend(o.in, bytes, MPI_BYTE, o.root, 0, c, &o.req);
  case Kind::Recv: return MPI_Irecv(o.out, bytes, MPI_BYTE, o.root, 0, c, &o.req);
  }
  return MPI_ERR_OTHER;
}

/* avg's division, then the results into device memory */
void stage_out(Op &o) {
  size_t n = out_elems(o);
  if (!n) return;
  bool red = is_reduction(o.kind);
  if (red && o.op == ncclAvg) {
    int k = o.comm->nranks;
    switch (o.type) {
    case ncclFloat64: { double s = 1.0 / k; for (size_t i = 0; i < n; i++) ((double *)o.out)[i] *= s; break; }
    case ncclInt8: for (size_t i = 0; i < n; i++) ((int8_t *)o.out)[i] /= k; break;
    case ncclUint8: for (size_t i = 0; i < n; i++) ((uint8_t *)o.out)[i] /= k; break;
    case ncclInt32: for (size_t i = 0; i < n; i++) ((int32_t *)o.out)[i] /= k; break;
    case ncclUint32: for (size_t i = 0; i < n; i++) ((uint32_t *)o.out)[i] /= k; break;
    case ncclInt64: for (size_t i = 0; i < n; i++) ((int64_t *)o.out)[i] /= k; break;
    case ncclUint64: for (size_t i = 0; i < n; i++) ((uint64_t *)o.out)[i] /= k; break;
    default: { float s = (float)(1.0 / k); for (size_t i = 0; i < n; i++) ((float *)o.out)[i] *= s; break; }
    }
  }
  uint16_t *d = (uint16_t *)o.recv;
  if (red && o.type == ncclBfloat16) for (size_t i = 0; i < n; i++) d[i] = float_to_bf16(((float *)o.out)[i]);
  else if (red && o.type == ncclFloat16) for (size_t i = 0; i < n; i++) d[i] = float_to_f16(((float *)o.out)[i]);
  else memcpy(o.recv, o.out, n * (red ? reduce_size(o.type) : type_size(o.type)));
}

void set_async(const std::vector<Op> &ops, ncclResult_t r) {
  for (const Op &o : ops) {
    int ok = ncclSuccess;
    o.comm->async_error.compare_exchange_strong(ok, r);
  }
}

/* What a work item runs: the calls of one launch, and the communicators it
   holds until it is destroyed (run or dropped by a sticky context). */
struct Batch {
  std::vector<Op> ops;
  bool leak = false;     /* MPI may still write the host buffers: keep them */
  ~Batch() {
    for (Op &o : ops) {
      if (!leak) { free(o.in); free(o.out); }
      comm_release(o.comm);
    }
  }

  void run() {
    for (Op &o : ops)
      if (o.comm->aborted) { set_async(ops, ncclInvalidUsage); return; }
    for (size_t i = 0; i < ops.size(); i++) {
      stage_in(ops[i]);
      int e = post(ops[i]);
      if (e != MPI_SUCCESS) {
        leak = i > 0;   /* the ones already posted stay in flight */
        char s[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(e, s, &len);
        set_async(ops, ncclSystemError);
        gl_sim_fail(cudaErrorLaunchFailure, "%s on rank %d of %d: posting the MPI transfer failed: %s",
                    ops[i].name, ops[i].comm->rank, ops[i].comm->nranks, s);
        return;
      }
    }
    std::vector<MPI_Request> reqs(ops.size());
    std::vector<MPI_Status> st(ops.size());
    for (size_t i = 0; i < ops.size(); i++) reqs[i] = ops[i].req;
    double t0 = now_s();
    for (;;) {
      int flag = 0;
      int e = MPI_Testall((int)reqs.size(), reqs.data(), &flag, st.data());
      if (e != MPI_SUCCESS && e != MPI_ERR_IN_STATUS) { failed_mpi(e, -1); return; }
      if (e == MPI_ERR_IN_STATUS) {
        for (size_t i = 0; i < ops.size(); i++)
          if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING) { failed_mpi(st[i].MPI_ERROR, (int)i); return; }
      }
      if (flag) break;
      for (Op &o : ops)
        if (o.comm->aborted) { leak = true; set_async(ops, ncclInvalidUsage); return; }
      double waited = now_s() - t0;
      if (waited > wait_limit_s()) {
        leak = true;
        set_async(ops, ncclSystemError);
        const Op &o = ops[0];
        gl_sim_fail(cudaErrorLaunchTimeout, "%s%s on rank %d of %d waited %g s for its peers (GL_SIM_NCCL_TIMEOUT); "
                    "a rank that never joins hangs NCCL on a GPU too", o.name, ops.size() > 1 ? " (in a group)" : "",
                    o.comm->rank, o.comm->nranks, wait_limit_s());
        return;
      }
      pause_after(waited);
    }
    for (size_t i = 0; i < ops.size(); i++) {
      Op &o = ops[i];
      if (o.kind == Kind::Recv) {
        int got = 0;
        MPI_Get_count(&st[i], MPI_BYTE, &got);
        size_t want = o.count * type_size(o.type);
        if ((size_t)got != want) {
          set_async(ops, ncclInvalidUsage);
          gl_sim_fail(cudaErrorLaunchFailure, "ncclRecv on rank %d of %d from peer %d expects %zu bytes but the "
                      "matching ncclSend sent %d (on a GPU this hangs or corrupts memory)", o.comm->rank,
                      o.comm->nranks, o.root, want, got);
          return;
        }
      }
      stage_out(o);
    }
  }

  void failed_mpi(int err, int which) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(err, s, &len);
    leak = true;
    set_async(ops, ncclSystemError);
    const Op &o = ops[which >= 0 ? which : 0];
    if (which >= 0 && o.kind == Kind::Recv && err == MPI_ERR_TRUNCATE)
      gl_sim_fail(cudaErrorLaunchFailure, "ncclRecv on rank %d of %d from peer %d expects %zu bytes but the matching "
                  "ncclSend sent more (on a GPU this hangs or corrupts memory)", o.comm->rank, o.comm->nranks, o.root,
                  o.count * type_size(o.type));
    else
      gl_sim_fail(cudaErrorLaunchFailure, "%s on rank %d of %d: MPI transfer failed: %s", o.name, o.comm->rank,
                  o.comm->nranks, s);
  }
};

/* Queues ops as one work item on the first op's stream.  Other streams of
   the batch join it before and after (as NCCL does for a group), and each
   communicator's previous operation is waited for. */
ncclResult_t launch(std::vector<Op> ops) {
  const char *fn = ops.size() > 1 ? "ncclGroupEnd" : ops[0].name;
  DeviceGuard on(ops[0].comm->device);
  cudaStream_t main = ops[0].stream;
  std::vector<cudaStream_t> others;
  std::vector<ncclComm *> comms;
  for (const Op &o : ops) {
    if (o.stream != main && std::find(others.begin(), others.end(), o.stream) == others.end()) others.push_back(o.stream);
    if (std::find(comms.begin(), comms.end(), o.comm) == comms.end()) comms.push_back(o.comm);
  }
#define CUDA_OR_FAIL(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) \
    return fail(ncclUnhandledCudaError, "%s: %s: %s", fn, #call, cudaGetErrorString(e_)); } while (0)
  for (ncclComm *c : comms)
    if (c->has_last && c->last_stream != main) CUDA_OR_FAIL(cudaStreamWaitEvent(main, c->last_done, 0));
  std::vector<cudaEvent_t> joins(others.size(), nullptr);
  for (size_t i = 0; i < others.size(); i++) {
    CUDA_OR_FAIL(cudaEventCreateWithFlags(&joins[i], cudaEventDisableTiming));
    CUDA_OR_FAIL(cudaEventRecord(joins[i], others[i]));
    CUDA_OR_FAIL(cudaStreamWaitEvent(main, joins[i], 0));
  }

  auto batch = std::make_shared<Batch>();
  for (Op &o : ops) o.comm->refs++;
  batch->ops = std::move(ops);
  char what[96];
  if (batch->ops.size() > 1) snprintf(what, sizeof what, "ncclGroupEnd (%zu operations)", batch->ops.size());
  else snprintf(what, sizeof what, "%s", batch->ops[0].name);
  gl_sim_submit(main, what, [batch] { batch->run(); });
  batch.reset();   /* the work item holds it now */
  /* in sync mode the work has run: what it failed with is this call's error */
  if (gl_sim_sticky() != cudaSuccess)
    return fail(ncclUnhandledCudaError, "%s: %s", fn, cudaGetErrorString(gl_sim_sticky()));

  for (size_t i = 0; i < others.size(); i++) {
    CUDA_OR_FAIL(cudaEventRecord(joins[i], main));
    CUDA_OR_FAIL(cudaStreamWaitEvent(others[i], joins[i], 0));
    CUDA_OR_FAIL(cudaEventDestroy(joins[i]));
  }
  for (ncclComm *c : comms) {
    CUDA_OR_FAIL(cudaEventRecord(c->last_done, main));
    c->last_stream = main;
    c->has_last = true;
  }
#undef CUDA_OR_FAIL
  return ncclSuccess;
}

/* ---- groups (per host thread, as NCCL's) --------------------------------- */
thread_local int group_depth;
thread_local std::vector<Op> group_ops;
thread_local ncclResult_t group_error = ncclSuccess;
thread_local std::string group_error_msg;

/* Checks o, then starts it or adds it to the open group. */
ncclResult_t enqueue(const Op &o) {
  ncclResult_t r = check_op(o);
  if (group_depth > 0) {
    if (r != ncclSuccess && group_error == ncclSuccess) { group_error = r; group_error_msg = last_error; }
    if (r == ncclSuccess) group_ops.push_back(o);
    return r;
  }
  if (r != ncclSuccess) return r;
  return launch(std::vector<Op>{o});
}

Op make_op(Kind k, const char *name, const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
           int root, ncclComm *comm, cudaStream_t stream) {
  Op o;
  o.kind = k;
  o.name = name;
  o.comm = comm;
  o.stream = stream;
  o.send = (const char *)send;
  o.recv = (char *)recv;
  o.count = count;
  o.type = type;
  o.op = op;
  o.root = root;
  /* the sides this rank does not use are not looked at */
  if (k == Kind::Recv) o.send = nullptr;
  if (k == Kind::Send) o.recv = nullptr;
  if (comm && is_live(comm)) {
    if (k == Kind::Broadcast && comm->rank != root) o.send = nullptr;
    if (k == Kind::Reduce && comm->rank != root) o.recv = nullptr;
  }
  return o;
}

}  // namespace

extern "C" {

ncclResult_t ncclGroupStart(void) {
  if (group_depth++ == 0) {
    group_ops.clear();
    group_error = ncclSuccess;
    group_error_msg.clear();
  }
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: no group is open (ncclGroupStart not called)");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<Op> ops;
  ops.swap(group_ops);
  if (group_error != ncclSuccess) {
    ncclResult_t r = group_error;
    group_error = ncclSuccess;
    return fail(r, "%s (an operation of the group failed; nothing was started)", group_error_msg.c_str());
  }
  if (ops.empty()) return ncclSuccess;
  /* a communicator that was destroyed inside the group */
  for (const Op &o : ops) {
    ncclResult_t r = check_comm(o.comm, "ncclGroupEnd");
    if (r != ncclSuccess) return r;
  }
  return launch(std::move(ops));
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::AllReduce, "ncclAllReduce", sendbuff, recvbuff, count, datatype, op, 0, comm, stream));
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::ReduceScatter, "ncclReduceScatter", sendbuff, recvbuff, recvcount, datatype, op, 0,
                         comm, stream));
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::AllGather, "ncclAllGather", sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm,
                         stream));
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::Broadcast, "ncclBroadcast", sendbuff, recvbuff, count, datatype, ncclSum, root, comm,
                         stream));
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::Reduce, "ncclReduce", sendbuff, recvbuff, count, datatype, op, root, comm, stream));
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return enqueue(make_op(Kind::Send, "ncclSend", sendbuff, nullptr, count, datatype, ncclSum, peer, comm, stream));
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return enqueue(make_op(Kind::Recv, "ncclRecv", nullptr, recvbuff, count, datatype, ncclSum, peer, comm, stream));
}

}  // extern "C"
