// Host-side staging buffers: pinned memory when the driver grants it, pageable memory otherwise.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

void* alloc_staging(size_t bytes, bool* pinned) {
  void* ptr = nullptr;
  if (cudaMallocHost(&ptr, bytes) != cudaSuccess) {
    cudaGetLastError();  // expect: discarded-status
    fprintf(stderr, "pinned allocation of %zu bytes failed: using pageable memory\n", bytes);
    *pinned = false;
    return malloc(bytes);
  }
  *pinned = true;
  return ptr;
}

void free_staging(void* ptr, bool pinned) {
  if (pinned) {
    if (cudaFreeHost(ptr) != cudaSuccess) {
      (void)cudaGetLastError();  // already says the status is dropped on purpose
    }
  } else {
    free(ptr);
  }
}
