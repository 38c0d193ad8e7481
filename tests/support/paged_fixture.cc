#include "support/paged_fixture.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "dsacp/random.h"

namespace dsacp::testing {

PageLayout make_page_layout(std::span<const int64_t> request_lens, int32_t page_size, uint64_t seed,
                            int32_t spare_pages) {
  PageLayout l;
  l.page_size = page_size;
  l.num_requests = static_cast<int32_t>(request_lens.size());
  int64_t total = 0, widest = 0;
  for (int64_t len : request_lens) {
    const int64_t pages = (len + page_size - 1) / page_size;
    total += pages;
    widest = std::max(widest, pages);
  }
  l.max_pages = static_cast<int32_t>(widest + 1);
  l.num_pages = total + spare_pages;
  std::vector<int32_t> perm(static_cast<size_t>(l.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  for (int64_t i = l.num_pages - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(counter_hash(seed, 7, static_cast<uint64_t>(i)) % uint64_t(i + 1));
    std::swap(perm[i], perm[j]);
  }
  l.block_table.assign(static_cast<size_t>(l.num_requests) * l.max_pages, -1);
  int64_t next = 0;
  for (int32_t b = 0; b < l.num_requests; ++b) {
    const int64_t pages = (request_lens[b] + page_size - 1) / page_size;
    for (int64_t c = 0; c < pages; ++c) l.block_table[static_cast<size_t>(b) * l.max_pages + c] = perm[next++];
  }
  return l;
}

Result<PagedPool> make_paged_pool(Backend& backend, const PageLayout& layout, DType dtype, int32_t dim,
                                  const std::vector<std::vector<float>>& rows, DType rows_dtype) {
  PagedPool pool;
  const int64_t count = layout.num_pages * layout.page_size * dim;
  DSACP_ASSIGN_OR_RETURN(pool.buffer, backend.allocate(static_cast<size_t>(count) * dtype_size(dtype)));
  DSACP_RETURN_IF_ERROR(backend.fill(pool.buffer.get(), dtype, count, std::numeric_limits<float>::quiet_NaN()));
  pool.view = PagedPoolView{pool.buffer.get(), dtype, layout.num_pages, layout.page_size, dim};

  std::vector<uint8_t> host;  // all rows, in rows_dtype
  std::vector<int64_t> slots;
  for (int32_t b = 0; b < static_cast<int32_t>(rows.size()); ++b) {
    const int64_t len = static_cast<int64_t>(rows[b].size()) / dim;
    for (int64_t j = 0; j < len; ++j) {
      slots.push_back(layout.slot(b, j));
      for (int32_t d = 0; d < dim; ++d) {
        const size_t at = host.size();
        host.resize(at + dtype_size(rows_dtype));
        store_from_f32(host.data() + at, rows_dtype, 0, rows[b][j * dim + d]);
      }
    }
  }
  if (slots.empty()) return pool;
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer dev_rows, backend.allocate(host.size()));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer dev_slots, backend.allocate(slots.size() * sizeof(int64_t)));
  DSACP_RETURN_IF_ERROR(backend.copy_to_device(dev_rows.get(), host.data(), host.size()));
  DSACP_RETURN_IF_ERROR(backend.copy_to_device(dev_slots.get(), slots.data(), slots.size() * sizeof(int64_t)));
  CacheWriteParams p;
  p.rows = dev_rows.get();
  p.rows_dtype = rows_dtype;
  p.num_rows = static_cast<int64_t>(slots.size());
  p.slots = dev_slots.as<int64_t>();
  p.pool = pool.view;
  DSACP_RETURN_IF_ERROR(cache_write_run(backend, p));
  DSACP_RETURN_IF_ERROR(backend.synchronize());
  return pool;
}

std::vector<float> random_values(uint64_t seed, uint64_t stream, int64_t count, float amp, bool bf16) {
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const float x = amp * counter_uniform(seed, stream, static_cast<uint64_t>(i));
    v[i] = bf16 ? round_to_bf16(x) : x;
  }
  return v;
}

}  // namespace dsacp::testing
