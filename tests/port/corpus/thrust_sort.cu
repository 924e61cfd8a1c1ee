// Sort token scores descending on a stream (top-k routing), with Thrust's CUDA backend.
#include <thrust/sort.h>
#include <thrust/functional.h>
#include <thrust/system/cuda/execution_policy.h>
#include "common.cuh"

void sort_scores_desc(float* scores, int* token_ids, int n, cudaStream_t stream) {
  thrust::sort_by_key(thrust::cuda::par.on(stream), scores, scores + n, token_ids,  // expect: thrust-cuda-par
                      thrust::greater<float>());
  CUDA_CHECK(cudaStreamSynchronize(stream));
}
