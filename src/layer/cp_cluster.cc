// Every rank of a CP layout as threads of this process (the embedded default; what tests use).
#include <cstring>
#include <string>
#include <thread>

#include "dsacp/cp_step.h"
#include "layer/step_checks.h"

namespace dsacp {

Result<Tensor> select_rows(const Tensor& full, const std::vector<int64_t>& rows) {
  if (full.shape().empty()) return invalid_argument("select_rows: a tensor with no dimensions");
  Shape shape = full.shape();
  const int64_t n = shape[0];
  shape[0] = static_cast<int64_t>(rows.size());
  DSACP_ASSIGN_OR_RETURN(Tensor out, Tensor::zeros(full.dtype(), shape));
  const size_t row_bytes = n == 0 ? 0 : full.nbytes() / static_cast<size_t>(n);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < -1 || rows[i] >= n) {
      return out_of_range("select_rows: row " + std::to_string(rows[i]) + " outside [-1, " + std::to_string(n) + ")");
    }
    if (rows[i] >= 0) {
      std::memcpy(static_cast<char*>(out.data()) + i * row_bytes,
                  static_cast<const char*>(full.data()) + rows[i] * row_bytes, row_bytes);
    }
  }
  return out;
}

Result<std::unique_ptr<LocalCpCluster>> LocalCpCluster::create(Backend& backend, const CpLayout& layout,
                                                               const PagedCacheConfig& per_rank_cache) {
  if (layout.P < 1) return invalid_argument("--pcp must be >= 1, got " + std::to_string(layout.P));
  if (layout.interleave < 0) return invalid_argument("--interleave must be >= 1, got " + std::to_string(layout.interleave));
  if (layout.graph_bucket_tokens < 0) return invalid_argument("graph bucket must be >= 0");
  std::unique_ptr<LocalCpCluster> c(new LocalCpCluster());
  c->backend_ = &backend;
  c->layout_ = layout;
  c->sharding_ = KvSharding{layout.P, layout.interleave == 0 ? per_rank_cache.page_size : layout.interleave};
  c->cache_config_ = per_rank_cache;
  for (int32_t r = 0; r < layout.P; ++r) {
    DSACP_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::create(backend, per_rank_cache));
    c->caches_.push_back(std::move(cache));
  }
  return c;
}

size_t LocalCpCluster::cache_bytes_per_rank() const { return caches_.empty() ? 0 : caches_[0].bytes(); }

Status LocalCpCluster::load_context(const std::vector<Request>& requests, const BlockTable& table,
                                    const Tensor& ctx_latent, const Tensor& ctx_rope, const Tensor& ctx_index_keys) {
  if (sharding_.Pt == 1) {
    return cache_load_context(*backend_, caches_[0], requests, table, ctx_latent, ctx_rope, ctx_index_keys);
  }
  const int32_t B = cache_config_.page_size;
  for (int32_t cr = 0; cr < sharding_.Pt; ++cr) {
    std::vector<int64_t> slots;
    for (size_t b = 0; b < requests.size(); ++b) {
      for (int64_t p = 0; p < requests[b].context_len; ++p) {
        DSACP_ASSIGN_OR_RETURN(int64_t s, sharded_slot(sharding_, cr, table, static_cast<int32_t>(b), p, B));
        slots.push_back(s);
      }
    }
    const int64_t rows = static_cast<int64_t>(slots.size());
    const auto floats = {DType::kF32, DType::kBF16};
    DSACP_RETURN_IF_ERROR(check_tensor("ctx_kv_latent", ctx_latent.view(), floats, {{"sum C", rows}, {"Dl", cache_config_.Dl}}));
    DSACP_RETURN_IF_ERROR(check_tensor("ctx_k_rope", ctx_rope.view(), floats, {{"sum C", rows}, {"Dr", cache_config_.Dr}}));
    DSACP_RETURN_IF_ERROR(check_tensor("ctx_idx_k", ctx_index_keys.view(), floats, {{"sum C", rows}, {"Di", cache_config_.Di}}));
    if (rows == 0) continue;
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_slots, upload_vector(*backend_, slots));
    const struct {
      const Tensor* rows;
      PagedPoolView pool;
    } writes[] = {{&ctx_latent, caches_[cr].latent()}, {&ctx_rope, caches_[cr].rope()},
                  {&ctx_index_keys, caches_[cr].index_keys()}};
    for (const auto& w : writes) {
      DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_rows, backend_->allocate(w.rows->nbytes()));
      DSACP_RETURN_IF_ERROR(backend_->copy_to_device(d_rows.get(), w.rows->data(), w.rows->nbytes()));
      CacheWriteParams p;
      p.rows = d_rows.get();
      p.rows_dtype = w.rows->dtype();
      p.num_rows = rows;
      p.slots = d_slots.as<const int64_t>();
      p.pool = w.pool;
      DSACP_RETURN_IF_ERROR(cache_write_run(*backend_, p).with_context("context load on rank " + std::to_string(cr)));
    }
  }
  return backend_->synchronize();
}

