// tiletune syntax-level stub of c10/hip/HIPGuard.h (see torch_stubs/README.md): host-side declarations only
#pragma once
#include "ATen/ATen.h"

namespace c10 { namespace hip {
struct HIPGuard { explicit HIPGuard(int device); explicit HIPGuard(at::Device device); };
struct OptionalHIPGuard { explicit OptionalHIPGuard(at::Device device); };
using HIPGuardMasqueradingAsCUDA = HIPGuard;
using OptionalHIPGuardMasqueradingAsCUDA = OptionalHIPGuard;
}}  // namespace c10::hip
namespace at { namespace hip { using c10::hip::HIPGuard; using c10::hip::OptionalHIPGuard; } }
namespace c10 { namespace cuda { using CUDAGuard = c10::hip::HIPGuard; using OptionalCUDAGuard = c10::hip::OptionalHIPGuard; } }
namespace at { namespace cuda { using c10::cuda::CUDAGuard; using c10::cuda::OptionalCUDAGuard; } }
