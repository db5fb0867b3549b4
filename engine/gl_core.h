/* gl_core.h — tensors, storage, allocator, errors, RNG, safetensors.
 *
 * Part of the public C API of the gptlua engine (umbrella: gptlua.h).  Every
 * declaration here must be plain C that LuaJIT's ffi.cdef accepts: the Lua
 * binding's declarations are generated from these headers at build time by
 * running the preprocessor with GL_CDEF defined (see Makefile, target cdef).
 * So: no macros the Lua side needs (use enums), no inline functions, and
 * system includes only inside #ifndef GL_CDEF.
 *
 * Conventions
 *  - Functions returning int return GL_OK (0) on success and GL_ERR (-1) on
 *    failure; functions returning a pointer return NULL on failure.  On
 *    failure gl_last_error() holds a thread-local message naming the function,
 *    the argument and expected vs got.
 *  - The engine never exits or aborts on bad input.
 *  - Pointer arguments must not be NULL unless their declaration says so
 *    (optional outputs, destructors, which accept NULL as free() does); a
 *    NULL one is an error naming the function and the argument
 *    (spec/null_args_spec.lua calls every function with each one NULL).
 *  - Ownership: gl_tensor structs are heap objects owned by whoever created
 *    them (Lua: through ffi.gc).  Storage is reference counted; views share it.
 */
#ifndef GL_CORE_H
#define GL_CORE_H
#ifndef GL_CDEF
#include <stdint.h>
#include <stddef.h>
#endif

enum { GL_OK = 0, GL_ERR = -1 };
enum { GL_MAX_DIMS = 8 };
enum { GL_TENSOR_MAGIC = 0x676c7453 }; /* "gltS": a live tensor struct */
enum { GL_DEVICE_CPU = -1 };           /* device >= 0 means cuda:device */

typedef enum gl_dtype {
  GL_F32 = 0, GL_F64 = 1, GL_BF16 = 2, GL_F16 = 3,
  GL_I32 = 4, GL_I64 = 5, GL_U16 = 6, GL_U8 = 7, GL_BOOL = 8,
  GL_F8E4M3 = 9, GL_F8E5M2 = 10,  /* OCP FP8: float8_e4m3fn (no inf, max 448), float8_e5m2 */
  GL_NDTYPES = 11
} gl_dtype;

typedef struct gl_storage {
  void *data;         /* NULL once released */
  int64_t nbytes;     /* usable bytes requested */
  int64_t capacity;   /* bytes of the allocator block behind data */
  int32_t refcount;
  int32_t device;
  int32_t external;   /* 0: allocator block; 1: borrowed (e.g. mmap), never
                         freed here; 2: pinned host memory, freed with it */
  int32_t meta;       /* 0: real; 1: a meta storage (no data: data is NULL,
                         nbytes and capacity as a real one's); 2: real, made
                         while planning and charged to the plan too */
} gl_storage;

typedef struct gl_tensor {
  uint32_t magic;     /* GL_TENSOR_MAGIC while valid, 0 after free */
  int32_t dtype;      /* gl_dtype */
  int32_t device;     /* GL_DEVICE_CPU or CUDA ordinal */
  int32_t ndim;
  int64_t offset;     /* in elements, into storage */
  int64_t numel;
  int64_t shape[8];
  int64_t stride[8];  /* in elements; 0 for broadcast dims */
  gl_storage *storage;/* NULL after gl_tensor_release */
} gl_tensor;

typedef struct gl_mem_stats {
  int64_t allocated;  /* bytes handed out to live storages */
  int64_t reserved;   /* bytes held by the allocator (live + cached) */
  int64_t peak;       /* high-water mark of allocated since reset */
  int64_t n_allocs;   /* storage allocations served */
  int64_t n_frees;
  int64_t cache_hits; /* allocations served from the cache */
  int64_t n_live;     /* live storages */
} gl_mem_stats;

/* errors and build info */
const char *gl_last_error(void);
void gl_clear_error(void);
const char *gl_version(void);
int gl_cuda_built(void);          /* 1 if compiled with CUDA */
int gl_cuda_device_count(void);   /* 0 without CUDA build, driver or GPU */
const char *gl_dtype_name(int dtype);
int gl_dtype_size(int dtype);
/* n in [1, GL_THREADS_PER_CORE * gl_num_cores()]: some oversubscription
   is allowed (tests split work over more threads than a small machine
   has), a number far past the cores is refused (OpenMP would try to start
   that many threads) */
int gl_set_num_threads(int n);
int gl_get_num_threads(void);
int gl_num_cores(void);   /* CPUs this process may run on (OpenMP's count) */
enum { GL_THREADS_PER_CORE = 4 };
const char *gl_blas_info(void);

/* tensors */
gl_tensor *gl_empty(int dtype, int device, int ndim, const int64_t *shape);
gl_tensor *gl_as_strided(const gl_tensor *src, int ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset);
gl_tensor *gl_from_external(void *data, int64_t nbytes, int dtype, int ndim,
                            const int64_t *shape);
/* CPU tensor in page-locked (pinned) host memory for fast device copies;
   the memory is freed when the last tensor sharing it is released.
   Needs a CUDA build with a device. */
gl_tensor *gl_empty_pinned(int dtype, int ndim, const int64_t *shape);
/* A tensor of another dtype over the same bytes as src (contiguous src,
   byte offset within its storage), bounds-checked against the storage. */
