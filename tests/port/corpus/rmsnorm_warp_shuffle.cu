// RMSNorm over the hidden dimension: one block per row, bf16 in and out, fp32 accumulation.
// Each warp reduces its partial sum of squares with shuffles, then warp 0 reduces the warp sums.
#include <cuda_runtime.h>
#include <cuda_bf16.h>  // expect: bf16-type
#include "common.cuh"

#define WARP_SIZE 32  // expect: warp-size-define
#define FULL_MASK 0xffffffff  // expect: mask-32bit

__device__ __forceinline__ float warp_reduce_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {  // expect: warp-lane-loop
    value += __shfl_xor_sync(FULL_MASK, value, offset);  // expect: mask-32bit
  }
  return value;
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads, 2)  // expect: launch-bounds-2nd-arg
rmsnorm_kernel(const __nv_bfloat16* __restrict__ x,
               const __nv_bfloat16* __restrict__ weight,
               __nv_bfloat16* __restrict__ y, int hidden, float eps) {
  __shared__ float warp_sums[kThreads / WARP_SIZE];
  const int row = blockIdx.x;
  const int lane = threadIdx.x & 31;  // expect: warp-size-literal
  const int warp = threadIdx.x >> 5;  // expect: warp-size-literal
  const __nv_bfloat16* x_row = x + static_cast<size_t>(row) * hidden;
  __nv_bfloat16* y_row = y + static_cast<size_t>(row) * hidden;

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < hidden; i += kThreads) {
    const float v = __bfloat162float(x_row[i]);
    sum_sq += v * v;
  }
  sum_sq = warp_reduce_sum(sum_sq);
  if (lane == 0) warp_sums[warp] = sum_sq;
  __syncthreads();
  if (warp == 0) {
    sum_sq = lane < kThreads / WARP_SIZE ? warp_sums[lane] : 0.f;
    sum_sq = warp_reduce_sum(sum_sq);
    if (lane == 0) warp_sums[0] = rsqrtf(sum_sq / hidden + eps);
  }
  __syncthreads();

  const float inv_rms = warp_sums[0];
  for (int i = threadIdx.x; i < hidden; i += kThreads) {
    const float v = __bfloat162float(x_row[i]) * inv_rms;
    y_row[i] = __float2bfloat16(v * __bfloat162float(weight[i]));
  }
}

void rmsnorm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y,
                  int rows, int hidden, float eps, cudaStream_t stream) {
  rmsnorm_kernel<256><<<rows, 256, 0, stream>>>(x, weight, y, hidden, eps);
  CUDA_CHECK(cudaGetLastError());
}
