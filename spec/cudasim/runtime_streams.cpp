/* runtime_streams.cpp — the CUDA simulator's streams and events: queueing
 * and running work items, host synchronisation, copies and sets, and the
 * stream and event API.  Part of the runtime (runtime.cpp lists its three
 * files; runtime_internal.h is what they share): the device memory every
 * work item touches, and the checks made while it runs, are
 * runtime_memory.cpp's.
 *
 * Execution.  GL_SIM_STREAMS=sync (default): work runs at once on the
 * submitting thread.  GL_SIM_STREAMS=threads: each stream has a host worker
 * thread with a FIFO of work items, event markers and waits, so work on
 * different streams really runs unordered (in turns while the stream-order
 * check is on: see gl_sim_device_scope); host synchronizations wait for
 * the queues.  The runtime's state is allocated once and never destroyed,
 * so worker threads may still be parked when the process exits.
 *
 * Ordering.  Every work item gets (stream, seq) and a vector clock of what
 * it is ordered after (stream order, events, the legacy default stream's
 * implicit syncs with blocking streams, host synchronizations, and queries
 * that found the work done), kept here; runtime_memory.cpp's stream-order
 * check compares them. */
#include <string.h>
#include <functional>
#include <thread>
#include "runtime_internal.h"

using namespace gl_sim_rt;

/* ---- vector clocks -------------------------------------------------------------- */
static void clock_merge(Clock &dst, const Clock &src) {
  if (dst.size() < src.size()) dst.resize(src.size(), 0);
  for (size_t i = 0; i < src.size(); i++)
    if (src[i] > dst[i]) dst[i] = src[i];
}

/* ---- event times, work names ------------------------------------------------------ */
static double now_ms(void) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - rt_state->t0).count();
}

static const char *intern(const char *s) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.names_mu);
  return R.names.insert(std::string(s ? s : "work")).first->c_str();
}

/* ---- running work ---------------------------------------------------------------- */
/* wall time spent inside work items (all streams), in nanoseconds: what the
   host spent outside them is its own (gl_sim_work_seconds, for benchmarks) */
static std::atomic<uint64_t> work_ns{0};
extern "C" __attribute__((visibility("default"))) double gl_sim_work_seconds(void) { return (double)work_ns.load() * 1e-9; }

