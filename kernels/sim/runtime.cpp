/* runtime.cpp — the CUDA simulator's runtime: simulated devices, the device
 * heap with guard pages, host access checks, copies and sets, streams,
 * events, errors (runtime_api.h and the runtime half of sim.h).
 *
 * Device memory.  Every cudaMalloc is its own mapping:
 *     [guard page][data pages ............ |ptr ... ptr+size| slack][guard page]
 * ptr is 256-byte aligned and as close to the trailing guard page as that
 * allows, so a store past the end faults at once; the few slack bytes
 * before/after the block (and the head of its first page) keep the fill
 * value 0xFF, and a changed byte there is reported after the work item as an
 * out-of-bounds write.  New memory is 0xFF everywhere (NaN for floats).
 *
 * Host access checks (GL_SIM_HOSTCHECK, default on).  Data pages are
 * PROT_NONE except inside a device context (gl_sim_device_scope: every work
 * item runs in one).  The SIGSEGV handler opens a page on the first access
 * from a device context and remembers it; the outermost scope exit closes
 * every page opened.  Host code touching device memory outside a device
 * context is reported and the process aborts (a GPU process would crash).
 *
 * Stream-order checks (GL_SIM_STREAMCHECK, default on; needs the host
 * checks).  Every work item gets (stream, seq) and a vector clock of what it
 * is ordered after (stream order, events, the legacy default stream's
 * implicit syncs with blocking streams, host synchronizations, and queries
 * that found the work done).  Pages are closed between work items, so the
 * handler sees each item's first read and first write of each page; per
 * page it keeps the last writer and the last reader per stream, and an
 * access not ordered after a conflicting access of another stream is a
 * "missing stream wait" error.  The clocks model the
 * GPU's guarantees, not the simulator's actual order, so the check finds
 * the bug even though 'sync' mode runs everything in submission order.
 *
 * Execution.  GL_SIM_STREAMS=sync (default): work runs at once on the
 * submitting thread.  GL_SIM_STREAMS=threads: each stream has a host worker
 * thread with a FIFO of work items, event markers and waits, so work on
 * different streams really runs unordered; host synchronizations wait for
 * the queues.  The runtime's state is allocated once and never destroyed,
 * so worker threads may still be parked when the process exits. */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>
#include "sim.h"
#include "runtime_api.h"

enum { MAX_DEVICES = 16, READER_SLOTS = 3, FREED_RING = 256 };
static const size_t PAGE = 4096;

/* ---- configuration --------------------------------------------------------- */
struct Config {
  int devices = 1;
  size_t memory_bytes = (size_t)81920 << 20;
  int hostcheck = 1, streamcheck = 1, threaded = 0, racecheck = 0;
  uint64_t seed = 1;
};
static Config config;  /* filled by init(), read-only afterwards (also by the fault handler) */

static long env_long(const char *name, long dflt, long lo, long hi) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end = nullptr;
  long x = strtol(v, &end, 10);
  if (*end || x < lo || x > hi) {
    fprintf(stderr, "gptlua cuda-sim: %s expected an integer in [%ld, %ld], got '%s'; using %ld\n", name, lo, hi,
            v, dflt);
    return dflt;
  }
  return x;
}

/* ---- messages ------------------------------------------------------------ */
/* One line "gptlua cuda-sim: <msg>" to stderr in one write (no stdio lock,
   so it is usable from the fault handler). */
static void say_raw(const char *msg) {
  char line[2048];
  int n = snprintf(line, sizeof line, "gptlua cuda-sim: %s\n", msg);
  if (n < 0) return;
  if (n >= (int)sizeof line) { n = (int)sizeof line - 1; line[n - 1] = '\n'; }
  ssize_t w = write(2, line, (size_t)n);
  (void)w;
}

