/* nccl.c — the NCCL backend of gptlua.dist: collectives on CUDA tensors.
 *
 * An NCCL communicator is the twin of a host one, MPI or Gloo
 * (gl_nccl_comm_create): the same ranks and topology, the unique id handed
 * over by a broadcast on that parent, and its own CUDA stream.  Every collective is ordered against the device's
 * compute stream with events: the communicator's stream waits for an event
 * recorded on the compute stream when the collective starts (its inputs were
 * written there), and an event recorded after the collective is what the
 * work's test polls, so gl_work_wait returns once the result is in memory
 * and the timeout watchdog of comm.c covers NCCL as it covers MPI.
 * gl_work_wait_device instead makes the compute stream wait for that event
 * (the consumer is device work): no host wait, and the collective overlaps
 * whatever compute was queued between its start and that wait.  The
 * control channel (who is missing after a timeout) is the world's.
 *
 * Mapping: all_reduce, reduce_scatter (even counts), all_gather (even),
 * broadcast and reduce are NCCL collectives; uneven reduce_scatter and
 * all_gather are grouped per-rank reduces and broadcasts; gather, scatter,
 * all_to_all and send/recv are grouped ncclSend/ncclRecv, each rank's own
 * chunk a device copy; barrier is a one-element all_reduce.  Reductions run
 * natively in float32/64, bfloat16, float16, int32 and int64 (avg as
 * ncclAvg); moves go as bytes.  CPU tensors handed to an NCCL communicator
 * are staged through device memory (gptlua.dist routes them to MPI, but the
 * C API must not crash on them).  NCCL cannot check that a recv expects as
 * many elements as its peer sends: mismatched sizes hang until the timeout.
 *
 * Without nccl.h at build time (Makefile: MPI_NCCL_H) only the entry points
 * exist and report that this build has no NCCL. */
#include "internal.h"
#include <stdio.h>
#include <stdlib.h>

#ifndef GL_WITH_NCCL

int gl_nccl_version(void) { return 0; }

/* why this library has no NCCL (the simulator's TCP build defines its own) */
#ifndef GL_NCCL_MISSING
#define GL_NCCL_MISSING "nccl.h was not found, or CUDA was off, when it was built"
#endif

int gl_nccl_comm_create(gl_comm *parent, int device, gl_comm **out) {
  if (out) *out = NULL;
  return gl_error("gl_nccl_comm_create: this build of the %s backend has no NCCL (%s)",
                  parent && parent->backend ? parent->backend->name : "distributed", GL_NCCL_MISSING);
}

#else
#include <cuda_runtime.h>
#include <nccl.h>

typedef struct nccl_comm {
  ncclComm_t comm;
  int device;
  cudaStream_t stream;       /* this communicator's own stream */
  cudaStream_t compute;      /* the device's compute stream (kernels, staging copies) */
  cudaEvent_t ready;         /* recorded on compute when a collective starts */
  cudaEvent_t *spare;        /* events of finished works, for reuse */
  int nspare, spare_cap;
  float *scratch;            /* one float on the device: the barrier's payload */
} nccl_comm;

typedef struct nccl_work {
  cudaEvent_t done;          /* recorded on the stream after the collective */
} nccl_work;

static const gl_dist_backend nccl_backend;

