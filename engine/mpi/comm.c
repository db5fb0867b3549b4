/* comm.c — the backend-neutral half of the communicators: argument checks,
 * staging, work handles, sequence numbers, the timeout-guarded wait loop and
 * split.  The bytes are moved by the communicator's backend vtable (mpi.c;
 * an NCCL backend plugs in the same way).  See gl_dist.h for the contract. */
#include "internal.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sched.h>

static const char *coll_names[GL_COLL_COUNT] = {
  "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
  "scatter", "all_to_all", "barrier", "send", "recv"};
static const char *op_names[GL_DIST_NOPS] = {"sum", "avg", "max", "min"};

const char *gl_coll_name(int coll) {
  return (coll >= 0 && coll < GL_COLL_COUNT) ? coll_names[coll] : "invalid-collective";
}
const char *gl_dist_op_name(int op) {
  return (op >= 0 && op < GL_DIST_NOPS) ? op_names[op] : "invalid-op";
}

double gl_dist_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- registry of live communicators (the watchdog looks them up by name) */
static gl_comm *live_comms;

gl_comm *gl_comm_alloc(const gl_dist_backend *b, const char *name) {
  GL_NONNULL_OR(NULL, "gl_comm_alloc", name);
  gl_comm *c = calloc(1, sizeof *c);
  if (!c) return gl_error_null("gl_comm_alloc: out of host memory");
  c->backend = b;
  c->refcount = 1;
  snprintf(c->name, sizeof c->name, "%s", name);
  c->next_live = live_comms;
  live_comms = c;
  return c;
}

gl_comm *gl_comm_find(const char *name) {
  GL_NONNULL_OR(NULL, "gl_comm_find", name);
  for (gl_comm *c = live_comms; c; c = c->next_live)
    if (strcmp(c->name, name) == 0) return c;
  return NULL;
}

static void comm_decref(gl_comm *c) {
  if (--c->refcount > 0) return;
  for (gl_comm **p = &live_comms; *p; p = &(*p)->next_live)
    if (*p == c) { *p = c->next_live; break; }
  if (c->backend && c->backend->destroy) c->backend->destroy(c);
  free(c->world_ranks);
  free(c);
}

void gl_comm_free(gl_comm *c) {
  if (!c || c->is_world || c->refcount <= 0) return;
  comm_decref(c);
}

/* The world is dropped by gl_dist_finalize through this (mpi.c). */
void gl_comm_free_world(gl_comm *c) {
  if (!c) return;
  c->is_world = 0;
  comm_decref(c);
}

int gl_comm_set_timeout(gl_comm *c, double timeout_s) {
  GL_NONNULL("gl_comm_set_timeout", c);
  if (c->refcount <= 0) return gl_error("gl_comm_set_timeout: comm is not a live communicator");
  if (!(timeout_s > 0)) return gl_error("gl_comm_set_timeout: timeout expected > 0 seconds, got %g", timeout_s);
  c->timeout_s = timeout_s;
  return GL_OK;
}

/* ---- works ----------------------------------------------------------- */
static gl_work *detached;   /* freed by their owner while in flight */

static void release_buffers(gl_work *w) {
  gl_tensor_free(w->send_view);  gl_tensor_free(w->recv_view);
  gl_tensor_free(w->send_stage); gl_tensor_free(w->recv_stage);
  w->send_view = w->recv_view = w->send_stage = w->recv_stage = NULL;
  w->send_buf = w->recv_buf = NULL;
}

static void work_destroy(gl_work *w) {
  release_buffers(w);
  free(w->impl);
  free(w->send_counts);
  free(w->recv_counts);
  comm_decref(w->comm);
  free(w);
}

static int is_reduction(int coll) {
  return coll == GL_COLL_ALL_REDUCE || coll == GL_COLL_REDUCE_SCATTER || coll == GL_COLL_REDUCE;
}
static int is_in_place(int coll) {
  return coll == GL_COLL_ALL_REDUCE || coll == GL_COLL_BROADCAST || coll == GL_COLL_REDUCE;
}
static int is_p2p(int coll) { return coll == GL_COLL_SEND || coll == GL_COLL_RECV; }

