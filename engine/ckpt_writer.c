/* ckpt_writer.c — the checkpoint writer: safetensors files written by a
 * thread of their own from host copies, so a training step waits only for
 * the copies (gptlua.checkpoint's asynchronous saves).
 *
 * gl_ckpt_writer_add copies each tensor into a staging buffer the writer
 * owns (page-locked for a tensor on a GPU, copied there by gl_copy_async on
 * the copy stream, which the compute stream waits for on the device; plain
 * host memory for a CPU tensor), and gl_ckpt_writer_start hands the files
 * added since the last start to the thread, which waits for the device
 * copies (one event), writes each file exactly as gl_safetensors_save does
 * (same code, so the same bytes) and checksums it.  The staging buffers are
 * kept and reused by the next save, and freed only by gl_ckpt_writer_free,
 * on the caller's thread: the thread never allocates or frees.  A new add
 * waits for a job still being written, so one save is in flight at a time.
 *
 * Test hook: GPTLUA_TEST_CKPT_KILL=K in the environment when the writer is
 * made kills the process (SIGKILL) in its K-th job, right after the first
 * tensor of the first file is written: a crash in the middle of a write. */
#define _GNU_SOURCE  /* SCHED_BATCH */
#include "internal.h"
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct ckpt_file {
  char *path, *meta;
  int n;
  char **names;
  gl_tensor **views;     /* views of staging buffers: what the thread writes */
  uint64_t checksum;
} ckpt_file;

struct gl_ckpt_writer {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t wake, done;
  int stop, busy;        /* busy: a started job not yet written */
  int failed;            /* the last job failed; err says why */
  char err[1024];
  ckpt_file *files;      /* the job being added, then the one started */
  int nfiles, cap_files;
  gl_tensor **stage;     /* staging buffers (U8), reused job after job */
  int nstage, cap_stage, used;
  gl_cuda_event *copied; /* recorded on the copy stream after the job's device copies */
  int copied_device;
  int job_copies;        /* the job has device copies to wait for */
  int started;           /* the files are a started job's (the next add clears them) */
  int jobs, kill_job;    /* jobs started; the test hook's job (0: off) */
};

static void kill_now(void *arg, int i) {
  (void)arg; (void)i;
  raise(SIGKILL);
}

static void *writer_main(void *arg) {
  gl_ckpt_writer *w = arg;
  struct sched_param sp = {0};
  pthread_setschedparam(pthread_self(), SCHED_BATCH, &sp);  /* I/O behind the trainer; best effort */
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (!w->busy && !w->stop) pthread_cond_wait(&w->wake, &w->mu);
    if (w->stop) break;
    pthread_mutex_unlock(&w->mu);
    int rc = GL_OK;
#ifdef GL_WITH_CUDA
    if (w->job_copies) rc = gl_cuda_event_synchronize(w->copied);
#endif
    int kill = w->kill_job > 0 && w->jobs == w->kill_job;
    for (int f = 0; f < w->nfiles && rc == GL_OK; f++) {
      ckpt_file *cf = &w->files[f];
      rc = gl_st_write(cf->path, cf->n, (const char **)cf->names, (const gl_tensor **)cf->views, cf->meta,
                       kill && f == 0 ? kill_now : NULL, NULL);
      if (rc == GL_OK) rc = gl_file_checksum(cf->path, &cf->checksum);
    }
    pthread_mutex_lock(&w->mu);
    w->failed = rc != GL_OK;
    if (w->failed) snprintf(w->err, sizeof w->err, "%s", gl_last_error());
    w->busy = 0;
    pthread_cond_broadcast(&w->done);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

gl_ckpt_writer *gl_ckpt_writer_new(void) {
  gl_ckpt_writer *w = calloc(1, sizeof *w);
  if (!w) return gl_error_null("gl_ckpt_writer_new: out of memory");
  const char *k = getenv("GPTLUA_TEST_CKPT_KILL");
  w->kill_job = k ? atoi(k) : 0;
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->wake, NULL);
  pthread_cond_init(&w->done, NULL);
  if (pthread_create(&w->thread, NULL, writer_main, w) != 0) {
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->wake);
    pthread_cond_destroy(&w->done);
    free(w);
    return gl_error_null("gl_ckpt_writer_new: cannot start the writer thread");
  }
  return w;
}

