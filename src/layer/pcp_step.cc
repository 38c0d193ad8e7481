// One rank's PCP step (reference-design §3, contract §3):
//   1. all-gather the step's KV rows (latent, rope, indexer key) of every rank's local rows;
//   2. write the rows this rank owns (padded slot mapping composed with the restore order);
//   3. build gathered views of the indexer keys (all requests) and of the latent/rope KV (the requests
//      attended over a gathered view);
//   4. indexer + exact top-k for the local rows (head and tail chunks at once: each row carries its own
//      causal horizon, so the head and tail calls of the reference design are one call here);
//   5. attention: prefill rows over the gathered view; decode rows either over the gathered view too
//      (kGathered) or over this rank's own keys with the LSE merge across ranks (kLocalMerge).
#include <limits>
#include <numeric>
#include <string>

#include "dsacp/cp_step.h"
#include "layer/step_checks.h"

namespace dsacp {
namespace {

struct View {
  DeviceBuffer storage;
  PagedPoolView pool;
};

// Packs `own` rows for the view, all-gathers them and lays them out as the view's pool.
Result<View> build_view(Backend& backend, Communicator& comm, const PagedPoolView& own, const GatheredViewPlan& v) {
  const int64_t P = comm.size();
  const size_t row_bytes = static_cast<size_t>(own.dim) * dtype_size(own.dtype);
  if (v.rows_per_rank < 1) return internal_error("gathered view with no rows");
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_pack_slots, upload_vector(backend, v.pack_slots));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer pack, backend.allocate(v.rows_per_rank * row_bytes));
  GatherRowsParams g;
  g.src = own.data;
  g.src_dtype = own.dtype;
  g.src_rows = own.num_pages * own.page_size;
  g.dim = own.dim;
  g.index = d_pack_slots.as<const int64_t>();
  g.num_rows = v.rows_per_rank;
  g.dst = pack.get();
  g.dst_dtype = own.dtype;
  DSACP_RETURN_IF_ERROR(gather_rows_run(backend, g).with_context("pack for a gathered view"));
  View out;
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer gathered, backend.allocate(P * v.rows_per_rank * row_bytes));
  DSACP_RETURN_IF_ERROR(comm.all_gather(pack.get(), gathered.get(), v.rows_per_rank * row_bytes));
  out.pool = own;
  out.pool.num_pages = v.view_num_pages;
  if (v.direct) {
    out.storage = std::move(gathered);
  } else {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_unpack, upload_vector(backend, v.unpack_rows));
    DSACP_ASSIGN_OR_RETURN(out.storage, backend.allocate(v.view_num_pages * own.page_size * row_bytes));
    g.src = gathered.get();
    g.src_rows = P * v.rows_per_rank;
    g.index = d_unpack.as<const int64_t>();
    g.num_rows = static_cast<int64_t>(v.unpack_rows.size());
    g.dst = out.storage.get();
    DSACP_RETURN_IF_ERROR(gather_rows_run(backend, g).with_context("unpack a gathered view"));
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

}  // namespace

