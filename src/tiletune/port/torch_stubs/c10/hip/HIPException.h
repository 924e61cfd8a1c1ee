// tiletune syntax-level stub of c10/hip/HIPException.h (see torch_stubs/README.md)
#pragma once
#include <hip/hip_runtime.h>
#include "c10/util/Exception.h"

#define C10_HIP_CHECK(EXPR) do { hipError_t tiletune_err = (EXPR); (void)tiletune_err; } while (0)
#define C10_HIP_CHECK_WARN(EXPR) C10_HIP_CHECK(EXPR)
#define C10_HIP_KERNEL_LAUNCH_CHECK() C10_HIP_CHECK(hipGetLastError())
#define C10_CUDA_CHECK(EXPR) C10_HIP_CHECK(EXPR)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_HIP_KERNEL_LAUNCH_CHECK()
