// Every rank of a CP layout as threads of this process (the embedded default; what tests use), on one backend
// or one per rank (GPUs: NCCL).
#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include <algorithm>
#include <new>

#include "dsacp/cp_step.h"
#include "core/rank_workers.h"
#include "dsacp/nccl_communicator.h"
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

Result<Tensor> select_rows_heads(const Tensor& full, const std::vector<int64_t>& rows, int64_t h0, int64_t nh) {
  const int64_t H = full.dim(1), D = full.dim(2);
  DSACP_ASSIGN_OR_RETURN(Tensor out, Tensor::zeros(full.dtype(), {static_cast<int64_t>(rows.size()), nh, D}));
  const size_t elem = dtype_size(full.dtype());
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0) continue;
    std::memcpy(static_cast<char*>(out.data()) + i * nh * D * elem,
                static_cast<const char*>(full.data()) + (rows[i] * H + h0) * D * elem, nh * D * elem);
  }
  return out;
}

Result<std::unique_ptr<LocalCpCluster>> LocalCpCluster::create(Backend& backend, const CpLayout& layout,
                                                               const PagedCacheConfig& per_rank_cache) {
  return create(std::vector<Backend*>(static_cast<size_t>(std::max(layout.num_ranks(), 1)), &backend), layout,
                per_rank_cache);
}

Result<std::unique_ptr<LocalCpCluster>> LocalCpCluster::create(const std::vector<Backend*>& rank_backends,
                                                               const CpLayout& layout,
                                                               const PagedCacheConfig& per_rank_cache) {
  if (layout.P < 1) return invalid_argument("--pcp must be >= 1, got " + std::to_string(layout.P));
  if (layout.D < 1) return invalid_argument("--dcp must be >= 1, got " + std::to_string(layout.D));
  if (layout.interleave < 0) return invalid_argument("--interleave must be >= 1, got " + std::to_string(layout.interleave));
  if (layout.graph_bucket_tokens < 0) return invalid_argument("graph bucket must be >= 0");
  if (layout.comm_timeout_ms < 1) {
    return invalid_argument("communicator timeout must be >= 1 ms, got " + std::to_string(layout.comm_timeout_ms));
  }
  const int32_t Pt = layout.num_ranks();
  if (static_cast<int32_t>(rank_backends.size()) != Pt) {
    return invalid_argument("CP cluster: " + std::to_string(rank_backends.size()) + " backends for P=" +
                            std::to_string(layout.P) + " x D=" + std::to_string(layout.D) + " = " +
                            std::to_string(Pt) + " ranks (one per rank, or one for all)");
  }
  for (size_t i = 0; i < rank_backends.size(); ++i) {
    if (rank_backends[i] == nullptr) return invalid_argument("CP cluster: no backend for rank " + std::to_string(i));
  }
  // One backend for every rank, or a different one per rank; GPU ranks on different devices use NCCL.
  const bool shared = std::all_of(rank_backends.begin(), rank_backends.end(),
                                  [&](Backend* b) { return b == rank_backends[0]; });
  bool nccl = false;
  if (!shared) {
    std::vector<int> device_rank;
    for (int32_t cr = 0; cr < Pt; ++cr) {
      const int dev = rank_backends[cr]->cuda_device();
      if ((dev >= 0) != (rank_backends[0]->cuda_device() >= 0)) {
        return invalid_argument("CP cluster: ranks 0 and " + std::to_string(cr) +
                                " mix host-memory and GPU backends; use one kind for every rank");
      }
      if (dev < 0) continue;
      if (dev >= static_cast<int>(device_rank.size())) device_rank.resize(dev + 1, -1);
      if (device_rank[dev] >= 0) {
        return invalid_argument("CP cluster: ranks " + std::to_string(device_rank[dev]) + " and " +
                                std::to_string(cr) + " are both on CUDA device " + std::to_string(dev) +
                                ": NCCL needs one rank per GPU (one backend for every rank runs them all on one GPU)");
      }
      device_rank[dev] = cr;
      nccl = true;
    }
    if (nccl && !nccl_available()) {
      return unsupported("CP cluster: ranks on several GPUs need NCCL: " + nccl_version());
    }
  }
  std::unique_ptr<LocalCpCluster> c(new LocalCpCluster());
  c->backends_ = rank_backends;
  c->nccl_ = nccl;
  c->layout_ = layout;
  c->sharding_ = cp_kv_sharding(layout, per_rank_cache.page_size);
  c->cache_config_ = cp_rank_cache_config(layout, per_rank_cache);
  for (int32_t r = 0; r < Pt; ++r) {
    DSACP_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::create(*rank_backends[r], c->cache_config_));
    c->caches_.push_back(std::move(cache));
  }
  DSACP_ASSIGN_OR_RETURN(c->workers_, RankWorkers::create(Pt));
  if (nccl) DSACP_RETURN_IF_ERROR(c->make_nccl_comms());
  return c;
}

