/* mpi.c — the MPI side of gptlua.dist: bootstrap of the process group
 * (world, node topology, exit handling), the MPI data backend for host
 * tensors (nonblocking MPI collectives, polled by comm.c), and the control
 * channel the timeout watchdog uses to ask every rank what it is doing.
 *
 * Three MPI communicators back the world: the data one (a dup of
 * MPI_COMM_WORLD, errors returned instead of fatal), a control one (another
 * dup, so status queries never match data traffic), and MPI_COMM_WORLD
 * itself for MPI_Abort. */
#define _GNU_SOURCE
#include "internal.h"
#include <mpi.h>
#include <dlfcn.h>
#include <limits.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { TAG_P2P = 7, TAG_QUERY = 11, TAG_REPLY = 12 };

typedef struct mpi_comm { MPI_Comm comm; } mpi_comm;

/* request + int counts/displacements for the v-collectives, which MPI
   reads until the request completes */
typedef struct mpi_work {
  MPI_Request req;
  int *scounts, *sdispls, *rcounts, *rdispls;
  int ints[];
} mpi_work;

static int initialized, finalized;
static gl_comm *world;
static int world_rank = -1;  /* for messages, also after finalize */
static MPI_Comm ctl = MPI_COMM_NULL;

int gl_dist_initialized(void) { return initialized && !finalized; }
gl_comm *gl_dist_world(void) { return gl_dist_initialized() ? world : NULL; }

