/* tokenizer.c — byte-level BPE (GPT-4 style) and character tokenizers.
 *
 * Encoding a text: the regex (PCRE2, JIT-compiled, UTF + UCP, invalid UTF-8
 * allowed) splits it into chunks; bytes between matches (invalid UTF-8) form
 * chunks of their own, so every byte is covered.  Each chunk starts as its
 * byte ids and is merged by rank: the pair with the lowest merged id first,
 * all its occurrences left to right — exactly what training did, so encode
 * reproduces the training segmentation.  Short chunks use a plain scan, long
 * ones (a megabyte of spaces) a heap so the cost stays O(n log n).
 *
 * Training (gl_bpe_trainer) counts unique chunks, then merges the most
 * frequent pair repeatedly, keeping pair counts up to date incrementally: each
 * pair knows the words it occurs in, a merge rewrites only those words and
 * applies count deltas for their neighbours; a lazy max-heap picks the next
 * pair (stale entries are re-pushed with their current count when popped).
 *
 * Files: tiktoken's format (base64 token bytes, space, rank, per line) plus a
 * JSON sidecar for the type, pattern and special tokens. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <cjson/cJSON.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include "internal.h"

static const char GPT4_PATTERN[] =
  "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*"
  "|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+";

const char *gl_tok_gpt4_pattern(void) { return GPT4_PATTERN; }

/* ------------------------------------------------------------- helpers */

/* Grows *p (elements of size elem) to hold at least need; doubling. */
static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
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
static int resize(void **p, int64_t n, size_t elem) {
  void *q = realloc(*p, (size_t)n * elem);
  if (!q) return -1;
  *p = q;
  return 0;
}

/* Binary heaps: DEFINE_HEAP(name, T, before) makes name_push(&arr, &n, &cap, x)
   and name_pop(arr, &n); before(a, b) is true when a must come out first. */
#define DEFINE_HEAP(name, T, before)                                                   \
  static int name##_push(T **arr, int64_t *n, int64_t *cap, T x) {                     \
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
  static T name##_pop(T *h, int64_t *n) {                                              \
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
static uint64_t hash_bytes(const uint8_t *p, int64_t n) {
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

static int pairmap_init(pairmap *m, int64_t cap) {
  int64_t c = 64;
  while (c < cap * 2) c *= 2;
  m->keys = malloc((size_t)c * sizeof(uint64_t));
  m->vals = malloc((size_t)c * sizeof(int32_t));
  if (!m->keys || !m->vals) { free(m->keys); free(m->vals); m->keys = NULL; m->vals = NULL; return -1; }
  memset(m->keys, 0xff, (size_t)c * sizeof(uint64_t));
  m->cap = c; m->n = 0;
  return 0;
}
static void pairmap_free(pairmap *m) { free(m->keys); free(m->vals); memset(m, 0, sizeof *m); }
static inline int32_t pairmap_get(const pairmap *m, uint64_t k) {
  uint64_t mask = (uint64_t)m->cap - 1;
  for (uint64_t i = mix64(k) & mask;; i = (i + 1) & mask) {
    if (m->keys[i] == k) return m->vals[i];
    if (m->keys[i] == UINT64_MAX) return -1;
  }
}
/* value slot for k, inserted (value -1) if absent; NULL when out of memory */
static int32_t *pairmap_slot(pairmap *m, uint64_t k, int *created) {
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

static int bytemap_init(bytemap *m, int64_t cap) {
  int64_t c = 64;
  while (c < cap * 2) c *= 2;
  memset(m, 0, sizeof *m);
  m->e = calloc((size_t)c, sizeof(bm_entry));
  if (!m->e) return -1;
  m->cap = c;
  return 0;
}
static void bytemap_free(bytemap *m) { free(m->e); free(m->arena); memset(m, 0, sizeof *m); }
static bm_entry *bytemap_find(const bytemap *m, const uint8_t *s, int64_t len, uint64_t h) {
  uint64_t mask = (uint64_t)m->cap - 1;
  for (uint64_t i = h & mask;; i = (i + 1) & mask) {
    bm_entry *e = &m->e[i];
    if (!e->used) return e;
    if (e->hash == h && e->len == len && memcmp(m->arena + e->off, s, (size_t)len) == 0) return e;
  }
}
static int64_t bytemap_get(const bytemap *m, const uint8_t *s, int64_t len) {
  bm_entry *e = bytemap_find(m, s, len, hash_bytes(s, len));
  return e->used ? e->val : -1;
}
/* entry for s, inserted with val 0 if absent; NULL when out of memory */
static bm_entry *bytemap_slot(bytemap *m, const uint8_t *s, int64_t len) {
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

static pcre2_code *compile_pattern(const char *fn, const char *pattern) {
  int errcode; PCRE2_SIZE erroff;
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                 PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &errcode, &erroff, NULL);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(errcode, msg, sizeof msg);
    gl_error("%s: pattern does not compile at offset %zu: %s", fn, (size_t)erroff, (char *)msg);
    return NULL;
  }
  /* without JIT support PCRE2 falls back to its interpreter: slower, same result */
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
  return re;
}

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

static int splitter_init(splitter *sp, const pcre2_code *re) {
  memset(sp, 0, sizeof *sp);
  sp->re = re;
  if (!re) return 0;
  sp->md = pcre2_match_data_create_from_pattern(re, NULL);
  sp->mctx = pcre2_match_context_create(NULL);
  sp->jstack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, NULL);
  if (!sp->md || !sp->mctx || !sp->jstack) return -1;
  pcre2_jit_stack_assign(sp->mctx, NULL, sp->jstack);
  return 0;
}
static void splitter_free(splitter *sp) {
  if (sp->md) pcre2_match_data_free(sp->md);
  if (sp->mctx) pcre2_match_context_free(sp->mctx);
  if (sp->jstack) pcre2_jit_stack_free(sp->jstack);
  memset(sp, 0, sizeof *sp);
}

/* Calls fn for every chunk of text in order; chunks tile the text.  No
   pattern: the whole text is one chunk. */
typedef int (*chunk_fn)(void *ud, const uint8_t *s, int64_t n, int64_t off);
static int split_text(splitter *sp, const uint8_t *text, int64_t len, chunk_fn fn, void *ud, enc_err *err) {
  if (len == 0) return 0;
  if (!sp->re) return fn(ud, text, len, 0);
  int64_t gap = 0, search = 0;
  while (search < len) {
    int rc = pcre2_match(sp->re, text, (PCRE2_SIZE)len, (PCRE2_SIZE)search, 0, sp->md, sp->mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) { err->kind = ENC_REGEX; err->value = rc; err->offset = search; return -1; }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(sp->md);
    int64_t s = (int64_t)ov[0], e = (int64_t)ov[1];
    if (e == s) { /* an empty match: the character joins the gap */
      search = s + 1;
      while (search < len && (text[search] & 0xC0) == 0x80) search++;
      continue;
    }
    if (s > gap && fn(ud, text + gap, s - gap, gap)) return -1;
    if (fn(ud, text + s, e - s, s)) return -1;
    gap = search = e;
  }
  if (gap < len && fn(ud, text + gap, len - gap, gap)) return -1;
  return 0;
}

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
  pcre2_code *re;
};

void gl_tok_free(gl_tokenizer *t) {
  if (!t) return;
  free(t->left); free(t->right); free(t->merge_ids);
  pairmap_free(&t->pairs);
  free(t->tok_off); free(t->tok_len); free(t->blob);
  free(t->pattern);
  if (t->re) pcre2_code_free(t->re);
  free(t);
}

/* pattern: NULL means GPT-4, "" means none */
static gl_tokenizer *tok_new(const char *fn, const char *pattern, int is_char) {
  gl_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return gl_error_null("%s: out of memory", fn);
  t->is_char = is_char;
  for (int b = 0; b < 256; b++) t->byte_id[b] = -1;
  if (pairmap_init(&t->pairs, 1024)) { gl_tok_free(t); return gl_error_null("%s: out of memory", fn); }
  if (pattern == NULL) pattern = GPT4_PATTERN;
  if (!is_char && pattern[0]) {
    t->pattern = strdup(pattern);
    if (!t->pattern) { gl_tok_free(t); return gl_error_null("%s: out of memory", fn); }
    t->re = compile_pattern(fn, pattern);
    if (!t->re) { gl_tok_free(t); return NULL; }
  }
  t->safe_split = is_char || (t->pattern && strcmp(t->pattern, GPT4_PATTERN) == 0);
  return t;
}

