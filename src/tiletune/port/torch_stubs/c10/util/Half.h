// tiletune syntax-level stub of c10/util/Half.h (see torch_stubs/README.md)
#pragma once
#include <hip/hip_fp16.h>

namespace c10 {
struct alignas(2) Half {
  unsigned short x;
  Half() = default;
  __host__ __device__ Half(float value) : x(__half_as_ushort(__float2half(value))) {}
  __host__ __device__ Half(__half value) : x(__half_as_ushort(value)) {}
  __host__ __device__ operator float() const { return __half2float(__ushort_as_half(x)); }
  __host__ __device__ operator __half() const { return __ushort_as_half(x); }
  __host__ __device__ Half& operator+=(float o) { return *this = Half(float(*this) + o); }
  __host__ __device__ Half& operator-=(float o) { return *this = Half(float(*this) - o); }
  __host__ __device__ Half& operator*=(float o) { return *this = Half(float(*this) * o); }
  __host__ __device__ Half& operator/=(float o) { return *this = Half(float(*this) / o); }
};
}  // namespace c10
namespace at { using c10::Half; }
