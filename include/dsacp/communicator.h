// Collectives between the ranks of a context-parallel group. The executor talks to other ranks only
// through this interface; implementations: local (ranks as threads in one process — the embedded default
// and what tests use; host memory, or device memory through a copy function), MPI (ranks as processes, host
// memory: dsacp/mpi_context.h) and NCCL (one rank per GPU, device memory: dsacp/nccl_communicator.h).
//
// Every collective is called by every rank of the group in the same order. Every wait is bounded by the
// group's timeout and turns into a kTimeout error instead of a hang. A rank that fails calls abort(): every
// rank waiting in (or later entering) a collective of that group gets an error naming the failed rank.
// Buffers are in the backend's memory (host memory for the CPU backend) and must hold their data when the
// collective is called: on host transports the producing calls have finished by then; a device transport
// (NCCL) orders its collectives after the work already enqueued on the producer's stream
// (NcclOptions::producer_stream), and its consumers can order themselves after a collective on the device
// (CollectiveHandle::order_before).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsacp/kernel_params.h"
#include "dsacp/status.h"

namespace dsacp {

// A collective in flight. wait() completes it (bounded by the group's timeout); a handle that is destroyed
// without wait() waits in its destructor, so buffers are never left in use.
class CollectiveHandle {
 public:
  virtual ~CollectiveHandle() = default;
  virtual Status wait() = 0;
  // Makes work enqueued later on `stream` (a cudaStream_t of this communicator's device) wait on the device
  // for the collective to finish, without blocking the host. True when done; false when this transport cannot
  // (host memory): then call wait() before using the result. Either way wait() must still be called (it
  // bounds the collective and reports its errors), typically at the end of the step.
  virtual bool order_before(void* stream) {
    (void)stream;
    return false;
  }
  // Gives the handle up without a wait, after order_before() ordered every consumer of the collective on the
  // device (an enqueue-only run: a CUDA graph capture). The collective's errors are then not reported here.
  // Host transports (order_before false) ignore it: their destructor still waits.
  virtual void release_ordered() {}
};

// What a communicator has done since it was made (or since reset_stats): collectives, bytes this rank sent,
// the time its collectives kept the network busy (device time on a GPU communicator, from launch to
// completion, so waiting for a late peer counts; 0 where it cannot be measured), the time the calling thread
// spent starting them (enqueue_ms) and blocked in wait() (wait_ms). 1 - wait_ms / busy_ms is the share of the
// communication that overlapped other work.
struct CommStats {
  int64_t collectives = 0;
  int64_t bytes = 0;
  double busy_ms = 0;
  double enqueue_ms = 0;
  double wait_ms = 0;
  int64_t peer_collectives = 0;  // of `collectives`, those a GPU communicator moved by its peer exchange
  int64_t window_publishes = 0;  // of `collectives`, window publishes (Communicator::window_publish)
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv [size * bytes] = concat over ranks of each rank's send [bytes] (rank order).
  virtual Result<std::unique_ptr<CollectiveHandle>> all_gather_async(const void* send, void* recv, size_t bytes) = 0;
  // send [size * bytes]: block k goes to rank k; recv [size * bytes]: block k came from rank k.
  virtual Result<std::unique_ptr<CollectiveHandle>> all_to_all_async(const void* send, void* recv, size_t bytes) = 0;
  // buf [bytes] on every rank takes the root's content.
  virtual Result<std::unique_ptr<CollectiveHandle>> broadcast_async(void* buf, size_t bytes, int root) = 0;
  virtual Status barrier() = 0;
  // Marks this rank failed with a reason; every collective of the group then fails on every rank.
  virtual void abort(const std::string& reason) = 0;
  virtual CommStats stats() const { return {}; }
  virtual void reset_stats() {}
  // Device transports: the stream (cudaStream_t) whose work enqueued so far the next collectives start after
  // (NcclOptions::producer_stream), for a producer that moves between streams (Backend lanes). Host transports
  // ignore it (their inputs are ready when a collective is called).
  virtual void set_producer_stream(void* stream) { (void)stream; }
  // True when the collectives order themselves on the device (after the producer stream's work, and their
  // consumers through CollectiveHandle::order_before), so they may be launched from a backend lane. False for
  // host transports, and for device memory moved through a CopyFn: those copies run on whichever rank's thread
  // completes the collective, ordered only on that thread's current stream.
  virtual bool orders_on_device() const { return false; }

