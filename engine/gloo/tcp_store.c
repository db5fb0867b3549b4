/* tcp_store.c — the key-value store of the TCP rendezvous (contract in
 * tcp_store.h).
 *
 * Wire format, both directions little-endian host order (every rank of a
 * job runs this same build):
 *   request  u8 op, u32 key length, key, [u32 value length, value]   op SET has a value
 *   reply    SET: u8 1          TRY_GET: u8 found, [u32 length, value]
 * The server is one thread of rank 0 polling its listening socket and every
 * client; a client sends one request and reads its reply before the next,
 * so the server needs no queue: it answers each complete request at once.
 * Keys live in a flat array (a job has a few keys per rank and group). */
#define _GNU_SOURCE
#include "internal.h"
#include "tcp_store.h"
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { OP_SET = 1, OP_TRY_GET = 2 };
enum { MAX_KEY = 4096, MAX_VALUE = 64 << 20, MAX_CLIENTS = 4096 };

typedef struct kv { char *key; void *val; uint32_t n; } kv;

typedef struct client { int fd; char *buf; size_t len, cap; } client;

typedef struct server {
  int listen_fd, wake[2];      /* wake: a pipe that tells the thread to stop */
  pthread_t thread;
  kv *kvs; int nkv, kv_cap;
  client *clients; int nclients;
  pthread_mutex_t lock;        /* nclients, read by gl_tcp_store_close's linger */
} server;

struct gl_tcp_store {
  int fd;
  server *srv;                 /* rank 0 only */
  char local_addr[64];
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* whole buffers over a blocking socket; -1 on error or end of stream */
static int write_all(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n > 0) {
    ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    c += k; n -= (size_t)k;
  }
  return 0;
}
static int read_all(int fd, void *p, size_t n) {
  char *c = p;
  while (n > 0) {
    ssize_t k = recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    c += k; n -= (size_t)k;
  }
  return 0;
}

/* ---- server ------------------------------------------------------------- */
static kv *find(server *s, const char *key, uint32_t klen) {
  for (int i = 0; i < s->nkv; i++)
    if (strlen(s->kvs[i].key) == klen && memcmp(s->kvs[i].key, key, klen) == 0) return &s->kvs[i];
  return NULL;
}

static int put(server *s, const char *key, uint32_t klen, const void *val, uint32_t n) {
  kv *e = find(s, key, klen);
  if (!e) {
    if (s->nkv == s->kv_cap) {
      int cap = s->kv_cap ? 2 * s->kv_cap : 64;
      kv *p = realloc(s->kvs, sizeof *p * (size_t)cap);
      if (!p) return -1;
      s->kvs = p; s->kv_cap = cap;
    }
    e = &s->kvs[s->nkv];
    e->key = strndup(key, klen);
    e->val = NULL;
    if (!e->key) return -1;
    s->nkv++;
  }
  void *v = malloc(n ? n : 1);
  if (!v) return -1;
  memcpy(v, val, n);
  free(e->val);
  e->val = v;
  e->n = n;
  return 0;
}

/* Answers every complete request in c's buffer; -1 drops the client. */
static int serve_requests(server *s, client *c) {
  size_t off = 0;
  for (;;) {
    size_t left = c->len - off;
    const char *p = c->buf + off;
    uint32_t klen, vlen = 0;
    if (left < 5) break;
    memcpy(&klen, p + 1, 4);
    if (klen > MAX_KEY) return -1;
    size_t need = 5 + (size_t)klen;
    if (p[0] == OP_SET) {
      if (left < need + 4) break;
      memcpy(&vlen, p + need, 4);
      if (vlen > MAX_VALUE) return -1;
      need += 4 + (size_t)vlen;
    } else if (p[0] != OP_TRY_GET) return -1;
    if (left < need) break;
    const char *key = p + 5;
    if (p[0] == OP_SET) {
      uint8_t ok = put(s, key, klen, p + 5 + klen + 4, vlen) == 0;
      if (write_all(c->fd, &ok, 1)) return -1;
    } else {
      kv *e = find(s, key, klen);
      uint8_t found = e != NULL;
      if (write_all(c->fd, &found, 1)) return -1;
      if (e && (write_all(c->fd, &e->n, 4) || write_all(c->fd, e->val, e->n))) return -1;
    }
    off += need;
  }
  memmove(c->buf, c->buf + off, c->len - off);
  c->len -= off;
  return 0;
}

static void drop_client(server *s, int i) {
  close(s->clients[i].fd);
  free(s->clients[i].buf);
  pthread_mutex_lock(&s->lock);
  s->clients[i] = s->clients[--s->nclients];
  pthread_mutex_unlock(&s->lock);
}