/* Does the result land in this rank's recv tensor? */
static int receives(const gl_work *w) {
  const gl_comm *c = w->comm;
  switch (w->args.coll) {
  case GL_COLL_BROADCAST: return c->rank != w->args.root;
  case GL_COLL_REDUCE: case GL_COLL_GATHER: return c->rank == w->args.root;
  case GL_COLL_BARRIER: case GL_COLL_SEND: return 0;
  default: return 1;
  }
}

/* Scales the reduced wire buffer for avg (host-memory backends reduce avg
   as a sum; device backends are handed GL_DIST_AVG and do it themselves). */
#define GL_SCALE_LOOP(T) do { T *p = (T *)buf; T s = (T)scale; \
    for (int64_t i = 0; i < n; i++) p[i] *= s; } while (0)
static void scale_buffer(void *buf, int dtype, int64_t n, double scale) {
  if (dtype == GL_F32) GL_SCALE_LOOP(float);
  else if (dtype == GL_F64) GL_SCALE_LOOP(double);
}
#undef GL_SCALE_LOOP

/* The backend reported completion: average, copy staged results out, and
   drop the work's hold on the tensors. */
static int work_complete(gl_work *w) {
  int rc = GL_OK;
  if (receives(w)) {
    if (w->args.op == GL_DIST_AVG && is_reduction(w->args.coll) && w->comm->backend->host_memory)
      scale_buffer(w->recv_buf, w->wire_dtype, w->recv_numel, 1.0 / w->comm->size);
    if (w->recv_stage && gl_copy(w->recv_view, w->recv_stage) != GL_OK) {
      snprintf(w->error, sizeof w->error, "%s: copying the result out of the staging buffer: %s",
               w->args.label, gl_last_error());
      rc = GL_ERR;
    }
  }
  w->state = rc == GL_OK ? GL_WORK_DONE : GL_WORK_FAILED;
  release_buffers(w);
  return rc;
}

static int work_progress(gl_work *w, int *done) {
  *done = 0;
  if (w->state != GL_WORK_RUNNING) { *done = 1; return w->state == GL_WORK_DONE ? GL_OK : GL_ERR; }
  int fin = 0;
  if (w->comm->backend->test(w, &fin) != GL_OK) {
    snprintf(w->error, sizeof w->error, "%s", gl_last_error());
    w->state = GL_WORK_FAILED;
    release_buffers(w);
    *done = 1;
    return GL_ERR;
  }
  if (!fin) return GL_OK;
  *done = 1;
  return work_complete(w);
}

static void timed_out(const gl_work *w, double timeout);

/* Detached works complete in the background: every entry point moves them
   on.  One the compute stream waits for (gl_work_wait_device) has no host
   waiter, so its timeout is watched here. */
static void progress_detached(void) {
  for (gl_work **p = &detached; *p;) {
    gl_work *w = *p;
    int done;
    work_progress(w, &done);
    if (done) { *p = w->next_detached; work_destroy(w); continue; }
    double timeout = w->comm->timeout_s;
    if (w->device_waited && timeout > 0 && gl_dist_now() - w->started_at > timeout) timed_out(w, timeout);
    p = &w->next_detached;
  }
}

int gl_dist_progress(void) {
  gl_comm *w = gl_dist_world();
  if (!w) return gl_error("gl_dist_progress: gptlua.dist is not initialised (or already finalised)");
  progress_detached();
  if (w->backend->serve) w->backend->serve(NULL);   /* polls the backend, not blocked in anything */
  return GL_OK;
}

void gl_work_drain_detached(void) {
  while (detached) {
    gl_work *w = detached;
    detached = w->next_detached;
    gl_work_wait(w);
    work_destroy(w);
  }
}

static int failed_error(const gl_work *w) {
  return gl_error("%s on group '%s' (seq %lld) failed: %s", w->args.label, w->comm->name,
                  (long long)w->seq, w->error);
}

int gl_work_test(gl_work *w, int *done) {
  if (!w || !done) return gl_error("gl_work_test: work and done must not be NULL");
  progress_detached();
  if (work_progress(w, done) != GL_OK) return failed_error(w);
  return GL_OK;
}

static void sleep_us(long us) {
  struct timespec ts = {0, us * 1000};
  nanosleep(&ts, NULL);
}

