enum { GL_OK = 0, GL_ERR = -1 };
enum { GL_MAX_DIMS = 8 };
enum { GL_TENSOR_MAGIC = 0x676c7453 };
enum { GL_DEVICE_CPU = -1 };
typedef enum gl_dtype {
  GL_F32 = 0, GL_F64 = 1, GL_BF16 = 2, GL_F16 = 3,
  GL_I32 = 4, GL_I64 = 5, GL_U16 = 6, GL_U8 = 7, GL_BOOL = 8,
  GL_NDTYPES = 9
} gl_dtype;
typedef struct gl_storage {
  void *data;
  int64_t nbytes;
  int64_t capacity;
  int32_t refcount;
  int32_t device;
  int32_t external;
  int32_t pad_;
} gl_storage;
typedef struct gl_tensor {
  uint32_t magic;
  int32_t dtype;
  int32_t device;
  int32_t ndim;
  int64_t offset;
  int64_t numel;
  int64_t shape[8];
  int64_t stride[8];
  gl_storage *storage;
} gl_tensor;
typedef struct gl_mem_stats {
  int64_t allocated;
  int64_t reserved;
  int64_t peak;
  int64_t n_allocs;
  int64_t n_frees;
  int64_t cache_hits;
  int64_t n_live;
} gl_mem_stats;
const char *gl_last_error(void);
void gl_clear_error(void);
const char *gl_version(void);
int gl_cuda_built(void);
int gl_cuda_device_count(void);
const char *gl_dtype_name(int dtype);
int gl_dtype_size(int dtype);
int gl_set_num_threads(int n);
int gl_get_num_threads(void);
gl_tensor *gl_empty(int dtype, int device, int ndim, const int64_t *shape);
gl_tensor *gl_as_strided(const gl_tensor *src, int ndim, const int64_t *shape,
                         const int64_t *stride, int64_t offset);
gl_tensor *gl_from_external(void *data, int64_t nbytes, int dtype, int ndim,
                            const int64_t *shape);
gl_tensor *gl_empty_pinned(int dtype, int ndim, const int64_t *shape);
gl_tensor *gl_view_dtype(const gl_tensor *src, int dtype, int ndim, const int64_t *shape, int64_t byte_offset);
void gl_tensor_free(gl_tensor *t);
int gl_tensor_release(gl_tensor *t);
int gl_tensor_check(const gl_tensor *t, const char *fn, const char *arg);
void *gl_data_ptr(const gl_tensor *t);
int gl_is_contiguous(const gl_tensor *t);
int64_t gl_storage_refcount(const gl_tensor *t);
int gl_same_storage(const gl_tensor *a, const gl_tensor *b);
int gl_copy(gl_tensor *dst, const gl_tensor *src);
int gl_fill(gl_tensor *t, double value);
int gl_get_item(const gl_tensor *t, int64_t elem_offset, double *out);
int gl_set_item(gl_tensor *t, int64_t elem_offset, double value);
int gl_to_doubles(const gl_tensor *t, double *out);
int gl_from_doubles(gl_tensor *t, const double *in);
int gl_arange(gl_tensor *t, double start, double step);
int gl_rand_uniform(gl_tensor *t, uint64_t seed, uint64_t offset, double lo, double hi);
int gl_rand_normal(gl_tensor *t, uint64_t seed, uint64_t offset, double mean, double std);
int gl_rand_u32(uint64_t seed, uint64_t counter, uint32_t out[4]);
int gl_mem_stats_get(int device, gl_mem_stats *out);
int gl_mem_reset_peak(int device);
int gl_empty_cache(int device);
int gl_signal_catch(int signum);
int gl_signal_restore(int signum);
int gl_signal_take(int signum);
int gl_file_checksum(const char *path, uint64_t *out);
int gl_max_abs_diff(const gl_tensor *a, const gl_tensor *b, double *out);
int gl_safetensors_save(const char *path, int n, const char **names,
                        const gl_tensor **tensors, const char *metadata_json);
