/* exec.cpp — the CUDA simulator's execution core: runs a kernel launch on
 * the CPU.
 *
 *   launch checks   H100 limits (sim_types.h); a bad configuration sets the
 *                   last error and runs nothing, as on a GPU
 *   grid            one work item for the runtime (gl_sim_submit); blocks run
 *                   one after another, one kernel at a time in the process
 *   block           every simulated thread is a user-level fiber; a thread
 *                   runs until it waits at a barrier or warp collective or
 *                   exits, then the scheduler picks the next ready thread.
 *                   The switch is a few instructions (no system call), and a
 *                   thread that exits hands its fiber straight to the next
 *                   unstarted thread, so a block without barriers costs no
 *                   switch at all
 *   barriers        sm_70+ rules as compute-sanitizer's synccheck sees them:
 *                   exited threads are excused, live threads waiting at
 *                   different __syncthreads = barrier divergence, nothing
 *                   ready while threads wait = deadlock
 *   warp collectives every lane named in the mask must arrive at the same
 *                   collective with the same mask; shuffles follow PTX
 *                   shfl.sync
 *   shared memory   static: an arena with a fixed offset per GL_SHARED slot,
 *                   poisoned (0xFF) when a block first touches the slot;
 *                   dynamic: a buffer right-aligned against a PROT_NONE page,
 *                   poisoned at every block start
 *   race mode       GL_SIM_RACECHECK=1: every grid runs twice, in order and in
 *                   a seeded random thread order from the same starting
 *                   memory, and the two results must be identical
 *   order           in order: threads released from a barrier or collective
 *                   (first released first), then unstarted ones by index;
 *                   random: any ready or unstarted thread, drawn afresh at
 *                   every scheduling point
 *   faults          a SIGSEGV on the dynamic buffer's guard pages stops the
 *                   kernel (runtime.cpp's handler passes on faults outside
 *                   device memory); -fsanitize=bounds reports on fixed-size
 *                   arrays (GL_SHARED included) stop it too
 *   portability     x86-64 gets the hand-written switch; elsewhere (or with
 *                   -DGL_SIM_UCONTEXT) ucontext, about 7x slower
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
#include "sim_types.h"
#include "sim.h"
#include "device.h"

#if !defined(__x86_64__) || defined(GL_SIM_UCONTEXT)
#define GL_SIM_USE_UCONTEXT 1
#include <ucontext.h>
#endif

const gl_sim_thread_ctx *gl_sim_self = nullptr;
const gl_sim_block_ctx *gl_sim_block = nullptr;

namespace {

/* ---- small helpers ------------------------------------------------------- */
[[noreturn]] __attribute__((format(printf, 1, 2))) void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("gptlua cuda-sim: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  abort();
}

struct Coord {  /* "(x,y,z)" for messages */
  char s[48];
  Coord(unsigned x, unsigned y, unsigned z) { snprintf(s, sizeof s, "(%u,%u,%u)", x, y, z); }
  Coord(uint3 v) : Coord(v.x, v.y, v.z) {}
  Coord(dim3 v) : Coord(v.x, v.y, v.z) {}
};

/* "file:line", or "unknown call site" */
struct Site {
  char s[256];
  Site(const char *file, int line) {
    if (file) snprintf(s, sizeof s, "%s:%d", file, line);
    else snprintf(s, sizeof s, "unknown call site");
  }
};

std::string strip_spaces(const char *s) {
  std::string r;
  for (; *s; s++)
    if (*s != ' ' && *s != '\t' && *s != '\n') r += *s;
  return r;
}

/* splitmix64: the random thread orders of the race mode */
uint64_t next_random(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* ---- fiber contexts -------------------------------------------------------- */
#ifdef GL_SIM_USE_UCONTEXT
struct Context {
  ucontext_t uc;
};
#else
struct Context {
  void *sp;  /* everything else is on the stack it points to */
};
#endif

}  // namespace

extern "C" {
/* the fibers' body (below); never returns */
__attribute__((visibility("hidden"))) void gl_sim_fiber_main(void);
#ifndef GL_SIM_USE_UCONTEXT
/* Saves the callee-saved registers and the SSE / x87 control words on the
   current stack, stores the stack pointer in *save_sp, loads load_sp and
   restores the same set from there.  No system call: a switch costs a few
   nanoseconds. */
__attribute__((visibility("hidden"))) void gl_sim_ctx_switch(void **save_sp, void *load_sp);
/* where a fresh fiber's first switch "returns" to */
__attribute__((visibility("hidden"))) void gl_sim_fiber_start(void);
#endif
}

