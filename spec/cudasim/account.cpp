/* account.cpp — the CUDA simulator's byte-and-FLOP account: what each work
 * item (kernel launch, cuBLASLt matmul, copy, set) costs a GPU, counted
 * while it runs, and how often the host waits for the device.  Read by
 * recipes/tools/account.lua (`recipes/tools/bench_cuda.lua --account`) through the
 * C functions at the end of this file; recipes/tools/ACCOUNT.md says what
 * the figures mean.
 *
 *   bytes    global memory a kernel reads and writes.  Only the account
 *            flavour of the simulator counts them (make sim-account:
 *            build/sim-account/, every kernels/NAME.cu compiled with
 *            -fsanitize=thread's instrumentation), where every load and
 *            store a kernel makes calls sanitize.cpp's __tsan_{read,write}N
 *            hooks, which call gl_sim_account_touch below.  The 32-byte sectors touched are collected per
 *            work item; at its end those inside a device allocation are
 *            counted once each, as read and/or as written.  Unique sectors
 *            per launch is what DRAM must move at least: a tile re-read from
 *            L2 or shared memory is not counted again (stack, shared memory
 *            and the simulator's own bookkeeping are not device memory and
 *            fall out).
 *   FLOPs    tensor-core work: wmma::mma_sync adds 2*M*N*K per warp op
 *            (mma.h), a cuBLASLt matmul 2*m*n*k per batch plus its epilogue
 *            (cublaslt_matmul.cpp, which also gives the bytes of its
 *            operands, each moved once: the best the library can do).
 *            Arithmetic on CUDA cores (norms, softmax, optimizers) is not
 *            counted: those kernels are memory-bound by far.
 *   copies   cudaMemcpy*, cudaMemset*: their byte counts (runtime_streams.cpp).
 *   syncs    every time the host blocks on the device: stream, event and
 *            device synchronisation, a copy to pageable host memory,
 *            cudaFree (runtime_streams.cpp, runtime_memory.cpp).
 *
 * The quick mode (gl_sim_account_skip_products): cuBLASLt products are
 * counted from their descriptors as always, but not computed; their outputs
 * get a fixed pattern of small finite numbers (cublaslt_matmul.cpp).  No
 * count depends on a product's values (spec/account_spec.lua compares a
 * tiny model's step counted both ways), and the products are nearly all of
 * the simulator's time at nanochat d20's width: the account runs in this
 * mode, so its numbers (losses, norms) are garbage while its counts are not.
 *
 * Items are aggregated by name (the kernel expression, "cublasLt bf16 NT
 * gelu", "cudaMemcpy ..."), in first-seen order.  The account needs the
 * default sync stream mode (one work item at a time on the submitting
 * thread); gl_sim_account_start refuses threads mode. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <atomic>
#include <string>
#include <unordered_map>
#include <vector>
#include "sim.h"

/* counting: the account is on and a work item is running (sync mode: on
   this thread).  A plain global: sanitize.cpp's hooks read it at every
   instrumented access before calling gl_sim_account_touch. */
bool gl_sim_account_counting = false;

