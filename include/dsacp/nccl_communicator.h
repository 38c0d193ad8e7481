// NCCL communicators: one CP rank per GPU, buffers in device memory. Host-only header (no CUDA or NCCL
// headers here); in a build without NCCL every entry point answers `unsupported: built without NCCL`.
//
// Ranks can be threads of one process (one thread per GPU: the default on one machine, what LocalCpCluster
// does) or processes (started by mpirun, or by a launcher that sets RANK / WORLD_SIZE / LOCAL_RANK, the NCCL
// id shared through a file: nccl_id_write / nccl_id_read).
//
// Each communicator has its own CUDA stream: a collective is enqueued there and returns at once, so it runs
// while the caller computes; wait() polls a CUDA event. Creation, split and finalization (which NCCL may block
// in while a peer is missing) run on helper threads that the caller waits for, bounded by the timeout, as is
// every wait. A rank that times out, or whose NCCL reports an asynchronous error, aborts its communicator
// (ncclCommAbort, on a detached thread) and fails every later call. abort(reason) does the same and raises the shared AbortSignal, if any: communicators of
// one process that share a signal (ranks as threads) then fail their waits at once, naming the failed rank,
// instead of running into their own timeouts. Ranks in other processes fail when their waits time out.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "dsacp/communicator.h"
#include "dsacp/status.h"

namespace dsacp {

// True when dsacp was built with NCCL.
bool nccl_available();
// "NCCL 2.28.9" (the library loaded at run time), or why there is none.
std::string nccl_version();
// Helper threads still inside NCCL: aborts (detached), and creations or finalizations given up on after a
// timeout. A process that ends while any run should end with std::_Exit (after flushing its output): NCCL and
// the CUDA runtime tearing down under them can crash or hang the exit.
int nccl_background_threads();

// The id every rank of a new NCCL communicator needs: made by one rank, shared with the others.
struct NcclId {
  std::array<char, 128> bytes{};
};
Result<NcclId> nccl_make_id();
// Writes the id to `path` atomically (a temporary file renamed into place).
Status nccl_id_write(const std::string& path, const NcclId& id);
// Reads the id from `path`, waiting up to `timeout` for the file to appear.
Result<NcclId> nccl_id_read(const std::string& path, std::chrono::milliseconds timeout);

// A failure shared by the communicators of one process: the first reason raised wins.
class AbortSignal {
 public:
  void raise(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!raised_.load()) {
      reason_ = reason;
      raised_.store(true);
    }
  }
  bool raised() const { return raised_.load(); }
  std::string reason() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reason_;
  }

 private:
  mutable std::mutex mu_;
  std::atomic<bool> raised_{false};
  std::string reason_;
};

struct NcclOptions {
  int device = 0;                                  // CUDA device of this rank
  std::chrono::milliseconds timeout{600000};       // bounds creation, split and every wait
  std::shared_ptr<AbortSignal> abort_signal;       // optional: shared by ranks that are threads of one process
  // Optional: the stream (cudaStream_t) that produces the collectives' inputs, normally the rank's backend
  // stream (Backend::native_stream()). Each collective starts after the work enqueued there before it, so
  // the producer need not synchronize first (deferred errors). Inherited by split communicators.
  void* producer_stream = nullptr;
  // Device memory for the peer exchange: all-gathers and all-to-alls up to peer_exchange_bytes / (2 x ranks)
  // per rank moved by dsacp's own kernels straight into the peers' memory instead of by NCCL (GPUs of one host,
  // ranks as threads or processes). Off by default (0): on the H200 pair it measured no faster than NCCL in the
  // DCP decode step. Below 8 KiB x ranks it stays off. It is used only when every rank has it
  // on and can reach every other rank's memory. An exchange runs on the producer stream: it starts after the
  // producer's work, not after this communicator's earlier NCCL collectives (a consumer of one collective's
  // output orders itself with CollectiveHandle::order_before, as always). Inherited by split communicators.
  size_t peer_exchange_bytes = 0;
  // Device memory for the exchange window (Communicator::window_next): two buffers of window_bytes per rank,
  // registered with every peer at creation (GPUs of one host, ranks as threads or processes; used only when
  // every rank has it and reaches every other). The DCP decode step exchanges its candidates and its partial
  // outputs through it; 0 (below 4 KiB) goes without: every exchange through NCCL. Inherited by split
  // communicators. 32 MiB: the partials of a 2-rank decode batch of up to 255 rows at H = 128 (bf16) fit,
  // so b = 128 merges them inside attention too (16 MiB fit b <= 127).
  size_t window_bytes = size_t{32} << 20;
  // Diagnostic: with the peer exchange on, each exchange's phase times (put, wait, unpack: the kernels' global
  // timer) printed to stderr when the communicator goes.
  bool exchange_stamps = false;
};

class NcclCommunicator : public Communicator {
 public:
  // Rank `rank` of a `size`-rank communicator on CUDA device options.device. Every rank calls it with the same
  // id, concurrently (its own thread or process).
  static Result<std::unique_ptr<NcclCommunicator>> create(const NcclId& id, int size, int rank,
                                                          const NcclOptions& options);
  // Collective over every rank of this communicator: the ranks with the same color (>= 0) form a new
  // communicator, ranked by key (ncclCommSplit). It shares this one's device, timeout and abort signal.
  virtual Result<std::unique_ptr<NcclCommunicator>> split(int color, int key) = 0;
  virtual int device() const = 0;
};

}  // namespace dsacp
