/* safetensors.c — named tensors in the safetensors format: an 8-byte
 * little-endian header length, a JSON header (cJSON), then raw little-endian
 * data.  Saving is atomic (temp file, fsync, rename); loading checks every
 * size and offset against the file before reading a byte of payload. */
#include "internal.h"
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *st_dtype_names[GL_NDTYPES] = {"F32", "F64", "BF16", "F16", "I32", "I64", "U16", "U8", "BOOL",
                                                  "F8_E4M3", "F8_E5M2"};
enum { MAX_HEADER = 100 << 20 };

static int st_dtype_from_name(const char *s) {
  for (int i = 0; i < GL_NDTYPES; i++) if (!strcmp(s, st_dtype_names[i])) return i;
  return -1;
}

static int write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0) { if (errno == EINTR) continue; return -1; }
    p += w; n -= (size_t)w;
  }
  return 0;
}

int gl_safetensors_save(const char *path, int n, const char **names,
                        const gl_tensor **ts, const char *metadata_json) {
  GL_NONNULL("gl_safetensors_save", path);
  if (n > 0) GL_NONNULL("gl_safetensors_save", names, ts);  /* n == 0: may be NULL */
  if (n < 0) return gl_error("gl_safetensors_save: n must be >= 0, got %d", n);
  return gl_st_write(path, n, names, ts, metadata_json, NULL, NULL);
}

int gl_st_write(const char *path, int n, const char **names, const gl_tensor **ts, const char *metadata_json,
                void (*after_tensor)(void *arg, int i), void *arg) {
  cJSON *root = cJSON_CreateObject();
  if (metadata_json) {
    cJSON *meta = cJSON_Parse(metadata_json);
    if (!meta || !cJSON_IsObject(meta)) { cJSON_Delete(meta); cJSON_Delete(root);
      return gl_error("gl_safetensors_save: metadata is not a JSON object"); }
    cJSON *m;
    cJSON_ArrayForEach(m, meta) if (!cJSON_IsString(m)) { cJSON_Delete(meta); cJSON_Delete(root);
      return gl_error("gl_safetensors_save: metadata value '%s' is not a string", m->string); }
    cJSON_AddItemToObject(root, "__metadata__", meta);
  }
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    char arg[32]; snprintf(arg, sizeof arg, "tensor %d", i + 1);
    if (gl_tensor_check(ts[i], "gl_safetensors_save", arg)) { cJSON_Delete(root); return GL_ERR; }
    if (gl_is_meta(ts[i])) {  /* even where a plan's reads give zeros: nothing to write */
      cJSON_Delete(root);
      char sh[96];
      return gl_error("gl_safetensors_save: %s '%s' is a meta tensor %s %s (a shape without data): it has no values to "
                      "save", arg, names[i] ? names[i] : "", gl_shape_str(ts[i], sh, sizeof sh), gl_dtype_name(ts[i]->dtype));
    }
    if (!names[i] || !names[i][0] || cJSON_GetObjectItemCaseSensitive(root, names[i])) {
      cJSON_Delete(root);
      return gl_error("gl_safetensors_save: name of tensor %d is empty or repeated ('%s')", i + 1, names[i] ? names[i] : "");
    }
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "dtype", st_dtype_names[ts[i]->dtype]);
    cJSON *shape = cJSON_AddArrayToObject(e, "shape");
    for (int d = 0; d < ts[i]->ndim; d++) cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)ts[i]->shape[d]));
    int64_t nb = ts[i]->numel * gl_dtype_size(ts[i]->dtype);
    cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)off));
    cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)(off + nb)));
    cJSON_AddItemToObject(root, names[i], e);
    off += nb;
  }
  char *hdr = cJSON_PrintUnformatted(root);
  cJSON_Delete(root);
  if (!hdr) return gl_error("gl_safetensors_save: could not build the JSON header");
  size_t hlen = strlen(hdr), padded = (hlen + 7) / 8 * 8;  /* keep data 8-byte aligned */

  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) { free(hdr); return gl_error("gl_safetensors_save: cannot create '%s': %s", tmp, strerror(errno)); }
  uint64_t hsz = padded;
  uint8_t le[8]; for (int b = 0; b < 8; b++) le[b] = (uint8_t)(hsz >> (8 * b));
  int rc = write_all(fd, le, 8) || write_all(fd, hdr, hlen) || write_all(fd, "        ", padded - hlen);
  free(hdr);
  for (int i = 0; i < n && !rc; i++) {
    const gl_tensor *t = ts[i];
    if (t->device < 0 && gl_is_contiguous(t)) {
      rc = write_all(fd, (char *)t->storage->data + t->offset * gl_dtype_size(t->dtype),
                     (size_t)(t->numel * gl_dtype_size(t->dtype)));
    } else {  /* strided or on a GPU: stage a contiguous CPU copy */
      gl_tensor *c = gl_empty(t->dtype, GL_DEVICE_CPU, t->ndim, t->shape);
      if (!c || gl_copy(c, t) != GL_OK) { gl_tensor_free(c); close(fd); unlink(tmp); return GL_ERR; }
      rc = write_all(fd, c->storage->data, (size_t)(c->numel * gl_dtype_size(c->dtype)));
      gl_tensor_free(c);
    }
    if (!rc && after_tensor) after_tensor(arg, i);
  }
  if (!rc) rc = fsync(fd);
  if (close(fd) != 0) rc = -1;
  if (rc) { int e = errno; unlink(tmp); return gl_error("gl_safetensors_save: writing '%s' failed: %s", tmp, strerror(e)); }
  if (rename(tmp, path) != 0) { int e = errno; unlink(tmp);
    return gl_error("gl_safetensors_save: rename to '%s' failed: %s", path, strerror(e)); }
  return GL_OK;
}