namespace {

/* ---- the sectors one work item touched ------------------------------------- */
/* Per device allocation (made at its first touch), a bit per 32-byte sector
   for "read" and one for "written", and the range of words set by the open
   item; the item's end counts and clears that range.  A direct-mapped cache
   of 4 KiB pages says which allocation a page belongs to (or none: the
   stack, shared memory, the simulator's own data), so that an access costs
   a few instructions; it is emptied at every item start, as allocations
   come and go between items. */
enum { SECTOR_SHIFT = 5, PAGE_SHIFT = 12, PAGE_CACHE = 4096 };

struct Bitmap {
  uintptr_t base = 0, end = 0;
  std::vector<uint64_t> bits[2];  /* [0] read, [1] written */
  size_t lo[2], hi[2];            /* words touched by the open item: [lo, hi) */
  bool touched = false;
};

struct PageEntry {
  uintptr_t page = ~(uintptr_t)0;
  Bitmap *bm = nullptr;  /* NULL: not device memory */
};

struct Row {
  std::string name;
  double launches = 0, flops = 0, read = 0, written = 0;
};

struct Account {
  bool on = false;
  bool item_open = false;
  std::string item_name;                  /* the open item's name (renamed by gl_sim_account_add) */
  double item_flops = 0, item_read = 0, item_written = 0;
  PageEntry pages[PAGE_CACHE];
  std::unordered_map<uintptr_t, Bitmap *> bitmaps; /* by allocation start */
  std::vector<Bitmap *> touched;          /* by the open item */
  std::vector<Row> rows;
  std::unordered_map<std::string, size_t> row_of;
  std::vector<Row> syncs;                 /* by kind: launches = times */
  std::unordered_map<std::string, size_t> sync_of;
  double item_t0 = 0, item_seconds = 0;   /* wall time inside work items */
};

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
Account A;

/* the quick mode: products counted, not computed (read by stream threads too) */
std::atomic<bool> g_skip_products{false};


Bitmap *bitmap_of(uintptr_t addr) {
  void *base = nullptr;
  size_t size = 0;
  if (!gl_sim_find_alloc((const void *)addr, &base, &size, nullptr)) return nullptr;
  Bitmap *&bm = A.bitmaps[(uintptr_t)base];
  if (bm && bm->end != (uintptr_t)base + size) { delete bm; bm = nullptr; } /* freed and mapped again */
  if (!bm) {
    bm = new Bitmap();
    bm->base = (uintptr_t)base;
    bm->end = (uintptr_t)base + size;
    size_t words = ((size + 31) / 32 + 63) / 64;
    bm->bits[0].assign(words, 0);
    bm->bits[1].assign(words, 0);
  }
  return bm;
}

void touch_bytes(uintptr_t addr, size_t n, int kind) {
  if (!gl_sim_account_counting || n == 0) return;
  uintptr_t page = addr >> PAGE_SHIFT;
  PageEntry &pe = A.pages[page & (PAGE_CACHE - 1)];
  if (pe.page != page) {
    pe.page = page;
    pe.bm = bitmap_of(addr);
  }
  Bitmap *bm = pe.bm;
  if (!bm || addr < bm->base) return;
  uintptr_t last = addr + n - 1 < bm->end ? addr + n - 1 : bm->end - 1;
  if (!bm->touched) {
    bm->touched = true;
    bm->lo[0] = bm->lo[1] = SIZE_MAX;
    bm->hi[0] = bm->hi[1] = 0;
    A.touched.push_back(bm);
  }
  uint64_t *bits = bm->bits[kind].data();
  for (size_t s = (addr - bm->base) >> SECTOR_SHIFT, e = (last - bm->base) >> SECTOR_SHIFT; s <= e; s++) {
    size_t w = s >> 6;
    bits[w] |= 1ull << (s & 63);
    if (w < bm->lo[kind]) bm->lo[kind] = w;
    if (w >= bm->hi[kind]) bm->hi[kind] = w + 1;
  }
}

Row &row_named(std::vector<Row> &rows, std::unordered_map<std::string, size_t> &index, const std::string &name) {
  auto it = index.find(name);
  if (it != index.end()) return rows[it->second];
  index[name] = rows.size();
  rows.emplace_back();
  rows.back().name = name;
  return rows.back();
}

/* The item's device sectors: each counts 32 bytes read and/or written. */
void close_item(void) {
  double count[2] = {0, 0};
  for (Bitmap *bm : A.touched) {
    for (int k = 0; k < 2; k++) {
      uint64_t *bits = bm->bits[k].data();
      for (size_t w = bm->lo[k]; w < bm->hi[k]; w++) {
        count[k] += __builtin_popcountll(bits[w]);
        bits[w] = 0;
      }
    }
    bm->touched = false;
  }
  A.touched.clear();
  double read = 32 * count[0], written = 32 * count[1];
  Row &r = row_named(A.rows, A.row_of, A.item_name);
  r.launches += 1;
  r.flops += A.item_flops;
  r.read += read + A.item_read;
  r.written += written + A.item_written;
}

}  // namespace

