-- gptlua.libc — the C library's functions that gptlua calls through the FFI,
-- each declared once, here: two modules declaring one function with
-- different types would make the second declaration fail (silently, under
-- pcall) and its callers pass the wrong type.  And the clocks: one
-- clock_gettime read three ways.
--   libc.C            ffi.C, with every declaration below made
--   libc.monotonic()  seconds of CLOCK_MONOTONIC: durations, deadlines
--   libc.realtime()   seconds since the epoch, to the microsecond: timestamps
--   libc.cpu_seconds()  CPU seconds of the whole process (all its threads)
--   libc.thread_cpu_seconds()  CPU seconds of the calling thread
local ffi = require 'ffi'

local M = {}

local DECLARATIONS = {
  -- files and processes
  'int mkdir(const char *path, unsigned int mode);',
  'int access(const char *path, int mode);',
  'int unlink(const char *path);',
  'int chmod(const char *path, unsigned mode);',
  'char *realpath(const char *path, char *resolved);',
  'void free(void *p);',
  'char *strerror(int errnum);',
  'unsigned umask(unsigned mask);',
  'unsigned geteuid(void);',
  'unsigned int getuid(void);',
  'int getpid(void);',
  'int kill(int pid, int sig);',
  'int waitpid(int pid, int *status, int options);',
  'int setenv(const char *name, const char *value, int overwrite);',
  'extern char **environ;',
  'int usleep(unsigned int usec);',
  'double pow(double x, double y);',
  'struct gl_passwd { char *pw_name; };',
  'struct gl_passwd *getpwuid(unsigned uid);',
  -- posix_spawn (glibc's posix_spawnattr_t is 336 bytes; an opaque block larger than that)
  [[typedef struct { long opaque_[64]; } gl_spawnattr_t;
    int posix_spawnattr_init(gl_spawnattr_t *attr);
    int posix_spawnattr_destroy(gl_spawnattr_t *attr);
    int posix_spawnattr_setflags(gl_spawnattr_t *attr, short flags);
    int posix_spawnattr_setpgroup(gl_spawnattr_t *attr, int pgroup);
    int posix_spawnp(int *pid, const char *file, const void *file_actions, const gl_spawnattr_t *attrp,
                     char *const argv[], char *const envp[]);]],
  -- sockets and polling
  'int socket(int domain, int type, int protocol);',
  'int bind(int fd, const void *addr, unsigned len);',
  'int listen(int fd, int backlog);',
  'int connect(int fd, const void *addr, unsigned len);',
  'int accept4(int fd, void *addr, void *len, int flags);',
  'int getsockname(int fd, void *addr, unsigned int *len);',
  'int getsockopt(int fd, int level, int name, void *val, unsigned *len);',
  'int close(int fd);',
  'long recv(int fd, void *buf, size_t n, int flags);',
  'long send(int fd, const void *buf, size_t n, int flags);',
  'int shutdown(int fd, int how);',
  'int setsockopt(int fd, int level, int name, const void *val, unsigned len);',
  'struct gl_sockaddr_un { unsigned short sun_family; char sun_path[108]; };',
  'struct gl_ucred { int pid; unsigned uid; unsigned gid; };',
  'struct gl_pollfd { int fd; short events; short revents; };',
  'int poll(struct gl_pollfd *fds, unsigned long n, int timeout_ms);',
  [[struct gl_addrinfo { int ai_flags; int ai_family; int ai_socktype; int ai_protocol; unsigned ai_addrlen;
      void *ai_addr; char *ai_canonname; struct gl_addrinfo *ai_next; };
    int getaddrinfo(const char *node, const char *service, const struct gl_addrinfo *hints,
                    struct gl_addrinfo **res);
    void freeaddrinfo(struct gl_addrinfo *res);
    const char *gai_strerror(int errcode);]],
  -- the clock
  'struct gl_timespec { long tv_sec; long tv_nsec; };',
  'int clock_gettime(int clk_id, struct gl_timespec *tp);',
}
for _, decl in ipairs(DECLARATIONS) do pcall(ffi.cdef, decl) end
M.C = ffi.C

local CLOCK_REALTIME, CLOCK_MONOTONIC, CLOCK_PROCESS_CPUTIME_ID, CLOCK_THREAD_CPUTIME_ID = 0, 1, 2, 3
local ts = ffi.new('struct gl_timespec')
local function seconds(clock)
  ffi.C.clock_gettime(clock, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
function M.monotonic() return seconds(CLOCK_MONOTONIC) end
function M.realtime()  -- to the microsecond: what a timestamp in metrics.jsonl keeps
  ffi.C.clock_gettime(CLOCK_REALTIME, ts)
  return tonumber(ts.tv_sec) + math.floor(tonumber(ts.tv_nsec) / 1e3) * 1e-6
end
function M.cpu_seconds() return seconds(CLOCK_PROCESS_CPUTIME_ID) end
function M.thread_cpu_seconds() return seconds(CLOCK_THREAD_CPUTIME_ID) end

return M
