// DCP planning against the worked examples of reference-design §4 and §5.
#include <gtest/gtest.h>

#include "dsacp/backend.h"
#include "dsacp/cp_plan.h"

#include <set>

namespace dsacp {
namespace {

using V = std::vector<int64_t>;

// 4.1: D = 2, local row [7, 3] -> replicated row [14, 15, 6, 7]; token 9 with page size 4 -> block 6, slot 25.
TEST(DcpPlan, ReplicatedIndexView41) {
  BlockTable t;
  t.num_requests = 1;
  t.max_pages = 2;
  t.data = {7, 3};
  auto r = replicated_index_table(t, {16}, 2, 4);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->data, (std::vector<int32_t>{14, 15, 6, 7}));
  EXPECT_EQ(int64_t{r->page(0, 9 / 4)} * 4 + 9 % 4, 25);
  // Cross-check: with I = 4 token 9 is owned by rank 0 at local position 5 -> local block 3, and 6 = 3*2 + 0.
  KvSharding s{2, 4};
  EXPECT_EQ(s.owner(9), 0);
  EXPECT_EQ(s.local_pos(9), 5);
  // 4.6b: S = 10, table [7, 3]: the reference row [14, 15, 6, 7] cut to the 3 global pages S needs.
  auto r10 = replicated_index_table(t, {10}, 2, 4);
  ASSERT_TRUE(r10.ok());
  EXPECT_EQ(r10->data, (std::vector<int32_t>{14, 15, 6}));
  // A request whose share has too few pages is refused.
  EXPECT_FALSE(replicated_index_table(t, {40}, 2, 4).ok());
}

// Any interleave: the replicated view gives every (request, position) its own slot (no two collide).
TEST(DcpPlan, ReplicatedIndexViewIsInjectiveForAnyInterleave) {
  for (int32_t Pt : {2, 3, 4}) {
    for (int32_t I : {1, 3, 4, 16}) {
      KvSharding s{Pt, I};
      std::vector<int64_t> S = {1, 37, 100};
      PageAllocator alloc(256, 9);
      std::vector<SequencePages> seqs(S.size());
      std::vector<const SequencePages*> ptrs;
      for (size_t i = 0; i < S.size(); ++i) {
        ASSERT_TRUE(seqs[i].reserve(alloc, s.local_len(S[i], 0), 4).ok());
        ptrs.push_back(&seqs[i]);
      }
      BlockTable t = BlockTable::from_sequences(ptrs);
      auto r = replicated_index_table(t, S, Pt, 4);
      ASSERT_TRUE(r.ok()) << "Pt=" << Pt << " I=" << I << ": " << r.status().to_string();
      std::set<int64_t> slots;
      for (size_t i = 0; i < S.size(); ++i)
        for (int64_t p = 0; p < S[i]; ++p) slots.insert(int64_t{r->page(static_cast<int32_t>(i), p / 4)} * 4 + p % 4);
      EXPECT_EQ(slots.size(), 138u);
      EXPECT_LT(*slots.rbegin(), 256 * 4 * Pt);
    }
  }
}

// 4.4 step 3: D = 2, I = 4, row [9, 2, 5, -1, 13, 4]: rank 0 -> [5, 2, -1...]; rank 1 -> [1, 5, 0, -1...].
TEST(DcpPlan, TopkRemap44) {
  auto backend = make_cpu_backend(1);
  const std::vector<int32_t> row = {9, 2, 5, -1, 13, 4};
  std::vector<int32_t> local(6);
  TopkRemapParams p;
  p.num_rows = 1;
  p.K = 6;
  p.topk = row.data();
  p.local = local.data();
  p.Pt = 2;
  p.I = 4;
  p.cr = 0;
  ASSERT_TRUE(topk_remap_run(*backend, p).ok());
  EXPECT_EQ(local, (std::vector<int32_t>{5, 2, -1, -1, -1, -1}));
  p.cr = 1;
  ASSERT_TRUE(topk_remap_run(*backend, p).ok());
  EXPECT_EQ(local, (std::vector<int32_t>{1, 5, 0, -1, -1, -1}));
  // Exact integers past 2^24 (the reference computes this in fp32).
  const std::vector<int32_t> big = {(1 << 24) + 1, (1 << 30) + 7};
  std::vector<int32_t> out(2);
  p.K = 2;
  p.topk = big.data();
  p.local = out.data();
  p.Pt = 2;
  p.I = 1;
  p.cr = 1;
  ASSERT_TRUE(topk_remap_run(*backend, p).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{(1 << 23), (1 << 29) + 3}));
  // An entry below -1 is an error, not a silent skip.
  const std::vector<int32_t> bad = {3, -5};
  p.topk = bad.data();
  EXPECT_FALSE(topk_remap_run(*backend, p).ok());
}

// Invariant 4: local entries of all ranks map back to the global row, order kept, counts add up.
TEST(DcpPlan, TopkRemapRoundTrip) {
  auto backend = make_cpu_backend(1);
  const std::vector<int32_t> row = {0, 1, 4, 5, 9, 12, 13, 30, 31, 64, -1, -1};
  for (int32_t Pt : {2, 3, 4, 8}) {
    for (int32_t I : {1, 3, 4}) {
      KvSharding s{Pt, I};
      int64_t total = 0;
      for (int32_t cr = 0; cr < Pt; ++cr) {
        std::vector<int32_t> local(row.size());
        TopkRemapParams p;
        p.num_rows = 1;
        p.K = static_cast<int32_t>(row.size());
        p.topk = row.data();
        p.local = local.data();
        p.Pt = Pt;
        p.I = I;
        p.cr = cr;
        ASSERT_TRUE(topk_remap_run(*backend, p).ok());
        std::vector<int32_t> back;
        for (int32_t e : local) {
          if (e < 0) break;
          back.push_back(static_cast<int32_t>(s.global_pos(e, cr)));
        }
        std::vector<int32_t> expect;
        for (int32_t e : row)
          if (e >= 0 && s.owner(e) == cr) expect.push_back(e);
        EXPECT_EQ(back, expect);
        total += static_cast<int64_t>(back.size());
      }
      EXPECT_EQ(total, 10);
    }
  }
}

// §5: TP = 2, A = decode (1 token, S = 100), B = prefill (Q = 6, S = 6): Tpad 8, Tloc 4;
// rank 0 -> cuQ [1, 4], lenK [100, 3]; rank 1 -> cuQ [0, 3], lenK [0, 6].
TEST(DcpPlan, DsaCpSlicing5) {
  std::vector<Request> reqs = {{1, 99}, {6, 0}};
  auto r0 = dsa_cp_slice(reqs, 2, 0);
  auto r1 = dsa_cp_slice(reqs, 2, 1);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_EQ(r0->num_tokens_pad, 8);
  EXPECT_EQ(r0->cu_q_local, (V{1, 4}));
  EXPECT_EQ(r0->len_k_local, (V{100, 3}));
  EXPECT_EQ(r1->cu_q_local, (V{0, 3}));
  EXPECT_EQ(r1->len_k_local, (V{0, 6}));
  EXPECT_EQ(r1->local_start, 4);
  EXPECT_EQ(r1->local_end, 7);
  EXPECT_EQ(r1->local_end_with_pad, 8);
  EXPECT_FALSE(dsa_cp_slice(reqs, 2, 2).ok());
}

}  // namespace
}  // namespace dsacp
