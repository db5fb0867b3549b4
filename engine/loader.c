/* loader.c — asynchronous, deterministic, rank-aware batch loader.
 *
 * The data is a list of sources (mapped shards, in-memory token tensors or a
 * virtual source of uniform random tokens).  A "window" is T+1 consecutive
 * tokens of one source; row (x, y) = (window[0..T), window[1..T+1)).
 *
 * Global row g of the stream reads window w(g):
 *   sequential: w = g mod n_windows, windows of one source at stride T in
 *               order (the last token of a window is the first of the next);
 *   random:     w = uniform(n_windows) drawn from Philox(seed, counter g),
 *               windows at every start (nanoGPT's get_batch).
 * With bos_aligned the windows are instead the BOS positions (random: every
 * BOS with T+1 tokens after it in its source; sequential: greedy rows, each
 * starting at the first BOS at or after the previous row's last token, so a
 * document cut at a row's end loses its remainder).
 *
 * Rank r of world N with per-rank batch B takes, for the k-th batch since
 * start(sample), rows sample + k*B*N + r*B + [0, B).  A pthread producer
 * fills a ring of `prefetch` slots in that order; next() hands the filled
 * slot's tensors to the caller and puts fresh ones (from the caching
 * allocator, on the caller's thread) in their place, so nothing is copied and
 * the producer never touches memory the caller owns.
 *
 * For a CUDA device (gl_loader_pin_memory) the batches live in pinned host
 * memory, so the caller's host-to-device copy is a DMA that does not block
 * (gl_copy_async).  Pinning is expensive, so those buffers are recycled: the
 * loader keeps a reference to every pinned buffer it made, and a buffer
 * whose only reference left is the loader's (the caller and its copy have
 * let go) is handed out again. */
#define _GNU_SOURCE /* SCHED_BATCH */
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include "backend.h"

enum { SRC_MEM = 0, SRC_SHARD = 1, SRC_RANDOM = 2 };
enum { STREAM_WINDOW = 0x77696e64u, STREAM_TOKENS = 0x746f6b73u }; /* Philox counter word 2 */

typedef struct {
  int kind;
  int width;             /* bytes per token: 2 (uint16), 4 (uint32/int32 >= 0), 8 (int64) */
  const void *data;
  int64_t n;
  gl_shard *shard;       /* owned, SRC_SHARD only */
} source;

typedef struct {
  gl_tensor *x, *y;
  int full;
} slot;

struct gl_loader {
  gl_loader_config cfg;
  source *src; int nsrc, src_cap;
  int64_t n_tokens;
  /* window tables, built by the first start() */
  int ready;
  int64_t *tok_prefix;   /* nsrc + 1: tokens before source s */
  int64_t *win_prefix;   /* nsrc + 1: windows before source s (not bos_aligned) */
  int64_t *starts;       /* bos_aligned: global token position of each window */
  int64_t n_windows;
  /* producer */
  slot *ring;
  pthread_t thread;
  int running, stop;
  pthread_mutex_t mu;
  pthread_cond_t can_fill, can_take;
  int64_t produced, consumed;  /* batches since the last start() */
  int64_t start_sample;
  double last_wait;
  /* pinned batches (gl_loader_pin_memory): every buffer made so far */
  int pinned;
  gl_tensor **pool;
  int npool;
};

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------ tokens */

/* tokens [off, off+n) of s as int64 */
static void read_tokens(const gl_loader *L, const source *s, int64_t off, int64_t n, int64_t *dst) {
  switch (s->kind == SRC_RANDOM ? 0 : s->width) {
  case 2: { const uint16_t *p = (const uint16_t *)s->data + off; for (int64_t i = 0; i < n; i++) dst[i] = p[i]; break; }
  case 4: { const uint32_t *p = (const uint32_t *)s->data + off; for (int64_t i = 0; i < n; i++) dst[i] = p[i]; break; }
  case 8: memcpy(dst, (const int64_t *)s->data + off, (size_t)n * sizeof(int64_t)); break;
  default: { /* random: token p = Philox word p of the tokens stream, scaled to [0, vocab) */
    uint64_t seed = L->cfg.seed, v = (uint64_t)L->cfg.vocab_size;
    uint32_t r[4];
    for (int64_t i = 0; i < n;) {
      uint64_t p = (uint64_t)(off + i), blk = p >> 2;
      gl_philox4x32((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)blk, (uint32_t)(blk >> 32), STREAM_TOKENS, 0, r);
      for (unsigned k = (unsigned)(p & 3); k < 4 && i < n; k++, i++) dst[i] = (int64_t)(((uint64_t)r[k] * v) >> 32);
    }
  }
  }
}

