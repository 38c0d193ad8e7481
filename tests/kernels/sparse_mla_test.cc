// Sparse MLA and LSE merge on the CPU backend against fp64 math: paged latent/rope pools (shuffled pages, NaN
// in unused slots), odd dims, front-packed rows with padding and stray entries, bf16 in and out, empty rows,
// determinism across threads and token splits, and merging split key sets back into the whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "dsacp/backend.h"
#include "dsacp/random.h"
#include "kernels/kernel_test_util.h"
#include "support/reference_math.h"

namespace dsacp::testing {
namespace {

struct MlaCase {
  int32_t h, dl, dr, k, page_size;
  DType in_dtype;  // q and the pools
  DType out_dtype;
  std::vector<RequestShape> requests;
};

std::string case_label(const MlaCase& c) {
  return std::string("H") + std::to_string(c.h) + "_Dl" + std::to_string(c.dl) + "_Dr" + std::to_string(c.dr) + "_K" +
         std::to_string(c.k) + "_ps" + std::to_string(c.page_size) + "_in" + dtype_label(c.in_dtype) + "_out" +
         dtype_label(c.out_dtype) + "_" + requests_name(c.requests);
}
std::string case_name(const ::testing::TestParamInfo<MlaCase>& info) { return case_label(info.param); }
// gtest prints the parameter of a failing case with this instead of raw bytes.
void PrintTo(const MlaCase& c, std::ostream* os) { *os << case_label(c); }

struct MlaProblem {
  MlaCase c;
  TokenRows rows;
  PageLayout layout;
  std::vector<std::vector<float>> latent, rope;  // dense per request: [S_b, Dl], [S_b, Dr]
  PagedPool latent_pool, rope_pool;
  std::vector<float> q_nope, q_rope;  // f32 values (bf16-exact when in_dtype is bf16)
  std::vector<uint16_t> q_nope_bf16, q_rope_bf16;
  std::vector<int32_t> topk;  // [T, K]
  float scale = 0.f;

  // The problem's parameters, without out and lse.
  SparseMlaParams params() const {
    SparseMlaParams p;
    p.rows = rows.view();
    p.H = c.h;
    p.Dl = c.dl;
    p.Dr = c.dr;
    p.K = c.k;
    p.scale = scale;
    const bool bf = c.in_dtype == DType::kBF16;
    p.q_nope = bf ? static_cast<const void*>(q_nope_bf16.data()) : q_nope.data();
    p.q_rope = bf ? static_cast<const void*>(q_rope_bf16.data()) : q_rope.data();
    p.q_dtype = c.in_dtype;
    p.latent = latent_pool.view;
    p.rope = rope_pool.view;
    p.block_table = layout.view();
    p.topk = topk.data();
    return p;
  }

