// The CUDA backend's kernel calls, one per family: validate what the backend supports, plan, launch (run_kernel),
// finish (checked or deferred). The launchers and the dispatch rules live in each family's folder.
#include "kernels/cuda/cuda_backend_impl.h"

namespace dsacp::cuda {

Result<std::shared_ptr<const KernelPlan>> CudaBackend::plan_indexer_topk(const IndexerTopkParams& p) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (capturing_) return refuse_in_capture("plan_indexer_topk");
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (p.host_request == nullptr || p.host_key_len == nullptr) {
    return invalid_argument("plan_indexer_topk: host_request and host_key_len are required (the plan is made on the host)");
  }
  auto kp = std::make_shared<CudaIndexerPlan>();
  kp->num_tokens = p.rows.num_tokens;
  DSACP_ASSIGN_OR_RETURN(kp->plan, cuda::indexer_plan(p, p.host_request, p.host_key_len));
  const cuda::IndexerPlan& plan = kp->plan;
  kp->workspace_bytes = std::max<size_t>(1, static_cast<size_t>(plan.max_score_floats)) * sizeof(float);
  if (cuda::inline_plan_fits(plan, p.rows.num_tokens) && options_.indexer_inline_plan) {
    kp->dev.inl = cuda::make_inline_plan(plan);
    return std::shared_ptr<const KernelPlan>(std::move(kp));
  }
  // [groups | offsets] uploaded into the plan's own buffer, the items expanded into its own (once).
  const size_t groups_bytes = plan.groups.size() * sizeof(cuda::ScoreGroup);
  const size_t offsets_at = (groups_bytes + 255) / 256 * 256;
  const size_t plan_bytes = offsets_at + plan.score_offset.size() * sizeof(int64_t);
  std::vector<char> host(std::max<size_t>(plan_bytes, 1));
  if (groups_bytes > 0) std::memcpy(host.data(), plan.groups.data(), groups_bytes);
  if (plan_bytes > offsets_at) std::memcpy(host.data() + offsets_at, plan.score_offset.data(), plan_bytes - offsets_at);
  DSACP_ASSIGN_OR_RETURN(kp->upload, allocate(host.size()));
  DSACP_ASSIGN_OR_RETURN(kp->items, allocate(std::max<int64_t>(1, plan.num_items) * sizeof(cuda::ScoreItem)));
  DSACP_RETURN_IF_ERROR(copy_to_device(kp->upload.get(), host.data(), plan_bytes));
  DSACP_RETURN_IF_ERROR(cuda::launch_expand_score_items(static_cast<const cuda::ScoreGroup*>(kp->upload.get()),
                                                        static_cast<int64_t>(plan.groups.size()),
                                                        kp->items.as<cuda::ScoreItem>(), plan.num_items, ctx(nullptr)));
  DSACP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(lane().stream));  // (host is freed on return)
  kp->dev.items = kp->items.as<const cuda::ScoreItem>();
  kp->dev.score_offset = reinterpret_cast<const int64_t*>(kp->upload.as<const char>() + offsets_at);
  return std::shared_ptr<const KernelPlan>(std::move(kp));
}

size_t CudaBackend::sparse_mla_workspace_bytes(const SparseMlaParams& p) const {
  LaunchContext c;
  c.num_sms = num_sms_;
  c.options = options_;
  const int splits = cuda::sparse_mla_num_splits(p, c);
  return static_cast<size_t>(std::max<int64_t>(0, cuda::sparse_mla_workspace_floats(p, splits, options_))) * sizeof(float);
}

Status CudaBackend::cache_write(const CacheWriteParams& p) {
  if (p.upload.bytes > 0 && !cuda::cache_write_carries_upload(p)) {
    DSACP_RETURN_IF_ERROR(copy_to_device(p.upload.device, p.upload.host, p.upload.bytes));
    CacheWriteParams rest = p;
    rest.upload = {};
    return cache_write(rest);
  }
  return run_kernel("cache_write", [&](const LaunchContext& c) { return cuda::launch_cache_write(p, c); });
}

