#include "backends.h"

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace dsacp::py {
namespace {

// The CUDA backends, one per (device, caller's stream), with deferred errors on for good. They are never
// destroyed: the streams are the caller's (torch's pool streams live for the process) and a backend torn down
// by static destruction at exit could run after the CUDA runtime is gone.
struct CudaEntry {
  int device;
  uintptr_t stream;
  Backend* backend;
};
std::mutex cuda_mu;
std::vector<CudaEntry>& cuda_backends() {
  static auto* v = new std::vector<CudaEntry>();
  return *v;
}

}  // namespace

// One CPU backend per thread count, made on first use and kept for the process (its threads are reused).
Backend& cpu_backend(int threads) {
  if (threads < 0 || threads > 1024) {
    throw nb::value_error(("threads=" + std::to_string(threads) + ", expected 0 (all cores) .. 1024").c_str());
  }
  static std::mutex mu;
  static std::vector<std::pair<int, std::unique_ptr<Backend>>> backends;
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [n, b] : backends) {
    if (n == threads) return *b;
  }
  backends.emplace_back(threads, make_cpu_backend(threads));
  return *backends.back().second;
}

Backend& cuda_backend(int device, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(cuda_mu);
  for (const CudaEntry& e : cuda_backends()) {
    if (e.device == device && e.stream == stream) return *e.backend;
  }
  CudaBackendOptions o;
  // 0 (what torch reports for the default stream) is the legacy default stream, which the runtime names
  // cudaStreamLegacy = (cudaStream_t)0x1; a null CudaBackendOptions::stream would mean a stream of the backend's own.
  o.stream = reinterpret_cast<void*>(stream == 0 ? uintptr_t{1} : stream);
  Result<std::unique_ptr<Backend>> made = [&] {
    nb::gil_scoped_release release;
    return make_cuda_backend(device, o);
  }();
  if (!made.ok()) {
    // A stream of another device is the caller's argument error (ValueError); no usable device, or a build without
    // CUDA, a RuntimeError.
    const Status s = made.status().with_context("CUDA tensors on cuda:" + std::to_string(device));
    if (s.code() == StatusCode::kInvalidArgument) raise_if_error(s);
    throw std::runtime_error(s.to_string());
  }
  Backend* b = std::move(made).value().release();
  b->defer_errors(true);
  cuda_backends().push_back({device, stream, b});
  return *b;
}

uintptr_t call_stream(const Placement& pl, std::optional<uintptr_t> stream) {
  if (!stream && pl.torch) stream = torch_current_stream(pl.device_id);
  return stream.value_or(0);
}

Backend& op_backend(const Placement& pl, int threads, std::optional<uintptr_t> stream) {
  if (pl.cuda()) return cuda_backend(pl.device_id, call_stream(pl, stream));
  return cpu_backend(threads);
}

// Waits for every CUDA backend's work and raises the first data error a kernel found since the last check.
void check_errors() {
  std::vector<Backend*> all;
  {
    std::lock_guard<std::mutex> lock(cuda_mu);
    for (const CudaEntry& e : cuda_backends()) all.push_back(e.backend);
  }
  Status first;
  {
    nb::gil_scoped_release release;
    for (Backend* b : all) {
      Status s = b->synchronize();
      if (first.ok() && !s.ok()) first = std::move(s);
    }
  }
  raise_if_error(first);
}

}  // namespace dsacp::py