/* ---- error codes ------------------------------------------------------------- */
struct ErrorText { cudaError_t code; const char *name, *text; };
static const ErrorText error_texts[] = {
  {cudaSuccess, "cudaSuccess", "no error"},
  {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
  {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
  {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
  {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
  {cudaErrorInvalidPitchValue, "cudaErrorInvalidPitchValue", "invalid pitch argument"},
  {cudaErrorInvalidSymbol, "cudaErrorInvalidSymbol", "invalid device symbol"},
  {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
  {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
  {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
  {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
  {cudaErrorInvalidKernelImage, "cudaErrorInvalidKernelImage", "device kernel image is invalid"},
  {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
  {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
  {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
  {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
  {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources", "too many resources requested for launch"},
  {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout", "the launch timed out and was terminated"},
  {cudaErrorAssert, "cudaErrorAssert", "device-side assert triggered"},
  {cudaErrorIllegalInstruction, "cudaErrorIllegalInstruction", "an illegal instruction was encountered"},
  {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
  {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
  {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
  {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};
static const ErrorText *error_text(cudaError_t code) {
  for (const ErrorText &e : error_texts)
    if (e.code == code) return &e;
  return nullptr;
}

/* The sticky error: the first failure of the context wins. */
static std::mutex sticky_mu;
static std::atomic<int> sticky_code{0};
static char sticky_full[1200];  /* "<standard text>: <message>" */

/* The last error of each host thread, and the detail of its latest error
   (kept after cudaGetLastError resets the code, because GL_CU_CHECK resets
   before it asks cudaGetErrorString). */
static thread_local cudaError_t tls_last = cudaSuccess;
static thread_local cudaError_t tls_detail_code = cudaSuccess;
static thread_local char tls_detail_full[1200];

cudaError_t gl_sim_sticky(void) { return (cudaError_t)sticky_code.load(std::memory_order_acquire); }

static void set_detail(cudaError_t code, const char *msg) {
  const ErrorText *t = error_text(code);
  snprintf(tls_detail_full, sizeof tls_detail_full, "%s: %s", t ? t->text : "unrecognized error code", msg);
  tls_detail_code = code;
}

/* An API call's failure: the thread's last error with a detail, not printed
   (the caller gets the code; GL_CU_CHECK puts the text in its message). */
static cudaError_t api_error(cudaError_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static cudaError_t api_error(cudaError_t code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  tls_last = code;
  set_detail(code, msg);
  return code;
}

static void fail_msg(cudaError_t code, const char *msg) {
  std::lock_guard<std::mutex> g(sticky_mu);
  if (sticky_code.load() != 0) return;
  const ErrorText *t = error_text(code);
  snprintf(sticky_full, sizeof sticky_full, "%s: %s", t ? t->text : "unrecognized error code", msg);
  sticky_code.store((int)code, std::memory_order_release);
  say_raw(msg);
}

void gl_sim_fail(cudaError_t code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fail_msg(code, msg);
}

void gl_sim_set_last_error(cudaError_t code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  tls_last = code;
  set_detail(code, msg);
  say_raw(msg);
}

extern "C" cudaError_t cudaGetLastError(void) {
  cudaError_t s = gl_sim_sticky();
  if (s != cudaSuccess) return s;
  cudaError_t e = tls_last;
  tls_last = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) {
  cudaError_t s = gl_sim_sticky();
  return s != cudaSuccess ? s : tls_last;
}

extern "C" const char *cudaGetErrorString(cudaError_t error) {
  if (error != cudaSuccess && error == gl_sim_sticky()) return sticky_full;
  if (error != cudaSuccess && error == tls_detail_code) return tls_detail_full;
  const ErrorText *t = error_text(error);
  return t ? t->text : "unrecognized error code";
}

extern "C" const char *cudaGetErrorName(cudaError_t error) {
  const ErrorText *t = error_text(error);
  return t ? t->name : "unrecognized error code";
}

/* the sticky error, returned by every call that needs a working context */
#define RETURN_IF_STICKY()                                   \
  do {                                                       \
    cudaError_t sticky_ = gl_sim_sticky();                   \
    if (sticky_ != cudaSuccess) return sticky_;              \
  } while (0)

/* ---- vector clocks -------------------------------------------------------------- */
typedef std::vector<uint64_t> Clock;  /* clock[stream id] = last work seq of that stream ordered before */

static void clock_merge(Clock &dst, const Clock &src) {
  if (dst.size() < src.size()) dst.resize(src.size(), 0);
  for (size_t i = 0; i < src.size(); i++)
    if (src[i] > dst[i]) dst[i] = src[i];
}

/* ---- streams and events ------------------------------------------------------- */
struct CUevent_st;

struct QueueItem {
  enum Kind { WORK, MARKER, WAIT, EXIT } kind = WORK;
  std::function<void()> work;      /* WORK */
  const char *what = nullptr;      /* WORK: interned name */
  uint64_t seq = 0;                /* WORK: the stream's work sequence number */
  Clock clock;                     /* WORK: what the item is ordered after */
  std::shared_ptr<CUevent_st> event;  /* MARKER: the event to stamp */
  uint64_t gen = 0;                /* MARKER: which record of the event */
  struct CUstream_st *target = nullptr;  /* WAIT: until target->completed >= count */
  uint64_t count = 0;
};

struct CUstream_st {
  uint32_t id = 0;          /* index in Runtime::streams; 0 is never used (means "none" in page records) */
  int device = 0;
  unsigned flags = 0;
  bool legacy = false;      /* the legacy default stream (NULL) of `device` */
  bool destroyed = false;
  uint64_t work_seq = 0;    /* work items submitted so far */
  Clock clock;              /* what the next item will be ordered after */
  uint64_t submitted = 0, completed = 0;  /* queue positions (work, markers, waits) */
  std::deque<QueueItem> queue;            /* threads mode */
};

struct CUevent_st {
  unsigned flags = 0;
  int device = 0;
  bool recorded = false;
  CUstream_st *stream = nullptr;  /* of the latest record */
  uint64_t count = 0;             /* its marker's queue position on `stream` */
  uint64_t gen = 0;               /* records so far */
  Clock clock;                    /* the recording stream's clock at the record */
  double time_ms = 0;             /* host wall time when the marker ran */
};

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
};
static Runtime *rt_state;
static std::once_flag rt_once;
static void init(void);
static Runtime &rt() {
  std::call_once(rt_once, init);
  return *rt_state;
}

static thread_local int tls_device = 0;

static double now_ms(void) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - rt_state->t0).count();
}

static const char *intern(const char *s) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.names_mu);
  return R.names.insert(std::string(s ? s : "work")).first->c_str();
}

/* ---- the device heap --------------------------------------------------------- */
/* One access record of a page: which work item, for the stream check. */
struct Access {
  uint32_t stream;   /* 0: none */
  int16_t device;
  uint8_t legacy;
  uint64_t seq;
  const char *what;
};
struct PageRec {
  Access writer;
  Access readers[READER_SLOTS];
  uint32_t next_evict;
};

struct Alloc {
  uintptr_t map_begin, map_end;    /* the whole mapping, guard pages included */
  uintptr_t data_begin, data_end;  /* the pages between the guards */
  uintptr_t begin, end;            /* what cudaMalloc returned: [begin, begin + size) */
  size_t size;
  int device;
  std::atomic<int> opened{0};      /* some page was opened since the last close */
  std::atomic<int> written{0};     /* some page was opened writable */
  PageRec *pages = nullptr;        /* per data page (stream check only) */
};

/* A freed allocation in quarantine: its mapping stays reserved (PROT_NONE,
   pages discarded) until FREED_RING later frees, so its addresses cannot be
   handed to anyone else meanwhile and a use after free is recognised. */
struct FreedRange { uintptr_t begin, end; size_t size; int device; uintptr_t map_begin, map_end; };

/* The allocation table: sorted by map_begin, searched by the fault handler
   without allocating.  A spinlock (the handler cannot block on a mutex the
   interrupted thread might hold; no code holding it touches device pages). */
static std::atomic_flag table_lock = ATOMIC_FLAG_INIT;
static Alloc **table;
static size_t table_n, table_cap;
static FreedRange freed_ring[FREED_RING];
static unsigned freed_next;
static Alloc **opened_list;  /* the allocations with `opened` set (capacity table_cap) */
static size_t opened_n;

struct TableGuard {
  TableGuard() {
    while (table_lock.test_and_set(std::memory_order_acquire)) sched_yield();
  }
  ~TableGuard() { table_lock.clear(std::memory_order_release); }
  TableGuard(const TableGuard &) = delete;
  TableGuard &operator=(const TableGuard &) = delete;
};

/* the allocation whose mapping (guards included) contains a; table locked */
static Alloc *table_find_mapping(uintptr_t a) {
  size_t lo = 0, hi = table_n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (table[mid]->map_begin <= a) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0) return nullptr;
  Alloc *al = table[lo - 1];
  return a < al->map_end ? al : nullptr;
}

static const FreedRange *freed_find(uintptr_t a) {
  for (unsigned k = 0; k < FREED_RING; k++) {
    const FreedRange &f = freed_ring[(freed_next + FREED_RING - 1 - k) % FREED_RING];
    if (f.end > f.begin && a >= f.begin && a < f.end) return &f;
  }
  return nullptr;
}

/* The live allocation whose data pages contain a (its slack included). */
static bool find_data_page_owner(uintptr_t a, uintptr_t *base, size_t *size, int *device) {
  TableGuard g;
  Alloc *al = table_find_mapping(a);
  if (!al || a < al->data_begin || a >= al->data_end) return false;
  *base = al->begin;
  *size = al->size;
  *device = al->device;
  return true;
}

bool gl_sim_find_alloc(const void *p, void **base, size_t *size, int *device) {
  uintptr_t a = (uintptr_t)p, b = 0;
  size_t n = 0;
  int d = 0;
  if (!find_data_page_owner(a, &b, &n, &d) || a < b || a >= b + n) return false;
  if (base) *base = (void *)b;
  if (size) *size = n;
  if (device) *device = d;
  return true;
}

void gl_sim_for_each_alloc(const std::function<void(void *, size_t)> &f) {
  std::vector<std::pair<void *, size_t>> list;
  {
    TableGuard g;
    list.reserve(table_n);
    for (size_t i = 0; i < table_n; i++) list.emplace_back((void *)table[i]->begin, table[i]->size);
  }
  /* unlocked: f touches the memory (faults); untracked: the race mode's
     snapshots are not accesses of the work item that runs them */
  gl_sim_untracked_scope untracked;
  for (auto &e : list) f(e.first, e.second);
}

/* First byte of the slack around the block that is no longer 0xFF, as an
   offset from the block (negative: before it); 0 if intact.  The pages are
   made readable here and closed again by the caller. */
static bool slack_damaged(const Alloc *al, long *where) {
  if (al->begin > al->data_begin) {
    mprotect((void *)al->data_begin, PAGE, PROT_READ);
    const unsigned char *p = (const unsigned char *)al->data_begin;
    for (uintptr_t a = al->data_begin; a < al->begin; a++)
      if (p[a - al->data_begin] != 0xFF) { *where = -(long)(al->begin - a); return true; }
  }
  if (al->end < al->data_end) {
    uintptr_t last = al->data_end - PAGE;
    mprotect((void *)last, PAGE, PROT_READ);
    for (uintptr_t a = al->end; a < al->data_end; a++)
      if (*(const unsigned char *)a != 0xFF) { *where = (long)(a - al->end); return true; }
  }
  return false;
}

/* ---- the fault handler ----------------------------------------------------- */
/* The work item the calling thread runs, for the stream check. */
struct ItemCtx {
  Access me;
  const uint64_t *clock;
  size_t nclock;
};
/* (the library is dlopen'd by LuaJIT, so these use the default TLS model;
   a thread reaching the fault handler has normally touched them already) */
static thread_local int tls_depth = 0;         /* device scopes entered */
static thread_local int tls_untracked = 0;     /* gl_sim_untracked_scope depth */
static thread_local ItemCtx *tls_item = nullptr;

static struct sigaction old_segv;
static void on_segv(int sig, siginfo_t *si, void *uctx);

static bool check_streams(void) { return config.hostcheck && config.streamcheck; }

static bool ordered_after(const ItemCtx *it, const Access &a) {
  if (a.stream == 0 || a.stream == it->me.stream) return true;
  return a.stream < it->nclock && it->clock[a.stream] >= a.seq;
}

static int stream_name(char *buf, size_t n, const Access &a) {
  if (a.legacy) return snprintf(buf, n, "the default stream of cuda:%d", a.device);
  return snprintf(buf, n, "stream %u of cuda:%d", a.stream, a.device);
}

/* Checks an access of page `pg` of al by the current item and records it.
   Returns false with msg filled on a conflict.  Table locked. */
static bool stream_access(Alloc *al, uintptr_t addr, bool write, char *msg, size_t n) {
  ItemCtx *it = tls_item;
  if (!it || !al->pages || tls_untracked || gl_sim_sticky() != cudaSuccess) return true;
  PageRec &r = al->pages[(addr - al->data_begin) / PAGE];
  const Access *bad = nullptr;
  bool bad_was_write = false;
  if (!ordered_after(it, r.writer)) { bad = &r.writer; bad_was_write = true; }
  if (!bad && write)
    for (int k = 0; k < READER_SLOTS; k++)
      if (!ordered_after(it, r.readers[k])) { bad = &r.readers[k]; break; }
  if (bad) {
    char mine[96], theirs[96];
    stream_name(mine, sizeof mine, it->me);
    stream_name(theirs, sizeof theirs, *bad);
    const char *where = gl_sim_where();
    long off = (long)(addr - al->begin);
    snprintf(msg, n,
             "missing stream wait: %s on %s %s 0x%lx (byte %ld of a %zu-byte allocation of cuda:%d) which %s on %s "
             "%s, with no event ordering them%s%s%s",
             it->me.what, mine, write ? "writes" : "reads", (unsigned long)addr, off, al->size, al->device, bad->what,
             theirs, bad_was_write ? "wrote" : "read", where ? " (in " : "", where ? where : "", where ? ")" : "");
    return false;
  }
  if (write) {
    r.writer = it->me;
    memset(r.readers, 0, sizeof r.readers);  /* every reader is ordered before this write, so before later ones */
  } else {
    int slot = -1;
    for (int k = 0; k < READER_SLOTS && slot < 0; k++)
      if (r.readers[k].stream == it->me.stream) slot = k;
    for (int k = 0; k < READER_SLOTS && slot < 0; k++)
      if (r.readers[k].stream == 0) slot = k;
    if (slot < 0) slot = (int)(r.next_evict++ % READER_SLOTS);  /* forgets one reader: may miss a WAR, never invents one */
    r.readers[slot] = it->me;
  }
  return true;
}

/* Opens a data page (or, without the stream check, the whole allocation)
   for a device context.  Table locked. */
static void open_page(Alloc *al, uintptr_t addr, bool write) {
  int prot = write ? PROT_READ | PROT_WRITE : PROT_READ;
  bool whole = !check_streams() || tls_untracked;
  if (whole) prot = PROT_READ | PROT_WRITE;
  uintptr_t page = addr & ~(uintptr_t)(PAGE - 1);
  int rc = whole ? mprotect((void *)al->data_begin, al->data_end - al->data_begin, prot)
                 : mprotect((void *)page, PAGE, prot);
  if (rc != 0) {
    /* too many distinct protections (vm.max_map_count): open it all */
    prot = PROT_READ | PROT_WRITE;
    if (mprotect((void *)al->data_begin, al->data_end - al->data_begin, prot) != 0) {
      say_raw("mprotect failed while opening a device page; cannot continue");
      abort();
    }
  }
  if (!al->opened.exchange(1)) opened_list[opened_n++] = al;
  if (prot & PROT_WRITE) al->written.store(1);
}

static void describe_bad_address(char *msg, size_t n, const char *kind, uintptr_t a, const Alloc *al,
                                 const FreedRange *fr, const char *in) {
  char tail[300];
  snprintf(tail, sizeof tail, "%s%s%s", in ? " (in " : "", in ? in : "", in ? ")" : "");
  if (al && a >= al->data_end)
    snprintf(msg, n, "%s at 0x%lx: %lu bytes past the end of a %zu-byte allocation of cuda:%d%s", kind,
             (unsigned long)a, (unsigned long)(a - al->end), al->size, al->device, tail);
  else if (al && a < al->data_begin)
    snprintf(msg, n, "%s at 0x%lx: %lu bytes before the start of a %zu-byte allocation of cuda:%d%s", kind,
             (unsigned long)a, (unsigned long)(al->begin - a), al->size, al->device, tail);
  else if (fr)
    snprintf(msg, n, "%s at 0x%lx: byte %ld of a %zu-byte allocation of cuda:%d that was freed%s", kind,
             (unsigned long)a, (long)(a - fr->begin), fr->size, fr->device, tail);
  else if (a < 65536)
    snprintf(msg, n, "%s at 0x%lx: a null pointer%s", kind, (unsigned long)a, tail);
  else
    snprintf(msg, n, "%s at 0x%lx: not device memory%s", kind, (unsigned long)a, tail);
}

/* Calls the handler installed before ours (if it is a function), then
   takes SIGSEGV back: a handler that does not own a fault typically
   reinstalls its own predecessor before returning. */
static void chain_previous(int sig, siginfo_t *si, void *uctx) {
  struct sigaction mine;
  if (sigaction(SIGSEGV, nullptr, &mine) != 0) return;
  if (old_segv.sa_flags & SA_SIGINFO) {
    if (old_segv.sa_sigaction && old_segv.sa_sigaction != on_segv) old_segv.sa_sigaction(sig, si, uctx);
  } else if (old_segv.sa_handler != SIG_DFL && old_segv.sa_handler != SIG_IGN) {
    old_segv.sa_handler(sig);
  }
  sigaction(SIGSEGV, &mine, nullptr);
}

static void on_segv(int sig, siginfo_t *si, void *uctx) {
  uintptr_t a = (uintptr_t)si->si_addr;
#if defined(__x86_64__)
  /* page-fault error code: bit 1 set for a write */
  bool write = (((ucontext_t *)uctx)->uc_mcontext.gregs[REG_ERR] & 2) != 0;
#else
  bool write = true;  /* unknown on this architecture: treat every access as a write */
  (void)uctx;
#endif
  char msg[1024];
  msg[0] = 0;
  bool in_device = tls_depth > 0;
  enum { OPENED, CONFLICT, OUT_OF_BOUNDS, HOST_ACCESS, NOT_OURS } outcome = NOT_OURS;
  bool device_related = false;  /* the address is (or was) in a device mapping */
  {
    TableGuard g;
    Alloc *al = table_find_mapping(a);
    bool live_page = al && a >= al->data_begin && a < al->data_end;
    const FreedRange *fr = al ? nullptr : freed_find(a);
    device_related = al || fr;
    if (in_device) {
      if (live_page) {
        outcome = stream_access(al, a, write, msg, sizeof msg) ? OPENED : CONFLICT;
        open_page(al, a, write);
      } else {
        const char *where = gl_sim_where();
        describe_bad_address(msg, sizeof msg, write ? "out-of-bounds write" : "out-of-bounds read", a, al, fr,
                             where ? where : (tls_item ? tls_item->me.what : "device code"));
        outcome = OUT_OF_BOUNDS;
      }
    } else if (live_page) {
      if (write)
        snprintf(msg, sizeof msg,
                 "host code wrote device memory at 0x%lx (a %zu-byte allocation of cuda:%d): copy to it with "
                 "cudaMemcpy instead",
                 (unsigned long)a, al->size, al->device);
      else
        snprintf(msg, sizeof msg,
                 "host code read device memory at 0x%lx (a %zu-byte allocation of cuda:%d): copy it to the host "
                 "first",
                 (unsigned long)a, al->size, al->device);
      outcome = HOST_ACCESS;
    } else if (al || fr) {
      char what[48];
      snprintf(what, sizeof what, "host code %s device memory", write ? "wrote" : "read");
      describe_bad_address(msg, sizeof msg, what, a, al, fr, nullptr);
      outcome = HOST_ACCESS;
    }
  }
  switch (outcome) {
    case OPENED:
      return;
    case CONFLICT:
      /* inside a kernel this does not return; a copy or library call finishes
         (its page is open) and the sticky error stops everything after it */
      if (!gl_sim_abort_kernel(cudaErrorLaunchFailure, msg)) fail_msg(cudaErrorLaunchFailure, msg);
      return;
    case OUT_OF_BOUNDS:
      /* not device memory at all: another part of the simulator (exec.cpp's
         dynamic shared memory guard pages) may own the address; it stops
         the kernel itself, or returns having passed the fault on */
      if (!device_related) chain_previous(sig, si, uctx);
      if (!gl_sim_abort_kernel(cudaErrorIllegalAddress, msg)) {
        say_raw(msg);
        abort();
      }
      return;
    case HOST_ACCESS:
      say_raw(msg);
      abort();
    case NOT_OURS:
      break;
  }
  /* not device memory: let the previous handler (or the default action) have it */
  sigaction(SIGSEGV, &old_segv, nullptr);
  (void)sig;
}

static void install_handler(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
}

/* A library initialised after us (MPI) may have installed its own handler:
   take SIGSEGV back, keeping theirs as the one to fall back to. */
static void ensure_handler(void) {
  if (!config.hostcheck) return;
  struct sigaction cur;
  if (sigaction(SIGSEGV, nullptr, &cur) != 0) return;
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_segv) return;
  install_handler();
}

/* Closes every page opened by device contexts, after checking the slack of
   allocations opened writable; a damaged slack is reported as an
   out-of-bounds write of `what`. */
static void close_opened(const char *what) {
  if (!config.hostcheck || __atomic_load_n(&opened_n, __ATOMIC_RELAXED) == 0) return;
  char msg[512];
  msg[0] = 0;
  {
    TableGuard g;
    for (size_t i = 0; i < opened_n; i++) {
      Alloc *al = opened_list[i];
      long where = 0;
      if (al->written.load() && !msg[0] && slack_damaged(al, &where)) {
        uintptr_t a = where < 0 ? al->begin + where : al->end + where;
        snprintf(msg, sizeof msg, "out-of-bounds write at 0x%lx: %ld bytes %s a %zu-byte allocation of cuda:%d (in %s)",
                 (unsigned long)a, where < 0 ? -where : where, where < 0 ? "before the start of" : "past the end of",
                 al->size, al->device, what ? what : "device code");
      }
      mprotect((void *)al->data_begin, al->data_end - al->data_begin, PROT_NONE);
      al->opened.store(0);
      al->written.store(0);
    }
    opened_n = 0;
  }
  if (msg[0]) fail_msg(cudaErrorIllegalAddress, msg);
}

gl_sim_device_scope::gl_sim_device_scope() { tls_depth++; }
gl_sim_device_scope::~gl_sim_device_scope() {
  if (--tls_depth == 0) close_opened(tls_item ? tls_item->me.what : nullptr);
}

gl_sim_untracked_scope::gl_sim_untracked_scope() { tls_untracked++; }
gl_sim_untracked_scope::~gl_sim_untracked_scope() {
  /* close what was opened unrecorded, so the work item's own later accesses fault and are seen */
  if (--tls_untracked == 0 && check_streams()) close_opened(tls_item ? tls_item->me.what : nullptr);
}

/* ---- initialisation ----------------------------------------------------------- */
static CUstream_st *new_stream_locked(Runtime &R, int device, unsigned flags, bool legacy);

static void init(void) {
  Config c;
  c.devices = (int)env_long("GL_SIM_DEVICES", 1, 0, MAX_DEVICES);
  c.memory_bytes = (size_t)env_long("GL_SIM_MEMORY_MB", 81920, 1, 1L << 24) << 20;
  c.hostcheck = env_long("GL_SIM_HOSTCHECK", 1, 0, 1) != 0;
  c.streamcheck = env_long("GL_SIM_STREAMCHECK", 1, 0, 1) != 0;
  c.racecheck = env_long("GL_SIM_RACECHECK", 0, 0, 1) != 0;
  const char *seed = getenv("GL_SIM_SEED");
  if (seed && *seed) {
    char *end = nullptr;
    unsigned long long s = strtoull(seed, &end, 10);
    if (*end) fprintf(stderr, "gptlua cuda-sim: GL_SIM_SEED expected an integer, got '%s'; using 1\n", seed);
    else c.seed = s;
  }
  const char *streams = getenv("GL_SIM_STREAMS");
  if (streams && *streams) {
    if (!strcmp(streams, "threads")) c.threaded = 1;
    else if (strcmp(streams, "sync") != 0)
      fprintf(stderr, "gptlua cuda-sim: GL_SIM_STREAMS expected 'sync' or 'threads', got '%s'; using 'sync'\n",
              streams);
  }
  config = c;
  Runtime *R = new Runtime();  /* never destroyed: stream threads may outlive static destructors */
  for (int d = 0; d < MAX_DEVICES; d++) R->in_use[d].store(0);
  rt_state = R;
  {
    std::lock_guard<std::mutex> g(R->mu);
    for (int d = 0; d < c.devices; d++) R->legacy[d] = new_stream_locked(*R, d, cudaStreamDefault, true);
  }
  if (c.hostcheck) install_handler();
}

int gl_sim_racecheck(void) { rt(); return config.racecheck; }
uint64_t gl_sim_seed(void) { rt(); return config.seed; }
int gl_sim_streams_threaded(void) { rt(); return config.threaded; }

/* ---- running work ---------------------------------------------------------------- */
static void run_work(CUstream_st *s, QueueItem &it) {
  if (gl_sim_sticky() != cudaSuccess) return;  /* a failed context runs nothing more */
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
  it.work();
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

static CUstream_st *new_stream_locked(Runtime &R, int device, unsigned flags, bool legacy) {
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
static void host_wait(CUstream_st *s, uint64_t count, const Clock &clock) {
  Runtime &R = *rt_state;
  std::unique_lock<std::mutex> lk(R.mu);
  if (!tls_item) R.cv.wait(lk, [&] { return s->completed >= count; });
  clock_merge(R.host_clock, clock);
}

/* every stream of device d (all devices when d < 0) */
static void host_wait_device(int d) {
  Runtime &R = *rt_state;
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

/* ---- handles --------------------------------------------------------------------- */
static cudaError_t resolve_stream(const char *fn, cudaStream_t h, CUstream_st **out) {
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

static std::shared_ptr<CUevent_st> find_event(cudaEvent_t e) {  /* R.mu held */
  auto it = rt_state->events.find(e);
  return it == rt_state->events.end() ? nullptr : it->second;
}

/* ---- sim.h: submit, function attributes ------------------------------------------- */
void gl_sim_submit(cudaStream_t stream, const char *what, std::function<void()> work) {
  CUstream_st *s = nullptr;
  const char *name = intern(what);
  if (resolve_stream(name, stream, &s) != cudaSuccess) {
    gl_sim_set_last_error(cudaErrorInvalidResourceHandle, "%s: stream %p is not a live stream", name, (void *)stream);
    return;
  }
  if (gl_sim_sticky() != cudaSuccess) return;
  submit_on(s, name, std::move(work), nullptr);
}

int gl_sim_func_smem_optin(const void *fn) {
  Runtime &R = rt();
  std::lock_guard<std::mutex> g(R.func_mu);
  auto it = R.func_smem.find(fn);
  return it == R.func_smem.end() ? 0 : it->second;
}

/* ---- devices ------------------------------------------------------------------- */
static cudaError_t check_device(const char *fn, int d) {
  rt();
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "%s: no simulated device (GL_SIM_DEVICES=0)", fn);
  if (d < 0 || d >= config.devices)
    return api_error(cudaErrorInvalidDevice, "%s: device %d requested but %d simulated device(s) exist (GL_SIM_DEVICES)",
                     fn, d, config.devices);
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetDeviceCount(int *count) {
  rt();
  if (!count) return api_error(cudaErrorInvalidValue, "cudaGetDeviceCount: count is NULL");
  *count = config.devices;
  return cudaSuccess;
}

extern "C" cudaError_t cudaSetDevice(int device) {
  cudaError_t e = check_device("cudaSetDevice", device);
  if (e != cudaSuccess) return e;
  tls_device = device;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetDevice(int *device) {
  rt();
  if (!device) return api_error(cudaErrorInvalidValue, "cudaGetDevice: device is NULL");
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaGetDevice: no simulated device (GL_SIM_DEVICES=0)");
  *device = tls_device;
  return cudaSuccess;
}

/* H100 SXM figures for what sim_types.h does not fix */
enum { SIM_CLOCK_KHZ = 1980000, SIM_MEM_CLOCK_KHZ = 2619000, SIM_BUS_WIDTH = 5120, SIM_L2_BYTES = 50 << 20,
       SIM_REGS_PER_BLOCK = 65536, SIM_SMEM_PER_SM = 228 * 1024 };

extern "C" cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *prop, int device) {
  if (!prop) return api_error(cudaErrorInvalidValue, "cudaGetDeviceProperties: prop is NULL");
  cudaError_t e = check_device("cudaGetDeviceProperties", device);
  if (e != cudaSuccess) return e;
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "gptlua cuda-sim (H100 limits)");
  prop->totalGlobalMem = config.memory_bytes;
  prop->sharedMemPerBlock = GL_SIM_SMEM_DEFAULT;
  prop->regsPerBlock = SIM_REGS_PER_BLOCK;
  prop->warpSize = GL_SIM_WARP;
  prop->maxThreadsPerBlock = GL_SIM_MAX_THREADS_PER_BLOCK;
  prop->maxThreadsDim[0] = GL_SIM_MAX_THREADS_PER_BLOCK;
  prop->maxThreadsDim[1] = GL_SIM_MAX_THREADS_PER_BLOCK;
  prop->maxThreadsDim[2] = GL_SIM_MAX_BLOCK_Z;
  prop->maxGridSize[0] = (int)GL_SIM_MAX_GRID_X;
  prop->maxGridSize[1] = GL_SIM_MAX_GRID_Y;
  prop->maxGridSize[2] = GL_SIM_MAX_GRID_Z;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = GL_SIM_SM_COUNT;
  prop->memoryBusWidth = SIM_BUS_WIDTH;
  prop->l2CacheSize = SIM_L2_BYTES;
  prop->sharedMemPerBlockOptin = GL_SIM_SMEM_OPTIN;
  prop->sharedMemPerMultiprocessor = SIM_SMEM_PER_SM;
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device) {
  if (!value) return api_error(cudaErrorInvalidValue, "cudaDeviceGetAttribute: value is NULL");
  cudaError_t e = check_device("cudaDeviceGetAttribute", device);
  if (e != cudaSuccess) return e;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = GL_SIM_MAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxBlockDimX: *value = GL_SIM_MAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxBlockDimY: *value = GL_SIM_MAX_THREADS_PER_BLOCK; break;
    case cudaDevAttrMaxBlockDimZ: *value = GL_SIM_MAX_BLOCK_Z; break;
    case cudaDevAttrMaxGridDimX: *value = (int)GL_SIM_MAX_GRID_X; break;
    case cudaDevAttrMaxGridDimY: *value = GL_SIM_MAX_GRID_Y; break;
    case cudaDevAttrMaxGridDimZ: *value = GL_SIM_MAX_GRID_Z; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = GL_SIM_SMEM_DEFAULT; break;
    case cudaDevAttrWarpSize: *value = GL_SIM_WARP; break;
    case cudaDevAttrClockRate: *value = SIM_CLOCK_KHZ; break;
    case cudaDevAttrMultiProcessorCount: *value = GL_SIM_SM_COUNT; break;
    case cudaDevAttrMemoryClockRate: *value = SIM_MEM_CLOCK_KHZ; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = SIM_BUS_WIDTH; break;
    case cudaDevAttrL2CacheSize: *value = SIM_L2_BYTES; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = GL_SIM_SMEM_OPTIN; break;
    default:
      return api_error(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute %d is not simulated", (int)attr);
  }
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceSynchronize(void) {
  rt();
  RETURN_IF_STICKY();
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaDeviceSynchronize: no simulated device");
  host_wait_device(tls_device);
  RETURN_IF_STICKY();
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  rt();
  RETURN_IF_STICKY();
  if (!free_bytes || !total_bytes) return api_error(cudaErrorInvalidValue, "cudaMemGetInfo: NULL argument");
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaMemGetInfo: no simulated device");
  size_t used = rt_state->in_use[tls_device].load();
  *total_bytes = config.memory_bytes;
  *free_bytes = used < config.memory_bytes ? config.memory_bytes - used : 0;
  return cudaSuccess;
}

extern "C" cudaError_t cudaFuncSetAttribute(const void *func, enum cudaFuncAttribute attr, int value) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!func) return api_error(cudaErrorInvalidValue, "cudaFuncSetAttribute: func is NULL");
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || value > GL_SIM_SMEM_OPTIN)
      return api_error(cudaErrorInvalidValue,
                       "cudaFuncSetAttribute: cudaFuncAttributeMaxDynamicSharedMemorySize %d, expected 0..%d "
                       "(227 KiB on an H100)",
                       value, (int)GL_SIM_SMEM_OPTIN);
    std::lock_guard<std::mutex> g(R.func_mu);
    R.func_smem[func] = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {
    if (value < -1 || value > 100)
      return api_error(cudaErrorInvalidValue,
                       "cudaFuncSetAttribute: cudaFuncAttributePreferredSharedMemoryCarveout %d, expected -1..100",
                       value);
    return cudaSuccess;  /* a hint; nothing to simulate */
  }
  return api_error(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute %d is not simulated", (int)attr);
}

/* ---- device memory ------------------------------------------------------------ */
extern "C" cudaError_t cudaMalloc(void **dev_ptr, size_t size) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!dev_ptr) return api_error(cudaErrorInvalidValue, "cudaMalloc: devPtr is NULL");
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaMalloc: no simulated device");
  *dev_ptr = nullptr;
  if (size == 0) return cudaSuccess;  /* as the real runtime: success and a NULL pointer */
  int dev = tls_device;
  size_t rounded = (size + 255) & ~(size_t)255;
  if (rounded < size || rounded > config.memory_bytes)
    return api_error(cudaErrorMemoryAllocation, "cudaMalloc: %zu bytes requested on cuda:%d, which has %zu bytes",
                     size, dev, config.memory_bytes);
  size_t used = R.in_use[dev].fetch_add(rounded) + rounded;
  if (used > config.memory_bytes) {
    R.in_use[dev].fetch_sub(rounded);
    return api_error(cudaErrorMemoryAllocation,
                     "cudaMalloc: %zu bytes requested on cuda:%d with %zu of %zu bytes in use (GL_SIM_MEMORY_MB)", size,
                     dev, used - rounded, config.memory_bytes);
  }
  size_t data_len = (rounded + PAGE - 1) & ~(PAGE - 1);
  size_t map_len = data_len + 2 * PAGE;
  void *m = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    R.in_use[dev].fetch_sub(rounded);
    return api_error(cudaErrorMemoryAllocation, "cudaMalloc: mapping %zu bytes for cuda:%d failed: %s", map_len, dev,
                     strerror(errno));
  }
  Alloc *al = new Alloc();
  al->map_begin = (uintptr_t)m;
  al->map_end = al->map_begin + map_len;
  al->data_begin = al->map_begin + PAGE;
  al->data_end = al->data_begin + data_len;
  al->begin = al->data_end - rounded;
  al->end = al->begin + size;
  al->size = size;
  al->device = dev;
  if (check_streams()) al->pages = (PageRec *)calloc(data_len / PAGE, sizeof(PageRec));
  memset((void *)al->data_begin, 0xFF, data_len);
  mprotect(m, PAGE, PROT_NONE);
  mprotect((void *)al->data_end, PAGE, PROT_NONE);
  if (config.hostcheck) mprotect((void *)al->data_begin, data_len, PROT_NONE);
  {
    TableGuard g;
    if (table_n == table_cap) {
      size_t cap = table_cap ? 2 * table_cap : 1024;
      Alloc **t = (Alloc **)malloc(cap * sizeof *t), **o = (Alloc **)malloc(cap * sizeof *o);
      if (!t || !o) { say_raw("out of host memory for the allocation table"); abort(); }
      if (table_n) memcpy(t, table, table_n * sizeof *t);
      if (opened_n) memcpy(o, opened_list, opened_n * sizeof *o);
      free(table);
      free(opened_list);
      table = t;
      opened_list = o;
      table_cap = cap;
    }
    size_t pos = table_n;
    while (pos > 0 && table[pos - 1]->map_begin > al->map_begin) pos--;
    memmove(table + pos + 1, table + pos, (table_n - pos) * sizeof *table);
    table[pos] = al;
    table_n++;
  }
  *dev_ptr = (void *)al->begin;
  return cudaSuccess;
}

extern "C" cudaError_t cudaFree(void *dev_ptr) {
  Runtime &R = rt();
  if (!dev_ptr) return gl_sim_sticky();
  uintptr_t a = (uintptr_t)dev_ptr;
  int dev = -1;
  {
    TableGuard g;
    Alloc *al = table_find_mapping(a);
    if (al && al->begin == a) dev = al->device;
  }
  if (dev < 0) {
    /* describe the bad pointer (outside the spinlock: api_error formats with stdio) */
    uintptr_t base = 0;
    size_t size = 0;
    int d = 0;
    if (find_data_page_owner(a, &base, &size, &d))
      return api_error(cudaErrorInvalidValue,
                       "cudaFree: %p is byte %ld of a %zu-byte allocation of cuda:%d, expected its start %p", dev_ptr,
                       (long)(a - base), size, d, (void *)base);
    bool was_freed = false;
    FreedRange fr{};
    {
      TableGuard g;
      const FreedRange *f = freed_find(a);
      if (f) { was_freed = true; fr = *f; }
    }
    if (was_freed && fr.begin == a)
      return api_error(cudaErrorInvalidValue, "cudaFree: %p was already freed (a %zu-byte allocation of cuda:%d)",
                       dev_ptr, fr.size, fr.device);
    return api_error(cudaErrorInvalidValue, "cudaFree: %p is not device memory", dev_ptr);
  }
  /* as the real cudaFree: wait for the device, so queued work never runs on freed memory */
  host_wait_device(dev);
  Alloc *al = nullptr;
  FreedRange evicted{};
  char msg[512];
  msg[0] = 0;
  {
    TableGuard g;
    Alloc *found = table_find_mapping(a);
    if (found && found->begin == a) {
      al = found;
      size_t pos = 0;
      while (table[pos] != al) pos++;
      memmove(table + pos, table + pos + 1, (table_n - pos - 1) * sizeof *table);
      table_n--;
      for (size_t i = 0; i < opened_n; i++)
        if (opened_list[i] == al) { opened_list[i] = opened_list[--opened_n]; break; }
      long where = 0;
      if (slack_damaged(al, &where))
        snprintf(msg, sizeof msg, "out-of-bounds write found at cudaFree: %ld bytes %s a %zu-byte allocation of cuda:%d",
                 where < 0 ? -where : where, where < 0 ? "before the start of" : "past the end of", al->size,
                 al->device);
      evicted = freed_ring[freed_next % FREED_RING];
      freed_ring[freed_next % FREED_RING] =
          FreedRange{al->begin, al->data_end, al->size, al->device, al->map_begin, al->map_end};
      freed_next++;
    }
  }
  if (!al) return api_error(cudaErrorInvalidValue, "cudaFree: %p was freed by another thread", dev_ptr);
  if (msg[0]) fail_msg(cudaErrorIllegalAddress, msg);
  /* quarantine: keep the range reserved, give the memory back */
  mprotect((void *)al->map_begin, al->map_end - al->map_begin, PROT_NONE);
  madvise((void *)al->map_begin, al->map_end - al->map_begin, MADV_DONTNEED);
  if (evicted.map_end > evicted.map_begin) munmap((void *)evicted.map_begin, evicted.map_end - evicted.map_begin);
  R.in_use[al->device].fetch_sub((al->size + 255) & ~(size_t)255);
  free(al->pages);
  delete al;
  return gl_sim_sticky();
}

/* ---- pinned host memory ------------------------------------------------------------ */
extern "C" cudaError_t cudaHostAlloc(void **host_ptr, size_t size, unsigned int flags) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!host_ptr) return api_error(cudaErrorInvalidValue, "cudaHostAlloc: pHost is NULL");
  *host_ptr = nullptr;
  if (flags & ~(unsigned)(cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined))
    return api_error(cudaErrorInvalidValue, "cudaHostAlloc: flags 0x%x, expected a combination of 0x1, 0x2, 0x4", flags);
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaHostAlloc: no simulated device");
  size_t len = ((size ? size : 1) + PAGE - 1) & ~(PAGE - 1);
  void *p = nullptr;
  if (posix_memalign(&p, PAGE, len) != 0 || !p)
    return api_error(cudaErrorMemoryAllocation, "cudaHostAlloc: out of host memory allocating %zu bytes", size);
  memset(p, 0xFF, len);  /* uninitialised, visibly */
  std::lock_guard<std::mutex> g(R.pinned_mu);
  R.pinned[(uintptr_t)p] = PinnedBlock{size};
  *host_ptr = p;
  return cudaSuccess;
}

extern "C" cudaError_t cudaMallocHost(void **host_ptr, size_t size) { return cudaHostAlloc(host_ptr, size, 0); }

extern "C" cudaError_t cudaFreeHost(void *host_ptr) {
  Runtime &R = rt();
  if (!host_ptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> g(R.pinned_mu);
    if (!R.pinned.count((uintptr_t)host_ptr))
      return api_error(cudaErrorInvalidValue, "cudaFreeHost: %p is not a block of cudaHostAlloc/cudaMallocHost", host_ptr);
  }
  host_wait_device(-1);  /* queued copies may still read or write it */
  {
    std::lock_guard<std::mutex> g(R.pinned_mu);
    R.pinned.erase((uintptr_t)host_ptr);
  }
  free(host_ptr);
  return cudaSuccess;
}

/* ---- what a pointer is ---------------------------------------------------------- */
enum Side { HOST_PAGEABLE, HOST_PINNED, DEVICE, FREED_DEVICE };
struct PtrInfo {
  Side side;
  int device;
  uintptr_t base;
  size_t size;
};

static PtrInfo classify(const void *p, size_t n) {
  PtrInfo in{HOST_PAGEABLE, -1, 0, 0};
  if (find_data_page_owner((uintptr_t)p, &in.base, &in.size, &in.device)) {
    in.side = DEVICE;  /* possibly outside [base, base + size): check_device_range says so */
    return in;
  }
  {
    TableGuard g;
    const FreedRange *f = freed_find((uintptr_t)p);
    if (f) {
      in.side = FREED_DEVICE;
      in.device = f->device;
      in.base = f->begin;
      in.size = f->size;
      return in;
    }
  }
  Runtime &R = *rt_state;
  std::lock_guard<std::mutex> g(R.pinned_mu);
  auto it = R.pinned.upper_bound((uintptr_t)p);
  if (it != R.pinned.begin()) {
    --it;
    uintptr_t a = (uintptr_t)p;
    if (a >= it->first && a + n <= it->first + it->second.size) {
      in.side = HOST_PINNED;
      in.base = it->first;
      in.size = it->second.size;
    }
  }
  return in;
}

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

/* ---- copies ---------------------------------------------------------------------- */
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
  Clock clock;
  if (k == cudaMemcpyHostToHost) {
    uint64_t pos = submit_on(s, "cudaMemcpy host to host", [=] { memmove(dst, src, n); }, &clock);
    host_wait(s, pos, clock);
  } else if (k == cudaMemcpyHostToDevice) {
    if (si.side == HOST_PINNED) {
      uint64_t pos = submit_on(s, "cudaMemcpy host to device", [=] { memmove(dst, src, n); }, &clock);
      if (sync_api) host_wait(s, pos, clock);
    } else {
      if (sync_api) {  /* "a stream sync is performed before the copy is initiated" */
        Runtime &R = *rt_state;
        uint64_t pos;
        {
          std::lock_guard<std::mutex> g(R.mu);
          pos = s->submitted;
          clock = s->clock;
        }
        host_wait(s, pos, clock);
      }
      auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char *)src,
                                                                   (const unsigned char *)src + n);
      submit_on(s, "cudaMemcpy host to device", [=] { memmove(dst, staged->data(), n); }, nullptr);
    }
  } else if (k == cudaMemcpyDeviceToHost) {
    uint64_t pos = submit_on(s, "cudaMemcpy device to host", [=] { memmove(dst, src, n); }, &clock);
    if (sync_api || di.side == HOST_PAGEABLE) host_wait(s, pos, clock);
  } else {
    submit_on(s, "cudaMemcpy device to device", [=] { memmove(dst, src, n); }, nullptr);
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
  if (sync_api) {
    /* cudaMemcpyPeer is serialised with all work on both devices (and the current one) */
    host_wait_device(-1);
    Clock clock;
    uint64_t pos = submit_on(s, "cudaMemcpyPeer", [=] { memmove(dst, src, n); }, &clock);
    host_wait(s, pos, clock);
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
  unsigned char byte = (unsigned char)value;
  submit_on(s, fn, [=] { memset(p, byte, n); }, nullptr);
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

extern "C" cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr) {
  rt();
  RETURN_IF_STICKY();
  if (!attributes) return api_error(cudaErrorInvalidValue, "cudaPointerGetAttributes: attributes is NULL");
  PtrInfo in = classify(ptr, 1);
  memset(attributes, 0, sizeof *attributes);
  switch (in.side) {
    case DEVICE:
      attributes->type = cudaMemoryTypeDevice;
      attributes->device = in.device;
      attributes->devicePointer = (void *)ptr;
      break;
    case HOST_PINNED:
      attributes->type = cudaMemoryTypeHost;
      attributes->device = tls_device;
      attributes->devicePointer = (void *)ptr;
      attributes->hostPointer = (void *)ptr;
      break;
    default:
      attributes->type = cudaMemoryTypeUnregistered;
      attributes->device = -1;
      attributes->hostPointer = (void *)ptr;
      break;
  }
  return cudaSuccess;
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
  uint64_t pos;
  Clock clock;
  {
    std::lock_guard<std::mutex> g(R.mu);
    pos = s->submitted;
    clock = s->clock;
  }
  host_wait(s, pos, clock);
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
  if (s->completed < s->submitted) return cudaErrorNotReady;  /* not an error: no last error */
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
  if (!ev->recorded) return cudaSuccess;  /* waiting for an event never recorded is a no-op */
  order_submission_locked(R, s);
  clock_merge(s->clock, ev->clock);
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
  if (!event_done_locked(ev.get())) return cudaErrorNotReady;
  if (ev->recorded) clock_merge(R.host_clock, ev->clock);  /* the host has seen it pass, as after a synchronize */
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  std::unique_lock<std::mutex> lk(R.mu);
  std::shared_ptr<CUevent_st> ev = find_event(event);
  if (!ev) return api_error(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: %p is not a live event", (void *)event);
  if (!ev->recorded) return cudaSuccess;
  if (!tls_item) R.cv.wait(lk, [&] { return event_done_locked(ev.get()); });
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
