// The CUDA backend (sm_90a): device memory, copies, and the step's kernels on one stream.
// Memory comes from the device's stream-ordered pool (cudaMallocAsync, kept cached): cudaMalloc/cudaFree would
// synchronize the device (and, with peer access on, its peers), which stalls behind NCCL kernels in flight and
// can deadlock ranks that are threads of one process (NCCL's "concurrency with CUDA calls" rule).
// Thread-safe (calls are serialized). Each kernel call validates what the backend supports and launches. Checked
// (the default), it then reads the launch's device error word (one small device-to-host copy and a stream
// synchronization) so that a bad page id, request row or slot comes back as a Status from the same call.
// Deferred (Backend::defer_errors, what the executors use for a step), kernels, uploads and device copies only
// enqueue, each launch gets its own error word, and synchronize() reads them all back at once. Every CUDA call
// is checked; nothing aborts.
//
// This file: construction, lanes, memory, copies, synchronization and capture (cuda_backend_impl.h has the class).
#include "kernels/cuda/cuda_backend_impl.h"

namespace dsacp {
namespace cuda {

Status CudaBackend::begin_lanes() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const std::thread::id me = std::this_thread::get_id();
  if (thread_lane_.count(me) != 0) {
    return internal_error("CUDA backend: begin_lanes: a lane session is already open on this thread");
  }
  if (lanes_[1].stream == nullptr) {
    // The side lane: the device's highest stream priority, so its blocks are scheduled first as SMs free up
    // (CudaBackendOptions::side_lane_high_priority off: the default priority, a diagnostic).
    int lowest = 0, highest = 0;
    DSACP_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    if (!options_.side_lane_high_priority) highest = 0;
    cudaStream_t side = nullptr;
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&side, cudaStreamNonBlocking, highest));
    lanes_[1].set_stream(side);
    DSACP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&lane_event_, cudaEventDisableTiming));
    DSACP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork_event_, cudaEventDisableTiming));
  }
  // The fork: the side lane starts after the main stream's work so far. Only the event is recorded here; the
  // side stream waits for it when the side lane is first used (set_lane(1)): a CUDA call less before the
  // caller's next launch (the CP step forks right before its indexer launch and uses the side lane after it).
  DSACP_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_event_, lanes_[0].stream));
  fork_pending_ = true;
  thread_lane_[me] = 0;
  box_->begin_hold();
  return Status::ok_status();
}

void CudaBackend::set_lane(int l) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = thread_lane_.find(std::this_thread::get_id());
  if (it == thread_lane_.end()) return;
  it->second = l == 1 ? 1 : 0;
  if (l == 1 && fork_pending_) {
    // (a failure comes back from the next synchronize(); the side lane then waits for everything)
    fork_pending_ = false;
    (void)cudaSetDevice(device_);
    const cudaError_t e = cudaStreamWaitEvent(lanes_[1].stream, fork_event_, 0);
    if (e != cudaSuccess && held_error_.ok()) {
      (void)(held_error_ = internal_error(std::string("CUDA backend: the side lane's fork: ") + cudaGetErrorString(e)));
      (void)cudaDeviceSynchronize();
    }
  }
}

Status CudaBackend::end_lanes() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = thread_lane_.find(std::this_thread::get_id());
  if (it == thread_lane_.end()) return Status::ok_status();
  thread_lane_.erase(it);
  (void)cudaSetDevice(device_);
  if (thread_lane_.empty()) fork_pending_ = false;  // a side lane no session used has nothing to order
  Status s = order_after(lanes_[0].stream, lanes_[1].stream);
  if (!s.ok()) (void)sync_lanes();  // cannot order on the device: wait, so held blocks are free to reuse
  box_->end_hold();
  return s;
}

Result<DeviceBuffer> CudaBackend::allocate(size_t bytes) {
  TraceScope trace(trace_, bytes < (1u << 20) ? "allocate < 1 MiB" : "allocate >= 1 MiB");
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return refuse_in_capture("allocate");
  const double t0 = cuda::timeline::host_now_us(device_);
  const size_t cls = StreamBox::size_class(bytes);
  void* p = box_->take(cls);
  cudaError_t err = cudaSuccess;
  // A cached block needs no CUDA call at all (unless checked mode synchronizes below).
  if (p == nullptr || deferred_ == 0) DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (p == nullptr) {
    err = cudaMallocAsync(&p, cls, stream_);
    if (err != cudaSuccess) {
      // Out of memory with blocks cached: give them back to the pool and try once more.
      (void)cudaGetLastError();
      box_->release_cached();
      p = nullptr;
      err = cudaMallocAsync(&p, cls, stream_);
    }
  }
  if (err == cudaSuccess && deferred_ == 0) err = cudaStreamSynchronize(stream_);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return resource_exhausted("CUDA backend: allocation of " + std::to_string(bytes) + " bytes on device " +
                              std::to_string(device_) + " failed: " + cudaGetErrorName(err));
  }
  cuda::timeline::host_span(device_, t0, "allocate", "host");
  std::shared_ptr<StreamBox> box = box_;
  return DeviceBuffer(p, bytes, [box, cls](void* q) { box->give_back(q, cls); });
}

