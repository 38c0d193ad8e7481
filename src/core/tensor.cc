#include "dsacp/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>

namespace dsacp {

std::string shape_to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Result<int64_t> shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return invalid_argument("negative dimension in shape " + shape_to_string(shape));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return invalid_argument("shape " + shape_to_string(shape) + " overflows int64 elements");
    }
    n *= d;
  }
  return n;
}

std::string dims_to_string(std::initializer_list<DimSpec> dims) {
  std::string s = "[";
  bool first = true;
  for (const DimSpec& d : dims) {
    if (!first) s += ", ";
    first = false;
    s += std::string(d.name) + "=" + std::to_string(d.value);
  }
  return s + "]";
}

TensorView TensorView::contiguous(void* data, DType dtype, Shape shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.strides.assign(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) v.strides[i] = v.strides[i + 1] * shape[i + 1];
  v.shape = std::move(shape);
  return v;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  if (strides.size() != shape.size()) return false;
  int64_t expect = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

Status check_tensor(const char* name, const TensorView& view, std::initializer_list<DType> dtypes,
                    std::initializer_list<DimSpec> dims) {
  bool dtype_ok = false;
  std::string dtype_list;
  for (DType t : dtypes) {
    dtype_ok = dtype_ok || t == view.dtype;
    if (!dtype_list.empty()) dtype_list += " or ";
    dtype_list += dtype_name(t);
  }
  bool shape_ok = view.shape.size() == dims.size();
  if (shape_ok) {
    size_t i = 0;
    for (const DimSpec& d : dims) shape_ok = shape_ok && view.shape[i++] == d.value;
  }
  if (dtype_ok && shape_ok) {
    if (!view.is_contiguous()) {
      return invalid_argument(std::string(name) + ": expected a contiguous row-major tensor");
    }
    if (view.data == nullptr && view.numel() > 0) {
      return invalid_argument(std::string(name) + ": data pointer is null");
    }
    return Status();
  }
  return invalid_argument(std::string(name) + ": expected " + dtype_list + " with shape " + dims_to_string(dims) +
                          ", got " + dtype_name(view.dtype) + " " + shape_to_string(view.shape));
}

void Tensor::AlignedFree::operator()(std::byte* p) const { std::free(p); }

Result<Tensor> Tensor::zeros(DType dtype, Shape shape) {
  DSACP_ASSIGN_OR_RETURN(int64_t n, shape_numel(shape));
  const size_t elem = dtype_size(dtype);
  if (static_cast<uint64_t>(n) > (uint64_t{1} << 40) / elem) {
    return resource_exhausted("tensor of shape " + shape_to_string(shape) + " is larger than 1 TiB");
  }
  size_t bytes = static_cast<size_t>(n) * elem;
  size_t alloc = ((bytes + 63) / 64) * 64;
  if (alloc == 0) alloc = 64;
  void* p = std::aligned_alloc(64, alloc);
  if (p == nullptr) {
    return resource_exhausted("could not allocate " + std::to_string(alloc) + " bytes for tensor of shape " +
                              shape_to_string(shape));
  }
  std::memset(p, 0, alloc);
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.numel_ = n;
  t.storage_.reset(static_cast<std::byte*>(p));
  return t;
}

TensorView Tensor::view() const { return TensorView::contiguous(const_cast<std::byte*>(storage_.get()), dtype_, shape_); }

float Tensor::get_f32(int64_t i) const {
  if (dtype_ == DType::kI32) return static_cast<float>(data_as<int32_t>()[i]);
  return load_as_f32(data(), dtype_, i);
}

void Tensor::set_f32(int64_t i, float v) {
  if (dtype_ == DType::kI32) {
    data_as<int32_t>()[i] = static_cast<int32_t>(v);
  } else {
    store_from_f32(data(), dtype_, i, v);
  }
}

Result<Tensor> Tensor::to_dtype(DType dtype) const {
  DSACP_ASSIGN_OR_RETURN(Tensor out, Tensor::zeros(dtype, shape_));
  if (dtype == dtype_) {
    if (nbytes() > 0) std::memcpy(out.data(), data(), nbytes());
    return out;
  }
  if (dtype == DType::kI32 || dtype_ == DType::kI32) {
    return invalid_argument(std::string("cannot convert ") + dtype_name(dtype_) + " to " + dtype_name(dtype));
  }
  for (int64_t i = 0; i < numel_; ++i) out.set_f32(i, get_f32(i));
  return out;
}

}  // namespace dsacp
