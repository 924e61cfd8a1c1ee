// A library's build checks and its version report, written against nvcc's and the runtime's version macros.
#include <cuda_runtime_api.h>

static_assert(__CUDACC_VER_MAJOR__ > 10 || (__CUDACC_VER_MAJOR__ == 10 && __CUDACC_VER_MINOR__ >= 2),  // expect: cuda-version-expression
              "requires CUDA 10.2 or later");

#if defined(__CUDACC__)
__device__ float halve(float x) { return x * 0.5f; }
#endif

int runtime_version() {
  return CUDART_VERSION;  // expect: cuda-version-expression
}
