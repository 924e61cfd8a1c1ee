// A half-precision GEMM through CUTLASS 2.x's device-level API, plus a CuTe layout helper.
#include <cutlass/gemm/device/gemm.h>  // expect: cutlass-cute
#include <cute/tensor.hpp>  // expect: cutlass-cute
#include "common.cuh"

using Gemm = cutlass::gemm::device::Gemm<cutlass::half_t, cutlass::layout::RowMajor,
                                         cutlass::half_t, cutlass::layout::ColumnMajor,
                                         float, cutlass::layout::RowMajor>;

cutlass::Status gemm_fp16(const cutlass::half_t* a, const cutlass::half_t* b, float* c, int M, int N,
                          int K, float alpha, float beta, cudaStream_t stream) {
  Gemm gemm;
  Gemm::Arguments args({M, N, K}, {a, K}, {b, K}, {c, N}, {c, N}, {alpha, beta});
  return gemm(args, nullptr, stream);
}

auto row_major_layout(int rows, int cols) {
  return cute::make_layout(cute::make_shape(rows, cols), cute::make_stride(cols, 1));
}
