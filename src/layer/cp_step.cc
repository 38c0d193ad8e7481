// One CP rank's step for any P x D layout (contract §3, reference-design §3-5):
//   1. KV exchange: the step's KV rows are all-gathered over the exchange group (the PCP group; the DCP group
//      under DSA-CP) and each rank writes the tokens it owns (and, with the replicated indexer, every token's
//      indexer key);
//   2. top-k: replicated indexer -> computed locally over the replicated keys; sharded indexer -> rows shared
//      by every rank get per-rank candidates merged exactly, other rows (PCP prefill) use a gathered view of
//      the indexer keys;
//   3. attention: decode rows attend over each rank's own keys, and the partial results are merged by LSE
//      (all-to-all over the heads, or over the tokens under DSA-CP); prefill rows attend over a gathered view
//      of the KV with this rank's heads. Decodes never re-gather the KV (unless DecodeMode::kGathered, D = 1).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>

#include "dsacp/cp_step.h"
#include "layer/step_checks.h"
#include "layer/step_timing_internal.h"

namespace dsacp {
namespace {

struct View {
  DeviceBuffer storage;
  PagedPoolView pool;
};

// A gathered view in flight: this rank's rows packed, the all-gather started.
struct PendingView {
  GatheredViewPlan plan;
  PagedPoolView own;
  DeviceBuffer pack, gathered;
  std::unique_ptr<CollectiveHandle> handle;
  int64_t ranks = 0;
};

// Rows src[index[i]] -> dst (with dtype conversion), rows of `dim` elements; the index in device memory.
Status gather_dev(Backend& backend, const void* src, DType src_dtype, int64_t src_rows, int32_t dim,
                  const int64_t* d_index, int64_t n, void* dst, DType dst_dtype, const char* what) {
  if (n == 0) return Status();
  GatherRowsParams g;
  g.src = src;
  g.src_dtype = src_dtype;
  g.src_rows = src_rows;
  g.dim = dim;
  g.index = d_index;
  g.num_rows = n;
  g.dst = dst;
  g.dst_dtype = dst_dtype;
  return gather_rows_run(backend, g).with_context(what);
}

// The same with a host index.
Status gather(Backend& backend, const void* src, DType src_dtype, int64_t src_rows, int32_t dim,
              const std::vector<int64_t>& index, void* dst, DType dst_dtype, const char* what) {
  if (index.empty()) return Status();
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_index, upload_vector(backend, index));
  return gather_dev(backend, src, src_dtype, src_rows, dim, d_index.as<const int64_t>(),
                    static_cast<int64_t>(index.size()), dst, dst_dtype, what);
}

// How a pool's rows travel: as they are stored (dim values of its dtype), or, for fp8_ds_mla records, each
// record's bytes whole (latent values, scales and rope together) as 4- or 2-byte units copied bit for bit.
struct RowUnits {
  DType dtype;
  int32_t dim;
};
RowUnits row_units(const PagedPoolView& own) {
  if (!own.records()) return {own.dtype, own.dim};
  return own.record_bytes % 4 == 0 ? RowUnits{DType::kF32, own.record_bytes / 4}
                                   : RowUnits{DType::kBF16, own.record_bytes / 2};
}

// Packs `own` rows for the view (reference-design 4.6: right after the cache write, so the gather overlaps
// the indexer); its all-gather is started by the caller (alone, or grouped with another view's).
Result<PendingView> pack_view(Backend& backend, Communicator& comm, const PagedPoolView& own,
                              const GatheredViewPlan& v) {
  PendingView pv;
  pv.plan = v;
  pv.own = own;
  pv.ranks = comm.size();
  const RowUnits u = row_units(own);
  const size_t row_bytes = static_cast<size_t>(u.dim) * dtype_size(u.dtype);
  if (v.rows_per_rank < 1) return internal_error("gathered view with no rows");
  DSACP_ASSIGN_OR_RETURN(pv.pack, backend.allocate(v.rows_per_rank * row_bytes));
  DSACP_RETURN_IF_ERROR(gather(backend, own.data, u.dtype, own.num_pages * own.page_size, u.dim, v.pack_slots,
                               pv.pack.get(), u.dtype, "pack for a gathered view"));
  DSACP_ASSIGN_OR_RETURN(pv.gathered, backend.allocate(pv.ranks * v.rows_per_rank * row_bytes));
  return pv;
}

Communicator::Part view_part(const PendingView& pv) {
  const RowUnits u = row_units(pv.own);
  const size_t row_bytes = static_cast<size_t>(u.dim) * dtype_size(u.dtype);
  return {pv.pack.get(), pv.gathered.get(), pv.plan.rows_per_rank * row_bytes};
}

Result<PendingView> start_view(Backend& backend, Communicator& comm, const PagedPoolView& own,
                               const GatheredViewPlan& v) {
  DSACP_ASSIGN_OR_RETURN(PendingView pv, pack_view(backend, comm, own, v));
  const Communicator::Part part = view_part(pv);
  DSACP_ASSIGN_OR_RETURN(pv.handle, comm.all_gather_async(part.send, part.recv, part.bytes));
  return pv;
}

// Waits for the view's all-gather and lays the gathered rows out as the view's pool.
// (A view whose gather was grouped with another's has no handle of its own: the other's wait covers it.)
Result<View> finish_view(Backend& backend, PendingView& pv) {
  if (pv.handle) DSACP_RETURN_IF_ERROR(pv.handle->wait());
  const GatheredViewPlan& v = pv.plan;
  const RowUnits u = row_units(pv.own);
  const size_t row_bytes = static_cast<size_t>(u.dim) * dtype_size(u.dtype);
  View out;
  out.pool = pv.own;
  out.pool.num_pages = v.view_num_pages;
  if (v.direct) {
    out.storage = std::move(pv.gathered);
  } else {
    DSACP_ASSIGN_OR_RETURN(out.storage, backend.allocate(v.view_num_pages * pv.own.page_size * row_bytes));
    DSACP_RETURN_IF_ERROR(gather(backend, pv.gathered.get(), u.dtype, pv.ranks * v.rows_per_rank, u.dim,
                                 v.unpack_rows, out.storage.get(), u.dtype, "unpack a gathered view"));
  }
  out.pool.data = out.storage.get();
  return out;
}

template <typename T>
T* offset_ptr(T* p, int64_t elements) {
  return p == nullptr ? nullptr : p + elements;
}
void* offset_bytes(void* p, int64_t bytes) { return p == nullptr ? nullptr : static_cast<char*>(p) + bytes; }
const void* offset_bytes(const void* p, int64_t bytes) {
  return p == nullptr ? nullptr : static_cast<const char*>(p) + bytes;
}

// Everything one rank needs while it runs a step.
struct RankStep {
  Backend& backend;
  const CpComms& comms;
  const StepConfig& c;
  const std::vector<Request>& requests;
  const CpRankPlan& plan;
  const CpLayout& layout;
  const KvSharding& sharding;
  const BlockTable& table;
  PagedKvCache& cache;
  const StepInputs& in;
  const StepOutputs& out;
  std::vector<int64_t> seq_lens;
  DeviceBuffer step_table;  // the block table
  DeviceBuffer step_rows;   // one upload: the rows' requests and key lengths, the KV slots
  const int32_t* d_table = nullptr;
  const int32_t* d_row_request = nullptr;
  const int32_t* d_row_key_len = nullptr;
  std::vector<int32_t> row_local_len;      // the rows' key lengths over this rank's own keys
  const int32_t* d_row_local_len = nullptr;
  // Collectives the backend's stream waits for on the device; the host waits for them (bounded) at the end.
  std::vector<std::unique_ptr<CollectiveHandle>> in_flight;
  // Communicators with a row-synchronized window exchange in this step (window_rows): after the step's
  // synchronize, window_rows_check reports a consumer's wait that gave up. No end event on the stream (one between
  // the consumer and the next kernel costs the stream a few microseconds; one at the end, and the host's wait for
  // it, cost the step's tail), no handle: the kernels' row waits are bounded by themselves.
  std::vector<Communicator*> rows_checked_at_end;
  std::vector<DeviceBuffer> kv_rows;  // the step's gathered KV rows (the cache write reads them on the device)