/* waits for the job in flight; GL_ERR with its error when it failed (once) */
static int wait_job(gl_ckpt_writer *w, const char *fn) {
  pthread_mutex_lock(&w->mu);
  while (w->busy) pthread_cond_wait(&w->done, &w->mu);
  int failed = w->failed;
  w->failed = 0;
  pthread_mutex_unlock(&w->mu);
  if (failed) return gl_error("%s: the checkpoint writer failed: %s", fn, w->err);
  return GL_OK;
}

static void clear_files(gl_ckpt_writer *w) {
  for (int f = 0; f < w->nfiles; f++) {
    ckpt_file *cf = &w->files[f];
    for (int i = 0; i < cf->n; i++) { free(cf->names[i]); gl_tensor_free(cf->views[i]); }
    free(cf->names); free(cf->views); free(cf->path); free(cf->meta);
  }
  w->nfiles = 0;
  w->used = 0;
}

int gl_ckpt_writer_wait(gl_ckpt_writer *w) {
  GL_NONNULL("gl_ckpt_writer_wait", w);
  return wait_job(w, "gl_ckpt_writer_wait");
}

int gl_ckpt_writer_busy(gl_ckpt_writer *w) {
  GL_NONNULL("gl_ckpt_writer_busy", w);
  pthread_mutex_lock(&w->mu);
  int busy = w->busy, failed = w->failed;
  pthread_mutex_unlock(&w->mu);
  if (busy) return 1;
  if (failed) return wait_job(w, "gl_ckpt_writer_busy");
  return 0;
}

/* a staging buffer of at least nbytes, pinned or not, for the job's next tensor */
static gl_tensor *stage_buffer(gl_ckpt_writer *w, int64_t nbytes, int pinned) {
  int k = w->used;
  if (k == w->nstage) {
    if (w->nstage == w->cap_stage) {
      int cap = w->cap_stage ? 2 * w->cap_stage : 16;
      gl_tensor **s = realloc(w->stage, (size_t)cap * sizeof *s);
      if (!s) return gl_error_null("gl_ckpt_writer_add: out of memory");
      w->stage = s; w->cap_stage = cap;
    }
    w->stage[w->nstage++] = NULL;
  }
  gl_tensor *b = w->stage[k];
  if (b && (b->storage->nbytes < nbytes || (b->storage->external == 2) != pinned)) {
    gl_tensor_free(b);
    b = w->stage[k] = NULL;
  }
  if (!b) {
    int64_t shape[1] = {nbytes > 8 ? nbytes : 8};
    b = pinned ? gl_empty_pinned(GL_U8, 1, shape) : gl_empty_host(GL_U8, 1, shape);
    if (!b) return NULL;
    w->stage[k] = b;
  }
  w->used = k + 1;
  return b;
}

/* the file's entry and copies; on failure the caller drops the whole job */
static int add_file(gl_ckpt_writer *w, const char *fn, const char *path, int n, const char **names,
                    const gl_tensor **ts, const char *metadata_json) {
  if (w->nfiles == w->cap_files) {
    int cap = w->cap_files ? 2 * w->cap_files : 4;
    ckpt_file *f = realloc(w->files, (size_t)cap * sizeof *f);
    if (!f) return gl_error("%s: out of memory", fn);
    w->files = f; w->cap_files = cap;
  }
  ckpt_file *cf = &w->files[w->nfiles];
  memset(cf, 0, sizeof *cf);
  w->nfiles++;  /* counted now, so clear_files frees what was made if a copy fails */
  cf->path = strdup(path);
  cf->meta = metadata_json ? strdup(metadata_json) : NULL;
  cf->names = calloc((size_t)(n > 0 ? n : 1), sizeof *cf->names);
  cf->views = calloc((size_t)(n > 0 ? n : 1), sizeof *cf->views);
  if (!cf->path || (metadata_json && !cf->meta) || !cf->names || !cf->views) return gl_error("%s: out of memory", fn);
  for (int i = 0; i < n; i++) {
    const gl_tensor *t = ts[i];
    int on_gpu = t->device >= 0;
    gl_tensor *b = stage_buffer(w, t->numel * gl_dtype_size(t->dtype), on_gpu);
    if (!b) return GL_ERR;
    cf->n = i + 1;
    cf->names[i] = strdup(names[i]);
    if (!cf->names[i]) return gl_error("%s: out of memory", fn);
    cf->views[i] = gl_view_dtype(b, t->dtype, t->ndim, t->shape, 0);
    if (!cf->views[i]) return GL_ERR;
#ifdef GL_WITH_CUDA
    if (on_gpu && gl_is_contiguous(t)) {
      /* on the copy stream behind the step's work; the compute stream waits
         for it on the device, so the next step cannot overwrite the source */
      if (w->copied && w->copied_device != t->device) { gl_cuda_event_destroy(w->copied); w->copied = NULL; }
      if (!w->copied && !(w->copied = gl_cuda_event_create(t->device))) return GL_ERR;
      w->copied_device = t->device;
      GL_TRY(gl_copy_async(cf->views[i], t, NULL));
      w->job_copies = 1;
      continue;
    }
#endif
    GL_TRY(gl_copy(cf->views[i], t));
  }
  return GL_OK;
}