Status CudaBackend::indexer_topk(const IndexerTopkParams& p) {
  TraceScope trace(trace_, "indexer_topk");
  std::lock_guard<std::recursive_mutex> lock(mu_);
  DSACP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  DSACP_RETURN_IF_ERROR(cuda::indexer_topk_supported(p));
  DSACP_RETURN_IF_ERROR(cuda::indexer_topk_merge_supported(p));
  const int64_t T = p.rows.num_tokens;
  if (p.plan != nullptr) {
    // Planned once for these rows (plan_indexer_topk): launches only.
    const auto* kp = dynamic_cast<const CudaIndexerPlan*>(p.plan);
    if (kp == nullptr || kp->num_tokens != T) {
      return invalid_argument("indexer_topk: IndexerTopkParams::plan is not this backend's plan of these " +
                              std::to_string(T) + " rows");
    }
    if (p.workspace == nullptr) return invalid_argument("indexer_topk: a planned call needs IndexerTopkParams::workspace");
    cuda::IndexerPlanDevice dev = kp->dev;
    dev.scores = static_cast<float*>(p.workspace);
    DSACP_RETURN_IF_ERROR(cuda::launch_indexer_topk(p, kp->plan, dev, ctx("indexer_topk")));
    return finish("indexer_topk");
  }
  std::vector<int32_t> request, key_len;
  const int32_t* h_request = p.host_request;
  const int32_t* h_key_len = p.host_key_len;
  cuda::IndexerPlan plan;
  Lane& ln = lane();
  cuda::IndexerPlanDevice dev;
  {
    TraceScope plan_trace(trace_, "indexer_topk: plan + upload");
    if (h_request == nullptr || h_key_len == nullptr) {
      // No host copies given: read the rows back (waits for the work queued before this call).
      TraceScope t1(trace_, "indexer_topk: rows to host");
      request.resize(static_cast<size_t>(T));
      key_len.resize(static_cast<size_t>(T));
      DSACP_RETURN_IF_ERROR(copy_to_host(request.data(), p.rows.request, T * sizeof(int32_t)));
      DSACP_RETURN_IF_ERROR(copy_to_host(key_len.data(), p.rows.key_len, T * sizeof(int32_t)));
      h_request = request.data();
      h_key_len = key_len.data();
    }
    {
      TraceScope t2(trace_, "indexer_topk: host plan");
      DSACP_ASSIGN_OR_RETURN(plan, cuda::indexer_plan(p, h_request, h_key_len));
    }
    DSACP_RETURN_IF_ERROR(ln.scores.reserve(std::max<size_t>(1, plan.max_score_floats) * sizeof(float)));
    // A small plan (a decode batch) goes in the kernels' parameters: no upload, no expansion launch
    // (CudaBackendOptions::indexer_inline_plan off: always the device plan, an A/B switch).
    if (cuda::inline_plan_fits(plan, T) && options_.indexer_inline_plan) {
      dev.inl = cuda::make_inline_plan(plan);
    } else {
      TraceScope t3(trace_, "indexer_topk: plan upload");
      DSACP_RETURN_IF_ERROR(ln.plan_items.reserve(std::max<int64_t>(1, plan.num_items) * sizeof(cuda::ScoreItem)));
      // The groups and the score offsets go up in one copy (one pinned-ring slot, one DMA): [groups | offsets].
      const size_t groups_bytes = plan.groups.size() * sizeof(cuda::ScoreGroup);
      const size_t offsets_at = (groups_bytes + 255) / 256 * 256;
      const size_t plan_bytes = offsets_at + plan.score_offset.size() * sizeof(int64_t);
      DSACP_RETURN_IF_ERROR(ln.plan_upload.reserve(std::max<size_t>(1, plan_bytes)));
      ln.plan_host.resize(plan_bytes);
      if (groups_bytes > 0) std::memcpy(ln.plan_host.data(), plan.groups.data(), groups_bytes);
      if (plan_bytes > offsets_at) {
        std::memcpy(ln.plan_host.data() + offsets_at, plan.score_offset.data(), plan_bytes - offsets_at);
      }
      DSACP_RETURN_IF_ERROR(copy_to_device(ln.plan_upload.ptr, ln.plan_host.data(), plan_bytes));
      const auto* d_groups = static_cast<const cuda::ScoreGroup*>(ln.plan_upload.ptr);
      dev.score_offset = reinterpret_cast<const int64_t*>(static_cast<const char*>(ln.plan_upload.ptr) + offsets_at);
      DSACP_RETURN_IF_ERROR(cuda::launch_expand_score_items(d_groups,
                                                            static_cast<int64_t>(plan.groups.size()),
                                                            static_cast<cuda::ScoreItem*>(ln.plan_items.ptr),
                                                            plan.num_items, ctx(nullptr)));
      dev.items = static_cast<const cuda::ScoreItem*>(ln.plan_items.ptr);
    }
  }
  dev.scores = static_cast<float*>(ln.scores.ptr);
  const cuda::timeline::Span span = cuda::timeline::open(device_, ln.stream);
  DSACP_RETURN_IF_ERROR(cuda::launch_indexer_topk(p, plan, dev, ctx("indexer_topk")));
  cuda::timeline::close(device_, span, ln.stream, "indexer_topk", "kernel");
  return finish("indexer_topk");
}

