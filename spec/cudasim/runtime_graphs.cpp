/* runtime_graphs.cpp — the CUDA simulator's stream capture and graphs
 * (cudaStreamBeginCapture ... cudaGraphLaunch).  Part of the runtime
 * (runtime.cpp lists its files; runtime_internal.h is what they share).
 *
 * Capture.  cudaStreamBeginCapture(s) starts a capture sequence on s: from
 * then on the work queued on s (kernels, cuBLASLt, pinned and device copies,
 * sets) is not run but recorded as a node of the sequence, with the closure
 * that would have run it — the kernel's converted arguments, the copy's
 * pointers — so a launch re-runs the same work on the same addresses.  An
 * event recorded in a capturing stream carries the nodes before it; a
 * stream that waits for it joins the capture (fork), and the origin waiting
 * for an event of a joined stream depends on that stream's work (join).
 * cudaStreamEndCapture on the origin ends the sequence for every stream in
 * it and returns the graph, or the reason there is none.
 *
 * What a capture forbids (the real runtime's codes; the capture is
 * invalidated, so the mistake also surfaces at cudaStreamEndCapture, which
 * names the call that broke it):
 *   - the host waiting for a capturing stream: cudaStreamSynchronize,
 *     cudaStreamQuery, a copy to pageable host memory, synchronous copies
 *     -> cudaErrorStreamCaptureUnsupported;
 *   - capturing pageable host memory (a copy from it would be staged once,
 *     at capture, not at each launch) -> cudaErrorStreamCaptureUnsupported;
 *   - potentially unsafe calls (cudaMalloc, cudaFree, cudaHostAlloc,
 *     cudaFreeHost, cudaMemcpyPeer, cudaDeviceSynchronize) while a
 *     global-mode capture runs anywhere, or a thread-local one on the
 *     calling thread, unless the thread's mode is relaxed
 *     (cudaThreadExchangeStreamCaptureMode) -> cudaErrorStreamCaptureUnsupported;
 *   - the legacy default stream while a blocking stream of its device
 *     captures -> cudaErrorStreamCaptureImplicit;
 *   - waiting for an event recorded outside the capture ->
 *     cudaErrorStreamCaptureIsolation; merging two captures ->
 *     cudaErrorStreamCaptureMerge;
 *   - querying, synchronising or timing an event recorded in a capture ->
 *     cudaErrorCapturedEvent (the capture goes on);
 *   - ending on another stream than the origin -> cudaErrorStreamCaptureUnmatched,
 *     on another thread (not relaxed) -> cudaErrorStreamCaptureWrongThread,
 *     with a joined stream's work not joined back -> cudaErrorStreamCaptureUnjoined.
 *
 * Launch.  cudaGraphLaunch(exec, s) queues every node on s in the recorded
 * order (a topological order of the graph), each an ordinary work item: the
 * stream-order, host-access and race checks see replayed work as they see
 * any other.  A graph launched into a capturing stream is recorded node by
 * node.  What the nodes touch must still be allocated at launch: replaying
 * work on freed memory faults like any kernel would. */
#include <string.h>
#include <algorithm>
#include "runtime_internal.h"

using namespace gl_sim_rt;

struct CUgraph_st {
  std::vector<CUgraphNode_st> nodes;
};
struct CUgraphExec_st {
  std::vector<CUgraphNode_st> nodes;
};

/* the calling thread's capture interaction mode (cudaThreadExchangeStreamCaptureMode) */
static thread_local int tls_capture_mode = cudaStreamCaptureModeGlobal;

static const char *mode_name(int m) {
  switch (m) {
    case cudaStreamCaptureModeGlobal: return "cudaStreamCaptureModeGlobal";
    case cudaStreamCaptureModeThreadLocal: return "cudaStreamCaptureModeThreadLocal";
    case cudaStreamCaptureModeRelaxed: return "cudaStreamCaptureModeRelaxed";
  }
  return "?";
}

/* marks the sequence invalid with the first reason (R.mu held) */
static void invalidate_locked(CaptureSeq &c, const char *why) {
  if (c.invalidated) return;
  c.invalidated = true;
  c.why = why;
}

