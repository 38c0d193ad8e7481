// Batch classification (reference-design §2), page allocator, block tables and slot mappings.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "dsacp/batch.h"
#include "dsacp/paged_cache.h"
#include "dsacp/step.h"

namespace dsacp {
namespace {

TEST(Batch, DecodesFirstThenPrefills) {
  // decode, MTP decode (3 tokens), fresh prefill, chunked prefill, then a decode-like request that counts as prefill.
  std::vector<Request> reqs = {{1, 100}, {3, 50}, {37, 0}, {20, 64}, {1, 9}};
  auto l = batch_layout(reqs, 4);
  ASSERT_TRUE(l.ok()) << l.status().to_string();
  EXPECT_EQ(l->num_decodes, 2);
  EXPECT_EQ(l->num_prefills, 3);
  EXPECT_EQ(l->num_decode_tokens, 4);
  EXPECT_EQ(l->num_prefill_tokens, 58);
  EXPECT_EQ(l->num_tokens, 62);
  EXPECT_EQ(l->query_start, (std::vector<int64_t>{0, 1, 4, 41, 61, 62}));
  EXPECT_EQ(l->max_seq_len, 101);
}

TEST(Batch, ThresholdDecidesMtpDecodes) {
  std::vector<Request> reqs = {{3, 10}};
  EXPECT_EQ(batch_layout(reqs, 2)->num_decodes, 0);
  EXPECT_EQ(batch_layout(reqs, 3)->num_decodes, 1);
}

TEST(Batch, BadLengthsAreRefusedByName) {
  auto expect_error = [](std::vector<Request> reqs, int32_t threshold, const std::string& text) {
    auto l = batch_layout(reqs, threshold);
    ASSERT_FALSE(l.ok());
    EXPECT_NE(l.status().message().find(text), std::string::npos) << l.status().message();
  };
  expect_error({{1, 0}, {0, 5}}, 16, "request 1: query_len must be >= 1, got 0");
  expect_error({{1, -3}}, 16, "request 0: context_len must be >= 0, got -3");
  expect_error({{2, INT32_MAX}}, 16, "request 0: context_len + query_len");
  expect_error({}, 16, "no requests");
  expect_error({{1, 1}}, 17, "decode_threshold must be in [1, 16]");
  expect_error({{1, 1}}, 0, "decode_threshold");
}

TEST(PageAllocator, HandsOutEveryPageOnceAndReportsExhaustion) {
  PageAllocator a(10, /*shuffle_seed=*/7);
  auto p1 = a.allocate(6);
  ASSERT_TRUE(p1.ok());
  auto p2 = a.allocate(4);
  ASSERT_TRUE(p2.ok());
  std::set<int32_t> all(p1->begin(), p1->end());
  all.insert(p2->begin(), p2->end());
  EXPECT_EQ(all.size(), 10u);
  EXPECT_EQ(*all.begin(), 0);
  EXPECT_EQ(*all.rbegin(), 9);
  auto none = a.allocate(1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(none.status().message(), "out of pages: asked for 1, 0 of 10 free");
  ASSERT_TRUE(a.release(*p1).ok());
  EXPECT_EQ(a.num_free(), 6);
  EXPECT_FALSE(a.release({(*p1)[0]}).ok());  // double free
  EXPECT_FALSE(a.release({10}).ok());        // out of range
  EXPECT_FALSE(a.allocate(-1).ok());
}

TEST(PageAllocator, ShuffledOrderDiffersFromSequential) {
  PageAllocator seq(64, 0), shuf(64, 3);
  auto a = seq.allocate(64), b = shuf.allocate(64);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<int32_t> expect(64);
  for (int i = 0; i < 64; ++i) expect[i] = i;
  EXPECT_EQ(*a, expect);
  EXPECT_NE(*b, expect);
  std::vector<int32_t> sorted = *b;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, expect);
}

TEST(SlotMapping, FollowsTheBlockTable) {
  PageAllocator a(16, 11);
  SequencePages s0, s1;
  ASSERT_TRUE(s0.reserve(a, 10, 4).ok());  // 3 pages
  ASSERT_TRUE(s1.reserve(a, 3, 4).ok());   // 1 page
  ASSERT_TRUE(s1.reserve(a, 4, 4).ok());   // still 1 page
  ASSERT_TRUE(s1.reserve(a, 5, 4).ok());   // 2 pages
  EXPECT_EQ(s0.pages.size(), 3u);
  EXPECT_EQ(s1.pages.size(), 2u);
  BlockTable t = BlockTable::from_sequences({&s0, &s1});
  EXPECT_EQ(t.max_pages, 3);
  EXPECT_EQ(t.page(1, 2), -1);
  for (int64_t pos = 0; pos < 10; ++pos) {
    auto slot = slot_of(t, 0, pos, 4);
    ASSERT_TRUE(slot.ok());
    EXPECT_EQ(*slot, int64_t{s0.pages[pos / 4]} * 4 + pos % 4);
  }
  EXPECT_FALSE(slot_of(t, 1, 8, 4).ok());  // no page
  EXPECT_FALSE(slot_of(t, 2, 0, 4).ok());  // no such request
  // New tokens of a chunked prefill (context 6, 4 new) and a decode (context 4, 1 new).
  auto slots = new_token_slots({{4, 6}, {1, 4}}, t, 4);
  ASSERT_TRUE(slots.ok());
  std::vector<int64_t> expect = {s0.pages[1] * 4 + 2, s0.pages[1] * 4 + 3, s0.pages[2] * 4 + 0,
                                 s0.pages[2] * 4 + 1, s1.pages[1] * 4 + 0};
  EXPECT_EQ(*slots, expect);
  ASSERT_TRUE(s0.release(a).ok());
  EXPECT_TRUE(s0.pages.empty());
}

TEST(SingleDevicePlan, KeyLengthsAreCausal) {
  PageAllocator a(8);
  SequencePages s0, s1;
  ASSERT_TRUE(s0.reserve(a, 5, 2).ok());
  ASSERT_TRUE(s1.reserve(a, 3, 2).ok());
  BlockTable t = BlockTable::from_sequences({&s0, &s1});
  auto plan = single_device_plan({{2, 3}, {3, 0}}, t, 2);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->token_request, (std::vector<int32_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(plan->token_key_len, (std::vector<int32_t>{4, 5, 1, 2, 3}));
  EXPECT_FALSE(single_device_plan({{2, 3}}, t, 2).ok());  // table rows != requests
}

}  // namespace
}  // namespace dsacp