  // Several all-gathers (or all-to-alls) as one operation with one handle: parts[i] is {send, recv, bytes} as
  // for all_gather_async (all_to_all_async). A GPU communicator launches them together (one NCCL group), which
  // pays the per-collective latency once. Every rank passes the same number of parts and the same sizes. The
  // default implementation starts them one by one.
  struct Part {
    const void* send;
    void* recv;
    size_t bytes;
  };
  virtual Result<std::unique_ptr<CollectiveHandle>> all_gather_group_async(const std::vector<Part>& parts);
  virtual Result<std::unique_ptr<CollectiveHandle>> all_to_all_group_async(const std::vector<Part>& parts);

  // Window exchanges: zero-copy all-gathers for device transports whose ranks address each other's memory
  // (NCCL ranks on one host). Each rank writes its message straight into its own window buffer, publishes it,
  // and consumers read every rank's message in place; nothing is copied into a receive buffer and no
  // collective kernel runs (a publish is one small kernel that raises this rank's flag in every peer and waits
  // for theirs). Every rank, in the same order, with the same size:
  //   Window w = window_next(bytes);  // then enqueue work on the producer stream that writes w.mine[0, bytes)
  //   auto h = window_publish();      // then enqueue reads of w.all[k] (rank k's message) on the producer stream
  // One window exchange at a time: the reads of an exchange must be enqueued on the producer stream before this
  // rank's next window_publish() (each rank keeps two window buffers and alternates), and before the next
  // window_next() if the producer stream changes in between (window_next orders the new stream after the old
  // one's work so far). The handle works as a
  // collective's (order_before, a bounded wait() that reports a rank that never published). Communicators
  // without windows (host transports, ranks that cannot reach each other, messages past the window size)
  // answer window_next with kUnsupported: use the collectives then.
  struct Window {
    void* mine = nullptr;
    std::vector<void*> all;  // rank order; all[rank()] == mine
  };
  virtual Result<Window> window_next(size_t bytes);
  virtual Result<std::unique_ptr<CollectiveHandle>> window_publish();

  // A window exchange synchronized by the kernels, row by row, instead of window_publish (no publish kernel
  // between producer and consumer, and a consumer's row t waits only for row t). After window_next:
  //   WindowRowSync sync = window_rows(num_rows);  // the producer kernel signals with it, the consumer waits
  //   ... enqueue the producer, then the consumer, on the producer stream ...
  //   auto h = window_rows_done();                // a handle whose wait() reports a consumer's failed wait
  // or, where the caller synchronizes the consumers' stream anyway (a step's end), no handle: after that
  // synchronize, window_rows_check() reports the same (no event on the stream, no wait of its own; the kernels'
  // row waits are bounded by the communicator's timeout and its abort, so the synchronize is too).
  // Producers may also store into the peers' buffers (w.all[k]) instead of their own: a peer's buffer of this
  // exchange is free once window_next returned it (the same parity argument). The consumer must wait for every
  // peer's flag of each row it reads. Unsupported past the row flags (4096 rows) and where window_next is.
  virtual Result<WindowRowSync> window_rows(int64_t num_rows);
  virtual Result<std::unique_ptr<CollectiveHandle>> window_rows_done();
  virtual Status window_rows_check();

  // Blocking forms.
  Status all_gather(const void* send, void* recv, size_t bytes);
  Status all_to_all(const void* send, void* recv, size_t bytes);
  Status broadcast(void* buf, size_t bytes, int root);

  // All-gather along dimension `dim` of a row-major [outer, local_dim, inner] block of `elem_size`-byte
  // elements: recv is [outer, size * local_dim, inner], rank r's slice at [:, r*local_dim : (r+1)*local_dim, :].
  // `scratch` must hold size * outer * local_dim * inner elements (the gathered rank-major blocks).
  // The default implementation rearranges the blocks with copy_block; a communicator may override it whole.
  virtual Status all_gather_dim(const void* send, void* recv, void* scratch, int64_t outer, int64_t local_dim,
                                int64_t inner, size_t elem_size);

 protected:
  // Copies bytes within this communicator's memory (all_gather_dim's rearrangement): memcpy by default.
  virtual Status copy_block(void* dst, const void* src, size_t bytes);
};

// Copies `bytes` from src to dst in the ranks' memory (a backend's copy_on_device for device buffers).
using CopyFn = std::function<Status(void* dst, const void* src, size_t bytes)>;

// A group of `size` ranks that live as threads of this process. make_communicator(r) gives rank r's
// endpoint; each rank's thread uses only its own endpoint. Buffers are host memory (copied with memcpy), or
// any memory `copy` can move (e.g. every rank's buffers on one GPU).
class LocalGroup {
 public:
  static std::shared_ptr<LocalGroup> create(int size, std::chrono::milliseconds timeout = std::chrono::seconds(120),
                                            CopyFn copy = nullptr);
  virtual ~LocalGroup() = default;
  virtual std::unique_ptr<Communicator> make_communicator(int rank) = 0;
};

}  // namespace dsacp
