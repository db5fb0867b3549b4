/* cublaslt_misuse.cu — the simulator's cuBLASLt (spec/cudasim/cublaslt*.cpp)
 * misused, called from spec/sim_cublaslt_spec.lua through LuaJIT's ffi
 * (build/sim/libgptlua_simtest.so); cublaslt.cu checks its products.
 *
 *  gl_simtest_lt_refusal   a named misuse -> the status it returned and the
 *                          simulator's message.
 *  gl_simtest_lt_attributes  Get/Set round trips and size queries.
 *  gl_simtest_lt_fault     a named fault that the work detects (sticky
 *                          error): the cudaError the stream reports. */
#include "simtest.h"
#include <cublasLt.h>
#include <stdint.h>
#include <string.h>

extern "C" {
int gl_simtest_lt_refusal(const char *name, char *msg, int cap);
int gl_simtest_lt_attributes(char *msg, int cap);
int gl_simtest_lt_fault(const char *name);
}

/* ---- refusals ------------------------------------------------------------------ */
/* A small valid fp32 problem (D 6 x 5 = op(A) 6 x 4 . op(B) 4 x 5) to break one
   piece of at a time. */
struct Small {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  void *A = nullptr, *B = nullptr, *C = nullptr, *ws = nullptr;
  float alpha = 1, beta = 0;
  size_t ws_bytes = 1 << 16;
  explicit Small(int type = CUDA_R_32F, cublasComputeType_t ct = CUBLAS_COMPUTE_32F) {
    cublasLtCreate(&h);
    cublasLtMatmulDescCreate(&desc, ct, ct == CUBLAS_COMPUTE_64F ? CUDA_R_64F : CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&la, (cudaDataType)type, 6, 4, 6);
    cublasLtMatrixLayoutCreate(&lb, (cudaDataType)type, 4, 5, 4);
    cublasLtMatrixLayoutCreate(&lc, (cudaDataType)type, 6, 5, 6);
    cublasLtMatrixLayoutCreate(&ld, (cudaDataType)type, 6, 5, 6);
    cublasLtMatmulPreferenceCreate(&pref);
    uint64_t w = ws_bytes;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w);
    cudaMalloc(&A, 4096);
    cudaMalloc(&B, 4096);
    cudaMalloc(&C, 4096);
    cudaMalloc(&ws, ws_bytes);
    memset(&res, 0, sizeof res);
  }
  cublasStatus_t heuristic() { return cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, ld, pref, 1, &res, &found); }
  cublasStatus_t matmul(const void *a, const void *b, size_t wsb) {
    return cublasLtMatmul(h, desc, &alpha, a, la, b, lb, &beta, C, lc, C, ld, &res.algo, ws, wsb, 0);
  }
  cublasStatus_t matmul() { return matmul(A, B, ws_bytes); }
  ~Small() {
    cudaDeviceSynchronize();
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
    if (h) cublasLtDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(ws);
  }
};

template <class V> static void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, V v) {
  cublasLtMatmulDescSetAttribute(d, a, &v, sizeof v);
}
template <class V> static void set_layout(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t a, V v) {
  cublasLtMatrixLayoutSetAttribute(l, a, &v, sizeof v);
}

/* Runs the misuse `name`; returns the status of the refusing call (-1: no
   such scenario) and copies the simulator's message to msg. */
