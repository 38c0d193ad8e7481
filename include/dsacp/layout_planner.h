// The layout planner (`dsacp plan`): a cost model of one DSA layer step per rank, and the search over
// context-parallel layouts for a model, a context length, a batch and a cluster.
//
//   * cp_step_collectives: the collectives one step issues on one rank (group, kind, bytes, count), from the
//     same plan functions the executor runs (cp_rank_plan, gathered_view_plan), in the executor's order.
//   * PlannerCalibration: fitted kernel and link coefficients of one GPU kind (calibration/<gpu>.json, written by
//     scripts/plan_calibrate.py from bench/results).
//   * cp_step_cost: one step's time on its slowest rank, the collectives overlapped as the executor overlaps them.
//   * plan_layouts: every feasible layout for G GPUs ranked by prefill time (TTFT), decode time per token (TPOT)
//     and KV bytes per GPU.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dsacp/batch.h"
#include "dsacp/cp_plan.h"
#include "dsacp/paged_cache.h"
#include "dsacp/status.h"
#include "dsacp/step.h"

namespace dsacp {

// ---------------------------------------------------------------------------------------------------
// Collectives of one step.

enum class CommGroup : uint8_t { kWorld, kPcp, kDcp };
// kWindow: a zero-copy window exchange (Communicator::window_next) that a GPU communicator on one host takes
// instead of an all-gather; the thread and MPI transports never do.
enum class CommKind : uint8_t { kAllGather, kAllToAll, kWindow };
const char* comm_group_name(CommGroup g);
const char* comm_kind_name(CommKind k);

struct PlannedCollective {
  CommGroup group = CommGroup::kWorld;
  CommKind kind = CommKind::kAllGather;
  int32_t ranks = 1;       // the group's size
  int64_t bytes = 0;       // this rank sent: CommStats::bytes' convention (a part of b bytes sends b * (ranks - 1))
  int32_t parts = 1;       // buffers launched together as one collective
  bool blocking = false;   // the rank waits for it before its next kernel (nothing overlaps it)
  std::string what;        // "KV exchange", "gathered KV view", ...
};

// What shapes a step's exchanges besides the plan: the cache's storage and whether the communicator has
// exchange windows (NCCL ranks on one host).
struct CommContext {
  PagedCacheConfig cache;      // per-rank cache (page size, dims, dtypes, latent format)
  bool windows = false;        // window exchanges where the executor takes them
  bool index_keys = true;      // the step carries indexer keys (a precomputed top-k may come without)
  // The rows a rank packs for a gathered view from KvSharding alone (page-granular views: the requests' pages,
  // each request owning its pages; row-granular: rank 0's share), not from gathered_view_plan's full view:
  // O(requests) instead of O(positions). Equal for block tables whose requests own distinct pages (tested).
  bool light_views = false;
};

// The collectives CP rank `plan.cr` issues in one cp_step_run of `requests` (the indexer runs: no precomputed
// top-k). Validates what cp_step_run validates of the layout and the batch.
Result<std::vector<PlannedCollective>> cp_step_collectives(const StepConfig& config,
                                                           const std::vector<Request>& requests,
                                                           const CpLayout& layout, const CpRankPlan& plan,
                                                           const BlockTable& table, const CommContext& context);

// Sums in CommStats' terms: collectives and bytes of one group (window exchanges counted apart).
struct CollectiveTotals {
  int64_t collectives = 0, bytes = 0, windows = 0;
};
CollectiveTotals collective_totals(const std::vector<PlannedCollective>& list, CommGroup group);

// ---------------------------------------------------------------------------------------------------
// Calibration: per kernel t = launch + max(bytes / bandwidth, flops / throughput) (in ms), and the links.

struct KernelFit {
  double launch_us = 0;  // fixed cost a launch
  double gbs = 0;        // effective bandwidth (GB/s); 0 = not bandwidth-limited
  double tflops = 0;     // effective throughput; 0 = not compute-limited
  double ms(double bytes, double flops) const;
};

struct TopkFit {
  double launch_us = 0;
  double total_gelem_s = 0;  // elements a second over all rows (many rows in flight)
  double row_gelem_s = 0;    // elements a second within one row (the longest row's floor)
  double ms(double total_elems, double longest_row) const;
};

struct LinkFit {
  double latency_us = 0;
  double gbs = 0;  // bytes a rank sends a second (bus bandwidth)
  double ms(double sent_bytes) const;
};

struct PlannerCalibration {
  std::string gpu, version, source_commit, source_date, path;
  double memory_gib = 0;  // usable memory a GPU
  // Indexer scores (decode rows read their keys, prefill rows are flops), for Hi > 32 and Hi <= 32 (own rows).
  KernelFit indexer_bf16, indexer_fp8, indexer_bf16_hi32, indexer_fp8_hi32;
  TopkFit topk_decode, topk_prefill;         // top-k of rows of key_len scores
  KernelFit mla_decode, mla_prefill;         // sparse MLA: decode kernels (rows of decode tokens) and prefill
  KernelFit topk_merge, lse_merge;           // merges of per-rank candidates and partials
  double kv_phase_us = 0, kv_phase_ns_per_row = 0;  // the step's uploads and cache write
  double replicated_table_ns_per_page = 0;   // the replicated indexer's block table, built each step
  double host_step_us = 0;                   // the step's fixed host cost (plans, uploads, the end sync)
  LinkFit nvlink, window;                    // inside a node; window exchanges (latency: a publish)
};

Result<PlannerCalibration> parse_planner_calibration(std::string_view json_text);
Result<PlannerCalibration> load_planner_calibration(const std::string& path);

// Links between nodes: a group whose ranks are not all on one node moves at inter_node_gbs (each GPU's share of
// the node's network) with inter_node_latency_us more a collective.
struct ClusterLinks {
  int32_t gpus_per_node = 8;
  double inter_node_gbs = 50.0;  // 400 Gb/s InfiniBand a GPU
  double inter_node_latency_us = 5.0;
};

// ---------------------------------------------------------------------------------------------------
// One step's cost.

struct StepCost {
  double kv_ms = 0;         // KV exchange and cache write (the start of the step to the indexer)
  double indexer_ms = 0;    // scores, top-k, candidates' exchange and merge
  double attention_ms = 0;  // from the top-k to the step's end (waits for views, exchanges, merges)
  double step_ms = 0;       // the slowest rank's critical path
  double comm_ms = 0;       // link time of every collective of that rank (overlapped or not)
  int64_t comm_bytes = 0;   // bytes that rank sent, every group
  int64_t collectives = 0;
  int32_t rank = 0;         // the slowest rank (cr)
};

struct StepCostOptions {
  PagedCacheConfig cache;  // per rank (dims, dtypes, page size)
  ClusterLinks links;
  bool windows = true;     // NCCL on one node: window exchanges where the executor takes them
  // Ranks whose cost is evaluated (the slowest is the step's): every rank up to this many, else the first and
  // the last (the ranks' shares differ only at the edges).
  int32_t all_ranks_up_to = 8;
  // A batch of one prefill: the rank's rows from planner_prefill_rank_plan (O(rows of the rank)) instead of
  // cp_rank_plan (O(tokens of the batch), with every rank's gathered order). The same cost either way (tested).
  bool light_prefill_plans = false;
};

// The fields of cp_rank_plan the cost model reads, for a batch of one prefill request (query_len above the decode
// threshold), from the plan's own split functions (pcp_prefill_offsets, dsa_cp_slice): num_rows, num_shared_rows,
// num_heads, head_begin, output_rows, layout, row_request, row_key_len, pcp.num_local_decode_tokens, and under DSA-CP
// gathered_request / gathered_pos. Left empty: row_token, the PCP plan's vectors, and without DSA-CP gathered_*
// (the exchange gathers P x num_rows rows).
Result<CpRankPlan> planner_prefill_rank_plan(const Request& request, const CpLayout& layout, int32_t r, int32_t d,
                                             int32_t decode_threshold, int32_t H);

Result<StepCost> cp_step_cost(const PlannerCalibration& cal, const StepConfig& config,
                              const std::vector<Request>& requests, const CpLayout& layout,
                              const StepCostOptions& options);

// ---------------------------------------------------------------------------------------------------
// The layout search.

struct ModelDims {
  std::string name;
  int32_t layers = 0, H = 0, Dl = 0, Dr = 0, Hi = 0, Di = 0, K = 0;
  CaseDims dims() const { return CaseDims{H, Dl, Dr, Hi, Di}; }
};
// "deepseek-v3.2", "glm-5"; anything else is refused naming the known ones.
Result<ModelDims> model_dims(const std::string& name);

struct PlanQuery {
  ModelDims model;
  int64_t context = 0;             // prompt tokens; decodes see this context
  int32_t batch = 1;               // requests decoding together (split over data-parallel replicas)
  int32_t gpus = 1;
  ClusterLinks links;
  DType kv_dtype = DType::kBF16;   // kBF16 or the fp8_ds_mla record format (kv_fp8)
  bool kv_fp8 = false;
  DType index_dtype = DType::kBF16;  // kBF16 or kF8E4M3
  double memory_per_gpu_gib = 0;   // 0: the calibration's
  int64_t prefill_chunk = 0;       // prompt tokens a step (each chunk a step with the chunks before as context);
                                   // 0: 8192 a PCP rank (DSA-CP: 8192 a rank, at most 65536)
  int32_t page_size = 64;
  int64_t decode_tokens = 1024;    // a request's output tokens: the ranking's weight of TPOT against TTFT
  bool fixed = false;              // evaluate fixed_layout only (its P * D must divide gpus)
  CpLayout fixed_layout;
};

// The step the planner costs for a query: the model's shapes, bf16 activations and outputs, the query's indexer
// dtype (the softmax scale does not change a cost: 1).
StepConfig plan_step_config(const PlanQuery& q);

struct LayoutChoice {
  CpLayout layout;
  int32_t replicas = 1;       // data-parallel copies of the layout (G / (P * D))
  int32_t batch_per_replica = 1;
  std::string name;           // "P2 D4 sharded", "D8 dsa-cp replicated", ...
  double ttft_ms = 0;         // prompt prefill, every layer
  double tpot_ms = 0;         // one decode step of the replica's batch, every layer
  StepCost decode_step;       // one layer
  StepCost last_prefill_step; // the prompt's last chunk, one layer
  uint64_t kv_bytes_per_gpu = 0;      // every layer's KV cache at the full context
  uint64_t memory_per_gpu = 0;        // KV plus the step's buffers (the memory estimate)
  bool feasible = true;
  std::string refused;        // why it is not feasible
  std::string loses;          // why it was not chosen (empty for the chosen one)
};

struct PlanAnswer {
  std::vector<LayoutChoice> layouts;  // feasible ones ranked (best first), then refused ones
  int32_t chosen = -1;                // index into layouts, -1 when none is feasible
  int64_t layouts_considered = 0;
};

// The layouts: P x D dividing G (G / (P * D) data-parallel replicas, each with ceil(batch / replicas) requests),
// D dividing H (or DSA-CP with P = 1), both indexer modes; ranked by a request's time to its last token,
// TTFT + decode_tokens x TPOT (ties: less KV a GPU). Refuses in one line what no layout can serve: more GPUs than
// tokens, a fixed layout whose heads do not divide, memory below the smallest layout's need.
Result<PlanAnswer> plan_layouts(const PlanQuery& query, const PlannerCalibration& cal);

// The layout's display name.
std::string layout_name(const CpLayout& layout);

}  // namespace dsacp