/* appends a token's bytes; returns its id or -1 (out of memory) */
static int32_t tok_push(gl_tokenizer *t, const uint8_t *s, int64_t len, int32_t left, int32_t right) {
  int32_t id = t->n_ordinary + t->n_special;
  if (id >= t->tok_cap) {
    int64_t cap = t->tok_cap ? 2 * t->tok_cap : 512;
    if (resize((void **)&t->tok_off, cap, sizeof(int64_t)) || resize((void **)&t->tok_len, cap, sizeof(int32_t)) ||
        resize((void **)&t->left, cap, sizeof(int32_t)) || resize((void **)&t->right, cap, sizeof(int32_t))) return -1;
    t->tok_cap = cap;
  }
  if (GROW(t->blob, t->blob_cap, t->blob_n + len)) return -1;
  memcpy(t->blob + t->blob_n, s, (size_t)len);
  t->tok_off[id] = t->blob_n; t->tok_len[id] = (int32_t)len;
  t->left[id] = left; t->right[id] = right;
  t->blob_n += len;
  return id;
}

/* Ordinary token made by merging a and b; bytes are concatenated.  Must be
   called before any special token is added. */
static int32_t tok_add_merge(gl_tokenizer *t, int32_t a, int32_t b) {
  int64_t la = t->tok_len[a], lb = t->tok_len[b];
  if (GROW(t->blob, t->blob_cap, t->blob_n + la + lb)) return -1;
  uint8_t *tmp = malloc((size_t)(la + lb));
  if (!tmp) return -1;
  memcpy(tmp, t->blob + t->tok_off[a], (size_t)la);
  memcpy(tmp + la, t->blob + t->tok_off[b], (size_t)lb);
  int32_t id = tok_push(t, tmp, la + lb, a, b);
  free(tmp);
  if (id < 0) return -1;
  int created;
  int32_t *slot = pairmap_slot(&t->pairs, pair_key(a, b), &created);
  if (!slot) return -1;
  *slot = id;
  if (GROW(t->merge_ids, t->merge_cap, t->n_merges + 1)) return -1;
  t->merge_ids[t->n_merges++] = id;
  t->n_ordinary++;
  return id;
}

static int tok_add_specials(const char *fn, gl_tokenizer *t, int n, const char *const *names) {
  if (n < 0) return gl_error("%s: n_special expected >= 0, got %d", fn, n);
  if (n > 0 && !names) return gl_error("%s: special expected %d names, got NULL", fn, n);
  for (int i = 0; i < n; i++) {
    if (!names[i] || !names[i][0]) return gl_error("%s: special[%d] expected a non-empty name", fn, i);
    for (int j = 0; j < i; j++)
      if (strcmp(names[i], names[j]) == 0) return gl_error("%s: special token '%s' given twice", fn, names[i]);
    if (tok_push(t, (const uint8_t *)names[i], (int64_t)strlen(names[i]), -1, -1) < 0)
      return gl_error("%s: out of memory", fn);
    t->n_special++;
  }
  return GL_OK;
}

/* ------------------------------------------------------------ encoding */

/* Per-thread scratch for the heap merge of long chunks. */
typedef struct {
  int32_t *next, *prev; int64_t link_cap;
  uint64_t *heap; int64_t heap_n, heap_cap;
} merge_scratch;
static void merge_scratch_free(merge_scratch *s) { free(s->next); free(s->prev); free(s->heap); memset(s, 0, sizeof *s); }

static int heap_push_min(merge_scratch *s, uint64_t v) { return rankheap_push(&s->heap, &s->heap_n, &s->heap_cap, v); }

enum { MERGE_SCAN_MAX = 64 }; /* chunks up to this many ids use the plain scan */

/* Merges ids[0..n) in place by rank; returns the new length or -1 (ENOMEM). */
static int64_t bpe_merge(const gl_tokenizer *t, int32_t *ids, int64_t n, merge_scratch *s) {
  if (n < 2 || t->n_merges == 0) return n;
  if (n <= MERGE_SCAN_MAX) {
    int32_t rank[MERGE_SCAN_MAX]; /* rank[i]: merged id of (ids[i], ids[i+1]), INT32_MAX if none */
    for (int64_t i = 0; i + 1 < n; i++) {
      int32_t r = pairmap_get(&t->pairs, pair_key(ids[i], ids[i + 1]));
      rank[i] = r < 0 ? INT32_MAX : r;
    }
    for (;;) {
      int32_t best = INT32_MAX;
      for (int64_t i = 0; i + 1 < n; i++) if (rank[i] < best) best = rank[i];
      if (best == INT32_MAX) break;
      int64_t w = 0;
      for (int64_t i = 0; i < n;) {
        if (i + 1 < n && rank[i] == best) { ids[w] = best; rank[w] = INT32_MAX; w++; i += 2; }
        else { ids[w] = ids[i]; rank[w] = rank[i]; w++; i++; }
      }
      n = w;
      /* only pairs next to a new token changed */
      for (int64_t i = 0; i + 1 < n; i++) {
        if (ids[i] == best || ids[i + 1] == best) {
          int32_t r = pairmap_get(&t->pairs, pair_key(ids[i], ids[i + 1]));
          rank[i] = r < 0 ? INT32_MAX : r;
        }
      }
      if (n >= 1) rank[n - 1] = INT32_MAX;
    }
    return n;
  }
  /* heap of (rank << 32 | position): lowest rank first, then leftmost */
  if (n > s->link_cap) {
    if (resize((void **)&s->next, n, sizeof(int32_t)) || resize((void **)&s->prev, n, sizeof(int32_t))) return -1;
    s->link_cap = n;
  }
  s->heap_n = 0;
  for (int64_t i = 0; i < n; i++) {
    s->next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
    s->prev[i] = (int32_t)i - 1;
    if (i + 1 < n) {
      int32_t r = pairmap_get(&t->pairs, pair_key(ids[i], ids[i + 1]));
      if (r >= 0 && heap_push_min(s, (uint64_t)r << 32 | (uint64_t)i)) return -1;
    }
  }
  while (s->heap_n > 0) {
    uint64_t top = rankheap_pop(s->heap, &s->heap_n);
    int32_t r = (int32_t)(top >> 32), p = (int32_t)(top & 0xffffffffu);
    if (s->prev[p] == -2) continue;            /* p was merged into its left */
    int32_t q = s->next[p];
    if (q < 0 || pairmap_get(&t->pairs, pair_key(ids[p], ids[q])) != r) continue;
    ids[p] = r;
    s->next[p] = s->next[q];
    if (s->next[q] >= 0) s->prev[s->next[q]] = p;
    s->prev[q] = -2;
    int32_t l = s->prev[p], nx = s->next[p];
    if (l >= 0) {
      int32_t rl = pairmap_get(&t->pairs, pair_key(ids[l], ids[p]));
      if (rl >= 0 && heap_push_min(s, (uint64_t)rl << 32 | (uint64_t)l)) return -1;
    }
    if (nx >= 0) {
      int32_t rr = pairmap_get(&t->pairs, pair_key(ids[p], ids[nx]));
      if (rr >= 0 && heap_push_min(s, (uint64_t)rr << 32 | (uint64_t)p)) return -1;
    }
  }
  int64_t w = 0;
  for (int32_t i = 0; i >= 0; i = s->next[i]) ids[w++] = ids[i];
  return w;
}

/* Chunk cache: natural text repeats its words, so a direct-mapped table of
   recent chunks (up to CACHE_BYTES bytes that merge to up to CACHE_IDS ids)
   skips most merging.  Only worth its 512 KB for large inputs. */
enum { CACHE_SLOTS = 8192, CACHE_BYTES = 22, CACHE_IDS = 8, CACHE_MIN_TEXT = 1 << 16 };
typedef struct {
  uint64_t hash;
  uint8_t len, nids;
  uint8_t bytes[CACHE_BYTES];
  int32_t ids[CACHE_IDS];
} cache_entry;

/* One thread's encoder: appends ids to out. */
typedef struct {
  const gl_tokenizer *t;
  splitter sp;
  merge_scratch ms;
  cache_entry *cache;   /* NULL: no cache */
  i32vec out;
  enc_err err;
  int64_t base;   /* offset of the text being encoded within the caller's text */
} encoder;