/* ends a sequence: its streams stop capturing (R.mu held) */
static void end_locked(Runtime &R, const std::shared_ptr<CaptureSeq> &c) {
  c->ended = true;
  for (CUstream_st *t : c->streams) {
    if (t->capture == c) {
      t->capture.reset();
      t->tail.clear();
    }
  }
  R.captures.erase(std::remove(R.captures.begin(), R.captures.end(), c), R.captures.end());
}

namespace gl_sim_rt {

cudaError_t capture_guard_locked(Runtime &R, const char *fn, CUstream_st *s, bool host_waits, bool pageable) {
  if (s->capture) {
    CaptureSeq &c = *s->capture;
    if (c.invalidated)
      return api_error(cudaErrorStreamCaptureInvalidated, "%s: the capture of stream %p was invalidated earlier by %s",
                       fn, (void *)c.origin, c.why.c_str());
    char why[512];
    if (host_waits) {
      snprintf(why, sizeof why, "%s (the host would wait for stream %p, which is being captured)", fn, (void *)s);
      invalidate_locked(c, why);
      return api_error(cudaErrorStreamCaptureUnsupported, "%s", why);
    }
    if (pageable) {
      snprintf(why, sizeof why,
               "%s (pageable host memory cannot be captured: a launch would not read it again; use pinned memory)", fn);
      invalidate_locked(c, why);
      return api_error(cudaErrorStreamCaptureUnsupported, "%s", why);
    }
    return cudaSuccess;
  }
  if (s->legacy) {
    for (const std::shared_ptr<CaptureSeq> &c : R.captures)
      for (CUstream_st *t : c->streams)
        if (t->device == s->device && !(t->flags & cudaStreamNonBlocking)) {
          char why[512];
          snprintf(why, sizeof why,
                   "%s on the legacy default stream (it would wait for stream %p, a blocking stream being captured)", fn,
                   (void *)t);
          invalidate_locked(*c, why);
          return api_error(cudaErrorStreamCaptureImplicit, "%s", why);
        }
  }
  return cudaSuccess;
}

void capture_record_locked(CUstream_st *s, const char *what, std::function<void()> work) {
  CaptureSeq &c = *s->capture;
  CUgraphNode_st n;
  n.what = what;
  n.work = std::move(work);
  n.deps = s->tail;
  c.nodes.push_back(std::move(n));
  s->tail.assign(1, c.nodes.size() - 1);
}

cudaError_t capture_wait_event_locked(Runtime &R, CUstream_st *s, CUevent_st *ev) {
  (void)R;
  const std::shared_ptr<CaptureSeq> &ec = ev->capture;
  if (s->capture && s->capture->invalidated)
    return api_error(cudaErrorStreamCaptureInvalidated, "cudaStreamWaitEvent: the capture of stream %p was invalidated earlier by %s",
                     (void *)s->capture->origin, s->capture->why.c_str());
  if (!ec || ec->ended) {
    if (!s->capture) return cudaSuccess;  /* an event of a finished capture orders nothing */
    char why[256];
    snprintf(why, sizeof why, "cudaStreamWaitEvent (event %p was recorded outside the capture)", (void *)ev);
    invalidate_locked(*s->capture, why);
    return api_error(cudaErrorStreamCaptureIsolation, "%s", why);
  }
  if (s->capture == ec) {  /* a join inside one capture */
    for (size_t n : ev->tail)
      if (std::find(s->tail.begin(), s->tail.end(), n) == s->tail.end()) s->tail.push_back(n);
    return cudaSuccess;
  }
  if (s->capture) {
    char why[256];
    snprintf(why, sizeof why, "cudaStreamWaitEvent (stream %p and event %p belong to two different captures)", (void *)s,
             (void *)ev);
    invalidate_locked(*s->capture, why);
    invalidate_locked(*ec, why);
    return api_error(cudaErrorStreamCaptureMerge, "%s", why);
  }
  if (s->legacy) {
    char why[256];
    snprintf(why, sizeof why, "cudaStreamWaitEvent (the legacy default stream cannot join a capture)");
    invalidate_locked(*ec, why);
    return api_error(cudaErrorStreamCaptureUnsupported, "%s", why);
  }
  s->capture = ec;  /* a fork: s joins the capture */
  s->tail = ev->tail;
  ec->streams.push_back(s);
  return cudaSuccess;
}

cudaError_t capture_unsafe_call(const char *fn, bool device_sync) {
  Runtime &R = *rt_state;
  std::lock_guard<std::mutex> g(R.mu);
  std::thread::id me = std::this_thread::get_id();
  for (const std::shared_ptr<CaptureSeq> &c : R.captures) {
    bool forbids = device_sync || (tls_capture_mode != cudaStreamCaptureModeRelaxed &&
                                   (c->mode == cudaStreamCaptureModeGlobal ||
                                    (c->mode == cudaStreamCaptureModeThreadLocal && c->thread == me)));
    if (!forbids) continue;
    char why[512];
    snprintf(why, sizeof why, "%s (not permitted while stream %p is being captured in %s%s)", fn, (void *)c->origin,
             mode_name(c->mode), device_sync ? "" : "; a relaxed thread mode would allow it");
    invalidate_locked(*c, why);
    return api_error(cudaErrorStreamCaptureUnsupported, "%s", why);
  }
  return cudaSuccess;
}

}  // namespace gl_sim_rt

