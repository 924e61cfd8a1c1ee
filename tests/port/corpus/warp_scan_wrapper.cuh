// A sub-warp reduce / scan wrapper over CUB's shuffle specialisations (no temporary storage), and a shared
// buffer type borrowed from Thrust's CUDA backend.
#pragma once
#include <cub/cub.cuh>
#include <thrust/system/cuda/detail/core/util.h>  // expect: cub-internal

template <typename T, int LOGICAL_WARP_THREADS>
class SubWarpReduce {
 public:
  __device__ T Sum(T input) { return Reduce(input, cub::Sum()); }
  template <typename ReduceOp>
  __device__ T Reduce(T input, ReduceOp op) {
    typename Shfl::TempStorage unused;
    return Shfl(unused).template Reduce<true>(input, LOGICAL_WARP_THREADS, op);
  }

 private:
  typedef cub::WarpReduceShfl<T, LOGICAL_WARP_THREADS> Shfl;  // expect: cub-internal
};

template <typename T, int LOGICAL_WARP_THREADS>
class SubWarpScan {
 public:
  __device__ void InclusiveSum(T input, T& output) {
    typename Shfl::TempStorage unused;
    Shfl(unused).InclusiveScan(input, output, cub::Sum());
  }

 private:
  typedef cub::WarpScanShfl<T, LOGICAL_WARP_THREADS> Shfl;  // expect: cub-internal
};

template <typename T, int N>
using staged_rows = thrust::cuda_cub::core::uninitialized_array<T, N>;  // expect: cub-internal
