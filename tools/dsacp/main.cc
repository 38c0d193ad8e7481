// dsacp: DeepSeek Sparse Attention with context parallelism — command-line tool.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"

namespace dsacp::cli {

std::map<std::string, std::string> layout_flags_not_yet() {
  const std::string single = "is not available yet: this release runs the single-device layout only";
  return {
      {"--pcp", single + " (prefill context parallelism comes in a later release)"},
      {"--dcp", single + " (decode context parallelism comes in a later release)"},
      {"--interleave", single + " (KV interleave applies to context parallel layouts, which come in a later release)"},
      {"--indexer", single + " (indexer modes apply to decode context parallelism, which comes in a later release)"},
      {"--dsa-cp", single + " (DSA-CP comes in a later release)"},
  };
}

int report_error(const std::string& command, const Status& status) {
  std::fprintf(stderr, "dsacp %s: error: %s\n", command.c_str(), status.to_string().c_str());
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
  try {
    if (cmd == "run") return cmd_run(args);
    if (cmd == "replay") return cmd_replay(args);
    if (cmd == "make-case") return cmd_make_case(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsacp %s: internal error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "dsacp: unknown command \"%s\" (commands: run, replay, make-case; see dsacp --help)\n",
               cmd.c_str());
  return 2;
}
