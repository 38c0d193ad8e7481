// DLPack tensors (nanobind ndarrays) as the library's kernel arguments: dtype, shape, contiguity and device
// checked with one-line messages naming the op and the tensor; outputs either the caller's buffers (written in
// place: zero-copy) or new numpy arrays (CPU only). Every tensor of one call is on one device (Placement): all on
// the CPU, or all on one CUDA device. Internal to the Python module.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
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

// A tensor argument's DLPack view, held for the call. torch tensors are read through DLPack's C exchange table
// where torch has one (a C call filling a DLTensor), else torch._C._to_dlpack (a C function: ~0.5 us), instead of
// their Python-level __dlpack__ (~7 us a tensor, most of an op call's overhead);
// every other object (numpy, cupy, jax, a DLPack capsule) through nanobind's ndarray import.
class DlArg {
 public:
  // False when `obj` is neither a torch tensor nor something nanobind imports (DLPack / buffer protocol).
  bool import(nb::handle obj, bool writable);
  bool from_torch() const { return torch_; }
  const nb::dlpack::dltensor& t() const { return *t_; }
  int32_t device_type() const { return t_->device.device_type; }
  int32_t device_id() const { return t_->device.device_id; }
  size_t ndim() const { return static_cast<size_t>(t_->ndim); }
  int64_t shape(size_t i) const { return t_->shape[i]; }
  int64_t stride(size_t i) const;  // elements (a null strides array: row-major)
  nb::dlpack::dtype dtype() const { return t_->dtype; }
  void* data() const { return static_cast<char*>(t_->data) + t_->byte_offset; }

 private:
  template <typename A>
  void view_of(const A& a);
  const nb::dlpack::dltensor* t_ = nullptr;
  nb::object capsule_;  // torch: the capsule, whose destructor releases torch's reference
  nb::object owner_;    // torch through the DLPack exchange table: the tensor, whose shape view_ points into
  Arr ro_;              // others: the ndarray (read-only or writable import), seen through view_
  WArr rw_;
  nb::dlpack::dltensor view_;
  std::vector<int64_t> shape_, strides_;
  bool torch_ = false;
};

// Whether torch tensors are read through DLPack's C exchange table (torch imported and publishing one).
bool torch_dlpack_exchange();
// Whether torch is imported and `obj` a torch.Tensor (exact type or subclass).
bool is_torch_tensor(nb::handle obj);
// torch's current raw CUDA stream on `device` (torch._C._cuda_getCurrentRawStream), or nullopt without torch.
std::optional<uintptr_t> torch_current_stream(int device);

struct TensorArg {
  const void* data = nullptr;
  Elem elem = Elem::kF32;
  DType dtype = DType::kF32;  // for the float element types
  std::vector<int64_t> shape;
  // A paged pool's outer stride (elements from one page to the next) where it is larger than the page's own
  // elements (pages padded to a common size); 0 when the tensor is contiguous.
  int64_t page_stride = 0;
  std::shared_ptr<DlArg> keep;  // the exporter's reference (the caller's tensor stays alive for the call)
};

// A named dim: ("T", 6). A dim of -1 takes any size.
using Dim = std::pair<const char*, int64_t>;

// Where one op call's tensors are: set by the first tensor checked, every later one must match (else a ValueError
// naming both tensors and their devices).
struct Placement {
  const char* op = "";
  int32_t device_type = 0;  // 0: no tensor seen yet; else nb::device::cpu::value or nb::device::cuda::value
  int32_t device_id = 0;
  bool torch = false;  // a torch tensor among the call's (a CUDA call without stream= then runs on torch's current one)
  std::string first;  // the tensor that set it
  explicit Placement(const char* op_name) : op(op_name) {}
  bool cuda() const { return device_type == nb::device::cuda::value; }
  std::string where() const;  // "cpu" or "cuda:N"
};

// Checks device (the call's placement), contiguity, dtype (one of `elems`) and rank; the sizes are the caller's to
// check.
TensorArg tensor_arg(Placement& pl, const char* name, nb::handle a, std::initializer_list<Elem> elems, size_t ndim,
                     bool writable = false);
