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
// This file holds the run's order (cp_step_run over a CpStepPlan) and the one-shot form that plans first; the
// plan is cp_step_plan.cc, the stages cp_step_views.cc, cp_step_topk.cc and cp_step_decodes.cc.
#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "layer/cp_step_internal.h"
#include "layer/step_timing_internal.h"

namespace dsacp {

// The step's end checks comm's row-synchronized exchanges (Communicator::window_rows_check), once a communicator.
void check_rows_at_end(RankStep& s, Communicator* comm) {
  if (std::find(s.rows_checked_at_end.begin(), s.rows_checked_at_end.end(), comm) == s.rows_checked_at_end.end()) {
    s.rows_checked_at_end.push_back(comm);
  }
}

// Orders the backend's later work after the collective: on the device when the transport can (the host then
// waits for it at the step's end, bounded; an enqueue-only run does not), else by waiting now (refused in an
// enqueue-only run: cp_step_run checked its communicators first, so this is a transport that changed its mind).
Status after(RankStep& s, std::unique_ptr<CollectiveHandle> h) {
  void* stream = s.backend.native_stream();
  if (stream != nullptr && h->order_before(stream)) {
    s.in_flight.push_back(std::move(h));
    return Status();
  }
  if (s.p.enqueue_only) {
    return internal_error("CP step run (enqueue only): a collective could not be ordered on the device stream");
  }
  return h->wait();
}

// The communicator, with its next collectives ordered after the work enqueued so far on the backend's current
// lane (the producer of their inputs; Backend lanes move it between streams).
Communicator& producing(RankStep& s, Communicator& c) {
  if (void* stream = s.backend.native_stream()) c.set_producer_stream(stream);
  return c;
}

// A window exchange of `bytes` on `comm` (Communicator::window_next), or nothing where the communicator has no
// window for it or the plan's runs only enqueue (the caller then uses the collectives). Other errors (a failed
// communicator) are returned.
Result<std::optional<Communicator::Window>> try_window(const RankStep& s, Communicator& comm, size_t bytes) {
  if (s.p.enqueue_only) return std::optional<Communicator::Window>();
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

namespace {

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

// An enqueue-only run's communicators (CpStepPlanOptions::enqueue_only; its plan checked the backend): those of
// more than one rank must order their collectives on the device.
Status check_enqueue_only(const CpComms& comms) {
  const std::pair<const Communicator*, const char*> named[] = {{comms.world, "world"}, {comms.pcp, "PCP"},
                                                               {comms.dcp, "DCP"}};
  for (const auto& [c, name] : named) {
    if (c->size() > 1 && !c->orders_on_device()) {
      return unsupported(std::string("CP step run: an enqueue-only plan needs communicators that order their "
                                     "collectives on the device (NCCL); the ") +
                         name + " communicator waits on the host");
    }
  }
  return Status();
}

}  // namespace

Status cp_step_run(Backend& backend, const CpComms& comms, const CpStepPlan& step_plan, PagedKvCache& cache,
                   const StepInputs& in, const StepOutputs& caller_out) {
  const CpStepPlan::Impl& p = step_plan.impl();
  const StepConfig& c = p.config;
  const CpRankPlan& plan = p.rank;
  const CpLayout& layout = p.layout;
  if (p.backend != &backend) {
    return invalid_argument("CP step run: the plan was made for backend " + p.backend->name() + ", the run is on " +
                            backend.name() + " (a plan's tables live in its backend's memory)");
  }
  const PagedCacheConfig& cc = cache.config();
  if (!same_cache_layout(cc, p.cache)) {
    return invalid_argument("CP step run: the cache (" + cache_layout_name(cc) + ") is not of the plan's layout (" +
                            cache_layout_name(p.cache) + ")");
  }
  if (cc.num_pages < p.pages_needed) {
    return out_of_range("CP step run: the cache holds " + std::to_string(cc.num_pages) +
                        " pages, the plan's block table uses page " + std::to_string(p.pages_needed - 1));
  }
  DSACP_RETURN_IF_ERROR(check_comms(comms, plan));
  if (p.enqueue_only) DSACP_RETURN_IF_ERROR(check_enqueue_only(comms));
  DSACP_RETURN_IF_ERROR(check_indexer_inputs(c, in));
  RunScratchClaim claim(p.scratch);
  DSACP_RETURN_IF_ERROR(claim.claim("CP step run"));
  PhaseClock clock(backend);
  // The step's own top-k is canonical: the caller's buffer, or (slot form) one that output_forms converts from.
  StepOutputs out = caller_out;
  RankStep s{backend, comms, p, cache, in, out, p.scratch, {}, {}, {}};
  DeviceBuffer canonical_topk;
  if (c.topk_form != TopkForm::kCanonical) {
    DSACP_ASSIGN_OR_RETURN(canonical_topk, s.take(static_cast<size_t>(plan.num_rows) * c.K * sizeof(int32_t)));
    out.topk = canonical_topk.as<int32_t>();
  }
  const bool precomputed = in.topk != nullptr;
  const bool replicated = p.replicated;
  const bool fp8 = p.fp8;
  // Kernels, uploads and device copies only enqueue; collectives order themselves after them (NCCL's
  // producer stream) and errors come back from the synchronize() at the end (an enqueue-only run's: from the
  // caller's next synchronize()).
  std::optional<DeferredErrors> defer;
  std::optional<PendingErrors> pending;
  if (p.enqueue_only) {
    pending.emplace(backend);
    for (Communicator* comm : {comms.world, comms.pcp, comms.dcp}) producing(s, *comm);
  } else {
    defer.emplace(backend);
  }
  const int32_t B = cc.page_size;
  const int64_t rows = plan.num_rows;
  const int64_t Hr = plan.num_heads;
  const size_t act = dtype_size(c.act_dtype);
  Communicator& ex = layout.dsa_cp ? *comms.dcp : *comms.pcp;
  const int64_t gathered = static_cast<int64_t>(plan.gathered_pos.size());

  // Rows [first_gathered, rows) attend over the gathered KV (the rest: local decodes).
  const bool decode_only = plan.layout.num_prefills == 0;
  const bool local_decodes = layout.decode_mode == DecodeMode::kLocalMerge;
  const int64_t T_all = gathered;  // DSA-CP: the padded batch
  const int64_t T_dec = p.gathered_rows.local_decode_rows;
  const int64_t first_gathered = p.gathered_rows.first_gathered;

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
        DSACP_ASSIGN_OR_RETURN(e.rows, s.take(std::max<size_t>(gathered * e.dim * e.elem, 1)));
        e.gathered = e.rows.get();
        parts.push_back({e.local, e.rows.get(), bytes});
      }
      DSACP_ASSIGN_OR_RETURN(handle, ex.all_gather_group_async(parts));
    }
    if (handle) DSACP_RETURN_IF_ERROR(after(s, std::move(handle)));
    // One call writes the owned rows' indexer keys (every row's under the replicated indexer), latent and rope
    // (one launch on a GPU).
    CacheWriteParams w;
    w.rows = kv[2].gathered;
    w.rows_dtype = c.index_input_dtype();
    if (fp8) w.row_scales = static_cast<const float*>(kv[3].gathered);
    w.fp8_scale_mode = cc.index_scale_mode;
    w.record_scale_mode = cc.latent_scale_mode;  // an fp8_ds_mla latent: the owners quantize their rows
    w.num_rows = gathered;
    w.slots = replicated ? p.d_all : p.d_owned;
    w.pool = cache.index_keys();
    w.more[0] = {kv[0].gathered, p.d_owned, cache.latent(), c.act_dtype};
    w.more[1] = {kv[1].gathered, p.d_owned, cache.rope(), c.act_dtype};
    if (!keys) {
      w.rows = kv[0].gathered;
      w.rows_dtype = c.act_dtype;
      w.row_scales = nullptr;
      w.slots = p.d_owned;
      w.pool = cache.latent();
      w.more[0] = {kv[1].gathered, p.d_owned, cache.rope(), c.act_dtype};
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
    DSACP_ASSIGN_OR_RETURN(kv_view, start_kv_view(s));
  }
  const int32_t D = comms.dcp->size();
  // The decode queries along heads: launched right after this rank's indexer launch (the indexer, on the critical
  // path, is not queued behind the collective's host launch), yet ordered only after the work enqueued before
  // the indexer: the side lane, forked here, holds that point, and the gather is launched from it. The gather
  // then runs during the indexer instead of after it. Only where the collective orders itself on the device
  // (NCCL); a transport that copies on the host's schedule keeps the main stream's order.
  std::optional<PendingHeads> q_heads;
  const bool want_q_heads = p.q_heads;
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
    DSACP_ASSIGN_OR_RETURN(all_qn, s.take(std::max<size_t>(T_all * qn_row, 1)));
    DSACP_ASSIGN_OR_RETURN(all_qr, s.take(std::max<size_t>(T_all * qr_row, 1)));
    DSACP_ASSIGN_OR_RETURN(h_q, comms.dcp->all_gather_group_async({{in.q_nope, all_qn.get(), rows * qn_row},
                                                                    {in.q_rope, all_qr.get(), rows * qr_row}}));
  }

  std::optional<LocalDecodes> decodes;  // prepared early under the sharded indexer

  // 3. Top-k of this rank's rows (and, under DSA-CP decode-only batches, of every token).
  DeviceBuffer all_topk;
  auto gather_all_topk = [&]() -> Status {  // DSA-CP decode-only: every token's rows on every rank
    if (!(layout.dsa_cp && decode_only)) return Status();
    DSACP_ASSIGN_OR_RETURN(all_topk, s.take(std::max<size_t>(T_all * c.K * sizeof(int32_t), 1)));
    DSACP_ASSIGN_OR_RETURN(auto h, producing(s, *comms.dcp).all_gather_async(out.topk, all_topk.get(),
                                                                             rows * c.K * sizeof(int32_t)));
    return after(s, std::move(h));
  };
  if (precomputed) {
    // The caller's rows (this rank's rows, global positions), checked; no indexer, no candidates' exchange.
    TopkInputParams tp;
    tp.num_rows = rows;
    tp.K = c.K;
    tp.key_len = p.d_row_key_len;
    tp.topk = in.topk;
    tp.out = out.topk;
    DSACP_RETURN_IF_ERROR(topk_input_run(backend, tp).with_context("CP rank " + std::to_string(plan.cr)));
    clock.indexer_launched();
    DSACP_RETURN_IF_ERROR(start_q_heads());
    DSACP_RETURN_IF_ERROR(gather_all_topk());
  } else if (replicated) {
    IndexerTopkParams ip;
    ip.rows = {rows, p.d_row_request, p.d_row_key_len};
    ip.Hi = c.Hi;
    ip.Di = c.Di;
    ip.K = c.K;
    ip.q = in.idx_q;
    ip.q_dtype = c.index_input_dtype();
    ip.q_scale = in.idx_q_scale;
    ip.w = in.idx_w;
    ip.keys = cache.index_keys();
    ip.block_table = {p.d_rep.as<const int32_t>(), p.rep_table.num_requests, p.rep_table.max_pages};
    ip.topk = out.topk;
    ip.host_request = plan.row_request.data();
    ip.host_key_len = plan.row_key_len.data();
    DSACP_RETURN_IF_ERROR(indexer_topk_run(backend, ip).with_context("replicated indexer top-k"));
    clock.indexer_launched();
    DSACP_RETURN_IF_ERROR(start_q_heads());
    DSACP_RETURN_IF_ERROR(gather_all_topk());
  } else if (layout.dsa_cp) {
    // Every rank needs every token's candidates: gather the indexer queries along tokens first.
    const size_t q_row = static_cast<size_t>(c.Hi) * c.Di * dtype_size(c.index_input_dtype());
    const size_t w_row = static_cast<size_t>(c.Hi) * sizeof(float);
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer all_q, s.take(std::max<size_t>(T_all * q_row, 1)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer all_w, s.take(std::max<size_t>(T_all * w_row, 1)));
    DeviceBuffer all_qs;  // FP8: the queries' scales travel with them
    std::vector<Communicator::Part> q_parts = {{in.idx_q, all_q.get(), rows * q_row}, {in.idx_w, all_w.get(), rows * w_row}};
    if (fp8) {
      DSACP_ASSIGN_OR_RETURN(all_qs, s.take(std::max<size_t>(T_all * w_row, 1)));
      q_parts.push_back({in.idx_q_scale, all_qs.get(), rows * w_row});
    }
    DSACP_ASSIGN_OR_RETURN(auto h, comms.dcp->all_gather_group_async(q_parts));
    DSACP_RETURN_IF_ERROR(after(s, std::move(h)));
    DSACP_ASSIGN_OR_RETURN(all_topk, s.take(std::max<size_t>(T_all * c.K * sizeof(int32_t), 1)));
    const MergedTopkRows all_rows{T_all, p.d_all_request, p.all_request.data(), p.d_all_local_len,
                                  p.all_local_len.data()};
    DSACP_ASSIGN_OR_RETURN(PendingTopk pt, start_merged_topk(s, all_rows, all_q.get(), all_qs.as<const float>(),
                                                             all_w.as<const float>(), all_topk.as<int32_t>()));
    DSACP_RETURN_IF_ERROR(finish_merged_topk(s, pt));
    clock.indexer_launched();
    DSACP_RETURN_IF_ERROR(backend.copy_on_device(out.topk, all_topk.as<int32_t>() + plan.d * rows * c.K,
                                                 rows * c.K * sizeof(int32_t)));
  } else {
    const int64_t shared = plan.num_shared_rows;
    std::optional<PendingView> idx_pending;
    if (shared < rows) {
      // PCP prefill rows: a gathered view of every request's indexer keys.
      DSACP_ASSIGN_OR_RETURN(idx_pending, start_view(s, *comms.world, cache.index_keys(), *p.index_view));
    }
    std::optional<PendingTopk> pending_topk;
    // The merged rows are the local decodes' rows: the merge writes their local top-k too (no remap kernel).
    DeviceBuffer merged_local_topk;
    if (shared > 0 && local_decodes && T_dec > 0 && shared == T_dec) {
      DSACP_ASSIGN_OR_RETURN(merged_local_topk, s.take(T_dec * c.K * sizeof(int32_t)));
    }
    if (shared > 0) {
      // The plan's upload has the rows' local lengths already.
      const MergedTopkRows shared_rows{shared, p.d_row_request, plan.row_request.data(), p.d_row_local_len,
                                       p.row_local_len.data()};
      DSACP_ASSIGN_OR_RETURN(pending_topk, start_merged_topk(s, shared_rows, in.idx_q, in.idx_q_scale, in.idx_w,
                                                             out.topk, merged_local_topk.as<int32_t>()));
      clock.indexer_launched();  // (and the candidates' exchange started)
    }
    DSACP_RETURN_IF_ERROR(start_q_heads());
    if (shared < rows) {
      DSACP_ASSIGN_OR_RETURN(View idx_view, finish_view(s, *idx_pending));
      const DeviceViewPlan& iv = *p.index_view;
      IndexerTopkParams ip;
      ip.rows = {rows - shared, offset_ptr(p.d_row_request, shared), offset_ptr(p.d_row_key_len, shared)};
      ip.Hi = c.Hi;
      ip.Di = c.Di;
      ip.K = c.K;
      ip.q = offset_bytes(in.idx_q, shared * c.Hi * c.Di * static_cast<int64_t>(act));
      ip.q_dtype = c.act_dtype;
      ip.w = offset_ptr(in.idx_w, shared * c.Hi);
      ip.keys = idx_view.pool;
      ip.block_table = {iv.view_table, iv.host.view_table.num_requests, iv.host.view_table.max_pages};
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
    DSACP_RETURN_IF_ERROR(after(s, std::move(h_q)));
    const int64_t H = c.H;
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer part_out, s.take(T_all * H * c.Dl * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer part_lse, s.take(T_all * H * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer local_topk, s.take(std::max<size_t>(T_all * c.K * sizeof(int32_t), 1)));
    DSACP_RETURN_IF_ERROR(partial_attention_own_keys(s, T_all, all_qn.get(), all_qr.get(), p.d_all_request,
                                                     p.d_all_local_len, all_topk.as<const int32_t>(),
                                                     local_topk.as<int32_t>(), part_out.get(), part_lse.as<float>()));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer recv_out, s.take(T_all * H * c.Dl * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer recv_lse, s.take(T_all * H * sizeof(float)));
    DSACP_ASSIGN_OR_RETURN(auto h, producing(s, *comms.dcp).all_to_all_group_async(
                                       {{part_out.get(), recv_out.get(), rows * H * c.Dl * sizeof(float)},
                                        {part_lse.get(), recv_lse.get(), rows * H * sizeof(float)}}));
    DSACP_RETURN_IF_ERROR(after(s, std::move(h)));
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
  forms.request = p.d_row_request;
  forms.block_table = {p.d_table, p.table.num_requests, p.table.max_pages};
  forms.page_size = B;
  forms.num_pages = cc.num_pages;
  forms.Pt = p.sharding.Pt;
  forms.I = p.sharding.I;
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
  if (p.enqueue_only) {
    // Every consumer is ordered after its collective on the device: nothing to wait for (no window exchange
    // was taken, so no row check either).
    for (auto& h : s.in_flight) h->release_ordered();
    clock.finish();
    return Status();
  }
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

Status cp_step_run(Backend& backend, const CpComms& comms, const StepConfig& c, const std::vector<Request>& requests,
                   const CpRankPlan& plan, const CpLayout& layout, const KvSharding& sharding, const BlockTable& table,
                   PagedKvCache& cache, const StepInputs& in, const StepOutputs& out) {
  CpStepPlanOptions options;
  options.device_block_table = in.block_table;
  DSACP_ASSIGN_OR_RETURN(CpStepPlan step_plan,
                         cp_step_plan(backend, c, requests, plan, layout, sharding, table, cache.config(), options));
  return cp_step_run(backend, comms, step_plan, cache, in, out);
}

}  // namespace dsacp
