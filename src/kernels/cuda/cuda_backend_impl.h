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
// The backend's class and its pieces (internal to src/kernels/cuda): cuda_backend.cu holds construction, lanes,
// memory, copies, synchronization and capture; cuda_backend_kernels.cu the kernel calls, one per family;
// cuda_backend_errors.cu the device error words (checked and deferred).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dsacp/backend.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/timeline.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {


// A grow-only device scratch buffer.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  cudaStream_t stream = nullptr;
  Status reserve(size_t want) {
    if (want <= bytes) return Status::ok_status();
    if (ptr != nullptr) {
      DSACP_CUDA_RETURN_IF_ERROR(cudaFreeAsync(ptr, stream));
      ptr = nullptr;
      bytes = 0;
    }
    cudaError_t err = cudaMallocAsync(&ptr, want, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) {
      ptr = nullptr;
      (void)cudaGetLastError();
      return resource_exhausted("CUDA backend: cannot allocate " + std::to_string(want) +
                                " bytes of scratch: " + cudaGetErrorName(err));
    }
    bytes = want;
    return Status::ok_status();
  }
  void release() {
    if (ptr != nullptr) (void)cudaFreeAsync(ptr, stream);
    ptr = nullptr;
    bytes = 0;
  }
};

// CudaBackendOptions::call_trace: every backend call's count and host wall time, printed to stderr when the backend
// goes (a diagnostic of per-call overheads; calls made inside other calls are counted in both).
struct CallTrace {
  bool on = false;
  std::mutex mu;
  std::map<std::string, std::pair<int64_t, double>> calls;
  void add(const char* name, double ms) {
    std::lock_guard<std::mutex> lock(mu);
    auto& c = calls[name];
    ++c.first;
    c.second += ms;
  }
  void print(int device) {
    if (!on) return;
    std::fprintf(stderr, "dsacp CUDA backend %d calls:\n", device);
    for (const auto& [name, c] : calls) {
      std::fprintf(stderr, "  %-28s %8lld calls %10.3f ms %8.1f us/call\n", name.c_str(), static_cast<long long>(c.first),
                   c.second, 1000.0 * c.second / static_cast<double>(std::max<int64_t>(c.first, 1)));
    }
  }
};

class TraceScope {
 public:
  TraceScope(CallTrace& t, const char* name) : t_(t), name_(name) {
    if (t_.on) start_ = std::chrono::steady_clock::now();
  }
  ~TraceScope() {
    if (t_.on) t_.add(name_, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count());
  }

 private:
  CallTrace& t_;
  const char* name_;
  std::chrono::steady_clock::time_point start_;
};

// The backend's stream and its cache of freed device blocks, shared with the deleters of the buffers it hands
// out: a buffer that outlives the backend still goes back in stream order.
//
// The block cache: cudaMallocAsync costs 1-30 us of host time per call, and a step makes ~20 allocations. A
// freed buffer's block goes back to a free list of its size class instead (no CUDA call), and the next
// allocation of that class takes it. That is safe in stream order: the block's earlier users were enqueued on
// the backend stream before it was freed, its next users after; work on other streams (collectives) is waited
// for by the host before its buffers are freed. Size classes: 4 per power of two (at most 25% over), 512 bytes
// at least. Cached blocks go back to the pool when an allocation fails (then it is retried) and when the
// backend's last buffer and the backend are gone.
struct StreamBox {
  int device = 0;
  cudaStream_t stream = nullptr;
  bool owns_stream = true;  // false for the caller's stream (CudaBackendOptions::stream): never destroyed here
  std::mutex mu;
  std::map<size_t, std::vector<void*>> free_blocks;  // size class -> blocks
  // While a lane session is open (Backend::begin_lanes), a freed block may still be in use by the other lane's
  // work: it is held here and goes to the free lists when the last session ends (the main stream is then
  // ordered after both lanes).
  int lane_sessions = 0;
  std::vector<std::pair<void*, size_t>> held;

