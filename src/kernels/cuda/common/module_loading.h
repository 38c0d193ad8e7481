// CUDA's module loading mode and dsacp's stance on it. With lazy loading (CUDA's default since 12.2), a kernel's
// first launch loads its module under the context's lock and waits for the GPU's running kernels; beside a kernel
// that spins for another GPU (an NCCL collective, a window wait) that deadlocks the ranks of one process (seen on
// 2 x H200). Linking this unit (any use of the functions below; the CUDA
// backend and the NCCL communicator use them) sets CUDA_MODULE_LOADING=EAGER at static initialization, before
// the process's first CUDA call, unless the environment already has a value.
#pragma once

namespace dsacp::cuda {

// True when this process's CUDA loads modules lazily (asks the driver; false when it cannot tell).
bool lazy_module_loading();

// Once per process, when lazy_module_loading(): a warning on stderr naming `who` (what is about to wait across
// GPUs) and the fix (CUDA_MODULE_LOADING=EAGER before CUDA starts).
void warn_if_lazy_module_loading(const char* who);

}  // namespace dsacp::cuda
