/* tokenizer_internal.h — what the tokenizer's three files share: the object,
 * its small containers (growable arrays, heaps, hash maps), the regex
 * splitter and the merge loop.  Private to engine/tokenizer*.c; the public
 * interface is gl_tok_* and gl_bpe_trainer_* in gptlua.h. */
#ifndef GL_TOKENIZER_INTERNAL_H
#define GL_TOKENIZER_INTERNAL_H
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "internal.h"

/* shared between the files of the tokenizer, not exported from the library */
#define TOK_PRIVATE __attribute__((visibility("hidden")))

TOK_PRIVATE extern const char GPT4_PATTERN[];

/* ------------------------------------------------------------- helpers */

/* Grows *p (elements of size elem) to hold at least need; doubling. */
static inline int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
  if (need <= *cap) return 0;
  int64_t c = *cap ? *cap : 16;
  while (c < need) c *= 2;
  void *q = realloc(*p, (size_t)c * elem);
  if (!q) return -1;
  *p = q; *cap = c;
  return 0;
}
#define GROW(arr, cap, need) grow((void **)&(arr), &(cap), (need), sizeof(*(arr)))
/* Resizes *p to n elements (parallel arrays sharing one capacity). */
static inline int resize(void **p, int64_t n, size_t elem) {
  void *q = realloc(*p, (size_t)n * elem);
  if (!q) return -1;
  *p = q;
  return 0;
}

/* Binary heaps: DEFINE_HEAP(name, T, before) makes name_push(&arr, &n, &cap, x)
   and name_pop(arr, &n); before(a, b) is true when a must come out first. */
#define DEFINE_HEAP(name, T, before)                                                   \
  static inline int name##_push(T **arr, int64_t *n, int64_t *cap, T x) {                     \
    if (grow((void **)arr, cap, *n + 1, sizeof(T))) return -1;                         \
    T *h = *arr;                                                                       \
    int64_t i = (*n)++;                                                                \
    while (i > 0) {                                                                    \
      int64_t p = (i - 1) / 2;                                                         \
      if (!before(x, h[p])) break;                                                     \
      h[i] = h[p]; i = p;                                                              \
    }                                                                                  \
    h[i] = x;                                                                          \
    return 0;                                                                          \
  }                                                                                    \
  static inline T name##_pop(T *h, int64_t *n) {                                              \
    T top = h[0], v = h[--*n];                                                         \
    int64_t i = 0, m = *n;                                                             \
    for (;;) {                                                                         \
      int64_t c = 2 * i + 1;                                                           \
      if (c >= m) break;                                                               \
      if (c + 1 < m && before(h[c + 1], h[c])) c++;                                    \
      if (!before(h[c], v)) break;                                                     \
      h[i] = h[c]; i = c;                                                              \
    }                                                                                  \
    if (m > 0) h[i] = v;                                                               \
    return top;                                                                        \
  }

/* encoding: (rank << 32 | position), lowest first */
static inline int u64_less(uint64_t a, uint64_t b) { return a < b; }
DEFINE_HEAP(rankheap, uint64_t, u64_less)
/* training: (count, pair key), most frequent first, ties to the smallest pair */
typedef struct { int64_t count; uint64_t key; } heap_item;
static inline int heap_before(heap_item a, heap_item b) {
  return a.count > b.count || (a.count == b.count && a.key < b.key);
}
DEFINE_HEAP(pairheap, heap_item, heap_before)

typedef struct { int32_t *v; int64_t n, cap; } i32vec;
static inline int i32vec_push(i32vec *a, int32_t x) {
  if (a->n == a->cap && GROW(a->v, a->cap, a->n + 1)) return -1;
  a->v[a->n++] = x;
  return 0;
}

static inline uint64_t mix64(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}
static inline uint64_t hash_bytes(const uint8_t *p, int64_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w; memcpy(&w, p, 8);
    h = (h ^ w) * 0xbf58476d1ce4e5b9ULL; h ^= h >> 29;
  }
  uint64_t w = 0; memcpy(&w, p, (size_t)n);
  return mix64(h ^ w);
}
static inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

/* uint64 -> int32 open-addressing map (pairs); UINT64_MAX marks empty. */
typedef struct { uint64_t *keys; int32_t *vals; int64_t cap, n; } pairmap;

