// A torch extension for a paged KV cache: a gather kernel dispatched for float, Half and BFloat16, block swaps
// between devices, a shared-memory budget read from the device, and a check for CUDA-graph capture.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

template <typename scalar_t>
__global__ void gather_cache_kernel(const scalar_t* __restrict__ cache, scalar_t* __restrict__ out,
                                    const int64_t* __restrict__ slots, int row_size) {
  const int64_t slot = slots[blockIdx.x];
  for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
    out[blockIdx.x * row_size + i] = __ldg(&cache[slot * row_size + i]);  // expect: ldg-torch-half
  }
}

void gather_cache(torch::Tensor cache, torch::Tensor out, torch::Tensor slots) {
  const int row_size = cache.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, cache.scalar_type(), "gather", [&] {
    gather_cache_kernel<scalar_t><<<slots.size(0), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(), row_size);
  });
}

void swap_block(torch::Tensor src, torch::Tensor dst, int64_t src_block, int64_t dst_block, int64_t block_bytes) {
  void* src_ptr = src.data_ptr();
  char* dst_ptr = static_cast<char*>(dst.data_ptr());
  cudaMemcpyAsync(dst_ptr + dst_block * block_bytes, src_ptr + src_block * block_bytes,  // expect: void-pointer-arith
                  block_bytes, cudaMemcpyDefault, at::cuda::getCurrentCUDAStream());
}

int shared_memory_budget(int device) {
  int bytes = 0;
  cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);  // expect: smem-optin-zero
  return bytes;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph;
  cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph, nullptr, nullptr);  // expect: capture-info-v2
  return status == cudaStreamCaptureStatusActive;
}