  // Runs the kernel for `topk_rows` (default: the problem's) with out in out_dtype; returns out as f32.
  Status run(Backend& backend, std::vector<float>& out, std::vector<float>& lse, DType out_dtype,
             const std::vector<int32_t>* topk_rows = nullptr) const {
    const int64_t t = rows.size();
    std::vector<uint8_t> raw(static_cast<size_t>(t * c.h * c.dl) * dtype_size(out_dtype), 0xCD);
    lse.assign(static_cast<size_t>(t * c.h), 12345.f);
    SparseMlaParams p = params();
    p.topk = (topk_rows != nullptr ? topk_rows : &topk)->data();
    p.out = raw.data();
    p.out_dtype = out_dtype;
    p.lse = lse.data();
    Status st = sparse_mla_run(backend, p);
    out.resize(static_cast<size_t>(t * c.h * c.dl));
    for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_f32(raw.data(), out_dtype, static_cast<int64_t>(i));
    return st;
  }
};

// Token t's row: m distinct positions of [0, key_len) ascending, where m varies with t (full, half, one less,
// none); some rows carry a stray entry >= key_len followed by a valid-looking one, which must end the scan.
std::vector<int32_t> make_row(uint64_t seed, int64_t t, int32_t key_len, int32_t k) {
  std::vector<int32_t> pos(static_cast<size_t>(key_len));
  std::iota(pos.begin(), pos.end(), 0);
  for (int32_t i = key_len - 1; i > 0; --i) {
    std::swap(pos[i], pos[counter_hash(seed, 1000 + t, i) % uint64_t(i + 1)]);
  }
  int32_t m = std::min(k, key_len);
  if (t % 4 == 1) m /= 2;
  if (t % 4 == 2) m = std::max(0, m - 1);
  if (t % 7 == 6) m = 0;
  std::vector<int32_t> row(pos.begin(), pos.begin() + m);
  std::sort(row.begin(), row.end());
  row.resize(static_cast<size_t>(k), -1);
  if (m + 2 <= k && t % 3 == 0) {
    row[m] = key_len + 3;  // stray: past key_len, ends the row
    row[m + 1] = 0;        // looks valid, must be ignored
  }
  return row;
}

MlaProblem make_problem(Backend& backend, const MlaCase& c, uint64_t seed) {
  MlaProblem pr;
  pr.c = c;
  const bool bf = c.in_dtype == DType::kBF16;
  pr.rows = make_token_rows(c.requests, /*empty_row=*/true);
  pr.layout = make_page_layout(key_counts(c.requests), c.page_size, seed);
  for (size_t b = 0; b < c.requests.size(); ++b) {
    pr.latent.push_back(random_values(seed, 200 + b, c.requests[b].num_keys * c.dl, 1.f, bf));
    pr.rope.push_back(random_values(seed, 300 + b, c.requests[b].num_keys * c.dr, 1.f, bf));
  }
  auto lat = make_paged_pool(backend, pr.layout, c.in_dtype, c.dl, pr.latent, c.in_dtype);
  auto rope = make_paged_pool(backend, pr.layout, c.in_dtype, c.dr, pr.rope, c.in_dtype);
  EXPECT_TRUE(lat.ok() && rope.ok());
  if (lat.ok()) pr.latent_pool = std::move(lat).value();
  if (rope.ok()) pr.rope_pool = std::move(rope).value();
  const int64_t t = pr.rows.size();
  pr.q_nope = random_values(seed, 3, t * c.h * c.dl, 1.f, bf);
  pr.q_rope = random_values(seed, 4, t * c.h * c.dr, 1.f, bf);
  for (float x : pr.q_nope) pr.q_nope_bf16.push_back(f32_to_bf16(x).bits);
  for (float x : pr.q_rope) pr.q_rope_bf16.push_back(f32_to_bf16(x).bits);
  for (int64_t i = 0; i < t; ++i) {
    const auto row = make_row(seed, i, pr.rows.key_len[i], c.k);
    pr.topk.insert(pr.topk.end(), row.begin(), row.end());
  }
  pr.scale = 2.f / std::sqrt(float(c.dl + c.dr));  // logits of order 1..3: a non-trivial softmax
  return pr;
}

// The valid prefix of a row (what the kernel must use).
std::vector<int32_t> valid_prefix(std::span<const int32_t> row, int32_t key_len) {
  std::vector<int32_t> v;
  for (int32_t e : row) {
    if (e < 0 || e >= key_len) break;
    v.push_back(e);
  }
  return v;
}

class SparseMlaKernel : public ::testing::TestWithParam<MlaCase> {};

TEST_P(SparseMlaKernel, MatchesFp64AndIsDeterministic) {
  const MlaCase& c = GetParam();
  auto backend2 = make_cpu_backend(2);
  auto backend1 = make_cpu_backend(1);
  MlaProblem pr = make_problem(*backend2, c, 0xabc + c.dl);
  std::vector<float> out, lse;
  ASSERT_TRUE(pr.run(*backend2, out, lse, c.out_dtype).ok());
  const double out_tol = c.out_dtype == DType::kBF16 ? 1e-2 : 1e-5;
  for (int64_t t = 0; t < pr.rows.size(); ++t) {
    const int32_t b = pr.rows.request[t];
    const auto chosen = valid_prefix(std::span(pr.topk).subspan(t * c.k, c.k), pr.rows.key_len[t]);
    for (int32_t h = 0; h < c.h; ++h) {
      const int64_t th = t * c.h + h;
      const auto want =
          ref::attention(std::span(pr.q_nope).subspan(th * c.dl, c.dl), std::span(pr.q_rope).subspan(th * c.dr, c.dr),
                         pr.latent[b], pr.rope[b], chosen, pr.scale, c.dl, c.dr);
      std::span<const float> got(out.data() + th * c.dl, c.dl);
      if (chosen.empty()) {
        EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.f && !std::signbit(x); }))
            << "empty row must give out = 0, token " << t;
        EXPECT_EQ(lse[th], -std::numeric_limits<float>::infinity()) << "token " << t;
        continue;
      }
      EXPECT_LT(ref::rel_norm_error(got, want.out), out_tol) << "token " << t << " head " << h;
      EXPECT_NEAR(lse[th], want.lse, 1e-5 * std::max(1.0, std::abs(want.lse))) << "token " << t << " head " << h;
    }
  }
  std::vector<float> out2, lse2, out1, lse1;
  ASSERT_TRUE(pr.run(*backend2, out2, lse2, c.out_dtype).ok());
  EXPECT_TRUE(bit_equal(out, out2) && bit_equal(lse, lse2)) << "second run differs";
  ASSERT_TRUE(pr.run(*backend1, out1, lse1, c.out_dtype).ok());
  EXPECT_TRUE(bit_equal(out, out1) && bit_equal(lse, lse1)) << "1 thread differs from 2 threads";
}

