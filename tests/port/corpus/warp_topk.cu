// Warp-level top-k over rows of scores: a bitonic network across the 32 lanes of a warp, one row per warp.
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#include "warp_defs.cuh"  // this project's kWarpSize

namespace cg = cooperative_groups;

#if CUDA_VERSION < 9000  // expect: compiler-guard
#error "CUDA >= 9.0 is required"
#endif

#define HAS_BF16_MATH (__CUDA_ARCH__ >= 800)  // expect: cuda-arch-guard

constexpr int kRowsPerBlock = 4;
constexpr int kLanes = kWarpSize;

__device__ inline void bitonic_sort_lanes(float& key, int& index) {
  // five stages: 2, 4, 8, 16 and 32 lanes
  static_assert(kWarpSize == 32, "the network below has five stages");  // expect: warp-size-assert
  int lane = threadIdx.x % kLanes;
  for (int size = 2; size <= kLanes; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      float other_key = __shfl_xor_sync(0xffffffffu, key, stride);  // expect: mask-32bit
      int other_index = __shfl_xor_sync(0xffffffffu, index, stride);  // expect: mask-32bit
      bool ascending = ((lane & size) == 0) == ((lane & stride) == 0);
      if ((other_key < key) == ascending) {
        key = other_key;
        index = other_index;
      }
    }
  }
}

__global__ void row_topk(const float* scores, int cols, int k, float* top_scores, int* top_index) {
  int row = blockIdx.x * kRowsPerBlock + threadIdx.y;
  int lane = threadIdx.x;
  float key = lane < cols ? scores[row * cols + lane] : -1e30f;
  int index = lane;
  bitonic_sort_lanes(key, index);
  if (lane < k) {
    top_scores[row * k + lane] = key;
    top_index[row * k + lane] = index;
  }
}

// How many lanes of each 32-lane tile hold a score above the threshold: the tile's vote taken as the warp's.
__device__ int tile_hits(cg::thread_block block, float key, float threshold) {
  auto tile = cg::tiled_partition<32>(block);  // expect: warp-tile-32
  return __popc(tile.ballot(key > threshold));  // expect: cg-missing-api
}

void launch_row_topk(const float* scores, int rows, int cols, int k, float* top_scores, int* top_index,
                     cudaStream_t stream) {
  dim3 block(kLanes, kRowsPerBlock);  // expect: host-warp-size
  dim3 grid((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  row_topk<<<grid, block, 0, stream>>>(scores, cols, k, top_scores, top_index);
}
