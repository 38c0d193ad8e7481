// The PCP planner against the worked examples of reference-design §3, and its invariants on random batches.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "dsacp/cp_plan.h"
#include "dsacp/random.h"

namespace dsacp {
namespace {

using V = std::vector<int64_t>;

// A block table with explicit rows (-1 padded).
BlockTable table_of(const std::vector<std::vector<int32_t>>& rows) {
  BlockTable t;
  t.num_requests = static_cast<int32_t>(rows.size());
  for (const auto& r : rows) t.max_pages = std::max<int32_t>(t.max_pages, static_cast<int32_t>(r.size()));
  t.data.assign(rows.size() * t.max_pages, -1);
  for (size_t b = 0; b < rows.size(); ++b) std::copy(rows[b].begin(), rows[b].end(), t.data.begin() + b * t.max_pages);
  return t;
}

TEST(KvSharding, WorkedExamples32) {
  KvSharding s{2, 2};
  EXPECT_EQ(s.local_len(10, 0), 6);
  EXPECT_EQ(s.local_len(10, 1), 4);
  KvSharding s4{4, 128};
  EXPECT_EQ((V{s4.local_len(300, 0), s4.local_len(300, 1), s4.local_len(300, 2), s4.local_len(300, 3)}),
            (V{128, 128, 44, 0}));
  // Pt = 2, B = I = 4: tokens 0-3 rank0 col0, 4-7 rank1 col0, 8-11 rank0 col1.
  KvSharding t{2, 4};
  EXPECT_EQ(t.owner(5), 1);
  EXPECT_EQ(t.local_pos(5), 1);
  EXPECT_EQ(t.owner(9), 0);
  EXPECT_EQ(t.local_pos(9), 5);
}

TEST(KvSharding, OwnerLocalGlobalRoundTripAndLengthsAddUp) {
  for (int32_t Pt : {1, 2, 3, 4, 8}) {
    for (int32_t I : {1, 3, 4, 64}) {
      KvSharding s{Pt, I};
      for (int64_t S : {0, 1, 7, 64, 300, 1013}) {
        int64_t sum = 0;
        for (int32_t cr = 0; cr < Pt; ++cr) {
          const int64_t len = s.local_len(S, cr);
          sum += len;
          EXPECT_LE(len, (S + int64_t{I} * Pt - 1) / (int64_t{I} * Pt) * I);
        }
        EXPECT_EQ(sum, S) << "Pt=" << Pt << " I=" << I << " S=" << S;
        std::vector<int64_t> seen(Pt, 0);
        for (int64_t p = 0; p < S; ++p) {
          const int32_t k = s.owner(p);
          const int64_t lp = s.local_pos(p);
          EXPECT_EQ(s.global_pos(lp, k), p);
          EXPECT_LT(lp, s.local_len(S, k));
          ++seen[k];
        }
        for (int32_t cr = 0; cr < Pt; ++cr) EXPECT_EQ(seen[cr], s.local_len(S, cr));
      }
    }
  }
}

TEST(PcpPlan, TokenSplit33TenTokens) {
  EXPECT_EQ(pcp_prefill_offsets(10, 2, 0), (V{0, 1, 2, 9, 10, 11}));
  EXPECT_EQ(pcp_prefill_offsets(10, 2, 1), (V{3, 4, 5, 6, 7, 8}));
}

// Mixed docstring example (3.3, 3.4): P = 2, Q = [1 (decode), 5, 8].
TEST(PcpPlan, MixedDocstringExample) {
  std::vector<Request> reqs = {{1, 4}, {5, 0}, {8, 0}};
  BlockTable t = table_of({{0, 1}, {2, 3}, {4, 5}});
  KvSharding s{2, 4};
  PcpOptions o;
  o.P = 2;
  auto r0 = pcp_plan(reqs, o, 0, s, 0, t, 4);
  auto r1 = pcp_plan(reqs, o, 1, s, 1, t, 4);
  ASSERT_TRUE(r0.ok() && r1.ok()) << r0.status().to_string();
  EXPECT_EQ(r0->padded_query_lens, (V{2, 8, 8}));
  EXPECT_EQ(r0->num_local_tokens, 9);
  EXPECT_EQ(r0->row_offset, (std::vector<int32_t>{0, 0, 1, 6, 7, 0, 1, 6, 7}));
  EXPECT_EQ(r1->row_offset, (std::vector<int32_t>{0, 2, 3, 4, 5, 2, 3, 4, 5}));
  EXPECT_EQ(r0->unpad_mask, (std::vector<uint8_t>{1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(r0->restore_index, (V{0, 9, 1, 2, 10, 11, 12, 13, 3, 4, 5, 6, 14, 15, 16, 17, 7, 8}));
  EXPECT_EQ(r1->restore_index, r0->restore_index);
  // Pads (offsets 5..7 of request 1) see no keys.
  EXPECT_EQ(r0->row_is_pad, (std::vector<uint8_t>{0, 0, 0, 1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(r0->row_key_len, (std::vector<int32_t>{5, 1, 2, 0, 0, 1, 2, 7, 8}));
}

// 10-token example (3.4, 3.7) and the head/tail indices example (3.5).
TEST(PcpPlan, TenTokenRestoreAndKeyLengths) {
  std::vector<Request> reqs = {{10, 0}};
  BlockTable t = table_of({{0, 1}});
  KvSharding s{2, 4};
  PcpOptions o;
  o.P = 2;
  auto r0 = pcp_plan(reqs, o, 0, s, 0, t, 4);
  auto r1 = pcp_plan(reqs, o, 1, s, 1, t, 4);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_EQ(r0->restore_index, (V{0, 1, 2, 6, 7, 8, 9, 10, 11, 3, 4, 5}));
  EXPECT_EQ(r0->unpad_mask, (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0}));
  EXPECT_EQ(r0->head_key_lens, (V{3}));
  EXPECT_EQ(r0->tail_key_lens, (V{12}));
  EXPECT_EQ(r1->head_key_lens, (V{6}));
  EXPECT_EQ(r1->tail_key_lens, (V{9}));
  // Chunked prefill with context: the corrected formula C + c(r+1), C + c(2P-r).
  o.decode_threshold = 4;  // 10 tokens with context is a prefill chunk, not an MTP decode
  auto c0 = pcp_plan({{10, 7}}, o, 0, s, 0, table_of({{0, 1, 2}}), 4);
  ASSERT_TRUE(c0.ok());
  EXPECT_EQ(c0->head_key_lens, (V{10}));
  EXPECT_EQ(c0->tail_key_lens, (V{19}));
}

TEST(PcpPlan, HeadTailIndices35) {
  // Local counts [6, 4] on rank 0 of P = 2: prefills of 12 and 8 tokens (chunks 3 and 2).
  std::vector<Request> reqs = {{12, 0}, {8, 0}};
  PcpOptions o;
  o.P = 2;
  auto r = pcp_plan(reqs, o, 0, KvSharding{2, 4}, 0, table_of({{0, 1}, {2, 3}}), 4);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->q_head_idx, (V{0, 1, 2, 6, 7}));
  EXPECT_EQ(r->q_tail_idx, (V{3, 4, 5, 8, 9}));
  EXPECT_EQ(r->q_full_idx, (V{0, 1, 2, 5, 6, 7, 3, 4, 8, 9}));
}

// 3.10: P = 2, decode lengths [2, 1].
TEST(PcpPlan, MtpDecodeSlotCompaction310) {
  std::vector<int64_t> slots = {100, -1, 101, -1, 102, -1};
  pcp_compact_decode_slots(slots, {2, 1}, 2);
  EXPECT_EQ(slots, (V{100, 101, -1, -1, 102, -1}));
  std::vector<int64_t> empty = {5, 6};
  pcp_compact_decode_slots(empty, {}, 2);
  EXPECT_EQ(empty, (V{5, 6}));
}

// 3.13: P = 2, B = I = 4; A = decode (Q=1, C=7), B = prefill (Q=10); tables A -> [5, 0], B -> [9, 2].
TEST(PcpPlan, EndToEndToyExample313) {
  std::vector<Request> reqs = {{1, 7}, {10, 0}};
  BlockTable t = table_of({{5, 0}, {9, 2}});
  KvSharding s{2, 4};
  PcpOptions o;
  o.P = 2;
  auto r0 = pcp_plan(reqs, o, 0, s, 0, t, 4);
  auto r1 = pcp_plan(reqs, o, 1, s, 1, t, 4);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_EQ(r0->num_local_tokens, 7);
  EXPECT_EQ(r0->all_positions, (V{0, 2, 3, 4, 11, 12, 13, 1, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(r0->restore_index, (V{0, 7, 1, 2, 3, 8, 9, 10, 11, 12, 13, 4, 5, 6}));
  EXPECT_EQ(r0->padded_slots, (V{-1, -1, 36, 37, 38, 39, -1, -1, -1, -1, 8, 9, -1, -1}));
  EXPECT_EQ(r1->padded_slots, (V{23, -1, -1, -1, -1, -1, 36, 37, 38, 39, -1, -1, -1, -1}));
  EXPECT_EQ(r0->q_head_idx, (V{0, 1, 2}));
  EXPECT_EQ(r0->q_tail_idx, (V{3, 4, 5}));
  EXPECT_EQ(r0->q_full_idx, (V{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(r0->head_key_lens, (V{3}));
  EXPECT_EQ(r0->tail_key_lens, (V{12}));
  EXPECT_EQ(r1->head_key_lens, (V{6}));
  EXPECT_EQ(r1->tail_key_lens, (V{9}));
  // Prefill view: valid ids [2, 9], table [[1, 3, 0, (2)]] — B covers 10 positions, so 3 global pages.
  auto v = gathered_view_plan({1}, {10}, t, s, 0, 4);
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->direct);
  EXPECT_EQ(v->valid_block_ids, (std::vector<int32_t>{2, 9}));
  EXPECT_EQ(v->view_table.data, (std::vector<int32_t>{1, 3, 0}));
  // Decode view of A (S = 8): global pages 0 (rank0 col0 = page 5) and 1 (rank1 col0 = page 5).
  auto d = gathered_view_plan({0}, {8}, t, s, 0, 4);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->valid_block_ids, (std::vector<int32_t>{5}));
  EXPECT_EQ(d->view_table.data, (std::vector<int32_t>{0, 1}));
}

// 3.9 compact gather: Pt = 2, prefill rows [[5, 9, 0], [9, 2, 0]] -> valid [0, 2, 5, 9],
// block_table_cp [[2, 6, 3, 7, 0, 4], [3, 7, 1, 5, 0, 4]].
TEST(GatheredView, CompactGather39) {
  BlockTable t = table_of({{5, 9, 0}, {9, 2, 0}});
  auto v = gathered_view_plan({0, 1}, {24, 24}, t, KvSharding{2, 4}, 1, 4);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(v->valid_block_ids, (std::vector<int32_t>{0, 2, 5, 9}));
  EXPECT_EQ(v->view_table.data, (std::vector<int32_t>{2, 6, 3, 7, 0, 4, 3, 7, 1, 5, 0, 4}));
  EXPECT_EQ(v->rows_per_rank, 16);
  EXPECT_EQ(v->pack_slots[4], 8);  // page 2, offset 0
}

// Invariant 8: the view addresses the same rows as the owners' caches, for any interleave.
TEST(GatheredView, ViewAddressesOwnersRows) {
  for (int32_t Pt : {2, 3, 4}) {
    for (int32_t I : {1, 3, 4, 8}) {
      const int32_t B = 4;
      KvSharding s{Pt, I};
      std::vector<int64_t> S = {1, 13, 30};
      PageAllocator alloc(64, 5);
      std::vector<SequencePages> seqs(S.size());
      std::vector<const SequencePages*> ptrs;
      for (size_t i = 0; i < S.size(); ++i) {
        ASSERT_TRUE(seqs[i].reserve(alloc, s.local_len(S[i], 0), B).ok());
        ptrs.push_back(&seqs[i]);
      }
      BlockTable t = BlockTable::from_sequences(ptrs);
      // Each rank's pool row holds the global (request, position) it stores: value = 1000 * req + pos.
      std::vector<std::vector<int64_t>> pool(Pt, std::vector<int64_t>(64 * B, -7));
      for (int32_t k = 0; k < Pt; ++k)
        for (size_t i = 0; i < S.size(); ++i)
          for (int64_t p = 0; p < S[i]; ++p) {
            auto slot = sharded_slot(s, k, t, static_cast<int32_t>(i), p, B);
            ASSERT_TRUE(slot.ok());
            if (*slot >= 0) pool[k][*slot] = 1000 * static_cast<int64_t>(i) + p;
          }
      std::vector<std::vector<int64_t>> packs;
      GatheredViewPlan plan0;
      for (int32_t k = 0; k < Pt; ++k) {
        auto v = gathered_view_plan({0, 1, 2}, S, t, s, k, B);
        ASSERT_TRUE(v.ok());
        std::vector<int64_t> pack;
        for (int64_t slot : v->pack_slots) pack.push_back(slot < 0 ? -9 : pool[k][slot]);
        packs.push_back(pack);
        if (k == 0) plan0 = *v;
      }
      std::vector<int64_t> gathered;
      for (auto& p : packs) gathered.insert(gathered.end(), p.begin(), p.end());
      for (size_t i = 0; i < S.size(); ++i)
        for (int64_t p = 0; p < S[i]; ++p) {
          const int64_t view_slot = int64_t{plan0.view_table.page(static_cast<int32_t>(i), p / B)} * B + p % B;
          const int64_t row = plan0.direct ? view_slot : plan0.unpack_rows[view_slot];
          ASSERT_GE(row, 0);
          EXPECT_EQ(gathered[row], 1000 * static_cast<int64_t>(i) + p) << "Pt=" << Pt << " I=" << I;
        }
    }
  }
}

// Invariants 5, 6, 9 on random batches: restore is a permutation, each real token is written exactly once
// (on its owner), pads and duplicate decode copies never, every rank holds L = Qpad / P rows of each prefill.
TEST(PcpPlan, RandomBatchInvariants) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const int32_t P = std::vector<int32_t>{1, 2, 3, 4, 8}[seed % 5];
    const int32_t I = std::vector<int32_t>{1, 3, 4, 8}[seed % 4];
    const int32_t B = 4;
    std::vector<Request> reqs;
    const int nd = static_cast<int>(counter_hash(seed, 1, 0) % 3);
    for (int i = 0; i < nd; ++i) {
      reqs.push_back({1 + static_cast<int32_t>(counter_hash(seed, 2, i) % 4), 1 + static_cast<int32_t>(counter_hash(seed, 3, i) % 40)});
    }
    const int np = 1 + static_cast<int>(counter_hash(seed, 4, 0) % 3);
    for (int i = 0; i < np; ++i) {
      const int32_t q = std::vector<int32_t>{1, 2 * P - 1, 2 * P, 17, 40}[counter_hash(seed, 5, i) % 5];
      reqs.push_back({q, static_cast<int32_t>(counter_hash(seed, 6, i) % 20)});
    }
    KvSharding s{P, I};
    PageAllocator alloc(1024);
    std::vector<SequencePages> seqs(reqs.size());
    std::vector<const SequencePages*> ptrs;
    for (size_t b = 0; b < reqs.size(); ++b) {
      ASSERT_TRUE(seqs[b].reserve(alloc, s.local_len(reqs[b].seq_len(), 0), B).ok());
      ptrs.push_back(&seqs[b]);
    }
    BlockTable t = BlockTable::from_sequences(ptrs);
    PcpOptions o;
    o.P = P;
    o.decode_threshold = 4;
    std::multiset<int64_t> written;  // (rank, slot) pairs
    int64_t real_tokens = 0;
    for (const Request& r : reqs) real_tokens += r.query_len;
    for (int32_t r = 0; r < P; ++r) {
      auto plan = pcp_plan(reqs, o, r, s, r, t, B);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      std::vector<int64_t> sorted = plan->restore_index;
      std::sort(sorted.begin(), sorted.end());
      for (size_t j = 0; j < sorted.size(); ++j) ASSERT_EQ(sorted[j], static_cast<int64_t>(j));
      std::vector<int64_t> full = plan->q_full_idx;
      std::sort(full.begin(), full.end());
      for (size_t j = 0; j < full.size(); ++j) ASSERT_EQ(full[j], static_cast<int64_t>(j));
      // Every gathered row's slot: written only for real tokens, once over all ranks.
      const std::vector<int64_t> gslots = plan->gathered_row_slots();
      for (size_t j = 0; j < gslots.size(); ++j) {
        if (gslots[j] >= 0) written.insert(int64_t{r} * 1000000 + gslots[j]);
      }
      // Equal share of each prefill.
      for (int32_t b = plan->layout.num_decodes; b < static_cast<int32_t>(reqs.size()); ++b) {
        const int64_t rows = std::count(plan->row_request.begin(), plan->row_request.end(), b);
        EXPECT_EQ(rows, plan->padded_query_lens[b] / P);
      }
    }
    EXPECT_EQ(static_cast<int64_t>(written.size()), real_tokens) << "seed " << seed;
    EXPECT_EQ(std::set<int64_t>(written.begin(), written.end()).size(), written.size()) << "seed " << seed;
  }
}

TEST(PcpPlan, GraphBucketAndErrors) {
  PcpOptions o;
  o.P = 2;
  o.graph_bucket_tokens = 32;
  auto r = pcp_plan({{5, 0}}, o, 0, KvSharding{2, 4}, 0, table_of({{0}}), 4);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->num_local_tokens, 4);
  EXPECT_EQ(r->output_rows, 32);
  EXPECT_FALSE(pcp_plan({{5, 0}}, o, 2, KvSharding{2, 4}, 0, table_of({{0}}), 4).ok());
  o.P = 0;
  EXPECT_FALSE(pcp_plan({{5, 0}}, o, 0, KvSharding{2, 4}, 0, table_of({{0}}), 4).ok());
  EXPECT_FALSE(validate_sharding(KvSharding{2, 0}).ok());
}

}  // namespace
}  // namespace dsacp
