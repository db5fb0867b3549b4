/* alloc.c — the per-device caching allocator behind every storage.
 *
 * Blocks are rounded up to size classes (512-byte granularity below 1 MiB,
 * then 1/8-power-of-two steps) and kept on a per-class free list when
 * released, so a training step that allocates the same shapes every
 * iteration reuses the same blocks and reaches a steady state.  empty_cache
 * returns cached blocks to the system (or to cudaFree).  One mutex guards
 * each device: the loader thread may allocate concurrently with Lua.
 *
 * The meta device (gl_meta_set, gptlua.plan): while the process plans, its
 * storages get a size and no memory.  Each device has a second cache,
 * its meta twin, run by the same code (same classes, same free lists and
 * cache hits, same statistics) with the raw allocation left out, so a plan
 * reads the peak the device's allocator would reach.  Storages a plan
 * makes for real (host values it needs: the dataset, the loader's
 * batches; gl_meta_pause) are charged to the twin as well (storage->meta
 * 2), so the plan's totals are the real run's, data included.
 *
 * Graph pools (CUDA graphs, kernels/runtime.cu): a graph replays its work on
 * the addresses it was captured with, so while a capture runs the device's
 * open pool serves every allocation, from its own blocks or fresh ones,
 * never from the shared free lists, and takes every block freed meanwhile
 * (the graph still uses it at each launch).  A pool's blocks, once free, are
 * reused only inside a capture into that pool; they return to the shared
 * cache when the graph is destroyed (gl_alloc_pool_release).  Meta twins
 * have no pools. */
#include "internal.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

enum { N_SMALL = 2048, N_CLASSES = 2048 + 8 * 44, MAX_DEVICES = 17 /* cpu + 16 GPUs */ };
#define SMALL_LIMIT ((int64_t)1 << 20)

typedef struct block { struct block *next; void *ptr; int64_t size; } block;
/* a graph pool's blocks: handed out (live) or free for its next capture */
typedef struct pool_block { void *ptr; int64_t size; int live; } pool_block;
struct gl_alloc_pool {
  int device;
  int released;                  /* the graph is gone: blocks go to the cache when freed */
  pool_block *b;
  int64_t n, cap, live;
  struct gl_alloc_pool *next;    /* the device's pools */
};


typedef struct dev_cache {
  pthread_mutex_t mu;
  block *free_lists[N_CLASSES];  /* cached blocks per class */
  block *spare;                  /* recycled block records */
  gl_mem_stats st;
  gl_alloc_pool *open_pool;      /* serving allocations (a capture runs) */
  gl_alloc_pool *pools;          /* every pool with blocks */
} dev_cache;

static dev_cache caches[MAX_DEVICES], meta_caches[MAX_DEVICES];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void init_caches(void) {
  for (int i = 0; i < MAX_DEVICES; i++) {
    pthread_mutex_init(&caches[i].mu, NULL);
    pthread_mutex_init(&meta_caches[i].mu, NULL);
  }
}

/* the planning state: GL_META_OFF/ON/ZEROS and paused.  The process's, not
   a thread's: the ops' OpenMP workers dispatch too (the planner's Lua runs
   on one thread; the loader's producer thread makes no storages) */
static int meta_mode, meta_paused;
int gl_meta_set(int mode) {
  if (mode < GL_META_OFF || mode > GL_META_ZEROS)
    return gl_error("gl_meta_set: mode must be 0 (off), 1 (on) or 2 (on, reads give zeros), got %d", mode);
  int old = meta_mode;
  meta_mode = mode;
  meta_paused = 0;
  return old;
}
int gl_meta_mode(void) { return meta_mode; }
int gl_meta_pause(int paused) { int old = meta_paused; meta_paused = paused != 0; return old; }
int gl_meta_active(void) { return meta_mode != GL_META_OFF && !meta_paused; }
/* what a storage made now is: 1 meta, 2 real but charged
   to the meta twin too, 0 real */
int gl_meta_kind(void) { return meta_mode == GL_META_OFF ? 0 : meta_paused ? 2 : 1; }

static dev_cache *cache_for(int device) {
  pthread_once(&once, init_caches);
  int i = device + 1;
  return (i >= 0 && i < MAX_DEVICES) ? &caches[i] : NULL;
}
/* the statistics a caller sees: the meta twin's during a plan */
static dev_cache *stats_for(int device) {
  dev_cache *c = cache_for(device);
  return c && meta_mode != GL_META_OFF ? &meta_caches[c - caches] : c;
}

/* Size class of a request, rounding *size up to the class size: 512-byte
   steps up to 1 MiB (classes 0..2047), then 8 classes per power of two. */
