// cache_write: scatter rows into flat pool slots, converting f32 <-> bf16 (round to nearest even).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp::cpu {
namespace {

void write_row(const CacheWriteParams& p, int64_t t) {
  const int64_t slot = p.slots[t];
  if (slot < 0) return;  // -1: skipped row (checked before)
  const int64_t dim = p.pool.dim;
  const int64_t src = t * dim;
  const int64_t dst = slot * dim;  // slot = page * page_size + offset, rows contiguous
  if (p.rows_dtype == p.pool.dtype) {
    const size_t esz = dtype_size(p.rows_dtype);
    std::memcpy(static_cast<char*>(p.pool.data) + dst * esz, static_cast<const char*>(p.rows) + src * esz,
                static_cast<size_t>(dim) * esz);
    return;
  }
  for (int64_t d = 0; d < dim; ++d) {
    store_from_f32(p.pool.data, p.pool.dtype, dst + d, load_as_f32(p.rows, p.rows_dtype, src + d));
  }
}

}  // namespace

Status cache_write(const CacheWriteParams& p, int num_threads) {
  const int64_t num_slots = p.pool.num_pages * p.pool.page_size;
  std::vector<int64_t> used;
  used.reserve(static_cast<size_t>(p.num_rows));
  for (int64_t t = 0; t < p.num_rows; ++t) {
    const int64_t slot = p.slots[t];
    if (slot == -1) continue;
    if (slot < 0 || slot >= num_slots) {
      return out_of_range("cache_write: row " + std::to_string(t) + ": slot " + std::to_string(slot) +
                          " outside [0, num_pages*page_size=" + std::to_string(num_slots) + ") (and not -1)");
    }
    used.push_back(slot);
  }
  // Two rows aimed at one slot would race; then run in row order so the last row wins, deterministically.
  std::sort(used.begin(), used.end());
  const bool has_duplicates = std::adjacent_find(used.begin(), used.end()) != used.end();
  parallel_for(p.num_rows, has_duplicates ? 1 : num_threads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) write_row(p, t);
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu
