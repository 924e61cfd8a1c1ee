// Two-stage all-reduce between the GPUs of one node: each block raises its flag in every peer's signal
// buffer, then waits for the peers' flags in its own, with clang's scoped atomics (device scope for the
// block's own flags, system scope for the ones a peer writes over the fabric).
#include <cstdint>
#include "common.cuh"

constexpr int kMaxBlocks = 64;
constexpr int kMaxRanks = 8;

struct Signal {
  alignas(128) uint32_t start[kMaxBlocks][kMaxRanks];
  alignas(128) uint32_t end[kMaxBlocks][kMaxRanks];
};

__device__ void start_sync(Signal* self, Signal* const* peers, int rank, int world_size) {
  if (threadIdx.x < world_size) {
    __scoped_atomic_store_n(&self->end[blockIdx.x][threadIdx.x], 0, __ATOMIC_RELAXED, __MEMORY_SCOPE_DEVICE);  // expect: scoped-atomic
    __scoped_atomic_store_n(&peers[threadIdx.x]->start[blockIdx.x][rank], 1, __ATOMIC_RELEASE,  // expect: scoped-atomic
                            __MEMORY_SCOPE_SYSTEM);
    while (!__scoped_atomic_load_n(&self->start[blockIdx.x][threadIdx.x], __ATOMIC_ACQUIRE,  // expect: scoped-atomic
                                   __MEMORY_SCOPE_SYSTEM)) {
    }
  }
  __syncthreads();
}

__global__ void allreduce_sum(const float* const* inputs, float* out, Signal* self, Signal* const* peers, int rank,
                              int world_size, int n) {
  start_sync(self, peers, rank, world_size);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float sum = 0.f;
    for (int r = 0; r < world_size; ++r) sum += inputs[r][i];
    out[i] = sum;
  }
}