  static size_t size_class(size_t bytes) {
    size_t top = 512;
    while (top < bytes) top <<= 1;  // the smallest power of two >= bytes
    const size_t step = std::max<size_t>(512, top / 8);  // top/2 < bytes <= top: 4 classes in between
    return (std::max<size_t>(bytes, 1) + step - 1) / step * step;
  }
  void* take(size_t cls) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = free_blocks.find(cls);
    if (it == free_blocks.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  void give_back(void* p, size_t cls) {
    std::lock_guard<std::mutex> lock(mu);
    if (lane_sessions > 0) {
      held.emplace_back(p, cls);
      return;
    }
    free_blocks[cls].push_back(p);
  }
  void begin_hold() {
    std::lock_guard<std::mutex> lock(mu);
    ++lane_sessions;
  }
  void end_hold() {
    std::lock_guard<std::mutex> lock(mu);
    if (lane_sessions > 0 && --lane_sessions > 0) return;
    for (const auto& [p, cls] : held) free_blocks[cls].push_back(p);
    held.clear();
  }
  // Returns every cached block to the device's pool (in stream order).
  void release_cached() {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [cls, blocks] : free_blocks) {
      for (void* p : blocks) (void)cudaFreeAsync(p, stream);
    }
    free_blocks.clear();
  }
  ~StreamBox() {
    for (const auto& [p, cls] : held) free_blocks[cls].push_back(p);
    held.clear();
    (void)cudaSetDevice(device);
    release_cached();
    (void)cudaStreamSynchronize(stream);
    if (owns_stream) (void)cudaStreamDestroy(stream);
  }
};

// The words kernels record data errors in: slot 0 for checked calls, one slot per launch while errors are
// deferred (so the first error can be traced to its launch with one read-back).
inline constexpr int kErrorSlots = 512;

Status device_error_status(const std::string& k, int32_t code, int32_t row);

// The indexer's schedule for a batch's rows, made once (Backend::plan_indexer_topk): the host plan, and either the
// inline form or the expanded items and score offsets in device memory the plan owns.
struct CudaIndexerPlan final : KernelPlan {
  cuda::IndexerPlan plan;
  cuda::IndexerPlanDevice dev;  // dev.scores unset: the caller's workspace
  DeviceBuffer upload, items;
  int64_t num_tokens = 0;
};

