/* tokenizer_train.c — learning a byte-level BPE from text (gl_bpe_trainer).
 *
 * Counts unique chunks, then merges the most frequent pair repeatedly, keeping
 * pair counts up to date incrementally: each pair knows the words it occurs in,
 * a merge rewrites only those words and applies count deltas for their
 * neighbours; a lazy max-heap picks the next pair (stale entries are re-pushed
 * with their current count when popped). */
#include <omp.h>
#include "tokenizer_internal.h"

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

