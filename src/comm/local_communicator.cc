// Ranks as threads of one process. A collective completes when the last rank posts it: that rank copies
// for everyone (all senders' buffers are still untouched, since no rank has returned from wait()), then
// marks the operation complete. Progress therefore never depends on the order in which ranks wait on
// several collectives in flight, and every wait is bounded by the group's timeout.
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "dsacp/communicator.h"

namespace dsacp {
namespace {

enum class OpKind { kAllGather, kAllToAll, kBroadcast, kBarrier };

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kAllToAll: return "all_to_all";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

struct Op {
  OpKind kind = OpKind::kBarrier;
  size_t bytes = 0;
  int root = 0;
  std::vector<const void*> send;
  std::vector<void*> recv;
  int posted = 0;
  int released = 0;
  bool complete = false;
  bool executing = false;  // the last rank to post is copying into every rank's buffers (outside the lock)
};

class LocalGroupImpl;

class LocalHandle final : public CollectiveHandle {
 public:
  LocalHandle(std::shared_ptr<LocalGroupImpl> group, int rank, uint64_t seq)
      : group_(std::move(group)), rank_(rank), seq_(seq) {}
  ~LocalHandle() override {
    if (!waited_) (void)wait();
  }
  Status wait() override;

 private:
  std::shared_ptr<LocalGroupImpl> group_;
  int rank_;
  uint64_t seq_;
  bool waited_ = false;
  Status result_;
};

class LocalGroupImpl final : public LocalGroup, public std::enable_shared_from_this<LocalGroupImpl> {
 public:
  LocalGroupImpl(int size, std::chrono::milliseconds timeout, CopyFn copy)
      : size_(size), timeout_(timeout), copy_(std::move(copy)), next_seq_(size, 0) {}

  std::unique_ptr<Communicator> make_communicator(int rank) override;
  int size() const { return size_; }
  Status copy(void* dst, const void* src, size_t n) {
    if (n == 0 || dst == src) return Status();
    if (copy_) return copy_(dst, src, n);
    std::memmove(dst, src, n);
    return Status();
  }


  Result<std::unique_ptr<CollectiveHandle>> post(int rank, OpKind kind, const void* send, void* recv, size_t bytes,
                                                 int root) {
    std::unique_lock<std::mutex> lock(mu_);
    if (failed_) return failure_status();
    const uint64_t seq = next_seq_[rank]++;
    Op& op = ops_[seq];
    if (op.posted == 0) {
      op.kind = kind;
      op.bytes = bytes;
      op.root = root;
      op.send.assign(size_, nullptr);
      op.recv.assign(size_, nullptr);
    } else if (op.kind != kind || op.bytes != bytes || op.root != root) {
      fail_locked("collective mismatch at call " + std::to_string(seq) + ": rank " + std::to_string(rank) +
                  " called " + op_name(kind) + "(" + std::to_string(bytes) + " bytes, root " + std::to_string(root) +
                  "), another rank called " + op_name(op.kind) + "(" + std::to_string(op.bytes) + " bytes, root " +
                  std::to_string(op.root) + ")");
      return failure_status();
    }
    op.send[rank] = send;
    op.recv[rank] = recv;
    if (++op.posted == size_) {
      // The last rank to post performs every rank's copy, outside the lock: no rank can return from wait()
      // (and reuse its buffers) before `complete` is set, nor before `executing` is cleared even when the group
      // fails meanwhile (a rank that aborts must not free buffers the copy still writes or reads).
      op.executing = true;
      lock.unlock();
      const Status copied = execute(op);
      lock.lock();
      op.executing = false;
      cv_.notify_all();
      if (!copied.ok()) {
        fail_locked("copy of " + std::string(op_name(kind)) + " failed: " + copied.message());
        return failure_status();
      }
      op.complete = true;
      cv_.notify_all();
    }
    return std::unique_ptr<CollectiveHandle>(new LocalHandle(shared_from_this(), rank, seq));
  }

  Status wait(int rank, uint64_t seq) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = ops_.find(seq);
    if (it == ops_.end()) return internal_error("wait on an unknown collective");
    Op& op = it->second;
    const bool done = cv_.wait_for(lock, timeout_, [&] { return op.complete || (failed_ && !op.executing); });
    // Never return while another rank's thread still copies into this rank's buffers.
    cv_.wait(lock, [&] { return !op.executing; });
    Status s;
    if (!op.complete) {
      if (failed_) {
        s = failure_status();
      } else {
        s = Status(StatusCode::kTimeout, std::string("rank ") + std::to_string(rank) + ": " + op_name(op.kind) +
                                             " timed out after " + std::to_string(timeout_.count()) + " ms (" +
                                             std::to_string(op.posted) + " of " + std::to_string(size_) +
                                             " ranks arrived)");
        fail_locked(s.message());
      }
    }
    (void)done;
    if (++op.released == size_) ops_.erase(it);
    return s;
  }

  void abort(int rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_locked("rank " + std::to_string(rank) + " failed: " + reason);
  }

 private:
  void fail_locked(const std::string& reason) {
    if (!failed_) {
      failed_ = true;
      failure_ = reason;
    }
    cv_.notify_all();
  }
  Status failure_status() const { return Status(StatusCode::kBackendError, "communicator aborted: " + failure_); }

