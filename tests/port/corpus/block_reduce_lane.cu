// Row-wise L2 norm for small rows: one 32-thread block per row, and a block-wide sum for wide rows
// that parks one partial per warp in shared memory and lets the first warp add them up.
#include "common.cuh"

constexpr int kThreads = 256;

__device__ float warp_sum(float v) {
  for (int offset = warpSize / 2; offset > 0; offset /= 2) v += __shfl_xor(v, offset);
  return v;
}

__global__ void row_norm_wide_kernel(const float* x, float* norms, int cols) {
  __shared__ float warp_partials[32];  // one slot per warp, up to 1024 threads
  const float* row = x + static_cast<size_t>(blockIdx.x) * cols;
  float acc = 0.f;
  for (int c = threadIdx.x; c < cols; c += kThreads) acc += row[c] * row[c];
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  acc = warp_sum(acc);
  if (lane == 0) warp_partials[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = warp_sum(warp_partials[lane]);  // expect: lane-indexed-warp-array
    if (lane == 0) norms[blockIdx.x] = sqrtf(acc);
  }
}

__global__ void row_norm_narrow_kernel(const float* x, float* norms, int cols) {
  const float* row = x + static_cast<size_t>(blockIdx.x) * cols;
  float acc = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += row[c] * row[c];
  acc = warp_sum(acc);
  if (threadIdx.x == 0) norms[blockIdx.x] = sqrtf(acc);
}

void row_norm(const float* x, float* norms, int rows, int cols, cudaStream_t stream) {
  if (cols <= 256) {
    row_norm_narrow_kernel<<<rows, 32, 0, stream>>>(x, norms, cols);  // expect: block-32-threads
  } else {
    row_norm_wide_kernel<<<rows, kThreads, 0, stream>>>(x, norms, cols);
  }
  CUDA_CHECK(cudaGetLastError());
}
