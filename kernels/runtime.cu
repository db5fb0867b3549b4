/* runtime.cu — device memory, copies, streams, events, pinned host memory
 * and the per-device state every kernel file uses (common.cuh).
 *
 * Nothing here touches the driver until a CUDA device is asked for:
 * cuda_device_count() is the only call made on a machine without a GPU, and
 * it turns "no driver" / "no device" into 0. */
#include <stdio.h>
#include <stdlib.h>
#include <mutex>
#include <atomic>
#include <vector>
#include "common.cuh"

struct CuDevice {
  std::once_flag once;
  int init_rc = GL_ERR;
  char init_err[512] = {0};
  cudaStream_t stream[3] = {nullptr, nullptr, nullptr}; /* compute, communication, copy */
  int sm_count = 0;
  int smem_optin = 0;
  /* deferred id checks (cu_check_slot): device words, 2 per slot, and what
     each slot checked; guarded by checks_mu (the loader thread copies too) */
  long long *checks = nullptr;
  long long *checks_host = nullptr;  /* pinned: the slots are read by a copy queued before the host's wait */
  CuIdCheck check_meta[CU_CHECK_SLOTS];
  int checks_used = 0;
  std::mutex checks_mu;
  /* a CUDA graph capture of the compute stream runs (gl_cuda_graph_begin):
     its allocation pool and the tables it uses (kept resident until the
     graph is destroyed) */
  bool capturing = false;
  gl_alloc_pool *capture_pool = nullptr;
  std::vector<void *> capture_tables;
};
static CuDevice devices[CU_MAX_DEVICES];

static int device_count_cached = -1;
static std::mutex count_mu;

extern "C" int cuda_device_count(void) {
  std::lock_guard<std::mutex> g(count_mu);
  if (device_count_cached < 0) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) { (void)cudaGetLastError(); n = 0; }
    device_count_cached = n > CU_MAX_DEVICES ? CU_MAX_DEVICES : n;
  }
  return device_count_cached;
}

static int check_device(int dev, const char *fn) {
  int n = cuda_device_count();
  if (dev < 0 || dev >= n)
    return gl_error("%s: cuda:%d requested but %d CUDA device(s) are available", fn, dev, n);
  return GL_OK;
}

/* Blocking streams (not cudaStreamNonBlocking): work on the legacy default
   stream, e.g. a library's plain cudaMemcpy, stays ordered with ours. */
