/* runtime_memory.cpp — the CUDA simulator's device memory: the heap with
 * guard pages (cudaMalloc, cudaFree, the quarantine of freed ranges), the
 * SIGSEGV handler that makes the host access and stream-order checks,
 * pinned host memory, and what a pointer is.  Part of the runtime
 * (runtime.cpp lists its three files; runtime_internal.h is what they
 * share): the work items whose accesses are checked here are queued and
 * run by runtime_streams.cpp, which sets tls_item and calls close_opened
 * around each.
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
 * the bug even though 'sync' mode runs everything in submission order. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <functional>
#include <vector>
#include "runtime_internal.h"

using namespace gl_sim_rt;

enum { READER_SLOTS = 3, FREED_RING = 256 };
static const size_t PAGE = 4096;

/* ---- the device heap --------------------------------------------------------- */
namespace {
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
  uint8_t *init_bits = nullptr;    /* a bit per byte of [begin, end) once written (initcheck; host checks only) */
};

/* A freed allocation in quarantine: its mapping stays reserved (PROT_NONE,
   pages discarded) until FREED_RING later frees, so its addresses cannot be
   handed to anyone else meanwhile and a use after free is recognised. */
struct FreedRange { uintptr_t begin, end; size_t size; int device; uintptr_t map_begin, map_end; };
}  // namespace

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

