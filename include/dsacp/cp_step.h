// The context-parallel step: one rank's part (cp_step_run), and a local cluster that runs every rank of a
// layout as threads of this process over full-batch host tensors (what replay, run and the tests use).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/communicator.h"
#include "dsacp/cp_plan.h"
#include "dsacp/cp_step_plan.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"

namespace dsacp {

class RankWorkers;  // (src/core/rank_workers.h: one long-lived thread per rank)

// A rank's communicators: all Pt ranks (rank cr = r*D + d), its PCP group (the P ranks with the same d,
// rank r) and its DCP group (the D ranks with the same r, rank d).
struct CpComms {
  Communicator* world = nullptr;
  Communicator* pcp = nullptr;
  Communicator* dcp = nullptr;
};

// A rank's communicators, owned.
struct OwnedCpComms {
  std::unique_ptr<Communicator> world, pcp, dcp;
  CpComms view() const { return CpComms{world.get(), pcp.get(), dcp.get()}; }
};

// CP rank cr's NCCL communicators on options.device: the world of P*D ranks (from `id`), and the PCP group
// (same d, ranked by r) and DCP group (same r, ranked by d) split from it. Collective: every rank of the layout
// calls it, from its own thread or process.
Result<OwnedCpComms> nccl_cp_comms(const NcclId& id, const CpLayout& layout, int32_t cr, const NcclOptions& options);

// One CP rank's step, planned and run at once (cp_step_plan + cp_step_run of dsacp/cp_step_plan.h; a serving
// engine plans once per forward pass and runs each layer). `inputs` hold the rank's rows (plan.num_rows; padding rows may hold anything) with its
// heads only (q_nope/q_rope [rows, plan.num_heads, .]); `outputs` hold plan.output_rows rows of its heads:
// the rows' results, then graph-bucket rows (topk -1, out 0, lse -inf). The cache must have
// index_page_factor = Pt under the replicated indexer.
Status cp_step_run(Backend& backend, const CpComms& comms, const StepConfig& config,
                   const std::vector<Request>& requests, const CpRankPlan& plan, const CpLayout& layout,
                   const KvSharding& sharding, const BlockTable& table, PagedKvCache& cache, const StepInputs& inputs,
                   const StepOutputs& outputs);

// The KV sharding of a layout (Pt = P * D ranks, interleave I; I = 0 means the page size).
KvSharding cp_kv_sharding(const CpLayout& layout, int32_t page_size);
// One rank's cache configuration: per_rank_cache with index_page_factor = Pt under the replicated indexer.
PagedCacheConfig cp_rank_cache_config(const CpLayout& layout, const PagedCacheConfig& per_rank_cache);

// Writes the context rows (positions [0, context_len) of each request) that CP rank `cr` stores into `cache`:
// the positions it owns, and every indexer key under the replicated indexer. The cache must have the
// configuration cp_rank_cache_config gives.
Status cp_load_context_rank(Backend& backend, const CpLayout& layout, const KvSharding& sharding, int32_t cr,
                            const std::vector<Request>& requests, const BlockTable& table, const Tensor& ctx_latent,
                            const Tensor& ctx_rope, const Tensor& ctx_index_keys, PagedKvCache& cache,
                            const Tensor* ctx_index_key_scales = nullptr,
                            const Tensor* ctx_latent_scales = nullptr);
// "unsupported": FP8 prefill rows under the sharded indexer without DSA-CP (the gathered view of FP8 pages).
Status cp_fp8_unsupported();

// The plans of every rank of a layout (index cr = r * D + d).
Result<std::vector<CpRankPlan>> cp_all_rank_plans(const StepConfig& config, const std::vector<Request>& requests,
                                                  const CpLayout& layout, const BlockTable& table, int32_t page_size);

// One CP rank's step over the full batch's host inputs (Pt > 1): selects the rank's rows and heads, runs
// cp_step_run and returns the rank's output buffers (plan.output_rows rows of its heads). Every rank of the
// layout calls it (as threads or as processes) with the same inputs and its own plan, cache and comms.
Result<StepResult> cp_rank_step_host(Backend& backend, const CpComms& comms, const StepConfig& config,
                                     const std::vector<Request>& requests, const CpLayout& layout,
                                     const KvSharding& sharding, const BlockTable& table, const CpRankPlan& plan,
                                     PagedKvCache& cache, const HostStepInputs& inputs);

// The same under a plan made once (cp_step_plan; its block table is the one the run reads): one layer's step
// of a forward pass whose plan every layer shares.
Result<StepResult> cp_rank_step_host(Backend& backend, const CpComms& comms, const CpStepPlan& plan,
                                     PagedKvCache& cache, const HostStepInputs& inputs);

// The full batch's result ([T, ...] in token order) from every rank's result and plan (index cr).
Result<StepResult> cp_assemble_result(const StepConfig& config, const CpLayout& layout, int64_t T,
                                      const std::vector<CpRankPlan>& plans,
                                      const std::vector<StepResult>& rank_results);

// Every rank of a CP layout as threads of this process, each with its own cache pools; one shared block
// table per request (pages for the request's share on rank 0, the largest). A failing rank aborts the
// groups, so no rank hangs. Transports:
//   * one backend for every rank: the thread communicator (memcpy on the CPU; the backend's device copies
//     when the backend is a GPU: all ranks on one GPU, for tests);
//   * one backend per rank: CPU backends use the thread communicator; CUDA backends, each on a different
//     device, talk through NCCL (one thread per GPU; the communicators are made once, by create).
class LocalCpCluster {
 public:
  // per_rank_cache.index_page_factor is set from the layout (Pt under the replicated indexer).
  static Result<std::unique_ptr<LocalCpCluster>> create(Backend& backend, const CpLayout& layout,
                                                        const PagedCacheConfig& per_rank_cache);
  // rank_backends[cr] runs CP rank cr (P * D backends).
  static Result<std::unique_ptr<LocalCpCluster>> create(const std::vector<Backend*>& rank_backends,
                                                        const CpLayout& layout, const PagedCacheConfig& per_rank_cache);
  ~LocalCpCluster();
  const KvSharding& sharding() const { return sharding_; }
  const CpLayout& layout() const { return layout_; }
  int32_t num_ranks() const { return sharding_.Pt; }
  // "threads", "threads (device copies)" or "nccl".
  std::string transport() const;
  // Pages a request of S tokens needs in the shared block table.
  int64_t pages_needed(int64_t S) const { return sharding_.pages_needed(S, cache_config_.page_size); }
  size_t cache_bytes_per_rank() const;
  const PagedKvCache& cache(int32_t cr) const { return caches_.at(static_cast<size_t>(cr)); }

