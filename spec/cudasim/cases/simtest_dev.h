/* simtest_dev.h — device memory and launch checks for the execution-core
 * checks (spec/cudasim/cases/exec.cu, cases/exec_faults.cu): Dev<T>, device
 * memory freed with the scope; ALLOC(name, T, count), which notes a failed
 * cudaMalloc and returns its error; TRY_LAUNCH() after a launch.  Uses
 * simtest.h's note() and TRY(). */
#ifndef GL_SIM_SIMTEST_DEV_H
#define GL_SIM_SIMTEST_DEV_H
#include "simtest.h"

/* after a launch: the configuration was accepted and the grid ran */
#define TRY_LAUNCH() \
  do {               \
    TRY(cudaGetLastError());  \
    TRY(cudaDeviceSynchronize()); \
  } while (0)

namespace {
/* n elements of device memory, freed with the scope */
template <class T> struct Dev {
  T *p = nullptr;
  size_t n;
  explicit Dev(size_t count) : n(count) {
    if (cudaMalloc((void **)&p, n * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(const Dev &) = delete;
  Dev &operator=(const Dev &) = delete;
  cudaError_t put(const std::vector<T> &h) { return cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice); }
  cudaError_t get(std::vector<T> &h) {
    h.resize(n);
    return cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  }
};
}  // namespace

#define ALLOC(name, T, count)                                \
  Dev<T> name(count);                                        \
  if (!name.p) {                                             \
    note("cudaMalloc of %zu %s failed", (size_t)(count), #T); \
    return -(int)cudaErrorMemoryAllocation;                  \
  }

#endif
