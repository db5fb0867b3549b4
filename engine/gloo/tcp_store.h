/* tcp_store.h — the rendezvous of a TCP-launched world: a small key-value
 * store that rank 0 serves at MASTER_ADDR:MASTER_PORT and every rank
 * (rank 0 included) talks to over one TCP connection.
 *
 * What it is for: Gloo's full-mesh connect needs a Store to swap addresses
 * (this Gloo has file, hash, prefix and redis stores, no TCP one), the
 * rendezvous needs to say which ranks never arrived, and the timeout
 * watchdog and abort travel through it (engine/gloo/world.c).
 *
 * Contract: values are bytes; set overwrites; try_get never blocks (found
 * 0/1); waiting for a key is the caller's loop, so no request is ever left
 * pending on the connection and a timeout cannot desynchronise it.  The
 * client is used by one thread at a time (the Lua thread).  Every function
 * returns GL_OK or GL_ERR with gl_error's message; GL_TCP_STORE_LOST means the
 * server went away (rank 0 ended). */
#ifndef GL_TCP_STORE_H
#define GL_TCP_STORE_H
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { GL_TCP_STORE_LOST = -2 };

typedef struct gl_tcp_store gl_tcp_store;

/* serve != 0: start the server on port (all interfaces) first.  Then
   connect to host:port, retrying until timeout_s has passed. */
gl_tcp_store *gl_tcp_store_open(const char *host, int port, int serve, double timeout_s);
int gl_tcp_store_set(gl_tcp_store *s, const char *key, const void *val, size_t n);
/* *val is malloc'ed (caller frees) when *found; NULL otherwise. */
int gl_tcp_store_try_get(gl_tcp_store *s, const char *key, void **val, size_t *n, int *found);
/* Closes the connection; the server (rank 0) first waits up to linger_s for
   the other ranks to close theirs, so it never leaves before them. */
void gl_tcp_store_close(gl_tcp_store *s, double linger_s);
/* The address this client's connection goes out of (the interface that
   reaches rank 0), e.g. "10.0.0.3"; "" when unknown. */
const char *gl_tcp_store_local_addr(const gl_tcp_store *s);

#ifdef __cplusplus
}
#endif
#endif
