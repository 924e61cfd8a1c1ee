// Row softmax of attention scores, one warp per row. A row whose every score is masked (-inf)
// must come out as zeros, not NaN: the warp votes with a ballot to find such rows.
#include <cmath>
#include "common.cuh"

constexpr int kWarpSize = 32;  // expect: warp-size-define
constexpr int kRowsPerBlock = 4;

__global__ void masked_softmax_kernel(const float* __restrict__ scores, float* __restrict__ probs,
                                      int rows, int cols) {
  const unsigned active = __activemask();  // expect: ballot-32bit-result
  const int warp_id = threadIdx.x / 32;  // expect: warp-size-literal
  const int lane = threadIdx.x % 32;  // expect: warp-size-literal
  const int row = blockIdx.x * kRowsPerBlock + warp_id;
  if (row >= rows) return;
  const float* in = scores + static_cast<size_t>(row) * cols;
  float* out = probs + static_cast<size_t>(row) * cols;

  float row_max = -INFINITY;
  for (int c = lane; c < cols; c += kWarpSize) row_max = fmaxf(row_max, in[c]);
  unsigned live_mask = __ballot_sync(0xffffffff, row_max != -INFINITY);  // expect: ballot-32bit-result, mask-32bit
  if (__popc(live_mask) == 0) {  // expect: popc-32bit
    for (int c = lane; c < cols; c += kWarpSize) out[c] = 0.f;
    return;
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    row_max = fmaxf(row_max, __shfl_down_sync(active, row_max, offset));  // expect: mask-32bit
  }
  row_max = __shfl_sync(0xffffffff, row_max, 0);  // expect: mask-32bit

  float sum = 0.f;
  for (int c = lane; c < cols; c += kWarpSize) sum += __expf(in[c] - row_max);
  for (int offset = 16; offset >= 1; offset /= 2) {  // expect: warp-lane-loop
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);  // expect: mask-32bit
  }
  const float inv_sum = 1.f / sum;
  for (int c = lane; c < cols; c += kWarpSize) out[c] = __expf(in[c] - row_max) * inv_sum;
}

void masked_softmax(const float* scores, float* probs, int rows, int cols, cudaStream_t stream) {
  masked_softmax_kernel<<<ceil_div(rows, kRowsPerBlock), kWarpSize * kRowsPerBlock, 0, stream>>>(
      scores, probs, rows, cols);
  CUDA_CHECK(cudaGetLastError());
}
