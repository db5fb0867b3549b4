/* gl_dist.h — communicators and collectives on tensors.
 *
 * Part of the public API (umbrella gptlua.h), implemented twice over one
 * shared half (engine/mpi/comm.c, nccl.c): build/libgptlua_mpi.so (MPI,
 * engine/mpi/) and build/libgptlua_gloo.so (a TCP rendezvous and Gloo,
 * engine/gloo/).  A single process never loads either: lua/gptlua/dist/
 * loads one of them only for a world of more than one rank (a world of one
 * is handled in Lua, every collective a copy).
 *
 * Layers
 *  - The process group is bootstrapped by MPI (gl_dist_init) or by the TCP
 *    rendezvous of torchrun-style launches (gl_dist_init_tcp): it gives the
 *    world, the node topology, and the control channel the timeout watchdog
 *    uses to learn which rank is missing.  The world's collectives hand
 *    NCCL its unique id, whatever the backend.
 *  - A communicator (gl_comm) is backend-neutral: rank, size, topology,
 *    sequence counter, timeout, and a vtable (gl_dist_backend) that moves the
 *    bytes.  engine/mpi/mpi.c is the MPI backend and engine/gloo/world.c
 *    the Gloo one (host memory both); engine/mpi/nccl.c is the NCCL backend
 *    for CUDA tensors, another vtable.
 *  - Every collective is started nonblocking (gl_comm_start) and returns a
 *    work handle; blocking calls are start + gl_work_wait.  gl_work_wait
 *    polls with a deadline (the communicator's timeout): a collective that
 *    does not complete in time asks every rank over the control channel
 *    what it is doing, prints which ranks are missing, and aborts the job.
 *
 * Tensor roles (flat semantics: only numel matters, not shape):
 *   all_reduce      send == recv == t, in place
 *   reduce_scatter  send: sum(recv_counts) elements; recv: recv_counts[rank]
 *   all_gather      send: recv_counts[rank];          recv: sum(recv_counts)
 *   broadcast       send == recv == t; root's data lands everywhere
 *   reduce          send == recv == t; the result is valid on root only
 *   gather          send on every rank; recv (sum of recv_counts) on root only
 *   scatter         send (sum of send_counts) on root only; recv everywhere
 *   all_to_all      send: sum(send_counts), chunk r goes to rank r;
 *                   recv: sum(recv_counts), chunk r came from rank r
 *   send / recv     one tensor, peer in `root`
 *   barrier         no tensors
 * Counts arrays have `size` entries; NULL means the even split (the tensor's
 * numel divided by size, which must divide).  send and recv have the same
 * dtype.  Reductions (sum, avg, max, min) run natively where the backend
 * can (MPI: float32, float64, int32, int64); bfloat16 and float16 are
 * reduced in float32 on the host and rounded back.  avg needs a float dtype.
 * Non-contiguous tensors and tensors a backend cannot address directly are
 * staged through contiguous buffers.
 *
 * Lifetime: a work holds its own views of its tensors (storage refcounts),
 * so memory an in-flight collective reads or writes cannot be freed under
 * it.  gl_work_free on an unfinished work detaches it: it completes in the
 * background (progressed by later calls) and is freed then. */
#ifndef GL_DIST_H
#define GL_DIST_H
#include "gl_core.h"

typedef enum gl_dist_op {
  GL_DIST_SUM = 0, GL_DIST_AVG, GL_DIST_MAX, GL_DIST_MIN, GL_DIST_NOPS
} gl_dist_op;

typedef enum gl_coll {
  GL_COLL_ALL_REDUCE = 0, GL_COLL_REDUCE_SCATTER, GL_COLL_ALL_GATHER,
  GL_COLL_BROADCAST, GL_COLL_REDUCE, GL_COLL_GATHER, GL_COLL_SCATTER,
  GL_COLL_ALL_TO_ALL, GL_COLL_BARRIER, GL_COLL_SEND, GL_COLL_RECV,
  GL_COLL_COUNT
} gl_coll;

