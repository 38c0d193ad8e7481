// Indexer + exact top-k: host plan (chunks of tokens with bounded score buffers, token groups, score items)
// and the launch sequence per chunk: fused tensor-core scores into the chunk's buffer, then radix select.
// The score buffer never holds more than the plan's budget (128 MiB by default), whatever T and the contexts.
#include <algorithm>
#include <string>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::cuda {

Status indexer_topk_supported(const IndexerTopkParams& p) {
  const std::string supported =
      " (CUDA indexer_topk supports Hi = 32 or 64, Di = 128, bf16 q and keys or e4m3 q with q_scale and FP8 "
      "two-plane keys, page_size 1..1024, num_pages * page_size < 2^31)";
  if ((p.Hi != 32 && p.Hi != 64) || p.Di != 128) {
    return unsupported("indexer_topk: Hi=" + std::to_string(p.Hi) + ", Di=" + std::to_string(p.Di) + supported);
  }
  const bool bf16 = p.q_dtype == DType::kBF16 && p.keys.dtype == DType::kBF16;
  const bool fp8 = p.q_dtype == DType::kF8E4M3 && p.keys.dtype == DType::kF8E4M3;
  if (!bf16 && !fp8) {
    return unsupported(std::string("indexer_topk: q ") + dtype_name(p.q_dtype) + ", keys " +
                       dtype_name(p.keys.dtype) + supported);
  }
  if (fp8 && p.q_scale == nullptr) {
    return invalid_argument("indexer_topk: q_scale is null; e4m3 q needs its [T, Hi] f32 scales");
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
    auto where = [t] { return "indexer_topk: token " + std::to_string(t) + ": "; };
    if (request[t] < 0 || request[t] >= p.block_table.num_requests) {
      return out_of_range(where() + "rows.request=" + std::to_string(request[t]) + " outside the block table's [0, " +
                          std::to_string(p.block_table.num_requests) + ")");
    }
    if (key_len[t] < 0 || key_len[t] > max_len) {
      return out_of_range(where() + "rows.key_len=" + std::to_string(key_len[t]) + " outside [0, max_pages*page_size=" +
                          std::to_string(max_len) + "]");
    }
  }
  plan.score_offset.resize(static_cast<size_t>(T));
  for (int64_t c0 = 0; c0 < T;) {
    IndexerPlan::Chunk ch{c0, c0, plan.num_items, 0, 0, 1, 0};
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
      const int64_t items = (int64_t{glen} + kScoreKeys - 1) / kScoreKeys;
      if (items > 0) {
        plan.groups.push_back({static_cast<int32_t>(g), static_cast<int32_t>(e - g), plan.num_items});
        plan.num_items += items;
      }
      g = e;
    }
    ch.item_end = plan.num_items;
    plan.max_score_floats = std::max(plan.max_score_floats, total);
    plan.chunks.push_back(ch);
    c0 = ch.t1;
  }
  return plan;
}

bool inline_plan_fits(const IndexerPlan& plan, int64_t num_tokens) {
  return plan.chunks.size() == 1 && plan.chunks[0].item_begin == 0 && !plan.groups.empty() &&
         num_tokens <= kInlinePlanRows &&
         plan.groups.size() <= static_cast<size_t>(kInlinePlanRows) && plan.num_items < (int64_t{1} << 31) &&
         plan.max_score_floats < (int64_t{1} << 31);
}

InlinePlan make_inline_plan(const IndexerPlan& plan) {
  InlinePlan inl;
  inl.num_groups = static_cast<int32_t>(plan.groups.size());
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    inl.group_t0[g] = plan.groups[g].t0;
    inl.group_nt[g] = plan.groups[g].nt;
    inl.group_item_begin[g] = static_cast<int32_t>(plan.groups[g].item_begin);
  }
  for (size_t t = 0; t < plan.score_offset.size(); ++t) inl.score_offset[t] = static_cast<int32_t>(plan.score_offset[t]);
  return inl;
}

std::vector<ScoreItem> indexer_plan_items(const IndexerPlan& plan) {
  std::vector<ScoreItem> items;
  items.reserve(static_cast<size_t>(plan.num_items));
  for (size_t j = 0; j < plan.groups.size(); ++j) {
    const int64_t end = j + 1 < plan.groups.size() ? plan.groups[j + 1].item_begin : plan.num_items;
    for (int64_t i = plan.groups[j].item_begin; i < end; ++i) {
      items.push_back({plan.groups[j].t0, plan.groups[j].nt,
                       static_cast<int32_t>((i - plan.groups[j].item_begin) * kScoreKeys), 0});
    }
  }
  return items;
}

