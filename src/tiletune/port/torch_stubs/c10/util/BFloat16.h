// tiletune syntax-level stub of c10/util/BFloat16.h (see torch_stubs/README.md)
#pragma once
#include <hip/hip_runtime.h>
#include <cstdint>

namespace c10 {
struct alignas(2) BFloat16 {
  uint16_t x;
  BFloat16() = default;
  __host__ __device__ BFloat16(float value) {
    union { float f; uint32_t u; } bits{value};
    x = static_cast<uint16_t>((bits.u + 0x7fffu + ((bits.u >> 16) & 1u)) >> 16);
  }
  __host__ __device__ operator float() const {
    union { uint32_t u; float f; } bits{static_cast<uint32_t>(x) << 16};
    return bits.f;
  }
  __host__ __device__ BFloat16& operator+=(float o) { return *this = BFloat16(float(*this) + o); }
  __host__ __device__ BFloat16& operator-=(float o) { return *this = BFloat16(float(*this) - o); }
  __host__ __device__ BFloat16& operator*=(float o) { return *this = BFloat16(float(*this) * o); }
  __host__ __device__ BFloat16& operator/=(float o) { return *this = BFloat16(float(*this) / o); }
};
}  // namespace c10
namespace at { using c10::BFloat16; }
