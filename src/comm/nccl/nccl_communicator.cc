// NCCL communicator (dsacp/nccl_communicator.h): one stream each, bounded waits by polling CUDA events and
// ncclCommGetAsyncError; creation, split and finalization bounded on helper threads.
#include "dsacp/nccl_communicator.h"

#include "kernels/cuda/comm/peer_exchange.h"
#include "kernels/cuda/common/module_loading.h"
#include "kernels/cuda/common/timeline.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <unistd.h>

namespace dsacp {
namespace {

using Clock = std::chrono::steady_clock;

Status nccl_error(ncclResult_t r, const std::string& what, ncclComm_t comm = nullptr) {
  std::string msg = what + ": NCCL " + ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') msg += " (" + std::string(last) + ")";
  }
  return Status(StatusCode::kBackendError, msg);
}

Status cuda_error(cudaError_t e, const std::string& what) {
  return Status(StatusCode::kBackendError,
                what + ": CUDA " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

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

std::atomic<int> g_background{0};  // helper threads still inside NCCL (nccl_background_threads)

// A random number drawn once per process: ranks with the same one share an address space (pids and host names
// can repeat across containers).
uint64_t process_nonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
           (static_cast<uint64_t>(getpid()) << 16);
  }();
  return nonce;
}

// Aborts a communicator on a detached thread, so the caller never waits: ncclCommAbort can wait for the other
// ranks of its process (ranks that are threads) to abort too, or join a bootstrap thread that waits for a peer
// that never arrived.
void abort_comm(ncclComm_t comm) {
  if (comm == nullptr) return;
  ++g_background;
  std::thread([comm] {
    (void)ncclCommAbort(comm);
    --g_background;
  }).detach();
}

// Polls a communicator until its asynchronous state leaves ncclInProgress (after a creation, and for an enqueue
// that answers ncclInProgress), bounded by `timeout`; an asynchronous error fails it. On failure or timeout the communicator is aborted and *comm set to null.
Status settle(ncclComm_t* comm, const std::string& what, std::chrono::milliseconds timeout,
              const std::shared_ptr<AbortSignal>& signal) {
  const auto deadline = Clock::now() + timeout;
  Backoff backoff;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(*comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess) return Status();
    Status failure;
    if (state != ncclInProgress) {
      failure = nccl_error(state, what, *comm);
    } else if (signal && signal->raised()) {
      failure = Status(StatusCode::kBackendError, what + ": communicator aborted: " + signal->reason());
    } else if (Clock::now() > deadline) {
      failure = Status(StatusCode::kTimeout, what + " timed out after " + std::to_string(timeout.count()) +
                                                 " ms (a peer did not arrive)");
    }
    if (!failure.ok()) {
      abort_comm(*comm);
      *comm = nullptr;
      return failure;
    }
    backoff();
  }
}

// Communicators are blocking (ncclConfig_t.blocking = 1): NCCL's blocking launch path is the fast one. The
// non-blocking mode measured 75-110 us per collective launched back to back on the H200 pair against 19-43 us
// blocking (1-8 MiB all-gathers). Blocking calls that could wait for a missing peer (creation, split,
// finalization) run on a helper thread that the caller waits for, bounded; aborts run detached.
ncclConfig_t comm_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  return config;
}

// Connects a new communicator to its peers while its creation is still bounded. NCCL connects lazily: the
// first collective of an algorithm and the first send/recv to a peer exchange connection details with the
// peer on the host, and a blocking communicator's enqueue call waits there, unbounded, for a peer that never
// posts. Running one collective of each kind here (all-gather, all-reduce, send/recv with every peer) moves
// that wait into creation, whose caller gives up after its timeout; later enqueues only launch. With
// NCCL_RUNTIME_CONNECT=0 (set for the process unless the user chose) init connects every collective algorithm.
ncclResult_t connect_peers(ncclComm_t comm, const std::atomic<bool>& abandoned) {
  int size = 1;
  ncclResult_t r = ncclCommCount(comm, &size);
  if (r != ncclSuccess || size == 1) return r;
  float* buf = nullptr;
  cudaStream_t stream = nullptr;
  if (cudaMalloc(&buf, sizeof(float) * 2 * static_cast<size_t>(size)) != cudaSuccess ||
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    if (buf != nullptr) (void)cudaFree(buf);
    return ncclUnhandledCudaError;
  }
  r = ncclAllGather(buf, buf + size, 1, ncclFloat32, comm, stream);
  if (r == ncclSuccess) r = ncclAllReduce(buf, buf, 1, ncclFloat32, ncclSum, comm, stream);
  if (r == ncclSuccess) r = ncclGroupStart();
  for (int k = 0; k < size && r == ncclSuccess; ++k) {
    r = ncclSend(buf + k, 1, ncclFloat32, k, comm, stream);
    if (r == ncclSuccess) r = ncclRecv(buf + size + k, 1, ncclFloat32, k, comm, stream);
  }
  if (r == ncclSuccess) r = ncclGroupEnd();
  // Wait for the kernels by polling: a caller that gave up (abandoned) gets the communicator aborted, which
  // ends kernels that wait for a missing peer.
  Backoff backoff;
  while (r == ncclSuccess) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      r = ncclUnhandledCudaError;
      break;
    }
    ncclResult_t state = ncclSuccess;
    (void)ncclCommGetAsyncError(comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) r = state;
    if (abandoned.load()) r = ncclInternalError;
    backoff();
  }
  if (r != ncclSuccess) return r;  // the caller aborts the communicator; buf and stream are left to it
  (void)cudaStreamDestroy(stream);
  (void)cudaFree(buf);
  return ncclSuccess;
}

