// tiletune syntax-level stub of ATen/ATen.h (see torch_stubs/README.md): host-side declarations only
#pragma once
#include <cstdint>
#include <vector>
#include "c10/util/BFloat16.h"
#include "c10/util/Exception.h"
#include "c10/util/Half.h"
#include "c10/util/complex.h"

namespace at {
enum class ScalarType : int8_t { Byte, Char, Short, Int, Long, Half, Float, Double, ComplexFloat, Bool, BFloat16 };
constexpr ScalarType kByte = ScalarType::Byte, kInt = ScalarType::Int, kLong = ScalarType::Long,
                     kHalf = ScalarType::Half, kFloat = ScalarType::Float, kDouble = ScalarType::Double,
                     kBFloat16 = ScalarType::BFloat16, kBool = ScalarType::Bool;
struct Device { bool is_cuda() const; int index() const; };
struct TensorOptions { TensorOptions dtype(ScalarType) const; };
using IntArrayRef = std::vector<int64_t>;
using IntList = IntArrayRef;  // the pre-1.0 name
class Tensor {
 public:
  template <typename T> T* data_ptr() const;
  template <typename T> T* data() const;  // deprecated spelling of data_ptr
  void* data_ptr() const;
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t dim() const;
  int64_t numel() const;
  IntArrayRef sizes() const;
  IntArrayRef strides() const;
  ScalarType scalar_type() const;
  ScalarType dtype() const;
  Device device() const;
  TensorOptions options() const;
  bool is_contiguous() const;
  bool is_cuda() const;
  Tensor contiguous() const;
  Tensor to(ScalarType) const;
};
Tensor empty(IntArrayRef sizes, TensorOptions options);
Tensor empty_like(const Tensor& other);
Tensor zeros(IntArrayRef sizes, TensorOptions options);
Tensor zeros_like(const Tensor& other);
}  // namespace at
namespace torch { using at::Tensor; }
