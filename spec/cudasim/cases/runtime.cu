/* runtime.cu — checks of the simulator's runtime (spec/cudasim/runtime*.cpp),
 * built into build/sim/libgptlua_simtest.so and driven by
 * spec/sim_runtime_spec.lua through LuaJIT's ffi.
 *
 * Written like the kernel sources in kernels/ (common.cuh, GL_LAUNCH), device
 * memory only through the runtime API.
 *
 *   gl_simtest_rt_copies      copies and sets in every direction, sync and
 *                             async, pageable and pinned: values, staging
 *                             semantics, memory accounting, pointer kinds
 *   gl_simtest_rt_peer        cudaMemcpyPeer(Async) (needs GL_SIM_DEVICES>=2)
 *   gl_simtest_rt_streams     streams and events: ordering through events,
 *                             host syncs and the legacy stream, timing, queries
 *   gl_simtest_rt_concurrent  GL_SIM_STREAMS=threads: two streams really run
 *                             at once (one item waits for a later one)
 *   gl_simtest_rt_bad_arg(name)  one misuse: the cudaError_t it returned
 *   gl_simtest_rt_planted(name)  a deliberately buggy program (out-of-bounds
 *                             store, missing stream wait, reuse across
 *                             streams, host access, ...) or its fixed twin:
 *                             the error the next synchronize reports.  The
 *                             bugs leave a sticky error (or abort), so the
 *                             spec runs them in a subprocess.
 * Scenario functions return the number of mismatches (0 = pass) or
 * -cudaError_t when a CUDA call failed; gl_simtest_rt_message() describes
 * the first problem. */
#include "common.cuh"
#include "simtest.h"
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <thread>

/* ---- harness -------------------------------------------------------------- */
SIMTEST_MESSAGE(rt)
extern "C" int gl_simtest_rt_sticky(void) { return (int)gl_sim_sticky(); }

#define EXPECT(cond, ...)  \
  do {                     \
    if (!(cond)) {         \
      note(__VA_ARGS__);   \
      bad++;               \
    }                      \
  } while (0)

/* device memory freed with the scope */
struct DevBuf {
  void *p = nullptr;
  DevBuf() = default;
  DevBuf(const DevBuf &) = delete;
  DevBuf &operator=(const DevBuf &) = delete;
  ~DevBuf() { if (p) cudaFree(p); }
  template <class T> T *as() const { return (T *)p; }
};
#define ALLOC(buf, bytes) TRY(cudaMalloc(&(buf).p, (bytes)))

/* pinned host memory freed with the scope */
struct PinnedBuf {
  void *p = nullptr;
  ~PinnedBuf() { if (p) cudaFreeHost(p); }
  template <class T> T *as() const { return (T *)p; }
};

/* ---- kernels ----------------------------------------------------------------- */
__global__ void k_fill(float *x, float v, int n) {
  CU_GRID_LOOP(i, n) x[i] = v;
}
__global__ void k_add(float *x, float v, int n) {
  CU_GRID_LOOP(i, n) x[i] += v;
}
/* y = x * 2 (reads x, writes y) */
__global__ void k_double(const float *x, float *y, int n) {
  CU_GRID_LOOP(i, n) y[i] = 2 * x[i];
}
/* one thread stores x[n]: a single element past the end */
__global__ void k_store_past_end(float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) x[i] = 1;
}
/* one thread stores x[-1] */
__global__ void k_store_before_start(float *x) {
  if (threadIdx.x == 0) x[-1] = 1;
}

static unsigned blocks_for(int n) { return (unsigned)((n + 255) / 256); }