static int encoder_init(encoder *e, const gl_tokenizer *t, int64_t text_bytes) {
  memset(e, 0, sizeof *e);
  e->t = t;
  if (splitter_init(&e->sp, t->re)) { e->err.kind = ENC_NOMEM; return -1; }
  /* a failed cache allocation only costs speed */
  if (!t->is_char && t->n_merges > 0 && text_bytes >= CACHE_MIN_TEXT)
    e->cache = calloc(CACHE_SLOTS, sizeof(cache_entry));
  return 0;
}
static void encoder_free(encoder *e) {
  splitter_free(&e->sp); merge_scratch_free(&e->ms); free(e->cache); free(e->out.v);
}

static int encode_chunk(void *ud, const uint8_t *s, int64_t n, int64_t off) {
  encoder *e = ud;
  const gl_tokenizer *t = e->t;
  if (n > INT32_MAX) { e->err.kind = ENC_TOO_LONG; e->err.offset = e->base + off; e->err.value = 0; return -1; }
  if (GROW(e->out.v, e->out.cap, e->out.n + n)) { e->err.kind = ENC_NOMEM; return -1; }
  int32_t *ids = e->out.v + e->out.n;
  cache_entry *ce = NULL;
  uint64_t h = 0;
  if (e->cache && n <= CACHE_BYTES) {
    h = hash_bytes(s, n);
    ce = &e->cache[h & (CACHE_SLOTS - 1)];
    if (ce->hash == h && ce->len == n && memcmp(ce->bytes, s, (size_t)n) == 0) {
      memcpy(ids, ce->ids, (size_t)ce->nids * sizeof(int32_t));
      e->out.n += ce->nids;
      return 0;
    }
  }
  for (int64_t i = 0; i < n; i++) {
    int32_t id = t->byte_id[s[i]];
    if (id < 0) { e->err.kind = ENC_BYTE; e->err.value = s[i]; e->err.offset = e->base + off + i; return -1; }
    ids[i] = id;
  }
  int64_t m = bpe_merge(t, ids, n, &e->ms);
  if (m < 0) { e->err.kind = ENC_NOMEM; return -1; }
  if (ce && m <= CACHE_IDS) {
    ce->hash = h; ce->len = (uint8_t)n; ce->nids = (uint8_t)m;
    memcpy(ce->bytes, s, (size_t)n);
    memcpy(ce->ids, ids, (size_t)m * sizeof(int32_t));
  }
  e->out.n += m;
  return 0;
}

static int encode_text(encoder *e, const uint8_t *text, int64_t len, int64_t base) {
  e->base = base;
  if (e->t->is_char) return encode_chunk(e, text, len, 0);
  return split_text(&e->sp, text, len, encode_chunk, e, &e->err);
}

static int report_enc_err(const char *fn, const enc_err *err, int doc) {
  char where[64] = "";
  if (doc >= 0) snprintf(where, sizeof where, " in text %d", doc + 1);
  switch (err->kind) {
  case ENC_BYTE:
    return gl_error("%s: byte 0x%02x at offset %lld%s is not in the vocabulary", fn, err->value,
                    (long long)err->offset, where);
  case ENC_REGEX: {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err->value, msg, sizeof msg);
    return gl_error("%s: regex match failed at offset %lld%s: %s", fn, (long long)err->offset, where, (char *)msg);
  }
  case ENC_TOO_LONG:
    return gl_error("%s: a chunk at offset %lld%s is longer than 2^31 bytes", fn, (long long)err->offset, where);
  default:
    return gl_error("%s: out of memory", fn);
  }
}

static gl_tensor *ids_tensor(const char *fn, const int32_t *ids, int64_t n) {
  int64_t shape[1] = {n};
  gl_tensor *out = gl_empty_host(GL_I32, 1, shape);
  if (!out) return NULL;
  if (n) memcpy(gl_data_ptr(out), ids, (size_t)n * sizeof(int32_t));
  return out;
}

static int check_tok(const char *fn, const gl_tokenizer *t) {
  return t ? GL_OK : gl_error("%s: tokenizer expected, got NULL", fn);
}
static int check_text(const char *fn, const char *text, int64_t len) {
  if (len < 0) return gl_error("%s: len expected >= 0, got %lld", fn, (long long)len);
  if (len > 0 && !text) return gl_error("%s: text expected, got NULL", fn);
  return GL_OK;
}
static int check_prepend(const char *fn, const gl_tokenizer *t, int32_t prepend_id) {
  if (prepend_id >= t->n_ordinary + t->n_special)
    return gl_error("%s: prepend_id %d is out of range [0, %d)", fn, prepend_id, t->n_ordinary + t->n_special);
  return GL_OK;
}

/* the first cut >= from where the text can be split without changing the
   encoding (see gl_tok_safe_cut); len if none */
static int64_t next_safe_cut(const uint8_t *s, int64_t len, int64_t from) {
  for (int64_t p = from < 1 ? 1 : from; p < len; p++)
    if (s[p - 1] == '\n' && s[p] > 0x20 && s[p] < 0x7f) return p;
  return len;
}

int64_t gl_tok_safe_cut(const gl_tokenizer *t, const char *text, int64_t len) {
  GL_TRY(check_tok("gl_tok_safe_cut", t));
  GL_TRY(check_text("gl_tok_safe_cut", text, len));
  if (!t->safe_split) return 0;
  const uint8_t *s = (const uint8_t *)text;
  /* a cut at len itself is only known safe when byte len exists; callers
     pass the bytes they have, so look for a cut strictly inside */
  for (int64_t p = len - 1; p >= 1; p--)
    if (s[p - 1] == '\n' && s[p] > 0x20 && s[p] < 0x7f) return p;
  return 0;
}

enum { PARALLEL_MIN_BYTES = 1 << 20 };

/* Cut points for spreading a big text over nthreads (about 8 pieces per
   thread, at least 256 KB each, at safe cuts): cuts[0] = 0 < ... <
   cuts[*npieces] = len.  NULL when out of memory. */
static int64_t *make_cuts(const uint8_t *s, int64_t len, int nthreads, int64_t *npieces) {
  int64_t target = len / ((int64_t)nthreads * 8);
  if (target < (1 << 18)) target = 1 << 18;
  int64_t cap = len / target + 2;
  int64_t *cuts = malloc((size_t)(cap + 1) * sizeof(int64_t));
  if (!cuts) return NULL;
  int64_t n = 0;
  cuts[0] = 0;
  while (cuts[n] < len && n < cap - 1) { cuts[n + 1] = next_safe_cut(s, len, cuts[n] + target); n++; }
  if (cuts[n] < len) { cuts[n + 1] = len; n++; }
  *npieces = n;
  return cuts;
}

/* character level: one id per byte, written straight into the result */
static gl_tensor *encode_char(const char *fn, const gl_tokenizer *t, const uint8_t *s, int64_t len, int32_t prepend_id) {
  int64_t shape[1] = {len + (prepend_id >= 0)};
  gl_tensor *out = gl_empty_host(GL_I32, 1, shape);
  if (!out) return NULL;
  int32_t *dst = gl_data_ptr(out);
  if (prepend_id >= 0) *dst++ = prepend_id;
  int64_t bad = len;
  #pragma omp parallel for num_threads(gl_threads_for(len, 1)) reduction(min : bad)
  for (int64_t i = 0; i < len; i++) {
    int32_t id = t->byte_id[s[i]];
    if (id < 0 && i < bad) bad = i;
    dst[i] = id;
  }
  if (bad < len) {
    gl_tensor_free(out);
    enc_err err = {ENC_BYTE, s[bad], bad};
    report_enc_err(fn, &err, -1);
    return NULL;
  }
  return out;
}

