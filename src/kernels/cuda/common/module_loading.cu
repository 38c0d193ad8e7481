// CUDA_MODULE_LOADING=EAGER at static initialization, and the driver's answer about the mode (module_loading.h).
#include "kernels/cuda/common/module_loading.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace dsacp::cuda {
namespace {

// Runs before main(), so before any CUDA call of a program that links this unit; a value in the environment is
// kept (an explicit LAZY then gets the warning below), and a process whose CUDA started before this library was
// loaded keeps the mode it started with.
const bool kEagerModuleLoading = [] {
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  return true;
}();

}  // namespace

bool lazy_module_loading() {
  (void)kEagerModuleLoading;
  // cuModuleGetLoadingMode (driver API, CUDA 11.7) through the runtime, without linking the driver library.
  using GetLoadingMode = int (*)(int*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 11070, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    (void)cudaGetLastError();
    return false;
  }
  int mode = 0;
  constexpr int kLazy = 0x2;  // CU_MODULE_LAZY_LOADING
  return reinterpret_cast<GetLoadingMode>(fn)(&mode) == 0 && mode == kLazy;
}

void warn_if_lazy_module_loading(const char* who) {
  static std::once_flag once;
  std::call_once(once, [who] {
    if (!lazy_module_loading()) return;
    std::fprintf(stderr,
                 "dsacp: warning: CUDA loads modules lazily in this process (the driver's loading mode); %s "
                 "waits across GPUs, and a kernel's first launch beside such a wait can deadlock the ranks of one "
                 "process. Set CUDA_MODULE_LOADING=EAGER before CUDA starts.\n",
                 who);
  });
}

}  // namespace dsacp::cuda