/* ---- copies and sets ---------------------------------------------------------- */
extern "C" int gl_simtest_rt_copies(void) {
  begin();
  int bad = 0;
  const int n = 1000;  /* 4000 bytes: not a multiple of 256, so the block has slack */
  const size_t nb = n * sizeof(float);
  size_t free0 = 0, total = 0;
  TRY(cudaMemGetInfo(&free0, &total));
  DevBuf a, b;
  ALLOC(a, nb);
  ALLOC(b, nb);
  size_t free1 = 0;
  TRY(cudaMemGetInfo(&free1, &total));
  EXPECT(free0 - free1 == 2 * 4096, "cudaMemGetInfo: two 4000-byte blocks took %zu bytes, expected 8192",
         free0 - free1);
  EXPECT((uintptr_t)a.p % 256 == 0, "cudaMalloc returned %p, expected 256-byte alignment", a.p);

  /* new memory is 0xFF in every byte (NaN as float) */
  std::vector<unsigned char> raw(nb, 0);
  TRY(cudaMemcpy(raw.data(), a.p, nb, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < nb; i++)
    if (raw[i] != 0xFF) { EXPECT(false, "fresh device memory byte %zu is 0x%02x, expected 0xFF", i, raw[i]); break; }

  /* host -> device (pageable, sync), device -> device, device -> host */
  std::vector<float> h(n), back(n);
  for (int i = 0; i < n; i++) h[i] = (float)i;
  TRY(cudaMemcpy(a.p, h.data(), nb, cudaMemcpyHostToDevice));
  TRY(cudaMemcpy(b.p, a.p, nb, cudaMemcpyDeviceToDevice));
  TRY(cudaMemcpy(back.data(), b.p, nb, cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; i++)
    if (back[i] != h[i]) { EXPECT(false, "H2D/D2D/D2H: element %d is %g, expected %g", i, back[i], h[i]); break; }

  /* cudaMemcpyDefault infers every direction */
  std::vector<float> h2(n, -1.0f);
  TRY(cudaMemcpy(b.p, h2.data(), nb, cudaMemcpyDefault));
  TRY(cudaMemcpy(a.p, b.p, nb, cudaMemcpyDefault));
  std::vector<float> h3(n, 0.0f);
  TRY(cudaMemcpy(h3.data(), a.p, nb, cudaMemcpyDefault));
  TRY(cudaMemcpy(back.data(), h3.data(), nb, cudaMemcpyDefault));
  for (int i = 0; i < n; i++)
    if (back[i] != -1.0f) { EXPECT(false, "cudaMemcpyDefault chain: element %d is %g, expected -1", i, back[i]); break; }

  /* memset (sync and async on a stream, on a sub-range) */
  TRY(cudaMemset(a.p, 0, nb));
  cudaStream_t s;
  TRY(cudaStreamCreate(&s));
  TRY(cudaMemsetAsync(a.as<char>() + 400, 0x3F, 800, s));  /* floats 100..299 = 0x3F3F3F3F */
  TRY(cudaMemcpyAsync(raw.data(), a.p, nb, cudaMemcpyDeviceToHost, s));  /* pageable: returns when done */
  for (size_t i = 0; i < nb; i++) {
    unsigned char want = (i >= 400 && i < 1200) ? 0x3F : 0;
    if (raw[i] != want) { EXPECT(false, "memset: byte %zu is 0x%02x, expected 0x%02x", i, raw[i], want); break; }
  }

  /* async from pageable memory stages the source at the call: changing it
     afterwards does not change what arrives */
  std::vector<float> src(n, 5.0f);
  TRY(cudaMemcpyAsync(a.p, src.data(), nb, cudaMemcpyHostToDevice, s));
  for (int i = 0; i < n; i++) src[i] = 6.0f;
  TRY(cudaStreamSynchronize(s));
  TRY(cudaMemcpy(back.data(), a.p, nb, cudaMemcpyDeviceToHost));
  EXPECT(back[0] == 5.0f && back[n - 1] == 5.0f, "pageable async copy delivered %g, expected the staged 5", back[0]);

  /* a kernel on the stream, then pinned async copies both ways */
  PinnedBuf pin;
  TRY(cudaMallocHost(&pin.p, nb));
  for (int i = 0; i < n; i++) pin.as<float>()[i] = (float)(2 * i);
  TRY(cudaMemcpyAsync(a.p, pin.p, nb, cudaMemcpyHostToDevice, s));
  GL_LAUNCH(blocks_for(n), 256, 0, s, k_add)(a.as<float>(), 1.0f, n);
  TRY(cudaGetLastError());
  TRY(cudaMemcpyAsync(pin.p, a.p, nb, cudaMemcpyDeviceToHost, s));
  TRY(cudaStreamSynchronize(s));
  for (int i = 0; i < n; i++)
    if (pin.as<float>()[i] != (float)(2 * i + 1)) {
      EXPECT(false, "pinned round trip with a kernel: element %d is %g, expected %d", i, pin.as<float>()[i], 2 * i + 1);
      break;
    }

  /* host to host */
  std::vector<float> hh(n, 0.0f);
  TRY(cudaMemcpy(hh.data(), h.data(), nb, cudaMemcpyHostToHost));
  EXPECT(hh[n - 1] == h[n - 1], "host to host copy: %g, expected %g", hh[n - 1], h[n - 1]);

  /* zero bytes: nothing to check, nothing to do */
  TRY(cudaMemcpy(nullptr, nullptr, 0, cudaMemcpyDeviceToHost));

  /* pointer kinds */
  cudaPointerAttributes at;
  TRY(cudaPointerGetAttributes(&at, a.as<char>() + 10));
  EXPECT(at.type == cudaMemoryTypeDevice && at.device == 0, "device pointer: type %d device %d", (int)at.type, at.device);
  TRY(cudaPointerGetAttributes(&at, pin.p));
  EXPECT(at.type == cudaMemoryTypeHost, "pinned pointer: type %d, expected cudaMemoryTypeHost", (int)at.type);
  TRY(cudaPointerGetAttributes(&at, h.data()));
  EXPECT(at.type == cudaMemoryTypeUnregistered, "pageable pointer: type %d, expected unregistered", (int)at.type);

  TRY(cudaStreamDestroy(s));
  return bad;
}

/* cudaMemcpyPeer / PeerAsync between cuda:0 and cuda:1 */
extern "C" int gl_simtest_rt_peer(void) {
  begin();
  int bad = 0, count = 0;
  TRY(cudaGetDeviceCount(&count));
  if (count < 2) { note("needs GL_SIM_DEVICES >= 2, have %d", count); return -1; }
  const int n = 300;
  DevBuf a, b;
  TRY(cudaSetDevice(0));
  ALLOC(a, n * sizeof(float));
  TRY(cudaSetDevice(1));
  ALLOC(b, n * sizeof(float));
  std::vector<float> h(n), back(n);
  for (int i = 0; i < n; i++) h[i] = (float)(3 * i);
  TRY(cudaMemcpy(a.p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  TRY(cudaMemcpyPeer(b.p, 1, a.p, 0, n * sizeof(float)));
  TRY(cudaMemcpy(back.data(), b.p, n * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT(back[n - 1] == h[n - 1], "cudaMemcpyPeer: %g, expected %g", back[n - 1], h[n - 1]);
  cudaStream_t s1;
  TRY(cudaStreamCreate(&s1));  /* a stream of cuda:1 */
  GL_LAUNCH(blocks_for(n), 256, 0, s1, k_add)(b.as<float>(), 1.0f, n);
  TRY(cudaGetLastError());
  TRY(cudaMemcpyPeerAsync(a.p, 0, b.p, 1, n * sizeof(float), s1));
  TRY(cudaStreamSynchronize(s1));
  TRY(cudaSetDevice(0));
  TRY(cudaMemcpy(back.data(), a.p, n * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT(back[7] == h[7] + 1, "cudaMemcpyPeerAsync after a kernel: %g, expected %g", back[7], h[7] + 1);
  cudaError_t e = cudaMemcpyPeer(b.p, 0, a.p, 0, 4);  /* b is memory of cuda:1 */
  EXPECT(e == cudaErrorInvalidValue, "cudaMemcpyPeer with the wrong dstDevice returned %s", cudaGetErrorName(e));
  (void)cudaGetLastError();
  TRY(cudaStreamDestroy(s1));
  return bad;
}

/* ---- streams and events ------------------------------------------------------- */
extern "C" int gl_simtest_rt_streams(void) {
  begin();
  int bad = 0;
  const int n = 5000;
  const size_t nb = n * sizeof(float);
  DevBuf x, y;
  ALLOC(x, nb);
  ALLOC(y, nb);
  cudaStream_t a, b;
  TRY(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  TRY(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  unsigned flags = 9;
  TRY(cudaStreamGetFlags(a, &flags));
  EXPECT(flags == cudaStreamNonBlocking, "cudaStreamGetFlags: %u, expected 1", flags);
  cudaEvent_t ev, t0, t1;
  TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  TRY(cudaEventCreate(&t0));
  TRY(cudaEventCreate(&t1));
  EXPECT(cudaEventQuery(ev) == cudaSuccess, "an event never recorded: query is not cudaSuccess");

  /* producer on a, consumer on b, ordered by an event, many rounds */
  std::vector<float> back(n);
  for (int round = 0; round < 20; round++) {
    GL_LAUNCH(blocks_for(n), 256, 0, a, k_fill)(x.as<float>(), (float)round, n);
    TRY(cudaEventRecord(ev, a));
    TRY(cudaStreamWaitEvent(b, ev, 0));
    GL_LAUNCH(blocks_for(n), 256, 0, b, k_double)(x.as<float>(), y.as<float>(), n);
    TRY(cudaEventRecord(ev, b));
    TRY(cudaStreamWaitEvent(a, ev, 0));  /* the next fill overwrites x, which b read */
  }
  TRY(cudaGetLastError());
  TRY(cudaMemcpyAsync(back.data(), y.p, nb, cudaMemcpyDeviceToHost, b));
  EXPECT(back[0] == 38.0f && back[n - 1] == 38.0f, "event-ordered rounds: y = %g, expected 38", back[0]);

  /* a host synchronisation orders too: a writes, the host waits, b reads */
  GL_LAUNCH(blocks_for(n), 256, 0, a, k_fill)(x.as<float>(), 4.0f, n);
  TRY(cudaStreamSynchronize(a));
  GL_LAUNCH(blocks_for(n), 256, 0, b, k_double)(x.as<float>(), y.as<float>(), n);
  TRY(cudaMemcpyAsync(back.data(), y.p, nb, cudaMemcpyDeviceToHost, b));
  EXPECT(back[5] == 8.0f, "after a host sync: y = %g, expected 8", back[5]);

  /* the legacy default stream waits for blocking streams and they for it */
  cudaStream_t blocking;
  TRY(cudaStreamCreate(&blocking));
  GL_LAUNCH(blocks_for(n), 256, 0, blocking, k_fill)(x.as<float>(), 7.0f, n);
  GL_LAUNCH(blocks_for(n), 256, 0, (cudaStream_t)0, k_add)(x.as<float>(), 1.0f, n);
  GL_LAUNCH(blocks_for(n), 256, 0, blocking, k_double)(x.as<float>(), y.as<float>(), n);
  TRY(cudaMemcpy(back.data(), y.p, nb, cudaMemcpyDeviceToHost));
  EXPECT(back[9] == 16.0f, "legacy stream ordering: y = %g, expected 16", back[9]);

  /* timing: the events' host times around 30 ms of work */
  TRY(cudaEventRecord(t0, a));
  gl_sim_submit(a, "sleep 30 ms", [] { usleep(30000); });
  TRY(cudaEventRecord(t1, a));
  TRY(cudaEventSynchronize(t1));
  float ms = -1;
  TRY(cudaEventElapsedTime(&ms, t0, t1));
  EXPECT(ms >= 25.0f && ms < 2000.0f, "cudaEventElapsedTime around a 30 ms item: %g ms", ms);
  EXPECT(cudaStreamQuery(a) == cudaSuccess, "cudaStreamQuery after a sync: not cudaSuccess");
  EXPECT(cudaEventQuery(t1) == cudaSuccess, "cudaEventQuery after its sync: not cudaSuccess");

  /* destroying an event right after recording it (deferred until it passes) */
  cudaEvent_t tmp;
  TRY(cudaEventCreateWithFlags(&tmp, cudaEventDisableTiming));
  GL_LAUNCH(blocks_for(n), 256, 0, a, k_add)(x.as<float>(), 1.0f, n);
  TRY(cudaEventRecord(tmp, a));
  TRY(cudaStreamWaitEvent(b, tmp, 0));
  TRY(cudaEventDestroy(tmp));
  GL_LAUNCH(blocks_for(n), 256, 0, b, k_double)(x.as<float>(), y.as<float>(), n);
  TRY(cudaDeviceSynchronize());
  TRY(cudaMemcpy(back.data(), y.p, nb, cudaMemcpyDeviceToHost));
  EXPECT(back[1] == 18.0f, "wait on an event destroyed after its record: y = %g, expected 18", back[1]);

  TRY(cudaEventDestroy(ev));
  TRY(cudaEventDestroy(t0));
  TRY(cudaEventDestroy(t1));
  TRY(cudaStreamDestroy(a));
  TRY(cudaStreamDestroy(b));
  TRY(cudaStreamDestroy(blocking));
  EXPECT(gl_sim_sticky() == cudaSuccess, "a sticky error after correct stream use: %s",
         cudaGetErrorString(gl_sim_sticky()));
  return bad;
}

/* Two streams run at once only in threads mode: an item on stream a waits
   (paused, as NCCL waits for its peers) for a flag set by an item submitted
   LATER on stream b.  Also: queries see
   unfinished work.  Returns 0 when a saw the flag. */
extern "C" int gl_simtest_rt_concurrent(void) {
  begin();
  int bad = 0;
  if (!gl_sim_streams_threaded()) { note("needs GL_SIM_STREAMS=threads"); return -1; }
  cudaStream_t a, b;
  TRY(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  TRY(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t ev;
  TRY(cudaEventCreate(&ev));
  static std::atomic<int> flag, release, saw;
  flag = 0;
  release = 0;
  saw = 0;
  gl_sim_submit(a, "wait for b", [] {
    /* an item waiting on something outside (as NCCL waits for its peers)
       lets the other streams' work take its turn on the device */
    gl_sim_device_scope_pause waiting;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!flag.load() && std::chrono::steady_clock::now() < until) usleep(100);
    saw = flag.load();
  });
  gl_sim_submit(b, "hold b", [] {
    flag = 1;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!release.load() && std::chrono::steady_clock::now() < until) usleep(100);
  });
  TRY(cudaEventRecord(ev, b));
  cudaError_t q = cudaStreamQuery(b), qe = cudaEventQuery(ev);
  EXPECT(q == cudaErrorNotReady, "cudaStreamQuery on a busy stream: %s, expected cudaErrorNotReady", cudaGetErrorName(q));
  EXPECT(qe == cudaErrorNotReady, "cudaEventQuery behind busy work: %s, expected cudaErrorNotReady", cudaGetErrorName(qe));
  float ms = 0;
  cudaEvent_t e0;
  TRY(cudaEventCreate(&e0));
  TRY(cudaEventRecord(e0, b));
  cudaError_t el = cudaEventElapsedTime(&ms, ev, e0);
  EXPECT(el == cudaErrorNotReady, "cudaEventElapsedTime on pending events: %s, expected cudaErrorNotReady",
         cudaGetErrorName(el));
  EXPECT(cudaGetLastError() == cudaSuccess, "cudaErrorNotReady was left as the last error");
  release = 1;
  TRY(cudaStreamSynchronize(a));
  TRY(cudaStreamSynchronize(b));
  EXPECT(saw.load() == 1, "the item on stream a never saw stream b's later item run: streams are not concurrent");
  TRY(cudaEventDestroy(ev));
  TRY(cudaEventDestroy(e0));
  TRY(cudaStreamDestroy(a));
  TRY(cudaStreamDestroy(b));
  return bad;
}

/* ---- misuse: error codes and messages --------------------------------------- */
/* Runs the named misuse; returns its cudaError_t.  Also checks that
   cudaGetLastError returns that code once (then cudaSuccess); the error text
   (cudaGetErrorString) is left in gl_simtest_rt_message(). */
extern "C" int gl_simtest_rt_bad_arg(const char *name) {
  begin();
  std::string w = name;
  DevBuf a;
  ALLOC(a, 1024);
  float h[512];
  cudaError_t e = cudaErrorUnknown;
  if (w == "copy_past_end") e = cudaMemcpy(h, a.as<char>() + 512, 1024, cudaMemcpyDeviceToHost);
  else if (w == "copy_kind_host_dst") e = cudaMemcpy(h, a.p, 16, cudaMemcpyHostToDevice);
  else if (w == "copy_kind_device_src") e = cudaMemcpy(a.p, a.p, 16, cudaMemcpyHostToDevice);
  else if (w == "copy_direction") e = cudaMemcpy(h, a.p, 16, (cudaMemcpyKind)7);
  else if (w == "copy_null") e = cudaMemcpy(nullptr, a.p, 16, cudaMemcpyDeviceToHost);
  else if (w == "memset_past_end") e = cudaMemset(a.as<char>() + 1000, 0, 100);
  else if (w == "memset_host") e = cudaMemset(h, 0, 16);
  else if (w == "free_interior") e = cudaFree(a.as<char>() + 8);
  else if (w == "free_host") e = cudaFree(h);
  else if (w == "double_free") {
    void *p = nullptr;
    TRY(cudaMalloc(&p, 64));
    TRY(cudaFree(p));
    e = cudaFree(p);
  } else if (w == "copy_freed") {
    void *p = nullptr;
    TRY(cudaMalloc(&p, 64));
    TRY(cudaFree(p));
    e = cudaMemcpy(h, p, 16, cudaMemcpyDeviceToHost);
  } else if (w == "out_of_memory") {
    void *p = nullptr;
    e = cudaMalloc(&p, (size_t)1 << 50);
  } else if (w == "free_host_not_pinned") e = cudaFreeHost(h);
  else if (w == "host_alloc_flags") {
    void *p = nullptr;
    e = cudaHostAlloc(&p, 64, 0x100);
  } else if (w == "set_device") e = cudaSetDevice(99);
  else if (w == "device_attribute") {
    int v = 0;
    e = cudaDeviceGetAttribute(&v, cudaDevAttrWarpSize, -1);
  } else if (w == "stream_flags") {
    cudaStream_t s;
    e = cudaStreamCreateWithFlags(&s, 4);
  } else if (w == "stream_destroyed") {
    cudaStream_t s;
    TRY(cudaStreamCreate(&s));
    TRY(cudaStreamDestroy(s));
    e = cudaStreamSynchronize(s);
  } else if (w == "destroy_default_stream") e = cudaStreamDestroy(0);
  else if (w == "event_flags") {
    cudaEvent_t ev;
    e = cudaEventCreateWithFlags(&ev, 0x40);
  } else if (w == "event_destroyed") {
    cudaEvent_t ev;
    TRY(cudaEventCreate(&ev));
    TRY(cudaEventDestroy(ev));
    e = cudaEventRecord(ev, 0);
  } else if (w == "elapsed_disable_timing") {
    cudaEvent_t a0, a1;
    TRY(cudaEventCreateWithFlags(&a0, cudaEventDisableTiming));
    TRY(cudaEventCreateWithFlags(&a1, cudaEventDisableTiming));
    TRY(cudaEventRecord(a0, 0));
    TRY(cudaEventRecord(a1, 0));
    float ms;
    e = cudaEventElapsedTime(&ms, a0, a1);
    cudaEventDestroy(a0);
    cudaEventDestroy(a1);
  } else if (w == "elapsed_unrecorded") {
    cudaEvent_t a0, a1;
    TRY(cudaEventCreate(&a0));
    TRY(cudaEventCreate(&a1));
    TRY(cudaEventRecord(a1, 0));
    float ms;
    e = cudaEventElapsedTime(&ms, a0, a1);
    cudaEventDestroy(a0);
    cudaEventDestroy(a1);
  } else if (w == "wait_event_flags") {
    cudaEvent_t ev;
    TRY(cudaEventCreate(&ev));
    e = cudaStreamWaitEvent(0, ev, 3);
    cudaEventDestroy(ev);
  } else if (w == "func_smem_over_limit")
    e = cudaFuncSetAttribute(k_fill, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024);
  else {
    note("unknown misuse '%s'", name);
    return -1;
  }
  simtest_msg = cudaGetErrorString(e);
  cudaError_t last = cudaGetLastError(), again = cudaGetLastError();
  if (last != e || again != cudaSuccess) {
    simtest_msg = std::string("cudaGetLastError returned ") + cudaGetErrorName(last) + " then " + cudaGetErrorName(again) +
             ", expected " + cudaGetErrorName(e) + " then cudaSuccess";
    return -2;
  }
  return (int)e;
}

/* cudaFuncSetAttribute is recorded per function for the launch checks */
extern "C" int gl_simtest_rt_func_attribute(void) {
  begin();
  int bad = 0;
  EXPECT(gl_sim_func_smem_optin((const void *)k_add) == 0, "k_add opted in before any cudaFuncSetAttribute");
  TRY(cudaFuncSetAttribute(k_add, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
  EXPECT(gl_sim_func_smem_optin((const void *)k_add) == 100 * 1024, "k_add's opt-in: %d, expected 102400",
         gl_sim_func_smem_optin((const void *)k_add));
  EXPECT(gl_sim_func_smem_optin((const void *)k_fill) == 0, "k_fill's opt-in changed with k_add's");
  TRY(cudaFuncSetAttribute(k_add, cudaFuncAttributeMaxDynamicSharedMemorySize, 0));
  return bad;
}

/* ---- planted bugs and their fixed twins ------------------------------------ */
/* A tensor of n floats from the engine's caching allocator on cuda:0. */
static gl_tensor *engine_tensor(int64_t n) {
  int64_t shape[1] = {n};
  return gl_empty(GL_F32, 0, 1, shape);
}

/* Runs the named program; returns the cudaError_t the next device
   synchronisation reports (0 when the program is correct), with its text
   in gl_simtest_rt_message().  Abort-style bugs (host access) end the
   process instead. */
extern "C" int gl_simtest_rt_planted(const char *name) {
  begin();
  std::string w = name;
  const int n = 4096;
  const size_t nb = n * sizeof(float);
  std::vector<float> back(n);
  cudaStream_t a = nullptr, b = nullptr;
  TRY(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  TRY(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  DevBuf x, y;
  ALLOC(x, nb);
  ALLOC(y, nb);
  /* with GL_SIM_STREAMS=threads the unordered read may run before the write:
     x starts defined so that the one error such a case can report is the
     missing wait, whichever side runs first */
  auto define_x = [&]() -> int {
    TRY(cudaMemset(x.p, 0, nb));
    TRY(cudaDeviceSynchronize());
    return 0;
  };
  if (w == "oob_store") {
    /* 64 floats = 256 bytes: the block ends right at the guard page */
    DevBuf s;
    ALLOC(s, 64 * sizeof(float));
    GL_LAUNCH(1, 128, 0, a, k_store_past_end)(s.as<float>(), 64);
  } else if (w == "oob_slack") {
    /* 10 floats: the store past the end lands in the block's slack */
    DevBuf s;
    ALLOC(s, 10 * sizeof(float));
    GL_LAUNCH(1, 32, 0, a, k_store_past_end)(s.as<float>(), 10);
  } else if (w == "oob_before_start") {
    GL_LAUNCH(1, 32, 0, a, k_store_before_start)(x.as<float>());
  } else if (w == "use_after_free") {
    void *p = nullptr;
    TRY(cudaMalloc(&p, 1024));
    TRY(cudaFree(p));
    GL_LAUNCH(1, 32, 0, a, k_fill)((float *)p, 1.0f, 32);
  } else if (w == "missing_wait_copy" || w == "event_wait_copy") {
    /* a kernel on a writes x; a copy on b reads it */
    if (int rc = define_x()) return rc;
    GL_LAUNCH(blocks_for(n), 256, 0, a, k_fill)(x.as<float>(), 3.0f, n);
    if (w == "event_wait_copy") {
      cudaEvent_t ev;
      TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      TRY(cudaEventRecord(ev, a));
      TRY(cudaStreamWaitEvent(b, ev, 0));
      TRY(cudaEventDestroy(ev));
    }
    TRY(cudaMemcpyAsync(back.data(), x.p, nb, cudaMemcpyDeviceToHost, b));
    if (w == "event_wait_copy" && back[n - 1] != 3.0f) {
      note("the copy after the event read %g, expected 3", back[n - 1]);
      return -1;
    }
  } else if (w == "missing_wait_kernel" || w == "event_wait_kernel") {
    /* a kernel on a writes x; a kernel on b reads it */
    if (int rc = define_x()) return rc;
    GL_LAUNCH(blocks_for(n), 256, 0, a, k_fill)(x.as<float>(), 3.0f, n);
    if (w == "event_wait_kernel") {
      cudaEvent_t ev;
      TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      TRY(cudaEventRecord(ev, a));
      TRY(cudaStreamWaitEvent(b, ev, 0));
      TRY(cudaEventDestroy(ev));
    }
    GL_LAUNCH(blocks_for(n), 256, 0, b, k_double)(x.as<float>(), y.as<float>(), n);
  } else if (w == "overlapping_missing_wait") {
    /* a's item writes x and stays in flight while b's reads it: with stream
       threads the read must still fault and be checked although a's write
       opened the page (work items take turns on the device) */
    if (int rc = define_x()) return rc;
    float *xp = x.as<float>(), *yp = y.as<float>();
    static std::atomic<int> b_started;
    b_started = 0;
    /* a gives b 200 ms to start (it cannot while a has the turn), then
       writes while b is, or would be, in flight; b reads after a wrote */
    gl_sim_submit(a, "write x and linger", [xp] {
      for (int i = 0; i < 2000 && !b_started.load(); i++) usleep(100);
      xp[0] = 1;
      usleep(100000);
    });
    gl_sim_submit(b, "read x", [xp, yp] {
      b_started = 1;
      usleep(50000);
      yp[0] = xp[0];
    });
  } else if (w == "unrelated_streams") {
    /* two streams on separate buffers need no ordering (also under the race
       mode, whose snapshots touch every allocation: they are untracked) */
    GL_LAUNCH(blocks_for(n), 256, 0, a, k_fill)(x.as<float>(), 1.0f, n);
    GL_LAUNCH(blocks_for(n), 256, 0, b, k_fill)(y.as<float>(), 2.0f, n);
  } else if (w == "missing_wait_war") {
    /* b reads x, then a overwrites it with nothing ordering the two */
    if (int rc = define_x()) return rc;
    GL_LAUNCH(blocks_for(n), 256, 0, b, k_double)(x.as<float>(), y.as<float>(), n);
    GL_LAUNCH(blocks_for(n), 256, 0, a, k_fill)(x.as<float>(), 1.0f, n);
  } else if (w == "nonblocking_vs_legacy" || w == "blocking_vs_legacy") {
    /* a kernel on a (non-)blocking stream writes x, a plain cudaMemcpy reads it */
    if (int rc = define_x()) return rc;
    cudaStream_t s = a;
    if (w == "blocking_vs_legacy") TRY(cudaStreamCreate(&s));
    GL_LAUNCH(blocks_for(n), 256, 0, s, k_fill)(x.as<float>(), 2.0f, n);
    TRY(cudaMemcpy(back.data(), x.p, nb, cudaMemcpyDeviceToHost));
    if (s != a) TRY(cudaStreamDestroy(s));
  } else if (w == "reuse_across_streams" || w == "reuse_with_wait") {
    /* the engine's caching allocator hands a block freed after use on the
       communication stream to the compute stream: without a wait the
       compute stream's writes may land before the earlier reads/writes */
    cudaStream_t comm = (cudaStream_t)gl_cuda_stream(0, GL_STREAM_COMM);
    cudaStream_t compute = (cudaStream_t)gl_cuda_stream(0, GL_STREAM_COMPUTE);
    if (!comm || !compute) { note("gl_cuda_stream: %s", gl_last_error()); return -1; }
    gl_tensor *t = engine_tensor(n);
    if (!t) { note("gl_empty: %s", gl_last_error()); return -1; }
    void *first = cu_ptr(t);
    GL_LAUNCH(blocks_for(n), 256, 0, comm, k_fill)((float *)cu_ptr(t), 1.0f, n);
    gl_tensor_free(t);  /* back to the cache; the comm kernel may still be running on a GPU */
    if (w == "reuse_with_wait" && gl_cuda_stream_wait(0, GL_STREAM_COMPUTE, GL_STREAM_COMM) != GL_OK) {
      note("gl_cuda_stream_wait: %s", gl_last_error());
      return -1;
    }
    gl_tensor *u = engine_tensor(n);
    if (!u) { note("gl_empty: %s", gl_last_error()); return -1; }
    if (cu_ptr(u) != first) {
      note("the cache handed out %p, expected the freed block %p", (void *)cu_ptr(u), first);
      gl_tensor_free(u);
      return -1;
    }
    GL_LAUNCH(blocks_for(n), 256, 0, compute, k_fill)((float *)cu_ptr(u), 2.0f, n);
    gl_tensor_free(u);
  } else if (w == "host_read") {
    volatile float v = x.as<float>()[3];  /* host code reading device memory: the process aborts */
    (void)v;
  } else if (w == "host_write") {
    x.as<float>()[3] = 1.0f;
  } else {
    note("unknown program '%s'", name);
    return -1;
  }
  cudaError_t e = cudaDeviceSynchronize();
  simtest_msg = cudaGetErrorString(e);
  if (e == cudaSuccess) {
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
  return (int)e;
}