static int size_class(int64_t *size) {
  int64_t s = *size < 512 ? 512 : *size;
  if (s <= SMALL_LIMIT) {
    int64_t r = (s + 511) / 512 * 512;
    *size = r;
    return (int)(r / 512 - 1);
  }
  int lg = 63 - __builtin_clzll((unsigned long long)s);
  int64_t step = ((int64_t)1 << lg) / 8;
  int64_t r = (s + step - 1) / step * step;
  lg = 63 - __builtin_clzll((unsigned long long)r);
  *size = r;
  return N_SMALL + (lg - 20) * 8 + (int)((r >> (lg - 3)) & 7);
}

static int raw_alloc(int device, int meta, int64_t size, void **out) {
  if (meta) { *out = NULL; return GL_OK; }  /* a meta twin: no memory */
  if (device < 0) {
    void *p = NULL;
    if (posix_memalign(&p, 64, (size_t)size) != 0 || !p)
      return gl_error("gl_empty: out of host memory allocating %lld bytes", (long long)size);
    *out = p;
    return GL_OK;
  }
#ifdef GL_WITH_CUDA
  return cuda_malloc(device, size, out);
#else
  return gl_error("gl_empty: cuda:%d requested but this engine was built without CUDA", device);
#endif
}

static void raw_free(int device, int meta, void *p) {
  if (meta) return;
  if (device < 0) { free(p); return; }
#ifdef GL_WITH_CUDA
  cuda_free(device, p);
#endif
}

static int is_meta(const dev_cache *c) { return c >= meta_caches && c < meta_caches + MAX_DEVICES; }

static void release_cached(dev_cache *c, int device) {
  for (int k = 0; k < N_CLASSES; k++) {
    block *b = c->free_lists[k];
    while (b) {
      block *n = b->next;
      raw_free(device, is_meta(c), b->ptr);
      c->st.reserved -= b->size;
      b->next = c->spare; c->spare = b;
      b = n;
    }
    c->free_lists[k] = NULL;
  }
}

#ifdef GL_SIM
/* In the CUDA simulator every raw device block ends at a guard page.  A
   storage is placed at the END of its (class-sized) block, 16-byte aligned,
   so an access past the tensor's last element faults instead of landing in
   the class's slack.  The block start is found again on release through
   this table (user pointer -> block), kept only in simulator builds. */
typedef struct sim_place { void *user, *block; } sim_place;
static sim_place *sim_places;
static int64_t sim_nplaces, sim_cap_places;
static pthread_mutex_t sim_places_mu = PTHREAD_MUTEX_INITIALIZER;

static void *sim_place_end(void *block, int64_t size, int64_t nbytes) {
  int64_t tail = (size - (nbytes > 0 ? nbytes : 0)) & ~(int64_t)15;
  void *user = (char *)block + tail;
  pthread_mutex_lock(&sim_places_mu);
  if (sim_nplaces == sim_cap_places) {
    int64_t cap = sim_cap_places ? 2 * sim_cap_places : 1024;
    sim_place *np = realloc(sim_places, (size_t)cap * sizeof *np);
    if (!np) gl_panic("gl_alloc: out of host memory for the simulator's block table");
    sim_places = np;
    sim_cap_places = cap;
  }
  sim_places[sim_nplaces++] = (sim_place){user, block};
  pthread_mutex_unlock(&sim_places_mu);
  return user;
}
static void *sim_block_of(void *user) {
  void *block = user;
  pthread_mutex_lock(&sim_places_mu);
  for (int64_t i = sim_nplaces - 1; i >= 0; i--)
    if (sim_places[i].user == user) {
      block = sim_places[i].block;
      sim_places[i] = sim_places[--sim_nplaces];
      break;
    }
  pthread_mutex_unlock(&sim_places_mu);
  return block;
}
#endif

/* ---- graph pools ----------------------------------------------------------- */
static void cache_block_locked(dev_cache *c, int device, void *p, int64_t size, int k);

static int pool_add_locked(gl_alloc_pool *pool, void *p, int64_t size, int live) {
  if (pool->n == pool->cap) {
    int64_t cap = pool->cap ? 2 * pool->cap : 256;
    pool_block *nb = realloc(pool->b, (size_t)cap * sizeof *nb);
    if (!nb) return GL_ERR;
    pool->b = nb;
    pool->cap = cap;
  }
  pool->b[pool->n++] = (pool_block){p, size, live};
  pool->live += live;
  return GL_OK;
}

/* a free block of exactly `size` (a class size) from the pool */
static int pool_take_locked(gl_alloc_pool *pool, int64_t size, void **out) {
  for (int64_t i = 0; i < pool->n; i++)
    if (!pool->b[i].live && pool->b[i].size == size) {
      pool->b[i].live = 1;
      pool->live++;
      *out = pool->b[i].ptr;
      return 1;
    }
  return 0;
}

static void pool_unlink_free_locked(dev_cache *c, gl_alloc_pool *pool) {
  for (gl_alloc_pool **pp = &c->pools; *pp; pp = &(*pp)->next)
    if (*pp == pool) { *pp = pool->next; break; }
  free(pool->b);
  free(pool);
}

