/* gloo_ops.cpp — collectives of the TCP backend on Gloo (contract in
 * gloo_ops.h).  The only C++ of the backend: it adapts the TCP store to
 * Gloo's rendezvous Store, connects a context, and maps each gl_coll onto
 * Gloo, catching every exception at this boundary.
 *
 * Mapping (buffers are host memory of the wire dtype, see gl_dist.h):
 *   all_reduce, broadcast, reduce, barrier   Gloo's own algorithms
 *   all_gather                               Gloo's allgatherv (any counts)
 *   reduce_scatter                           all_reduce of a copy, own chunk kept
 *                                            (Gloo's halving-doubling one needs
 *                                            powers of two and even counts)
 *   gather, scatter, all_to_all              pairwise unbound-buffer sends and
 *                                            receives at each rank's offset
 *   send, recv                               unbound-buffer messages: size, then payload
 * Reductions run natively in float32/64 and int32/64 (comm.c stages 16-bit
 * floats to float32 and scales avg, as for MPI). */
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

extern "C" {
#include "gptlua.h"
int gl_error(const char *fmt, ...);   /* internal.h's, whose macros are C only */
}
#include "gloo_ops.h"

namespace {

using ms = std::chrono::milliseconds;
using ReduceFn = void (*)(void *, const void *, const void *, size_t);

ms millis(double s) { return ms((long long)(s * 1000.0)); }

/* Gloo's Store over the TCP store: get and wait poll try_get (the store
   never parks a request), and give up with the key's name at the deadline. */
class TcpStore : public gloo::rendezvous::Store {
 public:
  TcpStore(gl_tcp_store *s, double timeout_s) : s_(s), timeout_s_(timeout_s) {}
  void set(const std::string &key, const std::vector<char> &data) override {
    if (gl_tcp_store_set(s_, key.c_str(), data.data(), data.size()) != GL_OK) throw std::runtime_error(gl_last_error());
  }
  std::vector<char> get(const std::string &key) override {
    std::vector<char> out;
    poll_for(key, &out, millis(timeout_s_));
    return out;
  }
  void wait(const std::vector<std::string> &keys) override { wait(keys, millis(timeout_s_)); }
  void wait(const std::vector<std::string> &keys, const ms &timeout) override {
    for (const auto &k : keys) poll_for(k, nullptr, timeout);
  }

 private:
  void poll_for(const std::string &key, std::vector<char> *out, ms timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int spins = 0;; spins++) {
      void *v = nullptr;
      size_t n = 0;
      int found = 0;
      if (gl_tcp_store_try_get(s_, key.c_str(), &v, &n, &found) != GL_OK) throw std::runtime_error(gl_last_error());
      if (found) {
        if (out) out->assign((char *)v, (char *)v + n);
        free(v);
        return;
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("timed out waiting for key '" + key + "' in the rendezvous store");
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 200 : 5000));
    }
  }
  gl_tcp_store *s_;
  double timeout_s_;
};

/* one TCP device per process: every context's pairs share its event loop */
std::shared_ptr<gloo::transport::Device> the_device;
std::mutex device_lock;

std::shared_ptr<gloo::transport::Device> device_for(const char *host, const char *iface) {
  std::lock_guard<std::mutex> g(device_lock);
  if (!the_device) {
    gloo::transport::tcp::attr attr;
    if (iface && *iface) attr.iface = iface;
    else attr.hostname = host;
    the_device = gloo::transport::tcp::CreateDevice(attr);
  }
  return the_device;
}

template <typename T> ReduceFn pick(int op) {
  if (op == GL_DIST_MAX) return &gloo::max<T>;
  if (op == GL_DIST_MIN) return &gloo::min<T>;
  return &gloo::sum<T>;   /* sum, and avg (comm.c scales it) */
}

/* calls f with a (null) T* for the reduction dtypes of the backend */
template <typename F> void by_dtype(int dtype, F f) {
  switch (dtype) {
  case GL_F32: f((float *)nullptr); return;
  case GL_F64: f((double *)nullptr); return;
  case GL_I32: f((int32_t *)nullptr); return;
  case GL_I64: f((int64_t *)nullptr); return;
  default: throw std::runtime_error(std::string("no reduction for ") + gl_dtype_name(dtype));
  }
}