/* ---- checks ------------------------------------------------------------ */
static int nccl_fail(ncclResult_t r, ncclComm_t comm, const char *fn, const char *call) {
  const char *detail = ncclGetLastError(comm);
  return gl_error("%s: %s: NCCL: %s%s%s", fn, call, ncclGetErrorString(r), detail && *detail ? ": " : "",
                  detail ? detail : "");
}
static int cuda_fail(cudaError_t e, const char *fn, const char *call) {
  (void)cudaGetLastError();
  return gl_error("%s: %s: CUDA: %s", fn, call, cudaGetErrorString(e));
}
#define NCCL_TRY(comm, call, fn) do { ncclResult_t r_ = (call); \
    if (r_ != ncclSuccess) return nccl_fail(r_, (comm), (fn), #call); } while (0)
#define CUDA_TRY(call, fn) do { cudaError_t e_ = (call); \
    if (e_ != cudaSuccess) return cuda_fail(e_, (fn), #call); } while (0)

int gl_nccl_version(void) {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

static nccl_comm *impl_of(const gl_comm *c) { return (nccl_comm *)c->impl; }

/* ---- events of finished works are reused ------------------------------- */
static int event_get(nccl_comm *n, cudaEvent_t *ev, const char *fn) {
  if (n->nspare > 0) { *ev = n->spare[--n->nspare]; return GL_OK; }
  CUDA_TRY(cudaEventCreateWithFlags(ev, cudaEventDisableTiming), fn);
  return GL_OK;
}
static void event_put(nccl_comm *n, cudaEvent_t ev) {
  if (n->nspare == n->spare_cap) {
    int cap = n->spare_cap ? 2 * n->spare_cap : 8;
    cudaEvent_t *p = realloc(n->spare, sizeof *p * (size_t)cap);
    if (!p) { cudaEventDestroy(ev); return; }
    n->spare = p;
    n->spare_cap = cap;
  }
  n->spare[n->nspare++] = ev;
}

/* ---- data types -------------------------------------------------------- */
static int nccl_dtype(int d, ncclDataType_t *out) {
  switch (d) {
  case GL_F32: *out = ncclFloat32; return GL_OK;
  case GL_F64: *out = ncclFloat64; return GL_OK;
  case GL_BF16: *out = ncclBfloat16; return GL_OK;
  case GL_F16: *out = ncclFloat16; return GL_OK;
  case GL_I32: *out = ncclInt32; return GL_OK;
  case GL_I64: *out = ncclInt64; return GL_OK;
  default: return gl_error("nccl: no NCCL reduction for %s", gl_dtype_name(d));
  }
}
static ncclRedOp_t nccl_op(int op) {
  return op == GL_DIST_AVG ? ncclAvg : op == GL_DIST_MAX ? ncclMax : op == GL_DIST_MIN ? ncclMin : ncclSum;
}

/* ---- buffers ----------------------------------------------------------- */
static int is_in_place(int coll) {
  return coll == GL_COLL_ALL_REDUCE || coll == GL_COLL_BROADCAST || coll == GL_COLL_REDUCE;
}

/* One side of w in device memory of n's GPU: a CPU tensor (or comm.c's
   host staging buffer) moves into a device buffer, copied in when the
   collective reads it; comm.c copies a staged result back out. */
static int side_on_device(gl_work *w, nccl_comm *n, gl_tensor *view, gl_tensor **stage, void **buf,
                          int copy_in, const char *what) {
  const char *fn = w->args.label;
  if (!view) return GL_OK;
  if (view->device >= 0) {
    if (view->device != n->device)
      return gl_error("%s: %s is on cuda:%d but NCCL communicator '%s' uses cuda:%d", fn, what, view->device,
                      w->comm->name, n->device);
    return GL_OK;
  }
  gl_tensor *d = gl_empty(w->wire_dtype, n->device, view->ndim, view->shape);
  if (!d) return gl_error("%s: staging the CPU %s on cuda:%d: %s", fn, what, n->device, gl_last_error());
  if (copy_in && gl_copy(d, *stage ? *stage : view) != GL_OK) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", gl_last_error());
    gl_tensor_free(d);
    return gl_error("%s: staging the CPU %s on cuda:%d: %s", fn, what, n->device, msg);
  }
  gl_tensor_free(*stage);
  *stage = d;
  *buf = gl_data_ptr(d);
  return GL_OK;
}

static int buffers_on_device(gl_work *w, nccl_comm *n) {
  int in_place = w->args.send && w->args.send == w->args.recv;
  GL_TRY(side_on_device(w, n, w->recv_view, &w->recv_stage, &w->recv_buf, is_in_place(w->args.coll), "tensor"));
  if (in_place) w->send_buf = w->recv_buf;
  else GL_TRY(side_on_device(w, n, w->send_view, &w->send_stage, &w->send_buf, 1, "send tensor"));
  return GL_OK;
}

/* ---- the collectives ---------------------------------------------------- */
static int all_equal(const int64_t *c, int n) {
  for (int r = 1; r < n; r++) if (c[r] != c[0]) return 0;
  return 1;
}

/* a device-to-device copy of this rank's own chunk, on the stream */
static int self_copy(nccl_comm *n, void *dst, const void *src, size_t bytes, const char *fn) {
  if (bytes > 0 && dst != src) CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, n->stream), fn);
  return GL_OK;
}