static int init_device(int dev, CuDevice *d) {
  GL_CU_CHECK(cudaSetDevice(dev));
  GL_CU_CHECK(cudaDeviceGetAttribute(&d->sm_count, cudaDevAttrMultiProcessorCount, dev));
  GL_CU_CHECK(cudaDeviceGetAttribute(&d->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  GL_CU_CHECK(cudaStreamCreateWithFlags(&d->stream[0], cudaStreamDefault));
  GL_CU_CHECK(cudaStreamCreateWithFlags(&d->stream[1], cudaStreamDefault));
  GL_CU_CHECK(cudaStreamCreateWithFlags(&d->stream[2], cudaStreamDefault));
  GL_CU_CHECK(cudaMalloc((void **)&d->checks, 2 * CU_CHECK_SLOTS * sizeof(long long)));
  GL_CU_CHECK(cudaMemset(d->checks, 0xff, 2 * CU_CHECK_SLOTS * sizeof(long long)));
  GL_CU_CHECK(cudaHostAlloc((void **)&d->checks_host, 2 * CU_CHECK_SLOTS * sizeof(long long), cudaHostAllocPortable));
  return GL_OK;
}

static int device_state(int dev, const char *fn, CuDevice **out) {
  GL_TRY(check_device(dev, fn));
  CuDevice *d = &devices[dev];
  std::call_once(d->once, [&] {
    d->init_rc = init_device(dev, d);
    if (d->init_rc != GL_OK) snprintf(d->init_err, sizeof d->init_err, "%s", gl_last_error());
  });
  if (d->init_rc != GL_OK) return gl_error("%s: cuda:%d could not be initialised: %s", fn, dev, d->init_err);
  *out = d;
  return GL_OK;
}

/* the public entry points name themselves in errors; kernels say "cuda" */
static int begin_named(int dev, const char *fn, cudaStream_t *stream) {
  CuDevice *d = nullptr;
  GL_TRY(device_state(dev, fn, &d));
  GL_CU_CHECK(cudaSetDevice(dev));
  *stream = d->stream[0];
  return GL_OK;
}
int cu_begin(int dev, cudaStream_t *stream) { return begin_named(dev, "cuda", stream); }

int cu_sm_count(int dev) { return (dev >= 0 && dev < CU_MAX_DEVICES) ? devices[dev].sm_count : 0; }
int cu_smem_optin(int dev) { return (dev >= 0 && dev < CU_MAX_DEVICES) ? devices[dev].smem_optin : 0; }

/* ---- deferred id checks ------------------------------------------------------
   An op that takes ids queues a check kernel that writes its slot (first bad
   position or -1, and the id there); nothing waits for it.  The slots are read
   where the host waits for the device anyway (a copy to the host, a
   synchronize): the wait's caller queues a copy of the used slots into a
   pinned mirror first (queue_checks_read_locked), so the one wait it makes
   brings them back too, and read_checks_locked turns the first bad slot in
   queue order into the op's own error message.  A graphed training step
   thus costs one host wait, not three.  A full table is read at once (a
   host wait, only after CU_CHECK_SLOTS checks without one). */
static int queue_checks_read_locked(int dev, CuDevice *d, cudaStream_t st, int *used) {
  *used = d->checks_used;
  if (*used == 0) return GL_OK;
  GL_CU_CHECK(cudaSetDevice(dev));
  GL_CU_CHECK(cudaMemcpyAsync(d->checks_host, d->checks, 2 * (size_t)*used * sizeof(long long),
                              cudaMemcpyDeviceToHost, st));
  return GL_OK;
}

/* after the host's wait for the copy queue_checks_read_locked queued (the
   caller holds checks_mu throughout, so no slot was added meanwhile) */
static int read_checks_locked(CuDevice *d, int used) {
  const long long *h = d->checks_host;
  d->checks_used = 0;
  for (int k = 0; k < used; k++) {
    if (h[2 * k] < 0) continue;
    const CuIdCheck *m = &d->check_meta[k];
    long long pos = h[2 * k], v = h[2 * k + 1];
    if (m->has_ignore)
      return gl_error("%s: %s[%lld] is %lld, expected 0 <= %s < %lld (%s) or ignore_index %lld", m->fn, m->arg, pos,
                      v, m->arg, (long long)m->limit, m->what, (long long)m->ignore);
    return gl_error("%s: %s[%lld] is %lld, expected 0 <= %s < %lld (%s)", m->fn, m->arg, pos, v, m->arg,
                    (long long)m->limit, m->what);
  }
  return GL_OK;
}

/* the slots now, with a wait of their own */
static int report_checks_locked(int dev, CuDevice *d) {
  int used = 0;
  cudaStream_t st = d->stream[0];
  GL_TRY(queue_checks_read_locked(dev, d, st, &used));
  if (used == 0) return GL_OK;
  GL_CU_CHECK(cudaStreamSynchronize(st));
  return read_checks_locked(d, used);
}

int cu_check_slot(int dev, const CuIdCheck *meta, long long **slot) {
  CuDevice *d = nullptr;
  GL_TRY(device_state(dev, "cuda", &d));
  std::lock_guard<std::mutex> g(d->checks_mu);
  if (d->checks_used == CU_CHECK_SLOTS) {
    if (d->capturing)  /* reading the table is a host wait, which the capture cannot hold */
      return gl_error("%s: the CUDA graph being captured queues more than %d id checks (CU_CHECK_SLOTS, "
                      "kernels/common.cuh)", meta->fn, (int)CU_CHECK_SLOTS);
    GL_TRY(report_checks_locked(dev, d));
  }
  int k = d->checks_used++;
  d->check_meta[k] = *meta;
  *slot = d->checks + 2 * k;
  return GL_OK;
}

int cu_report_checks(int dev) {
  if (dev < 0 || dev >= CU_MAX_DEVICES) return GL_OK;
  CuDevice *d = &devices[dev];
  if (d->init_rc != GL_OK) return GL_OK;  /* never used: nothing queued */
  std::lock_guard<std::mutex> g(d->checks_mu);
  return report_checks_locked(dev, d);
}

extern "C" int gl_cuda_check_flags(int device) {
  if (device < 0) {
    int n = cuda_device_count();
    for (int i = 0; i < n; i++) GL_TRY(gl_cuda_check_flags(i));
    return GL_OK;
  }
  GL_TRY(check_device(device, "gl_cuda_check_flags"));
  return cu_report_checks(device);
}

/* ---- small tables for the multi-tensor kernels --------------------------------
   A multi-tensor kernel reads its list of (pointer, size) segments from
   device memory.  The list of a training step repeats the last step's (the
   same parameters and gradients), so tables are cached by content: a repeat
   uploads nothing, a new one is one stream-ordered copy.  A few tables per
   device (AdamW, the grad norm, several optimizers) stay resident. */
enum { CU_TABLES = 8 };
struct CuTable {
  std::vector<char> bytes;  /* what the device copy holds */
  void *dptr = nullptr;
  size_t cap = 0;
  uint64_t used = 0;
  int graphs = 0;           /* CUDA graphs that read it: never replaced meanwhile */
};
struct CuTables {
  std::mutex mu;
  CuTable t[CU_TABLES];
  uint64_t clock = 0;
};
static CuTables tables[CU_MAX_DEVICES];

int cu_table(int dev, cudaStream_t st, const void *host, size_t nbytes, const void **out) {
  if (dev < 0 || dev >= CU_MAX_DEVICES) return gl_error("cuda: device %d out of range", dev);
  CuTables *ts = &tables[dev];
  std::lock_guard<std::mutex> g(ts->mu);
  CuDevice *d = &devices[dev];
  CuTable *victim = nullptr;
  for (CuTable &t : ts->t) {
    if (t.bytes.size() == nbytes && t.dptr && memcmp(t.bytes.data(), host, nbytes) == 0) {
      t.used = ++ts->clock;
      *out = t.dptr;
      if (d->capturing) {
        t.graphs++;
        d->capture_tables.push_back(t.dptr);
      }
      return GL_OK;
    }
    if (t.graphs == 0 && (!victim || t.used < victim->used)) victim = &t;
  }
  if (!victim)
    return gl_error("cuda: cuda:%d has all %d multi-tensor tables held by CUDA graphs; destroy one first", dev, CU_TABLES);
  if (victim->cap < nbytes) {  /* grows rarely: cudaFree waits for the device */
    if (victim->dptr) GL_CU_CHECK(cudaFree(victim->dptr));
    victim->dptr = nullptr;
    victim->cap = 0;
    victim->bytes.clear();
    GL_CU_CHECK(cudaMalloc(&victim->dptr, nbytes));
    victim->cap = nbytes;
  }
  victim->bytes.assign((const char *)host, (const char *)host + nbytes);
  /* from the kept host copy: it outlives the copy however the driver stages it */
  GL_CU_CHECK(cudaMemcpyAsync(victim->dptr, victim->bytes.data(), nbytes, cudaMemcpyHostToDevice, st));
  victim->used = ++ts->clock;
  *out = victim->dptr;
  if (d->capturing) {
    victim->graphs++;
    d->capture_tables.push_back(victim->dptr);
  }
  return GL_OK;
}

/* a graph destroyed: the tables it held may be replaced again */
static void release_tables(int dev, const std::vector<void *> &held) {
  CuTables *ts = &tables[dev];
  std::lock_guard<std::mutex> g(ts->mu);
  for (void *p : held)
    for (CuTable &t : ts->t)
      if (t.dptr == p && t.graphs > 0) { t.graphs--; break; }
}

/* ---- raw device memory (behind engine/alloc.c's caching allocator) ------ */
extern "C" int cuda_malloc(int device, int64_t nbytes, void **out) {
  cudaStream_t st = nullptr;
  GL_TRY(begin_named(device, "cuda_malloc", &st));
  void *p = nullptr;
  /* cudaMalloc is not stream-ordered, so a capture may allocate: a graph
     pool (engine/alloc.c) grows while the step is captured, as PyTorch's
     caching allocator does, in the relaxed capture mode */
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  GL_CU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  cudaError_t e = cudaMalloc(&p, (size_t)(nbytes > 0 ? nbytes : 1));
  GL_CU_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) { (void)cudaGetLastError(); fr = tot = 0; }
    return gl_error("cudaMalloc: cuda:%d out of memory allocating %lld bytes (%s; driver reports %lld of %lld bytes free) at %s:%d",
                    device, (long long)nbytes, cudaGetErrorString(e), (long long)fr, (long long)tot,
                    __FILE__, __LINE__);
  }
  *out = p;
  return GL_OK;
}