// Makes a communicator with `make` on a helper thread (on `device`) and waits for it up to `timeout` (or until
// `signal` is raised). A helper that is given up on aborts what it made, if it ever finishes.
Result<ncclComm_t> bounded_create(std::function<ncclResult_t(ncclComm_t*)> make, int device, const std::string& what,
                                  std::chrono::milliseconds timeout, const std::shared_ptr<AbortSignal>& signal) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::atomic<bool> abandoned{false};
    ncclComm_t comm = nullptr;
    Status status;
  };
  auto st = std::make_shared<State>();
  ++g_background;
  std::thread([st, make, device, what, timeout, signal] {
    ncclComm_t comm = nullptr;
    Status result;
    const cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess) {
      result = cuda_error(ce, what);
    } else {
      const ncclResult_t r = make(&comm);
      if (r != ncclSuccess && r != ncclInProgress) {
        abort_comm(comm);
        comm = nullptr;
        result = nccl_error(r, what);
      } else {
        result = settle(&comm, what, timeout, signal);
        if (result.ok()) {
          const ncclResult_t c = connect_peers(comm, st->abandoned);
          if (c != ncclSuccess) {
            result = nccl_error(c, what + ": connecting to the peers", comm);
            abort_comm(comm);
            comm = nullptr;
          }
        }
      }
    }
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->abandoned) {
      abort_comm(comm);
    } else {
      st->comm = comm;
      st->status = result;
      st->done = true;
      st->cv.notify_all();
    }
    --g_background;
  }).detach();
  std::unique_lock<std::mutex> lock(st->mu);
  const auto deadline = Clock::now() + timeout;
  while (!st->done) {
    st->cv.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(20)));
    if (st->done) break;
    const bool aborted = signal && signal->raised();
    if (aborted || Clock::now() > deadline) {
      st->abandoned.store(true);
      if (aborted) return Status(StatusCode::kBackendError, what + ": communicator aborted: " + signal->reason());
      return Status(StatusCode::kTimeout,
                    what + " timed out after " + std::to_string(timeout.count()) + " ms (a peer did not arrive)");
    }
  }
  DSACP_RETURN_IF_ERROR(st->status);
  return st->comm;
}

// Serializes the release of device resources by communicators across the process: ncclCommDestroy (after its
// finalization) and a communicator's own frees (its flag, stream and events). Ranks that are threads of one
// process release their communicators together; dsacp_gpu_cp_tests then aborted about one run in five with
// glibc's "double free or corruption" inside ncclCommDestroy -> cuMemUnmap (2 x H200, NCCL 2.28.3, driver
// 580). Serializing ncclCommDestroy alone still crashed once in six runs; with the frees serialized too, three
// full runs and ~145 make/use/release cycles (dsacp_gpu_cp_tests --churn) passed. The root cause (driver or
// NCCL) is not known. Finalization stays concurrent (it may wait for the other ranks); a destroy after it only
// frees local resources, so holding the lock cannot wait for a peer.
std::mutex g_destroy_mu;

