// Test fixture for paged caches: a page layout with shuffled physical pages and spare (never used) pages, and
// pools poisoned with NaN in every slot no key occupies, filled with dense per-request rows through the real
// cache_write kernel. Hostile by construction: a paging bug reads NaN or another request's keys.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/kernel_params.h"

namespace dsacp::testing {

struct PageLayout {
  int32_t page_size = 0;
  int32_t max_pages = 0;
  int32_t num_requests = 0;
  int64_t num_pages = 0;
  std::vector<int32_t> block_table;  // [num_requests, max_pages]; entries past a request's pages are -1

  BlockTableView view() const { return {block_table.data(), num_requests, max_pages}; }
  // Flat pool slot of key position j of request b.
  int64_t slot(int32_t b, int64_t j) const {
    return int64_t{block_table[static_cast<size_t>(b) * max_pages + j / page_size]} * page_size + j % page_size;
  }
};

// Physical pages are a seeded permutation; `spare_pages` extra pages stay unused; every request gets one
// extra block-table column of -1 so reads past its keys would be caught.
PageLayout make_page_layout(std::span<const int64_t> request_lens, int32_t page_size, uint64_t seed,
                            int32_t spare_pages = 3);

struct PagedPool {
  DeviceBuffer buffer;
  PagedPoolView view;
};

// rows[b] is request b's dense keys, [request_lens[b], dim] f32; they are stored through cache_write from
// rows of rows_dtype (f32 rows are converted to the pool dtype by the kernel with RNE). Unused slots are NaN.
Result<PagedPool> make_paged_pool(Backend& backend, const PageLayout& layout, DType dtype, int32_t dim,
                                  const std::vector<std::vector<float>>& rows, DType rows_dtype = DType::kF32);

// Counter-based values in [-amp, amp), rounded to bf16 when `bf16` (so both dtypes hold the same numbers).
std::vector<float> random_values(uint64_t seed, uint64_t stream, int64_t count, float amp, bool bf16);

}  // namespace dsacp::testing
