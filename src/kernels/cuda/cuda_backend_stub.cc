// make_cuda_backend in a build without CUDA (DSACP_ENABLE_CUDA=OFF).
#include "dsacp/backend.h"

namespace dsacp {

Result<std::unique_ptr<Backend>> make_cuda_backend(int device, const CudaBackendOptions& options) {
  (void)device;
  (void)options;
  return unsupported("this dsacp was built without CUDA (configure with -DDSACP_ENABLE_CUDA=ON and nvcc on PATH)");
}

Result<int> cuda_device_count() {
  return unsupported("this dsacp was built without CUDA (configure with -DDSACP_ENABLE_CUDA=ON and nvcc on PATH)");
}

}  // namespace dsacp
