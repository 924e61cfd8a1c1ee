// tiletune syntax-level stub of ATen/hip/Atomic.cuh (see torch_stubs/README.md)
#pragma once
#include <hip/hip_runtime.h>
#include "c10/util/complex.h"

template <typename T>
__device__ inline T gpuAtomicAdd(T* address, T value) { return atomicAdd(address, value); }
template <typename T>
__device__ inline c10::complex<T> gpuAtomicAdd(c10::complex<T>* address, c10::complex<T> value) {
  T* parts = reinterpret_cast<T*>(address);
  return {atomicAdd(parts, value.real_), atomicAdd(parts + 1, value.imag_)};
}