static void run_work(CUstream_st *s, QueueItem &it) {
  if (gl_sim_sticky() != cudaSuccess) return;  /* a failed context runs nothing more */
  auto t0 = std::chrono::steady_clock::now();
  struct AddTime {
    std::chrono::steady_clock::time_point t0;
    ~AddTime() {
      work_ns += (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    }
  } add_time{t0};
  gl_sim_device_scope scope;
  ItemCtx ctx;
  ctx.me.stream = s->id;
  ctx.me.device = (int16_t)s->device;
  ctx.me.legacy = s->legacy;
  ctx.me.seq = it.seq;
  ctx.me.what = it.what;
  ctx.clock = it.clock.data();
  ctx.nclock = it.clock.size();
  ItemCtx *prev = tls_item;
  if (check_streams()) close_opened(prev ? prev->me.what : nullptr);  /* this item's first accesses must fault */
  ensure_handler();
  tls_item = &ctx;
  gl_sim_account_item_begin(it.what);
  it.work();
  gl_sim_account_item_end();
  close_opened(ctx.me.what);
  tls_item = prev;
}

static void stamp_marker(QueueItem &it) {  /* R.mu held */
  if (it.event->gen == it.gen) it.event->time_ms = now_ms();
}

static void worker_main(CUstream_st *s) {
  Runtime &R = *rt_state;
  std::unique_lock<std::mutex> lk(R.mu);
  for (;;) {
    R.cv.wait(lk, [&] { return !s->queue.empty(); });
    QueueItem it = std::move(s->queue.front());
    s->queue.pop_front();
    switch (it.kind) {
      case QueueItem::EXIT:
        return;
      case QueueItem::WAIT:
        R.cv.wait(lk, [&] { return it.target->completed >= it.count; });
        break;
      case QueueItem::MARKER:
        stamp_marker(it);
        break;
      case QueueItem::WORK:
        lk.unlock();
        run_work(s, it);
        it.work = nullptr;  /* drop captures (staging buffers) before taking the lock */
        lk.lock();
        break;
    }
    s->completed++;
    R.cv.notify_all();
  }
}

namespace gl_sim_rt {
CUstream_st *new_stream_locked(Runtime &R, int device, unsigned flags, bool legacy) {
  CUstream_st *s = new CUstream_st();
  s->id = (uint32_t)R.streams.size();
  s->device = device;
  s->flags = flags;
  s->legacy = legacy;
  R.streams.push_back(s);
  R.live.insert(s);
  if (config.threaded) std::thread(worker_main, s).detach();
  return s;
}
}  // namespace gl_sim_rt

static void push_wait_locked(CUstream_st *s, CUstream_st *target, uint64_t count) {
  QueueItem w;
  w.kind = QueueItem::WAIT;
  w.target = target;
  w.count = count;
  s->queue.push_back(std::move(w));
  s->submitted++;
}

/* What every operation queued on s is ordered after: the host's waits and the
   legacy default stream's implicit synchronisation with blocking streams. */
static void order_submission_locked(Runtime &R, CUstream_st *s) {
  clock_merge(s->clock, R.host_clock);
  if (s->legacy) {
    for (CUstream_st *t : R.streams) {
      if (!t || t == s || t->legacy || t->device != s->device || (t->flags & cudaStreamNonBlocking)) continue;
      if (t->destroyed && t->completed >= t->submitted) continue;
      clock_merge(s->clock, t->clock);
      if (config.threaded && t->completed < t->submitted) push_wait_locked(s, t, t->submitted);
    }
  } else if (!(s->flags & cudaStreamNonBlocking)) {
    CUstream_st *L = R.legacy[s->device];
    clock_merge(s->clock, L->clock);
    if (config.threaded && L->completed < L->submitted) push_wait_locked(s, L, L->submitted);
  }
}

/* Queues (threads) or runs (sync) work on s; returns its queue position and
   clock for callers that wait for it. */
static uint64_t submit_on(CUstream_st *s, const char *what, std::function<void()> work, Clock *clock_out) {
  Runtime &R = *rt_state;
  std::unique_lock<std::mutex> lk(R.mu);
  if (s->capture) {  /* recorded, not run: a graph launch runs it */
    capture_record_locked(s, what, std::move(work));
    return 0;
  }
  order_submission_locked(R, s);
  s->work_seq++;
  if (s->clock.size() <= s->id) s->clock.resize(s->id + 1, 0);
  s->clock[s->id] = s->work_seq;
  QueueItem it;
  it.kind = QueueItem::WORK;
  it.work = std::move(work);
  it.what = what;
  it.seq = s->work_seq;
  it.clock = s->clock;
  trace_work(s->device, s->id, it.seq, what, it.clock);
  if (clock_out) *clock_out = s->clock;
  uint64_t pos = ++s->submitted;
  if (config.threaded) {
    s->queue.push_back(std::move(it));
    R.cv.notify_all();
    return pos;
  }
  lk.unlock();
  run_work(s, it);
  it.work = nullptr;
  lk.lock();
  s->completed++;
  R.cv.notify_all();
  return pos;
}

/* The host waits until s has completed queue position `count`, then is
   ordered after `clock`.  Code running inside a work item does not wait:
   in sync mode everything it submitted has already run, and in threads mode
   it could be waiting for its own stream (like a real stream callback, a
   work item must not synchronise). */
static void host_wait(const char *fn, CUstream_st *s, uint64_t count, const Clock &clock) {
  Runtime &R = *rt_state;
  if (!tls_item) { gl_sim_account_sync(fn); trace_host(true, fn); }
  std::unique_lock<std::mutex> lk(R.mu);
  if (!tls_item) R.cv.wait(lk, [&] { return s->completed >= count; });
  clock_merge(R.host_clock, clock);
}

namespace gl_sim_rt {
/* every stream of device d (all devices when d < 0) */
void host_wait_device(const char *fn, int d) {
  Runtime &R = *rt_state;
  if (!tls_item) { gl_sim_account_sync(fn); trace_host(true, fn); }
  std::unique_lock<std::mutex> lk(R.mu);
  std::vector<std::pair<CUstream_st *, uint64_t>> targets;
  for (CUstream_st *t : R.streams)
    if (t && (d < 0 || t->device == d)) {
      targets.emplace_back(t, t->submitted);
      clock_merge(R.host_clock, t->clock);
    }
  if (tls_item) return;
  R.cv.wait(lk, [&] {
    for (auto &p : targets)
      if (p.first->completed < p.second) return false;
    return true;
  });
}
}  // namespace gl_sim_rt

namespace gl_sim_rt {
void submit_work(CUstream_st *s, const char *what, std::function<void()> work) {
  submit_on(s, what, std::move(work), nullptr);
}
}  // namespace gl_sim_rt

/* ---- handles --------------------------------------------------------------------- */
namespace gl_sim_rt {
cudaError_t resolve_stream(const char *fn, cudaStream_t h, CUstream_st **out) {
  Runtime &R = rt();
  if (!h) {
    if (config.devices == 0) return api_error(cudaErrorNoDevice, "%s: no simulated device (GL_SIM_DEVICES=0)", fn);
    *out = R.legacy[tls_device];
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> g(R.mu);
  if (!R.live.count(h)) return api_error(cudaErrorInvalidResourceHandle, "%s: stream %p is not a live stream", fn, (void *)h);
  *out = h;
  return cudaSuccess;
}

std::shared_ptr<CUevent_st> find_event(cudaEvent_t e) {  /* R.mu held */
  auto it = rt_state->events.find(e);
  return it == rt_state->events.end() ? nullptr : it->second;
}
}  // namespace gl_sim_rt

/* the capture guard of an operation on s (R.mu taken here) */
static cudaError_t guard(const char *fn, CUstream_st *s, bool host_waits, bool pageable) {
  Runtime &R = *rt_state;
  std::lock_guard<std::mutex> g(R.mu);
  return capture_guard_locked(R, fn, s, host_waits, pageable);
}

/* ---- sim.h: submit ----------------------------------------------------------------- */
void gl_sim_submit(cudaStream_t stream, const char *what, std::function<void()> work) {
  CUstream_st *s = nullptr;
  const char *name = intern(what);
  if (resolve_stream(name, stream, &s) != cudaSuccess) {
    gl_sim_set_last_error(cudaErrorInvalidResourceHandle, "%s: stream %p is not a live stream", name, (void *)stream);
    return;
  }
  if (gl_sim_sticky() != cudaSuccess) return;
  cudaError_t e = guard(name, s, false, false);
  if (e != cudaSuccess) {
    gl_sim_set_last_error(e, "%s", cudaGetErrorString(e));
    return;
  }
  submit_on(s, name, std::move(work), nullptr);
}

/* ---- copies ---------------------------------------------------------------------- */
static const char *kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToHost: return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice: return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost: return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice: return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault: return "cudaMemcpyDefault";
  }
  return "?";
}

