/* gloo_ops.h — the C face of the Gloo layer (gloo_ops.cpp): one Gloo
 * context per communicator, connected full mesh through the TCP store, and
 * a blocking call per collective.  world.c puts the blocking calls on a
 * worker thread per communicator so comm.c sees them as nonblocking.
 *
 * Every call is safe from any thread (Gloo's pairs lock themselves); a
 * failure returns GL_ERR with the reason in err (Gloo throws; nothing
 * escapes as an exception). */
#ifndef GL_GLOO_OPS_H
#define GL_GLOO_OPS_H
#include <stddef.h>
#include <stdint.h>
#include "tcp_store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gl_gloo gl_gloo;
typedef struct gl_gloo_p2p gl_gloo_p2p;
struct gl_work;

/* Connects rank of size over the store, keys under prefix (one per
   communicator).  host: this rank's address for its peers; iface (may be
   NULL or ""): a network interface to use instead.  Waits up to timeout_s
   for the others.  NULL with gl_error's message on failure. */
gl_gloo *gl_gloo_connect(gl_tcp_store *store, const char *prefix, const char *host, const char *iface, int rank,
                         int size, double timeout_s);
void gl_gloo_free(gl_gloo *g);

/* Runs w's collective (not send/recv) to completion: tag unique among the
   group's collectives in flight, timeout_s Gloo's own deadline. */
int gl_gloo_run(gl_gloo *g, const struct gl_work *w, uint32_t tag, double timeout_s, char *err, size_t errn);

/* send/recv: posted at once (nonblocking), then waited for (blocking,
   frees p; a recv's wait reads the size first, then posts the payload, so
   sends and receives need separate waiting threads).  n: how many messages this rank sent to (recv: received
   from) the peer before, which matches the two sides' messages in order. */
gl_gloo_p2p *gl_gloo_p2p_post(gl_gloo *g, const struct gl_work *w, uint64_t n, char *err, size_t errn);
int gl_gloo_p2p_wait(gl_gloo_p2p *p, double timeout_s, char *err, size_t errn);

#ifdef __cplusplus
}
#endif
#endif
