/* sim.h — the seams between the parts of the CUDA simulator (C++ only).
 *
 *   exec.cpp exec_block.cpp  (the execution core)  grids, blocks, thread fibers,
 *                 barriers, warp collectives, shared memory, launch checks, race mode
 *   runtime*.cpp  (the runtime, its files listed in runtime.cpp)  devices, device
 *                 heap with guard pages, host access and stream-order checks,
 *                 copies, streams, events, sticky errors
 *   cublaslt.cpp cublaslt_heuristic.cpp cublaslt_matmul.cpp  cuBLASLt over OpenBLAS
 *   nccl_comm.cpp nccl_ops.cpp  NCCL over MPI
 *   cuda_bf16.h cuda_fp16.h mma.h       numeric types and WMMA
 *   account.cpp   the byte-and-FLOP account of each work item, host syncs
 *   trace.cpp     the stream trace: work items with their vector clocks, cross-stream
 *                 waits, host syncs and marks (recipes/tools/host_syncs.lua)
 *
 * Environment switches (read once, at first use):
 *   GL_SIM_RACECHECK=1    run every launch twice, in-order and in a seeded
 *                         random thread order, and require identical memory
 *   GL_SIM_SEED=N         the seed of the random orders (default 1)
 *   GL_SIM_STREAMS=threads  each stream runs on its own host thread (work on
 *                         different streams really is unordered); default
 *                         'sync': all work runs in submission order
 *   GL_SIM_HOSTCHECK=0    leave device memory readable by host code
 *                         (default 1: a host dereference is an error)
 *   GL_SIM_ARCH=CC        the GPU pretended, by compute capability: 80, 86,
 *                         89 or 90 (default): what the device reports
 *                         (major, minor, opt-in shared memory per block) and
 *                         the launch limits it enforces
 *   GL_SIM_CHECKS=LIST    the sanitizer classes every kernel runs under
 *                         (sanitize.cpp): a comma list of memcheck, initcheck,
 *                         racecheck, synccheck, or 'all' (default) or 'none'
 *   GL_SIM_SMS=N          the multiprocessor count the devices report
 *                         (default 132, an H100's; the account counts with
 *                         fewer, recipes/tools/account.lua says why) */
#ifndef GL_SIM_H
#define GL_SIM_H
#include <functional>
#include "sim_types.h"

/* ---- runtime*.cpp ------------------------------------------------------ */
/* Queues work on stream s (NULL: the legacy default stream, ordered with
   every blocking stream).  The work runs inside a device context (device
   pages accessible, see gl_sim_device_scope) on the calling thread in sync
   mode, or on the stream's thread in threads mode.  If the context holds a
   sticky error the work is dropped.  `what` names the work in diagnostics
   ("kernel flash_fwd_kernel<64>", "cublasLtMatmul", "ncclAllReduce"). */
void gl_sim_submit(cudaStream_t s, const char *what, std::function<void()> work);
/* Records a sticky error (the first one wins, as on a GPU, where the context
   is unusable after an illegal address): every later runtime call returns
   `code`, and cudaGetErrorString(code) returns "<standard text>: <message>".
   Also printed to stderr once, prefixed "gptlua cuda-sim: ". */