int gl_dist_cpu_count(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

static int mpi_fail(int err, const char *what) {
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(err, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "error code %d", err);
  return gl_error("%s: MPI: %s", what, s);
}
#define MPI_TRY(call, what) do { int e_ = (call); if (e_ != MPI_SUCCESS) return mpi_fail(e_, (what)); } while (0)

static MPI_Comm comm_of(const gl_comm *c) { return ((const mpi_comm *)c->impl)->comm; }

/* 16-bit floats travel as raw 16-bit words: MPI only moves them (their
   reductions are staged to float32 by comm.c). */
static MPI_Datatype mpi_dtype(int d) {
  switch (d) {
  case GL_F32: return MPI_FLOAT;
  case GL_F64: return MPI_DOUBLE;
  case GL_I32: return MPI_INT32_T;
  case GL_I64: return MPI_INT64_T;
  case GL_BF16: case GL_F16: case GL_U16: return MPI_UINT16_T;
  default: return MPI_UINT8_T;
  }
}

static int int_count(int64_t n, int *out, const char *fn) {
  if (n > INT_MAX)
    return gl_error("%s: %lld elements exceed MPI's int count (%d); split the tensor", fn, (long long)n, INT_MAX);
  *out = (int)n;
  return GL_OK;
}

static int int_counts(const int64_t *c, int n, int *counts, int *displs, const char *fn) {
  int64_t off = 0;
  for (int r = 0; r < n; r++) {
    GL_TRY(int_count(c[r], &counts[r], fn));
    GL_TRY(int_count(off, &displs[r], fn));
    off += c[r];
  }
  return GL_OK;
}

static int all_equal(const int64_t *c, int n) {
  for (int r = 1; r < n; r++) if (c[r] != c[0]) return 0;
  return 1;
}

/* ---- the data backend ---------------------------------------------------- */
static int mpi_start(gl_work *w) {
  const gl_comm *c = w->comm;
  const gl_coll_args *a = &w->args;
  const char *fn = a->label;
  int size = c->size, rank = c->rank, root = a->root, n = 0;
  mpi_work *m = calloc(1, sizeof *m + sizeof(int) * 4 * (size_t)size);
  if (!m) return gl_error("%s: out of host memory", fn);
  w->impl = m;
  m->req = MPI_REQUEST_NULL;
  m->scounts = m->ints; m->sdispls = m->ints + size;
  m->rcounts = m->ints + 2 * size; m->rdispls = m->ints + 3 * size;
  MPI_Comm comm = comm_of(c);
  MPI_Datatype dt = mpi_dtype(w->wire_dtype);
  MPI_Op op = a->op == GL_DIST_MAX ? MPI_MAX : a->op == GL_DIST_MIN ? MPI_MIN : MPI_SUM;
  void *sb = w->send_buf, *rb = w->recv_buf;
  MPI_Request *req = &m->req;

  switch (a->coll) {
  case GL_COLL_ALL_REDUCE:
    GL_TRY(int_count(w->recv_numel, &n, fn));
    MPI_TRY(MPI_Iallreduce(MPI_IN_PLACE, rb, n, dt, op, comm, req), fn);
    break;
  case GL_COLL_REDUCE_SCATTER:
    GL_TRY(int_count(w->send_numel, &n, fn));
    if (all_equal(w->recv_counts, size)) {
      GL_TRY(int_count(w->recv_counts[0], &n, fn));
      MPI_TRY(MPI_Ireduce_scatter_block(sb, rb, n, dt, op, comm, req), fn);
    } else {
      GL_TRY(int_counts(w->recv_counts, size, m->rcounts, m->rdispls, fn));
      MPI_TRY(MPI_Ireduce_scatter(sb, rb, m->rcounts, dt, op, comm, req), fn);
    }
    break;
  case GL_COLL_ALL_GATHER:
    GL_TRY(int_count(w->recv_numel, &n, fn));
    GL_TRY(int_count(w->send_numel, &n, fn));
    if (all_equal(w->recv_counts, size)) {
      MPI_TRY(MPI_Iallgather(sb, n, dt, rb, n, dt, comm, req), fn);
    } else {
      GL_TRY(int_counts(w->recv_counts, size, m->rcounts, m->rdispls, fn));
      MPI_TRY(MPI_Iallgatherv(sb, n, dt, rb, m->rcounts, m->rdispls, dt, comm, req), fn);
    }
    break;
  case GL_COLL_BROADCAST:
    GL_TRY(int_count(w->recv_numel, &n, fn));
    MPI_TRY(MPI_Ibcast(rb, n, dt, root, comm, req), fn);
    break;
  case GL_COLL_REDUCE:
    GL_TRY(int_count(w->recv_numel, &n, fn));
    MPI_TRY(MPI_Ireduce(rank == root ? MPI_IN_PLACE : rb, rank == root ? rb : NULL, n, dt, op, root,
                        comm, req), fn);
    break;
  /* gather, scatter and all_to_all always take the v-form: a rank that
     passed no counts cannot tell whether the others split evenly, and every
     rank must call the same MPI collective */
  case GL_COLL_GATHER:
    GL_TRY(int_count(w->send_numel, &n, fn));
    if (rank == root) GL_TRY(int_counts(w->recv_counts, size, m->rcounts, m->rdispls, fn));
    MPI_TRY(MPI_Igatherv(sb, n, dt, rb, m->rcounts, m->rdispls, dt, root, comm, req), fn);
    break;
  case GL_COLL_SCATTER:
    GL_TRY(int_count(w->recv_numel, &n, fn));
    if (rank == root) GL_TRY(int_counts(w->send_counts, size, m->scounts, m->sdispls, fn));
    MPI_TRY(MPI_Iscatterv(sb, m->scounts, m->sdispls, dt, rb, n, dt, root, comm, req), fn);
    break;
  case GL_COLL_ALL_TO_ALL:
    GL_TRY(int_counts(w->send_counts, size, m->scounts, m->sdispls, fn));
    GL_TRY(int_counts(w->recv_counts, size, m->rcounts, m->rdispls, fn));
    MPI_TRY(MPI_Ialltoallv(sb, m->scounts, m->sdispls, dt, rb, m->rcounts, m->rdispls, dt, comm, req), fn);
    break;
  case GL_COLL_BARRIER:
    MPI_TRY(MPI_Ibarrier(comm, req), fn);
    break;
  case GL_COLL_SEND:
    GL_TRY(int_count(w->send_numel, &n, fn));
    MPI_TRY(MPI_Isend(sb, n, dt, root, TAG_P2P, comm, req), fn);
    break;
  case GL_COLL_RECV:
    GL_TRY(int_count(w->recv_numel, &n, fn));
    MPI_TRY(MPI_Irecv(rb, n, dt, root, TAG_P2P, comm, req), fn);
    break;
  default:
    return gl_error("%s: collective %d unknown to the MPI backend", fn, a->coll);
  }
  return GL_OK;
}

static int mpi_test(gl_work *w, int *done) {
  mpi_work *m = w->impl;
  MPI_Status st;
  int flag = 0;
  MPI_TRY(MPI_Test(&m->req, &flag, &st), w->args.label);
  if (flag && w->args.coll == GL_COLL_RECV) {
    int got = 0;
    MPI_Get_count(&st, mpi_dtype(w->wire_dtype), &got);
    if (got != w->recv_numel)
      return gl_error("recv: rank %d sent %d elements, expected %lld", w->args.root, got,
                      (long long)w->recv_numel);
  }
  *done = flag;
  return GL_OK;
}

static int wrap_comm(gl_comm *c, MPI_Comm comm) {
  mpi_comm *m = malloc(sizeof *m);
  if (!m) { MPI_Comm_free(&comm); return gl_error("gptlua.dist: out of host memory"); }
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  m->comm = comm;
  c->impl = m;
  return GL_OK;
}

static int mpi_split(gl_comm *parent, int color, int key, gl_comm *child) {
  MPI_Comm nc = MPI_COMM_NULL;
  MPI_TRY(MPI_Comm_split(comm_of(parent), child ? color : MPI_UNDEFINED, key, &nc), "split");
  if (!child) {
    if (nc != MPI_COMM_NULL) MPI_Comm_free(&nc);
    return GL_OK;
  }
  int r = -1, s = -1;
  MPI_Comm_rank(nc, &r);
  MPI_Comm_size(nc, &s);
  if (r != child->rank || s != child->size) {
    MPI_Comm_free(&nc);
    return gl_error("split: MPI made rank %d of %d, expected rank %d of %d (ranks disagree on the split)",
                    r, s, child->rank, child->size);
  }
  return wrap_comm(child, nc);
}

static void mpi_destroy(gl_comm *c) {
  mpi_comm *m = c->impl;
  if (!m) return;
  if (!finalized && m->comm != MPI_COMM_NULL) MPI_Comm_free(&m->comm);
  free(m);
  c->impl = NULL;
}

/* ---- control channel ---------------------------------------------------- */
typedef struct ctl_query {
  int64_t seq;
  int32_t p2p;
  int32_t pad_;
  char comm[GL_COMM_NAME_MAX];
} ctl_query;

typedef struct ctl_reply {
  int64_t started;    /* ops started on the asked group; -1: not a member */
  int64_t wait_seq;
  int32_t waiting;    /* blocked in the op described below */
  int32_t pad_;
  char wait_label[32];
  char wait_comm[GL_COMM_NAME_MAX];
} ctl_reply;

static void mpi_serve(const gl_work *waiting) {
  if (!gl_dist_initialized()) return;
  for (;;) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_QUERY, ctl, &flag, &st) != MPI_SUCCESS || !flag) return;
    ctl_query q;
    if (MPI_Recv(&q, sizeof q, MPI_BYTE, st.MPI_SOURCE, TAG_QUERY, ctl, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
    q.comm[sizeof q.comm - 1] = 0;
    ctl_reply r;
    memset(&r, 0, sizeof r);
    const gl_comm *c = gl_comm_find(q.comm);
    r.started = c ? (q.p2p ? c->p2p_seq : c->seq) : -1;
    if (waiting) {
      r.waiting = 1;
      r.wait_seq = waiting->seq;
      snprintf(r.wait_label, sizeof r.wait_label, "%s", waiting->args.label);
      snprintf(r.wait_comm, sizeof r.wait_comm, "%s", waiting->comm->name);
    }
    /* small: goes eagerly, and the asker pre-posted its receive */
    MPI_Send(&r, sizeof r, MPI_BYTE, st.MPI_SOURCE, TAG_REPLY, ctl);
  }
}

