// The sharded indexer's merged top-k on a CP rank: each rank's candidates (its local top-k with scores over its
// own indexer keys) exchanged over the world group, in its exchange window where it has one (else an
// all-gather), and merged exactly with the canonical tie rule — by the top-k itself, row by row, where the
// window is synchronized row by row (fused), else by the merge kernel.
#include <string>

#include "layer/cp_step_internal.h"

namespace dsacp {
namespace {

// The merge of pt's candidates (the world's parts, in its window or gathered) into pt.topk / pt.local_topk.
TopkMergeParams candidate_merge_params(const RankStep& s, const PendingTopk& pt) {
  TopkMergeParams mp;
  mp.num_parts = s.comms.world->size();
  mp.num_rows = pt.n;
  mp.K = s.c().K;
  mp.I = s.p.sharding.I;
  if (pt.window) {
    // The candidates in place, in every rank's window buffer.
    const size_t topk_bytes = static_cast<size_t>(pt.n * s.c().K) * sizeof(int32_t);
    mp.part_topk = nullptr;
    mp.part_scores = nullptr;
    for (int32_t k = 0; k < mp.num_parts; ++k) {
      const char* buf = static_cast<const char*>(pt.window->all[static_cast<size_t>(k)]);
      mp.part_topk_of[k] = reinterpret_cast<const int32_t*>(buf);
      mp.part_scores_of[k] = reinterpret_cast<const float*>(buf + topk_bytes);
    }
  } else {
    mp.part_topk = pt.all_topk.as<const int32_t>();
    mp.part_scores = pt.all_scores.as<const float>();
  }
  mp.topk = pt.topk;
  mp.local_topk = pt.local_topk;
  mp.local_part = s.plan().cr;
  mp.wait = pt.rows;
  return mp;
}

}  // namespace

// The top-k merges the window's rows itself (IndexerTopkParams::merge) unless CpLayout::fused_topk_merge is off: no
// merge kernel, and the attention follows the top-k directly. On 2 x H200 (DCP 128K b=64, 5 alternating rounds)
// 0.673 ms a step against 0.677 with the merge kernel: within the run-to-run spread, not worse.
// With local_topk, the merge also writes the merged rows remapped to this rank's own local positions (the local
// decodes' input, in the same kernel). q_scale: the FP8 queries' scales ([n, Hi]; null for f32/bf16 queries).
Result<PendingTopk> start_merged_topk(RankStep& s, const MergedTopkRows& rows, const void* q, const float* q_scale,
                                      const float* w, int32_t* topk, int32_t* local_topk) {
  Communicator& world = *s.comms.world;
  const StepConfig& c = s.c();
  const int64_t Pt = world.size(), K = c.K, n = rows.n;
  PendingTopk pt;
  pt.n = n;
  pt.topk = topk;
  pt.local_topk = local_topk;
  const size_t topk_bytes = static_cast<size_t>(n * K) * sizeof(int32_t);
  // The window only under one PCP rank (the DCP decode: the world is the DCP group) and for the merge kernel's
  // small shape (at most 4096 candidates a row: 2 x 2048), what was run on the GPUs. P2 layouts stalled in a
  // window publish in 2 of 5 test runs on 2 x H200 (not understood; D2 layouts, whose prefill rows' views also go
  // over the world, passed every run); they keep NCCL, as do larger merges (whose host fallback would copy from
  // the peers' memory).
  if (s.p.layout.P == 1 && Pt * K <= 4096) {
    DSACP_ASSIGN_OR_RETURN(pt.window, try_window(s, world, 2 * topk_bytes));
  }
  int32_t* part_topk = nullptr;
  float* part_scores = nullptr;
  if (pt.window) {
    part_topk = static_cast<int32_t*>(pt.window->mine);
    part_scores = reinterpret_cast<float*>(static_cast<char*>(pt.window->mine) + topk_bytes);
  } else {
    DSACP_ASSIGN_OR_RETURN(pt.part_topk, s.take(n * K * sizeof(int32_t)));
    DSACP_ASSIGN_OR_RETURN(pt.part_scores, s.take(n * K * sizeof(float)));
    part_topk = pt.part_topk.as<int32_t>();
    part_scores = pt.part_scores.as<float>();
  }
  IndexerTopkParams ip;
  ip.rows = {n, rows.request, rows.local_len};
  ip.Hi = c.Hi;
  ip.Di = c.Di;
  ip.K = c.K;
  ip.q = q;
  ip.q_dtype = c.index_input_dtype();
  ip.q_scale = q_scale;
  ip.w = w;
  ip.keys = s.cache.index_keys();
  ip.block_table = {s.p.d_table, s.p.table.num_requests, s.p.table.max_pages};
  ip.topk = part_topk;
  ip.topk_scores = part_scores;
  ip.host_request = rows.host_request;
  ip.host_key_len = rows.host_local_len;
  if (pt.window) {
    // The top-k raises each row's flag in the peers as it stores the row; the merge waits for it.
    DSACP_ASSIGN_OR_RETURN(pt.rows, try_window_rows(s.p.layout, producing(s, world), n, /*topk_exchange=*/true));
    ip.signal = pt.rows;
    if (pt.rows.active() && s.p.layout.fused_topk_merge) {
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
  DSACP_ASSIGN_OR_RETURN(pt.all_topk, s.take(Pt * n * K * sizeof(int32_t)));
  DSACP_ASSIGN_OR_RETURN(pt.all_scores, s.take(Pt * n * K * sizeof(float)));
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

}  // namespace dsacp
