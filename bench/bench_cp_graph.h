// dsacp_bench_cp's graph-replayed decode layers (bench_cp_graph.cc): a forward pass's layers planned once per
// pass and captured into one CUDA graph, on one GPU (step_plan / step_run) and on a CP layout's ranks over NCCL
// (cp_step_plan with enqueue_only / cp_step_run, every rank capturing and replaying at once).
#pragma once

#include <memory>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/batch.h"
#include "dsacp/cp_plan.h"
#include "dsacp/step.h"

namespace dsacp::bench::cp {

// Device milliseconds a layer (the graph's replay time / layers, CUDA events on the stream, median of reps).
double one_gpu_graph_layer_ms(Backend& be, const StepConfig& c, const std::vector<Request>& requests, int layers,
                              int reps);
// The same on the ranks of `layout` (rank cr on GPU cr): a replay's time is the slowest rank's.
double cp_graph_layer_ms(std::vector<std::unique_ptr<Backend>>& gpus, const StepConfig& c,
                         const std::vector<Request>& requests, const CpLayout& layout, int layers, int reps);

}  // namespace dsacp::bench::cp
