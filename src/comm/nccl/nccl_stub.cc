// The NCCL entry points in a build without NCCL (no CUDA, or nccl.h / libnccl not found at configure time).
#include "dsacp/nccl_communicator.h"

namespace dsacp {
namespace {
Status no_nccl() {
  return unsupported("this dsacp was built without NCCL (configure with CUDA, and NCCL where CMake finds it: "
                     "-DNCCL_ROOT=DIR)");
}
}  // namespace

bool nccl_available() { return false; }
int nccl_background_threads() { return 0; }
std::string nccl_version() { return "built without NCCL"; }
Result<NcclId> nccl_make_id() { return no_nccl(); }
Status nccl_id_write(const std::string&, const NcclId&) { return no_nccl(); }
Result<NcclId> nccl_id_read(const std::string&, std::chrono::milliseconds) { return no_nccl(); }
Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(const NcclId&, int, int, const NcclOptions&) {
  return no_nccl();
}

}  // namespace dsacp
