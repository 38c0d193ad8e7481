// Checks and upload helpers shared by the single-device and context-parallel step executors.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/cp_plan.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"

namespace dsacp {

// A cache configuration's layout in words ("page_size=64 Dl=512 ..."), and whether two have the same layout
// (every field but num_pages): a plan's pools against a layer's cache.
std::string cache_layout_name(const PagedCacheConfig& c);
bool same_cache_layout(const PagedCacheConfig& a, const PagedCacheConfig& b);

// The config's dims and dtypes against the cache's.
Status check_step_config(const StepConfig& c, const PagedCacheConfig& cache);

// Every request's block-table entries [first_page[b], pages_per_request[b]) are pages inside the pool (from
// entry 0 when first_page is empty).
Status check_block_table_pages(const BlockTable& table, const std::vector<int64_t>& pages_per_request,
                               const PagedCacheConfig& cache, const std::vector<int64_t>& first_page = {});

// The indexer's inputs are there unless the step has a precomputed top-k (StepInputs::topk).
Status check_indexer_inputs(const StepConfig& c, const StepInputs& in);

// The step's own (canonical) top-k buffer of `rows` rows: the caller's output when it asked for canonical rows,
// else a buffer in *storage that output_forms converts into the caller's.
Result<int32_t*> step_topk_buffer(Backend& backend, const StepConfig& c, int64_t rows, int32_t* out_topk,
                                  DeviceBuffer* storage);

// The outputs in the caller's forms (StepConfig::topk_form, lse_base): the canonical rows `topk` of `rows` rows
// (requests `request`, device memory) as slots into out_topk, and lse_count LSE values of `lse` in base 2.
// Nothing to do for the default forms. Pt, I: the KV sharding (1, 1 on one device).
struct OutputForms {
  int64_t rows = 0;
  const int32_t* topk = nullptr;
  const int32_t* request = nullptr;
  BlockTableView block_table;
  int32_t page_size = 0;
  int64_t num_pages = 0;
  int32_t Pt = 1, I = 1;
  int32_t* out_topk = nullptr;
  float* lse = nullptr;
  int64_t lse_count = 0;
};
Status output_forms(Backend& backend, const StepConfig& c, const OutputForms& f);

// The host tensors of a step's inputs: names, dtypes and shapes against the config and T.
Status check_host_step_inputs(const StepConfig& c, int64_t T, const HostStepInputs& in);

// A host vector copied into a new backend buffer (at least one byte, so the pointer is never null).
template <typename T>
Result<DeviceBuffer> upload_vector(Backend& backend, const std::vector<T>& v) {
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer buf, backend.allocate(std::max<size_t>(v.size() * sizeof(T), 1)));
  if (!v.empty()) DSACP_RETURN_IF_ERROR(backend.copy_to_device(buf.get(), v.data(), v.size() * sizeof(T)));
  return buf;
}

// The step's block table in backend memory: `in.block_table` when the caller keeps it there, else `table`
// uploaded into *storage (which must outlive the step's use of the pointer).
inline Result<const int32_t*> step_device_table(Backend& backend, const BlockTable& table, const StepInputs& in,
                                                DeviceBuffer* storage) {
  if (in.block_table != nullptr) return in.block_table;
  DSACP_ASSIGN_OR_RETURN(*storage, upload_vector(backend, table.data));
  return storage->as<const int32_t>();
}

// For the host-memory helpers (HostStepInputs::device_block_table): `table` uploaded once into a buffer the
// step then reads as StepInputs::block_table, or an empty buffer (null pointer: the step uploads it itself).
inline Result<DeviceBuffer> kept_block_table(Backend& backend, const BlockTable& table, bool keep) {
  if (!keep) return DeviceBuffer{};
  return upload_vector(backend, table.data);
}

// Small host vectors sent in one device buffer (one allocation, one copy), each at a 16-byte aligned offset.
class UploadBatch {
 public:
  template <typename T>
  size_t add(const std::vector<T>& v) {
    const size_t at = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(at);  // alignment padding only: the data is appended without a zero fill first
    const char* p = reinterpret_cast<const char*>(v.data());
    bytes_.insert(bytes_.end(), p, p + v.size() * sizeof(T));
    return at;
  }
  Result<DeviceBuffer> upload(Backend& backend) const {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d, backend.allocate(std::max<size_t>(bytes_.size(), 1)));
    DSACP_RETURN_IF_ERROR(backend.copy_to_device(d.get(), bytes_.data(), bytes_.size()));
    return d;
  }
  // The same, made by the cache write `w` (CacheWriteParams::upload: no copy call of its own on a GPU) when the
  // batch is small enough; the caller runs `w` next, before anything reads the buffer, while this batch lives.
  Result<DeviceBuffer> upload_with(Backend& backend, CacheWriteParams& w) const {
    if (bytes_.size() > kCacheWriteMaxUploadBytes) return upload(backend);
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d, backend.allocate(std::max<size_t>(bytes_.size(), 1)));
    w.upload = {bytes_.data(), d.get(), bytes_.size()};
    return d;
  }
  template <typename T>
  static const T* at(const DeviceBuffer& d, size_t offset) {
    return reinterpret_cast<const T*>(static_cast<const char*>(d.get()) + offset);
  }

 private:
  std::vector<char> bytes_;
};

}  // namespace dsacp