#ifndef GL_SIM_USE_UCONTEXT
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl gl_sim_ctx_switch\n"
    ".hidden gl_sim_ctx_switch\n"
    ".type gl_sim_ctx_switch,@function\n"
    "gl_sim_ctx_switch:\n"
    "  .cfi_startproc\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    "  .cfi_endproc\n"
    ".size gl_sim_ctx_switch, .-gl_sim_ctx_switch\n"
    ".p2align 4\n"
    ".globl gl_sim_fiber_start\n"
    ".hidden gl_sim_fiber_start\n"
    ".type gl_sim_fiber_start,@function\n"
    "gl_sim_fiber_start:\n"
    "  .cfi_startproc\n"
    "  .cfi_undefined rip\n" /* the bottom of a fiber's call chain, for debuggers */
    "  call gl_sim_fiber_main\n"
    "  ud2\n"
    "  .cfi_endproc\n"
    ".size gl_sim_fiber_start, .-gl_sim_fiber_start\n");
#endif

namespace {

#ifdef GL_SIM_USE_UCONTEXT
void ctx_prepare(Context *c, char *stack, size_t size, uint32_t, uint16_t) {
  if (getcontext(&c->uc) != 0) die("getcontext failed: %s", strerror(errno));
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, gl_sim_fiber_main, 0);
}
inline void ctx_switch(Context *from, Context *to) { swapcontext(&from->uc, &to->uc); }
#else
/* The frame gl_sim_ctx_switch pops, built so that its `ret` enters
   gl_sim_fiber_start with the stack 16-byte aligned (the ABI's state just
   before a call). */
void ctx_prepare(Context *c, char *stack, size_t size, uint32_t mxcsr, uint16_t fpucw) {
  uintptr_t top = ((uintptr_t)stack + size) & ~(uintptr_t)15;
  uint64_t *sp = (uint64_t *)(top - 80);
  sp[0] = (uint64_t)mxcsr | ((uint64_t)fpucw << 32);
  for (int i = 1; i <= 6; i++) sp[i] = 0; /* r15 r14 r13 r12 rbx rbp */
  sp[7] = (uint64_t)(uintptr_t)gl_sim_fiber_start;
  sp[8] = sp[9] = 0;
  c->sp = sp;
}
inline void ctx_switch(Context *from, Context *to) { gl_sim_ctx_switch(&from->sp, to->sp); }
#endif

/* ---- simulated threads, warps, fibers ------------------------------------ */
enum ThreadState : uint8_t { T_UNSTARTED, T_READY, T_RUNNING, T_BARRIER, T_WARP, T_EXITED };

struct Fiber;

struct SimThread {
  gl_sim_thread_ctx ctx; /* what threadIdx reads (set once per launch) */
  unsigned linear;       /* index in the block, x fastest */
  uint8_t state;
  Fiber *fiber;          /* while started and not exited */
  /* where it waits, for the deadlock message */
  const char *wait_op, *wait_file;
  int wait_line;
  unsigned wait_mask;
};

enum { STACK_SIZE = 256 * 1024, MAX_THREADS = GL_SIM_MAX_THREADS_PER_BLOCK, MAX_WARPS = MAX_THREADS / 32 };

struct Fiber {
  Context ctx;
  char *stack; /* usable part, above the guard page */
  size_t size;
  /* The stacks are mmap'd at a page-multiple stride, so their tops would
     all fall in the same L1 cache sets: each starts this much lower
     (a multiple of 64 below 4 KiB), about 10% faster switching. */
  size_t color;
};

typedef void (*LeaderFn)(void *ctx, void **lanes, unsigned mask);

/* a warp collective some lanes of `mask` have reached */
struct Rendezvous {
  unsigned mask, arrived;
  const char *op;
  uint64_t key;
  const char *file;
  int line;
  unsigned first_lane;
  void *mine[32];
};

struct Warp {
  unsigned exists; /* lanes the block has */
  unsigned exited;
  int nopen;
  Rendezvous open[32]; /* at most one per lane */
};

