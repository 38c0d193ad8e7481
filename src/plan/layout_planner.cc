// The layout search of `dsacp plan`: every layout of G GPUs, its prefill time (TTFT), decode time per token
// (TPOT) and KV bytes per GPU, ranked.
#include <algorithm>
#include <cmath>
#include <string>

#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "dsacp/layout_planner.h"
#include "dsacp/memory_estimate.h"

namespace dsacp {

Result<ModelDims> model_dims(const std::string& name) {
  // DeepSeek-V3.2-Exp: 61 layers, 128 heads, kv_lora_rank 512, rope 64, indexer 64 heads of 128, top-2048.
  if (name == "deepseek-v3.2") return ModelDims{name, 61, 128, 512, 64, 64, 128, 2048};
  // GLM-5 (GlmMoeDsa): 78 layers, 64 heads, kv_lora_rank 512, qk_rope_head_dim 64, index_n_heads 32,
  // index_head_dim 128, index_topk 2048 -- NVIDIA NeMo AutoModel's GlmMoeDsaConfig defaults,
  // https://docs.nvidia.com/nemo/automodel/nemo-automodel/nemo_automodel/components/models/glm_moe_dsa/config
  // (index_head_dim 128 also per https://huggingface.co/tiny-random/glm-5 commit df3b1cc, citing zai-org/GLM-5).
  if (name == "glm-5") return ModelDims{name, 78, 64, 512, 64, 32, 128, 2048};
  return invalid_argument("unknown model \"" + name + "\": expected deepseek-v3.2 or glm-5 (or explicit dims: "
                          "--layers --heads --latent-dim --rope-dim --index-heads --index-dim --topk)");
}

std::string layout_name(const CpLayout& l) {
  std::string s;
  if (l.num_ranks() == 1) return "1 GPU";
  if (l.P > 1) s += "P" + std::to_string(l.P);
  if (l.D > 1) s += std::string(s.empty() ? "" : " ") + "D" + std::to_string(l.D);
  if (l.dsa_cp) s += " dsa-cp";
  s += l.indexer == IndexerMode::kSharded ? " sharded" : " replicated";
  return s;
}

namespace {

constexpr int64_t kDefaultChunk = 8192;
constexpr int kChunkSamples = 4;  // a step's time is close to linear in its context


PagedCacheConfig cache_config(const PlanQuery& q) {
  PagedCacheConfig cc;
  cc.page_size = q.page_size;
  cc.Dl = q.model.Dl;
  cc.Dr = q.model.Dr;
  cc.Di = q.model.Di;
  cc.dtype = DType::kBF16;
  if (q.index_dtype == DType::kF8E4M3) cc.index_dtype = DType::kF8E4M3;
  if (q.kv_fp8) cc.latent_format = LatentFormat::kFp8DsMla;
  return cc;
}

// One layer's KV bytes on a rank holding `pages` pages: the memory estimate's caches for bf16 pools; its rows
// with the FP8 formats' bytes otherwise (the estimate sizes every pool in `dtype`).
uint64_t layer_kv_bytes(const StepConfig& c, const CpLayout& l, PagedCacheConfig cc, int64_t pages) {
  cc.num_pages = pages;
  if (!cc.fp8_latent() && !cc.index_dtype) return cp_memory_estimate(c, l, cc, 0, 1).caches;
  const double slots = static_cast<double>(pages) * cc.page_size;
  const double latent = cc.fp8_latent() ? fp8_ds_mla_record_bytes(cc.Dl, cc.Dr) : (cc.Dl + cc.Dr) * 2.0;
  const double key = cc.index_dtype == DType::kF8E4M3 ? cc.Di + 4.0 : cc.Di * 2.0;
  const double factor = l.indexer == IndexerMode::kReplicated ? l.num_ranks() : 1;
  return static_cast<uint64_t>(slots * (latent + key * factor));
}

std::string fmt(double v, int digits = 3) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

std::string gib(uint64_t bytes) { return fmt(static_cast<double>(bytes) / (1u << 30), 3) + " GiB"; }

// The prompt's prefill on one replica: chunks of `chunk` tokens, each a step with the chunk before as context;
// kChunkSamples chunks evaluated (the first and the last among them), the others interpolated linearly.
Result<double> prefill_ms(const PlannerCalibration& cal, const StepConfig& c, const CpLayout& l, const PlanQuery& q,
                          const StepCostOptions& o, int64_t chunk, StepCost* last) {
  const int64_t n = (q.context + chunk - 1) / chunk;
  std::vector<int64_t> at;
  if (n <= kChunkSamples) {
    for (int64_t i = 0; i < n; ++i) at.push_back(i);
  } else {
    for (int s = 0; s < kChunkSamples; ++s) at.push_back(s * (n - 1) / (kChunkSamples - 1));
  }
  std::vector<double> ms;
  for (int64_t i : at) {
    const int64_t ctx = i * chunk;
    const Request r{static_cast<int32_t>(std::min(chunk, q.context - ctx)), static_cast<int32_t>(ctx)};
    DSACP_ASSIGN_OR_RETURN(StepCost sc, cp_step_cost(cal, c, {r}, l, o));
    ms.push_back(sc.step_ms);
    if (i == n - 1) *last = sc;
  }
  double total = 0;
  for (size_t k = 0; k < at.size(); ++k) {
    total += ms[k];
    if (k + 1 < at.size()) {
      // The chunks strictly between two samples, interpolated.
      const int64_t gap = at[k + 1] - at[k];
      for (int64_t j = 1; j < gap; ++j) total += ms[k] + (ms[k + 1] - ms[k]) * static_cast<double>(j) / gap;
    }
  }
  return total;
}

}  // namespace

Result<PlanAnswer> plan_layouts(const PlanQuery& q, const PlannerCalibration& cal) {
  const ModelDims& m = q.model;
  if (m.layers < 1 || m.H < 1 || m.Dl < 1 || m.Dr < 1 || m.Hi < 1 || m.Di < 1 || m.K < 1) {
    return invalid_argument("model dims must all be >= 1 (layers " + std::to_string(m.layers) + ", heads " +
                            std::to_string(m.H) + ", latent " + std::to_string(m.Dl) + ", rope " + std::to_string(m.Dr) +
                            ", index heads " + std::to_string(m.Hi) + ", index dim " + std::to_string(m.Di) +
                            ", topk " + std::to_string(m.K) + ")");
  }
  if (q.context < 1 || q.context >= (int64_t{1} << 31) - 1) {
    return invalid_argument("context must be in [1, 2^31 - 2] tokens, got " + std::to_string(q.context));
  }
  if (q.batch < 1) return invalid_argument("batch must be >= 1, got " + std::to_string(q.batch));
  if (q.gpus < 1) return invalid_argument("gpus must be >= 1, got " + std::to_string(q.gpus));
  if (q.links.gpus_per_node < 1) return invalid_argument("gpus per node must be >= 1");
  if (static_cast<double>(q.gpus) > static_cast<double>(q.context) * q.batch) {
    return invalid_argument("more ranks than tokens: " + std::to_string(q.gpus) + " GPUs for " +
                            std::to_string(q.batch) + " x " + std::to_string(q.context) +
                            " tokens; expected at most one GPU a token");
  }
  if (q.kv_fp8 && m.Dl % kFp8DsMlaTile != 0) {
    return invalid_argument("fp8_ds_mla KV needs the latent dim to be a multiple of " + std::to_string(kFp8DsMlaTile) +
                            ", got " + std::to_string(m.Dl));
  }
  const double budget_gib = q.memory_per_gpu_gib > 0 ? q.memory_per_gpu_gib : cal.memory_gib;
  const uint64_t budget = static_cast<uint64_t>(budget_gib * static_cast<double>(1u << 30));
  const StepConfig c = plan_step_config(q);
  const PagedCacheConfig cc = cache_config(q);

  std::vector<CpLayout> candidates;
  if (q.fixed) {
    DSACP_RETURN_IF_ERROR(validate_layout(q.fixed_layout, m.H));
    if (q.gpus % q.fixed_layout.num_ranks() != 0) {
      return invalid_argument("layout " + layout_name(q.fixed_layout) + " has " +
                              std::to_string(q.fixed_layout.num_ranks()) + " ranks: expected a divisor of the " +
                              std::to_string(q.gpus) + " GPUs");
    }
    candidates.push_back(q.fixed_layout);
  }
  for (int32_t Pt = 1; Pt <= q.gpus && !q.fixed; ++Pt) {
    if (q.gpus % Pt != 0) continue;
    for (int32_t P = 1; P <= Pt; ++P) {
      if (Pt % P != 0) continue;
      const int32_t D = Pt / P;
      for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
        CpLayout l;
        l.P = P;
        l.D = D;
        l.indexer = mode;
        if (Pt == 1 && mode == IndexerMode::kReplicated) continue;  // one GPU: the indexer mode is moot
        if (m.H % D == 0) candidates.push_back(l);
        if (P == 1 && D > 1) {
          l.dsa_cp = true;
          candidates.push_back(l);
        }
      }
    }
  }