/* p is a block of one of c's pools: marked free there, or, the pool
   released, handed to the shared cache.  0 when no pool has p. */
static int pool_give_back_locked(dev_cache *c, void *p) {
  for (gl_alloc_pool *pool = c->pools; pool; pool = pool->next)
    for (int64_t i = 0; i < pool->n; i++) {
      if (pool->b[i].ptr != p || !pool->b[i].live) continue;
      pool->b[i].live = 0;
      pool->live--;
      if (pool->released) {
        int64_t size = pool->b[i].size;
        pool->b[i] = pool->b[--pool->n];
        cache_block_locked(c, pool->device, p, size, size_class(&size));
        if (pool->n == 0) pool_unlink_free_locked(c, pool);
      }
      return 1;
    }
  return 0;
}

gl_alloc_pool *gl_alloc_pool_open(int device) {
  dev_cache *c = cache_for(device);
  if (!c || device < 0) { gl_error("gl_alloc_pool_open: device %d is not a CUDA device", device); return NULL; }
  gl_alloc_pool *pool = calloc(1, sizeof *pool);
  if (!pool) { gl_error("gl_alloc_pool_open: out of host memory"); return NULL; }
  pool->device = device;
  pthread_mutex_lock(&c->mu);
  if (c->open_pool) {
    pthread_mutex_unlock(&c->mu);
    free(pool);
    gl_error("gl_alloc_pool_open: cuda:%d already has a capture running", device);
    return NULL;
  }
  pool->next = c->pools;
  c->pools = pool;
  c->open_pool = pool;
  pthread_mutex_unlock(&c->mu);
  return pool;
}

void gl_alloc_pool_close(int device) {
  dev_cache *c = cache_for(device);
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  c->open_pool = NULL;
  pthread_mutex_unlock(&c->mu);
}

void gl_alloc_pool_release(gl_alloc_pool *pool) {
  if (!pool) return;
  dev_cache *c = cache_for(pool->device);
  pthread_mutex_lock(&c->mu);
  if (c->open_pool == pool) c->open_pool = NULL;
  pool->released = 1;
  for (int64_t i = 0; i < pool->n;) {
    if (pool->b[i].live) { i++; continue; }
    int64_t size = pool->b[i].size;
    void *p = pool->b[i].ptr;
    pool->b[i] = pool->b[--pool->n];
    cache_block_locked(c, pool->device, p, size, size_class(&size));
  }
  if (pool->n == 0) pool_unlink_free_locked(c, pool);
  pthread_mutex_unlock(&c->mu);
}

int64_t gl_alloc_pool_bytes(const gl_alloc_pool *pool) {
  int64_t n = 0;
  for (int64_t i = 0; i < pool->n; i++) n += pool->b[i].size;
  return n;
}

/* A block of class size *size from c: from the open graph pool, cached, or
   fresh from the system. */
static int take_block(dev_cache *c, int device, int64_t nbytes, void **out, int64_t *capacity) {
  int meta = is_meta(c);
  int64_t size = nbytes;
  int k = size_class(&size);
  pthread_mutex_lock(&c->mu);
  block **pp = &c->free_lists[k];
  void *p = NULL;
  gl_alloc_pool *pool = c->open_pool;
  if (pool && pool_take_locked(pool, size, &p)) {
    c->st.cache_hits++;
  } else if (pool) {  /* a fresh block for the pool, never one of the shared cache */
    pthread_mutex_unlock(&c->mu);
    int rc = raw_alloc(device, meta, size, &p);
    if (rc != GL_OK) return rc;
    pthread_mutex_lock(&c->mu);
    if (pool_add_locked(pool, p, size, 1) != GL_OK) {
      pthread_mutex_unlock(&c->mu);
      raw_free(device, meta, p);
      return gl_error("gl_empty: out of host memory for the graph pool's block table");
    }
    c->st.reserved += size;
  } else if (*pp) {
    block *b = *pp; *pp = b->next;
    p = b->ptr;
    b->next = c->spare; c->spare = b;
    c->st.cache_hits++;
  } else {
    pthread_mutex_unlock(&c->mu);
    int rc = raw_alloc(device, meta, size, &p);
    if (rc != GL_OK) {  /* free everything cached and retry once */
      pthread_mutex_lock(&c->mu);
      release_cached(c, device);
      pthread_mutex_unlock(&c->mu);
      char msg[512];
      snprintf(msg, sizeof msg, "%s", gl_last_error());
      if (raw_alloc(device, meta, size, &p) != GL_OK) {
        gl_mem_stats st = c->st;
        return gl_error("%s (in use %lld bytes, reserved %lld bytes)", msg,
                        (long long)st.allocated, (long long)st.reserved);
      }
    }
    pthread_mutex_lock(&c->mu);
    c->st.reserved += size;
  }
  c->st.allocated += size;
  c->st.n_allocs++;
  c->st.n_live++;
  if (c->st.allocated > c->st.peak) c->st.peak = c->st.allocated;
  pthread_mutex_unlock(&c->mu);
  *out = p;
  *capacity = size;
  return GL_OK;
}