// Finalizes and destroys a healthy communicator on a helper thread, waiting up to `timeout` (a finalization
// that waits for a dead peer is left behind).
void bounded_release(ncclComm_t comm, int device, std::chrono::milliseconds timeout) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  ++g_background;
  std::thread([comm, device, timeout, done] {
    (void)cudaSetDevice(device);
    ncclComm_t c = comm;
    const ncclResult_t r = ncclCommFinalize(c);
    if (r == ncclInProgress) (void)settle(&c, "NCCL finalize", timeout, nullptr);
    if (c != nullptr) {
      std::lock_guard<std::mutex> lock(g_destroy_mu);
      (void)ncclCommDestroy(c);
    }
    done->store(true);
    --g_background;
  }).detach();
  const auto deadline = Clock::now() + timeout;
  while (!done->load() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

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

  ~NcclComm() override {
    (void)cudaSetDevice(options_.device);
    const bool area_safe = quiesce_peer_exchange();
    // Flush and release; a peer that is gone must not hang the destructor.
    if (comm_ != nullptr) bounded_release(comm_, options_.device, std::min(options_.timeout, std::chrono::milliseconds(10000)));
    // Not concurrently with another rank's ncclCommDestroy (g_destroy_mu): both release device memory.
    std::lock_guard<std::mutex> lock(g_destroy_mu);
    for (cudaEvent_t e : free_events_) (void)cudaEventDestroy(e);
    if (producer_ready_ != nullptr) (void)cudaEventDestroy(producer_ready_);
    peer_order_.destroy();
    window_order_.destroy();
    print_stamps();
    if (peer_stamps_ != nullptr) (void)cudaFree(peer_stamps_);
    release_peer_exchange(area_safe);
    (void)cudaFree(flag_);
    (void)cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return options_.device; }
  CommStats stats() const override { return stats_; }
  void reset_stats() override { stats_ = CommStats{}; }
  void set_producer_stream(void* stream) override { options_.producer_stream = stream; }
  bool orders_on_device() const override { return true; }

  Result<std::unique_ptr<CollectiveHandle>> all_gather_async(const void* send, void* recv, size_t bytes) override {
    if (peer_fits({{send, recv, bytes}})) return peer_collective("p2p all_gather", false, {{send, recv, bytes}});
    return launch("all_gather", bytes * (size_ - 1),
                  [&] { return ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_); }, bytes == 0);
  }

  Result<std::unique_ptr<CollectiveHandle>> all_to_all_async(const void* send, void* recv, size_t bytes) override {
    if (peer_fits({{send, recv, bytes}})) return peer_collective("p2p all_to_all", true, {{send, recv, bytes}});
    return launch("all_to_all", bytes * (size_ - 1), [&] {
      ncclResult_t r = copy_own_block(send, recv, bytes);
      if (r == ncclSuccess) r = ncclGroupStart();
      for (int k = 0; k < size_ && r == ncclSuccess; ++k) {
        if (k == rank_) continue;
        r = ncclSend(static_cast<const char*>(send) + k * bytes, bytes, ncclUint8, k, comm_, stream_);
        if (r == ncclSuccess) r = ncclRecv(static_cast<char*>(recv) + k * bytes, bytes, ncclUint8, k, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    }, bytes == 0);
  }

  // An all-to-all's own block goes by the copy engine on the communicator's stream: a send/recv to self runs
  // in NCCL's kernel on a few CTAs, several times slower for the MiB-sized blocks of a decode step.
  ncclResult_t copy_own_block(const void* send, void* recv, size_t bytes) {
    const size_t at = static_cast<size_t>(rank_) * bytes;
    const cudaError_t e = cudaMemcpyAsync(static_cast<char*>(recv) + at, static_cast<const char*>(send) + at, bytes,
                                          cudaMemcpyDeviceToDevice, stream_);
    if (e == cudaSuccess) return ncclSuccess;
    (void)cudaGetLastError();
    return ncclUnhandledCudaError;
  }

  static bool all_empty(const std::vector<Part>& parts) {
    for (const Part& p : parts) {
      if (p.bytes > 0) return false;
    }
    return true;
  }

  Result<std::unique_ptr<CollectiveHandle>> all_gather_group_async(const std::vector<Part>& parts) override {
    if (peer_fits(parts)) return peer_collective("p2p all_gather group", false, parts);
    size_t sent = 0;
    for (const Part& p : parts) sent += p.bytes * (size_ - 1);
    return launch("all_gather group", sent, [&] {
      ncclResult_t r = ncclGroupStart();
      for (const Part& p : parts) {
        if (r == ncclSuccess && p.bytes > 0) r = ncclAllGather(p.send, p.recv, p.bytes, ncclUint8, comm_, stream_);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    }, all_empty(parts));
  }

  Result<std::unique_ptr<CollectiveHandle>> all_to_all_group_async(const std::vector<Part>& parts) override {
    if (peer_fits(parts)) return peer_collective("p2p all_to_all group", true, parts);
    size_t sent = 0;
    for (const Part& p : parts) sent += p.bytes * (size_ - 1);
    return launch("all_to_all group", sent, [&] {
      ncclResult_t r = ncclSuccess;
      for (const Part& p : parts) {
        if (r == ncclSuccess && p.bytes > 0) r = copy_own_block(p.send, p.recv, p.bytes);
      }
      if (r == ncclSuccess) r = ncclGroupStart();
      for (const Part& p : parts) {
        for (int k = 0; k < size_ && r == ncclSuccess && p.bytes > 0; ++k) {
          if (k == rank_) continue;
          r = ncclSend(static_cast<const char*>(p.send) + k * p.bytes, p.bytes, ncclUint8, k, comm_, stream_);
          if (r == ncclSuccess) {
            r = ncclRecv(static_cast<char*>(p.recv) + k * p.bytes, p.bytes, ncclUint8, k, comm_, stream_);
          }
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      return r != ncclSuccess ? r : end;
    }, all_empty(parts));
  }

  Result<std::unique_ptr<CollectiveHandle>> broadcast_async(void* buf, size_t bytes, int root) override {
    if (root < 0 || root >= size_) {
      return invalid_argument("broadcast root " + std::to_string(root) + " outside [0, " + std::to_string(size_) + ")");
    }
    return launch("broadcast", rank_ == root ? bytes * (size_ - 1) : 0,
                  [&] { return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_); }, bytes == 0);
  }

  Status barrier() override {
    DSACP_ASSIGN_OR_RETURN(auto h, launch("barrier", 0, [&] {
      return ncclAllReduce(flag_, flag_, 1, ncclFloat32, ncclSum, comm_, stream_);
    }, false));
    return h->wait();
  }

  void abort(const std::string& reason) override {
    if (options_.abort_signal) options_.abort_signal->raise("rank " + std::to_string(rank_) + " failed: " + reason);
    fail("rank " + std::to_string(rank_) + " aborted: " + reason);
  }

  Status all_gather_dim(const void* send, void* recv, void* scratch, int64_t outer, int64_t local_dim, int64_t inner,
                        size_t elem_size) override {
    if (outer < 0 || local_dim < 0 || inner < 0) return invalid_argument("all_gather_dim: negative extent");
    const size_t row = static_cast<size_t>(local_dim * inner) * elem_size;
    const size_t block = static_cast<size_t>(outer) * row;
    if (outer == 1) return all_gather(send, recv, block);
    DSACP_RETURN_IF_ERROR(all_gather(send, scratch, block));
    if (row == 0) return Status();
    for (int k = 0; k < size_; ++k) {
      const cudaError_t e = cudaMemcpy2DAsync(static_cast<char*>(recv) + k * row, size_ * row,
                                              static_cast<const char*>(scratch) + k * block, row, row,
                                              static_cast<size_t>(outer), cudaMemcpyDeviceToDevice, stream_);
      if (e != cudaSuccess) return cuda_error(e, "all_gather_dim rearrangement");
    }
    const cudaError_t e = cudaStreamSynchronize(stream_);
    return e == cudaSuccess ? Status() : cuda_error(e, "all_gather_dim rearrangement");
  }

  Result<std::unique_ptr<NcclCommunicator>> split(int color, int key) override {
    if (color < 0) return invalid_argument("NCCL split: color must be >= 0, got " + std::to_string(color));
    DSACP_RETURN_IF_ERROR(usable());
    const cudaError_t e = cudaSetDevice(options_.device);
    if (e != cudaSuccess) return cuda_error(e, "NCCL split");
    ncclComm_t parent = comm_;
    const std::string what = "NCCL split of rank " + std::to_string(rank_) + " (color " + std::to_string(color) + ")";
    auto child = bounded_create(
        [parent, color, key](ncclComm_t* out) {
          ncclConfig_t config = comm_config();
          return ncclCommSplit(parent, color, key, out, &config);
        },
        options_.device, what, options_.timeout, options_.abort_signal);
    if (!child.ok()) {
      // The helper may still be inside ncclCommSplit with the parent: the parent is left alone (not aborted),
      // only marked failed.
      if (failure_.empty()) failure_ = child.status().message();
      comm_ = nullptr;
      return child.status();
    }
    return wrap(*child, options_);
  }

  // A new communicator's resources around an initialized NCCL communicator (aborted on failure).
  static Result<std::unique_ptr<NcclCommunicator>> wrap(ncclComm_t comm, const NcclOptions& options) {
    int rank = 0, size = 0;
    ncclResult_t r = ncclCommUserRank(comm, &rank);
    if (r == ncclSuccess) r = ncclCommCount(comm, &size);
    if (r != ncclSuccess) {
      abort_comm(comm);
      return nccl_error(r, "NCCL communicator rank/size");
    }
    cudaStream_t stream = nullptr;
    float* flag = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaMalloc(&flag, sizeof(float));
    if (e != cudaSuccess) {
      abort_comm(comm);
      if (stream != nullptr) (void)cudaStreamDestroy(stream);
      return cuda_error(e, "NCCL communicator stream");
    }
    std::unique_ptr<NcclComm> made(new NcclComm(comm, rank, size, options, stream, flag));
    DSACP_RETURN_IF_ERROR(made->setup_peer_exchange());
    return std::unique_ptr<NcclCommunicator>(std::move(made));
  }

  // Called by NcclHandle::wait: polls the end event; fails on an async NCCL error, the shared abort signal or
  // the timeout (then aborts the communicator).
  Status wait_for(cudaEvent_t start, cudaEvent_t end, const std::string& what, const char* label) {
    const auto t0 = Clock::now();
    const double tl0 = cuda::timeline::host_now_us(options_.device);
    const auto deadline = t0 + options_.timeout;
    Status result;
    Backoff backoff;
    for (;;) {
      const cudaError_t q = cudaEventQuery(end);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        result = cuda_error(q, "rank " + std::to_string(rank_) + ": " + what);
        break;
      }
      if (comm_ == nullptr) {
        result = failure_status();
        break;
      }
      ncclResult_t state = ncclSuccess;
      (void)ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        result = nccl_error(state, "rank " + std::to_string(rank_) + ": " + what, comm_);
        break;
      }
      if (options_.abort_signal && options_.abort_signal->raised()) {
        result = Status(StatusCode::kBackendError, "communicator aborted: " + options_.abort_signal->reason());
        break;
      }
      if (Clock::now() > deadline) {
        result = Status(StatusCode::kTimeout, "rank " + std::to_string(rank_) + ": " + what + " timed out after " +
                                                  std::to_string(options_.timeout.count()) + " ms (a peer did not arrive)");
        break;
      }
      backoff();
    }
    if (result.ok() && peer_words_ != nullptr && peer_words_[1] != 0) {
      result = options_.abort_signal && options_.abort_signal->raised()
                   ? Status(StatusCode::kBackendError, "communicator aborted: " + options_.abort_signal->reason())
               : peer_words_[1] < 0 || !failure_.empty()
                   ? failure_status()
                   : Status(StatusCode::kTimeout, "rank " + std::to_string(rank_) + ": " + what + ": rank " +
                                                std::to_string(peer_words_[1] - 1) + " did not deliver within " +
                                                std::to_string(options_.timeout.count()) + " ms (peer exchange or window)");
    }
    stats_.wait_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    cuda::timeline::host_span(options_.device, tl0, label, "wait");
    if (!result.ok()) {
      fail(result.message());
      return result;
    }
    float ms = 0;
    if (start != nullptr && cudaEventElapsedTime(&ms, start, end) == cudaSuccess) stats_.busy_ms += ms;
    return Status();
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

  void fail(const std::string& reason) {
    if (failure_.empty()) failure_ = reason;
    if (peer_words_ != nullptr) peer_words_[0] = 1;  // a peer exchange kernel waiting on this rank ends
    abort_comm(comm_);
    comm_ = nullptr;
  }

  // ---- The peer exchange (kernels/cuda/comm/peer_exchange.h) ----

  // The stream the peer exchange and the window run on: the producer's, else the communicator's own.
  cudaStream_t exchange_stream() const {
    return options_.producer_stream != nullptr ? static_cast<cudaStream_t>(options_.producer_stream) : stream_;
  }
  // The communicator's timeout in ns, for the kernels' bounded waits.
  uint64_t timeout_ns() const {
    const uint64_t ms = static_cast<uint64_t>(options_.timeout.count());
    return ms > UINT64_MAX / 1000000ull ? UINT64_MAX : ms * 1000000ull;
  }
  // A CUDA failure of a peer exchange or window call: it fails the communicator (a rank that skipped an exchange
  // its peers ran would pair its next one with their last: the waits accept any newer sequence number).
  Status exchange_failed(cudaError_t e, const char* what) {
    const Status st = cuda_error(e, std::string("rank ") + std::to_string(rank_) + ": " + what);
    fail(st.message());
    return st;
  }

  // What each rank tells the others when a communicator is made.
  struct PeerInfo {
    int32_t want = 0;    // this rank has an exchange area and wants to use it
    int32_t device = 0;
    int32_t ipc_ok = 0;  // ipc holds a handle to the area
    int32_t pad = 0;
    uint64_t slot_bytes = 0;    // the area's layout, which every rank must share
    uint64_t window_bytes = 0;
    uint64_t host = 0;   // hash of the host name
    uint64_t process = 0;  // a random number per process: equal means the same address space
    uint64_t area = 0;   // the area's address in its own process
    cudaIpcMemHandle_t ipc{};
  };

  // Registers an exchange area with every peer: a collective, run by every rank at creation and split. Ranks in
  // this process address a peer's area through peer access, ranks in other processes of this host through CUDA
  // IPC. Used only when every rank can reach every other (else every collective stays with NCCL); the only
  // error is a failed exchange of the areas' details.
  Status setup_peer_exchange() {
    if (size_ < 2 || size_ > cuda::peer::kMaxRanks) return Status();
    const char* env = std::getenv("DSACP_NCCL_PEER_EXCHANGE");
    if (env != nullptr && std::string(env) == "1" && options_.peer_exchange_bytes == 0) {
      options_.peer_exchange_bytes = size_t{32} << 20;
    }
    const bool exchange_wanted = options_.peer_exchange_bytes >= 4096 * static_cast<size_t>(2 * size_) &&
                                 !(env != nullptr && std::string(env) == "0");
    const char* window_env = std::getenv("DSACP_NCCL_WINDOW");
    const char* window_mb = std::getenv("DSACP_NCCL_WINDOW_MB");
    if (window_mb != nullptr && std::atoll(window_mb) > 0) options_.window_bytes = size_t(std::atoll(window_mb)) << 20;
    const bool window_wanted = options_.window_bytes >= 4096 && !(window_env != nullptr && std::string(window_env) == "0");
    const bool wanted = exchange_wanted || window_wanted;
    slot_bytes_ = exchange_wanted ? options_.peer_exchange_bytes / (2 * static_cast<size_t>(size_)) / 256 * 256 : 0;
    window_bytes_ = window_wanted ? options_.window_bytes / 256 * 256 : 0;
    PeerInfo me;
    me.slot_bytes = slot_bytes_;
    me.window_bytes = window_bytes_;
    me.device = options_.device;
    me.process = process_nonce();
    char host[256] = {};
    (void)gethostname(host, sizeof(host) - 1);
    me.host = std::hash<std::string>{}(host);
    if (wanted) {
      void* words = nullptr;
      const size_t window_at = cuda::peer::area_bytes(size_, slot_bytes_);
      // [exchange flags and slots][window region][this rank's failed word (device memory, peer_sync.cuh)]
      const size_t failed_at = window_at + (window_bytes_ > 0 ? cuda::peer::window_region_bytes(window_bytes_) : 0);
      cudaError_t e = cudaMalloc(&area_, failed_at + 256);
      if (e == cudaSuccess) {
        failed_dev_ = reinterpret_cast<int32_t*>(area_ + failed_at);
        e = cudaMemsetAsync(failed_dev_, 0, sizeof(int32_t), stream_);
      }
      if (e == cudaSuccess) e = cudaMemsetAsync(area_, 0, cuda::peer::kFlagBytes, stream_);
      if (e == cudaSuccess && window_bytes_ > 0) {
        e = cudaMemsetAsync(area_ + window_at, 0, cuda::peer::kWindowHeaderBytes, stream_);
      }
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
      if (e == cudaSuccess) e = cudaHostAlloc(&words, 2 * sizeof(int32_t), cudaHostAllocMapped);
      if (e == cudaSuccess) {
        peer_words_ = static_cast<volatile int32_t*>(words);
        peer_words_[0] = 0;
        peer_words_[1] = 0;
        e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&peer_words_dev_), words, 0);
      }
      if (e == cudaSuccess) {
        me.want = 1;
        me.area = reinterpret_cast<uint64_t>(area_);
        me.ipc_ok = cudaIpcGetMemHandle(&me.ipc, area_) == cudaSuccess;
      }
      (void)cudaGetLastError();
    }
    DSACP_ASSIGN_OR_RETURN(std::vector<PeerInfo> all, exchange_setup_record(me));
    int32_t ok = 1;
    for (const PeerInfo& p : all) ok &= p.want && p.slot_bytes == me.slot_bytes && p.window_bytes == me.window_bytes;
    if (!ok) {  // every rank sees the same records: all of them stop here, no vote needed
      release_peer_exchange(true);
      return Status();
    }
    for (int k = 0; k < size_ && ok; ++k) {
      const PeerInfo& p = all[static_cast<size_t>(k)];
      if (k == rank_) {
        peer_areas_[k] = area_;
      } else if (p.process == me.process) {
        int can = 0;
        if (p.device != me.device) {
          if (cudaDeviceCanAccessPeer(&can, me.device, p.device) != cudaSuccess || !can) ok = 0;
          const cudaError_t e = ok ? cudaDeviceEnablePeerAccess(p.device, 0) : cudaSuccess;
          if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) ok = 0;
        }
        peer_areas_[k] = reinterpret_cast<char*>(p.area);
      } else if (p.host == me.host && p.ipc_ok) {
        void* mapped = nullptr;
        if (cudaIpcOpenMemHandle(&mapped, p.ipc, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess) {
          peer_areas_[k] = static_cast<char*>(mapped);
          ipc_opened_.push_back(mapped);
        } else {
          ok = 0;
        }
      } else {
        ok = 0;
      }
      (void)cudaGetLastError();
    }
    // Every rank must agree, or ranks would pair a peer exchange with NCCL.
    PeerInfo vote;
    vote.want = ok;
    DSACP_ASSIGN_OR_RETURN(std::vector<PeerInfo> votes, exchange_setup_record(vote));
    bool all_ok = true;
    for (const PeerInfo& v : votes) all_ok &= v.want != 0;
    if (!all_ok) {
      release_peer_exchange(true);
      return Status();
    }
    peer_ready_ = true;
    const char* fence = std::getenv("DSACP_PEER_FENCE");
    peer_fence_mode_ = fence != nullptr ? std::atoi(fence) : 0;
    const char* window_sync = std::getenv("DSACP_WINDOW_SYNC");
    window_sync_mode_ = window_sync != nullptr ? std::atoi(window_sync) : 0;
    const char* stamps = std::getenv("DSACP_PEER_STAMPS");
    if (stamps != nullptr && std::string(stamps) == "1") {
      const size_t bytes = sizeof(unsigned long long) * cuda::peer::kStampRing * cuda::peer::kStamps;
      if (cudaMalloc(&peer_stamps_, bytes) != cudaSuccess) peer_stamps_ = nullptr;
      reset_stamps();
    }
    return Status();
  }

  // DSACP_PEER_STAMPS=1: each exchange's phases (put, wait, unpack) from the kernels' global timer.
  void reset_stamps() {
    if (peer_stamps_ == nullptr) return;
    std::vector<unsigned long long> init(cuda::peer::kStampRing * cuda::peer::kStamps);
    for (size_t i = 0; i < init.size(); ++i) init[i] = i % 2 == 0 ? ~0ull : 0ull;
    (void)cudaMemcpy(peer_stamps_, init.data(), init.size() * sizeof(init[0]), cudaMemcpyHostToDevice);
  }
  void print_stamps() {
    if (peer_stamps_ == nullptr) return;
    std::vector<unsigned long long> st(cuda::peer::kStampRing * cuda::peer::kStamps);
    if (cudaMemcpy(st.data(), peer_stamps_, st.size() * sizeof(st[0]), cudaMemcpyDeviceToHost) != cudaSuccess) return;
    std::string out = "peer exchange stamps, rank " + std::to_string(rank_) + " (us from put start: put end, wait start, wait end, unpack start, unpack end):\n";
    const uint64_t last = std::min<uint64_t>(peer_seq_, cuda::peer::kStampRing - 1);
    for (uint64_t q = last > 24 ? last - 23 : 1; q <= last; ++q) {
      const unsigned long long* x = st.data() + q * cuda::peer::kStamps;
      if (x[0] == ~0ull) continue;
      char line[200];
      auto us = [&](unsigned long long t) { return (static_cast<double>(t) - static_cast<double>(x[0])) / 1000.0; };
      std::snprintf(line, sizeof line, "  seq %llu: %.1f %.1f %.1f %.1f %.1f\n", static_cast<unsigned long long>(q), us(x[1]),
                    us(x[2]), us(x[3]), us(x[4]), us(x[5]));
      out += line;
    }
    std::fprintf(stderr, "%s", out.c_str());
  }

  // All-gathers one PeerInfo per rank through NCCL (creation time only).
  Result<std::vector<PeerInfo>> exchange_setup_record(const PeerInfo& mine) {
    std::vector<PeerInfo> all(static_cast<size_t>(size_));
    void* dev = nullptr;
    cudaError_t e = cudaMalloc(&dev, sizeof(PeerInfo) * (size_ + 1));
    if (e == cudaSuccess) e = cudaMemcpy(dev, &mine, sizeof(PeerInfo), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      if (dev != nullptr) (void)cudaFree(dev);
      return cuda_error(e, "peer exchange setup");
    }
    char* recv = static_cast<char*>(dev) + sizeof(PeerInfo);
    Status s;
    {
      auto h = launch("all_gather", 0, [&] { return ncclAllGather(dev, recv, sizeof(PeerInfo), ncclUint8, comm_, stream_); });
      s = h.ok() ? (*h)->wait() : h.status();
    }
    if (s.ok()) {
      e = cudaMemcpy(all.data(), recv, sizeof(PeerInfo) * size_, cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) s = cuda_error(e, "peer exchange setup");
    }
    (void)cudaFree(dev);
    stats_ = CommStats{};  // setup traffic is not the caller's
    if (!s.ok()) return s.with_context("NCCL communicator: peer exchange setup");
    return all;
  }

  // Before NCCL goes: with the exchange in use and the communicator healthy, this rank closes its mappings of
  // the peers' areas and a barrier (bounded by 10 s) makes sure no peer still reads or writes this rank's area
  // (and every peer has closed its mapping of it) before it is freed. False: the area must be left allocated.
  bool quiesce_peer_exchange() {
    if (!peer_ready_) return true;
    for (void* p : ipc_opened_) (void)cudaIpcCloseMemHandle(p);
    ipc_opened_.clear();
    if (comm_ == nullptr) return false;
    const auto timeout = options_.timeout;
    options_.timeout = std::min(timeout, std::chrono::milliseconds(10000));
    const bool ok = barrier().ok();
    options_.timeout = timeout;
    return ok;
  }

  // area_safe false (a failed communicator, whose peers may still be in an exchange): the area is left allocated
  // (leaked) rather than freed under a peer that may still store into it.
  void release_peer_exchange(bool area_safe) {
    peer_ready_ = false;
    for (void* p : ipc_opened_) (void)cudaIpcCloseMemHandle(p);
    ipc_opened_.clear();
    if (area_ != nullptr && area_safe) (void)cudaFree(area_);
    area_ = nullptr;
    failed_dev_ = nullptr;
    if (peer_words_ != nullptr) (void)cudaFreeHost(const_cast<int32_t*>(peer_words_));
    peer_words_ = nullptr;
    (void)cudaGetLastError();
  }

  // True when these parts go through the peer exchange (set up, at most kMaxParts, the message fits a slot).
  bool peer_fits(const std::vector<Part>& parts) const {
    if (!peer_ready_ || slot_bytes_ == 0 || parts.empty() || parts.size() > static_cast<size_t>(cuda::peer::kMaxParts)) {
      return false;
    }
    std::vector<cuda::peer::Part> p;
    for (const Part& x : parts) {
      if (x.bytes > slot_bytes_) return false;  // (and no overflow in the sum below)
      p.push_back({x.send, x.recv, x.bytes});
    }
    return cuda::peer::message_bytes(p.data(), static_cast<int>(p.size())) <= slot_bytes_;
  }

  Result<std::unique_ptr<CollectiveHandle>> peer_collective(const char* what, bool all_to_all,
                                                            const std::vector<Part>& parts) {
    cuda::peer::ExchangeArgs a;
    a.kind = all_to_all ? cuda::peer::Kind::kAllToAll : cuda::peer::Kind::kAllGather;
    a.rank = rank_;
    a.size = size_;
    size_t sent = 0;
    for (const Part& p : parts) {
      sent += p.bytes * (size_ - 1);
      if (p.bytes > 0) a.parts[a.num_parts++] = {p.send, p.recv, p.bytes};
    }
    for (int k = 0; k < size_; ++k) a.areas[k] = peer_areas_[k];
    a.slot_bytes = slot_bytes_;
    a.timeout_ns = timeout_ns();
    a.abort_word = peer_words_dev_;
    a.stamps = peer_stamps_;
    a.fence_mode = peer_fence_mode_;
    a.error_word = peer_words_dev_ + 1;  // [1]: the host reads it after the exchange ([0] is the abort word)
    a.failed_word = failed_dev_;
    // On the producer's stream: in line with the kernels that make the inputs and use the outputs. The
    // exchanges of this communicator must still run one after another (the area's parity argument): an
    // exchange on another stream than the last one waits for the last one's end.
    const cudaStream_t on = exchange_stream();
    // Any failure from here on fails the communicator (exchange_failed).
    if (const cudaError_t e = peer_order_.before(on); e != cudaSuccess) return exchange_failed(e, what);
    auto h = launch(what, sent, [&] {
      a.seq = ++peer_seq_;  // only exchanges that launch count, the same on every rank
      if (cuda::peer::launch_exchange(a, on) == cudaSuccess) return ncclSuccess;
      (void)cudaGetLastError();
      return ncclUnhandledCudaError;
    }, a.num_parts == 0, on);
    if (h.ok() && a.num_parts > 0) {
      if (const cudaError_t e = peer_order_.after(on); e != cudaSuccess) return exchange_failed(e, what);
      ++stats_.peer_collectives;
    }
    return h;
  }

  // A window call on this communicator: usable, and with a window.
  Status window_usable() const {
    DSACP_RETURN_IF_ERROR(usable());
    if (!peer_ready_ || window_bytes_ == 0) return unsupported("NCCL communicator: no exchange window");
    return Status();
  }

  // Rank k's window region (its flags, then its two buffers) as this device addresses it.
  char* window_region(int k) const { return peer_areas_[k] + cuda::peer::area_bytes(size_, slot_bytes_); }

 public:
  Result<Window> window_next(size_t bytes) override {
    DSACP_RETURN_IF_ERROR(usable());
    if (!peer_ready_ || window_bytes_ == 0) {
      return unsupported("NCCL communicator: no exchange window (DSACP_NCCL_WINDOW=0, window_bytes 0, or a rank "
                         "that cannot reach the others' memory)");
    }
    if (bytes > window_bytes_) {
      return unsupported("NCCL communicator: a window message of " + std::to_string(bytes) + " bytes, the window holds " +
                         std::to_string(window_bytes_) + " (NcclOptions::window_bytes, DSACP_NCCL_WINDOW_MB)");
    }
    // A producer stream other than the last exchange's: this exchange's producers (enqueued after this call) and
    // its publish wait for all the old stream's work so far (the last publish and the reads after it), as the
    // parity argument needs; reads of the last exchange enqueued on the old stream after this call are not
    // covered (communicator.h: enqueue them first).
    if (const cudaError_t e = window_order_.move_to(exchange_stream()); e != cudaSuccess) {
      return exchange_failed(e, "window stream change");
    }
    const int parity = static_cast<int>((window_seq_ + 1) & 1);
    Window w;
    for (int k = 0; k < size_; ++k) w.all.push_back(cuda::peer::window_buffer(window_region(k), window_bytes_, parity));
    w.mine = cuda::peer::window_buffer(window_region(rank_), window_bytes_, parity);
    window_message_bytes_ = bytes;
    return w;
  }

  Result<std::unique_ptr<CollectiveHandle>> window_publish() override {
    DSACP_RETURN_IF_ERROR(window_usable());
    cuda::peer::WindowArgs a;
    a.rank = rank_;
    a.size = size_;
    for (int k = 0; k < size_; ++k) a.windows[k] = window_region(k);
    a.timeout_ns = timeout_ns();
    a.abort_word = peer_words_dev_;
    a.error_word = peer_words_dev_ + 1;
    a.failed_word = failed_dev_;
    a.sync_mode = window_sync_mode_;
    const cudaStream_t on = exchange_stream();
    // Window exchanges run one after another (the parity argument): one on another stream than the last waits
    // for the last one's end (window_next has moved the sequence to this stream already, unless it changed since).
    if (const cudaError_t e = window_order_.before(on); e != cudaSuccess) return exchange_failed(e, "window publish");
    auto h = launch("window publish", window_message_bytes_ * (size_ - 1), [&] {
      a.seq = ++window_seq_;  // only publishes that launch count, the same on every rank
      if (cuda::peer::launch_window_publish(a, on) == cudaSuccess) return ncclSuccess;
      (void)cudaGetLastError();
      return ncclUnhandledCudaError;
    }, false, on);
    if (h.ok()) {
      if (const cudaError_t e = window_order_.after(on); e != cudaSuccess) return exchange_failed(e, "window publish");
      ++stats_.window_publishes;
    }
    return h;
  }

  Result<WindowRowSync> window_rows(int64_t num_rows) override {
    DSACP_RETURN_IF_ERROR(window_usable());
    if (num_rows < 0 || num_rows > cuda::peer::kMaxWindowRows) {
      return unsupported("NCCL communicator: a window exchange of " + std::to_string(num_rows) +
                         " rows synchronized by the kernels; the row flags hold " +
                         std::to_string(cuda::peer::kMaxWindowRows));
    }
    WindowRowSync sync;
    sync.seq = ++window_seq_;  // the same on every rank: each calls this once per exchange, in the same order
    sync.rank = rank_;
    sync.size = size_;
    sync.num_rows = num_rows;
    for (int k = 0; k < size_; ++k) {
      if (k == rank_) continue;
      sync.signal_to[k] = cuda::peer::window_row_flags(window_region(k), rank_);
      sync.wait_on[k] = cuda::peer::window_row_flags(window_region(rank_), k);
    }
    sync.timeout_ns = timeout_ns();
    sync.abort_word = peer_words_dev_;
    sync.error_word = peer_words_dev_ + 1;
    sync.failed_word = failed_dev_;
    ++stats_.window_publishes;
    return sync;
  }

  Result<std::unique_ptr<CollectiveHandle>> window_rows_done() override {
    DSACP_RETURN_IF_ERROR(window_usable());
    const cudaStream_t on = exchange_stream();
    window_order_.now_on(on);
    // Nothing to enqueue: the handle's end event marks the point after the consumer, and its wait reads the error
    // word the consumers' waits store into.
    return launch("window rows", window_message_bytes_ * (size_ - 1), [] { return ncclSuccess; }, true, on);
  }

 private:
  cudaError_t take_event(cudaEvent_t* e) {
    if (!free_events_.empty()) {
      *e = free_events_.back();
      free_events_.pop_back();
      return cudaSuccess;
    }
    return cudaEventCreate(e);
  }

 public:
  void give_back_events(cudaEvent_t a, cudaEvent_t b) {
    for (cudaEvent_t e : {a, b}) {
      if (e != nullptr) free_events_.push_back(e);
    }
  }

 private:
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
  unsigned long long* peer_stamps_ = nullptr;  // DSACP_PEER_STAMPS=1
  int32_t peer_fence_mode_ = 0;                // DSACP_PEER_FENCE (a diagnostic), read once at setup
  InOrder peer_order_;  // the peer exchanges run one after another
  // The exchange window (after the slots in the area): its buffers' size, the window exchanges published so far,
  // the size of the message of the next one, where the last publish ran and its end.
  size_t window_bytes_ = 0;
  int32_t window_sync_mode_ = 0;  // DSACP_WINDOW_SYNC (a diagnostic), read once at setup
  uint64_t window_seq_ = 0;
  size_t window_message_bytes_ = 0;
  InOrder window_order_;  // the window exchanges run one after another
};