  PlanAnswer answer;
  answer.layouts_considered = static_cast<int64_t>(candidates.size());
  StepCostOptions o;
  o.cache = cc;
  o.links = q.links;
  o.all_ranks_up_to = 2;  // the first and the last rank beyond (their shares differ only there)
  o.light_prefill_plans = true;
  uint64_t smallest_need = UINT64_MAX;
  std::string smallest_need_name;
  for (const CpLayout& l : candidates) {
    LayoutChoice ch;
    ch.layout = l;
    ch.name = layout_name(l);
    const int32_t Pt = l.num_ranks();
    // The prompt's chunks: given, or kDefaultChunk tokens a PCP rank a step; under DSA-CP (every rank scores every
    // token of the step) kDefaultChunk a rank up to 8 x kDefaultChunk a step.
    const int64_t chunk = q.prefill_chunk > 0 ? q.prefill_chunk
                                              : kDefaultChunk * (l.dsa_cp ? std::min(l.D, 8) : l.P);
    ch.replicas = q.gpus / Pt;
    ch.batch_per_replica = static_cast<int32_t>((q.batch + ch.replicas - 1) / ch.replicas);
    auto refuse = [&](const std::string& why) {
      ch.feasible = false;
      ch.refused = why;
      answer.layouts.push_back(ch);
    };
    if (Pt > q.context) {
      refuse("more ranks (" + std::to_string(Pt) + ") than the prompt's " + std::to_string(q.context) + " tokens");
      continue;
    }
    if (c.index_input_dtype() == DType::kF8E4M3 && l.indexer == IndexerMode::kSharded && !l.dsa_cp && Pt > 1) {
      refuse("the sharded indexer's prefill rows need bf16 indexer keys (FP8: replicated or dsa-cp)");
      continue;
    }
    // KV: every layer's cache at the full context (+1 decoded token) for the replica's requests.
    const KvSharding s{Pt, l.interleave == 0 ? q.page_size : l.interleave};
    const int64_t pages = s.pages_needed(q.context + 1, q.page_size) * ch.batch_per_replica;
    ch.kv_bytes_per_gpu = layer_kv_bytes(c, l, cc, pages) * static_cast<uint64_t>(m.layers);
    // Step buffers: the larger of a prefill chunk's and the decode step's (one layer's; reused by every layer).
    const int64_t rows_prefill = l.dsa_cp ? (std::min(chunk, q.context) + Pt - 1) / Pt
                                          : (std::min(chunk, q.context) + 2 * l.P - 1) / (2 * l.P) * 2;
    const int64_t rows = std::max<int64_t>(rows_prefill, ch.batch_per_replica);
    PagedCacheConfig one = cc;
    one.num_pages = 0;
    ch.memory_per_gpu = ch.kv_bytes_per_gpu + cp_memory_estimate(c, l, one, rows, 1).step;
    if (ch.memory_per_gpu < smallest_need) {
      smallest_need = ch.memory_per_gpu;
      smallest_need_name = ch.name;
    }
    if (ch.memory_per_gpu > budget) {
      refuse("needs " + gib(ch.memory_per_gpu) + " a GPU (KV " + gib(ch.kv_bytes_per_gpu) + "), " + fmt(budget_gib) +
             " GiB available");
      continue;
    }
    Result<double> ttft = prefill_ms(cal, c, l, q, o, chunk, &ch.last_prefill_step);
    if (!ttft.ok()) {
      refuse(ttft.status().message());
      continue;
    }
    ch.ttft_ms = *ttft * m.layers;
    const std::vector<Request> decodes(static_cast<size_t>(ch.batch_per_replica),
                                       Request{1, static_cast<int32_t>(q.context)});
    Result<StepCost> dec = cp_step_cost(cal, c, decodes, l, o);
    if (!dec.ok()) {
      refuse(dec.status().message());
      continue;
    }
    ch.decode_step = *dec;
    ch.tpot_ms = dec->step_ms * m.layers;
    answer.layouts.push_back(ch);
  }

