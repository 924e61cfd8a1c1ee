// Tiled transpose of a ragged matrix: each warp votes which of its rows exist, then reads only those.
#include "common.cuh"

constexpr int kTile = 32;

__global__ void transpose_ragged(const float* in, float* out, int rows, int cols) {
  __shared__ float tile[kTile][kTile + 1];
  const int x = blockIdx.x * kTile + threadIdx.x;
  const int y0 = blockIdx.y * kTile;
  const unsigned long long present = __ballot_sync(~0ull, y0 + static_cast<int>(threadIdx.x) < rows);
  for (int j = 0; j < kTile; ++j) {
    if ((present & (1 << j)) && x < cols) tile[j][threadIdx.x] = in[(y0 + j) * cols + x];  // expect: ballot-bit-test
  }
  __syncthreads();
  for (int j = 0; j < kTile; ++j) {
    if (((present >> j) & 1) && x < cols) out[x * rows + y0 + j] = tile[threadIdx.x][j];
  }
}

// The launcher gives each warp of the block a slot of partial counts.
void launch_transpose_ragged(const float* in, float* out, int rows, int cols, int* counts, cudaStream_t stream) {
  const int threads = kTile;
  const int warps_per_block = threads / 32;  // expect: host-warp-size
  dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile);
  cudaMemsetAsync(counts, 0, sizeof(int) * warps_per_block * grid.x * grid.y, stream);
  transpose_ragged<<<grid, threads, 0, stream>>>(in, out, rows, cols);
}