/* the launch being run (one at a time: g_kernel_mutex) */
struct Launch {
  const char *name; /* interned "NAME" */
  const void *kernel;
  dim3 grid, block;
  size_t dyn_smem, smem_limit;
  const std::function<void()> *body;
  unsigned nthreads, nwarps;
  bool failed;
  /* scheduling order */
  bool random;
  uint64_t rng;
  /* the current block */
  gl_sim_block_ctx block_ctx; /* what blockIdx, blockDim, gridDim read */
  uint64_t block_gen;
  size_t static_used;
  char *dyn_ptr;
  unsigned exited;
  SimThread *cur;
  Fiber *cur_fiber;
  /* the barrier being filled */
  unsigned bar_arrived;
  const void *bar_site;
  const char *bar_file;
  int bar_line;
  unsigned bar_first;
  int bar_acc;
  int bar_result, bar_result_n; /* of the last release */
  unsigned bar_waiting[MAX_THREADS];
  /* ready threads: a FIFO ring (in order) or a bag (random order) */
  unsigned ready[MAX_THREADS];
  unsigned ready_head, ready_count;
  unsigned next_unstarted;             /* in order */
  unsigned unstarted[MAX_THREADS], n_unstarted; /* random order */
};

std::mutex g_kernel_mutex; /* one kernel at a time: the arena and L are global */
Launch L;
SimThread g_threads[MAX_THREADS];
Warp g_warps[MAX_WARPS];
std::vector<Fiber *> g_fibers, g_free_fibers;
Context g_main;             /* the scheduler's context on the host thread running the grid */
uint32_t g_mxcsr = 0x1f80;  /* control words fresh fibers start with */
uint16_t g_fpucw = 0x037f;
uint64_t g_block_gen;
uint64_t g_stat_launches, g_stat_blocks, g_stat_switches, g_stat_threads;
uint64_t g_race_runs;

/* this host thread is executing simulated device code (on a fiber) */
__thread bool tl_on_fiber;
__thread char tl_where[512];

/* ---- shared memory ------------------------------------------------------- */
enum { STATIC_ARENA = 16 << 20 };
char *g_static_arena;
size_t g_static_top;
char *g_dyn_end;   /* the guard page after the dynamic buffer */
char *g_dyn_begin; /* the guard page before it is the one below this */
size_t g_page;
std::mutex g_kernel_info_mutex;
std::unordered_map<const void *, size_t> g_kernel_static; /* static shared bytes per kernel, once seen */
std::unordered_set<std::string> g_names;                 /* interned kernel names */
struct sigaction g_segv_at_launch; /* the SIGSEGV handler in force when the running grid started */

char *map_or_die(size_t bytes, const char *what) {
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) die("mmap of %zu bytes for %s failed: %s", bytes, what, strerror(errno));
  return (char *)p;
}

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

/* ---- fibers -------------------------------------------------------------- */
Fiber *take_fiber(void) {
  Fiber *f;
  if (!g_free_fibers.empty()) {
    f = g_free_fibers.back();
    g_free_fibers.pop_back();
  } else {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char *m = map_or_die(STACK_SIZE + page, "a fiber stack");
    if (mprotect(m, page, PROT_NONE) != 0) die("mprotect of a fiber stack guard failed: %s", strerror(errno));
    f = new Fiber();
    f->stack = m + page;
    f->size = STACK_SIZE;
    f->color = g_fibers.size() * 17 % 64 * 64;
    g_fibers.push_back(f);
  }
  ctx_prepare(&f->ctx, f->stack, f->size - f->color, g_mxcsr, g_fpucw);
  return f;
}

/* thread i of the block starts on fiber f (the caller switches to it, or is
   already on it) */
void start_on(Fiber *f, unsigned i) {
  SimThread &t = g_threads[i];
  t.state = T_RUNNING;
  t.fiber = f;
  L.cur = &t;
  L.cur_fiber = f;
  gl_sim_self = &t.ctx;
  g_stat_threads++;
}

/* ---- errors -------------------------------------------------------------- */
/* Leaves the grid: back to the scheduler context, which sees L.failed.  The
   fibers' stacks are simply dropped (kernel frames own no resources). */
[[noreturn]] void abandon(void) {
  L.failed = true;
  Context dead;
  ctx_switch(&dead, &g_main);
  __builtin_unreachable();
}

