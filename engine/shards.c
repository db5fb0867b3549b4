/* shards.c — token shard files.
 *
 * Layout: a 64-byte gl_shard_header, then n_tokens little-endian uint16
 * (vocab_size <= 65536) or uint32 tokens.  The checksum is FNV-1a 64 taken
 * over the token values, one 32-bit word per token, so it does not depend on
 * the storage width and can be computed while streaming.
 *
 * The writer streams appends into path.tmp and renames it to path once the
 * header is final.  The reader maps the file and validates everything before
 * anyone reads a token: header fields, exact size, checksum, token range.
 * Token ids are int32 once read (gl_shard_tokens, the model's embedding), so
 * a vocabulary holds at most 2^31 ids.
 *
 * The reader also takes llm.c's shards (by their magic) and nanoGPT's raw
 * uint16 train.bin/val.bin (when asked: GL_SHARD_RAW_U16), so data people
 * already have trains without conversion. */
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include "internal.h"

static const char SHARD_MAGIC[8] = {'G', 'L', 'T', 'O', 'K', 'E', 'N', 'S'};
#define GL_SHARD_MAX_VOCAB 2147483648LL   /* ids 0 .. 2^31-1 fit int32 */
enum { FNV_BLOCK = 1 << 16 };
static const uint64_t FNV_OFFSET = 0xcbf29ce484222325ULL, FNV_PRIME = 0x100000001b3ULL;

_Static_assert(sizeof(gl_shard_header) == GL_SHARD_HEADER_BYTES, "shard header must be 64 bytes");

void gl_data_free(void *p) { free(p); }

/* token i of a payload of tb-byte little-endian tokens */
static inline uint32_t token_at(const uint8_t *data, uint32_t tb, int64_t i) {
  if (tb == 2) { uint16_t u; memcpy(&u, data + 2 * i, 2); return u; }
  uint32_t u; memcpy(&u, data + 4 * i, 4); return u;
}

/* ------------------------------------------------------------ writer */

struct gl_shard_writer {
  char *path, *tmp;
  FILE *f;
  uint32_t token_bytes;
  int64_t vocab_size;
  uint64_t n, checksum;
  void *buf;              /* converted tokens, FNV_BLOCK at a time */
};

static void writer_free(gl_shard_writer *w) {
  if (!w) return;
  if (w->f) fclose(w->f);
  free(w->path); free(w->tmp); free(w->buf); free(w);
}

gl_shard_writer *gl_shard_writer_open(const char *path, int64_t vocab_size) {
  const char *fn = "gl_shard_writer_open";
  if (!path) return gl_error_null("%s: path expected, got NULL", fn);
  if (vocab_size < 1 || vocab_size > GL_SHARD_MAX_VOCAB)
    return gl_error_null("%s: vocab_size expected in [1, 2^31], got %lld", fn, (long long)vocab_size);
  gl_shard_writer *w = calloc(1, sizeof *w);
  size_t pl = strlen(path);
  if (!w || !(w->path = strdup(path)) || !(w->tmp = malloc(pl + 5)) || !(w->buf = malloc(FNV_BLOCK * 4))) {
    writer_free(w);
    return gl_error_null("%s: out of memory", fn);
  }
  memcpy(w->tmp, path, pl); memcpy(w->tmp + pl, ".tmp", 5);
  w->token_bytes = vocab_size <= 65536 ? 2 : 4;
  w->vocab_size = vocab_size;
  w->checksum = FNV_OFFSET;
  w->f = fopen(w->tmp, "wb");
  if (!w->f) { int e = errno; gl_error("%s: cannot create '%s': %s", fn, w->tmp, strerror(e)); writer_free(w); return NULL; }
  static const uint8_t zero[GL_SHARD_HEADER_BYTES];
  if (fwrite(zero, 1, sizeof zero, w->f) != sizeof zero) {
    gl_error("%s: cannot write '%s': %s", fn, w->tmp, strerror(errno));
    gl_shard_writer_abort(w);
    return NULL;
  }
  return w;
}

