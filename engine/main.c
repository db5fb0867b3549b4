/* main.c — the gptlua executable: LuaJIT with the gptlua library on its
 * path and GNU readline for the REPL.  It locates the Lua tree and the
 * engine library, exposes readline (Ctrl-C, Tab completion, history) and the
 * REPL's Ctrl-C hook to Lua as the GPTLUA table, and hands the command line
 * to lua/gptlua/cli.lua, which does everything else (scripts, -e, REPL, -n). */
#include <errno.h>
#include <fcntl.h>
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <lualib.h>
#include <luajit.h>
#include <readline/history.h>
#include <readline/readline.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifndef GL_VERSION_STR
#define GL_VERSION_STR "0.1.0"
#endif

static int file_exists(const char *p) { struct stat sb; return stat(p, &sb) == 0; }

/* ---- Ctrl-C ---------------------------------------------------------------
   At the prompt a Ctrl-C clears the line being typed (readline's callback
   interface, as Python's readline module does it); while a REPL statement
   runs it sets a LuaJIT hook that raises "interrupted" at the next call,
   return or instruction of interpreted code (lua.c's way), so the statement
   stops and the session stays.  Compiled traces never run hooks, which is
   why the REPL runs its statements with the JIT off (library code stays
   compiled); a third Ctrl-C that is still not taken exits (status 130). */
static lua_State *interrupt_L;               /* the state the statement runs in */
static volatile sig_atomic_t sigint_count;   /* Ctrl-Cs not taken yet */
enum { OUTSIDE, AT_PROMPT, RUNNING, BETWEEN };
static volatile sig_atomic_t repl_state;     /* what a Ctrl-C interrupts */

static void interrupt_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  sigint_count = 0;
  lua_pushliteral(L, "interrupted");
  lua_error(L);
}

static void on_sigint(int sig) {
  (void)sig;
  sigint_count++;
  if (repl_state != RUNNING) return;  /* the prompt takes it; between statements it is dropped */
  if (sigint_count >= 3) {
    static const char msg[] = "\ngptlua: interrupt not taken (running compiled or C code); exiting\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    _exit(130);
  }
  if (interrupt_L) lua_sethook(interrupt_L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

/* (re)installs the handler: a statement may have replaced it (any code
   may catch SIGINT; the trainer does, to checkpoint, and puts ours back) */
static void catch_sigint(int state) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);  /* no SA_RESTART: a wait returns EINTR */
  sigaction(SIGINT, &sa, NULL);
  sigint_count = 0;
  repl_state = state;
}

/* interruptible(on): with on, Ctrl-C interrupts the Lua code that runs
   until interruptible(false), which drops an interrupt not yet taken */
static int l_interruptible(lua_State *L) {
  interrupt_L = L;
  lua_sethook(L, NULL, 0, 0);
  catch_sigint(lua_toboolean(L, 1) ? RUNNING : BETWEEN);
  return 0;
}

/* ---- readline ------------------------------------------------------------ */
static char *line_read;
static int line_done;
static void on_line(char *line) {
  line_read = line;
  line_done = 1;
  rl_callback_handler_remove();
}

/* Tab: inside a string, file names; elsewhere Lua names and fields from
   GPTLUA.complete(text, line, start) (lua/gptlua/repl.lua) */
static lua_State *complete_L;
static char **lua_matches;
static int lua_matches_next;
static char *next_lua_match(const char *text, int state) {
  (void)text;
  if (!lua_matches || !lua_matches[lua_matches_next]) return NULL;
  (void)state;
  return strdup(lua_matches[lua_matches_next++]);
}
static void free_lua_matches(void) {
  if (!lua_matches) return;
  for (int i = 0; lua_matches[i]; i++) free(lua_matches[i]);
  free(lua_matches);
  lua_matches = NULL;
}
static char **complete(const char *text, int start, int end) {
  (void)end;
  rl_attempted_completion_over = 1;  /* never fall back to file names outside strings */
  if (rl_completion_quote_character) {  /* a path in a string: no space after it */
    rl_completion_append_character = '\0';
    return rl_completion_matches(text, rl_filename_completion_function);
  }
  lua_State *L = complete_L;
  if (!L) return NULL;
  int top = lua_gettop(L);
  lua_getglobal(L, "GPTLUA");
  lua_getfield(L, -1, "complete");
  if (!lua_isfunction(L, -1)) { lua_settop(L, top); return NULL; }
  lua_pushstring(L, text);
  lua_pushstring(L, rl_line_buffer);
  lua_pushinteger(L, start);
  char **out = NULL;
  if (lua_pcall(L, 3, 1, 0) == 0 && lua_istable(L, -1)) {
    int n = (int)lua_objlen(L, -1);
    free_lua_matches();
    lua_matches = calloc((size_t)n + 1, sizeof *lua_matches);
    int k = 0;
    for (int i = 1; lua_matches && i <= n; i++) {
      lua_rawgeti(L, -1, i);
      if (lua_isstring(L, -1)) lua_matches[k++] = strdup(lua_tostring(L, -1));
      lua_pop(L, 1);
    }
    lua_matches_next = 0;
    rl_completion_append_character = '\0';  /* the candidates carry their own "(" or "." */
    if (k > 0) out = rl_completion_matches(text, next_lua_match);
    free_lua_matches();
  }
  lua_settop(L, top);
  return out;
}