/* A device operand: must be live device memory with [p, p + n) inside its
   allocation. */
static cudaError_t check_device_range(const char *fn, const char *arg, const void *p, size_t n, const PtrInfo &in,
                                      const char *why) {
  if (in.side == FREED_DEVICE)
    return api_error(cudaErrorInvalidValue, "%s: %s %p is byte %ld of a %zu-byte allocation of cuda:%d that was freed",
                     fn, arg, p, (long)((uintptr_t)p - in.base), in.size, in.device);
  if (in.side != DEVICE)
    return api_error(cudaErrorInvalidValue, "%s: %s %p is host memory, expected device memory%s%s", fn, arg, p,
                     why ? " for " : "", why ? why : "");
  uintptr_t a = (uintptr_t)p, end = in.base + in.size;
  if (a < in.base)
    return api_error(cudaErrorInvalidValue, "%s: %s %p starts %zu bytes before its %zu-byte allocation of cuda:%d at %p",
                     fn, arg, p, (size_t)(in.base - a), in.size, in.device, (void *)in.base);
  if (a > end || n > end - a)
    return api_error(cudaErrorInvalidValue,
                     "%s: %s range %p + %zu bytes runs %zu bytes past the end of its %zu-byte allocation of cuda:%d "
                     "at %p",
                     fn, arg, p, n, (size_t)(a + n - end), in.size, in.device, (void *)in.base);
  return cudaSuccess;
}

/* One copy, as the real runtime orders it with respect to the host:
     sync API (cudaMemcpy): device to host and pinned host to device wait for
       the copy; pageable host to device waits for the stream's earlier work,
       stages the source, returns; device to device does not wait.
     async API: pageable host to device stages the source at once; device to
       pageable host waits for the copy; pinned memory and device to device
       are truly asynchronous.  Host to host always completes at once. */
