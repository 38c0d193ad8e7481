// dsacp replay CASE --out RESULT: one batch step from a case file (contract §4).
#include <chrono>
#include <cstdio>
#include <string>

#include "commands.h"
#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/mpi_context.h"
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
      {"--launcher", "threads|mpi",
       "CP ranks as threads of this process, or one rank per MPI process (run under mpirun -np P*D; CPU only)",
       "threads"},
  };
  for (const OptionSpec& o : layout_options(1, 1)) s.options.push_back(o);
  return s;
}

// --launcher mpi: this process is CP rank cr = MPI world rank (r = cr / D, d = cr % D). Errors every process
// meets alike (the world size, the case file) are reported by rank 0 and every process returns; an error of
// one rank after the communicators exist aborts the MPI job, so no peer waits for it.
int replay_mpi(const std::string& case_path, const std::string& out_path, const ReplayOptions& options, int threads) {
  auto fail = [](const Status& s) { return report_error("replay", s); };
  const CpLayout& layout = options.layout;
  auto mpi = MpiContext::init(std::chrono::milliseconds(layout.comm_timeout_ms));
  if (!mpi.ok()) return fail(mpi.status());
  MpiContext& ctx = **mpi;
  const bool leader = ctx.rank() == 0;
  if (ctx.size() != layout.num_ranks()) {
    const Status s = invalid_argument(
        "--launcher mpi: the MPI world has " + std::to_string(ctx.size()) +
        " processes, the layout P=" + std::to_string(layout.P) + " x D=" + std::to_string(layout.D) + " needs " +
        std::to_string(layout.num_ranks()) + " (mpirun -np " + std::to_string(layout.num_ranks()) + ")");
    return leader ? fail(s) : report_error_code(s);
  }
  auto c = case_read(case_path);
  if (!c.ok()) return leader ? fail(c.status()) : report_error_code(c.status());
  const int32_t cr = ctx.rank();
  auto world = ctx.world();
  if (!world.ok()) return fail(world.status());
  auto pcp = ctx.split(cr % layout.D, cr / layout.D);  // same d, ranked by r
  if (!pcp.ok()) return fail(pcp.status());
  auto dcp = ctx.split(cr / layout.D, cr % layout.D);  // same r, ranked by d
  if (!dcp.ok()) return fail(dcp.status());
  const CpComms comms{world->get(), pcp->get(), dcp->get()};
  auto abort_with = [&](const Status& s) {
    const int code = fail(s);
    comms.world->abort("rank " + std::to_string(cr) + ": " + s.to_string());
    return code;
  };

  std::unique_ptr<Backend> backend = make_cpu_backend(threads);
  auto result = replay_case_rank(*backend, *c, options, comms);
  if (!result.ok()) return abort_with(result.status().with_context(case_path + ", CP rank " + std::to_string(cr)));
  if (leader) {
    if (Status s = result_write(out_path, *result); !s.ok()) return abort_with(s);
    std::fprintf(stderr, "dsacp replay: %lld tokens, %zu requests, K=%d, P=%d x D=%d (MPI, %d processes) -> %s\n",
                 static_cast<long long>(c->num_tokens()), c->requests.size(), c->topk, layout.P, layout.D, ctx.size(),
                 out_path.c_str());
  }
  // Every process leaves together: no rank finalizes MPI while rank 0 is still writing.
  if (Status s = comms.world->barrier(); !s.ok()) return abort_with(s);
  return 0;
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

  auto launcher = args.get_choice("--launcher", "threads", {"threads", "mpi"});
  if (!launcher.ok()) return fail(launcher.status());
  auto layout = read_layout(args, 1, 1);
  if (!layout.ok()) return fail(layout.status());
  ReplayOptions options;
  options.page_size = static_cast<int32_t>(*page_size);
  options.out_dtype = *out_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  options.page_shuffle_seed = static_cast<uint64_t>(*page_seed);
  options.layout = *layout;
  const std::string case_path = args.positionals()[0];
  const std::string out_path = *args.get("--out");
  if (*launcher == "mpi") {
    if (*device != "cpu") return fail(unsupported("--launcher mpi runs CPU ranks only (--device cpu)"));
    return replay_mpi(case_path, out_path, options, static_cast<int>(*threads));
  }

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
  auto result = replay_case(*backend, *c, options);
  if (!result.ok()) return fail(result.status().with_context(case_path));
  if (Status s = result_write(out_path, *result); !s.ok()) return fail(s);
  std::fprintf(stderr, "dsacp replay: %lld tokens, %zu requests, K=%d, P=%d x D=%d -> %s\n",
               static_cast<long long>(c->num_tokens()), c->requests.size(), c->topk, layout->P, layout->D,
               out_path.c_str());
  return 0;
}

}  // namespace dsacp::cli
