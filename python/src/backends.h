// The backends the Python calls run on: one CPU backend per thread count, one CUDA backend per (device, caller's
// stream), each made on first use and kept for the process. Internal to the Python module.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>

#include "dsacp/backend.h"
#include "tensor_args.h"

namespace dsacp::py {

Backend& cpu_backend(int threads);
// The CUDA backend issuing its work on `stream` (a cudaStream_t as an int; 0: the legacy default stream), with
// deferred data errors (check_errors() raises them).
Backend& cuda_backend(int device, uintptr_t stream);
// The stream a CUDA call runs on: `stream` when given, else torch's current stream when the call has torch tensors,
// else 0 (the legacy default stream).
uintptr_t call_stream(const Placement& pl, std::optional<uintptr_t> stream);
// The backend of a call: by where its tensors are (CPU: `threads`; CUDA: the device and call_stream).
Backend& op_backend(const Placement& pl, int threads, std::optional<uintptr_t> stream);
// Adds StepPlan, plan() and run_layer() (plan.cc) to the module.
void register_plan(nanobind::module_& m);
// Adds CpGroup, CpStepPlan, cp_plan() and cp_run_layer() (cp.cc) to the module.
void register_cp(nanobind::module_& m);
// Waits for every CUDA backend's work and raises the first data error a kernel found since the last check.
void check_errors();

// Runs a kernel with the GIL released; a failed status becomes the matching Python exception.
template <typename F>
void run_kernel(F&& f) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = f();
  }
  raise_if_error(s);
}

}  // namespace dsacp::py
