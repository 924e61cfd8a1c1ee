// tiletune syntax-level stub of ATen/hip/DeviceUtils.cuh (see torch_stubs/README.md)
#pragma once
#include <hip/hip_runtime.h>

template <typename T>
__device__ __forceinline__ T WARP_SHFL(T value, int srcLane, int width = warpSize, unsigned int mask = 0xffffffff) {
  return __shfl(value, srcLane, width);
}
template <typename T>
__device__ __forceinline__ T WARP_SHFL_XOR(T value, int laneMask, int width = warpSize, unsigned int mask = 0xffffffff) {
  return __shfl_xor(value, laneMask, width);
}
template <typename T>
__device__ __forceinline__ T WARP_SHFL_UP(T value, unsigned int delta, int width = warpSize, unsigned int mask = 0xffffffff) {
  return __shfl_up(value, delta, width);
}
template <typename T>
__device__ __forceinline__ T WARP_SHFL_DOWN(T value, unsigned int delta, int width = warpSize, unsigned int mask = 0xffffffff) {
  return __shfl_down(value, delta, width);
}