/* Polls until done.  MPI moves large messages in fragments that advance
   only while someone polls, so the loop spins for the first millisecond,
   then yields between polls (full speed, yet an oversubscribed core goes to
   a rank that still computes), and only after two seconds, when it is
   waiting on a peer rather than on bandwidth, sleeps between polls.  It
   also answers the control channel so a peer that timed out can learn what
   this rank is doing. */
/* On timeout: ask the backend who is missing, print, end every rank. */
static void timed_out(const gl_work *w, double timeout) {
  const gl_comm *c = w->comm;
  char why[3000], me[64], msg[3600];
  why[0] = 0;
  if (c->backend->diagnose) c->backend->diagnose(w, why, sizeof why);
  if (c->is_world) snprintf(me, sizeof me, "rank %d", c->rank);
  else snprintf(me, sizeof me, "rank %d (world rank %d)", c->rank, c->world_rank);
  if (is_p2p(w->args.coll))
    snprintf(msg, sizeof msg,
             "gptlua.dist: timeout: %s %s rank %d on group '%s' (p2p seq %lld) did not complete "
             "within %.1f s on %s. %s",
             w->args.label, w->args.coll == GL_COLL_SEND ? "to" : "from", w->args.root, c->name,
             (long long)w->seq, timeout, me, why);
  else
    snprintf(msg, sizeof msg,
             "gptlua.dist: timeout: %s on group '%s' (seq %lld, %d ranks) did not complete "
             "within %.1f s on %s. %s",
             w->args.label, c->name, (long long)w->seq, c->size, timeout, me, why);
  gl_dist_abort(3, msg);
}

static int64_t device_host_waits;   /* gl_dist_device_host_waits */
int64_t gl_dist_device_host_waits(void) { return device_host_waits; }

int gl_work_wait(gl_work *w) {
  if (!w) return gl_error("gl_work_wait: work is NULL");
  const gl_dist_backend *b = w->comm->backend;
  double t0 = gl_dist_now(), timeout = w->comm->timeout_s;
  if (!b->host_memory && w->state == GL_WORK_RUNNING) device_host_waits++;
  for (long iter = 0;; iter++) {
    int done;
    if (work_progress(w, &done) != GL_OK) return failed_error(w);
    if (done) return GL_OK;
    double waited = gl_dist_now() - t0;
    if ((iter & 63) == 0) {
      progress_detached();
      if (b->serve) b->serve(w);
      if (timeout > 0 && waited > timeout) timed_out(w, timeout);
    }
    if (waited > 2.0) sleep_us(50);
    else if (waited > 0.001) sched_yield();
  }
}

int gl_work_wait_device(gl_work *w) {
  if (!w) return gl_error("gl_work_wait_device: work is NULL");
  const gl_dist_backend *b = w->comm->backend;
  if (w->state != GL_WORK_RUNNING || !b->device_wait) return gl_work_wait(w);
  if (w->device_waited) return GL_OK;
  progress_detached();
  if (b->device_wait(w) != GL_OK) {
    snprintf(w->error, sizeof w->error, "%s", gl_last_error());
    w->state = GL_WORK_FAILED;
    release_buffers(w);
    return failed_error(w);
  }
  w->device_waited = 1;
  /* staged results are copied out on the compute stream, behind its wait;
     the buffers go back with every later use ordered after the collective */
  if (receives(w) && w->recv_stage && gl_copy(w->recv_view, w->recv_stage) != GL_OK) {
    snprintf(w->error, sizeof w->error, "%s: copying the result out of the staging buffer: %s", w->args.label,
             gl_last_error());
    w->state = GL_WORK_FAILED;
    release_buffers(w);
    return failed_error(w);
  }
  release_buffers(w);
  return GL_OK;
}

void gl_work_free(gl_work *w) {
  if (!w) return;
  if (w->state == GL_WORK_RUNNING) {
    w->detached = 1;
    w->next_detached = detached;
    detached = w;
    return;
  }
  work_destroy(w);
}

/* ---- argument checks -------------------------------------------------- */
static int check_tensor(const gl_tensor *t, const char *fn, const char *arg, int output) {
  GL_CHECK_T(t, fn, arg);
  if (output) GL_TRY(gl_check_no_zero_stride(t, fn, arg));
  return GL_OK;
}

/* Fills dst (size entries) from the caller's counts or the even split of
   total; checks every count is >= 0 and, when given, that they add up. */