gl_tensor *gl_view_dtype(const gl_tensor *src, int dtype, int ndim, const int64_t *shape, int64_t byte_offset);
void gl_tensor_free(gl_tensor *t);    /* drops the struct and its storage ref */
int gl_tensor_release(gl_tensor *t);  /* drops the storage ref, keeps the struct */
int gl_tensor_check(const gl_tensor *t, const char *fn, const char *arg);
void *gl_data_ptr(const gl_tensor *t);
int gl_is_contiguous(const gl_tensor *t);
int64_t gl_storage_refcount(const gl_tensor *t);
int gl_same_storage(const gl_tensor *a, const gl_tensor *b);

/* copy with dtype conversion; src is broadcast to dst's shape by the caller
   (as_strided with 0 strides).  Works across devices. */
int gl_copy(gl_tensor *dst, const gl_tensor *src);
int gl_fill(gl_tensor *t, double value);
int gl_get_item(const gl_tensor *t, int64_t elem_offset, double *out);
int gl_set_item(gl_tensor *t, int64_t elem_offset, double value);
/* reads/writes a contiguous double array of t.numel() elements */
int gl_to_doubles(const gl_tensor *t, double *out);
int gl_from_doubles(gl_tensor *t, const double *in);
int gl_arange(gl_tensor *t, double start, double step);

/* counter-based RNG (Philox-4x32-10): element i of t takes counter
   (offset + i), so a seed and shape give the same numbers everywhere. */
int gl_rand_uniform(gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi);
int gl_rand_normal(gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std);
int gl_rand_u32(uint64_t seed, uint64_t counter, uint32_t out[4]);

/* allocator (during a plan: the meta twin's statistics) */
int gl_mem_stats_get(int device, gl_mem_stats *out);
int gl_mem_reset_peak(int device);
int gl_empty_cache(int device);

/* The meta device, for the process (gptlua.plan runs the trainer on it).
   With mode ON or ZEROS every storage made is a meta storage: a
   size and no memory, charged to its device's meta twin in the allocator
   (same size classes and caching; gl_mem_stats_get reads the twin), and
   the ops validate and return without running a kernel.  Reading a meta
   tensor's values (get_item, to_doubles, data_ptr, sumsq, saving, copy
   to another device) is an error naming it under ON; under ZEROS the
   numbers read are 0 (the planner: the trainer reads its loss).
   gl_meta_pause(1) makes real storages again (host values a plan needs:
   the dataset, the loader's batches), still charged to the twin; a meta
   tensor is refused outside an unpaused plan.  One thread plans at a time.  gl_meta_set returns the
   previous mode (and unpauses); gl_meta_reset zeroes a twin with no live
   meta storages. */
enum { GL_META_OFF = 0, GL_META_ON = 1, GL_META_ZEROS = 2 };
int gl_meta_set(int mode);
int gl_meta_mode(void);
int gl_meta_pause(int paused);
int gl_meta_active(void);
int gl_meta_reset(int device);

/* signals: catch counts deliveries of signum (e.g. SIGINT = 2) instead of
   the default action; take returns the count since the last take. */
int gl_signal_catch(int signum);
int gl_signal_restore(int signum);
int gl_signal_take(int signum);

/* FNV-1a 64-bit checksum of a file's bytes (checkpoint verification) */
int gl_file_checksum(const char *path, uint64_t *out);
/* FNV-1a 64 over a contiguous CPU tensor's bytes (as 64-bit words, then the
   tail bytes), continuing from *h (start it at 0xcbf29ce484222325): the
   journal's hashes of parameters and optimizer state */
int gl_tensor_hash(const gl_tensor *t, uint64_t *h);

/* comparison helpers (float64 accumulation) */
int gl_max_abs_diff(const gl_tensor *a, const gl_tensor *b, double *out);

/* safetensors: save n named tensors atomically (temp file + rename).
   metadata_json may be NULL or a JSON object of string values; names and
   tensors may be NULL when n is 0. */
int gl_safetensors_save(const char *path, int n, const char **names,
                        const gl_tensor **tensors, const char *metadata_json);
/* The checkpoint writer: a thread that writes safetensors files from host
   copies (engine/ckpt_writer.c).  add copies n tensors into staging the
   writer owns and keeps for the next job (pinned memory for GPU tensors,
   copied on the copy stream, which the compute stream waits for), after
   waiting for a job still being written; start hands the files added since
   the last start to the thread, which writes each as gl_safetensors_save
   would and checksums it (gl_file_checksum).  busy: 1 while writing, 0 when
   done, GL_ERR once if the job failed; wait: until done (GL_ERR likewise);
   checksum: file i (in the order added) of the finished job.  free (NULL
   is a no-op) waits, stops the thread and frees the staging. */
typedef struct gl_ckpt_writer gl_ckpt_writer;
gl_ckpt_writer *gl_ckpt_writer_new(void);
int gl_ckpt_writer_add(gl_ckpt_writer *w, const char *path, int n, const char **names,
                       const gl_tensor **tensors, const char *metadata_json);
int gl_ckpt_writer_start(gl_ckpt_writer *w);
int gl_ckpt_writer_busy(gl_ckpt_writer *w);
int gl_ckpt_writer_wait(gl_ckpt_writer *w);
int gl_ckpt_writer_checksum(gl_ckpt_writer *w, int i, uint64_t *out);
void gl_ckpt_writer_free(gl_ckpt_writer *w);
typedef struct gl_st_file gl_st_file;
gl_st_file *gl_safetensors_open(const char *path);
int gl_safetensors_count(const gl_st_file *f);
const char *gl_safetensors_name(const gl_st_file *f, int i);
const char *gl_safetensors_metadata(const gl_st_file *f); /* JSON or NULL */
gl_tensor *gl_safetensors_get(const gl_st_file *f, int i); /* new CPU tensor */
void gl_safetensors_close(gl_st_file *f);

#endif