/* slot prefixes of our own unbound-buffer messages (Gloo's algorithms use
   small ones); the tag or the per-peer count fills the low bits */
constexpr uint8_t kPairwiseSlot = 0xe1, kP2PHeaderSlot = 0xe2, kP2PSlot = 0xe3;
/* the tag of the barrier that ends a connect: collectives are tagged with
   their sequence number (mod 2^32), which starts at 0, so none of the first
   4 billion can have its messages taken for the barrier's */
constexpr uint32_t kConnectedTag = 0xffffffffu;

}  // namespace

struct gl_gloo {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
};

struct gl_gloo_p2p {
  std::shared_ptr<gloo::Context> ctx;
  std::unique_ptr<gloo::transport::UnboundBuffer> head, buf;
  uint64_t header;             /* the message's byte count */
  uint64_t header_slot, slot;
  void *data;
  size_t bytes, es;            /* this side's byte count, element size */
  int peer;
  bool is_send;
};

static void set_err(char *err, size_t errn, const char *what) {
  if (err && errn) snprintf(err, errn, "gloo: %s", what);
}

extern "C" gl_gloo *gl_gloo_connect(gl_tcp_store *store, const char *prefix, const char *host, const char *iface,
                                    int rank, int size, double timeout_s) {
  try {
    auto dev = device_for(host, iface);
    TcpStore tcp(store, timeout_s);
    gloo::rendezvous::PrefixStore ps(prefix, tcp);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(millis(timeout_s));
    ctx->connectFullMesh(ps, dev);
    /* connectFullMesh returns on a rank once its own side of every pair is
       up, which can be before the peer has read the handshake; a rank that
       then freed the group (or exited) closed the socket under the peer,
       whose connect failed with "Connection closed by peer".  No rank leaves
       until every rank is connected. */
    gloo::BarrierOptions connected(ctx);
    connected.setTag(kConnectedTag);
    connected.setTimeout(millis(timeout_s));
    gloo::barrier(connected);
    gl_gloo *g = new gl_gloo;
    g->ctx = ctx;
    return g;
  } catch (const std::exception &e) {
    gl_error("gloo: connecting group '%s' (rank %d of %d): %s", prefix, rank, size, e.what());
    return nullptr;
  }
}

extern "C" void gl_gloo_free(gl_gloo *g) { delete g; }

/* every rank sends send[r] (bytes at soff[r]) to r and receives rlen[r]
   (at roff[r]) from r; the own chunk is a copy */
static void pairwise(gloo::Context &ctx, uint32_t tag, ms timeout, char *sb, const std::vector<size_t> &soff,
                     const std::vector<size_t> &slen, char *rb, const std::vector<size_t> &roff,
                     const std::vector<size_t> &rlen) {
  int me = ctx.rank, n = ctx.size;
  uint64_t slot = gloo::Slot::build(kPairwiseSlot, tag);
  std::unique_ptr<gloo::transport::UnboundBuffer> in, out;
  size_t stotal = 0, rtotal = 0;
  for (int r = 0; r < n; r++) { stotal = std::max(stotal, soff[r] + slen[r]); rtotal = std::max(rtotal, roff[r] + rlen[r]); }
  if (sb && stotal) out = ctx.createUnboundBuffer(sb, stotal);
  if (rb && rtotal) in = ctx.createUnboundBuffer(rb, rtotal);
  int nsend = 0, nrecv = 0;
  for (int r = 0; r < n; r++) {
    if (r == me) continue;
    if (out && slen[r]) { out->send(r, slot, soff[r], slen[r]); nsend++; }
    if (in && rlen[r]) { in->recv(r, slot, roff[r], rlen[r]); nrecv++; }
  }
  if (sb && rb && slen[me]) memcpy(rb + roff[me], sb + soff[me], slen[me]);
  for (int i = 0; i < nsend; i++) out->waitSend(timeout);
  for (int i = 0; i < nrecv; i++) in->waitRecv(timeout);
}

