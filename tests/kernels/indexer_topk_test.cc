// Indexer top-k on the CPU backend against fp64 math: paged keys (shuffled pages, NaN in unused slots), odd
// dims, ties, short rows, padding rows, determinism across threads and across ways of splitting the tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/backend.h"
#include "kernels/kernel_test_util.h"
#include "support/reference_math.h"

namespace dsacp::testing {
namespace {

struct IndexerCase {
  int32_t hi, di, k, page_size;
  DType dtype;  // of q and the key pool
  std::vector<RequestShape> requests;
};

std::string case_label(const IndexerCase& c) {
  return std::string("Hi") + std::to_string(c.hi) + "_Di" + std::to_string(c.di) + "_K" + std::to_string(c.k) + "_ps" +
         std::to_string(c.page_size) + "_" + dtype_label(c.dtype) + "_" + requests_name(c.requests);
}
std::string case_name(const ::testing::TestParamInfo<IndexerCase>& info) { return case_label(info.param); }
// gtest prints the parameter of a failing case with this instead of raw bytes.
void PrintTo(const IndexerCase& c, std::ostream* os) { *os << case_label(c); }

// A batch ready to run: dense keys per request (for the reference), the paged pool, queries and weights.
struct IndexerProblem {
  IndexerCase c;
  TokenRows rows;
  PageLayout layout;
  std::vector<std::vector<float>> keys;  // [R][S_b * Di]
  PagedPool pool;
  std::vector<float> q_f32, w;   // [T, Hi, Di], [T, Hi]
  std::vector<uint16_t> q_bf16;  // q_f32 as bf16 bits, when dtype is bf16