NcclHandle::~NcclHandle() {
  if (!waited_) (void)wait();
  comm_->give_back_events(start_, end_);
}

bool NcclHandle::order_before(void* stream) {
  if (waited_) return true;  // already complete
  if (static_cast<cudaStream_t>(stream) == stream_) return true;  // enqueued there: in order already
  if (cudaSetDevice(comm_->device()) != cudaSuccess ||
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), end_, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

Status NcclHandle::wait() {
  if (!waited_) {
    waited_ = true;
    result_ = comm_->wait_for(start_, end_, what_, label_);
  }
  return result_;
}

}  // namespace

bool nccl_available() { return true; }

int nccl_background_threads() { return g_background.load(); }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (version unknown)";
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

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

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(const NcclId& id, int size, int rank,
                                                                   const NcclOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return invalid_argument("NCCL communicator: rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  if (options.timeout.count() < 1) return invalid_argument("NCCL communicator: timeout must be >= 1 ms");
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return unsupported(std::string("NCCL communicator: no usable CUDA device (") + cudaGetErrorName(e) + ")");
  }
  if (options.device < 0 || options.device >= count) {
    return invalid_argument("NCCL communicator: device " + std::to_string(options.device) + " outside [0, " +
                            std::to_string(count) + ")");
  }
  cuda::warn_if_lazy_module_loading("an NCCL communicator");
  static std::once_flag connect_at_init;
  std::call_once(connect_at_init, [] { (void)setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0); });
  ncclUniqueId raw;
  std::copy(id.bytes.begin(), id.bytes.end(), raw.internal);
  const std::string what = "NCCL init of rank " + std::to_string(rank) + " of " + std::to_string(size) +
                           " on device " + std::to_string(options.device);
  DSACP_ASSIGN_OR_RETURN(ncclComm_t comm, bounded_create(
                                               [raw, size, rank](ncclComm_t* out) {
                                                 ncclConfig_t config = comm_config();
                                                 return ncclCommInitRankConfig(out, size, raw, rank, &config);
                                               },
                                               options.device, what, options.timeout, options.abort_signal));
  e = cudaSetDevice(options.device);
  if (e != cudaSuccess) {
    abort_comm(comm);
    return cuda_error(e, what);
  }
  return NcclComm::wrap(comm, options);
}

}  // namespace dsacp
