/* runtime_internal.h — what the three files of the CUDA simulator's runtime
 * share (private: included by spec/cudasim/runtime*.cpp only; C++ only).
 *
 *   runtime.cpp          configuration and initialisation, messages and
 *                        errors (sticky, per thread), the simulated devices
 *                        and their properties, function attributes
 *   runtime_memory.cpp   device memory: the heap with guard pages, slack
 *                        checks and its quarantine, the SIGSEGV handler
 *                        with the host access and stream-order checks,
 *                        pinned host memory, what a pointer is
 *   runtime_streams.cpp  streams and events: queueing and running work,
 *                        host synchronisation, copies and sets
 *   runtime_graphs.cpp   stream capture and graphs: what a capturing stream
 *                        records instead of running, the calls a capture
 *                        forbids, instantiation and launch
 *
 * The runtime's state (Runtime, one instance, made at first use) and the
 * stream and event records are defined here because all three files touch
 * them.  The names are in namespace gl_sim_rt with hidden visibility:
 * shared by the three files, not exported from libgptlua.so (the structs
 * behind cudaStream_t and cudaEvent_t, and the queue entry they hold, stay
 * global: see there). */
#ifndef GL_SIM_RUNTIME_INTERNAL_H
#define GL_SIM_RUNTIME_INTERNAL_H
#include <stdint.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <functional>
#include <thread>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>
#include "sim.h"
#include "runtime_api.h"

