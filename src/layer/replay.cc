#include "dsacp/replay.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "dsacp/paged_cache.h"
#include "dsacp/step.h"
#include "layer/step_checks.h"

namespace dsacp {

DType case_compute_dtype(const CaseFile& c) {
  for (const Tensor* t : {&c.q_nope, &c.q_rope, &c.kv_latent, &c.k_rope, &c.idx_q, &c.idx_k, &c.ctx_kv_latent,
                          &c.ctx_k_rope, &c.ctx_idx_k}) {
    if (t->dtype() == DType::kF8E4M3) continue;  // the FP8 indexer tensors stay as they are
    if (t->dtype() != DType::kBF16) return DType::kF32;
  }
  return DType::kBF16;
}

namespace {

// Everything a replay needs besides the caches, the same on every rank and every process: the per-rank cache
// configuration, the shared block table (pages from the seeded allocator: deterministic), the inputs in the
// compute dtype and the step's configuration.
struct ReplaySetup {
  PagedCacheConfig cache_config;
  KvSharding sharding;
  BlockTable table;
  Tensor ctx_latent, ctx_rope, ctx_idx_k;
  Tensor q_nope, q_rope, kv_latent, k_rope, idx_q, idx_k;
  // The FP8 indexer's scales (the case's, or made by quantizing its f32/bf16 indexer tensors).
  Tensor idx_q_scale, idx_k_scale, ctx_idx_k_scale;
  Tensor ctx_latent_scale;  // the fp8_ds_mla context latent's tile scales
  StepConfig config;
  bool device_block_table = false;
  const Tensor* topk = nullptr;  // a precomputed top-k (ReplayOptions::topk)
  HostStepInputs inputs(const CaseFile& c) const {
    HostStepInputs in{&q_nope, &q_rope, &kv_latent, &k_rope, &idx_q, &c.idx_w, &idx_k, device_block_table};
    in.topk = topk;
    if (config.index_input_dtype() == DType::kF8E4M3) {
      in.idx_q_scale = &idx_q_scale;
      in.idx_k_scale = &idx_k_scale;
    }
    return in;
  }
  const Tensor* ctx_index_key_scales() const {
    return config.index_input_dtype() == DType::kF8E4M3 ? &ctx_idx_k_scale : nullptr;
  }
  const Tensor* ctx_latent_scales() const { return cache_config.fp8_latent() ? &ctx_latent_scale : nullptr; }
};

Result<ReplaySetup> replay_setup(const CaseFile& c, const ReplayOptions& options) {
  if (options.page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(options.page_size));
  if (options.spare_pages < 0) return invalid_argument("spare_pages must be >= 0");
  const DType dtype = case_compute_dtype(c);
  DSACP_RETURN_IF_ERROR(batch_layout(c.requests).status());

  ReplaySetup s;
  PagedCacheConfig& cc = s.cache_config;
  cc.page_size = options.page_size;
  cc.Dl = c.dims.Dl;
  cc.Dr = c.dims.Dr;
  cc.Di = c.dims.Di;
  cc.dtype = dtype;
  s.sharding = cp_kv_sharding(options.layout, options.page_size);
  cc.num_pages = options.spare_pages;
  for (const Request& r : c.requests) cc.num_pages += s.sharding.pages_needed(r.seq_len(), cc.page_size);

  // One block table shared by every rank: pages for the largest share (rank 0's), in a shuffled order.
  PageAllocator allocator(cc.num_pages, options.page_shuffle_seed);
  std::vector<SequencePages> seqs(c.requests.size());
  std::vector<const SequencePages*> seq_ptrs;
  for (size_t b = 0; b < c.requests.size(); ++b) {
    DSACP_RETURN_IF_ERROR(seqs[b].reserve(allocator, s.sharding.local_len(c.requests[b].seq_len(), 0), cc.page_size));
    seq_ptrs.push_back(&seqs[b]);
  }
  s.table = BlockTable::from_sequences(seq_ptrs);

  // Inputs converted (losslessly) to the compute dtype.
  auto conv = [&](const Tensor& t) { return t.to_dtype(dtype); };
  // The fp8_ds_mla latent: the case's e4m3 context latent as it is, or (options.latent_fp8) its f32/bf16 one
  // quantized here exactly as `make-case --kv-dtype fp8_ds_mla` would (case_quantize_latent).
  if (c.latent_fp8() || options.latent_fp8) {
    CaseFile q;
    const CaseFile* src = &c;
    if (!c.latent_fp8()) {
      DSACP_ASSIGN_OR_RETURN(q.ctx_kv_latent, c.ctx_kv_latent.clone());
      q.dims = c.dims;
      DSACP_RETURN_IF_ERROR(case_quantize_latent(q, options.latent_scale_mode));
      src = &q;
    }
    DSACP_ASSIGN_OR_RETURN(s.ctx_latent, src->ctx_kv_latent.clone());
    DSACP_ASSIGN_OR_RETURN(s.ctx_latent_scale, src->ctx_kv_latent_scale.clone());
    cc.latent_format = LatentFormat::kFp8DsMla;
    cc.latent_scale_mode = options.latent_scale_mode;
  } else {
    DSACP_ASSIGN_OR_RETURN(s.ctx_latent, conv(c.ctx_kv_latent));
  }
  DSACP_ASSIGN_OR_RETURN(s.ctx_rope, conv(c.ctx_k_rope));
  DSACP_ASSIGN_OR_RETURN(s.q_nope, conv(c.q_nope));
  DSACP_ASSIGN_OR_RETURN(s.q_rope, conv(c.q_rope));
  DSACP_ASSIGN_OR_RETURN(s.kv_latent, conv(c.kv_latent));
  DSACP_ASSIGN_OR_RETURN(s.k_rope, conv(c.k_rope));
  // The FP8 indexer: the case's e4m3 tensors as they are, or (options.index_fp8) its f32/bf16 ones quantized here
  // exactly as `make-case --index-dtype fp8` would (case_quantize_index).
  const bool fp8 = c.index_fp8() || options.index_fp8;
  if (fp8) {
    CaseFile q;
    const CaseFile* src = &c;
    if (!c.index_fp8()) {
      DSACP_ASSIGN_OR_RETURN(q.idx_q, c.idx_q.clone());
      DSACP_ASSIGN_OR_RETURN(q.idx_k, c.idx_k.clone());
      DSACP_ASSIGN_OR_RETURN(q.ctx_idx_k, c.ctx_idx_k.clone());
      q.dims = c.dims;
      DSACP_RETURN_IF_ERROR(case_quantize_index(q, options.index_scale_mode));
      src = &q;
    }
    DSACP_ASSIGN_OR_RETURN(s.idx_q, src->idx_q.clone());
    DSACP_ASSIGN_OR_RETURN(s.idx_k, src->idx_k.clone());
    DSACP_ASSIGN_OR_RETURN(s.ctx_idx_k, src->ctx_idx_k.clone());
    DSACP_ASSIGN_OR_RETURN(s.idx_q_scale, src->idx_q_scale.clone());
    DSACP_ASSIGN_OR_RETURN(s.idx_k_scale, src->idx_k_scale.clone());
    DSACP_ASSIGN_OR_RETURN(s.ctx_idx_k_scale, src->ctx_idx_k_scale.clone());
    cc.index_dtype = DType::kF8E4M3;
    cc.index_scale_mode = options.index_scale_mode;
  } else {
    DSACP_ASSIGN_OR_RETURN(s.idx_q, conv(c.idx_q));
    DSACP_ASSIGN_OR_RETURN(s.idx_k, conv(c.idx_k));
    DSACP_ASSIGN_OR_RETURN(s.ctx_idx_k, conv(c.ctx_idx_k));
  }

  StepConfig& config = s.config;
  config = step_config_of(c.dims, c.topk, c.scale, dtype, options.out_dtype);
  if (fp8) config.index_dtype = DType::kF8E4M3;
  s.device_block_table = options.device_block_table;
  config.topk_form = options.topk_form;
  config.lse_base = options.lse_base;
  s.topk = options.topk;
  return s;
}

// A rank's result as raw bytes (topk, out, lse), zero-padded to `bytes`, and back.
std::vector<char> pack_rank_result(const StepResult& r, size_t bytes) {
  std::vector<char> packed(bytes, 0);
  size_t at = 0;
  for (const Tensor* t : {&r.topk_indices, &r.out, &r.lse}) {
    if (t->nbytes() > 0) std::memcpy(packed.data() + at, t->data(), t->nbytes());
    at += t->nbytes();
  }
  return packed;
}

Result<StepResult> unpack_rank_result(const char* packed, const StepConfig& c, const CpRankPlan& plan) {
  StepResult r;
  DSACP_ASSIGN_OR_RETURN(r.topk_indices, Tensor::zeros(DType::kI32, {plan.output_rows, c.K}));
  DSACP_ASSIGN_OR_RETURN(r.out, Tensor::zeros(c.out_dtype, {plan.output_rows, plan.num_heads, c.Dl}));
  DSACP_ASSIGN_OR_RETURN(r.lse, Tensor::zeros(DType::kF32, {plan.output_rows, plan.num_heads}));
  size_t at = 0;
  for (Tensor* t : {&r.topk_indices, &r.out, &r.lse}) {
    if (t->nbytes() > 0) std::memcpy(t->data(), packed + at, t->nbytes());
    at += t->nbytes();
  }
  return r;
}

size_t rank_result_bytes(const StepConfig& c, const CpRankPlan& plan) {
  const size_t rows = static_cast<size_t>(plan.output_rows), heads = static_cast<size_t>(plan.num_heads);
  return rows * c.K * sizeof(int32_t) + rows * heads * c.Dl * dtype_size(c.out_dtype) + rows * heads * sizeof(float);
}

// Refuses a replay whose estimate does not fit (host backends; a GPU backend's host side is the case only).
Status check_replay_memory(const std::vector<Backend*>& backends, const CaseFile& c, const ReplayOptions& options,
                           int32_t ranks_here) {
  if (!backends.empty() && backends[0] != nullptr && backends[0]->cuda_device() >= 0) {
    return device_memory_check(replay_memory_estimate(c, options, ranks_here), ranks_here, backends, "this replay");
  }
  return host_memory_check(replay_memory_estimate(c, options, ranks_here), "this replay", options.max_memory_bytes);
}

}  // namespace

MemoryEstimate replay_memory_estimate(const CaseFile& c, const ReplayOptions& options, int32_t ranks_here) {
  const CpLayout& layout = options.layout;
  const int32_t page_size = std::max(options.page_size, 1);
  const KvSharding sharding = cp_kv_sharding(layout, page_size);
  PagedCacheConfig cc;
  cc.page_size = page_size;
  cc.Dl = c.dims.Dl;
  cc.Dr = c.dims.Dr;
  cc.Di = c.dims.Di;
  cc.dtype = case_compute_dtype(c);
  cc.num_pages = std::max(options.spare_pages, 0);
  for (const Request& r : c.requests) cc.num_pages += sharding.pages_needed(r.seq_len(), page_size);
  const StepConfig config = step_config_of(c.dims, c.topk, c.scale, cc.dtype);
  MemoryEstimate e = cp_memory_estimate(config, layout, cc, c.num_tokens(), ranks_here);
  // The context rows, converted to the compute dtype before they are loaded.
  const uint64_t ctx = static_cast<uint64_t>(c.ctx_kv_latent.numel() + c.ctx_k_rope.numel() + c.ctx_idx_k.numel());
  e.inputs += ctx * dtype_size(cc.dtype);
  return e;
}

Result<StepResult> replay_case(Backend& backend, const CaseFile& c, const ReplayOptions& options) {
  return replay_case(std::vector<Backend*>(static_cast<size_t>(std::max(options.layout.num_ranks(), 1)), &backend), c,
                     options);
}

Result<StepResult> replay_case(const std::vector<Backend*>& rank_backends, const CaseFile& c,
                               const ReplayOptions& options) {
  DSACP_RETURN_IF_ERROR(
      check_replay_memory(rank_backends, c, options, std::max(options.layout.num_ranks(), 1)));
  DSACP_ASSIGN_OR_RETURN(ReplaySetup s, replay_setup(c, options));
  DSACP_ASSIGN_OR_RETURN(std::unique_ptr<LocalCpCluster> cluster,
                         LocalCpCluster::create(rank_backends, options.layout, s.cache_config));
  DSACP_RETURN_IF_ERROR(
      cluster->load_context(c.requests, s.table, s.ctx_latent, s.ctx_rope, s.ctx_idx_k, s.ctx_index_key_scales(),
                            s.ctx_latent_scales()));
  return cluster->step(s.config, c.requests, s.table, s.inputs(c));
}

Result<StepResult> replay_case_rank(Backend& backend, const CaseFile& c, const ReplayOptions& options,
                                    const CpComms& comms) {
  const CpLayout& layout = options.layout;
  const int32_t Pt = layout.num_ranks();
  if (comms.world == nullptr || comms.pcp == nullptr || comms.dcp == nullptr) {
    return invalid_argument("replay_case_rank: the world, PCP and DCP communicators are all needed");
  }
  if (comms.world->size() != Pt || comms.pcp->size() != layout.P || comms.dcp->size() != layout.D) {
    return invalid_argument("replay_case_rank: communicators of " + std::to_string(comms.world->size()) + " (world), " +
                            std::to_string(comms.pcp->size()) + " (PCP), " + std::to_string(comms.dcp->size()) +
                            " (DCP) ranks for a layout of P=" + std::to_string(layout.P) +
                            " x D=" + std::to_string(layout.D));
  }
  const int32_t cr = comms.world->rank();
  if (comms.pcp->rank() != cr / layout.D || comms.dcp->rank() != cr % layout.D) {
    return invalid_argument("replay_case_rank: world rank " + std::to_string(cr) + " must be PCP rank " +
                            std::to_string(cr / layout.D) + " and DCP rank " + std::to_string(cr % layout.D));
  }
  DSACP_RETURN_IF_ERROR(check_replay_memory({&backend}, c, options, 1));
  DSACP_ASSIGN_OR_RETURN(ReplaySetup s, replay_setup(c, options));
  DSACP_ASSIGN_OR_RETURN(PagedKvCache cache,
                         PagedKvCache::create(backend, cp_rank_cache_config(layout, s.cache_config)));
  DSACP_RETURN_IF_ERROR(cp_load_context_rank(backend, layout, s.sharding, cr, c.requests, s.table, s.ctx_latent,
                                             s.ctx_rope, s.ctx_idx_k, cache, s.ctx_index_key_scales(),
                                             s.ctx_latent_scales()));
  if (Pt == 1) return step_run_host(backend, s.config, c.requests, s.table, cache, s.inputs(c));

  DSACP_RETURN_IF_ERROR(validate_layout(layout, s.config.H));
  DSACP_ASSIGN_OR_RETURN(BatchLayout batch, batch_layout(c.requests, s.config.decode_threshold));
  const HostStepInputs inputs = s.inputs(c);
  DSACP_RETURN_IF_ERROR(check_host_step_inputs(s.config, batch.num_tokens, inputs));
  // Every process computes every rank's plan (pure host functions of the same inputs): its own to run, all
  // of them to size the gather and (on rank 0) to assemble the result.
  DSACP_ASSIGN_OR_RETURN(std::vector<CpRankPlan> plans,
                         cp_all_rank_plans(s.config, c.requests, layout, s.table, s.cache_config.page_size));
  DSACP_ASSIGN_OR_RETURN(StepResult mine, cp_rank_step_host(backend, comms, s.config, c.requests, layout, s.sharding,
                                                            s.table, plans[cr], cache, inputs));

  size_t slot_bytes = 1;
  for (const CpRankPlan& plan : plans) slot_bytes = std::max(slot_bytes, rank_result_bytes(s.config, plan));
  const std::vector<char> packed = pack_rank_result(mine, slot_bytes);
  std::vector<char> gathered(slot_bytes * static_cast<size_t>(Pt));
  {
    // Collective buffers live in the backend's memory (device memory under NCCL).
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_packed, backend.allocate(slot_bytes));
    DSACP_ASSIGN_OR_RETURN(DeviceBuffer d_gathered, backend.allocate(gathered.size()));
    DSACP_RETURN_IF_ERROR(backend.copy_to_device(d_packed.get(), packed.data(), slot_bytes));
    DSACP_RETURN_IF_ERROR(
        comms.world->all_gather(d_packed.get(), d_gathered.get(), slot_bytes).with_context("result gather"));
    DSACP_RETURN_IF_ERROR(backend.copy_to_host(gathered.data(), d_gathered.get(), gathered.size()));
  }
  if (cr != 0) return StepResult{};
  std::vector<StepResult> results;
  for (int32_t k = 0; k < Pt; ++k) {
    DSACP_ASSIGN_OR_RETURN(StepResult r, unpack_rank_result(gathered.data() + k * slot_bytes, s.config, plans[k]));
    results.push_back(std::move(r));
  }
  return cp_assemble_result(s.config, layout, batch.num_tokens, plans, results);
}

}  // namespace dsacp
