// What one CP rank's planned step holds (CpStepPlan::Impl) and what its run passes between its stages
// (RankStep): shared by cp_step_plan.cc (the plan), cp_step.cc (the run's order), cp_step_views.cc (the gathered
// KV and indexer views), cp_step_topk.cc (the sharded indexer's merged top-k) and cp_step_decodes.cc (the local
// decodes merged by LSE).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "dsacp/cp_step.h"
#include "dsacp/cp_step_plan.h"
#include "layer/run_scratch.h"
#include "layer/step_checks.h"

namespace dsacp {

// A gathered view's plan with its index vectors in backend memory.
struct DeviceViewPlan {
  GatheredViewPlan host;
  DeviceBuffer storage;  // [pack_slots | unpack_rows | view_table]
  const int64_t* pack_slots = nullptr;
  const int64_t* unpack_rows = nullptr;
  const int32_t* view_table = nullptr;
};

struct CpStepPlan::Impl {
  Backend* backend = nullptr;
  StepConfig config;
  std::vector<Request> requests;
  CpRankPlan rank;
  CpLayout layout;
  KvSharding sharding;
  BlockTable table;  // the host table (its shape; the views' plans were made from it)
  PagedCacheConfig cache;
  int64_t pages_needed = 0;
  std::vector<int64_t> seq_lens;
  CpGatheredRows gathered_rows;
  bool replicated = false, fp8 = false;
  bool enqueue_only = false;  // CpStepPlanOptions::enqueue_only
  std::vector<int32_t> row_local_len;  // the rows' key lengths over this rank's own keys

  // Device tables: the block table (the caller's or uploaded), and one upload of the rows' requests, key
  // lengths, local key lengths and the exchanged rows' slots (own, and every rank's indexer slots when replicated).
  DeviceBuffer table_storage;
  const int32_t* d_table = nullptr;
  DeviceBuffer rows;
  const int32_t* d_row_request = nullptr;
  const int32_t* d_row_key_len = nullptr;
  const int32_t* d_row_local_len = nullptr;
  const int64_t* d_owned = nullptr;
  const int64_t* d_all = nullptr;

  BlockTable rep_table;  // the replicated indexer's table, and its device copy
  DeviceBuffer d_rep;

  // DSA-CP: every token of the padded batch (T_all rows): key lengths, requests, local key lengths.
  std::vector<int32_t> all_key_len, all_request, all_local_len;
  DeviceBuffer all_rows;  // [request | local key length]
  const int32_t* d_all_request = nullptr;
  const int32_t* d_all_local_len = nullptr;

  // The sharded indexer's PCP prefill rows: the gathered view of every request's indexer keys.
  std::optional<DeviceViewPlan> index_view;
  // Rows [first_gathered, rows): the gathered KV view of gathered_rows.view_ids, and each row's view row.
  std::optional<DeviceViewPlan> kv_view;
  DeviceBuffer d_rows_view;

  // The local decodes (rows [0, local_decode_rows)): whether the head-gathered queries are used in place
  // (direct), the head-gather's row order, and the partials' pack order by head (when not direct).
  bool q_heads = false, decodes_direct = false;
  DeviceBuffer d_heads_order, d_pack;

  // The runs' device buffers (run_scratch.h): after a plan's first run, its runs allocate nothing.
  mutable RunScratch scratch;
};

struct View {
  DeviceBuffer storage;
  PagedPoolView pool;
};

// A gathered view in flight: this rank's rows packed, the all-gather started.
struct PendingView {
  const DeviceViewPlan* plan = nullptr;
  PagedPoolView own;
  DeviceBuffer pack, gathered;
  std::unique_ptr<CollectiveHandle> handle;
  int64_t ranks = 0;
};

// Everything one rank needs while it runs a step.
struct RankStep {
  Backend& backend;
  const CpComms& comms;
  const CpStepPlan::Impl& p;
  PagedKvCache& cache;
  const StepInputs& in;
  const StepOutputs& out;
  RunScratch& scratch;  // the plan's: every device buffer of the run comes from it
  // Collectives the backend's stream waits for on the device; the host waits for them (bounded) at the end.
  std::vector<std::unique_ptr<CollectiveHandle>> in_flight;
  // Communicators with a row-synchronized window exchange in this step (window_rows): after the step's
  // synchronize, window_rows_check reports a consumer's wait that gave up. No end event on the stream (one between
  // the consumer and the next kernel costs the stream a few microseconds; one at the end, and the host's wait for
  // it, cost the step's tail), no handle: the kernels' row waits are bounded by themselves.
  std::vector<Communicator*> rows_checked_at_end;
  std::vector<DeviceBuffer> kv_rows;  // the step's gathered KV rows (the cache write reads them on the device)