void gl_sim_fail(cudaError_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A non-sticky error for the next cudaGetLastError / launch check (bad
   launch configuration and the like); also printed to stderr. */
void gl_sim_set_last_error(cudaError_t code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The sticky error, cudaSuccess if none. */
cudaError_t gl_sim_sticky(void);
/* RAII: host code inside may touch device memory (a kernel, a copy, a
   cuBLASLt GEMM, an NCCL staging copy).  Nestable.  gl_sim_submit wraps
   every work item in one, so only code outside the queue needs it. */
struct gl_sim_device_scope {
  gl_sim_device_scope();
  ~gl_sim_device_scope();
  gl_sim_device_scope(const gl_sim_device_scope &) = delete;
  gl_sim_device_scope &operator=(const gl_sim_device_scope &) = delete;
};
/* RAII, inside a work item: lets other streams' work run while this one
   waits for something outside the process (an NCCL item polling its peers).
   Device contexts take turns while the stream-order check is on; code
   inside the pause must not touch device memory. */
struct gl_sim_device_scope_pause {
  gl_sim_device_scope_pause();
  ~gl_sim_device_scope_pause();
  gl_sim_device_scope_pause(const gl_sim_device_scope_pause &) = delete;
  gl_sim_device_scope_pause &operator=(const gl_sim_device_scope_pause &) = delete;
 private:
  bool held;
};
/* The live device allocation containing p: its base and size, and the
   device; false if p is not device memory. */
bool gl_sim_find_alloc(const void *p, void **base, size_t *size, int *device);
/* Every live device allocation, for the race mode's snapshots:
   calls f(base, size) for each. */
void gl_sim_for_each_alloc(const std::function<void(void *, size_t)> &f);
/* configuration (environment, read once) */
int gl_sim_racecheck(void);
uint64_t gl_sim_seed(void);
int gl_sim_streams_threaded(void);
/* the sanitizer classes on (GL_SIM_CHECKS), a mask of these bits */
enum { GL_SIM_CHECK_MEM = 1, GL_SIM_CHECK_INIT = 2, GL_SIM_CHECK_RACE = 4, GL_SIM_CHECK_SYNC = 8 };
unsigned gl_sim_checks(void);
/* the opt-in shared memory per block of the GPU pretended (GL_SIM_ARCH) */
int gl_sim_smem_optin(void);
/* A device allocation as the sanitizer (sanitize.cpp) sees it: its data
   pages (slack included), the bytes cudaMalloc returned, and one bit per
   byte of those, set once the byte has been written (initcheck).  False if
   `a` is in no live allocation's data pages.  The view stays valid while
   the allocation lives (no cudaFree can run during a kernel). */
struct gl_sim_alloc_view {
  uintptr_t data_begin, data_end, begin, end;
  uint8_t *written; /* NULL: not tracked (the host checks are off), every byte counts as written */
};
bool gl_sim_alloc_view_of(uintptr_t a, gl_sim_alloc_view *out);
/* The dynamic shared memory a kernel may use without / with opting in
   (cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, n)
   records n for the function f; 0 if never set). */
int gl_sim_func_smem_optin(const void *fn);

/* ---- exec.cpp ----------------------------------------------------------- */
/* Where the calling host thread is in simulated device code, for messages:
   "kernel NAME block (x,y,z) thread (x,y,z)", or NULL outside kernels. */
const char *gl_sim_where(void);
/* Called by runtime_memory.cpp's fault handler on an access that faulted inside a
   kernel: records the sticky error and abandons the rest of the grid (the
   launch's work item returns).  Never returns.  Outside a kernel returns
   false and the caller reports and aborts the process itself. */
bool gl_sim_abort_kernel(cudaError_t code, const char *msg);
/* Runs a grid: fn(thread) is called once per simulated thread on its fiber.
   Validates the configuration first (returns the error it sets with
   gl_sim_set_last_error).  `kernel` identifies the function for the
   opt-in shared memory limit. */
cudaError_t gl_sim_launch(const char *name, const void *kernel, dim3 grid, dim3 block, size_t dyn_smem,
                          cudaStream_t stream, std::function<void()> body);
/* Warp-collective rendezvous for operations that need every lane's operand
   at once (WMMA, and the shuffles / votes in exec.cpp): each lane of `mask`
   calls it with the same `op` and `key` (the arguments that must agree
   across lanes, e.g. a pointer and a leading dimension) and its own `mine`.
   When the last lane of the mask arrives, `leader(lanes, n)` runs once with
   every lane's `mine` indexed by lane (NULL for lanes outside the mask);
   then every lane returns.  Disagreeing keys, a mask naming an absent or
   exited lane, or a calling lane outside the mask are errors that stop the
   kernel (gl_sim_abort_kernel). */
void gl_sim_warp_collective(unsigned mask, const char *op, uint64_t key, void *mine,
                            const std::function<void(void **lanes, int nlanes)> &leader);
/* the calling simulated thread's lane (threadIdx linear % 32) */
int gl_sim_lane(void);

/* ---- added by the runtime (runtime_memory.cpp): the stream check's blind spot ---------
   RAII: device memory touched inside is neither recorded nor checked by the
   stream-order check (GL_SIM_STREAMCHECK).  For simulator bookkeeping that
   touches memory the work item itself does not, e.g. the race mode's
   snapshots and restores of every allocation, which would otherwise count
   as accesses of the kernel and clash with other streams' work.  On exit
   the pages opened inside are closed again, so the item's own later
   accesses are still seen.  Nestable; use inside a device context.
   gl_sim_for_each_alloc runs its callback in one. */
struct gl_sim_untracked_scope {
  gl_sim_untracked_scope();
  ~gl_sim_untracked_scope();
  gl_sim_untracked_scope(const gl_sim_untracked_scope &) = delete;
  gl_sim_untracked_scope &operator=(const gl_sim_untracked_scope &) = delete;
};

/* ---- account.cpp: the byte-and-FLOP account (recipes/tools/account.lua) ---
   Hooks, each a no-op unless the account is on.  runtime_streams.cpp's
   run_work brackets every work item with item_begin / item_end (`what` is
   the item's name); code that moves bytes or does FLOPs the instrumented
   kernels cannot show adds them to the open item (cuBLASLt, copies, sets,
   WMMA products), optionally renaming it (NULL: keep the name); the
   runtime reports every host wait on the device with sync (the API's name). */
void gl_sim_account_item_begin(const char *what);
void gl_sim_account_item_end(void);
void gl_sim_account_add(const char *rename, double flops, double bytes_read, double bytes_written);
void gl_sim_account_sync(const char *what);
/* a kernel's load (written 0) or store (1) of n bytes at addr: sanitize.cpp's
   hooks report every instrumented access while gl_sim_account_counting */
void gl_sim_account_touch(uintptr_t addr, size_t n, int written);
extern bool gl_sim_account_counting __attribute__((visibility("hidden")));
/* The account's quick mode (gl_sim_account_skip_products): true while
   cuBLASLt products are counted from their descriptors and not computed. */
bool gl_sim_account_skips_products(void);

#endif