  int32_t B() const { return cache.config().page_size; }
  size_t act() const { return dtype_size(c.act_dtype); }
};

// The step's end checks comm's row-synchronized exchanges (Communicator::window_rows_check), once a communicator.
void check_rows_at_end(RankStep& s, Communicator* comm) {
  if (std::find(s.rows_checked_at_end.begin(), s.rows_checked_at_end.end(), comm) == s.rows_checked_at_end.end()) {
    s.rows_checked_at_end.push_back(comm);
  }
}

// Orders the backend's later work after the collective: on the device when the transport can (the host then
// waits for it at the step's end, bounded), else by waiting now.
Status after(RankStep& s, std::unique_ptr<CollectiveHandle> h) {
  void* stream = s.backend.native_stream();
  if (stream != nullptr && h->order_before(stream)) {
    s.in_flight.push_back(std::move(h));
    return Status();
  }
  return h->wait();
}

// The communicator, with its next collectives ordered after the work enqueued so far on the backend's current
// lane (the producer of their inputs; Backend lanes move it between streams).
Communicator& producing(RankStep& s, Communicator& c) {
  if (void* stream = s.backend.native_stream()) c.set_producer_stream(stream);
  return c;
}

// Local key lengths of rows with global key lengths `global_key_len`, on the device.
Result<DeviceBuffer> upload_local_len(RankStep& s, const std::vector<int32_t>& global_key_len,
                                      std::vector<int32_t>* host = nullptr) {
  std::vector<int32_t> local_len(global_key_len.size());
  for (size_t t = 0; t < local_len.size(); ++t) {
    local_len[t] = static_cast<int32_t>(s.sharding.local_len(global_key_len[t], s.plan.cr));
  }
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d, upload_vector(s.backend, local_len));
  if (host != nullptr) *host = std::move(local_len);
  return d;
}

// A window exchange of `bytes` on `comm` (Communicator::window_next), or nothing where the communicator has no
// window for it (the caller then uses the collectives). Other errors (a failed communicator) are returned.
Result<std::optional<Communicator::Window>> try_window(Communicator& comm, size_t bytes) {
  Result<Communicator::Window> w = comm.window_next(bytes);
  if (w.ok()) return std::optional<Communicator::Window>(std::move(w).value());
  if (w.status().code() == StatusCode::kUnsupported) return std::optional<Communicator::Window>();
  return w.status();
}

// The window exchange's synchronization by the kernels themselves, row by row (Communicator::window_rows), for
// `rows` rows; inactive (seq 0: the caller publishes) where the communicator cannot. On by default for both
// exchanges (the candidates and the partials); CpLayout::window_rows turns it off (a publish kernel per exchange
// and the LSE merge kernel) or keeps one exchange's only. On 2 x H200 the DCP 128K step took 0.685 / 0.667 ms with
// it against 0.693 / 0.693 without. Every rank decides alike: the answer depends on the layout, the communicator
// and the shape only.
Result<WindowRowSync> try_window_rows(const CpLayout& layout, Communicator& comm, int64_t rows, bool topk_exchange) {
  using W = CpLayout::WindowRows;
  const W want = layout.window_rows;
  if (want == W::kNone || (want == W::kTopkOnly && !topk_exchange) || (want == W::kMlaOnly && topk_exchange)) {
    return WindowRowSync{};
  }
  Result<WindowRowSync> r = comm.window_rows(rows);
  if (r.ok() || r.status().code() != StatusCode::kUnsupported) return r;
  return WindowRowSync{};
}

// The sharded indexer's merged top-k of `n` rows in flight: the local top-k (with scores) over this rank's own
// indexer keys is enqueued and its exchange over the world group started (written straight into the world's
// exchange window and published, where it has one; else an all-gather); finish_merged_topk waits for the
// candidates and merges them exactly. With the window synchronized row by row, the top-k merges each row itself
// once the peers' rows came (fused; CpLayout::fused_topk_merge off: the merge kernel after it). All ranks must hold the
// same rows in the same order.
struct PendingTopk {
  int64_t n = 0;
  int32_t* topk = nullptr;
  int32_t* local_topk = nullptr;  // optional: the merged rows remapped to this rank's local positions
  bool fused = false;             // the top-k merged the rows (no merge kernel)
  std::vector<int32_t> local_len;
  DeviceBuffer d_local_len, part_topk, part_scores, all_topk, all_scores;
  const int32_t* local_len_dev = nullptr;
  const int32_t* local_len_host = nullptr;
  std::optional<Communicator::Window> window;  // every rank's [n, K] positions, then [n, K] scores
  WindowRowSync rows;  // the window synchronized row by row by the top-k and the merge (else a publish)
  std::unique_ptr<CollectiveHandle> handle;
};

// The merge of pt's candidates (the world's parts, in its window or gathered) into pt.topk / pt.local_topk.
TopkMergeParams candidate_merge_params(const RankStep& s, const PendingTopk& pt) {
  TopkMergeParams mp;
  mp.num_parts = s.comms.world->size();
  mp.num_rows = pt.n;
  mp.K = s.c.K;
  mp.I = s.sharding.I;
  if (pt.window) {
    // The candidates in place, in every rank's window buffer.
    const size_t topk_bytes = static_cast<size_t>(pt.n * s.c.K) * sizeof(int32_t);
    mp.part_topk = nullptr;
    mp.part_scores = nullptr;
    for (int32_t k = 0; k < mp.num_parts; ++k) {
      mp.part_topk_of[k] = static_cast<const int32_t*>(pt.window->all[static_cast<size_t>(k)]);
      mp.part_scores_of[k] = reinterpret_cast<const float*>(static_cast<const char*>(pt.window->all[static_cast<size_t>(k)]) +
                                                            topk_bytes);
    }
  } else {
    mp.part_topk = pt.all_topk.as<const int32_t>();
    mp.part_scores = pt.all_scores.as<const float>();
  }
  mp.topk = pt.topk;
  mp.local_topk = pt.local_topk;
  mp.local_part = s.plan.cr;
  mp.wait = pt.rows;
  return mp;
}

// The top-k merges the window's rows itself (IndexerTopkParams::merge) unless CpLayout::fused_topk_merge is off: no
// merge kernel, and the attention follows the top-k directly. On 2 x H200 (DCP 128K b=64, 5 alternating rounds)
// 0.673 ms a step against 0.677 with the merge kernel: within the run-to-run spread, not worse.

// The rows' local key lengths are computed and uploaded here, unless the caller has them on the device and the
// host already (d_local_len, h_local_len). With local_topk, the merge also writes the merged rows remapped to this
// rank's own local positions (the local decodes' input, in the same kernel).
// q_scale: the FP8 queries' scales ([n, Hi]; null for f32/bf16 queries).
Result<PendingTopk> start_merged_topk(RankStep& s, int64_t n, const void* q, const float* q_scale, const float* w,
                                      const int32_t* request,
                                      const int32_t* host_request, const std::vector<int32_t>& global_key_len,
                                      int32_t* topk, const int32_t* d_local_len = nullptr,
                                      const int32_t* h_local_len = nullptr, int32_t* local_topk = nullptr) {
  Communicator& world = *s.comms.world;
  const int64_t Pt = world.size();
  const int64_t K = s.c.K;
  PendingTopk pt;
  pt.n = n;
  pt.topk = topk;
  pt.local_topk = local_topk;
  if (d_local_len != nullptr && h_local_len != nullptr) {
    pt.local_len_dev = d_local_len;
    pt.local_len_host = h_local_len;
  } else {
    DSACP_ASSIGN_OR_RETURN(pt.d_local_len, upload_local_len(s, global_key_len, &pt.local_len));
    pt.local_len_dev = pt.d_local_len.as<const int32_t>();
    pt.local_len_host = pt.local_len.data();
  }
  const size_t topk_bytes = static_cast<size_t>(n * K) * sizeof(int32_t);
  // The window only under one PCP rank (the DCP decode: the world is the DCP group) and for the merge kernel's
  // small shape (at most 4096 candidates a row: 2 x 2048), what was run on the GPUs. P2 layouts stalled in a
  // window publish in 2 of 5 test runs on 2 x H200 (not understood; D2
  // layouts, whose prefill rows' views also go over the world, passed every run); they keep NCCL, as do larger
  // merges (whose host fallback would copy from the peers' memory).
  if (s.layout.P == 1 && Pt * K <= 4096) {
    DSACP_ASSIGN_OR_RETURN(pt.window, try_window(world, 2 * topk_bytes));
  }
  int32_t* part_topk = nullptr;
  float* part_scores = nullptr;
  if (pt.window) {
    part_topk = static_cast<int32_t*>(pt.window->mine);
    part_scores = reinterpret_cast<float*>(static_cast<char*>(pt.window->mine) + topk_bytes);
  } else {
    DSACP_ASSIGN_OR_RETURN(pt.part_topk, s.backend.allocate(n * K * sizeof(int32_t)));
    DSACP_ASSIGN_OR_RETURN(pt.part_scores, s.backend.allocate(n * K * sizeof(float)));
    part_topk = pt.part_topk.as<int32_t>();
    part_scores = pt.part_scores.as<float>();
  }
  IndexerTopkParams ip;
  ip.rows = {n, request, pt.local_len_dev};
  ip.Hi = s.c.Hi;
  ip.Di = s.c.Di;
  ip.K = s.c.K;
  ip.q = q;
  ip.q_dtype = s.c.index_input_dtype();
  ip.q_scale = q_scale;
  ip.w = w;
  ip.keys = s.cache.index_keys();
  ip.block_table = {s.d_table, s.table.num_requests, s.table.max_pages};
  ip.topk = part_topk;
  ip.topk_scores = part_scores;
  ip.host_request = host_request;
  ip.host_key_len = pt.local_len_host;
  if (pt.window) {
    // The top-k raises each row's flag in the peers as it stores the row; the merge waits for it.
    DSACP_ASSIGN_OR_RETURN(pt.rows, try_window_rows(s.layout, producing(s, world), n, /*topk_exchange=*/true));
    ip.signal = pt.rows;
    if (pt.rows.active() && s.layout.fused_topk_merge) {
      ip.merge = candidate_merge_params(s, pt);
      pt.fused = true;
    }
  }
  DSACP_RETURN_IF_ERROR(indexer_topk_run(s.backend, ip).with_context("sharded indexer: local top-k"));
  if (pt.window) {
    if (!pt.rows.active()) {
      DSACP_ASSIGN_OR_RETURN(pt.handle, producing(s, world).window_publish());
    }
    return pt;
  }
  DSACP_ASSIGN_OR_RETURN(pt.all_topk, s.backend.allocate(Pt * n * K * sizeof(int32_t)));
  DSACP_ASSIGN_OR_RETURN(pt.all_scores, s.backend.allocate(Pt * n * K * sizeof(float)));
  DSACP_ASSIGN_OR_RETURN(pt.handle,
                         world.all_gather_group_async({{pt.part_topk.get(), pt.all_topk.get(), n * K * sizeof(int32_t)},
                                                       {pt.part_scores.get(), pt.all_scores.get(), n * K * sizeof(float)}}));
  return pt;
}

