/* nccl_ops.cpp — the simulator's NCCL operations and groups: the
 * collectives and send / recv of spec/cudasim/nccl.h, their argument checks,
 * and running them as stream work over MPI.  The communicators they run on
 * are nccl_comm.cpp's; what the two share is in nccl_internal.h.
 *
 * How it works
 *  - A collective, or a whole group of operations, is one work item on the
 *    stream (gl_sim_submit).  The item copies every input from device
 *    memory into host buffers (MPI's shared-memory transport may read
 *    another process's pages, and the simulator keeps device pages
 *    protected), posts every transfer as a nonblocking MPI operation, polls
 *    them all to completion, then writes the results into device memory.
 *    Posting a group's operations together before waiting is what keeps
 *    grouped send/recv pairs and grouped uneven collectives deadlock-free.
 *    16-bit float reductions travel as float and are rounded once.
 *  - Operations of one communicator keep their call order across streams:
 *    each waits for an event recorded after the previous one.
 *  - Each queued work item holds a reference to its communicators (see
 *    nccl_comm.cpp), and gives up when one of them is aborted. */
#include <mpi.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <memory>
#include <string>
#include <vector>
#include "sim_types.h"
#include "runtime_api.h"
#include "sim.h"
#include "nccl.h"
#include "nccl_internal.h"

using namespace gl_sim_nccl;

namespace {

/* ---- 16-bit floats (bit-exact, round to nearest even) ------------------- */
float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
uint32_t float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

float bf16_to_float(uint16_t h) { return bits_to_float((uint32_t)h << 16); }
uint16_t float_to_bf16(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);   /* NaN stays a quiet NaN */
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

float f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {   /* zero or subnormal: mant * 2^-24, exact in float */
    float v = ldexpf((float)mant, -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}
uint16_t float_to_f16(float f) {
  uint32_t x = float_to_bits(f), ax = x & 0x7fffffffu;
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((ax >> 13) & 0x3ff));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  /* 65520 and up round to inf */
  if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal */
    float v = bits_to_float(ax) * 16777216.0f;              /* exact: in units of 2^-24 */
    return (uint16_t)(sign | (uint16_t)nearbyintf(v));      /* 1024 becomes the smallest normal */
  }
  uint32_t e = ax - 0x38000000u;                            /* rebias 127 -> 15 */
  return (uint16_t)(sign | ((e + 0xfffu + ((e >> 13) & 1)) >> 13));
}

/* ---- data types and ops ------------------------------------------------- */
size_t type_size(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: case ncclUint8: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  default: return 0;
  }
}
bool is_16bit_float(ncclDataType_t t) { return t == ncclFloat16 || t == ncclBfloat16; }

/* the type MPI reduces in: 16-bit floats as float */
MPI_Datatype reduce_type(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: return MPI_INT8_T;
  case ncclUint8: return MPI_UINT8_T;
  case ncclInt32: return MPI_INT32_T;
  case ncclUint32: return MPI_UINT32_T;
  case ncclInt64: return MPI_INT64_T;
  case ncclUint64: return MPI_UINT64_T;
  case ncclFloat64: return MPI_DOUBLE;
  default: return MPI_FLOAT;
  }
}
size_t reduce_size(ncclDataType_t t) { return is_16bit_float(t) ? 4 : type_size(t); }

MPI_Op mpi_op(ncclRedOp_t op) {
  switch (op) {
  case ncclProd: return MPI_PROD;
  case ncclMax: return MPI_MAX;
  case ncclMin: return MPI_MIN;
  default: return MPI_SUM;   /* sum, and avg before its division */
  }
}

/* ---- operations ----------------------------------------------------------- */

enum class Kind { AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, Send, Recv };

/* One call, as passed, plus its host buffers while it runs. */
struct Op {
  Kind kind;
  const char *name;
  ncclComm *comm;
  cudaStream_t stream;
  const char *send;       /* device memory, or NULL where this rank reads none */
  char *recv;             /* device memory, or NULL where this rank writes none */
  size_t count;           /* as in the call's signature */
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;               /* root, or the peer of send / recv */
  /* while running */
  void *in = nullptr, *out = nullptr;   /* host buffers (reduction type for reductions, else raw bytes) */
  MPI_Request req = MPI_REQUEST_NULL;
};

