// Device side of device_error.h: record the first data-dependent error of a launch.
#pragma once

#include "kernels/cuda/common/device_error.h"

namespace dsacp::cuda {

__device__ __forceinline__ void report_device_error(DeviceErrorWord e, int32_t code, int64_t row) {
  if (e.word == nullptr) return;
  if (atomicCAS(e.word, 0, code) == 0) atomicExch(e.word + 1, static_cast<int32_t>(row));
}

}  // namespace dsacp::cuda