/* ---- the API -------------------------------------------------------------------- */
extern "C" cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamBeginCapture", stream, &s);
  if (e != cudaSuccess) return e;
  if ((unsigned)mode > (unsigned)cudaStreamCaptureModeRelaxed)
    return api_error(cudaErrorInvalidValue, "cudaStreamBeginCapture: mode %d, expected 0..2 (cudaStreamCaptureModeGlobal..Relaxed)",
                     (int)mode);
  if (s->legacy)
    return api_error(cudaErrorStreamCaptureUnsupported, "cudaStreamBeginCapture: the legacy default stream cannot be captured");
  std::lock_guard<std::mutex> g(R.mu);
  if (s->capture)
    return api_error(cudaErrorIllegalState, "cudaStreamBeginCapture: stream %p is already capturing", (void *)s);
  auto c = std::make_shared<CaptureSeq>();
  c->origin = s;
  c->mode = (int)mode;
  c->thread = std::this_thread::get_id();
  c->streams.push_back(s);
  s->capture = c;
  s->tail.clear();
  R.captures.push_back(c);
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!graph) return api_error(cudaErrorInvalidValue, "cudaStreamEndCapture: pGraph is NULL");
  *graph = nullptr;
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamEndCapture", stream, &s);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> g(R.mu);
  std::shared_ptr<CaptureSeq> c = s->capture;
  if (!c) return api_error(cudaErrorIllegalState, "cudaStreamEndCapture: stream %p is not capturing", (void *)s);
  if (c->origin != s) {
    invalidate_locked(*c, "cudaStreamEndCapture on a stream that joined the capture, not its origin");
    return api_error(cudaErrorStreamCaptureUnmatched,
                     "cudaStreamEndCapture: stream %p joined the capture begun on stream %p; end it there", (void *)s,
                     (void *)c->origin);
  }
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id())
    return api_error(cudaErrorStreamCaptureWrongThread,
                     "cudaStreamEndCapture: the capture was begun on another thread in %s", mode_name(c->mode));
  /* every joined stream's last work must be an ancestor of the origin's */
  std::vector<char> reach(c->nodes.size(), 0);
  std::vector<size_t> todo(s->tail);
  while (!todo.empty()) {
    size_t n = todo.back();
    todo.pop_back();
    if (reach[n]) continue;
    reach[n] = 1;
    for (size_t d : c->nodes[n].deps) todo.push_back(d);
  }
  CUstream_st *unjoined = nullptr;
  for (CUstream_st *t : c->streams)
    for (size_t n : t->tail)
      if (t != s && !reach[n]) unjoined = t;
  end_locked(R, c);
  if (c->invalidated)
    return api_error(cudaErrorStreamCaptureInvalidated, "cudaStreamEndCapture: the capture was invalidated by %s",
                     c->why.c_str());
  if (unjoined)
    return api_error(cudaErrorStreamCaptureUnjoined,
                     "cudaStreamEndCapture: stream %p joined the capture and its last work was not waited for by "
                     "stream %p (record an event there and wait for it on the origin)",
                     (void *)unjoined, (void *)s);
  CUgraph_st *gr = new CUgraph_st();
  gr->nodes = std::move(c->nodes);
  R.graphs.insert(gr);
  *graph = gr;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!status) return api_error(cudaErrorInvalidValue, "cudaStreamIsCapturing: pCaptureStatus is NULL");
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaStreamIsCapturing", stream, &s);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> g(R.mu);
  if (s->legacy) {
    for (const std::shared_ptr<CaptureSeq> &c : R.captures)
      for (CUstream_st *t : c->streams)
        if (t->device == s->device && !(t->flags & cudaStreamNonBlocking))
          return api_error(cudaErrorStreamCaptureImplicit,
                           "cudaStreamIsCapturing: the legacy default stream while blocking stream %p is being captured",
                           (void *)t);
  }
  *status = !s->capture ? cudaStreamCaptureStatusNone
            : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

