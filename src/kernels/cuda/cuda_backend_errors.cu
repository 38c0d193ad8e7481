// The CUDA backend's device error words: a launch's context (its error slot), the checked calls' read-back of
// slot 0 and the deferred scope's collection of slots 1.. at synchronize().
#include "kernels/cuda/cuda_backend_impl.h"

namespace dsacp::cuda {

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

LaunchContext CudaBackend::ctx(const char* kernel) {
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

Status CudaBackend::refuse_in_capture(const char* what) {
  const Status s = invalid_argument(std::string("CUDA backend: ") + what +
                                    " while capturing (a capture records kernel launches only)");
  if (capture_error_.ok()) (void)(capture_error_ = s);
  return s;
}

Status CudaBackend::finish(const char* kernel) {
  if (deferred_ > 0) return Status::ok_status();
  return check_device_error(kernel);
}

cudaError_t CudaBackend::enqueue_error_readback() {
  const size_t n = pending_.size();
  if (n == 0) return cudaSuccess;
  return cudaMemcpyAsync(err_host_ + 2, err_dev_ + 2, 2 * n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_);
}

Status CudaBackend::collect_deferred() {
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

Status CudaBackend::check_device_error(const char* kernel) {
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

}  // namespace dsacp::cuda