LocalCpCluster::~LocalCpCluster() { release_nccl_comms(); }

// NCCL communicators are released by their own rank's thread, all at once (finalization may wait for peers).
void LocalCpCluster::release_nccl_comms() {
  if (comms_.empty()) return;
  workers_->run([this](int32_t cr) {
    OwnedCpComms& rc = comms_[static_cast<size_t>(cr)];
    rc.dcp.reset();
    rc.pcp.reset();
    rc.world.reset();
  });
  comms_.clear();
}

std::string LocalCpCluster::transport() const {
  if (nccl_) return "nccl";
  return backends_.empty() || backends_[0]->cuda_device() < 0 ? "threads" : "threads (device copies)";
}

Result<OwnedCpComms> nccl_cp_comms(const NcclId& id, const CpLayout& layout, int32_t cr, const NcclOptions& options) {
  const int32_t D = layout.D;
  DSACP_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> world,
                         NcclCommunicator::create(id, layout.num_ranks(), cr, options));
  DSACP_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> pcp, world->split(cr % D, cr / D));
  DSACP_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> dcp, world->split(cr / D, cr % D));
  OwnedCpComms comms;
  comms.world = std::move(world);
  comms.pcp = std::move(pcp);
  comms.dcp = std::move(dcp);
  return comms;
}

// Every rank's communicators (nccl_cp_comms), each rank in its own thread, since creation is collective.
Status LocalCpCluster::make_nccl_comms() {
  const int32_t Pt = sharding_.Pt;
  comms_.clear();
  comms_.resize(static_cast<size_t>(Pt));
  DSACP_ASSIGN_OR_RETURN(NcclId id, nccl_make_id());
  auto signal = std::make_shared<AbortSignal>();
  std::vector<Status> status(static_cast<size_t>(Pt));
  workers_->run([&](int32_t cr) {
    auto run = [&]() -> Status {
      NcclOptions o;
      o.device = backends_[cr]->cuda_device();
      o.producer_stream = backends_[cr]->native_stream();
      o.timeout = std::chrono::milliseconds(layout_.comm_timeout_ms);
      o.abort_signal = signal;
      o.window_bytes = layout_.nccl_window_bytes;
      o.peer_exchange_bytes = layout_.nccl_peer_exchange_bytes;
      DSACP_ASSIGN_OR_RETURN(comms_[cr], nccl_cp_comms(id, layout_, cr, o));
      return Status();
    };
    status[cr] = run();
    if (!status[cr].ok()) signal->raise("rank " + std::to_string(cr) + ": " + status[cr].message());
  });
  for (int32_t cr = 0; cr < Pt; ++cr) {
    if (!status[cr].ok()) {
      const Status s = status[cr].with_context("NCCL communicators of CP rank " + std::to_string(cr));
      comms_.clear();
      return s;
    }
  }
  return Status();
}

size_t LocalCpCluster::cache_bytes_per_rank() const { return caches_.empty() ? 0 : caches_[0].bytes(); }

KvSharding cp_kv_sharding(const CpLayout& layout, int32_t page_size) {
  return KvSharding{std::max(layout.num_ranks(), 1), layout.interleave == 0 ? page_size : layout.interleave};
}

Status cp_fp8_unsupported() {
  return unsupported("the FP8 indexer (F8_E4M3 idx_q/idx_k): prefill rows under the sharded indexer without DSA-CP "
                     "(a gathered view of FP8 pages) are not supported yet; --indexer replicated runs FP8 in every "
                     "layout, the sharded indexer runs FP8 decode-only batches and DSA-CP");
}