gl_tensor *gl_tok_encode(const gl_tokenizer *t, const char *text, int64_t len, int32_t prepend_id) {
  const char *fn = "gl_tok_encode";
  if (check_tok(fn, t) || check_text(fn, text, len) || check_prepend(fn, t, prepend_id)) return NULL;
  const uint8_t *s = (const uint8_t *)text;
  if (t->is_char) return encode_char(fn, t, s, len, prepend_id);
  int nthreads = gl_get_num_threads();
  /* pieces: one for small texts, else cut at safe points and spread */
  int64_t npieces = 1;
  int64_t *cuts = NULL;
  if (t->safe_split && nthreads > 1 && len >= PARALLEL_MIN_BYTES &&
      !(cuts = make_cuts(s, len, nthreads, &npieces)))
    return gl_error_null("%s: out of memory", fn);
  if (npieces == 1) {
    encoder e;
    if (encoder_init(&e, t, len)) { encoder_free(&e); free(cuts); return gl_error_null("%s: out of memory", fn); }
    if (prepend_id >= 0 && i32vec_push(&e.out, prepend_id)) e.err.kind = ENC_NOMEM;
    gl_tensor *out = NULL;
    if (e.err.kind == ENC_OK && encode_text(&e, s, len, 0) == 0) out = ids_tensor(fn, e.out.v, e.out.n);
    else report_enc_err(fn, &e.err, -1);
    encoder_free(&e);
    free(cuts);
    return out;
  }
  /* each thread appends its pieces to one buffer of its own (grown in place,
     so no per-piece allocations); pieces are stitched in order afterwards */
  typedef struct { int thread; int64_t off, n; } piece_out;
  piece_out *parts = calloc((size_t)npieces, sizeof(piece_out));
  enc_err *errs = calloc((size_t)npieces, sizeof(enc_err));
  i32vec *bufs = calloc((size_t)nthreads, sizeof(i32vec));
  if (!parts || !errs || !bufs) {
    free(parts); free(errs); free(bufs); free(cuts);
    return gl_error_null("%s: out of memory", fn);
  }
  #pragma omp parallel num_threads(nthreads)
  {
    int me = omp_get_thread_num();
    encoder e;
    int ok = encoder_init(&e, t, len) == 0;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < npieces; i++) {
      if (!ok) { errs[i].kind = ENC_NOMEM; continue; }
      int64_t start = e.out.n;
      e.err.kind = ENC_OK;
      if (encode_text(&e, s + cuts[i], cuts[i + 1] - cuts[i], cuts[i])) { errs[i] = e.err; continue; }
      parts[i] = (piece_out){me, start, e.out.n - start};
    }
    bufs[me] = e.out;
    memset(&e.out, 0, sizeof e.out);
    encoder_free(&e);
  }
  gl_tensor *out = NULL;
  int64_t total = prepend_id >= 0;
  int64_t bad = -1;
  for (int64_t i = 0; i < npieces; i++) { total += parts[i].n; if (bad < 0 && errs[i].kind) bad = i; }
  if (bad >= 0) report_enc_err(fn, &errs[bad], -1);
  else {
    int64_t shape[1] = {total};
    out = gl_empty_host(GL_I32, 1, shape);
    if (out) {
      int32_t *dst = gl_data_ptr(out);
      if (prepend_id >= 0) *dst++ = prepend_id;
      for (int64_t i = 0; i < npieces; i++) {
        if (parts[i].n) memcpy(dst, bufs[parts[i].thread].v + parts[i].off, (size_t)parts[i].n * sizeof(int32_t));
        dst += parts[i].n;
      }
    }
  }
  for (int k = 0; k < nthreads; k++) free(bufs[k].v);
  free(bufs); free(parts); free(errs); free(cuts);
  return out;
}

int gl_tok_encode_batch(const gl_tokenizer *t, int n, const char *const *texts, const int64_t *lens,
                        int32_t prepend_id, gl_tensor **out) {
  const char *fn = "gl_tok_encode_batch";
  GL_TRY(check_tok(fn, t));
  GL_TRY(check_prepend(fn, t, prepend_id));
  if (n < 0) return gl_error("%s: n expected >= 0, got %d", fn, n);
  if (n > 0 && (!texts || !lens || !out)) return gl_error("%s: texts, lens and out expected, got NULL", fn);
  for (int i = 0; i < n; i++) {
    out[i] = NULL;
    if (lens[i] < 0 || (lens[i] > 0 && !texts[i]))
      return gl_error("%s: text %d expected a buffer and len >= 0, got len %lld", fn, i + 1, (long long)lens[i]);
  }
  i32vec *res = calloc((size_t)(n ? n : 1), sizeof(i32vec));
  enc_err *errs = calloc((size_t)(n ? n : 1), sizeof(enc_err));
  if (!res || !errs) { free(res); free(errs); return gl_error("%s: out of memory", fn); }
  int nthreads = gl_get_num_threads();
  if (nthreads > n) nthreads = n > 0 ? n : 1;
  int64_t total = 0;
  for (int i = 0; i < n; i++) total += lens[i];
  #pragma omp parallel num_threads(nthreads)
  {
    encoder e;
    int ok = encoder_init(&e, t, total / nthreads) == 0;
    #pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; i++) {
      if (!ok) { errs[i].kind = ENC_NOMEM; continue; }
      e.out.n = 0; e.err.kind = ENC_OK;
      if (prepend_id >= 0 && i32vec_push(&e.out, prepend_id)) { errs[i].kind = ENC_NOMEM; continue; }
      if (encode_text(&e, (const uint8_t *)texts[i], lens[i], 0)) { errs[i] = e.err; continue; }
      res[i] = e.out;
      memset(&e.out, 0, sizeof e.out);
    }
    encoder_free(&e);
  }
  int rc = GL_OK;
  for (int i = 0; i < n && rc == GL_OK; i++)
    if (errs[i].kind) rc = report_enc_err(fn, &errs[i], i);
  for (int i = 0; i < n && rc == GL_OK; i++) {
    out[i] = ids_tensor(fn, res[i].v, res[i].n);
    if (!out[i]) rc = GL_ERR;
  }
  if (rc != GL_OK)
    for (int i = 0; i < n; i++) { gl_tensor_free(out[i]); out[i] = NULL; }
  for (int i = 0; i < n; i++) free(res[i].v);
  free(res); free(errs);
  return rc;
}

typedef struct { int64_t *v; int64_t n, cap; } split_acc;
static int split_collect(void *ud, const uint8_t *s, int64_t n, int64_t off) {
  split_acc *a = ud;
  if (GROW(a->v, a->cap, a->n + 1)) return -1;
  a->v[a->n++] = off + n;
  return 0;
}

gl_tensor *gl_tok_split(const gl_tokenizer *t, const char *text, int64_t len) {
  const char *fn = "gl_tok_split";
  if (check_tok(fn, t) || check_text(fn, text, len)) return NULL;
  splitter sp;
  split_acc acc = {0};
  enc_err err = {0};
  gl_tensor *out = NULL;
  if (splitter_init(&sp, t->is_char ? NULL : t->re)) err.kind = ENC_NOMEM;
  else if (split_text(&sp, (const uint8_t *)text, len, split_collect, &acc, &err) && err.kind == ENC_OK)
    err.kind = ENC_NOMEM;
  if (err.kind) report_enc_err(fn, &err, -1);
  else {
    int64_t shape[1] = {acc.n};
    out = gl_empty_host(GL_I64, 1, shape);
    if (out && acc.n) memcpy(gl_data_ptr(out), acc.v, (size_t)acc.n * sizeof(int64_t));
  }
  splitter_free(&sp);
  free(acc.v);
  return out;
}

/* ------------------------------------------------------------ decoding */

static int64_t decoded_len(const char *fn, const gl_tokenizer *t, const int32_t *ids, int64_t n) {
  GL_TRY(check_tok(fn, t));
  if (n < 0) return gl_error("%s: expected n >= 0 ids, got %lld", fn, (long long)n);
  if (n > 0) GL_NONNULL(fn, ids);  /* n == 0: ids may be NULL */
  int32_t v = t->n_ordinary + t->n_special;
  int64_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    if (ids[i] < 0 || ids[i] >= v)
      return gl_error("%s: ids[%lld] = %d is out of range [0, %d)", fn, (long long)(i + 1), ids[i], v);
    total += t->tok_len[ids[i]];
  }
  return total;
}

int64_t gl_tok_decoded_len(const gl_tokenizer *t, const int32_t *ids, int64_t n) {
  return decoded_len("gl_tok_decode", t, ids, n);  /* the sizing pass of gl_tok_decode */
}

int gl_tok_decode(const gl_tokenizer *t, const int32_t *ids, int64_t n, char *out) {
  int64_t total = decoded_len("gl_tok_decode", t, ids, n);
  if (total < 0) return GL_ERR;
  if (total > 0 && !out) return gl_error("gl_tok_decode: out expected a buffer of %lld bytes, got NULL", (long long)total);
  for (int64_t i = 0; i < n; i++) {
    memcpy(out, t->blob + t->tok_off[ids[i]], (size_t)t->tok_len[ids[i]]);
    out += t->tok_len[ids[i]];
  }
  return GL_OK;
}

