// The exact canonical top-k's kernels and how a launch picks one (cluster_topk.cu, radix_select_topk.cu).
// launch_radix_select_topk (indexer_kernels.h) is launch_topk_rows with the default options.
#pragma once

#include <cstdint>

#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::cuda {

// How a top-k launch runs. The default (all fields as below) picks by the rows' count and length; the other
// values exist for the benchmarks and the tests, which compare the forms on the same scores.
struct TopkLaunchOptions {
  int cluster = 0;       // CTAs per row of the cluster kernel: 0 = chosen (rows x CTAs about 4 per SM), 1, 2, 4, 8
  int cache = -1;        // rank keys of each CTA's slice kept in shared memory after the first pass (the rest read
                         // again from L2): -1 = the whole slice where every CTA of the launch stays resident with it
                         // (at most 4 an SM), else none; 0 = none; 1 = as many as one CTA holds
  bool one_cta = false;  // the one-CTA, 1024-thread radix select (the form the fused merge, kMerge, always takes)
};

// Exact canonical top-k of tokens [t0, t1) (the contract of launch_radix_select_topk), in the form `opt` asks.
// A fused merge (p.merge.num_rows > 0) and a row-synchronized exchange (p.signal active) take the one-CTA form.
Status launch_topk_rows(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                        const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                        const LaunchContext& ctx, const TopkLaunchOptions& opt);

// The one-CTA form (radix_select_topk.cu).
Status launch_radix_select_one_cta(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                                   const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                                   const LaunchContext& ctx);

// The cluster form (cluster_topk.cu): `cluster` CTAs of 256 threads per row (1, 2, 4 or 8); cache as above.
Status launch_cluster_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                           const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                           const LaunchContext& ctx, int cluster, int cache);

}  // namespace dsacp::cuda
