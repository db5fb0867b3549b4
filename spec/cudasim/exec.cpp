/* exec.cpp — the CUDA simulator's execution core: runs a kernel launch on
 * the CPU.  This file takes a launch from its checks to its end; how the
 * threads of one block run (fibers, scheduler, barriers, warp collectives)
 * is exec_block.cpp; what the two share is exec_internal.h.
 *
 *   launch checks   H100 limits (sim_types.h); a bad configuration sets the
 *                   last error and runs nothing, as on a GPU
 *   grid            one work item for the runtime (gl_sim_submit); blocks run
 *                   one after another, one kernel at a time in the process
 *   block           (exec_block.cpp) every simulated thread is a user-level
 *                   fiber that runs until it waits at a barrier or warp
 *                   collective or exits
 *   shared memory   static: an arena with a fixed offset per GL_SHARED slot,
 *                   poisoned (0xFF) when a block first touches the slot;
 *                   dynamic: a buffer right-aligned against a PROT_NONE page,
 *                   poisoned at every block start
 *   race mode       GL_SIM_RACECHECK=1: every grid runs twice, in order and in
 *                   a seeded random thread order from the same starting
 *                   memory, and the two results must be identical
 *   faults          a SIGSEGV on the dynamic buffer's guard pages stops the
 *                   kernel (runtime_memory.cpp's handler passes on faults outside
 *                   device memory); -fsanitize=bounds reports on fixed-size
 *                   arrays (GL_SHARED included) stop it too
 *
 * Errors found while a kernel runs are sticky (gl_sim_fail) and abandon the
 * rest of the grid.  The codes are the ones a GPU reports for the nearest
 * hardware failure:
 *   deadlock (threads wait forever)               cudaErrorLaunchTimeout
 *   barrier divergence, warp collective misuse    cudaErrorIllegalInstruction
 *   out-of-bounds index into a fixed-size array   cudaErrorIllegalAddress
 *   a race (the two orders disagree)              cudaErrorLaunchFailure
 *   static + dynamic shared memory over the limit cudaErrorLaunchOutOfResources
 *     (known only once a block has touched its static slots) */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>
#include "exec_internal.h"

using namespace gl_sim_exec;

/* ---- small helpers ------------------------------------------------------- */
namespace gl_sim_exec __attribute__((visibility("hidden"))) {

[[noreturn]] __attribute__((format(printf, 1, 2))) void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("gptlua cuda-sim: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  abort();
}

char *map_or_die(size_t bytes, const char *what) {
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die("mmap of %zu bytes for %s failed: %s", bytes, what, strerror(errno));
  return (char *)p;
}

/* ---- the launch being run -------------------------------------------------- */
std::mutex g_kernel_mutex; /* one kernel at a time: the arena and L are global */
Launch L;
SimThread g_threads[MAX_THREADS];
uint64_t g_stat_launches, g_stat_blocks, g_stat_switches, g_stat_threads;

/* this host thread is executing simulated device code (on a fiber) */
__thread bool tl_on_fiber;

/* the dynamic shared memory buffer (shared_init, below) */
char *g_dyn_end;   /* the guard page after the dynamic buffer */
char *g_dyn_begin; /* the guard page before it is the one below this */
char *g_static_arena;

}  // namespace gl_sim_exec

