// Indexer + exact top-k: host plan (chunks of tokens with bounded score buffers, token groups, score items)
// and the launch sequence per chunk: fused tensor-core scores into the chunk's buffer, then radix select.
// The score buffer never holds more than the plan's budget (128 MiB by default), whatever T and the contexts.
#include <algorithm>
#include <string>

#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::cuda {

Status indexer_topk_supported(const IndexerTopkParams& p) {
  const std::string supported =
      " (CUDA indexer_topk supports Hi = 64, Di = 128, bf16 q and keys, page_size 1..1024, "
      "num_pages * page_size < 2^31)";
  if (p.Hi != 64 || p.Di != 128) {
    return unsupported("indexer_topk: Hi=" + std::to_string(p.Hi) + ", Di=" + std::to_string(p.Di) + supported);
  }
  if (p.q_dtype != DType::kBF16 || p.keys.dtype != DType::kBF16) {
    return unsupported(std::string("indexer_topk: q ") + dtype_name(p.q_dtype) + ", keys " +
                       dtype_name(p.keys.dtype) + supported);
  }
  if (p.keys.page_size < 1 || p.keys.page_size > 1024) {
    return unsupported("indexer_topk: page_size=" + std::to_string(p.keys.page_size) + supported);
  }
  if (p.keys.num_pages * p.keys.page_size >= (int64_t{1} << 31)) {
    return unsupported("indexer_topk: num_pages * page_size=" +
                       std::to_string(p.keys.num_pages * p.keys.page_size) + supported);
  }
  if (p.rows.num_tokens >= (int64_t{1} << 31)) return unsupported("indexer_topk: T >= 2^31" + supported);
  return Status::ok_status();
}

Result<IndexerPlan> indexer_plan(const IndexerTopkParams& p, const int32_t* request, const int32_t* key_len,
                                 int64_t score_budget_floats) {
  IndexerPlan plan;
  const int64_t T = p.rows.num_tokens;
  const int64_t max_len = static_cast<int64_t>(p.block_table.max_pages) * p.keys.page_size;
  for (int64_t t = 0; t < T; ++t) {
    const std::string where = "indexer_topk: token " + std::to_string(t) + ": ";
    if (request[t] < 0 || request[t] >= p.block_table.num_requests) {
      return out_of_range(where + "rows.request=" + std::to_string(request[t]) + " outside the block table's [0, " +
                          std::to_string(p.block_table.num_requests) + ")");
    }
    if (key_len[t] < 0 || key_len[t] > max_len) {
      return out_of_range(where + "rows.key_len=" + std::to_string(key_len[t]) + " outside [0, max_pages*page_size=" +
                          std::to_string(max_len) + "]");
    }
  }
  plan.score_offset.resize(static_cast<size_t>(T));
  for (int64_t c0 = 0; c0 < T;) {
    IndexerPlan::Chunk ch{c0, c0, static_cast<int64_t>(plan.items.size()), 0, 0, 1, 0};
    int64_t total = 0;
    int64_t t = c0;
    while (t < T) {
      const int64_t len = (int64_t{key_len[t]} + 3) / 4 * 4;  // rows 16-byte aligned (vector loads)
      if (t > c0 && total + len > score_budget_floats) break;
      plan.score_offset[t] = total;
      total += len;
      ch.max_len = std::max(ch.max_len, key_len[t]);
      ++t;
    }
    ch.t1 = t;
    ch.score_floats = total;
    for (int64_t g = ch.t0; g < ch.t1;) {
      int64_t e = g;
      int32_t glen = 0;
      while (e < ch.t1 && e - g < kMaxGroupTokens && request[e] == request[g]) {
        glen = std::max(glen, key_len[e]);
        ++e;
      }
      ch.max_group_tokens = std::max<int32_t>(ch.max_group_tokens, static_cast<int32_t>(e - g));
      for (int32_t k0 = 0; k0 < glen; k0 += kScoreKeys) {
        plan.items.push_back({static_cast<int32_t>(g), static_cast<int32_t>(e - g), k0, 0});
      }
      g = e;
    }
    ch.item_end = static_cast<int64_t>(plan.items.size());
    plan.max_score_floats = std::max(plan.max_score_floats, total);
    plan.chunks.push_back(ch);
    c0 = ch.t1;
  }
  return plan;
}

Status launch_indexer_topk(const IndexerTopkParams& p, const IndexerPlan& plan, const IndexerPlanDevice& dev,
                           const LaunchContext& ctx) {
  DSACP_RETURN_IF_ERROR(indexer_topk_supported(p));
  for (const IndexerPlan::Chunk& ch : plan.chunks) {
    DSACP_RETURN_IF_ERROR(launch_indexer_scores(p, dev.items + ch.item_begin, ch.item_end - ch.item_begin,
                                                ch.max_group_tokens, dev.score_offset, dev.scores, ctx));
    DSACP_RETURN_IF_ERROR(launch_radix_select_topk(p, ch.t0, ch.t1, ch.max_len, dev.score_offset, dev.scores, ctx));
  }
  return Status::ok_status();
}

}  // namespace dsacp::cuda