/* ---- hooks for the simulator (sim.h) ----------------------------------------- */
void gl_sim_account_item_begin(const char *what) {
  if (!A.on) return;
  A.item_open = true;
  A.item_name = what ? what : "work";
  if (A.item_name.compare(0, 7, "kernel ") == 0) A.item_name.erase(0, 7);
  A.item_flops = A.item_read = A.item_written = 0;
  for (PageEntry &pe : A.pages) pe = PageEntry();
  gl_sim_account_counting = true;
  A.item_t0 = now_s();
}

void gl_sim_account_item_end(void) {
  if (!A.item_open) return;
  gl_sim_account_counting = false;
  A.item_open = false;
  close_item();
  A.item_seconds += now_s() - A.item_t0;
}

void gl_sim_account_add(const char *rename, double flops, double bytes_read, double bytes_written) {
  if (!A.item_open) return;
  if (rename) A.item_name = rename;
  A.item_flops += flops;
  A.item_read += bytes_read;
  A.item_written += bytes_written;
}

bool gl_sim_account_skips_products(void) { return g_skip_products.load(std::memory_order_relaxed); }

void gl_sim_account_sync(const char *what) {
  if (!A.on) return;
  row_named(A.syncs, A.sync_of, what ? what : "sync").launches += 1;
}

/* ---- the instrumentation's hooks (sanitize.cpp) call this for every access ---- */
void gl_sim_account_touch(uintptr_t addr, size_t n, int written) {
  if (gl_sim_account_counting) touch_bytes(addr, n, written);
}

/* ---- the C interface (recipes/tools/account.lua declares it itself) ---------- */
extern "C" {

typedef struct {
  const char *name;
  double launches, flops, bytes_read, bytes_written;
} gl_sim_account_row;

/* 1 in the account flavour (kernels instrumented), 0 in plain build/sim */
__attribute__((visibility("default"))) int gl_sim_account_counts_bytes(void) {
#ifdef GL_SIM_ACCOUNT_FLAVOUR
  return 1;
#else
  return 0;
#endif
}

/* Forgets what was counted and starts counting.  0, or -1 with a message in
   `err` (threads mode, or a build whose kernels are not instrumented). */
__attribute__((visibility("default"))) int gl_sim_account_start(char *err, int errlen) {
  if (gl_sim_streams_threaded()) {
    snprintf(err, (size_t)errlen, "the account needs GL_SIM_STREAMS=sync (work items one at a time)");
    return -1;
  }
  if (!gl_sim_account_counts_bytes()) {
    snprintf(err, (size_t)errlen,
             "this simulator build does not count memory traffic: build build/sim-account/ with `make sim-account` "
             "and run build/sim-account/gptlua");
    return -1;
  }
  A.rows.clear();
  A.row_of.clear();
  A.syncs.clear();
  A.sync_of.clear();
  A.item_seconds = 0;
  A.on = true;
  return 0;
}

__attribute__((visibility("default"))) void gl_sim_account_stop(void) { A.on = false; }

/* The quick mode on (1) or off (0), in any simulator build and whether or
   not the account is counting: from now on every cuBLASLt product is
   counted from its descriptors and its outputs get a fixed pattern instead
   of its values.  Returns the previous setting. */
__attribute__((visibility("default"))) int gl_sim_account_skip_products(int on) {
  return g_skip_products.exchange(on != 0) ? 1 : 0;
}

/* wall seconds spent running work items (and counting them) since start:
   what the host spent outside them is its own time (dispatch) */
__attribute__((visibility("default"))) double gl_sim_account_item_seconds(void) { return A.item_seconds; }

/* row i of the work items (0-based) or of the host syncs (launches = times);
   0, or -1 past the end.  Names stay valid until the next start. */
__attribute__((visibility("default"))) int gl_sim_account_get(int syncs, int i, gl_sim_account_row *out) {
  const std::vector<Row> &rows = syncs ? A.syncs : A.rows;
  if (i < 0 || (size_t)i >= rows.size()) return -1;
  const Row &r = rows[(size_t)i];
  out->name = r.name.c_str();
  out->launches = r.launches;
  out->flops = r.flops;
  out->bytes_read = r.read;
  out->bytes_written = r.written;
  return 0;
}

}  // extern "C"
