// The context-parallel step: one rank's part (pcp_step_run), and a local cluster that runs every rank of a
// layout as threads of this process over full-batch host tensors (what replay, run and the tests use).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/communicator.h"
#include "dsacp/cp_plan.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"

namespace dsacp {

// How decode tokens are attended under PCP.
enum class PcpDecodeMode {
  // Every rank takes the global top-k (indexer over the gathered indexer keys), attends over the keys it
  // stores, and the partial results are merged exactly by their LSE across ranks. Moves only indexer keys
  // and partial outputs; the default.
  kLocalMerge,
  // The reference design: every rank gathers the decodes' whole KV and attends over it.
  kGathered,
};

struct CpLayout {
  int32_t P = 1;                  // PCP ranks
  int32_t interleave = 0;         // KV interleave I; 0 = the page size
  PcpDecodeMode decode_mode = PcpDecodeMode::kLocalMerge;
  int64_t graph_bucket_tokens = 0;
};

// One PCP rank's step. `plan` is this rank's pcp_plan; `inputs` hold its local rows (plan.num_local_tokens
// rows; padding rows may hold anything); `outputs` hold plan.output_rows rows: the local rows' results, then
// zero rows up to the graph bucket (topk -1, out 0, lse -inf). The KV of the step is all-gathered and each
// token stored on its owner only; indexer + top-k and attention run for the local rows over gathered views.
Status pcp_step_run(Backend& backend, Communicator& comm, const StepConfig& config,
                    const std::vector<Request>& requests, const PcpRankPlan& plan, const KvSharding& sharding,
                    const BlockTable& table, PagedKvCache& cache, PcpDecodeMode decode_mode, const StepInputs& inputs,
                    const StepOutputs& outputs);

// Every rank of a CP layout as threads of this process, each with its own cache pools; one shared block
// table per request (pages for the request's share on rank 0, the largest). A failing rank aborts the group,
// so no rank hangs.
class LocalCpCluster {
 public:
  static Result<std::unique_ptr<LocalCpCluster>> create(Backend& backend, const CpLayout& layout,
                                                        const PagedCacheConfig& per_rank_cache);
  const KvSharding& sharding() const { return sharding_; }
  int32_t num_ranks() const { return sharding_.Pt; }
  // Pages a request of S tokens needs in the shared block table.
  int64_t pages_needed(int64_t S) const { return sharding_.pages_needed(S, cache_config_.page_size); }
  size_t cache_bytes_per_rank() const;
  const PagedKvCache& cache(int32_t rank) const { return caches_.at(static_cast<size_t>(rank)); }

  // Writes each request's context rows (positions [0, context_len)) on the ranks that own them.
  Status load_context(const std::vector<Request>& requests, const BlockTable& table, const Tensor& ctx_latent,
                      const Tensor& ctx_rope, const Tensor& ctx_index_keys);
  // Runs one step on every rank; returns the full batch's results in token order (prefill rows from the rank
  // that computed them, decode rows from rank 0).
  Result<StepResult> step(const StepConfig& config, const std::vector<Request>& requests, const BlockTable& table,
                          const HostStepInputs& inputs);

 private:
  LocalCpCluster() = default;
  Backend* backend_ = nullptr;
  CpLayout layout_;
  KvSharding sharding_;
  PagedCacheConfig cache_config_;
  std::vector<PagedKvCache> caches_;  // one per rank
};

// Host rows of `full` selected by `rows` (-1 = a zero row): [rows.size(), ...].
Result<Tensor> select_rows(const Tensor& full, const std::vector<int64_t>& rows);

}  // namespace dsacp
