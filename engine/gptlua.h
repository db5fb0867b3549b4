/* gptlua.h — the public C API of the gptlua engine, prefix gl_.
 *
 * This umbrella header is the single source of truth for the C/Lua boundary:
 * the Makefile preprocesses it with -DGL_CDEF into build/gl_cdef.h, which is
 * embedded in libgptlua.so and handed to ffi.cdef by lua/gptlua/ffi.lua
 * (gl_cdef()).  Each concern keeps its declarations in its own header. */
#ifndef GPTLUA_H
#define GPTLUA_H
#include "gl_core.h"
#include "gl_ops.h"
#include "gl_data.h"
#include "gl_dist.h"
#include "gl_cuda.h"
#endif