/* a character inside a Lua string: readline then keeps it in the word (a
   path's leading "/" is not the division that breaks words outside) */
static int in_string(char *line, int index) {
  char open = 0;
  for (int i = 0; i < index && line[i]; i++) {
    if (open && line[i] == '\\') i++;
    else if (open && line[i] == open) open = 0;
    else if (!open && (line[i] == '"' || line[i] == '\'')) open = line[i];
  }
  return open && line[index] != open;
}

/* readline(prompt[, fd]) -> the line; nil at end of input; false after a
   Ctrl-C (the line typed so far is dropped); with fd (gptlua attach's
   socket): nil, "fd" when fd turns readable while the user types (the job
   went away), the line typed so far dropped */
static int l_readline(lua_State *L) {
  const char *prompt = luaL_optstring(L, 1, "> ");
  int watch = (int)luaL_optinteger(L, 2, -1);
  int watched = 0;
  complete_L = L;
  sigset_t block, orig;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigprocmask(SIG_BLOCK, &block, &orig);
  catch_sigint(AT_PROMPT);
  line_read = NULL;
  line_done = 0;
  int interrupted = 0;
  rl_callback_handler_install(prompt, on_line);
  while (!line_done) {
    if (sigint_count) {
      interrupted = 1;
      rl_free_line_state();
      rl_callback_sigcleanup();
      rl_cleanup_after_signal();
      rl_callback_handler_remove();
      fputs("^C\n", rl_outstream ? rl_outstream : stdout);
      fflush(rl_outstream ? rl_outstream : stdout);
      break;
    }
    int fd = fileno(rl_instream ? rl_instream : stdin);
    fd_set fds;
    FD_ZERO(&fds);
    FD_SET(fd, &fds);
    if (watch >= 0) FD_SET(watch, &fds);
    /* SIGINT is blocked except inside pselect: none is lost between the check and the wait */
    int r = pselect((watch > fd ? watch : fd) + 1, &fds, NULL, NULL, NULL, &orig);
    if (r < 0) {
      if (errno == EINTR) continue;
      rl_callback_handler_remove();
      break;
    }
    if (watch >= 0 && FD_ISSET(watch, &fds)) {
      watched = 1;
      rl_free_line_state();
      rl_callback_handler_remove();
      fputs("\n", rl_outstream ? rl_outstream : stdout);
      break;
    }
    if (!FD_ISSET(fd, &fds)) continue;
    /* input ready and a Ctrl-C pending too (keys typed right after it):
       pselect reports the input, so take the Ctrl-C first */
    struct timespec now = { 0, 0 };
    if (sigtimedwait(&block, NULL, &now) == SIGINT) { sigint_count++; continue; }
    rl_callback_read_char();
  }
  repl_state = BETWEEN;
  sigint_count = 0;
  sigprocmask(SIG_SETMASK, &orig, NULL);
  complete_L = NULL;
  if (interrupted) { lua_pushboolean(L, 0); return 1; }
  if (watched) { lua_pushnil(L); lua_pushliteral(L, "fd"); return 2; }
  if (!line_read) { lua_pushnil(L); return 1; }
  lua_pushstring(L, line_read);
  free(line_read);
  return 1;
}

/* add_history(entry[, file]): one entry (a whole statement, lines and all)
   into the session's history and, at once, appended to the file */
static int l_add_history(lua_State *L) {
  add_history(luaL_checkstring(L, 1));
  const char *path = luaL_optstring(L, 2, NULL);
  int ok = 1;
  if (path) {
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0600);  /* append_history needs the file */
    if (fd >= 0) close(fd);
    ok = fd >= 0 && append_history(1, path) == 0;
  }
  lua_pushboolean(L, ok);
  return 1;
}
/* read_history(file[, keep]): loads the file, then trims it to its last `keep` entries */
static int l_read_history(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int keep = (int)luaL_optinteger(L, 2, 1000);
  /* multi-line entries only in a file that has timestamps between its
     entries (one written by an older gptlua has none: one entry a line) */
  FILE *f = fopen(path, "r");
  int c0 = f ? fgetc(f) : EOF, c1 = f ? fgetc(f) : EOF;
  if (f) fclose(f);
  history_multiline_entries = c0 == EOF || (c0 == '#' && c1 >= '0' && c1 <= '9');
  int ok = read_history(path) == 0;
  if (ok) history_truncate_file(path, keep);
  lua_pushboolean(L, ok);
  return 1;
}
static int l_isatty(lua_State *L) { lua_pushboolean(L, isatty((int)luaL_optinteger(L, 1, 0))); return 1; }

