/* graphs.cu — checks of the simulator's stream capture and graphs
 * (spec/cudasim/runtime_graphs.cpp), built into build/sim/libgptlua_simtest.so
 * and driven by spec/sim_graphs_spec.lua through LuaJIT's ffi.  Written like
 * cases/runtime.cu: kernels through GL_LAUNCH, memory through the runtime API.
 *
 *   gl_simtest_graph_replay     a captured sequence (kernels, a set, pinned
 *                               copies both ways) runs nothing while captured;
 *                               each launch re-runs it on the recorded
 *                               addresses, reading the pinned input anew
 *   gl_simtest_graph_fork_join  a second stream joins the capture through an
 *                               event and is joined back; the launch runs both
 *                               branches in order, on any stream
 *   gl_simtest_graph_misuse(name, &end)  one call a capture forbids (or a
 *                               permitted twin): its cudaError_t, and what
 *                               cudaStreamEndCapture then returned
 * Return values as cases/runtime.cu's: mismatches, or -cudaError_t. */
#include "common.cuh"
#include "simtest.h"
#include <string.h>
#include <string>
#include <thread>

SIMTEST_MESSAGE(graph)

#define EXPECT(cond, ...)  \
  do {                     \
    if (!(cond)) {         \
      note(__VA_ARGS__);   \
      bad++;               \
    }                      \
  } while (0)

namespace {
struct DevBuf {
  void *p = nullptr;
  DevBuf() = default;
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
  ~DevBuf() { if (p) cudaFree(p); }
  template <class T> T *as() const { return (T *)p; }
};
struct PinnedBuf {
  void *p = nullptr;
  ~PinnedBuf() { if (p) cudaFreeHost(p); }
  template <class T> T *as() const { return (T *)p; }
};
struct Stream {
  cudaStream_t s = nullptr;
  ~Stream() { if (s) cudaStreamDestroy(s); }
};
struct Event {
  cudaEvent_t e = nullptr;
  ~Event() { if (e) cudaEventDestroy(e); }
};
/* a graph and its executable, destroyed with the scope */
struct Graph {
  cudaGraph_t g = nullptr;
  cudaGraphExec_t x = nullptr;
  ~Graph() {
    if (x) cudaGraphExecDestroy(x);
    if (g) cudaGraphDestroy(g);
  }
};
}  // namespace
#define ALLOC(buf, bytes) TRY(cudaMalloc(&(buf).p, (bytes)))

__global__ void kg_fill(float *x, float v, int n) {
  CU_GRID_LOOP(i, n) x[i] = v;
}
__global__ void kg_add(float *x, float v, int n) {
  CU_GRID_LOOP(i, n) x[i] += v;
}
/* y = a * x + y */
__global__ void kg_axpy(float *y, const float *x, float a, int n) {
  CU_GRID_LOOP(i, n) y[i] += a * x[i];
}

static size_t node_count(cudaGraph_t g) {
  size_t n = 0;
  if (cudaGraphGetNodes(g, nullptr, &n) != cudaSuccess) return (size_t)-1;
  return n;
}

