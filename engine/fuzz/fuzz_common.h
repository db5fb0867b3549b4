/* fuzz_common.h — shared by the libFuzzer harnesses in engine/fuzz/ (`make
 * fuzz`, `make fuzz-ci`).  The parsers under test take paths, so each input
 * is written to a file in a per-process directory on tmpfs (/dev/shm, else
 * $TMPDIR or /tmp) and the public entry point opens that file.  A harness
 * returns 0 for any input the engine refuses with an error (that is the
 * contract); a crash, a sanitizer report, a hang (-timeout=) or a broken
 * invariant (fuzz_require: abort with the message) is a finding. */
#ifndef GL_FUZZ_COMMON_H
#define GL_FUZZ_COMMON_H
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char fuzz_dir[256];

/* removes the scratch directory (its files are flat) when libFuzzer exits;
   after a crash it stays, next to the crash's own artifact */
static void fuzz_cleanup(void) {
  DIR *d = opendir(fuzz_dir);
  if (!d) return;
  char p[512];
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') { snprintf(p, sizeof p, "%s/%s", fuzz_dir, e->d_name); unlink(p); }
  closedir(d);
  rmdir(fuzz_dir);
}

/* the per-process scratch directory, created once */
static const char *fuzz_scratch(void) {
  if (fuzz_dir[0]) return fuzz_dir;
  const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : (getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  snprintf(fuzz_dir, sizeof fuzz_dir, "%s/gptlua-fuzz-%d", base, (int)getpid());
  mkdir(fuzz_dir, 0700);
  atexit(fuzz_cleanup);
  return fuzz_dir;
}

/* dir/name (a static buffer per call site is enough: harnesses are serial) */
static void fuzz_path(char *out, size_t n, const char *name) {
  snprintf(out, n, "%s/%s", fuzz_scratch(), name);
}

static void fuzz_write(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) { perror(path); abort(); }
  if (n && fwrite(data, 1, n, f) != n) { perror(path); abort(); }
  fclose(f);
}

/* an invariant of the code under test: a violation is a finding */
#define fuzz_require(cond, ...) do { if (!(cond)) { \
  fprintf(stderr, "fuzz: invariant broken at %s:%d: ", __FILE__, __LINE__); \
  fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); abort(); } } while (0)

#endif