const char *where_now(void) {
  const SimThread *t = L.cur;
  if (t)
    snprintf(tl_where, sizeof tl_where, "kernel %s block %s thread %s", L.name, Coord(L.block_ctx.block_idx).s,
             Coord(t->ctx.thread_idx).s);
  else
    snprintf(tl_where, sizeof tl_where, "kernel %s block %s", L.name, Coord(L.block_ctx.block_idx).s);
  return tl_where;
}

/* a kernel error: sticky, stops the grid; msg is prefixed with where */
[[noreturn]] __attribute__((format(printf, 2, 3))) void kernel_fail(cudaError_t code, const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  gl_sim_fail(code, "%s: %s", where_now(), msg);
  abandon();
}

/* the running simulated thread; device functions called from host code
   are a programming error */
inline SimThread *current_thread(const char *what) {
  if (!tl_on_fiber || !L.cur) die("%s called outside a kernel", what);
  return L.cur;
}

/* ---- scheduling ---------------------------------------------------------- */
void make_ready(unsigned i) {
  g_threads[i].state = T_READY;
  if (L.random) L.ready[L.ready_count++] = i;
  else L.ready[(L.ready_head + L.ready_count++) % MAX_THREADS] = i;
}

/* the next thread to run (taken out of its set), or -1 if none is ready */
int pick_next(void) {
  if (!L.random) {
    if (L.ready_count) {
      unsigned i = L.ready[L.ready_head];
      L.ready_head = (L.ready_head + 1) % MAX_THREADS;
      L.ready_count--;
      return (int)i;
    }
    return L.next_unstarted < L.nthreads ? (int)L.next_unstarted++ : -1;
  }
  unsigned total = L.ready_count + L.n_unstarted;
  if (!total) return -1;
  unsigned r = (unsigned)(next_random(&L.rng) % total), i;
  if (r < L.ready_count) {
    i = L.ready[r];
    L.ready[r] = L.ready[--L.ready_count];
  } else {
    r -= L.ready_count;
    i = L.unstarted[r];
    L.unstarted[r] = L.unstarted[--L.n_unstarted];
  }
  return (int)i;
}

[[noreturn]] void deadlock(void) {
  /* group the waiting threads by where they wait */
  struct Group { const char *op, *file; int line; unsigned mask, count, first; };
  std::vector<Group> groups;
  for (unsigned i = 0; i < L.nthreads; i++) {
    const SimThread &t = g_threads[i];
    if (t.state != T_BARRIER && t.state != T_WARP) continue;
    bool found = false;
    for (Group &g : groups)
      if (g.op == t.wait_op && g.file == t.wait_file && g.line == t.wait_line && g.mask == t.wait_mask) {
        g.count++;
        found = true;
        break;
      }
    if (!found) groups.push_back(Group{t.wait_op, t.wait_file, t.wait_line, t.wait_mask, 1, i});
  }
  std::string what;
  for (const Group &g : groups) {
    char buf[512];
    const SimThread &t = g_threads[g.first];
    if (g.mask)
      snprintf(buf, sizeof buf, "%s%u thread(s) wait at %s mask 0x%08x (%s), first thread %s", what.empty() ? "" : "; ",
               g.count, g.op, g.mask, Site(g.file, g.line).s, Coord(t.ctx.thread_idx).s);
    else
      snprintf(buf, sizeof buf, "%s%u thread(s) wait at %s (%s), first thread %s", what.empty() ? "" : "; ", g.count,
               g.op, Site(g.file, g.line).s, Coord(t.ctx.thread_idx).s);
    what += buf;
  }
  L.cur = nullptr; /* the message names the block, not one thread */
  kernel_fail(cudaErrorLaunchTimeout, "deadlock: no thread can run and %u of %u have not exited: %s",
              L.nthreads - L.exited, L.nthreads, what.c_str());
}

/* Runs thread i, switching away from `from` (the calling fiber). */
void switch_to_thread(Context *from, unsigned i) {
  SimThread &t = g_threads[i];
  if (&t == L.cur) { /* the caller itself (random order picked it again) */
    t.state = T_RUNNING;
    return;
  }
  if (t.fiber) {
    t.state = T_RUNNING;
    L.cur = &t;
    L.cur_fiber = t.fiber;
    gl_sim_self = &t.ctx;
    g_stat_switches++;
    ctx_switch(from, &t.fiber->ctx);
  } else {
    Fiber *f = take_fiber();
    start_on(f, i);
    g_stat_switches++;
    ctx_switch(from, &f->ctx);
  }
  /* resumed: whoever switched here has set L.cur and gl_sim_self */
}