bool is_reduction(Kind k) { return k == Kind::AllReduce || k == Kind::ReduceScatter || k == Kind::Reduce; }

/* elements this rank reads from send / writes to recv (0: none) */
size_t in_elems(const Op &o) {
  switch (o.kind) {
  case Kind::ReduceScatter: return o.count * (size_t)o.comm->nranks;
  case Kind::Broadcast: return o.comm->rank == o.root ? o.count : 0;
  case Kind::Recv: return 0;
  default: return o.count;
  }
}
size_t out_elems(const Op &o) {
  switch (o.kind) {
  case Kind::AllGather: return o.count * (size_t)o.comm->nranks;
  case Kind::Reduce: return o.comm->rank == o.root ? o.count : 0;
  case Kind::Send: return 0;
  default: return o.count;
  }
}

/* A device buffer argument: inside one allocation of the communicator's
   device (NULL only when nothing is read or written). */
ncclResult_t check_buffer(const Op &o, const void *p, size_t elems, const char *what) {
  if (elems == 0) return ncclSuccess;
  size_t bytes = elems * type_size(o.type);
  if (!p) return fail(ncclInvalidArgument, "%s: %s is NULL but %zu bytes are to be %s", o.name, what, bytes,
                      strcmp(what, "sendbuff") == 0 ? "read" : "written");
  void *base = nullptr;
  size_t size = 0;
  int dev = -1;
  if (!gl_sim_find_alloc(p, &base, &size, &dev))
    return fail(ncclInvalidArgument, "%s: %s %p is not device memory (NCCL moves device buffers only)", o.name, what, p);
  if (dev != o.comm->device)
    return fail(ncclInvalidArgument, "%s: %s %p is memory of cuda:%d but the communicator uses cuda:%d", o.name, what,
                p, dev, o.comm->device);
  size_t off = (size_t)((const char *)p - (const char *)base);
  if (off + bytes > size)
    return fail(ncclInvalidArgument, "%s: %s %p + %zu bytes leaves its %zu-byte allocation of cuda:%d by %zu bytes",
                o.name, what, p, bytes, size, dev, off + bytes - size);
  return ncclSuccess;
}

/* Overlapping send and recv ranges are a race on a GPU unless they are
   NCCL's in-place layout. */
ncclResult_t check_overlap(const Op &o) {
  size_t ib = in_elems(o) * type_size(o.type), ob = out_elems(o) * type_size(o.type);
  if (!ib || !ob || !o.send || !o.recv) return ncclSuccess;
  const char *s = o.send, *r = o.recv;
  if (s + ib <= r || r + ob <= s) return ncclSuccess;
  size_t blk = o.count * type_size(o.type) * (size_t)o.comm->rank;
  bool in_place = o.kind == Kind::AllGather ? s == r + blk : o.kind == Kind::ReduceScatter ? r == s + blk : s == r;
  if (in_place) return ncclSuccess;
  return fail(ncclInvalidArgument, "%s: sendbuff %p (%zu bytes) and recvbuff %p (%zu bytes) overlap but are not "
              "the in-place layout (%s)", o.name, (const void *)s, ib, (void *)r, ob,
              o.kind == Kind::AllGather ? "sendbuff == recvbuff + rank * sendcount"
              : o.kind == Kind::ReduceScatter ? "recvbuff == sendbuff + rank * recvcount" : "sendbuff == recvbuff");
}