static void *server_main(void *arg) {
  server *s = arg;
  struct pollfd *fds = calloc(MAX_CLIENTS + 2, sizeof *fds);
  if (!fds) return NULL;
  for (;;) {
    int n = s->nclients;
    fds[0] = (struct pollfd){.fd = s->wake[0], .events = POLLIN};
    fds[1] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
    for (int i = 0; i < n; i++) fds[2 + i] = (struct pollfd){.fd = s->clients[i].fd, .events = POLLIN};
    if (poll(fds, (nfds_t)n + 2, -1) < 0) { if (errno == EINTR) continue; break; }
    if (fds[0].revents) break;
    /* clients first (indices shift when one is dropped: walk backwards) */
    for (int i = n - 1; i >= 0; i--) {
      if (!fds[2 + i].revents) continue;
      client *c = &s->clients[i];
      if (c->cap - c->len < 65536) {
        size_t cap = c->cap ? 2 * c->cap : 65536;
        char *b = realloc(c->buf, cap);
        if (!b) { drop_client(s, i); continue; }
        c->buf = b; c->cap = cap;
      }
      ssize_t k = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) { drop_client(s, i); continue; }
      c->len += (size_t)k;
      if (serve_requests(s, c)) drop_client(s, i);
    }
    if (fds[1].revents & POLLIN) {
      int fd = accept(s->listen_fd, NULL, NULL);
      if (fd >= 0 && s->nclients < MAX_CLIENTS) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        pthread_mutex_lock(&s->lock);
        s->clients[s->nclients++] = (client){.fd = fd};
        pthread_mutex_unlock(&s->lock);
      } else if (fd >= 0) close(fd);
    }
  }
  free(fds);
  return NULL;
}

static void server_free(server *s) {
  if (!s) return;
  for (int i = 0; i < s->nclients; i++) { close(s->clients[i].fd); free(s->clients[i].buf); }
  for (int i = 0; i < s->nkv; i++) { free(s->kvs[i].key); free(s->kvs[i].val); }
  if (s->listen_fd >= 0) close(s->listen_fd);
  if (s->wake[0] >= 0) { close(s->wake[0]); close(s->wake[1]); }
  pthread_mutex_destroy(&s->lock);
  free(s->kvs);
  free(s->clients);
  free(s);
}

static server *server_start(int port) {
  server *s = calloc(1, sizeof *s);
  if (!s) return gl_error_null("rendezvous: out of host memory");
  s->listen_fd = s->wake[0] = s->wake[1] = -1;
  pthread_mutex_init(&s->lock, NULL);
  s->clients = calloc(MAX_CLIENTS, sizeof *s->clients);
  int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0), v6 = fd >= 0;
  if (fd < 0) fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (!s->clients || fd < 0 || pipe2(s->wake, O_CLOEXEC) != 0) {
    if (fd >= 0) close(fd);
    server_free(s);
    return gl_error_null("rendezvous: cannot make a socket: %s", strerror(errno));
  }
  s->listen_fd = fd;
  int one = 1, zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (v6) {   /* dual stack: IPv4 and IPv6 clients alike */
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port), .sin6_addr = in6addr_any};
    rc = bind(fd, (struct sockaddr *)&a, sizeof a);
  } else {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port), .sin_addr.s_addr = htonl(INADDR_ANY)};
    rc = bind(fd, (struct sockaddr *)&a, sizeof a);
  }
  if (rc != 0 || listen(fd, 1024) != 0) {
    int e = errno;
    server_free(s);
    return gl_error_null("rendezvous: rank 0 cannot serve on port %d (MASTER_PORT): %s", port, strerror(e));
  }
  if (pthread_create(&s->thread, NULL, server_main, s) != 0) {
    server_free(s);
    return gl_error_null("rendezvous: cannot start the server thread");
  }
  return s;
}

static void server_stop(server *s) {
  if (!s) return;
  ssize_t k = write(s->wake[1], "x", 1);
  (void)k;
  pthread_join(s->thread, NULL);
  server_free(s);
}

/* ---- client ------------------------------------------------------------- */
/* One connect attempt to every address of host:port; the socket or -1 with
   the last error in *err. */
static int connect_once(const char *host, int port, int *err) {
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
  int g = getaddrinfo(host, ps, &hints, &res);
  if (g != 0) { *err = -g; return -1; }
  int fd = -1;
  for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) { *err = errno; continue; }
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) { *err = errno; close(fd); fd = -1; }
  }
  freeaddrinfo(res);
  return fd;
}