static cudaError_t copy(const char *fn, void *dst, const void *src, size_t n, cudaMemcpyKind kind, CUstream_st *s,
                        bool sync_api) {
  if ((unsigned)kind > (unsigned)cudaMemcpyDefault)
    return api_error(cudaErrorInvalidMemcpyDirection, "%s: kind %d, expected 0..4 (cudaMemcpyHostToHost..Default)", fn,
                     (int)kind);
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return api_error(cudaErrorInvalidValue, "%s: %s is NULL", fn, dst ? "src" : "dst");
  PtrInfo di = classify(dst, n), si = classify(src, n);
  bool dst_dev = di.side == DEVICE || di.side == FREED_DEVICE, src_dev = si.side == DEVICE || si.side == FREED_DEVICE;
  cudaMemcpyKind k = kind;
  if (k == cudaMemcpyDefault)
    k = src_dev ? (dst_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
                : (dst_dev ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  bool want_dst_dev = k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice;
  bool want_src_dev = k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice;
  cudaError_t e;
  if (want_dst_dev) {
    if ((e = check_device_range(fn, "dst", dst, n, di, kind_name(kind))) != cudaSuccess) return e;
  } else if (dst_dev) {
    return api_error(cudaErrorInvalidValue, "%s: dst %p is device memory (cuda:%d), expected host memory for %s", fn,
                     dst, di.device, kind_name(kind));
  }
  if (want_src_dev) {
    if ((e = check_device_range(fn, "src", src, n, si, kind_name(kind))) != cudaSuccess) return e;
  } else if (src_dev) {
    return api_error(cudaErrorInvalidValue, "%s: src %p is device memory (cuda:%d), expected host memory for %s", fn,
                     src, si.device, kind_name(kind));
  }
  {
    bool host_waits = sync_api || k == cudaMemcpyHostToHost || (k == cudaMemcpyDeviceToHost && di.side == HOST_PAGEABLE);
    bool pageable = (k == cudaMemcpyHostToDevice && si.side == HOST_PAGEABLE) ||
                    (k == cudaMemcpyDeviceToHost && di.side == HOST_PAGEABLE);
    if ((e = guard(fn, s, host_waits, pageable)) != cudaSuccess) return e;
  }
  Clock clock;
  if (k == cudaMemcpyHostToHost) {
    uint64_t pos = submit_on(s, "cudaMemcpy host to host", [=] { memmove(dst, src, n); }, &clock);
    host_wait("cudaMemcpy host to host", s, pos, clock);
  } else if (k == cudaMemcpyHostToDevice) {
    if (si.side == HOST_PINNED) {
      uint64_t pos = submit_on(s, "cudaMemcpy host to device", [=] {
        memmove(dst, src, n);
        gl_sim_account_add(nullptr, 0, 0, (double)n);
      }, &clock);
      if (sync_api) host_wait("cudaMemcpy from pinned host memory", s, pos, clock);
    } else {
      if (sync_api) {  /* "a stream sync is performed before the copy is initiated" */
        Runtime &R = *rt_state;
        uint64_t pos;
        {
          std::lock_guard<std::mutex> g(R.mu);
          pos = s->submitted;
          clock = s->clock;
        }
        host_wait("cudaMemcpy from pageable host memory", s, pos, clock);
      }
      auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char *)src,
                                                                   (const unsigned char *)src + n);
      submit_on(s, "cudaMemcpy host to device", [=] {
        memmove(dst, staged->data(), n);
        gl_sim_account_add(nullptr, 0, 0, (double)n);
      }, nullptr);
    }
  } else if (k == cudaMemcpyDeviceToHost) {
    uint64_t pos = submit_on(s, "cudaMemcpy device to host", [=] {
      memmove(dst, src, n);
      gl_sim_account_add(nullptr, 0, (double)n, 0);
    }, &clock);
    if (sync_api || di.side == HOST_PAGEABLE) host_wait("cudaMemcpy to host memory", s, pos, clock);
  } else {
    submit_on(s, "cudaMemcpy device to device", [=] {
      memmove(dst, src, n);
      gl_sim_account_add(nullptr, 0, (double)n, (double)n);
    }, nullptr);
  }
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaMemcpy", nullptr, &s);
  if (e != cudaSuccess) return e;
  return copy("cudaMemcpy", dst, src, count, kind, s, true);
}