int gl_shard_writer_append(gl_shard_writer *w, const gl_tensor *ids) {
  const char *fn = "gl_shard_writer_append";
  if (!w) return gl_error("%s: writer expected, got NULL", fn);
  GL_CHECK_T(ids, fn, "ids");
  if (ids->device != GL_DEVICE_CPU || ids->ndim != 1 || !gl_is_contiguous(ids) ||
      (ids->dtype != GL_I32 && ids->dtype != GL_I64))
    return gl_error("%s: ids expected a 1-D contiguous int32/int64 CPU tensor, got %dD %s", fn, ids->ndim,
                    gl_dtype_name(ids->dtype));
  const void *src = gl_data_ptr(ids);
  int is64 = ids->dtype == GL_I64;
  for (int64_t done = 0; done < ids->numel;) {
    int64_t n = ids->numel - done < FNV_BLOCK ? ids->numel - done : FNV_BLOCK;
    uint64_t h = w->checksum;
    for (int64_t i = 0; i < n; i++) {
      int64_t v = is64 ? ((const int64_t *)src)[done + i] : ((const int32_t *)src)[done + i];
      if (v < 0 || v >= w->vocab_size)
        return gl_error("%s: ids[%lld] = %lld is out of range [0, %lld) for '%s'", fn, (long long)(done + i + 1),
                        (long long)v, (long long)w->vocab_size, w->path);
      if (w->token_bytes == 2) ((uint16_t *)w->buf)[i] = (uint16_t)v;
      else ((uint32_t *)w->buf)[i] = (uint32_t)v;
      h = (h ^ (uint64_t)v) * FNV_PRIME;
    }
    if (fwrite(w->buf, w->token_bytes, (size_t)n, w->f) != (size_t)n)
      return gl_error("%s: cannot write '%s': %s", fn, w->tmp, strerror(errno));
    w->checksum = h;
    w->n += (uint64_t)n;
    done += n;
  }
  return GL_OK;
}

int64_t gl_shard_writer_count(const gl_shard_writer *w) {
  return w ? (int64_t)w->n : gl_error("gl_shard_writer_count: writer expected, got NULL");
}

int gl_shard_writer_close(gl_shard_writer *w) {
  const char *fn = "gl_shard_writer_close";
  if (!w) return gl_error("%s: writer expected, got NULL", fn);
  gl_shard_header h;
  memset(&h, 0, sizeof h);
  memcpy(h.magic, SHARD_MAGIC, 8);
  h.version = GL_SHARD_VERSION;
  h.token_bytes = w->token_bytes;
  h.vocab_size = (uint32_t)w->vocab_size;
  h.header_bytes = GL_SHARD_HEADER_BYTES;
  h.n_tokens = w->n;
  h.checksum = w->checksum;
  int ok = fseek(w->f, 0, SEEK_SET) == 0 && fwrite(&h, sizeof h, 1, w->f) == 1 && fflush(w->f) == 0 &&
           fsync(fileno(w->f)) == 0;
  int e = errno;
  ok = (fclose(w->f) == 0) && ok;
  w->f = NULL;
  if (!ok || rename(w->tmp, w->path) != 0) {
    if (ok) e = errno;
    remove(w->tmp);
    gl_error("%s: cannot write '%s': %s", fn, w->path, strerror(e));
    writer_free(w);
    return GL_ERR;
  }
  writer_free(w);
  return GL_OK;
}

void gl_shard_writer_abort(gl_shard_writer *w) {
  if (!w) return;
  if (w->f) { fclose(w->f); w->f = NULL; }
  remove(w->tmp);
  writer_free(w);
}

/* ------------------------------------------------------------ reader */

struct gl_shard {
  char *path;
  void *map; size_t map_len;
  gl_shard_header h;
  int64_t max_id;   /* the largest token (-1: none), from the one pass of gl_shard_open */
};

