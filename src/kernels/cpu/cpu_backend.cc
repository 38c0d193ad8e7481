// The CPU backend: host memory and the oracle kernels, split over a fixed number of threads.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "core/parallel.h"
#include "dsacp/backend.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp {
namespace cpu {

Status check_token_keys(const char* kernel, const QueryRowsView& rows, int64_t t, const BlockTableView& bt,
                        int32_t page_size, int64_t num_pages, int32_t* checked_pages) {
  const int32_t b = rows.request[t];
  const int32_t key_len = rows.key_len[t];
  const std::string where = std::string(kernel) + ": token " + std::to_string(t) + ": ";
  if (b < 0 || b >= bt.num_requests) {
    return out_of_range(where + "rows.request=" + std::to_string(b) + " outside the block table's [0, " +
                        std::to_string(bt.num_requests) + ")");
  }
  const int64_t max_keys = static_cast<int64_t>(bt.max_pages) * page_size;
  if (key_len < 0 || key_len > max_keys) {
    return out_of_range(where + "rows.key_len=" + std::to_string(key_len) +
                        " outside [0, max_pages*page_size=" + std::to_string(max_keys) + "]");
  }
  const int32_t pages = static_cast<int32_t>((static_cast<int64_t>(key_len) + page_size - 1) / page_size);
  for (int32_t c = checked_pages[b]; c < pages; ++c) {
    const int32_t page = bt.data[static_cast<int64_t>(b) * bt.max_pages + c];
    if (page < 0 || page >= num_pages) {
      return out_of_range(where + "block_table[" + std::to_string(b) + ", " + std::to_string(c) +
                          "]=" + std::to_string(page) + " outside [0, num_pages=" + std::to_string(num_pages) +
                          ") for key_len=" + std::to_string(key_len));
    }
  }
  checked_pages[b] = std::max(checked_pages[b], pages);
  return Status::ok_status();
}

void load_row_f32(const void* data, DType dtype, int64_t offset, int64_t n, float* dst) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(data) + offset, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(&dst[i], &u, sizeof(float));
  }
}

}  // namespace cpu

namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads) : num_threads_(num_threads > 0 ? num_threads : default_num_threads()) {}

  std::string name() const override { return "cpu(" + std::to_string(num_threads_) + " threads)"; }

  // 64-byte aligned host memory; aligned_alloc reports failure with nullptr (no exception).
  Result<DeviceBuffer> allocate(size_t bytes) override {
    constexpr size_t kAlign = 64;
    if (bytes > std::numeric_limits<size_t>::max() - kAlign) {
      return resource_exhausted("cpu allocate: " + std::to_string(bytes) + " bytes is too large");
    }
    const size_t rounded = std::max<size_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
    void* ptr = std::aligned_alloc(kAlign, rounded);
    if (ptr == nullptr)
      return resource_exhausted("cpu allocate: out of host memory for " + std::to_string(bytes) + " bytes");
    return DeviceBuffer(ptr, bytes, [](void* q) { std::free(q); });
  }

  Status copy_to_device(void* dst, const void* src, size_t bytes) override {
    return copy("copy_to_device", dst, src, bytes);
  }
  Status copy_to_host(void* dst, const void* src, size_t bytes) override {
    return copy("copy_to_host", dst, src, bytes);
  }
  Status copy_on_device(void* dst, const void* src, size_t bytes) override {
    return copy("copy_on_device", dst, src, bytes);
  }

  Status fill(void* dst, DType dtype, int64_t count, float value) override {
    if (count < 0) return invalid_argument("fill: count must be >= 0, got " + std::to_string(count));
    if (count == 0) return Status::ok_status();
    if (dst == nullptr) return invalid_argument("fill: dst must not be null");
    switch (dtype) {
      case DType::kF32:
        std::fill_n(static_cast<float*>(dst), count, value);
        return Status::ok_status();
      case DType::kBF16:
        std::fill_n(static_cast<bf16*>(dst), count, f32_to_bf16(value));
        return Status::ok_status();
      case DType::kI32: {
        // i32 has no NaN or infinity; only integral values in range are meaningful.
        if (!(value >= -2147483648.0f && value < 2147483648.0f) || std::trunc(value) != value) {
          return invalid_argument("fill: value " + std::to_string(value) + " is not representable as I32");
        }
        std::fill_n(static_cast<int32_t*>(dst), count, static_cast<int32_t>(value));
        return Status::ok_status();
      }
      case DType::kF8E4M3:  // every byte the e4m3 code of value (NaN: 0x7f); an FP8 pool's scale plane included
        std::memset(dst, f32_to_e4m3(value), static_cast<size_t>(count));
        return Status::ok_status();
    }
    return invalid_argument("fill: unknown dtype");
  }

  Status synchronize() override { return Status::ok_status(); }

  Status cache_write(const CacheWriteParams& p) override {
    if (p.upload.bytes > 0) std::memcpy(p.upload.device, p.upload.host, p.upload.bytes);  // first: the slots may lie there
    for (int i = 0; i < cache_write_pools(p); ++i) DSACP_RETURN_IF_ERROR(cpu::cache_write(cache_write_pool(p, i), num_threads_));
    return Status::ok_status();
  }
  Status indexer_topk(const IndexerTopkParams& p) override {
    DSACP_RETURN_IF_ERROR(no_window_rows(p.signal, "indexer_topk"));
    if (p.merge.num_rows > 0) {
      return unsupported("indexer_topk: the fused candidate merge (IndexerTopkParams::merge) needs a device backend's "
                         "row-synchronized exchange; on the CPU, run topk_merge after the top-k");
    }
    return cpu::indexer_topk(p, num_threads_);
  }
  Status sparse_mla(const SparseMlaParams& p) override {
    DSACP_RETURN_IF_ERROR(no_window_rows(p.peer.sync, "sparse_mla"));
    return cpu::sparse_mla(p, num_threads_);
  }
  Status lse_merge(const LseMergeParams& p) override { return cpu::lse_merge(p, num_threads_); }
  Status gather_rows(const GatherRowsParams& p) override { return cpu::gather_rows(p, num_threads_); }
  Status topk_remap(const TopkRemapParams& p) override { return cpu::topk_remap(p, num_threads_); }
  Status topk_input(const TopkInputParams& p) override { return cpu::topk_input(p); }
  Status output_form(const OutputFormParams& p) override { return cpu::output_form(p); }
  Status topk_merge(const TopkMergeParams& p) override {
    DSACP_RETURN_IF_ERROR(no_window_rows(p.wait, "topk_merge"));
    return cpu::topk_merge(p, num_threads_);
  }

 private:
  // Row-synchronized window exchanges are a device feature (kernels raising and waiting on peers' flags).
  static Status no_window_rows(const WindowRowSync& w, const char* what) {
    if (!w.active()) return Status::ok_status();
    return unsupported(std::string(what) + ": a row-synchronized window exchange (WindowRowSync) needs a device "
                       "backend; the CPU backend's communicators have no windows");
  }
  static Status copy(const char* what, void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return Status::ok_status();
    if (dst == nullptr || src == nullptr) return invalid_argument(std::string(what) + ": null pointer");
    std::memmove(dst, src, bytes);
    return Status::ok_status();
  }

  int num_threads_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads) { return std::make_unique<CpuBackend>(num_threads); }

}  // namespace dsacp
