/* tensor.c — tensor structs, reference-counted storage, views, element
 * access and the device-crossing parts of copy.  Shapes and strides are in
 * elements; every view is checked against its storage's bounds so no view
 * built from Lua can address memory outside what was allocated. */
#include "backend.h"
#include <stdio.h>
#include <stdlib.h>

int gl_alloc(int device, int kind, int64_t nbytes, void **out, int64_t *capacity);
void gl_dealloc(int device, int kind, void *p, int64_t capacity);

#ifdef GL_WITH_CUDA
void *gl_cuda_host_alloc(int64_t nbytes);
int gl_cuda_host_free(void *ptr);
#endif

static void storage_decref(gl_storage *s) {
  if (!s) return;
  if (__atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) == 0) {
    if (s->external == 0 && (s->data || s->meta == 1)) gl_dealloc(s->device, s->meta, s->data, s->capacity);
#ifdef GL_WITH_CUDA
    if (s->external == 2 && s->data) gl_cuda_host_free(s->data);
#endif
    free(s);
  }
}

int gl_tensor_check(const gl_tensor *t, const char *fn, const char *arg) {
  GL_NONNULL("gl_tensor_check", fn, arg);
  if (!t) return gl_error("%s: %s is nil, expected a tensor", fn, arg);
  if (t->magic != GL_TENSOR_MAGIC) return gl_error("%s: %s is not a valid tensor handle", fn, arg);
  if (!t->storage || (!t->storage->data && t->storage->meta != 1))
    return gl_error("%s: %s has been freed (its storage was released)", fn, arg);
  if (t->storage->meta == 1 && !gl_meta_active()) {
    char sh[96];
    return gl_error("%s: %s is a meta tensor %s %s (a shape without data), usable only while planning", fn, arg,
                    gl_shape_str(t, sh, sizeof sh), gl_dtype_name(t->dtype));
  }
  return GL_OK;
}

int gl_meta_read(const gl_tensor *t, const char *fn, const char *arg) {
  if (!gl_is_meta(t)) return GL_OK;
  if (gl_meta_mode() == GL_META_ZEROS) return 1;
  char sh[96];
  return gl_error("%s: %s is a meta tensor %s %s (a shape without data): it has no values to read", fn, arg,
                  gl_shape_str(t, sh, sizeof sh), gl_dtype_name(t->dtype));
}

static int check_shape(const char *fn, int ndim, const int64_t *shape, int64_t *numel) {
  GL_NONNULL(fn, shape);
  if (ndim < 0 || ndim > GL_MAX_DIMS)
    return gl_error("%s: ndim must be in 0..%d, got %d", fn, GL_MAX_DIMS, ndim);
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) return gl_error("%s: size of dim %d must be >= 0, got %lld", fn, d + 1, (long long)shape[d]);
    if (shape[d] > 0 && n > INT64_MAX / shape[d])
      return gl_error("%s: shape overflows 64-bit element count at dim %d", fn, d + 1);
    n *= shape[d];
  }
  *numel = n;
  return GL_OK;
}

static gl_tensor *new_struct(int dtype, int device, int ndim, const int64_t *shape) {
  gl_tensor *t = calloc(1, sizeof *t);
  if (!t) return gl_error_null("gl_empty: out of host memory");
  t->magic = GL_TENSOR_MAGIC; t->dtype = dtype; t->device = device; t->ndim = ndim;
  int64_t n = 1;
  for (int d = ndim - 1; d >= 0; d--) { t->shape[d] = shape[d]; t->stride[d] = n; n *= shape[d]; }
  t->numel = n;
  return t;
}