/* ------------------------------------------------------------ accessors */

int gl_tok_vocab_size(const gl_tokenizer *t) { return t ? t->n_ordinary + t->n_special : gl_error("gl_tok_vocab_size: tokenizer expected, got NULL"); }
int gl_tok_n_ordinary(const gl_tokenizer *t) { return t ? t->n_ordinary : gl_error("gl_tok_n_ordinary: tokenizer expected, got NULL"); }
int gl_tok_is_char(const gl_tokenizer *t) { return t ? t->is_char : gl_error("gl_tok_is_char: tokenizer expected, got NULL"); }
const char *gl_tok_pattern(const gl_tokenizer *t) {
  GL_NONNULL_OR(NULL, "gl_tok_pattern", t);
  return t->pattern;
}
int gl_tok_n_merges(const gl_tokenizer *t) { return t ? t->n_merges : gl_error("gl_tok_n_merges: tokenizer expected, got NULL"); }
int gl_tok_n_special(const gl_tokenizer *t) { return t ? t->n_special : gl_error("gl_tok_n_special: tokenizer expected, got NULL"); }

int gl_tok_merge(const gl_tokenizer *t, int i, int32_t *left, int32_t *right, int32_t *id) {
  GL_NONNULL("gl_tok_merge", t, left, right, id);
  if (i < 0 || i >= t->n_merges) return gl_error("gl_tok_merge: i expected in [0, %d), got %d", t->n_merges, i);
  int32_t m = t->merge_ids[i];
  *left = t->left[m]; *right = t->right[m]; *id = m;
  return GL_OK;
}

int gl_tok_special_id(const gl_tokenizer *t, const char *name) {
  GL_NONNULL("gl_tok_special_id", t, name);
  int64_t len = (int64_t)strlen(name);
  for (int32_t i = t->n_ordinary; i < t->n_ordinary + t->n_special; i++)
    if (t->tok_len[i] == len && memcmp(t->blob + t->tok_off[i], name, (size_t)len) == 0) return i;
  return -1;
}

const char *gl_tok_token_bytes(const gl_tokenizer *t, int id, int64_t *len) {
  GL_NONNULL_OR(NULL, "gl_tok_token_bytes", t, len);
  int32_t v = t->n_ordinary + t->n_special;
  if (id < 0 || id >= v) return gl_error_null("gl_tok_token_bytes: id %d is out of range [0, %d)", id, v);
  *len = t->tok_len[id];
  return (const char *)t->blob + t->tok_off[id];
}

/* ------------------------------------------------------------ constructors */

gl_tokenizer *gl_tok_from_merges(const char *pattern, int n_merges, const int32_t *pairs,
                                 int n_special, const char *const *special) {
  const char *fn = "gl_tok_from_merges";
  if (n_merges < 0 || (n_merges > 0 && !pairs))
    return gl_error_null("%s: expected n_merges >= 0 pairs, got %d", fn, n_merges);
  gl_tokenizer *t = tok_new(fn, pattern, 0);
  if (!t) return NULL;
  for (int b = 0; b < 256; b++) {
    uint8_t c = (uint8_t)b;
    if ((t->byte_id[b] = tok_push(t, &c, 1, -1, -1)) < 0) goto nomem;
    t->n_ordinary++;
  }
  for (int i = 0; i < n_merges; i++) {
    int32_t a = pairs[2 * i], b = pairs[2 * i + 1];
    if (a < 0 || a >= t->n_ordinary || b < 0 || b >= t->n_ordinary) {
      gl_error("%s: merge %d joins (%d, %d), expected ids in [0, %d)", fn, i + 1, a, b, t->n_ordinary);
      gl_tok_free(t); return NULL;
    }
    if (pairmap_get(&t->pairs, pair_key(a, b)) >= 0) {
      gl_error("%s: merge %d joins (%d, %d), a pair merged before", fn, i + 1, a, b);
      gl_tok_free(t); return NULL;
    }
    if (tok_add_merge(t, a, b) < 0) goto nomem;
  }
  if (tok_add_specials(fn, t, n_special, special)) { gl_tok_free(t); return NULL; }
  return t;
nomem:
  gl_tok_free(t);
  return gl_error_null("%s: out of memory", fn);
}

gl_tokenizer *gl_tok_char(const char *text, int64_t len, int n_special, const char *const *special) {
  const char *fn = "gl_tok_char";
  if (check_text(fn, text, len)) return NULL;
  int seen[256] = {0};
  for (int64_t i = 0; i < len; i++) seen[(uint8_t)text[i]] = 1;
  gl_tokenizer *t = tok_new(fn, "", 1);
  if (!t) return NULL;
  for (int b = 0; b < 256; b++) {
    if (!seen[b]) continue;
    uint8_t c = (uint8_t)b;
    if ((t->byte_id[b] = tok_push(t, &c, 1, -1, -1)) < 0) { gl_tok_free(t); return gl_error_null("%s: out of memory", fn); }
    t->n_ordinary++;
  }
  if (tok_add_specials(fn, t, n_special, special)) { gl_tok_free(t); return NULL; }
  return t;
}

/* ------------------------------------------------------------ training */

struct gl_bpe_trainer {
  char *pattern;      /* NULL: none */
  pcre2_code *re;
  bytemap chunks;     /* chunk bytes -> occurrences */
};

gl_bpe_trainer *gl_bpe_trainer_new(const char *pattern) {
  const char *fn = "gl_bpe_trainer_new";
  gl_bpe_trainer *tr = calloc(1, sizeof *tr);
  if (!tr || bytemap_init(&tr->chunks, 1 << 12)) { free(tr); return gl_error_null("%s: out of memory", fn); }
  if (pattern == NULL) pattern = GPT4_PATTERN;
  if (pattern[0]) {
    tr->pattern = strdup(pattern);
    if (!tr->pattern) { gl_bpe_trainer_free(tr); return gl_error_null("%s: out of memory", fn); }
    if (!(tr->re = compile_pattern(fn, pattern))) { gl_bpe_trainer_free(tr); return NULL; }
  }
  return tr;
}

void gl_bpe_trainer_free(gl_bpe_trainer *tr) {
  if (!tr) return;
  bytemap_free(&tr->chunks);
  if (tr->re) pcre2_code_free(tr->re);
  free(tr->pattern);
  free(tr);
}

typedef struct { bytemap *m; int oom; } count_acc;
static int count_chunk(void *ud, const uint8_t *s, int64_t n, int64_t off) {
  count_acc *a = ud;
  if (n > INT32_MAX) { a->oom = 2; return -1; }
  bm_entry *e = bytemap_slot(a->m, s, n);
  if (!e) { a->oom = 1; return -1; }
  e->val++;
  return 0;
}

/* counts the chunks of text into m; failures described in *err */
static void count_text(const pcre2_code *re, const uint8_t *text, int64_t len, bytemap *m, enc_err *err) {
  splitter sp;
  count_acc acc = {m, 0};
  if (splitter_init(&sp, re)) err->kind = ENC_NOMEM;
  else if (split_text(&sp, text, len, count_chunk, &acc, err) && err->kind == ENC_OK)
    err->kind = acc.oom == 2 ? ENC_TOO_LONG : ENC_NOMEM;
  splitter_free(&sp);
}

/* Big texts split with the GPT-4 pattern are counted on all threads, each
   into its own map, merged at the end (the cuts do not change the chunks). */