/* Queues the collective on n->stream.  Grouped calls end their group on
   every path (an open group would swallow the next collective). */
static int enqueue(gl_work *w, nccl_comm *n) {
  const gl_coll_args *a = &w->args;
  const char *fn = a->label;
  ncclComm_t comm = n->comm;
  cudaStream_t st = n->stream;
  int size = w->comm->size, rank = w->comm->rank, root = a->root;
  size_t es = (size_t)gl_dtype_size(w->wire_dtype);
  char *sb = w->send_buf, *rb = w->recv_buf;
  const int64_t *sc = w->send_counts, *rc = w->recv_counts;
  ncclDataType_t dt = ncclFloat32;
  ncclRedOp_t op = nccl_op(a->op);
  if (a->coll == GL_COLL_ALL_REDUCE || a->coll == GL_COLL_REDUCE || a->coll == GL_COLL_REDUCE_SCATTER)
    GL_TRY(nccl_dtype(w->wire_dtype, &dt));
  ncclResult_t r = ncclSuccess;
  const char *call = "";
#define GROUP_CALL(expr) do { if (r == ncclSuccess) { r = (expr); call = #expr; } } while (0)

  switch (a->coll) {
  case GL_COLL_ALL_REDUCE:
    NCCL_TRY(comm, ncclAllReduce(rb, rb, (size_t)w->recv_numel, dt, op, comm, st), fn);
    return GL_OK;
  case GL_COLL_BROADCAST:
    NCCL_TRY(comm, ncclBroadcast(rb, rb, (size_t)w->recv_numel * es, ncclUint8, root, comm, st), fn);
    return GL_OK;
  case GL_COLL_REDUCE:
    NCCL_TRY(comm, ncclReduce(rb, rb, (size_t)w->recv_numel, dt, op, root, comm, st), fn);
    return GL_OK;
  case GL_COLL_BARRIER:
    NCCL_TRY(comm, ncclAllReduce(n->scratch, n->scratch, 1, ncclFloat32, ncclSum, comm, st), fn);
    return GL_OK;
  case GL_COLL_REDUCE_SCATTER:
    if (all_equal(rc, size)) {
      NCCL_TRY(comm, ncclReduceScatter(sb, rb, (size_t)rc[0], dt, op, comm, st), fn);
      return GL_OK;
    }
    /* uneven: rank q's chunk reduced to q; the others pass their own input
       as the output they do not get (an in-place reduce) */
    NCCL_TRY(comm, ncclGroupStart(), fn);
    for (int64_t q = 0, o = 0; q < size; o += rc[q], q++)
      if (rc[q] > 0)
        GROUP_CALL(ncclReduce(sb + o * es, q == rank ? (void *)rb : (void *)(sb + o * es), (size_t)rc[q], dt, op,
                              (int)q, comm, st));
    break;
  case GL_COLL_ALL_GATHER:
    if (all_equal(rc, size)) {
      NCCL_TRY(comm, ncclAllGather(sb, rb, (size_t)rc[0] * es, ncclUint8, comm, st), fn);
      return GL_OK;
    }
    /* uneven: rank q broadcasts its chunk into its place */
    NCCL_TRY(comm, ncclGroupStart(), fn);
    for (int64_t q = 0, o = 0; q < size; o += rc[q], q++)
      if (rc[q] > 0)
        GROUP_CALL(ncclBroadcast(q == rank ? (void *)sb : (void *)(rb + o * es), rb + o * es, (size_t)rc[q] * es,
                                 ncclUint8, (int)q, comm, st));
    break;
  case GL_COLL_GATHER:
    if (rank == root) {
      int64_t o = 0;
      for (int q = 0; q < rank; q++) o += rc[q];
      GL_TRY(self_copy(n, rb + o * es, sb, (size_t)rc[rank] * es, fn));
    }
    NCCL_TRY(comm, ncclGroupStart(), fn);
    if (rank != root) {
      if (w->send_numel > 0) GROUP_CALL(ncclSend(sb, (size_t)w->send_numel * es, ncclUint8, root, comm, st));
    } else {
      for (int64_t q = 0, o = 0; q < size; o += rc[q], q++)
        if (q != rank && rc[q] > 0)
          GROUP_CALL(ncclRecv(rb + o * es, (size_t)rc[q] * es, ncclUint8, (int)q, comm, st));
    }
    break;
  case GL_COLL_SCATTER:
    if (rank == root) {
      int64_t o = 0;
      for (int q = 0; q < rank; q++) o += sc[q];
      GL_TRY(self_copy(n, rb, sb + o * es, (size_t)sc[rank] * es, fn));
    }
    NCCL_TRY(comm, ncclGroupStart(), fn);
    if (rank != root) {
      if (w->recv_numel > 0) GROUP_CALL(ncclRecv(rb, (size_t)w->recv_numel * es, ncclUint8, root, comm, st));
    } else {
      for (int64_t q = 0, o = 0; q < size; o += sc[q], q++)
        if (q != rank && sc[q] > 0)
          GROUP_CALL(ncclSend(sb + o * es, (size_t)sc[q] * es, ncclUint8, (int)q, comm, st));
    }
    break;
  case GL_COLL_ALL_TO_ALL: {
    if (sc[rank] != rc[rank])
      return gl_error("%s: sends itself %lld elements but expects %lld from itself", fn, (long long)sc[rank],
                      (long long)rc[rank]);
    int64_t so = 0, ro = 0;
    for (int q = 0; q < rank; q++) { so += sc[q]; ro += rc[q]; }
    GL_TRY(self_copy(n, rb + ro * es, sb + so * es, (size_t)sc[rank] * es, fn));
    NCCL_TRY(comm, ncclGroupStart(), fn);
    so = ro = 0;
    for (int64_t q = 0; q < size; so += sc[q], ro += rc[q], q++) {
      if (q == rank) continue;
      if (sc[q] > 0) GROUP_CALL(ncclSend(sb + so * es, (size_t)sc[q] * es, ncclUint8, (int)q, comm, st));
      if (rc[q] > 0) GROUP_CALL(ncclRecv(rb + ro * es, (size_t)rc[q] * es, ncclUint8, (int)q, comm, st));
    }
    break;
  }
  case GL_COLL_SEND:
    if (w->send_numel > 0) NCCL_TRY(comm, ncclSend(sb, (size_t)w->send_numel * es, ncclUint8, root, comm, st), fn);
    return GL_OK;
  case GL_COLL_RECV:
    if (w->recv_numel > 0) NCCL_TRY(comm, ncclRecv(rb, (size_t)w->recv_numel * es, ncclUint8, root, comm, st), fn);
    return GL_OK;
  default:
    return gl_error("%s: collective %d unknown to the NCCL backend", fn, a->coll);
  }
#undef GROUP_CALL
  /* the grouped cases end here */
  ncclResult_t end = ncclGroupEnd();
  if (r != ncclSuccess) return nccl_fail(r, comm, fn, call);
  if (end != ncclSuccess) return nccl_fail(end, comm, fn, "ncclGroupEnd()");
  return GL_OK;
}