extern "C" cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                       cudaStream_t stream) {
  rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaMemcpyAsync", stream, &s);
  if (e != cudaSuccess) return e;
  return copy("cudaMemcpyAsync", dst, src, count, kind, s, false);
}

static cudaError_t peer_copy(const char *fn, void *dst, int dst_device, const void *src, int src_device, size_t n,
                             CUstream_st *s, bool sync_api) {
  cudaError_t e;
  if ((e = check_device(fn, dst_device)) != cudaSuccess) return e;
  if ((e = check_device(fn, src_device)) != cudaSuccess) return e;
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return api_error(cudaErrorInvalidValue, "%s: %s is NULL", fn, dst ? "src" : "dst");
  PtrInfo di = classify(dst, n), si = classify(src, n);
  if ((e = check_device_range(fn, "dst", dst, n, di, nullptr)) != cudaSuccess) return e;
  if ((e = check_device_range(fn, "src", src, n, si, nullptr)) != cudaSuccess) return e;
  if (di.device != dst_device)
    return api_error(cudaErrorInvalidValue, "%s: dst %p is memory of cuda:%d, expected cuda:%d (dstDevice)", fn, dst,
                     di.device, dst_device);
  if (si.device != src_device)
    return api_error(cudaErrorInvalidValue, "%s: src %p is memory of cuda:%d, expected cuda:%d (srcDevice)", fn, src,
                     si.device, src_device);
  if (sync_api && (e = capture_unsafe_call(fn, false)) != cudaSuccess) return e;
  if ((e = guard(fn, s, sync_api, false)) != cudaSuccess) return e;
  if (sync_api) {
    /* cudaMemcpyPeer is serialised with all work on both devices (and the current one) */
    host_wait_device("cudaMemcpyPeer", -1);
    Clock clock;
    uint64_t pos = submit_on(s, "cudaMemcpyPeer", [=] { memmove(dst, src, n); }, &clock);
    host_wait("cudaMemcpyPeer", s, pos, clock);
  } else {
    submit_on(s, "cudaMemcpyPeerAsync", [=] { memmove(dst, src, n); }, nullptr);
  }
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemcpyPeer(void *dst, int dst_device, const void *src, int src_device, size_t count) {
  rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaMemcpyPeer", nullptr, &s);
  if (e != cudaSuccess) return e;
  return peer_copy("cudaMemcpyPeer", dst, dst_device, src, src_device, count, s, true);
}

extern "C" cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_device, const void *src, int src_device, size_t count,
                                           cudaStream_t stream) {
  rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaMemcpyPeerAsync", stream, &s);
  if (e != cudaSuccess) return e;
  return peer_copy("cudaMemcpyPeerAsync", dst, dst_device, src, src_device, count, s, false);
}

