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
 * Training lives in tokenizer_train.c, the files in tokenizer_io.c; what the
 * three share is in tokenizer_internal.h. */
#include <cjson/cJSON.h>
#include <omp.h>
#include <errno.h>
#include "tokenizer_internal.h"

const char GPT4_PATTERN[] =
  "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*"
  "|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+";

const char *gl_tok_gpt4_pattern(void) { return GPT4_PATTERN; }

/* ------------------------------------------------------------ the regex */

pcre2_code *compile_pattern(const char *fn, const char *pattern) {
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


int splitter_init(splitter *sp, const pcre2_code *re) {
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
void splitter_free(splitter *sp) {
  if (sp->md) pcre2_match_data_free(sp->md);
  if (sp->mctx) pcre2_match_context_free(sp->mctx);
  if (sp->jstack) pcre2_jit_stack_free(sp->jstack);
  memset(sp, 0, sizeof *sp);
}

int split_text(splitter *sp, const uint8_t *text, int64_t len, chunk_fn fn, void *ud, enc_err *err) {
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
gl_tokenizer *tok_new(const char *fn, const char *pattern, int is_char) {
  gl_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return gl_error_null("%s: out of memory", fn);
  t->is_char = is_char;
  pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, t->unicode_version);
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
int32_t tok_push(gl_tokenizer *t, const uint8_t *s, int64_t len, int32_t left, int32_t right) {
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
int32_t tok_add_merge(gl_tokenizer *t, int32_t a, int32_t b) {
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

int tok_add_specials(const char *fn, gl_tokenizer *t, int n, const char *const *names) {
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

void merge_scratch_free(merge_scratch *s) { free(s->next); free(s->prev); free(s->heap); memset(s, 0, sizeof *s); }

static int heap_push_min(merge_scratch *s, uint64_t v) { return rankheap_push(&s->heap, &s->heap_n, &s->heap_cap, v); }

enum { MERGE_SCAN_MAX = 64 }; /* chunks up to this many ids use the plain scan */

/* Merges ids[0..n) in place by rank; returns the new length or -1 (ENOMEM). */
int64_t bpe_merge(const gl_tokenizer *t, int32_t *ids, int64_t n, merge_scratch *s) {
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

int report_enc_err(const char *fn, const enc_err *err, int doc) {
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

int check_tok(const char *fn, const gl_tokenizer *t) {
  return t ? GL_OK : gl_error("%s: tokenizer expected, got NULL", fn);
}
int check_text(const char *fn, const char *text, int64_t len) {
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


/* Cut points for spreading a big text over nthreads (about 8 pieces per
   thread, at least 256 KB each, at safe cuts): cuts[0] = 0 < ... <
   cuts[*npieces] = len.  NULL when out of memory. */
int64_t *make_cuts(const uint8_t *s, int64_t len, int nthreads, int64_t *npieces) {
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
const char *gl_tok_unicode_version(const gl_tokenizer *t) {
  static char here[24];
  if (t) return t->unicode_version;
  if (!here[0]) pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, here);
  return here;
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

/* Each multi-byte ordinary token's merge, recovered the way tiktoken applies
   ranks: its bytes, encoded with the merges of lower rank, must come out as
   exactly two tokens, and those two become its pair.  Both ways of making a
   tokenizer from ranks use it (a merge list, a ranks file), so a tokenizer
   encodes the same before and after save + load.  path names the file in
   errors ("" for none); NULL means the tokens came from a merge list (ids
   256.. are its merges in order). */
int tok_derive_merges(const char *fn, const char *path, gl_tokenizer *t) {
  merge_scratch ms = {0};
  int32_t *ids = NULL; int64_t ids_cap = 0;
  int rc = GL_OK;
  char where[256];
  for (int32_t id = 0; id < t->n_ordinary && rc == GL_OK; id++) {
    int64_t n = t->tok_len[id];
    if (n == 1) continue;
    if (path && path[0]) snprintf(where, sizeof where, "'%s': token %d", path, id);
    else if (path) snprintf(where, sizeof where, "token %d", id);
    else snprintf(where, sizeof where, "merge %d (token %d)", id - 255, id);
    if (GROW(ids, ids_cap, n)) { rc = gl_error("%s: out of memory", fn); break; }
    const uint8_t *s = t->blob + t->tok_off[id];
    int64_t k;
    for (k = 0; k < n; k++) if ((ids[k] = t->byte_id[s[k]]) < 0) break;
    if (k < n) { rc = gl_error("%s: %s contains byte 0x%02x, which has no token", fn, where, s[k]); break; }
    int64_t m = bpe_merge(t, ids, n, &ms);
    if (m < 0) { rc = gl_error("%s: out of memory", fn); break; }
    if (m != 2) {
      rc = gl_error("%s: %s is not a merge of two tokens of lower rank (%s)", fn, where,
                    m == 1 ? "it duplicates another token" : "its bytes do not merge to it");
      break;
    }
    int created;
    int32_t *slot = pairmap_slot(&t->pairs, pair_key(ids[0], ids[1]), &created);
    if (!slot || GROW(t->merge_ids, t->merge_cap, t->n_merges + 1)) { rc = gl_error("%s: out of memory", fn); break; }
    *slot = id;
    t->left[id] = ids[0]; t->right[id] = ids[1];
    t->merge_ids[t->n_merges++] = id;
  }
  merge_scratch_free(&ms);
  free(ids);
  return rc;
}

/* A merge list (a, b) -> id 256 + i: the tokens' bytes are the pairs'
   concatenations; the pairs that encoding uses are then derived by rank
   (tok_derive_merges), as tiktoken does, so a merge such as (ab, c) after
   (b, c) is reached as (a, bc). */
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
  uint8_t *tmp = NULL; int64_t tmp_cap = 0;
  for (int i = 0; i < n_merges; i++) {
    int32_t a = pairs[2 * i], b = pairs[2 * i + 1];
    if (a < 0 || a >= t->n_ordinary || b < 0 || b >= t->n_ordinary) {
      gl_error("%s: merge %d joins (%d, %d), expected ids in [0, %d)", fn, i + 1, a, b, t->n_ordinary);
      free(tmp); gl_tok_free(t); return NULL;
    }
    int64_t la = t->tok_len[a], lb = t->tok_len[b];
    if (GROW(tmp, tmp_cap, la + lb)) { free(tmp); goto nomem; }
    memcpy(tmp, t->blob + t->tok_off[a], (size_t)la);
    memcpy(tmp + la, t->blob + t->tok_off[b], (size_t)lb);
    if (tok_push(t, tmp, la + lb, -1, -1) < 0) { free(tmp); goto nomem; }
    t->n_ordinary++;
  }
  free(tmp);
  if (tok_derive_merges(fn, NULL, t) || tok_add_specials(fn, t, n_special, special)) { gl_tok_free(t); return NULL; }
  return t;
nomem:
  gl_tok_free(t);
  return gl_error_null("%s: out of memory", fn);
}

gl_tokenizer *gl_tok_from_ranks(const char *pattern, int n_ordinary, const char *const *tokens, const int64_t *lens,
                                int n_special, const char *const *special) {
  const char *fn = "gl_tok_from_ranks";
  GL_NONNULL_OR(NULL, fn, tokens, lens);
  if (n_special > 0 && !special) return gl_error_null("%s: special expected %d names, got NULL", fn, n_special);
  if (n_ordinary < 256) return gl_error_null("%s: n_ordinary expected >= 256 (a token per byte), got %d", fn, n_ordinary);
  gl_tokenizer *t = tok_new(fn, pattern, 0);
  if (!t) return NULL;
  for (int i = 0; i < n_ordinary; i++) {
    if (!tokens[i] || lens[i] < 1 || lens[i] > INT32_MAX) {
      gl_error("%s: token %d expected 1 or more bytes, got %s", fn, i, tokens[i] ? "none" : "NULL");
      gl_tok_free(t); return NULL;
    }
    const uint8_t *s = (const uint8_t *)tokens[i];
    if (lens[i] == 1) {
      if (t->byte_id[s[0]] >= 0) {
        gl_error("%s: token %d is byte 0x%02x, which is token %d already", fn, i, s[0], t->byte_id[s[0]]);
        gl_tok_free(t); return NULL;
      }
      t->byte_id[s[0]] = i;
    }
    if (tok_push(t, s, lens[i], -1, -1) < 0) { gl_tok_free(t); return gl_error_null("%s: out of memory", fn); }
    t->n_ordinary++;
  }
  for (int b = 0; b < 256; b++)
    if (t->byte_id[b] < 0) { gl_error("%s: byte 0x%02x has no token", fn, b); gl_tok_free(t); return NULL; }
  if (tok_derive_merges(fn, "", t) || tok_add_specials(fn, t, n_special, special)) { gl_tok_free(t); return NULL; }
  return t;
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