ncclResult_t check_op(const Op &o) {
  ncclResult_t r = check_comm(o.comm, o.name);
  if (r != ncclSuccess) return r;
  if ((int)o.type < 0 || o.type >= ncclNumTypes)
    return fail(ncclInvalidArgument, "%s: datatype expected 0..%d, got %d", o.name, ncclNumTypes - 1, (int)o.type);
  if (is_reduction(o.kind) && ((int)o.op < 0 || o.op >= ncclNumOps))
    return fail(ncclInvalidArgument, "%s: op expected ncclSum, ncclProd, ncclMax, ncclMin or ncclAvg, got %d", o.name,
                (int)o.op);
  bool p2p = o.kind == Kind::Send || o.kind == Kind::Recv;
  if ((p2p || o.kind == Kind::Broadcast || o.kind == Kind::Reduce) && (o.root < 0 || o.root >= o.comm->nranks))
    return fail(ncclInvalidArgument, "%s: %s expected 0..%d, got %d", o.name, p2p ? "peer" : "root",
                o.comm->nranks - 1, o.root);
  if (o.comm->aborted) return fail(ncclInvalidUsage, "%s: the communicator was aborted", o.name);
  size_t most = std::max(in_elems(o), out_elems(o)) * (is_reduction(o.kind) ? reduce_size(o.type) : type_size(o.type));
  if (most > (size_t)0x7fffffff)
    return fail(ncclInvalidArgument, "%s: %zu bytes exceed the simulator's 2 GiB per operation (MPI int counts)",
                o.name, most);
  if ((r = check_buffer(o, o.send, in_elems(o), "sendbuff")) != ncclSuccess) return r;
  if ((r = check_buffer(o, o.recv, out_elems(o), "recvbuff")) != ncclSuccess) return r;
  if (gl_sim_sticky() != cudaSuccess)
    return fail(ncclUnhandledCudaError, "%s: the CUDA context is unusable: %s", o.name, cudaGetErrorString(gl_sim_sticky()));
  return check_overlap(o);
}

/* ---- running a batch (one call, or a group) on the stream ---------------- */
/* Host copies of the inputs; reductions of 16-bit floats convert to float. */
void stage_in(Op &o) {
  size_t n = in_elems(o), out_n = out_elems(o);
  bool red = is_reduction(o.kind);
  size_t es = red ? reduce_size(o.type) : type_size(o.type);
  o.in = malloc(n * es + 1);
  o.out = malloc(out_n * es + 1);
  if (!n) return;
  if (red && o.type == ncclBfloat16) {
    const uint16_t *s = (const uint16_t *)o.send;
    for (size_t i = 0; i < n; i++) ((float *)o.in)[i] = bf16_to_float(s[i]);
  } else if (red && o.type == ncclFloat16) {
    const uint16_t *s = (const uint16_t *)o.send;
    for (size_t i = 0; i < n; i++) ((float *)o.in)[i] = f16_to_float(s[i]);
  } else {
    memcpy(o.in, o.send, n * es);
  }
}

/* Posts the transfer; MPI_SUCCESS or MPI's error. */
int post(Op &o) {
  MPI_Comm c = o.comm->data;
  int n = (int)o.count, bytes = (int)(o.count * type_size(o.type));
  MPI_Datatype rt = reduce_type(o.type);
  MPI_Op op = mpi_op(o.op);
  switch (o.kind) {
  case Kind::AllReduce: return MPI_Iallreduce(o.in, o.out, n, rt, op, c, &o.req);
  case Kind::ReduceScatter: return MPI_Ireduce_scatter_block(o.in, o.out, n, rt, op, c, &o.req);
  case Kind::Reduce: return MPI_Ireduce(o.in, o.comm->rank == o.root ? o.out : nullptr, n, rt, op, o.root, c, &o.req);
  case Kind::AllGather: return MPI_Iallgather(o.in, bytes, MPI_BYTE, o.out, bytes, MPI_BYTE, c, &o.req);
  case Kind::Broadcast:
    if (o.comm->rank == o.root) memcpy(o.out, o.in, (size_t)bytes);
    return MPI_Ibcast(o.out, bytes, MPI_BYTE, o.root, c, &o.req);
  case Kind::Send: return MPI_Isend(o.in, bytes, MPI_BYTE, o.root, 0, c, &o.req);
  case Kind::Recv: return MPI_Irecv(o.out, bytes, MPI_BYTE, o.root, 0, c, &o.req);
  }
  return MPI_ERR_OTHER;
}