static cudaError_t memset_on(const char *fn, void *p, int value, size_t n, CUstream_st *s) {
  if (n == 0) return cudaSuccess;
  if (!p) return api_error(cudaErrorInvalidValue, "%s: devPtr is NULL", fn);
  PtrInfo in = classify(p, n);
  cudaError_t e = check_device_range(fn, "devPtr", p, n, in, nullptr);
  if (e != cudaSuccess) return e;
  if ((e = guard(fn, s, false, false)) != cudaSuccess) return e;
  unsigned char byte = (unsigned char)value;
  submit_on(s, fn, [=] {
    memset(p, byte, n);
    gl_sim_account_add(nullptr, 0, 0, (double)n);
  }, nullptr);
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemset(void *dev_ptr, int value, size_t count) {
  rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaMemset", nullptr, &s);
  if (e != cudaSuccess) return e;
  return memset_on("cudaMemset", dev_ptr, value, count, s);
}

extern "C" cudaError_t cudaMemsetAsync(void *dev_ptr, int value, size_t count, cudaStream_t stream) {
  rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaMemsetAsync", stream, &s);
  if (e != cudaSuccess) return e;
  return memset_on("cudaMemsetAsync", dev_ptr, value, count, s);
}

/* ---- streams ---------------------------------------------------------------------- */
extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!stream) return api_error(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: pStream is NULL");
  if (flags & ~(unsigned)cudaStreamNonBlocking)
    return api_error(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: flags 0x%x, expected 0 or 1 (cudaStreamNonBlocking)",
                     flags);
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaStreamCreateWithFlags: no simulated device");
  std::lock_guard<std::mutex> g(R.mu);
  *stream = new_stream_locked(R, tls_device, flags, false);
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t *stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

extern "C" cudaError_t cudaStreamGetFlags(cudaStream_t stream, unsigned int *flags) {
  rt();
  RETURN_IF_STICKY();
  if (!flags) return api_error(cudaErrorInvalidValue, "cudaStreamGetFlags: flags is NULL");
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamGetFlags", stream, &s);
  if (e != cudaSuccess) return e;
  *flags = s->flags;
  return cudaSuccess;
}

/* Returns at once, as the real one: queued work still runs (threads mode:
   the worker drains its queue, then exits). */
extern "C" cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.mu);
  if (!stream || !R.live.count(stream))
    return api_error(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: %p is not a live stream%s", (void *)stream,
                     stream ? "" : " (the default stream cannot be destroyed)");
  stream->destroyed = true;
  R.live.erase(stream);
  if (config.threaded) {
    QueueItem x;
    x.kind = QueueItem::EXIT;
    stream->queue.push_back(std::move(x));
    R.cv.notify_all();
  }
  return gl_sim_sticky();
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamSynchronize", stream, &s);
  if (e != cudaSuccess) return e;
  if ((e = guard("cudaStreamSynchronize", s, true, false)) != cudaSuccess) return e;
  uint64_t pos;
  Clock clock;
  {
    std::lock_guard<std::mutex> g(R.mu);
    pos = s->submitted;
    clock = s->clock;
  }
  host_wait("cudaStreamSynchronize", s, pos, clock);
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamQuery", stream, &s);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> g(R.mu);
  if ((e = capture_guard_locked(R, "cudaStreamQuery", s, true, false)) != cudaSuccess) return e;
  if (s->completed < s->submitted) return cudaErrorNotReady;  /* not an error: no last error */
  if (!tls_item) trace_host(false, "cudaStreamQuery");
  clock_merge(R.host_clock, s->clock);  /* the host has seen it finish: later work is ordered after */
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamWaitEvent", stream, &s);
  if (e != cudaSuccess) return e;
  if (flags != cudaEventWaitDefault)
    return api_error(cudaErrorInvalidValue, "cudaStreamWaitEvent: flags 0x%x, expected 0", flags);
  std::lock_guard<std::mutex> g(R.mu);
  std::shared_ptr<CUevent_st> ev = find_event(event);
  if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: %p is not a live event", (void *)event);
  if (ev->capture || s->capture) return capture_wait_event_locked(R, s, ev.get());
  if ((e = capture_guard_locked(R, "cudaStreamWaitEvent", s, false, false)) != cudaSuccess) return e;
  if (!ev->recorded) return cudaSuccess;  /* waiting for an event never recorded is a no-op */
  order_submission_locked(R, s);
  clock_merge(s->clock, ev->clock);
  {
    uint32_t w = ev->stream->id;
    trace_wait(s->device, s->id, w, w < ev->clock.size() ? ev->clock[w] : 0);
  }
  if (config.threaded && ev->stream->completed < ev->count) {
    push_wait_locked(s, ev->stream, ev->count);
    R.cv.notify_all();
  }
  return cudaSuccess;
}

/* ---- events ----------------------------------------------------------------------- */
extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!event) return api_error(cudaErrorInvalidValue, "cudaEventCreateWithFlags: event is NULL");
  if (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming))
    return api_error(cudaErrorInvalidValue, "cudaEventCreateWithFlags: flags 0x%x, expected a combination of 0x1, 0x2",
                     flags);
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaEventCreateWithFlags: no simulated device");
  auto ev = std::make_shared<CUevent_st>();
  ev->flags = flags;
  ev->device = tls_device;
  std::lock_guard<std::mutex> g(R.mu);
  R.events[ev.get()] = ev;
  *event = ev.get();
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