Status finish_merged_topk(RankStep& s, PendingTopk& pt) {
  if (pt.handle) DSACP_RETURN_IF_ERROR(after(s, std::move(pt.handle)));
  if (!pt.fused) {
    DSACP_RETURN_IF_ERROR(topk_merge_run(s.backend, candidate_merge_params(s, pt))
                              .with_context("sharded indexer: candidate merge"));
  }
  if (pt.rows.active()) {
    // The step's end reports a merge whose wait gave up (a peer's row never came), fused or not.
    check_rows_at_end(s, s.comms.world);
  }
  return Status();
}

Status merged_topk(RankStep& s, int64_t n, const void* q, const float* q_scale, const float* w,
                   const int32_t* request, const int32_t* host_request, const std::vector<int32_t>& global_key_len,
                   int32_t* topk) {
  DSACP_ASSIGN_OR_RETURN(PendingTopk pt,
                         start_merged_topk(s, n, q, q_scale, w, request, host_request, global_key_len, topk));
  return finish_merged_topk(s, pt);
}

// The sparse MLA of partial attention of `n` rows (all `H` heads) over this rank's own keys: local_topk (local
// positions) over the local lengths d_local_len; the partial out [n, H, Dl] in part_dtype (f32 or bf16) and the
// lse [n, H] in f32. (After the remap the causal horizon is already in the indices: every kept entry is below the
// request's local length, the sparse_mode 0 of reference-design 4.4 step 5.)
SparseMlaParams own_keys_mla_params(RankStep& s, int64_t n, const void* q_nope, const void* q_rope,
                                    const int32_t* request, const int32_t* d_local_len, const int32_t* local_topk,
                                    void* part_out, float* part_lse, int32_t head_blocks, DType part_dtype) {
  SparseMlaParams ap;
  ap.rows = {n, request, d_local_len};
  ap.H = s.c.H;
  ap.Dl = s.c.Dl;
  ap.Dr = s.c.Dr;
  ap.K = s.c.K;
  ap.scale = s.c.scale;
  ap.q_nope = q_nope;
  ap.q_rope = q_rope;
  ap.q_dtype = s.c.act_dtype;
  ap.latent = s.cache.latent();
  ap.rope = s.cache.rope();
  ap.block_table = {s.d_table, s.table.num_requests, s.table.max_pages};
  ap.topk = local_topk;
  ap.out = part_out;
  ap.out_dtype = part_dtype;
  ap.lse = part_lse;
  ap.head_blocks = head_blocks;
  return ap;
}

// The global top-k of `n` rows remapped to this rank's local positions (into local_topk).
Status remap_to_local(RankStep& s, int64_t n, const int32_t* global_topk, int32_t* local_topk) {
  TopkRemapParams rp;
  rp.num_rows = n;
  rp.K = s.c.K;
  rp.topk = global_topk;
  rp.local = local_topk;
  rp.Pt = s.sharding.Pt;
  rp.I = s.sharding.I;
  rp.cr = s.plan.cr;
  return topk_remap_run(s.backend, rp).with_context("top-k remap to local positions");
}

// Partial attention over own keys (own_keys_mla_params), the global top-k remapped first (unless `remapped`: the
// merge wrote local_topk already).
Status partial_attention_own_keys(RankStep& s, int64_t n, const void* q_nope, const void* q_rope, const int32_t* request,
                                  const int32_t* d_local_len, const int32_t* global_topk, int32_t* local_topk,
                                  void* part_out, float* part_lse, int32_t head_blocks = 1,
                                  DType part_dtype = DType::kF32, bool remapped = false) {
  if (!remapped) DSACP_RETURN_IF_ERROR(remap_to_local(s, n, global_topk, local_topk));
  return sparse_mla_run(s.backend, own_keys_mla_params(s, n, q_nope, q_rope, request, d_local_len, local_topk,
                                                       part_out, part_lse, head_blocks, part_dtype))
      .with_context("local sparse MLA");
}

Status local_partial_attention(RankStep& s, int64_t n, const void* q_nope, const void* q_rope, const int32_t* request,
                               const std::vector<int32_t>& global_key_len, const int32_t* global_topk, float* part_out,
                               float* part_lse) {
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer local_topk, s.backend.allocate(n * s.c.K * sizeof(int32_t)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_local_len, upload_local_len(s, global_key_len));
  return partial_attention_own_keys(s, n, q_nope, q_rope, request, d_local_len.as<const int32_t>(), global_topk,
                                    local_topk.as<int32_t>(), part_out, part_lse);
}

// LSE merge of `parts` partial results [parts, rows, Dl] (part_dtype) into out (out_dtype, converted by the
// merge) and lse.
Status merge_into(RankStep& s, int32_t parts, int64_t rows, const void* part_out, const float* part_lse, void* out,
                  float* lse, DType part_dtype = DType::kF32) {
  LseMergeParams mp;
  mp.num_parts = parts;
  mp.num_rows = rows;
  mp.Dl = s.c.Dl;
  mp.part_dtype = part_dtype;
  mp.part_out = part_out;
  mp.part_lse = part_lse;
  mp.out = out;
  mp.out_dtype = s.c.out_dtype;
  mp.lse = lse;
  return lse_merge_run(s.backend, mp).with_context("LSE merge");
}

// The latent and rope views of the requests attended over the gathered KV, started early.
// The group's handle is the last member, so it is destroyed first: a rank that returns early (an error) waits
// for the gather before either view's buffers are freed (the last rank to post may still be copying into them).
struct PendingKvView {
  std::vector<int32_t> requests;
  GatheredViewPlan plan;
  PendingView latent, rope;
  std::unique_ptr<CollectiveHandle> handle;
};

Result<PendingKvView> start_kv_view(RankStep& s, const std::vector<int32_t>& view_requests) {
  PendingKvView kv;
  kv.requests = view_requests;
  std::vector<int64_t> lens;
  for (int32_t b : view_requests) lens.push_back(s.seq_lens[b]);
  DSACP_ASSIGN_OR_RETURN(kv.plan, gathered_view_plan(view_requests, lens, s.table, s.sharding, s.plan.cr, s.B()));
  DSACP_ASSIGN_OR_RETURN(kv.latent, pack_view(s.backend, *s.comms.world, s.cache.latent(), kv.plan));
  if (s.cache.config().fp8_latent()) {
    // fp8_ds_mla: the latent view's records carry the rope too (the 656-byte records travel, not bf16 rows).
    DSACP_ASSIGN_OR_RETURN(kv.latent.handle, s.comms.world->all_gather_group_async({view_part(kv.latent)}));
    return kv;
  }
  DSACP_ASSIGN_OR_RETURN(kv.rope, pack_view(s.backend, *s.comms.world, s.cache.rope(), kv.plan));
  DSACP_ASSIGN_OR_RETURN(kv.handle, s.comms.world->all_gather_group_async({view_part(kv.latent), view_part(kv.rope)}));
  return kv;
}

