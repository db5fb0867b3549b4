/* gl_data.h — tokenizers, token shards and the batch loader.
 * Part of the public API (umbrella gptlua.h); plain C for ffi.cdef.
 *
 * Tokenizer (engine/tokenizer.c).  One object serves two kinds:
 *  - byte-level BPE: text is split by a regex (PCRE2 + JIT, the GPT-4 pattern
 *    by default) into chunks; each chunk's bytes are merged by rank.  Ids
 *    0..255 are the bytes (for tokenizers trained here), merge i makes id
 *    256+i, special tokens follow the ordinary ones.
 *  - character level: the distinct bytes of a text, sorted, are ids 0..k-1;
 *    no pattern, no merges.
 * Special tokens are never produced from plain text (they are not reachable
 * by merges); encoding can only prepend one explicitly (prepend_id).
 * Bytes that are not valid UTF-8 fall between regex matches and are encoded
 * byte-wise, so decode(encode(s)) == s for every byte string.
 *
 * Shards (engine/shards.c): a 64-byte header (gl_shard_header) followed by
 * n_tokens little-endian uint16 (vocab <= 65536) or uint32 tokens.
 *
 * Loader (engine/loader.c): B x T batches of (x, y) windows from shards, an
 * in-memory token tensor or a random source, assembled by a background
 * pthread into a ring of tensors.  The global stream of rows depends only on
 * (seed, sampling, data, block_size): global row g of the stream is a pure
 * function of g.  A step of world_size ranks with batch B consumes global
 * rows [s, s + B*world); rank r takes rows [s + r*B, s + (r+1)*B).  So the
 * union of the ranks' batches equals the world_size = 1 batch of size
 * B*world, and resuming from `sample` (rows consumed) is exact for any rank
 * count. */
#ifndef GL_DATA_H
#define GL_DATA_H
#include "gl_core.h"

/* ------------------------------------------------------------ tokenizer */
typedef struct gl_tokenizer gl_tokenizer;
typedef struct gl_bpe_trainer gl_bpe_trainer;

/* The GPT-4 (cl100k) pre-tokenisation pattern, GPT-2's (r50k, p50k) and
   o200k's, as tiktoken splits them. */
const char *gl_tok_gpt4_pattern(void);
const char *gl_tok_r50k_pattern(void);
const char *gl_tok_o200k_pattern(void);

/* BPE training: add any number of texts (split and counted as they come),
   then train.  vocab_size counts the 256 byte tokens, the merges and the
   n_special special tokens.  Ties between equally frequent pairs go to the
   smallest (left, right) id pair; a pair whose bytes already exist as a token
   is never merged (keeps token bytes unique, as tiktoken files need).
   Training stops early when no pair is left; the tokenizer is then smaller. */
gl_bpe_trainer *gl_bpe_trainer_new(const char *pattern); /* NULL: GPT-4, "": none */
int gl_bpe_trainer_add(gl_bpe_trainer *tr, const char *text, int64_t len);
int64_t gl_bpe_trainer_unique_chunks(const gl_bpe_trainer *tr);
gl_tokenizer *gl_bpe_trainer_train(gl_bpe_trainer *tr, int vocab_size, int n_special,
                                   const char *const *special);
void gl_bpe_trainer_free(gl_bpe_trainer *tr);

/* A BPE tokenizer from an explicit merge list: merge i joins ids
   (pairs[2i], pairs[2i+1]) into id 256+i.  pattern: NULL for GPT-4, ""
   for no splitting (as for the trainer). */
gl_tokenizer *gl_tok_from_merges(const char *pattern, int n_merges, const int32_t *pairs,
                                 int n_special, const char *const *special);
/* A BPE tokenizer from its ranks, as tiktoken holds one: token id i has the
   n_ordinary byte strings tokens[i] (lens[i] bytes); every byte has a
   one-byte token, and each longer token must be the merge of two tokens of
   lower rank (derived as gl_tok_load does).  Specials follow as ids
   n_ordinary.. .  pattern as for gl_tok_from_merges. */
gl_tokenizer *gl_tok_from_ranks(const char *pattern, int n_ordinary, const char *const *tokens, const int64_t *lens,
                                int n_special, const char *const *special);
/* Character-level tokenizer over the distinct bytes of text. */
gl_tokenizer *gl_tok_char(const char *text, int64_t len, int n_special,
                          const char *const *special);