/* Asks every rank what it is doing (ranks blocked in gptlua.dist answer from
   their wait loop; a rank busy elsewhere, hung or dead does not), then
   names the members of w's group that have not joined w. */
static void mpi_diagnose(const gl_work *w, char *buf, int n) {
  const gl_comm *c = w->comm;
  int nw = world->size, me = world->rank, p2p = w->args.coll == GL_COLL_SEND || w->args.coll == GL_COLL_RECV;
  /* rep, rr, sr and q stay allocated: the job is about to be aborted with
     requests still posted, and a late reply must not land in freed memory */
  ctl_reply *rep = calloc(nw, sizeof *rep);
  MPI_Request *rr = calloc(nw, sizeof *rr), *sr = calloc(nw, sizeof *sr);
  int *got = calloc(nw, sizeof *got);
  if (!rep || !rr || !sr || !got) { gl_dist_appendf(buf, n, "(out of memory while asking the other ranks)"); return; }
  static ctl_query q;
  memset(&q, 0, sizeof q);
  q.seq = w->seq;
  q.p2p = p2p;
  snprintf(q.comm, sizeof q.comm, "%s", c->name);
  for (int r = 0; r < nw; r++) {
    rr[r] = sr[r] = MPI_REQUEST_NULL;
    if (r == me) continue;
    MPI_Irecv(&rep[r], sizeof rep[r], MPI_BYTE, r, TAG_REPLY, ctl, &rr[r]);
    MPI_Isend(&q, sizeof q, MPI_BYTE, r, TAG_QUERY, ctl, &sr[r]);
  }
  double grace = c->timeout_s * 0.5;
  grace = grace < 0.2 ? 0.2 : grace > 5.0 ? 5.0 : grace;
  double t0 = gl_dist_now();
  for (int pending = nw - 1; pending > 0 && gl_dist_now() - t0 < grace;) {
    for (int r = 0; r < nw; r++) {
      int f = 0;
      if (r != me && !got[r] && MPI_Test(&rr[r], &f, MPI_STATUS_IGNORE) == MPI_SUCCESS && f) { got[r] = 1; pending--; }
    }
    mpi_serve(w);
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  enum { WHY = 400 };
  char *whys = calloc((size_t)c->size, WHY);
  const char **why = calloc((size_t)c->size, sizeof *why);
  if (!whys || !why) { free(whys); free(why); free(got); gl_dist_appendf(buf, n, "(out of memory)"); return; }
  for (int g = 0; g < c->size; g++) {
    if (g == c->rank || (p2p && g != w->args.root)) continue;
    int wr = c->world_ranks[g];
    const ctl_reply *r = &rep[wr];
    if (got[wr] && !p2p && r->started > w->seq) continue;   /* joined */
    char *s = whys + (size_t)g * WHY;
    why[g] = s;
    if (!got[wr])
      gl_dist_appendf(s, WHY, " did not answer (busy outside any collective, hung or dead)");
    else {
      if (!p2p) gl_dist_appendf(s, WHY, " has started %lld collectives on this group and", (long long)r->started);
      if (r->waiting)
        gl_dist_appendf(s, WHY, " is blocked in %s on group '%s' (seq %lld)", r->wait_label, r->wait_comm,
                        (long long)r->wait_seq);
      else
        gl_dist_appendf(s, WHY, " is not blocked");
    }
  }
  gl_dist_verdict(w, why, buf, n);
  free(why);
  free(whys);
  free(got);
}

static void mpi_abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  _exit(code);
}