/* The running thread t has just started waiting (state set): run others
   until someone makes t ready and the scheduler picks it. */
void wait_here(SimThread *t) {
  int next = pick_next();
  if (next < 0) deadlock();
  switch_to_thread(&t->fiber->ctx, (unsigned)next);
}

/* In random order every completed barrier or collective is a scheduling
   point for the thread that completed it, too. */
void maybe_yield(SimThread *t) {
  if (!L.random) return;
  make_ready(t->linear);
  switch_to_thread(&t->fiber->ctx, (unsigned)pick_next());
}

/* ---- barriers ------------------------------------------------------------ */
enum { BAR_SYNC, BAR_COUNT, BAR_AND, BAR_OR };

void barrier_release(void) {
  L.bar_result = L.bar_acc;
  L.bar_result_n = (int)L.bar_arrived;
  L.bar_acc = 0;
  unsigned n = L.bar_arrived;
  L.bar_arrived = 0;
  /* bar_waiting holds the arrivals except possibly the releasing thread */
  for (unsigned k = 0; k < n; k++) {
    unsigned i = L.bar_waiting[k];
    if (g_threads[i].state == T_BARRIER) make_ready(i);
  }
}

__attribute__((noinline)) int barrier(int kind, int pred, const void *site, const char *file, int line) {
  SimThread *t = current_thread("__syncthreads");
  if (L.bar_arrived == 0) {
    L.bar_site = site;
    L.bar_file = file;
    L.bar_line = line;
    L.bar_first = t->linear;
  } else if (site != L.bar_site) {
    kernel_fail(cudaErrorIllegalInstruction,
                "barrier divergence: this thread reached the barrier at %s while thread %s waits at the one at %s",
                Site(file, line).s, Coord(g_threads[L.bar_first].ctx.thread_idx).s, Site(L.bar_file, L.bar_line).s);
  }
  L.bar_waiting[L.bar_arrived++] = t->linear;
  if (pred) L.bar_acc++;
  if (L.bar_arrived + L.exited == L.nthreads) {
    barrier_release();
    maybe_yield(t);
  } else {
    t->state = T_BARRIER;
    t->wait_op = "__syncthreads";
    t->wait_file = file;
    t->wait_line = line;
    t->wait_mask = 0;
    wait_here(t);
  }
  switch (kind) {
    case BAR_COUNT: return L.bar_result;
    case BAR_AND: return L.bar_result == L.bar_result_n;
    case BAR_OR: return L.bar_result != 0;
  }
  return 0;
}

/* ---- warp collectives ---------------------------------------------------- */
bool same_op(const char *a, const char *b) { return a == b || strcmp(a, b) == 0; }

