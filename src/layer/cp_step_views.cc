// The gathered views of a CP rank's step: the PCP prefill rows' view of every request's indexer keys, and the
// gathered KV (latent and rope, or the fp8_ds_mla records whole) that rows attend over with the rank's heads.
// Their pack and unpack orders and view tables come from the plan (cp_step_plan.cc).
#include <algorithm>
#include <string>

#include "layer/cp_step_internal.h"

namespace dsacp {

Status gather_dev(Backend& backend, const void* src, DType src_dtype, int64_t src_rows, int32_t dim,
                  const int64_t* d_index, int64_t n, void* dst, DType dst_dtype, const char* what,
                  int64_t src_stride, int64_t src_page_rows, int64_t src_page_pad) {
  if (n == 0) return Status();
  GatherRowsParams g;
  g.src_stride = src_stride;
  g.src_page_rows = src_page_rows;
  g.src_page_pad = src_page_pad;
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

namespace {

// How a pool's rows travel: as they are stored (dim values of its dtype), or, for fp8_ds_mla records, each
// record's bytes whole (latent values, scales and rope together) as 4- or 2-byte units copied bit for bit.
struct RowUnits {
  DType dtype;
  int32_t dim;
  size_t row_bytes() const { return static_cast<size_t>(dim) * dtype_size(dtype); }
};
RowUnits row_units(const PagedPoolView& own) {
  if (!own.records()) return {own.dtype, own.dim};
  return own.record_bytes % 4 == 0 ? RowUnits{DType::kF32, own.record_bytes / 4}
                                   : RowUnits{DType::kBF16, own.record_bytes / 2};
}

// Packs `own` rows for the view (reference-design 4.6: right after the cache write, so the gather overlaps
// the indexer); its all-gather is started by the caller (alone, or grouped with another view's).
Result<PendingView> pack_view(RankStep& s, Communicator& comm, const PagedPoolView& own, const DeviceViewPlan& v) {
  Backend& backend = s.backend;
  PendingView pv;
  pv.plan = &v;
  pv.own = own;
  pv.ranks = comm.size();
  const RowUnits u = row_units(own);
  const int64_t n = v.host.rows_per_rank;
  if (n < 1) return internal_error("gathered view with no rows");
  DSACP_ASSIGN_OR_RETURN(pv.pack, s.take(n * u.row_bytes()));
  DSACP_RETURN_IF_ERROR(gather_dev(backend, own.data, u.dtype, own.num_pages * own.page_size, u.dim, v.pack_slots, n,
                                   pv.pack.get(), u.dtype, "pack for a gathered view",
                                   own.records() ? 0 : own.row_stride, own.page_size,
                                   pool_page_pad_bytes(own) / static_cast<int64_t>(dtype_size(u.dtype))));
  DSACP_ASSIGN_OR_RETURN(pv.gathered, s.take(pv.ranks * n * u.row_bytes()));
  return pv;
}

Communicator::Part view_part(const PendingView& pv) {
  return {pv.pack.get(), pv.gathered.get(), pv.plan->host.rows_per_rank * row_units(pv.own).row_bytes()};
}

}  // namespace

Result<PendingView> start_view(RankStep& s, Communicator& comm, const PagedPoolView& own, const DeviceViewPlan& v) {
  DSACP_ASSIGN_OR_RETURN(PendingView pv, pack_view(s, comm, own, v));
  const Communicator::Part part = view_part(pv);
  DSACP_ASSIGN_OR_RETURN(pv.handle, comm.all_gather_async(part.send, part.recv, part.bytes));
  return pv;
}

// Waits for the view's all-gather and lays the gathered rows out as the view's pool.
// (A view whose gather was grouped with another's has no handle of its own: the other's wait covers it.)
Result<View> finish_view(RankStep& s, PendingView& pv) {
  Backend& backend = s.backend;
  if (pv.handle) DSACP_RETURN_IF_ERROR(after(s, std::move(pv.handle)));
  const GatheredViewPlan& v = pv.plan->host;
  const RowUnits u = row_units(pv.own);
  View out;
  out.pool = pv.own;
  out.pool.num_pages = v.view_num_pages;
  out.pool.row_stride = 0;  // the gathered rows are dense, whatever the own pool's strides
  out.pool.page_stride = 0;
  if (v.direct) {
    out.storage = std::move(pv.gathered);
  } else {
    const int64_t n = v.view_num_pages * pv.own.page_size;
    DSACP_ASSIGN_OR_RETURN(out.storage, s.take(n * u.row_bytes()));
    DSACP_RETURN_IF_ERROR(gather_dev(backend, pv.gathered.get(), u.dtype, pv.ranks * v.rows_per_rank, u.dim,
                                     pv.plan->unpack_rows, static_cast<int64_t>(v.unpack_rows.size()),
                                     out.storage.get(), u.dtype, "unpack a gathered view"));
  }
  out.pool.data = out.storage.get();
  return out;
}

Result<PendingKvView> start_kv_view(RankStep& s) {
  const DeviceViewPlan& v = *s.p.kv_view;
  Communicator& world = *s.comms.world;
  PendingKvView kv;
  DSACP_ASSIGN_OR_RETURN(kv.latent, pack_view(s, world, s.cache.latent(), v));
  if (s.p.cache.fp8_latent()) {
    // fp8_ds_mla: the latent view's records carry the rope too (the 656-byte records travel, not bf16 rows).
    DSACP_ASSIGN_OR_RETURN(kv.latent.handle, world.all_gather_group_async({view_part(kv.latent)}));
    return kv;
  }
  DSACP_ASSIGN_OR_RETURN(kv.rope, pack_view(s, world, s.cache.rope(), v));
  DSACP_ASSIGN_OR_RETURN(kv.handle, world.all_gather_group_async({view_part(kv.latent), view_part(kv.rope)}));
  return kv;
}

Status gathered_attention(RankStep& s, int64_t first, int64_t n, PendingKvView& kv) {
  if (kv.handle) DSACP_RETURN_IF_ERROR(after(s, std::move(kv.handle)));
  DSACP_ASSIGN_OR_RETURN(View lat, finish_view(s, kv.latent));
  View rope;
  if (s.p.cache.fp8_latent()) {
    rope.pool = s.cache.rope();  // the rope view of the gathered records
    rope.pool.data = lat.pool.data;
    rope.pool.num_pages = lat.pool.num_pages;
    rope.pool.page_stride = 0;
  } else {
    DSACP_ASSIGN_OR_RETURN(rope, finish_view(s, kv.rope));
  }
  if (n == 0) return Status();
  const StepConfig& c = s.c();
  const DeviceViewPlan& vp = *s.p.kv_view;
  const int64_t Hr = s.plan().num_heads;
  SparseMlaParams ap;
  ap.rows = {n, s.p.d_rows_view.as<const int32_t>(), offset_ptr(s.p.d_row_key_len, first)};
  ap.H = static_cast<int32_t>(Hr);
  ap.Dl = c.Dl;
  ap.Dr = c.Dr;
  ap.K = c.K;
  ap.scale = c.scale;
  ap.q_nope = offset_bytes(s.in.q_nope, first * Hr * c.Dl * static_cast<int64_t>(s.act()));
  ap.q_rope = offset_bytes(s.in.q_rope, first * Hr * c.Dr * static_cast<int64_t>(s.act()));
  ap.q_dtype = c.act_dtype;
  ap.latent = lat.pool;
  ap.rope = rope.pool;
  ap.block_table = {vp.view_table, vp.host.view_table.num_requests, vp.host.view_table.max_pages};
  ap.topk = offset_ptr<const int32_t>(s.out.topk, first * c.K);
  ap.out = offset_bytes(s.out.out, first * Hr * c.Dl * static_cast<int64_t>(dtype_size(c.out_dtype)));
  ap.out_dtype = c.out_dtype;
  ap.lse = offset_ptr(s.out.lse, first * Hr);
  return sparse_mla_run(s.backend, ap).with_context("sparse MLA over the gathered KV");
}

}  // namespace dsacp