Status CudaBackend::copy_to_device(void* dst, const void* src, size_t bytes) {
  TraceScope trace(trace_, bytes < (1u << 20) ? "copy_to_device < 1 MiB" : "copy_to_device >= 1 MiB");
  if (bytes == 0) return Status::ok_status();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return refuse_in_capture("copy_to_device");
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStream_t stream = lane().stream;
  if (deferred_ > 0) {
    if (ring_ != nullptr && bytes <= kRingBytes) {
      if (ring_used_ + bytes > kRingBytes) {
        // The ring is full: its earlier copies (on either lane) must finish before it is reused.
        DSACP_RETURN_IF_ERROR(sync_lanes());
        ring_used_ = 0;
      }
      char* slot = static_cast<char*>(ring_) + ring_used_;
      std::memcpy(slot, src, bytes);
      ring_used_ += (bytes + 255) / 256 * 256;
      src = slot;
    }
    const cuda::timeline::Span span = cuda::timeline::open(device_, stream);
    DSACP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
    cuda::timeline::close(device_, span, stream, "upload", "copy");
    return Status::ok_status();
  }
  if (bytes <= kStageBytes && stage_ != nullptr) {
    // Small copies go through pinned memory: a true async DMA instead of the pageable staging path.
    std::memcpy(stage_, src, bytes);
    src = stage_;
  }
  DSACP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::ok_status();
}

Status CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  TraceScope trace(trace_, bytes < (1u << 20) ? "copy_to_host < 1 MiB" : "copy_to_host >= 1 MiB");
  if (bytes == 0) return Status::ok_status();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return refuse_in_capture("copy_to_host");
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const bool staged = bytes <= kStageBytes && stage_ != nullptr;
  cudaStream_t stream = lane().stream;
  const cuda::timeline::Span span = cuda::timeline::open(device_, stream);
  DSACP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(staged ? stage_ : dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  cuda::timeline::close(device_, span, stream, "download (waits)", "copy");
  DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (staged) std::memcpy(dst, stage_, bytes);
  return Status::ok_status();
}

Status CudaBackend::copy_on_device(void* dst, const void* src, size_t bytes) {
  TraceScope trace(trace_, bytes < (1u << 20) ? "copy_on_device < 1 MiB" : "copy_on_device >= 1 MiB");
  if (bytes == 0) return Status::ok_status();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStream_t stream = lane().stream;
  const cuda::timeline::Span span = cuda::timeline::open(device_, stream);
  DSACP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  cuda::timeline::close(device_, span, stream, "device copy", "copy");
  if (deferred_ == 0) DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  return Status::ok_status();
}

Status CudaBackend::synchronize() {
  TraceScope trace(trace_, "synchronize");
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return refuse_in_capture("synchronize");
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const double t0 = cuda::timeline::host_now_us(device_);
  Status s = collect_deferred();
  cuda::timeline::host_span(device_, t0, "synchronize", "wait");
  return s;
}

Status CudaBackend::begin_synchronize() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  // Not inside a lane session: the side lane's kernels may still run after the main stream's copy.
  if (deferred_ == 0 || !thread_lane_.empty() || capturing_) return Status::ok_status();
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  DSACP_CUDA_RETURN_IF_ERROR(enqueue_error_readback());
  staged_ = pending_.size();
  return Status::ok_status();
}

void CudaBackend::defer_errors(bool on) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (on) {
    if (deferred_++ == 0) cuda::timeline::begin_step(device_, stream_);
    return;
  }
  if (deferred_ == 0) return;
  if (--deferred_ == 0) {
    // A scope left without synchronize() (an early error): wait for its work, drop its pending errors.
    (void)cudaSetDevice(device_);
    (void)collect_deferred();
    cuda::timeline::end_step(device_);
  }
}

void CudaBackend::defer_errors_keep_pending() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (deferred_ > 0 && --deferred_ == 0) cuda::timeline::end_step(device_);
}

Status CudaBackend::begin_capture() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return internal_error("CUDA backend: begin_capture: a capture is already open");
  if (!thread_lane_.empty()) return invalid_argument("CUDA backend: begin_capture inside a lane session");
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Status before = collect_deferred();
  if (!before.ok() && held_error_.ok()) (void)(held_error_ = std::move(before));
  DSACP_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
  (void)(capture_error_ = Status::ok_status());
  ++deferred_;
  return Status::ok_status();
}