static inline int pairmap_init(pairmap *m, int64_t cap) {
  int64_t c = 64;
  while (c < cap * 2) c *= 2;
  m->keys = malloc((size_t)c * sizeof(uint64_t));
  m->vals = malloc((size_t)c * sizeof(int32_t));
  if (!m->keys || !m->vals) { free(m->keys); free(m->vals); m->keys = NULL; m->vals = NULL; return -1; }
  memset(m->keys, 0xff, (size_t)c * sizeof(uint64_t));
  m->cap = c; m->n = 0;
  return 0;
}
static inline void pairmap_free(pairmap *m) { free(m->keys); free(m->vals); memset(m, 0, sizeof *m); }
static inline int32_t pairmap_get(const pairmap *m, uint64_t k) {
  uint64_t mask = (uint64_t)m->cap - 1;
  for (uint64_t i = mix64(k) & mask;; i = (i + 1) & mask) {
    if (m->keys[i] == k) return m->vals[i];
    if (m->keys[i] == UINT64_MAX) return -1;
  }
}
/* value slot for k, inserted (value -1) if absent; NULL when out of memory */
static inline int32_t *pairmap_slot(pairmap *m, uint64_t k, int *created) {
  if ((m->n + 1) * 2 > m->cap) {
    pairmap old = *m;
    if (pairmap_init(m, old.cap)) { *m = old; return NULL; }
    for (int64_t i = 0; i < old.cap; i++)
      if (old.keys[i] != UINT64_MAX) { int c; *pairmap_slot(m, old.keys[i], &c) = old.vals[i]; }
    pairmap_free(&old);
  }
  uint64_t mask = (uint64_t)m->cap - 1;
  for (uint64_t i = mix64(k) & mask;; i = (i + 1) & mask) {
    if (m->keys[i] == k) { *created = 0; return &m->vals[i]; }
    if (m->keys[i] == UINT64_MAX) {
      m->keys[i] = k; m->vals[i] = -1; m->n++; *created = 1;
      return &m->vals[i];
    }
  }
}

/* byte string -> int64 map with its own arena (chunk counts, token ids). */
typedef struct { uint64_t hash; int64_t off; int64_t val; int32_t len; int32_t used; } bm_entry;
typedef struct { bm_entry *e; int64_t cap, n; uint8_t *arena; int64_t arena_n, arena_cap; } bytemap;

static inline int bytemap_init(bytemap *m, int64_t cap) {
  int64_t c = 64;
  while (c < cap * 2) c *= 2;
  memset(m, 0, sizeof *m);
  m->e = calloc((size_t)c, sizeof(bm_entry));
  if (!m->e) return -1;
  m->cap = c;
  return 0;
}
static inline void bytemap_free(bytemap *m) { free(m->e); free(m->arena); memset(m, 0, sizeof *m); }
static inline bm_entry *bytemap_find(const bytemap *m, const uint8_t *s, int64_t len, uint64_t h) {
  uint64_t mask = (uint64_t)m->cap - 1;
  for (uint64_t i = h & mask;; i = (i + 1) & mask) {
    bm_entry *e = &m->e[i];
    if (!e->used) return e;
    if (e->hash == h && e->len == len && memcmp(m->arena + e->off, s, (size_t)len) == 0) return e;
  }
}
static inline int64_t bytemap_get(const bytemap *m, const uint8_t *s, int64_t len) {
  bm_entry *e = bytemap_find(m, s, len, hash_bytes(s, len));
  return e->used ? e->val : -1;
}
/* entry for s, inserted with val 0 if absent; NULL when out of memory */
static inline bm_entry *bytemap_slot(bytemap *m, const uint8_t *s, int64_t len) {
  if ((m->n + 1) * 2 > m->cap) {
    bm_entry *old = m->e; int64_t oldcap = m->cap, c = m->cap * 2;
    bm_entry *ne = calloc((size_t)c, sizeof(bm_entry));
    if (!ne) return NULL;
    m->e = ne; m->cap = c;
    for (int64_t i = 0; i < oldcap; i++) {
      if (!old[i].used) continue;
      uint64_t mask = (uint64_t)c - 1, j = old[i].hash & mask;
      while (ne[j].used) j = (j + 1) & mask;
      ne[j] = old[i];
    }
    free(old);
  }
  uint64_t h = hash_bytes(s, len);
  bm_entry *e = bytemap_find(m, s, len, h);
  if (e->used) return e;
  if (GROW(m->arena, m->arena_cap, m->arena_n + len)) return NULL;
  memcpy(m->arena + m->arena_n, s, (size_t)len);
  e->hash = h; e->off = m->arena_n; e->len = (int32_t)len; e->val = 0; e->used = 1;
  m->arena_n += len; m->n++;
  return e;
}