  // Writes each request's context rows (positions [0, context_len)) on the ranks that own them (and every
  // indexer key on every rank under the replicated indexer).
  Status load_context(const std::vector<Request>& requests, const BlockTable& table, const Tensor& ctx_latent,
                      const Tensor& ctx_rope, const Tensor& ctx_index_keys,
                      const Tensor* ctx_index_key_scales = nullptr, const Tensor* ctx_latent_scales = nullptr);
  // Runs one step on every rank; returns the full batch's results in token order. With `per_rank`, also
  // each rank's own output buffers as it returned them (plan.output_rows rows of its heads).
  Result<StepResult> step(const StepConfig& config, const std::vector<Request>& requests, const BlockTable& table,
                          const HostStepInputs& inputs, std::vector<StepResult>* per_rank = nullptr);
  // Each rank's world-communicator statistics over the last step (counts and bytes on both transports; times
  // only on NCCL).
  const std::vector<CommStats>& last_step_comm_stats() const { return comm_stats_; }
  // Each rank's statistics of its three communicators over the last step (the world's as above).
  struct GroupCommStats {
    CommStats world, pcp, dcp;
  };
  const std::vector<GroupCommStats>& last_step_group_comm_stats() const { return group_stats_; }

 private:
  LocalCpCluster() = default;
  Status make_nccl_comms();
  void release_nccl_comms();
  std::vector<Backend*> backends_;  // one per CP rank cr
  bool nccl_ = false;
  CpLayout layout_;
  KvSharding sharding_;
  PagedCacheConfig cache_config_;
  std::vector<PagedKvCache> caches_;  // one per CP rank cr
  std::vector<OwnedCpComms> comms_;   // NCCL: one per CP rank, made once (again after a failed step)
  std::vector<CommStats> comm_stats_;
  std::vector<GroupCommStats> group_stats_;
  std::unique_ptr<RankWorkers> workers_;  // one long-lived thread per CP rank: every rank's work runs there
};

// Host rows of `full` selected by `rows` (-1 = a zero row): [rows.size(), ...].
Result<Tensor> select_rows(const Tensor& full, const std::vector<int64_t>& rows);
// Rows of a [T, H, D] tensor selected by `rows` (-1 = a zero row), heads [h0, h0 + nh) only: [rows.size(), nh, D].
Result<Tensor> select_rows_heads(const Tensor& full, const std::vector<int64_t>& rows, int64_t h0, int64_t nh);

}  // namespace dsacp