enum { GL_COMM_NAME_MAX = 96 };
enum { GL_WORK_RUNNING = 0, GL_WORK_DONE = 1, GL_WORK_FAILED = -1 };

typedef struct gl_comm gl_comm;
typedef struct gl_work gl_work;

/* What to run: filled by the caller of gl_comm_start. */
typedef struct gl_coll_args {
  int32_t coll;                /* gl_coll */
  int32_t op;                  /* gl_dist_op, reductions only */
  int32_t root;                /* root of broadcast/reduce/gather/scatter; peer of send/recv */
  int32_t pad_;
  gl_tensor *send;             /* NULL where the role has no send side */
  gl_tensor *recv;
  const int64_t *send_counts;  /* size entries or NULL (even split) */
  const int64_t *recv_counts;
  const char *label;           /* names the op in timeout reports; NULL: gl_coll_name */
} gl_coll_args;

/* The data-moving half of a backend.  Buffers handed to start() are
   contiguous, of w->wire_dtype, on the host when host_memory is set. */
typedef struct gl_dist_backend {
  const char *name;
  int32_t host_memory;         /* 1: buffers must live in host memory */
  uint32_t reduce_dtypes;      /* bit d set: dtype d reduced natively, else staged as float32 */
  int (*start)(gl_work *w);                 /* post the op, nonblocking */
  int (*test)(gl_work *w, int *done);       /* progress; *done = 1 once buffers hold the result */
  /* called on every rank of parent after all of them arrived; child is NULL
     on ranks that passed color < 0, else its fields are set and impl is
     left to fill */
  int (*split)(gl_comm *parent, int color, int key, gl_comm *child);
  void (*destroy)(gl_comm *c);              /* release impl */
  /* control channel: answer peers' status queries while blocked, and
     describe which ranks are missing when w timed out (into buf) */
  void (*serve)(const gl_work *waiting);
  void (*diagnose)(const gl_work *w, char *buf, int n);
  void (*abort)(int code);                  /* ends every rank, never returns */
  /* optional (device backends): make the device's compute stream wait for
     w on the device, without the host waiting; NULL: gl_work_wait_device
     waits on the host */
  int (*device_wait)(gl_work *w);
} gl_dist_backend;

struct gl_comm {
  const gl_dist_backend *backend;
  void *impl;                  /* backend state */
  int32_t rank, size;          /* in this group */
  int32_t local_rank, local_size; /* among this group's ranks on this node */
  int32_t node, nnodes;        /* node index (world numbering), nodes in the world */
  int32_t world_rank;          /* this process in the world */
  int32_t is_world;
  int32_t refcount;            /* the owner + in-flight works */
  int32_t nsplits;             /* children split off so far (names them) */
  int64_t seq;                 /* collectives started (p2p excluded) */
  int64_t p2p_seq;             /* send/recv started */
  double timeout_s;
  int32_t *world_ranks;        /* group rank -> world rank */
  gl_comm *next_live;          /* registry of live communicators */
  char name[96];               /* same on every member: "world", "world.1[color=0]" */
};

struct gl_work {
  gl_comm *comm;
  gl_coll_args args;           /* counts point at the arrays below */
  int64_t seq;                 /* comm->seq (or p2p_seq) when started */
  int32_t state;               /* GL_WORK_* */
  int32_t wire_dtype;          /* dtype on the wire (float32 for staged bf16/f16 reductions) */
  int32_t detached;
  int32_t device_waited;       /* the compute stream waits for it (gl_work_wait_device) */
  double started_at;           /* seconds, gl_dist_now() */
  gl_tensor *send_view, *recv_view;   /* the caller's tensors (own views) */
  gl_tensor *send_stage, *recv_stage; /* contiguous wire buffers when staged, else NULL */
  void *send_buf, *recv_buf;   /* what the backend reads and writes */
  int64_t send_numel, recv_numel;
  int64_t *send_counts, *recv_counts; /* size entries each, always filled */
  void *impl;                  /* backend request state */
  gl_work *next_detached;
  char error[256];             /* why it failed (GL_WORK_FAILED) */
};

