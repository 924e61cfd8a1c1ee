// A max reduction over half values whose identity element is written as the bits of -inf.
#include <cuda_fp16.h>
#include "common.cuh"

__device__ __half neg_inf_half() {
  constexpr __half_raw bits = {0xFC00};  // expect: half-raw-bits
  return __half(bits);
}

__device__ __half zero_half() {
  __half_raw zero;
  zero.x = 0;  // naming the member: the same on both vendors
  return __half(zero);
}

__global__ void row_max_kernel(const __half* x, __half* out, int cols) {
  __half best = neg_inf_half();
  for (int c = threadIdx.x; c < cols; c += blockDim.x) best = __hmax(best, x[blockIdx.x * cols + c]);
  if (threadIdx.x == 0) out[blockIdx.x] = __hadd(best, zero_half());
}

__global__ void row_sum_pairs_kernel(const __half2* x, __half2* out, int cols) {
  __half2 acc;
  acc = {};  // expect: half-brace-assign
  for (int c = threadIdx.x; c < cols; c += blockDim.x) acc = __hadd2(acc, x[blockIdx.x * cols + c]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