namespace {

std::string strip_spaces(const char *s) {
  std::string r;
  for (; *s; s++)
    if (*s != ' ' && *s != '\t' && *s != '\n') r += *s;
  return r;
}

uint64_t g_race_runs;

/* ---- shared memory ------------------------------------------------------- */
size_t g_static_top;
size_t g_page;
std::mutex g_kernel_info_mutex;
std::unordered_map<const void *, size_t> g_kernel_static; /* static shared bytes per kernel, once seen */
std::unordered_set<std::string> g_names;                 /* interned kernel names */
struct sigaction g_segv_at_launch; /* the SIGSEGV handler in force when the running grid started */

void shared_init(void) {
  if (g_static_arena) return;
  g_static_arena = map_or_die(STATIC_ARENA, "the static shared memory arena");
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t body = round_up((size_t)GL_SIM_SMEM_OPTIN, page);
  char *m = map_or_die(page + body + page, "the dynamic shared memory buffer");
  if (mprotect(m, page, PROT_NONE) != 0 || mprotect(m + page + body, page, PROT_NONE) != 0)
    die("mprotect of the dynamic shared memory guard pages failed: %s", strerror(errno));
  g_page = page;
  g_dyn_begin = m + page;
  g_dyn_end = m + page + body;
}

/* ---- running a grid ------------------------------------------------------ */
void run_blocks(bool random) {
  L.random = random;
  L.failed = false;
  L.dyn_ptr = nullptr;
  if (random) L.rng = gl_sim_seed() * 0x100000001b3ull + (++g_race_runs);
  for (unsigned z = 0; z < L.grid.z; z++)
    for (unsigned y = 0; y < L.grid.y; y++)
      for (unsigned x = 0; x < L.grid.x; x++) {
        L.block_ctx.block_idx = uint3{x, y, z};
        run_block();
        if (L.failed) return;
      }
}

struct Snapshot {
  char *base;
  size_t size;
  std::vector<char> bytes;
  bool same; /* in_order only: the in-order run left this block as it was (bytes unused) */
};

/* Copies every allocation into s, reusing s's buffers (the allocations are
   mostly the same from launch to launch).  With before given, a block that
   still equals its copy there is only marked same, not copied. */
void snapshot_device(std::vector<Snapshot> &s, const std::vector<Snapshot> *before) {
  size_t n = 0;
  gl_sim_for_each_alloc([&](void *base, size_t size) {
    if (n == s.size()) s.emplace_back();
    Snapshot &one = s[n];
    one.base = (char *)base;
    one.size = size;
    const Snapshot *b = before && n < before->size() ? &(*before)[n] : nullptr;
    one.same = b && b->base == one.base && b->size == size && memcmp(one.base, b->bytes.data(), size) == 0;
    if (!one.same) one.bytes.assign((char *)base, (char *)base + size);
    n++;
  });
  s.resize(n);
}

std::vector<Snapshot> g_before, g_in_order; /* run_racecheck's, kept between launches */

/* Race mode: the in-order result must equal the result of a random order
   from the same starting memory.  The snapshots, restores and comparisons
   touch every allocation, which the kernel itself may not: they run in
   untracked scopes, so the runtime's stream-order check does not count
   them as the kernel's accesses.  Most kernels write one or two of the
   live blocks: a block the in-order run left unchanged is neither copied
   nor restored (only read), and the random run's result is compared with
   the block's state before, which is its in-order state. */
void run_racecheck(void) {
  std::vector<Snapshot> &before = g_before, &in_order = g_in_order;
  {
    gl_sim_untracked_scope untracked;
    snapshot_device(before, nullptr);
  }
  run_blocks(false);
  if (L.failed) return;
  {
    gl_sim_untracked_scope untracked;
    snapshot_device(in_order, &before);
    for (size_t i = 0; i < in_order.size(); i++)
      if (!in_order[i].same) {
        const Snapshot *b = nullptr;
        for (const Snapshot &c : before)
          if (c.base == in_order[i].base && c.size == in_order[i].size) { b = &c; break; }
        if (b) memcpy(in_order[i].base, b->bytes.data(), b->size);
      }
  }
  run_blocks(true);
  if (L.failed) return;
  gl_sim_untracked_scope untracked;
  for (size_t i = 0; i < in_order.size(); i++) {
    const Snapshot &s = in_order[i];
    const char *want = s.same ? before[i].bytes.data() : s.bytes.data();
    if (memcmp(s.base, want, s.size) == 0) continue;
    size_t off = 0;
    while (s.base[off] == want[off]) off++;
    unsigned char a = (unsigned char)want[off], b = (unsigned char)s.base[off];
    memcpy(s.base, want, s.size); /* leave the in-order result */
    gl_sim_fail(cudaErrorLaunchFailure,
                "kernel %s: race: device allocation %p (%zu bytes) differs at byte offset %zu between the in-order "
                "run (0x%02x) and a random thread order (0x%02x, GL_SIM_SEED=%llu): threads exchange data without "
                "a barrier between them",
                L.name, (void *)s.base, s.size, off, a, b, (unsigned long long)gl_sim_seed());
    return;
  }
}

struct LaunchDesc {
  const char *name;
  const void *kernel;
  dim3 grid, block;
  size_t dyn_smem, smem_limit;
  std::function<void()> body;
};

void run_grid(const LaunchDesc &d) {
  std::lock_guard<std::mutex> lock(g_kernel_mutex);
  shared_init();
#ifndef GL_SIM_USE_UCONTEXT
  __asm__ __volatile__("stmxcsr %0" : "=m"(g_mxcsr));
  __asm__ __volatile__("fnstcw %0" : "=m"(g_fpucw));
#endif
  sigaction(SIGSEGV, nullptr, &g_segv_at_launch);
  L.name = d.name;
  L.kernel = d.kernel;
  L.grid = d.grid;
  L.block = d.block;
  L.dyn_smem = d.dyn_smem;
  L.smem_limit = d.smem_limit;
  L.body = &d.body;
  L.nthreads = d.block.x * d.block.y * d.block.z;
  L.nwarps = (L.nthreads + 31) / 32;
  L.block_ctx.block_dim = d.block;
  L.block_ctx.grid_dim = d.grid;
  for (unsigned i = 0, bx = d.block.x, by = d.block.y; i < L.nthreads; i++) {
    g_threads[i].linear = i;
    g_threads[i].ctx.thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
  }
  g_stat_launches++;
  L.synccheck = (gl_sim_checks() & GL_SIM_CHECK_SYNC) != 0;
  san_launch_begin();
  if (gl_sim_racecheck()) run_racecheck();
  else run_blocks(false);
  san_launch_end();
  L.body = nullptr;
}

}  // namespace

