/* trace.cpp — the CUDA simulator's stream trace: what the host queued on
 * which stream, in submission order, with each work item's vector clock
 * (what it is ordered after), the cross-stream waits, the host's waits on
 * the device, and marks the caller puts in (a step's start and end).  It
 * shows what timing cannot in a simulator: that a collective ran on a
 * stream of its own, after the event that says its input is ready, that
 * compute queued after it was *not* ordered after it (on a GPU the two
 * overlap), and that the host never waited for the device inside a step.
 * recipes/tools/host_syncs.lua and spec/dist_overlap_spec.lua read it
 * through the C functions at the end; off (a no-op per hook) unless
 * gl_sim_trace_start was called.
 *
 * Records (gl_sim_trace_rec.kind):
 *   WORK   a work item (kernel, copy, set, NCCL call) queued on `stream`
 *          of `device` as its seq-th item; `what` is its name
 *   WAIT   cudaStreamWaitEvent: `stream` now waits for item `seq` of
 *          stream `other` (the event's record)
 *   SYNC   the host blocked on the device (`what`: the API call): the
 *          account's host syncs (stream, event and device synchronisation,
 *          copies to pageable host memory, cudaFree)
 *   QUERY  a cudaEventQuery / cudaStreamQuery found the work done: the host
 *          learned it without blocking (a poll)
 *   MARK   gl_sim_trace_mark(what) */
#include <stdint.h>
#include <string.h>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>
#include "runtime_internal.h"

namespace {

enum { WORK = 0, WAIT = 1, SYNC = 2, QUERY = 3, MARK = 4 };

struct Rec {
  int32_t kind, device, stream, other;
  uint64_t seq;
  const char *what;            /* interned by the runtime, or owned below */
  gl_sim_rt::Clock clock;      /* WORK: what the item is ordered after */
};

struct Trace {
  std::mutex mu;
  std::atomic<bool> on{false};
  std::vector<Rec> recs;
  std::vector<std::string *> marks;  /* the MARK names (kept until the next start) */
};
Trace T;

void add(Rec r) {
  std::lock_guard<std::mutex> g(T.mu);
  if (T.on) T.recs.push_back(std::move(r));
}

}  // namespace

/* ---- hooks (runtime_streams.cpp) ----------------------------------------------- */
namespace gl_sim_rt {
bool trace_on(void) { return T.on; }
void trace_work(int device, uint32_t stream, uint64_t seq, const char *what, const Clock &clock) {
  if (!T.on) return;
  add(Rec{WORK, device, (int32_t)stream, 0, seq, what, clock});
}
void trace_wait(int device, uint32_t stream, uint32_t waited, uint64_t seq) {
  if (!T.on) return;
  add(Rec{WAIT, device, (int32_t)stream, (int32_t)waited, seq, "cudaStreamWaitEvent", {}});
}
void trace_host(bool blocking, const char *what) {
  if (!T.on) return;
  add(Rec{blocking ? SYNC : QUERY, -1, 0, 0, 0, what, {}});
}
}  // namespace gl_sim_rt

/* ---- the C API ------------------------------------------------------------------- */
extern "C" {

typedef struct gl_sim_trace_rec {
  int32_t kind, device, stream, other;
  int64_t seq;
  const char *what;
} gl_sim_trace_rec;

/* Clears the trace and starts recording. */
__attribute__((visibility("default"))) void gl_sim_trace_start(void) {
  std::lock_guard<std::mutex> g(T.mu);
  T.recs.clear();
  for (std::string *s : T.marks) delete s;
  T.marks.clear();
  T.on = true;
}

/* Stops recording; the records stay readable until the next start. */
__attribute__((visibility("default"))) void gl_sim_trace_stop(void) {
  std::lock_guard<std::mutex> g(T.mu);
  T.on = false;
}

__attribute__((visibility("default"))) void gl_sim_trace_mark(const char *what) {
  std::lock_guard<std::mutex> g(T.mu);
  if (!T.on) return;
  T.marks.push_back(new std::string(what ? what : ""));
  T.recs.push_back(Rec{MARK, -1, 0, 0, 0, T.marks.back()->c_str(), {}});
}

__attribute__((visibility("default"))) int64_t gl_sim_trace_count(void) {
  std::lock_guard<std::mutex> g(T.mu);
  return (int64_t)T.recs.size();
}

/* Record i (0-based) into *out: 0, or -1 past the end. */
__attribute__((visibility("default"))) int gl_sim_trace_get(int64_t i, gl_sim_trace_rec *out) {
  std::lock_guard<std::mutex> g(T.mu);
  if (i < 0 || (size_t)i >= T.recs.size() || !out) return -1;
  const Rec &r = T.recs[(size_t)i];
  *out = gl_sim_trace_rec{r.kind, r.device, r.stream, r.other, (int64_t)r.seq, r.what};
  return 0;
}

/* 1 if work record j is ordered after work record i (stream order, events,
   host waits: j's clock has reached i's item), 0 if not, -1 if either is not
   a WORK record.  Two items of different streams neither of which is
   ordered after the other may run at the same time on a GPU. */
__attribute__((visibility("default"))) int gl_sim_trace_after(int64_t i, int64_t j) {
  std::lock_guard<std::mutex> g(T.mu);
  if (i < 0 || j < 0 || (size_t)i >= T.recs.size() || (size_t)j >= T.recs.size()) return -1;
  const Rec &a = T.recs[(size_t)i], &b = T.recs[(size_t)j];
  if (a.kind != WORK || b.kind != WORK) return -1;
  if (a.device != b.device) return 0;
  size_t s = (size_t)a.stream;
  return s < b.clock.size() && b.clock[s] >= a.seq ? 1 : 0;
}

/* The trace's number for a stream handle (the engine's compute stream,
   gl_cuda_stream), or -1 for one that is not live. */
__attribute__((visibility("default"))) int gl_sim_trace_stream_id(void *stream) {
  gl_sim_rt::Runtime &R = gl_sim_rt::rt();
  std::lock_guard<std::mutex> g(R.mu);
  CUstream_st *s = (CUstream_st *)stream;
  if (!s || !R.live.count(s)) return -1;
  return (int)s->id;
}

}  // extern "C"
