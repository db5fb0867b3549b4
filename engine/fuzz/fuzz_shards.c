/* fuzz_shards.c — libFuzzer harness for engine/shards.c and the batch loader
 * (engine/loader.c) reading a shard: the input is a whole token shard file,
 * read as gptlua's or llm.c's format (by its magic) or, for one seed in
 * four, as nanoGPT's raw uint16 tokens.
 * Each input is tried twice: as it is, and with the header's checksum
 * recomputed over the payload, so that mutations get past the checksum to the
 * size and token-range checks and to the loader (the one place this harness
 * restates the format: FNV-1a 64 over the token values as 32-bit numbers). */
#include "fuzz_common.h"
#include "gptlua.h"

static void require_message(void) {
  const char *m = gl_last_error();
  fuzz_require(m && strncmp(m, "gl_", 3) == 0, "refusal without a gl_ message: '%s'", m ? m : "(null)");
}

/* a loader over the shard: a few batches of short rows, both samplings */
static void load_batches(const char *path, int format, int64_t n_tokens, int64_t vocab, uint64_t seed, int bos) {
  gl_loader_config cfg = {0};
  cfg.batch_size = 2; cfg.block_size = 1 + (int64_t)(seed % 7);
  cfg.rank = 0; cfg.world_size = 1; cfg.seed = seed;
  cfg.sampling = (int32_t)(seed & 1); cfg.bos_aligned = bos; cfg.bos_id = 0;
  cfg.vocab_size = vocab; cfg.prefetch = 2; cfg.shard_format = format;
  gl_loader *L = gl_loader_new(&cfg);
  fuzz_require(L != NULL, "gl_loader_new refused a valid config: %s", gl_last_error());
  if (gl_loader_add_shard(L, path) != GL_OK) { require_message(); gl_loader_free(L); return; }
  fuzz_require(gl_loader_n_tokens(L) == n_tokens, "loader sees %lld tokens, shard has %lld",
               (long long)gl_loader_n_tokens(L), (long long)n_tokens);
  if (gl_loader_start(L, 0) != GL_OK) { require_message(); gl_loader_free(L); return; }
  for (int b = 0; b < 3; b++) {
    gl_tensor *x = NULL, *y = NULL;
    if (gl_loader_next(L, &x, &y) != GL_OK) { require_message(); break; }
    const int64_t *xs = gl_data_ptr(x), *ys = gl_data_ptr(y);
    for (int64_t i = 0; i < x->numel; i++)
      fuzz_require(xs[i] >= 0 && xs[i] < vocab && ys[i] >= 0 && ys[i] < vocab, "batch token out of range");
    gl_tensor_free(x); gl_tensor_free(y);
  }
  gl_loader_free(L);
}

static void try_shard(const char *path, uint64_t seed) {
  gl_shard_header h;
  int format = seed % 4 == 3 ? GL_SHARD_RAW_U16 : GL_SHARD_AUTO;
  int64_t limit = (int64_t)(seed % 3 == 0 ? 0 : 1 + seed % 300);
  int hdr_ok = gl_shard_read_header(path, format, &h) == GL_OK;
  if (!hdr_ok) require_message();
  gl_shard *s = gl_shard_open(path, limit, format);
  if (!s) { require_message(); return; }
  fuzz_require(hdr_ok, "gl_shard_open accepted a shard whose header gl_shard_read_header refused");
  int64_t n = gl_shard_n_tokens(s), vocab = gl_shard_vocab_size(s);
  fuzz_require(n >= 0 && vocab >= 0, "shard of %lld tokens, vocab %lld", (long long)n, (long long)vocab);
  /* formats without a vocabulary: the bound is the limit asked for, else the width's */
  if (vocab == 0) vocab = limit > 0 ? limit : gl_shard_token_bytes(s) == 2 ? 65536 : 2147483647;
  else if (limit > 0 && limit < vocab) vocab = limit;
  int64_t starts[3] = { 0, n / 2, n - 1 }, lens[3] = { n, 1, 2 };
  for (int k = 0; k < 3; k++) {
    gl_tensor *t = gl_shard_tokens(s, starts[k], lens[k]);
    if (!t) { require_message(); continue; }
    const int32_t *v = gl_data_ptr(t);
    for (int64_t i = 0; i < t->numel; i++) fuzz_require(v[i] >= 0 && v[i] < vocab, "token %d out of range", v[i]);
    gl_tensor_free(t);
  }
  gl_shard_close(s);
  load_batches(path, format, n, vocab, seed, (int)(seed >> 8) & 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static char path[512];
  if (!path[0]) fuzz_path(path, sizeof path, "in.bin");
  uint64_t seed = 0;
  for (size_t i = 0; i < size && i < 64; i++) seed = seed * 31 + data[i];
  fuzz_write(path, data, size);
  try_shard(path, seed);
  if (size < GL_SHARD_HEADER_BYTES) return 0;
  gl_shard_header h;
  memcpy(&h, data, sizeof h);
  if (h.token_bytes != 2 && h.token_bytes != 4) return 0;
  uint8_t *fixed = malloc(size);
  memcpy(fixed, data, size);
  uint64_t sum = 0xcbf29ce484222325ULL;
  size_t ntok = (size - GL_SHARD_HEADER_BYTES) / h.token_bytes;
  if (h.n_tokens < ntok) ntok = (size_t)h.n_tokens;
  for (size_t i = 0; i < ntok; i++) {
    const uint8_t *p = fixed + GL_SHARD_HEADER_BYTES + i * h.token_bytes;
    uint32_t v = h.token_bytes == 2 ? (uint32_t)(p[0] | p[1] << 8) : (uint32_t)(p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24);
    sum = (sum ^ v) * 0x100000001b3ULL;
  }
  h.checksum = sum;
  memcpy(fixed, &h, sizeof h);
  fuzz_write(path, fixed, size);
  try_shard(path, seed);
  free(fixed);
  return 0;
}