static int fill_counts(int64_t *dst, const int64_t *given, int size, int64_t total,
                       int total_known, const char *fn, const char *what) {
  if (given) {
    int64_t sum = 0;
    for (int r = 0; r < size; r++) {
      if (given[r] < 0) return gl_error("%s: %s[%d] expected >= 0, got %lld", fn, what, r + 1, (long long)given[r]);
      dst[r] = given[r];
      sum += given[r];
    }
    if (total_known && sum != total)
      return gl_error("%s: %s add up to %lld elements but the tensor has %lld", fn, what,
                      (long long)sum, (long long)total);
    return GL_OK;
  }
  if (total % size != 0)
    return gl_error("%s: tensor of %lld elements does not split evenly over %d ranks "
                    "(pass per-rank counts or pad it)", fn, (long long)total, size);
  for (int r = 0; r < size; r++) dst[r] = total / size;
  return GL_OK;
}

static int check_numel(const gl_tensor *t, int64_t expect, const char *fn, const char *arg, const char *why) {
  if (t->numel != expect)
    return gl_error("%s: %s expected %lld elements (%s), got %lld", fn, arg, (long long)expect, why,
                    (long long)t->numel);
  return GL_OK;
}

/* Validates a and fills w's tensors and counts; nothing is started yet. */
static int setup_args(gl_work *w, const gl_coll_args *a) {
  gl_comm *c = w->comm;
  const char *fn = w->args.label;
  int coll = a->coll, size = c->size, rank = c->rank;
  gl_tensor *send = a->send, *recv = a->recv;

  if (is_reduction(coll) && (a->op < 0 || a->op >= GL_DIST_NOPS))
    return gl_error("%s: op expected sum, avg, max or min (0..%d), got %d", fn, GL_DIST_NOPS - 1, a->op);
  int rooted = coll == GL_COLL_BROADCAST || coll == GL_COLL_REDUCE || coll == GL_COLL_GATHER ||
               coll == GL_COLL_SCATTER;
  if ((rooted || is_p2p(coll)) && (a->root < 0 || a->root >= size))
    return gl_error("%s: %s expected a rank in 0..%d, got %d", fn, is_p2p(coll) ? "peer" : "root",
                    size - 1, a->root);
  if (is_p2p(coll) && a->root == rank)
    return gl_error("%s: peer expected a rank other than this one (%d)", fn, rank);

  if (is_in_place(coll)) {
    gl_tensor *t = recv ? recv : send;
    if (send && recv && send != recv)
      return gl_error("%s: works in place, expected the same tensor as send and recv", fn);
    GL_TRY(check_tensor(t, fn, "tensor", 1));
    send = recv = t;
  } else if (coll == GL_COLL_BARRIER) {
    send = recv = NULL;
  } else {
    int need_send = coll != GL_COLL_RECV && !(coll == GL_COLL_SCATTER && rank != a->root);
    int need_recv = coll != GL_COLL_SEND && !(coll == GL_COLL_GATHER && rank != a->root);
    if (!need_send) send = NULL;
    if (!need_recv) recv = NULL;
    if (need_send) GL_TRY(check_tensor(send, fn, "send", 0));
    if (need_recv) GL_TRY(check_tensor(recv, fn, "recv", 1));
    if (send && recv && send->dtype != recv->dtype)
      return gl_error("%s: send is %s but recv is %s, expected one dtype", fn,
                      gl_dtype_name(send->dtype), gl_dtype_name(recv->dtype));
  }
  gl_tensor *any = recv ? recv : send;
  if (is_reduction(coll)) {
    int d = any->dtype;
    if (!(d == GL_F32 || d == GL_F64 || d == GL_BF16 || d == GL_F16 || d == GL_I32 || d == GL_I64))
      return gl_error("%s: reductions expected float32, float64, bfloat16, float16, int32 or int64, got %s",
                      fn, gl_dtype_name(d));
    if (a->op == GL_DIST_AVG && !gl_is_float(d))
      return gl_error("%s: avg expected a floating dtype, got %s (use sum)", fn, gl_dtype_name(d));
  }

  w->send_counts = calloc(size, sizeof(int64_t));
  w->recv_counts = calloc(size, sizeof(int64_t));
  if (!w->send_counts || !w->recv_counts) return gl_error("%s: out of host memory", fn);
  int64_t *sc = w->send_counts, *rc = w->recv_counts;
  switch (coll) {
  case GL_COLL_ALL_REDUCE: case GL_COLL_BROADCAST: case GL_COLL_REDUCE:
  case GL_COLL_SEND: case GL_COLL_RECV:
    break;
  case GL_COLL_BARRIER:
    break;
  case GL_COLL_REDUCE_SCATTER:
    if (a->recv_counts) {
      GL_TRY(fill_counts(rc, a->recv_counts, size, send->numel, 1, fn, "counts"));
      GL_TRY(check_numel(recv, rc[rank], fn, "recv", "counts[rank]"));
    } else {
      GL_TRY(fill_counts(rc, NULL, size, send->numel, 1, fn, "counts"));
      GL_TRY(check_numel(recv, rc[rank], fn, "recv", "send's numel / ranks"));
    }
    break;
  case GL_COLL_ALL_GATHER:
    if (a->recv_counts) {
      GL_TRY(fill_counts(rc, a->recv_counts, size, recv->numel, 1, fn, "counts"));
      GL_TRY(check_numel(send, rc[rank], fn, "send", "counts[rank]"));
    } else {
      GL_TRY(fill_counts(rc, NULL, size, recv->numel, 1, fn, "counts"));
      GL_TRY(check_numel(send, rc[rank], fn, "send", "recv's numel / ranks"));
    }
    break;
  case GL_COLL_GATHER:
    if (rank == a->root) {
      GL_TRY(fill_counts(rc, a->recv_counts, size, recv->numel, 1, fn, "counts"));
      GL_TRY(check_numel(send, rc[rank], fn, "send", a->recv_counts ? "counts[rank]" : "recv's numel / ranks"));
    } else if (a->recv_counts) {
      GL_TRY(fill_counts(rc, a->recv_counts, size, 0, 0, fn, "counts"));
      GL_TRY(check_numel(send, rc[rank], fn, "send", "counts[rank]"));
    }
    break;
  case GL_COLL_SCATTER:
    if (rank == a->root) {
      GL_TRY(fill_counts(sc, a->send_counts, size, send->numel, 1, fn, "counts"));
      GL_TRY(check_numel(recv, sc[rank], fn, "recv", a->send_counts ? "counts[rank]" : "send's numel / ranks"));
    } else if (a->send_counts) {
      GL_TRY(fill_counts(sc, a->send_counts, size, 0, 0, fn, "counts"));
      GL_TRY(check_numel(recv, sc[rank], fn, "recv", "counts[rank]"));
    }
    break;
  case GL_COLL_ALL_TO_ALL:
    GL_TRY(fill_counts(sc, a->send_counts, size, send->numel, 1, fn, "send_counts"));
    GL_TRY(fill_counts(rc, a->recv_counts, size, recv->numel, 1, fn, "recv_counts"));
    break;
  default:
    return gl_error("gl_comm_start: coll expected 0..%d, got %d", GL_COLL_COUNT - 1, coll);
  }
  w->args.send = send;
  w->args.recv = recv;
  w->args.send_counts = w->send_counts;
  w->args.recv_counts = w->recv_counts;
  return GL_OK;
}