/* avg's division, then the results into device memory */
void stage_out(Op &o) {
  size_t n = out_elems(o);
  if (!n) return;
  bool red = is_reduction(o.kind);
  if (red && o.op == ncclAvg) {
    int k = o.comm->nranks;
    switch (o.type) {
    case ncclFloat64: { double s = 1.0 / k; for (size_t i = 0; i < n; i++) ((double *)o.out)[i] *= s; break; }
    case ncclInt8: for (size_t i = 0; i < n; i++) ((int8_t *)o.out)[i] /= k; break;
    case ncclUint8: for (size_t i = 0; i < n; i++) ((uint8_t *)o.out)[i] /= k; break;
    case ncclInt32: for (size_t i = 0; i < n; i++) ((int32_t *)o.out)[i] /= k; break;
    case ncclUint32: for (size_t i = 0; i < n; i++) ((uint32_t *)o.out)[i] /= k; break;
    case ncclInt64: for (size_t i = 0; i < n; i++) ((int64_t *)o.out)[i] /= k; break;
    case ncclUint64: for (size_t i = 0; i < n; i++) ((uint64_t *)o.out)[i] /= k; break;
    default: { float s = (float)(1.0 / k); for (size_t i = 0; i < n; i++) ((float *)o.out)[i] *= s; break; }
    }
  }
  uint16_t *d = (uint16_t *)o.recv;
  if (red && o.type == ncclBfloat16) for (size_t i = 0; i < n; i++) d[i] = float_to_bf16(((float *)o.out)[i]);
  else if (red && o.type == ncclFloat16) for (size_t i = 0; i < n; i++) d[i] = float_to_f16(((float *)o.out)[i]);
  else memcpy(o.recv, o.out, n * (red ? reduce_size(o.type) : type_size(o.type)));
}

void set_async(const std::vector<Op> &ops, ncclResult_t r) {
  for (const Op &o : ops) {
    int ok = ncclSuccess;
    o.comm->async_error.compare_exchange_strong(ok, r);
  }
}

/* What a work item runs: the calls of one launch, and the communicators it
   holds until it is destroyed (run or dropped by a sticky context). */
struct Batch {
  std::vector<Op> ops;
  bool leak = false;     /* MPI may still write the host buffers: keep them */
  ~Batch() {
    for (Op &o : ops) {
      if (!leak) { free(o.in); free(o.out); }
      comm_release(o.comm);
    }
  }

