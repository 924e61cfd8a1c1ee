// Row normalisation with a host-side reference and an inclusive scan helper: a host specialisation that
// uses CUDA's host versions of device math, a scan step that forgets to return its carry, and host/device
// qualifiers chosen by nvcc's own macro.
#include "common.cuh"

#ifdef __NVCC__  // expect: compiler-guard
#define SCAN_HD __host__ __device__
#else
#define SCAN_HD
#endif
SCAN_HD inline int ceil_div(int a, int b) { return (a + b - 1) / b; }  // host-only under hipcc

template <typename T> T inv_norm(T v) { return T(1) / std::sqrt(v); }
template <> float inv_norm(float v) { return rsqrtf(v); }  // expect: device-only-math
template <> double inv_norm(double v) { return inv_norm<double>(v); }

__host__ __device__ inline float host_and_device(float v) { return rsqrtf(v); }  // fine: compiled for the device
__device__ float probit(float p) { return normcdfinvf(p); }

template <typename T>
__device__ T inclusive_step(T* values, int n) {
  T carry = 0;
  for (int i = 0; i < n; ++i) {
    carry += values[i];
    values[i] = carry;
  }
}  // expect: missing-return

template <typename T>
__device__ T exclusive_step(T* values, int n) {
  T carry = 0;
  for (int i = 0; i < n; ++i) {
    const T v = values[i];
    values[i] = carry;
    carry += v;
  }
  return carry;
}

__global__ void scale_rows(float* x, const float* sumsq, int cols) {
  const float scale = host_and_device(sumsq[blockIdx.x]) + probit(0.5f) * 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) x[blockIdx.x * cols + c] *= scale;
}