/* ------------------------------------------------------------ windows */

static int64_t windows_in(const gl_loader *L, int64_t n) {
  int64_t T = L->cfg.block_size;
  if (n < T + 1) return 0;
  return L->cfg.sampling == GL_SAMPLE_SEQUENTIAL ? (n - 1) / T : n - T;
}

/* largest s with prefix[s] <= v (prefix non-decreasing, prefix[0] = 0) */
static int find_source(const int64_t *prefix, int nsrc, int64_t v) {
  int lo = 0, hi = nsrc - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

static uint64_t draw64(uint64_t seed, int64_t g) {
  uint32_t r[4];
  gl_philox4x32((uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)g, (uint32_t)((uint64_t)g >> 32), STREAM_WINDOW, 0, r);
  return (uint64_t)r[0] | (uint64_t)r[1] << 32;
}

/* window read by global row g */
static void locate(const gl_loader *L, int64_t g, int *s, int64_t *off) {
  int64_t w = L->cfg.sampling == GL_SAMPLE_SEQUENTIAL
                  ? g % L->n_windows
                  : (int64_t)(((unsigned __int128)draw64(L->cfg.seed, g) * (uint64_t)L->n_windows) >> 64);
  if (L->cfg.bos_aligned) {
    int64_t pos = L->starts[w];
    *s = find_source(L->tok_prefix, L->nsrc, pos);
    *off = pos - L->tok_prefix[*s];
  } else {
    *s = find_source(L->win_prefix, L->nsrc, w); /* never one without windows: w < total */
    int64_t local = w - L->win_prefix[*s];
    *off = L->cfg.sampling == GL_SAMPLE_SEQUENTIAL ? local * L->cfg.block_size : local;
  }
}

static int build_tables(gl_loader *L) {
  const char *fn = "gl_loader_start";
  int64_t T = L->cfg.block_size;
  L->tok_prefix = calloc((size_t)L->nsrc + 1, sizeof(int64_t));
  L->win_prefix = calloc((size_t)L->nsrc + 1, sizeof(int64_t));
  if (!L->tok_prefix || !L->win_prefix) return gl_error("%s: out of memory", fn);
  int64_t longest = 0;
  for (int s = 0; s < L->nsrc; s++) {
    L->tok_prefix[s + 1] = L->tok_prefix[s] + L->src[s].n;
    L->win_prefix[s + 1] = L->win_prefix[s] + windows_in(L, L->src[s].n);
    if (L->src[s].n > longest) longest = L->src[s].n;
  }
  if (!L->cfg.bos_aligned) {
    L->n_windows = L->win_prefix[L->nsrc];
    if (L->n_windows == 0)
      return gl_error("%s: no source has block_size + 1 = %lld tokens (the longest has %lld)", fn,
                      (long long)(T + 1), (long long)longest);
    return GL_OK;
  }
  /* bos_aligned: collect row starts, scanning each source in blocks */
  enum { BLOCK = 1 << 16 };
  int64_t *buf = malloc(BLOCK * sizeof(int64_t)), cap = 0, n = 0;
  if (!buf) return gl_error("%s: out of memory", fn);
  int seq = L->cfg.sampling == GL_SAMPLE_SEQUENTIAL;
  for (int s = 0; s < L->nsrc; s++) {
    const source *src = &L->src[s];
    int64_t next_ok = 0;   /* sequential: earliest start of the next row */
    for (int64_t b = 0; b + T + 1 <= src->n; b += BLOCK) {
      int64_t m = src->n - T - b < BLOCK ? src->n - T - b : BLOCK; /* starts p with p + T + 1 <= n */
      read_tokens(L, src, b, m, buf);
      for (int64_t i = 0; i < m; i++) {
        if (buf[i] != L->cfg.bos_id || b + i < next_ok) continue;
        if (n == cap) {
          cap = cap ? 2 * cap : 1024;
          int64_t *q = realloc(L->starts, (size_t)cap * sizeof(int64_t));
          if (!q) { free(buf); return gl_error("%s: out of memory", fn); }
          L->starts = q;
        }
        L->starts[n++] = L->tok_prefix[s] + b + i;
        if (seq) next_ok = b + i + T;
      }
    }
  }
  free(buf);
  L->n_windows = n;
  if (n == 0)
    return gl_error("%s: bos_aligned: no BOS token (id %lld) has block_size + 1 = %lld tokens after it in its source",
                    fn, (long long)L->cfg.bos_id, (long long)(T + 1));
  return GL_OK;
}

/* ------------------------------------------------------------ producer */

static void fill(gl_loader *L, int64_t batch, int64_t *x, int64_t *y) {
  int64_t B = L->cfg.batch_size, T = L->cfg.block_size;
  int64_t first = L->start_sample + batch * B * L->cfg.world_size + (int64_t)L->cfg.rank * B;
  for (int64_t i = 0; i < B; i++) {
    int s; int64_t off;
    locate(L, first + i, &s, &off);
    int64_t *xr = x + i * T, *yr = y + i * T;
    read_tokens(L, &L->src[s], off, T, xr);
    memcpy(yr, xr + 1, (size_t)(T - 1) * sizeof(int64_t));
    read_tokens(L, &L->src[s], off + T, 1, yr + T - 1);
  }
}

static void *producer(void *arg) {
  gl_loader *L = arg;
  int K = L->cfg.prefetch;
  /* a batch-class thread does not preempt the trainer when next() wakes it
     on a busy core; best effort, the default policy works too */
  struct sched_param sp = {0};
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);
  pthread_mutex_lock(&L->mu);
  while (!L->stop) {
    slot *sl = &L->ring[L->produced % K];
    if (sl->full) { pthread_cond_wait(&L->can_fill, &L->mu); continue; }
    int64_t batch = L->produced;
    int64_t *x = gl_data_ptr(sl->x), *y = gl_data_ptr(sl->y);
    pthread_mutex_unlock(&L->mu);
    fill(L, batch, x, y);
    pthread_mutex_lock(&L->mu);
    sl->full = 1;
    L->produced++;
    pthread_cond_signal(&L->can_take);
  }
  pthread_mutex_unlock(&L->mu);
  return NULL;
}

