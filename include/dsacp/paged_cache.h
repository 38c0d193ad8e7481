// Paged caches of one layer: latent (Dl), rope (Dr) and indexer-key (Di) pools over one page allocator,
// block tables per request and slot mappings (slot = page * page_size + offset; -1 = skip).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/batch.h"
#include "dsacp/kernel_params.h"
#include "dsacp/status.h"

namespace dsacp {

// A free list of physical pages. With a non-zero shuffle seed the free list starts in a shuffled order,
// so consecutive logical pages land on scattered physical pages (paging bugs show).
class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages, uint64_t shuffle_seed = 0);
  // n pages or an error "out of pages: asked for 5, 3 of 64 free" (nothing is taken on failure).
  Result<std::vector<int32_t>> allocate(int64_t n);
  // Returns pages to the free list; a page that is out of range or already free is an error.
  Status release(const std::vector<int32_t>& pages);
  int64_t num_pages() const { return num_pages_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_used() const { return num_pages_ - num_free(); }

 private:
  int64_t num_pages_;
  std::vector<int32_t> free_;     // popped from the back
  std::vector<uint8_t> in_use_;   // [num_pages]
};

// The physical pages of one request's sequence, in logical order.
struct SequencePages {
  std::vector<int32_t> pages;
  // Grows the list so it covers `num_tokens` tokens (ceil(num_tokens / page_size) pages).
  Status reserve(PageAllocator& allocator, int64_t num_tokens, int32_t page_size);
  Status release(PageAllocator& allocator);
};

// Host block table [num_requests, max_pages]; unused entries are -1.
struct BlockTable {
  int32_t num_requests = 0;
  int32_t max_pages = 0;
  std::vector<int32_t> data;
  static BlockTable from_sequences(const std::vector<const SequencePages*>& sequences);
  int32_t page(int32_t request, int64_t logical_page) const { return data[static_cast<size_t>(request) * max_pages + logical_page]; }
};

// Slot of key position `pos` of `request`: block_table[request, pos / page_size] * page_size + pos % page_size;
// an error when the position has no page.
Result<int64_t> slot_of(const BlockTable& table, int32_t request, int64_t pos, int32_t page_size);

// Slots of the batch's new tokens (positions context_len + i), in token order.
Result<std::vector<int64_t>> new_token_slots(const std::vector<Request>& requests, const BlockTable& table,
                                             int32_t page_size);

// How the latent and rope pools store a token: rows of the cache's dtype (two pools), or one pool of fp8_ds_mla
// records (dsacp/fp8.h: 656 bytes a token for Dl = 512, Dr = 64; Dl a multiple of 128).
enum class LatentFormat : uint8_t { kRows, kFp8DsMla };
// CLI spelling: "bf16" (rows) and "fp8_ds_mla".
const char* latent_format_name(LatentFormat f);

struct PagedCacheConfig {
  int64_t num_pages = 0;
  int32_t page_size = 64;
  int32_t Dl = 512, Dr = 64, Di = 128;
  DType dtype = DType::kBF16;  // storage of the pools (of all three unless index_dtype says otherwise)
  // The indexer-key pool holds num_pages * index_page_factor pages: Pt for the replicated indexer of context
  // parallelism (every rank stores every key, reference-design 4.1), else 1.
  int32_t index_page_factor = 1;
  // The indexer-key pool's storage when set: F32, BF16, or F8_E4M3 (two-plane pages, dsacp/fp8.h; the cache write
  // quantizes f32/bf16 keys with index_scale_mode, e4m3 keys are stored with their scales).
  std::optional<DType> index_dtype = std::nullopt;
  Fp8ScaleMode index_scale_mode = Fp8ScaleMode::kFp32;
  DType index_key_dtype() const { return index_dtype.value_or(dtype); }
  // kFp8DsMla: the latent and rope of a token in one record (the cache write quantizes f32/bf16 latent rows per
  // 128-value tile with latent_scale_mode; e4m3 rows are stored with their scales). `dtype` then names only the
  // indexer pool's storage (unless index_dtype is set).
  LatentFormat latent_format = LatentFormat::kRows;
  Fp8ScaleMode latent_scale_mode = Fp8ScaleMode::kFp32;
  bool fp8_latent() const { return latent_format == LatentFormat::kFp8DsMla; }
};