/* A view of t owned by the work (keeps the storage alive), and, when the
   backend cannot use t's memory as is, a contiguous staging tensor of the
   wire dtype.  copy_in: the collective reads t. */
static int prepare_buffer(gl_work *w, gl_tensor *t, int force_stage, int copy_in,
                          gl_tensor **view, gl_tensor **stage, void **buf) {
  const char *fn = w->args.label;
  *view = gl_as_strided(t, t->ndim, t->shape, t->stride, t->offset);
  if (!*view) return GL_ERR;
  int host = w->comm->backend->host_memory;
  int need = force_stage || !gl_is_contiguous(t) || t->dtype != w->wire_dtype ||
             (host && t->device != GL_DEVICE_CPU);
  if (!need) { *buf = gl_data_ptr(t); return GL_OK; }
  *stage = gl_empty(w->wire_dtype, host ? GL_DEVICE_CPU : t->device, t->ndim, t->shape);
  if (!*stage) return gl_error("%s: staging buffer: %s", fn, gl_last_error());
  if (copy_in && gl_copy(*stage, t) != GL_OK)
    return gl_error("%s: staging the input: %s", fn, gl_last_error());
  *buf = gl_data_ptr(*stage);
  return GL_OK;
}

gl_work *gl_comm_start(gl_comm *c, const gl_coll_args *a) {
  GL_NONNULL_OR(NULL, "gl_comm_start", c, a);
  if (c->refcount <= 0 || !c->backend) return gl_error_null("gl_comm_start: c is not a live communicator");
  if (a->coll < 0 || a->coll >= GL_COLL_COUNT)
    return gl_error_null("gl_comm_start: coll expected 0..%d, got %d", GL_COLL_COUNT - 1, a->coll);
  if (!gl_dist_initialized()) return gl_error_null("%s: gptlua.dist is not initialised (or already finalised)",
                                                   gl_coll_name(a->coll));
  progress_detached();
  gl_work *w = calloc(1, sizeof *w);
  if (!w) return gl_error_null("gl_comm_start: out of host memory");
  w->comm = c;
  c->refcount++;
  w->args = *a;
  if (!w->args.label) w->args.label = gl_coll_name(a->coll);
  w->state = GL_WORK_FAILED;
  if (setup_args(w, a) != GL_OK) { work_destroy(w); return NULL; }

  gl_tensor *send = w->args.send, *recv = w->args.recv;
  gl_tensor *any = recv ? recv : send;
  w->wire_dtype = any ? any->dtype : GL_F32;
  if (any && is_reduction(a->coll) && !(c->backend->reduce_dtypes & (1u << any->dtype)))
    w->wire_dtype = GL_F32;
  if (recv) {
    w->recv_numel = recv->numel;
    if (prepare_buffer(w, recv, 0, is_in_place(a->coll), &w->recv_view, &w->recv_stage, &w->recv_buf)) {
      work_destroy(w); return NULL;
    }
  }
  if (send && send == recv) {
    w->send_numel = recv->numel;
    w->send_buf = w->recv_buf;
  } else if (send) {
    w->send_numel = send->numel;
    /* a send sharing storage with recv (a shard viewed inside the gathered
       buffer, say) would alias what the backend writes: copy it first */
    int alias = recv && gl_same_storage(send, recv);
    if (prepare_buffer(w, send, alias, 1, &w->send_view, &w->send_stage, &w->send_buf)) {
      work_destroy(w); return NULL;
    }
  }
  w->seq = is_p2p(a->coll) ? c->p2p_seq : c->seq;
  w->started_at = gl_dist_now();
  w->state = GL_WORK_RUNNING;
  if (c->backend->start(w) != GL_OK) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", gl_last_error());
    work_destroy(w);
    return gl_error_null("%s", msg);
  }
  if (is_p2p(a->coll)) c->p2p_seq++;
  else c->seq++;
  return w;
}

