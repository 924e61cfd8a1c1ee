// A torch extension for int8 dot products and a float max reduction: launch geometry from the warp size on
// the host, a warp-synchronous step, the file's own float atomicMax and a packed int8 dot product.
#include <torch/extension.h>
#include <c10/macros/Macros.h>
#include "common.cuh"

__device__ float atomicMax(float* address, float val) {  // expect: hip-builtin-redefinition
  int* bits = reinterpret_cast<int*>(address);
  int old = *bits, assumed;
  do {
    assumed = old;
    old = atomicCAS(bits, assumed, __float_as_int(fmaxf(val, __int_as_float(assumed))));
  } while (assumed != old);
  return __int_as_float(old);
}

__global__ void int8_dot_kernel(const int* a, const int* b, float* out, float* absmax, int n_words) {
  __shared__ int partial[256];
  int acc = 0;
  for (int i = threadIdx.x; i < n_words; i += blockDim.x) acc = __dp4a(a[i], b[i], acc);  // expect: missing-intrinsic
  partial[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int i = 0; i < blockDim.x; ++i) total += partial[i];
    out[blockIdx.x] = static_cast<float>(total);
    atomicMax(absmax, fabsf(static_cast<float>(total)));
  }
  __syncwarp();  // expect: syncwarp
}

void int8_dot(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out, torch::Tensor& absmax) {
  const int n_words = static_cast<int>(a.size(1));
  const int threads = std::min(256, (n_words + C10_WARP_SIZE - 1) / C10_WARP_SIZE * C10_WARP_SIZE);  // expect: host-warp-size
  int8_dot_kernel<<<a.size(0), threads>>>(a.data_ptr<int>(), b.data_ptr<int>(), out.data_ptr<float>(),
                                          absmax.data_ptr<float>(), n_words);
}
