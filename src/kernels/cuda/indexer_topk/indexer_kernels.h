// Launchers of the indexer's two kernels (scores, then the per-row top-k), used by indexer_topk.cu.
#pragma once

#include <cstdint>

#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {

inline constexpr int kScoreKeys = 256;       // keys per score CTA
inline constexpr int kMaxGroupTokens = 4;    // tokens of one request sharing a score CTA

// Shared memory of one score CTA: Hi = 32 or 64, bf16 or fp8 (e4m3 q and two-plane keys).
int64_t indexer_scores_smem_bytes(int Hi, bool fp8, int max_group_tokens);
// items / score_offset: the chunk's device plan, unless inl holds the plan (inl.num_groups > 0). The kernel: the
// persistent wgmma one or the mma.sync one (the rule below); bf16 and page sizes not a multiple of 4 always run
// the mma.sync kernel.
Status launch_indexer_scores(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                             int max_group_tokens, const int64_t* score_offset, float* scores,
                             const InlinePlan& inl, const LaunchContext& ctx);

// The arguments both score kernels take (each kernel's own struct derives from it), filled in one place.
struct ScoreKernelArgs {
  const ScoreItem* items;
  int64_t num_items;
  const int32_t* request;     // [T]
  const int32_t* key_len;     // [T]
  const unsigned char* q;     // [T, Hi, 128] bf16 or e4m3
  const float* q_scale;       // [T, Hi] (fp8)
  const float* w;             // [T, Hi]
  const unsigned char* keys;  // bf16 rows [num_pages * page_size, 128], or fp8 two-plane pages
  const int32_t* block_table;
  int32_t page_size, max_pages;
  int64_t num_pages;
  int64_t page_stride;          // bytes from one page of keys to the next
  const int64_t* score_offset;  // [T]
  float* scores;
  DeviceErrorWord err;
  InlinePlan inl;  // the plan itself (inl.num_groups > 0: items and score_offset unused)
};
inline void fill_score_kernel_args(ScoreKernelArgs& a, const IndexerTopkParams& p, const ScoreItem* items,
                                   int64_t num_items, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx) {
  a.inl = inl.num_groups > 0 ? inl : InlinePlan{};
  a.items = items;
  a.num_items = num_items;
  a.request = p.rows.request;
  a.key_len = p.rows.key_len;
  a.q = static_cast<const unsigned char*>(p.q);
  a.q_scale = p.q_scale;
  a.w = p.w;
  a.keys = static_cast<const unsigned char*>(p.keys.data);
  a.block_table = p.block_table.data;
  a.page_size = p.keys.page_size;
  a.max_pages = p.block_table.max_pages;
  a.num_pages = p.keys.num_pages;
  a.page_stride = pool_page_stride(p.keys);
  a.score_offset = score_offset;
  a.scores = scores;
  a.err = ctx.error;
}

// The persistent wgmma score kernel (indexer_scores_wgmma.cu): FP8 q and keys, Hi = 32 or 64, page sizes that are
// multiples of 4 (16-byte aligned key rows and scale groups), groups of <= kMaxGroupTokens tokens.
// indexer_scores_wgmma_applies is the rule of where it can run; launch_indexer_scores runs it there unless
// ctx.options.indexer_score_kernel says kMmaSync, or says kAuto and indexer_scores_wgmma_preferred (the measured
// rule, docs/design/2026-12-02-persistent-score-kernel.md) is false.
bool indexer_scores_wgmma_applies(const IndexerTopkParams& p, int max_group_tokens);
bool indexer_scores_wgmma_preferred(const IndexerTopkParams& p, int max_group_tokens);
// Its math loop follows ctx.options.indexer_score_kernel: kWgmmaV5 = v5 (one accumulator set a warpgroup), kWgmmaV6
// = v6 (two; docs/design/2026-12-03-score-kernel-v6.md), else v7 (v6 with a 128B-swizzled stage by tensor copies,
// conversions without shifts, the chain epilogue at one token a pass; docs/design/2026-12-03-score-kernel-v7.md).
Status launch_indexer_scores_wgmma(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                                   int max_group_tokens, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx);
// The same with the variant named (the benchmark's same-run comparisons): version 5, 6 or 7; math warpgroups a CTA
// (0: the rule; 2 is also built for v6 at heads x group tokens <= 64, where the rule says 3); v7's epilogue at one
// token a pass (0: the rule = the chain, 1: v6's reduce-scatter) and its swizzled stage (page sizes % 64 == 0).
struct ScoreWgmmaVariant {
  int version = 7;
  int math_warpgroups = 0;
  int epilogue = 0;
  bool tma_stage = true;
};
Status launch_indexer_scores_wgmma(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                                   int max_group_tokens, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx, const ScoreWgmmaVariant& v);

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