// Attention of rows [first, first + n) with this rank's heads over the gathered view of the requests' KV.
Status gathered_attention(RankStep& s, int64_t first, int64_t n, PendingKvView& kv) {
  if (kv.handle) DSACP_RETURN_IF_ERROR(kv.handle->wait());
  DSACP_ASSIGN_OR_RETURN(View lat, finish_view(s.backend, kv.latent));
  View rope;
  if (s.cache.config().fp8_latent()) {
    rope.pool = s.cache.rope();  // the rope view of the gathered records
    rope.pool.data = lat.pool.data;
    rope.pool.num_pages = lat.pool.num_pages;
  } else {
    DSACP_ASSIGN_OR_RETURN(rope, finish_view(s.backend, kv.rope));
  }
  if (n == 0) return Status();
  const GatheredViewPlan& vp = kv.plan;
  std::vector<int32_t> view_row(static_cast<size_t>(s.requests.size()), -1);
  for (size_t i = 0; i < kv.requests.size(); ++i) view_row[kv.requests[i]] = static_cast<int32_t>(i);
  std::vector<int32_t> rows_view(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows_view[i] = std::max(0, view_row[s.plan.row_request[first + i]]);
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_rows_view, upload_vector(s.backend, rows_view));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_view_table, upload_vector(s.backend, vp.view_table.data));
  const int64_t Hr = s.plan.num_heads;
  SparseMlaParams ap;
  ap.rows = {n, d_rows_view.as<const int32_t>(), offset_ptr(s.d_row_key_len, first)};
  ap.H = static_cast<int32_t>(Hr);
  ap.Dl = s.c.Dl;
  ap.Dr = s.c.Dr;
  ap.K = s.c.K;
  ap.scale = s.c.scale;
  ap.q_nope = offset_bytes(s.in.q_nope, first * Hr * s.c.Dl * static_cast<int64_t>(s.act()));
  ap.q_rope = offset_bytes(s.in.q_rope, first * Hr * s.c.Dr * static_cast<int64_t>(s.act()));
  ap.q_dtype = s.c.act_dtype;
  ap.latent = lat.pool;
  ap.rope = rope.pool;
  ap.block_table = {d_view_table.as<const int32_t>(), vp.view_table.num_requests, vp.view_table.max_pages};
  ap.topk = offset_ptr<const int32_t>(s.out.topk, first * s.c.K);
  ap.out = offset_bytes(s.out.out, first * Hr * s.c.Dl * static_cast<int64_t>(dtype_size(s.c.out_dtype)));
  ap.out_dtype = s.c.out_dtype;
  ap.lse = offset_ptr(s.out.lse, first * Hr);
  return sparse_mla_run(s.backend, ap).with_context("sparse MLA over the gathered KV");
}

// All rows' queries of `n` rows (q_nope and q_rope), gathered along heads over the DCP group (rank-major
// blocks [D][n, Hr, dim]) in one grouped collective, rearranged into [n, D*Hr, dim] once the gather is done.
struct PendingHeads {
  DeviceBuffer nope_blocks, rope_blocks;
  std::unique_ptr<CollectiveHandle> handle;
};

Result<PendingHeads> start_head_gather(RankStep& s, const void* q_nope, const void* q_rope, int64_t n) {
  PendingHeads ph;
  const size_t per_head = static_cast<size_t>(n) * s.plan.num_heads * s.act();
  const size_t nope = per_head * s.c.Dl, rope = per_head * s.c.Dr;
  DSACP_ASSIGN_OR_RETURN(ph.nope_blocks, s.backend.allocate(std::max<size_t>(s.comms.dcp->size() * nope, 1)));
  DSACP_ASSIGN_OR_RETURN(ph.rope_blocks, s.backend.allocate(std::max<size_t>(s.comms.dcp->size() * rope, 1)));
  DSACP_ASSIGN_OR_RETURN(ph.handle, producing(s, *s.comms.dcp).all_gather_group_async({{q_nope, ph.nope_blocks.get(), nope},
                                                                          {q_rope, ph.rope_blocks.get(), rope}}));
  return ph;
}

// The row order of queries gathered along heads: row (t, k, h) of [n, D*Hr] comes from block k's row (t, h).
Result<DeviceBuffer> heads_to_rows_index(RankStep& s, int64_t n) {
  const int64_t D = s.comms.dcp->size(), Hr = s.plan.num_heads;
  std::vector<int64_t> index;
  index.reserve(static_cast<size_t>(n * D * Hr));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < D; ++k)
      for (int64_t h = 0; h < Hr; ++h) index.push_back((k * n + t) * Hr + h);
  return upload_vector(s.backend, index);
}

// The local decodes (rows [0, n) attend over each rank's own keys, merged by LSE across the world group) in two
// halves: prepare_local_decodes does everything that does not need the top-k (the queries along heads, the
// buffers, the local lengths, the pack order), so that under the sharded indexer it is issued while the
// candidates are still being computed; run_local_decodes remaps the top-k, attends, exchanges and merges.
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
  DeviceBuffer heads_order, full_qn, full_qr, local_topk, part_out, part_lse, d_pack, send_out, send_lse, recv_out,
      recv_lse;
  // Where the all-to-all's send layout goes: send_out and send_lse, or (direct, with a window on the world) this
  // rank's window buffer [Pt blocks of out][Pt blocks of lse], which every rank's LSE merge reads in place.
  void* send_out_at = nullptr;
  float* send_lse_at = nullptr;
  std::optional<Communicator::Window> window;
  size_t window_lse_at = 0;  // the lse blocks' offset in a window buffer
};

