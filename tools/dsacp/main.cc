// dsacp: DeepSeek Sparse Attention with context parallelism — command-line tool.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "commands.h"
#include "dsacp/nccl_communicator.h"

namespace dsacp::cli {

std::vector<OptionSpec> layout_options(int32_t default_P, int32_t default_D) {
  return {
      {"--pcp", "N",
       "prefill context parallel ranks (P; threads of this process, or MPI processes with --launcher mpi)",
       std::to_string(default_P)},
      {"--dcp", "N", "decode context parallel ranks inside each PCP rank (D); P*D ranks in all",
       std::to_string(default_D)},
      {"--interleave", "N", "KV interleave: consecutive positions per shard unit (0 = the page size)", "0"},
      {"--indexer", "sharded|replicated",
       "indexer keys sharded like the KV (exact merge of per-rank top-k) or stored on every rank", "sharded"},
      {"--dsa-cp", "", "DCP ranks split tokens (all heads each) instead of heads (needs --pcp 1)", ""},
      {"--comm-timeout", "S", "seconds a rank waits in a collective before failing (a dead or hung peer)", "600"},
      {"--pcp-decode", "local|gathered",
       "decodes: local attention + LSE merge, or over the gathered KV (reference design; D = 1 only)", "local"},
      {"--nccl-window-mb", "N",
       "NCCL ranks: MiB of each rank's exchange window (the DCP decode's zero-copy exchanges); 0 = none, every "
       "exchange through NCCL collectives", "32"},
      {"--nccl-peer-exchange-mb", "N",
       "NCCL ranks: MiB of device memory for dsacp's own peer exchange of small collectives; 0 = off", "0"},
  };
}

OptionSpec max_memory_option() {
  return {"--max-memory", "BYTES",
          "most host memory the job may plan to take, e.g. 8G (K, M, G, T: powers of 1024); a job estimated "
          "above it, or above what the host has available, is refused before it allocates",
          "what is available"};
}

std::vector<OptionSpec> cuda_diagnostic_options() {
  return {
      {"--cuda-timeline", "",
       "--device cuda: print, for the last step on each GPU, when each backend call and collective was issued "
       "and when the GPU ran it",
       ""},
      {"--cuda-trace", "", "--device cuda: print every backend call's count and host time", ""},
  };
}

CudaBackendOptions read_cuda_options(const ParsedArgs& args) {
  CudaBackendOptions o;
  o.timeline = args.has("--cuda-timeline");
  o.call_trace = args.has("--cuda-trace");
  return o;
}

Result<CpLayout> read_layout(const ParsedArgs& args, int32_t default_P, int32_t default_D) {
  CpLayout layout;
  DSACP_ASSIGN_OR_RETURN(int64_t P, args.get_int("--pcp", default_P, 1, 1024));
  DSACP_ASSIGN_OR_RETURN(int64_t D, args.get_int("--dcp", default_D, 1, 1024));
  if (P * D > 1024) return invalid_argument("--pcp x --dcp must be at most 1024 ranks, got " + std::to_string(P * D));
  DSACP_ASSIGN_OR_RETURN(int64_t I, args.get_int("--interleave", 0, 0, 1 << 30));
  DSACP_ASSIGN_OR_RETURN(std::string indexer, args.get_choice("--indexer", "sharded", {"sharded", "replicated"}));
  DSACP_ASSIGN_OR_RETURN(std::string mode, args.get_choice("--pcp-decode", "local", {"local", "gathered"}));
  layout.P = static_cast<int32_t>(P);
  layout.D = static_cast<int32_t>(D);
  layout.interleave = static_cast<int32_t>(I);
  layout.indexer = indexer == "sharded" ? IndexerMode::kSharded : IndexerMode::kReplicated;
  layout.dsa_cp = args.has("--dsa-cp");
  layout.decode_mode = mode == "local" ? DecodeMode::kLocalMerge : DecodeMode::kGathered;
  DSACP_ASSIGN_OR_RETURN(int64_t timeout_s, args.get_int("--comm-timeout", 600, 1, 86400));
  layout.comm_timeout_ms = timeout_s * 1000;
  DSACP_ASSIGN_OR_RETURN(int64_t window_mb, args.get_int("--nccl-window-mb", 32, 0, 4096));
  DSACP_ASSIGN_OR_RETURN(int64_t exchange_mb, args.get_int("--nccl-peer-exchange-mb", 0, 0, 4096));
  layout.nccl_window_bytes = static_cast<size_t>(window_mb) << 20;
  layout.nccl_peer_exchange_bytes = static_cast<size_t>(exchange_mb) << 20;
  return layout;
}

int report_error(const std::string& command, const Status& status) {
  // One line of bounded length whatever a message carries (names are cut where they are quoted; this is the
  // last guard): the head and the tail of a longer one, joined by "...".
  constexpr size_t kMaxLine = 600;
  std::string text = status.to_string();
  for (char& ch : text) ch = ch == '\n' || ch == '\r' ? ' ' : ch;
  if (text.size() > kMaxLine) text = text.substr(0, kMaxLine - 203) + " ... " + text.substr(text.size() - 198);
  std::fprintf(stderr, "dsacp %s: error: %s\n", command.c_str(), text.c_str());
  return report_error_code(status);
}

int report_error_code(const Status& status) {
  return status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kUnsupported ? 2 : 1;
}

namespace {

const char* kTopHelp =
    "dsacp — DeepSeek Sparse Attention with context parallelism\n"
    "\n"
    "usage: dsacp <command> [options]\n"
    "\n"
    "commands:\n"
    "  run        the main job: a synthetic long-context serving workload (chunked prefill, then MTP decode)\n"
    "             through the step executor, verified against direct fp64 math\n"
    "  replay     run one batch step stored in a case file and write the result file (contract §4)\n"
    "  make-case  write a random case file (for replay, tests and bug reports)\n"
    "  plan       pick the context-parallel layout for a model, a context and a cluster from the calibrated\n"
    "             cost model (TTFT, TPOT, KV a GPU), or predict one step's cost\n"
    "\n"
    "Run 'dsacp <command> --help' for a command's options.\n";

}  // namespace
}  // namespace dsacp::cli

int main(int argc, char** argv) {
  using namespace dsacp::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kTopHelp, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  // A write past the file-size limit (ulimit -f) then fails with EFBIG, reported as an error, instead of
  // SIGXFSZ ending the process without a word.
  std::signal(SIGXFSZ, SIG_IGN);
  // After a failure across GPUs, NCCL aborts may still run on helper threads: end without tearing NCCL and the
  // CUDA runtime down under them.
  auto finish = [](int code) {
    if (dsacp::nccl_background_threads() > 0) {
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(code);
    }
    return code;
  };
  try {
    if (cmd == "run") return finish(cmd_run(args));
    if (cmd == "replay") return finish(cmd_replay(args));
    if (cmd == "make-case") return cmd_make_case(args);
    if (cmd == "plan") return cmd_plan(args);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "dsacp %s: error: resource exhausted: out of host memory (an allocation failed)\n", cmd.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsacp %s: internal error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "dsacp: unknown command \"%s\" (commands: run, replay, make-case, plan; see dsacp --help)\n",
               cmd.c_str());
  return 2;
}
