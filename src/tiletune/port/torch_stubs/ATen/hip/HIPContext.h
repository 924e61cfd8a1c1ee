// tiletune syntax-level stub of ATen/hip/HIPContext.h (see torch_stubs/README.md): host-side declarations only
#pragma once
#include <hip/hip_runtime.h>
#include "ATen/ATen.h"
#include "c10/hip/HIPException.h"
#include "c10/hip/HIPStream.h"

namespace at { namespace hip {
hipDeviceProp_t* getCurrentDeviceProperties();
int current_device();
}}  // namespace at::hip
namespace at { namespace cuda { using at::hip::getCurrentDeviceProperties; using at::hip::current_device; } }