static int nccl_start(gl_work *w) {
  nccl_comm *n = impl_of(w->comm);
  const char *fn = w->args.label;
  nccl_work *nw = calloc(1, sizeof *nw);
  if (!nw) return gl_error("%s: out of host memory", fn);
  w->impl = nw;   /* freed by comm.c */
  CUDA_TRY(cudaSetDevice(n->device), fn);
  GL_TRY(buffers_on_device(w, n));
  /* inputs were written (and staged) on the compute stream */
  CUDA_TRY(cudaEventRecord(n->ready, n->compute), fn);
  CUDA_TRY(cudaStreamWaitEvent(n->stream, n->ready, 0), fn);
  GL_TRY(enqueue(w, n));
  cudaEvent_t done;
  GL_TRY(event_get(n, &done, fn));
  cudaError_t e = cudaEventRecord(done, n->stream);
  if (e != cudaSuccess) { event_put(n, done); return cuda_fail(e, fn, "cudaEventRecord(done, stream)"); }
  nw->done = done;
  return GL_OK;
}

/* Done once the event after the collective has passed.  While it has not,
   an asynchronous NCCL error (a peer that died, a network failure) fails
   the work instead of leaving it to the timeout. */
static int nccl_test(gl_work *w, int *done) {
  nccl_comm *n = impl_of(w->comm);
  nccl_work *nw = w->impl;
  const char *fn = w->args.label;
  *done = 0;
  cudaError_t e = cudaEventQuery(nw->done);
  if (e == cudaSuccess) {
    event_put(n, nw->done);
    nw->done = NULL;
    *done = 1;
    return GL_OK;
  }
  ncclResult_t async = ncclSuccess, r = ncclSuccess;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    r = ncclCommGetAsyncError(n->comm, &async);
    if (r == ncclSuccess && (async == ncclSuccess || async == ncclInProgress)) return GL_OK;
  }
  /* failed: the event may never pass, so it is not reused */
  cudaEventDestroy(nw->done);
  nw->done = NULL;
  if (e != cudaErrorNotReady) return cuda_fail(e, fn, "cudaEventQuery(done)");
  if (r != ncclSuccess) return nccl_fail(r, n->comm, fn, "ncclCommGetAsyncError");
  return nccl_fail(async, n->comm, fn, "in flight");
}