  // Rank: a request's time to its last token, TTFT + decode_tokens x TPOT; ties by KV a GPU.
  const double n_out = q.decode_tokens;
  auto score = [&](const LayoutChoice& a) { return a.ttft_ms + n_out * a.tpot_ms; };
  std::stable_sort(answer.layouts.begin(), answer.layouts.end(), [&](const LayoutChoice& a, const LayoutChoice& b) {
    if (a.feasible != b.feasible) return a.feasible;
    if (!a.feasible) return false;
    if (score(a) != score(b)) return score(a) < score(b);
    return a.kv_bytes_per_gpu < b.kv_bytes_per_gpu;
  });
  if (answer.layouts.empty() || !answer.layouts[0].feasible) {
    if (smallest_need != UINT64_MAX && smallest_need > budget) {
      return resource_exhausted("memory too small: the smallest layout (" + smallest_need_name + ") needs " +
                                gib(smallest_need) + " a GPU, " + fmt(budget_gib) +
                                " GiB available (--memory-per-gpu)");
    }
    std::string why = answer.layouts.empty() ? "no layout" : answer.layouts[0].refused;
    return invalid_argument("no feasible layout for " + std::to_string(q.gpus) + " GPUs: " + why);
  }
  answer.chosen = 0;
  const LayoutChoice& best = answer.layouts[0];
  for (size_t i = 1; i < answer.layouts.size(); ++i) {
    LayoutChoice& a = answer.layouts[i];
    if (!a.feasible) {
      a.loses = "refused: " + a.refused;
      continue;
    }
    std::string why = fmt(score(a) / score(best)) + "x the time to the last of " + fmt(n_out, 6) + " tokens (TTFT " +
                      fmt(a.ttft_ms / best.ttft_ms) + "x, TPOT " + fmt(a.tpot_ms / best.tpot_ms) + "x";
    if (a.kv_bytes_per_gpu != best.kv_bytes_per_gpu) {
      why += ", KV " + fmt(static_cast<double>(a.kv_bytes_per_gpu) / static_cast<double>(best.kv_bytes_per_gpu)) + "x";
    }
    why += ")";
    a.loses = why;
  }
  return answer;
}

StepConfig plan_step_config(const PlanQuery& q) {
  StepConfig c = step_config_of(q.model.dims(), q.model.K, 1.f, DType::kBF16, DType::kBF16);
  if (q.index_dtype == DType::kF8E4M3) c.index_dtype = DType::kF8E4M3;
  return c;
}

}  // namespace dsacp