extern "C" int gl_simtest_lt_refusal(const char *name, char *msg, int cap) {
  int st = -1;
  std::string nm(name);
  if (nm == "null_handle") {
    Small s;
    st = cublasLtMatmulAlgoGetHeuristic(NULL, s.desc, s.la, s.lb, s.lc, s.ld, s.pref, 1, &s.res, &s.found);
  } else if (nm == "destroyed_handle") {
    Small s;
    s.heuristic();
    cublasLtDestroy(s.h);
    cublasLtHandle_t dead = s.h;
    s.h = nullptr;
    st = cublasLtMatmul(dead, s.desc, &s.alpha, s.A, s.la, s.B, s.lb, &s.beta, s.C, s.lc, s.C, s.ld, &s.res.algo, s.ws,
                        s.ws_bytes, 0);
  } else if (nm == "null_desc") {
    Small s;
    st = cublasLtMatmulAlgoGetHeuristic(s.h, NULL, s.la, s.lb, s.lc, s.ld, s.pref, 1, &s.res, &s.found);
  } else if (nm == "destroyed_layout") {
    Small s;
    cublasLtMatrixLayoutDestroy(s.lb);
    cublasLtMatrixLayout_t dead = s.lb;
    s.lb = nullptr;
    st = cublasLtMatmulAlgoGetHeuristic(s.h, s.desc, s.la, dead, s.lc, s.ld, s.pref, 1, &s.res, &s.found);
  } else if (nm == "set_size") {
    Small s;
    int64_t op = CUBLAS_OP_T;  /* TRANSA is int32_t */
    st = cublasLtMatmulDescSetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof op);
  } else if (nm == "get_size") {
    Small s;
    uint32_t rows;  /* ROWS is uint64_t */
    st = cublasLtMatrixLayoutGetAttribute(s.la, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows, NULL);
  } else if (nm == "pref_size") {
    Small s;
    uint32_t w = 1024;  /* MAX_WORKSPACE_BYTES is uint64_t */
    st = cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof w);
  } else if (nm == "bad_trans") {
    Small s;
    int32_t op = 7;
    st = cublasLtMatmulDescSetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof op);
  } else if (nm == "unknown_attr") {
    Small s;
    int32_t v = 0;  /* 6: CUBLASLT_MATMUL_DESC_FILL_MODE, not simulated */
    st = cublasLtMatmulDescSetAttribute(s.desc, (cublasLtMatmulDescAttributes_t)6, &v, sizeof v);
  } else if (nm == "dims") {
    Small s;
    set_layout(s.lb, CUBLASLT_MATRIX_LAYOUT_ROWS, (uint64_t)3);  /* k 4 vs 3 */
    st = s.heuristic();
  } else if (nm == "dims_trans") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, (int32_t)CUBLAS_OP_T);  /* op(A) becomes 4 x 6 */
    st = s.heuristic();
  } else if (nm == "ld_small") {
    Small s;
    set_layout(s.la, CUBLASLT_MATRIX_LAYOUT_LD, (int64_t)5);
    st = s.heuristic();
  } else if (nm == "batch_mismatch") {
    Small s;
    set_layout(s.la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, (int32_t)2);
    st = s.heuristic();
  } else if (nm == "types_mixed") {
    Small s(CUDA_R_16BF);
    set_layout(s.lc, CUBLASLT_MATRIX_LAYOUT_TYPE, (uint32_t)CUDA_R_16F);
    set_layout(s.ld, CUBLASLT_MATRIX_LAYOUT_TYPE, (uint32_t)CUDA_R_16F);
    st = s.heuristic();
  } else if (nm == "types_ab") {
    Small s(CUDA_R_16BF);
    set_layout(s.lb, CUBLASLT_MATRIX_LAYOUT_TYPE, (uint32_t)CUDA_R_16F);
    st = s.heuristic();
  } else if (nm == "f64_with_32f_compute") {
    Small s(CUDA_R_64F);
    st = s.heuristic();
  } else if (nm == "f32_with_64f_compute") {
    Small s(CUDA_R_32F, CUBLAS_COMPUTE_64F);
    st = s.heuristic();
  } else if (nm == "compute_16f") {
    Small s(CUDA_R_16F, CUBLAS_COMPUTE_16F);
    st = s.heuristic();
  } else if (nm == "fast_bf16_inputs") {
    Small s(CUDA_R_16BF, CUBLAS_COMPUTE_32F_FAST_TF32);
    st = s.heuristic();
  } else if (nm == "scale_type") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_SCALE_TYPE, (int32_t)CUDA_R_64F);
    st = s.heuristic();
  } else if (nm == "order_row") {
    Small s;
    set_layout(s.la, CUBLASLT_MATRIX_LAYOUT_ORDER, (int32_t)CUBLASLT_ORDER_ROW);
    st = s.heuristic();
  } else if (nm == "pointer_mode") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, (int32_t)CUBLASLT_POINTER_MODE_DEVICE);
    st = s.heuristic();
  } else if (nm == "requested_zero") {
    Small s;
    st = cublasLtMatmulAlgoGetHeuristic(s.h, s.desc, s.la, s.lb, s.lc, s.ld, s.pref, 0, &s.res, &s.found);
  } else if (nm == "align_promise") {
    Small s;
    uint32_t a = 2;  /* fp32 elements need 4 */
    cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a, sizeof a);
    st = s.heuristic();
  } else if (nm == "workspace_small") {
    Small s;
    s.heuristic();
    st = s.matmul(s.A, s.B, s.ws_bytes / 2);
  } else if (nm == "workspace_null") {
    Small s;
    s.heuristic();
    st = cublasLtMatmul(s.h, s.desc, &s.alpha, s.A, s.la, s.B, s.lb, &s.beta, s.C, s.lc, s.C, s.ld, &s.res.algo, NULL,
                        s.ws_bytes, 0);
  } else if (nm == "misaligned_a") {
    Small s;
    s.heuristic();  /* default promise 256 -> the algorithm assumes 16 for A (ld 6 * 4 = 24 bytes: 8) */
    st = s.matmul((const char *)s.A + 4, s.B, s.ws_bytes);
  } else if (nm == "epilogue_64f") {
    Small s(CUDA_R_64F, CUBLAS_COMPUTE_64F);
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_GELU);
    st = s.heuristic();
  } else if (nm == "epilogue_relu_aux") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_RELU_AUX);
    st = s.heuristic();
  } else if (nm == "epilogue_unknown") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)3);
    st = s.heuristic();
  } else if (nm == "bias_type") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_BIAS);
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, (int32_t)CUDA_R_16BF);
    st = s.heuristic();
  } else if (nm == "bias_null") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_BIAS);
    s.heuristic();
    st = s.matmul();
  } else if (nm == "aux_ld") {
    Small s;
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_GELU_AUX);
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, (int64_t)12);
    st = s.heuristic();
  } else if (nm == "bgrad_batch_stride") {
    Small s;
    for (cublasLtMatrixLayout_t l : {s.la, s.lb, s.lc, s.ld}) {
      set_layout(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, (int32_t)2);
      set_layout(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, (int64_t)64);
    }
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_BGRADB);
    st = s.heuristic();  /* BIAS_BATCH_STRIDE 0: both batches write one vector */
  } else if (nm == "d_overlap") {
    Small s;
    for (cublasLtMatrixLayout_t l : {s.la, s.lb, s.lc, s.ld}) {
      set_layout(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, (int32_t)3);
      set_layout(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, (int64_t)64);
    }
    set_layout(s.ld, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, (int64_t)12);  /* D spans 30 elements */
    st = s.heuristic();
  } else if (nm == "inplace_layout") {
    Small s;
    s.heuristic();
    set_layout(s.lc, CUBLASLT_MATRIX_LAYOUT_LD, (int64_t)8);
    st = s.matmul();
  } else if (nm == "algo_foreign") {
    Small s;
    s.heuristic();
    memset(&s.res.algo, 0, sizeof s.res.algo);
    st = s.matmul();
  } else if (nm == "algo_other_types") {
    Small s;
    s.heuristic();
    Small t(CUDA_R_64F, CUBLAS_COMPUTE_64F);
    double one = 1, zero = 0;
    st = cublasLtMatmul(t.h, t.desc, &one, t.A, t.la, t.B, t.lb, &zero, t.C, t.lc, t.C, t.ld, &s.res.algo, t.ws,
                        t.ws_bytes, 0);
  } else if (nm == "alpha_null") {
    Small s;
    s.heuristic();
    st = cublasLtMatmul(s.h, s.desc, NULL, s.A, s.la, s.B, s.lb, &s.beta, s.C, s.lc, s.C, s.ld, &s.res.algo, s.ws,
                        s.ws_bytes, 0);
  } else if (nm == "c_null_with_beta") {
    Small s;
    s.heuristic();
    s.beta = 1;
    st = cublasLtMatmul(s.h, s.desc, &s.alpha, s.A, s.la, s.B, s.lb, &s.beta, NULL, s.lc, s.C, s.ld, &s.res.algo,
                        s.ws, s.ws_bytes, 0);
  }
  snprintf(msg, (size_t)cap, "%s", gl_sim_cublaslt_last_message());
  return st;
}

