/* util.c — error reporting, dtype tables and conversions, strided iteration,
 * thread count.  Everything the other engine files lean on. */
#include "internal.h"
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <cblas.h>
#include <signal.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static __thread char err_buf[1024];

/* formats into a scratch buffer first: callers pass gl_last_error() as an
   argument to add context ("split: %s"), and vsnprintf into its own source
   is undefined (it garbled messages) */
static void set_error_v(const char *fmt, va_list ap) {
  char msg[sizeof err_buf];
  vsnprintf(msg, sizeof msg, fmt, ap);
  memcpy(err_buf, msg, sizeof msg);
}

int gl_error(const char *fmt, ...) {
  va_list ap; va_start(ap, fmt); set_error_v(fmt, ap); va_end(ap);
  return GL_ERR;
}
void *gl_error_null(const char *fmt, ...) {
  va_list ap; va_start(ap, fmt); set_error_v(fmt, ap); va_end(ap);
  return NULL;
}
void gl_panic(const char *fmt, ...) {
  va_list ap; va_start(ap, fmt);
  fprintf(stderr, "gptlua engine bug: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  abort();
}
/* names: the stringified argument list "a, b, c" of GL_NONNULL */
int gl_check_nonnull(const char *fn, const char *names, int n, const void *const *ptrs) {
  for (int i = 0; i < n; i++) {
    if (ptrs[i]) continue;
    const char *s = names;
    for (int k = 0; k < i; k++) { s = strchr(s, ','); s = s ? s + 1 : ""; }
    while (*s == ' ') s++;
    int len = (int)strcspn(s, ", ");
    return gl_error("%s: %.*s is NULL, expected a valid pointer", fn, len, s);
  }
  return GL_OK;
}

const char *gl_last_error(void) { return err_buf[0] ? err_buf : "unknown engine error"; }
void gl_clear_error(void) { err_buf[0] = 0; }

#ifndef GL_VERSION_STR
#define GL_VERSION_STR "0.1.0"
#endif
const char *gl_version(void) { return GL_VERSION_STR; }

int gl_cuda_built(void) {
#ifdef GL_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}
int gl_cuda_device_count(void) {
#ifdef GL_WITH_CUDA
  return cuda_device_count();
#else
  return 0;
#endif
}

static const char *dtype_names[GL_NDTYPES] = {
  "float32", "float64", "bfloat16", "float16", "int32", "int64", "uint16", "uint8", "bool",
  "float8_e4m3fn", "float8_e5m2"};
static const int dtype_sizes[GL_NDTYPES] = {4, 8, 2, 2, 4, 8, 2, 1, 1, 1, 1};

const char *gl_dtype_name(int dtype) {
  return (dtype >= 0 && dtype < GL_NDTYPES) ? dtype_names[dtype] : "invalid-dtype";
}
int gl_dtype_size(int dtype) { return (dtype >= 0 && dtype < GL_NDTYPES) ? dtype_sizes[dtype] : 0; }
int gl_is_float(int dtype) { return dtype == GL_F32 || dtype == GL_F64 || dtype == GL_BF16 || dtype == GL_F16; }
int gl_is_int(int dtype) { return dtype >= GL_I32 && dtype <= GL_BOOL; }
int gl_is_fp8(int dtype) { return dtype == GL_F8E4M3 || dtype == GL_F8E5M2; }

/* ---- threads ---------------------------------------------------------- */
static int n_threads = 0;
int gl_num_cores(void) {
#ifdef _OPENMP
  int n = omp_get_num_procs();
#else
  long n = sysconf(_SC_NPROCESSORS_ONLN);
#endif
  return n > 0 ? (int)n : 1;
}
int gl_set_num_threads(int n) {
  if (n < 1) return gl_error("gl_set_num_threads: n must be >= 1, got %d", n);
  int cores = gl_num_cores();
  if (n > GL_THREADS_PER_CORE * cores)
    return gl_error("gl_set_num_threads: n must be <= %d (%d threads for each of this machine's %d cores), got %d",
                    GL_THREADS_PER_CORE * cores, GL_THREADS_PER_CORE, cores, n);
  n_threads = n;
#ifdef _OPENMP
  omp_set_num_threads(n);
#endif
  openblas_set_num_threads(n);
  return GL_OK;
}
/* Which BLAS and which of its kernels run the matrix products, e.g.
   "OpenBLAS 0.3.21 ... (SkylakeX kernels)": benchmarks print it so their
   numbers can be compared across machines. */
const char *gl_blas_info(void) {
  static char info[256];
  if (!info[0]) snprintf(info, sizeof info, "%s (%s kernels)", openblas_get_config(), openblas_get_corename());
  return info;
}
int gl_get_num_threads(void) {
  if (n_threads == 0) {
#ifdef _OPENMP
    n_threads = omp_get_max_threads();
#else
    n_threads = 1;
#endif
  }
  return n_threads;
}
/* Threads worth using for n items of work w each (about 32K flops per thread
   pays for an OpenMP fork on this class of machine). */
int gl_threads_for(int64_t n, int64_t w) {
  int nt = gl_get_num_threads();
  int64_t total = n * (w > 0 ? w : 1);
  int64_t want = total / 32768;
  if (want < 1) want = 1;
  if (want > nt) want = nt;
  if (want > n) want = n > 0 ? n : 1;
  return (int)want;
}

/* ---- float16 ------------------------------------------------------------ */
float gl_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, u;
  if (exp == 0) {
    if (mant == 0) u = sign;
    else { /* subnormal: normalise */
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; exp--; }
      u = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) u = sign | 0x7f800000u | (mant << 13);
  else u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  float f; memcpy(&f, &u, 4); return f;
}
uint16_t gl_f32_to_f16(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000; int32_t exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
  uint32_t mant = u & 0x7fffff;
  if (((u >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return (uint16_t)(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    mant |= 0x800000; int shift = 14 - exp;
    uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) half++;
    return (uint16_t)(sign | half);
  }
  uint32_t half = sign | ((uint32_t)exp << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
  return (uint16_t)half;
}

/* ---- float8 (OCP FP8: e4m3fn and e5m2) ------------------------------------
   Decoding is exact.  Encoding rounds the exact double once to nearest even
   and saturates, as CUDA's __nv_cvt_double_to_fp8(x, __NV_SATFINITE, ...)
   does: a magnitude beyond the largest finite value (inf included) becomes
   the largest finite value of its sign (448 for e4m3fn, which has no inf;
   57344 for e5m2, whose inf pattern is only ever read, never produced).
   Every NaN becomes the canonical 0x7f (S.1111.111 / S.11111.11 with S = 0),
   PTX cvt's canonical NaN. */
typedef struct { int mbits, bias; double max; uint8_t max_code; } f8_format;
static const f8_format F8_E4M3 = {3, 7, 448.0, 0x7e}, F8_E5M2 = {2, 15, 57344.0, 0x7b};

static float f8_decode(uint8_t b, const f8_format *f, int has_inf) {
  int ebits = 7 - f->mbits, e = (b >> f->mbits) & ((1 << ebits) - 1), m = b & ((1 << f->mbits) - 1);
  float sign = (b & 0x80) ? -1.0f : 1.0f;
  if (has_inf ? e == (1 << ebits) - 1 : (b & 0x7f) == 0x7f) return (has_inf && m == 0) ? sign * INFINITY : NAN;
  if (e == 0) return sign * ldexpf((float)m, 1 - f->bias - f->mbits);           /* subnormal */
  return sign * ldexpf((float)(m | (1 << f->mbits)), e - f->bias - f->mbits);
}
static uint8_t f8_encode(double x, const f8_format *f) {
  if (x != x) return 0x7f;
  uint8_t sign = signbit(x) ? 0x80 : 0;
  double a = fabs(x);
  if (a >= f->max) return sign | f->max_code;  /* saturate (also inf) */
  const int emin = 1 - f->bias;
  int e2;
  frexp(a, &e2);                                /* a = r * 2^e2, r in [0.5, 1) */
  int ex = (a == 0 || e2 - 1 < emin) ? emin : e2 - 1;
  double n = nearbyint(ldexp(a, f->mbits - ex)); /* spacings of 2^(ex - mbits); exact scaling, ties to even */
  /* n <= 2^(mbits+1); n == 2^(mbits+1) carries into the next binade, which the
     field arithmetic below does by itself (a < max keeps it finite) */
  int code = ex == emin && n < (1 << f->mbits) ? (int)n
                                                : ((ex - emin + 1) << f->mbits) + (int)n - (1 << f->mbits);
  return sign | (uint8_t)code;
}
float gl_f8e4m3_to_f32(uint8_t b) { return f8_decode(b, &F8_E4M3, 0); }
float gl_f8e5m2_to_f32(uint8_t b) { return f8_decode(b, &F8_E5M2, 1); }
uint8_t gl_f64_to_f8e4m3(double x) { return f8_encode(x, &F8_E4M3); }
uint8_t gl_f64_to_f8e5m2(double x) { return f8_encode(x, &F8_E5M2); }

double gl_load(const void *base, int dtype, int64_t i) {
  switch (dtype) {
    case GL_F32: return ((const float *)base)[i];
    case GL_F64: return ((const double *)base)[i];
    case GL_BF16: return gl_bf16_to_f32(((const uint16_t *)base)[i]);
    case GL_F16: return gl_f16_to_f32(((const uint16_t *)base)[i]);
    case GL_I32: return ((const int32_t *)base)[i];
    case GL_I64: return (double)((const int64_t *)base)[i];
    case GL_U16: return ((const uint16_t *)base)[i];
    case GL_U8: return ((const uint8_t *)base)[i];
    case GL_BOOL: return ((const uint8_t *)base)[i] != 0;
    case GL_F8E4M3: return gl_f8e4m3_to_f32(((const uint8_t *)base)[i]);
    case GL_F8E5M2: return gl_f8e5m2_to_f32(((const uint8_t *)base)[i]);
  }
  gl_panic("gl_load: dtype %d", dtype);
}
void gl_store(void *base, int dtype, int64_t i, double v) {
  switch (dtype) {
    case GL_F32: ((float *)base)[i] = (float)v; return;
    case GL_F64: ((double *)base)[i] = v; return;
    case GL_BF16: ((uint16_t *)base)[i] = gl_f32_to_bf16((float)v); return;
    case GL_F16: ((uint16_t *)base)[i] = gl_f32_to_f16((float)v); return;
    case GL_I32: ((int32_t *)base)[i] = (int32_t)v; return;
    case GL_I64: ((int64_t *)base)[i] = (int64_t)v; return;
    case GL_U16: ((uint16_t *)base)[i] = (uint16_t)v; return;
    case GL_U8: ((uint8_t *)base)[i] = (uint8_t)v; return;
    case GL_BOOL: ((uint8_t *)base)[i] = v != 0; return;
    case GL_F8E4M3: ((uint8_t *)base)[i] = gl_f64_to_f8e4m3(v); return;
    case GL_F8E5M2: ((uint8_t *)base)[i] = gl_f64_to_f8e5m2(v); return;
  }
  gl_panic("gl_store: dtype %d", dtype);
}

/* ---- shapes ------------------------------------------------------------- */
const char *gl_shape_str(const gl_tensor *t, char *buf, size_t n) {
  size_t k = 0;
  k += (size_t)snprintf(buf + k, n - k, "{");
  for (int d = 0; d < t->ndim && k < n; d++)
    k += (size_t)snprintf(buf + k, n - k, d ? ",%lld" : "%lld", (long long)t->shape[d]);
  if (k < n) snprintf(buf + k, n - k, "}");
  return buf;
}
int gl_same_shape(const gl_tensor *a, const gl_tensor *b) {
  if (a->ndim != b->ndim) return 0;
  for (int d = 0; d < a->ndim; d++) if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}
int gl_check_same_shape(const gl_tensor *a, const gl_tensor *b, const char *fn,
                        const char *an, const char *bn) {
  if (gl_same_shape(a, b)) return GL_OK;
  char sa[128], sb[128];
  return gl_error("%s: %s has shape %s, expected the shape of %s %s", fn, bn,
                  gl_shape_str(b, sb, sizeof sb), an, gl_shape_str(a, sa, sizeof sa));
}
static void device_str(int dev, char *buf, size_t n) {
  if (dev < 0) snprintf(buf, n, "cpu"); else snprintf(buf, n, "cuda:%d", dev);
}
int gl_check_same_device(const gl_tensor *a, const gl_tensor *b, const char *fn,
                         const char *an, const char *bn) {
  if (a->device == b->device) return GL_OK;
  char da[16], db[16];
  device_str(a->device, da, sizeof da); device_str(b->device, db, sizeof db);
  return gl_error("%s: %s is on %s, expected %s (the device of %s)", fn, bn, db, da, an);
}
int gl_check_dtype_float(const gl_tensor *t, const char *fn, const char *arg) {
  if (gl_is_float(t->dtype)) return GL_OK;
  if (gl_is_fp8(t->dtype))  /* float8 is storage: copies, and the scaled product (gl_fp8_matmul) */
    return gl_error("%s: %s has dtype %s, expected float32, float64, bfloat16 or float16 (convert float8 first: "
                    "t:to('float32'))", fn, arg, gl_dtype_name(t->dtype));
  return gl_error("%s: %s has dtype %s, expected a floating dtype", fn, arg, gl_dtype_name(t->dtype));
}
int gl_check_no_zero_stride(const gl_tensor *t, const char *fn, const char *arg) {
  if (t->numel == 0) return GL_OK;  /* an empty tensor writes nothing */
  for (int d = 0; d < t->ndim; d++)
    if (t->stride[d] == 0 && t->shape[d] > 1)
      return gl_error("%s: %s is a broadcast view (stride 0 in dim %d); outputs must be writable "
                      "without overlap", fn, arg, d + 1);
  return GL_OK;
}

/* ---- strided iteration -------------------------------------------------- */
void gl_iter_init(gl_iter *it, int nops, const gl_tensor *const *ts) {
  const gl_tensor *t0 = ts[0];
  int nd = 0;
  int64_t shape[GL_MAX_DIMS], stride[GL_ITER_MAX_OPS][GL_MAX_DIMS];
  /* drop size-1 dims, then merge neighbours that are contiguous for all ops */
  for (int d = 0; d < t0->ndim; d++) {
    if (t0->shape[d] == 1) continue;
    int merge = nd > 0;
    for (int k = 0; k < nops && merge; k++)
      if (stride[k][nd - 1] != ts[k]->stride[d] * t0->shape[d]) merge = 0;
    if (merge) {
      shape[nd - 1] *= t0->shape[d];
      for (int k = 0; k < nops; k++) stride[k][nd - 1] = ts[k]->stride[d];
    } else {
      shape[nd] = t0->shape[d];
      for (int k = 0; k < nops; k++) stride[k][nd] = ts[k]->stride[d];
      nd++;
    }
  }
  it->nops = nops;
  for (int k = 0; k < nops; k++) it->base[k] = ts[k]->offset;
  if (t0->numel == 0) { it->ndim = 0; it->outer = 0; it->inner = 0; return; }
  if (nd == 0) { /* a single element */
    it->ndim = 0; it->outer = 1; it->inner = 1;
    for (int k = 0; k < nops; k++) it->istride[k] = 0;
    return;
  }
  it->inner = shape[nd - 1];
  for (int k = 0; k < nops; k++) it->istride[k] = stride[k][nd - 1];
  it->ndim = nd - 1;
  it->outer = 1;
  for (int d = 0; d < nd - 1; d++) {
    it->shape[d] = shape[d];
    it->outer *= shape[d];
    for (int k = 0; k < nops; k++) it->stride[k][d] = stride[k][d];
  }
}

void gl_iter_offsets(const gl_iter *it, int64_t o, int64_t *off) {
  for (int k = 0; k < it->nops; k++) off[k] = it->base[k];
  for (int d = it->ndim - 1; d >= 0; d--) {
    int64_t i = o % it->shape[d];
    o /= it->shape[d];
    for (int k = 0; k < it->nops; k++) off[k] += i * it->stride[k][d];
  }
}

/* ---- signals ------------------------------------------------------------ */
static volatile sig_atomic_t sig_counts[65];
/* the handler before the catch, put back by restore (the REPL's Ctrl-C
   handler while a training run in it ends) */
static struct sigaction sig_saved[65];
static char sig_caught[65];
static void count_signal(int s) { if (s > 0 && s < 65) sig_counts[s]++; }
int gl_signal_catch(int signum) {
  if (signum <= 0 || signum >= 65) return gl_error("gl_signal_catch: invalid signal %d", signum);
  struct sigaction sa, old;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  if (sigaction(signum, &sa, &old) != 0) return gl_error("gl_signal_catch: cannot catch signal %d", signum);
  if (!sig_caught[signum]) { sig_saved[signum] = old; sig_caught[signum] = 1; }
  return GL_OK;
}
int gl_signal_restore(int signum) {
  if (signum <= 0 || signum >= 65) return gl_error("gl_signal_restore: invalid signal %d", signum);
  if (sig_caught[signum]) { sigaction(signum, &sig_saved[signum], NULL); sig_caught[signum] = 0; }
  else signal(signum, SIG_DFL);
  return GL_OK;
}
int gl_signal_take(int signum) {
  if (signum <= 0 || signum >= 65) return 0;
  int n = sig_counts[signum];
  sig_counts[signum] = 0;
  return n;
}
