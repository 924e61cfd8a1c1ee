// A double-buffered copy engine that orders two streams with events, through the C++ overload and the default
// argument CUDA's runtime headers give these calls.
#include <cuda_runtime.h>

struct CopyEngine {
  cudaStream_t copy, compute;
  cudaEvent_t ready;

  void init() {
    cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
    cudaEventCreate(&ready, cudaEventDisableTiming);  // expect: runtime-overload
  }

  void hand_over(const float* src, float* dst, size_t bytes) {
    cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, copy);
    cudaEventRecord(ready, copy);
    cudaStreamWaitEvent(compute, ready);  // expect: runtime-overload
    cudaStreamWaitEvent(copy, ready, 0);
  }
};