static void run(gloo::Context &c, std::shared_ptr<gloo::Context> ctx, const gl_work *w, uint32_t tag, ms timeout) {
  const gl_coll_args *a = &w->args;
  size_t es = (size_t)gl_dtype_size(w->wire_dtype);
  int me = c.rank, n = c.size;
  char *sb = (char *)w->send_buf, *rb = (char *)w->recv_buf;
  std::vector<size_t> soff(n, 0), slen(n, 0), roff(n, 0), rlen(n, 0);
  auto offsets = [&](const int64_t *counts, std::vector<size_t> &off, std::vector<size_t> &len) {
    size_t o = 0;
    for (int r = 0; r < n; r++) { off[r] = o; len[r] = (size_t)counts[r] * es; o += len[r]; }
  };
  switch (a->coll) {
  case GL_COLL_ALL_REDUCE: case GL_COLL_REDUCE_SCATTER: {
    size_t elems = (size_t)(a->coll == GL_COLL_ALL_REDUCE ? w->recv_numel : w->send_numel);
    std::vector<char> copy;
    char *buf = rb;
    if (a->coll == GL_COLL_REDUCE_SCATTER) { copy.assign(sb, sb + elems * es); buf = copy.data(); }
    if (elems > 0) by_dtype(w->wire_dtype, [&](auto *t) {
      using T = std::remove_pointer_t<decltype(t)>;
      gloo::AllreduceOptions o(ctx);
      o.setOutput<T>((T *)buf, elems);
      o.setReduceFunction(pick<T>(a->op));
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::allreduce(o);
    });
    if (a->coll == GL_COLL_REDUCE_SCATTER) {
      offsets(w->recv_counts, roff, rlen);
      if (rlen[me]) memcpy(rb, buf + roff[me], rlen[me]);
    }
    return;
  }
  case GL_COLL_BROADCAST: {
    if (w->recv_numel == 0) return;
    gloo::BroadcastOptions o(ctx);
    o.setOutput<char>(rb, (size_t)w->recv_numel * es);
    o.setRoot(a->root);
    o.setTag(tag);
    o.setTimeout(timeout);
    gloo::broadcast(o);
    return;
  }
  case GL_COLL_REDUCE: {
    if (w->recv_numel == 0) return;
    /* Gloo reduces through every rank's buffer; a non-root's tensor stays
       as it was (as with MPI), so it lends a copy */
    std::vector<char> copy;
    char *buf = rb;
    if (me != a->root) { copy.assign(rb, rb + (size_t)w->recv_numel * es); buf = copy.data(); }
    by_dtype(w->wire_dtype, [&](auto *t) {
      using T = std::remove_pointer_t<decltype(t)>;
      gloo::ReduceOptions o(ctx);
      o.setOutput<T>((T *)buf, (size_t)w->recv_numel);
      o.setRoot(a->root);
      o.setReduceFunction(pick<T>(a->op));
      o.setTag(tag);
      o.setTimeout(timeout);
      gloo::reduce(o);
    });
    return;
  }
  case GL_COLL_ALL_GATHER: {
    std::vector<size_t> bytes(n);
    size_t total = 0;
    for (int r = 0; r < n; r++) { bytes[r] = (size_t)w->recv_counts[r] * es; total += bytes[r]; }
    if (total == 0) return;
    gloo::AllgathervOptions o(ctx);
    o.setInput<char>(sb, bytes[me]);
    o.setOutput<char>(rb, bytes);
    o.setTag(tag);
    o.setTimeout(timeout);
    gloo::allgatherv(o);
    return;
  }
  case GL_COLL_GATHER:   /* root receives every chunk; the others send theirs */
    if (me == a->root) offsets(w->recv_counts, roff, rlen);
    else { slen[a->root] = (size_t)w->send_numel * es; }
    if (me == a->root) { soff[me] = 0; slen[me] = rlen[me]; }
    pairwise(c, tag, timeout, sb, soff, slen, me == a->root ? rb : nullptr, roff, rlen);
    return;
  case GL_COLL_SCATTER:
    if (me == a->root) offsets(w->send_counts, soff, slen);
    else rlen[a->root] = (size_t)w->recv_numel * es;
    if (me == a->root) { roff[me] = 0; rlen[me] = slen[me]; }
    pairwise(c, tag, timeout, me == a->root ? sb : nullptr, soff, slen, rb, roff, rlen);
    return;
  case GL_COLL_ALL_TO_ALL:
    offsets(w->send_counts, soff, slen);
    offsets(w->recv_counts, roff, rlen);
    pairwise(c, tag, timeout, sb, soff, slen, rb, roff, rlen);
    return;
  case GL_COLL_BARRIER: {
    gloo::BarrierOptions o(ctx);
    o.setTag(tag);
    o.setTimeout(timeout);
    gloo::barrier(o);
    return;
  }
  default:
    throw std::runtime_error(std::string("collective ") + gl_coll_name(a->coll) + " has no Gloo mapping");
  }
}