// The same, with every dim checked.
TensorArg tensor_arg(Placement& pl, const char* name, nb::handle a, std::initializer_list<Elem> elems,
                     std::initializer_list<Dim> dims, bool writable = false);
// A host tensor whatever the call's placement (the indexer's host copies of request / key_len), every dim checked.
TensorArg host_tensor_arg(const char* op, const char* name, nb::handle a, std::initializer_list<Elem> elems,
                          std::initializer_list<Dim> dims);
void check_dims(const char* op, const char* name, const TensorArg& t, std::initializer_list<Dim> dims);

// A paged pool's dim 0 (its pages) may be strided wider than a page (an engine's pages padded to one size:
// vLLM's page_size_padded), the rest contiguous: the view's page_stride, in bytes (a multiple of 16, checked by
// the op), else every tensor is contiguous.
// A paged pool [num_pages, page_size, dim] (f32 / bf16), or FP8 two-plane pages as uint8 [num_pages,
// page_size * (dim + 4)] or [num_pages, page_size, dim + 4] (vLLM's and DeepGEMM's indexer-key layout), or, with
// records_ok, fp8_ds_mla records as uint8 [num_pages, page_size, record_bytes] (vLLM's FP8 latent cache:
// record_bytes = dim + 4 * dim / 128 + 2 * Dr, 656 for dim 512 and Dr 64): then the latent view (e4m3, dim)
// with record_bytes set; record_dr returns Dr.
PagedPoolView paged_pool_arg(Placement& pl, const char* name, const nb::handle& obj, int64_t dim,
                             bool writable = false, int64_t fp8_page_size = 0, bool records_ok = false,
                             int32_t* record_dr = nullptr);
// The rope view (bf16, dim Dr) of a record pool's latent view.
PagedPoolView record_rope_view(const PagedPoolView& latent, int32_t Dr);
// vLLM's and FlashMLA's bf16 KV cache: one f32 / bf16 tensor [num_pages, page_size, kv_row] whose token rows hold
// the Dl latent values, then the Dr rope values, then kv_row - Dl - Dr unused ones (kv_row = 576 for 512 + 64).
// Returns the latent view (row_stride kv_row); kv_rope_view gives the rope view of the same rows. Refused with a
// ValueError naming the tensor and the shape expected: another rank, kv_row < Dl + Dr, rows or a latent part
// whose bytes are not a multiple of 16 (the GPU kernels' vector loads), or a non-contiguous tensor.
// `because` says in the message why the tensor is read so ("rope is None").
PagedPoolView kv_rows_arg(Placement& pl, const char* name, const nb::handle& obj, int64_t Dl, int64_t Dr,
                          bool writable, const char* because);
PagedPoolView kv_rope_view(const PagedPoolView& latent, int32_t Dl, int32_t Dr);
// Whether `obj` is a uint8 tensor (the record and FP8-page layouts) rather than a float one.
bool is_u8_tensor(nb::handle obj);
// int32 [num_requests, max_pages].
BlockTableView block_table_arg(Placement& pl, nb::handle a);

// An output: the caller's tensor (checked: dtype among `allowed`, exact shape, contiguous, on the call's device,
// writable), or, for CPU calls, a new numpy array of `default_elem` (returned by object()). A CUDA call must give
// its outputs (the Python wrappers in dsacp/__init__.py allocate torch tensors).
struct OutArray {
  void* data = nullptr;
  DType dtype = DType::kF32;
  nb::object obj;
  nb::object object() const { return obj; }
};
OutArray out_array(Placement& pl, const char* name, const std::optional<nb::object>& given, Elem default_elem,
                   std::vector<int64_t> shape, std::initializer_list<Elem> allowed = {});

// A library tensor handed to Python as a numpy array that owns it (no copy).
nb::object tensor_to_numpy(Tensor t);

// Status -> Python exception: ValueError for bad arguments and malformed data, OSError for files,
// RuntimeError for device, communication and internal failures.
void raise_if_error(const Status& s);

}  // namespace dsacp::py
