#include "dsacp/replay.h"

#include <algorithm>
#include <string>
#include <vector>

#include "dsacp/paged_cache.h"
#include "dsacp/step.h"

namespace dsacp {

DType case_compute_dtype(const CaseFile& c) {
  for (const Tensor* t : {&c.q_nope, &c.q_rope, &c.kv_latent, &c.k_rope, &c.idx_q, &c.idx_k, &c.ctx_kv_latent,
                          &c.ctx_k_rope, &c.ctx_idx_k}) {
    if (t->dtype() != DType::kBF16) return DType::kF32;
  }
  return DType::kBF16;
}

Result<StepResult> replay_case(Backend& backend, const CaseFile& c, const ReplayOptions& options) {
  if (options.page_size < 1) return invalid_argument("page_size must be >= 1, got " + std::to_string(options.page_size));
  if (options.spare_pages < 0) return invalid_argument("spare_pages must be >= 0");
  const DType dtype = case_compute_dtype(c);
  DSACP_RETURN_IF_ERROR(batch_layout(c.requests).status());

  PagedCacheConfig cc;
  cc.page_size = options.page_size;
  cc.Dl = c.dims.Dl;
  cc.Dr = c.dims.Dr;
  cc.Di = c.dims.Di;
  cc.dtype = dtype;
  const KvSharding sharding{std::max(options.layout.num_ranks(), 1),
                            options.layout.interleave == 0 ? options.page_size : options.layout.interleave};
  cc.num_pages = options.spare_pages;
  for (const Request& r : c.requests) cc.num_pages += sharding.pages_needed(r.seq_len(), cc.page_size);
  DSACP_ASSIGN_OR_RETURN(std::unique_ptr<LocalCpCluster> cluster, LocalCpCluster::create(backend, options.layout, cc));

  // One block table shared by every rank: pages for the largest share (rank 0's), in a shuffled order.
  PageAllocator allocator(cc.num_pages, options.page_shuffle_seed);
  std::vector<SequencePages> seqs(c.requests.size());
  std::vector<const SequencePages*> seq_ptrs;
  for (size_t b = 0; b < c.requests.size(); ++b) {
    DSACP_RETURN_IF_ERROR(seqs[b].reserve(allocator, sharding.local_len(c.requests[b].seq_len(), 0), cc.page_size));
    seq_ptrs.push_back(&seqs[b]);
  }
  const BlockTable table = BlockTable::from_sequences(seq_ptrs);

  // Inputs converted (losslessly) to the compute dtype.
  auto conv = [&](const Tensor& t) { return t.to_dtype(dtype); };
  DSACP_ASSIGN_OR_RETURN(Tensor ctx_latent, conv(c.ctx_kv_latent));
  DSACP_ASSIGN_OR_RETURN(Tensor ctx_rope, conv(c.ctx_k_rope));
  DSACP_ASSIGN_OR_RETURN(Tensor ctx_idx_k, conv(c.ctx_idx_k));
  DSACP_RETURN_IF_ERROR(cluster->load_context(c.requests, table, ctx_latent, ctx_rope, ctx_idx_k));

  DSACP_ASSIGN_OR_RETURN(Tensor q_nope, conv(c.q_nope));
  DSACP_ASSIGN_OR_RETURN(Tensor q_rope, conv(c.q_rope));
  DSACP_ASSIGN_OR_RETURN(Tensor kv_latent, conv(c.kv_latent));
  DSACP_ASSIGN_OR_RETURN(Tensor k_rope, conv(c.k_rope));
  DSACP_ASSIGN_OR_RETURN(Tensor idx_q, conv(c.idx_q));
  DSACP_ASSIGN_OR_RETURN(Tensor idx_k, conv(c.idx_k));

  StepConfig config;
  config.H = c.dims.H;
  config.Dl = c.dims.Dl;
  config.Dr = c.dims.Dr;
  config.Hi = c.dims.Hi;
  config.Di = c.dims.Di;
  config.K = c.topk;
  config.scale = c.scale;
  config.act_dtype = dtype;
  config.out_dtype = options.out_dtype;
  HostStepInputs in{&q_nope, &q_rope, &kv_latent, &k_rope, &idx_q, &c.idx_w, &idx_k};
  return cluster->step(config, c.requests, table, in);
}

}  // namespace dsacp
