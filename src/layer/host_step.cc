// Host-memory wrappers around the step executor: shape checks, uploads, downloads.
#include <algorithm>
#include <string>

#include "layer/step_checks.h"

namespace dsacp {
namespace {

Result<DeviceBuffer> upload_tensor(Backend& backend, const Tensor& t) {
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer buf, backend.allocate(std::max<size_t>(t.nbytes(), 1)));
  if (t.nbytes() > 0) DSACP_RETURN_IF_ERROR(backend.copy_to_device(buf.get(), t.data(), t.nbytes()));
  return buf;
}

// A tensor the step may go without (the indexer's inputs, with a precomputed top-k): an empty buffer for none.
Result<DeviceBuffer> upload_optional(Backend& backend, const Tensor* t) {
  if (t == nullptr) return DeviceBuffer{};
  return upload_tensor(backend, *t);
}

Status check(const char* name, const Tensor* t, std::initializer_list<DType> dtypes,
             std::initializer_list<DimSpec> dims) {
  if (t == nullptr) return invalid_argument(std::string(name) + ": missing");
  return check_tensor(name, t->view(), dtypes, dims);
}

}  // namespace

Status check_host_step_inputs(const StepConfig& c, int64_t T, const HostStepInputs& in) {
  const DType a = c.act_dtype;
  DSACP_RETURN_IF_ERROR(check("q_nope", in.q_nope, {a}, {{"T", T}, {"H", c.H}, {"Dl", c.Dl}}));
  DSACP_RETURN_IF_ERROR(check("q_rope", in.q_rope, {a}, {{"T", T}, {"H", c.H}, {"Dr", c.Dr}}));
  DSACP_RETURN_IF_ERROR(check("kv_latent", in.kv_latent, {a}, {{"T", T}, {"Dl", c.Dl}}));
  DSACP_RETURN_IF_ERROR(check("k_rope", in.k_rope, {a}, {{"T", T}, {"Dr", c.Dr}}));
  const DType ia = c.index_input_dtype();
  // With a precomputed top-k the indexer's inputs may be left out (each one given is checked).
  const bool pre = in.topk != nullptr;
  if (pre) DSACP_RETURN_IF_ERROR(check("topk", in.topk, {DType::kI32}, {{"T", T}, {"K", c.K}}));
  if (!pre || in.idx_q != nullptr) {
    DSACP_RETURN_IF_ERROR(check("idx_q", in.idx_q, {ia}, {{"T", T}, {"Hi", c.Hi}, {"Di", c.Di}}));
  }
  if (!pre || in.idx_w != nullptr) DSACP_RETURN_IF_ERROR(check("idx_w", in.idx_w, {DType::kF32}, {{"T", T}, {"Hi", c.Hi}}));
  if (ia == DType::kF8E4M3) {
    if (!pre || in.idx_q != nullptr) {
      DSACP_RETURN_IF_ERROR(check("idx_q_scale", in.idx_q_scale, {DType::kF32}, {{"T", T}, {"Hi", c.Hi}}));
    }
    if (!pre || in.idx_k != nullptr) DSACP_RETURN_IF_ERROR(check("idx_k_scale", in.idx_k_scale, {DType::kF32}, {{"T", T}}));
  }
  if (pre && in.idx_k == nullptr) return Status();
  return check("idx_k", in.idx_k, {ia}, {{"T", T}, {"Di", c.Di}});
}

Result<StepResult> step_run_host(Backend& backend, const StepConfig& c, const std::vector<Request>& requests,
                                 const BlockTable& table, PagedKvCache& cache, const HostStepInputs& in) {
  DSACP_ASSIGN_OR_RETURN(BatchLayout layout, batch_layout(requests, c.decode_threshold));
  const int64_t T = layout.num_tokens;
  DSACP_RETURN_IF_ERROR(check_host_step_inputs(c, T, in));

  DSACP_ASSIGN_OR_RETURN(DeviceBuffer q_nope, upload_tensor(backend, *in.q_nope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer q_rope, upload_tensor(backend, *in.q_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer kv_latent, upload_tensor(backend, *in.kv_latent));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer k_rope, upload_tensor(backend, *in.k_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_q, upload_optional(backend, in.idx_q));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_w, upload_optional(backend, in.idx_w));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_k, upload_optional(backend, in.idx_k));
  const bool fp8 = c.index_input_dtype() == DType::kF8E4M3;
  DeviceBuffer idx_q_scale, idx_k_scale;
  if (fp8) {
    DSACP_ASSIGN_OR_RETURN(idx_q_scale, upload_optional(backend, in.idx_q != nullptr ? in.idx_q_scale : nullptr));
    DSACP_ASSIGN_OR_RETURN(idx_k_scale, upload_optional(backend, in.idx_k != nullptr ? in.idx_k_scale : nullptr));
  }
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer pre_topk, upload_optional(backend, in.topk));

  StepResult r;
  DSACP_ASSIGN_OR_RETURN(r.topk_indices, Tensor::zeros(DType::kI32, {T, c.K}));
  DSACP_ASSIGN_OR_RETURN(r.out, Tensor::zeros(c.out_dtype, {T, c.H, c.Dl}));
  DSACP_ASSIGN_OR_RETURN(r.lse, Tensor::zeros(DType::kF32, {T, c.H}));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_topk, backend.allocate(std::max<size_t>(r.topk_indices.nbytes(), 1)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_out, backend.allocate(std::max<size_t>(r.out.nbytes(), 1)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_lse, backend.allocate(std::max<size_t>(r.lse.nbytes(), 1)));

  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_table, kept_block_table(backend, table, in.device_block_table));
  StepInputs si{q_nope.get(), q_rope.get(), kv_latent.get(), k_rope.get(), idx_q.get(), idx_w.as<const float>(),
                idx_k.get(), d_table.as<const int32_t>(), idx_q_scale.as<const float>(),
                idx_k_scale.as<const float>(), pre_topk.as<const int32_t>()};
  r.topk_form = c.topk_form;
  r.lse_base = c.lse_base;
  StepOutputs so{d_topk.as<int32_t>(), d_out.get(), d_lse.as<float>()};
  DSACP_RETURN_IF_ERROR(step_run(backend, c, requests, table, cache, si, so));
  if (T > 0) {
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(r.topk_indices.data(), d_topk.get(), r.topk_indices.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(r.out.data(), d_out.get(), r.out.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(r.lse.data(), d_lse.get(), r.lse.nbytes()));
  }
  return r;
}

