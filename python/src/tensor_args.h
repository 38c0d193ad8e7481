// DLPack tensors (nanobind ndarrays) as the library's kernel arguments: dtype, shape, contiguity and device
// checked with one-line messages naming the op and the tensor; outputs either the caller's buffers (written in
// place: zero-copy) or new numpy arrays. Internal to the Python module.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dsacp/kernel_params.h"
#include "dsacp/status.h"
#include "dsacp/tensor.h"

namespace dsacp::py {

namespace nb = nanobind;

// Element types a Python tensor may carry (the library's DType plus the index types).
enum class Elem { kF32, kBF16, kF8E4M3, kI32, kI64, kU8 };
const char* elem_name(Elem e);

using Arr = nb::ndarray<nb::ro>;  // an input (read-only arrays accepted)
using WArr = nb::ndarray<>;       // written in place

struct TensorArg {
  const void* data = nullptr;
  Elem elem = Elem::kF32;
  DType dtype = DType::kF32;  // for the float element types
  std::vector<int64_t> shape;
};

// A named dim: ("T", 6). A dim of -1 takes any size.
using Dim = std::pair<const char*, int64_t>;

// Checks device (CPU), contiguity, dtype (one of `elems`) and rank; the sizes are the caller's to check.
TensorArg tensor_arg(const char* op, const char* name, const Arr& a, std::initializer_list<Elem> elems, size_t ndim);
// The same, with every dim checked.
TensorArg tensor_arg(const char* op, const char* name, const Arr& a, std::initializer_list<Elem> elems,
                     std::initializer_list<Dim> dims);
void check_dims(const char* op, const char* name, const TensorArg& t, std::initializer_list<Dim> dims);

// A paged pool [num_pages, page_size, dim] (f32 / bf16), or FP8 two-plane pages as uint8 [num_pages,
// page_size * (dim + 4)] or [num_pages, page_size, dim + 4] (vLLM's and DeepGEMM's indexer-key layout).
PagedPoolView paged_pool_arg(const char* op, const char* name, const nb::handle& obj, int64_t dim,
                             bool writable = false, int64_t fp8_page_size = 0);
// int32 [num_requests, max_pages].
BlockTableView block_table_arg(const char* op, const Arr& a);

// An output: the caller's tensor (checked: dtype among `allowed`, exact shape, contiguous, CPU, writable), or a
// new numpy array of `default_elem` (returned by object()).
struct OutArray {
  void* data = nullptr;
  DType dtype = DType::kF32;
  nb::object obj;
  nb::object object() const { return obj; }
};
OutArray out_array(const char* op, const char* name, const std::optional<nb::object>& given, Elem default_elem,
                   std::vector<int64_t> shape, std::initializer_list<Elem> allowed = {});

// A library tensor handed to Python as a numpy array that owns it (no copy).
nb::object tensor_to_numpy(Tensor t);

// Status -> Python exception: ValueError for bad arguments and malformed data, OSError for files,
// RuntimeError for device, communication and internal failures.
void raise_if_error(const Status& s);

}  // namespace dsacp::py