PagedCacheConfig cp_rank_cache_config(const CpLayout& layout, const PagedCacheConfig& per_rank_cache) {
  PagedCacheConfig c = per_rank_cache;
  c.index_page_factor = layout.indexer == IndexerMode::kReplicated ? layout.num_ranks() : 1;
  return c;
}

Status cp_load_context_rank(Backend& backend, const CpLayout& layout, const KvSharding& sharding, int32_t cr,
                            const std::vector<Request>& requests, const BlockTable& table, const Tensor& ctx_latent,
                            const Tensor& ctx_rope, const Tensor& ctx_index_keys, PagedKvCache& cache,
                            const Tensor* ctx_index_key_scales, const Tensor* ctx_latent_scales) {
  if (sharding.Pt == 1) {
    return cache_load_context(backend, cache, requests, table, ctx_latent, ctx_rope, ctx_index_keys,
                              ctx_index_key_scales, ctx_latent_scales);
  }
  const bool fp8 = ctx_index_keys.dtype() == DType::kF8E4M3;
  if (fp8 && ctx_index_key_scales == nullptr) return invalid_argument("ctx_idx_k is F8_E4M3 but ctx_idx_k_scale is missing");
  if (cr < 0 || cr >= sharding.Pt) {
    return out_of_range("context load: rank " + std::to_string(cr) + " outside [0, " + std::to_string(sharding.Pt) +
                        ")");
  }
  const PagedCacheConfig& cc = cache.config();
  const int32_t B = cc.page_size;
  const bool replicated = layout.indexer == IndexerMode::kReplicated;
  std::vector<int64_t> seq_lens;
  for (const Request& r : requests) seq_lens.push_back(r.seq_len());
  BlockTable rep;
  if (replicated) {
    DSACP_ASSIGN_OR_RETURN(rep, replicated_index_table(table, seq_lens, sharding.Pt, B));
  }
  int64_t rows = 0;
  for (const Request& r : requests) rows += r.context_len;
  const auto floats = {DType::kF32, DType::kBF16};
  DSACP_RETURN_IF_ERROR(check_context_latent(cc, rows, ctx_latent, ctx_latent_scales));
  DSACP_RETURN_IF_ERROR(check_tensor("ctx_k_rope", ctx_rope.view(), floats, {{"sum C", rows}, {"Dr", cc.Dr}}));
  DSACP_RETURN_IF_ERROR(check_tensor("ctx_idx_k", ctx_index_keys.view(),
                                     fp8 ? std::initializer_list<DType>{DType::kF8E4M3} : floats,
                                     {{"sum C", rows}, {"Di", cc.Di}}));
  if (fp8) {
    DSACP_RETURN_IF_ERROR(check_tensor("ctx_idx_k_scale", ctx_index_key_scales->view(), {DType::kF32}, {{"sum C", rows}}));
  }
  if (rows == 0) return Status();
  auto up = [&](const Tensor& t) -> Result<DeviceBuffer> {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer b, backend.allocate(t.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_device(b.get(), t.data(), t.nbytes()));
    return b;
  };
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_latent, up(ctx_latent));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_rope, up(ctx_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_idx, up(ctx_index_keys));
  DeviceBuffer d_idx_scales, d_latent_scales;
  if (fp8) {
    DSACP_ASSIGN_OR_RETURN(d_idx_scales, up(*ctx_index_key_scales));
  }
  if (ctx_latent.dtype() == DType::kF8E4M3) {
    DSACP_ASSIGN_OR_RETURN(d_latent_scales, up(*ctx_latent_scales));
  }
  std::vector<int64_t> owned, all;
  for (size_t b = 0; b < requests.size(); ++b) {
    for (int64_t p = 0; p < requests[b].context_len; ++p) {
      DSACP_ASSIGN_OR_RETURN(int64_t s, sharded_slot(sharding, cr, table, static_cast<int32_t>(b), p, B));
      owned.push_back(s);
      if (replicated) all.push_back(int64_t{rep.page(static_cast<int32_t>(b), p / B)} * B + p % B);
    }
  }
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_owned, upload_vector(backend, owned));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_all, upload_vector(backend, all));
  const struct {
    const DeviceBuffer* rows;
    DType dtype;
    PagedPoolView pool;
    const DeviceBuffer* slots;
  } writes[] = {{&d_latent, ctx_latent.dtype(), cache.latent(), &d_owned},
                {&d_rope, ctx_rope.dtype(), cache.rope(), &d_owned},
                {&d_idx, ctx_index_keys.dtype(), cache.index_keys(), replicated ? &d_all : &d_owned}};
  for (const auto& w : writes) {
    CacheWriteParams p;
    p.rows = w.rows->get();
    p.rows_dtype = w.dtype;
    p.num_rows = rows;
    p.slots = w.slots->as<const int64_t>();
    p.pool = w.pool;
    p.fp8_scale_mode = cc.index_scale_mode;
    p.record_scale_mode = cc.latent_scale_mode;
    if (w.rows == &d_idx && fp8) p.row_scales = d_idx_scales.as<const float>();
    if (w.rows == &d_latent && ctx_latent.dtype() == DType::kF8E4M3) p.row_scales = d_latent_scales.as<const float>();
    DSACP_RETURN_IF_ERROR(cache_write_run(backend, p).with_context("context load on rank " + std::to_string(cr)));
  }
  return backend.synchronize();
}