/* ---- process group -------------------------------------------------- */
/* Initialises MPI once (later calls return GL_OK), builds the world.  An
   exiting process that did not finalise aborts the job when its exit status
   is non-zero and finalises it when zero. */
int gl_dist_init(double timeout_s);        /* libgptlua_mpi.so only */
/* libgptlua_gloo.so only: the world of a torchrun-style launch.  Rank 0
   serves the rendezvous store on port (all interfaces); every rank connects
   to addr:port, retrying until timeout_s, and waits up to timeout_s for the
   others (the error names those that never joined). */
int gl_dist_init_tcp(int rank, int size, const char *addr, int port, double timeout_s);
int gl_dist_initialized(void);
gl_comm *gl_dist_world(void);          /* owned by the library */
int gl_dist_finalize(void);            /* completes detached work, then MPI_Finalize */
void gl_dist_abort(int code, const char *msg); /* prints msg with the rank, ends every rank */
int gl_dist_cpu_count(void);           /* CPUs online on this node */
double gl_dist_now(void);              /* monotonic seconds */

/* ---- communicators ---------------------------------------------------- */
/* Collective over c.  *out is NULL on ranks that passed color < 0. */
int gl_comm_split(gl_comm *c, int color, int key, gl_comm **out);
void gl_comm_free(gl_comm *c);         /* the world is freed by gl_dist_finalize only */
int gl_comm_set_timeout(gl_comm *c, double timeout_s);

/* ---- collectives ----------------------------------------------------- */
gl_work *gl_comm_start(gl_comm *c, const gl_coll_args *a);
int gl_work_test(gl_work *w, int *done); /* never blocks */
int gl_work_wait(gl_work *w);           /* blocks; on timeout aborts every rank */
/* The consumer of w is device work: on a device backend (NCCL) the compute
   stream waits for the collective's event and the host goes on at once;
   the result is then ready for everything queued on the compute stream
   after the call (a host read of it, a copy to the host, waits for that
   stream and so for the collective).  The work's buffers are released at
   once: later compute-stream work is ordered after the collective, so the
   caching allocator may hand them out again.  The work stays watched: it is
   polled (never waited for) by later calls into this library and, past the
   communicator's timeout, reported and aborted like a blocking wait.  On
   host-memory backends this is gl_work_wait. */
int gl_work_wait_device(gl_work *w);
/* Host waits for device collectives (gl_work_wait on a work of a device
   backend that had not finished) since the library was loaded: a counter
   for the benchmarks (recipes/tools/host_syncs.lua). */
int64_t gl_dist_device_host_waits(void);
void gl_work_free(gl_work *w);          /* detaches an unfinished work */
int gl_comm_run(gl_comm *c, const gl_coll_args *a); /* start + wait + free */
/* Advances every in-flight collective without blocking.  MPI moves data
   only inside MPI calls: call this between pieces of compute (the DDP
   backward hooks) so started collectives overlap with it. */
int gl_dist_progress(void);
const char *gl_coll_name(int coll);
const char *gl_dist_op_name(int op);

/* ---- for backends -------------------------------------------------------- */
/* A zeroed communicator with refcount 1, registered as live. */
gl_comm *gl_comm_alloc(const gl_dist_backend *b, const char *name);
/* The live communicator named `name`, or NULL. */
gl_comm *gl_comm_find(const char *name);
/* Drops the world (gl_dist_finalize). */
void gl_comm_free_world(gl_comm *c);
/* Waits for every detached work and frees it (gl_dist_finalize). */
void gl_work_drain_detached(void);

/* NCCL (engine/mpi/nccl.c).  NCCL_VERSION_CODE of the linked NCCL, 0 when
   built without it. */
int gl_nccl_version(void);
/* Collective over parent (a host-memory communicator, MPI or Gloo, which
   carries the unique id):
   an NCCL communicator of the same ranks on cuda:device, named
   "<parent>/nccl". */
int gl_nccl_comm_create(gl_comm *parent, int device, gl_comm **out);

#endif