int gl_comm_run(gl_comm *c, const gl_coll_args *a) {
  gl_work *w = gl_comm_start(c, a);
  if (!w) return GL_ERR;
  int rc = gl_work_wait(w);
  gl_work_free(w);
  return rc;
}

/* ---- diagnose helpers (the backends' diagnose) --------------------------- */
void gl_dist_appendf(char *buf, int n, const char *fmt, ...) {
  size_t len = strlen(buf);
  if ((int)len >= n - 1) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + len, (size_t)n - len, fmt, ap);
  va_end(ap);
}

void gl_dist_print_abort(int world_rank, const char *msg) {
  if (!msg || !*msg) return;
  if (world_rank >= 0) fprintf(stderr, "[rank %d] %s\n", world_rank, msg);
  else fprintf(stderr, "%s\n", msg);
  fflush(stderr);
}

static void describe_rank(char *buf, int n, const gl_comm *c, int g) {
  gl_dist_appendf(buf, n, "rank %d", g);
  if (!c->is_world) gl_dist_appendf(buf, n, " (world rank %d)", c->world_ranks[g]);
}

void gl_dist_verdict(const gl_work *w, const char *const *why, char *buf, int n) {
  const gl_comm *c = w->comm;
  int p2p = is_p2p(w->args.coll);
  char missing[1500] = "", joined[600] = "";
  int nmissing = 0, njoined = 0;
  for (int g = 0; g < c->size; g++) {
    if (g == c->rank || (p2p && g != w->args.root)) continue;
    if (!why[g]) {
      if (njoined++) gl_dist_appendf(joined, sizeof joined, ", ");
      describe_rank(joined, sizeof joined, c, g);
      continue;
    }
    if (nmissing++) gl_dist_appendf(missing, sizeof missing, "; ");
    describe_rank(missing, sizeof missing, c, g);
    gl_dist_appendf(missing, sizeof missing, "%s", why[g]);
  }
  if (nmissing) gl_dist_appendf(buf, n, "Missing: %s.", missing);
  else gl_dist_appendf(buf, n, "Every rank has joined; the collective itself did not finish.");
  if (njoined) gl_dist_appendf(buf, n, " Joined: %s.", joined);
}