static int check_dtype_device(const char *fn, int dtype, int device) {
  if (dtype < 0 || dtype >= GL_NDTYPES) return gl_error("%s: invalid dtype %d", fn, dtype);
  if (device < GL_DEVICE_CPU) return gl_error("%s: invalid device %d", fn, device);
  if (device >= 0 && gl_meta_kind() != 1) {  /* a plan may be of a GPU this machine lacks */
    int n = gl_cuda_device_count();
    if (!gl_cuda_built()) return gl_error("%s: cuda:%d requested but this engine was built without CUDA", fn, device);
    if (device >= n) return gl_error("%s: cuda:%d requested but %d CUDA device(s) are available", fn, device, n);
  }
  return GL_OK;
}

gl_tensor *gl_empty(int dtype, int device, int ndim, const int64_t *shape) {
  int64_t numel;
  if (check_dtype_device("gl_empty", dtype, device) || check_shape("gl_empty", ndim, shape, &numel)) return NULL;
  int64_t es = gl_dtype_size(dtype);
  if (numel > INT64_MAX / es) return gl_error_null("gl_empty: %lld elements of %s overflow the byte count",
                                                   (long long)numel, gl_dtype_name(dtype));
  gl_storage *s = calloc(1, sizeof *s);
  if (!s) return gl_error_null("gl_empty: out of host memory");
  int kind = gl_meta_kind();
  if (gl_alloc(device, kind, numel * es, &s->data, &s->capacity) != GL_OK) { free(s); return NULL; }
  s->nbytes = numel * es; s->refcount = 1; s->device = device; s->meta = kind;
  gl_tensor *t = new_struct(dtype, device, ndim, shape);
  if (!t) { storage_decref(s); return NULL; }
  t->storage = s;
  return t;
}

/* A host tensor whose values the engine fills itself (tokenizer output,
   loader batches, shard reads): real even while this thread plans. */
gl_tensor *gl_empty_host(int dtype, int ndim, const int64_t *shape) {
  int paused = gl_meta_pause(1);
  gl_tensor *t = gl_empty(dtype, GL_DEVICE_CPU, ndim, shape);
  gl_meta_pause(paused);
  return t;
}

gl_tensor *gl_from_external(void *data, int64_t nbytes, int dtype, int ndim, const int64_t *shape) {
  GL_NONNULL_OR(NULL, "gl_from_external", data, shape);
  int64_t numel;
  if (check_dtype_device("gl_from_external", dtype, GL_DEVICE_CPU) ||
      check_shape("gl_from_external", ndim, shape, &numel)) return NULL;
  if (numel * gl_dtype_size(dtype) > nbytes)
    return gl_error_null("gl_from_external: shape needs %lld bytes, buffer has %lld",
                         (long long)(numel * gl_dtype_size(dtype)), (long long)nbytes);
  gl_storage *s = calloc(1, sizeof *s);
  if (!s) return gl_error_null("gl_from_external: out of host memory");
  s->data = data; s->nbytes = nbytes; s->capacity = nbytes; s->refcount = 1;
  s->device = GL_DEVICE_CPU; s->external = 1;
  gl_tensor *t = new_struct(dtype, GL_DEVICE_CPU, ndim, shape);
  if (!t) { free(s); return NULL; }
  t->storage = s;
  return t;
}

gl_tensor *gl_empty_pinned(int dtype, int ndim, const int64_t *shape) {
  int64_t numel;
  if (check_dtype_device("gl_empty_pinned", dtype, GL_DEVICE_CPU) ||
      check_shape("gl_empty_pinned", ndim, shape, &numel)) return NULL;
  if (numel > INT64_MAX / gl_dtype_size(dtype)) return gl_error_null("gl_empty_pinned: shape overflows the byte count");
#ifdef GL_WITH_CUDA
  int64_t nbytes = numel * gl_dtype_size(dtype);
  void *data = gl_cuda_host_alloc(nbytes > 0 ? nbytes : 1);
  if (!data) return NULL;
  gl_storage *s = calloc(1, sizeof *s);
  gl_tensor *t = s ? new_struct(dtype, GL_DEVICE_CPU, ndim, shape) : NULL;
  if (!t) { free(s); gl_cuda_host_free(data); return gl_error_null("gl_empty_pinned: out of host memory"); }
  s->data = data; s->nbytes = nbytes; s->capacity = nbytes; s->refcount = 1;
  s->device = GL_DEVICE_CPU; s->external = 2;
  t->storage = s;
  return t;
#else
  return gl_error_null("gl_empty_pinned: pinned memory needs a CUDA build");
#endif
}