Status check_context_latent(const PagedCacheConfig& cc, int64_t rows, const Tensor& ctx_latent,
                            const Tensor* ctx_latent_scales) {
  if (ctx_latent.dtype() != DType::kF8E4M3) {
    return check_tensor("ctx_kv_latent", ctx_latent.view(), {DType::kF32, DType::kBF16},
                        {{"sum C", rows}, {"Dl", cc.Dl}});
  }
  if (!cc.fp8_latent()) {
    return invalid_argument("ctx_kv_latent is F8_E4M3 but the cache's latent is not fp8_ds_mla");
  }
  DSACP_RETURN_IF_ERROR(
      check_tensor("ctx_kv_latent", ctx_latent.view(), {DType::kF8E4M3}, {{"sum C", rows}, {"Dl", cc.Dl}}));
  if (ctx_latent_scales == nullptr) {
    return invalid_argument("ctx_kv_latent is F8_E4M3 but ctx_kv_latent_scale is missing");
  }
  return check_tensor("ctx_kv_latent_scale", ctx_latent_scales->view(), {DType::kF32},
                      {{"sum C", rows}, {"Dl/128", cc.Dl / kFp8DsMlaTile}});
}

Status cache_load_context(Backend& backend, PagedKvCache& cache, const std::vector<Request>& requests,
                          const BlockTable& table, const Tensor& ctx_latent, const Tensor& ctx_rope,
                          const Tensor& ctx_index_keys, const Tensor* ctx_index_key_scales,
                          const Tensor* ctx_latent_scales) {
  const PagedCacheConfig& cc = cache.config();
  std::vector<int64_t> slots;
  for (size_t b = 0; b < requests.size(); ++b) {
    for (int64_t pos = 0; pos < requests[b].context_len; ++pos) {
      DSACP_ASSIGN_OR_RETURN(int64_t s, slot_of(table, static_cast<int32_t>(b), pos, cc.page_size));
      slots.push_back(s);
    }
  }
  const int64_t rows = static_cast<int64_t>(slots.size());
  const auto floats = {DType::kF32, DType::kBF16};
  DSACP_RETURN_IF_ERROR(check_context_latent(cc, rows, ctx_latent, ctx_latent_scales));
  DSACP_RETURN_IF_ERROR(check_tensor("ctx_k_rope", ctx_rope.view(), floats, {{"sum C", rows}, {"Dr", cc.Dr}}));
  const bool fp8 = ctx_index_keys.dtype() == DType::kF8E4M3;
  DSACP_RETURN_IF_ERROR(check_tensor("ctx_idx_k", ctx_index_keys.view(),
                                     fp8 ? std::initializer_list<DType>{DType::kF8E4M3} : floats,
                                     {{"sum C", rows}, {"Di", cc.Di}}));
  if (fp8) {
    if (ctx_index_key_scales == nullptr) return invalid_argument("ctx_idx_k is F8_E4M3 but ctx_idx_k_scale is missing");
    DSACP_RETURN_IF_ERROR(check_tensor("ctx_idx_k_scale", ctx_index_key_scales->view(), {DType::kF32}, {{"sum C", rows}}));
  }
  if (rows == 0) return Status();
  DeviceBuffer d_scales, d_latent_scales;
  if (fp8) {
    DSACP_ASSIGN_OR_RETURN(d_scales, upload_tensor(backend, *ctx_index_key_scales));
  }
  if (ctx_latent.dtype() == DType::kF8E4M3) {
    DSACP_ASSIGN_OR_RETURN(d_latent_scales, upload_tensor(backend, *ctx_latent_scales));
  }
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_slots, backend.allocate(slots.size() * sizeof(int64_t)));
  DSACP_RETURN_IF_ERROR(backend.copy_to_device(d_slots.get(), slots.data(), slots.size() * sizeof(int64_t)));
  const struct {
    const Tensor* rows;
    PagedPoolView pool;
  } writes[] = {{&ctx_latent, cache.latent()}, {&ctx_rope, cache.rope()}, {&ctx_index_keys, cache.index_keys()}};
  for (const auto& wr : writes) {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_rows, upload_tensor(backend, *wr.rows));
    CacheWriteParams p;
    p.rows = d_rows.get();
    p.rows_dtype = wr.rows->dtype();
    p.num_rows = rows;
    p.slots = d_slots.as<const int64_t>();
    p.pool = wr.pool;
    p.fp8_scale_mode = cc.index_scale_mode;
    p.record_scale_mode = cc.latent_scale_mode;
    if (wr.rows == &ctx_index_keys && fp8) p.row_scales = d_scales.as<const float>();
    if (wr.rows == &ctx_latent && ctx_latent.dtype() == DType::kF8E4M3) {
      p.row_scales = d_latent_scales.as<const float>();
    }
    DSACP_RETURN_IF_ERROR(cache_write_run(backend, p));
  }
  return backend.synchronize();
}

}  // namespace dsacp