// A layer's pools in the caller's memory (a serving engine's own KV cache tensors), in the layouts PagedKvCache
// uses, which are the engines' own for the FP8 formats:
//   latent      [num_pages, page_size, Dl] rows of `dtype` (bf16 / f32); with fp8_ds_mla the records
//               [num_pages, page_size, 656 B] (vLLM's and FlashMLA's FP8 cache: uint8 [num_blocks, 64, 656])
//   rope        [num_pages, page_size, Dr] rows of `dtype`; null with fp8_ds_mla (the records hold the rope)
//   index_keys  [num_pages * index_page_factor, page_size, Di] rows, or the FP8 two-plane pages (uint8
//               [num_blocks, page_size * 132] for Di = 128: vLLM's and DeepGEMM's indexer cache)
// Each pointer with the bytes the caller has there (at least the config's size; more is allowed and unused).
struct ExternalPools {
  void* latent = nullptr;
  size_t latent_bytes = 0;
  void* rope = nullptr;
  size_t rope_bytes = 0;
  void* index_keys = nullptr;
  size_t index_keys_bytes = 0;
  // Instead of latent and rope (f32/bf16 latent only): one buffer of [num_pages, page_size, kv_row] elements,
  // each token's row its Dl latent values, then its Dr rope values, then kv_row - Dl - Dr unused ones (vLLM's and
  // FlashMLA's bf16 KV cache: kv_row = 576 for 512 + 64). kv_bytes: at least kv_bytes(config, kv_row).
  void* kv = nullptr;
  size_t kv_bytes = 0;
  int32_t kv_row = 0;
  // Bytes from one page to the next in each pool (kv: the combined buffer); 0 = dense, the page's rows or records
  // back to back. A larger stride, a multiple of 16, leaves each page's tail unused and never read or written: an
  // engine's pages padded to one size (vLLM's page_size_padded; a torch tensor's stride(0) times its item size).
  // A pool then needs (pages - 1) * stride + the dense page's bytes.
  int64_t latent_page_stride = 0, rope_page_stride = 0, index_keys_page_stride = 0, kv_page_stride = 0;
};

// The three pools of one layer, in a backend's memory.
class PagedKvCache {
 public:
  // Allocates the pools; with poison_unused every slot starts as NaN (so a read of an unwritten slot shows).
  static Result<PagedKvCache> create(Backend& backend, const PagedCacheConfig& config, bool poison_unused = true);
  // The caller's memory as the pools: nothing is allocated, filled or freed (the caller keeps the memory alive
  // while the cache is used, and in the backend's address space: device memory for a GPU backend). Refused with
  // one line naming the pool: a config create() refuses, a null pool, fewer bytes than the config needs, an
  // address not 16-byte aligned (the GPU kernels' vector loads), a rope pool given with fp8_ds_mla.
  static Result<PagedKvCache> wrap(const PagedCacheConfig& config, const ExternalPools& pools);
  // Bytes each pool of `config` takes (rope 0 with fp8_ds_mla).
  static size_t latent_bytes(const PagedCacheConfig& config);
  static size_t rope_bytes(const PagedCacheConfig& config);
  static size_t index_keys_bytes(const PagedCacheConfig& config);
  static size_t kv_bytes(const PagedCacheConfig& config, int32_t kv_row);
  // Bytes of one page of each pool laid out densely (the stride of a dense pool; rope 0 with fp8_ds_mla).
  static int64_t latent_page_bytes(const PagedCacheConfig& config);
  static int64_t rope_page_bytes(const PagedCacheConfig& config);
  static int64_t index_keys_page_bytes(const PagedCacheConfig& config);
  static int64_t kv_page_bytes(const PagedCacheConfig& config, int32_t kv_row);

  const PagedCacheConfig& config() const { return config_; }
  // With fp8_ds_mla both are views of the one record pool (PagedPoolView::record_bytes).
  PagedPoolView latent() const;
  PagedPoolView rope() const;
  PagedPoolView index_keys() const {
    PagedPoolView v = view(index_keys_, config_.Di, config_.index_key_dtype());
    v.num_pages *= config_.index_page_factor;
    return v;
  }
  size_t bytes() const { return latent_.bytes() + (kv_row_ > 0 ? 0 : rope_.bytes()) + index_keys_.bytes(); }

 private:
  PagedPoolView view(const DeviceBuffer& b, int32_t dim, DType dtype) const;
  PagedCacheConfig config_;
  DeviceBuffer latent_, rope_, index_keys_;
  int64_t kv_row_ = 0;  // > 0: latent_ and rope_ are views of one buffer of rows this many elements apart
  // Page strides of the caller's pools (PagedPoolView::page_stride; 0 = dense).
  int64_t latent_page_stride_ = 0, rope_page_stride_ = 0, index_page_stride_ = 0;
};

}  // namespace dsacp
