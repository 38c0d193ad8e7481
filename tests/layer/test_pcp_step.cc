// PCP on random batches: for P in {1, 2, 3, 4, 8}, both decode modes and several interleaves, the top-k rows
// are bit-identical to one device, outputs within fp32 rounding, and each token's KV sits on its owner only.
#include <gtest/gtest.h>

#include <cmath>
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

struct PcpCase {
  int32_t P;
  int32_t interleave;  // 0 = page size
  DecodeMode mode;
  int32_t page_size;
  DType dtype;
  uint64_t seed;
};

std::string pcp_case_name(const PcpCase& c) {
  return "P" + std::to_string(c.P) + "_I" + std::to_string(c.interleave) + "_" +
         (c.mode == DecodeMode::kLocalMerge ? "local" : "gathered") + "_ps" + std::to_string(c.page_size) + "_" +
         dtype_name(c.dtype) + "_seed" + std::to_string(c.seed);
}

void PrintTo(const PcpCase& c, std::ostream* os) { *os << pcp_case_name(c); }

class PcpStepTest : public ::testing::TestWithParam<PcpCase> {};

TEST_P(PcpStepTest, SameResultsAsOneDevice) {
  const PcpCase& pc = GetParam();
  CaseGenSpec spec;
  spec.topk = 24;
  spec.requests = testing::random_cp_batch(testing::test_seed(pc.seed), pc.P, spec.topk, false);
  spec.dims = CaseDims{3, 24, 8, 2, 16};
  spec.scale = 0.3f;
  spec.dtype = pc.dtype;
  spec.seed = testing::test_seed(pc.seed);
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  ReplayOptions one;
  one.page_size = pc.page_size;
  ReplayOptions cp = one;
  cp.layout.P = pc.P;
  cp.layout.interleave = pc.interleave;
  cp.layout.decode_mode = pc.mode;
  cp.page_shuffle_seed = pc.seed * 7 + 1;
  testing::expect_same_as_one_device(*c, one, cp);
}