typedef struct st_entry { char *name; int dtype, ndim; int64_t shape[GL_MAX_DIMS]; int64_t begin, end; } st_entry;
struct gl_st_file {
  int fd;
  int n;
  int64_t data_start;
  st_entry *e;
  char *metadata;
  char path[1024];
};

void gl_safetensors_close(gl_st_file *f) {
  if (!f) return;
  if (f->fd >= 0) close(f->fd);
  for (int i = 0; i < f->n; i++) free(f->e[i].name);
  free(f->e); free(f->metadata); free(f);
}

static gl_st_file *st_fail(gl_st_file *f, cJSON *root, char *hdr) {
  cJSON_Delete(root); free(hdr); gl_safetensors_close(f);
  return NULL;
}

static int cmp_begin(const void *a, const void *b) {  /* by begin, then end (empty entries first) */
  const st_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}
static int cmp_name(const void *a, const void *b) {
  return strcmp(((const st_entry *)a)->name, ((const st_entry *)b)->name);
}

gl_st_file *gl_safetensors_open(const char *path) {
  if (!path) return gl_error_null("gl_safetensors_open: path is NULL");
  gl_st_file *f = calloc(1, sizeof *f);
  if (!f) return gl_error_null("gl_safetensors_open: out of memory");
  snprintf(f->path, sizeof f->path, "%s", path);
  f->fd = open(path, O_RDONLY);
  if (f->fd < 0) { gl_error("gl_safetensors_open: cannot open '%s': %s", path, strerror(errno)); return st_fail(f, NULL, NULL); }
  struct stat sb;
  if (fstat(f->fd, &sb) != 0) { gl_error("gl_safetensors_open: cannot stat '%s'", path); return st_fail(f, NULL, NULL); }
  uint8_t le[8];
  if (sb.st_size < 8 || pread(f->fd, le, 8, 0) != 8) {
    gl_error("gl_safetensors_open: '%s' is truncated (%lld bytes, no header length)", path, (long long)sb.st_size);
    return st_fail(f, NULL, NULL);
  }
  uint64_t hsz = 0; for (int b = 0; b < 8; b++) hsz |= (uint64_t)le[b] << (8 * b);
  if (hsz > MAX_HEADER || (int64_t)hsz > sb.st_size - 8) {
    gl_error("gl_safetensors_open: '%s' header length %llu exceeds the file (%lld bytes)", path,
             (unsigned long long)hsz, (long long)sb.st_size);
    return st_fail(f, NULL, NULL);
  }
  char *hdr = malloc(hsz + 1);
  if (!hdr || pread(f->fd, hdr, hsz, 8) != (ssize_t)hsz) { gl_error("gl_safetensors_open: cannot read header of '%s'", path); return st_fail(f, NULL, hdr); }
  hdr[hsz] = 0;
  cJSON *root = cJSON_Parse(hdr);
  if (!root || !cJSON_IsObject(root)) { gl_error("gl_safetensors_open: '%s' header is not valid JSON", path); return st_fail(f, root, hdr); }
  f->data_start = 8 + (int64_t)hsz;
  int64_t data_len = sb.st_size - f->data_start;
  int count = cJSON_GetArraySize(root);
  f->e = calloc((size_t)(count > 0 ? count : 1), sizeof *f->e);
  if (!f->e) { gl_error("gl_safetensors_open: out of memory"); return st_fail(f, root, hdr); }
  cJSON *it;
  cJSON_ArrayForEach(it, root) {
    if (!strcmp(it->string, "__metadata__")) {
      if (f->metadata) { gl_error("gl_safetensors_open: '%s' __metadata__ appears twice", path); return st_fail(f, root, hdr); }
      if (!cJSON_IsObject(it)) { gl_error("gl_safetensors_open: '%s' __metadata__ is not an object", path); return st_fail(f, root, hdr); }
      cJSON *m;
      cJSON_ArrayForEach(m, it) if (!cJSON_IsString(m)) {
        gl_error("gl_safetensors_open: '%s' __metadata__ value '%s' must be a string", path, m->string);
        return st_fail(f, root, hdr);
      }
      f->metadata = cJSON_PrintUnformatted(it);
      continue;
    }
    st_entry *e = &f->e[f->n];
    cJSON *dt = cJSON_GetObjectItemCaseSensitive(it, "dtype");
    cJSON *sh = cJSON_GetObjectItemCaseSensitive(it, "shape");
    cJSON *of = cJSON_GetObjectItemCaseSensitive(it, "data_offsets");
    if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2) {
      gl_error("gl_safetensors_open: '%s' entry '%s' lacks dtype/shape/data_offsets", path, it->string);
      return st_fail(f, root, hdr);
    }
    e->dtype = st_dtype_from_name(dt->valuestring);
    if (e->dtype < 0) { gl_error("gl_safetensors_open: '%s' entry '%s' has unsupported dtype %s", path, it->string, dt->valuestring); return st_fail(f, root, hdr); }
    e->ndim = cJSON_GetArraySize(sh);
    if (e->ndim > GL_MAX_DIMS) { gl_error("gl_safetensors_open: '%s' entry '%s' has %d dims, at most %d supported", path, it->string, e->ndim, GL_MAX_DIMS); return st_fail(f, root, hdr); }
    int64_t numel = 1;
    for (int d = 0; d < e->ndim; d++) {
      cJSON *v = cJSON_GetArrayItem(sh, d);
      double x = cJSON_IsNumber(v) ? v->valuedouble : -1;
      if (x < 0 || x > 9.0e15 || x != (double)(int64_t)x || (x > 0 && numel > INT64_MAX / (int64_t)x / 8)) {
        gl_error("gl_safetensors_open: '%s' entry '%s' has an invalid size in dim %d", path, it->string, d + 1);
        return st_fail(f, root, hdr);
      }
      e->shape[d] = (int64_t)x; numel *= e->shape[d];
    }
    cJSON *b = cJSON_GetArrayItem(of, 0), *en = cJSON_GetArrayItem(of, 1);
    double bd = cJSON_IsNumber(b) ? b->valuedouble : -1, ed = cJSON_IsNumber(en) ? en->valuedouble : -1;
    if (bd < 0 || ed < bd || ed > (double)data_len) {
      gl_error("gl_safetensors_open: '%s' entry '%s' data_offsets [%.0f, %.0f] fall outside the %lld data bytes (truncated file?)",
               path, it->string, bd, ed, (long long)data_len);
      return st_fail(f, root, hdr);
    }
    if (bd != (double)(int64_t)bd || ed != (double)(int64_t)ed) {
      gl_error("gl_safetensors_open: '%s' entry '%s' data_offsets [%g, %g] must be whole byte offsets", path, it->string, bd, ed);
      return st_fail(f, root, hdr);
    }
    e->begin = (int64_t)bd; e->end = (int64_t)ed;
    if (e->end - e->begin != numel * gl_dtype_size(e->dtype)) {
      gl_error("gl_safetensors_open: '%s' entry '%s' holds %lld bytes, its shape and dtype need %lld", path,
               it->string, (long long)(e->end - e->begin), (long long)(numel * gl_dtype_size(e->dtype)));
      return st_fail(f, root, hdr);
    }
    e->name = strdup(it->string);
    f->n++;
  }
  /* names are unique, and the entries' byte ranges tile the data section: in
   * offset order each begins where the one before ended, the first at 0, the
   * last at the end of the file (no overlap, no hole, no trailing bytes) */
  st_entry *sorted = malloc(sizeof *sorted * (size_t)(f->n ? f->n : 1));
  if (!sorted) { gl_error("gl_safetensors_open: out of memory"); return st_fail(f, root, hdr); }
  memcpy(sorted, f->e, sizeof *sorted * (size_t)f->n);
  qsort(sorted, (size_t)f->n, sizeof *sorted, cmp_name);
  for (int i = 1; i < f->n; i++)
    if (!strcmp(sorted[i].name, sorted[i - 1].name)) {
      gl_error("gl_safetensors_open: '%s' entry name '%s' appears more than once", path, sorted[i].name);
      free(sorted); return st_fail(f, root, hdr);
    }
  qsort(sorted, (size_t)f->n, sizeof *sorted, cmp_begin);
  int64_t pos = 0;
  for (int i = 0; i < f->n; i++) {
    if (sorted[i].begin < pos) {
      gl_error("gl_safetensors_open: '%s' entries '%s' and '%s' overlap (data_offsets %lld < %lld)", path,
               sorted[i - 1].name, sorted[i].name, (long long)sorted[i].begin, (long long)pos);
      free(sorted); return st_fail(f, root, hdr);
    }
    if (sorted[i].begin > pos) {
      gl_error("gl_safetensors_open: '%s' data_offsets leave data bytes [%lld, %lld) unused before entry '%s' (entries must tile the %lld data bytes)",
               path, (long long)pos, (long long)sorted[i].begin, sorted[i].name, (long long)data_len);
      free(sorted); return st_fail(f, root, hdr);
    }
    pos = sorted[i].end;
  }
  if (pos != data_len) {
    gl_error("gl_safetensors_open: '%s' data_offsets leave data bytes [%lld, %lld) unused at the end (entries must tile the %lld data bytes)",
             path, (long long)pos, (long long)data_len, (long long)data_len);
    free(sorted); return st_fail(f, root, hdr);
  }
  free(sorted);
  cJSON_Delete(root); free(hdr);
  return f;
}