  IndexerTopkParams params(std::vector<int32_t>& topk) const {
    IndexerTopkParams p;
    p.rows = rows.view();
    p.Hi = c.hi;
    p.Di = c.di;
    p.K = c.k;
    p.q = c.dtype == DType::kBF16 ? static_cast<const void*>(q_bf16.data()) : q_f32.data();
    p.q_dtype = c.dtype;
    p.w = w.data();
    p.keys = pool.view;
    p.block_table = layout.view();
    topk.assign(static_cast<size_t>(rows.size() * c.k), -7);
    p.topk = topk.data();
    return p;
  }
};

IndexerProblem make_problem(Backend& backend, const IndexerCase& c, uint64_t seed) {
  IndexerProblem pr;
  pr.c = c;
  const bool bf = c.dtype == DType::kBF16;
  pr.rows = make_token_rows(c.requests, /*empty_row=*/true);
  pr.layout = make_page_layout(key_counts(c.requests), c.page_size, seed);
  for (size_t b = 0; b < c.requests.size(); ++b) {
    pr.keys.push_back(random_values(seed, 100 + b, c.requests[b].num_keys * c.di, 1.f, bf));
  }
  auto pool = make_paged_pool(backend, pr.layout, c.dtype, c.di, pr.keys);
  EXPECT_TRUE(pool.ok()) << pool.status().to_string();
  if (pool.ok()) pr.pool = std::move(pool).value();
  const int64_t t = pr.rows.size();
  pr.q_f32 = random_values(seed, 1, t * c.hi * c.di, 1.f, bf);
  pr.w = random_values(seed, 2, t * c.hi, 1.f, false);
  for (float& x : pr.w) x = 0.25f + std::abs(x);  // mostly positive weights, like the model's
  pr.w[0] = -0.5f;                                // and one negative one
  for (float x : pr.q_f32) pr.q_bf16.push_back(f32_to_bf16(x).bits);
  return pr;
}

std::vector<double> reference_scores(const IndexerProblem& pr, int64_t t) {
  const IndexerCase& c = pr.c;
  const int64_t q_row = int64_t{c.hi} * c.di;
  return ref::index_scores(std::span(pr.q_f32).subspan(t * q_row, q_row), std::span(pr.w).subspan(t * c.hi, c.hi),
                           pr.keys[pr.rows.request[t]], c.hi, c.di, pr.rows.key_len[t]);
}

class IndexerTopkKernel : public ::testing::TestWithParam<IndexerCase> {};

TEST_P(IndexerTopkKernel, MatchesFp64AndIsDeterministic) {
  const IndexerCase& c = GetParam();
  auto backend2 = make_cpu_backend(2);
  auto backend1 = make_cpu_backend(1);
  IndexerProblem pr = make_problem(*backend2, c, 0x5eed + c.di);

  std::vector<int32_t> topk, again, one_thread;
  ASSERT_TRUE(indexer_topk_run(*backend2, pr.params(topk)).ok());
  for (int64_t t = 0; t < pr.rows.size(); ++t) {
    std::span<const int32_t> row(topk.data() + t * c.k, c.k);
    const std::vector<double> s = reference_scores(pr, t);
    EXPECT_EQ(ref::check_topk_row(row, s, c.k), "") << "token " << t << " key_len " << pr.rows.key_len[t];
    if (pr.rows.key_len[t] <= c.k) {  // everything visible is chosen: exact canonical row
      EXPECT_EQ(std::vector<int32_t>(row.begin(), row.end()), ref::canonical_topk(s, c.k)) << "token " << t;
    }
  }
  ASSERT_TRUE(indexer_topk_run(*backend2, pr.params(again)).ok());
  EXPECT_EQ(topk, again) << "second run differs";
  ASSERT_TRUE(indexer_topk_run(*backend1, pr.params(one_thread)).ok());
  EXPECT_EQ(topk, one_thread) << "1 thread differs from 2 threads";

  // Each token alone (as a CP rank owning just that token would run it) gives the same row.
  for (int64_t t = 0; t < pr.rows.size(); ++t) {
    std::vector<int32_t> single;
    IndexerTopkParams p = pr.params(single);
    p.rows = {1, pr.rows.request.data() + t, pr.rows.key_len.data() + t};
    p.q = static_cast<const char*>(p.q) + t * int64_t{c.hi} * c.di * dtype_size(c.dtype);
    p.w = pr.w.data() + t * c.hi;
    single.resize(static_cast<size_t>(c.k));
    ASSERT_TRUE(indexer_topk_run(*backend2, p).ok());
    EXPECT_EQ(single, std::vector<int32_t>(topk.begin() + t * c.k, topk.begin() + (t + 1) * c.k)) << "token " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, IndexerTopkKernel,
    ::testing::Values(IndexerCase{3, 17, 5, 1, DType::kF32, {{40, 3}, {7, 2}}},
                      IndexerCase{3, 17, 5, 3, DType::kBF16, {{40, 3}, {7, 2}}},
                      IndexerCase{5, 33, 16, 61, DType::kF32, {{200, 4}, {1, 1}, {130, 20}}},
                      IndexerCase{4, 64, 64, 64, DType::kBF16, {{1013, 3}, {70, 1}}},
                      IndexerCase{2, 9, 300, 3, DType::kF32, {{200, 2}, {17, 17}}},  // K beyond every context
                      IndexerCase{2, 8, 32, 16, DType::kF32, {{5000, 1}}},           // long decode: key blocks
                      IndexerCase{64, 128, 64, 64, DType::kBF16, {{300, 2}, {65, 1}}}),
    case_name);

// Writes `rows` (dense [S, Di]) of one request into a fresh paged pool and runs the indexer for its tokens.
struct TinyIndexer {
  int32_t hi = 2, di = 4, k;
  std::vector<float> keys, q, w;
  TokenRows rows;

  std::vector<int32_t> run(Backend& backend, int32_t page_size) {
    const int64_t s = static_cast<int64_t>(keys.size()) / di;
    const std::vector<int64_t> lens{s};
    PageLayout layout = make_page_layout(lens, page_size, 99);
    auto pool = make_paged_pool(backend, layout, DType::kF32, di, {keys});
    EXPECT_TRUE(pool.ok());
    std::vector<int32_t> topk(static_cast<size_t>(rows.size() * k), -7);
    IndexerTopkParams p;
    p.rows = rows.view();
    p.Hi = hi;
    p.Di = di;
    p.K = k;
    p.q = q.data();
    p.q_dtype = DType::kF32;
    p.w = w.data();
    p.keys = pool->view;
    p.block_table = layout.view();
    p.topk = topk.data();
    const Status st = indexer_topk_run(backend, p);
    EXPECT_TRUE(st.ok()) << st.to_string();
    return topk;
  }
};

TEST(IndexerTopkTies, IdenticalKeysPickLowestPositions) {
  auto backend = make_cpu_backend(2);
  TinyIndexer x;
  x.k = 8;
  for (int j = 0; j < 50; ++j) x.keys.insert(x.keys.end(), {0.5f, -0.25f, 1.f, 0.125f});
  x.q = {1.f, 1.f, 1.f, 1.f, 0.5f, 0.f, 0.f, 2.f};
  x.w = {1.f, 1.f};
  x.rows = {{0}, {50}};
  for (int32_t ps : {1, 3, 64}) {
    EXPECT_EQ(x.run(*backend, ps), (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7})) << "page_size " << ps;
  }
}

TEST(IndexerTopkTies, TiedGroupsMatchCanonicalRowExactly) {
  auto backend = make_cpu_backend(2);
  TinyIndexer x;
  x.k = 7;
  // Three distinct keys repeated in a scrambled pattern: scores take three values, many ties per value.
  const float rows[3][4] = {{1.f, 0.f, 0.f, 0.f}, {0.5f, 0.f, 0.f, 0.f}, {2.f, 0.f, 0.f, 0.f}};
  for (int j = 0; j < 37; ++j) {
    const int r = (j * 7 + 3) % 5 == 0 ? 2 : (j % 3 == 0 ? 0 : 1);
    x.keys.insert(x.keys.end(), rows[r], rows[r] + 4);
  }
  x.rows = {{0, 0, 0}, {37, 20, 5}};
  for (int t = 0; t < 3; ++t) {  // per token: q [Hi=2, Di=4], w [Hi=2]
    x.q.insert(x.q.end(), {1.f, 0.f, 0.f, 0.f, 1.f, 1.f, 1.f, 1.f});
    x.w.insert(x.w.end(), {1.f, 0.5f});
  }
  const std::vector<int32_t> got = x.run(*backend, 3);
  for (int64_t t = 0; t < x.rows.size(); ++t) {
    const auto s = ref::index_scores(std::span(x.q).subspan(t * 8, 8), std::span(x.w).subspan(t * 2, 2), x.keys, x.hi,
                                     x.di, x.rows.key_len[t]);
    EXPECT_EQ(std::vector<int32_t>(got.begin() + t * x.k, got.begin() + (t + 1) * x.k), ref::canonical_topk(s, x.k))
        << "token " << t;
  }
}

TEST(IndexerTopkTies, NanScoresRankBelowEverything) {
  auto backend = make_cpu_backend(2);
  TinyIndexer x;
  x.k = 4;
  for (int j = 0; j < 6; ++j) x.keys.insert(x.keys.end(), {-1.f - j, 0.f, 0.f, 0.f});  // all scores 0 or less
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::fill_n(x.keys.begin() + 1 * 4, 4, nan);  // key 1 scores NaN
  x.q = {1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  x.w = {-1.f, 1.f, -1.f, 1.f};  // scores are exactly 0: ties everywhere, NaN must lose to all of them
  x.rows = {{0, 0}, {6, 3}};
  EXPECT_EQ(x.run(*backend, 2), (std::vector<int32_t>{0, 2, 3, 4, 0, 1, 2, -1}));
}

TEST(IndexerTopkRows, PaddingRowsAreAllMinusOne) {
  auto backend = make_cpu_backend(2);
  TinyIndexer x;
  x.k = 3;
  for (int j = 0; j < 5; ++j) x.keys.insert(x.keys.end(), {float(j), 1.f, 0.f, 0.f});
  x.q = std::vector<float>(3 * 8, 1.f);
  x.w = std::vector<float>(3 * 2, 1.f);
  x.rows = {{0, 0, 0}, {0, 2, 5}};
  EXPECT_EQ(x.run(*backend, 4), (std::vector<int32_t>{-1, -1, -1, 0, 1, -1, 2, 3, 4}));
}

TEST(IndexerTopkErrors, BadPageRequestOrLengthIsAnErrorNotACrash) {
  auto backend = make_cpu_backend(2);
  const int32_t hi = 1, di = 2, k = 2;
  std::vector<float> pool(4 * 2 * di, 0.f), q(di, 1.f), w(1, 1.f);
  std::vector<int32_t> bt{0, 9, 1, -1}, request{0}, key_len{4}, topk(k);
  IndexerTopkParams p;
  p.rows = {1, request.data(), key_len.data()};
  p.Hi = hi;
  p.Di = di;
  p.K = k;
  p.q = q.data();
  p.q_dtype = DType::kF32;
  p.w = w.data();
  p.keys = {pool.data(), DType::kF32, 4, 2, di};
  p.block_table = {bt.data(), 1, 4};
  Status st = indexer_topk_run(*backend, p);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "null topk";
  p.topk = topk.data();
  st = indexer_topk_run(*backend, p);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("block_table[0, 1]=9"), std::string::npos) << st.message();
  bt[1] = 2;
  key_len[0] = 7;  // needs page 3, which is -1
  st = indexer_topk_run(*backend, p);
  EXPECT_NE(st.message().find("block_table[0, 3]=-1"), std::string::npos) << st.message();
  key_len[0] = 9;  // more than max_pages * page_size
  st = indexer_topk_run(*backend, p);
  EXPECT_NE(st.message().find("key_len=9"), std::string::npos) << st.message();
  key_len[0] = 4;
  request[0] = 1;
  st = indexer_topk_run(*backend, p);
  EXPECT_NE(st.message().find("rows.request=1"), std::string::npos) << st.message();
  request[0] = 0;
  EXPECT_TRUE(indexer_topk_run(*backend, p).ok());
}

}  // namespace
}  // namespace dsacp::testing