INSTANTIATE_TEST_SUITE_P(Cases, SparseMlaKernel,
                         ::testing::Values(MlaCase{5, 13, 7, 6, 1, DType::kF32, DType::kF32, {{40, 3}, {7, 2}}},
                                           MlaCase{5, 13, 7, 6, 3, DType::kBF16, DType::kBF16, {{40, 3}, {7, 2}}},
                                           MlaCase{3, 33, 5, 64, 61, DType::kF32, DType::kBF16, {{200, 4}, {130, 20}}},
                                           MlaCase{16, 64, 16, 32, 64, DType::kBF16, DType::kF32, {{1013, 2}, {1, 1}}},
                                           MlaCase{1, 1, 1, 1, 2, DType::kF32, DType::kF32, {{5, 2}}},
                                           MlaCase{16, 512, 64, 128, 64, DType::kBF16, DType::kF32, {{300, 2}}}),
                         case_name);

// Splitting each row's keys over S parts, attending per part and merging by LSE reproduces the whole.
// head_blocks = B lays q, out and lse out as B blocks of [T, H / B]: the same numbers, permuted.
TEST(SparseMlaKernel, HeadBlocksArePermutedRowsOfThePlainLayout) {
  auto backend = make_cpu_backend(2);
  const MlaCase c{8, 24, 8, 40, 7, DType::kF32, DType::kF32, {{90, 5}, {33, 3}}};
  MlaProblem pr = make_problem(*backend, c, 91);
  std::vector<float> plain_out, plain_lse;
  ASSERT_TRUE(pr.run(*backend, plain_out, plain_lse, DType::kF32).ok());
  const int64_t T = static_cast<int64_t>(pr.rows.size());
  for (int32_t blocks : {2, 4, 8}) {
    const int32_t per = c.h / blocks;
    auto row = [&](int64_t t, int32_t h) { return (static_cast<int64_t>(h / per) * T + t) * per + h % per; };
    std::vector<float> qn(pr.q_nope.size()), qr(pr.q_rope.size());
    for (int64_t t = 0; t < T; ++t) {
      for (int32_t h = 0; h < c.h; ++h) {
        std::copy_n(pr.q_nope.begin() + (t * c.h + h) * c.dl, c.dl, qn.begin() + row(t, h) * c.dl);
        std::copy_n(pr.q_rope.begin() + (t * c.h + h) * c.dr, c.dr, qr.begin() + row(t, h) * c.dr);
      }
    }
    std::vector<float> out(plain_out.size(), 7.f), lse(plain_lse.size(), 7.f);
    SparseMlaParams p = pr.params();
    p.q_nope = qn.data();
    p.q_rope = qr.data();
    p.out = out.data();
    p.out_dtype = DType::kF32;
    p.lse = lse.data();
    p.head_blocks = blocks;
    ASSERT_TRUE(sparse_mla_run(*backend, p).ok());
    for (int64_t t = 0; t < T; ++t) {
      for (int32_t h = 0; h < c.h; ++h) {
        ASSERT_EQ(lse[row(t, h)], plain_lse[t * c.h + h]) << "blocks " << blocks << " t " << t << " h " << h;
        ASSERT_EQ(0, std::memcmp(out.data() + row(t, h) * c.dl, plain_out.data() + (t * c.h + h) * c.dl,
                                 c.dl * sizeof(float)));
      }
    }
  }
  SparseMlaParams bad = pr.params();
  bad.head_blocks = 3;
  EXPECT_NE(validate(bad).message().find("H=8 must be a multiple of head_blocks=3"), std::string::npos);
}