extern "C" int gl_gloo_run(gl_gloo *g, const gl_work *w, uint32_t tag, double timeout_s, char *err, size_t errn) {
  try {
    run(*g->ctx, g->ctx, w, tag, millis(timeout_s));
    return GL_OK;
  } catch (const std::exception &e) {
    set_err(err, errn, e.what());
    return GL_ERR;
  }
}

/* A message is a header (its byte count) and, unless empty, the payload.
   The receiver reads the header first, so a size that differs from what
   it expects is reported (as MPI does) instead of overrunning the buffer
   or leaving a short result; the payload is then drained into scratch so
   the sender still completes. */
extern "C" gl_gloo_p2p *gl_gloo_p2p_post(gl_gloo *g, const gl_work *w, uint64_t n, char *err, size_t errn) {
  try {
    auto p = std::make_unique<gl_gloo_p2p>();
    p->is_send = w->args.coll == GL_COLL_SEND;
    p->ctx = g->ctx;
    p->peer = w->args.root;
    p->es = (size_t)gl_dtype_size(w->wire_dtype);
    p->bytes = (size_t)(p->is_send ? w->send_numel : w->recv_numel) * p->es;
    p->data = p->is_send ? w->send_buf : w->recv_buf;
    p->header_slot = gloo::Slot::build(kP2PHeaderSlot, (uint32_t)n);
    p->slot = gloo::Slot::build(kP2PSlot, (uint32_t)n);
    p->header = p->bytes;
    p->head = g->ctx->createUnboundBuffer(&p->header, sizeof p->header);
    if (p->is_send) {
      p->head->send(p->peer, p->header_slot);
      if (p->bytes) {
        p->buf = g->ctx->createUnboundBuffer(p->data, p->bytes);
        p->buf->send(p->peer, p->slot);
      }
    } else {
      p->head->recv(p->peer, p->header_slot);
    }
    return p.release();
  } catch (const std::exception &e) {
    set_err(err, errn, e.what());
    return nullptr;
  }
}

extern "C" int gl_gloo_p2p_wait(gl_gloo_p2p *p, double timeout_s, char *err, size_t errn) {
  std::unique_ptr<gl_gloo_p2p> own(p);
  try {
    ms timeout = millis(timeout_s);
    if (p->is_send) {
      p->head->waitSend(timeout);
      if (p->buf) p->buf->waitSend(timeout);
      return GL_OK;
    }
    p->head->waitRecv(timeout);
    uint64_t sent = p->header;
    if (sent == 0 && p->bytes == 0) return GL_OK;
    std::vector<char> scratch;
    void *into = p->data;
    if (sent != p->bytes) { scratch.resize(sent ? sent : 1); into = scratch.data(); }
    if (sent) {
      p->buf = p->ctx->createUnboundBuffer(into, sent);
      p->buf->recv(p->peer, p->slot);
      p->buf->waitRecv(timeout);
    }
    if (sent != p->bytes) {
      if (err && errn)
        snprintf(err, errn, "rank %d sent %llu elements, expected %llu", p->peer,
                 (unsigned long long)(sent / p->es), (unsigned long long)(p->bytes / p->es));
      return GL_ERR;
    }
    return GL_OK;
  } catch (const std::exception &e) {
    set_err(err, errn, e.what());
    return GL_ERR;
  }
}