Status LocalCpCluster::load_context(const std::vector<Request>& requests, const BlockTable& table,
                                    const Tensor& ctx_latent, const Tensor& ctx_rope, const Tensor& ctx_index_keys,
                                    const Tensor* ctx_index_key_scales, const Tensor* ctx_latent_scales) {
  auto load = [&](int32_t cr) {
    return cp_load_context_rank(*backends_[cr], layout_, sharding_, cr, requests, table, ctx_latent, ctx_rope,
                                ctx_index_keys, caches_[cr], ctx_index_key_scales, ctx_latent_scales);
  };
  if (!nccl_) {
    for (int32_t cr = 0; cr < sharding_.Pt; ++cr) DSACP_RETURN_IF_ERROR(load(cr));
    return Status();
  }
  std::vector<Status> status(static_cast<size_t>(sharding_.Pt));
  workers_->run([&](int32_t cr) { status[cr] = load(cr); });
  for (const Status& st : status) DSACP_RETURN_IF_ERROR(st);
  return Status();
}

Result<StepResult> cp_rank_step_host(Backend& backend, const CpComms& comms, const StepConfig& c,
                                     const std::vector<Request>& requests, const CpLayout& layout,
                                     const KvSharding& sharding, const BlockTable& table, const CpRankPlan& plan,
                                     PagedKvCache& cache, const HostStepInputs& inputs) {
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_table, kept_block_table(backend, table, inputs.device_block_table));
  CpStepPlanOptions options;
  options.device_block_table = d_table.as<const int32_t>();
  DSACP_ASSIGN_OR_RETURN(CpStepPlan step_plan,
                         cp_step_plan(backend, c, requests, plan, layout, sharding, table, cache.config(), options));
  return cp_rank_step_host(backend, comms, step_plan, cache, inputs);
}