extern "C" cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) {
  rt();
  if (!mode) return api_error(cudaErrorInvalidValue, "cudaThreadExchangeStreamCaptureMode: mode is NULL");
  if ((unsigned)*mode > (unsigned)cudaStreamCaptureModeRelaxed)
    return api_error(cudaErrorInvalidValue, "cudaThreadExchangeStreamCaptureMode: mode %d, expected 0..2", (int)*mode);
  int old = tls_capture_mode;
  tls_capture_mode = (int)*mode;
  *mode = (enum cudaStreamCaptureMode)old;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *num_nodes) {
  Runtime &R = rt();
  if (!num_nodes) return api_error(cudaErrorInvalidValue, "cudaGraphGetNodes: numNodes is NULL");
  std::lock_guard<std::mutex> g(R.mu);
  if (!graph || !R.graphs.count(graph))
    return api_error(cudaErrorInvalidValue, "cudaGraphGetNodes: %p is not a live graph", (void *)graph);
  size_t n = graph->nodes.size();
  if (nodes) {
    size_t k = std::min(n, *num_nodes);
    for (size_t i = 0; i < k; i++) nodes[i] = &graph->nodes[i];
    for (size_t i = k; i < *num_nodes; i++) nodes[i] = nullptr;
    if (*num_nodes > n) *num_nodes = n;
  } else {
    *num_nodes = n;
  }
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long flags) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!exec) return api_error(cudaErrorInvalidValue, "cudaGraphInstantiate: pGraphExec is NULL");
  *exec = nullptr;
  if (flags != 0)
    return api_error(cudaErrorInvalidValue, "cudaGraphInstantiate: flags 0x%llx, the simulator supports 0", flags);
  std::lock_guard<std::mutex> g(R.mu);
  if (!graph || !R.graphs.count(graph))
    return api_error(cudaErrorInvalidValue, "cudaGraphInstantiate: %p is not a live graph", (void *)graph);
  CUgraphExec_st *x = new CUgraphExec_st();
  x->nodes = graph->nodes;  /* independent of the graph from now on, as the real one */
  R.execs.insert(x);
  *exec = x;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  CUstream_st *s = nullptr;
  cudaError_t e = resolve_stream("cudaGraphLaunch", stream, &s);
  if (e != cudaSuccess) return e;
  {
    std::lock_guard<std::mutex> g(R.mu);
    if (!exec || !R.execs.count(exec))
      return api_error(cudaErrorInvalidValue, "cudaGraphLaunch: %p is not a live executable graph", (void *)exec);
    if ((e = capture_guard_locked(R, "cudaGraphLaunch", s, false, false)) != cudaSuccess) return e;
  }
  for (const CUgraphNode_st &n : exec->nodes) {
    if (gl_sim_sticky() != cudaSuccess) break;
    submit_work(s, n.what, n.work);
  }
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.mu);
  if (!exec || !R.execs.erase(exec))
    return api_error(cudaErrorInvalidValue, "cudaGraphExecDestroy: %p is not a live executable graph", (void *)exec);
  delete exec;  /* queued work holds copies of the closures */
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.mu);
  if (!graph || !R.graphs.erase(graph))
    return api_error(cudaErrorInvalidValue, "cudaGraphDestroy: %p is not a live graph", (void *)graph);
  delete graph;
  return cudaSuccess;
}