TEST(LseMergeKernel, SplitKeySetsMergeToTheWhole) {
  auto backend = make_cpu_backend(2);
  const MlaCase c{4, 24, 8, 40, 7, DType::kF32, DType::kF32, {{90, 5}, {33, 3}}};
  MlaProblem pr = make_problem(*backend, c, 77);
  std::vector<float> whole_out, whole_lse;
  ASSERT_TRUE(pr.run(*backend, whole_out, whole_lse, DType::kF32).ok());

  const int32_t parts = 3;
  const int64_t t_count = pr.rows.size();
  const int64_t rows = t_count * c.h;
  std::vector<float> part_out(static_cast<size_t>(parts * rows * c.dl)), part_lse(static_cast<size_t>(parts * rows));
  for (int32_t s = 0; s < parts; ++s) {
    // Part s takes the chosen entries with (t + i) % parts == s (part 2 of token 0 is empty when it has few).
    std::vector<int32_t> sub(pr.topk.size(), -1);
    for (int64_t t = 0; t < t_count; ++t) {
      const auto chosen = valid_prefix(std::span(pr.topk).subspan(t * c.k, c.k), pr.rows.key_len[t]);
      int32_t n = 0;
      for (size_t i = 0; i < chosen.size(); ++i) {
        if ((t + static_cast<int64_t>(i)) % parts == s) sub[t * c.k + n++] = chosen[i];
      }
    }
    std::vector<float> o, l;
    ASSERT_TRUE(pr.run(*backend, o, l, DType::kF32, &sub).ok());
    std::copy(o.begin(), o.end(), part_out.begin() + s * rows * c.dl);
    std::copy(l.begin(), l.end(), part_lse.begin() + s * rows);
  }
  std::vector<float> out(static_cast<size_t>(rows * c.dl), 7.f), lse(static_cast<size_t>(rows), 7.f);
  LseMergeParams p{parts, rows, c.dl, part_out.data(), part_lse.data(), out.data(), lse.data()};
  ASSERT_TRUE(lse_merge_run(*backend, p).ok());
  // A bf16 out is the f32 merge rounded once (to nearest even); the lse is unchanged.
  std::vector<bf16> out_bf(static_cast<size_t>(rows * c.dl));
  std::vector<float> lse_bf(static_cast<size_t>(rows));
  LseMergeParams pb = p;
  pb.out = out_bf.data();
  pb.out_dtype = DType::kBF16;
  pb.lse = lse_bf.data();
  ASSERT_TRUE(lse_merge_run(*backend, pb).ok());
  for (size_t i = 0; i < out_bf.size(); ++i) ASSERT_EQ(bf16_to_f32(out_bf[i]), round_to_bf16(out[i])) << i;
  EXPECT_TRUE(bit_equal(lse_bf, lse));
  // In place (out and lse over part 0) gives the same bits.
  LseMergeParams in_place{parts, rows, c.dl, part_out.data(), part_lse.data(), part_out.data(), part_lse.data()};
  ASSERT_TRUE(lse_merge_run(*backend, in_place).ok());
  EXPECT_TRUE(bit_equal(std::vector<float>(part_out.begin(), part_out.begin() + rows * c.dl), out));
  EXPECT_TRUE(bit_equal(std::vector<float>(part_lse.begin(), part_lse.begin() + rows), lse));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> want(whole_out.begin() + r * c.dl, whole_out.begin() + (r + 1) * c.dl);
    std::span<const float> got(out.data() + r * c.dl, c.dl);
    if (std::isinf(whole_lse[r])) {
      EXPECT_EQ(lse[r], -std::numeric_limits<float>::infinity()) << "row " << r;
      EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](float x) { return x == 0.f; })) << "row " << r;
      continue;
    }
    EXPECT_LT(ref::rel_norm_error(got, want), 1e-5) << "row " << r;
    EXPECT_NEAR(lse[r], whole_lse[r], 1e-5 * std::max(1.f, std::abs(whole_lse[r]))) << "row " << r;
  }
}