extern "C" cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaEventRecord", stream, &s);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> g(R.mu);
  std::shared_ptr<CUevent_st> ev = find_event(event);
  if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaEventRecord: %p is not a live event", (void *)event);
  if (ev->device != s->device)
    return api_error(cudaErrorInvalidResourceHandle, "cudaEventRecord: an event of cuda:%d recorded on a stream of cuda:%d",
                     ev->device, s->device);
  if ((e = capture_guard_locked(R, "cudaEventRecord", s, false, false)) != cudaSuccess) return e;
  if (s->capture) {  /* a record inside a capture: what later waits on it depend on */
    ev->capture = s->capture;
    ev->tail = s->tail;
    return cudaSuccess;
  }
  ev->capture.reset();
  ev->tail.clear();
  order_submission_locked(R, s);
  ev->recorded = true;
  ev->stream = s;
  ev->clock = s->clock;
  ev->gen++;
  ev->count = ++s->submitted;
  QueueItem m;
  m.kind = QueueItem::MARKER;
  m.event = ev;
  m.gen = ev->gen;
  if (config.threaded) {
    s->queue.push_back(std::move(m));
    R.cv.notify_all();
  } else {
    stamp_marker(m);  /* everything before it on the stream has run */
    s->completed++;
    R.cv.notify_all();
  }
  return cudaSuccess;
}

static bool event_done_locked(const CUevent_st *ev) { return !ev->recorded || ev->stream->completed >= ev->count; }

extern "C" cudaError_t cudaEventQuery(cudaEvent_t event) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  std::lock_guard<std::mutex> g(R.mu);
  std::shared_ptr<CUevent_st> ev = find_event(event);
  if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaEventQuery: %p is not a live event", (void *)event);
  if (ev->capture)
    return api_error(cudaErrorCapturedEvent, "cudaEventQuery: event %p was last recorded in a capturing stream", (void *)event);
  if (!event_done_locked(ev.get())) return cudaErrorNotReady;
  if (ev->recorded && !tls_item) trace_host(false, "cudaEventQuery");
  if (ev->recorded) clock_merge(R.host_clock, ev->clock);  /* the host has seen it pass, as after a synchronize */
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  std::unique_lock<std::mutex> lk(R.mu);
  std::shared_ptr<CUevent_st> ev = find_event(event);
  if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: %p is not a live event", (void *)event);
  if (ev->capture)
    return api_error(cudaErrorCapturedEvent, "cudaEventSynchronize: event %p was last recorded in a capturing stream",
                     (void *)event);
  if (!ev->recorded) return cudaSuccess;
  if (!tls_item) {
    gl_sim_account_sync("cudaEventSynchronize");
    trace_host(true, "cudaEventSynchronize");
    R.cv.wait(lk, [&] { return event_done_locked(ev.get()); });
  }
  clock_merge(R.host_clock, ev->clock);
  lk.unlock();
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!ms) return api_error(cudaErrorInvalidValue, "cudaEventElapsedTime: ms is NULL");
  std::lock_guard<std::mutex> g(R.mu);
  std::shared_ptr<CUevent_st> a = find_event(start), b = find_event(end);
  if (!a || !b)
    return api_error(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: %s %p is not a live event",
                     a ? "end" : "start", a ? (void *)end : (void *)start);
  if ((a->flags | b->flags) & cudaEventDisableTiming)
    return api_error(cudaErrorInvalidResourceHandle,
                     "cudaEventElapsedTime: the %s event was created with cudaEventDisableTiming",
                     (a->flags & cudaEventDisableTiming) ? "start" : "end");
  if (a->capture || b->capture)
    return api_error(cudaErrorCapturedEvent, "cudaEventElapsedTime: the %s event was last recorded in a capturing stream",
                     a->capture ? "start" : "end");
  if (!a->recorded || !b->recorded)
    return api_error(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: the %s event was never recorded",
                     a->recorded ? "end" : "start");
  if (!event_done_locked(a.get()) || !event_done_locked(b.get())) return cudaErrorNotReady;
  *ms = (float)(b->time_ms - a->time_ms);
  return cudaSuccess;
}

/* Destruction of an event whose marker is still queued is deferred: the
   marker holds its own reference. */
extern "C" cudaError_t cudaEventDestroy(cudaEvent_t event) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.mu);
  if (!R.events.erase(event))
    return api_error(cudaErrorInvalidResourceHandle, "cudaEventDestroy: %p is not a live event", (void *)event);
  return gl_sim_sticky();
}
