// Per-channel mean and scale for a channels-last tensor: the launch helpers cap blocks at
// MAX_BLOCK_SIZE threads, one kernel states its bound, the small fix-up kernel runs 128 threads.
#include "common.cuh"

#define MAX_BLOCK_SIZE 512
constexpr int kFixupThreads = 128;

__host__ void plan_launch(int channels, int rows, dim3& block, dim3& grid) {
  block.x = min(channels, 64);
  block.y = min(rows, MAX_BLOCK_SIZE / static_cast<int>(block.x));
  grid = dim3((channels + block.x - 1) / block.x);
}

template <typename T>
__global__ void channel_mean_kernel(const T* x, float* mean, int rows, int channels) {  // expect: launch-bounds
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  float acc = 0.f;
  for (int r = threadIdx.y; r < rows; r += blockDim.y) acc += static_cast<float>(x[r * channels + c]);
  atomicAdd(&mean[c], acc / rows);
}

__global__ void row_scale_kernel(float* x, const float* scale, int cols) {  // expect: launch-bounds
  for (int c = threadIdx.x; c < cols; c += blockDim.x) x[blockIdx.x * cols + c] *= scale[c];
}

__global__ void __launch_bounds__(MAX_BLOCK_SIZE) channel_center_kernel(float* x, const float* mean, int channels) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < channels) x[blockIdx.y * channels + c] -= mean[c];
}

__global__ void fixup_kernel(float* mean, int channels) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c < channels && !isfinite(mean[c])) mean[c] = 0.f;
}

void channel_stats(const float* x, float* mean, float* y, const float* scale, int rows, int channels,
                   cudaStream_t stream) {
  dim3 block;
  dim3 grid;
  plan_launch(channels, rows, block, grid);
  channel_mean_kernel<float><<<grid, block, 0, stream>>>(x, mean, rows, channels);
  fixup_kernel<<<ceil_div(channels, kFixupThreads), kFixupThreads, 0, stream>>>(mean, channels);
  channel_center_kernel<<<dim3(ceil_div(channels, MAX_BLOCK_SIZE), rows), MAX_BLOCK_SIZE, 0, stream>>>(y, mean, channels);
  const int threads = std::min(channels, MAX_BLOCK_SIZE);
  row_scale_kernel<<<rows, threads, 0, stream>>>(y, scale, channels);
  CUDA_CHECK(cudaGetLastError());
}