static int check_header(const char *fn, const char *path, const gl_shard_header *h, int64_t file_bytes) {
  if (memcmp(h->magic, SHARD_MAGIC, 8) != 0)
    return gl_error("%s: '%s' is not a token shard (magic expected \"GLTOKENS\")", fn, path);
  if (h->version != GL_SHARD_VERSION)
    return gl_error("%s: '%s': version expected %d, got %u", fn, path, GL_SHARD_VERSION, h->version);
  if (h->header_bytes != GL_SHARD_HEADER_BYTES)
    return gl_error("%s: '%s': header_bytes expected %d, got %u", fn, path, GL_SHARD_HEADER_BYTES, h->header_bytes);
  if (h->token_bytes != 2 && h->token_bytes != 4)
    return gl_error("%s: '%s': token_bytes expected 2 or 4, got %u", fn, path, h->token_bytes);
  if (h->vocab_size == 0 || (h->token_bytes == 2 && h->vocab_size > 65536))
    return gl_error("%s: '%s': vocab_size %u does not fit %u-byte tokens", fn, path, h->vocab_size, h->token_bytes);
  if (h->vocab_size > GL_SHARD_MAX_VOCAB)
    return gl_error("%s: '%s': vocab_size %u is past 2^31 (token ids are int32)", fn, path, h->vocab_size);
  /* bounded so that the size below cannot overflow */
  if (h->n_tokens > (uint64_t)(INT64_MAX - GL_SHARD_HEADER_BYTES) / h->token_bytes)
    return gl_error("%s: '%s': n_tokens %llu is not plausible", fn, path, (unsigned long long)h->n_tokens);
  int64_t want = GL_SHARD_HEADER_BYTES + (int64_t)h->n_tokens * h->token_bytes;
  if (file_bytes < want)
    return gl_error("%s: '%s' is truncated: the header promises %llu tokens (%lld bytes), the file has %lld bytes",
                    fn, path, (unsigned long long)h->n_tokens, (long long)want, (long long)file_bytes);
  if (file_bytes > want)
    return gl_error("%s: '%s' has %lld bytes after its %llu tokens", fn, path, (long long)(file_bytes - want),
                    (unsigned long long)h->n_tokens);
  return GL_OK;
}

/* The other formats are read into a gl_shard_header too, so one reader
   serves all: magic names the format ("LLM.C", "RAW16", zero-padded),
   header_bytes is where the tokens start, vocab_size is 0 (unknown: tokens
   are checked against the model's vocabulary, else the width's range) and
   checksum 0 (they have none).
   llm.c (and modded-nanogpt): 256 little-endian int32, [0] = 20240520,
   [1] = version (1: uint16 tokens, 2: uint32), [2] = token count, then the
   tokens; llm.c's LLaMA-3 files the same with [0] = 20240801, [1] = 7 and
   uint32 tokens.  nanoGPT's train.bin/val.bin: raw uint16 tokens, no header, so
   nothing in the file says what it is: only an explicit GL_SHARD_RAW_U16
   reads it, and that refuses a file that starts like the other two. */
static const char LLMC_NAME[8] = {'L', 'L', 'M', '.', 'C', 0, 0, 0};
static const char RAW_NAME[8] = {'R', 'A', 'W', '1', '6', 0, 0, 0};
enum { LLMC_MAGIC = 20240520, LLMC_LLAMA3_MAGIC = 20240801, LLMC_LLAMA3_VERSION = 7, LLMC_HEADER_BYTES = 1024 };

