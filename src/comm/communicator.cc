#include <cstring>

#include "dsacp/communicator.h"

namespace dsacp {
namespace {

// Handles of a group started one by one: wait() waits for all of them; the first error is the result.
class GroupHandle final : public CollectiveHandle {
 public:
  explicit GroupHandle(std::vector<std::unique_ptr<CollectiveHandle>> parts) : parts_(std::move(parts)) {}
  Status wait() override {
    Status first;
    for (auto& h : parts_) {
      const Status s = h->wait();
      if (first.ok() && !s.ok()) first = s;
    }
    return first;
  }

 private:
  std::vector<std::unique_ptr<CollectiveHandle>> parts_;
};

}  // namespace

Result<Communicator::Window> Communicator::window_next(size_t bytes) {
  return unsupported("this communicator has no exchange window (" + std::to_string(bytes) +
                     " bytes asked): use the collectives");
}

Result<std::unique_ptr<CollectiveHandle>> Communicator::window_publish() {
  return unsupported("this communicator has no exchange window");
}

Result<WindowRowSync> Communicator::window_rows(int64_t num_rows) {
  return unsupported("this communicator has no exchange window (" + std::to_string(num_rows) + " rows)");
}

Result<std::unique_ptr<CollectiveHandle>> Communicator::window_rows_done() {
  return unsupported("this communicator has no exchange window");
}

Status Communicator::window_rows_check() { return unsupported("this communicator has no exchange window"); }

Result<std::unique_ptr<CollectiveHandle>> Communicator::all_gather_group_async(const std::vector<Part>& parts) {
  std::vector<std::unique_ptr<CollectiveHandle>> handles;
  for (const Part& p : parts) {
    DSACP_ASSIGN_OR_RETURN(auto h, all_gather_async(p.send, p.recv, p.bytes));
    handles.push_back(std::move(h));
  }
  return std::unique_ptr<CollectiveHandle>(new GroupHandle(std::move(handles)));
}

Result<std::unique_ptr<CollectiveHandle>> Communicator::all_to_all_group_async(const std::vector<Part>& parts) {
  std::vector<std::unique_ptr<CollectiveHandle>> handles;
  for (const Part& p : parts) {
    DSACP_ASSIGN_OR_RETURN(auto h, all_to_all_async(p.send, p.recv, p.bytes));
    handles.push_back(std::move(h));
  }
  return std::unique_ptr<CollectiveHandle>(new GroupHandle(std::move(handles)));
}

Status Communicator::all_gather(const void* send, void* recv, size_t bytes) {
  DSACP_ASSIGN_OR_RETURN(auto h, all_gather_async(send, recv, bytes));
  return h->wait();
}

Status Communicator::all_to_all(const void* send, void* recv, size_t bytes) {
  DSACP_ASSIGN_OR_RETURN(auto h, all_to_all_async(send, recv, bytes));
  return h->wait();
}

Status Communicator::broadcast(void* buf, size_t bytes, int root) {
  DSACP_ASSIGN_OR_RETURN(auto h, broadcast_async(buf, bytes, root));
  return h->wait();
}

Status Communicator::all_gather_dim(const void* send, void* recv, void* scratch, int64_t outer, int64_t local_dim,
                                    int64_t inner, size_t elem_size) {
  if (outer < 0 || local_dim < 0 || inner < 0) return invalid_argument("all_gather_dim: negative extent");
  const size_t row = static_cast<size_t>(local_dim * inner) * elem_size;  // one outer index, one rank
  const size_t block = static_cast<size_t>(outer) * row;                    // one rank's contribution
  if (outer == 1) return all_gather(send, recv, block);
  DSACP_RETURN_IF_ERROR(all_gather(send, scratch, block));
  const int P = size();
  auto* out = static_cast<char*>(recv);
  const auto* in = static_cast<const char*>(scratch);
  for (int64_t o = 0; o < outer; ++o) {
    for (int k = 0; k < P; ++k) {
      DSACP_RETURN_IF_ERROR(
          copy_block(out + (static_cast<size_t>(o) * P + k) * row, in + k * block + static_cast<size_t>(o) * row, row));
    }
  }
  return Status();
}

Status Communicator::copy_block(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return Status();
}

}  // namespace dsacp
