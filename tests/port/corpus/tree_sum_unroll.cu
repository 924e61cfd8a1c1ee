// Per-row sums through a shared-memory tree, and a masked row maximum that stops at the row's end: the
// `#pragma unroll` requests hip-clang can honour (compile-time bounds) and the ones it warns about.
#include "common.cuh"

template <int kBlock>
__global__ void row_sum_fixed_kernel(const float* x, float* sums, int cols) {
  __shared__ float partial[kBlock];
  float acc = 0.f;
  for (int c = threadIdx.x; c < cols; c += kBlock) acc += x[static_cast<size_t>(blockIdx.x) * cols + c];
  partial[threadIdx.x] = acc;
  __syncthreads();
#pragma unroll
  for (int offset = kBlock / 2; offset > 0; offset >>= 1) {
    if (threadIdx.x < offset) partial[threadIdx.x] += partial[threadIdx.x + offset];
    __syncthreads();
  }
  if (threadIdx.x == 0) sums[blockIdx.x] = partial[0];
}

__global__ void row_sum_kernel(const float* x, float* sums, int cols) {
  extern __shared__ float partial[];
  float acc = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += x[static_cast<size_t>(blockIdx.x) * cols + c];
  partial[threadIdx.x] = acc;
  __syncthreads();
#pragma unroll  // expect: unroll-unknown-trip
  for (int offset = blockDim.x >> 1; offset > 0; offset >>= 1) {
    if (threadIdx.x < offset) partial[threadIdx.x] += partial[threadIdx.x + offset];
    __syncthreads();
  }
  if (threadIdx.x == 0) sums[blockIdx.x] = partial[0];
}

template <int kColsFixed>
__global__ void row_max_kernel(const float* x, float* maxima, int cols_arg, int stride) {
  const int cols = kColsFixed == 0 ? cols_arg : kColsFixed;
  float best = -INFINITY;
#pragma unroll 4  // expect: unroll-unknown-trip
  for (int c0 = 0; c0 < cols; c0 += stride) {
    const int c = c0 + threadIdx.x;
    if (kColsFixed == 0 && c >= cols) {
      break;
    }
    best = fmaxf(best, x[static_cast<size_t>(blockIdx.x) * cols + c]);
  }
#pragma unroll 1
  for (int offset = stride >> 1; offset > 0; offset >>= 1) best = fmaxf(best, best * 0.f + offset);
  if (threadIdx.x == 0) maxima[blockIdx.x] = best;
}
