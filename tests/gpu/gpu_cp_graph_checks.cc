// A CP rank's planned step captured into a CUDA graph over NCCL (CpStepPlanOptions::enqueue_only): D = 2, one
// rank a GPU, b = 8 decode at 4K context with DeepSeek-V3.2 dims (sharded and replicated indexer, and DSA-CP).
// Each rank runs 4 layers eagerly under a default plan, then captures the same 4 layers under an enqueue-only
// plan (both ranks capture at once: their collectives are recorded into each rank's graph) and replays the
// graph 20 times: the replays' top-k, out and lse equal the eager ones bit for bit. Needs 2 GPUs and NCCL.
#include "gpu/gpu_cp_graph_checks.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/cp_step_plan.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/step.h"

namespace dsacp::testing {
namespace {

constexpr int kLayers = 4, kReplays = 20;

// A device copy of a host tensor (a rank's rows of a step input: select_rows / select_rows_heads).
Result<DeviceBuffer> upload_rows(Backend& be, Result<Tensor> rows) {
  DSACP_RETURN_IF_ERROR(rows.status());
  DSACP_ASSIGN_OR_RETURN(DeviceBuffer b, be.allocate(std::max<size_t>(rows->nbytes(), 4)));
  if (rows->nbytes() > 0) DSACP_RETURN_IF_ERROR(be.copy_to_device(b.get(), rows->data(), rows->nbytes()));
  return b;
}

struct RankBuffers {
  DeviceBuffer q_nope, q_rope, kv, kr, iq, iw, ik;
  DeviceBuffer topk[2], out[2], lse[2];
  StepInputs in() const {
    return {q_nope.get(), q_rope.get(), kv.get(), kr.get(), iq.get(), iw.as<const float>(), ik.get()};
  }
  StepOutputs outs(int k) const { return {topk[k].as<int32_t>(), out[k].get(), lse[k].as<float>()}; }
};

std::vector<char> download(Backend& be, const RankBuffers& b, int k) {
  std::vector<char> all;
  for (const DeviceBuffer* d : {&b.topk[k], &b.out[k], &b.lse[k]}) {
    std::vector<char> h(d->bytes());
    if (!be.copy_to_host(h.data(), d->get(), h.size()).ok()) return {};
    all.insert(all.end(), h.begin(), h.end());
  }
  return all;
}

// One rank: eager layers, then the captured ones replayed; `detail` says what went wrong.
Status run_rank(const CaseFile& c, const StepConfig& config, const CpLayout& layout, const CpRankPlan& rank_plan,
                const BlockTable& table, const PagedCacheConfig& per_rank, const NcclId& id, int32_t cr, bool* equal) {
  DSACP_ASSIGN_OR_RETURN(std::unique_ptr<Backend> be, make_cuda_backend(cr));
  NcclOptions o;
  o.device = cr;
  o.producer_stream = be->native_stream();
  DSACP_ASSIGN_OR_RETURN(OwnedCpComms comms, nccl_cp_comms(id, layout, cr, o));
  const KvSharding sharding = cp_kv_sharding(layout, per_rank.page_size);
  const PagedCacheConfig cc = cp_rank_cache_config(layout, per_rank);
  DSACP_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::create(*be, cc));
  DSACP_RETURN_IF_ERROR(cp_load_context_rank(*be, layout, sharding, cr, c.requests, table, c.ctx_kv_latent,
                                             c.ctx_k_rope, c.ctx_idx_k, cache));
  const std::vector<int64_t>& tok = rank_plan.row_token;
  const int64_t h0 = rank_plan.head_begin, nh = rank_plan.num_heads;
  RankBuffers b;
  DSACP_ASSIGN_OR_RETURN(b.q_nope, upload_rows(*be, select_rows_heads(c.q_nope, tok, h0, nh)));
  DSACP_ASSIGN_OR_RETURN(b.q_rope, upload_rows(*be, select_rows_heads(c.q_rope, tok, h0, nh)));
  DSACP_ASSIGN_OR_RETURN(b.kv, upload_rows(*be, select_rows(c.kv_latent, tok)));
  DSACP_ASSIGN_OR_RETURN(b.kr, upload_rows(*be, select_rows(c.k_rope, tok)));
  DSACP_ASSIGN_OR_RETURN(b.iq, upload_rows(*be, select_rows(c.idx_q, tok)));
  DSACP_ASSIGN_OR_RETURN(b.iw, upload_rows(*be, select_rows(c.idx_w, tok)));
  DSACP_ASSIGN_OR_RETURN(b.ik, upload_rows(*be, select_rows(c.idx_k, tok)));
  const int64_t rows = rank_plan.output_rows;
  for (int k = 0; k < 2; ++k) {
    DSACP_ASSIGN_OR_RETURN(b.topk[k], be->allocate(std::max<int64_t>(rows * config.K * 4, 4)));
    DSACP_ASSIGN_OR_RETURN(b.out[k], be->allocate(std::max<int64_t>(rows * nh * config.Dl * dtype_size(config.out_dtype), 4)));
    DSACP_ASSIGN_OR_RETURN(b.lse[k], be->allocate(std::max<int64_t>(rows * nh * 4, 4)));
  }
  DSACP_ASSIGN_OR_RETURN(CpStepPlan eager_plan,
                         cp_step_plan(*be, config, c.requests, rank_plan, layout, sharding, table, cc));
  CpStepPlanOptions po;
  po.enqueue_only = true;
  DSACP_ASSIGN_OR_RETURN(CpStepPlan graph_plan,
                         cp_step_plan(*be, config, c.requests, rank_plan, layout, sharding, table, cc, po));
  const CpComms view = comms.view();
  // Eager: the layers (each rewrites the same new tokens' rows: the same results every layer).
  for (int l = 0; l < kLayers; ++l) DSACP_RETURN_IF_ERROR(cp_step_run(*be, view, eager_plan, cache, b.in(), b.outs(0)));
  DSACP_RETURN_IF_ERROR(be->synchronize());
  const std::vector<char> eager = download(*be, b, 0);
  // One eager run of the enqueue-only plan takes its buffers (a capture allocates nothing), then the capture.
  DSACP_RETURN_IF_ERROR(cp_step_run(*be, view, graph_plan, cache, b.in(), b.outs(1)));
  DSACP_RETURN_IF_ERROR(be->synchronize());
  DSACP_RETURN_IF_ERROR(be->fill(b.out[1].get(), config.out_dtype, static_cast<int64_t>(b.out[1].bytes() / dtype_size(config.out_dtype)), 0.f));
  DSACP_RETURN_IF_ERROR(be->fill(b.lse[1].get(), DType::kF32, static_cast<int64_t>(b.lse[1].bytes() / 4), 0.f));
  DSACP_RETURN_IF_ERROR(be->synchronize());
  DSACP_RETURN_IF_ERROR(be->begin_capture());
  Status st;
  for (int l = 0; l < kLayers && st.ok(); ++l) st = cp_step_run(*be, view, graph_plan, cache, b.in(), b.outs(1));
  Result<CapturedWork> graph = be->end_capture();
  DSACP_RETURN_IF_ERROR(st.with_context("capture"));
  DSACP_RETURN_IF_ERROR(graph.status().with_context("end_capture"));
  for (int i = 0; i < kReplays; ++i) DSACP_RETURN_IF_ERROR(be->replay(*graph));
  DSACP_RETURN_IF_ERROR(be->synchronize().with_context("replays"));
  *equal = !eager.empty() && download(*be, b, 1) == eager;
  return Status();
}

void check_layout(const char* name, const CpLayout& layout, CheckLog& log) {
  CaseGenSpec spec;
  spec.dims = kDeepSeekV32Dims;
  spec.topk = kDeepSeekV32TopK;
  spec.scale = 0.0723f;
  spec.dtype = DType::kBF16;
  spec.seed = 31;
  spec.requests.assign(8, Request{1, 4095});
  const std::string tag = std::string("CP graph ") + name + " (b=8 decode, 4K, H=128 K=2048 bf16, 2 GPUs NCCL): ";
  auto c = case_generate(spec);
  if (!c.ok()) {
    log.report(false, tag + "case", c.status().to_string());
    return;
  }
  const StepConfig config = step_config_of(c->dims, c->topk, c->scale, DType::kBF16);
  const int32_t page = 64;
  const KvSharding sharding = cp_kv_sharding(layout, page);
  int32_t pages = 1;
  for (const Request& r : c->requests) pages = std::max<int32_t>(pages, static_cast<int32_t>(sharding.pages_needed(r.seq_len(), page)));
  BlockTable table;
  table.num_requests = 8;
  table.max_pages = pages;
  for (int32_t i = 0; i < 8 * pages; ++i) table.data.push_back(i);
  const PagedCacheConfig per_rank{int64_t{8} * pages, page, config.Dl, config.Dr, config.Di, DType::kBF16};
  auto plans = cp_all_rank_plans(config, c->requests, layout, table, page);
  auto id = nccl_make_id();
  if (!plans.ok() || !id.ok()) {
    log.report(false, tag + "plans / NCCL id", (!plans.ok() ? plans.status() : id.status()).to_string());
    return;
  }
  Status st[2];
  bool equal[2] = {false, false};
  std::vector<std::thread> ranks;
  for (int32_t cr = 0; cr < 2; ++cr) {
    ranks.emplace_back([&, cr] {
      st[cr] = run_rank(*c, config, layout, (*plans)[cr], table, per_rank, *id, cr, &equal[cr]);
    });
  }
  for (auto& t : ranks) t.join();
  for (int32_t cr = 0; cr < 2; ++cr) {
    log.report(st[cr].ok() && equal[cr],
               tag + "rank " + std::to_string(cr) + ": " + std::to_string(kLayers) + " layers captured, " +
                   std::to_string(kReplays) + " replays == eager, bit for bit",
               st[cr].ok() ? (equal[cr] ? "" : "outputs differ") : st[cr].to_string());
  }
}

}  // namespace

void gpu_cp_graph_checks(CheckLog& log) {
  auto n = cuda_device_count();
  if (!n.ok() || *n < 2 || !nccl_available()) {
    std::printf("SKIP CP graph checks: they need 2 GPUs and NCCL (%d GPU(s), %s)\n", n.ok() ? *n : 0,
                nccl_version().c_str());
    return;
  }
  auto layout = [](IndexerMode mode, bool dsa_cp) {
    CpLayout l;
    l.P = 1;
    l.D = 2;
    l.indexer = mode;
    l.dsa_cp = dsa_cp;
    return l;
  };
  check_layout("D2 sharded", layout(IndexerMode::kSharded, false), log);
  check_layout("D2 replicated", layout(IndexerMode::kReplicated, false), log);
  check_layout("D2 DSA-CP", layout(IndexerMode::kSharded, true), log);
}

}  // namespace dsacp::testing