static int llmc_header(const char *fn, const char *path, const int32_t *w, int64_t file_bytes, gl_shard_header *h) {
  if (file_bytes < LLMC_HEADER_BYTES)
    return gl_error("%s: '%s' is truncated: %lld bytes, smaller than llm.c's %d-byte header", fn, path,
                    (long long)file_bytes, LLMC_HEADER_BYTES);
  int llama3 = w[0] == LLMC_LLAMA3_MAGIC;
  if (llama3 && w[1] != LLMC_LLAMA3_VERSION)
    return gl_error("%s: '%s': llm.c LLaMA-3 shard version expected %d (uint32 tokens), got %d", fn, path,
                    LLMC_LLAMA3_VERSION, w[1]);
  if (!llama3 && w[1] != 1 && w[1] != 2)
    return gl_error("%s: '%s': llm.c shard version expected 1 (uint16 tokens) or 2 (uint32), got %d", fn, path, w[1]);
  if (w[2] < 0) return gl_error("%s: '%s': llm.c token count expected >= 0, got %d", fn, path, w[2]);
  memset(h, 0, sizeof *h);
  memcpy(h->magic, LLMC_NAME, 8);
  h->version = (uint32_t)w[1];
  h->token_bytes = w[1] == 1 ? 2 : 4;
  h->header_bytes = LLMC_HEADER_BYTES;
  h->n_tokens = (uint64_t)w[2];
  int64_t want = LLMC_HEADER_BYTES + (int64_t)h->n_tokens * h->token_bytes;
  if (file_bytes != want)
    return gl_error("%s: '%s' has %lld bytes, expected %lld (llm.c's header promises %llu tokens of %u bytes)", fn, path,
                    (long long)file_bytes, (long long)want, (unsigned long long)h->n_tokens, h->token_bytes);
  return GL_OK;
}

static int raw_header(const char *fn, const char *path, const uint8_t *head, int64_t file_bytes, gl_shard_header *h) {
  int32_t w0 = 0;
  if (file_bytes >= 4) memcpy(&w0, head, 4);
  int llmc = w0 == LLMC_MAGIC || w0 == LLMC_LLAMA3_MAGIC;
  if ((file_bytes >= 8 && memcmp(head, SHARD_MAGIC, 8) == 0) || llmc)
    return gl_error("%s: '%s' is a %s shard, not raw uint16 tokens: read it with shard_format = 'auto'", fn, path,
                    llmc ? "llm.c" : "gptlua");
  if (file_bytes == 0) return gl_error("%s: '%s' holds no tokens (an empty file)", fn, path);
  if (file_bytes % 2)
    return gl_error("%s: '%s' has %lld bytes, expected an even count (raw uint16 tokens)", fn, path, (long long)file_bytes);
  memset(h, 0, sizeof *h);
  memcpy(h->magic, RAW_NAME, 8);
  h->token_bytes = 2;
  h->n_tokens = (uint64_t)(file_bytes / 2);
  return GL_OK;
}

int gl_shard_read_header(const char *path, int format, gl_shard_header *out) {
  const char *fn = "gl_shard_read_header";
  GL_NONNULL(fn, path, out);
  if (format != GL_SHARD_AUTO && format != GL_SHARD_RAW_U16)
    return gl_error("%s: format expected GL_SHARD_AUTO (0) or GL_SHARD_RAW_U16 (1), got %d", fn, format);
  int fd = open(path, O_RDONLY);
  if (fd < 0) return gl_error("%s: cannot open '%s': %s", fn, path, strerror(errno));
  struct stat sb;
  int32_t w[LLMC_HEADER_BYTES / 4] = {0};
  int rc = GL_OK;
  if (fstat(fd, &sb) != 0) { rc = gl_error("%s: cannot stat '%s': %s", fn, path, strerror(errno)); goto done; }
  int64_t size = (int64_t)sb.st_size, head = size < LLMC_HEADER_BYTES ? size : LLMC_HEADER_BYTES;
  if (pread(fd, w, (size_t)head, 0) != (ssize_t)head) { rc = gl_error("%s: cannot read '%s': %s", fn, path, strerror(errno)); goto done; }
  if (format == GL_SHARD_RAW_U16) rc = raw_header(fn, path, (const uint8_t *)w, size, out);
  else if (size >= 8 && memcmp(w, SHARD_MAGIC, 8) == 0) {
    if (size < GL_SHARD_HEADER_BYTES)
      rc = gl_error("%s: '%s' is truncated: %lld bytes, smaller than the %d-byte header", fn, path,
                    (long long)size, GL_SHARD_HEADER_BYTES);
    else { memcpy(out, w, sizeof *out); rc = check_header(fn, path, out, size); }
  } else if (size >= 4 && (w[0] == LLMC_MAGIC || w[0] == LLMC_LLAMA3_MAGIC)) rc = llmc_header(fn, path, w, size, out);
  else if (size < GL_SHARD_HEADER_BYTES && size < 4)
    rc = gl_error("%s: '%s' is truncated: %lld bytes, smaller than the %d-byte header", fn, path,
                  (long long)size, GL_SHARD_HEADER_BYTES);
  else
    rc = gl_error("%s: '%s' is not a token shard (magic expected \"GLTOKENS\", or llm.c's %d or %d; nanoGPT's raw "
                  "train.bin/val.bin: shard_format = 'nanogpt')", fn, path, LLMC_MAGIC, LLMC_LLAMA3_MAGIC);
done:
  close(fd);
  return rc;
}

