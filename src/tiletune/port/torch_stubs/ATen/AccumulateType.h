// tiletune syntax-level stub of ATen/AccumulateType.h (see torch_stubs/README.md)
#pragma once
#include "c10/util/BFloat16.h"
#include "c10/util/Half.h"

namespace at {
template <typename T, bool is_cuda> struct AccumulateType { using type = T; };
template <bool is_cuda> struct AccumulateType<c10::Half, is_cuda> { using type = float; };
template <bool is_cuda> struct AccumulateType<c10::BFloat16, is_cuda> { using type = float; };
template <bool is_cuda> struct AccumulateType<float, is_cuda> { using type = float; };
template <typename T, bool is_cuda> using acc_type = typename AccumulateType<T, is_cuda>::type;
}  // namespace at
