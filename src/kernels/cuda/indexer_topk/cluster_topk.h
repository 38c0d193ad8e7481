// The exact canonical top-k's kernels and how a launch picks one (cluster_topk.cu, radix_select_topk.cu).
// launch_radix_select_topk (indexer_kernels.h) is launch_topk_rows with the default options.
#pragma once

#include <cstdint>

#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::cuda {

// The kernel family of the exact top-k: the cluster kernel (cluster_topk.cu: the slice walked once a digit, in
// shared memory or L2) or the register form (register_topk.cu: each thread a contiguous chunk, one walk for the first
// digit, the later digits over the boundary bin's candidates) or the filter form (filter_topk.cu: two walks over
// the keys, the boundary bin's candidates resolved alone, the output from position bitmaps). kAuto = the rule in
// launch_topk_rows (kDefaultTopkForm).
enum class TopkForm { kAuto = 0, kCluster = 1, kRegister = 2, kFilter = 3 };

// The form a launch with form = kAuto takes: the one place the default kernel is chosen. kFilter: the filter form
// wherever its bitmaps fit (slices up to ~700K keys: every decode and prefill row up to 5M keys), measured faster
// than the other forms at every shape benchmarked (decode b = 64 at 32K-128K, the 8192 causal prefill, one 1M row);
// rows too long for it take the register form's rule below (kRegister: the register form where its cluster is 2
// CTAs or more, else the cluster kernel).
inline constexpr TopkForm kDefaultTopkForm = TopkForm::kFilter;

// The register form's candidate buffer (keys of the boundary bin, for the whole cluster of a row); a row whose
// boundary bin holds more (heavy ties) takes the form's fallback, which walks the chunks for the later digits.
inline constexpr int kRegisterTopkCandidates = 8192;

// How a top-k launch runs. The default (all fields as below) picks by the rows' count and length; the other
// values exist for the benchmarks and the tests, which compare the forms on the same scores.
struct TopkLaunchOptions {
  int cluster = 0;       // CTAs per row of the cluster kernel: 0 = chosen (rows x CTAs about 4 per SM), 1, 2, 4, 8
  int cache = -1;        // rank keys of each CTA's slice kept in shared memory after the first pass (the rest read
                         // again from L2): -1 = the whole slice where every CTA of the launch stays resident with it
                         // (at most 4 an SM), else none; 0 = none; 1 = as many as one CTA holds
  bool one_cta = false;  // the one-CTA, 1024-thread radix select (the form the fused merge, kMerge, always takes)
  TopkForm form = TopkForm::kAuto;  // the cluster kernel or the register form (its cluster 0 = register_topk_cluster;
                                    // cache unused) or the filter form (cluster 0 = filter_topk_cluster)
  int threads = 0;  // the filter form's threads a CTA: 0 = filter_topk_threads, 256, 512 or 1024
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

// The register form's cluster size for `rows` rows of at most max_len keys (cluster = 0 in TopkLaunchOptions).
int register_topk_cluster(int64_t rows, int32_t max_len, const LaunchContext& ctx);

// The register form (register_topk.cu): `cluster` CTAs of 256 threads per row (1, 2, 4 or 8).
Status launch_register_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                            const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                            const LaunchContext& ctx, int cluster);

// The filter form (filter_topk.cu): `cluster` CTAs of `threads` threads per row (1, 2, 4 or 8; 256, 512 or 1024).
// Rows whose slices' position bitmaps do not fit a CTA's shared memory (filter_topk_fits false: slices of more than
// ~700K keys) are refused; the default rule sends them to another form.
Status launch_filter_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                          const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                          const LaunchContext& ctx, int cluster, int threads);
bool filter_topk_fits(int32_t max_len, int cluster, int threads);
// The filter form's threads a CTA for `rows` rows (threads = 0), and its cluster (cluster = 0): the smallest whose
// rows x C fill the SMs, within one wave where a smaller cluster fits.
int filter_topk_threads(int64_t rows, int32_t max_len, const LaunchContext& ctx);
int filter_topk_cluster(int64_t rows, int32_t max_len, int threads, const LaunchContext& ctx);

}  // namespace dsacp::cuda
