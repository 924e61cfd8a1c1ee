// Embedding-style gather through the legacy texture-reference API (pre-CUDA-12 code).
#include "common.cuh"

texture<float, cudaTextureType1D, cudaReadModeElementType> g_table_tex;  // expect: texture-reference

__global__ void gather_kernel(const int* __restrict__ ids, float* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = tex1Dfetch(g_table_tex, ids[i]);
}

void gather(const float* table, size_t table_size, const int* ids, float* out, int n,
            cudaStream_t stream) {
  CUDA_CHECK(cudaBindTexture(nullptr, g_table_tex, table, table_size * sizeof(float)));  // expect: texture-reference
  gather_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(ids, out, n);
  CUDA_CHECK(cudaUnbindTexture(g_table_tex));  // expect: texture-reference
}