/* path: tiktoken ranks file; path + ".json": pattern, type, special tokens.
   load accepts a bare tiktoken file (no .json) of one of tiktoken's standard
   encodings, recognised by its ranks (r50k_base, cl100k_base, o200k_base:
   their pattern, no specials), and refuses any other.  load_pattern splits
   with pattern ("" for none) whatever the sidecar says. */
gl_tokenizer *gl_tok_load(const char *path);
gl_tokenizer *gl_tok_load_pattern(const char *path, const char *pattern);
int gl_tok_save(const gl_tokenizer *t, const char *path);
void gl_tok_free(gl_tokenizer *t);

int gl_tok_vocab_size(const gl_tokenizer *t);   /* ordinary + special */
int gl_tok_n_ordinary(const gl_tokenizer *t);
int gl_tok_is_char(const gl_tokenizer *t);
const char *gl_tok_pattern(const gl_tokenizer *t); /* NULL when none */
/* Unicode version of the regex's character tables the tokenizer was made
   with (PCRE2's; recorded in its file): characters added in later versions
   split differently.  gl_tok_unicode_version(NULL) is this build's. */
const char *gl_tok_unicode_version(const gl_tokenizer *t);
int gl_tok_n_merges(const gl_tokenizer *t);
/* merge i (in rank order): left, right and the id it makes */
int gl_tok_merge(const gl_tokenizer *t, int i, int32_t *left, int32_t *right, int32_t *id);
int gl_tok_n_special(const gl_tokenizer *t);
int gl_tok_special_id(const gl_tokenizer *t, const char *name); /* -1 if absent */
/* bytes of a token (special: its name); not NUL-terminated */
const char *gl_tok_token_bytes(const gl_tokenizer *t, int id, int64_t *len);

/* 1-D int32 tensor of ids; prepend_id >= 0 is put first (e.g. BOS).  Large
   texts are cut at chunk boundaries and encoded on all threads. */
gl_tensor *gl_tok_encode(const gl_tokenizer *t, const char *text, int64_t len, int32_t prepend_id);
/* out[i] = encode(texts[i]) (new tensors), documents spread over threads */
int gl_tok_encode_batch(const gl_tokenizer *t, int n, const char *const *texts,
                        const int64_t *lens, int32_t prepend_id, gl_tensor **out);
/* chunk boundaries: int64 tensor of chunk end offsets */
gl_tensor *gl_tok_split(const gl_tokenizer *t, const char *text, int64_t len);
/* Largest cut <= len where encoding the two parts separately equals encoding
   the whole (after a '\n' followed by a printable non-space ASCII byte);
   0 if none.  Lets callers stream huge files in pieces. */
int64_t gl_tok_safe_cut(const gl_tokenizer *t, const char *text, int64_t len);
/* decoding: length first (validates every id), then the bytes */
int64_t gl_tok_decoded_len(const gl_tokenizer *t, const int32_t *ids, int64_t n);
int gl_tok_decode(const gl_tokenizer *t, const int32_t *ids, int64_t n, char *out);

/* --------------------------------------------------------------- shards */
enum { GL_SHARD_VERSION = 1, GL_SHARD_HEADER_BYTES = 64 };
typedef struct gl_shard_header {
  char magic[8];          /* "GLTOKENS" */
  uint32_t version;       /* GL_SHARD_VERSION */
  uint32_t token_bytes;   /* 2: uint16 tokens (vocab <= 65536), 4: uint32 */
  uint32_t vocab_size;    /* every token is < vocab_size */
  uint32_t header_bytes;  /* GL_SHARD_HEADER_BYTES */
  uint64_t n_tokens;
  uint64_t checksum;      /* FNV-1a 64 over the token values (32-bit each) */
  uint8_t reserved[24];   /* zero */
} gl_shard_header;

typedef struct gl_shard_writer gl_shard_writer;
/* writes path.tmp, renamed to path by close (a crash leaves no half shard) */
gl_shard_writer *gl_shard_writer_open(const char *path, int64_t vocab_size);
/* ids: 1-D contiguous int32 or int64 CPU tensor, values in [0, vocab) */
int gl_shard_writer_append(gl_shard_writer *w, const gl_tensor *ids);
int64_t gl_shard_writer_count(const gl_shard_writer *w);
int gl_shard_writer_close(gl_shard_writer *w); /* frees w, also on error */
void gl_shard_writer_abort(gl_shard_writer *w); /* removes path.tmp, frees w */

