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

namespace dsacp {
namespace {

using cuda::LaunchContext;

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

Status device_error_status(const std::string& k, int32_t code, int32_t row) {
  const std::string r = std::to_string(row);
  switch (code) {
    case cuda::kDevBadRequest:
      return out_of_range(k + ": token " + r + ": rows.request outside the block table's rows");
    case cuda::kDevBadKeyLen:
      return out_of_range(k + ": token " + r + ": rows.key_len must be >= 0");
    case cuda::kDevBadPage:
      return out_of_range(k + ": token " + r +
                          ": a key it uses maps to a block_table entry outside [0, num_pages) or past max_pages");
    case cuda::kDevBadIndex:
      return out_of_range(k + ": index[" + r + "] outside [-1, src_rows)");
    case cuda::kDevBadEntry:
      return out_of_range(k + ": row " + r + ": an entry < -1 (entries are positions >= 0 or -1)");
    case cuda::kDevBadSlot:
      return out_of_range(k + ": row " + r + ": slot outside [0, num_pages*page_size) (and not -1)");
    case cuda::kDevBadTopkRow:
      return invalid_argument(k + ": row " + r + " is not a top-k row of canonical form (distinct positions below "
                                  "the row's key length, ascending, then -1 to the end)");
    case cuda::kDevSmemAlign:
      return internal_error(k + ": dynamic shared memory not 1024-byte aligned on this device/driver; "
                                "CudaBackendOptions::MlaKernel::kMmaSync selects a kernel that does not need it");
    default:
      return internal_error(k + ": unknown device error code " + std::to_string(code));
  }
}

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