typedef struct gl_st_file gl_st_file;
gl_st_file *gl_safetensors_open(const char *path);
int gl_safetensors_count(const gl_st_file *f);
const char *gl_safetensors_name(const gl_st_file *f, int i);
const char *gl_safetensors_metadata(const gl_st_file *f);
gl_tensor *gl_safetensors_get(const gl_st_file *f, int i);
void gl_safetensors_close(gl_st_file *f);
typedef enum gl_unary_op {
  GL_U_NEG = 0, GL_U_EXP, GL_U_LOG, GL_U_SQRT, GL_U_RSQRT, GL_U_TANH,
  GL_U_ABS, GL_U_RELU, GL_U_RELU2, GL_U_GELU_TANH, GL_U_SILU, GL_U_SIGMOID,
  GL_U_SIN, GL_U_COS, GL_U_SQUARE, GL_U_RECIPROCAL,
  GL_U_CLAMP,
  GL_U_POW,
  GL_U_ADD_SCALAR,
  GL_U_MUL_SCALAR,
  GL_U_AFFINE,
  GL_U_RSUB_SCALAR,
  GL_U_RDIV_SCALAR,
  GL_U_SOFTCAP,
  GL_U_COUNT
} gl_unary_op;
typedef enum gl_binary_op {
  GL_B_ADD = 0, GL_B_SUB, GL_B_MUL, GL_B_DIV, GL_B_POW, GL_B_MAXIMUM,
  GL_B_MINIMUM, GL_B_EQ, GL_B_NE, GL_B_LT, GL_B_LE, GL_B_GT, GL_B_GE,
  GL_B_COUNT
} gl_binary_op;
typedef enum gl_reduce_op {
  GL_R_SUM = 0, GL_R_MEAN, GL_R_MAX, GL_R_MIN, GL_R_SUMSQ, GL_R_NORM2,
  GL_R_COUNT
} gl_reduce_op;
int gl_unary(int op, gl_tensor *out, const gl_tensor *x, double p0, double p1);
int gl_unary_backward(int op, gl_tensor *dx, const gl_tensor *dy,
                      const gl_tensor *x, double p0, double p1);
int gl_binary(int op, gl_tensor *out, const gl_tensor *a, const gl_tensor *b);
int gl_where(gl_tensor *out, const gl_tensor *cond, const gl_tensor *a, const gl_tensor *b);
int gl_reduce(int op, gl_tensor *out, const gl_tensor *x, uint32_t dims_mask);
int gl_reduce_max_dim(gl_tensor *out, gl_tensor *indices, const gl_tensor *x, int dim);
int gl_sumsq(const gl_tensor *x, double *out);
int gl_matmul(gl_tensor *out, const gl_tensor *a, const gl_tensor *b, double alpha, double beta);
int gl_softmax(gl_tensor *out, const gl_tensor *x, int log);
int gl_softmax_backward(gl_tensor *dx, const gl_tensor *y, const gl_tensor *dy, int log);
int gl_layernorm_forward(gl_tensor *y, gl_tensor *mean, gl_tensor *rstd, const gl_tensor *x,
                         const gl_tensor *weight, const gl_tensor *bias, double eps);
int gl_layernorm_backward(gl_tensor *dx, gl_tensor *dweight, gl_tensor *dbias,
                          const gl_tensor *dy, const gl_tensor *x, const gl_tensor *weight,
                          const gl_tensor *mean, const gl_tensor *rstd);
int gl_rmsnorm_forward(gl_tensor *y, gl_tensor *rstd, const gl_tensor *x,
                       const gl_tensor *weight, double eps);
int gl_rmsnorm_backward(gl_tensor *dx, gl_tensor *dweight, const gl_tensor *dy,
                        const gl_tensor *x, const gl_tensor *weight, const gl_tensor *rstd);
int gl_embedding_forward(gl_tensor *out, const gl_tensor *table, const gl_tensor *ids);
int gl_embedding_backward(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids);
int gl_index_select(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx);
int gl_gather(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx);
int gl_scatter_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src);
int gl_index_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src);
int gl_attention_forward(gl_tensor *out, gl_tensor *lse, const gl_tensor *q,
                         const gl_tensor *k, const gl_tensor *v, double scale, int64_t window);
