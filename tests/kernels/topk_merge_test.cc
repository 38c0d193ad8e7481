// The sharded indexer's candidate merge (TopkMergeParams) against a brute-force global top-k: random parts of
// a KV sharding (several ranks, interleaves), ties, NaN scores, short and empty parts; and its optional local
// output against topk_remap of the merged rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "kernels/kernel_test_util.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The contract's order: higher score first (NaN below everything, -0 == +0), ties to the lower position.
bool better(float sa, int64_t pa, float sb, int64_t pb) {
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na != nb) return nb;
  if (!na && sa != sb) return sa > sb;
  return pa < pb;
}

struct Key {
  int64_t pos;
  float score;
};

// The best K of `keys`, as ascending positions, -1 padded to K.
std::vector<int32_t> best_k(std::vector<Key> keys, int32_t K) {
  std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) { return better(a.score, a.pos, b.score, b.pos); });
  if (static_cast<int32_t>(keys.size()) > K) keys.resize(K);
  std::vector<int32_t> out;
  for (const Key& k : keys) out.push_back(static_cast<int32_t>(k.pos));
  std::sort(out.begin(), out.end());
  out.resize(K, -1);
  return out;
}

TEST(TopkMergeKernel, MergedRowsAreTheGlobalTopkAndTheLocalOutputIsTheirRemap) {
  const uint64_t seed = testing::test_seed(4242);
  auto backend = make_cpu_backend(2);
  const int32_t K = 16;
  for (int32_t S : {2, 3, 4}) {
    for (int32_t I : {1, 4}) {
      const int64_t T = 6;
      std::vector<int32_t> part_topk(static_cast<size_t>(S * T * K));
      std::vector<float> part_scores(part_topk.size());
      std::vector<std::vector<int32_t>> want(T);
      for (int64_t t = 0; t < T; ++t) {
        const uint64_t rs = mix(seed ^ (static_cast<uint64_t>(S * 100 + I) << 32) ^ static_cast<uint64_t>(t));
        // Global keys 0..n-1 (row 0 empty, row 1 short, others past K on every part); quantized scores tie often.
        const int64_t n = t == 0 ? 0 : t == 1 ? K / 2 : static_cast<int64_t>(S) * K + static_cast<int64_t>(rs % (4 * K));
        std::vector<std::vector<Key>> local(S);
        std::vector<Key> all;
        for (int64_t g = 0; g < n; ++g) {
          const uint64_t h = mix(rs + static_cast<uint64_t>(g));
          float score = static_cast<float>(static_cast<int64_t>(h % 9) - 4) * 0.5f;
          if (h % 23 == 0) score = std::numeric_limits<float>::quiet_NaN();
          if (h % 29 == 0) score = -0.f;
          const int64_t s = (g / I) % S;
          const int64_t l = (g / (int64_t{S} * I)) * I + g % I;
          local[s].push_back({l, score});
          all.push_back({g, score});
        }
        for (int32_t s = 0; s < S; ++s) {
          // The part's row: its local top-k in the indexer's canonical form, with its scores.
          const std::vector<int32_t> row = best_k(local[s], K);
          for (int32_t i = 0; i < K; ++i) {
            const size_t at = static_cast<size_t>((s * T + t) * K + i);
            part_topk[at] = row[i];
            part_scores[at] = -7.f;  // past the row: never read
            for (const Key& k : local[s]) {
              if (k.pos == row[i]) part_scores[at] = k.score;
            }
          }
        }
        want[t] = best_k(all, K);
      }
      for (int32_t own = 0; own < S; ++own) {
        SCOPED_TRACE("S=" + std::to_string(S) + " I=" + std::to_string(I) + " local part " + std::to_string(own));
        std::vector<int32_t> merged(static_cast<size_t>(T * K)), local(merged.size()), remapped(merged.size());
        TopkMergeParams p;
        p.num_parts = S;
        p.num_rows = T;
        p.K = K;
        p.I = I;
        p.part_topk = part_topk.data();
        p.part_scores = part_scores.data();
        p.topk = merged.data();
        p.local_topk = local.data();
        p.local_part = own;
        ASSERT_TRUE(topk_merge_run(*backend, p).ok());
        for (int64_t t = 0; t < T; ++t) {
          EXPECT_EQ(std::vector<int32_t>(merged.begin() + t * K, merged.begin() + (t + 1) * K), want[t]) << "row " << t;
        }
        // The same parts given one buffer each (a window exchange's messages, read in place), in separate copies:
        // the same rows.
        {
          const std::vector<std::vector<int32_t>> own_topk = testing::split_parts(part_topk, S, T * K);
          const std::vector<std::vector<float>> own_scores = testing::split_parts(part_scores, S, T * K);
          TopkMergeParams q = p;
          q.part_topk = nullptr;
          q.part_scores = nullptr;
          for (int32_t s = 0; s < S; ++s) {
            q.part_topk_of[s] = own_topk[s].data();
            q.part_scores_of[s] = own_scores[s].data();
          }
          std::vector<int32_t> merged2(merged.size(), 99), local2(merged.size(), 99);
          q.topk = merged2.data();
          q.local_topk = local2.data();
          ASSERT_TRUE(topk_merge_run(*backend, q).ok());
          EXPECT_EQ(merged2, merged);
          EXPECT_EQ(local2, local);
        }
        TopkRemapParams rp;
        rp.num_rows = T;
        rp.K = K;
        rp.topk = merged.data();
        rp.local = remapped.data();
        rp.Pt = S;
        rp.I = I;
        rp.cr = own;
        ASSERT_TRUE(topk_remap_run(*backend, rp).ok());
        EXPECT_EQ(local, remapped);
      }
    }
  }
}

TEST(TopkMergeKernel, LocalPartOutsideThePartsIsRefused) {
  std::vector<int32_t> part(8, -1), out(4), local(4);
  std::vector<float> scores(8, 0.f);
  TopkMergeParams p;
  p.num_parts = 2;
  p.num_rows = 1;
  p.K = 4;
  p.part_topk = part.data();
  p.part_scores = scores.data();
  p.topk = out.data();
  p.local_topk = local.data();
  p.local_part = 2;
  const Status s = validate(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("local_part=2 outside [0, num_parts=2)"), std::string::npos) << s.to_string();
}

TEST(TopkMergeKernel, PartsGivenOneBufferEachMustAllBeThere) {
  std::vector<int32_t> part(4, -1), out(4);
  std::vector<float> scores(4, 0.f);
  TopkMergeParams p;
  p.num_parts = 2;
  p.num_rows = 1;
  p.K = 4;
  p.part_topk_of[0] = part.data();
  p.part_scores_of[0] = scores.data();
  p.topk = out.data();
  Status s = validate(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("part 1 has no buffer"), std::string::npos) << s.to_string();
  p.num_parts = kMaxPartBuffers + 1;
  s = validate(p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("at most 8 parts"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace dsacp