/* cudaFree waits for the device, so a block still read by queued kernels is
   never returned under them. */
extern "C" int cuda_free(int device, void *ptr) {
  if (!ptr) return GL_OK;
  GL_TRY(check_device(device, "cuda_free"));
  GL_CU_CHECK(cudaSetDevice(device));
  GL_CU_CHECK(cudaFree(ptr));
  return GL_OK;
}

/* Byte copy between any two of host / cuda:N.  A copy to the host waits for
   it (the caller reads the memory at once; one wait, which also brings the
   id checks back), and so does one from pinned host
   memory (the caller may overwrite it at once).  From pageable host memory
   cudaMemcpyAsync stages the source before it returns, so the host does not
   wait (no host sync for the small tensors a step uploads); device to
   device on one GPU stays queued on its compute stream. */
extern "C" int cuda_memcpy(void *dst, int dst_device, const void *src, int src_device, int64_t nbytes) {
  if (nbytes <= 0) return GL_OK;
  if (dst_device < 0 && src_device < 0) { memcpy(dst, src, (size_t)nbytes); return GL_OK; }
  if (dst_device >= 0 && src_device >= 0 && dst_device != src_device) {
    cudaStream_t ss = nullptr, ds = nullptr;
    GL_TRY(cu_begin(src_device, &ss));
    GL_CU_CHECK(cudaStreamSynchronize(ss));
    GL_TRY(cu_begin(dst_device, &ds));
    GL_CU_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, (size_t)nbytes, ds));
    GL_CU_CHECK(cudaStreamSynchronize(ds));
    return GL_OK;
  }
  int dev = dst_device >= 0 ? dst_device : src_device;
  cudaStream_t st = nullptr;
  GL_TRY(cu_begin(dev, &st));
  if (dst_device < 0) {  /* to the host: the id checks come back on the same wait */
    CuDevice *d = &devices[dev];
    std::lock_guard<std::mutex> g(d->checks_mu);
    int used = 0;
    GL_TRY(queue_checks_read_locked(dev, d, st, &used));
    GL_CU_CHECK(cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyDefault, st));
    /* to pageable memory the copy returns once it (and the stream's work
       before it) is done: that is the wait; to pinned memory wait for it */
    cudaPointerAttributes at;
    GL_CU_CHECK(cudaPointerGetAttributes(&at, dst));
    if (at.type != cudaMemoryTypeUnregistered) GL_CU_CHECK(cudaStreamSynchronize(st));
    return read_checks_locked(d, used);
  }
  GL_CU_CHECK(cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyDefault, st));
  if (src_device < 0) {
    cudaPointerAttributes at;
    GL_CU_CHECK(cudaPointerGetAttributes(&at, src));
    if (at.type != cudaMemoryTypeUnregistered) GL_CU_CHECK(cudaStreamSynchronize(st));  /* pinned (or managed) source */
  }
  return GL_OK;
}

