// A CTA-wide sum as a first ROCm port wrote it: per-warp partial sums in shared memory sized by HIP's warpSize
// (constexpr up to ROCm 6.x), flag polling with `register` temporaries, and an int8 output clamped with std::clamp.
#include <algorithm>
#include <cstdint>
#include "common.cuh"

constexpr int kThreads = 256;

__device__ int poll_flag(volatile int* flag) {
  register int seen = *flag;  // expect: register-storage
  while (seen == 0) seen = *flag;
  return seen;
}

__global__ void cta_sum(const float* x, float* out, volatile int* ready, int n) {
  __shared__ float partial[kThreads / warpSize];  // expect: warpsize-constexpr
  float v = 0.f;
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads) v += x[i];
  for (int offset = warpSize / 2; offset > 0; offset /= 2) v += __shfl_down(v, offset);
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kThreads / warpSize; ++w) total += partial[w];
    if (poll_flag(ready)) out[blockIdx.x] = total;
  }
}

__device__ int8_t to_int8(float x) {
  return static_cast<int8_t>(std::clamp(x, -128.f, 127.f));  // expect: device-std-clamp
}

int8_t host_to_int8(float x) { return static_cast<int8_t>(std::clamp(x, -128.f, 127.f)); }