void rendezvous(unsigned mask, const char *op, uint64_t key, void *mine, LeaderFn fn, void *fn_ctx, const char *file,
                int line) {
  SimThread *t = current_thread(op);
  unsigned lane = t->linear & 31, base = t->linear & ~31u, bit = 1u << lane;
  Warp &w = g_warps[t->linear >> 5];
  if (!(mask & bit))
    kernel_fail(cudaErrorIllegalInstruction, "%s at %s: the calling lane %u is not in mask 0x%08x", op,
                Site(file, line).s, lane, mask);
  if (mask & ~w.exists)
    kernel_fail(cudaErrorIllegalInstruction,
                "%s at %s: mask 0x%08x names lanes 0x%08x that do not exist (the block has %u threads; this warp "
                "has lanes 0x%08x)",
                op, Site(file, line).s, mask, mask & ~w.exists, L.nthreads, w.exists);
  if (mask & w.exited)
    kernel_fail(cudaErrorIllegalInstruction, "%s at %s: mask 0x%08x names lanes 0x%08x that have exited", op,
                Site(file, line).s, mask, mask & w.exited);
  /* Lanes meet in the open collective with the same op and mask (from any
     call site, as on sm_70+).  Other open collectives are no conflict:
     lanes of a warp may run different collectives one after another (lanes
     16..31 sync among themselves, then join a full-warp shuffle), and one
     that can never complete shows up as a deadlock or an exited lane.  The
     same call site reached with overlapping but different masks is the
     classic bug, reported at once. */
  Rendezvous *r = nullptr;
  for (int k = 0; k < w.nopen; k++) {
    Rendezvous &o = w.open[k];
    if (o.mask == mask && same_op(o.op, op)) {
      if (o.key != key)
        kernel_fail(cudaErrorIllegalInstruction,
                    "lanes disagree on the warp collective's arguments: lane %u calls %s at %s with %llu while lane "
                    "%u waits at %s with %llu, mask 0x%08x",
                    lane, op, Site(file, line).s, (unsigned long long)key, o.first_lane, Site(o.file, o.line).s,
                    (unsigned long long)o.key, mask);
      r = &o;
      break;
    }
  }
  for (int k = 0; !r && k < w.nopen; k++) {
    const Rendezvous &o = w.open[k];
    if ((o.mask & mask) && same_op(o.op, op) && o.file == file && o.line == line)
      kernel_fail(cudaErrorIllegalInstruction,
                  "bad shuffle mask: lanes disagree on the mask of %s at %s: lane %u passes 0x%08x, lane %u passed "
                  "0x%08x",
                  op, Site(file, line).s, lane, mask, o.first_lane, o.mask);
  }
  if (!r) {
    r = &w.open[w.nopen++];
    r->mask = mask;
    r->arrived = 0;
    r->op = op;
    r->key = key;
    r->file = file;
    r->line = line;
    r->first_lane = lane;
  }
  r->mine[lane] = mine;
  r->arrived |= bit;
  if (r->arrived != mask) {
    t->state = T_WARP;
    t->wait_op = op;
    t->wait_file = file;
    t->wait_line = line;
    t->wait_mask = mask;
    wait_here(t);
    return;
  }
  /* the last lane: run the collective for all, release the others */
  void *lanes[32];
  for (unsigned l = 0; l < 32; l++) lanes[l] = (mask >> l & 1) ? r->mine[l] : nullptr;
  if (r != &w.open[w.nopen - 1]) *r = w.open[w.nopen - 1];
  w.nopen--;
  fn(fn_ctx, lanes, mask);
  for (unsigned m = mask & ~bit; m; m &= m - 1) make_ready(base + (unsigned)__builtin_ctz(m));
  maybe_yield(t);
}

/* a lane exits: the lanes waiting for it in a collective never will */
void check_exit_in_collectives(SimThread *t) {
  Warp &w = g_warps[t->linear >> 5];
  unsigned bit = 1u << (t->linear & 31);
  for (int k = 0; k < w.nopen; k++) {
    const Rendezvous &o = w.open[k];
    if (o.mask & bit)
      kernel_fail(cudaErrorIllegalInstruction,
                  "this thread (lane %u) exited while lanes 0x%08x wait for it at %s at %s with mask 0x%08x",
                  t->linear & 31, o.arrived, o.op, Site(o.file, o.line).s, o.mask);
  }
}

struct ShflArg {
  uint64_t val;
  int b;
  uint64_t out;
};
struct ShflCtx {
  int mode, width;
};

/* PTX shfl.sync: segmask = 32 - width, clamp = 0 for up and 31 otherwise */
void shfl_leader(void *ctx, void **lanes, unsigned mask) {
  const ShflCtx *c = (const ShflCtx *)ctx;
  int seg = 32 - c->width;
  int clamp = c->mode == GL_SIM_SHFL_UP ? 0 : 31;
  for (int l = 0; l < 32; l++) {
    if (!(mask >> l & 1)) continue;
    ShflArg *a = (ShflArg *)lanes[l];
    int b = a->b & 31, min_lane = l & seg, max_lane = (l & seg) | (clamp & ~seg), j = l;
    bool ok = false;
    switch (c->mode) {
      case GL_SIM_SHFL_IDX: j = min_lane | (b & ~seg); ok = j <= max_lane; break;
      case GL_SIM_SHFL_UP: j = l - b; ok = j >= max_lane; break;
      case GL_SIM_SHFL_DOWN: j = l + b; ok = j <= max_lane; break;
      case GL_SIM_SHFL_XOR: j = l ^ b; ok = j <= max_lane; break;
    }
    if (!ok || !(mask >> j & 1)) j = l;
    a->out = ((ShflArg *)lanes[j])->val;
  }
}

