/* gl_cuda.h — see ARCHITECTURE.md.  Part of the public API (umbrella gptlua.h). */
#ifndef GL_CUDA_H
#define GL_CUDA_H
#include "gl_core.h"

#endif
