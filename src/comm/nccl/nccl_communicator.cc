// NCCL communicator (dsacp/nccl_communicator.h): one stream each, bounded waits by polling CUDA events and
// ncclCommGetAsyncError; creation, split and finalization bounded on helper threads. This file: the communicator's
// destruction, its collectives through NCCL, waits, abort and split, its collective handle, and the entry points
// (NcclCommunicator::create, nccl_available, nccl_version). The class is in nccl_comm.h; the peer exchange and the
// exchange window are in nccl_peer_exchange.cc, the bounded NCCL calls in nccl_lifecycle.cc, the id helpers in
// nccl_id.cc.
#include "comm/nccl/nccl_comm.h"

#include "kernels/cuda/common/module_loading.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>

namespace dsacp {
namespace nccl_detail {

NcclComm::~NcclComm() {
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

Result<std::unique_ptr<CollectiveHandle>> NcclComm::all_gather_async(const void* send, void* recv, size_t bytes) {
  if (peer_fits({{send, recv, bytes}})) return peer_collective("p2p all_gather", false, {{send, recv, bytes}});
  return launch("all_gather", bytes * (size_ - 1),
                [&] { return ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_); }, bytes == 0);
}

Result<std::unique_ptr<CollectiveHandle>> NcclComm::all_to_all_async(const void* send, void* recv, size_t bytes) {
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
ncclResult_t NcclComm::copy_own_block(const void* send, void* recv, size_t bytes) {
  const size_t at = static_cast<size_t>(rank_) * bytes;
  const cudaError_t e = cudaMemcpyAsync(static_cast<char*>(recv) + at, static_cast<const char*>(send) + at, bytes,
                                        cudaMemcpyDeviceToDevice, stream_);
  if (e == cudaSuccess) return ncclSuccess;
  (void)cudaGetLastError();
  return ncclUnhandledCudaError;
}

bool NcclComm::all_empty(const std::vector<Part>& parts) {
  for (const Part& p : parts) {
    if (p.bytes > 0) return false;
  }
  return true;
}

Result<std::unique_ptr<CollectiveHandle>> NcclComm::all_gather_group_async(const std::vector<Part>& parts) {
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

Result<std::unique_ptr<CollectiveHandle>> NcclComm::all_to_all_group_async(const std::vector<Part>& parts) {
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

Result<std::unique_ptr<CollectiveHandle>> NcclComm::broadcast_async(void* buf, size_t bytes, int root) {
  if (root < 0 || root >= size_) {
    return invalid_argument("broadcast root " + std::to_string(root) + " outside [0, " + std::to_string(size_) + ")");
  }
  return launch("broadcast", rank_ == root ? bytes * (size_ - 1) : 0,
                [&] { return ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_); }, bytes == 0);
}

Status NcclComm::barrier() {
  DSACP_ASSIGN_OR_RETURN(auto h, launch("barrier", 0, [&] {
    return ncclAllReduce(flag_, flag_, 1, ncclFloat32, ncclSum, comm_, stream_);
  }, false));
  return h->wait();
}

void NcclComm::abort(const std::string& reason) {
  if (options_.abort_signal) options_.abort_signal->raise("rank " + std::to_string(rank_) + " failed: " + reason);
  fail("rank " + std::to_string(rank_) + " aborted: " + reason);
}

Status NcclComm::all_gather_dim(const void* send, void* recv, void* scratch, int64_t outer, int64_t local_dim,
                                int64_t inner, size_t elem_size) {
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

Result<std::unique_ptr<NcclCommunicator>> NcclComm::split(int color, int key) {
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
Result<std::unique_ptr<NcclCommunicator>> NcclComm::wrap(ncclComm_t comm, const NcclOptions& options) {
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
Status NcclComm::wait_for(cudaEvent_t start, cudaEvent_t end, const std::string& what, const char* label) {
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
  if (result.ok()) result = peer_wait_error(what);
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

Status NcclComm::peer_wait_error(const std::string& what) const {
  if (peer_words_ == nullptr || peer_words_[1] == 0) return Status();
  if (options_.abort_signal && options_.abort_signal->raised()) {
    return Status(StatusCode::kBackendError, "communicator aborted: " + options_.abort_signal->reason());
  }
  if (peer_words_[1] < 0 || !failure_.empty()) return failure_status();
  return Status(StatusCode::kTimeout, "rank " + std::to_string(rank_) + ": " + what + ": rank " +
                                          std::to_string(peer_words_[1] - 1) + " did not deliver within " +
                                          std::to_string(options_.timeout.count()) + " ms (peer exchange or window)");
}

void NcclComm::fail(const std::string& reason) {
  if (failure_.empty()) failure_ = reason;
  if (peer_words_ != nullptr) peer_words_[0] = 1;  // a peer exchange kernel waiting on this rank ends
  abort_comm(comm_);
  comm_ = nullptr;
}

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

}  // namespace nccl_detail

using nccl_detail::abort_comm;
using nccl_detail::bounded_create;
using nccl_detail::comm_config;
using nccl_detail::cuda_error;
using nccl_detail::NcclComm;

bool nccl_available() { return true; }

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (version unknown)";
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
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