struct VoteArg {
  int pred;
  unsigned out;
};
void vote_leader(void *, void **lanes, unsigned mask) {
  unsigned ballot = 0;
  for (int l = 0; l < 32; l++)
    if ((mask >> l & 1) && ((VoteArg *)lanes[l])->pred) ballot |= 1u << l;
  for (int l = 0; l < 32; l++)
    if (mask >> l & 1) ((VoteArg *)lanes[l])->out = ballot;
}

void nothing_leader(void *, void **, unsigned) {}

void std_function_leader(void *ctx, void **lanes, unsigned) {
  (*(const std::function<void(void **, int)> *)ctx)(lanes, 32);
}

unsigned vote(const char *op, unsigned mask, int pred, const char *file, int line) {
  VoteArg a{pred != 0, 0};
  rendezvous(mask, op, 0, &a, vote_leader, nullptr, file, line);
  return a.out;
}

/* ---- running a grid ------------------------------------------------------ */
void reset_block(void) {
  unsigned n = L.nthreads;
  L.block_gen = ++g_block_gen;
  L.static_used = 0;
  L.exited = 0;
  L.cur = nullptr;
  L.bar_arrived = 0;
  L.bar_acc = 0;
  L.ready_head = L.ready_count = 0;
  L.next_unstarted = 0;
  if (L.random) {
    for (unsigned i = 0; i < n; i++) L.unstarted[i] = i;
    L.n_unstarted = n;
  }
  for (unsigned i = 0; i < n; i++) {
    g_threads[i].state = T_UNSTARTED;
    g_threads[i].fiber = nullptr;
  }
  for (unsigned k = 0; k < L.nwarps; k++) {
    unsigned lanes = n - k * 32 < 32 ? n - k * 32 : 32;
    g_warps[k].exists = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    g_warps[k].exited = 0;
    g_warps[k].nopen = 0;
  }
  /* every fiber is free again (an abandoned block leaves some holding threads) */
  g_free_fibers.assign(g_fibers.rbegin(), g_fibers.rend());
  if (L.dyn_smem) {
    size_t span = round_up(L.dyn_smem, 128);
    memset(g_dyn_end - span, 0xff, span);
  }
}

void run_block(void) {
  reset_block();
  g_stat_blocks++;
  Fiber *f = take_fiber();
  start_on(f, (unsigned)pick_next());
  tl_on_fiber = true;
  gl_sim_block = &L.block_ctx;
  g_stat_switches++;
  ctx_switch(&g_main, &f->ctx);
  tl_on_fiber = false;
  L.cur = nullptr;
  gl_sim_self = nullptr;
  gl_sim_block = nullptr;
}

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
};

std::vector<Snapshot> snapshot_device(void) {
  std::vector<Snapshot> s;
  gl_sim_for_each_alloc([&](void *base, size_t size) {
    Snapshot one{(char *)base, size, std::vector<char>((char *)base, (char *)base + size)};
    s.push_back(std::move(one));
  });
  return s;
}

/* Race mode: the in-order result must equal the result of a random order
   from the same starting memory.  The snapshots, restores and comparisons
   touch every allocation, which the kernel itself may not: they run in
   untracked scopes, so the runtime's stream-order check does not count
   them as the kernel's accesses. */