/* A validated, memory-mapped shard.  open checks magic, version, sizes, the
   checksum and that every token is < vocab_limit (0: the header's vocab).
   format GL_SHARD_AUTO reads gptlua's shards and llm.c's (int32 header,
   magic 20240520, or 20240801 for its LLaMA-3 files: no vocabulary, no
   checksum); GL_SHARD_RAW_U16 reads
   nanoGPT's headerless uint16 train.bin/val.bin.  Other formats come back in
   a gl_shard_header with magic "LLM.C" / "RAW16", header_bytes the tokens'
   offset, vocab_size and checksum 0. */
enum { GL_SHARD_AUTO = 0, GL_SHARD_RAW_U16 = 1 };
typedef struct gl_shard gl_shard;
gl_shard *gl_shard_open(const char *path, int64_t vocab_limit, int format);
int gl_shard_read_header(const char *path, int format, gl_shard_header *out);
int64_t gl_shard_n_tokens(const gl_shard *s);
int gl_shard_token_bytes(const gl_shard *s);
int64_t gl_shard_vocab_size(const gl_shard *s);
int64_t gl_shard_max_id(const gl_shard *s);     /* the largest token in the shard, -1 when it has none */
const void *gl_shard_data(const gl_shard *s);
const char *gl_shard_path(const gl_shard *s);
/* tokens [start, start+n) as a new int32 tensor */
gl_tensor *gl_shard_tokens(const gl_shard *s, int64_t start, int64_t n);
void gl_shard_close(gl_shard *s);
/* sorted, '\n'-joined paths dir/NAME of the regular files whose NAME starts
   with prefix and ends with suffix (NULL: any; hidden files skipped); free with
   gl_data_free */
char *gl_list_files(const char *dir, const char *prefix, const char *suffix);
void gl_data_free(void *p);

/* --------------------------------------------------------------- loader */
typedef enum gl_sampling { GL_SAMPLE_RANDOM = 0, GL_SAMPLE_SEQUENTIAL = 1 } gl_sampling;

typedef struct gl_loader_config {
  int64_t batch_size;   /* B rows per rank */
  int64_t block_size;   /* T */
  int32_t rank, world_size;
  uint64_t seed;
  int32_t sampling;     /* gl_sampling */
  int32_t bos_aligned;  /* rows start at bos_id tokens */
  int64_t bos_id;
  int64_t vocab_size;   /* shards/tokens must be below it (0: no check);
                           required by the random source */
  int32_t prefetch;     /* ring slots (batches assembled ahead), >= 2 */
  int32_t shard_format; /* how gl_loader_add_shard reads files: GL_SHARD_AUTO or _RAW_U16 */
} gl_loader_config;

/* where global row `sample` reads: source index, offset, epoch */
typedef struct gl_loader_pos {
  int64_t source, offset, epoch;
} gl_loader_pos;

typedef struct gl_loader gl_loader;
gl_loader *gl_loader_new(const gl_loader_config *cfg);
int gl_loader_add_shard(gl_loader *L, const char *path);
/* 1-D contiguous CPU tensor of uint16/int32/int64 ids; the caller keeps it
   alive for the loader's lifetime */
int gl_loader_add_tokens(gl_loader *L, const gl_tensor *tokens);
/* a virtual source of n_tokens uniform ids in [0, vocab_size) */
int gl_loader_add_random(gl_loader *L, int64_t n_tokens);
/* (Re)starts the producer at global row `sample` (rows consumed so far). */
/* batches in pinned host memory (needs a CUDA device), before the first start */
int gl_loader_pin_memory(gl_loader *L, int on);
int gl_loader_start(gl_loader *L, int64_t sample);
/* The next (x, y) int64 (B, T) CPU tensors, handed over to the caller.
   Blocks only when the producer is behind. */
int gl_loader_next(gl_loader *L, gl_tensor **x, gl_tensor **y);
int64_t gl_loader_sample(const gl_loader *L);      /* global rows consumed */
int64_t gl_loader_n_tokens(const gl_loader *L);    /* over all sources */
int64_t gl_loader_n_windows(const gl_loader *L);   /* distinct row starts */
int gl_loader_position(const gl_loader *L, int64_t sample, gl_loader_pos *out);
double gl_loader_last_wait(const gl_loader *L);    /* seconds next() blocked */
void gl_loader_free(gl_loader *L);

#endif
