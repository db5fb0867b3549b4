/* fuzz_tokenizer.c — libFuzzer harness for the tokenizer files read by
 * engine/tokenizer.c (gl_tok_load): the input is the ranks file (tiktoken's
 * "base64-token rank" lines), optionally followed by a NUL byte and the JSON
 * sidecar (type, pattern, special tokens).  A tokenizer the engine accepted
 * must work: a byte-level BPE one round-trips any text through encode and
 * decode, every id has bytes, and it saves and loads back the same. */
#include "fuzz_common.h"
#include "gptlua.h"

static void require_message(void) {
  const char *m = gl_last_error();
  fuzz_require(m && strncmp(m, "gl_", 3) == 0, "refusal without a gl_ message: '%s'", m ? m : "(null)");
}

/* encode + decode; BPE must give the text back */
static void roundtrip(const gl_tokenizer *t, const char *text, int64_t len) {
  gl_tensor *ids = gl_tok_encode(t, text, len, -1);
  if (!ids) { require_message(); return; }
  const int32_t *v = gl_data_ptr(ids);
  int64_t n = ids->numel;
  int64_t dl = gl_tok_decoded_len(t, v, n);
  fuzz_require(dl >= 0, "ids from encode do not decode: %s", gl_last_error());
  char *out = malloc((size_t)dl + 1);
  fuzz_require(gl_tok_decode(t, v, n, out) == GL_OK, "decode failed: %s", gl_last_error());
  if (!gl_tok_is_char(t))
    fuzz_require(dl == len && memcmp(out, text, (size_t)len) == 0, "BPE round trip changed a %lld-byte text", (long long)len);
  free(out);
  gl_tensor_free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static char path[512], side[512], out[512];
  if (!path[0]) {
    fuzz_path(path, sizeof path, "tok.bpe"); fuzz_path(side, sizeof side, "tok.bpe.json");
    fuzz_path(out, sizeof out, "out.bpe");
  }
  const uint8_t *nul = memchr(data, 0, size);
  size_t ranks_len = nul ? (size_t)(nul - data) : size;
  fuzz_write(path, data, ranks_len);
  if (nul) fuzz_write(side, nul + 1, size - ranks_len - 1);
  else unlink(side);
  gl_tokenizer *t = gl_tok_load(path);
  if (!t) { require_message(); return 0; }
  int V = gl_tok_vocab_size(t);
  fuzz_require(V > 0 && gl_tok_n_ordinary(t) <= V, "vocab %d, ordinary %d", V, gl_tok_n_ordinary(t));
  for (int id = 0; id < V; id++) {
    int64_t len = -1;
    fuzz_require(gl_tok_token_bytes(t, id, &len) != NULL && len >= 0, "id %d of %d has no bytes", id, V);
  }
  int64_t len = 0;
  fuzz_require(gl_tok_token_bytes(t, V, &len) == NULL, "id past the vocab has bytes");
  static const char sample[] = "Hello, world! It's 2026: naïve café, 東京, \xf0\x9f\x98\x80 and \xff\xfe bytes.\n\n  x";
  roundtrip(t, sample, (int64_t)sizeof sample - 1);
  roundtrip(t, (const char *)data, (int64_t)(ranks_len < 512 ? ranks_len : 512));
  if (gl_tok_save(t, out) == GL_OK) {
    gl_tokenizer *u = gl_tok_load(out);
    fuzz_require(u != NULL, "a saved tokenizer does not load: %s", gl_last_error());
    fuzz_require(gl_tok_vocab_size(u) == V && gl_tok_n_merges(u) == gl_tok_n_merges(t) &&
                 gl_tok_is_char(u) == gl_tok_is_char(t), "save and load changed the tokenizer");
    gl_tok_free(u);
  } else {
    require_message();
  }
  gl_tok_free(t);
  return 0;
}