  Status execute(const Op& op) {
    const size_t n = op.bytes;
    for (int r = 0; r < size_; ++r) {
      auto* recv = static_cast<char*>(op.recv[r]);
      switch (op.kind) {
        case OpKind::kAllGather:
          for (int k = 0; k < size_; ++k) DSACP_RETURN_IF_ERROR(copy(recv + k * n, op.send[k], n));
          break;
        case OpKind::kAllToAll:
          for (int k = 0; k < size_; ++k) {
            DSACP_RETURN_IF_ERROR(copy(recv + k * n, static_cast<const char*>(op.send[k]) + r * n, n));
          }
          break;
        case OpKind::kBroadcast:
          if (r != op.root) DSACP_RETURN_IF_ERROR(copy(op.recv[r], op.recv[op.root], n));
          break;
        case OpKind::kBarrier:
          break;
      }
    }
    return Status();
  }

  const int size_;
  const std::chrono::milliseconds timeout_;
  const CopyFn copy_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> next_seq_;  // per rank
  std::map<uint64_t, Op> ops_;
  bool failed_ = false;
  std::string failure_;
};

Status LocalHandle::wait() {
  if (!waited_) {
    waited_ = true;
    result_ = group_->wait(rank_, seq_);
  }
  return result_;
}

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroupImpl> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Result<std::unique_ptr<CollectiveHandle>> all_gather_async(const void* send, void* recv, size_t bytes) override {
    return counted(group_->post(rank_, OpKind::kAllGather, send, recv, bytes, 0), bytes * (size() - 1));
  }
  Result<std::unique_ptr<CollectiveHandle>> all_to_all_async(const void* send, void* recv, size_t bytes) override {
    return counted(group_->post(rank_, OpKind::kAllToAll, send, recv, bytes, 0), bytes * (size() - 1));
  }
  Result<std::unique_ptr<CollectiveHandle>> broadcast_async(void* buf, size_t bytes, int root) override {
    if (root < 0 || root >= size()) {
      return invalid_argument("broadcast root " + std::to_string(root) + " outside [0, " + std::to_string(size()) + ")");
    }
    return counted(group_->post(rank_, OpKind::kBroadcast, buf, buf, bytes, root),
                   rank_ == root ? bytes * (size() - 1) : 0);
  }
  Status barrier() override {
    DSACP_ASSIGN_OR_RETURN(auto h, counted(group_->post(rank_, OpKind::kBarrier, nullptr, nullptr, 0, 0), 0));
    return h->wait();
  }
  // A group counts as one collective with the bytes of its parts, as a GPU communicator launches it.
  Result<std::unique_ptr<CollectiveHandle>> all_gather_group_async(const std::vector<Part>& parts) override {
    return counted_group(parts, Communicator::all_gather_group_async(parts_uncounted(parts)));
  }
  Result<std::unique_ptr<CollectiveHandle>> all_to_all_group_async(const std::vector<Part>& parts) override {
    return counted_group(parts, Communicator::all_to_all_group_async(parts_uncounted(parts)));
  }
  void abort(const std::string& reason) override { group_->abort(rank_, reason); }
  // The same counts as the NCCL communicator's: collectives started, bytes this rank sent (a part of b bytes
  // all-gathered or exchanged all-to-all sends b * (size - 1)). No times: the host copies are not the network.
  CommStats stats() const override { return stats_; }
  void reset_stats() override { stats_ = CommStats{}; }

 protected:
  // The group's copy (memcpy, or its device copy function) for all_gather_dim's rearrangement.
  Status copy_block(void* dst, const void* src, size_t bytes) override { return group_->copy(dst, src, bytes); }

 private:
  Result<std::unique_ptr<CollectiveHandle>> counted(Result<std::unique_ptr<CollectiveHandle>> h, size_t sent) {
    if (h.ok() && grouped_ == 0) {
      ++stats_.collectives;
      stats_.bytes += static_cast<int64_t>(sent);
    }
    return h;
  }
  // The parts go through the one-by-one default with counting held off (grouped_), then count once.
  const std::vector<Part>& parts_uncounted(const std::vector<Part>& parts) {
    ++grouped_;
    return parts;
  }
  Result<std::unique_ptr<CollectiveHandle>> counted_group(const std::vector<Part>& parts,
                                                          Result<std::unique_ptr<CollectiveHandle>> h) {
    --grouped_;
    size_t sent = 0;
    for (const Part& p : parts) sent += p.bytes * (size() - 1);
    return counted(std::move(h), sent);
  }

  std::shared_ptr<LocalGroupImpl> group_;
  int rank_;
  CommStats stats_;
  int grouped_ = 0;
};

std::unique_ptr<Communicator> LocalGroupImpl::make_communicator(int rank) {
  if (rank < 0 || rank >= size_) return nullptr;
  return std::make_unique<LocalCommunicator>(shared_from_this(), rank);
}

}  // namespace

std::shared_ptr<LocalGroup> LocalGroup::create(int size, std::chrono::milliseconds timeout, CopyFn copy) {
  if (size < 1) return nullptr;
  return std::make_shared<LocalGroupImpl>(size, timeout, std::move(copy));
}

}  // namespace dsacp
