// The CLI's subcommands; each returns the process exit code (0 ok, 1 failure, 2 usage error).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "args.h"
#include "dsacp/backend.h"
#include "dsacp/cp_step.h"

namespace dsacp::cli {

int cmd_run(const std::vector<std::string>& args);
int cmd_replay(const std::vector<std::string>& args);
int cmd_make_case(const std::vector<std::string>& args);
int cmd_plan(const std::vector<std::string>& args);

// The layout options of replay and run (--pcp, --dcp, --interleave, --indexer, --dsa-cp, --pcp-decode) and
// their reading, with the command's default P and D.
std::vector<OptionSpec> layout_options(int32_t default_P, int32_t default_D);
Result<CpLayout> read_layout(const ParsedArgs& args, int32_t default_P, int32_t default_D);

// The backends of a layout's ranks: ranks[cr] runs CP rank cr. --device cpu: one CPU backend for every rank;
// --device cuda: one GPU per rank (rank cr on GPU cr; NCCL between them) or, with --gpus 1, every rank on GPU 0.
struct RankBackends {
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> ranks;
  std::string description;
};
OptionSpec gpus_option();
// --max-memory BYTES (run, replay): the most host memory a job may plan to take (its estimate before any
// allocation); without it, what the host has available.
OptionSpec max_memory_option();
// --cuda-timeline, --cuda-trace (run, replay): the CUDA backend's diagnostics (CudaBackendOptions), printed to
// stderr when the backends go.
std::vector<OptionSpec> cuda_diagnostic_options();
CudaBackendOptions read_cuda_options(const ParsedArgs& args);
// gpus = 0: the default (one per rank when the machine has enough GPUs).
Result<RankBackends> make_rank_backends(const std::string& device, int64_t gpus, const CpLayout& layout, int threads,
                                        const CudaBackendOptions& cuda_options = {});

// Prints "dsacp <cmd>: error: <message>" to stderr and returns the exit code for the status
// (2 for invalid arguments, 1 otherwise).
int report_error(const std::string& command, const Status& status);
// The exit code report_error would return, without printing (for MPI ranks other than the one that reports).
int report_error_code(const Status& status);

}  // namespace dsacp::cli