int gl_bpe_trainer_add(gl_bpe_trainer *tr, const char *text, int64_t len) {
  const char *fn = "gl_bpe_trainer_add";
  if (!tr) return gl_error("%s: trainer expected, got NULL", fn);
  GL_TRY(check_text(fn, text, len));
  const uint8_t *s = (const uint8_t *)text;
  int nthreads = gl_get_num_threads();
  enc_err err = {0};
  if (nthreads < 2 || len < 4 * PARALLEL_MIN_BYTES || !tr->pattern || strcmp(tr->pattern, GPT4_PATTERN) != 0) {
    count_text(tr->re, s, len, &tr->chunks, &err);
    return err.kind ? report_enc_err(fn, &err, -1) : GL_OK;
  }
  int64_t npieces;
  int64_t *cuts = make_cuts(s, len, nthreads, &npieces);
  bytemap *maps = calloc((size_t)nthreads, sizeof(bytemap));
  enc_err *errs = calloc((size_t)nthreads, sizeof(enc_err));
  if (!cuts || !maps || !errs) { free(cuts); free(maps); free(errs); return gl_error("%s: out of memory", fn); }
  #pragma omp parallel num_threads(nthreads)
  {
    int me = omp_get_thread_num();
    if (bytemap_init(&maps[me], 1 << 12)) errs[me].kind = ENC_NOMEM;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < npieces; i++)
      if (errs[me].kind == ENC_OK) count_text(tr->re, s + cuts[i], cuts[i + 1] - cuts[i], &maps[me], &errs[me]);
  }
  for (int k = 0; k < nthreads && err.kind == ENC_OK; k++) {
    err = errs[k];
    for (int64_t i = 0; i < maps[k].cap && err.kind == ENC_OK; i++) {
      const bm_entry *e = &maps[k].e[i];
      if (!e->used) continue;
      bm_entry *d = bytemap_slot(&tr->chunks, maps[k].arena + e->off, e->len);
      if (!d) err.kind = ENC_NOMEM;
      else d->val += e->val;
    }
  }
  for (int k = 0; k < nthreads; k++) bytemap_free(&maps[k]);
  free(maps); free(errs); free(cuts);
  return err.kind ? report_enc_err(fn, &err, -1) : GL_OK;
}

int64_t gl_bpe_trainer_unique_chunks(const gl_bpe_trainer *tr) {
  return tr ? tr->chunks.n : gl_error("gl_bpe_trainer_unique_chunks: trainer expected, got NULL");
}

/* Training state.  Words are the unique chunks: ids in one arena, each with
   its occurrence count.  Pair p: count[p] and the words it occurs in (may
   hold words it no longer occurs in; a merge skips those). */
typedef struct {
  int32_t *wids; int64_t *woff, *wcount; int32_t *wlen, *wstamp; int64_t nwords;
  pairmap pidx;                   /* pair key -> pair index */
  int64_t *pcount; uint64_t *pkey; i32vec *pwords; int32_t *pstamp; int64_t npairs, pcap;
  heap_item *heap; int64_t heap_n, heap_cap;
  i32vec touched;                 /* pairs that gained counts in this merge */
  int32_t stamp;
  int oom;
} bpe_state;

static int heap_push_max(bpe_state *st, heap_item it) { return pairheap_push(&st->heap, &st->heap_n, &st->heap_cap, it); }

/* count[(a,b)] += delta; word w (>= 0) is recorded as containing the pair */
static void add_pair(bpe_state *st, int32_t a, int32_t b, int64_t delta, int32_t w) {
  int created;
  int32_t *slot = pairmap_slot(&st->pidx, pair_key(a, b), &created);
  if (!slot) { st->oom = 1; return; }
  if (created) {
    if (st->npairs == st->pcap) {
      int64_t cap = st->pcap ? 2 * st->pcap : 1 << 16;
      if (resize((void **)&st->pcount, cap, sizeof(int64_t)) || resize((void **)&st->pkey, cap, sizeof(uint64_t)) ||
          resize((void **)&st->pwords, cap, sizeof(i32vec)) || resize((void **)&st->pstamp, cap, sizeof(int32_t))) {
        st->oom = 1; return;
      }
      st->pcap = cap;
    }
    *slot = (int32_t)st->npairs++;
    st->pcount[*slot] = 0;
    st->pkey[*slot] = pair_key(a, b);
    memset(&st->pwords[*slot], 0, sizeof(i32vec));
    st->pstamp[*slot] = -1;
  }
  int32_t p = *slot;
  st->pcount[p] += delta;
  if (w >= 0) {
    i32vec *l = &st->pwords[p];
    if ((l->n == 0 || l->v[l->n - 1] != w) && i32vec_push(l, w)) st->oom = 1;
    if (st->pstamp[p] != st->stamp) { st->pstamp[p] = st->stamp; if (i32vec_push(&st->touched, p)) st->oom = 1; }
  }
}

static void bpe_state_free(bpe_state *st) {
  free(st->wids); free(st->woff); free(st->wcount); free(st->wlen); free(st->wstamp);
  pairmap_free(&st->pidx);
  for (int64_t p = 0; p < st->npairs; p++) free(st->pwords[p].v);
  free(st->pcount); free(st->pkey); free(st->pwords); free(st->pstamp);
  free(st->heap); free(st->touched.v);
}

gl_tokenizer *gl_bpe_trainer_train(gl_bpe_trainer *tr, int vocab_size, int n_special,
                                   const char *const *special) {
  const char *fn = "gl_bpe_trainer_train";
  if (!tr) return gl_error_null("%s: trainer expected, got NULL", fn);
  if (n_special < 0) return gl_error_null("%s: n_special expected >= 0, got %d", fn, n_special);
  if (vocab_size < 256 + n_special)
    return gl_error_null("%s: vocab_size expected >= 256 + %d special tokens, got %d", fn, n_special, vocab_size);
  int n_merges = vocab_size - 256 - n_special;
  gl_tokenizer *t = gl_tok_from_merges(tr->pattern ? tr->pattern : "", 0, NULL, 0, NULL);
  if (!t) return NULL;
  bpe_state st = {0};
  bytemap known = {0};   /* bytes of every token so far: no two tokens share bytes */
  int nomem = 0;

  /* words */
  st.nwords = tr->chunks.n;
  int64_t nw = st.nwords ? st.nwords : 1;
  st.woff = malloc((size_t)nw * sizeof(int64_t));
  st.wcount = malloc((size_t)nw * sizeof(int64_t));
  st.wlen = malloc((size_t)nw * sizeof(int32_t));
  st.wstamp = malloc((size_t)nw * sizeof(int32_t));
  st.wids = malloc((size_t)(tr->chunks.arena_n ? tr->chunks.arena_n : 1) * sizeof(int32_t));
  if (!st.woff || !st.wcount || !st.wlen || !st.wstamp || !st.wids || pairmap_init(&st.pidx, 1 << 16) ||
      bytemap_init(&known, vocab_size)) { nomem = 1; goto done; }
  {
    int64_t w = 0, off = 0;
    for (int64_t i = 0; i < tr->chunks.cap; i++) {
      const bm_entry *e = &tr->chunks.e[i];
      if (!e->used) continue;
      st.woff[w] = off; st.wlen[w] = e->len; st.wcount[w] = e->val; st.wstamp[w] = -1;
      for (int32_t j = 0; j < e->len; j++) st.wids[off + j] = tr->chunks.arena[e->off + j];
      off += e->len; w++;
    }
  }
  for (int b = 0; b < 256; b++) {
    uint8_t c = (uint8_t)b;
    bm_entry *e = bytemap_slot(&known, &c, 1);
    if (!e) { nomem = 1; goto done; }
    e->val = b;
  }
  /* initial pair counts (stamp 0; merge m runs with stamp m + 1) */
  st.stamp = 0;
  for (int64_t w = 0; w < st.nwords; w++) {
    const int32_t *ids = st.wids + st.woff[w];
    for (int32_t j = 0; j + 1 < st.wlen[w]; j++) add_pair(&st, ids[j], ids[j + 1], st.wcount[w], (int32_t)w);
  }
  if (st.oom) { nomem = 1; goto done; }
  for (int64_t p = 0; p < st.npairs; p++)
    if (heap_push_max(&st, (heap_item){st.pcount[p], st.pkey[p]})) { nomem = 1; goto done; }

  uint8_t *cat = NULL; int64_t cat_cap = 0;
  for (int m = 0; m < n_merges; m++) {
    /* the most frequent live pair; stale heap entries are refreshed */
    int32_t p = -1, a = 0, b = 0;
    while (st.heap_n > 0) {
      heap_item it = pairheap_pop(st.heap, &st.heap_n);
      int32_t q = pairmap_get(&st.pidx, it.key);
      int64_t cur = st.pcount[q];
      if (cur != it.count) {
        if (cur > 0 && heap_push_max(&st, (heap_item){cur, it.key})) { nomem = 1; break; }
        continue;
      }
      if (cur <= 0) continue;
      a = (int32_t)(it.key >> 32); b = (int32_t)(it.key & 0xffffffffu);
      int64_t la = t->tok_len[a], lb = t->tok_len[b];
      if (GROW(cat, cat_cap, la + lb)) { nomem = 1; break; }
      memcpy(cat, t->blob + t->tok_off[a], (size_t)la);
      memcpy(cat + la, t->blob + t->tok_off[b], (size_t)lb);
      if (bytemap_get(&known, cat, la + lb) >= 0) continue; /* would duplicate a token */
      p = q;
      break;
    }
    if (nomem || p < 0) break;
    int32_t nid = tok_add_merge(t, a, b);
    bm_entry *ke = nid >= 0 ? bytemap_slot(&known, t->blob + t->tok_off[nid], t->tok_len[nid]) : NULL;
    if (!ke) { nomem = 1; break; }
    ke->val = nid;

    st.stamp = m + 1;
    st.touched.n = 0;
    i32vec words = st.pwords[p];       /* only pairs with nid gain words during this merge */
    for (int64_t k = 0; k < words.n; k++) {
      int32_t w = words.v[k];
      if (st.wstamp[w] == st.stamp) continue;
      st.wstamp[w] = st.stamp;
      int32_t *ids = st.wids + st.woff[w];
      int64_t n = st.wlen[w], c = st.wcount[w], out = 0;
      for (int64_t i = 0; i < n;) {
        if (i + 1 < n && ids[i] == a && ids[i + 1] == b) {
          if (out > 0) { int32_t l = ids[out - 1]; add_pair(&st, l, a, -c, -1); add_pair(&st, l, nid, c, w); }
          add_pair(&st, a, b, -c, -1);
          if (i + 2 < n) { int32_t r = ids[i + 2]; add_pair(&st, b, r, -c, -1); add_pair(&st, nid, r, c, w); }
          ids[out++] = nid; i += 2;
        } else {
          ids[out++] = ids[i++];
        }
      }
      st.wlen[w] = (int32_t)out;
    }
    if (st.oom) { nomem = 1; break; }
    if (st.pcount[p] != 0) gl_panic("%s: pair (%d, %d) has count %lld after its merge", fn, a, b, (long long)st.pcount[p]);
    free(st.pwords[p].v);
    memset(&st.pwords[p], 0, sizeof(i32vec));
    /* the pairs with nid are new: push them once, with their final counts
       (later they only lose counts, which the lazy heap tolerates) */
    for (int64_t k = 0; k < st.touched.n && !nomem; k++) {
      int32_t q = st.touched.v[k];
      if (st.pcount[q] > 0 && heap_push_max(&st, (heap_item){st.pcount[q], st.pkey[q]})) nomem = 1;
    }
    if (nomem) break;
  }
  free(cat);
done:
  bpe_state_free(&st);
  bytemap_free(&known);
  if (nomem) { gl_tok_free(t); return gl_error_null("%s: out of memory", fn); }
  if (tok_add_specials(fn, t, n_special, special)) { gl_tok_free(t); return NULL; }
  return t;
}

