// Per-tensor fp8 (e4m3) quantisation with a dynamic scale, as fp8 training recipes do it:
// scale = 448 / absmax, q = saturate(x * scale). 448 is the largest finite OCP e4m3 value.
#include <cuda_fp8.h>  // expect: fp8-type
#include "common.cuh"

constexpr float kFp8Max = 448.0f;

__global__ void absmax_kernel(const float* __restrict__ x, float* absmax, int n) {
  float local = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
    local = fmaxf(local, fabsf(x[i]));
  // Non-negative floats order like their bit patterns, so an integer max is a float max.
  atomicMax(reinterpret_cast<int*>(absmax), __float_as_int(local));
}

__global__ void quantize_fp8_kernel(const float* __restrict__ x, __nv_fp8_e4m3* __restrict__ q,  // expect: fp8-type
                                    const float* __restrict__ absmax, float* inv_scale, int n) {
  const float scale = kFp8Max / fmaxf(*absmax, 1e-12f);
  if (blockIdx.x == 0 && threadIdx.x == 0) *inv_scale = 1.f / scale;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
#if __CUDA_ARCH__ >= 890  // expect: cuda-arch-guard
    q[i] = __nv_fp8_e4m3(x[i] * scale);  // compiled out on AMD: not linted
#else
    q[i].__x = __nv_cvt_float_to_fp8(x[i] * scale, __NV_SATFINITE, __NV_E4M3);  // expect: fp8-type
#endif
  }
}

void quantize_fp8(const float* x, __nv_fp8_e4m3* q, float* absmax, float* inv_scale, int n,  // expect: fp8-type
                  cudaStream_t stream) {
  const int blocks = ceil_div(n, 256) < 1024 ? ceil_div(n, 256) : 1024;
  CUDA_CHECK(cudaMemsetAsync(absmax, 0, sizeof(float), stream));
  absmax_kernel<<<blocks, 256, 0, stream>>>(x, absmax, n);
  quantize_fp8_kernel<<<blocks, 256, 0, stream>>>(x, q, absmax, inv_scale, n);
  CUDA_CHECK(cudaGetLastError());
}