int gl_attention_backward(gl_tensor *dq, gl_tensor *dk, gl_tensor *dv, const gl_tensor *dout,
                          const gl_tensor *q, const gl_tensor *k, const gl_tensor *v,
                          const gl_tensor *out, const gl_tensor *lse, double scale, int64_t window);
int gl_rope(gl_tensor *out, const gl_tensor *x, const gl_tensor *cos, const gl_tensor *sin, int inverse);
int gl_cross_entropy_forward(gl_tensor *losses, gl_tensor *lse, const gl_tensor *logits,
                             const gl_tensor *targets, int64_t ignore_index, double softcap);
int gl_cross_entropy_backward(gl_tensor *dlogits, const gl_tensor *logits, const gl_tensor *targets,
                              const gl_tensor *lse, int64_t ignore_index, double softcap, double scale);
int gl_dropout(gl_tensor *out, const gl_tensor *x, double p, uint64_t seed, uint64_t offset);
int gl_adamw_update(gl_tensor *param, const gl_tensor *grad, gl_tensor *m, gl_tensor *v,
                    int64_t start, int64_t len, double lr, double beta1, double beta2,
                    double eps, double weight_decay, int64_t step);
int gl_momentum_update(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad,
                       int64_t start, int64_t len, double mu, int nesterov);
typedef struct gl_tokenizer gl_tokenizer;
typedef struct gl_bpe_trainer gl_bpe_trainer;
const char *gl_tok_gpt4_pattern(void);
gl_bpe_trainer *gl_bpe_trainer_new(const char *pattern);
int gl_bpe_trainer_add(gl_bpe_trainer *tr, const char *text, int64_t len);
int64_t gl_bpe_trainer_unique_chunks(const gl_bpe_trainer *tr);
gl_tokenizer *gl_bpe_trainer_train(gl_bpe_trainer *tr, int vocab_size, int n_special,
                                   const char *const *special);
void gl_bpe_trainer_free(gl_bpe_trainer *tr);
gl_tokenizer *gl_tok_from_merges(const char *pattern, int n_merges, const int32_t *pairs,
                                 int n_special, const char *const *special);
gl_tokenizer *gl_tok_char(const char *text, int64_t len, int n_special,
                          const char *const *special);
gl_tokenizer *gl_tok_load(const char *path);
int gl_tok_save(const gl_tokenizer *t, const char *path);
void gl_tok_free(gl_tokenizer *t);
int gl_tok_vocab_size(const gl_tokenizer *t);
int gl_tok_n_ordinary(const gl_tokenizer *t);
int gl_tok_is_char(const gl_tokenizer *t);
const char *gl_tok_pattern(const gl_tokenizer *t);
int gl_tok_n_merges(const gl_tokenizer *t);
int gl_tok_merge(const gl_tokenizer *t, int i, int32_t *left, int32_t *right, int32_t *id);
int gl_tok_n_special(const gl_tokenizer *t);
int gl_tok_special_id(const gl_tokenizer *t, const char *name);
const char *gl_tok_token_bytes(const gl_tokenizer *t, int id, int64_t *len);
gl_tensor *gl_tok_encode(const gl_tokenizer *t, const char *text, int64_t len, int32_t prepend_id);
int gl_tok_encode_batch(const gl_tokenizer *t, int n, const char *const *texts,
                        const int64_t *lens, int32_t prepend_id, gl_tensor **out);
