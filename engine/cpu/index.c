/* index.c — CPU kernels of the id-driven ops: embedding (forward and
 * backward), index_select, gather, scatter_add, index_add, and the id range
 * check they (and cross-entropy) run first (the twin of kernels/index.cu).
 *
 * Index ops walk "lines" along the indexed dim: every position over the
 * other dims owns one line of the output, so lines run in parallel without
 * races.  index_select is gather and index_add is scatter_add with the 1-D
 * index expanded (0 strides) to the full shape.  Ids are checked against
 * their limit before anything is written.
 *
 * Compiled as a template: the generic section at the bottom is included
 * with real = float and real = double (template.h). */
#ifndef real
#include "cpu.h"
#include <tgmath.h>

#define GL_TEMPLATE "index.c"
#include "template.h"

/* Every id in [0, limit), or == ignore when has_ignore; else an error naming
   the first offending value, its position and the limit. */
int cpu_check_ids(const char *fn, const char *arg, const gl_tensor *ids, int64_t limit, const char *what,
                  int has_ignore, int64_t ignore) {
  gl_iter it;
  gl_iter_init(&it, 1, (const gl_tensor *[]){ids});
  for (int64_t o = 0; o < it.outer; o++) {
    int64_t off[GL_ITER_MAX_OPS];
    gl_iter_offsets(&it, o, off);
    for (int64_t i = 0; i < it.inner; i++) {
      int64_t v = load_id(ids, off[0] + i * it.istride[0]);
      if ((v < 0 || v >= limit) && !(has_ignore && v == ignore)) {
        if (has_ignore)
          return gl_error("%s: %s[%lld] is %lld, expected 0 <= %s < %lld (%s) or ignore_index %lld", fn, arg,
                          (long long)(o * it.inner + i), (long long)v, arg, (long long)limit, what,
                          (long long)ignore);
        return gl_error("%s: %s[%lld] is %lld, expected 0 <= %s < %lld (%s)", fn, arg,
                        (long long)(o * it.inner + i), (long long)v, arg, (long long)limit, what);
      }
    }
  }
  return GL_OK;
}

/* the 1-D index idx as a view of `like`'s shape: idx[j] along dim, 0 strides elsewhere */
static gl_tensor expand_index(const gl_tensor *idx, const gl_tensor *like, int dim) {
  gl_tensor v = *idx;
  v.ndim = like->ndim; v.numel = like->numel;
  for (int d = 0; d < like->ndim; d++) { v.shape[d] = like->shape[d]; v.stride[d] = d == dim ? idx->stride[0] : 0; }
  return v;
}

static inline void copy_elem(char *dst, const char *src, int esz) {
  switch (esz) {
  case 1: *dst = *src; break;
  case 2: memcpy(dst, src, 2); break;
  case 4: memcpy(dst, src, 4); break;
  default: memcpy(dst, src, 8); break;
  }
}

/* out[pos, j] = x[pos, idx[pos, j]] along dim; idx has out's shape (any
   strides, 0 allowed); a byte copy, so any dtype */
static void gather_lines(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  int nd = out->ndim, esz = gl_dtype_size(x->dtype);
  int64_t L = out->shape[dim], npos = L ? out->numel / L : 0;
  const char *xb = (const char *)x->storage->data;
  char *ob = (char *)out->storage->data;
  int nt = gl_threads_for(npos, L);
  GL_PAR_FOR(nt, p, npos, 
    int64_t oo = walk_offset(out, out->shape, nd, dim, p), io = walk_offset(idx, out->shape, nd, dim, p);
    int64_t xo = walk_offset(x, out->shape, nd, dim, p);
    for (int64_t j = 0; j < L; j++) {
      int64_t id = load_id(idx, io + j * idx->stride[dim]);
      copy_elem(ob + (oo + j * out->stride[dim]) * esz, xb + (xo + id * x->stride[dim]) * esz, esz);
    }
  );
}

int cpu_embedding_forward(gl_tensor *out, const gl_tensor *table, const gl_tensor *ids) {
  GL_TRY(cpu_check_ids("gl_embedding_forward", "ids", ids, table->shape[0], "rows of table", 0, 0));
  int nd = ids->ndim, esz = gl_dtype_size(table->dtype);
  int64_t C = table->shape[1], n = ids->numel, tcs = table->stride[1], ocs = out->stride[nd];
  const char *tb = (const char *)table->storage->data;
  char *ob = (char *)out->storage->data;
  int nt = gl_threads_for(n, C);
  GL_PAR_FOR(nt, r, n, 
    int64_t id = load_id(ids, walk_offset(ids, ids->shape, nd, -1, r));
    const char *src = tb + (table->offset + id * table->stride[0]) * esz;
    char *dst = ob + walk_offset(out, out->shape, nd, -1, r) * esz;
    if (tcs == 1 && ocs == 1) memcpy(dst, src, (size_t)(C * esz));
    else for (int64_t c = 0; c < C; c++) copy_elem(dst + c * ocs * esz, src + c * tcs * esz, esz);
  );
  return GL_OK;
}
int cpu_embedding_backward(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids) {
  GL_TRY(cpu_check_ids("gl_embedding_backward", "ids", ids, dtable->shape[0], "rows of dtable", 0, 0));
  return CPU_CALL(cpu_wide(dtable), embedding_backward, dtable, dout, ids);
}