gl_shard *gl_shard_open(const char *path, int64_t vocab_limit, int format) {
  const char *fn = "gl_shard_open";
  gl_shard_header h;
  GL_NONNULL_OR(NULL, fn, path);
  if (gl_shard_read_header(path, format, &h)) return NULL;
  int checked = memcmp(h.magic, SHARD_MAGIC, 8) == 0;   /* has a vocabulary and a checksum */
  int64_t limit = h.vocab_size ? (int64_t)h.vocab_size : h.token_bytes == 2 ? 65536 : GL_SHARD_MAX_VOCAB;
  int by_model = vocab_limit > 0 && vocab_limit < limit;
  if (by_model) limit = vocab_limit;
  gl_shard *s = calloc(1, sizeof *s);
  if (!s || !(s->path = strdup(path))) { free(s); return gl_error_null("%s: out of memory", fn); }
  s->h = h;
  s->map_len = h.header_bytes + (size_t)h.n_tokens * h.token_bytes;
  int fd = open(path, O_RDONLY);
  if (fd < 0) { gl_error("%s: cannot open '%s': %s", fn, path, strerror(errno)); gl_shard_close(s); return NULL; }
  s->map = mmap(NULL, s->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
  int e = errno;
  close(fd);
  if (s->map == MAP_FAILED) {
    s->map = NULL;
    gl_error("%s: cannot map '%s': %s", fn, path, strerror(e));
    gl_shard_close(s);
    return NULL;
  }
  madvise(s->map, s->map_len, MADV_WILLNEED);
  /* one pass: checksum and range */
  const uint8_t *data = (const uint8_t *)s->map + h.header_bytes;
  uint64_t hsum = FNV_OFFSET;
  int64_t n = (int64_t)h.n_tokens, bad = -1;
  uint32_t maxv = 0;
  s->max_id = -1;
  for (int64_t start = 0; start < n && bad < 0; start += FNV_BLOCK) {
    int64_t end = start + FNV_BLOCK < n ? start + FNV_BLOCK : n;
    uint32_t bmax = 0;
    for (int64_t i = start; i < end; i++) {
      uint32_t v = token_at(data, h.token_bytes, i);
      hsum = (hsum ^ v) * FNV_PRIME;
      if (v > bmax) bmax = v;
    }
    if ((int64_t)bmax > s->max_id) s->max_id = bmax;
    if (bmax >= limit) /* find the first offender for the message */
      for (int64_t i = start; i < end; i++) {
        uint32_t v = token_at(data, h.token_bytes, i);
        if (v >= limit) { bad = i; maxv = v; break; }
      }
  }
  if (bad >= 0) {
    gl_error("%s: '%s': token %lld is %u, expected < %lld (%s)", fn, path, (long long)bad, maxv, (long long)limit,
             by_model ? "the model's vocab_size" : h.vocab_size ? "the shard's vocab_size" : "ids are int32");
    gl_shard_close(s);
    return NULL;
  }
  if (checked && hsum != h.checksum) {
    gl_error("%s: '%s': checksum mismatch (header %016llx, payload %016llx): the file is corrupt", fn, path,
             (unsigned long long)h.checksum, (unsigned long long)hsum);
    gl_shard_close(s);
    return NULL;
  }
  return s;
}

void gl_shard_close(gl_shard *s) {
  if (!s) return;
  if (s->map) munmap(s->map, s->map_len);
  free(s->path);
  free(s);
}

int64_t gl_shard_n_tokens(const gl_shard *s) { return s ? (int64_t)s->h.n_tokens : gl_error("gl_shard_n_tokens: shard expected, got NULL"); }
int gl_shard_token_bytes(const gl_shard *s) { return s ? (int)s->h.token_bytes : gl_error("gl_shard_token_bytes: shard expected, got NULL"); }
int64_t gl_shard_max_id(const gl_shard *s) { return s ? s->max_id : gl_error("gl_shard_max_id: shard expected, got NULL"); }
int64_t gl_shard_vocab_size(const gl_shard *s) { return s ? (int64_t)s->h.vocab_size : gl_error("gl_shard_vocab_size: shard expected, got NULL"); }
const void *gl_shard_data(const gl_shard *s) {
  GL_NONNULL_OR(NULL, "gl_shard_data", s);
  return (const uint8_t *)s->map + s->h.header_bytes;
}
const char *gl_shard_path(const gl_shard *s) {
  GL_NONNULL_OR(NULL, "gl_shard_path", s);
  return s->path;
}

gl_tensor *gl_shard_tokens(const gl_shard *s, int64_t start, int64_t n) {
  const char *fn = "gl_shard_tokens";
  if (!s) return gl_error_null("%s: shard expected, got NULL", fn);
  int64_t total = (int64_t)s->h.n_tokens;
  if (start < 0 || n < 0 || start > total || n > total - start)
    return gl_error_null("%s: range [%lld, %lld) expected within [0, %lld) of '%s'", fn, (long long)start,
                         (long long)(start + n), (long long)total, s->path);
  int64_t shape[1] = {n};
  gl_tensor *out = gl_empty_host(GL_I32, 1, shape);
  if (!out) return NULL;
  int32_t *dst = gl_data_ptr(out);
  const uint8_t *data = gl_shard_data(s);
  for (int64_t i = 0; i < n; i++) dst[i] = (int32_t)token_at(data, s->h.token_bytes, start + i);
  return out;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

char *gl_list_files(const char *dir, const char *prefix, const char *suffix) {
  const char *fn = "gl_list_files";
  if (!dir) return gl_error_null("%s: dir expected, got NULL", fn);
  if (!prefix) prefix = "";
  if (!suffix) suffix = "";
  DIR *d = opendir(dir);
  if (!d) return gl_error_null("%s: cannot open directory '%s': %s", fn, dir, strerror(errno));
  char **names = NULL; int64_t n = 0, cap = 0;
  size_t total = 1, dl = strlen(dir), pl = strlen(prefix), sl = strlen(suffix);
  int oom = 0;
  char *full = malloc(dl + 2 + 256 + 1);
  for (struct dirent *e; full && (e = readdir(d)) != NULL;) {
    size_t nl = strlen(e->d_name);
    if (e->d_name[0] == '.' || nl < pl + sl || strncmp(e->d_name, prefix, pl) != 0 ||
        strcmp(e->d_name + nl - sl, suffix) != 0) continue;
    struct stat sb;
    snprintf(full, dl + 2 + 256 + 1, "%s/%s", dir, e->d_name);
    if (stat(full, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 64;
      char **q = realloc(names, (size_t)cap * sizeof(char *));
      if (!q) { oom = 1; break; }
      names = q;
    }
    if (!(names[n] = strdup(e->d_name))) { oom = 1; break; }
    total += dl + 1 + nl + 1;
    n++;
  }
  closedir(d);
  char *out = oom || !full ? NULL : malloc(total);
  free(full);
  if (out) {
    qsort(names, (size_t)n, sizeof(char *), cmp_str);
    char *p = out;
    for (int64_t i = 0; i < n; i++) p += sprintf(p, "%s/%s\n", dir, names[i]);
    *p = 0;
  }
  for (int64_t i = 0; i < n; i++) free(names[i]);
  free(names);
  if (!out) return gl_error_null("%s: out of memory", fn);
  return out;
}
