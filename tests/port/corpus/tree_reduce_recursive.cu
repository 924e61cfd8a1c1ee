// A block-wide sum by a recursive template over a shared-memory array, halving the active threads at each step;
// the author dropped the barrier once the stride fits in a 32-lane warp.
template <typename T, int stride>
struct tree_sum {
  __device__ static void run(T* partial, T* out) {
    if (stride > 16) {  // expect: warp-sync-skipped
      __syncthreads();
    }
    if (threadIdx.x < stride) {
      partial[threadIdx.x] += partial[threadIdx.x + stride];
      tree_sum<T, stride / 2>::run(partial, out);
    }
  }
};

template <typename T>
struct tree_sum<T, 0> {
  __device__ static void run(T* partial, T* out) { out[blockIdx.x] = partial[0]; }
};

__global__ void block_sum(const float* x, float* out, int n) {
  __shared__ float partial[256];
  const int i = blockIdx.x * 256 + threadIdx.x;
  partial[threadIdx.x] = i < n ? x[i] : 0.f;
  tree_sum<float, 128>::run(partial, out);
}
