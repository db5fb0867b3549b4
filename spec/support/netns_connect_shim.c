/* Preloaded (LD_PRELOAD) into processes whose TCP connections to some
 * addresses must pass netns_relay: connect() to an IPv4 address listed in
 * GPTLUA_RELAY_TO (comma-separated) connects to 127.0.0.1:GPTLUA_RELAY_PORT
 * instead, sends the real destination and returns as the relay's own
 * connect did (0, or -1 with its errno).  Blocking for that exchange even
 * on a non-blocking socket (a connect that completes at once is allowed
 * there), the socket's flags restored after.  Every other connect is
 * untouched.  Build: cc -O2 -shared -fPIC -o netns_connect_shim.so
 * netns_connect_shim.c -ldl */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int listed(const char *ip, const char *list) {
  size_t n = strlen(ip);
  for (const char *p = list; *p;) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == n && strncmp(p, ip, n) == 0) return 1;
    if (!e) break;
    p = e + 1;
  }
  return 0;
}

int connect(int fd, const struct sockaddr *sa, socklen_t len) {
  static int (*real)(int, const struct sockaddr *, socklen_t);
  if (!real) real = (int (*)(int, const struct sockaddr *, socklen_t))dlsym(RTLD_NEXT, "connect");
  const char *list = getenv("GPTLUA_RELAY_TO"), *port = getenv("GPTLUA_RELAY_PORT");
  int type = 0;
  socklen_t tl = sizeof type;
  if (!list || !port || !sa || sa->sa_family != AF_INET || len < sizeof(struct sockaddr_in) ||
      getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM)
    return real(fd, sa, len);
  const struct sockaddr_in *to = (const struct sockaddr_in *)sa;
  char ip[INET_ADDRSTRLEN];
  if (!inet_ntop(AF_INET, &to->sin_addr, ip, sizeof ip) || !listed(ip, list)) return real(fd, sa, len);
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  struct sockaddr_in relay = {0};
  relay.sin_family = AF_INET;
  relay.sin_port = htons((unsigned short)atoi(port));
  relay.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int rc = real(fd, (const struct sockaddr *)&relay, sizeof relay), err = errno;
  if (rc == 0) {
    unsigned char hdr[6], status = EIO;
    memcpy(hdr, &to->sin_addr, 4);
    memcpy(hdr + 4, &to->sin_port, 2);
    ssize_t k;
    do k = write(fd, hdr, sizeof hdr); while (k < 0 && errno == EINTR);
    if (k == (ssize_t)sizeof hdr) {
      do k = read(fd, &status, 1); while (k < 0 && errno == EINTR);
      if (k != 1) status = ECONNREFUSED;   /* the relay closed without a verdict */
    }
    if (status) rc = -1, err = status;
  }
  fcntl(fd, F_SETFL, flags);
  errno = err;
  return rc;
}
