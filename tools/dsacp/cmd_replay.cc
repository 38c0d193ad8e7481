// dsacp replay CASE --out RESULT: one batch step from a case file (contract §4).
#include <cstdio>

#include "commands.h"
#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/replay.h"

namespace dsacp::cli {
namespace {

CommandSpec replay_spec() {
  CommandSpec s;
  s.name = "replay";
  s.usage = "dsacp replay CASE --out RESULT [options]";
  s.summary =
      "Loads the case's context into paged caches (pages in a shuffled order, NaN in every unused slot),\n"
      "runs the step (cache write, indexer + exact top-k, sparse MLA attention) in the given layout and writes\n"
      "the result file (the same whatever the layout):\n"
      "topk_indices I32 [T, K], out [T, H, Dl], lse F32 [T, H], rows in the case's token order.";
  s.positionals = {"CASE"};
  s.options = {
      {"--out", "RESULT", "result file to write (safetensors)", ""},
      {"--page-size", "N", "KV cache page size in tokens", "64"},
      {"--threads", "N", "CPU threads (0 = all cores)", "0"},
      {"--out-dtype", "f32|bf16", "dtype of out in the result file", "f32"},
      {"--page-seed", "N", "seed of the shuffled page order (0 = pages in order)", "24301"},
      {"--device", "cpu|cuda", "backend (cuda: sm_90a GPU 0)", "cpu"},
  };
  for (const OptionSpec& o : layout_options(1, 1)) s.options.push_back(o);
  return s;
}

}  // namespace

int cmd_replay(const std::vector<std::string>& argv) {
  const CommandSpec spec = replay_spec();
  auto parsed = parse_args(spec, argv);
  if (!parsed.ok()) return report_error("replay", parsed.status());
  const ParsedArgs& args = *parsed;
  if (args.help()) {
    std::fputs(command_help(spec).c_str(), stdout);
    return 0;
  }
  auto fail = [](const Status& s) { return report_error("replay", s); };
  if (!args.has("--out")) return fail(invalid_argument("--out RESULT is required"));
  auto device = args.get_choice("--device", "cpu", {"cpu", "cuda"});
  if (!device.ok()) return fail(device.status());
  auto page_size = args.get_int("--page-size", 64, 1, 1 << 20);
  auto threads = args.get_int("--threads", 0, 0, 1024);
  auto page_seed = args.get_int("--page-seed", 24301, 0, INT64_MAX);
  auto out_dtype = args.get_choice("--out-dtype", "f32", {"f32", "bf16"});
  for (const Status& s : {page_size.status(), threads.status(), page_seed.status(), out_dtype.status()}) {
    if (!s.ok()) return fail(s);
  }

  auto layout = read_layout(args, 1, 1);
  if (!layout.ok()) return fail(layout.status());
  const std::string case_path = args.positionals()[0];
  auto c = case_read(case_path);
  if (!c.ok()) return fail(c.status());

  std::unique_ptr<Backend> backend;
  if (*device == "cuda" && layout->num_ranks() > 1) {
    return fail(unsupported("--device cuda replays the single-device layout only (--pcp 1 --dcp 1) for now: "
                            "the in-process CP communicator copies rank buffers with host memcpy"));
  }
  if (*device == "cuda") {
    auto cuda = make_cuda_backend(0);
    if (!cuda.ok()) return fail(cuda.status().with_context("--device cuda"));
    backend = std::move(cuda).value();
  } else {
    backend = make_cpu_backend(static_cast<int>(*threads));
  }
  ReplayOptions options;
  options.page_size = static_cast<int32_t>(*page_size);
  options.out_dtype = *out_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  options.page_shuffle_seed = static_cast<uint64_t>(*page_seed);
  options.layout = *layout;
  auto result = replay_case(*backend, *c, options);
  if (!result.ok()) return fail(result.status().with_context(case_path));
  const std::string out_path = *args.get("--out");
  if (Status s = result_write(out_path, *result); !s.ok()) return fail(s);
  std::fprintf(stderr, "dsacp replay: %lld tokens, %zu requests, K=%d, P=%d x D=%d -> %s\n",
               static_cast<long long>(c->num_tokens()), c->requests.size(), c->topk, layout->P, layout->D,
               out_path.c_str());
  return 0;
}

}  // namespace dsacp::cli
