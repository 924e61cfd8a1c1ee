// SwiGLU's elementwise half: out = silu(gate) * up, for float and half tensors.
// Written to port cleanly: no warp-size assumptions (a warp of 32 lanes is never assumed),
// no masks, no inline assembly, default shared memory. The lint must stay silent here.
#include <cuda_fp16.h>
#include "common.cuh"

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

__global__ void silu_mul_kernel(const float* __restrict__ gate, const float* __restrict__ up,
                                float* __restrict__ out, int n) {
  const int stride = blockDim.x * gridDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = silu(gate[i]) * up[i];
  }
}

__global__ void silu_mul_half_kernel(const __half* __restrict__ gate, const __half* __restrict__ up,
                                     __half* __restrict__ out, int n) {
  const int stride = blockDim.x * gridDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = __half2float(gate[i]);
    out[i] = __float2half(silu(g) * __half2float(up[i]));
  }
}

// Host side: a grid-stride launch capped at 32 blocks per multiprocessor.
void silu_mul(const float* gate, const float* up, float* out, int n, cudaStream_t stream) {
  constexpr int kThreads = 256;
  int device = 0, num_sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = ceil_div(n, kThreads) < 32 * num_sms ? ceil_div(n, kThreads) : 32 * num_sms;
  silu_mul_kernel<<<blocks, kThreads, 0, stream>>>(gate, up, out, n);
  CUDA_CHECK(cudaGetLastError());
}

void silu_mul_half(const __half* gate, const __half* up, __half* out, int n, cudaStream_t stream) {
  constexpr int kThreads = 256;
  silu_mul_half_kernel<<<ceil_div(n, kThreads), kThreads, 0, stream>>>(gate, up, out, n);
  CUDA_CHECK(cudaGetLastError());
}

float* device_buffer(size_t count) {
  float* ptr = nullptr;
  CUDA_CHECK(cudaMalloc(&ptr, count * sizeof(float)));
  CUDA_CHECK(cudaMemset(ptr, 0, count * sizeof(float)));
  return ptr;
}