  void run() {
    for (Op &o : ops)
      if (o.comm->aborted) { set_async(ops, ncclInvalidUsage); return; }
    for (size_t i = 0; i < ops.size(); i++) {
      stage_in(ops[i]);
      int e = post(ops[i]);
      if (e != MPI_SUCCESS) {
        leak = i > 0;   /* the ones already posted stay in flight */
        char s[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(e, s, &len);
        set_async(ops, ncclSystemError);
        gl_sim_fail(cudaErrorLaunchFailure, "%s on rank %d of %d: posting the MPI transfer failed: %s",
                    ops[i].name, ops[i].comm->rank, ops[i].comm->nranks, s);
        return;
      }
    }
    std::vector<MPI_Request> reqs(ops.size());
    std::vector<MPI_Status> st(ops.size());
    for (size_t i = 0; i < ops.size(); i++) reqs[i] = ops[i].req;
    double t0 = now_s();
    {
      gl_sim_device_scope_pause wait_for_peers;  /* host buffers only until the transfers end */
      for (;;) {
        int flag = 0;
        int e = MPI_Testall((int)reqs.size(), reqs.data(), &flag, st.data());
        if (e != MPI_SUCCESS && e != MPI_ERR_IN_STATUS) { failed_mpi(e, -1); return; }
        if (e == MPI_ERR_IN_STATUS) {
          for (size_t i = 0; i < ops.size(); i++)
            if (st[i].MPI_ERROR != MPI_SUCCESS && st[i].MPI_ERROR != MPI_ERR_PENDING) { failed_mpi(st[i].MPI_ERROR, (int)i); return; }
        }
        if (flag) break;
        for (Op &o : ops)
          if (o.comm->aborted) { leak = true; set_async(ops, ncclInvalidUsage); return; }
        double waited = now_s() - t0;
        if (waited > wait_limit_s()) {
          leak = true;
          set_async(ops, ncclSystemError);
          const Op &o = ops[0];
          gl_sim_fail(cudaErrorLaunchTimeout, "%s%s on rank %d of %d waited %g s for its peers (GL_SIM_NCCL_TIMEOUT); "
                      "a rank that never joins hangs NCCL on a GPU too", o.name, ops.size() > 1 ? " (in a group)" : "",
                      o.comm->rank, o.comm->nranks, wait_limit_s());
          return;
        }
        pause_after(waited);
      }
    }
    for (size_t i = 0; i < ops.size(); i++) {
      Op &o = ops[i];
      if (o.kind == Kind::Recv) {
        int got = 0;
        MPI_Get_count(&st[i], MPI_BYTE, &got);
        size_t want = o.count * type_size(o.type);
        if ((size_t)got != want) {
          set_async(ops, ncclInvalidUsage);
          gl_sim_fail(cudaErrorLaunchFailure, "ncclRecv on rank %d of %d from peer %d expects %zu bytes but the "
                      "matching ncclSend sent %d (on a GPU this hangs or corrupts memory)", o.comm->rank,
                      o.comm->nranks, o.root, want, got);
          return;
        }
      }
      stage_out(o);
    }
  }

  void failed_mpi(int err, int which) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(err, s, &len);
    leak = true;
    set_async(ops, ncclSystemError);
    const Op &o = ops[which >= 0 ? which : 0];
    if (which >= 0 && o.kind == Kind::Recv && err == MPI_ERR_TRUNCATE)
      gl_sim_fail(cudaErrorLaunchFailure, "ncclRecv on rank %d of %d from peer %d expects %zu bytes but the matching "
                  "ncclSend sent more (on a GPU this hangs or corrupts memory)", o.comm->rank, o.comm->nranks, o.root,
                  o.count * type_size(o.type));
    else
      gl_sim_fail(cudaErrorLaunchFailure, "%s on rank %d of %d: MPI transfer failed: %s", o.name, o.comm->rank,
                  o.comm->nranks, s);
  }
};

/* Queues ops as one work item on the first op's stream.  Other streams of
   the batch join it before and after (as NCCL does for a group), and each
   communicator's previous operation is waited for. */