// A captured stream (Backend::end_capture): the executable graph and the kernels of its error slots 1..n.
struct GraphBox {
  int device = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<const char*> kernels;
  ~GraphBox() {
    (void)cudaSetDevice(device);
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  }
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, int num_sms, const CudaBackendOptions& options, std::shared_ptr<StreamBox> box,
              int32_t* err_dev, int32_t* err_host)
      : device_(device), num_sms_(num_sms), options_(options), box_(std::move(box)), stream_(box_->stream),
        err_dev_(err_dev), err_host_(err_host) {
    lanes_[0].set_stream(stream_);
    trace_.on = options.call_trace;
    if (options.timeline) cuda::timeline::enable();
    if (cudaMallocHost(&stage_, kStageBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      stage_ = nullptr;  // small copies then use the pageable path
    }
    if (cudaMallocHost(&ring_, kRingBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      ring_ = nullptr;  // deferred uploads then use the pageable path
    }
  }
  ~CudaBackend() override {
    trace_.print(device_);
    cuda::timeline::print_last(device_);
    (void)cudaSetDevice(device_);
    (void)sync_lanes();
    for (Lane& l : lanes_) l.release();
    (void)sync_lanes();
    if (lanes_[1].stream != nullptr) (void)cudaStreamDestroy(lanes_[1].stream);
    if (lane_event_ != nullptr) (void)cudaEventDestroy(lane_event_);
    if (fork_event_ != nullptr) (void)cudaEventDestroy(fork_event_);
    (void)cudaFree(err_dev_);
    (void)cudaFreeHost(err_host_);
    if (stage_ != nullptr) (void)cudaFreeHost(stage_);
    if (ring_ != nullptr) (void)cudaFreeHost(ring_);
  }

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  int cuda_device() const override { return device_; }
  int64_t device_memory_free() const override {
    int previous = -1;
    if (cudaGetDevice(&previous) != cudaSuccess) return -1;
    size_t free_bytes = 0, total_bytes = 0;
    const bool ok = cudaSetDevice(device_) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    (void)cudaSetDevice(previous);
    return ok ? static_cast<int64_t>(free_bytes) : -1;
  }
  void* native_stream() const override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return lane().stream;
  }

  int num_lanes() const override { return 2; }

  Status begin_lanes() override;

  void set_lane(int l) override;

  Status end_lanes() override;

  // From the device's default memory pool, in the order of the backend's stream. Checked calls synchronize
  // the stream so the memory is ready for any stream when allocate returns; while errors are deferred, other
  // streams order themselves after this one (collectives wait on an event recorded on it). Freed in the
  // backend stream's order: work enqueued on it before the free has finished by then, and collectives on
  // other streams are waited for before their buffers go.
  Result<DeviceBuffer> allocate(size_t bytes) override;

  // Checked: returns when the copy is done. Deferred: the bytes are staged in a pinned ring (or, past its size,
  // by the driver) before the call returns, and the copy runs in stream order.
  Status copy_to_device(void* dst, const void* src, size_t bytes) override;

  // Always waits (the host needs the bytes); deferred errors stay pending until synchronize().
  Status copy_to_host(void* dst, const void* src, size_t bytes) override;

  Status copy_on_device(void* dst, const void* src, size_t bytes) override;

  Status fill(void* dst, DType dtype, int64_t count, float value) override {
    return run_kernel("fill", [&](const LaunchContext& c) { return cuda::launch_fill(dst, dtype, count, value, c); });
  }

  Status synchronize() override;

  Status begin_synchronize() override;

  void defer_errors(bool on) override;

  void defer_errors_keep_pending() override;

  Result<std::shared_ptr<const KernelPlan>> plan_indexer_topk(const IndexerTopkParams& p) override;

  size_t sparse_mla_workspace_bytes(const SparseMlaParams& p) const override;

  // Stream capture of the main stream (thread-local mode: other threads' CUDA calls are not affected). Errors
  // of launches enqueued before it are collected first (kept for the next synchronize()).
  Status begin_capture() override;

  Result<CapturedWork> end_capture() override;

  // Launches the graph on the main stream; its launches' error slots are read back by the next synchronize().
  Status replay(const CapturedWork& work) override;

  Status cache_write(const CacheWriteParams& p) override;

  Status indexer_topk(const IndexerTopkParams& p) override;

  Status sparse_mla(const SparseMlaParams& p) override;

  // The caller's workspace (a planned run: SparseMlaParams::workspace, sized by sparse_mla_workspace_bytes), else
  // the lane's scratch.
  Status launch_mla(const SparseMlaParams& p, const LaunchContext& c);

  Status check_sparse_mla(const SparseMlaParams& p) const override;

  Status gather_rows(const GatherRowsParams& p) override;

  Status topk_remap(const TopkRemapParams& p) override;

  // Exact merge of the sharded indexer's candidate rows: on the device (a bitonic sort per row) when the
  // candidates fit in shared memory, else the CPU oracle's merge on host copies.
  Status topk_merge(const TopkMergeParams& p) override;

  Status topk_input(const TopkInputParams& p) override;

  Status output_form(const OutputFormParams& p) override;

  Status lse_merge(const LseMergeParams& p) override;

 private:
  // One kernel call: lock, device, launch with an error word, then finish (checked or deferred).
  template <typename Launch>
  Status run_kernel(const char* kernel, Launch launch) {
    TraceScope trace(trace_, kernel);
    std::lock_guard<std::recursive_mutex> lock(mu_);
    DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    cudaStream_t stream = lane().stream;
    const cuda::timeline::Span span = cuda::timeline::open(device_, stream);
    DSACP_RETURN_IF_ERROR(launch(ctx(kernel)));
    cuda::timeline::close(device_, span, stream, kernel, "kernel");
    return finish(kernel);
  }

  // The launch context of the next launch. `kernel` (null: the launch reports no data errors) gets its own
  // error slot while errors are deferred, slot 0 otherwise.
  LaunchContext ctx(const char* kernel);

  Status refuse_in_capture(const char* what);

  Status finish(const char* kernel);

  // The copy of the pending launches' error slots (slots 1..) to the host words, behind the main stream's work.
  cudaError_t enqueue_error_readback();

  // Waits for the stream, then turns the first error recorded by a deferred launch into a Status and clears
  // the slots (one read-back for the whole scope).
  Status collect_deferred();

  // Waits for the stream and turns a recorded device error (slot 0) into a Status (then clears it).
  Status check_device_error(const char* kernel);

  // A lane: its stream and the scratch its kernels use (each lane its own, so the lanes' work can overlap).
  struct Lane {
    cudaStream_t stream = nullptr;
    Scratch plan_items, plan_upload, scores, mla_ws;
    Scratch fp8_kv;  // a prefill's dequantized fp8_ds_mla pages (sparse_mla_fp8_via_bf16)
    std::vector<char> plan_host;  // the indexer plan's upload, staged
    void set_stream(cudaStream_t s) {
      stream = s;
      for (Scratch* x : {&plan_items, &plan_upload, &scores, &mla_ws, &fp8_kv}) x->stream = s;
    }
    void release() {
      for (Scratch* x : {&plan_items, &plan_upload, &scores, &mla_ws, &fp8_kv}) x->release();
    }
  };

  // The calling thread's lane (main outside a lane session). Callers hold mu_.
  Lane& lane() const {
    auto it = thread_lane_.find(std::this_thread::get_id());
    return lanes_[it == thread_lane_.end() ? 0 : it->second];
  }

  // Work enqueued on `waiter` from now on runs after the work enqueued on `producer` so far.
  Status order_after(cudaStream_t waiter, cudaStream_t producer) {
    DSACP_CUDA_RETURN_IF_ERROR(cudaEventRecord(lane_event_, producer));
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(waiter, lane_event_, 0));
    return Status::ok_status();
  }

  Status sync_lanes() {
    for (const Lane& l : lanes_) {
      if (l.stream != nullptr) DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(l.stream));
    }
    return Status::ok_status();
  }

  // One main stream (and a side lane), one set of error words and shared scratch: calls from several threads
  // (CP ranks as threads sharing the device) are serialized.
  mutable std::recursive_mutex mu_;
  int device_;
  int num_sms_;
  CudaBackendOptions options_;
  std::shared_ptr<StreamBox> box_;
  cudaStream_t stream_;
  int32_t* err_dev_;   // [kErrorSlots][2] device
  int32_t* err_host_;  // [kErrorSlots][2] pinned
  mutable Lane lanes_[2];                       // 0: main (stream_), 1: side (made by the first begin_lanes)
  cudaEvent_t lane_event_ = nullptr;            // orders one lane after the other (recorded, then waited at once)
  std::map<std::thread::id, int> thread_lane_;  // threads in a lane session -> their current lane
  static constexpr size_t kStageBytes = size_t{1} << 20;
  void* stage_ = nullptr;  // pinned host memory for small checked copies (kStageBytes), guarded by mu_
  static constexpr size_t kRingBytes = size_t{8} << 20;
  void* ring_ = nullptr;   // pinned upload ring of deferred copies, reset when the stream is synchronized
  size_t ring_used_ = 0;
  size_t staged_ = 0;  // error slots whose read-back begin_synchronize enqueued (0: none)
  int deferred_ = 0;                  // DeferredErrors scopes open
  std::vector<const char*> pending_;  // kernels (names are literals) launched with an error slot since the last check
  cudaEvent_t fork_event_ = nullptr;  // begin_lanes' fork point on the main stream
  bool fork_pending_ = false;         // the side stream has not waited for fork_event_ yet
  Status held_error_;                 // an error collected early (slots ran out), returned by synchronize()
  bool capturing_ = false;            // begin_capture .. end_capture on the main stream
  Status capture_error_;              // the first call refused while capturing (end_capture returns it)
  CallTrace trace_;
};

}  // namespace dsacp::cuda
