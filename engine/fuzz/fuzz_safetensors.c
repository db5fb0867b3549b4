/* fuzz_safetensors.c — libFuzzer harness for engine/safetensors.c: the input
 * is a whole .safetensors file.  Opens it, reads every name, the metadata and
 * every tensor, then writes what it read back through gl_safetensors_save and
 * reopens that: a file the engine accepted must round-trip (same count,
 * names and bytes), and a refusal must leave a message. */
#include "fuzz_common.h"
#include "gptlua.h"

static void require_message(void) {
  const char *m = gl_last_error();
  fuzz_require(m && strncmp(m, "gl_", 3) == 0, "refusal without a gl_ message: '%s'", m ? m : "(null)");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static char in[512], out[512];
  if (!in[0]) { fuzz_path(in, sizeof in, "in.safetensors"); fuzz_path(out, sizeof out, "out.safetensors"); }
  fuzz_write(in, data, size);
  uint64_t sum;
  fuzz_require(gl_file_checksum(in, &sum) == GL_OK, "checksum of a readable file failed: %s", gl_last_error());
  gl_st_file *f = gl_safetensors_open(in);
  if (!f) { require_message(); return 0; }
  int n = gl_safetensors_count(f);
  fuzz_require(n >= 0, "negative count %d", n);
  const char **names = calloc((size_t)n + 1, sizeof *names);
  const gl_tensor **ts = calloc((size_t)n + 1, sizeof *ts);
  int got = 0;
  for (int i = 0; i < n; i++) {
    names[i] = gl_safetensors_name(f, i);
    fuzz_require(names[i] != NULL, "tensor %d has no name", i);
    gl_tensor *t = gl_safetensors_get(f, i);
    if (!t) { require_message(); continue; }
    fuzz_require(t->numel >= 0, "tensor %d: numel %lld", i, (long long)t->numel);
    names[got] = names[i];
    ts[got++] = t;
  }
  fuzz_require(gl_safetensors_name(f, n) == NULL && gl_safetensors_name(f, -1) == NULL, "name out of range");
  const char *meta = gl_safetensors_metadata(f);
  /* what was read must write and read back the same */
  if (gl_safetensors_save(out, got, names, ts, meta) == GL_OK) {
    gl_st_file *g = gl_safetensors_open(out);
    fuzz_require(g != NULL, "reopening a file the engine wrote failed: %s", gl_last_error());
    fuzz_require(gl_safetensors_count(g) == got, "round trip: %d tensors, wrote %d", gl_safetensors_count(g), got);
    for (int i = 0; i < got; i++) {
      int j = 0;
      while (j < got && strcmp(gl_safetensors_name(g, j), names[i]) != 0) j++;
      fuzz_require(j < got, "round trip lost '%s'", names[i]);
      gl_tensor *t = gl_safetensors_get(g, j);
      fuzz_require(t && t->numel == ts[i]->numel && t->dtype == ts[i]->dtype, "round trip changed '%s'", names[i]);
      size_t nb = (size_t)t->numel * (size_t)gl_dtype_size(t->dtype);
      fuzz_require(nb == 0 || memcmp(gl_data_ptr(t), gl_data_ptr(ts[i]), nb) == 0, "round trip changed the bytes of '%s'", names[i]);
      gl_tensor_free(t);
    }
    gl_safetensors_close(g);
  } else {
    require_message();
  }
  for (int i = 0; i < got; i++) gl_tensor_free((gl_tensor *)ts[i]);
  free(names); free(ts);
  gl_safetensors_close(f);
  return 0;
}