int gl_ckpt_writer_add(gl_ckpt_writer *w, const char *path, int n, const char **names, const gl_tensor **ts,
                       const char *metadata_json) {
  const char *fn = "gl_ckpt_writer_add";
  GL_NONNULL(fn, w, path);
  if (n > 0) GL_NONNULL(fn, names, ts);  /* n == 0: may be NULL */
  if (n < 0) return gl_error("%s: n must be >= 0, got %d", fn, n);
  for (int i = 0; i < n; i++) {
    char arg[32]; snprintf(arg, sizeof arg, "tensor %d", i + 1);
    GL_TRY(gl_tensor_check(ts[i], fn, arg));
    if (gl_is_meta(ts[i])) return gl_error("%s: %s '%s' is a meta tensor (a shape without data)", fn, arg,
                                           names[i] ? names[i] : "");
    if (!names[i]) return gl_error("%s: name of tensor %d is NULL", fn, i + 1);
  }
  GL_TRY(wait_job(w, fn));
  if (w->started) {  /* the first file of a new job: the last job's files go */
    clear_files(w);
    w->started = 0;
    w->job_copies = 0;
  }
  if (add_file(w, fn, path, n, names, ts, metadata_json) != GL_OK) {
    clear_files(w);  /* the job is dropped: a save starts again from its first file */
    w->job_copies = 0;
    return GL_ERR;
  }
  return GL_OK;
}

int gl_ckpt_writer_start(gl_ckpt_writer *w) {
  GL_NONNULL("gl_ckpt_writer_start", w);
  GL_TRY(wait_job(w, "gl_ckpt_writer_start"));
  if (w->started) return gl_error("gl_ckpt_writer_start: no file added since the last start");
#ifdef GL_WITH_CUDA
  if (w->job_copies && gl_cuda_event_record(w->copied, GL_STREAM_COPY) != GL_OK) {
    clear_files(w);  /* the job is dropped, as a failed add drops it */
    w->job_copies = 0;
    return GL_ERR;
  }
#endif
  w->started = 1;
  pthread_mutex_lock(&w->mu);
  w->jobs++;
  w->busy = 1;
  pthread_cond_signal(&w->wake);
  pthread_mutex_unlock(&w->mu);
  return GL_OK;
}

int gl_ckpt_writer_checksum(gl_ckpt_writer *w, int i, uint64_t *out) {
  GL_NONNULL("gl_ckpt_writer_checksum", w, out);
  pthread_mutex_lock(&w->mu);
  int busy = w->busy;
  pthread_mutex_unlock(&w->mu);
  if (busy) return gl_error("gl_ckpt_writer_checksum: the job is still being written (gl_ckpt_writer_wait first)");
  if (!w->started) return gl_error("gl_ckpt_writer_checksum: no job was started");
  if (i < 0 || i >= w->nfiles)
    return gl_error("gl_ckpt_writer_checksum: file %d is out of range [0, %d)", i, w->nfiles);
  *out = w->files[i].checksum;
  return GL_OK;
}

void gl_ckpt_writer_free(gl_ckpt_writer *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  while (w->busy) pthread_cond_wait(&w->done, &w->mu);
  w->stop = 1;
  pthread_cond_signal(&w->wake);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  clear_files(w);
  for (int k = 0; k < w->nstage; k++) gl_tensor_free(w->stage[k]);
  free(w->stage);
  free(w->files);
#ifdef GL_WITH_CUDA
  gl_cuda_event_destroy(w->copied);
#endif
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->wake);
  pthread_cond_destroy(&w->done);
  free(w);
}
