// The collectives one CP rank issues in a step, read off the plan the executor runs (src/layer/cp_step.cc,
// cp_step_run): the same plan functions give the rows, the gathered views and the groups; this file only
// follows cp_step_run's branches and sizes each buffer it exchanges. A change there must be mirrored here (the
// tests in tests/plan run the executor on threads and compare every layout's counts and bytes exactly).
#include <algorithm>
#include <numeric>
#include <string>

#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "dsacp/layout_planner.h"

namespace dsacp {

const char* comm_group_name(CommGroup g) {
  switch (g) {
    case CommGroup::kWorld: return "world";
    case CommGroup::kPcp: return "pcp";
    case CommGroup::kDcp: return "dcp";
  }
  return "?";
}

const char* comm_kind_name(CommKind k) {
  switch (k) {
    case CommKind::kAllGather: return "all_gather";
    case CommKind::kAllToAll: return "all_to_all";
    case CommKind::kWindow: return "window";
  }
  return "?";
}

CollectiveTotals collective_totals(const std::vector<PlannedCollective>& list, CommGroup group) {
  CollectiveTotals t;
  for (const PlannedCollective& c : list) {
    if (c.group != group) continue;
    if (c.kind == CommKind::kWindow) {
      ++t.windows;
    } else {
      ++t.collectives;
      t.bytes += c.bytes;
    }
  }
  return t;
}

namespace {

struct Builder {
  std::vector<PlannedCollective> out;
  int32_t size_of[3] = {1, 1, 1};
  // One collective of `parts` buffers of the given bytes each (a group of one rank issues none where the
  // executor skips it; the callers decide).
  void add(CommGroup g, CommKind k, const std::vector<int64_t>& part_bytes, const char* what, bool blocking = false) {
    PlannedCollective c;
    c.group = g;
    c.kind = k;
    c.ranks = size_of[static_cast<int>(g)];
    for (int64_t b : part_bytes) c.bytes += b * (c.ranks - 1);
    c.parts = static_cast<int32_t>(part_bytes.size());
    c.blocking = blocking;
    c.what = what;
    out.push_back(std::move(c));
  }
};

// Bytes of one row of a pool as a gathered view moves it (cp_step.cc row_units): fp8_ds_mla records whole.
int64_t latent_row_bytes(const PagedCacheConfig& cc) {
  if (cc.fp8_latent()) return fp8_ds_mla_record_bytes(cc.Dl, cc.Dr);
  return int64_t{cc.Dl} * static_cast<int64_t>(dtype_size(cc.dtype));
}

// The rows every rank packs for the gathered view of `ids` (GatheredViewPlan::rows_per_rank).
Result<int64_t> view_rows(const std::vector<int32_t>& ids, const std::vector<int64_t>& seq_lens, const BlockTable& table,
                          const KvSharding& s, int32_t cr, int32_t B, bool light) {
  std::vector<int64_t> lens;
  for (int32_t id : ids) lens.push_back(seq_lens[id]);
  if (!light) {
    DSACP_ASSIGN_OR_RETURN(GatheredViewPlan v, gathered_view_plan(ids, lens, table, s, cr, B));
    return v.rows_per_rank;
  }
  int64_t rows = 0;
  for (int64_t S : lens) rows += s.I % B == 0 ? s.pages_needed(S, B) * B : s.local_len(S, 0);
  return rows;
}

}  // namespace

Result<std::vector<PlannedCollective>> cp_step_collectives(const StepConfig& c, const std::vector<Request>& requests,
                                                           const CpLayout& layout, const CpRankPlan& plan,
                                                           const BlockTable& table, const CommContext& ctx) {
  DSACP_RETURN_IF_ERROR(validate_layout(layout, c.H));
  const int32_t Pt = layout.num_ranks();
  const PagedCacheConfig& cc = ctx.cache;
  const int32_t B = cc.page_size;
  const KvSharding sharding{Pt, layout.interleave == 0 ? B : layout.interleave};
  Builder b;
  b.size_of[static_cast<int>(CommGroup::kWorld)] = Pt;
  b.size_of[static_cast<int>(CommGroup::kPcp)] = layout.P;
  b.size_of[static_cast<int>(CommGroup::kDcp)] = layout.D;
  if (Pt == 1) return b.out;  // one device: step_run, no collectives

  const bool replicated = layout.indexer == IndexerMode::kReplicated;
  const bool fp8 = c.index_input_dtype() == DType::kF8E4M3;
  if (fp8 && !replicated && !layout.dsa_cp && plan.layout.num_prefills > 0) {
    return unsupported("the sharded indexer's prefill rows with FP8 indexer inputs (cp_step_run refuses them)");
  }
  const int64_t act = static_cast<int64_t>(dtype_size(c.act_dtype));
  const int64_t idx_elem = static_cast<int64_t>(dtype_size(c.index_input_dtype()));
  const int64_t rows = plan.num_rows;
  const int64_t Hr = plan.num_heads;
  const int64_t K = c.K;
  const int32_t R = static_cast<int32_t>(requests.size());
  std::vector<int64_t> seq_lens;
  for (const Request& r : requests) seq_lens.push_back(r.seq_len());

  // 1. KV exchange over the exchange group (PCP, or DCP under DSA-CP): latent, rope, indexer keys (+ scales).
  const CommGroup ex = layout.dsa_cp ? CommGroup::kDcp : CommGroup::kPcp;
  if (b.size_of[static_cast<int>(ex)] > 1) {
    std::vector<int64_t> parts = {rows * c.Dl * act, rows * c.Dr * act};
    if (ctx.index_keys) {
      parts.push_back(rows * c.Di * idx_elem);
      if (fp8) parts.push_back(rows * static_cast<int64_t>(sizeof(float)));
    }
    b.add(ex, CommKind::kAllGather, parts, "KV exchange", /*blocking=*/true);
  }

  const bool decode_only = plan.layout.num_prefills == 0;
  const bool local_decodes = layout.decode_mode == DecodeMode::kLocalMerge;
  const int64_t T_all = static_cast<int64_t>(plan.gathered_pos.size());
  std::vector<int32_t> all_ids(R);
  std::iota(all_ids.begin(), all_ids.end(), 0);
  const CpGatheredRows gathered = cp_gathered_rows(plan, layout, R);
  const int64_t T_dec = gathered.local_decode_rows;
  const int64_t first_gathered = gathered.first_gathered;
  const std::vector<int32_t>& view_ids = gathered.view_ids;

  // 2. The gathered KV view (latent + rope, or fp8_ds_mla records alone) over the world, overlapping the indexer.
  // (Only the rows a rank packs matter here; the indexer-key view of the same requests packs as many.)
  int64_t kv_view_rows = -1;
  if (first_gathered < rows) {
    DSACP_ASSIGN_OR_RETURN(kv_view_rows, view_rows(view_ids, seq_lens, table, sharding, plan.cr, B, ctx.light_views));
    if (kv_view_rows < 1) return internal_error("gathered view with no rows");
    if (cc.fp8_latent()) {
      b.add(CommGroup::kWorld, CommKind::kAllGather, {kv_view_rows * latent_row_bytes(cc)}, "gathered KV view");
    } else {
      const int64_t rope_row = int64_t{cc.Dr} * static_cast<int64_t>(dtype_size(cc.dtype));
      b.add(CommGroup::kWorld, CommKind::kAllGather,
            {kv_view_rows * latent_row_bytes(cc), kv_view_rows * rope_row}, "gathered KV view");
    }
  }
  const int32_t D = layout.D;
  const bool want_q_heads = !layout.dsa_cp && local_decodes && T_dec > 0 && D > 1;
  auto q_heads = [&]() {
    b.add(CommGroup::kDcp, CommKind::kAllGather, {T_dec * Hr * act * c.Dl, T_dec * Hr * act * c.Dr},
          "decode queries along heads");
  };
  if (layout.dsa_cp && decode_only) {
    b.add(CommGroup::kDcp, CommKind::kAllGather, {rows * c.H * c.Dl * act, rows * c.H * c.Dr * act},
          "queries along tokens");
  }
  // The merged top-k's candidates of n rows over the world: a window (NCCL, one PCP rank, small merges) or a
  // grouped all-gather of positions and scores.
  auto candidates = [&](int64_t n) {
    const int64_t topk_bytes = n * K * static_cast<int64_t>(sizeof(int32_t));
    if (ctx.windows && layout.P == 1 && int64_t{Pt} * K <= 4096) {
      b.add(CommGroup::kWorld, CommKind::kWindow, {2 * topk_bytes}, "top-k candidates (window)");
    } else {
      b.add(CommGroup::kWorld, CommKind::kAllGather, {topk_bytes, n * K * static_cast<int64_t>(sizeof(float))},
            "top-k candidates");
    }
  };

  // 3. Top-k.
  if (replicated) {
    if (want_q_heads) q_heads();
    if (layout.dsa_cp && decode_only) {
      b.add(CommGroup::kDcp, CommKind::kAllGather, {rows * K * static_cast<int64_t>(sizeof(int32_t))},
            "top-k along tokens", /*blocking=*/true);
    }
  } else if (layout.dsa_cp) {
    const int64_t q_row = int64_t{c.Hi} * c.Di * idx_elem, w_row = int64_t{c.Hi} * static_cast<int64_t>(sizeof(float));
    std::vector<int64_t> parts = {rows * q_row, rows * w_row};
    if (fp8) parts.push_back(rows * w_row);
    b.add(CommGroup::kDcp, CommKind::kAllGather, parts, "indexer queries along tokens", /*blocking=*/true);
    candidates(T_all);
  } else {
    const int64_t shared = plan.num_shared_rows;
    if (shared < rows) {
      int64_t key_rows = kv_view_rows;
      if (view_ids != all_ids || key_rows < 0) {
        DSACP_ASSIGN_OR_RETURN(key_rows, view_rows(all_ids, seq_lens, table, sharding, plan.cr, B, ctx.light_views));
      }
      const int64_t key_row = int64_t{cc.Di} * static_cast<int64_t>(dtype_size(cc.index_key_dtype()));
      b.add(CommGroup::kWorld, CommKind::kAllGather, {key_rows * key_row}, "gathered indexer-key view");
    }
    if (shared > 0) candidates(shared);
    if (want_q_heads) q_heads();
  }

  // 4. Attention's exchanges: the partials of local decodes (all-to-all over the world; merged inside attention
  //    through a window where the communicator has one and the heads split whole), or DSA-CP's along tokens.
  if (layout.dsa_cp && decode_only) {
    b.add(CommGroup::kDcp, CommKind::kAllToAll,
          {rows * c.H * c.Dl * static_cast<int64_t>(sizeof(float)), rows * c.H * static_cast<int64_t>(sizeof(float))},
          "partials along tokens", /*blocking=*/true);
  } else if (!layout.dsa_cp && local_decodes && T_dec > 0) {
    const int64_t block = T_dec * Hr;
    const int64_t part = c.out_dtype == DType::kBF16 ? 2 : 4;
    const bool direct = want_q_heads && Pt == D && Hr % std::min<int64_t>(c.H, 64) == 0 && layout.decode_head_blocks;
    if (ctx.windows && direct && layout.window_rows != CpLayout::WindowRows::kNone) {
      const int64_t lse_at = (Pt * block * c.Dl * part + 255) / 256 * 256;
      b.add(CommGroup::kWorld, CommKind::kWindow, {lse_at + Pt * block * static_cast<int64_t>(sizeof(float))},
            "decode partials (window)");
    } else {
      b.add(CommGroup::kWorld, CommKind::kAllToAll, {block * c.Dl * part, block * static_cast<int64_t>(sizeof(float))},
            "decode partials", /*blocking=*/true);
    }
  }
  return b.out;
}

}  // namespace dsacp
