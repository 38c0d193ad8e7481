// The synthetic serving workload of `dsacp run`: counter-based values per (request, position), so any
// token's inputs and any cached key can be regenerated exactly for verification.
#pragma once

#include <cstdint>
#include <vector>

#include "dsacp/batch.h"
#include "dsacp/dtype.h"
#include "dsacp/step.h"
#include "dsacp/tensor.h"

namespace dsacp::cli {

struct WorkloadDims {
  int32_t H = 16, Dl = 512, Dr = 64, Hi = 16, Di = 128, K = 512;
  CaseDims dims() const { return CaseDims{H, Dl, Dr, Hi, Di}; }
};

// Values in [-1, 1), rounded to `dtype` (except idx_w, always f32).
class WorkloadValues {
 public:
  WorkloadValues(uint64_t seed, WorkloadDims dims, DType dtype) : seed_(seed), dims_(dims), dtype_(dtype) {}
  enum Stream : uint32_t { kLatent = 1, kRope, kIndexKey, kQNope, kQRope, kIndexQ, kIndexW };
  float value(Stream s, int32_t request, int64_t pos, int64_t i) const;  // i = element within the token's row
  const WorkloadDims& dims() const { return dims_; }
  DType dtype() const { return dtype_; }

 private:
  uint64_t seed_;
  WorkloadDims dims_;
  DType dtype_;
};

// One step's tokens: (request id in the workload, first position, count), in batch order.
struct StepSlice {
  int32_t request;
  int64_t first_pos;
  int32_t count;
};

struct StepTensors {
  Tensor q_nope, q_rope, kv_latent, k_rope, idx_q, idx_w, idx_k;
  HostStepInputs inputs() const { return {&q_nope, &q_rope, &kv_latent, &k_rope, &idx_q, &idx_w, &idx_k}; }
};

Result<StepTensors> make_step_tensors(const WorkloadValues& values, const std::vector<StepSlice>& slices,
                                      int num_threads);

}  // namespace dsacp::cli
