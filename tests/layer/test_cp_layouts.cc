// DCP, both indexer modes, DSA-CP and hybrid P x D layouts on random batches against one device: top-k rows
// bit-identical, outputs within fp32 rounding (contract §3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <string>

#include "dsacp/case_file.h"
#include "dsacp/random.h"
#include "dsacp/replay.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

struct LayoutCase {
  CpLayout layout;
  int32_t page_size;
  DType dtype;
  bool decode_only;
  uint64_t seed;
};

std::string layout_case_name(const LayoutCase& c) {
  const CpLayout& l = c.layout;
  return "P" + std::to_string(l.P) + "_D" + std::to_string(l.D) + "_I" + std::to_string(l.interleave) + "_" +
         (l.indexer == IndexerMode::kSharded ? "sharded" : "replicated") + (l.dsa_cp ? "_dsacp" : "") + "_ps" +
         std::to_string(c.page_size) + "_" + dtype_name(c.dtype) + (c.decode_only ? "_decodes" : "_mixed") + "_seed" +
         std::to_string(c.seed);
}

// MTP decodes of unequal lengths; unless decode_only, fresh prefills of 1, 2P-1, 2P, odd and long lengths and
// chunked prefills with context. Contexts below and above K.
std::vector<Request> random_batch(uint64_t seed, int32_t P, int32_t K, bool decode_only) {
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

void PrintTo(const LayoutCase& c, std::ostream* os) { *os << layout_case_name(c); }

class CpLayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(CpLayoutTest, SameResultsAsOneDevice) {
  const LayoutCase& lc = GetParam();
  const uint64_t seed = testing::test_seed(lc.seed);
  CaseGenSpec spec;
  spec.topk = 24;
  spec.requests = random_batch(seed, lc.layout.P, spec.topk, lc.decode_only);
  spec.dims = CaseDims{8, 24, 8, 2, 16};
  spec.scale = 0.3f;
  spec.dtype = lc.dtype;
  spec.seed = seed;
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto backend = make_cpu_backend(2);
  ReplayOptions one;
  one.page_size = lc.page_size;
  auto want = replay_case(*backend, *c, one);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  ReplayOptions cp = one;
  cp.layout = lc.layout;
  cp.page_shuffle_seed = seed * 7 + 1;
  auto got = replay_case(*backend, *c, cp);
  ASSERT_TRUE(got.ok()) << got.status().to_string();

  EXPECT_EQ(0, std::memcmp(got->topk_indices.data(), want->topk_indices.data(), want->topk_indices.nbytes()))
      << "top-k rows differ from one device";
  double err2 = 0, ref2 = 0;
  for (int64_t i = 0; i < want->out.numel(); ++i) {
    const double a = got->out.get_f32(i), b = want->out.get_f32(i);
    err2 += (a - b) * (a - b);
    ref2 += b * b;
  }
  EXPECT_LT(std::sqrt(err2 / ref2), 1e-5);
  for (int64_t i = 0; i < want->lse.numel(); ++i) {
    ASSERT_NEAR(got->lse.get_f32(i), want->lse.get_f32(i), 1e-5 * std::max(1.0f, std::fabs(want->lse.get_f32(i))))
        << "lse " << i;
  }
}

std::vector<LayoutCase> layout_cases() {
  std::vector<LayoutCase> v;
  uint64_t seed = 101;
  const int32_t ps = 4;
  for (int32_t D : {2, 4, 8}) {
    for (int32_t I : {1, 3, ps}) {
      for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
        CpLayout l;
        l.D = D;
        l.interleave = I;
        l.indexer = mode;
        v.push_back({l, ps, I == 3 ? DType::kBF16 : DType::kF32, (seed % 2) == 0, seed});
        ++seed;
      }
    }
    CpLayout dsa;
    dsa.D = D;
    dsa.dsa_cp = true;
    dsa.interleave = D == 4 ? 3 : 0;
    for (bool decode_only : {true, false}) {
      for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
        dsa.indexer = mode;
        v.push_back({dsa, ps, DType::kF32, decode_only, seed++});
      }
    }
  }
  for (auto [P, D] : {std::pair{2, 2}, std::pair{2, 4}, std::pair{4, 2}}) {
    for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
      for (int32_t I : {1, ps}) {
        CpLayout l;
        l.P = P;
        l.D = D;
        l.interleave = I;
        l.indexer = mode;
        v.push_back({l, ps, DType::kF32, false, seed++});
        v.push_back({l, ps, DType::kBF16, true, seed++});
      }
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, CpLayoutTest, ::testing::ValuesIn(layout_cases()),
                         [](const auto& info) { return layout_case_name(info.param); });

}  // namespace
}  // namespace dsacp
