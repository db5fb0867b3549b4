/* sanitize.cpp — the CUDA simulator's sanitizer: what NVIDIA's
 * compute-sanitizer reports about a kernel's memory accesses, found while
 * the kernel runs.  kernels/NAME.cu (and the simulator's test kernels) are
 * compiled with GCC's thread-sanitizer instrumentation, used here only as
 * instrumentation (no runtime library of GCC's is linked): every load and
 * store a kernel makes calls one of the __tsan_{read,write}N hooks below
 * with its address, and the hook's return address says which line of
 * source made it.  (GCC's address-sanitizer instrumentation would not do:
 * it checks an address once per basic block whether loaded or stored, so
 * the store of `s[t] += x` never reaches a hook and a race on it is missed.)
 *
 *   memcheck   a global access outside the bytes cudaMalloc returned (the
 *              slack inside the allocation's pages: past the last page the
 *              guard page faults, runtime_memory.cpp), a shared access
 *              outside every GL_SHARED array this block has touched or
 *              outside the launch's dynamic buffer, and a global or shared
 *              access of 2, 4, 8 or 16 bytes at an address not a multiple
 *              of its size (a GPU requires natural alignment), whatever
 *              value is moved
 *   initcheck  a read of global memory no one wrote since cudaMalloc (a
 *              kernel's stores set a bit per byte; every other writer opens
 *              pages through runtime_memory.cpp's fault handler, which
 *              counts each page it opens for writing as written whole) and
 *              a read of shared memory no thread of the block wrote
 *   racecheck  shared-memory hazards: two threads touch the same byte
 *              between two barriers and one of them writes (read-after-
 *              write, write-after-read, write-after-write), unless both are
 *              lanes of one warp and a warp collective (__syncwarp, a
 *              shuffle, a vote, a WMMA op) of that warp completed between
 *              the two.  Found from the accesses themselves, so the thread
 *              order (in order, or race mode's random one) does not matter.
 *              Atomics (device.h) are exempt: they are neither racing
 *              readers nor writers
 *   synccheck  (exec_block.cpp) barriers by source line; a barrier some
 *              live thread of the block never reaches because it exited;
 *              warp collectives whose masks name absent, exited or
 *              disagreeing lanes
 *
 * Each report names the class, kernel, block, thread, the access and the
 * source line ("file:line", through addr2line on the instrumented object),
 * and stops the grid with a sticky error: cudaErrorIllegalAddress (out of
 * bounds), cudaErrorMisalignedAddress, cudaErrorLaunchFailure (initcheck,
 * racecheck).  GL_SIM_CHECKS (sim.h) turns classes off.
 *
 * Cost: one call and a few compares per access; the account flavour
 * (account.cpp) counts its bytes through the same hooks. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>
#include "exec_internal.h"

using namespace gl_sim_exec;

/* device.h: nonzero while an atomic runs its read-modify-write */
int gl_sim_in_atomic;