/* ---- the public runtime API (gl_cuda.h) ---------------------------------- */
extern "C" int gl_cuda_get_props(int device, gl_cuda_props *out) {
  if (!out) return gl_error("gl_cuda_get_props: out is NULL");
  GL_TRY(check_device(device, "gl_cuda_get_props"));
  cudaDeviceProp p;
  GL_CU_CHECK(cudaGetDeviceProperties(&p, device));
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", p.name);
  out->major = p.major;
  out->minor = p.minor;
  out->multiprocessor_count = p.multiProcessorCount;
  out->max_threads_per_block = p.maxThreadsPerBlock;
  out->warp_size = p.warpSize;
  /* clock rates left cudaDeviceProp in CUDA 13: ask for the attributes */
  GL_CU_CHECK(cudaDeviceGetAttribute(&out->clock_khz, cudaDevAttrClockRate, device));
  GL_CU_CHECK(cudaDeviceGetAttribute(&out->memory_clock_khz, cudaDevAttrMemoryClockRate, device));
  out->memory_bus_width = p.memoryBusWidth;
  out->total_memory = (int64_t)p.totalGlobalMem;
  out->shared_memory_per_block_optin = (int64_t)p.sharedMemPerBlockOptin;
  out->l2_cache_size = (int64_t)p.l2CacheSize;
  return GL_OK;
}

extern "C" int gl_cuda_mem_info(int device, int64_t *free_bytes, int64_t *total_bytes) {
  cudaStream_t st = nullptr;
  GL_TRY(begin_named(device, "gl_cuda_mem_info", &st));
  size_t fr = 0, tot = 0;
  GL_CU_CHECK(cudaMemGetInfo(&fr, &tot));
  if (free_bytes) *free_bytes = (int64_t)fr;
  if (total_bytes) *total_bytes = (int64_t)tot;
  return GL_OK;
}

extern "C" int gl_cuda_set_device(int device) {
  cudaStream_t st = nullptr;
  return begin_named(device, "gl_cuda_set_device", &st);
}

static void reap_copies(void);

extern "C" int gl_cuda_synchronize(int device) {
  if (device < 0) {
    int n = cuda_device_count();
    for (int i = 0; i < n; i++) GL_TRY(gl_cuda_synchronize(i));
    return GL_OK;
  }
  cudaStream_t st = nullptr;
  GL_TRY(begin_named(device, "gl_cuda_synchronize", &st));
  CuDevice *d = &devices[device];
  int rc = GL_OK;
  {  /* the id checks come back on this one wait */
    std::lock_guard<std::mutex> g(d->checks_mu);
    int used = 0;
    GL_TRY(queue_checks_read_locked(device, d, st, &used));
    GL_CU_CHECK(cudaDeviceSynchronize());
    rc = read_checks_locked(d, used);
  }
  reap_copies();  /* every copy of the device has run: let its tensors go */
  return rc;
}