int gl_safetensors_count(const gl_st_file *f) {
  GL_NONNULL("gl_safetensors_count", f);
  return f->n;
}
const char *gl_safetensors_name(const gl_st_file *f, int i) {
  GL_NONNULL_OR(NULL, "gl_safetensors_name", f);
  if (i < 0 || i >= f->n) return gl_error_null("gl_safetensors_name: index %d out of range", i);
  return f->e[i].name;
}
const char *gl_safetensors_metadata(const gl_st_file *f) {
  GL_NONNULL_OR(NULL, "gl_safetensors_metadata", f);
  return f->metadata;
}

gl_tensor *gl_safetensors_get(const gl_st_file *f, int i) {
  GL_NONNULL_OR(NULL, "gl_safetensors_get", f);
  if (i < 0 || i >= f->n) return gl_error_null("gl_safetensors_get: index %d out of range", i);
  const st_entry *e = &f->e[i];
  gl_tensor *t = gl_empty_host(e->dtype, e->ndim, e->shape);
  if (!t) return NULL;
  int64_t left = e->end - e->begin, pos = f->data_start + e->begin;
  char *p = t->storage->data;
  while (left > 0) {
    ssize_t r = pread(f->fd, p, (size_t)left, pos);
    if (r <= 0) { gl_tensor_free(t);
      return gl_error_null("gl_safetensors_get: '%s' entry '%s': short read (file changed or truncated)", f->path, e->name); }
    p += r; pos += r; left -= r;
  }
  return t;
}

int gl_file_checksum(const char *path, uint64_t *out) {
  GL_NONNULL("gl_file_checksum", path, out);
  int fd = open(path, O_RDONLY);
  if (fd < 0) return gl_error("gl_file_checksum: cannot open '%s': %s", path, strerror(errno));
  uint64_t h = 1469598103934665603ull;
  static __thread unsigned char buf[1 << 16];
  for (;;) {
    ssize_t r = read(fd, buf, sizeof buf);
    if (r < 0) { if (errno == EINTR) continue; close(fd); return gl_error("gl_file_checksum: read error on '%s'", path); }
    if (r == 0) break;
    for (ssize_t i = 0; i < r; i++) { h ^= buf[i]; h *= 1099511628211ull; }
  }
  close(fd);
  *out = h;
  return GL_OK;
}