// bf16 partials (what DCP exchanges when the output is bf16): the merge reads each element as the f32 it
// rounds to, so it equals the f32 merge of the rounded parts bit for bit, with f32 or bf16 out.
TEST(LseMergeKernel, Bf16PartsMergeAsTheirF32Values) {
  auto backend = make_cpu_backend(2);
  const int32_t parts = 3, dl = 40;
  const int64_t rows = 23;
  std::vector<float> part_f32(static_cast<size_t>(parts * rows * dl)), part_lse(static_cast<size_t>(parts * rows));
  std::vector<bf16> part_bf(part_f32.size());
  for (size_t i = 0; i < part_f32.size(); ++i) {
    const float v = static_cast<float>(static_cast<int64_t>(counter_hash(41, 1, i) % 20001) - 10000) / 997.f;
    part_bf[i] = f32_to_bf16(v);
    part_f32[i] = bf16_to_f32(part_bf[i]);
  }
  for (size_t i = 0; i < part_lse.size(); ++i) {
    part_lse[i] = i % 7 == 3 ? -std::numeric_limits<float>::infinity()
                             : static_cast<float>(counter_hash(41, 2, i) % 1000) / 100.f;
  }
  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    const size_t n = static_cast<size_t>(rows * dl) * dtype_size(out_dtype);
    std::vector<char> want(n), got(n);
    std::vector<float> lse_want(static_cast<size_t>(rows)), lse_got(static_cast<size_t>(rows));
    LseMergeParams p{parts, rows, dl, part_f32.data(), part_lse.data(), want.data(), lse_want.data(), out_dtype};
    ASSERT_TRUE(lse_merge_run(*backend, p).ok());
    LseMergeParams pb = p;
    pb.part_out = part_bf.data();
    pb.part_dtype = DType::kBF16;
    pb.out = got.data();
    pb.lse = lse_got.data();
    ASSERT_TRUE(lse_merge_run(*backend, pb).ok());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), n)) << dtype_name(out_dtype);
    EXPECT_TRUE(bit_equal(lse_want, lse_got));
    // The parts given one buffer each (a window exchange's messages, read in place): the same result.
    const std::vector<std::vector<bf16>> own_out = split_parts(part_bf, parts, rows * dl);
    const std::vector<std::vector<float>> own_lse = split_parts(part_lse, parts, rows);
    LseMergeParams pp = pb;
    pp.part_out = nullptr;
    pp.part_lse = nullptr;
    for (int32_t k = 0; k < parts; ++k) {
      pp.part_out_of[k] = own_out[k].data();
      pp.part_lse_of[k] = own_lse[k].data();
    }
    std::vector<char> got2(n, 0);
    std::vector<float> lse_got2(static_cast<size_t>(rows), 0.f);
    pp.out = got2.data();
    pp.lse = lse_got2.data();
    ASSERT_TRUE(lse_merge_run(*backend, pp).ok());
    EXPECT_EQ(0, std::memcmp(want.data(), got2.data(), n)) << dtype_name(out_dtype) << " (one buffer per part)";
    EXPECT_TRUE(bit_equal(lse_want, lse_got2));
    pp.part_lse_of[parts - 1] = nullptr;
    const Status missing = lse_merge_run(*backend, pp);
    EXPECT_NE(missing.message().find("part 2 has no buffer"), std::string::npos) << missing.to_string();
  }
  // An in-place merge needs the same dtype on both sides.
  LseMergeParams alias{parts, rows, dl, part_bf.data(), part_lse.data(), part_bf.data(), part_lse.data()};
  alias.part_dtype = DType::kBF16;
  const Status st = lse_merge_run(*backend, alias);
  EXPECT_NE(st.message().find("out aliases part 0 with a different dtype"), std::string::npos) << st.to_string();
}

