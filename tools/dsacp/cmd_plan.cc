// dsacp plan: the layout for a model, a context and a cluster, from the calibrated cost model
// (dsacp/layout_planner.h, docs/planner.md); with --step, one step's predicted cost (scripts/plan_validate.py).
#include <chrono>
#include <ctime>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "core/json.h"
#include "default_calibration.h"
#include "dsacp/layout_planner.h"


namespace dsacp::cli {
namespace {

CommandSpec plan_spec() {
  CommandSpec s;
  s.name = "plan";
  s.usage = "dsacp plan --model deepseek-v3.2|glm-5 --context N --gpus G [options]";
  s.summary =
      "Ranks every context-parallel layout of G GPUs (P x D dividing G, the rest data-parallel replicas) by a\n"
      "request's time to its last token (TTFT + decode-tokens x TPOT), from kernel and link costs fitted to this\n"
      "project's benchmarks (calibration/h200.json); prints the chosen layout, TTFT, TPOT and KV a GPU, and why\n"
      "each other layout loses. With --step, prints one step's predicted cost instead (--pcp/--dcp/... its layout).";
  s.options = {
      {"--model", "NAME", "deepseek-v3.2 or glm-5 (or explicit dims: --layers --heads --latent-dim --rope-dim "
                          "--index-heads --index-dim --topk, which also override a model's)", ""},
      {"--layers", "N", "DSA layers", ""},
      {"--heads", "H", "attention heads", ""},
      {"--latent-dim", "Dl", "latent dim", ""},
      {"--rope-dim", "Dr", "rope dim", ""},
      {"--index-heads", "Hi", "indexer heads", ""},
      {"--index-dim", "Di", "indexer dim", ""},
      {"--topk", "K", "top-k", ""},
      {"--context", "N", "prompt tokens (decodes see this context)", ""},
      {"--batch", "B", "requests decoding together (split over data-parallel replicas)", "1"},
      {"--gpus", "G", "GPUs", "8"},
      {"--gpus-per-node", "N", "GPUs a node (NVLink inside; groups spanning nodes use the inter-node link)", "8"},
      {"--inter-node-gbs", "X", "inter-node bandwidth a GPU, GB/s (400 Gb/s InfiniBand = 50)", "50"},
      {"--inter-node-latency-us", "X", "inter-node latency a collective, us", "5"},
      {"--kv-dtype", "bf16|fp8_ds_mla", "KV cache format", "bf16"},
      {"--index-dtype", "bf16|fp8", "indexer queries and keys", "bf16"},
      {"--memory-per-gpu", "GiB", "memory a GPU for the KV cache and the step's buffers", "the calibration's"},
      {"--prefill-chunk", "N", "prompt tokens a prefill step (each chunk a step with the chunks before as context)",
       "8192 a PCP rank"},
      {"--decode-tokens", "N", "a request's output tokens (the ranking's weight of TPOT)", "1024"},
      {"--pcp", "N", "evaluate this layout only (with --dcp, --indexer, --dsa-cp)", ""},
      {"--dcp", "N", "DCP ranks of the fixed layout", "1"},
      {"--indexer", "sharded|replicated", "indexer mode of the fixed layout", "sharded"},
      {"--dsa-cp", "", "the fixed layout's DCP ranks split tokens", ""},
      {"--step", "Q:C[xN],...", "predict one step of this batch (Q new tokens, C context, N such requests) on the "
                                "fixed layout", ""},
      {"--calibration", "FILE", "calibration file", "calibration/h200.json, built in"},
      {"--json", "", "print JSON", ""},
  };
  return s;
}

Result<std::vector<Request>> parse_step_batch(const std::string& text) {
  std::vector<Request> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t colon = item.find(':');
    if (colon == std::string::npos) {
      return invalid_argument("--step: expected Q:C[xN] items, got \"" + item + "\"");
    }
    const size_t x = item.find('x', colon);
    DSACP_ASSIGN_OR_RETURN(int64_t q, parse_int("--step query length", item.substr(0, colon), 1, 1 << 24));
    DSACP_ASSIGN_OR_RETURN(int64_t c, parse_int("--step context length", item.substr(colon + 1, x == std::string::npos ? std::string::npos : x - colon - 1), 0, (int64_t{1} << 31) - 2));
    int64_t n = 1;
    if (x != std::string::npos) {
      DSACP_ASSIGN_OR_RETURN(n, parse_int("--step count", item.substr(x + 1), 1, 1 << 16));
    }
    for (int64_t i = 0; i < n; ++i) out.push_back({static_cast<int32_t>(q), static_cast<int32_t>(c)});
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

std::string step_json(const StepCost& s) {
  return "{\"step_ms\": " + num(s.step_ms) + ", \"kv_ms\": " + num(s.kv_ms) + ", \"indexer_ms\": " + num(s.indexer_ms) +
         ", \"attention_ms\": " + num(s.attention_ms) + ", \"comm_ms\": " + num(s.comm_ms) +
         ", \"comm_bytes\": " + std::to_string(s.comm_bytes) + ", \"collectives\": " + std::to_string(s.collectives) +
         ", \"rank\": " + std::to_string(s.rank) + "}";
}

std::string gib(uint64_t b) {
  char s[64];
  std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(b) / (1u << 30));
  return s;
}

std::string ms_text(double ms) {
  char s[64];
  if (ms >= 1000) {
    std::snprintf(s, sizeof s, "%.2f s", ms / 1000);
  } else {
    std::snprintf(s, sizeof s, "%.3g ms", ms);
  }
  return s;
}

}  // namespace

int cmd_plan(const std::vector<std::string>& argv) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::clock_t cpu0 = std::clock();
  const CommandSpec spec = plan_spec();
  auto parsed = parse_args(spec, argv);
  if (!parsed.ok()) return report_error("plan", parsed.status());
  const ParsedArgs& args = *parsed;
  if (args.help()) {
    std::fputs(command_help(spec).c_str(), stdout);
    return 0;
  }
  auto fail = [](const Status& s) { return report_error("plan", s); };
  auto run = [&]() -> Status {
    PlanQuery q;
    if (args.has("--model")) {
      DSACP_ASSIGN_OR_RETURN(q.model, model_dims(args.get_or("--model", "")));
    } else {
      q.model.name = "explicit dims";
    }
    struct Dim {
      const char* flag;
      int32_t* at;
    } dims[] = {{"--layers", &q.model.layers}, {"--heads", &q.model.H},       {"--latent-dim", &q.model.Dl},
                {"--rope-dim", &q.model.Dr},   {"--index-heads", &q.model.Hi}, {"--index-dim", &q.model.Di},
                {"--topk", &q.model.K}};
    for (const Dim& d : dims) {
      if (!args.has(d.flag) && !args.has("--model")) {
        return invalid_argument(std::string("no model: give --model deepseek-v3.2|glm-5 or every dim (") + d.flag +
                                " is missing)");
      }
      DSACP_ASSIGN_OR_RETURN(int64_t v, args.get_int(d.flag, *d.at, 1, 1 << 20));
      *d.at = static_cast<int32_t>(v);
    }
    DSACP_ASSIGN_OR_RETURN(int64_t gpus, args.get_int("--gpus", 8, 1, 1 << 16));
    DSACP_ASSIGN_OR_RETURN(int64_t gpn, args.get_int("--gpus-per-node", 8, 1, 1 << 10));
    DSACP_ASSIGN_OR_RETURN(int64_t batch, args.get_int("--batch", 1, 1, 1 << 20));
    DSACP_ASSIGN_OR_RETURN(double ib, args.get_double("--inter-node-gbs", 50.0));
    DSACP_ASSIGN_OR_RETURN(double ib_lat, args.get_double("--inter-node-latency-us", 5.0));
    if (!(ib > 0) || !(ib_lat >= 0)) return invalid_argument("--inter-node-gbs must be > 0 and the latency >= 0");
    DSACP_ASSIGN_OR_RETURN(std::string kv, args.get_choice("--kv-dtype", "bf16", {"bf16", "fp8_ds_mla"}));
    DSACP_ASSIGN_OR_RETURN(std::string idx, args.get_choice("--index-dtype", "bf16", {"bf16", "fp8"}));
    DSACP_ASSIGN_OR_RETURN(double mem, args.get_double("--memory-per-gpu", 0.0));
    if (mem < 0) return invalid_argument("--memory-per-gpu must be > 0 GiB, got " + num(mem));
    DSACP_ASSIGN_OR_RETURN(int64_t chunk, args.get_int("--prefill-chunk", 0, 0, 1 << 24));
    DSACP_ASSIGN_OR_RETURN(int64_t out_tokens, args.get_int("--decode-tokens", 1024, 0, 1 << 24));
    q.gpus = static_cast<int32_t>(gpus);
    q.batch = static_cast<int32_t>(batch);
    q.links.gpus_per_node = static_cast<int32_t>(gpn);
    q.links.inter_node_gbs = ib;
    q.links.inter_node_latency_us = ib_lat;
    q.kv_fp8 = kv == "fp8_ds_mla";
    q.index_dtype = idx == "fp8" ? DType::kF8E4M3 : DType::kBF16;
    q.memory_per_gpu_gib = mem;
    q.prefill_chunk = chunk;
    q.decode_tokens = out_tokens;
    if (args.has("--pcp") || args.has("--step")) {
      q.fixed = true;
      DSACP_ASSIGN_OR_RETURN(int64_t P, args.get_int("--pcp", 1, 1, 1 << 16));
      DSACP_ASSIGN_OR_RETURN(int64_t D, args.get_int("--dcp", 1, 1, 1 << 16));
      DSACP_ASSIGN_OR_RETURN(std::string mode, args.get_choice("--indexer", "sharded", {"sharded", "replicated"}));
      q.fixed_layout.P = static_cast<int32_t>(P);
      q.fixed_layout.D = static_cast<int32_t>(D);
      q.fixed_layout.indexer = mode == "sharded" ? IndexerMode::kSharded : IndexerMode::kReplicated;
      q.fixed_layout.dsa_cp = args.has("--dsa-cp");
    }
    Result<PlannerCalibration> loaded = args.has("--calibration")
                                            ? load_planner_calibration(args.get_or("--calibration", ""))
                                            : parse_planner_calibration(kDefaultCalibrationJson);
    if (loaded.ok() && !args.has("--calibration")) loaded->path = kDefaultCalibrationName;
    DSACP_ASSIGN_OR_RETURN(PlannerCalibration cal, std::move(loaded));
    const bool as_json = args.has("--json");

    if (args.has("--step")) {
      DSACP_ASSIGN_OR_RETURN(std::vector<Request> reqs, parse_step_batch(args.get_or("--step", "")));
      const StepConfig c = plan_step_config(q);
      StepCostOptions o;
      o.cache = PagedCacheConfig{0, q.page_size, c.Dl, c.Dr, c.Di, DType::kBF16};
      if (q.kv_fp8) o.cache.latent_format = LatentFormat::kFp8DsMla;
      if (q.index_dtype == DType::kF8E4M3) o.cache.index_dtype = DType::kF8E4M3;
      o.links = q.links;
      DSACP_ASSIGN_OR_RETURN(StepCost sc, cp_step_cost(cal, c, reqs, q.fixed_layout, o));
      if (as_json) {
        std::printf("%s\n", step_json(sc).c_str());
      } else {
        std::printf("%s, %zu requests: step %s (kv %s, indexer %s, attention %s), %lld collectives, %s sent\n",
                    layout_name(q.fixed_layout).c_str(), reqs.size(), ms_text(sc.step_ms).c_str(),
                    ms_text(sc.kv_ms).c_str(), ms_text(sc.indexer_ms).c_str(), ms_text(sc.attention_ms).c_str(),
                    static_cast<long long>(sc.collectives), gib(static_cast<uint64_t>(sc.comm_bytes)).c_str());
      }
      return Status();
    }
    if (!args.has("--context")) return invalid_argument("--context N is required (prompt tokens)");
    DSACP_ASSIGN_OR_RETURN(int64_t context, args.get_int("--context", 1, 1, (int64_t{1} << 31) - 2));
    q.context = context;
    DSACP_ASSIGN_OR_RETURN(PlanAnswer ans, plan_layouts(q, cal));
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double cpu = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
    if (as_json) {
      std::string s = "{\"model\": " + json::quote(q.model.name) + ", \"context\": " + std::to_string(q.context) +
                      ", \"batch\": " + std::to_string(q.batch) + ", \"gpus\": " + std::to_string(q.gpus) +
                      ", \"calibration\": " + json::quote(cal.path) + ", \"calibration_source_commit\": " +
                      json::quote(cal.source_commit) + ", \"seconds\": " + num(took) + ", \"cpu_seconds\": " + num(cpu) +
                      ", \"layouts\": [";
      for (size_t i = 0; i < ans.layouts.size(); ++i) {
        const LayoutChoice& l = ans.layouts[i];
        s += std::string(i ? ", " : "") + "{\"layout\": " + json::quote(l.name) + ", \"P\": " +
             std::to_string(l.layout.P) + ", \"D\": " + std::to_string(l.layout.D) + ", \"replicas\": " +
             std::to_string(l.replicas) + ", \"feasible\": " + (l.feasible ? "true" : "false");
        if (l.feasible) {
          s += ", \"ttft_ms\": " + num(l.ttft_ms) + ", \"tpot_ms\": " + num(l.tpot_ms) + ", \"kv_bytes_per_gpu\": " +
               std::to_string(l.kv_bytes_per_gpu) + ", \"memory_per_gpu\": " + std::to_string(l.memory_per_gpu) +
               ", \"decode_step\": " + step_json(l.decode_step) + ", \"last_prefill_step\": " +
               step_json(l.last_prefill_step);
        } else {
          s += ", \"refused\": " + json::quote(l.refused);
        }
        if (static_cast<int32_t>(i) == ans.chosen) s += ", \"chosen\": true";
        if (!l.loses.empty() && l.feasible) s += ", \"loses\": " + json::quote(l.loses);
        s += "}";
      }
      std::printf("%s]}\n", s.c_str());
      return Status();
    }
    const LayoutChoice& best = ans.layouts[ans.chosen];
    std::printf("%s, context %lld, batch %d, %d GPUs (%d a node), KV %s, indexer %s (calibration %s, %s)\n",
                q.model.name.c_str(), static_cast<long long>(q.context), q.batch, q.gpus, q.links.gpus_per_node,
                kv.c_str(), idx.c_str(), cal.gpu.c_str(), cal.source_commit.c_str());
    std::printf("chosen: %s x %d replica%s: TTFT %s, TPOT %s, KV %s a GPU (memory %s)\n", best.name.c_str(),
                best.replicas, best.replicas == 1 ? "" : "s", ms_text(best.ttft_ms).c_str(),
                ms_text(best.tpot_ms).c_str(), gib(best.kv_bytes_per_gpu).c_str(), gib(best.memory_per_gpu).c_str());
    std::printf("%-24s %9s %10s %10s %11s  %s\n", "layout", "replicas", "TTFT", "TPOT", "KV/GPU", "why it loses");
    for (const LayoutChoice& l : ans.layouts) {
      if (l.feasible) {
        std::printf("%-24s %9d %10s %10s %11s  %s\n", l.name.c_str(), l.replicas, ms_text(l.ttft_ms).c_str(),
                    ms_text(l.tpot_ms).c_str(), gib(l.kv_bytes_per_gpu).c_str(),
                    l.loses.empty() ? "(chosen)" : l.loses.c_str());
      } else {
        std::printf("%-24s %9d %10s %10s %11s  refused: %s\n", l.name.c_str(), l.replicas, "-", "-", "-",
                    l.refused.c_str());
      }
    }
    std::printf("%lld layouts in %.3f s (%.3f s of CPU)\n", static_cast<long long>(ans.layouts_considered), took, cpu);
    return Status();
  };
  Status s = run();
  return s.ok() ? 0 : fail(s);
}

}  // namespace dsacp::cli
