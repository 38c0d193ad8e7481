// cp_step_plan: everything of one CP rank's step that depends only on the batch, checked, built and uploaded
// once per forward pass (dsacp/cp_step_plan.h); the runs (cp_step.cc) read it.
#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

#include "layer/cp_step_internal.h"

namespace dsacp {

CpStepPlan::CpStepPlan() : impl_(std::make_unique<Impl>()) {}
CpStepPlan::~CpStepPlan() = default;
CpStepPlan::CpStepPlan(CpStepPlan&&) noexcept = default;
CpStepPlan& CpStepPlan::operator=(CpStepPlan&&) noexcept = default;
const StepConfig& CpStepPlan::config() const { return impl_->config; }
const CpRankPlan& CpStepPlan::rank_plan() const { return impl_->rank; }
const CpLayout& CpStepPlan::layout() const { return impl_->layout; }
int64_t CpStepPlan::pages_needed() const { return impl_->pages_needed; }
size_t CpStepPlan::run_scratch_bytes() const { return impl_->scratch.bytes(); }
int64_t CpStepPlan::run_scratch_allocations() const { return impl_->scratch.allocations(); }

Result<DeviceViewPlan> upload_view_plan(Backend& backend, GatheredViewPlan plan) {
  DeviceViewPlan v;
  v.host = std::move(plan);
  UploadBatch batch;
  const size_t at_pack = batch.add(v.host.pack_slots), at_unpack = batch.add(v.host.unpack_rows),
               at_table = batch.add(v.host.view_table.data);
  DSACP_ASSIGN_OR_RETURN(v.storage, batch.upload(backend));
  v.pack_slots = UploadBatch::at<int64_t>(v.storage, at_pack);
  v.unpack_rows = UploadBatch::at<int64_t>(v.storage, at_unpack);
  v.view_table = UploadBatch::at<int32_t>(v.storage, at_table);
  return v;
}

namespace {

Status check_plan_inputs(const StepConfig& c, const std::vector<Request>& requests, const CpRankPlan& plan,
                         const CpLayout& layout, const KvSharding& sharding, const BlockTable& table,
                         const PagedCacheConfig& cc) {
  DSACP_RETURN_IF_ERROR(check_step_config(c, cc));
  DSACP_RETURN_IF_ERROR(validate_layout(layout, c.H));
  const int32_t Pt = layout.num_ranks();
  if (plan.P != layout.P || plan.D != layout.D) {
    return invalid_argument("CP plan: the rank plan is of a P" + std::to_string(plan.P) + " x D" +
                            std::to_string(plan.D) + " layout, the layout is P" + std::to_string(layout.P) + " x D" +
                            std::to_string(layout.D));
  }
  if (sharding.Pt != Pt) {
    return invalid_argument("KV sharded over " + std::to_string(sharding.Pt) + " ranks, the layout has " +
                            std::to_string(Pt));
  }
  const bool replicated = layout.indexer == IndexerMode::kReplicated;
  // The sharded indexer's prefill rows read a gathered view of the indexer pool: not for FP8 pages yet. (Decided
  // from the batch, the same on every rank, so all of them refuse before any collective.)
  if (c.index_input_dtype() == DType::kF8E4M3 && !replicated && !layout.dsa_cp && plan.layout.num_prefills > 0) {
    return cp_fp8_unsupported();
  }
  if (replicated && cc.index_page_factor != Pt) {
    return invalid_argument("the replicated indexer needs an indexer pool of " + std::to_string(Pt) +
                            " x the pages (index_page_factor), the cache has " + std::to_string(cc.index_page_factor));
  }
  const int32_t R = static_cast<int32_t>(requests.size());
  if (table.num_requests != R) {
    return invalid_argument("block table has " + std::to_string(table.num_requests) + " rows, the batch has " +
                            std::to_string(R) + " requests");
  }
  const int64_t rows = plan.num_rows;
  const int64_t exchange = layout.dsa_cp ? plan.D : plan.P;
  if (static_cast<int64_t>(plan.gathered_pos.size()) != exchange * rows) {
    return internal_error("CP plan: " + std::to_string(plan.gathered_pos.size()) + " gathered rows, the exchange group of " +
                          std::to_string(exchange) + " ranks x " + std::to_string(rows) + " rows gathers " +
                          std::to_string(exchange * rows));
  }
  // DSA-CP: the token shards must follow DCP rank order (rank d holds tokens [d * rows, (d + 1) * rows)).
  if (layout.dsa_cp && rows > 0 && plan.row_token[0] >= 0 && plan.row_token[0] != int64_t{plan.d} * rows) {
    return invalid_argument("DSA-CP token shards must follow DCP rank order: rank " + std::to_string(plan.d) +
                            " expects tokens from " + std::to_string(int64_t{plan.d} * rows) + ", the plan starts at " +
                            std::to_string(plan.row_token[0]));
  }
  return Status();
}

// The local decodes' head orders (dsacp/cp_step_plan.h): the head-gathered queries as rows (row (t, k, h) of
// [n, D*Hr] from block k's row (t, h)), and the partials packed by head for the all-to-all over the world (rank
// (r', d') receives heads slice d' of every rank's partials).
Status plan_local_decodes(Backend& backend, CpStepPlan::Impl& p) {
  const int64_t n = p.gathered_rows.local_decode_rows;
  const bool local_decodes = p.layout.decode_mode == DecodeMode::kLocalMerge;
  if (p.layout.dsa_cp || !local_decodes || n == 0) return Status();
  const int64_t H = p.config.H, Hr = p.rank.num_heads, D = p.rank.D, Pt = int64_t{p.rank.P} * p.rank.D;
  p.q_heads = D > 1;
  // Direct needs head slices the CUDA kernels take whole (a multiple of their 64-head group, or all heads).
  p.decodes_direct = p.q_heads && Pt == D && Hr % std::min<int64_t>(H, 64) == 0 && p.layout.decode_head_blocks;
  if (p.decodes_direct) return Status();
  if (p.q_heads) {
    std::vector<int64_t> index;
    index.reserve(static_cast<size_t>(n * D * Hr));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < D; ++k)
        for (int64_t h = 0; h < Hr; ++h) index.push_back((k * n + t) * Hr + h);
    DSACP_ASSIGN_OR_RETURN(p.d_heads_order, upload_vector(backend, index));
  }
  std::vector<int64_t> pack;
  pack.reserve(static_cast<size_t>(Pt * n * Hr));
  for (int64_t k = 0; k < Pt; ++k) {
    const int64_t h0 = (k % D) * Hr;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < Hr; ++h) pack.push_back(t * H + h0 + h);
  }
  DSACP_ASSIGN_OR_RETURN(p.d_pack, upload_vector(backend, pack));
  return Status();
}

}  // namespace