static void stop_producer(gl_loader *L) {
  if (!L->running) return;
  pthread_mutex_lock(&L->mu);
  L->stop = 1;
  pthread_cond_broadcast(&L->can_fill);
  pthread_mutex_unlock(&L->mu);
  pthread_join(L->thread, NULL);
  L->running = 0;
}

/* More pinned buffers than this are not kept for reuse: the ring, the
   pair the caller holds and the pairs whose copies are in flight fit. */
static int pool_cap(const gl_loader *L) { return 2 * (L->cfg.prefetch + 4); }

/* A (B, T) int64 host tensor for a ring slot, made on the caller's thread.
   Pinned: a view of a pooled buffer nobody else holds, else a new one. */
static gl_tensor *batch_tensor(gl_loader *L) {
  int64_t shape[2] = {L->cfg.batch_size, L->cfg.block_size};
  if (!L->pinned) return gl_empty_host(GL_I64, 2, shape);
  for (int i = 0; i < L->npool; i++)
    if (__atomic_load_n(&L->pool[i]->storage->refcount, __ATOMIC_ACQUIRE) == 1)
      return gl_as_strided(L->pool[i], 2, L->pool[i]->shape, L->pool[i]->stride, 0);
  gl_tensor *t = gl_empty_pinned(GL_I64, 2, shape);
  if (!t || L->npool == pool_cap(L)) return t;   /* beyond the cap: freed with its last user */
  L->pool[L->npool++] = t;
  return gl_as_strided(t, 2, t->shape, t->stride, 0);
}