namespace {

/* ---- shared memory: one record per byte -------------------------------------- */
enum : uint8_t { S_INIT = 1, S_MULTI = 2, S_CROSS_WARP = 4 };
enum : uint16_t { NOBODY = 0xFFFF };
struct SharedRec {
  uint32_t gen;    /* the block (low bits of L.block_gen) this record belongs to; else stale */
  uint32_t epoch;  /* the barrier interval of the accesses below */
  uint32_t wsync;  /* the writer's warp's collective count at the write */
  uint32_t rsync;  /* the last reader's warp's collective count at the read */
  uint16_t writer, reader; /* thread indices in the block (reader: the first) */
  uint8_t flags;
};

SharedRec *g_static_rec, *g_dyn_rec; /* indexed like the static arena and the dynamic buffer */
uint32_t g_epoch;                    /* barrier intervals, across blocks */
uint32_t g_wsync[MAX_WARPS];         /* warp collectives completed, per warp */
std::vector<std::pair<size_t, size_t>> g_slots; /* GL_SHARED arrays (offset, bytes) this block touched */

/* ---- the launch ------------------------------------------------------------------ */
unsigned g_checks;          /* GL_SIM_CHECKS while a grid runs on the grid's thread; 0 otherwise */
void *g_grid_thread;        /* that thread's thread pointer (cheaper than pthread_self, the same per thread) */

/* device allocations by page: a direct-mapped cache of the runtime's table,
   emptied at every launch (allocations come and go between launches) */
enum { PAGE_SHIFT = 12, PAGE_CACHE = 1024 };
/* tags apart from the views: an access to host memory (a thread's
   threadIdx, its stack) reads only the small tag array */
uintptr_t g_page_tag[PAGE_CACHE];       /* page << 1 | (1 if device memory) */
gl_sim_alloc_view g_page_view[PAGE_CACHE];

/* "file:line" of the instruction before pc (the call of a hook), through
   addr2line on the object holding it: only when a report is made */
std::string source_line(const void *pc) {
  Dl_info di;
  if (!pc || !dladdr(pc, &di) || !di.dli_fname) return "an unknown source line";
  uintptr_t off = (uintptr_t)pc - 1 - (uintptr_t)di.dli_fbase;
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "addr2line -i -e '%s' 0x%lx 2>/dev/null", di.dli_fname, (unsigned long)off);
  FILE *f = popen(cmd, "r");
  if (!f) return "an unknown source line";
  std::vector<std::string> lines;
  char buf[1024];
  while (fgets(buf, sizeof buf, f)) {
    std::string s = buf;
    size_t cut = s.find_first_of(" \n");
    if (cut != std::string::npos) s.resize(cut);
    if (!s.empty()) lines.push_back(s);
  }
  pclose(f);
  if (lines.empty() || lines[0].find("??") == 0) return "an unknown source line";
  /* innermost first; name the kernel's own line too when a helper was inlined */
  std::string r = lines[0];
  if (lines.size() > 1 && lines.back() != lines[0]) r += " (inlined into " + lines.back() + ")";
  return r;
}

[[noreturn]] __attribute__((format(printf, 3, 4))) void report(cudaError_t code, const void *pc, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  g_checks = 0; /* no second report from the rest of this thread's accesses */
  kernel_fail(code, "%s, at %s", msg, source_line(pc).c_str());
}

const char *rw(bool write) { return write ? "write" : "read"; }

/* ---- shared memory ----------------------------------------------------------------- */
bool warp_synced(unsigned a, uint32_t a_sync, unsigned b) {
  return (a >> 5) == (b >> 5) && g_wsync[b >> 5] != a_sync;
}

void shared_access(SharedRec *rec, const char *what, size_t byte_of, size_t size_of, uintptr_t a, size_t n,
                   bool write, const void *pc) {
  unsigned t = L.cur->linear, warp = t >> 5;
  uint32_t gen = (uint32_t)L.block_gen;
  bool atomic = gl_sim_in_atomic != 0;
  for (size_t k = 0; k < n; k++) {
    SharedRec &r = rec[k];
    if (r.gen != gen) r = SharedRec{gen, 0, 0, 0, NOBODY, NOBODY, 0};
    if (!write && !(r.flags & S_INIT) && (g_checks & GL_SIM_CHECK_INIT))
      report(cudaErrorLaunchFailure, pc,
             "initcheck: %s of %zu bytes of uninitialized shared memory at 0x%lx: byte %zu of a %zu-byte %s, which "
             "no thread of this block has written",
             atomic ? "atomic" : "read", n, (unsigned long)a, byte_of + k, size_of, what);
    if (atomic) { /* neither a racing reader nor writer */
      r.flags |= S_INIT;
      continue;
    }
    if (g_checks & GL_SIM_CHECK_RACE) {
      if (r.epoch != g_epoch) {
        r.epoch = g_epoch;
        r.writer = r.reader = NOBODY;
        r.flags &= S_INIT;
      }
      if (r.writer != NOBODY && r.writer != t && !warp_synced(r.writer, r.wsync, t))
        report(cudaErrorLaunchFailure, pc,
               "racecheck: %s-after-write hazard on shared memory at 0x%lx (byte %zu of a %zu-byte %s): thread %s "
               "wrote it since the last barrier, with no __syncthreads (or, within a warp, __syncwarp) between",
               write ? "write" : "read", (unsigned long)a, byte_of + k, size_of, what,
               Coord(g_threads[r.writer].ctx.thread_idx).s);
      if (write && r.reader != NOBODY) {
        bool others = (r.flags & S_MULTI) || r.reader != t;
        bool synced = !(r.flags & S_CROSS_WARP) && warp_synced(r.reader, r.rsync, t);
        if (others && !synced)
          report(cudaErrorLaunchFailure, pc,
                 "racecheck: write-after-read hazard on shared memory at 0x%lx (byte %zu of a %zu-byte %s): thread "
                 "%s read it since the last barrier, with no __syncthreads (or, within a warp, __syncwarp) between",
                 (unsigned long)a, byte_of + k, size_of, what,
                 Coord(g_threads[r.reader != t ? r.reader : 0].ctx.thread_idx).s);
      }
      if (write) {
        r.writer = (uint16_t)t;
        r.wsync = g_wsync[warp];
      } else {
        if (r.reader == NOBODY) r.reader = (uint16_t)t;
        else if (r.reader != t) {
          r.flags |= S_MULTI;
          if ((r.reader >> 5) != warp) r.flags |= S_CROSS_WARP;
        }
        r.rsync = g_wsync[warp];
      }
    }
    if (write) r.flags |= S_INIT;
  }
}