// local_topk: the buffer of the rows' local top-k where the caller has one already (the candidate merge writes it).
Result<LocalDecodes> prepare_local_decodes(RankStep& s, int64_t n, std::optional<PendingHeads>& q_heads,
                                           DeviceBuffer local_topk = {}) {
  const StepConfig& c = s.c;
  const int64_t H = c.H, Hr = s.plan.num_heads, Pt = s.comms.world->size(), D = s.comms.dcp->size();
  Backend& be = s.backend;
  LocalDecodes d;
  d.n = n;
  d.qn = s.in.q_nope;
  d.qr = s.in.q_rope;
  d.q_heads = q_heads ? &*q_heads : nullptr;
  // Direct needs head slices the CUDA kernels take whole (a multiple of their 64-head group, or all heads).
  d.direct = q_heads && Pt == D && Hr % std::min<int64_t>(H, 64) == 0 && s.layout.decode_head_blocks;
  const int64_t block = n * Hr;
  d.part_dtype = c.out_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
  const size_t part = dtype_size(d.part_dtype);
  if (local_topk.get() != nullptr) {
    d.local_topk = std::move(local_topk);
  } else {
    DSACP_ASSIGN_OR_RETURN(d.local_topk, be.allocate(n * c.K * sizeof(int32_t)));
  }
  if (d.direct) {
    // Attention writes its partials straight into the world's exchange window where it has one.
    d.window_lse_at = (static_cast<size_t>(Pt * block * c.Dl) * part + 255) / 256 * 256;
    DSACP_ASSIGN_OR_RETURN(d.window,
                           try_window(*s.comms.world, d.window_lse_at + static_cast<size_t>(Pt * block) * sizeof(float)));
  }
  if (d.window) {
    d.send_out_at = d.window->mine;
    d.send_lse_at = reinterpret_cast<float*>(static_cast<char*>(d.window->mine) + d.window_lse_at);
  } else {
    DSACP_ASSIGN_OR_RETURN(d.send_out, be.allocate(Pt * block * c.Dl * part));
    DSACP_ASSIGN_OR_RETURN(d.send_lse, be.allocate(Pt * block * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(d.recv_out, be.allocate(Pt * block * c.Dl * part));
    DSACP_ASSIGN_OR_RETURN(d.recv_lse, be.allocate(Pt * block * sizeof(float)));
    d.send_out_at = d.send_out.get();
    d.send_lse_at = d.send_lse.as<float>();
  }
  if (d.direct) {
    d.qn = q_heads->nope_blocks.get();
    d.qr = q_heads->rope_blocks.get();
    return d;
  }
  if (q_heads) {
    DSACP_ASSIGN_OR_RETURN(d.heads_order, heads_to_rows_index(s, n));
    const size_t rows_all = static_cast<size_t>(n * D * Hr);
    DSACP_ASSIGN_OR_RETURN(d.full_qn, be.allocate(std::max<size_t>(rows_all * c.Dl * s.act(), 1)));
    DSACP_ASSIGN_OR_RETURN(d.full_qr, be.allocate(std::max<size_t>(rows_all * c.Dr * s.act(), 1)));
    d.qn = d.full_qn.get();
    d.qr = d.full_qr.get();
  }
  DSACP_ASSIGN_OR_RETURN(d.part_out, be.allocate(n * H * c.Dl * part));
  DSACP_ASSIGN_OR_RETURN(d.part_lse, be.allocate(n * H * sizeof(float)));
  // All-to-all over the world: rank (r', d') receives heads slice d' of every rank's partials.
  std::vector<int64_t> pack;
  pack.reserve(static_cast<size_t>(Pt * block));
  for (int64_t k = 0; k < Pt; ++k) {
    const int64_t h0 = (k % D) * Hr;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < Hr; ++h) pack.push_back(t * H + h0 + h);
  }
  DSACP_ASSIGN_OR_RETURN(d.d_pack, upload_vector(be, pack));
  return d;
}

// The direct layout's attention with the ranks' partials merged inside the kernel (SparseMlaParams::peer): each
// rank stores the other head blocks' partials straight into their owners' window buffers (rank k's buffer holds
// [Pt senders' blocks of out][Pt senders' blocks of lse]) and raises each row's flag there; the CTAs of its own
// block wait for the peers' rows and write the merged result into the step's out / lse. False (nothing enqueued,
// no window exchange taken) where the backend cannot or CpLayout::window_rows = kNone: the caller then publishes and runs
// the LSE merge.
Result<bool> attention_merged_in_window(RankStep& s, LocalDecodes& d) {
  const StepConfig& c = s.c;
  Communicator& world = *s.comms.world;
  const int64_t n = d.n, Pt = world.size(), block = n * s.plan.num_heads;
  const int32_t me = world.rank();
  if (!d.remapped) DSACP_RETURN_IF_ERROR(remap_to_local(s, n, s.out.topk, d.local_topk.as<int32_t>()));
  d.remapped = true;
  SparseMlaParams ap = own_keys_mla_params(s, n, d.qn, d.qr, s.d_row_request, s.d_row_local_len,
                                           d.local_topk.as<const int32_t>(), s.out.out, s.out.lse,
                                           static_cast<int32_t>(Pt), c.out_dtype);
  SparseMlaParams::PeerMerge& pm = ap.peer;
  pm.part_dtype = d.part_dtype;
  const size_t out_block = static_cast<size_t>(block * c.Dl) * dtype_size(d.part_dtype);
  for (int32_t k = 0; k < Pt; ++k) {
    char* theirs = static_cast<char*>(d.window->all[static_cast<size_t>(k)]);
    const char* mine = static_cast<const char*>(d.window->mine);
    pm.part_out_to[k] = theirs + me * out_block;
    pm.part_lse_to[k] = reinterpret_cast<float*>(theirs + d.window_lse_at) + me * block;
    pm.part_out_from[k] = mine + k * out_block;
    pm.part_lse_from[k] = reinterpret_cast<const float*>(mine + d.window_lse_at) + k * block;
  }
  // Ask the backend first (with a stand-in exchange), so that a refusal leaves the window's sequence untouched.
  pm.sync.seq = 1;
  pm.sync.rank = me;
  pm.sync.size = static_cast<int32_t>(Pt);
  pm.sync.num_rows = n;
  if (!s.backend.check_sparse_mla(ap).ok()) return false;
  DSACP_ASSIGN_OR_RETURN(pm.sync, try_window_rows(s.layout, producing(s, world), n, /*topk_exchange=*/false));
  if (!pm.sync.active()) return false;
  DSACP_RETURN_IF_ERROR(sparse_mla_run(s.backend, ap).with_context("local sparse MLA, merged across ranks"));
  check_rows_at_end(s, &world);
  return true;
}

Status run_local_decodes(RankStep& s, LocalDecodes& d) {
  const StepConfig& c = s.c;
  const int64_t n = d.n, H = c.H, Pt = s.comms.world->size(), block = n * s.plan.num_heads;
  if (d.direct) {
    // One launch over every head block; attention writes the all-to-all's send layout directly. (Computing the
    // other ranks' blocks first, then this rank's own block while their all-to-all runs, measured slower on
    // 2 x H200: 0.92 against 0.85 ms a step; two launches of half the heads take longer than one, and the own
    // block's CTAs compete with NCCL's kernels for the SMs.)
    DSACP_RETURN_IF_ERROR(after(s, std::move(d.q_heads->handle)));
    if (d.window) {
      // The partials merged inside attention where the backend can (no publish, no LSE merge kernel).
      DSACP_ASSIGN_OR_RETURN(bool merged, attention_merged_in_window(s, d));
      if (merged) return Status();
    }
    DSACP_RETURN_IF_ERROR(partial_attention_own_keys(
        s, n, d.qn, d.qr, s.d_row_request, s.d_row_local_len, s.out.topk, d.local_topk.as<int32_t>(),
        d.send_out_at, d.send_lse_at, static_cast<int32_t>(s.comms.dcp->size()), d.part_dtype, d.remapped));
    if (d.window) {
      // Every rank's block for this rank, read in place from its window buffer by the merge.
      DSACP_ASSIGN_OR_RETURN(auto h, producing(s, *s.comms.world).window_publish());
      DSACP_RETURN_IF_ERROR(after(s, std::move(h)));
      const size_t me = static_cast<size_t>(s.comms.world->rank());
      LseMergeParams mp;
      mp.num_parts = static_cast<int32_t>(Pt);
      mp.num_rows = block;
      mp.Dl = c.Dl;
      mp.part_dtype = d.part_dtype;
      for (int64_t k = 0; k < Pt; ++k) {
        const char* buf = static_cast<const char*>(d.window->all[static_cast<size_t>(k)]);
        mp.part_out_of[k] = buf + me * static_cast<size_t>(block * c.Dl) * dtype_size(d.part_dtype);
        mp.part_lse_of[k] = reinterpret_cast<const float*>(buf + d.window_lse_at) + me * static_cast<size_t>(block);
      }
      mp.out = s.out.out;
      mp.out_dtype = c.out_dtype;
      mp.lse = s.out.lse;
      return lse_merge_run(s.backend, mp).with_context("LSE merge (window)");
    }
  } else if (d.q_heads != nullptr) {
    // Issued after the top-k merge, so the merge (on the critical path) is not queued behind the head gather.
    const int64_t rows_all = n * s.comms.dcp->size() * s.plan.num_heads;
    DSACP_RETURN_IF_ERROR(after(s, std::move(d.q_heads->handle)));
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.q_heads->nope_blocks.get(), c.act_dtype, rows_all, c.Dl,
                                     d.heads_order.as<const int64_t>(), rows_all, d.full_qn.get(), c.act_dtype,
                                     "queries gathered along heads"));
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.q_heads->rope_blocks.get(), c.act_dtype, rows_all, c.Dr,
                                     d.heads_order.as<const int64_t>(), rows_all, d.full_qr.get(), c.act_dtype,
                                     "queries gathered along heads"));
  }
  if (!d.direct) {
    DSACP_RETURN_IF_ERROR(partial_attention_own_keys(s, n, d.qn, d.qr, s.d_row_request,
                                                     s.d_row_local_len, s.out.topk,
                                                     d.local_topk.as<int32_t>(), d.part_out.get(),
                                                     d.part_lse.as<float>(), 1, d.part_dtype, d.remapped));
    const int64_t packed = Pt * block;
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.part_out.get(), d.part_dtype, n * H, c.Dl,
                                     d.d_pack.as<const int64_t>(), packed, d.send_out.get(), d.part_dtype,
                                     "pack partial outputs by head"));
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.part_lse.get(), DType::kF32, n * H, 1, d.d_pack.as<const int64_t>(),
                                     packed, d.send_lse.get(), DType::kF32, "pack partial LSE by head"));
  }
  DSACP_ASSIGN_OR_RETURN(auto h, s.comms.world->all_to_all_group_async(
                                     {{d.send_out.get(), d.recv_out.get(), block * c.Dl * dtype_size(d.part_dtype)},
                                      {d.send_lse.get(), d.recv_lse.get(), block * sizeof(float)}}));
  DSACP_RETURN_IF_ERROR(after(s, std::move(h)));
  return merge_into(s, static_cast<int32_t>(Pt), block, d.recv_out.get(), d.recv_lse.as<const float>(), s.out.out,
                    s.out.lse, d.part_dtype);
}

Status check_comms(const CpComms& comms, const CpRankPlan& plan) {
  auto check = [](const Communicator* c, const char* name, int32_t size, int32_t rank) -> Status {
    if (c == nullptr) return invalid_argument(std::string("CP step: no ") + name + " communicator");
    if (c->size() != size || c->rank() != rank) {
      return invalid_argument(std::string("CP step: the ") + name + " communicator is rank " +
                              std::to_string(c->rank()) + " of " + std::to_string(c->size()) + ", the plan expects " +
                              std::to_string(rank) + " of " + std::to_string(size));
    }
    return Status();
  };
  DSACP_RETURN_IF_ERROR(check(comms.world, "world", plan.P * plan.D, plan.cr));
  DSACP_RETURN_IF_ERROR(check(comms.pcp, "PCP", plan.P, plan.r));
  return check(comms.dcp, "DCP", plan.D, plan.d);
}

}  // namespace

