/* world.c — gptlua.dist without MPI: a world launched torchrun-style
 * (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) meets at a TCP rendezvous
 * (tcp_store.c, served by rank 0) and moves host tensors with Gloo
 * (gloo_ops.cpp).  This is libgptlua_gloo.so's half of the process group
 * and its data backend; comm.c (shared with the MPI library) does the rest.
 *
 * Nonblocking: Gloo's collectives block, so each communicator runs them in
 * order on its own worker thread and comm.c polls a done flag.  send/recv
 * are posted at once from the caller (so two ranks that each send, then
 * receive, cannot deadlock) and waited for on two more threads, one for
 * sends and one for receives.
 *
 * Control channel (who is missing after a timeout): a rank blocked in a
 * collective for more than a quarter second publishes what it waits in
 * ("status/<rank>" in the store); the rank that timed out reads them.  A
 * rank that fails writes "abort" to the store and exits; blocked ranks see
 * it within half a second and exit too, as do ranks that lose the store
 * (rank 0 gone).  A rank busy computing learns at its next collective,
 * whose peers have gone (or the launcher ends it: gptlua -n, torchrun). */
#define _GNU_SOURCE
#include "internal.h"
#include "tcp_store.h"
#include "gloo_ops.h"
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* ---- a lane: one thread running jobs in order ------------------------- */
typedef struct gloo_work {
  atomic_int done;             /* 1 once the job ran (release: buffers are final) */
  int failed;
  uint32_t tag;
  double timeout_s;            /* Gloo's own deadline: a backstop behind comm.c's */
  gl_gloo_p2p *p2p;            /* send/recv: the posted message */
  gl_work *w;
  struct gloo_work *next;
  char err[240];
} gloo_work;

typedef struct lane {
  pthread_t thread;
  int started, stop;
  pthread_mutex_t lock;
  pthread_cond_t cv;
  gloo_work *head, *tail;
  gl_gloo *g;
} lane;

typedef struct gloo_comm {
  gl_gloo *g;
  lane coll, sends, recvs;      /* recvs apart: a receive's payload is posted by its lane, and
                                   sends complete only once the peer's is */
  int64_t *sent, *received;    /* messages to / from each peer so far */
} gloo_comm;

static void *lane_main(void *arg) {
  lane *l = arg;
  for (;;) {
    pthread_mutex_lock(&l->lock);
    while (!l->head && !l->stop) pthread_cond_wait(&l->cv, &l->lock);
    gloo_work *j = l->head;
    if (!j) { pthread_mutex_unlock(&l->lock); return NULL; }
    l->head = j->next;
    if (!l->head) l->tail = NULL;
    pthread_mutex_unlock(&l->lock);
    int rc = j->p2p ? gl_gloo_p2p_wait(j->p2p, j->timeout_s, j->err, sizeof j->err)
                    : gl_gloo_run(l->g, j->w, j->tag, j->timeout_s, j->err, sizeof j->err);
    j->p2p = NULL;
    j->failed = rc != GL_OK;
    atomic_store_explicit(&j->done, 1, memory_order_release);
  }
}

static int lane_push(lane *l, gloo_work *j) {
  pthread_mutex_lock(&l->lock);
  if (!l->started) {
    if (pthread_create(&l->thread, NULL, lane_main, l) != 0) {
      pthread_mutex_unlock(&l->lock);
      return gl_error("gloo: cannot start a worker thread");
    }
    l->started = 1;
  }
  if (l->tail) l->tail->next = j; else l->head = j;
  l->tail = j;
  pthread_cond_signal(&l->cv);
  pthread_mutex_unlock(&l->lock);
  return GL_OK;
}

static void lane_init(lane *l, gl_gloo *g) {
  pthread_mutex_init(&l->lock, NULL);
  pthread_cond_init(&l->cv, NULL);
  l->g = g;
}

static void lane_stop(lane *l) {
  pthread_mutex_lock(&l->lock);
  l->stop = 1;
  pthread_cond_signal(&l->cv);
  pthread_mutex_unlock(&l->lock);
  if (l->started) pthread_join(l->thread, NULL);
  pthread_mutex_destroy(&l->lock);
  pthread_cond_destroy(&l->cv);
}

/* ---- process state ------------------------------------------------------ */
static int initialized, finalized;
static gl_comm *world;
static int world_rank = -1;    /* for messages, also after finalize */
static gl_tcp_store *store;
static char self_host[64];     /* this rank's address for its Gloo peers */
static const char *iface;      /* GLOO_SOCKET_IFNAME, as PyTorch names it */