/* ---- split ------------------------------------------------------------- */
static int by_key_then_rank(const void *pa, const void *pb) {
  const int64_t *a = pa, *b = pb;   /* {key, parent rank} */
  if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
  return a[1] < b[1] ? -1 : a[1] > b[1];
}

/* Everyone's (color, key, node) first travels by all_gather, so the split
   itself is guarded by the timeout and each rank can compute its new group
   (ranks ordered by key, then parent rank, as MPI_Comm_split does). */
int gl_comm_split(gl_comm *c, int color, int key, gl_comm **out) {
  GL_NONNULL("gl_comm_split", c, out);
  *out = NULL;
  if (c->refcount <= 0) return gl_error("gl_comm_split: comm is not a live communicator");
  int size = c->size;
  int64_t mine[3] = {color < 0 ? -1 : color, key, c->node};
  int64_t *all = malloc(sizeof(int64_t) * 3 * size);
  int64_t *order = malloc(sizeof(int64_t) * 2 * size);
  if (!all || !order) { free(all); free(order); return gl_error("gl_comm_split: out of host memory"); }
  int64_t n3 = 3, nall = 3 * (int64_t)size;
  gl_tensor *tm = gl_from_external(mine, sizeof mine, GL_I64, 1, &n3);
  gl_tensor *ta = gl_from_external(all, sizeof(int64_t) * nall, GL_I64, 1, &nall);
  int rc = (tm && ta) ? GL_OK : GL_ERR;
  if (rc == GL_OK) {
    gl_coll_args ga = {.coll = GL_COLL_ALL_GATHER, .send = tm, .recv = ta, .label = "split"};
    rc = gl_comm_run(c, &ga);
  }
  gl_tensor_free(tm);
  gl_tensor_free(ta);
  c->nsplits++;
  gl_comm *child = NULL;
  if (rc == GL_OK && color >= 0) {
    int n = 0;
    for (int r = 0; r < size; r++)
      if (all[3 * r] == color) { order[2 * n] = all[3 * r + 1]; order[2 * n + 1] = r; n++; }
    qsort(order, n, 2 * sizeof(int64_t), by_key_then_rank);
    char name[GL_COMM_NAME_MAX + 32]; /* truncated to GL_COMM_NAME_MAX by gl_comm_alloc */
    snprintf(name, sizeof name, "%s.%d[%d]", c->name, c->nsplits, color);
    child = gl_comm_alloc(c->backend, name);
    if (child) child->world_ranks = malloc(sizeof(int32_t) * n);
    if (!child || !child->world_ranks) {
      rc = GL_ERR;
      if (child) gl_error("gl_comm_split: out of host memory");
    } else {
      child->size = n;
      child->node = c->node;
      child->nnodes = c->nnodes;
      child->world_rank = c->world_rank;
      child->timeout_s = c->timeout_s;
      for (int i = 0; i < n; i++) {
        int pr = (int)order[2 * i + 1];
        child->world_ranks[i] = c->world_ranks[pr];
        if (pr == c->rank) child->rank = i;
        if (all[3 * pr + 2] == c->node) {
          if (pr == c->rank) child->local_rank = child->local_size;
          child->local_size++;
        }
      }
    }
  }
  free(all);
  free(order);
  /* every rank of c enters the backend's split, even the ones left out */
  if (c->backend->split(c, color, key, rc == GL_OK ? child : NULL) != GL_OK) rc = GL_ERR;
  if (rc != GL_OK) {
    if (child) comm_decref(child);
    return GL_ERR;
  }
  *out = child;
  return GL_OK;
}