/* The consumer is device work: the compute stream waits for the event after
   the collective; the host does not.  nccl_test still polls the event (the
   work stays watched for its timeout and recycles the event once it has
   passed; a wait already queued keeps the record it saw). */
static int nccl_device_wait(gl_work *w) {
  nccl_comm *n = impl_of(w->comm);
  nccl_work *nw = w->impl;
  const char *fn = w->args.label;
  CUDA_TRY(cudaSetDevice(n->device), fn);
  CUDA_TRY(cudaStreamWaitEvent(n->compute, nw->done, 0), fn);
  return GL_OK;
}

/* ---- communicators ------------------------------------------------------- */
static void free_impl(nccl_comm *n) {
  if (!n) return;
  cudaSetDevice(n->device);
  if (n->comm) ncclCommDestroy(n->comm);
  for (int i = 0; i < n->nspare; i++) cudaEventDestroy(n->spare[i]);
  if (n->ready) cudaEventDestroy(n->ready);
  if (n->stream) cudaStreamDestroy(n->stream);
  if (n->scratch) cudaFree(n->scratch);
  (void)cudaGetLastError();
  free(n->spare);
  free(n);
}

static void nccl_destroy(gl_comm *c) {
  free_impl(impl_of(c));
  c->impl = NULL;
}

/* Gives c (fields set) the NCCL state around comm, which it then owns. */
static int attach(gl_comm *c, ncclComm_t comm, int device, const char *fn) {
  nccl_comm *n = calloc(1, sizeof *n);
  if (!n) { ncclCommDestroy(comm); return gl_error("%s: out of host memory", fn); }
  n->comm = comm;
  n->device = device;
  c->impl = n;   /* from here nccl_destroy releases whatever was made */
  n->compute = (cudaStream_t)gl_cuda_stream(device, GL_STREAM_COMPUTE);
  if (!n->compute) return gl_error("%s: the compute stream of cuda:%d: %s", fn, device, gl_last_error());
  CUDA_TRY(cudaSetDevice(device), fn);
  /* non-blocking: the legacy default stream never waits on a collective
     that itself waits for a peer */
  CUDA_TRY(cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking), fn);
  CUDA_TRY(cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming), fn);
  CUDA_TRY(cudaMalloc((void **)&n->scratch, sizeof(float)), fn);
  return GL_OK;
}