Status CudaBackend::sparse_mla(const SparseMlaParams& p) {
  return run_kernel("sparse_mla", [&](const LaunchContext& c) -> Status {
    DSACP_RETURN_IF_ERROR(cuda::sparse_mla_supported(p, options_));
    if (cuda::sparse_mla_fp8_via_bf16(p)) {  // a prefill over fp8_ds_mla: dequantized pages, bf16 kernels
      Scratch& kv = lane().fp8_kv;
      DSACP_RETURN_IF_ERROR(kv.reserve(static_cast<size_t>(cuda::sparse_mla_fp8_scratch_bytes(p))));
      DSACP_RETURN_IF_ERROR(cuda::launch_fp8_records_to_bf16(p, kv.ptr, c));
      return launch_mla(cuda::sparse_mla_fp8_bf16_view(p, kv.ptr), c);
    }
    return launch_mla(p, c);
  });
}

Status CudaBackend::launch_mla(const SparseMlaParams& p, const LaunchContext& c) {
  const int splits = cuda::sparse_mla_num_splits(p, c);
  if (p.workspace != nullptr) return cuda::launch_sparse_mla(p, splits, static_cast<float*>(p.workspace), c);
  const int64_t ws = cuda::sparse_mla_workspace_floats(p, splits, options_);
  Scratch& mla_ws = lane().mla_ws;
  if (ws > 0) DSACP_RETURN_IF_ERROR(mla_ws.reserve(static_cast<size_t>(ws) * sizeof(float)));
  return cuda::launch_sparse_mla(p, splits, static_cast<float*>(mla_ws.ptr), c);
}

Status CudaBackend::check_sparse_mla(const SparseMlaParams& p) const {
  SparseMlaParams plain = p;
  plain.peer = {};
  DSACP_RETURN_IF_ERROR(Backend::check_sparse_mla(plain));
  return cuda::sparse_mla_supported(p, options_);
}

Status CudaBackend::gather_rows(const GatherRowsParams& p) {
  return run_kernel("gather_rows", [&](const LaunchContext& c) { return cuda::launch_gather_rows(p, c); });
}

Status CudaBackend::topk_remap(const TopkRemapParams& p) {
  return run_kernel("topk_remap", [&](const LaunchContext& c) { return cuda::launch_topk_remap(p, c); });
}

Status CudaBackend::topk_merge(const TopkMergeParams& p) {
  if (cuda::topk_merge_on_device(p)) {
    return run_kernel("topk_merge", [&](const LaunchContext& c) { return cuda::launch_topk_merge(p, c); });
  }
  if (p.wait.active()) {
    return unsupported("topk_merge: a window exchange's parts (WindowRowSync) of a shape the device merge does not "
                       "take (" + std::to_string(p.num_parts) + " parts of K = " + std::to_string(p.K) + ")");
  }
  TraceScope trace(trace_, "topk_merge (host)");
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const size_t parts = static_cast<size_t>(p.num_parts) * p.num_rows * p.K;
  std::vector<int32_t> part_topk(parts), topk(static_cast<size_t>(p.num_rows) * p.K);
  std::vector<float> part_scores(parts);
  const size_t part_rows = static_cast<size_t>(p.num_rows) * p.K;  // one part's entries
  for (int32_t s = 0; s < p.num_parts; ++s) {
    DSACP_RETURN_IF_ERROR(copy_to_host(part_topk.data() + s * part_rows, topk_merge_part_topk(p, s),
                                       part_rows * sizeof(int32_t)));
    DSACP_RETURN_IF_ERROR(copy_to_host(part_scores.data() + s * part_rows, topk_merge_part_scores(p, s),
                                       part_rows * sizeof(float)));
  }
  std::vector<int32_t> local(p.local_topk != nullptr ? topk.size() : 0);
  TopkMergeParams h = p;
  h.part_topk = part_topk.data();
  h.part_scores = part_scores.data();
  h.topk = topk.data();
  h.local_topk = p.local_topk != nullptr ? local.data() : nullptr;
  DSACP_RETURN_IF_ERROR(cpu::topk_merge(h, 0));
  if (p.local_topk != nullptr) {
    DSACP_RETURN_IF_ERROR(copy_to_device(p.local_topk, local.data(), local.size() * sizeof(int32_t)));
  }
  return copy_to_device(p.topk, topk.data(), topk.size() * sizeof(int32_t));
}

Status CudaBackend::topk_input(const TopkInputParams& p) {
  return run_kernel("precomputed top-k", [&](const LaunchContext& c) { return cuda::launch_topk_input(p, c); });
}

Status CudaBackend::output_form(const OutputFormParams& p) {
  return run_kernel("output form", [&](const LaunchContext& c) { return cuda::launch_output_form(p, c); });
}

Status CudaBackend::lse_merge(const LseMergeParams& p) {
  return run_kernel("lse_merge", [&](const LaunchContext& c) { return cuda::launch_lse_merge(p, p.out, p.out_dtype, c); });
}

}  // namespace dsacp::cuda
