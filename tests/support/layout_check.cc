#include "support/layout_check.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dsacp/random.h"

namespace dsacp::testing {

std::vector<Request> random_cp_batch(uint64_t seed, int32_t P, int32_t K, bool decode_only) {
  std::vector<Request> r;
  const int nd = (decode_only ? 2 : 0) + static_cast<int>(counter_hash(seed, 1, 0) % 4);
  for (int i = 0; i < nd; ++i) {
    r.push_back({1 + static_cast<int32_t>(counter_hash(seed, 2, i) % 4),
                 1 + static_cast<int32_t>(counter_hash(seed, 3, i) % (4 * K))});
  }
  if (decode_only) return r;
  const int32_t lens[] = {1, 2 * P - 1, 2 * P, 17, 61};
  const int np = 1 + static_cast<int>(counter_hash(seed, 4, 0) % 3);
  for (int i = 0; i < np; ++i) {
    const int32_t q = std::max(1, lens[counter_hash(seed, 5, i) % 5]);
    const bool chunked = counter_hash(seed, 6, i) % 2;
    r.push_back({q, chunked ? static_cast<int32_t>(counter_hash(seed, 7, i) % (2 * K)) : 0});
  }
  return r;
}

void expect_same_as_one_device(const CaseFile& c, const ReplayOptions& one, const ReplayOptions& cp, double out_tol) {
  auto backend = make_cpu_backend(2);
  auto want = replay_case(*backend, c, one);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  auto got = replay_case(*backend, c, cp);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  ASSERT_EQ(got->topk_indices.nbytes(), want->topk_indices.nbytes());
  EXPECT_EQ(0, std::memcmp(got->topk_indices.data(), want->topk_indices.data(), want->topk_indices.nbytes()))
      << "top-k rows differ from one device";
  double err2 = 0, ref2 = 0;
  for (int64_t i = 0; i < want->out.numel(); ++i) {
    const double a = got->out.get_f32(i), b = want->out.get_f32(i);
    err2 += (a - b) * (a - b);
    ref2 += b * b;
  }
  EXPECT_LT(std::sqrt(err2 / ref2), out_tol);
  for (int64_t i = 0; i < want->lse.numel(); ++i) {
    ASSERT_NEAR(got->lse.get_f32(i), want->lse.get_f32(i), 1e-5 * std::max(1.0f, std::fabs(want->lse.get_f32(i))))
        << "lse " << i;
  }
}

StepConfig f32_step_config(const CaseFile& c, int32_t decode_threshold) {
  StepConfig sc = step_config_of(c.dims, c.topk, c.scale, DType::kF32);
  sc.decode_threshold = decode_threshold;
  return sc;
}

HostStepInputs case_inputs(const CaseFile& c) {
  return {&c.q_nope, &c.q_rope, &c.kv_latent, &c.k_rope, &c.idx_q, &c.idx_w, &c.idx_k};
}

}  // namespace dsacp::testing