void check_static_shared(uintptr_t a, size_t n, bool write, const void *pc) {
  size_t off = a - (uintptr_t)g_static_arena;
  SharedRec *rec = g_static_rec + off;
  uint32_t gen = (uint32_t)L.block_gen;
  for (size_t k = 0; k < n; k++)
    if (rec[k].gen != gen) { /* first touch of this byte in this block: inside an array the block has? */
      bool inside = false;
      for (const auto &s : g_slots)
        if (off + k >= s.first && off + k < s.first + s.second) { inside = true; break; }
      if (!inside) {
        if (!(g_checks & GL_SIM_CHECK_MEM)) return;
        report(cudaErrorIllegalAddress, pc,
               "memcheck: out-of-bounds shared %s of %zu bytes at 0x%lx: outside every GL_SHARED array of this block",
               rw(write), n, (unsigned long)a);
      }
    }
  size_t slot_off = 0, slot_bytes = 0;
  for (const auto &s : g_slots)
    if (off >= s.first && off < s.first + s.second) { slot_off = s.first; slot_bytes = s.second; break; }
  shared_access(rec, "GL_SHARED array", off - slot_off, slot_bytes, a, n, write, pc);
}

void check_dynamic_shared(uintptr_t a, size_t n, bool write, const void *pc) {
  uintptr_t lo = (uintptr_t)L.dyn_ptr, hi = lo + L.dyn_smem;
  if (!L.dyn_ptr || a < lo || a + n > hi) {
    if (!(g_checks & GL_SIM_CHECK_MEM)) return;
    if (L.dyn_ptr)
      report(cudaErrorIllegalAddress, pc,
             "memcheck: out-of-bounds shared %s of %zu bytes at 0x%lx: byte %ld of the launch's %zu-byte dynamic "
             "shared buffer",
             rw(write), n, (unsigned long)a, (long)(a - lo), L.dyn_smem);
    report(cudaErrorIllegalAddress, pc,
           "memcheck: out-of-bounds shared %s of %zu bytes at 0x%lx: this launch has %zu bytes of dynamic shared memory",
           rw(write), n, (unsigned long)a, L.dyn_smem);
  }
  shared_access(g_dyn_rec + (a - (uintptr_t)g_dyn_begin), "dynamic shared buffer", a - lo, L.dyn_smem, a, n, write,
                pc);
}

/* ---- global memory --------------------------------------------------------------- */
const gl_sim_alloc_view *device_view(uintptr_t a) {
  uintptr_t page = a >> PAGE_SHIFT;
  size_t slot = page & (PAGE_CACHE - 1);
  uintptr_t tag = g_page_tag[slot];
  if ((tag >> 1) != page) {
    tag = page << 1 | (gl_sim_alloc_view_of(a, &g_page_view[slot]) ? 1 : 0);
    g_page_tag[slot] = tag;
  }
  return (tag & 1) ? &g_page_view[slot] : nullptr;
}