Result<StepResult> cp_rank_step_host(Backend& backend, const CpComms& comms, const CpStepPlan& step_plan,
                                     PagedKvCache& cache, const HostStepInputs& inputs) {
  const StepConfig& c = step_plan.config();
  const CpRankPlan& plan = step_plan.rank_plan();
  // The rank's rows (and heads) of the full-batch inputs.
  const std::vector<int64_t>& token = plan.row_token;
  DSACP_ASSIGN_OR_RETURN(Tensor h_q_nope, select_rows_heads(*inputs.q_nope, token, plan.head_begin, plan.num_heads));
  DSACP_ASSIGN_OR_RETURN(Tensor h_q_rope, select_rows_heads(*inputs.q_rope, token, plan.head_begin, plan.num_heads));
  DSACP_ASSIGN_OR_RETURN(Tensor h_kv_latent, select_rows(*inputs.kv_latent, token));
  DSACP_ASSIGN_OR_RETURN(Tensor h_k_rope, select_rows(*inputs.k_rope, token));
  auto up = [&](const Tensor& t) -> Result<DeviceBuffer> {
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer b, backend.allocate(std::max<size_t>(t.nbytes(), 1)));
    if (t.nbytes() > 0) DSACP_RETURN_IF_ERROR(backend.copy_to_device(b.get(), t.data(), t.nbytes()));
    return b;
  };
  // The rank's rows of an input the step may go without (the indexer's, with a precomputed top-k): none for none.
  auto up_rows = [&](const Tensor* t) -> Result<DeviceBuffer> {
    if (t == nullptr) return DeviceBuffer{};
    DSACP_ASSIGN_OR_RETURN(Tensor rows, select_rows(*t, token));
    return up(rows);
  };
  // The precomputed top-k's rows; padding rows (no token) see no keys: -1 rows.
  DeviceBuffer pre_topk;
  if (inputs.topk != nullptr) {
    DSACP_ASSIGN_OR_RETURN(Tensor h_topk, select_rows(*inputs.topk, token));
    for (size_t i = 0; i < token.size(); ++i) {
      if (token[i] < 0) std::fill_n(h_topk.data_as<int32_t>() + i * c.K, c.K, -1);
    }
    DSACP_ASSIGN_OR_RETURN(pre_topk, up(h_topk));
  }
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer q_nope, up(h_q_nope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer q_rope, up(h_q_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer kv_latent, up(h_kv_latent));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer k_rope, up(h_k_rope));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_q, up_rows(inputs.idx_q));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_w, up_rows(inputs.idx_w));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer idx_k, up_rows(inputs.idx_k));
  DeviceBuffer idx_q_scale, idx_k_scale;  // the FP8 indexer's scales of the rank's rows
  if (c.index_input_dtype() == DType::kF8E4M3) {
    if ((inputs.idx_q != nullptr && inputs.idx_q_scale == nullptr) ||
        (inputs.idx_k != nullptr && inputs.idx_k_scale == nullptr)) {
      return invalid_argument("F8_E4M3 indexer inputs need idx_q_scale and idx_k_scale");
    }
    DSACP_ASSIGN_OR_RETURN(idx_q_scale, up_rows(inputs.idx_q != nullptr ? inputs.idx_q_scale : nullptr));
    DSACP_ASSIGN_OR_RETURN(idx_k_scale, up_rows(inputs.idx_k != nullptr ? inputs.idx_k_scale : nullptr));
  }
  const int64_t rows = plan.output_rows, Hr = plan.num_heads;
  StepResult result;
  result.topk_form = c.topk_form;
  result.lse_base = c.lse_base;
  DSACP_ASSIGN_OR_RETURN(result.topk_indices, Tensor::zeros(DType::kI32, {rows, c.K}));
  DSACP_ASSIGN_OR_RETURN(result.out, Tensor::zeros(c.out_dtype, {rows, Hr, c.Dl}));
  DSACP_ASSIGN_OR_RETURN(result.lse, Tensor::zeros(DType::kF32, {rows, Hr}));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_topk, backend.allocate(std::max<size_t>(result.topk_indices.nbytes(), 1)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_out, backend.allocate(std::max<size_t>(result.out.nbytes(), 1)));
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_lse, backend.allocate(std::max<size_t>(result.lse.nbytes(), 1)));
  StepInputs in{q_nope.get(), q_rope.get(), kv_latent.get(), k_rope.get(), idx_q.get(), idx_w.as<const float>(),
                idx_k.get(), nullptr, idx_q_scale.as<const float>(), idx_k_scale.as<const float>(),
                pre_topk.as<const int32_t>()};
  StepOutputs out{d_topk.as<int32_t>(), d_out.get(), d_lse.as<float>()};
  DSACP_RETURN_IF_ERROR(cp_step_run(backend, comms, step_plan, cache, in, out));
  if (rows > 0) {
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(result.topk_indices.data(), d_topk.get(), result.topk_indices.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(result.out.data(), d_out.get(), result.out.nbytes()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(result.lse.data(), d_lse.get(), result.lse.nbytes()));
  }
  return result;
}

