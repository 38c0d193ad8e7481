// DCP, both indexer modes, DSA-CP and hybrid P x D layouts on random batches against one device: top-k rows
// bit-identical, outputs within fp32 rounding (contract §3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <string>

#include "dsacp/case_file.h"
#include "dsacp/random.h"
#include "dsacp/replay.h"
#include "support/layout_check.h"
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

void PrintTo(const LayoutCase& c, std::ostream* os) { *os << layout_case_name(c); }

// A random CP batch of this file's shape (K=24, Dl=24, Dr=8, Hi=2, Di=16) with H heads, for P PCP ranks.
Result<CaseFile> cp_case(uint64_t seed, int32_t H, int32_t P, bool decode_only, DType dtype) {
  CaseGenSpec spec;
  spec.topk = 24;
  spec.requests = testing::random_cp_batch(seed, P, spec.topk, decode_only);
  spec.dims = CaseDims{H, 24, 8, 2, 16};
  spec.scale = 0.3f;
  spec.dtype = dtype;
  spec.seed = seed;
  return case_generate(spec);
}

class CpLayoutTest : public ::testing::TestWithParam<LayoutCase> {};

TEST_P(CpLayoutTest, SameResultsAsOneDevice) {
  const LayoutCase& lc = GetParam();
  const uint64_t seed = testing::test_seed(lc.seed);
  auto c = cp_case(seed, 8, lc.layout.P, lc.decode_only, lc.dtype);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ReplayOptions one;
  one.page_size = lc.page_size;
  ReplayOptions cp = one;
  cp.layout = lc.layout;
  cp.page_shuffle_seed = seed * 7 + 1;
  testing::expect_same_as_one_device(*c, one, cp);
}

// The local decodes on the direct path (head blocks) and on the packed path (CpLayout::decode_head_blocks off),
// each against one device.
void expect_both_decode_paths_same_as_one_device(const CaseFile& c, const ReplayOptions& one, const ReplayOptions& cp,
                                                 double out_tol = 1e-5) {
  testing::expect_same_as_one_device(c, one, cp, out_tol);
  ReplayOptions packed = cp;
  packed.layout.decode_head_blocks = false;
  testing::expect_same_as_one_device(c, one, packed, out_tol);
}

// H = 128 over D = 2: 64 heads per rank, so the local decodes take the direct path (attention reads the
// head-gathered queries in their block layout and writes its partials in the all-to-all's layout). Also with
// the direct path off (CpLayout::decode_head_blocks off): both match one device.
TEST(CpLayoutDirect, HeadBlockLayoutMatchesOneDeviceAndThePackedPath) {
  const uint64_t seed = testing::test_seed(977);
  auto c = cp_case(seed, 128, 1, /*decode_only=*/true, DType::kF32);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ReplayOptions one;
  one.page_size = 4;
  for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
    ReplayOptions cp = one;
    cp.layout.D = 2;
    cp.layout.indexer = mode;
    cp.page_shuffle_seed = seed * 7 + 1;
    expect_both_decode_paths_same_as_one_device(*c, one, cp);
  }
}

// With a bf16 output the local decodes' partials travel in bf16 (half the all-to-all's bytes): both paths stay
// within the contract's bf16 tolerance of one device, the top-k rows identical, the LSE (f32) within 1e-5.
// The one-device output is bf16 too, so this measures the partials' extra rounding, not the output's.
TEST(CpLayoutDirect, Bf16PartialsStayWithinBf16Tolerance) {
  const uint64_t seed = testing::test_seed(979);
  auto c = cp_case(seed, 128, 1, /*decode_only=*/true, DType::kBF16);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ReplayOptions one;
  one.page_size = 4;
  one.out_dtype = DType::kBF16;
  for (int32_t D : {2, 4}) {
    ReplayOptions cp = one;
    cp.layout.D = D;
    cp.page_shuffle_seed = seed * 7 + 1;
    expect_both_decode_paths_same_as_one_device(*c, one, cp, 1e-2);
  }
}

