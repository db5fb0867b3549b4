/* ops_step.c — the step block's entry points (gl_ops.h, "The step block"):
 * its copy between pinned host memory and the device, the gradient's sum of
 * squares into it, the step's norm / clip / skip from it, and AdamW with
 * its rates read from it.  Validation here (as ops.c), then dispatch to
 * engine/cpu/optim.c or kernels/optim.cu, kernels/reduce.cu.  What a
 * captured step reads from the block is what the host wrote before this
 * step's replay, which is how the optimizer can live inside a CUDA graph
 * (lua/gptlua/train_graph.lua). */
#include "ops_check.h"

/* block: a contiguous float64 tensor of at least GL_STEP_HEADER slots */
static int check_block(const char *fn, const gl_tensor *block, int out) {
  GL_TRY(check_args(fn, ARGS({block, "block", out ? A_OUT : A_IN})));
  GL_TRY(check_dtype(block, fn, "block", GL_F64, "the step block"));
  if (!gl_is_contiguous(block)) return gl_error("%s: block is not contiguous, expected a contiguous float64 tensor", fn);
  if (block->numel < GL_STEP_HEADER)
    return gl_error("%s: block has %lld elements, expected at least %d (GL_STEP_HEADER)", fn, (long long)block->numel,
                    GL_STEP_HEADER);
  return GL_OK;
}

/* [at, at + n) must be slots of the block past its header */
static int check_slots(const char *fn, const char *what, const gl_tensor *block, int64_t at, int64_t n) {
  if (at < GL_STEP_HEADER || n < 0 || at > block->numel - n)
    return gl_error("%s: %s is %lld, expected %d <= %s <= %lld (%lld slots in a block of %lld)", fn, what,
                    (long long)at, GL_STEP_HEADER, what, (long long)(block->numel - n), (long long)n,
                    (long long)block->numel);
  return GL_OK;
}

int gl_step_block_copy(gl_tensor *dst, const gl_tensor *src) {
  const char *fn = "gl_step_block_copy";
  GL_CHECK_T(dst, fn, "dst");
  GL_CHECK_T(src, fn, "src");
  GL_TRY(gl_check_no_zero_stride(dst, fn, "dst"));
  GL_TRY(check_dtype(dst, fn, "dst", GL_F64, "the step block"));
  GL_TRY(check_dtype(src, fn, "src", GL_F64, "the step block"));
  if (!gl_is_contiguous(dst) || !gl_is_contiguous(src))
    return gl_error("%s: %s is not contiguous, expected contiguous step blocks", fn, gl_is_contiguous(dst) ? "src" : "dst");
  if (dst->numel != src->numel)
    return gl_error("%s: src has %lld elements, expected %lld (the numel of dst)", fn, (long long)src->numel,
                    (long long)dst->numel);
  const gl_tensor *host = dst->device < 0 ? dst : src, *dev = dst->device < 0 ? src : dst;
  if (dev->device < 0) return gl_backend_of(-1)->step_block_copy(dst, src);  /* both on the CPU */
  if (host->device >= 0)
    return gl_error("%s: dst is on cuda:%d and src on cuda:%d, expected one of them in pinned host memory", fn,
                    dst->device, src->device);
  if (host->storage->external != 2)
    return gl_error("%s: %s is in pageable host memory, expected pinned memory (gl_empty_pinned): a copy from "
                    "pageable memory makes the host wait and cannot be captured", fn, host == dst ? "dst" : "src");
  return gl_backend_of(dev->device)->step_block_copy(dst, src);
}

int gl_step_sumsq(gl_tensor *block, int n, const gl_tensor **xs) {
  const char *fn = "gl_step_sumsq";
  if (n < 0) return gl_error("%s: n is %d, expected >= 0", fn, n);
  if (n > 0 && !xs) return gl_error("%s: xs is NULL, expected an array of %d tensors", fn, n);
  GL_TRY(check_block(fn, block, 1));
  for (int i = 0; i < n; i++) {
    char name[32];
    snprintf(name, sizeof name, "xs[%d]", i);
    GL_TRY(check_args(fn, ARGS({block, "block", A_IN}, {xs[i], name, A_IN})));
  }
  return gl_backend_of(block->device)->step_sumsq(block, n, xs);
}

int gl_step_finalize(gl_tensor *block, int64_t loss_at, int nloss) {
  const char *fn = "gl_step_finalize";
  GL_TRY(check_block(fn, block, 1));
  if (nloss < 1) return gl_error("%s: nloss is %d, expected >= 1 (the step's micro-step losses)", fn, nloss);
  GL_TRY(check_slots(fn, "loss_at", block, loss_at, nloss));
  return gl_backend_of(block->device)->step_finalize(block, loss_at, nloss);
}