  const StepConfig& c() const { return p.config; }
  const CpRankPlan& plan() const { return p.rank; }
  int32_t B() const { return p.cache.page_size; }
  size_t act() const { return dtype_size(p.config.act_dtype); }
  // The run's next device buffer of `bytes` bytes (RunScratch::take).
  Result<DeviceBuffer> take(size_t bytes) { return scratch.take(backend, bytes); }
};

template <typename T>
T* offset_ptr(T* p, int64_t elements) {
  return p == nullptr ? nullptr : p + elements;
}
inline void* offset_bytes(void* p, int64_t bytes) { return p == nullptr ? nullptr : static_cast<char*>(p) + bytes; }
inline const void* offset_bytes(const void* p, int64_t bytes) {
  return p == nullptr ? nullptr : static_cast<const char*>(p) + bytes;
}

// Rows src[index[i]] -> dst (with dtype conversion), rows of `dim` elements; the index in device memory.
// src_stride: elements from one source row to the next (0: dim); src_page_pad more elements after every
// src_page_rows rows (a padded pool's pages; GatherRowsParams).
Status gather_dev(Backend& backend, const void* src, DType src_dtype, int64_t src_rows, int32_t dim,
                  const int64_t* d_index, int64_t n, void* dst, DType dst_dtype, const char* what,
                  int64_t src_stride = 0, int64_t src_page_rows = 0, int64_t src_page_pad = 0);

// Orders the backend's later work after the collective: on the device when the transport can (the host then
// waits for it at the step's end, bounded), else by waiting now.
Status after(RankStep& s, std::unique_ptr<CollectiveHandle> h);
// The communicator, with its next collectives ordered after the work enqueued so far on the backend's current
// lane (the producer of their inputs; Backend lanes move it between streams).
Communicator& producing(RankStep& s, Communicator& c);
// The step's end checks comm's row-synchronized exchanges (Communicator::window_rows_check), once a communicator.
void check_rows_at_end(RankStep& s, Communicator* comm);
// A window exchange of `bytes` on `comm` (Communicator::window_next), or nothing where the communicator has no
// window for it (the caller then uses the collectives). Other errors (a failed communicator) are returned.
Result<std::optional<Communicator::Window>> try_window(const RankStep& s, Communicator& comm, size_t bytes);
// The window exchange's synchronization by the kernels themselves, row by row (Communicator::window_rows).
Result<WindowRowSync> try_window_rows(const CpLayout& layout, Communicator& comm, int64_t rows, bool topk_exchange);

// ---- gathered views (cp_step_views.cc)
Result<DeviceViewPlan> upload_view_plan(Backend& backend, GatheredViewPlan plan);
Result<PendingView> start_view(RankStep& s, Communicator& comm, const PagedPoolView& own, const DeviceViewPlan& v);
Result<View> finish_view(RankStep& s, PendingView& pv);
// The latent and rope views of the requests attended over the gathered KV, started early.
// The group's handle is the last member, so it is destroyed first: a rank that returns early (an error) waits
// for the gather before either view's buffers are freed (the last rank to post may still be copying into them).
struct PendingKvView {
  PendingView latent, rope;
  std::unique_ptr<CollectiveHandle> handle;
};
Result<PendingKvView> start_kv_view(RankStep& s);
// Attention of rows [first, first + n) with this rank's heads over the gathered view of the requests' KV.
Status gathered_attention(RankStep& s, int64_t first, int64_t n, PendingKvView& kv);

// ---- the sharded indexer's merged top-k (cp_step_topk.cc)
// The merged top-k of `n` rows in flight: the local top-k (with scores) over this rank's own indexer keys is
// enqueued and its exchange over the world group started; finish_merged_topk waits for the candidates and
// merges them exactly. All ranks must hold the same rows in the same order.
struct PendingTopk {
  int64_t n = 0;
  int32_t* topk = nullptr;
  int32_t* local_topk = nullptr;  // optional: the merged rows remapped to this rank's local positions
  bool fused = false;             // the top-k merged the rows (no merge kernel)
  DeviceBuffer part_topk, part_scores, all_topk, all_scores;
  std::optional<Communicator::Window> window;  // every rank's [n, K] positions, then [n, K] scores
  WindowRowSync rows;  // the window synchronized row by row by the top-k and the merge (else a publish)
  std::unique_ptr<CollectiveHandle> handle;
};
// The rows: their requests and local key lengths (device and host).
struct MergedTopkRows {
  int64_t n = 0;
  const int32_t* request = nullptr;
  const int32_t* host_request = nullptr;
  const int32_t* local_len = nullptr;
  const int32_t* host_local_len = nullptr;
};
Result<PendingTopk> start_merged_topk(RankStep& s, const MergedTopkRows& rows, const void* q, const float* q_scale,
                                      const float* w, int32_t* topk, int32_t* local_topk = nullptr);
Status finish_merged_topk(RankStep& s, PendingTopk& pt);

// ---- attention over own keys and the LSE merges (cp_step_decodes.cc)
// Partial attention of `n` rows (all heads) over this rank's own keys: the global top-k remapped to local
// positions (into local_topk), then the sparse MLA over the local key lengths.
Status partial_attention_own_keys(RankStep& s, int64_t n, const void* q_nope, const void* q_rope, const int32_t* request,
                                  const int32_t* d_local_len, const int32_t* global_topk, int32_t* local_topk,
                                  void* part_out, float* part_lse, int32_t head_blocks = 1,
                                  DType part_dtype = DType::kF32, bool remapped = false);
// LSE merge of `parts` partial results [parts, rows, Dl] (part_dtype) into out and lse.
Status merge_into(RankStep& s, int32_t parts, int64_t rows, const void* part_out, const float* part_lse, void* out,
                  float* lse, DType part_dtype = DType::kF32);
// All rows' queries of `n` rows gathered along heads over the DCP group (rank-major blocks [D][n, Hr, dim]).
struct PendingHeads {
  DeviceBuffer nope_blocks, rope_blocks;
  std::unique_ptr<CollectiveHandle> handle;
};
Result<PendingHeads> start_head_gather(RankStep& s, const void* q_nope, const void* q_rope, int64_t n);
// The local decodes (rows [0, n) over each rank's own keys, merged by LSE across the world group) in two
// halves: prepare_local_decodes does what does not need the top-k (buffers, the exchange window), so that under
// the sharded indexer it is issued while the candidates are still being computed; run_local_decodes remaps the
// top-k, attends, exchanges and merges.
struct LocalDecodes {
  int64_t n = 0;
  // The partial outputs' dtype: the step's output dtype when that is bf16 (the result is rounded to bf16
  // anyway; half the all-to-all's bytes), else f32.
  DType part_dtype = DType::kF32;
  // One PCP rank (the all-to-all's blocks are the DCP head slices): attention reads the head-gathered queries
  // in their block layout and writes its partials straight in the all-to-all's send layout (no reordering).
  bool direct = false;
  bool remapped = false;  // local_topk written by the candidate merge (the sharded indexer)
  const void* qn = nullptr;
  const void* qr = nullptr;
  PendingHeads* q_heads = nullptr;  // queries gathered along heads, laid out as rows by run_local_decodes
  DeviceBuffer full_qn, full_qr, local_topk, part_out, part_lse, send_out, send_lse, recv_out, recv_lse;
  // Where the all-to-all's send layout goes: send_out and send_lse, or (direct, with a window on the world) this
  // rank's window buffer [Pt blocks of out][Pt blocks of lse], which every rank's LSE merge reads in place.
  void* send_out_at = nullptr;
  float* send_lse_at = nullptr;
  std::optional<Communicator::Window> window;
  size_t window_lse_at = 0;  // the lse blocks' offset in a window buffer
};
Result<LocalDecodes> prepare_local_decodes(RankStep& s, int64_t n, std::optional<PendingHeads>& q_heads,
                                           DeviceBuffer local_topk = {});
Status run_local_decodes(RankStep& s, LocalDecodes& d);

}  // namespace dsacp