gl_tensor *gl_view_dtype(const gl_tensor *src, int dtype, int ndim, const int64_t *shape, int64_t byte_offset) {
  GL_NONNULL_OR(NULL, "gl_view_dtype", src, shape);
  if (gl_tensor_check(src, "gl_view_dtype", "src")) return NULL;
  int64_t numel;
  if (check_dtype_device("gl_view_dtype", dtype, GL_DEVICE_CPU) || check_shape("gl_view_dtype", ndim, shape, &numel))
    return NULL;
  int es = gl_dtype_size(dtype);
  int64_t base = src->offset * gl_dtype_size(src->dtype) + byte_offset;
  if (byte_offset < 0 || base % es != 0)
    return gl_error_null("gl_view_dtype: byte offset %lld is not a multiple of the %s size %d",
                         (long long)byte_offset, gl_dtype_name(dtype), es);
  if (numel > (src->storage->nbytes - base) / es)
    return gl_error_null("gl_view_dtype: %lld elements of %s need %lld bytes, %lld are available",
                         (long long)numel, gl_dtype_name(dtype), (long long)(numel * es),
                         (long long)(src->storage->nbytes - base));
  gl_tensor *t = new_struct(dtype, src->device, ndim, shape);
  if (!t) return NULL;
  t->offset = base / es;
  t->storage = src->storage;
  __atomic_add_fetch(&src->storage->refcount, 1, __ATOMIC_ACQ_REL);
  return t;
}

gl_tensor *gl_as_strided(const gl_tensor *src, int ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset) {
  GL_NONNULL_OR(NULL, "gl_as_strided", src, shape, stride);
  if (gl_tensor_check(src, "gl_as_strided", "src")) return NULL;
  int64_t numel;
  if (check_shape("gl_as_strided", ndim, shape, &numel)) return NULL;
  if (offset < 0) return gl_error_null("gl_as_strided: offset must be >= 0, got %lld", (long long)offset);
  int64_t max_off = offset;
  for (int d = 0; d < ndim; d++) {
    if (stride[d] < 0) return gl_error_null("gl_as_strided: stride of dim %d must be >= 0, got %lld",
                                            d + 1, (long long)stride[d]);
    if (shape[d] > 0 && stride[d] > 0 && (shape[d] - 1) > (INT64_MAX - max_off) / stride[d])
      return gl_error_null("gl_as_strided: view overflows the address range at dim %d", d + 1);
    if (shape[d] > 0) max_off += (shape[d] - 1) * stride[d];
  }
  int64_t capacity = src->storage->nbytes / gl_dtype_size(src->dtype);
  if (numel > 0 && max_off >= capacity)
    return gl_error_null("gl_as_strided: view reaches element %lld, storage holds %lld elements",
                         (long long)max_off, (long long)capacity);
  gl_tensor *t = new_struct(src->dtype, src->device, ndim, shape);
  if (!t) return NULL;
  for (int d = 0; d < ndim; d++) t->stride[d] = stride[d];
  t->offset = offset;
  t->numel = numel;
  t->storage = src->storage;
  __atomic_add_fetch(&src->storage->refcount, 1, __ATOMIC_ACQ_REL);
  return t;
}

void gl_tensor_free(gl_tensor *t) {
  if (!t || t->magic != GL_TENSOR_MAGIC) return;
  storage_decref(t->storage);
  t->storage = NULL;
  t->magic = 0;
  free(t);
}

