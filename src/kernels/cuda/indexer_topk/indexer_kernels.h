// Launchers of the indexer's two kernels (scores, then the per-row top-k), used by indexer_topk.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {

inline constexpr int kScoreKeys = 256;       // keys per score CTA
inline constexpr int kMaxGroupTokens = 4;    // tokens of one request sharing a score CTA

int64_t indexer_scores_smem_bytes(int max_group_tokens);
Status launch_indexer_scores(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                             int max_group_tokens, const int64_t* score_offset, float* scores,
                             const LaunchContext& ctx);

// Exact canonical top-k of tokens [t0, t1): row of token t = scores + score_offset[t] (16-byte aligned),
// key_len[t] <= max_len long.
Status launch_radix_select_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                                const int64_t* score_offset, const float* scores, const LaunchContext& ctx);

}  // namespace dsacp::cuda
