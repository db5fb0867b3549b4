/* A latency relay for links that tc cannot delay (kernels without netem):
 * a TCP proxy on 127.0.0.1:PORT that holds every byte DELAY_MS in each
 * direction before forwarding it, in order.  The processes whose
 * connections it carries run with netns_connect_shim.so preloaded: their
 * connect() to a relayed address reaches this relay instead, sends the
 * real destination (4 address bytes, 2 port bytes, network order) and
 * reads one status byte back (0, or the errno of the relay's own connect),
 * so a refused destination is refused to the caller as without the relay.
 *
 *   netns_relay PORT DELAY_MS
 *
 * One process per connection (fork): a connection's two directions are one
 * poll loop, each a queue of chunks stamped with the time they may leave;
 * the end of a direction (FIN) is delayed like its bytes.  Build:
 * cc -O2 -o netns_relay netns_relay.c */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* bytes a direction may hold before it stops reading (above the
   bandwidth-delay product of any link it is meant for: 20 ms at 1 GB/s) */
#define CAP (32 << 20)
#define CHUNK 65536

struct chunk { struct chunk *next; double due; size_t len, off; int fin; char data[]; };
struct dir { int src, dst, eof_read, done; size_t held; struct chunk *head, *tail; };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void push(struct dir *d, const char *p, size_t n, int fin, double due) {
  struct chunk *c = malloc(sizeof *c + n);
  if (!c) { perror("netns_relay: malloc"); exit(1); }
  c->next = NULL, c->due = due, c->len = n, c->off = 0, c->fin = fin;
  memcpy(c->data, p, n);
  if (d->tail) d->tail->next = c; else d->head = c;
  d->tail = c;
  d->held += n;
}

static void pop(struct dir *d) {
  struct chunk *c = d->head;
  d->head = c->next;
  if (!d->head) d->tail = NULL;
  d->held -= c->len;
  free(c);
}

static int read_full(int fd, void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = read(fd, (char *)p + got, n - got);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    got += (size_t)k;
  }
  return 0;
}

static void serve(int c, double delay) {
  unsigned char hdr[6];
  if (read_full(c, hdr, sizeof hdr) != 0) exit(0);
  struct sockaddr_in to = {0};
  to.sin_family = AF_INET;
  memcpy(&to.sin_addr, hdr, 4);
  memcpy(&to.sin_port, hdr + 4, 2);
  int d = socket(AF_INET, SOCK_STREAM, 0);
  unsigned char status = 0;
  if (d < 0 || connect(d, (struct sockaddr *)&to, sizeof to) != 0) status = (unsigned char)(errno ? errno : EIO);
  if (write(c, &status, 1) != 1 || status) exit(0);
  int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(d, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(c, F_SETFL, fcntl(c, F_GETFL) | O_NONBLOCK);
  fcntl(d, F_SETFL, fcntl(d, F_GETFL) | O_NONBLOCK);
  struct dir dirs[2] = {{.src = c, .dst = d}, {.src = d, .dst = c}};
  static char buf[CHUNK];
  while (!(dirs[0].done && dirs[1].done)) {
    struct pollfd p[4];
    int np = 0, in[2] = {-1, -1}, out[2] = {-1, -1};
    double t = now(), wait = -1;
    for (int i = 0; i < 2; i++) {
      struct dir *x = &dirs[i];
      if (!x->eof_read && x->held < CAP) { in[i] = np; p[np++] = (struct pollfd){x->src, POLLIN, 0}; }
      if (x->head) {
        if (x->head->due <= t) { out[i] = np; p[np++] = (struct pollfd){x->dst, POLLOUT, 0}; }
        else if (wait < 0 || x->head->due - t < wait) wait = x->head->due - t;
      }
    }
    struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
    int r = ppoll(p, (nfds_t)np, wait < 0 ? NULL : &ts, NULL);
    if (r < 0) { if (errno == EINTR) continue; exit(1); }
    for (int i = 0; i < 2; i++) {
      struct dir *x = &dirs[i];
      if (in[i] >= 0 && p[in[i]].revents) {
        ssize_t k = read(x->src, buf, sizeof buf);
        if (k > 0) push(x, buf, (size_t)k, 0, now() + delay);
        else if (k == 0) { x->eof_read = 1; push(x, NULL, 0, 1, now() + delay); }
        else if (errno != EAGAIN && errno != EINTR) exit(0);   /* reset: closing both passes it on */
      }
      if (out[i] >= 0 && p[out[i]].revents) {
        while (x->head && x->head->due <= now()) {
          struct chunk *h = x->head;
          if (h->fin) { shutdown(x->dst, SHUT_WR); x->done = 1; pop(x); break; }
          ssize_t k = write(x->dst, h->data + h->off, h->len - h->off);
          if (k < 0) { if (errno == EAGAIN || errno == EINTR) break; exit(0); }
          h->off += (size_t)k;
          if (h->off < h->len) break;
          pop(x);
        }
      }
    }
  }
  exit(0);
}

int main(int argc, char **argv) {
  if (argc != 3) { fprintf(stderr, "usage: netns_relay PORT DELAY_MS\n"); return 2; }
  int port = atoi(argv[1]);
  double delay = atof(argv[2]) / 1000;
  if (port < 1 || port > 65535 || !(delay >= 0)) {
    fprintf(stderr, "netns_relay: expected a port 1..65535 and a delay >= 0 ms, got %s %s\n", argv[1], argv[2]);
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  signal(SIGCHLD, SIG_IGN);   /* no zombies: the children are never waited for */
  int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons((unsigned short)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 128) != 0) {
    fprintf(stderr, "netns_relay: cannot listen on 127.0.0.1:%d: %s\n", port, strerror(errno));
    return 1;
  }
  printf("listening\n");
  fflush(stdout);
  for (;;) {
    int c = accept(s, NULL, NULL);
    if (c < 0) { if (errno == EINTR) continue; perror("netns_relay: accept"); return 1; }
    pid_t pid = fork();
    if (pid == 0) { close(s); serve(c, delay); }
    close(c);
  }
}
