/* exec_block.cpp — the CUDA simulator's execution core, one block: how the
 * simulated threads of a block run on the CPU.  exec.cpp runs the launch
 * (checks, the grid's blocks one after another, race mode, shared memory,
 * faults) and calls run_block for each block; what the two share is
 * exec_internal.h.  The error codes below are listed in exec.cpp's header.
 *
 *   block           every simulated thread is a user-level fiber; a thread
 *                   runs until it waits at a barrier or warp collective or
 *                   exits, then the scheduler picks the next ready thread.
 *                   The switch is a few instructions (no system call), and a
 *                   thread that exits hands its fiber straight to the next
 *                   unstarted thread, so a block without barriers costs no
 *                   switch at all
 *   barriers        as compute-sanitizer's synccheck sees them: a barrier is
 *                   its source line; live threads waiting at different
 *                   __syncthreads = barrier divergence; a thread exiting
 *                   while others wait at a barrier, or a barrier reached
 *                   after some thread exited = a barrier not every thread
 *                   reaches; nothing ready while threads wait = deadlock.
 *                   With GL_SIM_CHECKS leaving synccheck out, exited threads
 *                   are excused (sm_70+ hardware counts them as arrived)
 *   warp collectives every lane named in the mask must arrive at the same
 *                   collective with the same mask; shuffles follow PTX
 *                   shfl.sync
 *   order           in order: threads released from a barrier or collective
 *                   (first released first), then unstarted ones by index;
 *                   random (race mode): any ready or unstarted thread, drawn
 *                   afresh at every scheduling point
 *   portability     x86-64 gets the hand-written switch; elsewhere (or with
 *                   -DGL_SIM_UCONTEXT) ucontext, about 7x slower */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <string>
#include <vector>
#include "exec_internal.h"

using namespace gl_sim_exec;

const gl_sim_thread_ctx *gl_sim_self = nullptr;
const gl_sim_block_ctx *gl_sim_block = nullptr;
uint3 gl_sim_thread_idx(void) { return gl_sim_self->thread_idx; }
uint3 gl_sim_block_idx(void) { return gl_sim_block->block_idx; }
dim3 gl_sim_block_dim(void) { return gl_sim_block->block_dim; }
dim3 gl_sim_grid_dim(void) { return gl_sim_block->grid_dim; }

/* ---- the fiber switch ------------------------------------------------------ */
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

/* splitmix64: the random thread orders of the race mode */
uint64_t next_random(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

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

/* ---- warps ----------------------------------------------------------------- */
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

Warp g_warps[MAX_WARPS];
std::vector<Fiber *> g_fibers, g_free_fibers;
Context g_main;             /* the scheduler's context on the host thread running the grid */
uint64_t g_block_gen;
__thread char tl_where[512];

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

}  // namespace

namespace gl_sim_exec __attribute__((visibility("hidden"))) {

uint32_t g_mxcsr = 0x1f80;  /* control words fresh fibers start with */
uint16_t g_fpucw = 0x037f;

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

}  // namespace gl_sim_exec

namespace {

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
  san_barrier_released();
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

/* Barriers are told apart by source line (file and line of the call), not
   by the call's address: the compiler may duplicate a call (one copy per
   path of an if before it) and both copies are the same __syncthreads. */
bool same_site(const char *fa, int la, const char *fb, int lb) {
  return la == lb && (fa == fb || (fa && fb && strcmp(fa, fb) == 0));
}

int barrier(int kind, int pred, const char *file, int line) {
  SimThread *t = current_thread("__syncthreads");
  if (L.synccheck && L.exited) {
    unsigned gone = 0;
    while (gone < L.nthreads && g_threads[gone].state != T_EXITED) gone++;
    kernel_fail(cudaErrorIllegalInstruction,
                "synccheck: barrier at %s: %u thread(s) of the block exited without reaching it (thread %s among "
                "them), so it can never complete for all of them",
                Site(file, line).s, L.exited, Coord(g_threads[gone].ctx.thread_idx).s);
  }
  if (L.bar_arrived == 0) {
    L.bar_file = file;
    L.bar_line = line;
    L.bar_first = t->linear;
  } else if (!same_site(file, line, L.bar_file, L.bar_line)) {
    kernel_fail(cudaErrorIllegalInstruction,
                "synccheck: barrier divergence: this thread reached the barrier at %s while thread %s waits at the "
                "one at %s",
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
    kernel_fail(cudaErrorIllegalInstruction, "synccheck: %s at %s: the calling lane %u is not in mask 0x%08x", op,
                Site(file, line).s, lane, mask);
  if (mask & ~w.exists)
    kernel_fail(cudaErrorIllegalInstruction,
                "synccheck: %s at %s: mask 0x%08x names lanes 0x%08x that do not exist (the block has %u threads; this warp "
                "has lanes 0x%08x)",
                op, Site(file, line).s, mask, mask & ~w.exists, L.nthreads, w.exists);
  if (mask & w.exited)
    kernel_fail(cudaErrorIllegalInstruction, "synccheck: %s at %s: mask 0x%08x names lanes 0x%08x that have exited", op,
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
                    "synccheck: lanes disagree on the warp collective's arguments: lane %u calls %s at %s with %llu while lane "
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
                  "synccheck: bad shuffle mask: lanes disagree on the mask of %s at %s: lane %u passes 0x%08x, lane %u passed "
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
  san_warp_synced(t->linear >> 5);
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
                  "synccheck: this thread (lane %u) exited while lanes 0x%08x wait for it at %s at %s with mask 0x%08x",
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

/* ---- running a block ----------------------------------------------------- */
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
  san_block_begin();
}

}  // namespace

namespace gl_sim_exec __attribute__((visibility("hidden"))) {
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
}  // namespace gl_sim_exec

/* ---- the interface (sim.h, device.h): lanes, barriers, warp collectives --- */
int gl_sim_lane(void) { return (int)(current_thread("gl_sim_lane")->linear & 31); }

void gl_sim_warp_collective(unsigned mask, const char *op, uint64_t key, void *mine,
                            const std::function<void(void **lanes, int nlanes)> &leader) {
  rendezvous(mask, op, key, mine, std_function_leader, (void *)&leader, nullptr, 0);
}

void __syncthreads(const char *file, int line) { barrier(BAR_SYNC, 0, file, line); }
int __syncthreads_count(int pred, const char *file, int line) { return barrier(BAR_COUNT, pred != 0, file, line); }
int __syncthreads_and(int pred, const char *file, int line) { return barrier(BAR_AND, pred != 0, file, line); }
int __syncthreads_or(int pred, const char *file, int line) { return barrier(BAR_OR, pred != 0, file, line); }

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
    kernel_fail(cudaErrorIllegalInstruction, "synccheck: %s at %s: width %d is not a power of two in [1, 32]", op,
                Site(file, line).s, width);
  ShflArg a{bits, b, 0};
  ShflCtx c{mode & 3, width};
  rendezvous(mask, op, (uint64_t)width, &a, shfl_leader, &c, file, line);
  return a.out;
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
    if (L.synccheck && L.bar_arrived)
      kernel_fail(cudaErrorIllegalInstruction,
                  "synccheck: this thread exited while %u thread(s) of the block wait at the barrier at %s, which "
                  "every live thread must reach",
                  L.bar_arrived, Site(L.bar_file, L.bar_line).s);
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
