// A multi-stage tiled SGEMM that keeps kStages tiles of A and B in dynamic shared memory:
// 96 KiB per block, which NVIDIA allows after cudaFuncSetAttribute and AMD's 64 KiB LDS does not.
#include "common.cuh"

constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 32;
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kSmemBytes = kStages * (kBlockM + kBlockN) * kBlockK * sizeof(float);

// c = a * b for row-major a (M x K), b (K x N), c (M x N); each thread owns an 8 x 8 patch of c.
__global__ void __launch_bounds__(kThreads) tiled_sgemm_kernel(const float* a, const float* b,
                                                               float* c, int M, int N, int K,
                                                               int stages) {
  extern __shared__ float smem[];
  const int block_row = blockIdx.y * kBlockM, block_col = blockIdx.x * kBlockN;
  const int thread_row = (threadIdx.x / 16) * 8, thread_col = (threadIdx.x % 16) * 8;
  float acc[8][8] = {};
  for (int k0 = 0, stage = 0; k0 < K; k0 += kBlockK, stage = (stage + 1) % stages) {
    float* a_tile = smem + stage * (kBlockM + kBlockN) * kBlockK;
    float* b_tile = a_tile + kBlockM * kBlockK;
    for (int i = threadIdx.x; i < kBlockM * kBlockK; i += kThreads) {
      const int r = i / kBlockK, k = i % kBlockK;
      a_tile[i] = (block_row + r < M && k0 + k < K) ? a[(block_row + r) * K + k0 + k] : 0.f;
    }
    for (int i = threadIdx.x; i < kBlockK * kBlockN; i += kThreads) {
      const int k = i / kBlockN, col = i % kBlockN;
      b_tile[i] = (k0 + k < K && block_col + col < N) ? b[(k0 + k) * N + block_col + col] : 0.f;
    }
    __syncthreads();
    for (int k = 0; k < kBlockK; ++k)
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j)
          acc[i][j] += a_tile[(thread_row + i) * kBlockK + k] * b_tile[k * kBlockN + thread_col + j];
    __syncthreads();
  }
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j)
      if (block_row + thread_row + i < M && block_col + thread_col + j < N)
        c[(block_row + thread_row + i) * N + block_col + thread_col + j] = acc[i][j];
}

void tiled_sgemm(const float* a, const float* b, float* c, int M, int N, int K, cudaStream_t stream) {
  CUDA_CHECK(cudaFuncSetAttribute(tiled_sgemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,  // expect: lds-limit
                                  kSmemBytes));
  const dim3 grid(ceil_div(N, kBlockN), ceil_div(M, kBlockM));
  tiled_sgemm_kernel<<<grid, kThreads, kSmemBytes, stream>>>(a, b, c, M, N, K, kStages);  // expect: lds-limit
  CUDA_CHECK(cudaGetLastError());
}

// The stage count chosen at run time (e.g. from the device's limit): the size is unknown to the lint.
void tiled_sgemm_stages(const float* a, const float* b, float* c, int M, int N, int K, int stages,
                        cudaStream_t stream) {
  const int smem_bytes = stages * (kBlockM + kBlockN) * kBlockK * static_cast<int>(sizeof(float));
  CUDA_CHECK(cudaFuncSetAttribute(tiled_sgemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,  // expect: lds-limit
                                  smem_bytes));
  const dim3 grid(ceil_div(N, kBlockN), ceil_div(M, kBlockM));
  tiled_sgemm_kernel<<<grid, kThreads, smem_bytes, stream>>>(a, b, c, M, N, K, stages);
}
