// The plan of one CP rank (r, d) of a P x D layout.
#include <numeric>
#include <string>

#include "dsacp/cp_plan.h"

namespace dsacp {

Status validate_layout(const CpLayout& l, int32_t H) {
  if (l.P < 1) return invalid_argument("PCP size must be >= 1, got " + std::to_string(l.P));
  if (l.D < 1) return invalid_argument("DCP size must be >= 1, got " + std::to_string(l.D));
  if (l.interleave < 0) return invalid_argument("interleave must be >= 1 (or 0 = the page size), got " +
                                                std::to_string(l.interleave));
  if (l.graph_bucket_tokens < 0) return invalid_argument("graph bucket must be >= 0");
  if (l.dsa_cp && l.P > 1) {
    return unsupported("DSA-CP with PCP (P = " + std::to_string(l.P) + "): DSA-CP shards tokens inside a DCP group; "
                       "use --pcp 1 with --dsa-cp");
  }
  if (!l.dsa_cp && H % l.D != 0) {
    return invalid_argument("DCP splits the " + std::to_string(H) + " query heads over " + std::to_string(l.D) +
                            " ranks: H must be a multiple of D (or use --dsa-cp, which splits tokens)");
  }
  if (l.decode_mode == DecodeMode::kGathered && l.D > 1) {
    return unsupported("gathered decodes with DCP (D = " + std::to_string(l.D) +
                       "): DCP decodes attend locally and merge by LSE");
  }
  return Status();
}

Result<CpRankPlan> cp_rank_plan(const std::vector<Request>& requests, const CpLayout& layout, int32_t r, int32_t d,
                                const BlockTable& table, int32_t page_size, int32_t decode_threshold, int32_t H) {
  DSACP_RETURN_IF_ERROR(validate_layout(layout, H));
  if (r < 0 || r >= layout.P || d < 0 || d >= layout.D) {
    return invalid_argument("CP rank (" + std::to_string(r) + ", " + std::to_string(d) + ") outside the " +
                            std::to_string(layout.P) + " x " + std::to_string(layout.D) + " layout");
  }
  CpRankPlan plan;
  plan.P = layout.P;
  plan.D = layout.D;
  plan.r = r;
  plan.d = d;
  plan.cr = r * layout.D + d;
  const KvSharding sharding{layout.num_ranks(), layout.interleave == 0 ? page_size : layout.interleave};
  PcpOptions options;
  options.P = layout.P;
  options.decode_threshold = decode_threshold;
  options.graph_bucket_tokens = layout.graph_bucket_tokens;
  DSACP_ASSIGN_OR_RETURN(plan.pcp, pcp_plan(requests, options, r, sharding, plan.cr, table, page_size));
  plan.layout = plan.pcp.layout;
  const std::vector<int64_t>& qs = plan.layout.query_start;

  if (!layout.dsa_cp) {
    // Rows: this PCP rank's rows; heads: slice d of H.
    const PcpRankPlan& p = plan.pcp;
    plan.num_rows = p.num_local_tokens;
    for (int64_t i = 0; i < plan.num_rows; ++i) {
      plan.row_token.push_back(p.row_is_pad[i] ? -1 : qs[p.row_request[i]] + p.row_offset[i]);
    }
    plan.row_request = p.row_request;
    plan.row_key_len = p.row_key_len;
    plan.num_shared_rows = layout.P == 1 ? plan.num_rows : p.num_local_decode_tokens;
    plan.num_heads = H / layout.D;
    plan.head_begin = d * plan.num_heads;
    plan.gathered_request = p.gathered_request;
    plan.gathered_pos = p.gathered_pos;
    plan.output_rows = p.output_rows;
    return plan;
  }

  // DSA-CP (P = 1): the batch's tokens padded to a multiple of D, rank d takes slice d with all heads.
  DSACP_ASSIGN_OR_RETURN(DsaCpSlice slice, dsa_cp_slice(requests, layout.D, d));
  const int64_t T = plan.layout.num_tokens;
  std::vector<int32_t> token_request(static_cast<size_t>(T));
  for (size_t b = 0; b + 1 < qs.size(); ++b) {
    for (int64_t t = qs[b]; t < qs[b + 1]; ++t) token_request[t] = static_cast<int32_t>(b);
  }
  auto key_len_of = [&](int64_t t) {
    const int32_t b = token_request[t];
    return static_cast<int32_t>(requests[b].context_len + (t - qs[b]) + 1);
  };
  for (int64_t t = slice.local_start; t < slice.local_end_with_pad; ++t) {
    const bool real = t < T;
    plan.row_token.push_back(real ? t : -1);
    plan.row_request.push_back(real ? token_request[t] : 0);
    plan.row_key_len.push_back(real ? key_len_of(t) : 0);
  }
  plan.num_rows = slice.local_end_with_pad - slice.local_start;
  plan.num_shared_rows = 0;  // every rank holds its own slice
  plan.num_heads = H;
  plan.head_begin = 0;
  // The KV exchange gathers every rank's slice: row j is token j of the padded batch.
  for (int64_t t = 0; t < slice.num_tokens_pad; ++t) {
    const bool real = t < T;
    plan.gathered_request.push_back(real ? token_request[t] : -1);
    plan.gathered_pos.push_back(real ? key_len_of(t) - 1 : -1);
  }
  plan.output_rows = plan.num_rows;
  return plan;
}

CpGatheredRows cp_gathered_rows(const CpRankPlan& plan, const CpLayout& layout, int32_t num_requests) {
  CpGatheredRows g;
  g.first_gathered = plan.num_rows;
  g.local_decode_rows = layout.dsa_cp ? 0 : plan.pcp.num_local_decode_tokens;
  if (layout.dsa_cp) {
    if (plan.layout.num_prefills > 0) {
      g.first_gathered = 0;
      g.view_ids.resize(static_cast<size_t>(num_requests));
      std::iota(g.view_ids.begin(), g.view_ids.end(), 0);
    }
    return g;
  }
  const bool local_decodes = layout.decode_mode == DecodeMode::kLocalMerge;
  g.first_gathered = local_decodes ? g.local_decode_rows : 0;
  for (int32_t b = local_decodes ? plan.layout.num_decodes : 0; b < num_requests; ++b) g.view_ids.push_back(b);
  return g;
}

}  // namespace dsacp
