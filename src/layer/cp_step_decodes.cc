// A CP rank's attention over its own keys and the LSE merges: the local decodes (every head's partials over
// this rank's keys, exchanged by head slice over the world group and merged by LSE — in the kernel itself where
// the exchange window is synchronized row by row), and the pieces DSA-CP's decode-only batches use.
#include <algorithm>
#include <string>

#include "layer/cp_step_internal.h"

namespace dsacp {

// The sparse MLA of partial attention of `n` rows (all `H` heads) over this rank's own keys: local_topk (local
// positions) over the local lengths d_local_len; the partial out [n, H, Dl] in part_dtype (f32 or bf16) and the
// lse [n, H] in f32. (After the remap the causal horizon is already in the indices: every kept entry is below the
// request's local length, the sparse_mode 0 of reference-design 4.4 step 5.)
namespace {

SparseMlaParams own_keys_mla_params(RankStep& s, int64_t n, const void* q_nope, const void* q_rope,
                                    const int32_t* request, const int32_t* d_local_len, const int32_t* local_topk,
                                    void* part_out, float* part_lse, int32_t head_blocks, DType part_dtype) {
  SparseMlaParams ap;
  ap.rows = {n, request, d_local_len};
  ap.H = s.c().H;
  ap.Dl = s.c().Dl;
  ap.Dr = s.c().Dr;
  ap.K = s.c().K;
  ap.scale = s.c().scale;
  ap.q_nope = q_nope;
  ap.q_rope = q_rope;
  ap.q_dtype = s.c().act_dtype;
  ap.latent = s.cache.latent();
  ap.rope = s.cache.rope();
  ap.block_table = {s.p.d_table, s.p.table.num_requests, s.p.table.max_pages};
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
  rp.K = s.c().K;
  rp.topk = global_topk;
  rp.local = local_topk;
  rp.Pt = s.p.sharding.Pt;
  rp.I = s.p.sharding.I;
  rp.cr = s.plan().cr;
  return topk_remap_run(s.backend, rp).with_context("top-k remap to local positions");
}

}  // namespace

// Partial attention over own keys (own_keys_mla_params), the global top-k remapped first (unless `remapped`: the
// merge wrote local_topk already).
Status partial_attention_own_keys(RankStep& s, int64_t n, const void* q_nope, const void* q_rope, const int32_t* request,
                                  const int32_t* d_local_len, const int32_t* global_topk, int32_t* local_topk,
                                  void* part_out, float* part_lse, int32_t head_blocks, DType part_dtype,
                                  bool remapped) {
  if (!remapped) DSACP_RETURN_IF_ERROR(remap_to_local(s, n, global_topk, local_topk));
  return sparse_mla_run(s.backend, own_keys_mla_params(s, n, q_nope, q_rope, request, d_local_len, local_topk,
                                                       part_out, part_lse, head_blocks, part_dtype))
      .with_context("local sparse MLA");
}

// LSE merge of `parts` partial results [parts, rows, Dl] (part_dtype) into out (out_dtype, converted by the
// merge) and lse.
Status merge_into(RankStep& s, int32_t parts, int64_t rows, const void* part_out, const float* part_lse, void* out,
                  float* lse, DType part_dtype) {
  LseMergeParams mp;
  mp.num_parts = parts;
  mp.num_rows = rows;
  mp.Dl = s.c().Dl;
  mp.part_dtype = part_dtype;
  mp.part_out = part_out;
  mp.part_lse = part_lse;
  mp.out = out;
  mp.out_dtype = s.c().out_dtype;
  mp.lse = lse;
  return lse_merge_run(s.backend, mp).with_context("LSE merge");
}

Result<PendingHeads> start_head_gather(RankStep& s, const void* q_nope, const void* q_rope, int64_t n) {
  PendingHeads ph;
  const size_t per_head = static_cast<size_t>(n) * s.plan().num_heads * s.act();
  const size_t nope = per_head * s.c().Dl, rope = per_head * s.c().Dr;
  DSACP_ASSIGN_OR_RETURN(ph.nope_blocks, s.take(std::max<size_t>(s.comms.dcp->size() * nope, 1)));
  DSACP_ASSIGN_OR_RETURN(ph.rope_blocks, s.take(std::max<size_t>(s.comms.dcp->size() * rope, 1)));
  DSACP_ASSIGN_OR_RETURN(ph.handle, producing(s, *s.comms.dcp).all_gather_group_async({{q_nope, ph.nope_blocks.get(), nope},
                                                                          {q_rope, ph.rope_blocks.get(), rope}}));
  return ph;
}

// local_topk: the buffer of the rows' local top-k where the caller has one already (the candidate merge writes it).
Result<LocalDecodes> prepare_local_decodes(RankStep& s, int64_t n, std::optional<PendingHeads>& q_heads,
                                           DeviceBuffer local_topk) {
  const StepConfig& c = s.c();
  const int64_t H = c.H, Hr = s.plan().num_heads, Pt = s.comms.world->size(), D = s.comms.dcp->size();
  LocalDecodes d;
  d.n = n;
  d.qn = s.in.q_nope;
  d.qr = s.in.q_rope;
  d.q_heads = q_heads ? &*q_heads : nullptr;
  if (q_heads.has_value() != s.p.q_heads) {
    return internal_error("CP step: the local decodes' queries along heads do not match the plan");
  }
  d.direct = s.p.decodes_direct;
  const int64_t block = n * Hr;
  d.part_dtype = c.out_dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
  const size_t part = dtype_size(d.part_dtype);
  if (local_topk.get() != nullptr) {
    d.local_topk = std::move(local_topk);
  } else {
    DSACP_ASSIGN_OR_RETURN(d.local_topk, s.take(n * c.K * sizeof(int32_t)));
  }
  if (d.direct) {
    // Attention writes its partials straight into the world's exchange window where it has one.
    d.window_lse_at = (static_cast<size_t>(Pt * block * c.Dl) * part + 255) / 256 * 256;
    DSACP_ASSIGN_OR_RETURN(d.window,
                           try_window(s, *s.comms.world, d.window_lse_at + static_cast<size_t>(Pt * block) * sizeof(float)));
  }
  if (d.window) {
    d.send_out_at = d.window->mine;
    d.send_lse_at = reinterpret_cast<float*>(static_cast<char*>(d.window->mine) + d.window_lse_at);
  } else {
    DSACP_ASSIGN_OR_RETURN(d.send_out, s.take(Pt * block * c.Dl * part));
    DSACP_ASSIGN_OR_RETURN(d.send_lse, s.take(Pt * block * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(d.recv_out, s.take(Pt * block * c.Dl * part));
    DSACP_ASSIGN_OR_RETURN(d.recv_lse, s.take(Pt * block * sizeof(float)));
    d.send_out_at = d.send_out.get();
    d.send_lse_at = d.send_lse.as<float>();
  }
  if (d.direct) {
    d.qn = q_heads->nope_blocks.get();
    d.qr = q_heads->rope_blocks.get();
    return d;
  }
  if (q_heads) {
    const size_t rows_all = static_cast<size_t>(n * D * Hr);
    DSACP_ASSIGN_OR_RETURN(d.full_qn, s.take(std::max<size_t>(rows_all * c.Dl * s.act(), 1)));
    DSACP_ASSIGN_OR_RETURN(d.full_qr, s.take(std::max<size_t>(rows_all * c.Dr * s.act(), 1)));
    d.qn = d.full_qn.get();
    d.qr = d.full_qr.get();
  }
  DSACP_ASSIGN_OR_RETURN(d.part_out, s.take(n * H * c.Dl * part));
  DSACP_ASSIGN_OR_RETURN(d.part_lse, s.take(n * H * sizeof(float)));
  return d;
}

namespace {

// The direct layout's attention with the ranks' partials merged inside the kernel (SparseMlaParams::peer): each
// rank stores the other head blocks' partials straight into their owners' window buffers (rank k's buffer holds
// [Pt senders' blocks of out][Pt senders' blocks of lse]) and raises each row's flag there; the CTAs of its own
// block wait for the peers' rows and write the merged result into the step's out / lse. False (nothing enqueued,
// no window exchange taken) where the backend cannot or CpLayout::window_rows = kNone: the caller then publishes and runs
// the LSE merge.
Result<bool> attention_merged_in_window(RankStep& s, LocalDecodes& d) {
  const StepConfig& c = s.c();
  Communicator& world = *s.comms.world;
  const int64_t n = d.n, Pt = world.size(), block = n * s.plan().num_heads;
  const int32_t me = world.rank();
  if (!d.remapped) DSACP_RETURN_IF_ERROR(remap_to_local(s, n, s.out.topk, d.local_topk.as<int32_t>()));
  d.remapped = true;
  SparseMlaParams ap = own_keys_mla_params(s, n, d.qn, d.qr, s.p.d_row_request, s.p.d_row_local_len,
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
  DSACP_ASSIGN_OR_RETURN(pm.sync, try_window_rows(s.p.layout, producing(s, world), n, /*topk_exchange=*/false));
  if (!pm.sync.active()) return false;
  DSACP_RETURN_IF_ERROR(sparse_mla_run(s.backend, ap).with_context("local sparse MLA, merged across ranks"));
  check_rows_at_end(s, &world);
  return true;
}

}  // namespace

Status run_local_decodes(RankStep& s, LocalDecodes& d) {
  const StepConfig& c = s.c();
  const int64_t n = d.n, H = c.H, Pt = s.comms.world->size(), block = n * s.plan().num_heads;
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
        s, n, d.qn, d.qr, s.p.d_row_request, s.p.d_row_local_len, s.out.topk, d.local_topk.as<int32_t>(),
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
    const int64_t rows_all = n * s.comms.dcp->size() * s.plan().num_heads;
    DSACP_RETURN_IF_ERROR(after(s, std::move(d.q_heads->handle)));
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.q_heads->nope_blocks.get(), c.act_dtype, rows_all, c.Dl,
                                     s.p.d_heads_order.as<const int64_t>(), rows_all, d.full_qn.get(), c.act_dtype,
                                     "queries gathered along heads"));
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.q_heads->rope_blocks.get(), c.act_dtype, rows_all, c.Dr,
                                     s.p.d_heads_order.as<const int64_t>(), rows_all, d.full_qr.get(), c.act_dtype,
                                     "queries gathered along heads"));
  }
  if (!d.direct) {
    DSACP_RETURN_IF_ERROR(partial_attention_own_keys(s, n, d.qn, d.qr, s.p.d_row_request,
                                                     s.p.d_row_local_len, s.out.topk,
                                                     d.local_topk.as<int32_t>(), d.part_out.get(),
                                                     d.part_lse.as<float>(), 1, d.part_dtype, d.remapped));
    const int64_t packed = Pt * block;
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.part_out.get(), d.part_dtype, n * H, c.Dl,
                                     s.p.d_pack.as<const int64_t>(), packed, d.send_out.get(), d.part_dtype,
                                     "pack partial outputs by head"));
    DSACP_RETURN_IF_ERROR(gather_dev(s.backend, d.part_lse.get(), DType::kF32, n * H, 1, s.p.d_pack.as<const int64_t>(),
                                     packed, d.send_lse.get(), DType::kF32, "pack partial LSE by head"));
  }
  DSACP_ASSIGN_OR_RETURN(auto h, s.comms.world->all_to_all_group_async(
                                     {{d.send_out.get(), d.recv_out.get(), block * c.Dl * dtype_size(d.part_dtype)},
                                      {d.send_lse.get(), d.recv_lse.get(), block * sizeof(float)}}));
  DSACP_RETURN_IF_ERROR(after(s, std::move(h)));
  return merge_into(s, static_cast<int32_t>(Pt), block, d.recv_out.get(), d.recv_lse.as<const float>(), s.out.out,
                    s.out.lse, d.part_dtype);
}

}  // namespace dsacp