Result<std::vector<CpRankPlan>> cp_all_rank_plans(const StepConfig& c, const std::vector<Request>& requests,
                                                  const CpLayout& layout, const BlockTable& table, int32_t page_size) {
  std::vector<CpRankPlan> plans;
  for (int32_t cr = 0; cr < layout.num_ranks(); ++cr) {
    DSACP_ASSIGN_OR_RETURN(CpRankPlan plan, cp_rank_plan(requests, layout, cr / layout.D, cr % layout.D, table,
                                                         page_size, c.decode_threshold, c.H));
    plans.push_back(std::move(plan));
  }
  return plans;
}

Result<StepResult> cp_assemble_result(const StepConfig& c, const CpLayout& layout, int64_t T,
                                      const std::vector<CpRankPlan>& plans,
                                      const std::vector<StepResult>& rank_results) {
  if (plans.size() != rank_results.size() || static_cast<int32_t>(plans.size()) != layout.num_ranks()) {
    return invalid_argument("assemble: " + std::to_string(rank_results.size()) + " rank results and " +
                            std::to_string(plans.size()) + " plans for " + std::to_string(layout.num_ranks()) +
                            " ranks");
  }
  // Each (token, head) comes from one rank: a row shared by every PCP rank (a decode) from r = 0, any other row
  // from the rank that holds it; heads from the rank that computed them.
  StepResult result;
  result.topk_form = c.topk_form;
  result.lse_base = c.lse_base;
  DSACP_ASSIGN_OR_RETURN(result.topk_indices, Tensor::zeros(DType::kI32, {T, c.K}));
  DSACP_ASSIGN_OR_RETURN(result.out, Tensor::zeros(c.out_dtype, {T, c.H, c.Dl}));
  DSACP_ASSIGN_OR_RETURN(result.lse, Tensor::zeros(DType::kF32, {T, c.H}));
  const size_t out_elem = dtype_size(c.out_dtype);
  for (size_t cr = 0; cr < plans.size(); ++cr) {
    const CpRankPlan& plan = plans[cr];
    const StepResult& rank = rank_results[cr];
    const int64_t Hr = plan.num_heads, h0 = plan.head_begin;
    if (rank.topk_indices.numel() != plan.output_rows * c.K || rank.out.numel() != plan.output_rows * Hr * c.Dl ||
        rank.lse.numel() != plan.output_rows * Hr || rank.out.dtype() != c.out_dtype) {
      return invalid_argument("assemble: rank " + std::to_string(cr) + "'s result does not match its plan");
    }
    for (int64_t i = 0; i < plan.num_rows; ++i) {
      const int64_t t = plan.row_token[i];
      const bool decode_copy = !layout.dsa_cp && i < plan.pcp.num_local_decode_tokens && plan.r != 0;
      if (t < 0 || decode_copy) continue;
      if (t >= T) {
        return out_of_range("assemble: token " + std::to_string(t) + " outside [0, " + std::to_string(T) + ")");
      }
      if (h0 == 0) {
        std::memcpy(result.topk_indices.data_as<int32_t>() + t * c.K, rank.topk_indices.data_as<int32_t>() + i * c.K,
                    static_cast<size_t>(c.K) * sizeof(int32_t));
      }
      std::memcpy(static_cast<char*>(result.out.data()) + (t * c.H + h0) * c.Dl * out_elem,
                  static_cast<const char*>(rank.out.data()) + i * Hr * c.Dl * out_elem, Hr * c.Dl * out_elem);
      std::memcpy(result.lse.data_as<float>() + t * c.H + h0, rank.lse.data_as<float>() + i * Hr,
                  static_cast<size_t>(Hr) * sizeof(float));
    }
  }
  return result;
}