int gl_tensor_release(gl_tensor *t) {
  GL_NONNULL("gl_tensor_release", t);
  if (t->magic != GL_TENSOR_MAGIC) return gl_error("gl_tensor_release: t is not a valid tensor handle");
  storage_decref(t->storage);
  t->storage = NULL;
  return GL_OK;
}

void *gl_data_ptr(const gl_tensor *t) {
  if (gl_tensor_check(t, "gl_data_ptr", "tensor")) return NULL;
  int m = gl_meta_read(t, "gl_data_ptr", "tensor");
  if (m == GL_ERR) return NULL;
  if (m == 1) {  /* reads give zeros: a small host buffer (the trainer's numbers), writes go nowhere */
    static __thread double zeros[8];
    if (t->storage->nbytes > (int64_t)sizeof zeros)
      return gl_error_null("gl_data_ptr: tensor is a meta tensor of %lld bytes (a shape without data): "
                           "it has no values to read", (long long)t->storage->nbytes);
    memset(zeros, 0, sizeof zeros);
    return zeros;
  }
  return (char *)t->storage->data + t->offset * gl_dtype_size(t->dtype);
}

int gl_is_contiguous(const gl_tensor *t) {
  GL_NONNULL("gl_is_contiguous", t);
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] != 1 && t->stride[d] != expect) return 0;
    expect *= t->shape[d];
  }
  return 1;
}

/* FNV-1a 64 with the tensor's bytes taken as little-endian 64-bit words
   (eight times fewer multiplies than byte-wise; the tail bytes one by one) */
int gl_tensor_hash(const gl_tensor *t, uint64_t *h) {
  GL_NONNULL("gl_tensor_hash", t, h);
  if (gl_tensor_check(t, "gl_tensor_hash", "t")) return GL_ERR;
  if (t->device != GL_DEVICE_CPU) return gl_error("gl_tensor_hash: t must be on the CPU (copy it first)");
  if (!gl_is_contiguous(t)) return gl_error("gl_tensor_hash: t must be contiguous");
  const unsigned char *p = (const unsigned char *)t->storage->data + t->offset * gl_dtype_size(t->dtype);
  int64_t n = t->numel * gl_dtype_size(t->dtype), words = n / 8;
  uint64_t x = *h;
  for (int64_t i = 0; i < words; i++) {
    uint64_t w;
    memcpy(&w, p + 8 * i, 8);
    x ^= w;
    x *= 0x100000001b3ULL;
  }
  for (int64_t i = 8 * words; i < n; i++) { x ^= p[i]; x *= 0x100000001b3ULL; }
  *h = x;
  return GL_OK;
}

int64_t gl_storage_refcount(const gl_tensor *t) {
  GL_NONNULL("gl_storage_refcount", t);
  return (t->magic == GL_TENSOR_MAGIC && t->storage) ? t->storage->refcount : 0;
}
int gl_same_storage(const gl_tensor *a, const gl_tensor *b) {
  GL_NONNULL("gl_same_storage", a, b);
  return a->storage && a->storage == b->storage;
}

/* ---- element access (CPU only; CUDA tensors go through a copy) ---------- */
static int check_elem(const gl_tensor *t, const char *fn, int64_t off) {
  GL_CHECK_T(t, fn, "tensor");
  if (gl_is_meta(t)) return GL_OK;
  if (t->device >= 0) return gl_error("%s: tensor is on cuda:%d, element access needs a cpu tensor", fn, t->device);
  int64_t cap = t->storage->nbytes / gl_dtype_size(t->dtype);
  if (off < 0 || t->offset + off >= cap)
    return gl_error("%s: element offset %lld outside storage of %lld elements", fn, (long long)off, (long long)cap);
  return GL_OK;
}
int gl_get_item(const gl_tensor *t, int64_t off, double *out) {
  GL_NONNULL("gl_get_item", t, out);
  GL_TRY(check_elem(t, "gl_get_item", off));
  int m = gl_meta_read(t, "gl_get_item", "tensor");
  if (m != GL_OK) { *out = 0; return m == 1 ? GL_OK : GL_ERR; }
  *out = gl_load(t->storage->data, t->dtype, t->offset + off);
  return GL_OK;
}
int gl_set_item(gl_tensor *t, int64_t off, double v) {
  GL_TRY(check_elem(t, "gl_set_item", off));
  if (gl_is_meta(t)) return GL_OK;  /* a write to a meta tensor goes nowhere, as its kernels do */
  gl_store(t->storage->data, t->dtype, t->offset + off, v);
  return GL_OK;
}

