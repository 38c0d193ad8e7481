#include "workload.h"

#include "core/parallel.h"
#include "dsacp/random.h"

namespace dsacp::cli {

float WorkloadValues::value(Stream s, int32_t request, int64_t pos, int64_t i) const {
  int64_t width = 0;
  switch (s) {
    case kLatent: width = dims_.Dl; break;
    case kRope: width = dims_.Dr; break;
    case kIndexKey: width = dims_.Di; break;
    case kQNope: width = int64_t{dims_.H} * dims_.Dl; break;
    case kQRope: width = int64_t{dims_.H} * dims_.Dr; break;
    case kIndexQ: width = int64_t{dims_.Hi} * dims_.Di; break;
    case kIndexW: width = dims_.Hi; break;
  }
  const uint64_t stream = (static_cast<uint64_t>(request) << 8) | s;
  const float v = counter_uniform(seed_, stream, static_cast<uint64_t>(pos * width + i));
  return s == kIndexW || dtype_ == DType::kF32 ? v : round_to_bf16(v);
}

Result<StepTensors> make_step_tensors(const WorkloadValues& values, const std::vector<StepSlice>& slices,
                                      int num_threads) {
  const WorkloadDims& d = values.dims();
  const DType a = values.dtype();
  int64_t T = 0;
  std::vector<int64_t> row_request, row_pos;
  for (const StepSlice& s : slices) {
    for (int32_t i = 0; i < s.count; ++i) {
      row_request.push_back(s.request);
      row_pos.push_back(s.first_pos + i);
    }
    T += s.count;
  }
  StepTensors t;
  DSACP_ASSIGN_OR_RETURN(t.q_nope, Tensor::zeros(a, {T, d.H, d.Dl}));
  DSACP_ASSIGN_OR_RETURN(t.q_rope, Tensor::zeros(a, {T, d.H, d.Dr}));
  DSACP_ASSIGN_OR_RETURN(t.kv_latent, Tensor::zeros(a, {T, d.Dl}));
  DSACP_ASSIGN_OR_RETURN(t.k_rope, Tensor::zeros(a, {T, d.Dr}));
  DSACP_ASSIGN_OR_RETURN(t.idx_q, Tensor::zeros(a, {T, d.Hi, d.Di}));
  DSACP_ASSIGN_OR_RETURN(t.idx_w, Tensor::zeros(DType::kF32, {T, d.Hi}));
  DSACP_ASSIGN_OR_RETURN(t.idx_k, Tensor::zeros(a, {T, d.Di}));
  struct Fill {
    Tensor* tensor;
    WorkloadValues::Stream stream;
  };
  Fill fills[] = {{&t.q_nope, WorkloadValues::kQNope},    {&t.q_rope, WorkloadValues::kQRope},
                  {&t.kv_latent, WorkloadValues::kLatent}, {&t.k_rope, WorkloadValues::kRope},
                  {&t.idx_q, WorkloadValues::kIndexQ},     {&t.idx_w, WorkloadValues::kIndexW},
                  {&t.idx_k, WorkloadValues::kIndexKey}};
  parallel_for(T, num_threads, 16, [&](int64_t begin, int64_t end) {
    for (const Fill& f : fills) {
      const int64_t width = T == 0 ? 0 : f.tensor->numel() / T;
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < width; ++i) {
          f.tensor->set_f32(r * width + i,
                            values.value(f.stream, static_cast<int32_t>(row_request[r]), row_pos[r], i));
        }
      }
    }
  });
  return t;
}

}  // namespace dsacp::cli