static const gl_dist_backend mpi_backend = {
  .name = "mpi",
  .host_memory = 1,
  .reduce_dtypes = (1u << GL_F32) | (1u << GL_F64) | (1u << GL_I32) | (1u << GL_I64),
  .start = mpi_start,
  .test = mpi_test,
  .split = mpi_split,
  .destroy = mpi_destroy,
  .serve = mpi_serve,
  .diagnose = mpi_diagnose,
  .abort = mpi_abort,
};

/* ---- process group ------------------------------------------------------- */
void gl_dist_abort(int code, const char *msg) {
  gl_dist_print_abort(world_rank, msg);
  if (gl_dist_initialized()) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
  _exit(code ? code : 1);
}

/* A rank that exits after init without finalising: non-zero status (a Lua
   error, say) takes the whole job down at once instead of leaving the other
   ranks blocked until their timeout; zero finalises as if asked to. */
static void at_process_exit(int status, void *arg) {
  (void)arg;
  if (!gl_dist_initialized()) return;
  if (status != 0) {
    fprintf(stderr, "[rank %d] gptlua.dist: exiting with status %d, aborting every rank\n", world_rank, status);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, status);
  } else if (gl_dist_finalize() != GL_OK) {
    fprintf(stderr, "[rank %d] gptlua.dist: finalize at exit: %s\n", world_rank, gl_last_error());
  }
}

/* LuaJIT loads this library with dlopen(RTLD_LOCAL) and closes it when the
   Lua state goes away; the exit hook lives here, and OpenMPI's plugins need
   libmpi's symbols global.  So: pin this library, promote libmpi. */
static void pin_libraries(void) {
  Dl_info info;
  if (dladdr((void *)gl_dist_init, &info) && info.dli_fname)
    dlopen(info.dli_fname, RTLD_NOW | RTLD_NODELETE | RTLD_NOLOAD);
  if (dladdr((void *)MPI_Init_thread, &info) && info.dli_fname)
    dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NODELETE | RTLD_NOLOAD);
}