/* ---- the interface (sim.h, device.h) -------------------------------------- */
const char *gl_sim_where(void) {
  if (!tl_on_fiber) return nullptr;
  return where_now();
}

bool gl_sim_abort_kernel(cudaError_t code, const char *msg) {
  if (!tl_on_fiber) return false;
  gl_sim_fail(code, "%s", msg);
  abandon();
}

void *gl_sim_static_shared(gl_sim_shared_slot *slot, size_t bytes, size_t align) {
  current_thread("GL_SHARED");
  if (slot->bytes == 0) { /* first sight in this process: a fixed place in the arena */
    size_t a = align < 16 ? 16 : align;
    size_t off = round_up(g_static_top, a);
    if (off + bytes > STATIC_ARENA)
      kernel_fail(cudaErrorLaunchOutOfResources, "the simulator's static shared arena (%d bytes) is full",
                  (int)STATIC_ARENA);
    slot->offset = off;
    slot->bytes = bytes;
    g_static_top = off + bytes;
  }
  if (slot->block != L.block_gen) { /* first touch in this block */
    slot->block = L.block_gen;
    memset(g_static_arena + slot->offset, 0xff, slot->bytes);
    san_slot_touched(slot->offset, slot->bytes);
    L.static_used += slot->bytes;
    {
      std::lock_guard<std::mutex> lock(g_kernel_info_mutex);
      size_t &known = g_kernel_static[L.kernel];
      if (L.static_used > known) known = L.static_used;
    }
    if (L.static_used + L.dyn_smem > L.smem_limit)
      kernel_fail(cudaErrorLaunchOutOfResources,
                  "static shared memory %zu bytes + dynamic %zu bytes is more than the %zu bytes a block may use",
                  L.static_used, L.dyn_smem, L.smem_limit);
  }
  return g_static_arena + slot->offset;
}

void *gl_sim_dynamic_shared(size_t align) {
  current_thread("GL_DYNAMIC_SHARED");
  if (align == 0) align = 1;
  if (align > 128 || (align & (align - 1)))
    kernel_fail(cudaErrorIllegalInstruction,
                "GL_DYNAMIC_SHARED alignment %zu: must be a power of two, at most 128", align);
  if (!L.dyn_ptr) L.dyn_ptr = g_dyn_end - round_up(L.dyn_smem, align);
  if ((uintptr_t)L.dyn_ptr % align)
    kernel_fail(cudaErrorIllegalInstruction,
                "GL_DYNAMIC_SHARED alignment %zu differs from the alignment this launch's buffer was placed at", align);
  return L.dyn_ptr;
}

