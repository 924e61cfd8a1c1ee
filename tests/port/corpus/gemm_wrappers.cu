// The fp16 GEMM of a torch extension: cuBLAS on NVIDIA, and the rocBLAS branch its AMD port wrote when
// torch's hipify still turned cuBLAS into rocBLAS.
#include <ATen/cuda/CUDAContext.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>

int gemm_fp16(const __half* A, const __half* B, __half* C, int m, int n, int k) {
  auto handle = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.f, beta = 0.f;
#ifdef __HIP_PLATFORM_AMD__  // expect: rocblas-branch
  rocblas_status status = rocblas_gemm_ex(handle, rocblas_operation_none, rocblas_operation_none, m, n, k, &alpha,
                                          A, rocblas_datatype_f16_r, m, B, rocblas_datatype_f16_r, k, &beta, C,
                                          rocblas_datatype_f16_r, m, C, rocblas_datatype_f16_r, m,
                                          rocblas_datatype_f32_r, rocblas_gemm_algo_standard, 0, 0);
  return status == rocblas_status_success ? 0 : 1;
#else
  cublasStatus_t status = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &alpha, A, CUDA_R_16F, m, B,
                                       CUDA_R_16F, k, &beta, C, CUDA_R_16F, m, CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT_TENSOR_OP);
  return status == CUBLAS_STATUS_SUCCESS ? 0 : 1;
#endif
}