bool gl_sim_alloc_view_of(uintptr_t a, gl_sim_alloc_view *out) {
  TableGuard g;
  Alloc *al = table_find_mapping(a);
  if (!al || a < al->data_begin || a >= al->data_end) return false;
  out->data_begin = al->data_begin;
  out->data_end = al->data_end;
  out->begin = al->begin;
  out->end = al->end;
  out->written = al->init_bits;
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
/* (the library is dlopen'd by LuaJIT, so these use the default TLS model;
   a thread reaching the fault handler has normally touched them already) */
static thread_local int tls_depth = 0;         /* device scopes entered */
static thread_local int tls_untracked = 0;     /* gl_sim_untracked_scope depth */
namespace gl_sim_rt {
thread_local ItemCtx *tls_item = nullptr;
}  // namespace gl_sim_rt

static struct sigaction old_segv;
static void on_segv(int sig, siginfo_t *si, void *uctx);

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
static void mark_written(Alloc *al, uintptr_t lo, uintptr_t hi);
static void open_page(Alloc *al, uintptr_t addr, bool write) {
  int prot = write ? PROT_READ | PROT_WRITE : PROT_READ;
  bool whole = !check_streams() || tls_untracked;
  /* without the stream check an item's first access opens the whole block
     for good; an untracked scope (race mode's snapshots) opens it read-only
     for reading, so the close after it skips the slack check of a block it
     only read */
  if (!check_streams()) prot = PROT_READ | PROT_WRITE;
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
  /* initcheck: a kernel's stores mark the bytes they write (sanitize.cpp);
     every other writer (a copy, a set, cuBLASLt, NCCL, race mode's restores)
     is not instrumented, so the page (or block) it opens for writing counts
     as written whole: never a false report, at worst a missed one */
  if (al->init_bits && (prot & PROT_WRITE) && (write || whole) && !gl_sim_where()) {
    uintptr_t lo = whole ? al->data_begin : page, hi = whole ? al->data_end : page + PAGE;
    mark_written(al, lo, hi);
  }
}

/* sets the initcheck bits of [lo, hi) ∩ [begin, end) */
static void mark_written(Alloc *al, uintptr_t lo, uintptr_t hi) {
  if (lo < al->begin) lo = al->begin;
  if (hi > al->end) hi = al->end;
  for (uintptr_t a = lo; a < hi;) {
    size_t i = a - al->begin;
    if ((i & 7) == 0 && a + 8 <= hi) {
      size_t n = (hi - a) / 8;
      memset(al->init_bits + i / 8, 0xFF, n);
      a += n * 8;
    } else {
      al->init_bits[i / 8] |= (uint8_t)(1u << (i & 7));
      a++;
    }
  }
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

namespace gl_sim_rt {
void install_handler(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &old_segv);
}

/* A library initialised after us (MPI) may have installed its own handler:
   take SIGSEGV back, keeping theirs as the one to fall back to. */
void ensure_handler(void) {
  if (!config.hostcheck) return;
  struct sigaction cur;
  if (sigaction(SIGSEGV, nullptr, &cur) != 0) return;
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_segv) return;
  install_handler();
}

/* Closes every page opened by device contexts, after checking the slack of
   allocations opened writable; a damaged slack is reported as an
   out-of-bounds write of `what`. */
void close_opened(const char *what) {
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
}  // namespace gl_sim_rt

/* Device contexts take turns while the stream-order check is on.  Page
   protection is per process, so a page one thread's work item opened would
   let another thread's concurrent first access through unseen, and which
   check fired would depend on the thread schedule.  With turns every item's
   first access of every page faults; stream threads still race for the
   turn, so unordered work still runs in either order.  Without the check
   the items run concurrently. */
static std::mutex device_turn;
static thread_local bool tls_turn = false;  /* this thread holds device_turn */

gl_sim_device_scope::gl_sim_device_scope() {
  if (tls_depth++ == 0 && check_streams()) {
    device_turn.lock();
    tls_turn = true;
  }
}
gl_sim_device_scope::~gl_sim_device_scope() {
  if (--tls_depth == 0) {
    close_opened(tls_item ? tls_item->me.what : nullptr);
    if (tls_turn) {
      tls_turn = false;
      device_turn.unlock();
    }
  }
}

gl_sim_device_scope_pause::gl_sim_device_scope_pause() : held(tls_turn) {
  if (!held) return;
  close_opened(tls_item ? tls_item->me.what : nullptr);  /* accesses after the pause fault again */
  tls_turn = false;
  device_turn.unlock();
}
gl_sim_device_scope_pause::~gl_sim_device_scope_pause() {
  if (!held) return;
  device_turn.lock();
  tls_turn = true;
}

gl_sim_untracked_scope::gl_sim_untracked_scope() { tls_untracked++; }
gl_sim_untracked_scope::~gl_sim_untracked_scope() {
  /* close what was opened unrecorded, so the work item's own later accesses fault and are seen */
  if (--tls_untracked == 0 && check_streams()) close_opened(tls_item ? tls_item->me.what : nullptr);
}

/* ---- device memory ------------------------------------------------------------ */
extern "C" cudaError_t cudaMalloc(void **dev_ptr, size_t size) {
  Runtime &R = rt();
  RETURN_IF_STICKY();
  if (!dev_ptr) return api_error(cudaErrorInvalidValue, "cudaMalloc: devPtr is NULL");
  if (config.devices == 0) return api_error(cudaErrorNoDevice, "cudaMalloc: no simulated device");
  cudaError_t ce = capture_unsafe_call("cudaMalloc", false);
  if (ce != cudaSuccess) return ce;
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
  /* initcheck needs the host checks' faults to see the writes kernels do not make */
  if (config.hostcheck && (config.checks & GL_SIM_CHECK_INIT)) {
    al->init_bits = (uint8_t *)calloc((size + 7) / 8, 1);
    if (!al->init_bits) { say_raw("out of host memory for an allocation's initcheck bits"); abort(); }
  }
  memset((void *)al->data_begin, 0xFF, data_len);
  mprotect(m, PAGE, PROT_NONE);
  mprotect((void *)al->data_end, PAGE, PROT_NONE);
  /* guard pages flagged apart from the data pages never merge with them
     into one kernel mapping: opening and closing the whole block (the
     host checks do it at every work item, race mode several times per
     launch) then changes protections without splitting and re-merging */
  madvise(m, PAGE, MADV_DONTDUMP);
  madvise((void *)al->data_end, PAGE, MADV_DONTDUMP);
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
  cudaError_t ce = capture_unsafe_call("cudaFree", false);
  if (ce != cudaSuccess) return ce;
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
  host_wait_device("cudaFree", dev);
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
  free(al->init_bits);
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
  cudaError_t ce = capture_unsafe_call("cudaHostAlloc", false);
  if (ce != cudaSuccess) return ce;
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
  cudaError_t ce = capture_unsafe_call("cudaFreeHost", false);
  if (ce != cudaSuccess) return ce;
  {
    std::lock_guard<std::mutex> g(R.pinned_mu);
    if (!R.pinned.count((uintptr_t)host_ptr))
      return api_error(cudaErrorInvalidValue, "cudaFreeHost: %p is not a block of cudaHostAlloc/cudaMallocHost", host_ptr);
  }
  host_wait_device("cudaFreeHost", -1);  /* queued copies may still read or write it */
  {
    std::lock_guard<std::mutex> g(R.pinned_mu);
    R.pinned.erase((uintptr_t)host_ptr);
  }
  free(host_ptr);
  return cudaSuccess;
}

/* ---- what a pointer is ---------------------------------------------------------- */
namespace gl_sim_rt {
PtrInfo classify(const void *p, size_t n) {
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
}  // namespace gl_sim_rt

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