cudaError_t gl_sim_launch(const char *name, const void *kernel, dim3 grid, dim3 block, size_t dyn_smem,
                          cudaStream_t stream, std::function<void()> body) {
  std::string nm = strip_spaces(name ? name : "?");
  if (tl_on_fiber)
    kernel_fail(cudaErrorNotSupported, "kernel %s launched from device code (dynamic parallelism)", nm.c_str());
  const char *kn;
  size_t known_static = 0;
  {
    std::lock_guard<std::mutex> lock(g_kernel_info_mutex);
    kn = g_names.insert(nm).first->c_str();
    auto it = g_kernel_static.find(kernel);
    if (it != g_kernel_static.end()) known_static = it->second;
  }
  if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z) {
    gl_sim_set_last_error(cudaErrorInvalidConfiguration,
                          "kernel %s: grid %s block %s: every dimension must be at least 1", kn, Coord(grid).s,
                          Coord(block).s);
    return cudaErrorInvalidConfiguration;
  }
  if (block.x > GL_SIM_MAX_THREADS_PER_BLOCK || block.y > GL_SIM_MAX_THREADS_PER_BLOCK ||
      block.z > GL_SIM_MAX_BLOCK_Z) {
    gl_sim_set_last_error(cudaErrorInvalidConfiguration, "kernel %s: block %s: block dimensions are at most (%d,%d,%d)",
                          kn, Coord(block).s, GL_SIM_MAX_THREADS_PER_BLOCK, GL_SIM_MAX_THREADS_PER_BLOCK,
                          GL_SIM_MAX_BLOCK_Z);
    return cudaErrorInvalidConfiguration;
  }
  uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
  if (nthreads > GL_SIM_MAX_THREADS_PER_BLOCK) {
    gl_sim_set_last_error(cudaErrorInvalidConfiguration, "kernel %s: block %s has %llu threads, at most %d", kn,
                          Coord(block).s, (unsigned long long)nthreads, GL_SIM_MAX_THREADS_PER_BLOCK);
    return cudaErrorInvalidConfiguration;
  }
  if (grid.x > GL_SIM_MAX_GRID_X || grid.y > GL_SIM_MAX_GRID_Y || grid.z > GL_SIM_MAX_GRID_Z) {
    gl_sim_set_last_error(cudaErrorInvalidConfiguration, "kernel %s: grid %s: grid dimensions are at most (%u,%d,%d)",
                          kn, Coord(grid).s, GL_SIM_MAX_GRID_X, GL_SIM_MAX_GRID_Y, GL_SIM_MAX_GRID_Z);
    return cudaErrorInvalidConfiguration;
  }
  /* dynamic shared memory: at most the kernel's MaxDynamicSharedMemorySize
     (48 KiB unless raised with cudaFuncSetAttribute, at most 227 KiB) */
  int optin = gl_sim_func_smem_optin(kernel);
  size_t dyn_limit = optin > 0 ? (size_t)optin : (size_t)GL_SIM_SMEM_DEFAULT;
  size_t optin_max = (size_t)gl_sim_smem_optin(); /* the GPU pretended's (GL_SIM_ARCH) */
  size_t total_limit = optin > 0 ? optin_max : (size_t)GL_SIM_SMEM_DEFAULT;
  if (dyn_smem > optin_max) {
    gl_sim_set_last_error(cudaErrorInvalidValue, "kernel %s: dynamic shared memory %zu bytes, at most %zu", kn,
                          dyn_smem, optin_max);
    return cudaErrorInvalidValue;
  }
  if (dyn_smem > dyn_limit) {
    if (optin > 0)
      gl_sim_set_last_error(cudaErrorInvalidValue,
                            "kernel %s: dynamic shared memory %zu bytes, more than the %d its "
                            "cudaFuncAttributeMaxDynamicSharedMemorySize allows",
                            kn, dyn_smem, optin);
    else
      gl_sim_set_last_error(cudaErrorInvalidValue,
                            "kernel %s: dynamic shared memory %zu bytes, more than %d without "
                            "cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, %zu)",
                            kn, dyn_smem, GL_SIM_SMEM_DEFAULT, dyn_smem);
    return cudaErrorInvalidValue;
  }
  if (known_static + dyn_smem > total_limit) {
    gl_sim_set_last_error(cudaErrorLaunchOutOfResources,
                          "kernel %s: static shared memory %zu bytes + dynamic %zu bytes, more than %zu", kn,
                          known_static, dyn_smem, total_limit);
    return cudaErrorLaunchOutOfResources;
  }
  LaunchDesc d{kn, kernel, grid, block, dyn_smem, total_limit, std::move(body)};
  std::string what = std::string("kernel ") + kn;
  gl_sim_submit(stream, what.c_str(), [d = std::move(d)]() { run_grid(d); });
  return cudaSuccess;
}

