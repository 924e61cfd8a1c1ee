// C = A * B^T with tensor cores through the WMMA API: fp16 inputs, fp32 accumulation.
// One warp computes one 16x16 tile of C; a block holds 4 x 4 warps.
#include <mma.h>  // expect: wmma
#include <cuda_fp16.h>
#include "common.cuh"

using namespace nvcuda;  // expect: wmma

constexpr int WMMA_M = 16;
constexpr int WMMA_N = 16;
constexpr int WMMA_K = 16;
constexpr int kWarpsPerBlockX = 4;

// a: M x K row-major, b: N x K row-major (so B^T is column-major), c: M x N row-major.
__global__ void wmma_gemm_kernel(const half* a, const half* b, float* c, int M, int N, int K) {
  const int tile_m = (blockIdx.x * blockDim.x + threadIdx.x) / 32;  // expect: warp-size-literal
  const int tile_n = blockIdx.y * blockDim.y + threadIdx.y;
  const int row = tile_m * WMMA_M;
  const int col = tile_n * WMMA_N;
  if (row >= M || col >= N) return;

  wmma::fragment<wmma::matrix_a, WMMA_M, WMMA_N, WMMA_K, half, wmma::row_major> a_frag;  // expect: wmma
  wmma::fragment<wmma::matrix_b, WMMA_M, WMMA_N, WMMA_K, half, wmma::col_major> b_frag;  // expect: wmma
  wmma::fragment<wmma::accumulator, WMMA_M, WMMA_N, WMMA_K, float> acc;  // expect: wmma
  wmma::fill_fragment(acc, 0.0f);  // expect: wmma
  for (int k = 0; k < K; k += WMMA_K) {
    wmma::load_matrix_sync(a_frag, a + row * K + k, K);  // expect: wmma
    wmma::load_matrix_sync(b_frag, b + col * K + k, K);  // expect: wmma
    wmma::mma_sync(acc, a_frag, b_frag, acc);  // expect: wmma
  }
  wmma::store_matrix_sync(c + row * N + col, acc, N, wmma::mem_row_major);  // expect: wmma
}

// M, N, K must be multiples of 16.
void wmma_gemm(const half* a, const half* b, float* c, int M, int N, int K, cudaStream_t stream) {
  const dim3 block(kWarpsPerBlockX * 32, 4);  // expect: warp-size-literal
  const dim3 grid(ceil_div(M, WMMA_M * kWarpsPerBlockX), ceil_div(N, WMMA_N * 4));
  wmma_gemm_kernel<<<grid, block, 0, stream>>>(a, b, c, M, N, K);
  CUDA_CHECK(cudaGetLastError());
}
