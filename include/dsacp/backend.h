// The backend interface: memory and the step's kernels. The executor calls kernels only through it.
// Implementations: cpu (the oracle, multithreaded loops) and cuda (sm_90a).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "dsacp/kernel_params.h"
#include "dsacp/status.h"

namespace dsacp {

// Memory owned by a backend; released by the deleter the backend set.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* ptr, size_t bytes, std::function<void(void*)> deleter)
      : ptr_(ptr), bytes_(bytes), deleter_(std::move(deleter)) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      deleter_ = std::move(o.deleter_);
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  void reset() {
    if (ptr_ != nullptr && deleter_) deleter_(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> deleter_;
};

// A backend's schedule of one kernel for a batch's rows, made once per forward pass (the step plan holds it) and
// read by every layer's launch of that kernel (IndexerTopkParams::plan). workspace_bytes: the device scratch its
// launches need (IndexerTopkParams::workspace).
struct KernelPlan {
  virtual ~KernelPlan() = default;
  size_t workspace_bytes = 0;
};

// Work recorded by Backend::begin_capture / end_capture (a CUDA graph), run again by Backend::replay. Opaque.
struct CapturedWork {
  std::shared_ptr<void> impl;
  bool valid() const { return impl != nullptr; }
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // The CUDA device whose memory this backend allocates, or -1 for host memory.
  virtual int cuda_device() const { return -1; }
  // Bytes of device memory free for this backend's allocations now (CUDA: cudaMemGetInfo), or -1 for a host
  // backend (its memory is the host's) or when the device cannot say.
  virtual int64_t device_memory_free() const { return -1; }

  virtual Result<DeviceBuffer> allocate(size_t bytes) = 0;
  virtual Status copy_to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual Status copy_to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual Status copy_on_device(void* dst, const void* src, size_t bytes) = 0;
  // Fills count elements of dtype with value (NaN allowed): used to poison unused cache slots.
  virtual Status fill(void* dst, DType dtype, int64_t count, float value) = 0;
  // Waits for all work enqueued so far. With deferred errors on (below), it also returns the first data error
  // a kernel found since the last synchronize(), naming that kernel.
  virtual Status synchronize() = 0;
  // Optional: enqueues, behind the work so far, what the next synchronize() reads back (a device backend's error
  // words), so that a synchronize() called after the device is done (e.g. after waiting for collectives) does not
  // add a round trip of its own. Errors still come back from synchronize(); work enqueued after this call is still
  // covered (it is read back again). Host backends: nothing to do.
  virtual Status begin_synchronize() { return Status(); }

  // Deferred error checks (device backends). Off (the default), every kernel call waits for its kernel and
  // returns the kernel's data errors (a bad page id, slot or index) itself. On, kernel calls, uploads and
  // device copies only enqueue work on the backend's stream, and errors come back from the next synchronize():
  // a step then runs without a host round trip per call. Calls nest (on while any caller holds it); use the
  // DeferredErrors scope. Backends without device work ignore it.
  virtual void defer_errors(bool on) { (void)on; }
  // Ends a defer_errors(true) like defer_errors(false) but without waiting: the scope's errors stay pending for
  // the next synchronize() (a planned step run's end: it enqueues and returns).
  virtual void defer_errors_keep_pending() { defer_errors(false); }
  // The CUDA stream (cudaStream_t) the calling thread's work runs on (its current lane, below), or null (host
  // backends). Collectives on other streams order themselves after it (NcclOptions::producer_stream,
  // Communicator::set_producer_stream).
  virtual void* native_stream() const { return nullptr; }

  // Lanes: a second in-order queue of work (a higher-priority CUDA stream), so that independent parts of a step
  // overlap on the device. Backends without device work have one lane, and these calls do nothing (the work
  // runs in call order, which is a valid order for any use of the lanes).
  //   begin_lanes(): a lane session starts for the calling thread; the side lane (1) is ordered after the work
  //     enqueued so far.
  //   set_lane(l): the thread's later calls go to lane l (0 = main, 1 = side) until the session ends.
  //   end_lanes(): the main lane is ordered after the work of both, and the thread is back on it.
  // Work on one lane must not use what the other lane writes in the same session. Buffers freed during a session
  // are reused only after every session ends. Use the LaneSession scope.
  virtual int num_lanes() const { return 1; }
  virtual Status begin_lanes() { return Status(); }
  virtual void set_lane(int lane) { (void)lane; }
  virtual Status end_lanes() { return Status(); }

  // Kernels. Call them through the *_run functions below, which validate the parameters first.
  virtual Status cache_write(const CacheWriteParams& p) = 0;
  virtual Status indexer_topk(const IndexerTopkParams& p) = 0;
  virtual Status sparse_mla(const SparseMlaParams& p) = 0;
  virtual Status lse_merge(const LseMergeParams& p) = 0;
  virtual Status gather_rows(const GatherRowsParams& p) = 0;
  virtual Status topk_remap(const TopkRemapParams& p) = 0;
  virtual Status topk_merge(const TopkMergeParams& p) = 0;
  // The serving options' small kernels. The defaults run the host reference on copies (copy_to_host, then
  // copy_to_device): right on any backend, with a host round trip; the CPU and CUDA backends override them.
  virtual Status topk_input(const TopkInputParams& p);
  virtual Status output_form(const OutputFormParams& p);

  // Planning hooks (the step plan calls them once per forward pass, outside the per-layer runs). The indexer's
  // schedule for p's rows (host_request / host_key_len required), or null when the backend plans nothing; the
  // device workspace a sparse_mla call of p's shape needs when given SparseMlaParams::workspace (0: none).
  virtual Result<std::shared_ptr<const KernelPlan>> plan_indexer_topk(const IndexerTopkParams& p);
  virtual size_t sparse_mla_workspace_bytes(const SparseMlaParams& p) const {
    (void)p;
    return 0;
  }

  // Capture (device backends: CUDA graphs on the backend's stream). Between begin_capture() and end_capture() the
  // calling thread's kernel launches are recorded, not run; replay() runs them again, each launch with the error
  // word it was recorded with: a replay's data errors come back from the next synchronize(), naming the kernel and
  // the token. Only launches may be recorded: an allocation, a copy to or from the host, a synchronize() or a
  // checked call while capturing fails (the capture is then dropped by end_capture). Host backends answer
  // unsupported.
  virtual Status begin_capture();
  virtual Result<CapturedWork> end_capture();
  virtual Status replay(const CapturedWork& work);

  // Whether sparse_mla would take these parameters (shapes, dtypes, options such as SparseMlaParams::peer),
  // without running anything: ok, or the Status sparse_mla would return (kUnsupported ...). For a caller that
  // picks between two ways of doing one thing before committing to either (the DCP step, before it asks the
  // communicator for a row-synchronized window). The default accepts anything but SparseMlaParams::peer.
  virtual Status check_sparse_mla(const SparseMlaParams& p) const;
};

// Deferred error checks for a scope (an executor's step). The step calls synchronize() before the scope ends
// to collect the errors; a scope left early (another error) waits for its work and drops errors still pending.
class DeferredErrors {
 public:
  explicit DeferredErrors(Backend& backend) : backend_(backend) { backend_.defer_errors(true); }
  ~DeferredErrors() { backend_.defer_errors(false); }
  DeferredErrors(const DeferredErrors&) = delete;
  DeferredErrors& operator=(const DeferredErrors&) = delete;

 private:
  Backend& backend_;
};

// Deferred error checks for a scope whose errors stay pending past its end (a planned step run's: the caller's
// next synchronize() returns them), whichever way it is left.
class PendingErrors {
 public:
  explicit PendingErrors(Backend& backend) : backend_(backend) { backend_.defer_errors(true); }
  ~PendingErrors() { backend_.defer_errors_keep_pending(); }
  PendingErrors(const PendingErrors&) = delete;
  PendingErrors& operator=(const PendingErrors&) = delete;

 private:
  Backend& backend_;
};

// A lane session for a scope (Backend::begin_lanes). end() ends it and reports errors; a scope left early (another
// error) ends it in the destructor.
class LaneSession {
 public:
  explicit LaneSession(Backend& backend) : backend_(backend) {}
  ~LaneSession() { (void)end(); }
  LaneSession(const LaneSession&) = delete;
  LaneSession& operator=(const LaneSession&) = delete;
  Status begin() {
    DSACP_RETURN_IF_ERROR(backend_.begin_lanes());
    open_ = true;
    return Status();
  }
  void set_lane(int lane) {
    if (open_) backend_.set_lane(lane);
  }
  Status end() {
    if (!open_) return Status();
    open_ = false;
    return backend_.end_lanes();
  }

 private:
  Backend& backend_;
  bool open_ = false;
};

// The CPU backend: plain loops with fp32 accumulation, split over `num_threads` threads
// (0 = hardware concurrency).
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 0);

// Choices of the CUDA backend. Every default is the rule the backend applies (`kAuto`); the other values force one
// path, so tests and benchmarks compare paths on the same inputs. The CLI maps its flags onto these fields.
struct CudaBackendOptions {
  // Sparse MLA's kernel for whole 64-head groups: auto = the warp-specialized wgmma kernels (32-key tiles for
  // decode, 64-key tiles for prefill); kMmaSync = the mma.sync kernel the 32-head groups always run (and 16-head
  // groups where the rule does not pick the streaming kernel). kSmallHeads = the memory-streaming kernel for
  // 16-head groups (head blocks of <= 16 heads, bf16 pools or fp8_ds_mla records); other head groups keep the rule.
  enum class MlaKernel : uint8_t { kAuto, kWgmmaWs, kWgmmaWs32, kMmaSync, kSmallHeads };
  MlaKernel mla_kernel = MlaKernel::kAuto;
  int32_t mla_splits = 0;  // sparse MLA's split-K count (0 = the rule: enough CTAs to fill the GPU)
  // Split-K partials merged inside the kernel by a cluster of a token's splits (auto: for 64-head groups).
  enum class Choice : uint8_t { kAuto, kOn, kOff };
  Choice mla_cluster_merge = Choice::kAuto;
  // fp8_ds_mla records on the 64-head decode kernel: a token's head groups in pairs (a cluster of 2 CTAs over the
  // same keys), each CTA dequantizing half of every tile into both CTAs' shared memory (auto: wherever it applies,
  // an even number of head groups a token and no split-K cluster merge; kOff: each CTA dequantizes every tile).
  Choice mla_fp8_pair_dequant = Choice::kAuto;
  // The FP8 indexer's score kernel: auto = the rule in the CUDA backend (the persistent wgmma kernel where it applies
  // and measured faster, else the mma.sync one); kWgmma = the persistent wgmma kernel wherever it applies (FP8 q and
  // keys, Hi = 32 / 64, page sizes a multiple of 4); kMmaSync = the mma.sync kernel always (bf16 always runs it);
  // kWgmmaV5 / kWgmmaV6 = the wgmma kernel's previous math loops (v5: one accumulator set; v6: two, before v7's
  // swizzled stage and conversions) where it applies, for comparisons.
  enum class IndexerScoreKernel : uint8_t { kAuto, kWgmma, kMmaSync, kWgmmaV5, kWgmmaV6 };
  IndexerScoreKernel indexer_score_kernel = IndexerScoreKernel::kAuto;
  bool indexer_inline_plan = true;  // the indexer's plan in the launch parameters where it fits (else uploaded)
  bool topk_merge_general = false;  // the CP top-k merge's general kernel also for shapes the small one takes
  bool side_lane_high_priority = true;  // the side lane's stream at the device's highest priority
  // Diagnostics printed to stderr when the backend goes: every call's count and host time; the last step's
  // timeline (when each call was issued and when the GPU ran it).
  bool call_trace = false;
  bool timeline = false;
  // The caller's stream (a cudaStream_t on `device`; null = the backend creates its own). Every kernel, copy and
  // allocation of the backend's main lane is issued on it in order with the caller's own work on it, and the
  // backend never destroys it: the caller keeps it alive while the backend and the buffers it handed out live.
  void* stream = nullptr;
};

// The CUDA backend on `device` (kernels built for sm_90a: H100/H200). Without a usable device, or in a build
// without CUDA (DSACP_ENABLE_CUDA=OFF), an "unsupported" status says why.
Result<std::unique_ptr<Backend>> make_cuda_backend(int device = 0, const CudaBackendOptions& options = {});
// The number of CUDA devices (0 when the driver finds none); "unsupported" in a build without CUDA.
Result<int> cuda_device_count();

// Validated entry points (one validation for all backends).
Status cache_write_run(Backend& backend, const CacheWriteParams& p);
Status indexer_topk_run(Backend& backend, const IndexerTopkParams& p);
Status sparse_mla_run(Backend& backend, const SparseMlaParams& p);
Status lse_merge_run(Backend& backend, const LseMergeParams& p);
Status gather_rows_run(Backend& backend, const GatherRowsParams& p);
Status topk_remap_run(Backend& backend, const TopkRemapParams& p);
Status topk_merge_run(Backend& backend, const TopkMergeParams& p);
Status topk_input_run(Backend& backend, const TopkInputParams& p);
Status output_form_run(Backend& backend, const OutputFormParams& p);

Status validate(const CacheWriteParams& p);
Status validate(const IndexerTopkParams& p);
Status validate(const SparseMlaParams& p);
Status validate(const LseMergeParams& p);
Status validate(const GatherRowsParams& p);
Status validate(const TopkRemapParams& p);
Status validate(const TopkMergeParams& p);
Status validate(const TopkInputParams& p);
Status validate(const OutputFormParams& p);

}  // namespace dsacp
