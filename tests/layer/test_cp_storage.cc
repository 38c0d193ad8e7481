// Where the KV lives under DCP and hybrid layouts, and what a rank without chosen keys contributes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/case_file.h"
#include "dsacp/cp_step.h"
#include "dsacp/replay.h"
#include "dsacp/step_timing.h"
#include "support/test_seed.h"
#include "support/layout_check.h"

namespace dsacp {
namespace {

int64_t stored_rows(const PagedPoolView& pool) {
  const float* data = static_cast<const float*>(pool.data);
  int64_t n = 0;
  for (int64_t row = 0; row < pool.num_pages * pool.page_size; ++row) n += !std::isnan(data[row * pool.dim]);
  return n;
}

struct Built {
  std::unique_ptr<LocalCpCluster> cluster;
  BlockTable table;
  CaseFile c;
  StepResult result;
};

// One step of `reqs` through a cluster of `layout`, f32 pools with NaN in unused slots.
Built run_step(const CpLayout& layout, const std::vector<Request>& reqs, int32_t B) {
  Built b;
  CaseGenSpec spec;
  spec.requests = reqs;
  spec.dims = CaseDims{4, 8, 4, 2, 8};
  spec.topk = 6;
  auto c = case_generate(spec);
  EXPECT_TRUE(c.ok());
  b.c = std::move(*c);
  static auto backend = make_cpu_backend(1);
  const KvSharding s{layout.num_ranks(), layout.interleave == 0 ? B : layout.interleave};
  PagedCacheConfig cc{0, B, 8, 4, 8, DType::kF32};
  for (const Request& r : reqs) cc.num_pages += s.pages_needed(r.seq_len(), B);
  auto cluster = LocalCpCluster::create(*backend, layout, cc);
  EXPECT_TRUE(cluster.ok());
  b.cluster = std::move(*cluster);
  PageAllocator alloc(cc.num_pages, 5);
  std::vector<SequencePages> seqs(reqs.size());
  std::vector<const SequencePages*> ptrs;
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_TRUE(seqs[i].reserve(alloc, s.local_len(reqs[i].seq_len(), 0), B).ok());
    ptrs.push_back(&seqs[i]);
  }
  b.table = BlockTable::from_sequences(ptrs);
  EXPECT_TRUE(b.cluster->load_context(reqs, b.table, b.c.ctx_kv_latent, b.c.ctx_k_rope, b.c.ctx_idx_k).ok());
  const StepConfig sc = testing::f32_step_config(b.c);
  const HostStepInputs in = testing::case_inputs(b.c);
  auto r = b.cluster->step(sc, reqs, b.table, in);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  if (r.ok()) b.result = std::move(*r);
  return b;
}

// Latent KV per rank is about 1/Pt of one device's; the indexer keys too when sharded, all of them on
// every rank when replicated.
TEST(CpStorage, KvPerRankIsAShareOfOneDevice) {
  const std::vector<Request> reqs = {{1, 300}, {3, 211}, {40, 0}, {17, 90}};
  int64_t total = 0;
  for (const Request& r : reqs) total += r.seq_len();
  for (auto [P, D] : {std::pair{1, 2}, std::pair{1, 4}, std::pair{2, 2}, std::pair{4, 2}}) {
    for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
      CpLayout l;
      l.P = P;
      l.D = D;
      l.indexer = mode;
      l.interleave = 3;
      Built b = run_step(l, reqs, 4);
      const int32_t Pt = P * D;
      int64_t sum = 0;
      for (int32_t cr = 0; cr < Pt; ++cr) {
        const int64_t latent = stored_rows(b.cluster->cache(cr).latent());
        sum += latent;
        EXPECT_LE(std::abs(latent * Pt - total), int64_t{3} * Pt * static_cast<int64_t>(reqs.size()))
            << "P=" << P << " D=" << D << " rank " << cr << " stores " << latent << " of " << total;
        EXPECT_EQ(stored_rows(b.cluster->cache(cr).rope()), latent);
        EXPECT_EQ(stored_rows(b.cluster->cache(cr).index_keys()), mode == IndexerMode::kSharded ? latent : total);
      }
      EXPECT_EQ(sum, total);
    }
  }
}

// A request whose every key lives on rank 0 (all positions inside the first interleave unit): the other ranks
// own no chosen key, contribute LSE -inf, and the merged decode output equals one device's bit for bit.
TEST(CpStorage, RankWithoutChosenKeysContributesExactlyZero) {
  const std::vector<Request> reqs = {{1, 20}, {2, 30}};
  CpLayout one;
  Built want = run_step(one, reqs, 4);
  for (IndexerMode mode : {IndexerMode::kSharded, IndexerMode::kReplicated}) {
    CpLayout l;
    l.D = 4;
    l.interleave = 64;  // every position < 64 lives on rank 0
    l.indexer = mode;
    Built got = run_step(l, reqs, 4);
    ASSERT_EQ(got.result.out.nbytes(), want.result.out.nbytes());
    EXPECT_EQ(0, std::memcmp(got.result.out.data(), want.result.out.data(), want.result.out.nbytes()));
    EXPECT_EQ(0, std::memcmp(got.result.lse.data(), want.result.lse.data(), want.result.lse.nbytes()));
    EXPECT_EQ(0, std::memcmp(got.result.topk_indices.data(), want.result.topk_indices.data(),
                             want.result.topk_indices.nbytes()));
    for (int32_t cr = 1; cr < 4; ++cr) EXPECT_EQ(stored_rows(got.cluster->cache(cr).latent()), 0);
  }
}

