/* gl_cuda.h — the CUDA runtime as seen from Lua: devices, streams, events,
 * synchronisation, pinned host buffers.  Part of the public API (umbrella
 * gptlua.h); implemented in kernels/runtime.cu.
 *
 * gl_cuda_built() and gl_cuda_device_count() live in gl_core.h.  Everything
 * here returns GL_ERR with a message when the engine has no CUDA or the
 * device does not exist, so a GPU-less machine never touches the driver
 * beyond counting devices.  Memory statistics of cuda:N are the allocator's:
 * gl_mem_stats_get(N, ...) (gl_core.h). */
#ifndef GL_CUDA_H
#define GL_CUDA_H
#include "gl_core.h"

typedef struct gl_cuda_props {
  char name[256];
  int major, minor;              /* compute capability */
  int multiprocessor_count;
  int max_threads_per_block;
  int warp_size;
  int clock_khz;                 /* SM clock */
  int memory_clock_khz;
  int memory_bus_width;          /* bits */
  int64_t total_memory;          /* bytes of device memory */
  int64_t shared_memory_per_block_optin; /* bytes a block may opt into */
  int64_t l2_cache_size;         /* bytes */
} gl_cuda_props;

/* The streams of a device: kernels run on the compute stream, the
   distributed backend's collectives on the communication stream (the NCCL
   backend gives each communicator a stream of its own), and host<->device
   transfers started by gl_copy_async on the copy stream. */
typedef enum gl_cuda_stream_kind {
  GL_STREAM_COMPUTE = 0, GL_STREAM_COMM = 1, GL_STREAM_COPY = 2
} gl_cuda_stream_kind;

int gl_cuda_get_props(int device, gl_cuda_props *out);
/* device memory as the driver sees it (all processes), bytes */
int gl_cuda_mem_info(int device, int64_t *free_bytes, int64_t *total_bytes);
int gl_cuda_set_device(int device);
/* waits for all work on device (every stream); device -1: every device */
int gl_cuda_synchronize(int device);
/* Id checks (embedding, cross-entropy, gather/scatter) run on the device
   without a host wait; their results are read where the host waits anyway: a
   copy to the host and gl_cuda_synchronize read them, and this reads them
   (one small copy, a wait) after e.g. the trainer's loss read.  Returns the
   first bad check's error ("gl_embedding_forward: ids[3] is 70000, expected
   ...") and clears the queue.  device -1: every device. */
int gl_cuda_check_flags(int device);
/* the cudaStream_t of (device, kind) as an opaque pointer, created on first
   use; NULL with an error message on failure */
void *gl_cuda_stream(int device, int kind);
int gl_cuda_stream_synchronize(int device, int kind);
/* makes stream `waiter` wait (on the device, not the host) for everything
   queued so far on stream `waited` of the same device */
int gl_cuda_stream_wait(int device, int waiter, int waited);

/* Events (timing-enabled) for benchmarking and cross-stream ordering. */
typedef struct gl_cuda_event gl_cuda_event;
gl_cuda_event *gl_cuda_event_create(int device);
void gl_cuda_event_destroy(gl_cuda_event *e);
int gl_cuda_event_record(gl_cuda_event *e, int kind);
/* stream `kind` of e's device waits (on the device, not the host) for the
   work recorded before e; an event never recorded is a no-op */
int gl_cuda_stream_wait_event(gl_cuda_event *e, int kind);
int gl_cuda_event_synchronize(gl_cuda_event *e);
/* 1 if everything recorded before the event has finished, 0 if not, GL_ERR */
int gl_cuda_event_query(gl_cuda_event *e);
/* milliseconds between two recorded events of one device */
int gl_cuda_event_elapsed_ms(const gl_cuda_event *start, const gl_cuda_event *end, double *ms);

/* Asynchronous copy of src into dst (same dtype and numel, both
   contiguous) between the host and cuda:N, or within cuda:N, queued on the
   copy stream of N behind the work queued so far on its compute stream (dst
   may be memory the caching allocator just handed out again).  The host
   does not wait when the host side is pinned memory (gl_empty_pinned).
   The engine holds both tensors until a later gl_copy_async (or
   gl_cuda_synchronize) finds the copy done, so either may be freed at once.  done NULL: the compute stream waits for the copy, so dst
   is ready for everything queued after the call.  done given (an event of
   cuda:N): it is recorded after the copy instead and the compute stream
   does not wait: call gl_cuda_stream_wait_event(done, GL_STREAM_COMPUTE)
   before dst is used there; compute queued in between overlaps the copy
   (how the data loader prefetches). */
int gl_copy_async(gl_tensor *dst, const gl_tensor *src, gl_cuda_event *done);
/* copies started by gl_copy_async whose tensors are still held */
int gl_copy_async_pending(void);

/* CUDA graphs: the work queued on cuda:N's compute stream between begin and
   end is captured, not run; each launch replays it with the same arguments
   on the same addresses.  Allocations made meanwhile come from a pool the
   graph keeps until it is destroyed (memory freed during the capture too),
   so what the graph reads and writes stays its own; tensors allocated
   before and used by the capture must be kept alive by the caller (they are
   the graph's inputs and outputs: write inputs in place before a launch).
   A call the capture cannot contain (a host wait, a copy to pageable host
   memory) fails in the op that made it; end then fails too and says why.
   Without a GPU build these return GL_ERR. */
typedef struct gl_cuda_graph gl_cuda_graph;
int gl_cuda_graph_begin(int device);
gl_cuda_graph *gl_cuda_graph_end(int device);  /* NULL + error: nothing captured */
int gl_cuda_graph_launch(gl_cuda_graph *g);    /* queued on the compute stream */
int64_t gl_cuda_graph_nodes(const gl_cuda_graph *g);       /* kernels, copies, sets recorded; -1 for NULL */
int64_t gl_cuda_graph_pool_bytes(const gl_cuda_graph *g);  /* device memory the graph holds; -1 for NULL */
void gl_cuda_graph_destroy(gl_cuda_graph *g);

/* Page-locked host memory (for the data loader: fast, overlappable copies).
   Pinned blocks are counted in gl_cuda_pinned_bytes(). */
void *gl_cuda_host_alloc(int64_t nbytes);
int gl_cuda_host_free(void *ptr);
int64_t gl_cuda_pinned_bytes(void);

#endif