/* ------------------------------------------------------------ API */

gl_loader *gl_loader_new(const gl_loader_config *cfg) {
  const char *fn = "gl_loader_new";
  if (!cfg) return gl_error_null("%s: cfg expected, got NULL", fn);
  gl_loader_config c = *cfg;
  if (c.batch_size < 1 || c.block_size < 1 || c.batch_size > ((int64_t)1 << 40) / c.block_size)
    return gl_error_null("%s: batch_size and block_size expected >= 1 (and B*T < 2^40), got %lld and %lld", fn,
                         (long long)c.batch_size, (long long)c.block_size);
  if (c.world_size < 1 || c.rank < 0 || c.rank >= c.world_size)
    return gl_error_null("%s: rank expected in [0, world_size), got rank %d, world_size %d", fn, c.rank, c.world_size);
  if (c.sampling != GL_SAMPLE_RANDOM && c.sampling != GL_SAMPLE_SEQUENTIAL)
    return gl_error_null("%s: sampling expected GL_SAMPLE_RANDOM or GL_SAMPLE_SEQUENTIAL, got %d", fn, c.sampling);
  if (c.bos_aligned && c.bos_id < 0)
    return gl_error_null("%s: bos_aligned needs bos_id >= 0, got %lld", fn, (long long)c.bos_id);
  if (c.vocab_size < 0) return gl_error_null("%s: vocab_size expected >= 0, got %lld", fn, (long long)c.vocab_size);
  if (c.prefetch < 2 || c.prefetch > 64) return gl_error_null("%s: prefetch expected in [2, 64], got %d", fn, c.prefetch);
  gl_loader *L = calloc(1, sizeof *L);
  if (!L) return gl_error_null("%s: out of memory", fn);
  L->cfg = c;
  pthread_mutex_init(&L->mu, NULL);
  pthread_cond_init(&L->can_fill, NULL);
  pthread_cond_init(&L->can_take, NULL);
  return L;
}

static int add_source(gl_loader *L, source s) {
  if (L->ready) return gl_error("gl_loader: sources must be added before the first start");
  if (L->nsrc == L->src_cap) {
    int cap = L->src_cap ? 2 * L->src_cap : 8;
    source *q = realloc(L->src, (size_t)cap * sizeof(source));
    if (!q) return gl_error("gl_loader: out of memory");
    L->src = q; L->src_cap = cap;
  }
  L->src[L->nsrc++] = s;
  L->n_tokens += s.n;
  return GL_OK;
}

/* Batches in pinned host memory, for a loader feeding a CUDA device.
   Before the first start (which makes the ring). */
int gl_loader_pin_memory(gl_loader *L, int on) {
  const char *fn = "gl_loader_pin_memory";
  if (!L) return gl_error("%s: loader expected, got NULL", fn);
  if (L->ready) return gl_error("%s: expected before the first gl_loader_start (the ring already exists)", fn);
  if (on && !gl_cuda_built())
    return gl_error("%s: pinned batches need a CUDA device, but this engine was built without CUDA", fn);
  if (on && gl_cuda_device_count() == 0)
    return gl_error("%s: pinned batches need a CUDA device, but none is available", fn);
  if (on && !L->pool && !(L->pool = calloc((size_t)pool_cap(L), sizeof(gl_tensor *))))
    return gl_error("%s: out of memory", fn);
  L->pinned = on != 0;
  return GL_OK;
}

int gl_loader_add_shard(gl_loader *L, const char *path) {
  GL_NONNULL("gl_loader_add_shard", L, path);
  gl_shard *sh = gl_shard_open(path, L->cfg.vocab_size, L->cfg.shard_format);
  if (!sh) return GL_ERR;
  source s = {SRC_SHARD, gl_shard_token_bytes(sh), gl_shard_data(sh), gl_shard_n_tokens(sh), sh};
  if (add_source(L, s)) { gl_shard_close(sh); return GL_ERR; }
  return GL_OK;
}