/* ------------------------------------------------------------ the regex */

/* What went wrong inside a worker (gl_error is thread-local, so workers
   describe the failure and the calling thread reports it). */
enum { ENC_OK = 0, ENC_NOMEM, ENC_BYTE, ENC_REGEX, ENC_TOO_LONG };
typedef struct { int kind; int value; int64_t offset; } enc_err;

/* Per-thread regex state: match data and a JIT stack big enough for long
   runs of one character class. */
typedef struct {
  const pcre2_code *re;
  pcre2_match_data *md;
  pcre2_match_context *mctx;
  pcre2_jit_stack *jstack;
} splitter;

/* Calls fn for every chunk of text in order; chunks tile the text.  No
   pattern: the whole text is one chunk. */
typedef int (*chunk_fn)(void *ud, const uint8_t *s, int64_t n, int64_t off);

/* ------------------------------------------------------------ the object */

struct gl_tokenizer {
  int is_char;
  int safe_split;            /* char, or the GPT-4 pattern: gl_tok_safe_cut holds */
  int32_t n_ordinary, n_special;
  int32_t byte_id[256];      /* id of each single-byte token, -1 if none */
  int32_t *left, *right;     /* per ordinary id: its merge, -1 for base tokens */
  int32_t *merge_ids; int32_t n_merges; int64_t merge_cap; /* in rank order */
  pairmap pairs;             /* pair_key(left, right) -> merged id (= its rank) */
  int64_t *tok_off; int32_t *tok_len; int64_t tok_cap;     /* every id's bytes */
  uint8_t *blob; int64_t blob_n, blob_cap;
  char *pattern;             /* NULL: no splitting */
  char unicode_version[24];  /* of the tables it was made with (PCRE2's) */
  pcre2_code *re;
};

/* Per-thread scratch for the heap merge of long chunks. */
typedef struct {
  int32_t *next, *prev; int64_t link_cap;
  uint64_t *heap; int64_t heap_n, heap_cap;
} merge_scratch;

enum { PARALLEL_MIN_BYTES = 1 << 20 };  /* texts below this are encoded on one thread */

TOK_PRIVATE pcre2_code *compile_pattern(const char *fn, const char *pattern);
TOK_PRIVATE int splitter_init(splitter *sp, const pcre2_code *re);
TOK_PRIVATE void splitter_free(splitter *sp);
TOK_PRIVATE int split_text(splitter *sp, const uint8_t *text, int64_t len, chunk_fn fn, void *ud, enc_err *err);
TOK_PRIVATE gl_tokenizer *tok_new(const char *fn, const char *pattern, int is_char);
TOK_PRIVATE int32_t tok_push(gl_tokenizer *t, const uint8_t *s, int64_t len, int32_t left, int32_t right);
TOK_PRIVATE int32_t tok_add_merge(gl_tokenizer *t, int32_t a, int32_t b);
TOK_PRIVATE int tok_add_specials(const char *fn, gl_tokenizer *t, int n, const char *const *names);
TOK_PRIVATE void merge_scratch_free(merge_scratch *s);
TOK_PRIVATE int64_t bpe_merge(const gl_tokenizer *t, int32_t *ids, int64_t n, merge_scratch *s);
TOK_PRIVATE int report_enc_err(const char *fn, const enc_err *err, int doc);
TOK_PRIVATE int check_tok(const char *fn, const gl_tokenizer *t);
TOK_PRIVATE int check_text(const char *fn, const char *text, int64_t len);
TOK_PRIVATE int tok_derive_merges(const char *fn, const char *path, gl_tokenizer *t);
TOK_PRIVATE int64_t *make_cuts(const uint8_t *s, int64_t len, int nthreads, int64_t *npieces);

#endif