int gl_dist_initialized(void) { return initialized && !finalized; }
gl_comm *gl_dist_world(void) { return gl_dist_initialized() ? world : NULL; }

int gl_dist_cpu_count(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

/* ---- the data backend ---------------------------------------------------- */
static gloo_comm *impl_of(const gl_comm *c) { return (gloo_comm *)c->impl; }

static int gloo_start(gl_work *w) {
  gl_comm *c = w->comm;
  gloo_comm *gc = impl_of(c);
  gloo_work *j = calloc(1, sizeof *j);
  if (!j) return gl_error("%s: out of host memory", w->args.label);
  w->impl = j;   /* freed by comm.c with the work, after done */
  j->w = w;
  j->tag = (uint32_t)w->seq;
  j->timeout_s = c->timeout_s + 30;
  int coll = w->args.coll;
  if (coll == GL_COLL_SEND || coll == GL_COLL_RECV) {
    int peer = w->args.root;
    int64_t *n = coll == GL_COLL_SEND ? &gc->sent[peer] : &gc->received[peer];
    j->p2p = gl_gloo_p2p_post(gc->g, w, (uint64_t)*n, j->err, sizeof j->err);
    if (!j->p2p) return gl_error("%s to/from rank %d: %s", w->args.label, peer, j->err);
    (*n)++;
    return lane_push(coll == GL_COLL_SEND ? &gc->sends : &gc->recvs, j);
  }
  return lane_push(&gc->coll, j);
}

static int gloo_test(gl_work *w, int *done) {
  gloo_work *j = w->impl;
  *done = atomic_load_explicit(&j->done, memory_order_acquire);
  if (*done && j->failed) return gl_error("%s", j->err);
  return GL_OK;
}

static gloo_comm *gloo_comm_new(gl_comm *c, const char *prefix) {
  gloo_comm *gc = calloc(1, sizeof *gc);
  if (gc) {
    gc->sent = calloc((size_t)c->size, sizeof(int64_t));
    gc->received = calloc((size_t)c->size, sizeof(int64_t));
  }
  if (!gc || !gc->sent || !gc->received) {
    if (gc) { free(gc->sent); free(gc->received); free(gc); }
    return gl_error_null("gptlua.dist: out of host memory");
  }
  gc->g = gl_gloo_connect(store, prefix, self_host, iface, c->rank, c->size, c->timeout_s);
  if (!gc->g) { free(gc->sent); free(gc->received); free(gc); return NULL; }
  lane_init(&gc->coll, gc->g);
  lane_init(&gc->sends, gc->g);
  lane_init(&gc->recvs, gc->g);
  return gc;
}

static void gloo_destroy(gl_comm *c) {
  gloo_comm *gc = impl_of(c);
  if (!gc) return;
  lane_stop(&gc->coll);
  lane_stop(&gc->sends);
  lane_stop(&gc->recvs);
  gl_gloo_free(gc->g);
  free(gc->sent);
  free(gc->received);
  free(gc);
  c->impl = NULL;
}

/* The child's members connect their own Gloo context under its name
   (unique in the job: parents number their splits). */
static int gloo_split(gl_comm *parent, int color, int key, gl_comm *child) {
  (void)parent; (void)color; (void)key;
  if (!child) return GL_OK;
  gloo_comm *gc = gloo_comm_new(child, child->name);
  if (!gc) return gl_error("split: %s", gl_last_error());
  child->impl = gc;
  return GL_OK;
}

/* ---- control channel ---------------------------------------------------- */
typedef struct status_rec {
  int64_t seq;
  int32_t p2p, pad_;
  double when;                 /* CLOCK_REALTIME seconds when published */
  char label[32];
  char comm[GL_COMM_NAME_MAX];
} status_rec;

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void lost_store(void) {
  fprintf(stderr, "[rank %d] gptlua.dist: lost rank 0 (its rendezvous store did not answer: it ended or its node cannot be "
                  "reached); ending this rank\n", world_rank);
  fflush(stderr);
  _exit(1);
}

static void publish(const gl_work *w) {
  status_rec r;
  memset(&r, 0, sizeof r);
  r.seq = w->seq;
  r.p2p = w->args.coll == GL_COLL_SEND || w->args.coll == GL_COLL_RECV;
  r.when = wall_now();
  snprintf(r.label, sizeof r.label, "%s", w->args.label);
  snprintf(r.comm, sizeof r.comm, "%s", w->comm->name);
  char key[32];
  snprintf(key, sizeof key, "status/%d", world_rank);
  if (gl_tcp_store_set(store, key, &r, sizeof r) == GL_TCP_STORE_LOST) lost_store();
}

/* Another rank wrote "abort": say so and end this one. */
static void check_abort(void) {
  void *v = NULL;
  size_t n = 0;
  int found = 0;
  if (gl_tcp_store_try_get(store, "abort", &v, &n, &found) == GL_TCP_STORE_LOST) lost_store();
  if (!found) return;
  int who = -1, code = 1;
  sscanf(v, "%d %d", &who, &code);
  free(v);
  fprintf(stderr, "[rank %d] gptlua.dist: rank %d aborted the job; ending this rank\n", world_rank, who);
  fflush(stderr);
  _exit(code ? code : 1);
}

/* Called from comm.c's wait loop (waiting: the blocked work) and from
   gl_dist_progress (NULL: not blocked, so no round trip to the store). */
static void gloo_serve(const gl_work *waiting) {
  static const gl_work *published;
  static int64_t published_seq;
  static double last_publish, last_check;
  if (!waiting || !gl_dist_initialized()) return;
  double t = gl_dist_now(), blocked = t - waiting->started_at;
  if (blocked > 0.25 && (waiting != published || waiting->seq != published_seq || t - last_publish > 1.0)) {
    publish(waiting);
    published = waiting;
    published_seq = waiting->seq;
    last_publish = t;
  }
  if (blocked > 0.5 && t - last_check > 0.5) {
    last_check = t;
    check_abort();
  }
}

/* status of world rank wr, or 0 when it never published */
static int status_of(int wr, status_rec *r) {
  char key[32];
  snprintf(key, sizeof key, "status/%d", wr);
  void *v = NULL;
  size_t n = 0;
  int found = 0;
  if (gl_tcp_store_try_get(store, key, &v, &n, &found) != GL_OK || !found || n != sizeof *r) { free(v); return 0; }
  memcpy(r, v, sizeof *r);
  free(v);
  return 1;
}

static int has_joined(const gl_work *w, const status_rec *r) {
  int p2p = w->args.coll == GL_COLL_SEND || w->args.coll == GL_COLL_RECV;
  return !p2p && !r->p2p && strcmp(r->comm, w->comm->name) == 0 && r->seq >= w->seq;
}

/* Reads what every member of w's group last published (waiting up to a
   grace period for ranks blocked in w to publish), then names the ones that
   have not joined w. */
static void gloo_diagnose(const gl_work *w, char *buf, int n) {
  const gl_comm *c = w->comm;
  int p2p = w->args.coll == GL_COLL_SEND || w->args.coll == GL_COLL_RECV;
  publish(w);
  double grace = c->timeout_s * 0.5;
  grace = grace < 0.5 ? 0.5 : grace > 5.0 ? 5.0 : grace;
  status_rec *st = calloc((size_t)c->size, sizeof *st);
  int *got = calloc((size_t)c->size, sizeof *got);
  if (!st || !got) { free(st); free(got); gl_dist_appendf(buf, n, "(out of memory while asking the other ranks)"); return; }
  double t0 = gl_dist_now();
  for (;;) {
    int pending = 0;
    for (int g = 0; g < c->size; g++) {
      if (g == c->rank || (p2p && g != w->args.root)) continue;
      got[g] = status_of(c->world_ranks[g], &st[g]);
      if (!got[g] || !has_joined(w, &st[g])) pending++;
    }
    if (!pending || gl_dist_now() - t0 > grace) break;
    struct timespec ts = {0, 20000000};
    nanosleep(&ts, NULL);
  }
  enum { WHY = 400 };
  char *whys = calloc((size_t)c->size, WHY);
  const char **why = calloc((size_t)c->size, sizeof *why);
  if (!whys || !why) { free(whys); free(why); free(st); free(got); gl_dist_appendf(buf, n, "(out of memory)"); return; }
  double now = wall_now();
  for (int g = 0; g < c->size; g++) {
    if (g == c->rank || (p2p && g != w->args.root)) continue;
    if (got[g] && has_joined(w, &st[g])) continue;
    char *s = whys + (size_t)g * WHY;
    why[g] = s;
    if (!got[g])
      gl_dist_appendf(s, WHY, " has not been blocked in any collective (busy outside them, hung or dead)");
    else
      gl_dist_appendf(s, WHY, " was last blocked in %s on group '%s' (%sseq %lld) %.1f s ago", st[g].label,
                      st[g].comm, st[g].p2p ? "p2p " : "", (long long)st[g].seq, now - st[g].when);
  }
  gl_dist_verdict(w, why, buf, n);
  free(why);
  free(whys);
  free(st);
  free(got);
}

static void tell_abort(int code) {
  if (!store || world_rank < 0) return;
  char v[32];
  snprintf(v, sizeof v, "%d %d", world_rank, code);
  gl_tcp_store_set(store, "abort", v, strlen(v));
}

static void gloo_abort(int code) {
  tell_abort(code ? code : 1);
  _exit(code ? code : 1);
}

static const gl_dist_backend gloo_backend = {
  .name = "gloo",
  .host_memory = 1,
  .reduce_dtypes = (1u << GL_F32) | (1u << GL_F64) | (1u << GL_I32) | (1u << GL_I64),
  .start = gloo_start,
  .test = gloo_test,
  .split = gloo_split,
  .destroy = gloo_destroy,
  .serve = gloo_serve,
  .diagnose = gloo_diagnose,
  .abort = gloo_abort,
};

/* ---- process group ------------------------------------------------------- */
void gl_dist_abort(int code, const char *msg) {
  gl_dist_print_abort(world_rank, msg);
  if (gl_dist_initialized()) tell_abort(code ? code : 1);
  _exit(code ? code : 1);
}

/* As with MPI: a rank that exits non-zero after init ends the job at once
   (the others see "abort" or lose rank 0's store); zero finalises. */
static void at_process_exit(int status, void *arg) {
  (void)arg;
  if (!gl_dist_initialized()) return;
  if (status != 0) {
    fprintf(stderr, "[rank %d] gptlua.dist: exiting with status %d, aborting every rank\n", world_rank, status);
    fflush(stderr);
    tell_abort(status);
  } else if (gl_dist_finalize() != GL_OK) {
    fprintf(stderr, "[rank %d] gptlua.dist: finalize at exit: %s\n", world_rank, gl_last_error());
  }
}

/* LuaJIT closes this library with the Lua state; the exit hook lives here. */
static void pin_library(void) {
  Dl_info info;
  if (dladdr((void *)gl_dist_init_tcp, &info) && info.dli_fname)
    dlopen(info.dli_fname, RTLD_NOW | RTLD_NODELETE | RTLD_NOLOAD);
}

/* Every rank writes "join/<rank>" = "<size> <host>" and waits for all of
   them: who is missing at the deadline is named, a rank started with
   another WORLD_SIZE is refused, and the hosts give the node topology (the
   lowest rank on each host leads it, as MPI's shared-memory split does). */
static int rendezvous(gl_comm *c, const char *addr, int port, double timeout_s) {
  char host[256] = "", key[32], val[300];
  gethostname(host, sizeof host - 1);
  snprintf(key, sizeof key, "join/%d", c->rank);
  snprintf(val, sizeof val, "%d %s", c->size, host);
  if (gl_tcp_store_set(store, key, val, strlen(val)) != GL_OK) return GL_ERR;
  char **hosts = calloc((size_t)c->size, sizeof *hosts);
  if (!hosts) return gl_error("gl_dist_init_tcp: out of host memory");
  int rc = GL_OK, nmissing = 0;
  double t0 = gl_dist_now();
  for (;;) {
    nmissing = 0;
    for (int r = 0; r < c->size && rc == GL_OK; r++) {
      if (hosts[r]) continue;
      void *v = NULL;
      size_t n = 0;
      int found = 0;
      snprintf(key, sizeof key, "join/%d", r);
      if (gl_tcp_store_try_get(store, key, &v, &n, &found) != GL_OK) { rc = GL_ERR; break; }
      if (!found) { nmissing++; continue; }
      int size = 0, off = 0;
      if (sscanf(v, "%d %n", &size, &off) < 1 || size != c->size) {
        rc = gl_error("rendezvous at %s:%d: rank %d was started with WORLD_SIZE=%d but rank %d with %d; "
                      "start every rank with the same WORLD_SIZE", addr, port, r, size, c->rank, c->size);
        free(v);
        break;
      }
      hosts[r] = strdup((char *)v + off);
      free(v);
      if (!hosts[r]) rc = gl_error("gl_dist_init_tcp: out of host memory");
    }
    if (rc != GL_OK || nmissing == 0) break;
    if (gl_dist_now() - t0 > timeout_s) {
      char list[1200] = "";
      int k = 0;
      for (int r = 0; r < c->size; r++)
        if (!hosts[r]) gl_dist_appendf(list, sizeof list, "%s%d", k++ ? ", " : "", r);
      rc = gl_error("rendezvous at %s:%d timed out after %.1f s: rank%s %s of %d did not join (each rank needs "
                    "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and its own RANK)", addr, port, timeout_s,
                    nmissing > 1 ? "s" : "", list, c->size);
      break;
    }
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
  }
  if (rc == GL_OK) {
    int node = -1, nnodes = 0;
    for (int r = 0; r < c->size; r++) {
      int first = r;
      for (int q = 0; q < r; q++) if (strcmp(hosts[q], hosts[r]) == 0) { first = q; break; }
      if (first == r) nnodes++;
      if (strcmp(hosts[r], hosts[c->rank]) == 0) {
        if (r < c->rank) c->local_rank++;
        c->local_size++;
        if (node < 0) node = nnodes - 1;
      }
    }
    c->node = node;
    c->nnodes = nnodes;
  }
  for (int r = 0; r < c->size; r++) free(hosts[r]);
  free(hosts);
  return rc;
}

int gl_dist_init_tcp(int rank, int size, const char *addr, int port, double timeout_s) {
  GL_NONNULL("gl_dist_init_tcp", addr);
  if (!(timeout_s > 0)) return gl_error("gl_dist_init_tcp: timeout expected > 0 seconds, got %g", timeout_s);
  if (size < 1 || rank < 0 || rank >= size)
    return gl_error("gl_dist_init_tcp: expected a rank in 0..size-1 and a size >= 1, got rank %d of %d", rank, size);
  if (port < 1 || port > 65535) return gl_error("gl_dist_init_tcp: MASTER_PORT expected 1..65535, got %d", port);
  if (finalized) return gl_error("gl_dist_init_tcp: the TCP world was finalised and cannot be started again");
  if (initialized) { world->timeout_s = timeout_s; return GL_OK; }
  pin_library();
  iface = getenv("GLOO_SOCKET_IFNAME");
  store = gl_tcp_store_open(addr, port, rank == 0, timeout_s);
  if (!store) return GL_ERR;
  snprintf(self_host, sizeof self_host, "%s", gl_tcp_store_local_addr(store));
  gl_comm *c = gl_comm_alloc(&gloo_backend, "world");
  if (!c) { gl_tcp_store_close(store, 0); store = NULL; return GL_ERR; }
  c->rank = c->world_rank = rank;
  c->size = size;
  c->is_world = 1;
  c->timeout_s = timeout_s;
  world_rank = rank;
  c->world_ranks = malloc(sizeof(int32_t) * (size_t)size);
  int rc = c->world_ranks ? rendezvous(c, addr, port, timeout_s) : gl_error("gl_dist_init_tcp: out of host memory");
  if (rc == GL_OK) {
    for (int r = 0; r < size; r++) c->world_ranks[r] = r;
    c->impl = gloo_comm_new(c, "world");
    if (!c->impl) rc = GL_ERR;
  }
  if (rc != GL_OK) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", gl_last_error());
    gl_comm_free_world(c);
    gl_tcp_store_close(store, 0);
    store = NULL;
    world_rank = -1;
    return gl_error("gptlua.dist: %s", msg);
  }
  world = c;
  initialized = 1;
  on_exit(at_process_exit, NULL);
  return GL_OK;
}

int gl_dist_finalize(void) {
  if (!gl_dist_initialized()) return GL_OK;
  /* detached work first; the barrier (timeout-guarded) means no rank still
     needs the store or a peer once this one closes them */
  gl_work_drain_detached();
  gl_coll_args b = {.coll = GL_COLL_BARRIER, .label = "finalize"};
  if (gl_comm_run(world, &b) != GL_OK) return GL_ERR;
  double linger = world->timeout_s;
  gl_comm_free_world(world);
  world = NULL;
  finalized = 1;
  gl_tcp_store_close(store, linger);   /* rank 0 waits for the others to close theirs */
  store = NULL;
  return GL_OK;
}