// Reference-design 4.7: the validation errors that still apply, and the limits that became working code.
TEST(CpStorage, LayoutValidation) {
  CpLayout l;
  EXPECT_TRUE(validate_layout(l, 16).ok());
  l.D = 3;
  Status s = validate_layout(l, 16);
  EXPECT_NE(s.message().find("H must be a multiple of D"), std::string::npos) << s.message();
  l.dsa_cp = true;  // DSA-CP splits tokens: any D
  EXPECT_TRUE(validate_layout(l, 16).ok());
  l.P = 2;  // DSA-CP inside PCP
  EXPECT_EQ(validate_layout(l, 16).code(), StatusCode::kUnsupported);
  l = CpLayout{};
  l.P = 2;
  l.D = 2;  // hybrid: the reference design's "DCP without PCP only" is gone
  EXPECT_TRUE(validate_layout(l, 16).ok());
  l.decode_mode = DecodeMode::kGathered;
  EXPECT_EQ(validate_layout(l, 16).code(), StatusCode::kUnsupported);
  l = CpLayout{};
  l.interleave = -1;
  EXPECT_FALSE(validate_layout(l, 16).ok());
  l = CpLayout{};
  l.D = 0;
  EXPECT_FALSE(validate_layout(l, 16).ok());
}

// 4.6 tiny merge example: rank 0 owns keys with scores {0, ln 2} (LSE ln 3), rank 1 one key with score 0
// (LSE 0): weights (3/4, 1/4). With rank 1 owning nothing (LSE -inf): weights (1, 0).
TEST(CpStorage, LseMergeTinyExample46) {
  auto backend = make_cpu_backend(1);
  const float o0 = 2.f, o1 = 10.f;
  std::vector<float> parts = {o0, o1}, lses = {std::log(3.f), 0.f}, out(1), lse(1);
  LseMergeParams p;
  p.num_parts = 2;
  p.num_rows = 1;
  p.Dl = 1;
  p.part_out = parts.data();
  p.part_lse = lses.data();
  p.out = out.data();
  p.lse = lse.data();
  ASSERT_TRUE(lse_merge_run(*backend, p).ok());
  EXPECT_NEAR(out[0], 0.75f * o0 + 0.25f * o1, 1e-6);
  EXPECT_NEAR(lse[0], std::log(4.f), 1e-6);
  lses[1] = -std::numeric_limits<float>::infinity();
  parts[1] = std::numeric_limits<float>::quiet_NaN();  // an empty part's output never leaks
  ASSERT_TRUE(lse_merge_run(*backend, p).ok());
  EXPECT_EQ(out[0], o0);
  EXPECT_NEAR(lse[0], std::log(3.f), 1e-6);
}

// One backend per rank (how GPUs run: each rank its own device) gives the same bits as one backend for all.
TEST(CpCluster, OneBackendPerRankMatchesOneForAll) {
  CaseGenSpec spec;
  spec.requests = {{1, 70}, {2, 33}, {9, 0}, {5, 20}};
  spec.dims = CaseDims{4, 8, 4, 2, 8};
  spec.topk = 6;
  spec.seed = testing::test_seed(11);
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok());
  ReplayOptions o;
  o.page_size = 4;
  o.layout.P = 2;
  o.layout.D = 2;
  auto shared = make_cpu_backend(1);
  auto want = replay_case(*shared, *c, o);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  std::vector<std::unique_ptr<Backend>> owned;
  std::vector<Backend*> ranks;
  for (int i = 0; i < 4; ++i) {
    owned.push_back(make_cpu_backend(1));
    ranks.push_back(owned.back().get());
  }
  auto got = replay_case(ranks, *c, o);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(0, std::memcmp(got->out.data(), want->out.data(), want->out.nbytes()));
  EXPECT_EQ(0, std::memcmp(got->topk_indices.data(), want->topk_indices.data(), want->topk_indices.nbytes()));
  // The wrong number of backends is refused, naming the counts.
  ranks.pop_back();
  auto bad = replay_case(ranks, *c, o);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("3 backends for P=2 x D=2 = 4 ranks"), std::string::npos)
      << bad.status().to_string();
}

// The phase recorder adds one step's phases on the thread that runs it.
TEST(CpCluster, StepPhaseRecorderTimesTheSteps) {
  CaseGenSpec spec;
  spec.requests = {{1, 40}, {12, 0}};
  spec.dims = CaseDims{4, 8, 4, 2, 8};
  spec.topk = 6;
  auto c = case_generate(spec);
  ASSERT_TRUE(c.ok());
  auto backend = make_cpu_backend(1);
  StepPhaseTimes times;
  {
    StepPhaseRecorder rec(&times);
    ASSERT_TRUE(replay_case(*backend, *c, ReplayOptions{}).ok());
    ASSERT_TRUE(replay_case(*backend, *c, ReplayOptions{}).ok());
  }
  ASSERT_TRUE(replay_case(*backend, *c, ReplayOptions{}).ok());  // not recorded
  EXPECT_EQ(times.steps, 2);
  EXPECT_GT(times.total_ms, 0);
  EXPECT_LE(times.kv_ms + times.topk_ms + times.attention_ms, times.total_ms * 1.0001 + 1e-6);
}

}  // namespace
}  // namespace dsacp