namespace {

// Item i belongs to the last group whose item_begin <= i (binary search; groups ascend by item_begin).
__global__ void expand_score_items_kernel(const ScoreGroup* __restrict__ groups, int64_t num_groups,
                                          ScoreItem* __restrict__ items, int64_t num_items) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_items) return;
  int64_t lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (groups[mid].item_begin <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const ScoreGroup g = groups[lo];
  items[i] = ScoreItem{g.t0, g.nt, static_cast<int32_t>((i - g.item_begin) * kScoreKeys), 0};
}

}  // namespace

Status launch_expand_score_items(const ScoreGroup* groups, int64_t num_groups, ScoreItem* items, int64_t num_items,
                                 const LaunchContext& ctx) {
  if (num_items == 0 || num_groups == 0) return Status::ok_status();
  const int64_t blocks = (num_items + 255) / 256;
  expand_score_items_kernel<<<static_cast<unsigned>(blocks), 256, 0, ctx.stream>>>(groups, num_groups, items, num_items);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("expand_score_items_kernel");
  return Status::ok_status();
}

Status indexer_topk_merge_supported(const IndexerTopkParams& p) {
  const TopkMergeParams& m = p.merge;
  if (m.num_rows == 0) return Status::ok_status();
  const std::string what = "indexer_topk: the fused candidate merge (IndexerTopkParams::merge) ";
  if (!p.signal.active() || !m.wait.active()) {
    return invalid_argument(what + "needs the row-synchronized exchange (signal and merge.wait active)");
  }
  if (m.num_rows != p.rows.num_tokens || m.K != p.K || m.num_parts != p.signal.size) {
    return invalid_argument(what + "has num_rows=" + std::to_string(m.num_rows) + ", K=" + std::to_string(m.K) +
                            ", num_parts=" + std::to_string(m.num_parts) + "; expected the top-k's T=" +
                            std::to_string(p.rows.num_tokens) + ", K=" + std::to_string(p.K) +
                            " and the exchange's size " + std::to_string(p.signal.size));
  }
  if (!topk_merge_on_device(m) || int64_t{m.num_parts} * m.K > merge_row_max_candidates()) {
    return unsupported(what + "supports parts x K <= " + std::to_string(merge_row_max_candidates()) + " (got " +
                       std::to_string(m.num_parts) + " x " + std::to_string(m.K) + ")");
  }
  if (m.part_topk != nullptr || m.part_scores != nullptr || m.topk == nullptr) {
    return invalid_argument(what + "takes its parts as one buffer each (part_topk_of / part_scores_of) and needs topk");
  }
  for (int32_t s = 0; s < m.num_parts; ++s) {
    if (m.part_topk_of[s] == nullptr || m.part_scores_of[s] == nullptr) {
      return invalid_argument(what + "has no buffer for part " + std::to_string(s));
    }
  }
  if (m.part_topk_of[p.signal.rank] != p.topk || m.part_scores_of[p.signal.rank] != p.topk_scores) {
    return invalid_argument(what + "must read this rank's part where the top-k writes it (topk / topk_scores)");
  }
  return Status::ok_status();
}

Status launch_indexer_topk(const IndexerTopkParams& p, const IndexerPlan& plan, const IndexerPlanDevice& dev,
                           const LaunchContext& ctx) {
  DSACP_RETURN_IF_ERROR(indexer_topk_supported(p));
  DSACP_RETURN_IF_ERROR(indexer_topk_merge_supported(p));
  for (const IndexerPlan::Chunk& ch : plan.chunks) {
    DSACP_RETURN_IF_ERROR(launch_indexer_scores(p, dev.items == nullptr ? nullptr : dev.items + ch.item_begin,
                                                ch.item_end - ch.item_begin, ch.max_group_tokens, dev.score_offset,
                                                dev.scores, dev.inl, ctx));
    DSACP_RETURN_IF_ERROR(
        launch_radix_select_topk(p, ch.t0, ch.t1, ch.max_len, dev.score_offset, dev.scores, dev.inl, ctx));
  }
  return Status::ok_status();
}

}  // namespace dsacp::cuda
