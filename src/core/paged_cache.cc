#include "dsacp/paged_cache.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>

#include "dsacp/random.h"

namespace dsacp {

PageAllocator::PageAllocator(int64_t num_pages, uint64_t shuffle_seed)
    : num_pages_(std::clamp<int64_t>(num_pages, 0, std::numeric_limits<int32_t>::max())) {
  free_.resize(static_cast<size_t>(num_pages_));
  // Popped from the back: page 0 is handed out first.
  for (int64_t i = 0; i < num_pages_; ++i) free_[static_cast<size_t>(i)] = static_cast<int32_t>(num_pages_ - 1 - i);
  if (shuffle_seed != 0) {
    for (int64_t i = num_pages_ - 1; i > 0; --i) {
      const int64_t j = static_cast<int64_t>(counter_hash(shuffle_seed, 0x9a6e, static_cast<uint64_t>(i)) %
                                             static_cast<uint64_t>(i + 1));
      std::swap(free_[static_cast<size_t>(i)], free_[static_cast<size_t>(j)]);
    }
  }
  in_use_.assign(static_cast<size_t>(num_pages_), 0);
}

Result<std::vector<int32_t>> PageAllocator::allocate(int64_t n) {
  if (n < 0) return invalid_argument("cannot allocate a negative number of pages (" + std::to_string(n) + ")");
  if (n > num_free()) {
    return resource_exhausted("out of pages: asked for " + std::to_string(n) + ", " + std::to_string(num_free()) +
                              " of " + std::to_string(num_pages_) + " free");
  }
  std::vector<int32_t> pages(free_.end() - n, free_.end());
  std::reverse(pages.begin(), pages.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  for (int32_t p : pages) in_use_[static_cast<size_t>(p)] = 1;
  return pages;
}

Status PageAllocator::release(const std::vector<int32_t>& pages) {
  for (int32_t p : pages) {
    if (p < 0 || p >= num_pages_) {
      return out_of_range("release of page " + std::to_string(p) + ", outside [0, " + std::to_string(num_pages_) + ")");
    }
    if (!in_use_[static_cast<size_t>(p)]) return invalid_argument("release of page " + std::to_string(p) + ", which is free");
  }
  for (int32_t p : pages) {
    in_use_[static_cast<size_t>(p)] = 0;
    free_.push_back(p);
  }
  return Status();
}

Status SequencePages::reserve(PageAllocator& allocator, int64_t num_tokens, int32_t page_size) {
  if (page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(page_size));
  if (num_tokens < 0) return invalid_argument("num_tokens must be >= 0, got " + std::to_string(num_tokens));
  const int64_t need = (num_tokens + page_size - 1) / page_size;
  if (need <= static_cast<int64_t>(pages.size())) return Status();
  DSACP_ASSIGN_OR_RETURN(std::vector<int32_t> more, allocator.allocate(need - static_cast<int64_t>(pages.size())));
  pages.insert(pages.end(), more.begin(), more.end());
  return Status();
}

Status SequencePages::release(PageAllocator& allocator) {
  DSACP_RETURN_IF_ERROR(allocator.release(pages));
  pages.clear();
  return Status();
}

BlockTable BlockTable::from_sequences(const std::vector<const SequencePages*>& sequences) {
  BlockTable t;
  t.num_requests = static_cast<int32_t>(sequences.size());
  for (const SequencePages* s : sequences) t.max_pages = std::max<int32_t>(t.max_pages, static_cast<int32_t>(s->pages.size()));
  t.max_pages = std::max(t.max_pages, 1);
  t.data.assign(static_cast<size_t>(t.num_requests) * t.max_pages, -1);
  for (size_t b = 0; b < sequences.size(); ++b) {
    std::copy(sequences[b]->pages.begin(), sequences[b]->pages.end(), t.data.begin() + static_cast<int64_t>(b) * t.max_pages);
  }
  return t;
}

Result<int64_t> slot_of(const BlockTable& table, int32_t request, int64_t pos, int32_t page_size) {
  if (request < 0 || request >= table.num_requests) {
    return out_of_range("request " + std::to_string(request) + " is not in the block table (" +
                        std::to_string(table.num_requests) + " rows)");
  }
  if (pos < 0) return out_of_range("negative key position " + std::to_string(pos));
  const int64_t col = pos / page_size;
  if (col >= table.max_pages || table.page(request, col) < 0) {
    return out_of_range("request " + std::to_string(request) + ": key position " + std::to_string(pos) +
                        " has no page (logical page " + std::to_string(col) + ")");
  }
  return int64_t{table.page(request, col)} * page_size + pos % page_size;
}

Result<std::vector<int64_t>> new_token_slots(const std::vector<Request>& requests, const BlockTable& table,
                                             int32_t page_size) {
  std::vector<int64_t> slots;
  for (size_t b = 0; b < requests.size(); ++b) {
    for (int32_t i = 0; i < requests[b].query_len; ++i) {
      DSACP_ASSIGN_OR_RETURN(int64_t s,
                             slot_of(table, static_cast<int32_t>(b), int64_t{requests[b].context_len} + i, page_size));
      slots.push_back(s);
    }
  }
  return slots;
}

namespace {

Status check_cache_config(const PagedCacheConfig& config) {
  if (config.num_pages < 1 || config.num_pages > std::numeric_limits<int32_t>::max()) {
    return invalid_argument("num_pages must be in [1, 2^31 - 1], got " + std::to_string(config.num_pages));
  }
  if (config.page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(config.page_size));
  if (config.Dl < 1 || config.Dr < 1 || config.Di < 1) {
    return invalid_argument("cache dims must be >= 1, got Dl=" + std::to_string(config.Dl) + " Dr=" +
                            std::to_string(config.Dr) + " Di=" + std::to_string(config.Di));
  }
  if (config.dtype != DType::kF32 && config.dtype != DType::kBF16) {
    return invalid_argument(std::string("cache dtype must be F32 or BF16, got ") + dtype_name(config.dtype));
  }
  if (config.index_key_dtype() == DType::kI32) {
    return invalid_argument("cache index_dtype must be F32, BF16 or F8_E4M3, got I32");
  }
  if (config.index_page_factor < 1 || config.num_pages * config.index_page_factor > std::numeric_limits<int32_t>::max()) {
    return invalid_argument("index_page_factor must be >= 1 and keep the indexer pool under 2^31 pages, got " +
                            std::to_string(config.index_page_factor));
  }
  if (config.latent_format != LatentFormat::kRows && config.latent_format != LatentFormat::kFp8DsMla) {
    return invalid_argument("cache latent_format must be kRows or kFp8DsMla, got " +
                            std::to_string(static_cast<int>(config.latent_format)));
  }
  if (config.fp8_latent() && config.Dl % kFp8DsMlaTile != 0) {
    return invalid_argument(
        "cache latent_format fp8_ds_mla needs Dl a multiple of 128 (one scale a 128-value tile), got Dl=" +
        std::to_string(config.Dl));
  }
  return Status();
}

// Elements of the indexer pool (bytes for the FP8 two-plane pages).
int64_t index_elements(const PagedCacheConfig& config) {
  const int64_t pages = config.num_pages * config.index_page_factor;
  return config.index_key_dtype() == DType::kF8E4M3 ? pages * fp8_index_page_bytes(config.page_size, config.Di)
                                                    : pages * config.page_size * config.Di;
}

}  // namespace

int64_t PagedKvCache::latent_page_bytes(const PagedCacheConfig& config) {
  return config.fp8_latent() ? int64_t{config.page_size} * fp8_ds_mla_record_bytes(config.Dl, config.Dr)
                             : int64_t{config.page_size} * config.Dl * static_cast<int64_t>(dtype_size(config.dtype));
}

int64_t PagedKvCache::rope_page_bytes(const PagedCacheConfig& config) {
  return config.fp8_latent() ? 0 : int64_t{config.page_size} * config.Dr * static_cast<int64_t>(dtype_size(config.dtype));
}

int64_t PagedKvCache::index_keys_page_bytes(const PagedCacheConfig& config) {
  return config.index_key_dtype() == DType::kF8E4M3
             ? fp8_index_page_bytes(config.page_size, config.Di)
             : int64_t{config.page_size} * config.Di * static_cast<int64_t>(dtype_size(config.index_key_dtype()));
}

int64_t PagedKvCache::kv_page_bytes(const PagedCacheConfig& config, int32_t kv_row) {
  if (config.fp8_latent() || kv_row <= 0) return 0;
  return int64_t{config.page_size} * kv_row * static_cast<int64_t>(dtype_size(config.dtype));
}

// A pool's bytes: its pages, each of the dense page's bytes.
size_t PagedKvCache::latent_bytes(const PagedCacheConfig& config) {
  return static_cast<size_t>(config.num_pages * latent_page_bytes(config));
}

size_t PagedKvCache::rope_bytes(const PagedCacheConfig& config) {
  return static_cast<size_t>(config.num_pages * rope_page_bytes(config));
}

size_t PagedKvCache::kv_bytes(const PagedCacheConfig& config, int32_t kv_row) {
  return static_cast<size_t>(config.num_pages * kv_page_bytes(config, kv_row));
}

size_t PagedKvCache::index_keys_bytes(const PagedCacheConfig& config) {
  return static_cast<size_t>(config.num_pages * config.index_page_factor * index_keys_page_bytes(config));
}

Result<PagedKvCache> PagedKvCache::create(Backend& backend, const PagedCacheConfig& config, bool poison_unused) {
  DSACP_RETURN_IF_ERROR(check_cache_config(config));
  PagedKvCache c;
  c.config_ = config;
  const int64_t rows = config.num_pages * config.page_size;
  const float fill = poison_unused ? std::numeric_limits<float>::quiet_NaN() : 0.f;
  if (config.fp8_latent()) {
    // One pool of records, filled bytewise: an unwritten record's latent values read as NaN (0x7f; its scales and
    // rope bytes 0x7f too, finite), so attention over it shows. No rope pool of its own.
    const size_t bytes = latent_bytes(config);
    DSACP_ASSIGN_OR_RETURN(c.latent_, backend.allocate(bytes));
    DSACP_RETURN_IF_ERROR(backend.fill(c.latent_.get(), DType::kF8E4M3, static_cast<int64_t>(bytes), fill));
  } else {
    DSACP_ASSIGN_OR_RETURN(c.latent_, backend.allocate(latent_bytes(config)));
    DSACP_ASSIGN_OR_RETURN(c.rope_, backend.allocate(rope_bytes(config)));
    DSACP_RETURN_IF_ERROR(backend.fill(c.latent_.get(), config.dtype, rows * config.Dl, fill));
    DSACP_RETURN_IF_ERROR(backend.fill(c.rope_.get(), config.dtype, rows * config.Dr, fill));
  }
  // FP8: two-plane pages (values, then scales); filled bytewise, so an unwritten slot reads as NaN values.
  DSACP_ASSIGN_OR_RETURN(c.index_keys_, backend.allocate(index_keys_bytes(config)));
  DSACP_RETURN_IF_ERROR(backend.fill(c.index_keys_.get(), config.index_key_dtype(), index_elements(config), fill));
  return c;
}

Result<PagedKvCache> PagedKvCache::wrap(const PagedCacheConfig& config, const ExternalPools& pools) {
  DSACP_RETURN_IF_ERROR(check_cache_config(config));
  // A pool of `pages` pages, dense_page bytes each, page_stride apart (0: dense): its stride and the bytes it needs.
  auto check_stride = [&](const char* name, int64_t page_stride, int64_t dense_page) -> Status {
    if (page_stride == 0) return Status();
    if (page_stride < dense_page || page_stride % 16 != 0) {
      return invalid_argument(std::string("external KV cache: the ") + name + " pool's page stride " +
                              std::to_string(page_stride) + " must be 0 (dense) or a multiple of 16 bytes of at " +
                              "least a page's " + std::to_string(dense_page) + " bytes");
    }
    return Status();
  };
  auto span = [](int64_t pages, int64_t page_stride, int64_t dense_page) -> size_t {
    return static_cast<size_t>((pages - 1) * (page_stride > 0 ? page_stride : dense_page) + dense_page);
  };
  auto check = [&](const char* name, void* data, size_t given, size_t need) -> Status {
    if (data == nullptr) return invalid_argument(std::string("external KV cache: the ") + name + " pool is null");
    if (reinterpret_cast<uintptr_t>(data) % 16 != 0) {
      return invalid_argument(std::string("external KV cache: the ") + name +
                              " pool's address is not 16-byte aligned (the GPU kernels load 16 bytes at a time)");
    }
    if (given < need) {
      return invalid_argument(std::string("external KV cache: the ") + name + " pool has " + std::to_string(given) +
                              " bytes, the config (" + std::to_string(config.num_pages) + " pages of " +
                              std::to_string(config.page_size) + ") needs " + std::to_string(need));
    }
    return Status();
  };
  const int64_t index_pages = config.num_pages * config.index_page_factor;
  DSACP_RETURN_IF_ERROR(check_stride("indexer-key", pools.index_keys_page_stride, index_keys_page_bytes(config)));
  const size_t index_need = span(index_pages, pools.index_keys_page_stride, index_keys_page_bytes(config));
  if (pools.kv != nullptr) {
    // One buffer of latent-then-rope rows.
    if (config.fp8_latent()) {
      return invalid_argument("external KV cache: a combined kv buffer was given, but the cache is fp8_ds_mla (pass "
                              "its records as the latent pool)");
    }
    if (pools.latent != nullptr || pools.rope != nullptr) {
      return invalid_argument("external KV cache: both a combined kv buffer and latent/rope pools were given (pass one)");
    }
    if (pools.kv_row < config.Dl + config.Dr) {
      return invalid_argument("external KV cache: kv_row " + std::to_string(pools.kv_row) + " is less than Dl + Dr = " +
                              std::to_string(config.Dl + config.Dr) + " (a row holds the latent, then the rope)");
    }
    if (static_cast<size_t>(pools.kv_row) * dtype_size(config.dtype) % 16 != 0 ||
        static_cast<size_t>(config.Dl) * dtype_size(config.dtype) % 16 != 0) {
      return invalid_argument("external KV cache: kv_row " + std::to_string(pools.kv_row) + " and Dl " +
                              std::to_string(config.Dl) + " must each be a multiple of 16 bytes (" +
                              std::to_string(16 / dtype_size(config.dtype)) + " " + dtype_name(config.dtype) +
                              " elements: the GPU kernels load 16 bytes at a time)");
    }
    if (pools.latent_page_stride != 0 || pools.rope_page_stride != 0) {
      return invalid_argument("external KV cache: with a combined kv buffer its page stride is kv_page_stride "
                              "(latent_page_stride and rope_page_stride must be 0)");
    }
    const int64_t kv_page = kv_page_bytes(config, pools.kv_row);
    DSACP_RETURN_IF_ERROR(check_stride("kv", pools.kv_page_stride, kv_page));
    const size_t kv_need = span(config.num_pages, pools.kv_page_stride, kv_page);
    DSACP_RETURN_IF_ERROR(check("kv", pools.kv, pools.kv_bytes, kv_need));
    DSACP_RETURN_IF_ERROR(check("indexer-key", pools.index_keys, pools.index_keys_bytes, index_need));
    PagedKvCache c;
    c.config_ = config;
    c.kv_row_ = pools.kv_row;
    c.latent_page_stride_ = c.rope_page_stride_ = pools.kv_page_stride;
    c.index_page_stride_ = pools.index_keys_page_stride;
    const size_t row0 = static_cast<size_t>(config.Dl) * dtype_size(config.dtype);
    c.latent_ = DeviceBuffer(pools.kv, kv_need, nullptr);
    c.rope_ = DeviceBuffer(static_cast<char*>(pools.kv) + row0, kv_need - row0, nullptr);
    c.index_keys_ = DeviceBuffer(pools.index_keys, index_need, nullptr);
    return c;
  }
  if (pools.kv_page_stride != 0) {
    return invalid_argument("external KV cache: kv_page_stride was given without a combined kv buffer");
  }
  DSACP_RETURN_IF_ERROR(check_stride(config.fp8_latent() ? "latent (fp8_ds_mla records)" : "latent",
                                     pools.latent_page_stride, latent_page_bytes(config)));
  const size_t latent_need = span(config.num_pages, pools.latent_page_stride, latent_page_bytes(config));
  DSACP_RETURN_IF_ERROR(check(config.fp8_latent() ? "latent (fp8_ds_mla records)" : "latent", pools.latent,
                              pools.latent_bytes, latent_need));
  size_t rope_need = 0;
  if (config.fp8_latent()) {
    if (pools.rope != nullptr || pools.rope_page_stride != 0) {
      return invalid_argument("external KV cache: a rope pool (or its page stride) was given, but fp8_ds_mla records "
                              "hold the rope (pass none)");
    }
  } else {
    DSACP_RETURN_IF_ERROR(check_stride("rope", pools.rope_page_stride, rope_page_bytes(config)));
    rope_need = span(config.num_pages, pools.rope_page_stride, rope_page_bytes(config));
    DSACP_RETURN_IF_ERROR(check("rope", pools.rope, pools.rope_bytes, rope_need));
  }
  DSACP_RETURN_IF_ERROR(check("indexer-key", pools.index_keys, pools.index_keys_bytes, index_need));
  PagedKvCache c;
  c.config_ = config;
  c.latent_page_stride_ = pools.latent_page_stride;
  c.rope_page_stride_ = pools.rope_page_stride;
  c.index_page_stride_ = pools.index_keys_page_stride;
  // Views of the caller's memory: no deleter, the caller frees it.
  c.latent_ = DeviceBuffer(pools.latent, latent_need, nullptr);
  if (!config.fp8_latent()) c.rope_ = DeviceBuffer(pools.rope, rope_need, nullptr);
  c.index_keys_ = DeviceBuffer(pools.index_keys, index_need, nullptr);
  return c;
}

const char* latent_format_name(LatentFormat f) { return f == LatentFormat::kFp8DsMla ? "fp8_ds_mla" : "bf16"; }

PagedPoolView PagedKvCache::latent() const {
  if (!config_.fp8_latent()) return view(latent_, config_.Dl, config_.dtype);
  PagedPoolView v = view(latent_, config_.Dl, DType::kF8E4M3);
  v.record_bytes = fp8_ds_mla_record_bytes(config_.Dl, config_.Dr);
  return v;
}

PagedPoolView PagedKvCache::rope() const {
  if (!config_.fp8_latent()) return view(rope_, config_.Dr, config_.dtype);
  PagedPoolView v = view(latent_, config_.Dr, DType::kBF16);
  v.record_bytes = fp8_ds_mla_record_bytes(config_.Dl, config_.Dr);
  return v;
}

PagedPoolView PagedKvCache::view(const DeviceBuffer& b, int32_t dim, DType dtype) const {
  PagedPoolView v;
  v.data = b.get();
  v.dtype = dtype;
  v.num_pages = config_.num_pages;
  v.page_size = config_.page_size;
  v.dim = dim;
  if (&b != &index_keys_) v.row_stride = kv_row_;
  v.page_stride = &b == &index_keys_ ? index_page_stride_ : &b == &rope_ ? rope_page_stride_ : latent_page_stride_;
  return v;
}

}  // namespace dsacp