static int stream_of(int device, int kind, const char *fn, cudaStream_t *out) {
  if (kind != GL_STREAM_COMPUTE && kind != GL_STREAM_COMM && kind != GL_STREAM_COPY)
    return gl_error("%s: stream kind expected 0 (compute), 1 (comm) or 2 (copy), got %d", fn, kind);
  CuDevice *d = nullptr;
  GL_TRY(device_state(device, fn, &d));
  GL_CU_CHECK(cudaSetDevice(device));
  *out = d->stream[kind];
  return GL_OK;
}

extern "C" void *gl_cuda_stream(int device, int kind) {
  cudaStream_t s = nullptr;
  if (stream_of(device, kind, "gl_cuda_stream", &s) != GL_OK) return NULL;
  return (void *)s;
}

extern "C" int gl_cuda_stream_synchronize(int device, int kind) {
  cudaStream_t s = nullptr;
  GL_TRY(stream_of(device, kind, "gl_cuda_stream_synchronize", &s));
  GL_CU_CHECK(cudaStreamSynchronize(s));
  return GL_OK;
}

static int stream_wait(int device, int waiter, int waited) {
  cudaStream_t a = nullptr, b = nullptr;
  GL_TRY(stream_of(device, waiter, "gl_cuda_stream_wait", &a));
  GL_TRY(stream_of(device, waited, "gl_cuda_stream_wait", &b));
  if (a == b) return GL_OK;
  cudaEvent_t e;
  GL_CU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaError_t rc = cudaEventRecord(e, b);
  if (rc == cudaSuccess) rc = cudaStreamWaitEvent(a, e, 0);
  cudaEventDestroy(e);  /* destruction is deferred until the wait is done */
  GL_CU_CHECK(rc);
  return GL_OK;
}
extern "C" int gl_cuda_stream_wait(int device, int waiter, int waited) {
  return stream_wait(device, waiter, waited);
}

struct gl_cuda_event {
  cudaEvent_t ev;
  int device;
  int recorded;
};

static int event_create(int device, gl_cuda_event **out) {
  cudaStream_t st = nullptr;
  GL_TRY(begin_named(device, "gl_cuda_event_create", &st));
  gl_cuda_event *e = (gl_cuda_event *)calloc(1, sizeof *e);
  if (!e) return gl_error("gl_cuda_event_create: out of host memory");
  cudaError_t rc = cudaEventCreate(&e->ev);
  if (rc != cudaSuccess) free(e);
  GL_CU_CHECK(rc);
  e->device = device;
  *out = e;
  return GL_OK;
}
extern "C" gl_cuda_event *gl_cuda_event_create(int device) {
  gl_cuda_event *e = NULL;
  return event_create(device, &e) == GL_OK ? e : NULL;
}

extern "C" void gl_cuda_event_destroy(gl_cuda_event *e) {
  if (!e) return;
  if (cudaSetDevice(e->device) == cudaSuccess) cudaEventDestroy(e->ev);
  (void)cudaGetLastError();
  free(e);
}

extern "C" int gl_cuda_event_record(gl_cuda_event *e, int kind) {
  if (!e) return gl_error("gl_cuda_event_record: event is NULL");
  cudaStream_t s = nullptr;
  GL_TRY(stream_of(e->device, kind, "gl_cuda_event_record", &s));
  GL_CU_CHECK(cudaEventRecord(e->ev, s));
  e->recorded = 1;
  return GL_OK;
}

extern "C" int gl_cuda_stream_wait_event(gl_cuda_event *e, int kind) {
  if (!e) return gl_error("gl_cuda_stream_wait_event: event is NULL");
  cudaStream_t s = nullptr;
  GL_TRY(stream_of(e->device, kind, "gl_cuda_stream_wait_event", &s));
  if (!e->recorded) return GL_OK;
  GL_CU_CHECK(cudaStreamWaitEvent(s, e->ev, 0));
  return GL_OK;
}

extern "C" int gl_cuda_event_synchronize(gl_cuda_event *e) {
  if (!e) return gl_error("gl_cuda_event_synchronize: event is NULL");
  if (!e->recorded) return gl_error("gl_cuda_event_synchronize: event was never recorded");
  GL_CU_CHECK(cudaSetDevice(e->device));
  GL_CU_CHECK(cudaEventSynchronize(e->ev));
  return GL_OK;
}

