// Hand-tuned building blocks through inline PTX: a streaming vector load, the lane id, an
// m16n8k16 tensor-core MMA and an asynchronous global-to-shared copy.
#include <cuda_runtime.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float4 load_streaming(const float4* ptr) {
  float4 v;
  asm volatile("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];"  // expect: inline-asm
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ unsigned lane_id() {
  unsigned lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));  // expect: inline-asm
  return lane;
}

__device__ __forceinline__ void mma_m16n8k16(float* d, const unsigned* a, const unsigned* b,
                                             const float* c) {
  asm volatile(  // expect: inline-asm
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "  // expect: ptx-mma
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ void copy_async_16(void* smem, const void* gmem) {
  const unsigned smem_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));  // expect: missing-intrinsic
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));  // expect: inline-asm, ptx-mma
  asm volatile("cp.async.wait_all;\n" ::);  // expect: inline-asm, ptx-mma
}

__global__ void scale_kernel(const float4* __restrict__ in, float4* __restrict__ out, float alpha,
                             int n4, unsigned* lane_of_first) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) *lane_of_first = lane_id();
  if (i < n4) {
    float4 v = load_streaming(in + i);
    out[i] = make_float4(v.x * alpha, v.y * alpha, v.z * alpha, v.w * alpha);
  }
}