/* visits t's elements in row-major order, calling fn(base, dtype, index, k) */
static int to_from_doubles(gl_tensor *t, double *buf, int to, const char *fn) {
  GL_CHECK_T(t, fn, "tensor");
  if (t->device >= 0) return gl_error("%s: tensor is on cuda:%d, expected a cpu tensor", fn, t->device);
  if (gl_is_meta(t)) {
    if (!to) return GL_OK;  /* a write to a meta tensor goes nowhere */
    int m = gl_meta_read(t, fn, "tensor");
    if (m != 1) return GL_ERR;
    for (int64_t k = 0; k < t->numel; k++) buf[k] = 0;
    return GL_OK;
  }
  int64_t idx[GL_MAX_DIMS] = {0};
  for (int64_t k = 0; k < t->numel; k++) {
    int64_t off = t->offset;
    for (int d = 0; d < t->ndim; d++) off += idx[d] * t->stride[d];
    if (to) buf[k] = gl_load(t->storage->data, t->dtype, off);
    else gl_store(t->storage->data, t->dtype, off, buf[k]);
    for (int d = t->ndim - 1; d >= 0; d--) { if (++idx[d] < t->shape[d]) break; idx[d] = 0; }
  }
  return GL_OK;
}
int gl_to_doubles(const gl_tensor *t, double *out) {
  GL_NONNULL("gl_to_doubles", t, out);
  return to_from_doubles((gl_tensor *)t, out, 1, "gl_to_doubles");
}
int gl_from_doubles(gl_tensor *t, const double *in) {
  GL_NONNULL("gl_from_doubles", t, in);
  return to_from_doubles(t, (double *)in, 0, "gl_from_doubles");
}

int gl_max_abs_diff(const gl_tensor *a, const gl_tensor *b, double *out) {
  GL_NONNULL("gl_max_abs_diff", a, b, out);
  GL_CHECK_T(a, "gl_max_abs_diff", "a");
  GL_CHECK_T(b, "gl_max_abs_diff", "b");
  GL_TRY(gl_check_same_shape(a, b, "gl_max_abs_diff", "a", "b"));
  if (gl_meta_read(a, "gl_max_abs_diff", "a") == GL_ERR || gl_meta_read(b, "gl_max_abs_diff", "b") == GL_ERR) return GL_ERR;
  if (gl_is_meta(a) || gl_is_meta(b)) { *out = 0; return GL_OK; }
  if (a->device >= 0 || b->device >= 0) return gl_error("gl_max_abs_diff: expected cpu tensors");
  double m = 0;
  gl_iter it; gl_iter_init(&it, 2, (const gl_tensor *[]){a, b});
  for (int64_t o = 0; o < it.outer; o++) {
    int64_t off[GL_ITER_MAX_OPS]; gl_iter_offsets(&it, o, off);
    for (int64_t i = 0; i < it.inner; i++) {
      double x = gl_load(a->storage->data, a->dtype, off[0] + i * it.istride[0]);
      double y = gl_load(b->storage->data, b->dtype, off[1] + i * it.istride[1]);
      double d = fabs(x - y);
      if (d != d) { *out = d; return GL_OK; }  /* NaN anywhere: report NaN */
      if (d > m) m = d;
    }
  }
  *out = m;
  return GL_OK;
}

