// dsacp run: the main job. A synthetic long-context serving workload through the step executor:
// several requests prefill their prompts in chunks (continuous batching: decodes first, then prefill
// chunks up to a token budget), then decode with MTP (1..mtp tokens per step, lengths differing between
// requests); sampled tokens of every step are checked against direct fp64 math.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "core/parallel.h"
#include "dsacp/backend.h"
#include "dsacp/memory_estimate.h"
#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "dsacp/step.h"
#include "verify.h"
#include "workload.h"

namespace dsacp::cli {
namespace {

CommandSpec run_spec() {
  CommandSpec s;
  s.name = "run";
  s.usage = "dsacp run [options]";
  s.summary =
      "Serves a synthetic long-context workload through the DSA step executor: chunked prefill of every\n"
      "request's prompt, then decode steps with MTP, over one paged KV cache. Sampled tokens of every step\n"
      "are checked against direct fp64 math (top-k exact up to fp32 near-ties, out and lse within fp32\n"
      "rounding). Prints a progress bar (on a terminal) and a summary; exits 1 if a check fails.";
  s.options = {
      {"--requests", "N", "requests in the workload", "4"},
      {"--prompt-len", "A[:B]", "prompt length per request, uniform in [A, B]", "512:2048"},
      {"--chunk", "N", "prefill token budget per step", "1024"},
      {"--decode-steps", "N", "decode steps per request after its prefill", "8"},
      {"--mtp", "N", "most tokens per decode step (1 + draft tokens, <= 16); lengths vary in [1, N]", "2"},
      {"--heads", "H", "attention heads", "16"},
      {"--latent-dim", "Dl", "latent (kv_lora_rank) dim", "512"},
      {"--rope-dim", "Dr", "rope dim", "64"},
      {"--index-heads", "Hi", "indexer heads", "16; 64 with --device cuda"},
      {"--index-dim", "Di", "indexer head dim", "128"},
      {"--topk", "K", "indexer top-k", "512"},
      {"--scale", "X", "softmax scale", "0.1352338"},
      {"--page-size", "N", "KV cache page size in tokens", "64"},
      {"--dtype", "bf16|f32", "storage dtype of activations and caches", "bf16"},
      {"--kv-dtype", "float|fp8_ds_mla",
       "fp8_ds_mla: the latent cache as 656-byte records (e4m3 latent with a f32 scale a 128-value tile, bf16 "
       "rope; --latent-dim a multiple of 128), checked against the dequantized latent",
       "float"},
      {"--samples", "N", "tokens checked against fp64 per step", "4"},
      {"--seed", "N", "workload seed", "1"},
      {"--threads", "N", "CPU threads (0 = all cores)", "0"},
      {"--device", "cpu|cuda", "backend (cuda: sm_90a GPUs)", "cpu"},
      gpus_option(),
      {"--json", "", "print the summary as JSON on stdout", ""},
      {"--no-progress", "", "no progress bar", ""},
      max_memory_option(),
  };
  for (OptionSpec o : layout_options(2, 2)) {
    if (o.name == "--pcp" || o.name == "--dcp") o.fallback = "2; 1 with --device cuda";
    s.options.push_back(o);
  }
  for (const OptionSpec& o : cuda_diagnostic_options()) s.options.push_back(o);
  return s;
}

struct RunConfig {
  int32_t requests;
  std::pair<int64_t, int64_t> prompt;
  int32_t chunk, decode_steps, mtp, page_size, samples, threads;
  float scale;
  uint64_t seed;
  DType dtype;
  WorkloadDims dims;
  bool json, progress;
  CpLayout layout;
  bool cuda = false;  // --device cuda
  bool fp8_latent = false;  // --kv-dtype fp8_ds_mla
  int64_t gpus = 0;   // --gpus (0 = default)
  uint64_t max_memory = 0;  // --max-memory (0 = what is available)
  CudaBackendOptions cuda_options;  // --cuda-timeline, --cuda-trace
};

struct RequestState {
  int64_t prompt_len = 0;
  int64_t cached = 0;         // tokens in the cache
  int32_t decodes_left = 0;
  SequencePages pages;
  bool finished() const { return cached >= prompt_len && decodes_left == 0; }
};

struct PhaseStats {
  int64_t steps = 0, tokens = 0;
  double seconds = 0;
};

struct CheckStats {
  int64_t tokens = 0, exact = 0, near_tie_swaps = 0, failures = 0;
  double max_out_rel = 0, max_lse_abs = 0;
  std::string first_problem;
};

Result<RunConfig> read_config(const ParsedArgs& a) {
  RunConfig c;
  auto geti = [&](const char* n, int64_t def, int64_t lo, int64_t hi) { return a.get_int(n, def, lo, hi); };
  DSACP_ASSIGN_OR_RETURN(int64_t requests, geti("--requests", 4, 1, 4096));
  DSACP_ASSIGN_OR_RETURN(c.prompt, a.get_range("--prompt-len", {512, 2048}, 1, int64_t{1} << 30));
  DSACP_ASSIGN_OR_RETURN(int64_t chunk, geti("--chunk", 1024, 1, 1 << 24));
  DSACP_ASSIGN_OR_RETURN(int64_t decode_steps, geti("--decode-steps", 8, 0, 1 << 20));
  DSACP_ASSIGN_OR_RETURN(int64_t mtp, geti("--mtp", 2, 1, kMaxDecodeThreshold));
  DSACP_ASSIGN_OR_RETURN(int64_t H, geti("--heads", 16, 1, 1024));
  DSACP_ASSIGN_OR_RETURN(int64_t Dl, geti("--latent-dim", 512, 1, 8192));
  DSACP_ASSIGN_OR_RETURN(int64_t Dr, geti("--rope-dim", 64, 1, 8192));
  DSACP_ASSIGN_OR_RETURN(std::string device, a.get_choice("--device", "cpu", {"cpu", "cuda"}));
  c.cuda = device == "cuda";
  DSACP_ASSIGN_OR_RETURN(c.gpus, a.get_int("--gpus", 0, 1, 1024));
  // The CUDA indexer runs DeepSeek-V3.2's 64 indexer heads; the CPU default keeps the main job quick.
  DSACP_ASSIGN_OR_RETURN(int64_t Hi, geti("--index-heads", c.cuda ? 64 : 16, 1, 1024));
  DSACP_ASSIGN_OR_RETURN(int64_t Di, geti("--index-dim", 128, 1, 8192));
  DSACP_ASSIGN_OR_RETURN(int64_t K, geti("--topk", 512, 1, 1 << 24));
  DSACP_ASSIGN_OR_RETURN(double scale, a.get_double("--scale", 0.1352338));
  DSACP_ASSIGN_OR_RETURN(int64_t page_size, geti("--page-size", 64, 1, 1 << 20));
  DSACP_ASSIGN_OR_RETURN(std::string dtype, a.get_choice("--dtype", "bf16", {"bf16", "f32"}));
  DSACP_ASSIGN_OR_RETURN(std::string kv_dtype, a.get_choice("--kv-dtype", "float", {"float", "fp8_ds_mla"}));
  c.fp8_latent = kv_dtype == "fp8_ds_mla";
  DSACP_ASSIGN_OR_RETURN(int64_t samples, geti("--samples", 4, 0, 1 << 20));
  DSACP_ASSIGN_OR_RETURN(int64_t seed, geti("--seed", 1, 0, INT64_MAX));
  DSACP_ASSIGN_OR_RETURN(int64_t threads, geti("--threads", 0, 0, 1024));
  c.requests = static_cast<int32_t>(requests);
  c.chunk = static_cast<int32_t>(chunk);
  c.decode_steps = static_cast<int32_t>(decode_steps);
  c.mtp = static_cast<int32_t>(mtp);
  c.dims = {static_cast<int32_t>(H), static_cast<int32_t>(Dl), static_cast<int32_t>(Dr),
            static_cast<int32_t>(Hi), static_cast<int32_t>(Di), static_cast<int32_t>(K)};
  c.scale = static_cast<float>(scale);
  if (!std::isfinite(c.scale)) {
    return invalid_argument("--scale " + *a.get("--scale") + " is not finite as an f32 (|scale| must be below 3.4e38)");
  }
  if (a.has("--max-memory")) {
    DSACP_ASSIGN_OR_RETURN(c.max_memory, parse_bytes("--max-memory", *a.get("--max-memory")));
  }
  c.page_size = static_cast<int32_t>(page_size);
  c.dtype = dtype == "bf16" ? DType::kBF16 : DType::kF32;
  c.samples = static_cast<int32_t>(samples);
  c.seed = static_cast<uint64_t>(seed);
  c.threads = static_cast<int32_t>(threads);
  DSACP_ASSIGN_OR_RETURN(c.layout, read_layout(a, c.cuda ? 1 : 2, c.cuda ? 1 : 2));
  c.cuda_options = read_cuda_options(a);
  c.json = a.has("--json");
  c.progress = !a.has("--no-progress") && isatty(2);
  return c;
}

void draw_progress(int64_t done, int64_t total, int64_t step, const char* phase) {
  const int width = 30;
  const int filled = total > 0 ? static_cast<int>(width * done / total) : width;
  std::fprintf(stderr, "\r[%s%s] %3d%%  step %lld  %-7s", std::string(filled, '#').c_str(),
               std::string(width - filled, '.').c_str(), total > 0 ? static_cast<int>(100 * done / total) : 100,
               static_cast<long long>(step), phase);
  std::fflush(stderr);
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

int cmd_run(const std::vector<std::string>& argv) {
  const CommandSpec spec = run_spec();
  auto parsed = parse_args(spec, argv);
  if (!parsed.ok()) return report_error("run", parsed.status());
  if (parsed->help()) {
    std::fputs(command_help(spec).c_str(), stdout);
    return 0;
  }
  auto fail = [](const Status& s) { return report_error("run", s); };
  auto cfg_or = read_config(*parsed);
  if (!cfg_or.ok()) return fail(cfg_or.status());
  const RunConfig cfg = *cfg_or;
  const WorkloadDims& d = cfg.dims;
  const WorkloadValues values(cfg.seed, d, cfg.dtype);

  // Requests and the pools: enough pages for every request's whole life at once. Every CP rank has its own
  // pools; the block table is shared (pages for the largest share, rank 0's).
  const KvSharding sharding{cfg.layout.num_ranks(), cfg.layout.interleave == 0 ? cfg.page_size : cfg.layout.interleave};
  std::vector<RequestState> reqs(static_cast<size_t>(cfg.requests));
  int64_t pages_needed = 0, total_tokens = 0;
  for (int32_t b = 0; b < cfg.requests; ++b) {
    const uint64_t span = static_cast<uint64_t>(cfg.prompt.second - cfg.prompt.first + 1);
    reqs[b].prompt_len = cfg.prompt.first + static_cast<int64_t>(counter_hash(cfg.seed, 0x9e1, b) % span);
    reqs[b].decodes_left = cfg.decode_steps;
    const int64_t max_len = reqs[b].prompt_len + int64_t{cfg.decode_steps} * cfg.mtp;
    if (max_len > INT32_MAX) return fail(invalid_argument("request length exceeds 2^31 - 1 tokens"));
    pages_needed += sharding.pages_needed(max_len, cfg.page_size);
    total_tokens += reqs[b].prompt_len + cfg.decode_steps;  // decode progress counts steps
  }
  PagedCacheConfig cc{pages_needed, cfg.page_size, d.Dl, d.Dr, d.Di, cfg.dtype};
  cc.index_page_factor = cfg.layout.indexer == IndexerMode::kReplicated ? cfg.layout.num_ranks() : 1;
  if (cfg.fp8_latent) cc.latent_format = LatentFormat::kFp8DsMla;
  const StepConfig sc = step_config_of(d.dims(), d.K, cfg.scale, cfg.dtype);
  // The largest step: a full prefill chunk plus every request's decode tokens; checked against the host's
  // memory (CPU ranks) or each GPU's free memory (CUDA ranks) before anything is allocated.
  PagedCacheConfig per_rank = cc;
  per_rank.index_page_factor = 1;  // cp_memory_estimate applies the layout's
  const MemoryEstimate need = cp_memory_estimate(sc, cfg.layout, per_rank,
                                                 int64_t{cfg.chunk} + int64_t{cfg.requests} * cfg.mtp, sharding.Pt);
  if (!cfg.cuda) {
    if (Status s = host_memory_check(need, "this workload", cfg.max_memory); !s.ok()) return fail(s);
  }
  auto backends = make_rank_backends(cfg.cuda ? "cuda" : "cpu", cfg.gpus, cfg.layout, cfg.threads, cfg.cuda_options);
  if (!backends.ok()) return fail(backends.status());
  if (cfg.cuda) {
    if (Status s = device_memory_check(need, sharding.Pt, backends->ranks, "this workload"); !s.ok()) return fail(s);
  }
  auto cluster = LocalCpCluster::create(backends->ranks, cfg.layout, cc);
  if (!cluster.ok()) return fail(cluster.status());
  PageAllocator allocator(cc.num_pages, cfg.seed);

  PhaseStats prefill_stats, decode_stats;
  CheckStats check;
  CheckTolerance tol;
  // The CUDA kernels feed bf16 operands to the tensor cores (P is rounded to bf16 before P.V): the contract's
  // bf16 bound applies, not fp32 rounding.
  if (cfg.cuda) tol.out_rel = 1e-2;
  // Over fp8_ds_mla records the CUDA kernels dequantize the latent to bf16 (contract section 6: the bf16 bound
  // applies), so the keys themselves differ from the oracle's f32 ones by a bf16 rounding and the logits, hence the
  // LSE, move by up to ~2^-8 of |logit|: the LSE gets the bound the output has.
  if (cfg.cuda && cfg.fp8_latent) tol.lse_abs = 1e-2;
  int64_t peak_pages = 0, progress_done = 0, step = 0;
  // Peak KV bytes (latent + rope + indexer key of the tokens it stores) each rank holds.
  const double elem = static_cast<double>(dtype_size(cfg.dtype));
  const bool replicated_index = cfg.layout.indexer == IndexerMode::kReplicated;
  std::vector<double> peak_rank_bytes(static_cast<size_t>(sharding.Pt), 0.0);
  double gen_seconds = 0, verify_seconds = 0;
  using Clock = std::chrono::steady_clock;
  const auto t_start = Clock::now();

  while (true) {
    // Continuous batching: decodes first, then prefill chunks within the token budget.
    std::vector<StepSlice> slices;
    std::vector<Request> batch;
    std::vector<int32_t> decode_ids;
    bool has_prefill = false;
    for (int32_t b = 0; b < cfg.requests; ++b) {
      RequestState& r = reqs[b];
      if (r.cached < r.prompt_len || r.decodes_left == 0) continue;
      const int32_t q = 1 + static_cast<int32_t>(counter_hash(cfg.seed, 0x3a7, step * 4096 + b) % cfg.mtp);
      slices.push_back({b, r.cached, q});
      batch.push_back({q, static_cast<int32_t>(r.cached)});
      decode_ids.push_back(b);
    }
    int64_t budget = cfg.chunk;
    for (int32_t b = 0; b < cfg.requests && budget > 0; ++b) {
      RequestState& r = reqs[b];
      if (r.cached >= r.prompt_len) continue;
      const int32_t n = static_cast<int32_t>(std::min(budget, r.prompt_len - r.cached));
      slices.push_back({b, r.cached, n});
      batch.push_back({n, static_cast<int32_t>(r.cached)});
      budget -= n;
      has_prefill = true;
    }
    if (slices.empty()) break;

    std::vector<const SequencePages*> seqs;
    for (const StepSlice& s : slices) {
      RequestState& r = reqs[s.request];
      const int64_t local = sharding.local_len(s.first_pos + s.count, 0);
      if (Status st = r.pages.reserve(allocator, local, cfg.page_size); !st.ok()) return fail(st);
      seqs.push_back(&r.pages);
    }
    peak_pages = std::max(peak_pages, allocator.num_used());
    const BlockTable table = BlockTable::from_sequences(seqs);

    auto t0 = Clock::now();
    auto tensors = make_step_tensors(values, slices, cfg.threads);
    if (!tensors.ok()) return fail(tensors.status());
    auto t1 = Clock::now();
    auto result = (*cluster)->step(sc, batch, table, tensors->inputs());
    if (!result.ok()) return fail(result.status().with_context("step " + std::to_string(step)));
    auto t2 = Clock::now();
    gen_seconds += std::chrono::duration<double>(t1 - t0).count();
    const double step_seconds = std::chrono::duration<double>(t2 - t1).count();
    int64_t T = 0;
    for (const StepSlice& s : slices) T += s.count;
    PhaseStats& ph = has_prefill ? prefill_stats : decode_stats;
    ph.steps += 1;
    ph.tokens += T;
    ph.seconds += step_seconds;

    // Verify sampled tokens against fp64.
    for (int32_t i = 0; i < cfg.samples && T > 0; ++i) {
      const int64_t row = static_cast<int64_t>(counter_hash(cfg.seed, 0x5a3, step * 65536 + i) % T);
      int64_t base = 0;
      const StepSlice* sl = nullptr;
      for (const StepSlice& s : slices) {
        if (row < base + s.count) {
          sl = &s;
          break;
        }
        base += s.count;
      }
      const int64_t pos = sl->first_pos + (row - base);
      const TokenCheck tc = verify_token(values, sl->request, pos, cfg.scale,
                                         result->topk_indices.data_as<int32_t>() + row * d.K,
                                         result->out.data_as<float>() + row * d.H * d.Dl,
                                         result->lse.data_as<float>() + row * d.H, tol, cfg.fp8_latent);
      check.tokens += 1;
      check.exact += tc.topk_exact;
      check.near_tie_swaps += tc.near_tie_swaps;
      check.max_out_rel = std::max(check.max_out_rel, tc.out_rel_err);
      check.max_lse_abs = std::max(check.max_lse_abs, tc.lse_abs_err);
      if (!tc.ok) {
        check.failures += 1;
        if (check.first_problem.empty()) {
          check.first_problem = "step " + std::to_string(step) + ", request " + std::to_string(sl->request) +
                                ", position " + std::to_string(pos) + ": " + tc.problem;
        }
      }
    }
    verify_seconds += std::chrono::duration<double>(Clock::now() - t2).count();

    // Advance: prefill chunks are cached; a decode step accepts 1..q of its tokens (MTP).
    for (size_t k = 0; k < slices.size(); ++k) {
      const StepSlice& s = slices[k];
      RequestState& r = reqs[s.request];
      if (k < decode_ids.size()) {
        r.cached += 1 + static_cast<int64_t>(counter_hash(cfg.seed, 0xacc, step * 4096 + s.request) % s.count);
        r.decodes_left -= 1;
        progress_done += 1;
      } else {
        r.cached += s.count;
        progress_done += s.count;
      }
      if (r.finished()) {
        if (Status st = r.pages.release(allocator); !st.ok()) return fail(st);
      }
    }
    for (int32_t cr = 0; cr < sharding.Pt; ++cr) {
      double bytes = 0;
      for (const RequestState& r : reqs) {
        const double local = static_cast<double>(sharding.local_len(r.cached, cr));
        bytes += elem * ((d.Dl + d.Dr) * local + d.Di * (replicated_index ? static_cast<double>(r.cached) : local));
      }
      peak_rank_bytes[cr] = std::max(peak_rank_bytes[cr], bytes);
    }
    ++step;
    if (cfg.progress) draw_progress(progress_done, total_tokens, step, has_prefill ? "prefill" : "decode");
  }
  if (cfg.progress) std::fputc('\n', stderr);
  const double wall = std::chrono::duration<double>(Clock::now() - t_start).count();
  const bool pass = check.failures == 0;
  const bool checked = check.tokens > 0;  // --samples 0 checks nothing: reported as such, never as PASS
  const int threads_used = cfg.threads > 0 ? cfg.threads : default_num_threads();
  const double page_bytes = static_cast<double>((*cluster)->cache_bytes_per_rank()) / static_cast<double>(cc.num_pages);
  auto rate = [](const PhaseStats& p) { return p.seconds > 0 ? p.tokens / p.seconds : 0.0; };

  std::string rank_bytes_list, rank_bytes_text;
  for (double b : peak_rank_bytes) {
    rank_bytes_list += (rank_bytes_list.empty() ? "" : ",") + fmt("%.0f", b);
    rank_bytes_text += (rank_bytes_text.empty() ? "" : " ") + fmt("%.1f", b / (1 << 20));
  }
  if (cfg.json) {
    std::printf(
        "{\"command\":\"run\",\"device\":\"%s\",\"backend\":\"%s\",\"transport\":\"%s\",\"threads\":%d,\"requests\":%d,\"prompt_len\":[%lld,%lld],"
        "\"chunk\":%d,\"decode_steps\":%d,\"mtp\":%d,\"dims\":{\"H\":%d,\"Dl\":%d,\"Dr\":%d,\"Hi\":%d,\"Di\":%d,"
        "\"K\":%d},\"page_size\":%d,\"dtype\":\"%s\",\"seed\":%llu,"
        "\"prefill\":{\"steps\":%lld,\"tokens\":%lld,\"seconds\":%.6f,\"tokens_per_s\":%.3f},"
        "\"decode\":{\"steps\":%lld,\"tokens\":%lld,\"seconds\":%.6f,\"tokens_per_s\":%.3f},"
        "\"pages\":{\"total\":%lld,\"peak_used\":%lld,\"bytes_per_page\":%.0f},\"pcp\":%d,\"dcp\":%d,"
        "\"interleave\":%d,\"indexer\":\"%s\",\"dsa_cp\":%s,\"pcp_decode\":\"%s\",\"kv_bytes_per_rank\":[%s],"
        "\"check\":{\"tokens\":%lld,\"topk_exact\":%lld,\"near_tie_swaps\":%lld,\"failures\":%lld,"
        "\"max_out_rel_err\":%.3e,\"max_lse_abs_err\":%.3e,\"checked\":%s,\"pass\":%s},\"wall_seconds\":%.3f}\n",
        cfg.cuda ? "cuda" : "cpu", backends->description.c_str(), (*cluster)->transport().c_str(), threads_used,
        cfg.requests,
        static_cast<long long>(cfg.prompt.first), static_cast<long long>(cfg.prompt.second), cfg.chunk,
        cfg.decode_steps, cfg.mtp, d.H, d.Dl, d.Dr, d.Hi, d.Di, d.K, cfg.page_size, dtype_name(cfg.dtype),
        static_cast<unsigned long long>(cfg.seed), static_cast<long long>(prefill_stats.steps),
        static_cast<long long>(prefill_stats.tokens), prefill_stats.seconds, rate(prefill_stats),
        static_cast<long long>(decode_stats.steps), static_cast<long long>(decode_stats.tokens), decode_stats.seconds,
        rate(decode_stats), static_cast<long long>(cc.num_pages), static_cast<long long>(peak_pages), page_bytes,
        cfg.layout.P, cfg.layout.D, sharding.I, cfg.layout.indexer == IndexerMode::kSharded ? "sharded" : "replicated",
        cfg.layout.dsa_cp ? "true" : "false", cfg.layout.decode_mode == DecodeMode::kLocalMerge ? "local" : "gathered",
        rank_bytes_list.c_str(),
        static_cast<long long>(check.tokens), static_cast<long long>(check.exact),
        static_cast<long long>(check.near_tie_swaps), static_cast<long long>(check.failures), check.max_out_rel,
        check.max_lse_abs, checked ? "true" : "false", !checked ? "null" : pass ? "true" : "false", wall);
  } else {
    std::printf("dsacp run: %d requests, prompts %lld..%lld tokens, chunk %d, %d decode steps (MTP <= %d)\n",
                cfg.requests, static_cast<long long>(cfg.prompt.first), static_cast<long long>(cfg.prompt.second),
                cfg.chunk, cfg.decode_steps, cfg.mtp);
    std::printf("  H=%d Dl=%d Dr=%d Hi=%d Di=%d K=%d, page size %d, %s, %s backend\n", d.H, d.Dl, d.Dr, d.Hi,
                d.Di, d.K, cfg.page_size, dtype_name(cfg.dtype), backends->description.c_str());
    if (sharding.Pt == 1) {
      std::printf("  layout: single device\n\n");
    } else {
      std::printf("  layout: P=%d x D=%d (%d ranks%s, %s), interleave %d, %s indexer, decodes by %s\n\n",
                  cfg.layout.P, cfg.layout.D, sharding.Pt, cfg.layout.dsa_cp ? ", DSA-CP" : "",
                  (*cluster)->transport().c_str(), sharding.I,
                  cfg.layout.indexer == IndexerMode::kSharded ? "sharded" : "replicated",
                  cfg.layout.decode_mode == DecodeMode::kLocalMerge ? "local attention + LSE merge" : "gathered KV");
    }
    std::printf("  %-8s %6s %9s %10s %12s\n", "phase", "steps", "tokens", "seconds", "tokens/s");
    for (auto [name, p] : {std::pair{"prefill", prefill_stats}, std::pair{"decode", decode_stats}}) {
      std::printf("  %-8s %6lld %9lld %10.3f %12.1f\n", name, static_cast<long long>(p.steps),
                  static_cast<long long>(p.tokens), p.seconds, rate(p));
    }
    std::printf("\n  pages: peak %lld of %lld used (%d tokens, %.1f KiB each: latent + rope + indexer keys)\n",
                static_cast<long long>(peak_pages), static_cast<long long>(cc.num_pages), cfg.page_size,
                page_bytes / 1024.0);
    std::printf("  KV held per rank at peak (MiB): %s\n", rank_bytes_text.c_str());
    std::printf("  check vs fp64: %lld tokens, top-k exact %lld (near-tie swaps %lld), max out rel err %s,"
                " max lse err %s -> %s\n",
                static_cast<long long>(check.tokens), static_cast<long long>(check.exact),
                static_cast<long long>(check.near_tie_swaps), fmt("%.2e", check.max_out_rel).c_str(),
                fmt("%.2e", check.max_lse_abs).c_str(),
                !checked ? "not checked (--samples 0)" : pass ? "PASS" : "FAIL");
    std::printf("  wall %.1f s (input generation %.1f s, fp64 checks %.1f s)\n", wall, gen_seconds, verify_seconds);
  }
  if (!pass) {
    std::fprintf(stderr, "dsacp run: error: verification failed (%lld of %lld tokens): %s\n",
                 static_cast<long long>(check.failures), static_cast<long long>(check.tokens),
                 check.first_problem.c_str());
    return 1;
  }
  return 0;
}

}  // namespace dsacp::cli