Result<CpStepPlan> cp_step_plan(Backend& backend, const StepConfig& c, const std::vector<Request>& requests,
                                const CpRankPlan& plan, const CpLayout& layout, const KvSharding& sharding,
                                const BlockTable& table, const PagedCacheConfig& cc, const CpStepPlanOptions& options) {
  DSACP_RETURN_IF_ERROR(check_plan_inputs(c, requests, plan, layout, sharding, table, cc));
  if (options.enqueue_only && backend.native_stream() == nullptr) {
    return unsupported("CP step plan: enqueue_only needs a device backend (" + backend.name() +
                       " has no stream to enqueue on)");
  }
  CpStepPlan out;
  CpStepPlan::Impl& p = *out.impl_;
  p.backend = &backend;
  p.config = c;
  p.requests = requests;
  p.rank = plan;
  p.layout = layout;
  p.sharding = sharding;
  p.table.num_requests = table.num_requests;
  p.table.max_pages = table.max_pages;
  p.cache = cc;
  p.replicated = layout.indexer == IndexerMode::kReplicated;
  p.fp8 = c.index_input_dtype() == DType::kF8E4M3;
  p.enqueue_only = options.enqueue_only;
  const int32_t R = static_cast<int32_t>(requests.size());
  const int32_t Pt = layout.num_ranks();
  const int32_t B = cc.page_size;

  std::vector<int64_t> pages(R), first_new(R);
  for (int32_t b = 0; b < R; ++b) {
    p.seq_lens.push_back(requests[b].seq_len());
    pages[b] = sharding.pages_needed(p.seq_lens[b], B);
    // This rank's first new position has local position local_len(context_len).
    first_new[b] = sharding.local_len(requests[b].context_len, plan.cr) / B;
  }
  // With the table on the device already, the host checks the pages this rank writes (its new tokens'); the
  // kernels check every page they read.
  const bool device_table = options.device_block_table != nullptr;
  DSACP_RETURN_IF_ERROR(check_block_table_pages(table, pages, cc, device_table ? first_new : std::vector<int64_t>{}));
  for (int32_t b = 0; b < R; ++b) {
    const int32_t* row = table.data.data() + static_cast<size_t>(b) * table.max_pages;
    for (int64_t k = device_table ? first_new[b] : 0; k < pages[b]; ++k) {
      p.pages_needed = std::max<int64_t>(p.pages_needed, int64_t{row[k]} + 1);
    }
  }
  if (p.replicated) {
    DSACP_ASSIGN_OR_RETURN(p.rep_table, replicated_index_table(table, p.seq_lens, Pt, B));
    DSACP_ASSIGN_OR_RETURN(p.d_rep, upload_vector(backend, p.rep_table.data));
  }

  // The slots the gathered rows go to: this rank's own (latent, rope, and the sharded indexer's keys) and,
  // with the replicated indexer, every rank's indexer-key slots.
  const int64_t rows = plan.num_rows;
  const int64_t gathered = static_cast<int64_t>(plan.gathered_pos.size());
  std::vector<int64_t> owned(static_cast<size_t>(gathered), -1), all(p.replicated ? static_cast<size_t>(gathered) : 0, -1);
  for (int64_t j = 0; j < gathered; ++j) {
    const int32_t b = plan.gathered_request[j];
    if (b < 0) continue;
    const int64_t pos = plan.gathered_pos[j];
    DSACP_ASSIGN_OR_RETURN(owned[j], sharded_slot(sharding, plan.cr, table, b, pos, B));
    if (p.replicated) all[j] = int64_t{p.rep_table.page(b, pos / B)} * B + pos % B;
  }
  p.row_local_len.resize(plan.row_key_len.size());
  for (size_t t = 0; t < plan.row_key_len.size(); ++t) {
    p.row_local_len[t] = static_cast<int32_t>(sharding.local_len(plan.row_key_len[t], plan.cr));
  }
  UploadBatch batch;
  const size_t at_request = batch.add(plan.row_request), at_key_len = batch.add(plan.row_key_len),
               at_local_len = batch.add(p.row_local_len), at_owned = batch.add(owned), at_all = batch.add(all);
  DSACP_ASSIGN_OR_RETURN(p.rows, batch.upload(backend));
  p.d_row_request = UploadBatch::at<int32_t>(p.rows, at_request);
  p.d_row_key_len = UploadBatch::at<int32_t>(p.rows, at_key_len);
  p.d_row_local_len = UploadBatch::at<int32_t>(p.rows, at_local_len);
  p.d_owned = UploadBatch::at<int64_t>(p.rows, at_owned);
  p.d_all = UploadBatch::at<int64_t>(p.rows, at_all);
  if (device_table) {
    p.d_table = options.device_block_table;
  } else {
    DSACP_ASSIGN_OR_RETURN(p.table_storage, upload_vector(backend, table.data));
    p.d_table = p.table_storage.as<const int32_t>();
  }

  // DSA-CP: every token of the padded batch.
  if (layout.dsa_cp) {
    for (int64_t j = 0; j < gathered; ++j) {
      p.all_key_len.push_back(plan.gathered_pos[j] < 0 ? 0 : static_cast<int32_t>(plan.gathered_pos[j] + 1));
      p.all_request.push_back(std::max(0, plan.gathered_request[j]));
      p.all_local_len.push_back(static_cast<int32_t>(sharding.local_len(p.all_key_len.back(), plan.cr)));
    }
    UploadBatch batch_all;
    const size_t at_req = batch_all.add(p.all_request), at_len = batch_all.add(p.all_local_len);
    DSACP_ASSIGN_OR_RETURN(p.all_rows, batch_all.upload(backend));
    p.d_all_request = UploadBatch::at<int32_t>(p.all_rows, at_req);
    p.d_all_local_len = UploadBatch::at<int32_t>(p.all_rows, at_len);
  }

  // The gathered views.
  p.gathered_rows = cp_gathered_rows(plan, layout, R);
  const bool sharded_pcp_rows = !p.replicated && !layout.dsa_cp && plan.num_shared_rows < rows;
  if (sharded_pcp_rows) {
    // PCP prefill rows: a gathered view of every request's indexer keys.
    std::vector<int32_t> all_ids(static_cast<size_t>(R));
    std::iota(all_ids.begin(), all_ids.end(), 0);
    DSACP_ASSIGN_OR_RETURN(GatheredViewPlan v, gathered_view_plan(all_ids, p.seq_lens, table, sharding, plan.cr, B));
    DSACP_ASSIGN_OR_RETURN(p.index_view, upload_view_plan(backend, std::move(v)));
  }
  const int64_t first = p.gathered_rows.first_gathered;
  if (first < rows) {
    const std::vector<int32_t>& ids = p.gathered_rows.view_ids;
    std::vector<int64_t> lens;
    for (int32_t b : ids) lens.push_back(p.seq_lens[b]);
    DSACP_ASSIGN_OR_RETURN(GatheredViewPlan v, gathered_view_plan(ids, lens, table, sharding, plan.cr, B));
    DSACP_ASSIGN_OR_RETURN(p.kv_view, upload_view_plan(backend, std::move(v)));
    std::vector<int32_t> view_row(static_cast<size_t>(R), -1);
    for (size_t i = 0; i < ids.size(); ++i) view_row[ids[i]] = static_cast<int32_t>(i);
    std::vector<int32_t> rows_view(static_cast<size_t>(rows - first));
    for (int64_t i = 0; i < rows - first; ++i) rows_view[i] = std::max(0, view_row[plan.row_request[first + i]]);
    DSACP_ASSIGN_OR_RETURN(p.d_rows_view, upload_vector(backend, rows_view));
  }
  DSACP_RETURN_IF_ERROR(plan_local_decodes(backend, p));
  return out;
}

}  // namespace dsacp