/* ---- copy, fill, arange, rand: validation and dispatch ------------------ */
int gl_copy(gl_tensor *dst, const gl_tensor *src) {
  GL_CHECK_T(dst, "gl_copy", "dst");
  GL_CHECK_T(src, "gl_copy", "src");
  GL_TRY(gl_check_same_shape(dst, src, "gl_copy", "dst", "src"));
  GL_TRY(gl_check_no_zero_stride(dst, "gl_copy", "dst"));
  if (dst->device == src->device) return gl_backend_of(dst->device)->copy(dst, src);
  if (gl_meta_active()) {  /* a plan: to the host is reading values */
    if (dst->device < 0 && gl_meta_read(src, "gl_copy", "src") == GL_ERR) return GL_ERR;
    return GL_OK;
  }
#ifdef GL_WITH_CUDA
  /* across devices: convert on the source device into a contiguous buffer of
     dst's dtype, move the bytes, then place them into dst's layout */
  gl_tensor *a = gl_empty(dst->dtype, src->device, src->ndim, src->shape);
  gl_tensor *b = a ? gl_empty(dst->dtype, dst->device, dst->ndim, dst->shape) : NULL;
  int rc = (a && b) ? gl_backend_of(src->device)->copy(a, src) : GL_ERR;
  if (rc == GL_OK) rc = cuda_memcpy(b->storage->data, b->device, a->storage->data, a->device,
                                    a->numel * gl_dtype_size(a->dtype));
  if (rc == GL_OK) rc = gl_backend_of(dst->device)->copy(dst, b);
  gl_tensor_free(a); gl_tensor_free(b);
  return rc;
#else
  return gl_error("gl_copy: copy between devices needs a CUDA build");
#endif
}

int gl_fill(gl_tensor *t, double v) {
  GL_CHECK_T(t, "gl_fill", "tensor");
  GL_TRY(gl_check_no_zero_stride(t, "gl_fill", "tensor"));
  return gl_backend_of(t->device)->fill(t, v);
}

int gl_arange(gl_tensor *t, double start, double step) {
  GL_CHECK_T(t, "gl_arange", "tensor");
  if (t->ndim != 1) return gl_error("gl_arange: expected a 1-d tensor, got %d dims", t->ndim);
  if (gl_meta_active()) return GL_OK;  /* a plan runs no kernels */
  if (t->device >= 0) {
    gl_tensor *h = gl_empty(t->dtype, GL_DEVICE_CPU, 1, t->shape);
    if (!h) return GL_ERR;
    int rc = gl_arange(h, start, step);
    if (rc == GL_OK) rc = gl_copy(t, h);
    gl_tensor_free(h);
    return rc;
  }
  for (int64_t i = 0; i < t->numel; i++)
    gl_store(t->storage->data, t->dtype, t->offset + i * t->stride[0], start + (double)i * step);
  return GL_OK;
}

static int check_rand(gl_tensor *t, const char *fn) {
  GL_CHECK_T(t, fn, "tensor");
  GL_TRY(gl_check_dtype_float(t, fn, "tensor"));
  return gl_check_no_zero_stride(t, fn, "tensor");
}
int gl_rand_uniform(gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi) {
  GL_TRY(check_rand(t, "gl_rand_uniform"));
  return gl_backend_of(t->device)->rand_uniform(t, seed, offset, lo, hi);
}
int gl_rand_normal(gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std) {
  GL_TRY(check_rand(t, "gl_rand_normal"));
  if (!(std >= 0)) return gl_error("gl_rand_normal: std must be >= 0, got %g", std);
  return gl_backend_of(t->device)->rand_normal(t, seed, offset, mean, std);
}
int gl_rand_u32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  GL_NONNULL("gl_rand_u32", out);
  for (int i = 0; i < 4; i++) out[i] = gl_philox_word(seed, counter * 4 + (uint64_t)i);
  return GL_OK;
}