void run_racecheck(void) {
  std::vector<Snapshot> before, in_order;
  {
    gl_sim_untracked_scope untracked;
    before = snapshot_device();
  }
  run_blocks(false);
  if (L.failed) return;
  {
    gl_sim_untracked_scope untracked;
    in_order = snapshot_device();
    for (const Snapshot &s : before) memcpy(s.base, s.bytes.data(), s.size);
  }
  run_blocks(true);
  if (L.failed) return;
  gl_sim_untracked_scope untracked;
  for (const Snapshot &s : in_order) {
    if (memcmp(s.base, s.bytes.data(), s.size) == 0) continue;
    size_t off = 0;
    while (s.base[off] == s.bytes[off]) off++;
    unsigned char a = (unsigned char)s.bytes[off], b = (unsigned char)s.base[off];
    memcpy(s.base, s.bytes.data(), s.size); /* leave the in-order result */
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
  if (gl_sim_racecheck()) run_racecheck();
  else run_blocks(false);
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

int gl_sim_lane(void) { return (int)(current_thread("gl_sim_lane")->linear & 31); }

void gl_sim_warp_collective(unsigned mask, const char *op, uint64_t key, void *mine,
                            const std::function<void(void **lanes, int nlanes)> &leader) {
  rendezvous(mask, op, key, mine, std_function_leader, (void *)&leader, nullptr, 0);
}

__attribute__((noinline)) void __syncthreads(const char *file, int line) {
  barrier(BAR_SYNC, 0, __builtin_return_address(0), file, line);
}
__attribute__((noinline)) int __syncthreads_count(int pred, const char *file, int line) {
  return barrier(BAR_COUNT, pred != 0, __builtin_return_address(0), file, line);
}
__attribute__((noinline)) int __syncthreads_and(int pred, const char *file, int line) {
  return barrier(BAR_AND, pred != 0, __builtin_return_address(0), file, line);
}
__attribute__((noinline)) int __syncthreads_or(int pred, const char *file, int line) {
  return barrier(BAR_OR, pred != 0, __builtin_return_address(0), file, line);
}

void __syncwarp(unsigned mask, const char *file, int line) {
  rendezvous(mask, "__syncwarp", 0, nullptr, nothing_leader, nullptr, file, line);
}
unsigned __ballot_sync(unsigned mask, int pred, const char *file, int line) {
  return vote("__ballot_sync", mask, pred, file, line);
}
int __any_sync(unsigned mask, int pred, const char *file, int line) {
  return vote("__any_sync", mask, pred, file, line) != 0;
}
int __all_sync(unsigned mask, int pred, const char *file, int line) {
  return vote("__all_sync", mask, pred, file, line) == mask;
}
unsigned __activemask(void) {
  SimThread *t = current_thread("__activemask");
  const Warp &w = g_warps[t->linear >> 5];
  return w.exists & ~w.exited;
}

uint64_t gl_sim_shfl(int mode, unsigned mask, uint64_t bits, int b, int width, const char *file, int line) {
  static const char *const names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync"};
  const char *op = names[mode & 3];
  current_thread(op);
  if (width < 1 || width > 32 || (width & (width - 1)))
    kernel_fail(cudaErrorIllegalInstruction, "%s at %s: width %d is not a power of two in [1, 32]", op,
                Site(file, line).s, width);
  ShflArg a{bits, b, 0};
  ShflCtx c{mode & 3, width};
  rendezvous(mask, op, (uint64_t)width, &a, shfl_leader, &c, file, line);
  return a.out;
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
  size_t total_limit = optin > 0 ? (size_t)GL_SIM_SMEM_OPTIN : (size_t)GL_SIM_SMEM_DEFAULT;
  if (dyn_smem > (size_t)GL_SIM_SMEM_OPTIN) {
    gl_sim_set_last_error(cudaErrorInvalidValue, "kernel %s: dynamic shared memory %zu bytes, at most %d (227 KiB)", kn,
                          dyn_smem, GL_SIM_SMEM_OPTIN);
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

/* ---- the fibers' body ------------------------------------------------------ */
/* Runs simulated threads on the current fiber: the one it was started for,
   then, as each exits, the next unstarted one on the same stack.  When the
   next ready thread already has a fiber, this fiber goes back to the pool
   and control passes to that one. */
extern "C" void gl_sim_fiber_main(void) {
  for (;;) {
    SimThread *t = L.cur;
    (*L.body)();
    t->state = T_EXITED;
    t->fiber = nullptr;
    L.exited++;
    g_warps[t->linear >> 5].exited |= 1u << (t->linear & 31);
    if (g_warps[t->linear >> 5].nopen) check_exit_in_collectives(t);
    if (L.bar_arrived && L.bar_arrived + L.exited == L.nthreads) barrier_release();
    Fiber *self = L.cur_fiber;
    int next = pick_next();
    if (next < 0) {
      if (L.exited < L.nthreads) deadlock();
      Context dead; /* the block is done */
      g_stat_switches++;
      ctx_switch(&dead, &g_main);
      __builtin_unreachable();
    }
    if (!g_threads[next].fiber) {
      start_on(self, (unsigned)next);
      continue;
    }
    g_free_fibers.push_back(self);
    Context dead;
    L.cur = nullptr;
    switch_to_thread(&dead, (unsigned)next);
    __builtin_unreachable();
  }
}

/* ---- faults in the dynamic shared memory guard pages ---------------------- */
/* Installed when the library loads, so runtime.cpp's handler (installed at
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
    /* runtime.cpp's handler passed this fault on by reinstalling this one:
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