/* ---- attributes ---------------------------------------------------------------- */
extern "C" int gl_simtest_lt_attributes(char *msg, int cap) {
#define CHECK(cond, ...) do { if (!(cond)) { snprintf(msg, (size_t)cap, __VA_ARGS__); return 1; } } while (0)
  Small s;
  size_t written = 0;
  /* size queries */
  CHECK(cublasLtMatrixLayoutGetAttribute(s.la, CUBLASLT_MATRIX_LAYOUT_ROWS, NULL, 0, &written) == 0 && written == 8,
        "ROWS size query: %zu", written);
  CHECK(cublasLtMatmulDescGetAttribute(s.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, NULL, 0, &written) == 0 &&
            written == sizeof(void *),
        "BIAS_POINTER size query: %zu", written);
  CHECK(cublasLtMatmulPreferenceGetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, NULL, 0, &written) == 0 &&
            written == 4,
        "MIN_ALIGNMENT_C size query: %zu", written);
  CHECK(cublasLtMatrixLayoutGetAttribute(s.la, CUBLASLT_MATRIX_LAYOUT_ROWS, NULL, 0, NULL) == CUBLAS_STATUS_INVALID_VALUE,
        "size query without sizeWritten accepted");
  /* defaults */
  int32_t i32 = -5;
  uint32_t u32 = 0;
  int64_t i64 = -5;
  uint64_t u64 = 0;
  cublasLtMatmulDescGetAttribute(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &u32, 4, &written);
  CHECK(u32 == CUBLASLT_EPILOGUE_DEFAULT && written == 4, "default epilogue %u", u32);
  cublasLtMatmulDescGetAttribute(s.desc, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &i32, 4, NULL);
  CHECK(i32 == CUBLAS_COMPUTE_32F, "compute type %d", i32);
  cublasLtMatmulDescGetAttribute(s.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &i32, 4, NULL);
  CHECK(i32 == -1, "default bias type %d", i32);
  cublasLtMatrixLayoutGetAttribute(s.la, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &i32, 4, NULL);
  CHECK(i32 == 1, "default batch count %d", i32);
  cublasLtMatrixLayoutGetAttribute(s.la, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &i64, 8, NULL);
  CHECK(i64 == 0, "default batch stride %lld", (long long)i64);
  cublasLtMatrixLayoutGetAttribute(s.lb, CUBLASLT_MATRIX_LAYOUT_TYPE, &u32, 4, NULL);
  CHECK(u32 == CUDA_R_32F, "layout type %u", u32);
  cublasLtMatrixLayoutGetAttribute(s.lb, CUBLASLT_MATRIX_LAYOUT_COLS, &u64, 8, NULL);
  CHECK(u64 == 5, "cols %llu", (unsigned long long)u64);
  cublasLtMatmulPreferenceGetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &u32, 4, NULL);
  CHECK(u32 == 256, "default alignment %u", u32);
  /* round trips */
  set_desc(s.desc, CUBLASLT_MATMUL_DESC_TRANSB, (int32_t)CUBLAS_OP_T);
  cublasLtMatmulDescGetAttribute(s.desc, CUBLASLT_MATMUL_DESC_TRANSB, &i32, 4, NULL);
  CHECK(i32 == CUBLAS_OP_T, "TRANSB %d", i32);
  set_desc(s.desc, CUBLASLT_MATMUL_DESC_TRANSB, (int32_t)CUBLAS_OP_N);
  void *p = (void *)0x1230, *q = nullptr;
  set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, p);
  cublasLtMatmulDescGetAttribute(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &q, sizeof q, NULL);
  CHECK(q == p, "aux pointer %p", q);
  set_layout(s.lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, (int64_t)1 << 40);
  cublasLtMatrixLayoutGetAttribute(s.lc, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &i64, 8, NULL);
  CHECK(i64 == (int64_t)1 << 40, "batch stride %lld", (long long)i64);
  uint64_t w = 12345;
  cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, 8);
  cublasLtMatmulPreferenceGetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &u64, 8, NULL);
  CHECK(u64 == 12345, "workspace %llu", (unsigned long long)u64);
  /* the heuristic's workspace: what the preference allows, at most 4 MiB */
  CHECK(s.heuristic() == 0 && s.found == 1 && s.res.workspaceSize == 12345 && s.res.state == 0,
        "heuristic workspace %zu", s.res.workspaceSize);
  w = 64ull << 20;
  cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, 8);
  CHECK(s.heuristic() == 0 && s.res.workspaceSize == 4u << 20, "capped workspace %zu", s.res.workspaceSize);
  /* names and strings */
  CHECK(strcmp(cublasLtGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED") == 0, "status name");
  CHECK(strcmp(cublasLtGetStatusString(CUBLAS_STATUS_INVALID_VALUE),
               "an invalid numeric value was used as an argument") == 0,
        "status string");
  CHECK(CUBLAS_COMPUTE_32F_FAST_TF32 == 77 && CUBLASLT_EPILOGUE_GELU_AUX_BIAS == 164 &&
            CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE == 26 && CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES == 8,
        "enum values");
  snprintf(msg, (size_t)cap, "ok");
  return 0;
#undef CHECK
}

/* ---- faults in the work (sticky errors) -------------------------------------- */
/* Queues the faulting product `name` and returns the error the stream
   reports (cudaErrorIllegalAddress, cudaErrorMisalignedAddress); -1: no
   such scenario.  Leaves the context with a sticky error: run it in a
   process of its own. */
extern "C" int gl_simtest_lt_fault(const char *name) {
  std::string nm(name);
  Small s;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  static float host_b[64] __attribute__((aligned(256)));
  if (nm == "a_overrun") {
    /* A 6 x 4 with ld 400: its last column starts 1200 floats in, past the 4096-byte allocation */
    set_layout(s.la, CUBLASLT_MATRIX_LAYOUT_LD, (int64_t)400);
    s.heuristic();
    st = s.matmul();
  } else if (nm == "host_b") {
    s.heuristic();
    st = s.matmul(s.A, host_b, s.ws_bytes);
  } else if (nm == "bias_misaligned") {
    void *bias = nullptr;
    cudaMalloc(&bias, 256);
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)CUBLASLT_EPILOGUE_BIAS);
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    s.heuristic();  /* chosen for a 16-byte aligned bias */
    set_desc(s.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, (void *)((char *)bias + 4));
    st = s.matmul();
  } else if (nm == "workspace_host") {
    static char host_ws[1 << 16] __attribute__((aligned(256)));
    s.heuristic();
    st = cublasLtMatmul(s.h, s.desc, &s.alpha, s.A, s.la, s.B, s.lb, &s.beta, s.C, s.lc, s.C, s.ld, &s.res.algo,
                        host_ws, s.ws_bytes, 0);
  } else {
    return -1;
  }
  if (st != CUBLAS_STATUS_SUCCESS) return 1000 + (int)st;  /* refused at the call: not a fault */
  return (int)cudaDeviceSynchronize();
}
