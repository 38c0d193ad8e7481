// dsacp_bench_gpu's forward-pass case: `layers` planned decode layers on one GPU, eagerly and as one graph replay.
#pragma once

#include <cstdint>

namespace dsacp::bench {

struct LayerStackTiming {
  double eager_ms = 0;           // the pass, launched layer by layer (median)
  double graph_ms = 0;           // the pass as one graph replay (median)
  double host_us_per_layer = 0;  // host time of one eager planned run (its launches)
  double plan_us = 0;            // step_plan, once per pass
  double empty_launch_us = 0;    // one empty kernel launch's host time on the same stream (the floor a launch)
  bool identical = false;        // the replay's outputs equal the eager ones bit for bit
};

// b decodes of ctx tokens (H=128, K=2048, bf16, page 64); `distinct_caches` caches, layer l using l % distinct.
// call_trace: the backend prints every call's count and host time when it goes (CudaBackendOptions::call_trace).
LayerStackTiming bench_layer_stack(int32_t b, int32_t ctx, int layers, int distinct_caches, int reps,
                                   bool call_trace = false);

}  // namespace dsacp::bench