namespace {

// One rank's inputs, outputs and status for a step.
struct RankWork {
  PcpRankPlan plan;
  Tensor q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k;
  StepResult result;
  Status status;
};

Status run_rank(Backend& backend, Communicator& comm, const StepConfig& c, const std::vector<Request>& requests,
                const KvSharding& sharding, const BlockTable& table, PagedKvCache& cache, PcpDecodeMode mode,
                RankWork& w) {
  auto up = [&](const Tensor& t) -> Result<DeviceBuffer> {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer b, backend.allocate(std::max<size_t>(t.nbytes(), 1)));
    if (t.nbytes() > 0) DSACP_RETURN_IF_ERROR(backend.copy_to_device(b.get(), t.data(), t.nbytes()));
    return b;
  };
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer q_nope, up(w.q_nope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer q_rope, up(w.q_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer kv_latent, up(w.kv_latent));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer k_rope, up(w.k_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_q, up(w.idx_q));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_w, up(w.idx_w));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_k, up(w.idx_k));
  const int64_t rows = w.plan.output_rows;
  DSACP_ASSIGN_OR_RETURN(w.result.topk_indices, Tensor::zeros(DType::kI32, {rows, c.K}));
  DSACP_ASSIGN_OR_RETURN(w.result.out, Tensor::zeros(c.out_dtype, {rows, c.H, c.Dl}));
  DSACP_ASSIGN_OR_RETURN(w.result.lse, Tensor::zeros(DType::kF32, {rows, c.H}));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_topk, backend.allocate(std::max<size_t>(w.result.topk_indices.nbytes(), 1)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_out, backend.allocate(std::max<size_t>(w.result.out.nbytes(), 1)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_lse, backend.allocate(std::max<size_t>(w.result.lse.nbytes(), 1)));
  StepInputs in{q_nope.get(), q_rope.get(), kv_latent.get(), k_rope.get(), idx_q.get(), idx_w.as<const float>(),
                idx_k.get()};
  StepOutputs out{d_topk.as<int32_t>(), d_out.get(), d_lse.as<float>()};
  DSACP_RETURN_IF_ERROR(pcp_step_run(backend, comm, c, requests, w.plan, sharding, table, cache, mode, in, out));
  if (rows > 0) {
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(w.result.topk_indices.data(), d_topk.get(), w.result.topk_indices.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(w.result.out.data(), d_out.get(), w.result.out.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(w.result.lse.data(), d_lse.get(), w.result.lse.nbytes()));
  }
  return Status();
}

}  // namespace