TEST(LseMergeKernel, EmptyOrBrokenPartsContributeExactlyNothing) {
  auto backend = make_cpu_backend(2);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const int32_t dl = 3;
  // Row 0: part 0 real, parts 1..3 have -inf / NaN / +inf LSE with NaN outputs. Row 1: every part empty.
  std::vector<float> part_out = {0.25f, -1.5f, 3.f, 9.f, 9.f, 9.f, nan, nan, nan, 1.f, 1.f, 1.f,
                                 nan,   nan,   nan, 5.f, 5.f, 5.f, nan, nan, nan, 0.f, 0.f, 0.f};
  std::vector<float> part_lse = {1.75f, -inf, -inf, nan, nan, -inf, inf, -inf};
  std::vector<float> out(2 * dl, 7.f), lse(2, 7.f);
  LseMergeParams p{4, 2, dl, part_out.data(), part_lse.data(), out.data(), lse.data()};
  ASSERT_TRUE(lse_merge_run(*backend, p).ok());
  EXPECT_EQ(std::vector<float>(out.begin(), out.begin() + dl), (std::vector<float>{0.25f, -1.5f, 3.f}));
  EXPECT_EQ(lse[0], 1.75f);
  EXPECT_EQ(std::vector<float>(out.begin() + dl, out.end()), (std::vector<float>{0.f, 0.f, 0.f}));
  EXPECT_EQ(lse[1], -inf);
}

TEST(SparseMlaErrors, BadPageOrRequestIsAnErrorNotACrash) {
  auto backend = make_cpu_backend(2);
  std::vector<float> latent(3 * 2 * 2, 0.f), rope(3 * 2 * 1, 0.f), qn(2, 1.f), qr(1, 1.f), out(2), lse(1);
  std::vector<int32_t> bt{0, 5, -1}, request{0}, key_len{6}, topk{1, 3};
  SparseMlaParams p;
  p.rows = {1, request.data(), key_len.data()};
  p.H = 1;
  p.Dl = 2;
  p.Dr = 1;
  p.K = 2;
  p.scale = 1.f;
  p.q_nope = qn.data();
  p.q_rope = qr.data();
  p.q_dtype = DType::kF32;
  p.latent = {latent.data(), DType::kF32, 3, 2, 2};
  p.rope = {rope.data(), DType::kF32, 3, 2, 1};
  p.block_table = {bt.data(), 1, 3};
  p.topk = topk.data();
  p.out = out.data();
  p.out_dtype = DType::kF32;
  p.lse = lse.data();
  Status st = sparse_mla_run(*backend, p);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("block_table[0, 1]=5"), std::string::npos) << st.message();
  topk = {1, 5};  // page 2 is -1
  st = sparse_mla_run(*backend, p);
  EXPECT_NE(st.message().find("block_table[0, 2]=-1"), std::string::npos) << st.message();
  topk = {1, 7};  // past key_len: ends the row, never looked up
  EXPECT_TRUE(sparse_mla_run(*backend, p).ok());
  request[0] = -1;
  st = sparse_mla_run(*backend, p);
  EXPECT_NE(st.message().find("rows.request=-1"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace dsacp::testing