void gl_sim_exec_stats(uint64_t out[4]) {
  std::lock_guard<std::mutex> lock(g_kernel_mutex);
  out[0] = g_stat_launches;
  out[1] = g_stat_blocks;
  out[2] = g_stat_threads;
  out[3] = g_stat_switches;
}

/* ---- faults in the dynamic shared memory guard pages ---------------------- */
/* Installed when the library loads, so runtime_memory.cpp's handler (installed at
   the runtime's first use) finds it as the previous handler and passes it
   every fault outside device memory.  A fault on the guard pages around
   the dynamic shared buffer, inside a kernel, stops the kernel; anything
   else goes on to the handler that was there before this one. */
namespace {
struct sigaction g_prev_segv;

void on_segv(int sig, siginfo_t *si, void *uctx) {
  char *a = (char *)si->si_addr;
  bool guard = g_dyn_end && ((a >= g_dyn_end && a < g_dyn_end + g_page) || (a >= g_dyn_begin - g_page && a < g_dyn_begin));
  if (tl_on_fiber && guard) {
    char msg[512];
    const char *start = L.dyn_ptr ? L.dyn_ptr : g_dyn_end - L.dyn_smem;
    snprintf(msg, sizeof msg,
             "%s: out-of-bounds dynamic shared memory access at %p: byte %ld of the launch's %zu-byte buffer",
             where_now(), (void *)a, (long)(a - start), L.dyn_smem);
    /* runtime_memory.cpp's handler passed this fault on by reinstalling this one:
       put it back, it owns device memory faults */
    if (!((g_segv_at_launch.sa_flags & SA_SIGINFO) && g_segv_at_launch.sa_sigaction == on_segv))
      sigaction(SIGSEGV, &g_segv_at_launch, nullptr);
    gl_sim_abort_kernel(cudaErrorIllegalAddress, msg);
  }
  /* not ours: the previous handler (or the default action) gets the fault
     when the instruction runs again */
  sigaction(SIGSEGV, &g_prev_segv, nullptr);
  (void)sig;
  (void)uctx;
}

__attribute__((constructor)) void install_segv_handler(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_prev_segv);
}
}  // namespace

/* ---- -fsanitize=bounds reports (kernels are compiled with it) ------------ */
/* GCC's bounds check calls these with its source location and the index.
   Defined here, ahead of libubsan in the lookup order, so that an index out
   of a GL_SHARED array (or any fixed-size array) inside a kernel stops the
   kernel with a message naming the kernel, block and thread; outside a
   kernel it is printed and, for the non-recoverable form, aborts. */
namespace {
struct UbsanLocation {
  const char *file;
  uint32_t line, column;
};
struct UbsanType {
  uint16_t kind, info;
  char name[1];
};
struct UbsanOutOfBounds {
  UbsanLocation loc;
  const UbsanType *array_type, *index_type;
};

void report_out_of_bounds(void *data, void *index, bool fatal) {
  const UbsanOutOfBounds *d = (const UbsanOutOfBounds *)data;
  char idx[32];
  const UbsanType *it = d->index_type;
  unsigned bits = 1u << (it->info >> 1);
  uint64_t raw = (uint64_t)(uintptr_t)index;
  if (it->kind == 0 && bits <= 64) {
    if ((it->info & 1) && bits < 64 && (raw >> (bits - 1) & 1)) raw |= ~0ull << bits;
    if (it->info & 1) snprintf(idx, sizeof idx, "%lld", (long long)raw);
    else snprintf(idx, sizeof idx, "%llu", (unsigned long long)raw);
  } else {
    snprintf(idx, sizeof idx, "(a %s)", it->name);
  }
  if (tl_on_fiber)
    kernel_fail(cudaErrorIllegalAddress, "index %s out of bounds for type %s at %s:%u:%u", idx, d->array_type->name,
                d->loc.file, d->loc.line, d->loc.column);
  fprintf(stderr, "gptlua cuda-sim: index %s out of bounds for type %s at %s:%u:%u\n", idx, d->array_type->name,
          d->loc.file, d->loc.line, d->loc.column);
  if (fatal) abort();
}
}  // namespace

extern "C" void __ubsan_handle_out_of_bounds(void *data, void *index) { report_out_of_bounds(data, index, false); }
extern "C" void __ubsan_handle_out_of_bounds_abort(void *data, void *index) {
  report_out_of_bounds(data, index, true);
}
