// A kernel's dynamic shared memory limit (cudaFuncAttributeMaxDynamicSharedMemorySize), set once per kernel and
// device rather than before every launch: the call is a driver round trip (a few microseconds, more when CP ranks
// that are threads of one process make CUDA calls at the same time), and a launch that needs no more than an
// earlier one of the same kernel on the device needs none. The limit only grows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace dsacp::cuda {

inline cudaError_t ensure_dynamic_smem_limit(const void* kernel, int bytes) {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> set;  // (kernel, device) -> the limit set
  std::lock_guard<std::mutex> lock(mu);
  int& have = set[{kernel, device}];
  if (have >= bytes) return cudaSuccess;
  const cudaError_t r = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (r == cudaSuccess) have = bytes;
  return r;
}

template <typename... Args>
cudaError_t ensure_dynamic_smem_limit(void (*kernel)(Args...), int bytes) {
  return ensure_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), bytes);
}

}  // namespace dsacp::cuda