gl_tcp_store *gl_tcp_store_open(const char *host, int port, int serve, double timeout_s) {
  GL_NONNULL_OR(NULL, "gl_tcp_store_open", host);
  if (port < 1 || port > 65535) return gl_error_null("rendezvous: port expected 1..65535, got %d", port);
  gl_tcp_store *s = calloc(1, sizeof *s);
  if (!s) return gl_error_null("rendezvous: out of host memory");
  s->fd = -1;
  if (serve && !(s->srv = server_start(port))) { free(s); return NULL; }
  double t0 = now_s();
  int err = 0;
  while ((s->fd = connect_once(host, port, &err)) < 0) {
    if (err < 0 || now_s() - t0 > timeout_s) {
      server_stop(s->srv);
      free(s);
      if (err < 0)
        return gl_error_null("rendezvous: cannot resolve MASTER_ADDR %s: %s", host, gai_strerror(-err));
      return gl_error_null("rendezvous: cannot reach %s:%d (MASTER_ADDR:MASTER_PORT, served by rank 0) "
                           "within %.1f s: %s", host, port, timeout_s, strerror(err));
    }
    sleep_s(0.05);
  }
  int one = 1;
  setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  /* A request that gets no reply within the timeout (rank 0's node lost its
     link: no reset ever comes, TCP would retry for many minutes) counts as
     the store lost, so a blocked rank ends instead of hanging. */
  struct timeval tv = {.tv_sec = (time_t)timeout_s, .tv_usec = (suseconds_t)((timeout_s - (double)(time_t)timeout_s) * 1e6)};
  setsockopt(s->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(s->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  struct sockaddr_storage me;
  socklen_t len = sizeof me;
  if (getsockname(s->fd, (struct sockaddr *)&me, &len) == 0)
    getnameinfo((struct sockaddr *)&me, len, s->local_addr, sizeof s->local_addr, NULL, 0, NI_NUMERICHOST);
  return s;
}

const char *gl_tcp_store_local_addr(const gl_tcp_store *s) { return s ? s->local_addr : ""; }

static int lost(gl_tcp_store *s, const char *what) {
  if (s->fd >= 0) close(s->fd);
  s->fd = -1;
  gl_error("rendezvous: %s: lost the connection to the store (rank 0 ended)", what);
  return GL_TCP_STORE_LOST;
}

static int send_request(gl_tcp_store *s, uint8_t op, const char *key, const void *val, size_t n, const char *fn) {
  if (s->fd < 0) return lost(s, fn);
  size_t klen = strlen(key);
  if (klen > MAX_KEY) return gl_error("%s: key of %zu bytes, expected at most %d", fn, klen, MAX_KEY);
  if (n > MAX_VALUE) return gl_error("%s: value of %zu bytes, expected at most %d", fn, n, MAX_VALUE);
  uint32_t k32 = (uint32_t)klen, n32 = (uint32_t)n;
  if (write_all(s->fd, &op, 1) || write_all(s->fd, &k32, 4) || write_all(s->fd, key, klen)) return lost(s, fn);
  if (op == OP_SET && (write_all(s->fd, &n32, 4) || (n && write_all(s->fd, val, n)))) return lost(s, fn);
  return GL_OK;
}

int gl_tcp_store_set(gl_tcp_store *s, const char *key, const void *val, size_t n) {
  GL_NONNULL("gl_tcp_store_set", s, key);
  int rc = send_request(s, OP_SET, key, val, n, "gl_tcp_store_set");
  if (rc != GL_OK) return rc;
  uint8_t ok = 0;
  if (read_all(s->fd, &ok, 1)) return lost(s, "gl_tcp_store_set");
  if (!ok) return gl_error("gl_tcp_store_set: the store (rank 0) is out of memory");
  return GL_OK;
}

int gl_tcp_store_try_get(gl_tcp_store *s, const char *key, void **val, size_t *n, int *found) {
  GL_NONNULL("gl_tcp_store_try_get", s, key, val, n, found);
  *val = NULL; *n = 0; *found = 0;
  int rc = send_request(s, OP_TRY_GET, key, NULL, 0, "gl_tcp_store_try_get");
  if (rc != GL_OK) return rc;
  uint8_t f = 0;
  if (read_all(s->fd, &f, 1)) return lost(s, "gl_tcp_store_try_get");
  if (!f) return GL_OK;
  uint32_t len = 0;
  if (read_all(s->fd, &len, 4)) return lost(s, "gl_tcp_store_try_get");
  void *v = malloc(len + 1);   /* +1: a NUL for callers that read text */
  if (!v) return gl_error("gl_tcp_store_try_get: out of host memory");
  if (read_all(s->fd, v, len)) { free(v); return lost(s, "gl_tcp_store_try_get"); }
  ((char *)v)[len] = 0;
  *val = v; *n = len; *found = 1;
  return GL_OK;
}

void gl_tcp_store_close(gl_tcp_store *s, double linger_s) {
  if (!s) return;
  if (s->srv) {   /* wait for the others (our own connection is one client) */
    double t0 = now_s();
    for (;;) {
      pthread_mutex_lock(&s->srv->lock);
      int n = s->srv->nclients;
      pthread_mutex_unlock(&s->srv->lock);
      if (n <= 1 || now_s() - t0 > linger_s) break;
      sleep_s(0.005);
    }
  }
  if (s->fd >= 0) close(s->fd);
  server_stop(s->srv);
  free(s);
}