extern "C" int gl_cuda_event_query(gl_cuda_event *e) {
  if (!e) return gl_error("gl_cuda_event_query: event is NULL");
  if (!e->recorded) return 1;
  GL_CU_CHECK(cudaSetDevice(e->device));
  cudaError_t rc = cudaEventQuery(e->ev);
  if (rc == cudaErrorNotReady) { (void)cudaGetLastError(); return 0; }
  GL_CU_CHECK(rc);
  return 1;
}

extern "C" int gl_cuda_event_elapsed_ms(const gl_cuda_event *start, const gl_cuda_event *end, double *ms) {
  if (!start || !end || !ms) return gl_error("gl_cuda_event_elapsed_ms: NULL argument");
  if (start->device != end->device)
    return gl_error("gl_cuda_event_elapsed_ms: events of cuda:%d and cuda:%d, expected one device",
                    start->device, end->device);
  if (!start->recorded || !end->recorded)
    return gl_error("gl_cuda_event_elapsed_ms: both events must be recorded first");
  GL_CU_CHECK(cudaSetDevice(start->device));
  GL_CU_CHECK(cudaEventSynchronize(end->ev));
  float f = 0;
  GL_CU_CHECK(cudaEventElapsedTime(&f, start->ev, end->ev));
  *ms = f;
  return GL_OK;
}

/* ---- asynchronous copies ------------------------------------------------- */
/* A copy in flight: the event recorded after it on the copy stream, and
   views that keep both tensors' storage alive until it has run (a pinned
   loader buffer must not be refilled, nor a device block handed out again,
   under the DMA).  Reaped by later calls once the event has passed. */
struct PendingCopy { cudaEvent_t done; int device; gl_tensor *dst, *src; };
static std::mutex copies_mu;
static std::vector<PendingCopy> pending_copies;
static std::vector<cudaEvent_t> spare_events[CU_MAX_DEVICES];

static void reap_copies_locked(void) {
  size_t keep = 0;
  for (size_t i = 0; i < pending_copies.size(); i++) {
    PendingCopy p = pending_copies[i];
    cudaError_t e = cudaEventQuery(p.done);
    if (e == cudaErrorNotReady) { (void)cudaGetLastError(); pending_copies[keep++] = p; continue; }
    if (e == cudaSuccess) spare_events[p.device].push_back(p.done);
    else { (void)cudaGetLastError(); cudaEventDestroy(p.done); (void)cudaGetLastError(); } /* failed device: the copy is over */
    gl_tensor_free(p.dst);
    gl_tensor_free(p.src);
  }
  pending_copies.resize(keep);
}
static void reap_copies(void) {
  std::lock_guard<std::mutex> g(copies_mu);
  reap_copies_locked();
}

/* a holding view of t (shares its storage) */
static gl_tensor *hold(const gl_tensor *t) {
  return gl_as_strided(t, t->ndim, t->shape, t->stride, t->offset);
}