std::vector<PcpCase> pcp_cases() {
  std::vector<PcpCase> v;
  uint64_t seed = 11;
  for (int32_t P : {1, 2, 3, 4, 8}) {
    for (DecodeMode mode : {DecodeMode::kLocalMerge, DecodeMode::kGathered}) {
      v.push_back({P, 0, mode, 16, DType::kF32, seed++});
      v.push_back({P, 3, mode, 4, DType::kBF16, seed++});
    }
    v.push_back({P, 1, DecodeMode::kLocalMerge, 5, DType::kF32, seed++});
    v.push_back({P, 8, DecodeMode::kLocalMerge, 4, DType::kF32, seed++});  // interleave = 2 pages
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, PcpStepTest, ::testing::ValuesIn(pcp_cases()),
                         [](const auto& info) { return pcp_case_name(info.param); });

// Each real token's KV is stored on exactly its owner rank: the non-NaN rows of each rank's pools are its
// share of every request, and nothing else.
TEST(PcpStep, EachTokenStoredOnItsOwnerOnly) {
  for (int32_t P : {2, 3}) {
    for (int32_t I : {1, 4}) {
      const int32_t B = 4;
      std::vector<Request> reqs = {{2, 9}, {1, 5}, {13, 0}, {6, 7}};
      CpLayout layout;
      layout.P = P;
      layout.interleave = I;
      KvSharding s{P, I};
      PagedCacheConfig cc{64, B, 8, 4, 8, DType::kF32};
      auto backend = make_cpu_backend(1);
      auto cluster = LocalCpCluster::create(*backend, layout, cc);
      ASSERT_TRUE(cluster.ok());
      PageAllocator alloc(cc.num_pages, 3);
      std::vector<SequencePages> seqs(reqs.size());
      std::vector<const SequencePages*> ptrs;
      for (size_t b = 0; b < reqs.size(); ++b) {
        ASSERT_TRUE(seqs[b].reserve(alloc, s.local_len(reqs[b].seq_len(), 0), B).ok());
        ptrs.push_back(&seqs[b]);
      }
      BlockTable t = BlockTable::from_sequences(ptrs);
      CaseGenSpec spec;
      spec.requests = reqs;
      spec.dims = CaseDims{2, 8, 4, 2, 8};
      spec.topk = 6;
      auto c = case_generate(spec);
      ASSERT_TRUE(c.ok());
      ASSERT_TRUE((*cluster)->load_context(reqs, t, c->ctx_kv_latent, c->ctx_k_rope, c->ctx_idx_k).ok());
      const StepConfig sc = testing::f32_step_config(*c, /*decode_threshold=*/2);
      const HostStepInputs in = testing::case_inputs(*c);
      auto r = (*cluster)->step(sc, reqs, t, in);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      int64_t total = 0;
      for (int32_t cr = 0; cr < P; ++cr) {
        const PagedPoolView pool = (*cluster)->cache(cr).latent();
        const float* data = static_cast<const float*>(pool.data);
        int64_t stored = 0;
        for (int64_t row = 0; row < pool.num_pages * B; ++row) stored += !std::isnan(data[row * pool.dim]);
        int64_t expect = 0;
        for (const Request& q : reqs) expect += s.local_len(q.seq_len(), cr);
        EXPECT_EQ(stored, expect) << "P=" << P << " I=" << I << " rank " << cr;
        total += stored;
        // And each stored row is the right token: position p of request b at its owner's local slot.
        for (size_t b = 0; b < reqs.size(); ++b) {
          for (int64_t p = 0; p < reqs[b].seq_len(); ++p) {
            auto slot = sharded_slot(s, cr, t, static_cast<int32_t>(b), p, B);
            ASSERT_TRUE(slot.ok());
            if (*slot < 0) continue;
            int64_t ctx_before = 0, new_before = 0;
            for (size_t i = 0; i < b; ++i) {
              ctx_before += reqs[i].context_len;
              new_before += reqs[i].query_len;
            }
            const float want = p < reqs[b].context_len ? c->ctx_kv_latent.get_f32((ctx_before + p) * 8)
                                                       : c->kv_latent.get_f32((new_before + p - reqs[b].context_len) * 8);
            EXPECT_EQ(data[*slot * pool.dim], want);
          }
        }
      }
      int64_t all = 0;
      for (const Request& q : reqs) all += q.seq_len();
      EXPECT_EQ(total, all);
    }
  }
}

// 3.12: each rank's output holds the graph bucket's rows; the rows past its local rows are topk -1, out 0,
// lse -inf, and the real rows are the same as without the bucket.
TEST(PcpStep, GraphBucketPadsOutputRows) {
  const std::vector<Request> reqs = {{1, 9}, {5, 0}, {3, 4}};
  CaseGenSpec spec;
  spec.requests = reqs;
  spec.dims = CaseDims{2, 8, 4, 2, 8};
  spec.topk = 6;
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok());
  auto backend = make_cpu_backend(1);
  const int32_t B = 4;
  const StepConfig sc = testing::f32_step_config(*c, /*decode_threshold=*/2);
  const HostStepInputs in = testing::case_inputs(*c);
  std::vector<std::vector<StepResult>> runs;
  for (int64_t bucket : {0, 16}) {
    CpLayout layout;
    layout.P = 2;
    layout.graph_bucket_tokens = bucket;
    auto cluster = LocalCpCluster::create(*backend, layout, PagedCacheConfig{16, B, 8, 4, 8, DType::kF32});
    ASSERT_TRUE(cluster.ok());
    PageAllocator alloc(16);
    std::vector<SequencePages> seqs(reqs.size());
    std::vector<const SequencePages*> ptrs;
    for (size_t b = 0; b < reqs.size(); ++b) {
      ASSERT_TRUE(seqs[b].reserve(alloc, (*cluster)->sharding().local_len(reqs[b].seq_len(), 0), B).ok());
      ptrs.push_back(&seqs[b]);
    }
    const BlockTable t = BlockTable::from_sequences(ptrs);
    ASSERT_TRUE((*cluster)->load_context(reqs, t, c->ctx_kv_latent, c->ctx_k_rope, c->ctx_idx_k).ok());
    std::vector<StepResult> per_rank;
    ASSERT_TRUE((*cluster)->step(sc, reqs, t, in, &per_rank).ok());
    runs.push_back(std::move(per_rank));
  }
  for (int32_t r = 0; r < 2; ++r) {
    const StepResult& plain = runs[0][r];
    const StepResult& padded = runs[1][r];
    const int64_t local = plain.topk_indices.dim(0);  // this rank's rows without the bucket
    ASSERT_EQ(padded.topk_indices.dim(0), 16);
    ASSERT_LT(local, 16);
    EXPECT_EQ(0, std::memcmp(padded.topk_indices.data(), plain.topk_indices.data(), plain.topk_indices.nbytes()));
    EXPECT_EQ(0, std::memcmp(padded.out.data(), plain.out.data(), plain.out.nbytes()));
    EXPECT_EQ(0, std::memcmp(padded.lse.data(), plain.lse.data(), plain.lse.nbytes()));
    for (int64_t i = local * sc.K; i < 16 * sc.K; ++i) ASSERT_EQ(padded.topk_indices.data_as<int32_t>()[i], -1);
    for (int64_t i = local * sc.H * sc.Dl; i < 16 * sc.H * sc.Dl; ++i) ASSERT_EQ(padded.out.get_f32(i), 0.f);
    for (int64_t i = local * sc.H; i < 16 * sc.H; ++i) {
      ASSERT_TRUE(std::isinf(padded.lse.get_f32(i)) && padded.lse.get_f32(i) < 0);
    }
  }
}

}  // namespace
}  // namespace dsacp
