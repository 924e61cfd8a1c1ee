// Expert-offset computation for MoE routing: a block-wide exclusive scan of per-expert token counts
// with CUB, plus a small templated accumulator whose member templates nvcc calls without `template`.
#include <cub/cub.cuh>
#include "common.cuh"

struct CountTraits {
  using index_type = int;
};

template <typename T, int kItems>
struct Partial {
  T items[kItems];
  template <int I>
  __device__ T get() const { return items[I]; }
};

template <int kThreads, int kItems, typename Traits>
__global__ void expert_offsets_kernel(const int* counts, int* offsets, int num_experts) {
  using Load = cub::BlockLoad<int, kThreads, kItems, cub::BLOCK_LOAD_WARP_TRANSPOSE>;
  using Scan = cub::BlockScan<int, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using Store = cub::BlockStore<int, kThreads, kItems, cub::BLOCK_STORE_WARP_TRANSPOSE>;
  __shared__ union {
    typename Load::TempStorage load;
    typename Scan::TempStorage scan;
    typename Store::TempStorage store;
  } temp;

  Partial<int, kItems> partial;
  Load(temp.load).Load(counts, partial.items, num_experts, 0);
  __syncthreads();
  Traits::index_type first = partial.get<0>();  // expect: dependent-template-name
  Scan(temp.scan).ExclusiveScan(partial.items, partial.items, 0, cub::Sum());
  __syncthreads();
  Store(temp.store).Store(offsets, partial.items, num_experts);
  if (threadIdx.x == 0 && first < 0) offsets[0] = CUB_MAX(first, 0);
}

void expert_offsets(const int* counts, int* offsets, int num_experts, cudaStream_t stream) {
  constexpr int kThreads = 128, kItems = 4;
  expert_offsets_kernel<kThreads, kItems, CountTraits><<<1, kThreads, 0, stream>>>(counts, offsets, num_experts);
  CUDA_CHECK(cudaGetLastError());
}