int gl_adamw_update_block(int n, gl_tensor **params, const gl_tensor **grads, gl_tensor **ms, gl_tensor **vs,
                          gl_tensor **outs, const gl_tensor *block, const int64_t *slots) {
  const char *fn = "gl_adamw_update_block";
  if (n < 0) return gl_error("%s: n is %d, expected >= 0", fn, n);
  const void *arrays[5] = {params, grads, ms, vs, slots};
  const char *array_names[5] = {"params", "grads", "ms", "vs", "slots"};
  for (int k = 0; k < 5 && n > 0; k++)
    if (!arrays[k]) return gl_error("%s: %s is NULL, expected an array of %d", fn, array_names[k], n);
  GL_TRY(check_block(fn, block, 0));
  if (n == 0) return GL_OK;
  for (int i = 0; i < n; i++) {
    char np[32], ng[32], nm[32], nv[32], no[32], ns[32];
    snprintf(np, sizeof np, "params[%d]", i); snprintf(ng, sizeof ng, "grads[%d]", i);
    snprintf(nm, sizeof nm, "ms[%d]", i); snprintf(nv, sizeof nv, "vs[%d]", i);
    snprintf(no, sizeof no, "outs[%d]", i); snprintf(ns, sizeof ns, "slots[%d]", i);
    const gl_tensor *o = outs ? outs[i] : NULL;
    GL_TRY(check_args(fn, ARGS({block, "block", A_IN}, {params[i], np, A_OUT}, {grads[i], ng, A_FLOAT},
                               {ms[i], nm, A_OUT}, {vs[i], nv, A_OUT}, {o, no, A_OUT | A_OPT | A_FLOAT})));
    GL_TRY(check_dtype(params[i], fn, np, GL_F32, "the step block's AdamW updates float32 masters"));
    GL_TRY(check_dtype(ms[i], fn, nm, GL_F32, "AdamW's state"));
    GL_TRY(check_dtype(vs[i], fn, nv, GL_F32, "AdamW's state"));
    if (grads[i]->dtype != GL_F32 && grads[i]->dtype != GL_BF16)
      return gl_error("%s: %s has dtype %s, expected float32 or bfloat16", fn, ng, gl_dtype_name(grads[i]->dtype));
    if (o && o->dtype != GL_F32 && o->dtype != GL_BF16)
      return gl_error("%s: %s has dtype %s, expected float32 or bfloat16", fn, no, gl_dtype_name(o->dtype));
    const gl_tensor *ts[5] = {params[i], grads[i], ms[i], vs[i], o};
    const char *names[5] = {np, ng, nm, nv, no};
    for (int k = 0; k < 5; k++) {
      if (!ts[k]) continue;
      if (!gl_is_contiguous(ts[k])) return gl_error("%s: %s is not contiguous, expected a contiguous tensor", fn, names[k]);
      if (ts[k]->numel != params[i]->numel)
        return gl_error("%s: %s has %lld elements, expected %lld (the numel of %s)", fn, names[k],
                        (long long)ts[k]->numel, (long long)params[i]->numel, np);
    }
    GL_TRY(check_slots(fn, ns, block, slots[i], GL_STEP_ADAMW_SLOTS));
  }
  return gl_backend_of(block->device)->adamw_update_block(n, params, grads, ms, vs, outs, block, slots);
}

/* t: a contiguous tensor of dtype (or float32 / bfloat16 when dtype < 0) and numel n */
static int check_flat(const char *fn, const char *name, const gl_tensor *t, int dtype, int64_t n, const char *of) {
  if (dtype >= 0) GL_TRY(check_dtype(t, fn, name, dtype, NULL));
  else if (t->dtype != GL_F32 && t->dtype != GL_BF16)
    return gl_error("%s: %s has dtype %s, expected float32 or bfloat16", fn, name, gl_dtype_name(t->dtype));
  if (!gl_is_contiguous(t)) return gl_error("%s: %s is not contiguous, expected a contiguous tensor", fn, name);
  if (t->numel != n)
    return gl_error("%s: %s has %lld elements, expected %lld (the numel of %s)", fn, name, (long long)t->numel,
                    (long long)n, of);
  return GL_OK;
}

int gl_momentum_update_block(gl_tensor *out, gl_tensor *buf, const gl_tensor *grad, const gl_tensor *block,
                             int64_t slot, int nesterov) {
  const char *fn = "gl_momentum_update_block";
  GL_TRY(check_args(fn, ARGS({block, "block", A_IN}, {out, "out", A_OUT}, {buf, "buf", A_OUT}, {grad, "grad", A_FLOAT})));
  GL_TRY(check_block(fn, block, 0));
  GL_TRY(check_flat(fn, "buf", buf, GL_F32, buf->numel, "buf"));
  GL_TRY(check_flat(fn, "out", out, GL_F32, buf->numel, "buf"));
  GL_TRY(check_flat(fn, "grad", grad, -1, buf->numel, "buf"));
  GL_TRY(check_slots(fn, "slot", block, slot, 2));
  if (buf->numel == 0) return GL_OK;
  return gl_backend_of(block->device)->momentum_update_block(out, buf, grad, block, slot, nesterov != 0);
}

int gl_axpy_block(gl_tensor *y, const gl_tensor *x, const gl_tensor *block, int64_t slot) {
  const char *fn = "gl_axpy_block";
  GL_TRY(check_args(fn, ARGS({block, "block", A_IN}, {y, "y", A_OUT}, {x, "x", A_IN})));
  GL_TRY(check_block(fn, block, 0));
  GL_TRY(check_flat(fn, "y", y, GL_F32, y->numel, "y"));
  GL_TRY(check_flat(fn, "x", x, GL_F32, y->numel, "y"));
  GL_TRY(check_slots(fn, "slot", block, slot, 1));
  if (y->numel == 0) return GL_OK;
  return gl_backend_of(block->device)->axpy_block(y, x, block, slot);
}