static void give_block(dev_cache *c, int device, void *p, int64_t capacity) {
  int64_t size = capacity;
  int k = size_class(&size);
  if (size != capacity) gl_panic("gl_dealloc: capacity %lld is not a class size", (long long)capacity);
  pthread_mutex_lock(&c->mu);
  if ((c->pools && pool_give_back_locked(c, p))   /* a pool's block: back to its pool (or the cache) */
      || (c->open_pool && pool_add_locked(c->open_pool, p, size, 0) == GL_OK)) {  /* the graph still uses it */
    ;
  } else {
    cache_block_locked(c, device, p, size, k);
  }
  c->st.allocated -= size;
  c->st.n_frees++;
  c->st.n_live--;
  pthread_mutex_unlock(&c->mu);
}

static void cache_block_locked(dev_cache *c, int device, void *p, int64_t size, int k) {
  block *b = c->spare;
  if (b) c->spare = b->next;
  else b = malloc(sizeof *b);
  if (!b) { /* cannot cache: give it back */
    raw_free(device, is_meta(c), p);
    c->st.reserved -= size;
  } else {
    b->ptr = p; b->size = size; b->next = c->free_lists[k]; c->free_lists[k] = b;
  }
}

/* Allocate nbytes on device; *capacity receives the block size.  kind
   (gl_meta_kind): 1 a meta block (*out NULL), 2 a real block charged to
   the meta twin too. */
int gl_alloc(int device, int kind, int64_t nbytes, void **out, int64_t *capacity) {
  dev_cache *c = cache_for(device);
  if (!c) return gl_error("gl_empty: device %d out of range", device);
  dev_cache *twin = &meta_caches[c - caches];
  if (kind == 1) return take_block(twin, device, nbytes, out, capacity);
  GL_TRY(take_block(c, device, nbytes, out, capacity));
  if (kind == 2) {
    void *none;
    int64_t cap;
    take_block(twin, device, nbytes, &none, &cap);
  }
#ifdef GL_SIM
  if (device >= 0) *out = sim_place_end(*out, *capacity, nbytes);
#endif
  return GL_OK;
}

void gl_dealloc(int device, int kind, void *p, int64_t capacity) {
  dev_cache *c = cache_for(device);
  if (!c) return;
  dev_cache *twin = &meta_caches[c - caches];
  if (kind == 1) { give_block(twin, device, NULL, capacity); return; }
  if (!p) return;
  if (kind == 2) give_block(twin, device, NULL, capacity);
#ifdef GL_SIM
  if (device >= 0) p = sim_block_of(p);
#endif
  give_block(c, device, p, capacity);
}

int gl_mem_stats_get(int device, gl_mem_stats *out) {
  GL_NONNULL("gl_mem_stats_get", out);
  dev_cache *c = stats_for(device);
  if (!c) return gl_error("gl_mem_stats_get: device %d out of range", device);
  pthread_mutex_lock(&c->mu);
  *out = c->st;
  pthread_mutex_unlock(&c->mu);
  return GL_OK;
}

int gl_mem_reset_peak(int device) {
  dev_cache *c = stats_for(device);
  if (!c) return gl_error("gl_mem_reset_peak: device %d out of range", device);
  pthread_mutex_lock(&c->mu);
  c->st.peak = c->st.allocated;
  pthread_mutex_unlock(&c->mu);
  return GL_OK;
}

int gl_empty_cache(int device) {
  dev_cache *c = stats_for(device);
  if (!c) return gl_error("gl_empty_cache: device %d out of range", device);
  pthread_mutex_lock(&c->mu);
  release_cached(c, device);
  pthread_mutex_unlock(&c->mu);
  return GL_OK;
}

/* Forgets the meta twin of device: statistics to zero, cache emptied (a
   new plan starts from an empty allocator).  Refused while meta storages
   of it are alive. */
int gl_meta_reset(int device) {
  dev_cache *c = cache_for(device);
  if (!c) return gl_error("gl_meta_reset: device %d out of range", device);
  dev_cache *m = &meta_caches[c - caches];
  pthread_mutex_lock(&m->mu);
  int64_t live = m->st.n_live;
  if (live == 0) {
    release_cached(m, device);
    memset(&m->st, 0, sizeof m->st);
  }
  pthread_mutex_unlock(&m->mu);
  if (live) return gl_error("gl_meta_reset: %lld meta storages of device %d are still alive", (long long)live, device);
  return GL_OK;
}
