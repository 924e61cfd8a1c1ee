// Helpers shared by the samples: error checking and integer division. Nothing here is AMD-hostile.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CUDA_CHECK(expr)                                                                  \
  do {                                                                                    \
    cudaError_t status_ = (expr);                                                         \
    if (status_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(status_)); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