extern "C" int gl_simtest_graph_replay(void) {
  begin();
  int bad = 0;
  const int n = 300;
  const size_t nb = n * sizeof(float);
  Stream st;
  TRY(cudaStreamCreate(&st.s));
  DevBuf x, acc, y;
  ALLOC(x, nb);
  ALLOC(acc, nb);
  ALLOC(y, nb);
  PinnedBuf in, out;
  TRY(cudaMallocHost(&in.p, nb));
  TRY(cudaMallocHost(&out.p, nb));
  TRY(cudaMemsetAsync(acc.p, 0, nb, st.s));
  TRY(cudaMemsetAsync(y.p, 0, nb, st.s));
  for (int i = 0; i < n; i++) in.as<float>()[i] = 1;
  TRY(cudaStreamSynchronize(st.s));
  /* the step: x = in; x += 2; acc += x; y = 0 then y += 3 * acc; out = y */
  Graph g;
  TRY(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  TRY(cudaStreamIsCapturing(st.s, &cs));
  EXPECT(cs == cudaStreamCaptureStatusActive, "cudaStreamIsCapturing during capture: %d, expected 1 (active)", (int)cs);
  TRY(cudaMemcpyAsync(x.p, in.p, nb, cudaMemcpyHostToDevice, st.s));
  GL_LAUNCH(2, 256, 0, st.s, kg_add)(x.as<float>(), 2.0f, n);
  GL_LAUNCH(2, 256, 0, st.s, kg_axpy)(acc.as<float>(), x.as<float>(), 1.0f, n);
  TRY(cudaMemsetAsync(y.p, 0, nb, st.s));
  GL_LAUNCH(2, 256, 0, st.s, kg_axpy)(y.as<float>(), acc.as<float>(), 3.0f, n);
  TRY(cudaMemcpyAsync(out.p, y.p, nb, cudaMemcpyDeviceToHost, st.s));
  TRY(cudaGetLastError());
  TRY(cudaStreamEndCapture(st.s, &g.g));
  TRY(cudaStreamIsCapturing(st.s, &cs));
  EXPECT(cs == cudaStreamCaptureStatusNone, "cudaStreamIsCapturing after the capture: %d, expected 0", (int)cs);
  EXPECT(node_count(g.g) == 6, "the graph has %zu nodes, expected 6 (2 copies, 3 kernels, a set)", node_count(g.g));
  /* nothing ran while capturing */
  float h[n];
  TRY(cudaMemcpy(h, acc.p, nb, cudaMemcpyDeviceToHost));
  EXPECT(h[0] == 0 && h[n - 1] == 0, "acc is %g after the capture, expected 0 (captured work must not run)", h[0]);
  TRY(cudaGraphInstantiate(&g.x, g.g, 0));
  /* three launches, the pinned input changed between them */
  float expect_acc = 0;
  for (int launch = 0; launch < 3; launch++) {
    float v = (float)(launch + 1) * 10;
    for (int i = 0; i < n; i++) in.as<float>()[i] = v + (float)i;
    TRY(cudaGraphLaunch(g.x, st.s));
    TRY(cudaStreamSynchronize(st.s));
    expect_acc += v + 2;  /* at element 0 */
    EXPECT(out.as<float>()[0] == 3 * expect_acc, "launch %d: out[0] = %g, expected %g", launch, out.as<float>()[0],
           3 * expect_acc);
    float last = 3 * (expect_acc + (float)(launch + 1) * (float)(n - 1));
    EXPECT(out.as<float>()[n - 1] == last, "launch %d: out[%d] = %g, expected %g", launch, n - 1,
           out.as<float>()[n - 1], last);
  }
  /* the graph is independent of its executable; launched on another stream too */
  Stream other;
  TRY(cudaStreamCreate(&other.s));
  TRY(cudaGraphLaunch(g.x, other.s));
  TRY(cudaStreamSynchronize(other.s));
  EXPECT(out.as<float>()[0] == 3 * (expect_acc + 32), "launch on another stream: out[0] = %g, expected %g",
         out.as<float>()[0], 3 * (expect_acc + 32));
  return bad;
}

extern "C" int gl_simtest_graph_fork_join(void) {
  begin();
  int bad = 0;
  const int n = 256;
  const size_t nb = n * sizeof(float);
  Stream s0, s1;
  TRY(cudaStreamCreate(&s0.s));
  TRY(cudaStreamCreateWithFlags(&s1.s, cudaStreamNonBlocking));
  Event fork, join;
  TRY(cudaEventCreateWithFlags(&fork.e, cudaEventDisableTiming));
  TRY(cudaEventCreateWithFlags(&join.e, cudaEventDisableTiming));
  DevBuf a, b, c;
  ALLOC(a, nb);
  ALLOC(b, nb);
  ALLOC(c, nb);
  Graph g;
  TRY(cudaStreamBeginCapture(s0.s, cudaStreamCaptureModeGlobal));
  GL_LAUNCH(1, 256, 0, s0.s, kg_fill)(a.as<float>(), 2.0f, n);  /* a = 2 */
  TRY(cudaEventRecord(fork.e, s0.s));
  TRY(cudaStreamWaitEvent(s1.s, fork.e, 0));  /* s1 joins */
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  TRY(cudaStreamIsCapturing(s1.s, &cs));
  EXPECT(cs == cudaStreamCaptureStatusActive, "the forked stream is not capturing (%d)", (int)cs);
  GL_LAUNCH(1, 256, 0, s1.s, kg_fill)(b.as<float>(), 0.0f, n);
  GL_LAUNCH(1, 256, 0, s1.s, kg_axpy)(b.as<float>(), a.as<float>(), 5.0f, n);  /* b = 10 */
  GL_LAUNCH(1, 256, 0, s0.s, kg_fill)(c.as<float>(), 0.0f, n);  /* beside s1's branch */
  TRY(cudaEventRecord(join.e, s1.s));
  TRY(cudaStreamWaitEvent(s0.s, join.e, 0));
  GL_LAUNCH(1, 256, 0, s0.s, kg_axpy)(c.as<float>(), b.as<float>(), 1.0f, n);  /* c = 10 */
  TRY(cudaGetLastError());
  TRY(cudaStreamEndCapture(s0.s, &g.g));
  TRY(cudaStreamIsCapturing(s1.s, &cs));
  EXPECT(cs == cudaStreamCaptureStatusNone, "the forked stream still captures after the end (%d)", (int)cs);
  EXPECT(node_count(g.g) == 5, "the graph has %zu nodes, expected 5", node_count(g.g));
  cudaGraphNode_t nodes[8];
  size_t nn = 8;
  TRY(cudaGraphGetNodes(g.g, nodes, &nn));
  EXPECT(nn == 5 && nodes[4] != nullptr && nodes[5] == nullptr, "cudaGraphGetNodes gave %zu nodes", nn);
  TRY(cudaGraphInstantiate(&g.x, g.g, 0));
  /* launched on s1 this time: the launch stream does not matter */
  for (int k = 0; k < 2; k++) {
    TRY(cudaGraphLaunch(g.x, s1.s));
    float h[n];
    TRY(cudaStreamSynchronize(s1.s));  /* s1 is non-blocking: the legacy stream's copy does not wait for it */
    TRY(cudaMemcpy(h, c.p, nb, cudaMemcpyDeviceToHost));
    EXPECT(h[0] == 10 && h[n - 1] == 10, "launch %d: c = %g, expected 10", k, h[0]);
  }
  return bad;
}

/* One call a capture forbids, or its permitted twin.  Returns that call's
   cudaError_t; *end gets what cudaStreamEndCapture returned afterwards (0
   when the case ends no capture). */
extern "C" int gl_simtest_graph_misuse(const char *name, int *end) {
  begin();
  std::string w = name;
  *end = -1;
  Stream s, s1;
  TRY(cudaStreamCreate(&s.s));
  TRY(cudaStreamCreate(&s1.s));
  Event ev;
  TRY(cudaEventCreate(&ev.e));
  DevBuf a;
  ALLOC(a, 1024);
  PinnedBuf pin;
  TRY(cudaMallocHost(&pin.p, 1024));
  float host[256];
  void *p = nullptr;
  cudaError_t e = cudaErrorUnknown;
  bool capture = true;
  int mode = cudaStreamCaptureModeGlobal;
  if (w == "malloc_thread_local_other_thread" || w == "malloc_thread_local") mode = cudaStreamCaptureModeThreadLocal;
  if (w == "legacy_capture") {
    e = cudaStreamBeginCapture(0, cudaStreamCaptureModeGlobal);
    capture = false;
  } else if (w == "not_capturing") {
    cudaGraph_t g = nullptr;
    e = cudaStreamEndCapture(s.s, &g);
    capture = false;
  } else if (w == "bad_mode") {
    e = cudaStreamBeginCapture(s.s, (cudaStreamCaptureMode)7);
    capture = false;
  } else if (w == "isolation_setup") {
    TRY(cudaEventRecord(ev.e, s1.s));  /* outside any capture */
  }
  if (capture) TRY(cudaStreamBeginCapture(s.s, (cudaStreamCaptureMode)mode));
  GL_LAUNCH(1, 256, 0, s.s, kg_fill)(a.as<float>(), 1.0f, 256);
  if (!capture) {
  } else if (w == "stream_sync") e = cudaStreamSynchronize(s.s);
  else if (w == "stream_query") e = cudaStreamQuery(s.s);
  else if (w == "device_sync") e = cudaDeviceSynchronize();
  else if (w == "malloc") e = cudaMalloc(&p, 64);
  else if (w == "malloc_thread_local") e = cudaMalloc(&p, 64);
  else if (w == "malloc_relaxed") {
    cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
    TRY(cudaThreadExchangeStreamCaptureMode(&m));
    e = cudaMalloc(&p, 64);
    TRY(cudaThreadExchangeStreamCaptureMode(&m));
  } else if (w == "malloc_other_thread" || w == "malloc_thread_local_other_thread") {
    std::thread t([&] { e = cudaMalloc(&p, 64); });
    t.join();
  } else if (w == "free") e = cudaFree(a.p);
  else if (w == "pageable_to_device") e = cudaMemcpyAsync(a.p, host, 64, cudaMemcpyHostToDevice, s.s);
  else if (w == "device_to_pageable") e = cudaMemcpyAsync(host, a.p, 64, cudaMemcpyDeviceToHost, s.s);
  else if (w == "pinned_to_device") e = cudaMemcpyAsync(a.p, pin.p, 64, cudaMemcpyHostToDevice, s.s);
  else if (w == "sync_copy") e = cudaMemcpy(host, a.p, 64, cudaMemcpyDeviceToHost);
  else if (w == "legacy_stream") e = cudaMemsetAsync(a.p, 0, 64, 0);
  else if (w == "isolation_setup") e = cudaStreamWaitEvent(s.s, ev.e, 0);
  else if (w == "captured_event_query") {
    TRY(cudaEventRecord(ev.e, s.s));
    e = cudaEventQuery(ev.e);
  } else if (w == "captured_event_sync") {
    TRY(cudaEventRecord(ev.e, s.s));
    e = cudaEventSynchronize(ev.e);
  } else if (w == "double_begin") e = cudaStreamBeginCapture(s.s, cudaStreamCaptureModeGlobal);
  else if (w == "unjoined" || w == "unmatched") {
    TRY(cudaEventRecord(ev.e, s.s));
    TRY(cudaStreamWaitEvent(s1.s, ev.e, 0));
    GL_LAUNCH(1, 256, 0, s1.s, kg_add)(a.as<float>(), 1.0f, 256);
    e = cudaGetLastError();
    if (w == "unmatched") {
      cudaGraph_t g = nullptr;
      e = cudaStreamEndCapture(s1.s, &g);
    }
  } else if (w == "after_invalidation") {
    (void)cudaStreamSynchronize(s.s);
    (void)cudaGetLastError();
    GL_LAUNCH(1, 256, 0, s.s, kg_add)(a.as<float>(), 1.0f, 256);
    e = cudaGetLastError();
  } else {
    note("unknown misuse '%s'", name);
    cudaGraph_t g = nullptr;
    if (cudaStreamEndCapture(s.s, &g) == cudaSuccess) cudaGraphDestroy(g);
    return -1;
  }
  std::string msg = cudaGetErrorString(e);
  (void)cudaGetLastError();
  if (capture) {
    cudaGraph_t g = nullptr;
    *end = (int)cudaStreamEndCapture(s.s, &g);
    if (*end != cudaSuccess) msg += std::string(" | end: ") + cudaGetErrorString((cudaError_t)*end);
    if (*end != cudaSuccess && g) msg += " | a graph came back with an error";
    if (g) cudaGraphDestroy(g);
    (void)cudaGetLastError();
  } else {
    *end = 0;
  }
  if (p) cudaFree(p);
  TRY(cudaDeviceSynchronize());
  simtest_msg = msg;
  return (int)e;
}

/* a graph launch on a destroyed executable graph is an error, not a crash */
extern "C" int gl_simtest_graph_destroyed_exec(void) {
  begin();
  Stream s;
  TRY(cudaStreamCreate(&s.s));
  DevBuf a;
  ALLOC(a, 1024);
  cudaGraph_t g = nullptr;
  cudaGraphExec_t x = nullptr;
  TRY(cudaStreamBeginCapture(s.s, cudaStreamCaptureModeGlobal));
  GL_LAUNCH(1, 256, 0, s.s, kg_fill)(a.as<float>(), 1.0f, 256);
  TRY(cudaStreamEndCapture(s.s, &g));
  TRY(cudaGraphInstantiate(&x, g, 0));
  TRY(cudaGraphExecDestroy(x));
  TRY(cudaGraphDestroy(g));
  cudaError_t e = cudaGraphLaunch(x, s.s);
  simtest_msg = cudaGetErrorString(e);
  (void)cudaGetLastError();
  return (int)e;
}
