// Shared by the layout tests: random CP batches and the comparison of a layout against one device.
#pragma once

#include <cstdint>
#include <vector>

#include "dsacp/batch.h"
#include "dsacp/case_file.h"
#include "dsacp/replay.h"
#include "dsacp/step.h"

namespace dsacp::testing {

// MTP decodes of unequal lengths (at least two when decode_only); unless decode_only, fresh prefills of 1,
// 2P-1, 2P, odd and long lengths and chunked prefills with context. Contexts below and above K.
std::vector<Request> random_cp_batch(uint64_t seed, int32_t P, int32_t K, bool decode_only);

// Replays `c` with `one` and with `cp`: top-k rows bit-identical, out within 1e-5 relative (norm), lse
// within 1e-5 (relative for |lse| > 1). Failures are reported through GoogleTest.
// out_tol: the relative norm error allowed (fp32 rounding by default; bf16 outputs: the contract's 1e-2).
void expect_same_as_one_device(const CaseFile& c, const ReplayOptions& one, const ReplayOptions& cp,
                               double out_tol = 1e-5);

// A step config for an F32 case (its dims, topk and scale), and the case's new-token tensors as step inputs.
StepConfig f32_step_config(const CaseFile& c, int32_t decode_threshold = kMaxDecodeThreshold);
HostStepInputs case_inputs(const CaseFile& c);

}  // namespace dsacp::testing