/* ------------------------------------------------------------ files */

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static void b64_encode(const uint8_t *s, int64_t n, char *out) {
  int64_t i = 0;
  for (; i + 2 < n; i += 3) {
    uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
    *out++ = B64[v >> 18]; *out++ = B64[(v >> 12) & 63]; *out++ = B64[(v >> 6) & 63]; *out++ = B64[v & 63];
  }
  if (i < n) {
    uint32_t v = (uint32_t)s[i] << 16 | (i + 1 < n ? (uint32_t)s[i + 1] << 8 : 0);
    *out++ = B64[v >> 18]; *out++ = B64[(v >> 12) & 63];
    *out++ = i + 1 < n ? B64[(v >> 6) & 63] : '=';
    *out++ = '=';
  }
  *out = 0;
}

/* decodes n base64 chars into out; returns the byte count or -1 */
static int64_t b64_decode(const char *s, int64_t n, uint8_t *out) {
  if (n % 4) return -1;
  int64_t w = 0;
  for (int64_t i = 0; i < n; i += 4) {
    uint32_t v = 0; int pad = 0;
    for (int k = 0; k < 4; k++) {
      char c = s[i + k]; int d;
      if (c >= 'A' && c <= 'Z') d = c - 'A';
      else if (c >= 'a' && c <= 'z') d = c - 'a' + 26;
      else if (c >= '0' && c <= '9') d = c - '0' + 52;
      else if (c == '+') d = 62;
      else if (c == '/') d = 63;
      else if (c == '=' && i + 4 == n && k >= 2) { d = 0; pad++; }
      else return -1;
      if (pad && c != '=') return -1;
      v = v << 6 | (uint32_t)d;
    }
    out[w++] = (uint8_t)(v >> 16);
    if (pad < 2) out[w++] = (uint8_t)(v >> 8);
    if (pad < 1) out[w++] = (uint8_t)v;
  }
  return w;
}

/* write to path.tmp, then rename: readers never see half a file */
static int write_atomic(const char *fn, const char *path, const char *data, int64_t n) {
  size_t pl = strlen(path);
  char *tmp = malloc(pl + 5);
  if (!tmp) return gl_error("%s: out of memory", fn);
  memcpy(tmp, path, pl); memcpy(tmp + pl, ".tmp", 5);
  FILE *f = fopen(tmp, "wb");
  if (!f) { int e = errno; free(tmp); return gl_error("%s: cannot write '%s': %s", fn, path, strerror(e)); }
  int ok = fwrite(data, 1, (size_t)n, f) == (size_t)n;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp, path) != 0) {
    int e = errno; remove(tmp); free(tmp);
    return gl_error("%s: cannot write '%s': %s", fn, path, strerror(e));
  }
  free(tmp);
  return GL_OK;
}

/* the whole file, NUL-terminated; NULL with *missing = 1 if it does not exist */
static char *read_file(const char *fn, const char *path, int64_t *len, int *missing) {
  *missing = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) { *missing = 1; return NULL; }
    return gl_error_null("%s: cannot open '%s': %s", fn, path, strerror(errno));
  }
  char *buf = NULL; int64_t n = 0, cap = 0;
  for (;;) {
    if (GROW(buf, cap, n + 65536 + 1)) { fclose(f); free(buf); return gl_error_null("%s: out of memory reading '%s'", fn, path); }
    size_t r = fread(buf + n, 1, 65536, f);
    n += (int64_t)r;
    if (r < 65536) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) { free(buf); return gl_error_null("%s: read error on '%s'", fn, path); }
  buf[n] = 0;
  *len = n;
  return buf;
}

static char *sidecar_path(const char *path) {
  size_t pl = strlen(path);
  char *p = malloc(pl + 6);
  if (p) { memcpy(p, path, pl); memcpy(p + pl, ".json", 6); }
  return p;
}

int gl_tok_save(const gl_tokenizer *t, const char *path) {
  const char *fn = "gl_tok_save";
  GL_TRY(check_tok(fn, t));
  if (!path) return gl_error("%s: path expected, got NULL", fn);
  /* ranks file */
  int64_t cap = 0, n = 0;
  for (int32_t i = 0; i < t->n_ordinary; i++) cap += (t->tok_len[i] + 2) / 3 * 4 + 14;
  char *buf = malloc((size_t)cap + 1);
  int32_t maxlen = 0;
  for (int32_t i = 0; i < t->n_ordinary; i++) if (t->tok_len[i] > maxlen) maxlen = t->tok_len[i];
  char *enc = malloc((size_t)(maxlen + 2) / 3 * 4 + 1);
  if (!buf || !enc) { free(buf); free(enc); return gl_error("%s: out of memory", fn); }
  for (int32_t i = 0; i < t->n_ordinary; i++) {
    b64_encode(t->blob + t->tok_off[i], t->tok_len[i], enc);
    n += sprintf(buf + n, "%s %d\n", enc, i);
  }
  free(enc);
  int rc = write_atomic(fn, path, buf, n);
  free(buf);
  if (rc) return rc;
  /* sidecar */
  cJSON *j = cJSON_CreateObject();
  cJSON_AddStringToObject(j, "format", "gptlua-tokenizer");
  cJSON_AddNumberToObject(j, "version", 1);
  cJSON_AddStringToObject(j, "type", t->is_char ? "char" : "bpe");
  if (t->pattern) cJSON_AddStringToObject(j, "pattern", t->pattern);
  else cJSON_AddNullToObject(j, "pattern");
  cJSON_AddNumberToObject(j, "vocab_size", t->n_ordinary + t->n_special);
  cJSON *sp = cJSON_AddObjectToObject(j, "special_tokens");
  for (int32_t i = t->n_ordinary; i < t->n_ordinary + t->n_special; i++) {
    char *name = strndup((const char *)t->blob + t->tok_off[i], (size_t)t->tok_len[i]);
    if (name) cJSON_AddNumberToObject(sp, name, i);
    free(name);
  }
  char *text = cJSON_Print(j);
  cJSON_Delete(j);
  char *jpath = sidecar_path(path);
  if (!text || !jpath) { free(text); free(jpath); return gl_error("%s: out of memory", fn); }
  rc = write_atomic(fn, jpath, text, (int64_t)strlen(text));
  free(text); free(jpath);
  return rc;
}