Result<CapturedWork> CudaBackend::end_capture() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (!capturing_) return internal_error("CUDA backend: end_capture without begin_capture");
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  capturing_ = false;
  --deferred_;
  auto box = std::make_shared<GraphBox>();
  box->device = device_;
  const cudaError_t e = cudaStreamEndCapture(stream_, &box->graph);
  box->kernels = std::move(pending_);
  pending_.clear();
  staged_ = 0;
  if (!capture_error_.ok()) return std::exchange(capture_error_, Status::ok_status());
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return internal_error(std::string("CUDA backend: end_capture: the capture failed: ") + cudaGetErrorString(e));
  }
  DSACP_CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&box->exec, box->graph, 0));
  CapturedWork w;
  w.impl = std::move(box);
  return w;
}

Status CudaBackend::replay(const CapturedWork& work) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return refuse_in_capture("replay");
  auto* box = static_cast<const GraphBox*>(work.impl.get());
  if (box == nullptr || box->exec == nullptr) return invalid_argument("CUDA backend: replay of an empty capture");
  if (box->device != device_) {
    return invalid_argument("CUDA backend: replay of work captured on device " + std::to_string(box->device) +
                            " on device " + std::to_string(device_));
  }
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (!pending_.empty() && pending_ != box->kernels) {
    // Other launches hold the error slots the graph writes: collect them first (kept for synchronize()).
    Status before = collect_deferred();
    if (!before.ok() && held_error_.ok()) (void)(held_error_ = std::move(before));
  }
  DSACP_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(box->exec, stream_));
  pending_ = box->kernels;
  staged_ = 0;
  return Status::ok_status();
}

}  // namespace cuda

using cuda::CudaBackend;
using cuda::GraphBox;
using cuda::StreamBox;
using cuda::kErrorSlots;


Result<int> cuda_device_count() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return unsupported(std::string("no usable CUDA device (") + cudaGetErrorName(err) + ")");
  }
  return count;
}

Result<std::unique_ptr<Backend>> make_cuda_backend(int device, const CudaBackendOptions& options) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return unsupported(std::string("CUDA backend: no CUDA device (") +
                       (err != cudaSuccess ? cudaGetErrorName(err) : "0 devices") + ")");
  }
  if (device < 0 || device >= count) {
    return invalid_argument("CUDA backend: device " + std::to_string(device) + " outside [0, " +
                            std::to_string(count) + ")");
  }
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaDeviceProp prop{};
  DSACP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  if (prop.major != 9 || prop.minor != 0) {
    return unsupported("CUDA backend: built for sm_90a (H100/H200); device " + std::to_string(device) + " (" +
                       prop.name + ") is sm_" + std::to_string(prop.major) + std::to_string(prop.minor));
  }
  // Keep freed memory in the device's pool (the default threshold 0 returns it at every synchronization).
  cudaMemPool_t pool = nullptr;
  DSACP_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t keep = UINT64_MAX;
  DSACP_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  auto box = std::make_shared<StreamBox>();
  box->device = device;
  if (options.stream != nullptr) {
    const auto caller = static_cast<cudaStream_t>(options.stream);
    int stream_device = -1;
    const cudaError_t se = cudaStreamGetDevice(caller, &stream_device);
    if (se != cudaSuccess) {
      (void)cudaGetLastError();
      return invalid_argument(std::string("CUDA backend: CudaBackendOptions::stream is not a usable stream (") +
                              cudaGetErrorName(se) + ")");
    }
    if (stream_device != device) {
      return invalid_argument("CUDA backend: CudaBackendOptions::stream belongs to device " +
                              std::to_string(stream_device) + ", expected the backend's device " +
                              std::to_string(device));
    }
    box->stream = caller;
    box->owns_stream = false;
  } else {
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&box->stream, cudaStreamNonBlocking));
  }
  int32_t* err_dev = nullptr;
  int32_t* err_host = nullptr;
  const size_t err_bytes = 2 * sizeof(int32_t) * kErrorSlots;
  cudaError_t e = cudaMalloc(&err_dev, err_bytes);
  const char* failed = "cudaMalloc(error words)";
  if (e == cudaSuccess) {
    e = cudaMallocHost(&err_host, err_bytes);
    failed = "cudaMallocHost(error words)";
  }
  if (e == cudaSuccess) {
    e = cudaMemset(err_dev, 0, err_bytes);
    failed = "cudaMemset(error words)";
  }
  if (e != cudaSuccess) {
    if (err_dev != nullptr) (void)cudaFree(err_dev);
    if (err_host != nullptr) (void)cudaFreeHost(err_host);
    return cuda::cuda_status(e, failed, __FILE__, __LINE__);
  }
  return std::unique_ptr<Backend>(new CudaBackend(device, prop.multiProcessorCount, options, std::move(box), err_dev, err_host));
}

}  // namespace dsacp
