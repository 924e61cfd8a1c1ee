// hip-build: -D USE_MIOPEN -U USE_CUDNN
// A convolution layer's GPU pass through cuDNN, the whole file under the project's USE_CUDNN flag, which its ROCm
// build (USE_MIOPEN) leaves undefined: the layer compiles out on AMD, and once the test is widened its cuDNN calls
// need MIOpen's, which take other arguments in another order.
#ifdef USE_CUDNN  // expect: cuda-build-flag
#include <cudnn.h>  // expect: cudnn-api
#include "common.cuh"

#define CUDNN_CHECK(status) check_status(static_cast<int>(status), __FILE__, __LINE__)
void check_status(int status, const char* file, int line);

struct ConvLayer {
  cudnnHandle_t handle;
  cudnnTensorDescriptor_t x_desc, y_desc;
  cudnnFilterDescriptor_t w_desc;
  cudnnConvolutionDescriptor_t conv_desc;
  cudnnConvolutionFwdAlgo_t algo;
  void* workspace;
  size_t workspace_bytes;

  void forward(const float* x, const float* w, float* y) {
    const float one = 1.f, zero = 0.f;
    CUDNN_CHECK(cudnnConvolutionForward(handle, &one, x_desc, x, w_desc, w, conv_desc, algo,  // expect: cudnn-api
                                        workspace, workspace_bytes, &zero, y_desc, y));
  }
};
#endif  // USE_CUDNN