void check_global(const gl_sim_alloc_view *v, uintptr_t a, size_t n, bool write, const void *pc) {
  if (a < v->begin || a + n > v->end) {
    if (!(g_checks & GL_SIM_CHECK_MEM)) return;
    if (a + n > v->end)
      report(cudaErrorIllegalAddress, pc,
             "memcheck: out-of-bounds global %s of %zu bytes at 0x%lx: %ld bytes past the end of a %lu-byte "
             "allocation",
             rw(write), n, (unsigned long)a, (long)(a >= v->end ? a - v->end : 0), (unsigned long)(v->end - v->begin));
    report(cudaErrorIllegalAddress, pc,
           "memcheck: out-of-bounds global %s of %zu bytes at 0x%lx: %lu bytes before the start of a %lu-byte "
           "allocation",
           rw(write), n, (unsigned long)a, (unsigned long)(v->begin - a), (unsigned long)(v->end - v->begin));
  }
  uint8_t *bits = v->written;
  if (!bits || !(g_checks & GL_SIM_CHECK_INIT)) return;
  size_t i = a - v->begin;
  if ((i & 7) + n <= 8) { /* the usual case: all n bits in one byte of the bitmap */
    uint8_t mask = (uint8_t)(((1u << n) - 1) << (i & 7));
    if (write) {
      bits[i >> 3] |= mask;
      return;
    }
    if ((bits[i >> 3] & mask) == mask) return; /* written (an atomic's store changes nothing here) */
  }
  for (size_t k = 0; k < n; k++, i++) {
    uint8_t bit = (uint8_t)(1u << (i & 7));
    if (write) bits[i >> 3] |= bit;
    else if (!(bits[i >> 3] & bit))
      report(cudaErrorLaunchFailure, pc,
             "initcheck: %s of %zu bytes of uninitialized global memory at 0x%lx: byte %zu of a %lu-byte allocation "
             "that nothing has written since cudaMalloc",
             gl_sim_in_atomic ? "atomic" : "read", n, (unsigned long)a, i, (unsigned long)(v->end - v->begin));
  }
  if (gl_sim_in_atomic && !write) /* the atomic's store follows: count it written now (its read was checked) */
    for (size_t k = 0, j = a - v->begin; k < n; k++, j++) bits[j >> 3] |= (uint8_t)(1u << (j & 7));
}

__attribute__((always_inline)) inline void access(uintptr_t a, size_t n, bool write, const void *pc) {
  if (gl_sim_account_counting) gl_sim_account_touch(a, n, write);
  if (!g_checks || !L.cur || n == 0 || __builtin_thread_pointer() != g_grid_thread) return;
  bool in_static = a - (uintptr_t)g_static_arena < (uintptr_t)STATIC_ARENA;
  bool in_dynamic = a - (uintptr_t)g_dyn_begin < (uintptr_t)(g_dyn_end - g_dyn_begin);
  const gl_sim_alloc_view *v = in_static || in_dynamic ? nullptr : device_view(a);
  if (!in_static && !in_dynamic && !v) return; /* the thread's own stack, or host memory */
  if ((g_checks & GL_SIM_CHECK_MEM) && (n & (n - 1)) == 0 && n <= 16 && (a & (n - 1)))
    report(cudaErrorMisalignedAddress, pc, "memcheck: misaligned %s %s of %zu bytes at 0x%lx (not a multiple of %zu)",
           v ? "global" : "shared", rw(write), n, (unsigned long)a, n);
  if (in_static) check_static_shared(a, n, write, pc);
  else if (in_dynamic) check_dynamic_shared(a, n, write, pc);
  else check_global(v, a, n, write, pc);
}

}  // namespace

/* ---- what exec.cpp and exec_block.cpp tell the sanitizer ------------------------ */
namespace gl_sim_exec __attribute__((visibility("hidden"))) {
void san_launch_begin(void) {
  g_checks = gl_sim_checks() & (GL_SIM_CHECK_MEM | GL_SIM_CHECK_INIT | GL_SIM_CHECK_RACE);
  g_grid_thread = __builtin_thread_pointer();
  for (uintptr_t &t : g_page_tag) t = ~(uintptr_t)0; /* no page's tag */
  if (g_checks && !g_static_rec) {
    g_static_rec = (SharedRec *)map_or_die((size_t)STATIC_ARENA * sizeof(SharedRec), "the sanitizer's shared records");
    g_dyn_rec = (SharedRec *)map_or_die((size_t)(g_dyn_end - g_dyn_begin) * sizeof(SharedRec),
                                        "the sanitizer's dynamic shared records");
  }
}
void san_launch_end(void) { g_checks = 0; }
void san_block_begin(void) {
  g_epoch++;
  g_slots.clear();
}
void san_slot_touched(size_t offset, size_t bytes) { g_slots.emplace_back(offset, bytes); }
void san_barrier_released(void) { g_epoch++; }
void san_warp_synced(unsigned warp) { g_wsync[warp]++; }
}  // namespace gl_sim_exec