static void init_readline(void) {
  rl_readline_name = "gptlua";
  rl_catch_signals = 0;  /* Ctrl-C is ours (above) */
  rl_attempted_completion_function = complete;
  /* a Lua name with its fields and methods (gl.ra, x:nar) is one word */
  rl_basic_word_break_characters = " \t\n\"'`@$><=;|&{(+-*/%^~#,[]})";
  rl_completer_quote_characters = "\"'";
  rl_char_is_quoted_p = in_string;
  history_comment_char = '#';   /* timestamp lines "#<time>" ... */
  history_write_timestamps = 1;  /* ... separate entries, so the file keeps multi-line statements whole */
  stifle_history(1000);
}

/* Finds the Lua tree and library next to the executable: the source tree
   (build/gptlua with ../lua, build/sim/gptlua with ../../lua) or an install (bin/gptlua with
   ../share/gptlua/lua and ../lib). */
static void locate(char *exe, char *root, char *libdir, size_t n) {
  ssize_t k = readlink("/proc/self/exe", exe, n - 1);
  if (k <= 0) { snprintf(exe, n, "gptlua"); k = 6; }
  exe[k] = 0;
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", exe);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
  char probe[PATH_MAX + 64];
  snprintf(probe, sizeof probe, "%s/../lua/gptlua/init.lua", dir);
  char probe2[PATH_MAX + 64];  /* build/sim/gptlua: the CUDA simulator build */
  snprintf(probe2, sizeof probe2, "%s/../../lua/gptlua/init.lua", dir);
  if (file_exists(probe)) {
    snprintf(root, n, "%s/..", dir);
    snprintf(libdir, n, "%s", dir);
  } else if (file_exists(probe2)) {
    snprintf(root, n, "%s/../..", dir);
    snprintf(libdir, n, "%s", dir);
  } else {
    snprintf(root, n, "%s/../share/gptlua", dir);
    snprintf(libdir, n, "%s/../lib", dir);
  }
  char buf[PATH_MAX];
  if (realpath(root, buf)) snprintf(root, n, "%s", buf);
  if (realpath(libdir, buf)) snprintf(libdir, n, "%s", buf);
}

int main(int argc, char **argv) {
  char exe[PATH_MAX], root[PATH_MAX], libdir[PATH_MAX];
  /* OpenMP threads that spin long between parallel regions steal the core
     the other thread (or rank, or loader) needs on small machines, and ones
     that sleep at once pay a futex wake per region (hundreds per training
     step): spin briefly (a few microseconds), then sleep.  Must be set
     before libgomp initialises; a user's setting of either variable wins. */
  if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) {
    setenv("OMP_WAIT_POLICY", "ACTIVE", 1);
    setenv("GOMP_SPINCOUNT", "2000", 1);
  }
  locate(exe, root, libdir, PATH_MAX);

  lua_State *L = luaL_newstate();
  if (!L) { fprintf(stderr, "gptlua: cannot create the Lua state (out of memory)\n"); return 1; }
  luaL_openlibs(L);
  init_readline();

  lua_newtable(L);
  lua_pushstring(L, exe); lua_setfield(L, -2, "exe");
  lua_pushstring(L, root); lua_setfield(L, -2, "root");
  lua_pushstring(L, libdir); lua_setfield(L, -2, "libdir");
  lua_pushstring(L, GL_VERSION_STR); lua_setfield(L, -2, "version");
  lua_pushcfunction(L, l_readline); lua_setfield(L, -2, "readline");
  lua_pushcfunction(L, l_add_history); lua_setfield(L, -2, "add_history");
  lua_pushcfunction(L, l_read_history); lua_setfield(L, -2, "read_history");
  lua_pushcfunction(L, l_interruptible); lua_setfield(L, -2, "interruptible");
  lua_pushcfunction(L, l_isatty); lua_setfield(L, -2, "isatty");
  lua_newtable(L);
  for (int i = 0; i < argc; i++) { lua_pushstring(L, argv[i]); lua_rawseti(L, -2, i); }
  lua_setfield(L, -2, "argv");
  lua_setglobal(L, "GPTLUA");

  char boot[4 * PATH_MAX];
  snprintf(boot, sizeof boot,
           "package.path = '%s/lua/?.lua;%s/lua/?/init.lua;' .. package.path\n"
           "return require('gptlua.cli').main(GPTLUA.argv)", root, root);
  int status;
  if (luaL_loadbuffer(L, boot, strlen(boot), "=gptlua") != 0 || lua_pcall(L, 0, 1, 0) != 0) {
    fprintf(stderr, "gptlua: %s\n", lua_tostring(L, -1));
    status = 1;
  } else {
    status = lua_isnumber(L, -1) ? (int)lua_tointeger(L, -1) : 0;
  }
  fflush(stdout);
  lua_close(L);
  return status;
}