int cpu_index_select(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  GL_TRY(cpu_check_ids("gl_index_select", "idx", idx, x->shape[dim], "size of x in dim", 0, 0));
  gl_tensor full = expand_index(idx, out, dim);
  gather_lines(out, x, dim, &full);
  return GL_OK;
}
int cpu_gather(gl_tensor *out, const gl_tensor *x, int dim, const gl_tensor *idx) {
  GL_TRY(cpu_check_ids("gl_gather", "idx", idx, x->shape[dim], "size of x in dim", 0, 0));
  gather_lines(out, x, dim, idx);
  return GL_OK;
}
int cpu_scatter_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  GL_TRY(cpu_check_ids("gl_scatter_add", "idx", idx, out->shape[dim], "size of out in dim", 0, 0));
  CPU_CALL(cpu_wide(out) || cpu_wide(src), scatter_lines, out, dim, idx, src);
  return GL_OK;
}
int cpu_index_add(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  GL_TRY(cpu_check_ids("gl_index_add", "idx", idx, out->shape[dim], "size of out in dim", 0, 0));
  gl_tensor full = expand_index(idx, src, dim);
  CPU_CALL(cpu_wide(out) || cpu_wide(src), scatter_lines, out, dim, &full, src);
  return GL_OK;
}

#else /* ---- generic section: real is float or double, R(name) its suffix ---- */
#include "row_access.h"

/* ---- embedding backward ---------------------------------------------------
   dtable[v] = sum of dout rows r with ids[r] == v.  The rows of each v are
   found through a counting sort of ids (CSR, slot 1), so every table row is
   summed by one thread in row order: no races, deterministic, one rounding
   per output even for bfloat16. */
static int R(embedding_backward)(gl_tensor *dtable, const gl_tensor *dout, const gl_tensor *ids) {
  int nd = ids->ndim;
  int64_t V = dtable->shape[0], C = dtable->shape[1], n = ids->numel, bs;
  int64_t *start = (int64_t *)cpu_scratch(1, (size_t)(2 * V + 1 + n) * sizeof(int64_t));
  if (!start) return OOM("gl_embedding_backward", "the id index");
  int64_t *fill = start + V + 1, *order = fill + V;
  memset(start, 0, (size_t)(V + 1) * sizeof *start);
  for (int64_t r = 0; r < n; r++) start[load_id(ids, walk_offset(ids, ids->shape, nd, -1, r)) + 1]++;
  for (int64_t v = 0; v < V; v++) { start[v + 1] += start[v]; fill[v] = start[v]; }
  for (int64_t r = 0; r < n; r++) order[fill[load_id(ids, walk_offset(ids, ids->shape, nd, -1, r))]++] = r;
  int nt = gl_threads_for(V, C + C * n / (V ? V : 1));
  real *ws = R(thread_blocks)(nt, 2 * C, &bs);
  if (!ws) return OOM("gl_embedding_backward", "row buffers");
  GL_PAR_FOR(nt, v, V, 
    real *acc = ws + gl_thread_id() * bs, *rb = acc + C;
    for (int64_t c = 0; c < C; c++) acc[c] = 0;
    for (int64_t k = start[v]; k < start[v + 1]; k++) {
      const real *row = R(cpu_span_load)(dout, walk_offset(dout, dout->shape, nd, -1, order[k]), dout->stride[nd], C, rb);
      for (int64_t c = 0; c < C; c++) acc[c] += row[c];
    }
    R(cpu_span_store)(dtable, dtable->offset + v * dtable->stride[0], dtable->stride[1], C, acc);
  );
  return GL_OK;
}

/* ---- scatter_add / index_add ---------------------------------------------
   out[pos, idx[pos, j]] += src[pos, j] along dim; idx has src's shape. */
static void R(scatter_lines)(gl_tensor *out, int dim, const gl_tensor *idx, const gl_tensor *src) {
  int nd = src->ndim;
  int64_t L = src->shape[dim], npos = L ? src->numel / L : 0;
  int nt = gl_threads_for(npos, L);
  GL_PAR_FOR(nt, p, npos, 
    int64_t oo = walk_offset(out, src->shape, nd, dim, p), io = walk_offset(idx, src->shape, nd, dim, p);
    int64_t so = walk_offset(src, src->shape, nd, dim, p);
    for (int64_t j = 0; j < L; j++) {
      int64_t e = oo + load_id(idx, io + j * idx->stride[dim]) * out->stride[dim];
      R(st)(out, e, R(ld)(out, e) + R(ld)(src, so + j * src->stride[dim]));
    }
  );
}

#undef OOM
#undef real
#undef RDT
#undef R
#endif