// StepInputs::block_table (the table kept in backend memory, as a serving engine keeps it): every executor
// path reads it instead of uploading the host table, with the same results as one device over the host table.
TEST(CpLayoutDeviceTable, EveryLayoutReadsTheDeviceTable) {
  const uint64_t seed = testing::test_seed(983);
  auto c = cp_case(seed, 8, 2, /*decode_only=*/false, DType::kF32);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ReplayOptions one;
  one.page_size = 4;
  struct L {
    int32_t P, D;
    bool dsa;
    IndexerMode mode;
  };
  for (const L& l : {L{1, 1, false, IndexerMode::kSharded}, L{1, 2, false, IndexerMode::kSharded},
                     L{1, 2, false, IndexerMode::kReplicated}, L{2, 1, false, IndexerMode::kSharded},
                     L{2, 2, false, IndexerMode::kSharded}, L{1, 2, true, IndexerMode::kSharded}}) {
    ReplayOptions cp = one;
    cp.layout.P = l.P;
    cp.layout.D = l.D;
    cp.layout.dsa_cp = l.dsa;
    cp.layout.indexer = l.mode;
    cp.page_shuffle_seed = seed * 7 + 1;
    cp.device_block_table = true;
    SCOPED_TRACE("P" + std::to_string(l.P) + " D" + std::to_string(l.D) + (l.dsa ? " DSA-CP" : ""));
    testing::expect_same_as_one_device(*c, one, cp);
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

// The FP8 indexer (F8_E4M3 keys and queries, contract section 6) under every layout of the replicated indexer:
// PCP (the step's e4m3 key bytes and scales are all-gathered), DCP, hybrid, DSA-CP; top-k identical to one
// device, out within fp32 rounding. The sharded indexer: decode-only batches and DSA-CP the same; its prefill
// rows without DSA-CP refuse FP8 as unsupported.
TEST(CpLayoutFp8, LayoutsMatchOneDevice) {
  const uint64_t seed = testing::test_seed(0xf8);
  struct L {
    int32_t P, D, I;
    bool dsa_cp, decode_only;
    int32_t page_size;
  };
  for (const L& l : {L{2, 1, 0, false, false, 4}, L{1, 2, 0, false, true, 3}, L{2, 2, 1, false, false, 1},
                     L{1, 2, 0, true, false, 5}, L{3, 1, 2, false, false, 61}}) {
    SCOPED_TRACE("P" + std::to_string(l.P) + " D" + std::to_string(l.D) + (l.dsa_cp ? " dsa_cp" : ""));
    auto c = cp_case(seed + l.P * 10 + l.D, 8, l.P, l.decode_only, DType::kF32);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ASSERT_TRUE(case_quantize_index(*c).ok());
    ReplayOptions one;
    one.page_size = l.page_size;
    ReplayOptions cp = one;
    cp.layout.P = l.P;
    cp.layout.D = l.D;
    cp.layout.interleave = l.I;
    cp.layout.dsa_cp = l.dsa_cp;
    cp.layout.indexer = IndexerMode::kReplicated;
    cp.page_shuffle_seed = seed * 7 + 1;
    testing::expect_same_as_one_device(*c, one, cp);
  }
  for (const L& l : {L{2, 1, 0, false, true, 4}, L{1, 2, 0, false, true, 3}, L{2, 2, 1, false, true, 1},
                     L{1, 2, 0, true, false, 5}, L{1, 3, 0, true, true, 61}}) {
    SCOPED_TRACE("sharded P" + std::to_string(l.P) + " D" + std::to_string(l.D) + (l.dsa_cp ? " dsa_cp" : ""));
    auto c = cp_case(seed + 100 + l.P * 10 + l.D, 8, l.P, l.decode_only, DType::kF32);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    ASSERT_TRUE(case_quantize_index(*c).ok());
    ReplayOptions one;
    one.page_size = l.page_size;
    ReplayOptions cp = one;
    cp.layout.P = l.P;
    cp.layout.D = l.D;
    cp.layout.interleave = l.I;
    cp.layout.dsa_cp = l.dsa_cp;
    cp.page_shuffle_seed = seed * 5 + 3;
    testing::expect_same_as_one_device(*c, one, cp);
  }
  // A batch that surely holds a prefill (60 new tokens on 30 of context) beside a decode: its prefill rows read the
  // gathered view of the indexer pages, which FP8 does not support under the sharded indexer yet.
  CaseGenSpec spec;
  spec.topk = 24;
  spec.requests = {Request{1, 40}, Request{60, 30}};
  spec.dims = CaseDims{8, 24, 8, 2, 16};
  spec.scale = 0.3f;
  spec.seed = seed;
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(case_quantize_index(*c).ok());
  auto backend = make_cpu_backend(1);
  ReplayOptions sharded;
  sharded.layout.P = 2;
  Result<StepResult> r = replay_case(*backend, *c, sharded);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported) << r.status().message();
}

}  // namespace
}  // namespace dsacp
