// hip-build: -D HAVE_ROCM -U HAVE_CUDA -U SIZEOF_CUFLOATCOMPLEX -U HAVE_CUBLAS -U WITH_CUCUB
// A collective library's reduction kernels for complex data, compiled as C++ by nvcc but declared to C callers:
// its own CUDA header (which includes the CUDA runtime, fp16 and complex headers) sits inside the extern "C" block,
// and the complex case is kept under autoconf's size check of cuFloatComplex, which only the CUDA configure runs.
#ifdef __cplusplus
extern "C" {
#endif
#include "mc_cuda.h"  // expect: extern-c-include
#include <cuComplex.h>  // expect: extern-c-include
#include "utils/math.h"
#ifdef __cplusplus
}
#endif

__global__ void reduce_sum_complex(const cuFloatComplex* a, const cuFloatComplex* b, cuFloatComplex* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuCaddf(a[i], b[i]);
}

extern "C" int reduce_sum(int dtype, const void* a, const void* b, void* out, int n, cudaStream_t stream) {
  switch (dtype) {
#if SIZEOF_CUFLOATCOMPLEX == 8  // expect: cuda-build-flag
    case 1:
      reduce_sum_complex<<<(n + 255) / 256, 256, 0, stream>>>((const cuFloatComplex*)a, (const cuFloatComplex*)b,
                                                              (cuFloatComplex*)out, n);
      return 0;
#else
    case 1:
      return -1;  // not supported
#endif
    default:
      return -1;
  }
}

#ifdef WITH_CUCUB  // expect: cuda-build-flag
constexpr bool sort_with_cub = true;  // the CUB path, a CUDA library the HIP build has as hipCUB under its own flag
#else
constexpr bool sort_with_cub = false;
#endif

int reduce_max_index(int n, const float* x, int* index, void* handle) {
#ifdef HAVE_CUBLAS  // the project's hipBLAS branch follows: not flagged
  return cublasIsamax((cublasHandle_t)handle, n, x, 1, index);
#elif defined(HAVE_HIPBLAS)
  return hipblasIsamax((hipblasHandle_t)handle, n, x, 1, index);
#else
  return -1;
#endif
}

__host__ __device__ cuDoubleComplex pack_amplitude(double re, double im) {
  return {.x = re, .y = im};  // expect: vector-designated-init
}