static int nccl_split(gl_comm *parent, int color, int key, gl_comm *child) {
  const char *fn = "split";
  nccl_comm *p = impl_of(parent);
  CUDA_TRY(cudaSetDevice(p->device), fn);
  ncclComm_t nc = NULL;
  ncclResult_t res = ncclCommSplit(p->comm, child ? color : NCCL_SPLIT_NOCOLOR, key, &nc, NULL);
  if (res != ncclSuccess) {
    if (nc) ncclCommAbort(nc);
    return nccl_fail(res, p->comm, fn, "ncclCommSplit");
  }
  if (!child) {
    if (nc) ncclCommDestroy(nc);
    return GL_OK;
  }
  int r = -1, s = -1;
  if (!nc || ncclCommUserRank(nc, &r) != ncclSuccess || ncclCommCount(nc, &s) != ncclSuccess ||
      r != child->rank || s != child->size) {
    if (nc) ncclCommAbort(nc);
    return gl_error("split: NCCL made rank %d of %d, expected rank %d of %d (ranks disagree on the split)", r, s,
                    child->rank, child->size);
  }
  return attach(child, nc, p->device, fn);
}

/* the control channel and abort are the MPI world's */
static const gl_dist_backend *world_backend(void) {
  gl_comm *wd = gl_dist_world();
  return wd && wd->backend != &nccl_backend ? wd->backend : NULL;
}
static void nccl_serve(const gl_work *waiting) {
  const gl_dist_backend *b = world_backend();
  if (b && b->serve) b->serve(waiting);
}
static void nccl_diagnose(const gl_work *w, char *buf, int n) {
  const gl_dist_backend *b = world_backend();
  if (b && b->diagnose) b->diagnose(w, buf, n);
}
static void nccl_abort(int code) { gl_dist_abort(code, NULL); }

static const gl_dist_backend nccl_backend = {
  .name = "nccl",
  .host_memory = 0,
  .reduce_dtypes = (1u << GL_F32) | (1u << GL_F64) | (1u << GL_BF16) | (1u << GL_F16) | (1u << GL_I32) |
                   (1u << GL_I64),
  .start = nccl_start,
  .test = nccl_test,
  .split = nccl_split,
  .destroy = nccl_destroy,
  .serve = nccl_serve,
  .diagnose = nccl_diagnose,
  .abort = nccl_abort,
  .device_wait = nccl_device_wait,
};

/* What rank 0 broadcasts: whether it made an id, and the id. */
typedef struct id_message {
  int64_t ok;
  ncclUniqueId id;
} id_message;

/* Every rank's verdict over parent (MPI): 1 only if all passed 1. */
static int all_agree(gl_comm *parent, int mine, const char *label, int *all) {
  int32_t v = mine;
  int64_t one = 1;
  gl_tensor *t = gl_from_external(&v, sizeof v, GL_I32, 1, &one);
  if (!t) return GL_ERR;
  gl_coll_args a = {.coll = GL_COLL_ALL_REDUCE, .op = GL_DIST_MIN, .send = t, .recv = t, .label = label};
  int rc = gl_comm_run(parent, &a);
  gl_tensor_free(t);
  *all = v;
  return rc;
}

/* The local half of creating the communicator: device, id, init. */
static int init_rank(gl_comm *parent, int device, id_message *msg, ncclComm_t *comm, const char *fn) {
  CUDA_TRY(cudaSetDevice(device), fn);
  NCCL_TRY(NULL, ncclCommInitRank(comm, parent->size, msg->id, parent->rank), fn);
  return GL_OK;
}

