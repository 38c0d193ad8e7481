// The NCCL id helpers of dsacp/nccl_communicator.h: a new unique id (nccl_make_id), and the file through which
// ranks that are processes share it (nccl_id_write writes it atomically by a rename; nccl_id_read waits for it).
#include "comm/nccl/nccl_comm.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <thread>

namespace dsacp {

using nccl_detail::Clock;
using nccl_detail::nccl_error;

Result<NcclId> nccl_make_id() {
  ncclUniqueId raw;
  const ncclResult_t r = ncclGetUniqueId(&raw);
  if (r != ncclSuccess) return nccl_error(r, "ncclGetUniqueId");
  static_assert(sizeof(raw.internal) == sizeof(NcclId::bytes), "NCCL id size");
  NcclId id;
  std::copy(std::begin(raw.internal), std::end(raw.internal), id.bytes.begin());
  return id;
}

Status nccl_id_write(const std::string& path, const NcclId& id) {
  const std::string tmp = path + ".tmp." + std::to_string(static_cast<long long>(Clock::now().time_since_epoch().count()));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return invalid_argument("cannot write the NCCL id file " + tmp);
    f.write(id.bytes.data(), static_cast<std::streamsize>(id.bytes.size()));
    if (!f) return invalid_argument("cannot write the NCCL id file " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return invalid_argument("cannot rename " + tmp + " to " + path);
  }
  return Status();
}

Result<NcclId> nccl_id_read(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::ifstream f(path, std::ios::binary);
    if (f) {
      NcclId id;
      f.read(id.bytes.data(), static_cast<std::streamsize>(id.bytes.size()));
      if (f.gcount() == static_cast<std::streamsize>(id.bytes.size())) return id;
      return invalid_argument("NCCL id file " + path + " holds " + std::to_string(f.gcount()) +
                              " bytes, expected " + std::to_string(id.bytes.size()));
    }
    if (Clock::now() > deadline) {
      return Status(StatusCode::kTimeout, "the NCCL id file " + path + " did not appear within " +
                                              std::to_string(timeout.count()) + " ms (is rank 0 running?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace dsacp