gl_tokenizer *gl_tok_load(const char *path) {
  const char *fn = "gl_tok_load";
  if (!path) return gl_error_null("%s: path expected, got NULL", fn);
  int64_t len, jlen; int missing;
  char *text = read_file(fn, path, &len, &missing);
  if (!text) return missing ? gl_error_null("%s: '%s' does not exist", fn, path) : NULL;
  /* sidecar: type, pattern, specials */
  char *jpath = sidecar_path(path);
  if (!jpath) { free(text); return gl_error_null("%s: out of memory", fn); }
  char *jtext = read_file(fn, jpath, &jlen, &missing);
  if (!jtext && !missing) { free(text); free(jpath); return NULL; }
  int is_char = 0;
  char *pattern = NULL;         /* NULL with a sidecar: none; without: GPT-4 */
  int n_special = 0;
  char **snames = NULL; int32_t *sids = NULL;
  gl_tokenizer *t = NULL;
  uint8_t *bytes = NULL;
  cJSON *j = NULL;
  if (jtext) {
    j = cJSON_Parse(jtext);
    if (!j || !cJSON_IsObject(j)) { gl_error("%s: '%s' is not valid JSON", fn, jpath); goto fail; }
    cJSON *ty = cJSON_GetObjectItemCaseSensitive(j, "type");
    if (cJSON_IsString(ty)) {
      if (strcmp(ty->valuestring, "char") == 0) is_char = 1;
      else if (strcmp(ty->valuestring, "bpe") != 0) { gl_error("%s: '%s': type expected \"bpe\" or \"char\", got \"%s\"", fn, jpath, ty->valuestring); goto fail; }
    }
    cJSON *pat = cJSON_GetObjectItemCaseSensitive(j, "pattern");
    if (cJSON_IsString(pat)) pattern = pat->valuestring;
    else if (pat && !cJSON_IsNull(pat)) { gl_error("%s: '%s': pattern expected a string or null", fn, jpath); goto fail; }
    cJSON *sp = cJSON_GetObjectItemCaseSensitive(j, "special_tokens");
    if (sp && !cJSON_IsObject(sp)) { gl_error("%s: '%s': special_tokens expected an object", fn, jpath); goto fail; }
    n_special = sp ? cJSON_GetArraySize(sp) : 0;
    snames = calloc((size_t)n_special + 1, sizeof(char *));
    sids = calloc((size_t)n_special + 1, sizeof(int32_t));
    if (!snames || !sids) { gl_error("%s: out of memory", fn); goto fail; }
    int k = 0;
    for (cJSON *it = sp ? sp->child : NULL; it; it = it->next, k++) {
      if (!cJSON_IsNumber(it)) { gl_error("%s: '%s': special token '%s' expected an id", fn, jpath, it->string); goto fail; }
      snames[k] = it->string; sids[k] = (int32_t)it->valuedouble;
    }
    /* order the specials by id */
    for (int a = 1; a < n_special; a++)
      for (int b = a; b > 0 && sids[b] < sids[b - 1]; b--) {
        int32_t ti = sids[b]; sids[b] = sids[b - 1]; sids[b - 1] = ti;
        char *tn = snames[b]; snames[b] = snames[b - 1]; snames[b - 1] = tn;
      }
  } else {
    pattern = (char *)GPT4_PATTERN;
  }
  t = tok_new(fn, pattern ? pattern : "", is_char);
  if (!t) goto fail;
  bytes = malloc((size_t)len + 1);
  if (!bytes) { gl_error("%s: out of memory", fn); goto fail; }
  /* pass 1: every token's bytes, ranks dense from 0 */
  {
    int64_t line = 0;
    for (char *p = text; *p;) {
      char *eol = strchr(p, '\n');
      if (!eol) eol = p + strlen(p);
      line++;
      char *q = eol;
      if (q > p && q[-1] == '\r') q--;
      if (q > p) {
        char *sp = memchr(p, ' ', (size_t)(q - p));
        char *end = NULL;
        long long rank = sp ? strtoll(sp + 1, &end, 10) : -1;
        if (!sp || end != q) { gl_error("%s: '%s' line %lld: expected \"<base64> <rank>\"", fn, path, (long long)line); goto fail; }
        int64_t nb = b64_decode(p, sp - p, bytes);
        if (nb <= 0) { gl_error("%s: '%s' line %lld: invalid base64", fn, path, (long long)line); goto fail; }
        if (rank != t->n_ordinary) {
          gl_error("%s: '%s' line %lld: rank %lld, expected %d (ranks must be dense and in order)", fn, path,
                   (long long)line, rank, t->n_ordinary);
          goto fail;
        }
        if (tok_push(t, bytes, nb, -1, -1) < 0) { gl_error("%s: out of memory", fn); goto fail; }
        t->n_ordinary++;
        if (nb == 1) {
          if (t->byte_id[bytes[0]] >= 0) {
            gl_error("%s: '%s' line %lld: byte 0x%02x is token %d already", fn, path, (long long)line, bytes[0], t->byte_id[bytes[0]]);
            goto fail;
          }
          t->byte_id[bytes[0]] = (int32_t)rank;
        } else if (is_char) {
          gl_error("%s: '%s' line %lld: a char tokenizer has single-byte tokens only", fn, path, (long long)line);
          goto fail;
        }
      }
      p = *eol ? eol + 1 : eol;
    }
    if (t->n_ordinary == 0) {
      gl_error("%s: '%s' holds no tokens (vocabulary 0): expected lines \"<base64> <rank>\"", fn, path);
      goto fail;
    }
  }
  /* pass 2: recover each multi-byte token's merge by encoding its bytes
     with the merges of lower rank; it must come out as exactly two tokens */
  {
    merge_scratch ms = {0};
    int32_t *ids = NULL; int64_t ids_cap = 0;
    int ok = 1;
    for (int32_t id = 0; id < t->n_ordinary && ok; id++) {
      ok = 0;
      int64_t n = t->tok_len[id];
      if (n == 1) { ok = 1; continue; }
      if (GROW(ids, ids_cap, n)) { gl_error("%s: out of memory", fn); break; }
      const uint8_t *s = t->blob + t->tok_off[id];
      int64_t k;
      for (k = 0; k < n; k++) if ((ids[k] = t->byte_id[s[k]]) < 0) break;
      if (k < n) { gl_error("%s: '%s': token %d contains byte 0x%02x, which has no token", fn, path, id, s[k]); break; }
      int64_t m = bpe_merge(t, ids, n, &ms);
      if (m < 0) { gl_error("%s: out of memory", fn); break; }
      if (m != 2) {
        gl_error("%s: '%s': token %d is not a merge of two tokens of lower rank (%s)", fn, path, id,
                 m == 1 ? "it duplicates another token" : "its bytes do not merge to it");
        break;
      }
      int created;
      int32_t *slot = pairmap_slot(&t->pairs, pair_key(ids[0], ids[1]), &created);
      if (!slot || GROW(t->merge_ids, t->merge_cap, t->n_merges + 1)) { gl_error("%s: out of memory", fn); break; }
      *slot = id;
      t->left[id] = ids[0]; t->right[id] = ids[1];
      t->merge_ids[t->n_merges++] = id;
      ok = 1;
    }
    merge_scratch_free(&ms);
    free(ids);
    if (!ok) goto fail;
  }
  /* specials: ids must follow the ordinary tokens */
  for (int k = 0; k < n_special; k++) {
    if (sids[k] != t->n_ordinary + k) {
      gl_error("%s: '%s': special token '%s' has id %d, expected %d", fn, jpath, snames[k], sids[k], t->n_ordinary + k);
      goto fail;
    }
  }
  if (tok_add_specials(fn, t, n_special, (const char *const *)snames)) goto fail;
  free(text); free(jtext); free(jpath); free(bytes); free(snames); free(sids);
  cJSON_Delete(j);
  return t;
fail:
  gl_tok_free(t);
  free(text); free(jtext); free(jpath); free(bytes); free(snames); free(sids);
  cJSON_Delete(j);
  return NULL;
}
