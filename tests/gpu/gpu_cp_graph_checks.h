// The CP rank's planned step captured into a CUDA graph over NCCL (gpu_cp_graph_checks.cc): needs 2 GPUs.
#pragma once

#include "gpu/check_log.h"

namespace dsacp::testing {

// Skips (one line on stdout) with fewer than 2 GPUs or without NCCL.
void gpu_cp_graph_checks(CheckLog& log);

}  // namespace dsacp::testing