Status cp_step_run(Backend& backend, const CpComms& comms, const StepConfig& c, const std::vector<Request>& requests,
                   const CpRankPlan& plan, const CpLayout& layout, const KvSharding& sharding, const BlockTable& table,
                   PagedKvCache& cache, const StepInputs& in, const StepOutputs& caller_out) {
  PhaseClock clock(backend);
  const PagedCacheConfig& cc = cache.config();
  DSACP_RETURN_IF_ERROR(check_comms(comms, plan));
  DSACP_RETURN_IF_ERROR(check_step_config(c, cc));
  // The step's own top-k is canonical: the caller's buffer, or (slot form) one that output_forms converts from.
  DeviceBuffer canonical_topk;
  StepOutputs out = caller_out;
  DSACP_ASSIGN_OR_RETURN(out.topk, step_topk_buffer(backend, c, plan.num_rows, caller_out.topk, &canonical_topk));
  const bool precomputed = in.topk != nullptr;
  DSACP_RETURN_IF_ERROR(validate_layout(layout, c.H));
  const int32_t Pt = layout.num_ranks();
  if (sharding.Pt != Pt) {
    return invalid_argument("KV sharded over " + std::to_string(sharding.Pt) + " ranks, the layout has " +
                            std::to_string(Pt));
  }
  const bool replicated = layout.indexer == IndexerMode::kReplicated;
  // The FP8 indexer: every rank stores every key (the replicated indexer) and scores its own rows; the step's
  // e4m3 key bytes and their scales are what the ranks exchange.
  const bool fp8 = c.index_input_dtype() == DType::kF8E4M3;
  // The sharded indexer's prefill rows read a gathered view of the indexer pool: not for FP8 pages yet. (Decided
  // from the batch, the same on every rank, so all of them refuse before any collective.)
  if (fp8 && !replicated && !layout.dsa_cp && plan.layout.num_prefills > 0) return cp_fp8_unsupported();
  if (replicated && cc.index_page_factor != Pt) {
    return invalid_argument("the replicated indexer needs an indexer pool of " + std::to_string(Pt) +
                            " x the pages (index_page_factor), the cache has " + std::to_string(cc.index_page_factor));
  }
  const int32_t R = static_cast<int32_t>(requests.size());
  if (table.num_requests != R) {
    return invalid_argument("block table has " + std::to_string(table.num_requests) + " rows, the batch has " +
                            std::to_string(R) + " requests");
  }
  // Kernels, uploads and device copies only enqueue; collectives order themselves after them (NCCL's
  // producer stream) and errors come back from the synchronize() at the end.
  DeferredErrors defer(backend);
  RankStep s{backend, comms, c, requests, plan, layout, sharding, table, cache, in, out, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  std::vector<int64_t> pages(R), first_new(R);
  for (int32_t b = 0; b < R; ++b) {
    s.seq_lens.push_back(requests[b].seq_len());
    pages[b] = sharding.pages_needed(s.seq_lens[b], cc.page_size);
    // This rank's first new position has local position local_len(context_len).
    first_new[b] = sharding.local_len(requests[b].context_len, plan.cr) / cc.page_size;
  }
  // With the table on the device already, the host checks the pages this rank writes (its new tokens'); the
  // kernels check every page they read.
  DSACP_RETURN_IF_ERROR(
      check_block_table_pages(table, pages, cc, in.block_table != nullptr ? first_new : std::vector<int64_t>{}));
  DSACP_RETURN_IF_ERROR(check_indexer_inputs(c, in));
  const int32_t B = cc.page_size;
  const int64_t rows = plan.num_rows;
  const int64_t Hr = plan.num_heads;
  const size_t act = dtype_size(c.act_dtype);
  BlockTable rep_table;
  if (replicated) {
    DSACP_ASSIGN_OR_RETURN(rep_table, replicated_index_table(table, s.seq_lens, Pt, B));
  }
  Communicator& ex = layout.dsa_cp ? *comms.dcp : *comms.pcp;
  const int64_t gathered = ex.size() * rows;
  if (static_cast<int64_t>(plan.gathered_pos.size()) != gathered) {
    return internal_error("CP plan: " + std::to_string(plan.gathered_pos.size()) + " gathered rows, the exchange group of " +
                          std::to_string(ex.size()) + " ranks x " + std::to_string(rows) + " rows gathers " +
                          std::to_string(gathered));
  }
  // DSA-CP: the token shards must follow DCP rank order (rank d holds tokens [d * rows, (d + 1) * rows)).
  if (layout.dsa_cp && rows > 0 && plan.row_token[0] >= 0 && plan.row_token[0] != int64_t{plan.d} * rows) {
    return invalid_argument("DSA-CP token shards must follow DCP rank order: rank " + std::to_string(plan.d) +
                            " expects tokens from " + std::to_string(int64_t{plan.d} * rows) + ", the plan starts at " +
                            std::to_string(plan.row_token[0]));
  }
  // The slots the gathered rows go to: this rank's own (latent, rope, and the sharded indexer's keys) and,
  // with the replicated indexer, every rank's indexer-key slots.
  std::vector<int64_t> owned(static_cast<size_t>(gathered), -1), all(replicated ? static_cast<size_t>(gathered) : 0, -1);
  for (int64_t j = 0; j < gathered; ++j) {
    const int32_t b = plan.gathered_request[j];
    if (b < 0) continue;
    const int64_t p = plan.gathered_pos[j];
    DSACP_ASSIGN_OR_RETURN(owned[j], sharded_slot(sharding, plan.cr, table, b, p, B));
    if (replicated) all[j] = int64_t{rep_table.page(b, p / B)} * B + p % B;
  }
  // The block table: the caller's device copy, or uploaded on its own straight from its vector (copying it into
  // the batch first would touch fresh pages of a large temporary every step); the small vectors go in one batch.
  DSACP_ASSIGN_OR_RETURN(s.d_table, step_device_table(backend, table, in, &s.step_table));
  s.row_local_len.resize(plan.row_key_len.size());
  for (size_t t = 0; t < plan.row_key_len.size(); ++t) {
    s.row_local_len[t] = static_cast<int32_t>(sharding.local_len(plan.row_key_len[t], plan.cr));
  }
  UploadBatch batch;
  const size_t at_request = batch.add(plan.row_request), at_key_len = batch.add(plan.row_key_len),
               at_local_len = batch.add(s.row_local_len), at_owned = batch.add(owned), at_all = batch.add(all);
  // (uploaded by the step's cache write below where it is small: one CUDA call less before the indexer launch)
  CacheWriteParams w;
  DSACP_ASSIGN_OR_RETURN(s.step_rows, batch.upload_with(backend, w));
  s.d_row_request = UploadBatch::at<int32_t>(s.step_rows, at_request);
  s.d_row_key_len = UploadBatch::at<int32_t>(s.step_rows, at_key_len);
  s.d_row_local_len = UploadBatch::at<int32_t>(s.step_rows, at_local_len);
  const int64_t* d_owned = UploadBatch::at<int64_t>(s.step_rows, at_owned);
  const int64_t* d_all = UploadBatch::at<int64_t>(s.step_rows, at_all);

  // Rows [first_gathered, rows) attend over the gathered KV of `view_ids` (the rest: local decodes).
  const bool decode_only = plan.layout.num_prefills == 0;
  const bool local_decodes = layout.decode_mode == DecodeMode::kLocalMerge;
  const int64_t T_all = static_cast<int64_t>(plan.gathered_pos.size());  // DSA-CP: the padded batch
  std::vector<int32_t> all_ids(R);
  std::iota(all_ids.begin(), all_ids.end(), 0);
  const CpGatheredRows gathered_rows = cp_gathered_rows(plan, layout, R);
  const int64_t T_dec = gathered_rows.local_decode_rows;
  const int64_t first_gathered = gathered_rows.first_gathered;
  const std::vector<int32_t>& view_ids = gathered_rows.view_ids;

  // 1. KV exchange and the owners' cache writes (indexer keys, latent and rope rows in one call, before the
  //    indexer: nothing of it is left on the path after the indexer).
  {
    struct Exchange {
      const void* local;
      int32_t dim;
      size_t elem;  // bytes a value
      DeviceBuffer rows;
      const void* gathered = nullptr;
    } kv[4] = {{in.kv_latent, c.Dl, act, {}},
               {in.k_rope, c.Dr, act, {}},
               {in.idx_k, c.Di, dtype_size(c.index_input_dtype()), {}},
               {in.idx_k_scale, 1, sizeof(float), {}}};  // FP8: the keys' scales (else unused)
    // Without indexer keys (a precomputed top-k may come without them): latent and rope only.
    const bool keys = in.idx_k != nullptr;
    const int n_kv = !keys ? 2 : fp8 ? 4 : 3;
    std::unique_ptr<CollectiveHandle> handle;
    if (ex.size() == 1) {
      for (auto& e : kv) e.gathered = e.local;  // a group of one (DCP without PCP): the step's own rows
    } else {
      std::vector<Communicator::Part> parts;
      for (int i = 0; i < n_kv; ++i) {
        auto& e = kv[i];
        const size_t bytes = static_cast<size_t>(rows) * e.dim * e.elem;
        DSACP_ASSIGN_OR_RETURN(e.rows, backend.allocate(std::max<size_t>(gathered * e.dim * e.elem, 1)));
        e.gathered = e.rows.get();
        parts.push_back({e.local, e.rows.get(), bytes});
      }
      DSACP_ASSIGN_OR_RETURN(handle, ex.all_gather_group_async(parts));
    }
    if (handle) DSACP_RETURN_IF_ERROR(after(s, std::move(handle)));
    // One call writes the owned rows' indexer keys (every row's under the replicated indexer), latent and rope
    // (one launch on a GPU).
    w.rows = kv[2].gathered;
    w.rows_dtype = c.index_input_dtype();
    if (fp8) w.row_scales = static_cast<const float*>(kv[3].gathered);
    w.fp8_scale_mode = cc.index_scale_mode;
    w.record_scale_mode = cc.latent_scale_mode;  // an fp8_ds_mla latent: the owners quantize their rows
    w.num_rows = gathered;
    w.slots = replicated ? d_all : d_owned;
    w.pool = cache.index_keys();
    w.more[0] = {kv[0].gathered, d_owned, cache.latent(), c.act_dtype};
    w.more[1] = {kv[1].gathered, d_owned, cache.rope(), c.act_dtype};
    if (!keys) {
      w.rows = kv[0].gathered;
      w.rows_dtype = c.act_dtype;
      w.row_scales = nullptr;
      w.slots = d_owned;
      w.pool = cache.latent();
      w.more[0] = {kv[1].gathered, d_owned, cache.rope(), c.act_dtype};
      w.more[1] = {};
    }
    DSACP_RETURN_IF_ERROR(cache_write_run(backend, w).with_context("CP cache write"));
    for (auto& e : kv) s.kv_rows.push_back(std::move(e.rows));
  }

  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::kv_ms));

  // 2. Collectives that depend only on the cache write start now and overlap the indexer (reference-design
  //    4.6): the gathered KV views, the decode queries along heads (or tokens under DSA-CP).
  std::optional<PendingKvView> kv_view;
  if (first_gathered < rows) {
    DSACP_ASSIGN_OR_RETURN(kv_view, start_kv_view(s, view_ids));
  }
  const int32_t D = comms.dcp->size();
  // The decode queries along heads: launched right after this rank's indexer launch (the indexer, on the critical
  // path, is not queued behind the collective's host launch), yet ordered only after the work enqueued before
  // the indexer: the side lane, forked here, holds that point, and the gather is launched from it. The gather
  // then runs during the indexer instead of after it. Only where the collective orders itself on the device
  // (NCCL); a transport that copies on the host's schedule keeps the main stream's order.
  std::optional<PendingHeads> q_heads;
  const bool want_q_heads = !layout.dsa_cp && local_decodes && T_dec > 0 && D > 1;
  LaneSession before_indexer(backend);
  if (want_q_heads && comms.dcp->orders_on_device()) DSACP_RETURN_IF_ERROR(before_indexer.begin());
  auto start_q_heads = [&]() -> Status {
    if (want_q_heads && !q_heads) {
      before_indexer.set_lane(1);
      Result<PendingHeads> ph = start_head_gather(s, in.q_nope, in.q_rope, T_dec);
      before_indexer.set_lane(0);
      DSACP_RETURN_IF_ERROR(before_indexer.end());
      producing(s, *comms.dcp);  // later collectives start after the main lane again
      DSACP_RETURN_IF_ERROR(ph.status());
      q_heads = std::move(ph).value();
    }
    return Status();
  };
  DeviceBuffer all_qn, all_qr;
  std::unique_ptr<CollectiveHandle> h_q;
  if (layout.dsa_cp && decode_only) {
    const size_t qn_row = static_cast<size_t>(c.H) * c.Dl * act, qr_row = static_cast<size_t>(c.H) * c.Dr * act;
    DSACP_ASSIGN_OR_RETURN(all_qn, backend.allocate(std::max<size_t>(T_all * qn_row, 1)));
    DSACP_ASSIGN_OR_RETURN(all_qr, backend.allocate(std::max<size_t>(T_all * qr_row, 1)));
    DSACP_ASSIGN_OR_RETURN(h_q, comms.dcp->all_gather_group_async({{in.q_nope, all_qn.get(), rows * qn_row},
                                                                    {in.q_rope, all_qr.get(), rows * qr_row}}));
  }

  std::optional<LocalDecodes> decodes;  // prepared early under the sharded indexer

  // 3. Top-k of this rank's rows (and, under DSA-CP decode-only batches, of every token).
  DeviceBuffer all_topk;
  std::vector<int32_t> all_key_len, all_request;
  DeviceBuffer d_all_request;
  if (layout.dsa_cp) {
    for (int64_t j = 0; j < T_all; ++j) {
      all_key_len.push_back(plan.gathered_pos[j] < 0 ? 0 : static_cast<int32_t>(plan.gathered_pos[j] + 1));
      all_request.push_back(std::max(0, plan.gathered_request[j]));
    }
    DSACP_ASSIGN_OR_RETURN(d_all_request, upload_vector(backend, all_request));
  }
  if (precomputed) {
    // The caller's rows (this rank's rows, global positions), checked; no indexer, no candidates' exchange.
    TopkInputParams tp;
    tp.num_rows = rows;
    tp.K = c.K;
    tp.key_len = s.d_row_key_len;
    tp.topk = in.topk;
    tp.out = out.topk;
    DSACP_RETURN_IF_ERROR(topk_input_run(backend, tp).with_context("CP rank " + std::to_string(plan.cr)));
    clock.indexer_launched();
    DSACP_RETURN_IF_ERROR(start_q_heads());
    if (layout.dsa_cp && decode_only) {
      DSACP_ASSIGN_OR_RETURN(all_topk, backend.allocate(std::max<size_t>(T_all * c.K * sizeof(int32_t), 1)));
      DSACP_RETURN_IF_ERROR(comms.dcp->all_gather(out.topk, all_topk.get(), rows * c.K * sizeof(int32_t)));
    }
  } else if (replicated) {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_rep, upload_vector(backend, rep_table.data));
    IndexerTopkParams ip;
    ip.rows = {rows, s.d_row_request, s.d_row_key_len};
    ip.Hi = c.Hi;
    ip.Di = c.Di;
    ip.K = c.K;
    ip.q = in.idx_q;
    ip.q_dtype = c.index_input_dtype();
    ip.q_scale = in.idx_q_scale;
    ip.w = in.idx_w;
    ip.keys = cache.index_keys();
    ip.block_table = {d_rep.as<const int32_t>(), rep_table.num_requests, rep_table.max_pages};
    ip.topk = out.topk;
    ip.host_request = plan.row_request.data();
    ip.host_key_len = plan.row_key_len.data();
    DSACP_RETURN_IF_ERROR(indexer_topk_run(backend, ip).with_context("replicated indexer top-k"));
    clock.indexer_launched();
    DSACP_RETURN_IF_ERROR(start_q_heads());
    if (layout.dsa_cp && decode_only) {
      DSACP_ASSIGN_OR_RETURN(all_topk, backend.allocate(std::max<size_t>(T_all * c.K * sizeof(int32_t), 1)));
      DSACP_RETURN_IF_ERROR(comms.dcp->all_gather(out.topk, all_topk.get(), rows * c.K * sizeof(int32_t)));
    }
  } else if (layout.dsa_cp) {
    // Every rank needs every token's candidates: gather the indexer queries along tokens first.
    const size_t q_row = static_cast<size_t>(c.Hi) * c.Di * dtype_size(c.index_input_dtype());
    const size_t w_row = static_cast<size_t>(c.Hi) * sizeof(float);
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer all_q, backend.allocate(std::max<size_t>(T_all * q_row, 1)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer all_w, backend.allocate(std::max<size_t>(T_all * w_row, 1)));
    DeviceBuffer all_qs;  // FP8: the queries' scales travel with them
    std::vector<Communicator::Part> q_parts = {{in.idx_q, all_q.get(), rows * q_row}, {in.idx_w, all_w.get(), rows * w_row}};
    if (fp8) {
      DSACP_ASSIGN_OR_RETURN(all_qs, backend.allocate(std::max<size_t>(T_all * w_row, 1)));
      q_parts.push_back({in.idx_q_scale, all_qs.get(), rows * w_row});
    }
    DSACP_ASSIGN_OR_RETURN(auto h, comms.dcp->all_gather_group_async(q_parts));
    DSACP_RETURN_IF_ERROR(h->wait());
    DSACP_ASSIGN_OR_RETURN(all_topk, backend.allocate(std::max<size_t>(T_all * c.K * sizeof(int32_t), 1)));
    DSACP_RETURN_IF_ERROR(merged_topk(s, T_all, all_q.get(), all_qs.as<const float>(), all_w.as<const float>(),
                                      d_all_request.as<const int32_t>(), all_request.data(), all_key_len,
                                      all_topk.as<int32_t>()));
    clock.indexer_launched();
    DSACP_RETURN_IF_ERROR(backend.copy_on_device(out.topk, all_topk.as<int32_t>() + plan.d * rows * c.K,
                                                 rows * c.K * sizeof(int32_t)));
  } else {
    const int64_t shared = plan.num_shared_rows;
    std::optional<PendingView> idx_pending;
    GatheredViewPlan idx_plan;
    if (shared < rows) {
      // PCP prefill rows: a gathered view of every request's indexer keys.
      DSACP_ASSIGN_OR_RETURN(idx_plan, gathered_view_plan(all_ids, s.seq_lens, table, sharding, plan.cr, B));
      DSACP_ASSIGN_OR_RETURN(idx_pending, start_view(backend, *comms.world, cache.index_keys(), idx_plan));
    }
    std::optional<PendingTopk> pending_topk;
    // The merged rows are the local decodes' rows: the merge writes their local top-k too (no remap kernel).
    DeviceBuffer merged_local_topk;
    if (shared > 0 && local_decodes && T_dec > 0 && shared == T_dec) {
      DSACP_ASSIGN_OR_RETURN(merged_local_topk, backend.allocate(T_dec * c.K * sizeof(int32_t)));
    }
    if (shared > 0) {
      // The step's upload has the rows' local lengths already (no global lengths needed).
      DSACP_ASSIGN_OR_RETURN(pending_topk, start_merged_topk(s, shared, in.idx_q, in.idx_q_scale, in.idx_w, s.d_row_request,
                                                             plan.row_request.data(), {}, out.topk,
                                                             s.d_row_local_len, s.row_local_len.data(),
                                                             merged_local_topk.as<int32_t>()));
      clock.indexer_launched();  // (and the candidates' exchange started)
    }
    DSACP_RETURN_IF_ERROR(start_q_heads());
    if (shared < rows) {
      DSACP_ASSIGN_OR_RETURN(View idx_view, finish_view(backend, *idx_pending));
      DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_vt, upload_vector(backend, idx_plan.view_table.data));
      IndexerTopkParams ip;
      ip.rows = {rows - shared, offset_ptr(s.d_row_request, shared),
                 offset_ptr(s.d_row_key_len, shared)};
      ip.Hi = c.Hi;
      ip.Di = c.Di;
      ip.K = c.K;
      ip.q = offset_bytes(in.idx_q, shared * c.Hi * c.Di * static_cast<int64_t>(act));
      ip.q_dtype = c.act_dtype;
      ip.w = offset_ptr(in.idx_w, shared * c.Hi);
      ip.keys = idx_view.pool;
      ip.block_table = {d_vt.as<const int32_t>(), idx_plan.view_table.num_requests, idx_plan.view_table.max_pages};
      ip.topk = out.topk + shared * c.K;
      ip.host_request = plan.row_request.data() + shared;
      ip.host_key_len = plan.row_key_len.data() + shared;
      DSACP_RETURN_IF_ERROR(indexer_topk_run(backend, ip).with_context("indexer top-k over gathered keys"));
      clock.indexer_launched();
    }
    if (pending_topk) {
      // While the candidates are computed and exchanged, issue what the local decodes need that does not
      // depend on them; then wait for the candidates and merge.
      if (local_decodes && T_dec > 0) {
        const bool merged_local = merged_local_topk.get() != nullptr;
        DSACP_ASSIGN_OR_RETURN(decodes, prepare_local_decodes(s, T_dec, q_heads, std::move(merged_local_topk)));
        decodes->remapped = merged_local;
      }
      DSACP_RETURN_IF_ERROR(finish_merged_topk(s, *pending_topk));
    }
  }

  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::topk_ms));

  // 4. Attention: rows over the gathered KV with this rank's heads (no merge) ...
  if (kv_view) DSACP_RETURN_IF_ERROR(gathered_attention(s, first_gathered, rows - first_gathered, *kv_view));
  // ... and decode rows over each rank's own keys, merged by LSE.
  if (layout.dsa_cp && decode_only) {
    // Every token's query, local attention over own keys, all-to-all along tokens, merge.
    DSACP_RETURN_IF_ERROR(h_q->wait());
    const int64_t H = c.H;
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer part_out, backend.allocate(T_all * H * c.Dl * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer part_lse, backend.allocate(T_all * H * sizeof(float)));
    DSACP_RETURN_IF_ERROR(local_partial_attention(s, T_all, all_qn.get(), all_qr.get(), d_all_request.as<const int32_t>(),
                                                  all_key_len, all_topk.as<const int32_t>(), part_out.as<float>(),
                                                  part_lse.as<float>()));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer recv_out, backend.allocate(T_all * H * c.Dl * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer recv_lse, backend.allocate(T_all * H * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(auto h, comms.dcp->all_to_all_group_async({{part_out.get(), recv_out.get(), rows * H * c.Dl * sizeof(float)},
                                                                       {part_lse.get(), recv_lse.get(), rows * H * sizeof(float)}}));
    DSACP_RETURN_IF_ERROR(h->wait());
    DSACP_RETURN_IF_ERROR(merge_into(s, D, rows * H, recv_out.as<const float>(), recv_lse.as<const float>(), out.out,
                                     out.lse));
  } else if (!layout.dsa_cp && local_decodes && T_dec > 0) {
    DSACP_RETURN_IF_ERROR(start_q_heads());
    if (!decodes) {
      DSACP_ASSIGN_OR_RETURN(decodes, prepare_local_decodes(s, T_dec, q_heads));
    }
    DSACP_RETURN_IF_ERROR(run_local_decodes(s, *decodes));
  }

  // 5. The outputs in the caller's forms: each position's slot on the rank that stores it (the shared block table
  //    at its local position), base-2 LSE.
  OutputForms forms;
  forms.rows = rows;
  forms.topk = out.topk;
  forms.request = s.d_row_request;
  forms.block_table = {s.d_table, table.num_requests, table.max_pages};
  forms.page_size = B;
  forms.num_pages = cc.num_pages;
  forms.Pt = sharding.Pt;
  forms.I = sharding.I;
  forms.out_topk = caller_out.topk;
  forms.lse = out.lse;
  forms.lse_count = rows * Hr;
  DSACP_RETURN_IF_ERROR(output_forms(backend, c, forms));

  // 6. Graph-bucket rows past the local rows: topk -1, out 0, lse -inf.
  const int64_t extra = plan.output_rows - rows;
  if (extra > 0) {
    DSACP_RETURN_IF_ERROR(backend.fill(caller_out.topk + rows * c.K, DType::kI32, extra * c.K, -1.f));
    DSACP_RETURN_IF_ERROR(backend.fill(offset_bytes(out.out, rows * Hr * c.Dl * static_cast<int64_t>(dtype_size(c.out_dtype))),
                                       c.out_dtype, extra * Hr * c.Dl, 0.f));
    DSACP_RETURN_IF_ERROR(backend.fill(out.lse + rows * Hr, DType::kF32, extra * Hr, -std::numeric_limits<float>::infinity()));
  }
  // The kernels' error read-back is enqueued before the collectives' waits (which come first: they are bounded),
  // so the synchronize after them does not add its own device round trip once the GPU is done (the DCP decode's
  // timeline on 2 x H200: 7-9 us from the last wait to the step's end, 12-14 before).
  DSACP_RETURN_IF_ERROR(backend.begin_synchronize());
  for (auto& h : s.in_flight) DSACP_RETURN_IF_ERROR(h->wait());
  Status end = backend.synchronize();
  // (checked even after a failed synchronize: a row wait that gave up fails its communicator here, not at its
  // next use; the synchronize's error is the one reported)
  for (Communicator* comm : s.rows_checked_at_end) {
    const Status rows_status = comm->window_rows_check();
    if (end.ok()) end = rows_status;
  }
  DSACP_RETURN_IF_ERROR(end.with_context("CP step, rank " + std::to_string(plan.cr)));
  DSACP_RETURN_IF_ERROR(clock.mark(&StepPhaseTimes::attention_ms));
  clock.finish();
  return Status();
}

}  // namespace dsacp