int gl_nccl_comm_create(gl_comm *parent, int device, gl_comm **out) {
  const char *fn = "gl_nccl_comm_create";
  if (!out) return gl_error("%s: out is NULL", fn);
  *out = NULL;
  if (!parent || parent->refcount <= 0) return gl_error("%s: parent is not a live communicator", fn);
  if (!parent->backend->host_memory)
    return gl_error("%s: parent expected a host-memory communicator, MPI or Gloo (the unique id travels over "
                    "it), got '%s' (%s)", fn,
                    parent->name, parent->backend->name);
  int ndev = gl_cuda_device_count();
  if (device < 0 || device >= ndev)
    return gl_error("%s: cuda:%d requested but %d CUDA device(s) are available", fn, device, ndev);
  if (!gl_cuda_stream(device, GL_STREAM_COMPUTE)) return GL_ERR;   /* the device works */

  /* rank 0 makes the id; everyone learns whether it could */
  id_message msg;
  memset(&msg, 0, sizeof msg);
  char why[512] = "";
  if (parent->rank == 0) {
    ncclResult_t r = cudaSetDevice(device) == cudaSuccess ? ncclGetUniqueId(&msg.id) : ncclUnhandledCudaError;
    msg.ok = r == ncclSuccess;
    if (!msg.ok) snprintf(why, sizeof why, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  }
  int64_t nbytes = sizeof msg;
  gl_tensor *t = gl_from_external(&msg, sizeof msg, GL_U8, 1, &nbytes);
  if (!t) return GL_ERR;
  gl_coll_args b = {.coll = GL_COLL_BROADCAST, .root = 0, .send = t, .recv = t, .label = "nccl unique id"};
  int rc = gl_comm_run(parent, &b);
  gl_tensor_free(t);
  if (rc != GL_OK) return GL_ERR;
  if (!msg.ok) return gl_error("%s: rank 0 of '%s' could not make an NCCL unique id%s%s", fn, parent->name,
                               *why ? ": " : "", why);

  /* ncclCommInitRank meets every rank: NCCL refuses two ranks on one GPU
     (each rank gets the error).  The verdicts are then shared, so all ranks
     keep the communicator or none does.  A communicator whose init failed
     is still allocated, in an error state that only ncclCommAbort frees. */
  ncclComm_t comm = NULL;
  int ok = init_rank(parent, device, &msg, &comm, fn) == GL_OK;
  if (!ok) snprintf(why, sizeof why, "%s", gl_last_error());
  int all = 0;
  if (all_agree(parent, ok, "nccl init", &all) != GL_OK) {
    if (comm) ncclCommAbort(comm);
    return GL_ERR;
  }
  if (!all) {
    if (comm) ncclCommAbort(comm);
    if (!ok) return gl_error("%s", why);
    return gl_error("%s: another rank of '%s' could not join the NCCL communicator (see its error)", fn, parent->name);
  }

  char name[GL_COMM_NAME_MAX + 8];
  snprintf(name, sizeof name, "%s/nccl", parent->name);
  gl_comm *c = gl_comm_alloc(&nccl_backend, name);
  if (!c) { ncclCommDestroy(comm); return GL_ERR; }
  c->rank = parent->rank;
  c->size = parent->size;
  c->local_rank = parent->local_rank;
  c->local_size = parent->local_size;
  c->node = parent->node;
  c->nnodes = parent->nnodes;
  c->world_rank = parent->world_rank;
  c->timeout_s = parent->timeout_s;
  c->world_ranks = malloc(sizeof(int32_t) * (size_t)parent->size);
  if (!c->world_ranks) {
    ncclCommDestroy(comm);
    gl_comm_free(c);
    return gl_error("%s: out of host memory", fn);
  }
  memcpy(c->world_ranks, parent->world_ranks, sizeof(int32_t) * (size_t)parent->size);
  if (attach(c, comm, device, fn) != GL_OK) {
    char msg2[512];
    snprintf(msg2, sizeof msg2, "%s", gl_last_error());
    gl_comm_free(c);
    return gl_error("%s", msg2);
  }
  *out = c;
  return GL_OK;
}

#endif