ncclResult_t launch(std::vector<Op> ops) {
  const char *fn = ops.size() > 1 ? "ncclGroupEnd" : ops[0].name;
  DeviceGuard on(ops[0].comm->device);
  cudaStream_t main = ops[0].stream;
  std::vector<cudaStream_t> others;
  std::vector<ncclComm *> comms;
  for (const Op &o : ops) {
    if (o.stream != main && std::find(others.begin(), others.end(), o.stream) == others.end()) others.push_back(o.stream);
    if (std::find(comms.begin(), comms.end(), o.comm) == comms.end()) comms.push_back(o.comm);
  }
#define CUDA_OR_FAIL(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) \
    return fail(ncclUnhandledCudaError, "%s: %s: %s", fn, #call, cudaGetErrorString(e_)); } while (0)
  for (ncclComm *c : comms)
    if (c->has_last && c->last_stream != main) CUDA_OR_FAIL(cudaStreamWaitEvent(main, c->last_done, 0));
  std::vector<cudaEvent_t> joins(others.size(), nullptr);
  for (size_t i = 0; i < others.size(); i++) {
    CUDA_OR_FAIL(cudaEventCreateWithFlags(&joins[i], cudaEventDisableTiming));
    CUDA_OR_FAIL(cudaEventRecord(joins[i], others[i]));
    CUDA_OR_FAIL(cudaStreamWaitEvent(main, joins[i], 0));
  }

  auto batch = std::make_shared<Batch>();
  for (Op &o : ops) o.comm->refs++;
  batch->ops = std::move(ops);
  char what[96];
  if (batch->ops.size() > 1) snprintf(what, sizeof what, "ncclGroupEnd (%zu operations)", batch->ops.size());
  else snprintf(what, sizeof what, "%s", batch->ops[0].name);
  gl_sim_submit(main, what, [batch] { batch->run(); });
  batch.reset();   /* the work item holds it now */
  /* in sync mode the work has run: what it failed with is this call's error */
  if (gl_sim_sticky() != cudaSuccess)
    return fail(ncclUnhandledCudaError, "%s: %s", fn, cudaGetErrorString(gl_sim_sticky()));

  for (size_t i = 0; i < others.size(); i++) {
    CUDA_OR_FAIL(cudaEventRecord(joins[i], main));
    CUDA_OR_FAIL(cudaStreamWaitEvent(others[i], joins[i], 0));
    CUDA_OR_FAIL(cudaEventDestroy(joins[i]));
  }
  for (ncclComm *c : comms) {
    CUDA_OR_FAIL(cudaEventRecord(c->last_done, main));
    c->last_stream = main;
    c->has_last = true;
  }
#undef CUDA_OR_FAIL
  return ncclSuccess;
}

/* ---- groups (per host thread, as NCCL's) --------------------------------- */
thread_local int group_depth;
thread_local std::vector<Op> group_ops;
thread_local ncclResult_t group_error = ncclSuccess;
thread_local std::string group_error_msg;

/* Checks o, then starts it or adds it to the open group. */
ncclResult_t enqueue(const Op &o) {
  ncclResult_t r = check_op(o);
  if (group_depth > 0) {
    if (r != ncclSuccess && group_error == ncclSuccess) { group_error = r; group_error_msg = last_error; }
    if (r == ncclSuccess) group_ops.push_back(o);
    return r;
  }
  if (r != ncclSuccess) return r;
  return launch(std::vector<Op>{o});
}

Op make_op(Kind k, const char *name, const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
           int root, ncclComm *comm, cudaStream_t stream) {
  Op o;
  o.kind = k;
  o.name = name;
  o.comm = comm;
  o.stream = stream;
  o.send = (const char *)send;
  o.recv = (char *)recv;
  o.count = count;
  o.type = type;
  o.op = op;
  o.root = root;
  /* the sides this rank does not use are not looked at */
  if (k == Kind::Recv) o.send = nullptr;
  if (k == Kind::Send) o.recv = nullptr;
  if (comm && is_live(comm)) {
    if (k == Kind::Broadcast && comm->rank != root) o.send = nullptr;
    if (k == Kind::Reduce && comm->rank != root) o.recv = nullptr;
  }
  return o;
}

}  // namespace

extern "C" {

ncclResult_t ncclGroupStart(void) {
  if (group_depth++ == 0) {
    group_ops.clear();
    group_error = ncclSuccess;
    group_error_msg.clear();
  }
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: no group is open (ncclGroupStart not called)");
  if (--group_depth > 0) return ncclSuccess;
  std::vector<Op> ops;
  ops.swap(group_ops);
  if (group_error != ncclSuccess) {
    ncclResult_t r = group_error;
    group_error = ncclSuccess;
    return fail(r, "%s (an operation of the group failed; nothing was started)", group_error_msg.c_str());
  }
  if (ops.empty()) return ncclSuccess;
  /* a communicator that was destroyed inside the group */
  for (const Op &o : ops) {
    ncclResult_t r = check_comm(o.comm, "ncclGroupEnd");
    if (r != ncclSuccess) return r;
  }
  return launch(std::move(ops));
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::AllReduce, "ncclAllReduce", sendbuff, recvbuff, count, datatype, op, 0, comm, stream));
}

ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::ReduceScatter, "ncclReduceScatter", sendbuff, recvbuff, recvcount, datatype, op, 0,
                         comm, stream));
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::AllGather, "ncclAllGather", sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm,
                         stream));
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::Broadcast, "ncclBroadcast", sendbuff, recvbuff, count, datatype, ncclSum, root, comm,
                         stream));
}

ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return enqueue(make_op(Kind::Reduce, "ncclReduce", sendbuff, recvbuff, count, datatype, op, root, comm, stream));
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return enqueue(make_op(Kind::Send, "ncclSend", sendbuff, nullptr, count, datatype, ncclSum, peer, comm, stream));
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return enqueue(make_op(Kind::Recv, "ncclRecv", nullptr, recvbuff, count, datatype, ncclSum, peer, comm, stream));
}

}  // extern "C"
