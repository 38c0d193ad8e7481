// Launchers of the indexer's two kernels (scores, then the per-row top-k), used by indexer_topk.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {

inline constexpr int kScoreKeys = 256;       // keys per score CTA
inline constexpr int kMaxGroupTokens = 4;    // tokens of one request sharing a score CTA

// Shared memory of one score CTA: Hi = 32 or 64, bf16 or fp8 (e4m3 q and two-plane keys).
int64_t indexer_scores_smem_bytes(int Hi, bool fp8, int max_group_tokens);
// items / score_offset: the chunk's device plan, unless inl holds the plan (inl.num_groups > 0). FP8 layouts the
// wgmma kernel serves go there; the rest (bf16, page sizes not a multiple of 4) to the mma.sync kernel.
Status launch_indexer_scores(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                             int max_group_tokens, const int64_t* score_offset, float* scores,
                             const InlinePlan& inl, const LaunchContext& ctx);

// The persistent wgmma score kernel (indexer_scores_wgmma.cu): FP8 q and keys, Hi = 32 or 64, page sizes that are
// multiples of 4 (16-byte aligned key rows and scale groups), groups of <= kMaxGroupTokens tokens. The one rule that
// picks it over the mma.sync kernel, applied in launch_indexer_scores; off by default: it is right on the GPU but
// about 2x slower than the mma.sync kernel at decode (docs/design/2026-12-02-persistent-score-kernel.md), so only
// the bench calls it (side by side) until its per-block chain is fixed.
inline constexpr bool kScoresWgmmaByDefault = false;
bool indexer_scores_wgmma_applies(const IndexerTopkParams& p, int max_group_tokens);
Status launch_indexer_scores_wgmma(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                                   int max_group_tokens, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx);

// Exact canonical top-k of tokens [t0, t1): row of token t = scores + score_offset[t] (16-byte aligned),
// key_len[t] <= max_len long.
Status launch_radix_select_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                                const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                                const LaunchContext& ctx);

#ifdef __CUDACC__
// Token t's score row offset, from the inline plan or the device plan.
__device__ __forceinline__ int64_t plan_score_offset(const InlinePlan& inl, const int64_t* dev, int64_t t) {
  return inl.num_groups > 0 ? int64_t{inl.score_offset[t]} : dev[t];
}
// Score item i: the device plan's, or found in the inline plan's groups (the last group whose first item <= i).
__device__ __forceinline__ ScoreItem plan_item(const InlinePlan& inl, const ScoreItem* items, int64_t i) {
  if (inl.num_groups == 0) return items[i];
  int lo = 0, hi = inl.num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (inl.group_item_begin[mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return ScoreItem{inl.group_t0[lo], inl.group_nt[lo], static_cast<int32_t>((i - inl.group_item_begin[lo]) * kScoreKeys),
                   0};
}
#endif

}  // namespace dsacp::cuda
