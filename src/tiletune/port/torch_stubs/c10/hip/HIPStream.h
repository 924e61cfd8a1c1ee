// tiletune syntax-level stub of c10/hip/HIPStream.h (see torch_stubs/README.md): host-side declarations only
#pragma once
#include <hip/hip_runtime.h>

namespace c10 { namespace hip {
struct HIPStream {
  hipStream_t stream() const;
  operator hipStream_t() const;
};
HIPStream getCurrentHIPStream(int device_index = -1);
HIPStream getCurrentHIPStreamMasqueradingAsCUDA(int device_index = -1);
}}  // namespace c10::hip
namespace at { namespace hip {
using c10::hip::HIPStream;
using c10::hip::getCurrentHIPStream;
using c10::hip::getCurrentHIPStreamMasqueradingAsCUDA;
}}  // namespace at::hip
// A ROCm torch keeps the CUDA spellings (torch.utils.hipify leaves at::cuda:: names in extensions).
namespace c10 { namespace cuda {
using CUDAStream = c10::hip::HIPStream;
c10::hip::HIPStream getCurrentCUDAStream(int device_index = -1);
c10::hip::HIPStream getDefaultCUDAStream(int device_index = -1);
}}  // namespace c10::cuda
namespace at { namespace cuda { using namespace c10::cuda; } }
