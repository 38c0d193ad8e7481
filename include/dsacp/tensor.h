// Host tensors: an owning, contiguous, row-major Tensor and a non-owning strided TensorView.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dsacp/dtype.h"
#include "dsacp/status.h"

namespace dsacp {

using Shape = std::vector<int64_t>;

std::string shape_to_string(const Shape& shape);   // "[4, 2, 8]"
// Number of elements; an error if a dim is negative or the product overflows int64.
Result<int64_t> shape_numel(const Shape& shape);

// One expected dimension: its vocabulary name ("T", "H", "Dl") and value.
struct DimSpec {
  const char* name;
  int64_t value;
};
// "[T=4, H=2, Dl=8]"
std::string dims_to_string(std::initializer_list<DimSpec> dims);

// A non-owning view: data pointer, dtype, shape and strides in elements.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<int64_t> strides;  // elements; row-major contiguous when built by contiguous()

  static TensorView contiguous(void* data, DType dtype, Shape shape);
  int64_t numel() const;
  bool is_contiguous() const;
};

// Checks a view against an expected dtype and shape; the message names the tensor and both shapes:
// "q_nope: expected BF16 or F32 with shape [T=4, H=2, Dl=8], got F32 [4, 2, 7]".
Status check_tensor(const char* name, const TensorView& view, std::initializer_list<DType> dtypes,
                    std::initializer_list<DimSpec> dims);

// An owning contiguous host tensor (64-byte aligned storage).
class Tensor {
 public:
  Tensor() = default;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;  // copies are explicit: clone()
  Tensor& operator=(const Tensor&) = delete;
  // Zero-filled; fails on a negative dim or an absurd size.
  static Result<Tensor> zeros(DType dtype, Shape shape);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  void* data() { return storage_.get(); }
  const void* data() const { return storage_.get(); }
  template <typename T>
  T* data_as() { return static_cast<T*>(data()); }
  template <typename T>
  const T* data_as() const { return static_cast<const T*>(data()); }

  TensorView view() const;
  // Element i (row-major) as float; f32, bf16 or i32.
  float get_f32(int64_t i) const;
  void set_f32(int64_t i, float v);
  // A copy converted to another float dtype (f32 <-> bf16, round to nearest even).
  Result<Tensor> to_dtype(DType dtype) const;
  Result<Tensor> clone() const { return to_dtype(dtype_); }

 private:
  struct AlignedFree {
    void operator()(std::byte* p) const;
  };
  DType dtype_ = DType::kF32;
  Shape shape_;
  int64_t numel_ = 0;
  std::unique_ptr<std::byte[], AlignedFree> storage_;
};

}  // namespace dsacp
