// Checked CUDA runtime calls: every failure becomes a Status naming the call, the error and file:line.
// Host-only (includes cuda_runtime_api.h); no device code.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "dsacp/status.h"

namespace dsacp::cuda {

inline Status cuda_status(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return Status::ok_status();
  return Status(StatusCode::kBackendError, std::string("CUDA call ") + call + " failed: " + cudaGetErrorName(err) +
                                               " (" + cudaGetErrorString(err) + ") at " + file + ":" +
                                               std::to_string(line));
}

}  // namespace dsacp::cuda

// Returns a kBackendError Status from the enclosing function when the call fails.
#define DSACP_CUDA_RETURN_IF_ERROR(call) \
  DSACP_RETURN_IF_ERROR(::dsacp::cuda::cuda_status((call), #call, __FILE__, __LINE__))

// After a kernel launch: the launch error (bad configuration, no kernel image for the device).
#define DSACP_CUDA_RETURN_IF_LAUNCH_ERROR(what) \
  DSACP_RETURN_IF_ERROR(::dsacp::cuda::cuda_status(cudaGetLastError(), "launch of " what, __FILE__, __LINE__))
