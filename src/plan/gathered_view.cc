// Gathered views (reference-design 3.9, generalized to any interleave): which rows each rank packs, and
// how the all-gathered rows form one paged view of the requests' whole KV.
#include <algorithm>
#include <string>

#include "dsacp/cp_plan.h"

namespace dsacp {
namespace {

// Page granular: I is a multiple of page_size, so every global page lives whole on one rank's local page.
Result<GatheredViewPlan> page_granular_view(const std::vector<int32_t>& ids, const std::vector<int64_t>& seq_lens,
                                            const BlockTable& table, const KvSharding& s, int32_t B) {
  GatheredViewPlan v;
  v.direct = true;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t cols = s.pages_needed(seq_lens[i], B);
    if (cols > table.max_pages) {
      return out_of_range("request " + std::to_string(ids[i]) + " needs " + std::to_string(cols) +
                          " pages, the block table has " + std::to_string(table.max_pages) + " columns");
    }
    for (int64_t c = 0; c < cols; ++c) {
      const int32_t page = table.page(ids[i], c);
      if (page < 0) {
        return out_of_range("request " + std::to_string(ids[i]) + ": block table column " + std::to_string(c) +
                            " has no page");
      }
      v.valid_block_ids.push_back(page);
    }
  }
  std::sort(v.valid_block_ids.begin(), v.valid_block_ids.end());
  v.valid_block_ids.erase(std::unique(v.valid_block_ids.begin(), v.valid_block_ids.end()), v.valid_block_ids.end());
  const int64_t M = static_cast<int64_t>(v.valid_block_ids.size());
  v.rows_per_rank = M * B;
  v.pack_slots.reserve(static_cast<size_t>(v.rows_per_rank));
  for (int32_t page : v.valid_block_ids) {
    for (int32_t o = 0; o < B; ++o) v.pack_slots.push_back(int64_t{page} * B + o);
  }
  v.view_num_pages = int64_t{s.Pt} * M;
  int64_t max_cols = 1;
  for (int64_t S : seq_lens) max_cols = std::max(max_cols, (S + B - 1) / B);
  v.view_table.num_requests = static_cast<int32_t>(ids.size());
  v.view_table.max_pages = static_cast<int32_t>(max_cols);
  v.view_table.data.assign(ids.size() * static_cast<size_t>(max_cols), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t G = 0; G * B < seq_lens[i]; ++G) {
      const int64_t p0 = G * B;
      const int64_t local_col = s.local_pos(p0) / B;
      const int32_t page = table.page(ids[i], local_col);
      const int64_t inv = std::lower_bound(v.valid_block_ids.begin(), v.valid_block_ids.end(), page) -
                          v.valid_block_ids.begin();
      v.view_table.data[i * max_cols + G] = static_cast<int32_t>(int64_t{s.owner(p0)} * M + inv);
    }
  }
  return v;
}

// Row granular: any interleave. Each rank packs its local positions of every request in order; the view
// lays the requests out in global order, page after page.
Result<GatheredViewPlan> row_granular_view(const std::vector<int32_t>& ids, const std::vector<int64_t>& seq_lens,
                                           const BlockTable& table, const KvSharding& s, int32_t cr, int32_t B) {
  GatheredViewPlan v;
  v.direct = false;
  const size_t n = ids.size();
  // offset[k][i]: where request i starts in rank k's pack.
  std::vector<std::vector<int64_t>> offset(static_cast<size_t>(s.Pt), std::vector<int64_t>(n + 1, 0));
  for (int32_t k = 0; k < s.Pt; ++k) {
    for (size_t i = 0; i < n; ++i) offset[k][i + 1] = offset[k][i] + s.local_len(seq_lens[i], k);
    v.rows_per_rank = std::max(v.rows_per_rank, offset[k][n]);
  }
  v.pack_slots.assign(static_cast<size_t>(v.rows_per_rank), -1);
  for (size_t i = 0; i < n; ++i) {
    for (int64_t lp = 0; lp < s.local_len(seq_lens[i], cr); ++lp) {
      DSACP_ASSIGN_OR_RETURN(v.pack_slots[offset[cr][i] + lp], slot_of(table, ids[i], lp, B));
    }
  }
  int64_t max_cols = 1;
  std::vector<int64_t> base(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const int64_t cols = (seq_lens[i] + B - 1) / B;
    max_cols = std::max(max_cols, cols);
    base[i + 1] = base[i] + cols;
  }
  v.view_num_pages = std::max<int64_t>(base[n], 1);
  v.unpack_rows.assign(static_cast<size_t>(v.view_num_pages * B), -1);
  v.view_table.num_requests = static_cast<int32_t>(n);
  v.view_table.max_pages = static_cast<int32_t>(max_cols);
  v.view_table.data.assign(n * static_cast<size_t>(max_cols), -1);
  for (size_t i = 0; i < n; ++i) {
    for (int64_t G = 0; G * B < seq_lens[i]; ++G) v.view_table.data[i * max_cols + G] = static_cast<int32_t>(base[i] + G);
    for (int64_t p = 0; p < seq_lens[i]; ++p) {
      const int32_t k = s.owner(p);
      v.unpack_rows[(base[i] + p / B) * B + p % B] = int64_t{k} * v.rows_per_rank + offset[k][i] + s.local_pos(p);
    }
  }
  return v;
}

}  // namespace

Result<GatheredViewPlan> gathered_view_plan(const std::vector<int32_t>& request_ids,
                                            const std::vector<int64_t>& seq_lens, const BlockTable& table,
                                            const KvSharding& sharding, int32_t cr, int32_t page_size) {
  DSACP_RETURN_IF_ERROR(validate_sharding(sharding));
  if (page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(page_size));
  if (request_ids.size() != seq_lens.size()) return invalid_argument("gathered view: one length per request needed");
  for (size_t i = 0; i < request_ids.size(); ++i) {
    if (request_ids[i] < 0 || request_ids[i] >= table.num_requests) {
      return out_of_range("gathered view: request " + std::to_string(request_ids[i]) + " is not in the block table");
    }
    if (seq_lens[i] < 0) return invalid_argument("gathered view: negative sequence length");
  }
  if (sharding.I % page_size == 0) return page_granular_view(request_ids, seq_lens, table, sharding, page_size);
  return row_granular_view(request_ids, seq_lens, table, sharding, cr, page_size);
}

}  // namespace dsacp