int gl_loader_add_tokens(gl_loader *L, const gl_tensor *tokens) {
  const char *fn = "gl_loader_add_tokens";
  if (!L) return gl_error("%s: loader expected, got NULL", fn);
  GL_CHECK_T(tokens, fn, "tokens");
  if (tokens->device != GL_DEVICE_CPU || tokens->ndim != 1 || !gl_is_contiguous(tokens) ||
      (tokens->dtype != GL_U16 && tokens->dtype != GL_I32 && tokens->dtype != GL_I64))
    return gl_error("%s: tokens expected a 1-D contiguous uint16/int32/int64 CPU tensor, got %dD %s", fn,
                    tokens->ndim, gl_dtype_name(tokens->dtype));
  const void *p = gl_data_ptr(tokens);
  int64_t vmax = L->cfg.vocab_size > 0 ? L->cfg.vocab_size : INT64_MAX;
  for (int64_t i = 0; i < tokens->numel; i++) {
    int64_t v = tokens->dtype == GL_U16 ? ((const uint16_t *)p)[i]
              : tokens->dtype == GL_I32 ? ((const int32_t *)p)[i] : ((const int64_t *)p)[i];
    if (v < 0 || v >= vmax)
      return gl_error("%s: tokens[%lld] = %lld, expected in [0, %lld)%s", fn, (long long)(i + 1), (long long)v,
                      (long long)vmax, L->cfg.vocab_size > 0 ? " (the vocab_size the loader was given: the model's)" : "");
  }
  source s = {SRC_MEM, gl_dtype_size(tokens->dtype), p, tokens->numel, NULL};
  return add_source(L, s);
}

int gl_loader_add_random(gl_loader *L, int64_t n_tokens) {
  const char *fn = "gl_loader_add_random";
  if (!L) return gl_error("%s: loader expected, got NULL", fn);
  if (L->cfg.vocab_size < 1) return gl_error("%s: the random source needs vocab_size >= 1 in the config", fn);
  if (L->cfg.vocab_size > 4294967296LL) return gl_error("%s: vocab_size expected <= 2^32, got %lld", fn, (long long)L->cfg.vocab_size);
  if (n_tokens < 1) return gl_error("%s: n_tokens expected >= 1, got %lld", fn, (long long)n_tokens);
  if (L->cfg.bos_aligned) return gl_error("%s: the random source has no documents to align to (bos_aligned)", fn);
  source s = {SRC_RANDOM, 0, NULL, n_tokens, NULL};
  return add_source(L, s);
}

int gl_loader_start(gl_loader *L, int64_t sample) {
  const char *fn = "gl_loader_start";
  if (!L) return gl_error("%s: loader expected, got NULL", fn);
  if (sample < 0) return gl_error("%s: sample expected >= 0, got %lld", fn, (long long)sample);
  if (L->nsrc == 0) return gl_error("%s: no data: add shards, tokens or a random source first", fn);
  if (!L->ready) {
    int rc = build_tables(L);
    if (rc == GL_OK && !(L->ring = calloc((size_t)L->cfg.prefetch, sizeof(slot))))
      rc = gl_error("%s: out of memory", fn);
    for (int k = 0; rc == GL_OK && k < L->cfg.prefetch; k++)
      if (!(L->ring[k].x = batch_tensor(L)) || !(L->ring[k].y = batch_tensor(L))) rc = GL_ERR;
    if (rc != GL_OK) { /* leave the loader as before: a later start may retry */
      if (L->ring)
        for (int k = 0; k < L->cfg.prefetch; k++) { gl_tensor_free(L->ring[k].x); gl_tensor_free(L->ring[k].y); }
      free(L->ring); free(L->tok_prefix); free(L->win_prefix); free(L->starts);
      L->ring = NULL; L->tok_prefix = L->win_prefix = L->starts = NULL;
      return GL_ERR;
    }
    L->ready = 1;
  }
  stop_producer(L);
  for (int k = 0; k < L->cfg.prefetch; k++) L->ring[k].full = 0;
  L->produced = L->consumed = 0;
  L->start_sample = sample;
  L->stop = 0;
  if (pthread_create(&L->thread, NULL, producer, L) != 0) return gl_error("%s: cannot start the loader thread", fn);
  L->running = 1;
  return GL_OK;
}

