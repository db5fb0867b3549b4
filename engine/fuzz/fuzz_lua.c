/* fuzz_lua.c — libFuzzer harness for the parsers written in Lua (checkpoint
 * state.json validation, the config/command-line parser).  It embeds LuaJIT,
 * loads engine/fuzz/targets.lua once and calls the target FUZZ_TARGET (a
 * compile-time name) with each input under pcall.  Any Lua error is fine if
 * it is a clean one-line message (targets.lua says what that is and raises
 * "fuzz finding: ..." otherwise); a crash, a hang (-timeout=) or an unclean
 * error is a finding, reported by abort().
 *
 * Coverage: LuaJIT is not instrumented, so on its own libFuzzer would see only
 * this file's few edges.  A line hook feeds the Lua side's coverage back
 * instead: every (source, line) executed bumps one byte of libFuzzer's extra
 * counters (the __libfuzzer_extra_counters section), so inputs reaching new
 * lines of the Lua parsers are kept like new C edges.  The hook runs the
 * parsers in the interpreter (no JIT traces), which is what we fuzz anyway. */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef FUZZ_TARGET
#error "FUZZ_TARGET (the target's name in engine/fuzz/targets.lua) must be defined"
#endif
#ifndef FUZZ_ROOT
#error "FUZZ_ROOT (the source tree) must be defined"
#endif

enum { LUA_COUNTERS = 1 << 14 };
__attribute__((used, section("__libfuzzer_extra_counters")))
static uint8_t lua_lines[LUA_COUNTERS];

/* LeakSanitizer cannot see into LuaJIT's own heap (its arena is mmapped
   memory, not malloc), so everything a Lua object keeps alive looks leaked:
   leak checking is off for the Lua targets; the C targets keep it. */
const char *__asan_default_options(void) { return "detect_leaks=0"; }

static lua_State *L;
static int target_ref = LUA_NOREF, cleanup_ref = LUA_NOREF;

/* the targets' scratch directory goes when libFuzzer exits */
static void cleanup(void) {
  lua_sethook(L, NULL, 0, 0);
  lua_rawgeti(L, LUA_REGISTRYINDEX, cleanup_ref);
  if (lua_pcall(L, 0, 0, 0)) lua_pop(L, 1);
}

static void line_hook(lua_State *S, lua_Debug *ar) {
  if (!lua_getinfo(S, "S", ar)) return;
  /* the source string is interned: its address names the chunk */
  uintptr_t h = (uintptr_t)ar->source * 0x9E3779B97F4A7C15ULL ^ (uintptr_t)ar->currentline * 0xff51afd7ed558ccdULL;
  uint8_t *c = &lua_lines[(h >> 17) & (LUA_COUNTERS - 1)];
  if (*c != 255) (*c)++;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc; (void)argv;
  L = luaL_newstate();
  luaL_openlibs(L);
  /* the tree's Lua modules, its engine library (GPTLUA.libdir) and the targets */
  const char *boot =
    "local root, libdir, target = ...\n"
    "package.path = root .. '/lua/?.lua;' .. root .. '/lua/?/init.lua;' .. package.path\n"
    "GPTLUA = { root = root, libdir = libdir }\n"
    "local targets = dofile(root .. '/engine/fuzz/targets.lua')\n"
    "local f = targets[target]\n"
    "if not f then error('fuzz_lua: no target ' .. target .. ' in engine/fuzz/targets.lua') end\n"
    "return f, targets.cleanup\n";
  if (luaL_loadstring(L, boot)) { fprintf(stderr, "%s\n", lua_tostring(L, -1)); exit(2); }
  lua_pushstring(L, FUZZ_ROOT);
  lua_pushstring(L, getenv("GPTLUA_LIBDIR") ? getenv("GPTLUA_LIBDIR") : FUZZ_ROOT "/build");
  lua_pushstring(L, FUZZ_TARGET);
  if (lua_pcall(L, 3, 2, 0)) { fprintf(stderr, "fuzz_lua: %s\n", lua_tostring(L, -1)); exit(2); }
  cleanup_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  target_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  atexit(cleanup);
  lua_sethook(L, line_hook, LUA_MASKLINE, 0);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int top = lua_gettop(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, target_ref);
  lua_pushlstring(L, (const char *)data, size);
  if (lua_pcall(L, 1, 0, 0)) {
    /* targets.lua turns an acceptable error into a return: what reaches
       here is a finding */
    const char *msg = lua_tostring(L, -1);
    fprintf(stderr, "fuzz_lua(%s): %s\n", FUZZ_TARGET, msg ? msg : "(non-string error)");
    abort();
  }
  lua_settop(L, top);
  return 0;
}