namespace gl_sim_rt __attribute__((visibility("hidden"))) {

enum { MAX_DEVICES = 16 };

/* ---- configuration (runtime.cpp) -------------------------------------------- */
struct Config {
  int devices = 1;
  size_t memory_bytes = (size_t)81920 << 20;
  int hostcheck = 1, streamcheck = 1, threaded = 0, racecheck = 0;
  int arch = 90;                        /* GL_SIM_ARCH: the compute capability pretended, major*10 + minor */
  int smem_optin = GL_SIM_SMEM_OPTIN;   /* that GPU's opt-in shared memory per block */
  unsigned checks = GL_SIM_CHECK_MEM | GL_SIM_CHECK_INIT | GL_SIM_CHECK_RACE | GL_SIM_CHECK_SYNC;
  int sms = GL_SIM_SM_COUNT;  /* the multiprocessor count devices report (GL_SIM_SMS) */
  uint64_t seed = 1;
};
extern Config config;  /* filled by init(), read-only afterwards (also by the fault handler) */

/* ---- messages and errors (runtime.cpp) --------------------------------------- */
/* One line "gptlua cuda-sim: <msg>" to stderr in one write (no stdio lock,
   so it is usable from the fault handler). */
void say_raw(const char *msg);
/* An API call's failure: the thread's last error with a detail, not printed
   (the caller gets the code; GL_CU_CHECK puts the text in its message). */
cudaError_t api_error(cudaError_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* gl_sim_fail with a formatted message: the sticky error, printed once */
void fail_msg(cudaError_t code, const char *msg);

/* the sticky error, returned by every call that needs a working context */
#define RETURN_IF_STICKY()                                   \
  do {                                                       \
    cudaError_t sticky_ = gl_sim_sticky();                   \
    if (sticky_ != cudaSuccess) return sticky_;              \
  } while (0)

/* ---- streams, events, the runtime's state (runtime.cpp, runtime_streams.cpp) -- */
typedef std::vector<uint64_t> Clock;  /* clock[stream id] = last work seq of that stream ordered before */

}  // namespace gl_sim_rt

/* The records behind cudaStream_t and cudaEvent_t (sim_types.h), and a
   stream's queue entry: outside the hidden namespace, because GCC hides a
   function whose parameter types are hidden (the API functions take
   cudaStream_t and cudaEvent_t) and a visible struct cannot hold a hidden
   one. */
struct QueueItem {
  enum Kind { WORK, MARKER, WAIT, EXIT } kind = WORK;
  std::function<void()> work;      /* WORK */
  const char *what = nullptr;      /* WORK: interned name */
  uint64_t seq = 0;                /* WORK: the stream's work sequence number */
  gl_sim_rt::Clock clock;          /* WORK: what the item is ordered after */
  std::shared_ptr<CUevent_st> event;  /* MARKER: the event to stamp */
  uint64_t gen = 0;                /* MARKER: which record of the event */
  struct CUstream_st *target = nullptr;  /* WAIT: until target->completed >= count */
  uint64_t count = 0;
};

/* A capture sequence (runtime_graphs.cpp): begun on `origin`, joined by the
   streams that waited for an event recorded in it; its nodes are the work
   those streams queued while capturing, in the order queued (a topological
   order: a node is recorded after everything it depends on). */
struct CUgraphNode_st {
  const char *what = nullptr;     /* interned work name */
  std::function<void()> work;     /* re-run at every launch */
  std::vector<size_t> deps;       /* indices of the nodes it follows */
};
struct CaptureSeq {
  struct CUstream_st *origin = nullptr;
  int mode = 0;                   /* cudaStreamCaptureMode */
  std::thread::id thread;         /* that began it */
  bool ended = false;
  bool invalidated = false;
  std::string why;                /* the call that invalidated it */
  std::vector<CUgraphNode_st> nodes;
  std::vector<struct CUstream_st *> streams;  /* origin first, then joined ones */
};

struct CUstream_st {
  uint32_t id = 0;          /* index in Runtime::streams; 0 is never used (means "none" in page records) */
  int device = 0;
  unsigned flags = 0;
  bool legacy = false;      /* the legacy default stream (NULL) of `device` */
  bool destroyed = false;
  uint64_t work_seq = 0;    /* work items submitted so far */
  gl_sim_rt::Clock clock;   /* what the next item will be ordered after */
  uint64_t submitted = 0, completed = 0;  /* queue positions (work, markers, waits) */
  std::deque<QueueItem> queue;            /* threads mode */
  std::shared_ptr<CaptureSeq> capture;    /* the capture it belongs to, if any */
  std::vector<size_t> tail;               /* capturing: the nodes its next node follows */
};

struct CUevent_st {
  unsigned flags = 0;
  int device = 0;
  bool recorded = false;
  CUstream_st *stream = nullptr;  /* of the latest record */
  uint64_t count = 0;             /* its marker's queue position on `stream` */
  uint64_t gen = 0;               /* records so far */
  gl_sim_rt::Clock clock;         /* the recording stream's clock at the record */
  double time_ms = 0;             /* host wall time when the marker ran */
  std::shared_ptr<CaptureSeq> capture;  /* last recorded in a capturing stream: that capture */
  std::vector<size_t> tail;             /* the nodes it was recorded after */
};

namespace gl_sim_rt __attribute__((visibility("hidden"))) {

struct PinnedBlock { size_t size; };

struct Runtime {
  std::mutex mu;               /* streams, events, queues, host clock */
  std::condition_variable cv;  /* any queue progress */
  std::vector<CUstream_st *> streams{nullptr};  /* by id; never freed, so stale handles stay recognisable */
  std::unordered_set<CUstream_st *> live;
  CUstream_st *legacy[MAX_DEVICES] = {};
  Clock host_clock;            /* what the host has waited for */
  std::unordered_map<CUevent_st *, std::shared_ptr<CUevent_st>> events;
  std::unordered_set<std::string> names;  /* interned `what` strings (never freed: page records point at them) */
  std::mutex names_mu;
  std::mutex func_mu;
  std::unordered_map<const void *, int> func_smem;
  std::mutex pinned_mu;
  std::map<uintptr_t, PinnedBlock> pinned;  /* cudaHostAlloc blocks by start */
  std::atomic<size_t> in_use[MAX_DEVICES];
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  std::vector<std::shared_ptr<CaptureSeq>> captures;  /* active capture sequences */
  std::unordered_set<void *> graphs, execs;           /* live cudaGraph_t, cudaGraphExec_t */
};
extern Runtime *rt_state;
/* the runtime, initialised at the first call */
Runtime &rt();

extern thread_local int tls_device;  /* cudaSetDevice */

/* ---- devices (runtime.cpp) ------------------------------------------------------ */
/* cudaSuccess, or the API error for a device number that is not simulated */
cudaError_t check_device(const char *fn, int d);

/* ---- streams (runtime_streams.cpp) -------------------------------------------- */
CUstream_st *new_stream_locked(Runtime &R, int device, unsigned flags, bool legacy);  /* R.mu held */
/* The host waits for every stream of device d (all devices when d < 0);
   fn names the API call for the account's count of host syncs. */
void host_wait_device(const char *fn, int d);

/* (runtime_streams.cpp) a stream handle of the API: NULL is the calling
   thread's device's legacy stream; an error for one that is not live */
cudaError_t resolve_stream(const char *fn, cudaStream_t h, CUstream_st **out);
/* queues (or, capturing, records) work on s, as gl_sim_submit; R.mu not held */
void submit_work(CUstream_st *s, const char *what, std::function<void()> work);
/* the live event behind a handle, or NULL (R.mu held) */
std::shared_ptr<CUevent_st> find_event(cudaEvent_t e);

/* ---- the stream trace (trace.cpp): no-ops unless gl_sim_trace_start ran ------- */
void trace_work(int device, uint32_t stream, uint64_t seq, const char *what, const Clock &clock);
void trace_wait(int device, uint32_t stream, uint32_t waited, uint64_t seq);
void trace_host(bool blocking, const char *what);  /* blocking: a host sync; else a query that found work done */

/* ---- stream capture (runtime_graphs.cpp) --------------------------------------- */
/* Every stream operation asks first (R.mu held): cudaSuccess, or the error
   the real runtime gives for it now — the stream's capture was invalidated;
   the operation would make the host wait for a capturing stream
   (host_waits) or capture pageable host memory (pageable): the capture is
   invalidated; the legacy stream is used while a blocking stream of its
   device captures (cudaErrorStreamCaptureImplicit).  fn names the call. */
cudaError_t capture_guard_locked(Runtime &R, const char *fn, CUstream_st *s, bool host_waits, bool pageable);
/* A capturing stream's work becomes a node of its capture (R.mu held). */
void capture_record_locked(CUstream_st *s, const char *what, std::function<void()> work);
/* cudaStreamWaitEvent when the event or the stream is in a capture: joins
   s to the event's capture, adds a dependency inside one, or the error
   (R.mu held). */
cudaError_t capture_wait_event_locked(Runtime &R, CUstream_st *s, CUevent_st *ev);
/* Calls the runtime calls potentially unsafe during a capture (cudaMalloc,
   cudaFree, pinned allocations, cudaDeviceSynchronize, cudaMemcpyPeer):
   prohibited, and the capture invalidated, unless the thread's capture mode
   is relaxed, when a global-mode capture runs anywhere or a thread-local
   one on this thread.  device_sync: the call also waits for every stream
   (cudaDeviceSynchronize), which no capture survives. */
cudaError_t capture_unsafe_call(const char *fn, bool device_sync);

/* ---- the work item a thread runs, and the checks (runtime_memory.cpp) -------- */
/* One access record of a page: which work item, for the stream check. */
struct Access {
  uint32_t stream;   /* 0: none */
  int16_t device;
  uint8_t legacy;
  uint64_t seq;
  const char *what;
};
/* The work item the calling thread runs, for the stream check. */
struct ItemCtx {
  Access me;
  const uint64_t *clock;
  size_t nclock;
};
extern thread_local ItemCtx *tls_item;  /* set by runtime_streams.cpp's run_work */

inline bool check_streams(void) { return config.hostcheck && config.streamcheck; }

/* Installs the SIGSEGV handler (init), or takes SIGSEGV back from a library
   initialised after us (before each work item). */
void install_handler(void);
void ensure_handler(void);
/* Closes every page opened by device contexts, after checking the slack of
   allocations opened writable; a damaged slack is reported as an
   out-of-bounds write of `what`. */
void close_opened(const char *what);

/* ---- what a pointer is (runtime_memory.cpp) ----------------------------------- */
enum Side { HOST_PAGEABLE, HOST_PINNED, DEVICE, FREED_DEVICE };
struct PtrInfo {
  Side side;
  int device;
  uintptr_t base;
  size_t size;
};
/* Device (live or freed), pinned host ([p, p + n) inside a cudaHostAlloc
   block) or pageable host memory. */
PtrInfo classify(const void *p, size_t n);

}  // namespace gl_sim_rt

#endif