  Status begin_lanes() override {
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

  void set_lane(int l) override {
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

  Status end_lanes() override {
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

  // From the device's default memory pool, in the order of the backend's stream. Checked calls synchronize
  // the stream so the memory is ready for any stream when allocate returns; while errors are deferred, other
  // streams order themselves after this one (collectives wait on an event recorded on it). Freed in the
  // backend stream's order: work enqueued on it before the free has finished by then, and collectives on
  // other streams are waited for before their buffers go.
  Result<DeviceBuffer> allocate(size_t bytes) override {
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

  // Checked: returns when the copy is done. Deferred: the bytes are staged in a pinned ring (or, past its size,
  // by the driver) before the call returns, and the copy runs in stream order.
  Status copy_to_device(void* dst, const void* src, size_t bytes) override {
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

  // Always waits (the host needs the bytes); deferred errors stay pending until synchronize().
  Status copy_to_host(void* dst, const void* src, size_t bytes) override {
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

  Status copy_on_device(void* dst, const void* src, size_t bytes) override {
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

  Status fill(void* dst, DType dtype, int64_t count, float value) override {
    return run_kernel("fill", [&](const LaunchContext& c) { return cuda::launch_fill(dst, dtype, count, value, c); });
  }

  Status synchronize() override {
    TraceScope trace(trace_, "synchronize");
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (capturing_) return refuse_in_capture("synchronize");
    DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const double t0 = cuda::timeline::host_now_us(device_);
    Status s = collect_deferred();
    cuda::timeline::host_span(device_, t0, "synchronize", "wait");
    return s;
  }

  Status begin_synchronize() override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    // Not inside a lane session: the side lane's kernels may still run after the main stream's copy.
    if (deferred_ == 0 || !thread_lane_.empty() || capturing_) return Status::ok_status();
    DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    DSACP_CUDA_RETURN_IF_ERROR(enqueue_error_readback());
    staged_ = pending_.size();
    return Status::ok_status();
  }

  void defer_errors(bool on) override {
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

  void defer_errors_keep_pending() override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (deferred_ > 0 && --deferred_ == 0) cuda::timeline::end_step(device_);
  }

  Result<std::shared_ptr<const KernelPlan>> plan_indexer_topk(const IndexerTopkParams& p) override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (capturing_) return refuse_in_capture("plan_indexer_topk");
    DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (p.host_request == nullptr || p.host_key_len == nullptr) {
      return invalid_argument("plan_indexer_topk: host_request and host_key_len are required (the plan is made on the host)");
    }
    auto kp = std::make_shared<CudaIndexerPlan>();
    kp->num_tokens = p.rows.num_tokens;
    DSACP_ASSIGN_OR_RETURN(kp->plan, cuda::indexer_plan(p, p.host_request, p.host_key_len));
    const cuda::IndexerPlan& plan = kp->plan;
    kp->workspace_bytes = std::max<size_t>(1, static_cast<size_t>(plan.max_score_floats)) * sizeof(float);
    if (cuda::inline_plan_fits(plan, p.rows.num_tokens) && options_.indexer_inline_plan) {
      kp->dev.inl = cuda::make_inline_plan(plan);
      return std::shared_ptr<const KernelPlan>(std::move(kp));
    }
    // [groups | offsets] uploaded into the plan's own buffer, the items expanded into its own (once).
    const size_t groups_bytes = plan.groups.size() * sizeof(cuda::ScoreGroup);
    const size_t offsets_at = (groups_bytes + 255) / 256 * 256;
    const size_t plan_bytes = offsets_at + plan.score_offset.size() * sizeof(int64_t);
    std::vector<char> host(std::max<size_t>(plan_bytes, 1));
    if (groups_bytes > 0) std::memcpy(host.data(), plan.groups.data(), groups_bytes);
    if (plan_bytes > offsets_at) std::memcpy(host.data() + offsets_at, plan.score_offset.data(), plan_bytes - offsets_at);
    DSACP_ASSIGN_OR_RETURN(kp->upload, allocate(host.size()));
    DSACP_ASSIGN_OR_RETURN(kp->items, allocate(std::max<int64_t>(1, plan.num_items) * sizeof(cuda::ScoreItem)));
    DSACP_RETURN_IF_ERROR(copy_to_device(kp->upload.get(), host.data(), plan_bytes));
    DSACP_RETURN_IF_ERROR(cuda::launch_expand_score_items(static_cast<const cuda::ScoreGroup*>(kp->upload.get()),
                                                          static_cast<int64_t>(plan.groups.size()),
                                                          kp->items.as<cuda::ScoreItem>(), plan.num_items, ctx(nullptr)));
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lane().stream));  // (host is freed on return)
    kp->dev.items = kp->items.as<const cuda::ScoreItem>();
    kp->dev.score_offset = reinterpret_cast<const int64_t*>(kp->upload.as<const char>() + offsets_at);
    return std::shared_ptr<const KernelPlan>(std::move(kp));
  }

  size_t sparse_mla_workspace_bytes(const SparseMlaParams& p) const override {
    LaunchContext c;
    c.num_sms = num_sms_;
    c.options = options_;
    const int splits = cuda::sparse_mla_num_splits(p, c);
    return static_cast<size_t>(std::max<int64_t>(0, cuda::sparse_mla_workspace_floats(p, splits, options_))) * sizeof(float);
  }

  // Stream capture of the main stream (thread-local mode: other threads' CUDA calls are not affected). Errors
  // of launches enqueued before it are collected first (kept for the next synchronize()).
  Status begin_capture() override {
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

  Result<CapturedWork> end_capture() override {
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

  // Launches the graph on the main stream; its launches' error slots are read back by the next synchronize().
  Status replay(const CapturedWork& work) override {
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

  Status cache_write(const CacheWriteParams& p) override {
    if (p.upload.bytes > 0 && !cuda::cache_write_carries_upload(p)) {
      DSACP_RETURN_IF_ERROR(copy_to_device(p.upload.device, p.upload.host, p.upload.bytes));
      CacheWriteParams rest = p;
      rest.upload = {};
      return cache_write(rest);
    }
    return run_kernel("cache_write", [&](const LaunchContext& c) { return cuda::launch_cache_write(p, c); });
  }

  Status indexer_topk(const IndexerTopkParams& p) override {
    TraceScope trace(trace_, "indexer_topk");
    std::lock_guard<std::recursive_mutex> lock(mu_);
    DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    DSACP_RETURN_IF_ERROR(cuda::indexer_topk_supported(p));
    DSACP_RETURN_IF_ERROR(cuda::indexer_topk_merge_supported(p));
    const int64_t T = p.rows.num_tokens;
    if (p.plan != nullptr) {
      // Planned once for these rows (plan_indexer_topk): launches only.
      const auto* kp = dynamic_cast<const CudaIndexerPlan*>(p.plan);
      if (kp == nullptr || kp->num_tokens != T) {
        return invalid_argument("indexer_topk: IndexerTopkParams::plan is not this backend's plan of these " +
                                std::to_string(T) + " rows");
      }
      if (p.workspace == nullptr) return invalid_argument("indexer_topk: a planned call needs IndexerTopkParams::workspace");
      cuda::IndexerPlanDevice dev = kp->dev;
      dev.scores = static_cast<float*>(p.workspace);
      DSACP_RETURN_IF_ERROR(cuda::launch_indexer_topk(p, kp->plan, dev, ctx("indexer_topk")));
      return finish("indexer_topk");
    }
    std::vector<int32_t> request, key_len;
    const int32_t* h_request = p.host_request;
    const int32_t* h_key_len = p.host_key_len;
    cuda::IndexerPlan plan;
    Lane& ln = lane();
    cuda::IndexerPlanDevice dev;
    {
      TraceScope plan_trace(trace_, "indexer_topk: plan + upload");
      if (h_request == nullptr || h_key_len == nullptr) {
        // No host copies given: read the rows back (waits for the work queued before this call).
        TraceScope t1(trace_, "indexer_topk: rows to host");
        request.resize(static_cast<size_t>(T));
        key_len.resize(static_cast<size_t>(T));
        DSACP_RETURN_IF_ERROR(copy_to_host(request.data(), p.rows.request, T * sizeof(int32_t)));
        DSACP_RETURN_IF_ERROR(copy_to_host(key_len.data(), p.rows.key_len, T * sizeof(int32_t)));
        h_request = request.data();
        h_key_len = key_len.data();
      }
      {
        TraceScope t2(trace_, "indexer_topk: host plan");
        DSACP_ASSIGN_OR_RETURN(plan, cuda::indexer_plan(p, h_request, h_key_len));
      }
      DSACP_RETURN_IF_ERROR(ln.scores.reserve(std::max<size_t>(1, plan.max_score_floats) * sizeof(float)));
      // A small plan (a decode batch) goes in the kernels' parameters: no upload, no expansion launch
      // (CudaBackendOptions::indexer_inline_plan off: always the device plan, an A/B switch).
      if (cuda::inline_plan_fits(plan, T) && options_.indexer_inline_plan) {
        dev.inl = cuda::make_inline_plan(plan);
      } else {
        TraceScope t3(trace_, "indexer_topk: plan upload");
        DSACP_RETURN_IF_ERROR(ln.plan_items.reserve(std::max<int64_t>(1, plan.num_items) * sizeof(cuda::ScoreItem)));
        // The groups and the score offsets go up in one copy (one pinned-ring slot, one DMA): [groups | offsets].
        const size_t groups_bytes = plan.groups.size() * sizeof(cuda::ScoreGroup);
        const size_t offsets_at = (groups_bytes + 255) / 256 * 256;
        const size_t plan_bytes = offsets_at + plan.score_offset.size() * sizeof(int64_t);
        DSACP_RETURN_IF_ERROR(ln.plan_upload.reserve(std::max<size_t>(1, plan_bytes)));
        ln.plan_host.resize(plan_bytes);
        if (groups_bytes > 0) std::memcpy(ln.plan_host.data(), plan.groups.data(), groups_bytes);
        if (plan_bytes > offsets_at) {
          std::memcpy(ln.plan_host.data() + offsets_at, plan.score_offset.data(), plan_bytes - offsets_at);
        }
        DSACP_RETURN_IF_ERROR(copy_to_device(ln.plan_upload.ptr, ln.plan_host.data(), plan_bytes));
        const auto* d_groups = static_cast<const cuda::ScoreGroup*>(ln.plan_upload.ptr);
        dev.score_offset = reinterpret_cast<const int64_t*>(static_cast<const char*>(ln.plan_upload.ptr) + offsets_at);
        DSACP_RETURN_IF_ERROR(cuda::launch_expand_score_items(d_groups,
                                                              static_cast<int64_t>(plan.groups.size()),
                                                              static_cast<cuda::ScoreItem*>(ln.plan_items.ptr),
                                                              plan.num_items, ctx(nullptr)));
        dev.items = static_cast<const cuda::ScoreItem*>(ln.plan_items.ptr);
      }
    }
    dev.scores = static_cast<float*>(ln.scores.ptr);
    const cuda::timeline::Span span = cuda::timeline::open(device_, ln.stream);
    DSACP_RETURN_IF_ERROR(cuda::launch_indexer_topk(p, plan, dev, ctx("indexer_topk")));
    cuda::timeline::close(device_, span, ln.stream, "indexer_topk", "kernel");
    return finish("indexer_topk");
  }

  Status sparse_mla(const SparseMlaParams& p) override {
    return run_kernel("sparse_mla", [&](const LaunchContext& c) -> Status {
      DSACP_RETURN_IF_ERROR(cuda::sparse_mla_supported(p, options_));
      if (cuda::sparse_mla_fp8_via_bf16(p)) {  // a prefill over fp8_ds_mla: dequantized pages, bf16 kernels
        Scratch& kv = lane().fp8_kv;
        DSACP_RETURN_IF_ERROR(kv.reserve(static_cast<size_t>(cuda::sparse_mla_fp8_scratch_bytes(p))));
        DSACP_RETURN_IF_ERROR(cuda::launch_fp8_records_to_bf16(p, kv.ptr, c));
        return launch_mla(cuda::sparse_mla_fp8_bf16_view(p, kv.ptr), c);
      }
      return launch_mla(p, c);
    });
  }

  // The caller's workspace (a planned run: SparseMlaParams::workspace, sized by sparse_mla_workspace_bytes), else
  // the lane's scratch.
  Status launch_mla(const SparseMlaParams& p, const LaunchContext& c) {
    const int splits = cuda::sparse_mla_num_splits(p, c);
    if (p.workspace != nullptr) return cuda::launch_sparse_mla(p, splits, static_cast<float*>(p.workspace), c);
    const int64_t ws = cuda::sparse_mla_workspace_floats(p, splits, options_);
    Scratch& mla_ws = lane().mla_ws;
    if (ws > 0) DSACP_RETURN_IF_ERROR(mla_ws.reserve(static_cast<size_t>(ws) * sizeof(float)));
    return cuda::launch_sparse_mla(p, splits, static_cast<float*>(mla_ws.ptr), c);
  }

  Status check_sparse_mla(const SparseMlaParams& p) const override {
    SparseMlaParams plain = p;
    plain.peer = {};
    DSACP_RETURN_IF_ERROR(Backend::check_sparse_mla(plain));
    return cuda::sparse_mla_supported(p, options_);
  }

  Status gather_rows(const GatherRowsParams& p) override {
    return run_kernel("gather_rows", [&](const LaunchContext& c) { return cuda::launch_gather_rows(p, c); });
  }

  Status topk_remap(const TopkRemapParams& p) override {
    return run_kernel("topk_remap", [&](const LaunchContext& c) { return cuda::launch_topk_remap(p, c); });
  }

  // Exact merge of the sharded indexer's candidate rows: on the device (a bitonic sort per row) when the
  // candidates fit in shared memory, else the CPU oracle's merge on host copies.
  Status topk_merge(const TopkMergeParams& p) override {
    if (cuda::topk_merge_on_device(p)) {
      return run_kernel("topk_merge", [&](const LaunchContext& c) { return cuda::launch_topk_merge(p, c); });
    }
    if (p.wait.active()) {
      return unsupported("topk_merge: a window exchange's parts (WindowRowSync) of a shape the device merge does not "
                         "take (" + std::to_string(p.num_parts) + " parts of K = " + std::to_string(p.K) + ")");
    }
    TraceScope trace(trace_, "topk_merge (host)");
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const size_t parts = static_cast<size_t>(p.num_parts) * p.num_rows * p.K;
    std::vector<int32_t> part_topk(parts), topk(static_cast<size_t>(p.num_rows) * p.K);
    std::vector<float> part_scores(parts);
    const size_t part_rows = static_cast<size_t>(p.num_rows) * p.K;  // one part's entries
    for (int32_t s = 0; s < p.num_parts; ++s) {
      DSACP_RETURN_IF_ERROR(copy_to_host(part_topk.data() + s * part_rows, topk_merge_part_topk(p, s),
                                         part_rows * sizeof(int32_t)));
      DSACP_RETURN_IF_ERROR(copy_to_host(part_scores.data() + s * part_rows, topk_merge_part_scores(p, s),
                                         part_rows * sizeof(float)));
    }
    std::vector<int32_t> local(p.local_topk != nullptr ? topk.size() : 0);
    TopkMergeParams h = p;
    h.part_topk = part_topk.data();
    h.part_scores = part_scores.data();
    h.topk = topk.data();
    h.local_topk = p.local_topk != nullptr ? local.data() : nullptr;
    DSACP_RETURN_IF_ERROR(cpu::topk_merge(h, 0));
    if (p.local_topk != nullptr) {
      DSACP_RETURN_IF_ERROR(copy_to_device(p.local_topk, local.data(), local.size() * sizeof(int32_t)));
    }
    return copy_to_device(p.topk, topk.data(), topk.size() * sizeof(int32_t));
  }

  Status topk_input(const TopkInputParams& p) override {
    return run_kernel("precomputed top-k", [&](const LaunchContext& c) { return cuda::launch_topk_input(p, c); });
  }

  Status output_form(const OutputFormParams& p) override {
    return run_kernel("output form", [&](const LaunchContext& c) { return cuda::launch_output_form(p, c); });
  }

  Status lse_merge(const LseMergeParams& p) override {
    return run_kernel("lse_merge", [&](const LaunchContext& c) { return cuda::launch_lse_merge(p, p.out, p.out_dtype, c); });
  }

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
  LaunchContext ctx(const char* kernel) {
    LaunchContext c;
    c.stream = lane().stream;
    c.num_sms = num_sms_;
    c.options = options_;
    c.error.word = err_dev_;
    if (deferred_ > 0 && kernel != nullptr) {
      if (capturing_ && pending_.size() + 1 >= static_cast<size_t>(kErrorSlots)) {
        // A graph's launches keep their own slots: no collection (a wait) inside a capture.
        if (capture_error_.ok()) {
          (void)(capture_error_ = resource_exhausted("CUDA backend: a capture holds at most " +
                                                     std::to_string(kErrorSlots - 1) + " launches with error words"));
        }
        return c;
      }
      if (pending_.size() + 1 >= static_cast<size_t>(kErrorSlots)) {
        // Every slot used in this scope: collect now and keep the first error for the next synchronize().
        Status s = collect_deferred();  // returns (and clears) any held error too
        (void)(held_error_ = std::move(s));
      }
      pending_.push_back(kernel);
      c.error.word = err_dev_ + 2 * pending_.size();  // slots 1.. (slot 0 is the checked calls')
    }
    return c;
  }

  Status refuse_in_capture(const char* what) {
    const Status s = invalid_argument(std::string("CUDA backend: ") + what +
                                      " while capturing (a capture records kernel launches only)");
    if (capture_error_.ok()) (void)(capture_error_ = s);
    return s;
  }

  Status finish(const char* kernel) {
    if (deferred_ > 0) return Status::ok_status();
    return check_device_error(kernel);
  }

  // The copy of the pending launches' error slots (slots 1..) to the host words, behind the main stream's work.
  cudaError_t enqueue_error_readback() {
    const size_t n = pending_.size();
    if (n == 0) return cudaSuccess;
    return cudaMemcpyAsync(err_host_ + 2, err_dev_ + 2, 2 * n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_);
  }

  // Waits for the stream, then turns the first error recorded by a deferred launch into a Status and clears
  // the slots (one read-back for the whole scope).
  Status collect_deferred() {
    if (lanes_[1].stream != nullptr) DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lanes_[1].stream));
    const size_t n = pending_.size();
    // (begin_synchronize enqueued the read-back of slots [0, staged_) already: again only if launches came since)
    if (staged_ != n) DSACP_CUDA_RETURN_IF_ERROR(enqueue_error_readback());
    staged_ = 0;
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    ring_used_ = 0;
    const Status held = std::exchange(held_error_, Status::ok_status());
    size_t first = n;
    for (size_t i = 0; i < n && first == n; ++i) {
      if (err_host_[2 + 2 * i] != cuda::kDevOk) first = i;
    }
    if (first == n) {
      pending_.clear();
      return held;
    }
    const Status found = device_error_status(pending_[first], err_host_[2 + 2 * first], err_host_[3 + 2 * first])
                             .with_context("found at synchronize (launch " + std::to_string(first + 1) + " of " +
                                           std::to_string(n) + " since the last check)");
    DSACP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(err_dev_ + 2, 0, 2 * n * sizeof(int32_t), stream_));
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    pending_.clear();
    return held.ok() ? found : held;
  }

  // Waits for the stream and turns a recorded device error (slot 0) into a Status (then clears it).
  Status check_device_error(const char* kernel) {
    cudaStream_t stream = lane().stream;
    DSACP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(err_host_, err_dev_, 2 * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                               stream));
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    const int32_t code = err_host_[0], row = err_host_[1];
    if (code == cuda::kDevOk) return Status::ok_status();
    DSACP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(err_dev_, 0, 2 * sizeof(int32_t), stream));
    DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return device_error_status(kernel, code, row);
  }

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

}  // namespace

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