Status pcp_step_run(Backend& backend, Communicator& comm, const StepConfig& config,
                    const std::vector<Request>& requests, const PcpRankPlan& plan, const KvSharding& sharding,
                    const BlockTable& table, PagedKvCache& cache, PcpDecodeMode decode_mode, const StepInputs& in,
                    const StepOutputs& out) {
  const PagedCacheConfig& cc = cache.config();
  const int32_t P = comm.size(), rank = comm.rank();
  if (plan.P != P || plan.rank != rank) {
    return invalid_argument("PCP plan is for rank " + std::to_string(plan.rank) + " of " + std::to_string(plan.P) +
                            ", the communicator is rank " + std::to_string(rank) + " of " + std::to_string(P));
  }
  if (sharding.Pt != P) {
    return unsupported("PCP with the KV sharded over " + std::to_string(sharding.Pt) + " ranks (expected P = " +
                       std::to_string(P) + ")");
  }
  const int32_t cr = rank;
  DSACP_RETURN_IF_ERROR(check_step_config(config, cc));
  const int32_t R = static_cast<int32_t>(requests.size());
  if (table.num_requests != R) {
    return invalid_argument("block table has " + std::to_string(table.num_requests) + " rows, the batch has " +
                            std::to_string(R) + " requests");
  }
  std::vector<int64_t> pages(R), seq_lens(R);
  for (int32_t b = 0; b < R; ++b) {
    seq_lens[b] = requests[b].seq_len();
    pages[b] = sharding.pages_needed(seq_lens[b], cc.page_size);
  }
  DSACP_RETURN_IF_ERROR(check_block_table_pages(table, pages, cc));

  const int64_t T_loc = plan.num_local_tokens, T_dec = plan.num_local_decode_tokens;
  const int32_t num_decodes = plan.layout.num_decodes;
  const size_t act = dtype_size(config.act_dtype), outsz = dtype_size(config.out_dtype);

  // 1. All-gather the step's KV rows (three collectives in flight at once).
  struct Gathered {
    const void* local;
    int32_t dim;
    PagedPoolView pool;
    DeviceBuffer rows;
  } kv[3] = {{in.kv_latent, config.Dl, cache.latent(), {}},
             {in.k_rope, config.Dr, cache.rope(), {}},
             {in.idx_k, config.Di, cache.index_keys(), {}}};
  std::unique_ptr<CollectiveHandle> handles[3];
  for (int i = 0; i < 3; ++i) {
    const size_t bytes = static_cast<size_t>(T_loc) * kv[i].dim * act;
    DSACP_ASSIGN_OR_RETURN(kv[i].rows, backend.allocate(std::max<size_t>(P * bytes, 1)));
    DSACP_ASSIGN_OR_RETURN(handles[i], comm.all_gather_async(kv[i].local, kv[i].rows.get(), bytes));
  }
  for (auto& h : handles) DSACP_RETURN_IF_ERROR(h->wait());

  // 2. Write the rows this rank owns.
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_slots, upload_vector(backend, plan.gathered_row_slots()));
  for (auto& g : kv) {
    CacheWriteParams w;
    w.rows = g.rows.get();
    w.rows_dtype = config.act_dtype;
    w.num_rows = P * T_loc;
    w.slots = d_slots.as<const int64_t>();
    w.pool = g.pool;
    DSACP_RETURN_IF_ERROR(cache_write_run(backend, w).with_context("PCP cache write"));
  }

  // 3. Gathered views.
  std::vector<int32_t> all_ids(R);
  std::iota(all_ids.begin(), all_ids.end(), 0);
  DSACP_ASSIGN_OR_RETURN(GatheredViewPlan idx_plan,
                         gathered_view_plan(all_ids, seq_lens, table, sharding, cr, cc.page_size));
  DSACP_ASSIGN_OR_RETURN(View idx_view, build_view(backend, comm, cache.index_keys(), idx_plan));
  const bool gathered_decodes = decode_mode == PcpDecodeMode::kGathered;
  const int32_t first_attn = gathered_decodes ? 0 : num_decodes;  // requests attended over the gathered view
  std::vector<int32_t> attn_ids(all_ids.begin() + first_attn, all_ids.end());
  std::vector<int64_t> attn_lens(seq_lens.begin() + first_attn, seq_lens.end());
  GatheredViewPlan attn_plan;
  View lat_view, rope_view;
  if (!attn_ids.empty()) {
    DSACP_ASSIGN_OR_RETURN(attn_plan, gathered_view_plan(attn_ids, attn_lens, table, sharding, cr, cc.page_size));
    DSACP_ASSIGN_OR_RETURN(lat_view, build_view(backend, comm, cache.latent(), attn_plan));
    DSACP_ASSIGN_OR_RETURN(rope_view, build_view(backend, comm, cache.rope(), attn_plan));
  }

  // 4. Indexer + top-k for every local row over the indexer view (view row b = request b).
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_row_request, upload_vector(backend, plan.row_request));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_row_key_len, upload_vector(backend, plan.row_key_len));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_idx_table, upload_vector(backend, idx_plan.view_table.data));
  IndexerTopkParams ip;
  ip.rows = {T_loc, d_row_request.as<const int32_t>(), d_row_key_len.as<const int32_t>()};
  ip.Hi = config.Hi;
  ip.Di = config.Di;
  ip.K = config.K;
  ip.q = in.idx_q;
  ip.q_dtype = config.act_dtype;
  ip.w = in.idx_w;
  ip.keys = idx_view.pool;
  ip.block_table = {d_idx_table.as<const int32_t>(), idx_plan.view_table.num_requests, idx_plan.view_table.max_pages};
  ip.topk = out.topk;
  DSACP_RETURN_IF_ERROR(indexer_topk_run(backend, ip).with_context("PCP indexer top-k"));

  // 5. Attention over the gathered view for rows [first_row, T_loc).
  SparseMlaParams ap;
  ap.H = config.H;
  ap.Dl = config.Dl;
  ap.Dr = config.Dr;
  ap.K = config.K;
  ap.scale = config.scale;
  ap.q_dtype = config.act_dtype;
  ap.out_dtype = config.out_dtype;
  const int64_t first_row = gathered_decodes ? 0 : T_dec;
  DeviceBuffer d_view_rows, d_attn_table;
  if (first_row < T_loc) {
    std::vector<int32_t> view_rows(plan.row_request.begin() + first_row, plan.row_request.end());
    for (int32_t& b : view_rows) b -= first_attn;
    DSACP_ASSIGN_OR_RETURN(d_view_rows, upload_vector(backend, view_rows));
    DSACP_ASSIGN_OR_RETURN(d_attn_table, upload_vector(backend, attn_plan.view_table.data));
    ap.rows = {T_loc - first_row, d_view_rows.as<const int32_t>(),
               offset_ptr(d_row_key_len.as<const int32_t>(), first_row)};
    ap.q_nope = offset_bytes(in.q_nope, first_row * config.H * config.Dl * static_cast<int64_t>(act));
    ap.q_rope = offset_bytes(in.q_rope, first_row * config.H * config.Dr * static_cast<int64_t>(act));
    ap.latent = lat_view.pool;
    ap.rope = rope_view.pool;
    ap.block_table = {d_attn_table.as<const int32_t>(), attn_plan.view_table.num_requests,
                      attn_plan.view_table.max_pages};
    ap.topk = offset_ptr(out.topk, first_row * config.K);
    ap.out = offset_bytes(out.out, first_row * config.H * config.Dl * static_cast<int64_t>(outsz));
    ap.lse = offset_ptr(out.lse, first_row * config.H);
    DSACP_RETURN_IF_ERROR(sparse_mla_run(backend, ap).with_context("PCP sparse MLA (gathered view)"));
  }

  // Decode rows by local attention over this rank's keys and the exact LSE merge across ranks.
  if (!gathered_decodes && T_dec > 0) {
    const int64_t rows_h = T_dec * config.H;
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_local_topk, backend.allocate(T_dec * config.K * sizeof(int32_t)));
    TopkRemapParams rp;
    rp.num_rows = T_dec;
    rp.K = config.K;
    rp.topk = out.topk;
    rp.local = d_local_topk.as<int32_t>();
    rp.Pt = sharding.Pt;
    rp.I = sharding.I;
    rp.cr = cr;
    DSACP_RETURN_IF_ERROR(topk_remap_run(backend, rp).with_context("PCP decode top-k remap"));
    std::vector<int32_t> local_len(static_cast<size_t>(T_dec));
    for (int64_t t = 0; t < T_dec; ++t) {
      local_len[t] = static_cast<int32_t>(sharding.local_len(seq_lens[plan.row_request[t]], cr));
    }
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_local_len, upload_vector(backend, local_len));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_table, upload_vector(backend, table.data));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer part_out, backend.allocate(rows_h * config.Dl * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer part_lse, backend.allocate(rows_h * sizeof(float)));
    ap.rows = {T_dec, d_row_request.as<const int32_t>(), d_local_len.as<const int32_t>()};
    ap.q_nope = in.q_nope;
    ap.q_rope = in.q_rope;
    ap.latent = cache.latent();
    ap.rope = cache.rope();
    ap.block_table = {d_table.as<const int32_t>(), table.num_requests, table.max_pages};
    ap.topk = d_local_topk.as<const int32_t>();
    ap.out = part_out.get();
    ap.out_dtype = DType::kF32;
    ap.lse = part_lse.as<float>();
    DSACP_RETURN_IF_ERROR(sparse_mla_run(backend, ap).with_context("PCP sparse MLA (local decode)"));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer all_out, backend.allocate(P * rows_h * config.Dl * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer all_lse, backend.allocate(P * rows_h * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(auto h_out, comm.all_gather_async(part_out.get(), all_out.get(), rows_h * config.Dl * 4));
    DSACP_ASSIGN_OR_RETURN(auto h_lse, comm.all_gather_async(part_lse.get(), all_lse.get(), rows_h * 4));
    DSACP_RETURN_IF_ERROR(h_out->wait());
    DSACP_RETURN_IF_ERROR(h_lse->wait());
    DeviceBuffer merged;
    LseMergeParams mp;
    mp.num_parts = P;
    mp.num_rows = rows_h;
    mp.Dl = config.Dl;
    mp.part_out = all_out.as<const float>();
    mp.part_lse = all_lse.as<const float>();
    mp.lse = out.lse;
    if (config.out_dtype == DType::kF32) {
      mp.out = static_cast<float*>(out.out);
    } else {
      DSACP_ASSIGN_OR_RETURN(merged, backend.allocate(rows_h * config.Dl * sizeof(float)));
      mp.out = merged.as<float>();
    }
    DSACP_RETURN_IF_ERROR(lse_merge_run(backend, mp).with_context("PCP decode LSE merge"));
    if (config.out_dtype != DType::kF32) {
      std::vector<int64_t> identity(static_cast<size_t>(rows_h));
      std::iota(identity.begin(), identity.end(), 0);
      DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_identity, upload_vector(backend, identity));
      GatherRowsParams g;
      g.src = merged.get();
      g.src_dtype = DType::kF32;
      g.src_rows = rows_h;
      g.dim = config.Dl;
      g.index = d_identity.as<const int64_t>();
      g.num_rows = rows_h;
      g.dst = out.out;
      g.dst_dtype = config.out_dtype;
      DSACP_RETURN_IF_ERROR(gather_rows_run(backend, g).with_context("PCP decode output conversion"));
    }
  }

  // 6. Graph-bucket rows past the local rows: topk -1, out 0, lse -inf.
  const int64_t extra = plan.output_rows - T_loc;
  if (extra > 0) {
    DSACP_RETURN_IF_ERROR(backend.fill(out.topk + T_loc * config.K, DType::kI32, extra * config.K, -1.f));
    DSACP_RETURN_IF_ERROR(backend.fill(offset_bytes(out.out, T_loc * config.H * config.Dl * static_cast<int64_t>(outsz)),
                                       config.out_dtype, extra * config.H * config.Dl, 0.f));
    DSACP_RETURN_IF_ERROR(backend.fill(out.lse + T_loc * config.H, DType::kF32, extra * config.H,
                                       -std::numeric_limits<float>::infinity()));
  }
  return backend.synchronize();
}

}  // namespace dsacp
