#include "tensor_args.h"

#include <cstdlib>
#include <cstring>
#include <new>

#include "dsacp/fp8.h"

namespace dsacp::py {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

[[noreturn]] void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// DLPack dtype -> element type; nullopt when the library has no such element type.
std::optional<Elem> elem_of(nb::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (code == nb::dlpack::dtype_code::Float && t.bits == 32) return Elem::kF32;
  if (code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) return Elem::kBF16;
  if (code == nb::dlpack::dtype_code::Int && t.bits == 32) return Elem::kI32;
  if (code == nb::dlpack::dtype_code::Int && t.bits == 64) return Elem::kI64;
  if (code == nb::dlpack::dtype_code::UInt && t.bits == 8) return Elem::kU8;
  if (t.code == 10 && t.bits == 8) return Elem::kF8E4M3;  // DLPack kDLFloat8_e4m3fn (torch.float8_e4m3fn)
  return std::nullopt;
}

std::string dtype_str(nb::dlpack::dtype t) {
  if (auto e = elem_of(t)) return elem_name(*e);
  return "dlpack(code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits, " +
         std::to_string(t.lanes) + " lanes)";
}

std::string allowed_str(std::initializer_list<Elem> elems) {
  std::string s;
  for (Elem e : elems) s += (s.empty() ? "" : " or ") + std::string(elem_name(e));
  return s;
}

DType to_dtype(Elem e) {
  switch (e) {
    case Elem::kBF16: return DType::kBF16;
    case Elem::kF8E4M3: return DType::kF8E4M3;
    case Elem::kI32: return DType::kI32;
    default: return DType::kF32;
  }
}

nb::dlpack::dtype dlpack_of(Elem e) {
  switch (e) {
    case Elem::kI32: return nb::dtype<int32_t>();
    case Elem::kI64: return nb::dtype<int64_t>();
    case Elem::kU8: return nb::dtype<uint8_t>();
    default: return nb::dtype<float>();
  }
}

std::string device_str(int32_t type, int32_t id) {
  if (type == nb::device::cpu::value) return "cpu";
  if (type == nb::device::cuda::value) return "cuda:" + std::to_string(id);
  return "DLPack device type " + std::to_string(type);
}

// DLPack 1.2's C exchange table (dlpack.h: DLPackExchangeAPI), which a framework publishes on its tensor type as
// __dlpack_c_exchange_api__ (a "dlpack_exchange_api" capsule) or, first spelled, __c_dlpack_exchange_api__ (an
// integer address): a tensor's DLTensor filled in by a C call, without a capsule or a Python-level call. Stock torch
// 2.11 publishes neither; torch-c-dlpack-ext (which tvm-ffi, and so FlashInfer, loads) sets both on torch.Tensor.
// Only the members read here are named; the layout is dlpack.h's (checked against torch 2.11's ATen/dlpack.h).
struct DlpackExchangeApi {
  struct {
    uint32_t major, minor;  // DLPackVersion
    void* prev_api;
  } header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, nb::dlpack::dltensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

// torch, looked up once it is imported: torch.Tensor, its DLPack exchange table where it has one (else
// torch._C._to_dlpack), and _cuda_getCurrentRawStream.
struct Torch {
  PyTypeObject* tensor = nullptr;
  const DlpackExchangeApi* exchange = nullptr;  // major version 1 with both functions read here, else null
  nb::object to_dlpack, current_stream;
};
Torch* torch_api() {
  static Torch* api = nullptr;  // never freed (used until the interpreter ends)
  if (api != nullptr) return api;
  nb::object mod = nb::steal(PyImport_GetModule(nb::str("torch").ptr()));
  if (!mod.is_valid()) {
    PyErr_Clear();
    return nullptr;  // torch not imported (yet): no torch tensor can be passed
  }
  auto* a = new Torch();
  a->tensor = reinterpret_cast<PyTypeObject*>(mod.attr("Tensor").ptr());
  Py_INCREF(a->tensor);
  nb::object c = mod.attr("_C");
  a->to_dlpack = c.attr("_to_dlpack");
  for (const char* name : {"__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"}) {
    if (!nb::hasattr(mod.attr("Tensor"), name)) continue;
    nb::object ptr = mod.attr("Tensor").attr(name);
    void* p = PyCapsule_CheckExact(ptr.ptr()) ? PyCapsule_GetPointer(ptr.ptr(), "dlpack_exchange_api")
              : PyLong_Check(ptr.ptr())       ? PyLong_AsVoidPtr(ptr.ptr())
                                              : nullptr;
    if (p == nullptr) PyErr_Clear();
    const auto* x = static_cast<const DlpackExchangeApi*>(p);
    if (x != nullptr && x->header.major == 1 && x->dltensor_from_py_object_no_sync != nullptr &&
        x->current_work_stream != nullptr) {
      a->exchange = x;
      break;
    }
  }
  if (nb::hasattr(c, "_cuda_getCurrentRawStream")) a->current_stream = c.attr("_cuda_getCurrentRawStream");
  api = a;
  return api;
}

// The caller's tensor with its checks: device (the call's placement; a host tensor: pl null, the CPU), contiguity
// and dtype; returns its data, element type and shape.
TensorArg checked(const char* op, Placement* pl, const char* name, nb::handle obj, std::initializer_list<Elem> elems,
                  bool writable, bool paged = false) {
  auto keep = std::make_shared<DlArg>();
  if (!keep->import(obj, writable)) {
    // Not a tensor at all: a TypeError, as a call with the wrong kind of argument gets from the binding itself.
    const std::string msg = std::string(op) + ": '" + name + "' is not a " + (writable ? "writable " : "") +
                            "tensor (DLPack / buffer protocol), got " + nb::type_name(obj.type()).c_str();
    throw nb::type_error(msg.c_str());
  }
  const DlArg& a = *keep;
  const std::string what = std::string(op) + ": tensor '" + name + "'";
  const int32_t type = a.device_type(), id = a.device_id();
  if (type != nb::device::cpu::value && type != nb::device::cuda::value) {
    value_error(what + " is on " + device_str(type, id) + ", expected a CPU or CUDA tensor");
  }
  if (pl == nullptr) {
    if (type != nb::device::cpu::value) {
      value_error(what + " is on " + device_str(type, id) + ", expected a CPU tensor (host copies for planning)");
    }
  } else if (pl->device_type == 0) {
    pl->device_type = type;
    pl->device_id = type == nb::device::cuda::value ? id : 0;
    pl->first = name;
  } else if (pl->device_type != type || (type == nb::device::cuda::value && pl->device_id != id)) {
    value_error(what + " is on " + device_str(type, id) + " but '" + pl->first + "' is on " + pl->where() +
                "; expected every tensor of the call on one device");
  }
  if (pl != nullptr && a.from_torch()) pl->torch = true;
  TensorArg t;
  t.shape.resize(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) t.shape[i] = a.shape(i);
  const std::optional<Elem> e = elem_of(a.dtype());
  bool ok = false;
  for (Elem x : elems) ok = ok || (e && *e == x);
  if (!ok) value_error(what + " has dtype " + dtype_str(a.dtype()) + ", expected " + allowed_str(elems));
  int64_t expect = 1;
  for (size_t k = a.ndim(); k-- > 0;) {
    if (paged && k == 0 && a.ndim() > 1 && a.shape(0) > 1 && a.stride(0) > expect) {
      t.page_stride = a.stride(0);  // pages padded past their own elements
      continue;
    }
    if (a.shape(k) != 1 && a.stride(k) != expect) {
      std::vector<int64_t> strides, want(a.ndim());
      int64_t w = 1;
      for (size_t i = a.ndim(); i-- > 0;) want[i] = w, w *= a.shape(i);
      for (size_t i = 0; i < a.ndim(); ++i) strides.push_back(a.stride(i));
      value_error(what + " is not contiguous (strides " + shape_str(strides) + " elements, expected " +
                  shape_str(want) + (paged ? ", or a wider stride of dim 0 only: padded pages" : "") +
                  "): pass a contiguous tensor (.contiguous())");
    }
    expect *= a.shape(k);
  }
  t.data = a.data();
  t.elem = *e;
  t.dtype = to_dtype(*e);
  t.keep = std::move(keep);
  return t;
}

}  // namespace

std::string Placement::where() const { return device_str(device_type, device_id); }

// The unversioned DLPack capsule's payload (DLManagedTensor).
struct DlManaged {
  nb::dlpack::dltensor t;
  void* ctx;
  void (*deleter)(DlManaged*);
};

bool DlArg::import(nb::handle obj, bool writable) {
  Torch* api = torch_api();
  if (api != nullptr && api->exchange != nullptr && Py_TYPE(obj.ptr()) == api->tensor) {
    // The exchange table's non-owning DLTensor: its shape and strides are the tensor's own, alive while the
    // tensor is (held here for the call).
    if (api->exchange->dltensor_from_py_object_no_sync(obj.ptr(), &view_) == 0) {
      owner_ = nb::borrow(obj);
      t_ = &view_;
      torch_ = true;
      return true;
    }
    PyErr_Clear();  // the capsule path below says what it is not
  }
  if (api != nullptr && PyObject_TypeCheck(obj.ptr(), api->tensor)) {
    // torch._C._to_dlpack(t): a "dltensor" capsule that owns a reference to the tensor; its destructor (when
    // capsule_ goes) calls the deleter, as the capsule is never marked consumed.
    PyObject* args[] = {obj.ptr()};
    PyObject* cap = PyObject_Vectorcall(api->to_dlpack.ptr(), args, 1, nullptr);
    if (cap == nullptr) {
      PyErr_Clear();  // (e.g. a dtype DLPack has no code for): the general path says what it is not
    } else {
      capsule_ = nb::steal(cap);
      auto* m = static_cast<DlManaged*>(PyCapsule_GetPointer(cap, "dltensor"));
      if (m == nullptr) {
        PyErr_Clear();
        capsule_.reset();
      } else {
        t_ = &m->t;
        torch_ = true;
        return true;
      }
    }
  }
  if (writable ? !nb::try_cast(obj, rw_) : !nb::try_cast(obj, ro_)) return false;
  // nanobind's ndarray holds its DLPack tensor; a view of it through the public accessors.
  if (writable) view_of(rw_);
  else view_of(ro_);
  return true;
}

template <typename A>
void DlArg::view_of(const A& array_) {
  view_.data = const_cast<void*>(static_cast<const void*>(array_.data()));
  view_.device = {array_.device_type(), array_.device_id()};
  view_.ndim = static_cast<int32_t>(array_.ndim());
  view_.dtype = array_.dtype();
  shape_.resize(array_.ndim());
  strides_.resize(array_.ndim());
  for (size_t i = 0; i < array_.ndim(); ++i) shape_[i] = static_cast<int64_t>(array_.shape(i)), strides_[i] = array_.stride(i);
  view_.shape = shape_.data();
  view_.strides = strides_.data();
  view_.byte_offset = 0;
  t_ = &view_;
}

int64_t DlArg::stride(size_t i) const {
  if (t_->strides != nullptr) return t_->strides[i];
  int64_t s = 1;
  for (size_t k = i + 1; k < ndim(); ++k) s *= t_->shape[k];
  return s;
}

bool torch_dlpack_exchange() {
  Torch* api = torch_api();
  return api != nullptr && api->exchange != nullptr;
}

bool is_torch_tensor(nb::handle obj) {
  Torch* api = torch_api();
  return api != nullptr && PyObject_TypeCheck(obj.ptr(), api->tensor);
}

std::optional<uintptr_t> torch_current_stream(int device) {
  Torch* api = torch_api();
  if (api == nullptr) return std::nullopt;
  if (api->exchange != nullptr) {
    void* s = nullptr;
    if (api->exchange->current_work_stream(nb::device::cuda::value, device, &s) == 0) {
      return reinterpret_cast<uintptr_t>(s);
    }
    PyErr_Clear();
  }
  if (!api->current_stream.is_valid()) return std::nullopt;
  return nb::cast<uintptr_t>(api->current_stream(device));
}

const char* elem_name(Elem e) {
  switch (e) {
    case Elem::kF32: return "float32";
    case Elem::kBF16: return "bfloat16";
    case Elem::kF8E4M3: return "float8_e4m3fn";
    case Elem::kI32: return "int32";
    case Elem::kI64: return "int64";
    case Elem::kU8: return "uint8";
  }
  return "?";
}

void check_dims(const char* op, const char* name, const TensorArg& t, std::initializer_list<Dim> dims) {
  bool ok = t.shape.size() == dims.size();
  std::string want = "[";
  size_t i = 0;
  for (const Dim& d : dims) {
    want += (i ? ", " : "") + std::string(d.first) + (d.second >= 0 ? "=" + std::to_string(d.second) : "");
    if (ok && d.second >= 0 && t.shape[i] != d.second) ok = false;
    ++i;
  }
  want += "]";
  if (!ok) value_error(std::string(op) + ": tensor '" + name + "' has shape " + shape_str(t.shape) + ", expected " + want);
}

TensorArg tensor_arg(Placement& pl, const char* name, nb::handle a, std::initializer_list<Elem> elems, size_t ndim,
                     bool writable) {
  TensorArg t = checked(pl.op, &pl, name, a, elems, writable);
  if (t.shape.size() != ndim) {
    value_error(std::string(pl.op) + ": tensor '" + name + "' has " + std::to_string(t.shape.size()) + " dims " +
                shape_str(t.shape) + ", expected " + std::to_string(ndim));
  }
  return t;
}

TensorArg tensor_arg(Placement& pl, const char* name, nb::handle a, std::initializer_list<Elem> elems,
                     std::initializer_list<Dim> dims, bool writable) {
  TensorArg t = checked(pl.op, &pl, name, a, elems, writable);
  check_dims(pl.op, name, t, dims);
  return t;
}

TensorArg host_tensor_arg(const char* op, const char* name, nb::handle a, std::initializer_list<Elem> elems,
                          std::initializer_list<Dim> dims) {
  TensorArg t = checked(op, nullptr, name, a, elems, false);
  check_dims(op, name, t, dims);
  return t;
}

PagedPoolView paged_pool_arg(Placement& pl, const char* name, const nb::handle& obj, int64_t dim, bool writable,
                             int64_t fp8_page_size, bool records_ok, int32_t* record_dr) {
  const char* op = pl.op;
  TensorArg t = checked(op, &pl, name, obj, {Elem::kF32, Elem::kBF16, Elem::kU8}, writable, /*paged=*/true);
  PagedPoolView v;
  v.data = const_cast<void*>(t.data);
  v.dim = static_cast<int32_t>(dim);
  v.page_stride = t.page_stride * static_cast<int64_t>(t.elem == Elem::kU8 ? 1 : t.elem == Elem::kBF16 ? 2 : 4);
  if (t.elem == Elem::kU8) {
    // fp8_ds_mla records: [num_pages, page_size, dim + 4 * dim / 128 + 2 * Dr] (never dim + 4: Dr > 0).
    const int64_t head = dim + 4 * (dim / kFp8DsMlaTile);
    if (records_ok && t.shape.size() == 3 && dim % kFp8DsMlaTile == 0 && t.shape[2] > head &&
        (t.shape[2] - head) % 2 == 0) {
      v.dtype = DType::kF8E4M3;
      v.num_pages = t.shape[0];
      v.page_size = static_cast<int32_t>(t.shape[1]);
      v.record_bytes = static_cast<int32_t>(t.shape[2]);
      if (record_dr != nullptr) *record_dr = static_cast<int32_t>((t.shape[2] - head) / 2);
      return v;
    }
    // FP8 two-plane pages: [num_pages, page_size, dim + 4] or [num_pages, page_size * (dim + 4)].
    int64_t ps = 0;
    if (t.shape.size() == 3 && t.shape[2] == dim + 4) ps = t.shape[1];
    if (t.shape.size() == 2 && t.shape[1] % (dim + 4) == 0) ps = t.shape[1] / (dim + 4);
    if (fp8_page_size > 0 && t.shape.size() == 2) ps = t.shape[1] == fp8_page_size * (dim + 4) ? fp8_page_size : 0;
    if (ps <= 0) {
      std::string want = "FP8 pages [num_pages, page_size, " + std::to_string(dim + 4) + "] or [num_pages, page_size * " +
                         std::to_string(dim + 4) + "]";
      if (records_ok && dim % kFp8DsMlaTile == 0) {
        want = "fp8_ds_mla records [num_pages, page_size, " + std::to_string(head) + " + 2 * Dr] (" +
               std::to_string(head + 128) + " for Dr = 64)";
      }
      value_error(std::string(op) + ": uint8 pool '" + name + "' has shape " + shape_str(t.shape) + ", expected " + want);
    }
    v.dtype = DType::kF8E4M3;
    v.num_pages = t.shape[0];
    v.page_size = static_cast<int32_t>(ps);
    return v;
  }
  check_dims(op, name, t, {{"num_pages", -1}, {"page_size", -1}, {"dim", dim}});
  v.dtype = t.dtype;
  v.num_pages = t.shape[0];
  v.page_size = static_cast<int32_t>(t.shape[1]);
  return v;
}

PagedPoolView record_rope_view(const PagedPoolView& latent, int32_t Dr) {
  PagedPoolView r = latent;
  r.dtype = DType::kBF16;
  r.dim = Dr;
  return r;
}

PagedPoolView kv_rows_arg(Placement& pl, const char* name, const nb::handle& obj, int64_t Dl, int64_t Dr,
                          bool writable, const char* because) {
  const char* op = pl.op;
  TensorArg t = checked(op, &pl, name, obj, {Elem::kF32, Elem::kBF16}, writable, /*paged=*/true);
  const size_t esize = t.elem == Elem::kBF16 ? 2 : 4;
  const std::string want = "the combined KV cache [num_pages, page_size, kv_row] with kv_row >= Dl + Dr = " +
                           std::to_string(Dl) + " + " + std::to_string(Dr) +
                           " (each token's latent, then its rope, then unused values; 576 in vLLM's layout), since " +
                           because;
  if (t.shape.size() != 3 || t.shape[2] < Dl + Dr) {
    value_error(std::string(op) + ": tensor '" + name + "' has shape " + shape_str(t.shape) + ", expected " + want);
  }
  if (static_cast<size_t>(t.shape[2]) * esize % 16 != 0 || static_cast<size_t>(Dl) * esize % 16 != 0) {
    value_error(std::string(op) + ": tensor '" + name + "' has shape " + shape_str(t.shape) + " of " +
                elem_name(t.elem) + ": the combined KV cache's rows (" + std::to_string(t.shape[2]) +
                " values) and their latent part (" + std::to_string(Dl) +
                ") must each be a multiple of 16 bytes (the GPU kernels' vector loads)");
  }
  PagedPoolView v;
  v.data = const_cast<void*>(t.data);
  v.dtype = t.dtype;
  v.num_pages = t.shape[0];
  v.page_size = static_cast<int32_t>(t.shape[1]);
  v.dim = static_cast<int32_t>(Dl);
  v.row_stride = t.shape[2];
  v.page_stride = t.page_stride * static_cast<int64_t>(esize);
  return v;
}

PagedPoolView kv_rope_view(const PagedPoolView& latent, int32_t Dl, int32_t Dr) {
  PagedPoolView r = latent;
  r.data = static_cast<char*>(latent.data) + static_cast<size_t>(Dl) * dtype_size(latent.dtype);
  r.dim = Dr;
  return r;
}

bool is_u8_tensor(nb::handle obj) {
  PyObject* dt = PyObject_GetAttrString(obj.ptr(), "dtype");
  if (dt == nullptr) {
    PyErr_Clear();
    return false;
  }
  nb::object name = nb::steal(PyObject_Str(dt));
  Py_DECREF(dt);
  if (!name.is_valid()) {
    PyErr_Clear();
    return false;
  }
  const char* s = PyUnicode_AsUTF8(name.ptr());
  if (s == nullptr) {
    PyErr_Clear();
    return false;
  }
  return std::strcmp(s, "uint8") == 0 || std::strcmp(s, "torch.uint8") == 0;
}

BlockTableView block_table_arg(Placement& pl, nb::handle a) {
  TensorArg t = tensor_arg(pl, "block_table", a, {Elem::kI32}, 2);
  return {static_cast<const int32_t*>(t.data), static_cast<int32_t>(t.shape[0]), static_cast<int32_t>(t.shape[1])};
}

OutArray out_array(Placement& pl, const char* name, const std::optional<nb::object>& given, Elem default_elem,
                   std::vector<int64_t> shape, std::initializer_list<Elem> allowed) {
  const char* op = pl.op;
  OutArray o;
  if (given && !given->is_none()) {
    std::initializer_list<Elem> one = {default_elem};
    TensorArg t = checked(op, &pl, name, *given, allowed.size() > 0 ? allowed : one, true);
    if (t.shape != shape) {
      value_error(std::string(op) + ": output '" + name + "' has shape " + shape_str(t.shape) + ", expected " +
                  shape_str(shape));
    }
    o.data = const_cast<void*>(t.data);
    o.dtype = t.dtype;
    o.obj = *given;
    return o;
  }
  if (default_elem == Elem::kBF16) {
    value_error(std::string(op) + ": output '" + name + "' not given, and numpy has no bfloat16: pass " + name +
                "= (a bfloat16 tensor of shape " + shape_str(shape) + ")");
  }
  if (pl.cuda()) {
    value_error(std::string(op) + ": output '" + name + "' not given; a call on CUDA tensors writes into the " +
                "caller's outputs: pass " + name + "= (a " + pl.where() + " tensor of shape " + shape_str(shape) + ")");
  }
  size_t n = 1;
  std::vector<size_t> dims;
  for (int64_t d : shape) n *= static_cast<size_t>(d), dims.push_back(static_cast<size_t>(d));
  const size_t elem_bytes = default_elem == Elem::kI64 ? 8 : default_elem == Elem::kU8 ? 1 : 4;
  void* p = std::calloc(n == 0 ? 1 : n, elem_bytes);
  if (p == nullptr) throw std::bad_alloc();
  nb::capsule owner(p, [](void* q) noexcept { std::free(q); });
  o.data = p;
  o.dtype = to_dtype(default_elem);
  o.obj = nb::cast(nb::ndarray<nb::numpy>(p, dims.size(), dims.data(), owner, nullptr, dlpack_of(default_elem)));
  return o;
}

nb::object tensor_to_numpy(Tensor t) {
  std::vector<size_t> dims;
  for (int64_t d : t.shape()) dims.push_back(static_cast<size_t>(d));
  const Elem e = t.dtype() == DType::kI32 ? Elem::kI32 : Elem::kF32;
  auto* owned = new Tensor(std::move(t));
  nb::capsule owner(owned, [](void* q) noexcept { delete static_cast<Tensor*>(q); });
  return nb::cast(nb::ndarray<nb::numpy>(owned->data(), dims.size(), dims.data(), owner, nullptr, dlpack_of(e)));
}

void raise_if_error(const Status& s) {
  if (s.ok()) return;
  const std::string msg = s.to_string();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kUnsupported:
    case StatusCode::kDataLoss:
      throw nb::value_error(msg.c_str());
    case StatusCode::kIoError:
      PyErr_SetString(PyExc_OSError, msg.c_str());
      throw nb::python_error();
    default:
      throw std::runtime_error(msg);
  }
}

}  // namespace dsacp::py
