// dsacp make-case OUT: a random case file with counter-based values.
#include <cstdio>

#include "commands.h"
#include "dsacp/case_file.h"

namespace dsacp::cli {
namespace {

CommandSpec make_case_spec() {
  CommandSpec s;
  s.name = "make-case";
  s.usage = "dsacp make-case OUT --query-lens 1,1,37 --context-lens 100,5,0 [options]";
  s.summary = "Writes a random case file (contract §4) for replay: requests in the given order, values uniform in\n"
              "[-1, 1) from a counter-based generator (same seed, same file).";
  s.positionals = {"OUT"};
  s.options = {
      {"--query-lens", "A,B,...", "new tokens per request", "1,4,37"},
      {"--context-lens", "A,B,...", "tokens already in the cache per request", "300,90,0"},
      {"--heads", "H", "attention heads", "4"},
      {"--latent-dim", "Dl", "latent dim", "64"},
      {"--rope-dim", "Dr", "rope dim", "16"},
      {"--index-heads", "Hi", "indexer heads", "4"},
      {"--index-dim", "Di", "indexer dim", "32"},
      {"--topk", "K", "top-k", "64"},
      {"--scale", "X", "softmax scale", "0.125"},
      {"--dtype", "f32|bf16", "dtype of the float tensors (idx_w is always F32)", "bf16"},
      {"--seed", "N", "generator seed", "1"},
      {"--index-dtype", "float|fp8",
       "fp8: idx_q, idx_k, ctx_idx_k as F8_E4M3 with F32 scales (idx_q_scale [T, Hi], idx_k_scale [T], "
       "ctx_idx_k_scale [sumC]), quantized from the random values with the fp32 rule per token / (token, head)",
       "float"},
      {"--kv-dtype", "float|fp8_ds_mla",
       "fp8_ds_mla: ctx_kv_latent as F8_E4M3 with ctx_kv_latent_scale F32 [sumC, Dl/128], quantized per 128-value "
       "tile with the fp32 rule (--latent-dim a multiple of 128); kv_latent stays float",
       "float"},
  };
  return s;
}

Result<std::vector<int64_t>> parse_list(const std::string& name, const std::string& text, int64_t lo, int64_t hi) {
  std::vector<int64_t> v;
  size_t start = 0;
  while (true) {
    size_t comma = text.find(',', start);
    DSACP_ASSIGN_OR_RETURN(int64_t x, parse_int(name, text.substr(start, comma - start), lo, hi));
    v.push_back(x);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return v;
}

}  // namespace

int cmd_make_case(const std::vector<std::string>& argv) {
  const CommandSpec spec = make_case_spec();
  auto parsed = parse_args(spec, argv);
  if (!parsed.ok()) return report_error("make-case", parsed.status());
  const ParsedArgs& args = *parsed;
  if (args.help()) {
    std::fputs(command_help(spec).c_str(), stdout);
    return 0;
  }
  auto fail = [](const Status& s) { return report_error("make-case", s); };
  auto q = parse_list("--query-lens", args.get_or("--query-lens", "1,4,37"), 1, 1 << 20);
  auto ctx = parse_list("--context-lens", args.get_or("--context-lens", "300,90,0"), 0, 1 << 24);
  if (!q.ok()) return fail(q.status());
  if (!ctx.ok()) return fail(ctx.status());
  if (q->size() != ctx->size()) {
    return fail(invalid_argument("--query-lens has " + std::to_string(q->size()) + " entries, --context-lens " +
                                 std::to_string(ctx->size())));
  }
  CaseGenSpec g;
  for (size_t i = 0; i < q->size(); ++i) {
    g.requests.push_back({static_cast<int32_t>((*q)[i]), static_cast<int32_t>((*ctx)[i])});
  }
  auto H = args.get_int("--heads", 4, 1, 1024);
  auto Dl = args.get_int("--latent-dim", 64, 1, 4096);
  auto Dr = args.get_int("--rope-dim", 16, 1, 4096);
  auto Hi = args.get_int("--index-heads", 4, 1, 1024);
  auto Di = args.get_int("--index-dim", 32, 1, 4096);
  auto K = args.get_int("--topk", 64, 1, 1 << 20);
  auto scale = args.get_double("--scale", 0.125);
  auto dtype = args.get_choice("--dtype", "bf16", {"f32", "bf16"});
  auto seed = args.get_int("--seed", 1, 0, INT64_MAX);
  auto index_dtype = args.get_choice("--index-dtype", "float", {"float", "fp8"});
  if (!index_dtype.ok()) return fail(index_dtype.status());
  auto kv_dtype = args.get_choice("--kv-dtype", "float", {"float", "fp8_ds_mla"});
  if (!kv_dtype.ok()) return fail(kv_dtype.status());
  for (const Status& s : {H.status(), Dl.status(), Dr.status(), Hi.status(), Di.status(), K.status(),
                          scale.status(), dtype.status(), seed.status()}) {
    if (!s.ok()) return fail(s);
  }
  g.dims = {static_cast<int32_t>(*H), static_cast<int32_t>(*Dl), static_cast<int32_t>(*Dr),
            static_cast<int32_t>(*Hi), static_cast<int32_t>(*Di)};
  g.topk = static_cast<int32_t>(*K);
  g.scale = static_cast<float>(*scale);
  g.dtype = *dtype == "bf16" ? DType::kBF16 : DType::kF32;
  g.seed = static_cast<uint64_t>(*seed);
  auto c = case_generate(g);
  if (!c.ok()) return fail(c.status());
  if (*index_dtype == "fp8") {
    if (Status s = case_quantize_index(*c, Fp8ScaleMode::kFp32); !s.ok()) return fail(s);
  }
  if (*kv_dtype == "fp8_ds_mla") {
    if (Status s = case_quantize_latent(*c, Fp8ScaleMode::kFp32); !s.ok()) return fail(s);
  }
  if (Status s = case_write(args.positionals()[0], *c); !s.ok()) return fail(s);
  return 0;
}

}  // namespace dsacp::cli
