/* cuda_runtime.h — the CUDA simulator's stand-in for the toolkit header of
 * the same name (the sim build puts spec/cudasim/ first on the include path).
 * C code (engine/mpi/nccl.c) sees the host API; C++ (kernels/NAME.cu) also
 * gets the device side: built-in variables, barriers, warp collectives,
 * atomics and the launch machinery behind GL_LAUNCH (kernels/common.cuh). */
#ifndef GL_SIM_CUDA_RUNTIME_H
#define GL_SIM_CUDA_RUNTIME_H
#include "sim_types.h"
#include "runtime_api.h"
#ifdef __cplusplus
#include <math.h>
#include "sim.h"
#include "device.h"
#endif
#endif
