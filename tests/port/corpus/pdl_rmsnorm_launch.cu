// An RMSNorm launched with programmatic dependent launch (PDL): the kernel waits for the previous kernel's
// results with cudaGridDependencySynchronize, the host opts in through a launch attribute.
#include <cuda_runtime.h>

template <typename T>
__global__ void rmsnorm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int d, float eps) {
  cudaGridDependencySynchronize();  // expect: launch-attribute-missing
  const T* row = x + blockIdx.x * d;
  float sum = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) sum += float(row[i]) * float(row[i]);
  __shared__ float total;
  if (threadIdx.x == 0) total = 0.f;
  __syncthreads();
  atomicAdd(&total, sum);
  __syncthreads();
  const float scale = rsqrtf(total / d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x) y[blockIdx.x * d + i] = T(float(row[i]) * scale * float(w[i]));
  cudaTriggerProgrammaticLaunchCompletion();  // expect: launch-attribute-missing
}

cudaError_t launch_rmsnorm(const float* x, const float* w, float* y, int rows, int d, float eps, bool enable_pdl,
                           cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = rows;
  config.blockDim = 256;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // expect: launch-attribute-missing
  attrs[0].val.programmaticStreamSerializationAllowed = enable_pdl;  // expect: launch-attribute-missing
  config.numAttrs = 1;
  config.attrs = attrs;
  return cudaLaunchKernelEx(&config, rmsnorm_kernel<float>, x, w, y, d, eps);
}