gl_tensor *gl_tok_split(const gl_tokenizer *t, const char *text, int64_t len);
int64_t gl_tok_safe_cut(const gl_tokenizer *t, const char *text, int64_t len);
int64_t gl_tok_decoded_len(const gl_tokenizer *t, const int32_t *ids, int64_t n);
int gl_tok_decode(const gl_tokenizer *t, const int32_t *ids, int64_t n, char *out);
enum { GL_SHARD_VERSION = 1, GL_SHARD_HEADER_BYTES = 64 };
typedef struct gl_shard_header {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint32_t vocab_size;
  uint32_t header_bytes;
  uint64_t n_tokens;
  uint64_t checksum;
  uint8_t reserved[24];
} gl_shard_header;
typedef struct gl_shard_writer gl_shard_writer;
gl_shard_writer *gl_shard_writer_open(const char *path, int64_t vocab_size);
int gl_shard_writer_append(gl_shard_writer *w, const gl_tensor *ids);
int64_t gl_shard_writer_count(const gl_shard_writer *w);
int gl_shard_writer_close(gl_shard_writer *w);
void gl_shard_writer_abort(gl_shard_writer *w);
typedef struct gl_shard gl_shard;
gl_shard *gl_shard_open(const char *path, int64_t vocab_limit);
int gl_shard_read_header(const char *path, gl_shard_header *out);
int64_t gl_shard_n_tokens(const gl_shard *s);
int gl_shard_token_bytes(const gl_shard *s);
int64_t gl_shard_vocab_size(const gl_shard *s);
const void *gl_shard_data(const gl_shard *s);
const char *gl_shard_path(const gl_shard *s);
gl_tensor *gl_shard_tokens(const gl_shard *s, int64_t start, int64_t n);
void gl_shard_close(gl_shard *s);
char *gl_list_files(const char *dir, const char *prefix, const char *suffix);
void gl_data_free(void *p);
typedef enum gl_sampling { GL_SAMPLE_RANDOM = 0, GL_SAMPLE_SEQUENTIAL = 1 } gl_sampling;
typedef struct gl_loader_config {
  int64_t batch_size;
  int64_t block_size;
  int32_t rank, world_size;
  uint64_t seed;
  int32_t sampling;
  int32_t bos_aligned;
  int64_t bos_id;
  int64_t vocab_size;
  int32_t prefetch;
  int32_t pad_;
} gl_loader_config;
typedef struct gl_loader_pos {
  int64_t source, offset, epoch;
} gl_loader_pos;
typedef struct gl_loader gl_loader;
gl_loader *gl_loader_new(const gl_loader_config *cfg);
int gl_loader_add_shard(gl_loader *L, const char *path);
int gl_loader_add_tokens(gl_loader *L, const gl_tensor *tokens);
int gl_loader_add_random(gl_loader *L, int64_t n_tokens);
int gl_loader_start(gl_loader *L, int64_t sample);
int gl_loader_next(gl_loader *L, gl_tensor **x, gl_tensor **y);
int64_t gl_loader_sample(const gl_loader *L);
int64_t gl_loader_n_tokens(const gl_loader *L);
int64_t gl_loader_n_windows(const gl_loader *L);
int gl_loader_position(const gl_loader *L, int64_t sample, gl_loader_pos *out);
double gl_loader_last_wait(const gl_loader *L);
void gl_loader_free(gl_loader *L);
typedef enum gl_dist_op {
  GL_DIST_SUM = 0, GL_DIST_AVG, GL_DIST_MAX, GL_DIST_MIN, GL_DIST_NOPS
} gl_dist_op;
typedef enum gl_coll {
  GL_COLL_ALL_REDUCE = 0, GL_COLL_REDUCE_SCATTER, GL_COLL_ALL_GATHER,
  GL_COLL_BROADCAST, GL_COLL_REDUCE, GL_COLL_GATHER, GL_COLL_SCATTER,
  GL_COLL_ALL_TO_ALL, GL_COLL_BARRIER, GL_COLL_SEND, GL_COLL_RECV,
  GL_COLL_COUNT
} gl_coll;
enum { GL_COMM_NAME_MAX = 96 };
enum { GL_WORK_RUNNING = 0, GL_WORK_DONE = 1, GL_WORK_FAILED = -1 };
typedef struct gl_comm gl_comm;
typedef struct gl_work gl_work;
typedef struct gl_coll_args {
  int32_t coll;
  int32_t op;
  int32_t root;
  int32_t pad_;
  gl_tensor *send;
  gl_tensor *recv;
  const int64_t *send_counts;
  const int64_t *recv_counts;
  const char *label;
} gl_coll_args;
typedef struct gl_dist_backend {
  const char *name;
  int32_t host_memory;
  uint32_t reduce_dtypes;
  int (*start)(gl_work *w);
  int (*test)(gl_work *w, int *done);
  int (*split)(gl_comm *parent, int color, int key, gl_comm *child);
  void (*destroy)(gl_comm *c);
  void (*serve)(const gl_work *waiting);
  void (*diagnose)(const gl_work *w, char *buf, int n);
  void (*abort)(int code);
} gl_dist_backend;
struct gl_comm {
  const gl_dist_backend *backend;
  void *impl;
  int32_t rank, size;
  int32_t local_rank, local_size;
  int32_t node, nnodes;
  int32_t world_rank;
  int32_t is_world;
  int32_t refcount;
  int32_t nsplits;
  int64_t seq;
  int64_t p2p_seq;
  double timeout_s;
  int32_t *world_ranks;
  gl_comm *next_live;
  char name[96];
};
struct gl_work {
  gl_comm *comm;
  gl_coll_args args;
  int64_t seq;
  int32_t state;
  int32_t wire_dtype;
  int32_t detached;
  int32_t pad_;
  double started_at;
  gl_tensor *send_view, *recv_view;
  gl_tensor *send_stage, *recv_stage;
  void *send_buf, *recv_buf;
  int64_t send_numel, recv_numel;
  int64_t *send_counts, *recv_counts;
  void *impl;
  gl_work *next_detached;
  char error[256];
};
int gl_dist_init(double timeout_s);
int gl_dist_initialized(void);
gl_comm *gl_dist_world(void);
int gl_dist_finalize(void);
void gl_dist_abort(int code, const char *msg);
int gl_dist_cpu_count(void);
double gl_dist_now(void);
int gl_comm_split(gl_comm *c, int color, int key, gl_comm **out);
void gl_comm_free(gl_comm *c);
int gl_comm_set_timeout(gl_comm *c, double timeout_s);
gl_work *gl_comm_start(gl_comm *c, const gl_coll_args *a);
int gl_work_test(gl_work *w, int *done);
int gl_work_wait(gl_work *w);
void gl_work_free(gl_work *w);
int gl_comm_run(gl_comm *c, const gl_coll_args *a);
int gl_dist_progress(void);
const char *gl_coll_name(int coll);
const char *gl_dist_op_name(int op);
gl_comm *gl_comm_alloc(const gl_dist_backend *b, const char *name);
gl_comm *gl_comm_find(const char *name);
void gl_comm_free_world(gl_comm *c);
void gl_work_drain_detached(void);
typedef struct gl_cuda_props {
  char name[256];
  int major, minor;
  int multiprocessor_count;
  int max_threads_per_block;
  int warp_size;
  int clock_khz;
  int memory_clock_khz;
  int memory_bus_width;
  int64_t total_memory;
  int64_t shared_memory_per_block_optin;
  int64_t l2_cache_size;
} gl_cuda_props;
typedef enum gl_cuda_stream_kind { GL_STREAM_COMPUTE = 0, GL_STREAM_COMM = 1 } gl_cuda_stream_kind;
int gl_cuda_get_props(int device, gl_cuda_props *out);
int gl_cuda_mem_info(int device, int64_t *free_bytes, int64_t *total_bytes);
int gl_cuda_set_device(int device);
int gl_cuda_synchronize(int device);
void *gl_cuda_stream(int device, int kind);
int gl_cuda_stream_synchronize(int device, int kind);
int gl_cuda_stream_wait(int device, int waiter, int waited);
typedef struct gl_cuda_event gl_cuda_event;
gl_cuda_event *gl_cuda_event_create(int device);
void gl_cuda_event_destroy(gl_cuda_event *e);
int gl_cuda_event_record(gl_cuda_event *e, int kind);
int gl_cuda_event_synchronize(gl_cuda_event *e);
int gl_cuda_event_query(gl_cuda_event *e);
int gl_cuda_event_elapsed_ms(const gl_cuda_event *start, const gl_cuda_event *end, double *ms);
void *gl_cuda_host_alloc(int64_t nbytes);
int gl_cuda_host_free(void *ptr);
int64_t gl_cuda_pinned_bytes(void);