/* ---- the instrumentation's hooks --------------------------------------------------- */
/* -fsanitize=thread calls __tsan_readN / __tsan_writeN before each access
   of N bytes (the unaligned_ variants where the type's alignment is below
   N; the address itself is checked above) and the _range ones for other
   sizes.  Function entry and exit are not instrumented (Makefile's
   --param tsan-instrument-func-entry-exit=0). */
/* exported for the test kernels' libraries, bound directly (no PLT) from
   the kernels inside libgptlua.so */
#define GL_SIM_HOOK __attribute__((visibility("protected")))
#define GL_SIM_SANITIZE_HOOKS(n)                                                                                  \
  extern "C" GL_SIM_HOOK void __tsan_read##n(void *a) { access((uintptr_t)a, n, false, __builtin_return_address(0)); }           \
  extern "C" GL_SIM_HOOK void __tsan_write##n(void *a) { access((uintptr_t)a, n, true, __builtin_return_address(0)); }           \
  extern "C" GL_SIM_HOOK void __tsan_unaligned_read##n(void *a) { access((uintptr_t)a, n, false, __builtin_return_address(0)); } \
  extern "C" GL_SIM_HOOK void __tsan_unaligned_write##n(void *a) { access((uintptr_t)a, n, true, __builtin_return_address(0)); }
GL_SIM_SANITIZE_HOOKS(1)
GL_SIM_SANITIZE_HOOKS(2)
GL_SIM_SANITIZE_HOOKS(4)
GL_SIM_SANITIZE_HOOKS(8)
GL_SIM_SANITIZE_HOOKS(16)
#undef GL_SIM_SANITIZE_HOOKS
extern "C" void __tsan_read_range(void *a, size_t n) { access((uintptr_t)a, n, false, __builtin_return_address(0)); }
extern "C" void __tsan_write_range(void *a, size_t n) { access((uintptr_t)a, n, true, __builtin_return_address(0)); }
/* the rest of what the instrumentation calls: nothing to check */
extern "C" void __tsan_init(void) {}
extern "C" void __tsan_func_entry(void *) {}
extern "C" void __tsan_func_exit(void) {}
extern "C" void __tsan_vptr_update(void **, void *) {}
extern "C" void __tsan_vptr_read(void **) {}
/* atomics in what the kernels' files compile from the C++ library (the
   guards of function-local statics, shared_ptr's counts) become calls of
   these: done here as the builtins they stand for, sequentially consistent
   whatever order was asked (never weaker than asked) */
#define GL_SIM_TSAN_ATOMICS(bits)                                                                                  \
  typedef uint##bits##_t a##bits;                                                                                \
  extern "C" a##bits __tsan_atomic##bits##_load(const volatile a##bits *a, int) {                                \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                                 \
  }                                                                                                              \
  extern "C" void __tsan_atomic##bits##_store(volatile a##bits *a, a##bits v, int) {                             \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                                    \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_exchange(volatile a##bits *a, a##bits v, int) {                       \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                                          \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_fetch_add(volatile a##bits *a, a##bits v, int) {                      \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                                           \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_fetch_sub(volatile a##bits *a, a##bits v, int) {                      \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                                           \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_fetch_and(volatile a##bits *a, a##bits v, int) {                      \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                                           \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_fetch_or(volatile a##bits *a, a##bits v, int) {                       \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                                            \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_fetch_xor(volatile a##bits *a, a##bits v, int) {                      \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                                           \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_fetch_nand(volatile a##bits *a, a##bits v, int) {                     \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                                          \
  }                                                                                                              \
  extern "C" int __tsan_atomic##bits##_compare_exchange_strong(volatile a##bits *a, a##bits *c, a##bits v, int,  \
                                                               int) {                                            \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                      \
  }                                                                                                              \
  extern "C" int __tsan_atomic##bits##_compare_exchange_weak(volatile a##bits *a, a##bits *c, a##bits v, int,    \
                                                             int) {                                              \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                       \
  }                                                                                                              \
  extern "C" a##bits __tsan_atomic##bits##_compare_exchange_val(volatile a##bits *a, a##bits c, a##bits v, int,  \
                                                                int) {                                           \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                            \
    return c;                                                                                                    \
  }
GL_SIM_TSAN_ATOMICS(8)
GL_SIM_TSAN_ATOMICS(16)
GL_SIM_TSAN_ATOMICS(32)
GL_SIM_TSAN_ATOMICS(64)
#undef GL_SIM_TSAN_ATOMICS
extern "C" void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
extern "C" void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
