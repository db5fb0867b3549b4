/* main.c — the gptlua executable: LuaJIT with the gptlua library on its
 * path and GNU readline for the REPL.  It only locates the Lua tree and the
 * engine library, exposes readline to Lua, and hands the command line to
 * lua/gptlua/cli.lua, which does everything else (scripts, -e, REPL, -n). */
#include <lauxlib.h>
#include <limits.h>
#include <lua.h>
#include <lualib.h>
#include <luajit.h>
#include <readline/history.h>
#include <readline/readline.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef GL_VERSION_STR
#define GL_VERSION_STR "0.1.0"
#endif

static int file_exists(const char *p) { struct stat sb; return stat(p, &sb) == 0; }

/* readline(prompt) -> line or nil at end of input */
static int l_readline(lua_State *L) {
  const char *prompt = luaL_optstring(L, 1, "> ");
  char *line = readline(prompt);
  if (!line) { lua_pushnil(L); return 1; }
  lua_pushstring(L, line);
  free(line);
  return 1;
}
static int l_add_history(lua_State *L) { add_history(luaL_checkstring(L, 1)); return 0; }
static int l_read_history(lua_State *L) { lua_pushboolean(L, read_history(luaL_checkstring(L, 1)) == 0); return 1; }
static int l_write_history(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int keep = (int)luaL_optinteger(L, 2, 1000);
  int ok = write_history(path) == 0;
  if (ok) history_truncate_file(path, keep);
  lua_pushboolean(L, ok);
  return 1;
}
static int l_isatty(lua_State *L) { lua_pushboolean(L, isatty((int)luaL_optinteger(L, 1, 0))); return 1; }

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

  lua_newtable(L);
  lua_pushstring(L, exe); lua_setfield(L, -2, "exe");
  lua_pushstring(L, root); lua_setfield(L, -2, "root");
  lua_pushstring(L, libdir); lua_setfield(L, -2, "libdir");
  lua_pushstring(L, GL_VERSION_STR); lua_setfield(L, -2, "version");
  lua_pushcfunction(L, l_readline); lua_setfield(L, -2, "readline");
  lua_pushcfunction(L, l_add_history); lua_setfield(L, -2, "add_history");
  lua_pushcfunction(L, l_read_history); lua_setfield(L, -2, "read_history");
  lua_pushcfunction(L, l_write_history); lua_setfield(L, -2, "write_history");
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
