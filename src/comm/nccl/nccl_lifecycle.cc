// The NCCL calls that could wait for a missing peer, each bounded (declared in nccl_comm.h): a new
// communicator's creation and connection on a helper thread (bounded_create, with connect_peers), the wait for an
// asynchronous state to settle (settle), finalization and destruction (bounded_release) and aborts on detached
// threads (abort_comm); the Status of an NCCL or CUDA error; the count of helper threads still inside NCCL
// (nccl_background_threads).
#include "comm/nccl/nccl_comm.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <new>
#include <system_error>
#include <thread>

namespace dsacp {
namespace {

std::atomic<int> g_background{0};  // helper threads still inside NCCL (nccl_background_threads)

// Starts fn on a detached helper thread counted in g_background; false (nothing started, the count unchanged)
// when the system refuses a thread (std::system_error) or memory runs out.
bool start_helper(std::function<void()> fn) {
  ++g_background;
  try {
    std::thread([fn = std::move(fn)] {
      fn();
      --g_background;
    }).detach();
    return true;
  } catch (const std::system_error&) {
  } catch (const std::bad_alloc&) {
  }
  --g_background;
  return false;
}

}  // namespace

namespace nccl_detail {

Status nccl_error(ncclResult_t r, const std::string& what, ncclComm_t comm) {
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

// Aborts a communicator on a detached thread, so the caller never waits: ncclCommAbort can wait for the other
// ranks of its process (ranks that are threads) to abort too, or join a bootstrap thread that waits for a peer
// that never arrived.
void abort_comm(ncclComm_t comm) {
  if (comm == nullptr) return;
  // Without a helper thread the abort runs here (it may then wait for the other ranks of the process).
  if (!start_helper([comm] { (void)ncclCommAbort(comm); })) (void)ncclCommAbort(comm);
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

namespace {

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

}  // namespace

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
  const bool started = start_helper([st, make, device, what, timeout, signal] {
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
  });
  if (!started) {
    return Status(StatusCode::kResourceExhausted, what + ": cannot start a helper thread (thread or address-space limit)");
  }
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
  auto release = [comm, device, timeout, done] {
    (void)cudaSetDevice(device);
    ncclComm_t c = comm;
    const ncclResult_t r = ncclCommFinalize(c);
    if (r == ncclInProgress) (void)settle(&c, "NCCL finalize", timeout, nullptr);
    if (c != nullptr) {
      std::lock_guard<std::mutex> lock(g_destroy_mu);
      (void)ncclCommDestroy(c);
    }
    done->store(true);
  };
  // Without a helper thread the release runs here (its finalization is bounded by settle all the same).
  if (!start_helper(release)) release();
  const auto deadline = Clock::now() + timeout;
  while (!done->load() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

}  // namespace nccl_detail

int nccl_background_threads() { return g_background.load(); }

}  // namespace dsacp
