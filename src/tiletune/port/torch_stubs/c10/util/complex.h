// tiletune syntax-level stub of c10/util/complex.h (see torch_stubs/README.md)
#pragma once
#include <hip/hip_runtime.h>

namespace c10 {
template <typename T>
struct alignas(2 * sizeof(T)) complex {
  using value_type = T;
  T real_ = T(0), imag_ = T(0);
  constexpr complex() = default;
  __host__ __device__ constexpr complex(T re, T im = T(0)) : real_(re), imag_(im) {}
  __host__ __device__ constexpr T real() const { return real_; }
  __host__ __device__ constexpr T imag() const { return imag_; }
  __host__ __device__ complex& operator+=(const complex& o) { real_ += o.real_; imag_ += o.imag_; return *this; }
  __host__ __device__ complex& operator*=(const complex& o) { return *this = *this * o; }
  friend __host__ __device__ complex operator+(complex a, const complex& b) { return a += b; }
  friend __host__ __device__ complex operator-(const complex& a, const complex& b) { return {a.real_ - b.real_, a.imag_ - b.imag_}; }
  friend __host__ __device__ complex operator*(const complex& a, const complex& b) {
    return {a.real_ * b.real_ - a.imag_ * b.imag_, a.real_ * b.imag_ + a.imag_ * b.real_};
  }
  friend __host__ __device__ complex operator*(const complex& a, T b) { return {a.real_ * b, a.imag_ * b}; }
  friend __host__ __device__ complex operator*(T a, const complex& b) { return b * a; }
};
template <typename T> struct scalar_value_type { using type = T; };
template <typename T> struct scalar_value_type<complex<T>> { using type = T; };
}  // namespace c10