extern "C" int gl_copy_async(gl_tensor *dst, const gl_tensor *src, gl_cuda_event *done) {
  const char *fn = "gl_copy_async";
  GL_TRY(gl_tensor_check(dst, fn, "dst"));
  GL_TRY(gl_tensor_check(src, fn, "src"));
  if (dst->dtype != src->dtype)
    return gl_error("%s: dst is %s but src is %s, expected one dtype", fn, gl_dtype_name(dst->dtype),
                    gl_dtype_name(src->dtype));
  if (dst->numel != src->numel)
    return gl_error("%s: dst has %lld elements but src has %lld, expected as many", fn, (long long)dst->numel,
                    (long long)src->numel);
  if (!gl_is_contiguous(dst) || !gl_is_contiguous(src))
    return gl_error("%s: expected contiguous tensors, got %s dst and %s src (make them contiguous first)", fn,
                    gl_is_contiguous(dst) ? "a contiguous" : "a strided",
                    gl_is_contiguous(src) ? "a contiguous" : "a strided");
  int dev = dst->device >= 0 ? dst->device : src->device;
  if (dev < 0) return gl_error("%s: both tensors are on the CPU, expected one on a CUDA device (use gl_copy)", fn);
  if (dst->device >= 0 && src->device >= 0 && dst->device != src->device)
    return gl_error("%s: dst is on cuda:%d and src on cuda:%d, expected one device (use gl_copy)", fn, dst->device,
                    src->device);
  if (done && done->device != dev)
    return gl_error("%s: done is an event of cuda:%d, expected one of cuda:%d", fn, done->device, dev);
  CuDevice *d = nullptr;
  GL_TRY(device_state(dev, fn, &d));
  GL_CU_CHECK(cudaSetDevice(dev));
  std::lock_guard<std::mutex> g(copies_mu);
  reap_copies_locked();
  cudaEvent_t ev = nullptr;
  if (!spare_events[dev].empty()) { ev = spare_events[dev].back(); spare_events[dev].pop_back(); }
  else GL_CU_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  gl_tensor *hd = hold(dst), *hs = hd ? hold(src) : nullptr;
  if (!hs) {
    gl_tensor_free(hd);
    spare_events[dev].push_back(ev);
    return GL_ERR;
  }
  cudaStream_t compute = d->stream[GL_STREAM_COMPUTE], copy = d->stream[GL_STREAM_COPY];
  size_t nbytes = (size_t)dst->numel * (size_t)gl_dtype_size(dst->dtype);
  /* ev first marks the compute stream's position (dst's earlier users), then the copy's end */
  cudaError_t e = cudaEventRecord(ev, compute);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(copy, ev, 0);
  if (e == cudaSuccess && nbytes > 0)
    e = cudaMemcpyAsync(gl_data_ptr(dst), gl_data_ptr(src), nbytes, cudaMemcpyDefault, copy);
  if (e == cudaSuccess) e = cudaEventRecord(ev, copy);
  if (e == cudaSuccess) e = done ? cudaEventRecord(done->ev, copy) : cudaStreamWaitEvent(compute, ev, 0);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaEventDestroy(ev);
    (void)cudaGetLastError();
    gl_tensor_free(hd);
    gl_tensor_free(hs);
    return gl_error("%s: copying %lld bytes to %s: %s", fn, (long long)nbytes,
                    dst->device >= 0 ? "the device" : "the host", cudaGetErrorString(e));
  }
  if (done) done->recorded = 1;
  pending_copies.push_back(PendingCopy{ev, dev, hd, hs});
  return GL_OK;
}

extern "C" int gl_copy_async_pending(void) {
  std::lock_guard<std::mutex> g(copies_mu);
  reap_copies_locked();
  return (int)pending_copies.size();
}

/* ---- pinned host memory --------------------------------------------------- */
static std::atomic<int64_t> pinned_bytes{0};
/* sizes of live blocks, to keep the counter exact on free */
struct PinnedHeader { int64_t nbytes; int64_t pad[7]; };  /* 64 bytes: keeps alignment */

static int host_alloc(int64_t nbytes, void **out) {
  if (nbytes < 0) return gl_error("gl_cuda_host_alloc: nbytes expected >= 0, got %lld", (long long)nbytes);
  if (cuda_device_count() == 0) return gl_error("gl_cuda_host_alloc: no CUDA device is available");
  void *p = nullptr;
  GL_CU_CHECK(cudaHostAlloc(&p, (size_t)nbytes + sizeof(PinnedHeader), cudaHostAllocPortable));
  ((PinnedHeader *)p)->nbytes = nbytes;
  pinned_bytes += nbytes;
  *out = (char *)p + sizeof(PinnedHeader);
  return GL_OK;
}
extern "C" void *gl_cuda_host_alloc(int64_t nbytes) {
  void *p = NULL;
  return host_alloc(nbytes, &p) == GL_OK ? p : NULL;
}
extern "C" int gl_cuda_host_free(void *ptr) {
  if (!ptr) return GL_OK;
  PinnedHeader *h = (PinnedHeader *)((char *)ptr - sizeof(PinnedHeader));
  int64_t n = h->nbytes;
  GL_CU_CHECK(cudaFreeHost(h));
  pinned_bytes -= n;
  return GL_OK;
}
extern "C" int64_t gl_cuda_pinned_bytes(void) { return pinned_bytes.load(); }

/* ---- CUDA graphs (gl_cuda.h) ------------------------------------------------
   The compute stream is captured in the global mode: a call that would make
   the host wait for it (a synchronize, a copy to pageable memory) or
   allocate outside the graph pool fails, and the failing op's error names
   the call.  Allocations during the capture come from a graph pool
   (engine/alloc.c) that outlives the capture, so every address the graph
   recorded stays the graph's until gl_cuda_graph_destroy.  The id checks
   queued in the capture are re-armed at each launch (their slots are
   rewritten by the replayed check kernels and read at the next host wait);
   the multi-tensor tables it read stay resident. */
struct gl_cuda_graph {
  int device = 0;
  cudaGraphExec_t exec = nullptr;
  gl_alloc_pool *pool = nullptr;
  size_t nodes = 0;
  int nchecks = 0;
  CuIdCheck check_meta[CU_CHECK_SLOTS];
  std::vector<void *> tables;
};