Result<StepResult> LocalCpCluster::step(const StepConfig& c, const std::vector<Request>& requests,
                                        const BlockTable& table, const HostStepInputs& inputs) {
  if (sharding_.Pt == 1) return step_run_host(*backend_, c, requests, table, caches_[0], inputs);
  DSACP_ASSIGN_OR_RETURN(BatchLayout layout, batch_layout(requests, c.decode_threshold));
  const int64_t T = layout.num_tokens;
  const DType a = c.act_dtype;
  auto check = [](const char* name, const Tensor* t, std::initializer_list<DType> dtypes,
                  std::initializer_list<DimSpec> dims) -> Status {
    if (t == nullptr) return invalid_argument(std::string(name) + ": missing");
    return check_tensor(name, t->view(), dtypes, dims);
  };
  DSACP_RETURN_IF_ERROR(check("q_nope", inputs.q_nope, {a}, {{"T", T}, {"H", c.H}, {"Dl", c.Dl}}));
  DSACP_RETURN_IF_ERROR(check("q_rope", inputs.q_rope, {a}, {{"T", T}, {"H", c.H}, {"Dr", c.Dr}}));
  DSACP_RETURN_IF_ERROR(check("kv_latent", inputs.kv_latent, {a}, {{"T", T}, {"Dl", c.Dl}}));
  DSACP_RETURN_IF_ERROR(check("k_rope", inputs.k_rope, {a}, {{"T", T}, {"Dr", c.Dr}}));
  DSACP_RETURN_IF_ERROR(check("idx_q", inputs.idx_q, {a}, {{"T", T}, {"Hi", c.Hi}, {"Di", c.Di}}));
  DSACP_RETURN_IF_ERROR(check("idx_w", inputs.idx_w, {DType::kF32}, {{"T", T}, {"Hi", c.Hi}}));
  DSACP_RETURN_IF_ERROR(check("idx_k", inputs.idx_k, {a}, {{"T", T}, {"Di", c.Di}}));

  const int32_t P = layout_.P;
  PcpOptions options;
  options.P = P;
  options.decode_threshold = c.decode_threshold;
  options.graph_bucket_tokens = layout_.graph_bucket_tokens;
  std::vector<RankWork> work(static_cast<size_t>(P));
  for (int32_t r = 0; r < P; ++r) {
    RankWork& w = work[r];
    DSACP_ASSIGN_OR_RETURN(w.plan, pcp_plan(requests, options, r, sharding_, r, table, cache_config_.page_size));
    std::vector<int64_t> token(static_cast<size_t>(w.plan.num_local_tokens));
    for (int64_t i = 0; i < w.plan.num_local_tokens; ++i) {
      token[i] = w.plan.row_is_pad[i] ? -1 : layout.query_start[w.plan.row_request[i]] + w.plan.row_offset[i];
    }
    DSACP_ASSIGN_OR_RETURN(w.q_nope, select_rows(*inputs.q_nope, token));
    DSACP_ASSIGN_OR_RETURN(w.q_rope, select_rows(*inputs.q_rope, token));
    DSACP_ASSIGN_OR_RETURN(w.kv_latent, select_rows(*inputs.kv_latent, token));
    DSACP_ASSIGN_OR_RETURN(w.k_rope, select_rows(*inputs.k_rope, token));
    DSACP_ASSIGN_OR_RETURN(w.idx_q, select_rows(*inputs.idx_q, token));
    DSACP_ASSIGN_OR_RETURN(w.idx_w, select_rows(*inputs.idx_w, token));
    DSACP_ASSIGN_OR_RETURN(w.idx_k, select_rows(*inputs.idx_k, token));
  }

  auto group = LocalGroup::create(P);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      auto comm = group->make_communicator(r);
      work[r].status = run_rank(*backend_, *comm, c, requests, sharding_, table, caches_[r], layout_.decode_mode, work[r]);
      if (!work[r].status.ok()) comm->abort(work[r].status.message());
    });
  }
  for (auto& t : threads) t.join();
  for (int32_t r = 0; r < P; ++r) {
    if (!work[r].status.ok()) return work[r].status.with_context("PCP rank " + std::to_string(r));
  }

  // Assemble the batch in token order: prefill rows from the rank that computed them, decodes from rank 0.
  StepResult result;
  DSACP_ASSIGN_OR_RETURN(result.topk_indices, Tensor::zeros(DType::kI32, {T, c.K}));
  DSACP_ASSIGN_OR_RETURN(result.out, Tensor::zeros(c.out_dtype, {T, c.H, c.Dl}));
  DSACP_ASSIGN_OR_RETURN(result.lse, Tensor::zeros(DType::kF32, {T, c.H}));
  const size_t topk_row = static_cast<size_t>(c.K) * 4, out_row = static_cast<size_t>(c.H) * c.Dl * dtype_size(c.out_dtype),
               lse_row = static_cast<size_t>(c.H) * 4;
  for (int32_t r = 0; r < P; ++r) {
    const RankWork& w = work[r];
    for (int64_t i = 0; i < w.plan.num_local_tokens; ++i) {
      if (w.plan.row_is_pad[i] || (i < w.plan.num_local_decode_tokens && r != 0)) continue;
      const int64_t t = layout.query_start[w.plan.row_request[i]] + w.plan.row_offset[i];
      std::memcpy(static_cast<char*>(result.topk_indices.data()) + t * topk_row,
                  static_cast<const char*>(w.result.topk_indices.data()) + i * topk_row, topk_row);
      std::memcpy(static_cast<char*>(result.out.data()) + t * out_row,
                  static_cast<const char*>(w.result.out.data()) + i * out_row, out_row);
      std::memcpy(static_cast<char*>(result.lse.data()) + t * lse_row,
                  static_cast<const char*>(w.result.lse.data()) + i * lse_row, lse_row);
    }
  }
  return result;
}

}  // namespace dsacp
