/* exec_internal.h — what the two halves of the CUDA simulator's execution
 * core share (private: included by exec.cpp and exec_block.cpp only).
 *
 *   exec.cpp        a launch: launch checks, running a grid block after
 *                   block, race mode, the shared memory arena, the fault
 *                   hooks (guard pages, -fsanitize=bounds), sim.h's entry
 *                   points for them
 *   exec_block.cpp  one block: the fiber switch and stack pool, the
 *                   scheduler, barriers and warp collectives
 *
 * The state of the running launch (L, the thread records) is global: one
 * kernel runs at a time in the process (g_kernel_mutex).  Everything here
 * is in a hidden namespace, so none of it is exported from libgptlua.so. */
#ifndef GL_SIM_EXEC_INTERNAL_H
#define GL_SIM_EXEC_INTERNAL_H
#include <stdint.h>
#include <stdio.h>
#include <functional>
#include <mutex>
#include "sim_types.h"
#include "sim.h"
#include "device.h"

/* the fiber switch: hand-written on x86-64, ucontext elsewhere or with
   -DGL_SIM_UCONTEXT (exec_block.cpp, "portability") */
#if !defined(__x86_64__) || defined(GL_SIM_UCONTEXT)
#define GL_SIM_USE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace gl_sim_exec __attribute__((visibility("hidden"))) {

/* ---- small helpers ------------------------------------------------------- */
/* prints "gptlua cuda-sim: MESSAGE" and aborts */
[[noreturn]] __attribute__((format(printf, 1, 2))) void die(const char *fmt, ...);

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

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* an anonymous read-write mapping (no swap reserved), or die naming `what` */
char *map_or_die(size_t bytes, const char *what);

/* ---- fiber contexts -------------------------------------------------------- */
/* saved and restored by exec_block.cpp's switch */
#ifdef GL_SIM_USE_UCONTEXT
struct Context {
  ucontext_t uc;
};
#else
struct Context {
  void *sp;  /* everything else is on the stack it points to */
};
#endif

/* ---- simulated threads, fibers --------------------------------------------- */
enum ThreadState : uint8_t { T_UNSTARTED, T_READY, T_RUNNING, T_BARRIER, T_WARP, T_EXITED };

/* a stack a simulated thread runs on; exec_block.cpp keeps a pool of them */
struct Fiber {
  Context ctx;
  char *stack; /* usable part, above the guard page */
  size_t size;
  /* The stacks are mmap'd at a page-multiple stride, so their tops would
     all fall in the same L1 cache sets: each starts this much lower
     (a multiple of 64 below 4 KiB), about 10% faster switching. */
  size_t color;
};

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
  bool synccheck; /* GL_SIM_CHECKS has synccheck */
  unsigned bar_arrived;
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

/* ---- state (exec.cpp defines the launch's, exec_block.cpp the fibers') ---- */
extern std::mutex g_kernel_mutex; /* one kernel at a time: the arena and L are global */
extern Launch L;
extern SimThread g_threads[MAX_THREADS];
extern uint32_t g_mxcsr; /* control words fresh fibers start with */
extern uint16_t g_fpucw;
extern uint64_t g_stat_launches, g_stat_blocks, g_stat_switches, g_stat_threads;

/* this host thread is executing simulated device code (on a fiber) */
extern __thread bool tl_on_fiber;

/* the dynamic shared memory buffer (exec.cpp), which every block start
   poisons */
extern char *g_dyn_end;   /* the guard page after the dynamic buffer */
extern char *g_dyn_begin; /* the guard page before it is the one below this */

/* the static shared memory arena (exec.cpp): a fixed offset per GL_SHARED slot */
enum { STATIC_ARENA = 16 << 20 };
extern char *g_static_arena;

/* ---- sanitize.cpp: what the sanitizer is told ------------------------------ */
void san_launch_begin(void);            /* a grid starts on this host thread */
void san_launch_end(void);
void san_block_begin(void);             /* a block starts (after reset) */
void san_slot_touched(size_t offset, size_t bytes); /* a GL_SHARED array's first touch in the block */
void san_barrier_released(void);        /* a __syncthreads completed */
void san_warp_synced(unsigned warp);    /* a warp collective of that warp completed */

/* ---- exec_block.cpp ------------------------------------------------------ */
/* Runs the current block (L.block_ctx.block_idx) to its end, or until a
   kernel error abandons it (L.failed). */
void run_block(void);
/* Leaves the grid: back to the scheduler context, which sees L.failed. */
[[noreturn]] void abandon(void);
/* "kernel NAME block (x,y,z) thread (x,y,z)" (thread left out between
   threads), in a thread-local buffer */
const char *where_now(void);
/* a kernel error: sticky, stops the grid; msg is prefixed with where */
[[noreturn]] __attribute__((format(printf, 2, 3))) void kernel_fail(cudaError_t code, const char *fmt, ...);

/* the running simulated thread; device functions called from host code
   are a programming error */
inline SimThread *current_thread(const char *what) {
  if (!tl_on_fiber || !L.cur) die("%s called outside a kernel", what);
  return L.cur;
}

}  // namespace gl_sim_exec

#endif