extern "C" int gl_cuda_graph_begin(int device) {
  CuDevice *d = nullptr;
  GL_TRY(device_state(device, "gl_cuda_graph_begin", &d));
  if (d->capturing) return gl_error("gl_cuda_graph_begin: cuda:%d is already capturing a graph", device);
  GL_CU_CHECK(cudaSetDevice(device));
  GL_TRY(cu_report_checks(device));  /* the graph's checks start from an empty table */
  gl_alloc_pool *pool = gl_alloc_pool_open(device);
  if (!pool) return GL_ERR;
  cudaError_t e = cudaStreamBeginCapture(d->stream[GL_STREAM_COMPUTE], cudaStreamCaptureModeGlobal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    gl_alloc_pool_release(pool);
    return gl_error("gl_cuda_graph_begin: cudaStreamBeginCapture on cuda:%d: %s", device, cudaGetErrorString(e));
  }
  d->capture_pool = pool;
  d->capture_tables.clear();
  d->capturing = true;
  return GL_OK;
}

extern "C" gl_cuda_graph *gl_cuda_graph_end(int device) {
  CuDevice *d = nullptr;
  if (device_state(device, "gl_cuda_graph_end", &d) != GL_OK) return nullptr;
  if (!d->capturing) {
    gl_error("gl_cuda_graph_end: cuda:%d is not capturing (gl_cuda_graph_begin first)", device);
    return nullptr;
  }
  gl_alloc_pool_close(device);
  d->capturing = false;
  gl_alloc_pool *pool = d->capture_pool;
  d->capture_pool = nullptr;
  std::vector<void *> held;
  held.swap(d->capture_tables);
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamEndCapture(d->stream[GL_STREAM_COMPUTE], &graph);
  gl_cuda_graph *g = nullptr;
  if (e == cudaSuccess) {
    g = new gl_cuda_graph();
    g->device = device;
    e = cudaGraphGetNodes(graph, nullptr, &g->nodes);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&g->exec, graph, 0);
    cudaGraphDestroy(graph);  /* the executable graph is independent of it */
  }
  {
    std::lock_guard<std::mutex> lk(d->checks_mu);
    if (g && e == cudaSuccess) {
      g->nchecks = d->checks_used;
      memcpy(g->check_meta, d->check_meta, sizeof g->check_meta);
    }
    d->checks_used = 0;  /* the captured check kernels have not run */
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (g && g->exec) cudaGraphExecDestroy(g->exec);
    delete g;
    gl_alloc_pool_release(pool);
    release_tables(device, held);
    gl_error("gl_cuda_graph_end: the work queued on cuda:%d could not be captured: %s", device, cudaGetErrorString(e));
    return nullptr;
  }
  g->pool = pool;
  g->tables = std::move(held);
  return g;
}

extern "C" int gl_cuda_graph_launch(gl_cuda_graph *g) {
  if (!g) return gl_error("gl_cuda_graph_launch: g is NULL, expected a graph of gl_cuda_graph_end");
  CuDevice *d = nullptr;
  GL_TRY(device_state(g->device, "gl_cuda_graph_launch", &d));
  if (d->capturing) return gl_error("gl_cuda_graph_launch: cuda:%d is capturing a graph", g->device);
  GL_CU_CHECK(cudaSetDevice(g->device));
  std::lock_guard<std::mutex> lk(d->checks_mu);
  if (d->checks_used > 0) GL_TRY(report_checks_locked(g->device, d));  /* checks queued before: read them now */
  GL_CU_CHECK(cudaGraphLaunch(g->exec, d->stream[GL_STREAM_COMPUTE]));
  memcpy(d->check_meta, g->check_meta, sizeof d->check_meta);
  d->checks_used = g->nchecks;
  return GL_OK;
}

extern "C" int64_t gl_cuda_graph_nodes(const gl_cuda_graph *g) {
  if (!g) return gl_error("gl_cuda_graph_nodes: g is NULL, expected a graph of gl_cuda_graph_end");
  return (int64_t)g->nodes;
}
extern "C" int64_t gl_cuda_graph_pool_bytes(const gl_cuda_graph *g) {
  if (!g) return gl_error("gl_cuda_graph_pool_bytes: g is NULL, expected a graph of gl_cuda_graph_end");
  return g->pool ? gl_alloc_pool_bytes(g->pool) : 0;
}

extern "C" void gl_cuda_graph_destroy(gl_cuda_graph *g) {
  if (!g) return;
  if (g->exec) (void)cudaGraphExecDestroy(g->exec);
  (void)cudaGetLastError();
  gl_alloc_pool_release(g->pool);  /* later work on the stream is ordered after the graph's */
  release_tables(g->device, g->tables);
  delete g;
}