Result<StepResult> LocalCpCluster::step(const StepConfig& c, const std::vector<Request>& requests,
                                        const BlockTable& table, const HostStepInputs& inputs,
                                        std::vector<StepResult>* per_rank) {
  if (sharding_.Pt == 1) {
    comm_stats_.assign(1, CommStats{});  // one rank: no collectives
    group_stats_.assign(1, GroupCommStats{});
    return step_run_host(*backends_[0], c, requests, table, caches_[0], inputs);
  }
  DSACP_RETURN_IF_ERROR(validate_layout(layout_, c.H));
  DSACP_ASSIGN_OR_RETURN(BatchLayout layout, batch_layout(requests, c.decode_threshold));
  const int64_t T = layout.num_tokens;
  DSACP_RETURN_IF_ERROR(check_host_step_inputs(c, T, inputs));

  const int32_t P = layout_.P, D = layout_.D, Pt = P * D;
  DSACP_ASSIGN_OR_RETURN(std::vector<CpRankPlan> plans,
                         cp_all_rank_plans(c, requests, layout_, table, cache_config_.page_size));
  std::vector<StepResult> results(static_cast<size_t>(Pt));
  std::vector<Status> status(static_cast<size_t>(Pt));

  // Thread transport: the world, D PCP groups (same d) and P DCP groups (same r), made for this step.
  // NCCL: the communicators made once (again if an earlier step failed and aborted them).
  const std::chrono::milliseconds timeout(layout_.comm_timeout_ms);
  std::shared_ptr<LocalGroup> world;
  std::vector<std::shared_ptr<LocalGroup>> pcp_groups, dcp_groups;
  if (nccl_) {
    if (comms_.empty()) DSACP_RETURN_IF_ERROR(make_nccl_comms());
    for (auto& rc : comms_) {
      for (Communicator* comm : {rc.world.get(), rc.pcp.get(), rc.dcp.get()}) comm->reset_stats();
    }
  } else {
    CopyFn copy;
    if (backends_[0]->cuda_device() >= 0) {
      Backend* b = backends_[0];
      copy = [b](void* dst, const void* src, size_t n) { return b->copy_on_device(dst, src, n); };
    }
    world = LocalGroup::create(Pt, timeout, copy);
    for (int32_t d = 0; d < D; ++d) pcp_groups.push_back(LocalGroup::create(P, timeout, copy));
    for (int32_t r = 0; r < P; ++r) dcp_groups.push_back(LocalGroup::create(D, timeout, copy));
  }
  group_stats_.assign(static_cast<size_t>(Pt), GroupCommStats{});
  workers_->run([&](int32_t cr) {
    const int32_t r = cr / D, d = cr % D;
    std::unique_ptr<Communicator> w_comm, p_comm, d_comm;
    CpComms comms;
    if (nccl_) {
      comms = comms_[cr].view();
    } else {
      w_comm = world->make_communicator(cr);
      p_comm = pcp_groups[d]->make_communicator(r);
      d_comm = dcp_groups[r]->make_communicator(d);
      comms = CpComms{w_comm.get(), p_comm.get(), d_comm.get()};
    }
    // An exception (std::bad_alloc) is this rank's failure like any other: it aborts the communicators below,
    // so the peers waiting for this rank in a collective are released at once.
    Result<StepResult> rank_result = internal_error("CP rank step did not run");
    try {
      rank_result = cp_rank_step_host(*backends_[cr], comms, c, requests, layout_, sharding_, table, plans[cr],
                                      caches_[cr], inputs);
    } catch (const std::bad_alloc&) {
      rank_result = resource_exhausted("out of host memory in the step");
    } catch (const std::exception& e) {
      rank_result = internal_error(std::string("exception in the step: ") + e.what());
    }
    if (rank_result.ok()) {
      results[cr] = std::move(rank_result).value();
    } else {
      status[cr] = rank_result.status();
      for (Communicator* comm : {comms.world, comms.pcp, comms.dcp}) comm->abort(status[cr].message());
    }
    group_stats_[cr] = GroupCommStats{comms.world->stats(), comms.pcp->stats(), comms.dcp->stats()};
  });
  comm_stats_.assign(static_cast<size_t>(Pt), CommStats{});
  for (int32_t cr = 0; cr < Pt; ++cr) comm_stats_[cr] = group_stats_[cr].world;
  for (int32_t cr = 0; cr < Pt; ++cr) {
    if (!status[cr].ok()) {
      if (nccl_) {
        // The failure aborted the NCCL communicators: release them (each by its own rank's thread) and make new
        // ones at the next step.
        release_nccl_comms();
      }
      return status[cr].with_context("CP rank " + std::to_string(cr) + " (r=" + std::to_string(cr / D) +
                                     ", d=" + std::to_string(cr % D) + ")");
    }
  }
  DSACP_ASSIGN_OR_RETURN(StepResult result, cp_assemble_result(c, layout_, T, plans, results));
  if (per_rank != nullptr) *per_rank = std::move(results);
  return result;
}

}  // namespace dsacp
