// Helpers of the spectral kernels (host and device): float2 as a complex number, and bf16 sums.
#pragma once
#define HOST_DEVICE __host__ __device__
#include <cuda_bf16.h>  // expect: bf16-type
#include <thrust/complex.h>  // expect: unused-thrust-header
#include "nvToolsExt.h"  // expect: unused-nvtx-header

HOST_DEVICE inline float2 operator+(const float2& a, const float2& b) { return make_float2(a.x + b.x, a.y + b.y); }

HOST_DEVICE inline float2 operator*(const float2& a, const float2& b) {  // expect: hip-builtin-redefinition
  return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}

HOST_DEVICE inline float2 operator*(const float s, const float2& a) { return make_float2(s * a.x, s * a.y); }

__host__ __device__ inline void operator+=(float2& a, const float2& b) {  // expect: hip-builtin-redefinition
  a.x += b.x;
  a.y += b.y;
}

__device__ inline __nv_bfloat16 bf16_add(__nv_bfloat16 a, __nv_bfloat16 b) {
  return a + b;  // expect: bf16-arithmetic
}

__device__ inline float bf16_dot2(__nv_bfloat162 a, __nv_bfloat162 b) {
  const float2 fa = __bfloat1622float2(a), fb = __bfloat1622float2(b);
  return fa.x * fb.x + fa.y * fb.y;
}