int gl_loader_next(gl_loader *L, gl_tensor **x, gl_tensor **y) {
  const char *fn = "gl_loader_next";
  if (!L || !x || !y) return gl_error("%s: loader, x and y expected, got NULL", fn);
  if (!L->running) return gl_error("%s: the loader is not started (gl_loader_start)", fn);
  /* the replacements come from the allocator on this thread, before waiting */
  gl_tensor *nx = batch_tensor(L), *ny = nx ? batch_tensor(L) : NULL;
  if (!ny) { gl_tensor_free(nx); return GL_ERR; }
  slot *sl = &L->ring[L->consumed % L->cfg.prefetch];
  double t0 = 0;
  pthread_mutex_lock(&L->mu);
  if (!sl->full) {
    t0 = now_seconds();
    while (!sl->full) pthread_cond_wait(&L->can_take, &L->mu);
  }
  *x = sl->x; *y = sl->y;
  sl->x = nx; sl->y = ny;
  sl->full = 0;
  L->consumed++;
  pthread_mutex_unlock(&L->mu);
  pthread_cond_signal(&L->can_fill);
  L->last_wait = t0 > 0 ? now_seconds() - t0 : 0.0;
  return GL_OK;
}

int64_t gl_loader_sample(const gl_loader *L) {
  if (!L) return gl_error("gl_loader_sample: loader expected, got NULL");
  return L->start_sample + L->consumed * L->cfg.batch_size * L->cfg.world_size;
}

int64_t gl_loader_n_tokens(const gl_loader *L) { return L ? L->n_tokens : gl_error("gl_loader_n_tokens: loader expected, got NULL"); }

int64_t gl_loader_n_windows(const gl_loader *L) {
  if (!L) return gl_error("gl_loader_n_windows: loader expected, got NULL");
  if (!L->ready) return gl_error("gl_loader_n_windows: the loader is not started (gl_loader_start)");
  return L->n_windows;
}

int gl_loader_position(const gl_loader *L, int64_t sample, gl_loader_pos *out) {
  const char *fn = "gl_loader_position";
  if (!L || !out) return gl_error("%s: loader and out expected, got NULL", fn);
  if (!L->ready) return gl_error("%s: the loader is not started (gl_loader_start)", fn);
  if (sample < 0) return gl_error("%s: sample expected >= 0, got %lld", fn, (long long)sample);
  int s; int64_t off;
  locate(L, sample, &s, &off);
  out->source = s;
  out->offset = off;
  out->epoch = L->cfg.sampling == GL_SAMPLE_SEQUENTIAL
                   ? sample / L->n_windows
                   : (int64_t)((double)sample * (double)L->cfg.block_size / (double)L->n_tokens);
  return GL_OK;
}

double gl_loader_last_wait(const gl_loader *L) {
  GL_NONNULL("gl_loader_last_wait", L);  /* -1: an error */
  return L->last_wait;
}

void gl_loader_free(gl_loader *L) {
  if (!L) return;
  stop_producer(L);
  if (L->ring)
    for (int k = 0; k < L->cfg.prefetch; k++) { gl_tensor_free(L->ring[k].x); gl_tensor_free(L->ring[k].y); }
  for (int s = 0; s < L->nsrc; s++) gl_shard_close(L->src[s].shard);
  /* pinned buffers still held by the caller or a copy live on (refcount) */
  for (int i = 0; i < L->npool; i++) gl_tensor_free(L->pool[i]);
  free(L->pool);
  free(L->src); free(L->ring);
  free(L->tok_prefix); free(L->win_prefix); free(L->starts);
  pthread_mutex_destroy(&L->mu);
  pthread_cond_destroy(&L->can_fill);
  pthread_cond_destroy(&L->can_take);
  free(L);
}
