// DCP planning: the replicated indexer view (reference-design 4.1) and DSA-CP token slicing (§5).
#include <algorithm>
#include <string>

#include "dsacp/cp_plan.h"

namespace dsacp {

Result<BlockTable> replicated_index_table(const BlockTable& table, const std::vector<int64_t>& seq_lens, int32_t Pt,
                                          int32_t page_size) {
  if (Pt < 1) return invalid_argument("CP size must be >= 1, got " + std::to_string(Pt));
  if (page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(page_size));
  if (static_cast<int32_t>(seq_lens.size()) != table.num_requests) {
    return invalid_argument("replicated index table: " + std::to_string(seq_lens.size()) + " lengths for " +
                            std::to_string(table.num_requests) + " block-table rows");
  }
  BlockTable r;
  r.num_requests = table.num_requests;
  int64_t cols = 1;
  for (int64_t S : seq_lens) cols = std::max(cols, (S + page_size - 1) / page_size);
  if (cols > INT32_MAX) return out_of_range("replicated index table wider than 2^31 - 1 columns");
  r.max_pages = static_cast<int32_t>(cols);
  r.data.assign(static_cast<size_t>(r.num_requests) * r.max_pages, -1);
  for (int32_t b = 0; b < table.num_requests; ++b) {
    const int64_t pages = (seq_lens[b] + page_size - 1) / page_size;
    for (int64_t G = 0; G < pages; ++G) {
      const int64_t col = G / Pt;
      if (col >= table.max_pages || table.page(b, col) < 0) {
        return out_of_range("replicated index table: request " + std::to_string(b) + " has no page in column " +
                            std::to_string(col));
      }
      const int64_t page = int64_t{table.page(b, col)} * Pt + G % Pt;
      if (page > INT32_MAX) return out_of_range("replicated index page id exceeds 2^31 - 1");
      r.data[static_cast<size_t>(b) * r.max_pages + G] = static_cast<int32_t>(page);
    }
  }
  return r;
}

Result<DsaCpSlice> dsa_cp_slice(const std::vector<Request>& requests, int32_t group, int32_t g) {
  if (group < 1) return invalid_argument("DSA-CP group size must be >= 1, got " + std::to_string(group));
  if (g < 0 || g >= group) {
    return invalid_argument("DSA-CP rank " + std::to_string(g) + " outside [0, " + std::to_string(group) + ")");
  }
  int64_t T = 0;
  for (const Request& r : requests) T += r.query_len;
  DsaCpSlice s;
  s.num_tokens_pad = (T + group - 1) / group * group;
  const int64_t t_loc = s.num_tokens_pad / group;
  s.local_start = int64_t{g} * t_loc;
  s.local_end_with_pad = s.local_start + t_loc;
  s.local_end = std::min(s.local_end_with_pad, T);
  int64_t gs = 0, cum = 0;
  for (const Request& r : requests) {
    const int64_t ge = gs + r.query_len;
    const int64_t sb = std::max(gs, s.local_start), eb = std::min(ge, s.local_end_with_pad);
    const int64_t n = std::max<int64_t>(eb - sb, 0);
    cum += n;
    s.cu_q_local.push_back(cum);
    const int64_t S = r.seq_len();
    s.len_k_local.push_back(n > 0 && S > 0 ? std::max<int64_t>(S - (ge - eb), 0) : 0);
    gs = ge;
  }
  return s;
}

}  // namespace dsacp