/* MPI's collectives malloc and free temporaries as large as the message on
   every call (the reductions above all).  glibc serves big blocks with
   mmap and gives them back at free, so every call pays fresh page faults —
   on a VM that was 0.4 s per 64 MB, eight times the collective itself.
   Keeping freed memory in the heap makes the second call as fast as the
   data allows.  Left alone when the user tunes malloc through the
   environment. */
static void keep_freed_memory(void) {
  if (getenv("MALLOC_MMAP_MAX_") || getenv("MALLOC_TRIM_THRESHOLD_") || getenv("GLIBC_TUNABLES")) return;
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

/* node index and count: the lowest rank on each node leads it */
static int world_topology(MPI_Comm comm, gl_comm *c) {
  MPI_Comm local = MPI_COMM_NULL, leaders = MPI_COMM_NULL;
  MPI_TRY(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &local), "gl_dist_init");
  MPI_Comm_rank(local, &c->local_rank);
  MPI_Comm_size(local, &c->local_size);
  MPI_TRY(MPI_Comm_split(comm, c->local_rank == 0 ? 0 : MPI_UNDEFINED, c->rank, &leaders), "gl_dist_init");
  int node[2] = {0, 1};
  if (leaders != MPI_COMM_NULL) {
    MPI_Comm_rank(leaders, &node[0]);
    MPI_Comm_size(leaders, &node[1]);
    MPI_Comm_free(&leaders);
  }
  MPI_TRY(MPI_Bcast(node, 2, MPI_INT, 0, local), "gl_dist_init");
  MPI_Comm_free(&local);
  c->node = node[0];
  c->nnodes = node[1];
  return GL_OK;
}

/* Only the Lua thread calls MPI (FUNNELED), except in the CUDA simulator
   with GL_SIM_STREAMS=threads: its NCCL (spec/cudasim/nccl_ops.cpp) moves the
   data of CUDA collectives over MPI from the simulated streams' threads. */
static int thread_level(void) {
#ifdef GL_SIM
  const char *s = getenv("GL_SIM_STREAMS");
  if (s && strcmp(s, "threads") == 0) return MPI_THREAD_MULTIPLE;
#endif
  return MPI_THREAD_FUNNELED;
}

int gl_dist_init(double timeout_s) {
  if (!(timeout_s > 0)) return gl_error("gl_dist_init: timeout expected > 0 seconds, got %g", timeout_s);
  if (finalized) return gl_error("gl_dist_init: MPI was finalised and cannot be initialised again");
  if (initialized) { world->timeout_s = timeout_s; return GL_OK; }
  pin_libraries();
  keep_freed_memory();
  int flag = 0, provided = 0;
  MPI_Initialized(&flag);
  if (!flag && MPI_Init_thread(NULL, NULL, thread_level(), &provided) != MPI_SUCCESS)
    return gl_error("gl_dist_init: MPI_Init_thread failed");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  gl_comm *c = gl_comm_alloc(&mpi_backend, "world");
  if (!c) return GL_ERR;
  MPI_Comm data = MPI_COMM_NULL;
  MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
  MPI_Comm_size(MPI_COMM_WORLD, &c->size);
  c->world_rank = c->rank;
  c->is_world = 1;
  c->timeout_s = timeout_s;
  c->world_ranks = malloc(sizeof(int32_t) * c->size);
  if (!c->world_ranks) { gl_comm_free_world(c); return gl_error("gl_dist_init: out of host memory"); }
  for (int r = 0; r < c->size; r++) c->world_ranks[r] = r;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &data) != MPI_SUCCESS || MPI_Comm_dup(MPI_COMM_WORLD, &ctl) != MPI_SUCCESS ||
      wrap_comm(c, data) != GL_OK || world_topology(data, c) != GL_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", gl_last_error());
    gl_comm_free_world(c);
    return gl_error("gl_dist_init: building the world communicator: %s", msg);
  }
  world = c;
  world_rank = c->rank;
  initialized = 1;
  on_exit(at_process_exit, NULL);
  return GL_OK;
}

int gl_dist_finalize(void) {
  if (!gl_dist_initialized()) return GL_OK;
  /* detached work completes first; the barrier (timeout-guarded) keeps
     MPI_Finalize from blocking forever on a rank that never arrives */
  gl_work_drain_detached();
  gl_coll_args b = {.coll = GL_COLL_BARRIER, .label = "finalize"};
  if (gl_comm_run(world, &b) != GL_OK) return GL_ERR;
  gl_comm_free_world(world);
  world = NULL;
  MPI_Comm_free(&ctl);
  finalized = 1;
  MPI_Finalize();
  return GL_OK;
}
