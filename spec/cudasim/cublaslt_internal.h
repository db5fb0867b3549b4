/* cublaslt_internal.h — what the simulator's cuBLASLt files share; private
 * to them (nothing outside spec/cudasim/cublaslt*.cpp includes it).
 *
 * The simulated cuBLASLt (cublasLt.h's functions, over OpenBLAS) is three
 * files, in the order a caller meets them:
 *   cublaslt.cpp            the objects: handles, matmul descriptors, matrix
 *                           layouts, preferences and their attribute tables;
 *                           status, type and epilogue names; refusals and
 *                           gl_sim_cublaslt_last_message.  Its header comment
 *                           says how the calls map onto the real library and
 *                           every choice the simulator makes where it leaves room.
 *   cublaslt_heuristic.cpp  the problem's validation (make_problem, shared by
 *                           the heuristic and the matmul), what an algorithm
 *                           records, cublasLtMatmulAlgoGetHeuristic
 *   cublaslt_matmul.cpp     cublasLtMatmul: the host-side checks, then the
 *                           stream work: extent and alignment checks, the bit-
 *                           level conversions, OpenBLAS, the epilogues
 * The object structs are global (cublasLt.h names them in its opaque
 * typedefs); everything else here is in namespace gl_sim_lt, so that these
 * generic names (Mat, Problem, refuse) stay out of the rest of libgptlua.so. */
#ifndef GL_SIM_CUBLASLT_INTERNAL_H
#define GL_SIM_CUBLASLT_INTERNAL_H
#include <stddef.h>
#include <stdint.h>
#include "cublasLt.h"
#include "sim.h"

/* ---- objects (cublaslt.cpp) ------------------------------------------------ */
struct cublasLtContext {
  int unused;  /* a handle carries no state: the stream comes with each call */
};
struct gl_sim_lt_matmul_desc {
  int32_t compute, scale, pointer_mode, transa, transb, transc;
  uint32_t epilogue;
  const void *bias;
  int64_t bias_stride;
  void *aux;
  int64_t aux_ld, aux_stride;
  int32_t aux_type, bias_type;
  const void *a_scale, *b_scale;  /* FP8: device floats multiplying op(A) op(B) */
};
struct gl_sim_lt_layout {
  uint32_t type;
  int32_t order;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch;
  int64_t stride;
};
struct gl_sim_lt_preference {
  uint64_t max_workspace;
  uint32_t align[4];  /* A, B, C, D */
};

namespace gl_sim_lt {

/* Records and prints why a call was refused; returns st. */
cublasStatus_t refuse(cublasStatus_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* names for messages */
const char *type_name(int t);
const char *compute_name(int c);
const char *epilogue_name(uint32_t e);  /* NULL: not a cublasLtEpilogue_t */
/* bytes per element of the floating types the simulator computes with; 0 otherwise */
int type_size(int t);

/* Live objects by address, so that a NULL, destroyed or foreign pointer is
   reported instead of dereferenced. */
enum ObjKind { OBJ_HANDLE = 1, OBJ_DESC, OBJ_LAYOUT, OBJ_PREF };
bool reg_is(const void *p, int kind);

/* handles: NULL or unknown -> NOT_INITIALIZED, as the real library */
#define CHECK_HANDLE(fn, h)                                                                   \
  do {                                                                                        \
    if (!reg_is((h), OBJ_HANDLE))                                                             \
      return refuse(CUBLAS_STATUS_NOT_INITIALIZED, "%s: handle %p is not a live cublasLtHandle_t", fn, (const void *)(h)); \
  } while (0)
#define CHECK_OBJ(fn, what, p, kind)                                                          \
  do {                                                                                        \
    if (!reg_is((p), (kind)))                                                                 \
      return refuse(CUBLAS_STATUS_INVALID_VALUE, "%s: %s %p is not a live descriptor", fn, what, (const void *)(p)); \
  } while (0)

/* ---- the problem (cublaslt_heuristic.cpp) ---------------------------------- */
enum { WORKSPACE_NEED = 4 << 20 };     /* what the simulated algorithm asks for, at most */
enum { MAX_VECTOR_ALIGN = 16 };        /* the widest load a kernel makes: 16 bytes */
enum { ROUND_NONE, ROUND_TF32, ROUND_BF16, ROUND_FP16 };  /* FAST modes' input rounding */

struct Mat {
  int type;
  int64_t rows, cols, ld, stride;
};

/* Everything a matmul needs, copied out of the descriptors. */
struct Problem {
  int compute, scale, f64, rounding;
  int ta, tb;
  int64_t m, n, k, batch;
  Mat a, b, c, d;
  uint32_t epilogue;
  /* what the epilogue does */
  int bias_in, relu, gelu, aux_out, dgelu, bgrad_rows, bgrada, bgradb;
  int bias_type, aux_type;
  int64_t bias_len, bias_stride, aux_ld, aux_stride;
  const void *bias;
  void *aux;
  int fp8;                        /* FP8 A and B (the TN problem) */
  const void *a_scale, *b_scale;  /* device floats, or NULL (1) */
};

/* the lowest set bit of v, at most cap (v == 0: cap) */
int64_t lowest_pow2(uint64_t v, int64_t cap);

/* Validates descriptor + layouts as the real library does (dimensions, lds,
   types, epilogue) and fills q.  Pointers and alignment are checked by the
   callers. */
cublasStatus_t make_problem(const char *fn, const gl_sim_lt_matmul_desc *dsc, const gl_sim_lt_layout *A,
                            const gl_sim_lt_layout *B, const gl_sim_lt_layout *C, const gl_sim_lt_layout *D,
                            Problem *q);

/* ---- the algorithm (cublaslt_heuristic.cpp) -------------------------------- */
/* What cublasLtMatmulAlgo_t carries in the simulator. */
struct SimAlgo {
  int atype, dtype, compute;
  uint32_t epilogue;
  uint32_t align[4];         /* bytes the A, B, C, D pointers must be aligned to */
  uint32_t bias_align, aux_align;
  uint64_t workspace;
};
/* false if a was not packed by the heuristic */
bool algo_unpack(const cublasLtMatmulAlgo_t *a, SimAlgo *s);

/* The alignment an algorithm may assume for matrix x given a promise (or a
   pointer's actual alignment): at most 16 bytes, and no more than its ld and
   batch stride keep for every column and batch. */
uint32_t matrix_align(uint64_t promise, const Mat &x, int64_t batch);

}  // namespace gl_sim_lt

#endif
