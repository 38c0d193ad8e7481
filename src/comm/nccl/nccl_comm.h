// The NCCL communicator's class and what its files share (private to src/comm/nccl, namespace nccl_detail):
// NcclComm, the NcclCommunicator behind dsacp/nccl_communicator.h, and its collective handle; the polling policy
// of every wait (Backoff) and the launch-order keeper (InOrder); the bounded NCCL calls of nccl_lifecycle.cc.
// NcclComm's members are defined in nccl_communicator.cc (destruction, the NCCL collectives, waits, abort, split)
// and nccl_peer_exchange.cc (the peer exchange and the exchange window); the short ones and launch, the one
// template, are defined here.
#pragma once

#include "dsacp/nccl_communicator.h"

#include "kernels/cuda/comm/peer_exchange.h"
#include "kernels/cuda/common/timeline.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dsacp {
namespace nccl_detail {

using Clock = std::chrono::steady_clock;

Status nccl_error(ncclResult_t r, const std::string& what, ncclComm_t comm = nullptr);
Status cuda_error(cudaError_t e, const std::string& what);

// Polling policy of every wait: yield (no sleep) for the first millisecond, since the collectives of a step
// finish within tens to hundreds of microseconds and a sleep's wake-up latency (50-100 us) would add to the
// step and skew the ranks; sleep between polls after that.
class Backoff {
 public:
  void operator()() {
    if (Clock::now() - start_ < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  Clock::time_point start_ = Clock::now();
};

// The NCCL calls that could wait for a missing peer, bounded (nccl_lifecycle.cc says what each does).
void abort_comm(ncclComm_t comm);
Status settle(ncclComm_t* comm, const std::string& what, std::chrono::milliseconds timeout,
              const std::shared_ptr<AbortSignal>& signal);
ncclConfig_t comm_config();
Result<ncclComm_t> bounded_create(std::function<ncclResult_t(ncclComm_t*)> make, int device, const std::string& what,
                                  std::chrono::milliseconds timeout, const std::shared_ptr<AbortSignal>& signal);
extern std::mutex g_destroy_mu;  // serializes the communicators' release of device resources (why: there)
void bounded_release(ncclComm_t comm, int device, std::chrono::milliseconds timeout);

class NcclComm;

// Keeps a sequence of device operations launched on possibly different streams in launch order (the peer
// exchange's and the window's parity arguments need one after another): an operation on another stream than
// the last one waits for the last one's end.
struct InOrder {
  cudaStream_t last = nullptr;
  cudaEvent_t end = nullptr;
  // Before launching on `on`.
  cudaError_t before(cudaStream_t on) {
    return last != nullptr && last != on ? cudaStreamWaitEvent(on, end, 0) : cudaSuccess;
  }
  // After launching on `on`.
  cudaError_t after(cudaStream_t on) {
    cudaError_t e = end == nullptr ? cudaEventCreateWithFlags(&end, cudaEventDisableTiming) : cudaSuccess;
    if (e == cudaSuccess) e = cudaEventRecord(end, on);
    if (e == cudaSuccess) last = on;
    return e;
  }
  // Moves the sequence to `on` now: work enqueued on `on` from here waits for all of the last stream's work so
  // far (not just the last operation: what was enqueued after it too).
  cudaError_t move_to(cudaStream_t on) {
    if (last == nullptr || last == on) return cudaSuccess;
    const cudaStream_t old = last;
    cudaError_t e = after(old);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(on, end, 0);
    if (e == cudaSuccess) last = on;
    return e;
  }
  // The sequence's last operation is on `on` (enqueued there without an event of its own: a later move_to records
  // one when the stream changes).
  void now_on(cudaStream_t on) { last = on; }
  void destroy() {
    if (end != nullptr) (void)cudaEventDestroy(end);
    end = nullptr;
  }
};

class NcclHandle final : public CollectiveHandle {
 public:
  NcclHandle(NcclComm* comm, cudaEvent_t start, cudaEvent_t end, const char* what, cudaStream_t stream)
      : comm_(comm), start_(start), end_(end), label_(what), what_(what), stream_(stream) {}
  ~NcclHandle() override;
  Status wait() override;
  bool order_before(void* stream) override;
  void release_ordered() override { waited_ = true; }  // no event query: it may be a captured one

 private:
  NcclComm* comm_;
  cudaEvent_t start_, end_;
  const char* label_;  // a literal
  std::string what_;
  cudaStream_t stream_;  // where the collective was enqueued
  bool waited_ = false;
  Status result_;
};

class NcclComm final : public NcclCommunicator {
 public:
  NcclComm(ncclComm_t comm, int rank, int size, const NcclOptions& options, cudaStream_t stream, float* flag)
      : comm_(comm), rank_(rank), size_(size), options_(options), stream_(stream), flag_(flag) {}

  ~NcclComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return options_.device; }
  CommStats stats() const override { return stats_; }
  void reset_stats() override { stats_ = CommStats{}; }
  void set_producer_stream(void* stream) override { options_.producer_stream = stream; }
  bool orders_on_device() const override { return true; }

  // The collectives (through the peer exchange where peer_fits, else NCCL), waits, abort and split:
  // nccl_communicator.cc.
  Result<std::unique_ptr<CollectiveHandle>> all_gather_async(const void* send, void* recv, size_t bytes) override;
  Result<std::unique_ptr<CollectiveHandle>> all_to_all_async(const void* send, void* recv, size_t bytes) override;
  ncclResult_t copy_own_block(const void* send, void* recv, size_t bytes);
  static bool all_empty(const std::vector<Part>& parts);
  Result<std::unique_ptr<CollectiveHandle>> all_gather_group_async(const std::vector<Part>& parts) override;
  Result<std::unique_ptr<CollectiveHandle>> all_to_all_group_async(const std::vector<Part>& parts) override;
  Result<std::unique_ptr<CollectiveHandle>> broadcast_async(void* buf, size_t bytes, int root) override;
  Status barrier() override;
  void abort(const std::string& reason) override;
  Status all_gather_dim(const void* send, void* recv, void* scratch, int64_t outer, int64_t local_dim, int64_t inner,
                        size_t elem_size) override;
  Result<std::unique_ptr<NcclCommunicator>> split(int color, int key) override;
  static Result<std::unique_ptr<NcclCommunicator>> wrap(ncclComm_t comm, const NcclOptions& options);
  Status wait_for(cudaEvent_t start, cudaEvent_t end, const std::string& what, const char* label);

  // The exchange window: nccl_peer_exchange.cc.
  Result<Window> window_next(size_t bytes) override;
  Result<std::unique_ptr<CollectiveHandle>> window_publish() override;
  Result<WindowRowSync> window_rows(int64_t num_rows) override;
  Result<std::unique_ptr<CollectiveHandle>> window_rows_done() override;
  Status window_rows_check() override;

  void give_back_events(cudaEvent_t a, cudaEvent_t b) {
    for (cudaEvent_t e : {a, b}) {
      if (e != nullptr) free_events_.push_back(e);
    }
  }

 private:
  Status failure_status() const { return Status(StatusCode::kBackendError, "communicator aborted: " + failure_); }

  Status usable() const {
    if (comm_ == nullptr) return failure_status();
    if (options_.abort_signal && options_.abort_signal->raised()) {
      return Status(StatusCode::kBackendError, "communicator aborted: " + options_.abort_signal->reason());
    }
    return Status();
  }

  void fail(const std::string& reason);  // nccl_communicator.cc
  // The error a kernel-side wait (peer exchange, window, window rows) left in the error word, if any, for `what`
  // (nccl_communicator.cc; wait_for and window_rows_check).
  Status peer_wait_error(const std::string& what) const;

  // ---- The peer exchange (kernels/cuda/comm/peer_exchange.h) ----
  // (defined in nccl_peer_exchange.cc, but for the short ones here)

  // The stream the peer exchange and the window run on: the producer's, else the communicator's own.
  cudaStream_t exchange_stream() const {
    return options_.producer_stream != nullptr ? static_cast<cudaStream_t>(options_.producer_stream) : stream_;
  }
  // The communicator's timeout in ns, for the kernels' bounded waits.
  uint64_t timeout_ns() const {
    const uint64_t ms = static_cast<uint64_t>(options_.timeout.count());
    return ms > UINT64_MAX / 1000000ull ? UINT64_MAX : ms * 1000000ull;
  }
  Status exchange_failed(cudaError_t e, const char* what);
  struct PeerInfo;
  Status setup_peer_exchange();
  void reset_stamps();
  void print_stamps();
  Result<std::vector<PeerInfo>> exchange_setup_record(const PeerInfo& mine);
  bool quiesce_peer_exchange();
  void release_peer_exchange(bool area_safe);
  bool peer_fits(const std::vector<Part>& parts) const;
  Result<std::unique_ptr<CollectiveHandle>> peer_collective(const char* what, bool all_to_all,
                                                            const std::vector<Part>& parts);
  Status window_usable() const;

  // Rank k's window region (its flags, then its two buffers) as this device addresses it.
  char* window_region(int k) const { return peer_areas_[k] + cuda::peer::area_bytes(size_, slot_bytes_); }

  cudaError_t take_event(cudaEvent_t* e) {
    if (!free_events_.empty()) {
      *e = free_events_.back();
      free_events_.pop_back();
      return cudaSuccess;
    }
    return cudaEventCreate(e);
  }

  // Enqueues a collective on the communicator's stream, after the producer stream's work so far; with `on`
  // (the peer exchange), on that stream itself, in line with the producer's kernels (no cross-stream hops).
  template <typename Enqueue>
  Result<std::unique_ptr<CollectiveHandle>> launch(const char* what, size_t sent_bytes, Enqueue enqueue,
                                                   bool empty = false, cudaStream_t on = nullptr) {
    DSACP_RETURN_IF_ERROR(usable());
    const auto t0 = Clock::now();
    cudaError_t e = cudaSetDevice(options_.device);
    cudaEvent_t start = nullptr, end = nullptr;
    // (an empty launch records its end only: nothing runs between the two, and an event between the producer's
    // kernels costs the stream a few microseconds)
    if (e == cudaSuccess && !empty) e = take_event(&start);
    if (e == cudaSuccess) e = take_event(&end);
    const cudaStream_t stream = on != nullptr ? on : stream_;
    if (e == cudaSuccess && on == nullptr && options_.producer_stream != nullptr) {
      // Start after the producer's work so far (its kernels may still run: deferred errors).
      if (producer_ready_ == nullptr) e = cudaEventCreateWithFlags(&producer_ready_, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventRecord(producer_ready_, static_cast<cudaStream_t>(options_.producer_stream));
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, producer_ready_, 0);
    }
    if (e == cudaSuccess && start != nullptr) e = cudaEventRecord(start, stream);
    if (e != cudaSuccess) {
      give_back_events(start, end);
      // Failed before enqueueing: the peers would run this collective alone, so the communicator is done.
      const Status st = cuda_error(e, std::string("rank ") + std::to_string(rank_) + ": " + what);
      fail(st.message());
      return st;
    }
    const std::string name = std::string("rank ") + std::to_string(rank_) + ": " + what;
    Status s;
    const cuda::timeline::Span span = cuda::timeline::open(options_.device, stream);
    if (!empty) {
      const ncclResult_t r = enqueue();
      if (r == ncclInProgress) {
        s = settle(&comm_, name, options_.timeout, options_.abort_signal);
      } else if (r != ncclSuccess) {
        s = nccl_error(r, name, comm_);
      }
    }
    if (s.ok()) {
      e = cudaEventRecord(end, stream);
      if (e != cudaSuccess) s = cuda_error(e, name);
    }
    cuda::timeline::close(options_.device, span, stream, what, on != nullptr ? "peer" : "nccl");
    if (!s.ok()) {
      fail(s.message());
      give_back_events(start, end);
      return s;
    }
    stats_.enqueue_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    ++stats_.collectives;
    stats_.bytes += static_cast<int64_t>(sent_bytes);
    return std::unique_ptr<CollectiveHandle>(new NcclHandle(this, start, end, what, stream));
  }

  ncclComm_t comm_;
  int rank_, size_;
  NcclOptions options_;
  cudaStream_t stream_;
  float* flag_;
  std::string failure_;
  CommStats stats_;
  std::vector<cudaEvent_t> free_events_;  // timing events of finished collectives, reused
  cudaEvent_t producer_ready_ = nullptr;  // recorded on options_.producer_stream before each collective
  // The peer exchange: this rank's area, every rank's area as this device addresses it, the host words
  // ([0] abort, raised by fail(); [1] 1 + a rank that did not deliver) and the exchanges launched so far.
  bool peer_ready_ = false;
  char* area_ = nullptr;
  std::array<char*, cuda::peer::kMaxRanks> peer_areas_{};
  std::vector<void*> ipc_opened_;
  size_t slot_bytes_ = 0;
  volatile int32_t* peer_words_ = nullptr;
  int32_t* peer_words_dev_ = nullptr;
  int32_t* failed_dev_ = nullptr;  // in area_: 1 once a wait of this rank's exchanges failed (peer_sync.cuh)
  uint64_t peer_seq_ = 0;
  unsigned long long* peer_stamps_ = nullptr;  // NcclOptions::exchange_stamps
  InOrder peer_order_;  // the peer exchanges run one after another
  // The exchange window (after the slots in the area): its buffers' size, the window exchanges published so far,
  // the size of the message of the next one, where the last publish ran and its end.
  size_t window_bytes_ = 0;
  uint64_t window_seq_ = 0;
  size_t window_message_bytes_ = 0;
  InOrder window_order_;  // the window exchanges run one after another
};

}  // namespace nccl_detail
}  // namespace dsacp
