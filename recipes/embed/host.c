/* recipes/embed/host.c — a C program that embeds gptlua: it links
 * libgptlua and LuaJIT, opens a Lua state, loads the library and
 * recipes/embed/step.lua (a model and its optimizer), runs training steps,
 * and reads the trained weight back through the engine's C API
 * (gl_to_doubles).  `make embed-example` builds and runs it;
 * usage: embed_host [ROOT] [STEPS], ROOT the checkout (default: the one
 * it was built in). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include "gptlua.h"

#ifndef GPTLUA_ROOT
#define GPTLUA_ROOT "."
#endif

/* calls field `name` of the table at the top of the stack with no
 * arguments, leaving its one result on the stack; exits on an error */
static void call(lua_State *L, const char *name) {
  lua_getfield(L, -1, name);
  if (lua_pcall(L, 0, 1, 0) != 0) {
    fprintf(stderr, "embed_host: %s: %s\n", name, lua_tostring(L, -1));
    exit(1);
  }
}

int main(int argc, char **argv) {
  const char *root = argc > 1 ? argv[1] : GPTLUA_ROOT;
  int steps = argc > 2 ? atoi(argv[2]) : 50;
  printf("engine %s (libgptlua, called from C)\n", gl_version());

  lua_State *L = luaL_newstate();
  luaL_openlibs(L);
  /* the checkout's Lua tree on package.path; lua/gptlua/ffi.lua finds
   * build/libgptlua.so from its own location */
  char code[4096];
  snprintf(code, sizeof code,
           "package.path = '%s/lua/?.lua;%s/lua/?/init.lua;' .. package.path\n"
           "return dofile('%s/recipes/embed/step.lua')", root, root, root);
  if (luaL_dostring(L, code) != 0) {
    fprintf(stderr, "embed_host: %s\n", lua_tostring(L, -1));
    return 1;
  }
  double first = 0, last = 0;
  for (int i = 1; i <= steps; i++) {
    call(L, "step");
    last = lua_tonumber(L, -1);
    if (i == 1) first = last;
    lua_pop(L, 1);
    if (i == 1 || i % 10 == 0) printf("step %d: loss %.6f\n", i, last);
  }

  /* the weight, read by C through the engine's API */
  call(L, "weight_handle");
  gl_tensor *w = (gl_tensor *)(uintptr_t)lua_tonumber(L, -1);
  lua_pop(L, 1);
  double values[64];
  if (w->numel > 64 || gl_to_doubles(w, values) != 0) {
    fprintf(stderr, "embed_host: reading the weight: %s\n", gl_last_error());
    return 1;
  }
  char from_c[1024] = "";
  for (int64_t i = 0; i < w->numel; i++) {
    char one[64];
    snprintf(one, sizeof one, "%s%.14g", i ? " " : "", values[i]);
    strncat(from_c, one, sizeof from_c - strlen(from_c) - 1);
  }
  call(L, "weight_values");
  const char *from_lua = lua_tostring(L, -1);
  printf("weight %lldx%lld read by C:   %s\n", (long long)w->shape[0], (long long)w->shape[1], from_c);
  printf("weight as Lua reads it:  %s\n", from_lua);
  int same = strcmp(from_c, from_lua) == 0;
  lua_pop(L, 1);
  lua_close(L);
  if (!same || !(last < first)) {
    fprintf(stderr, "embed_host: %s\n", same ? "the loss did not fall" : "C and Lua read different values");
    return 1;
  }
  printf("loss %.6f -> %.6f over %d steps\n", first, last, steps);
  return 0;
}
