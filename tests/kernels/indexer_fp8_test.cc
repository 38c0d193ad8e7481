// The FP8 indexer format on the CPU backend (contract section 6): the two-plane page built byte by byte from the
// contract's words and read back through the cache write and the indexer; the quantizing cache write (both scale
// rules) against direct fp64 math; the FP8 score against direct fp64 math on odd dims and page sizes 1, 61, 64;
// hostile inputs (NaN/Inf keys, zero keys, all-equal scores, scales at the e4m3 edges, rows shorter than K).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/backend.h"
#include "dsacp/fp8.h"
#include "dsacp/paged_cache.h"
#include "kernels/kernel_test_util.h"
#include "support/reference_math.h"

namespace dsacp::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// One request's keys as the pool stores them: e4m3 codes [S, Di] and scales [S].
struct Fp8Keys {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

// The scale rule of the contract in fp64: max(amax / 448, 2^-126), ue8m0 = 2^ceil(log2 .), amax over finite |x|.
double ref_scale(const float* x, int32_t n, Fp8ScaleMode mode) {
  double amax = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  }
  double s = std::max(static_cast<double>(static_cast<float>(amax / 448.0)), std::ldexp(1.0, -126));
  if (mode == Fp8ScaleMode::kUe8m0) s = std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(s))));
  return s;
}

// An FP8 pool of `layout`, NaN-poisoned, with each request's keys written through cache_write as e4m3 rows + scales.
Result<PagedKvCache> make_fp8_cache(Backend& backend, const PageLayout& layout, int32_t di,
                                    const std::vector<Fp8Keys>& keys) {
  PagedCacheConfig cfg;
  cfg.num_pages = layout.num_pages;
  cfg.page_size = layout.page_size;
  cfg.Dl = 1;
  cfg.Dr = 1;
  cfg.Di = di;
  cfg.dtype = DType::kF32;
  cfg.index_dtype = DType::kF8E4M3;
  DSACP_ASSIGN_OR_RETURN(PagedKvCache cache, PagedKvCache::create(backend, cfg));
  std::vector<uint8_t> rows;
  std::vector<float> scales;
  std::vector<int64_t> slots;
  for (int32_t b = 0; b < static_cast<int32_t>(keys.size()); ++b) {
    for (size_t j = 0; j < keys[b].scales.size(); ++j) slots.push_back(layout.slot(b, static_cast<int64_t>(j)));
    rows.insert(rows.end(), keys[b].codes.begin(), keys[b].codes.end());
    scales.insert(scales.end(), keys[b].scales.begin(), keys[b].scales.end());
  }
  CacheWriteParams w;
  w.rows = rows.data();
  w.rows_dtype = DType::kF8E4M3;
  w.row_scales = scales.data();
  w.num_rows = static_cast<int64_t>(slots.size());
  w.slots = slots.data();
  w.pool = cache.index_keys();
  DSACP_RETURN_IF_ERROR(cache_write_run(backend, w));
  return cache;
}

// Random e4m3 keys of one request: values quantized from [-amp, amp) with the fp32 rule.
Fp8Keys random_keys(uint64_t seed, uint64_t stream, int64_t n, int32_t di, float amp) {
  Fp8Keys k;
  const std::vector<float> x = random_values(seed, stream, n * di, amp, false);
  for (int64_t j = 0; j < n; ++j) {
    float amax = 0.f;
    for (int32_t d = 0; d < di; ++d) amax = std::max(amax, fp8_amax_term(x[j * di + d]));
    const float s = fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32);
    k.scales.push_back(s);
    for (int32_t d = 0; d < di; ++d) k.codes.push_back(fp8_quantize(x[j * di + d], s));
  }
  return k;
}

TEST(Fp8IndexerPage, BuiltByteByByteFromTheContractAndReadBack) {
  auto backend = make_cpu_backend(2);
  for (int32_t ps : {1, 3, 61, 64}) {
    const int32_t di = 5;
    const std::vector<int64_t> lens = {ps * 2 + 1, 2};
    const PageLayout layout = make_page_layout(lens, ps, 0xbabe + ps);
    std::vector<Fp8Keys> keys = {random_keys(7, 1, lens[0], di, 3.f), random_keys(7, 2, lens[1], di, 100.f)};
    auto cache = make_fp8_cache(*backend, layout, di, keys);
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    const PagedPoolView v = cache->index_keys();
    ASSERT_EQ(v.dtype, DType::kF8E4M3);
    // "each page of page_size tokens holds all page_size x Di e4m3 bytes first, then the page_size fp32 scales":
    // the expected pool, written from those words alone (unwritten slots: the 0x7f poison bytes).
    const int64_t page_bytes = int64_t{ps} * di + int64_t{ps} * 4;
    std::vector<uint8_t> want(static_cast<size_t>(layout.num_pages * page_bytes), 0x7f);
    for (int32_t b = 0; b < 2; ++b) {
      for (int64_t j = 0; j < lens[b]; ++j) {
        const int64_t slot = layout.slot(b, j), page = slot / ps, off = slot % ps;
        for (int32_t d = 0; d < di; ++d) want[page * page_bytes + off * di + d] = keys[b].codes[j * di + d];
        std::memcpy(&want[page * page_bytes + int64_t{ps} * di + off * 4], &keys[b].scales[j], 4);
      }
    }
    ASSERT_EQ(cache->bytes() - (cache->latent().num_pages * ps * 2 * 4), want.size());
    EXPECT_EQ(std::memcmp(v.data, want.data(), want.size()), 0) << "page_size " << ps;

    // Read back through the indexer: one head, w = 1, q = one-hot on dim d with scale 1 gives
    // s(j) = relu(sk[j] * k8[j, d]); a bf16 indexer over the dequantized keys must pick the same rows.
    for (int32_t d = 0; d < di; ++d) {
      TokenRows rows;
      rows.request = {0, 1};
      rows.key_len = {static_cast<int32_t>(lens[0]), static_cast<int32_t>(lens[1])};
      std::vector<uint8_t> q(2 * di, 0);
      q[d] = q[di + d] = 0x38;  // 1.0
      const std::vector<float> qs = {1.f, 1.f}, w = {1.f, 1.f};
      const int32_t K = 4;
      std::vector<int32_t> topk(2 * K);
      std::vector<float> sc(2 * K);
      IndexerTopkParams p;
      p.rows = rows.view();
      p.Hi = 1;
      p.Di = di;
      p.K = K;
      p.q = q.data();
      p.q_dtype = DType::kF8E4M3;
      p.q_scale = qs.data();
      p.w = w.data();
      p.keys = v;
      p.block_table = layout.view();
      p.topk = topk.data();
      p.topk_scores = sc.data();
      ASSERT_TRUE(indexer_topk_run(*backend, p).ok());
      for (int32_t t = 0; t < 2; ++t) {
        std::vector<double> s;
        for (int64_t j = 0; j < lens[t]; ++j) {
          // the f32 product (the double one is exact; rounded once to f32)
          s.push_back(static_cast<float>(
              std::max(0.0, static_cast<double>(keys[t].scales[j]) * e4m3_to_f32(keys[t].codes[j * di + d]))));
        }
        EXPECT_EQ(std::vector<int32_t>(topk.begin() + t * K, topk.begin() + (t + 1) * K), ref::canonical_topk(s, K));
        for (int32_t i = 0; i < K && topk[t * K + i] >= 0; ++i) {
          EXPECT_EQ(sc[t * K + i], static_cast<float>(s[topk[t * K + i]]));
        }
      }
    }
  }
}

TEST(Fp8CacheWrite, QuantizesF32AndBf16RowsWithBothRules) {
  auto backend = make_cpu_backend(2);
  const int32_t di = 7, ps = 61;
  const std::vector<int64_t> lens = {130};
  const PageLayout layout = make_page_layout(lens, ps, 0x9a7e);
  std::vector<float> x = random_values(3, 3, lens[0] * di, 50.f, true);  // bf16-exact, so both row dtypes agree
  // Hostile rows: zeros, NaN/Inf among finite values, all non-finite, e4m3 edges, huge and tiny amax.
  const std::vector<std::vector<float>> special = {{0, 0, 0, 0, 0, 0, 0},
                                                   {kNaN, 1, -kInf, kInf, 0.25f, 2, 3},
                                                   {kNaN, kInf, -kInf, kNaN, kNaN, kNaN, kNaN},
                                                   {448, -448, 1, 2, 3, 4, 0.5f},
                                                   {3e38f, -1e38f, 1, 0, 0, 0, 1},
                                                   {std::ldexp(1.f, -130), 0, 0, 0, 0, 0, -std::ldexp(1.f, -133)}};
  for (size_t r = 0; r < special.size(); ++r) std::copy(special[r].begin(), special[r].end(), x.begin() + r * 11 * di);
  for (float& f : x) f = round_to_bf16(f);  // the same numbers as f32 and as bf16 rows
  std::vector<int64_t> slots;
  for (int64_t j = 0; j < lens[0]; ++j) slots.push_back(layout.slot(0, j));
  std::vector<uint16_t> xb;
  for (float f : x) xb.push_back(f32_to_bf16(f).bits);
  for (Fp8ScaleMode mode : {Fp8ScaleMode::kFp32, Fp8ScaleMode::kUe8m0}) {
    for (DType rows_dtype : {DType::kF32, DType::kBF16}) {
      PagedCacheConfig cfg{layout.num_pages, ps, 1, 1, di, DType::kBF16, 1, DType::kF8E4M3, mode};
      auto cache = PagedKvCache::create(*backend, cfg);
      ASSERT_TRUE(cache.ok()) << cache.status().to_string();
      CacheWriteParams w;
      w.rows = rows_dtype == DType::kF32 ? static_cast<const void*>(x.data()) : xb.data();
      w.rows_dtype = rows_dtype;
      w.fp8_scale_mode = mode;
      w.num_rows = lens[0];
      w.slots = slots.data();
      w.pool = cache->index_keys();
      ASSERT_TRUE(cache_write_run(*backend, w).ok());
      const uint8_t* base = static_cast<const uint8_t*>(w.pool.data);
      for (int64_t j = 0; j < lens[0]; ++j) {
        const float* row = x.data() + j * di;
        const double s = ref_scale(row, di, mode);
        const int64_t page = slots[j] / ps, off = slots[j] % ps;
        float got_s;
        std::memcpy(&got_s, base + page * ps * (di + 4) + ps * di + off * 4, 4);
        ASSERT_EQ(static_cast<double>(got_s), s) << "row " << j << " mode " << int(mode);
        for (int32_t d = 0; d < di; ++d) {
          const uint8_t got = base[page * ps * (di + 4) + off * di + d];
          // e4m3 of the f32 quotient: nearest even, saturating, NaN kept (fp8.h is checked against a brute-force
          // search in test_fp8.cc; here the quotient and the placement are checked).
          const float quot = static_cast<float>(static_cast<double>(row[d]) / s);
          ASSERT_EQ(got, f32_to_e4m3(quot)) << "row " << j << " d " << d;
          if (std::isfinite(row[d])) {
            EXPECT_LE(std::fabs(s * e4m3_to_f32(got) - row[d]), std::fabs(row[d]) / 16 + s * std::ldexp(1.0, -10))
                << "row " << j << " d " << d;
          }
        }
      }
    }
  }
}

TEST(Fp8CacheWrite, RefusesBadScalesAndMismatchedPools) {
  auto backend = make_cpu_backend(1);
  PagedCacheConfig cfg{2, 2, 1, 1, 3, DType::kF32, 1, DType::kF8E4M3, Fp8ScaleMode::kFp32};
  auto cache = PagedKvCache::create(*backend, cfg);
  ASSERT_TRUE(cache.ok());
  const std::vector<uint8_t> rows(6, 0x38);
  std::vector<int64_t> slots = {0, 3};
  for (float bad : {0.f, -1.f, kNaN, kInf}) {
    std::vector<float> scales = {1.f, bad};
    CacheWriteParams w;
    w.rows = rows.data();
    w.rows_dtype = DType::kF8E4M3;
    w.row_scales = scales.data();
    w.num_rows = 2;
    w.slots = slots.data();
    w.pool = cache->index_keys();
    const Status st = cache_write_run(*backend, w);
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("row_scales[1]"), std::string::npos) << st.message();
    w.row_scales = nullptr;
    EXPECT_NE(cache_write_run(*backend, w).message().find("row_scales"), std::string::npos);
    w.row_scales = scales.data();
    w.pool = cache->latent();  // e4m3 rows into an f32 pool
    EXPECT_NE(cache_write_run(*backend, w).message().find("F8_E4M3 pool"), std::string::npos);
  }
}

// A random FP8 indexer problem; the reference is the contract's f32 formula evaluated here directly (bitwise
// equal scores expected) and the fp64 value of the same formula (canonical row up to near ties).
struct Fp8Case {
  int32_t hi, di, k, page_size;
  std::vector<RequestShape> requests;
};

void run_fp8_case(const Fp8Case& c, uint64_t seed, bool hostile) {
  auto backend = make_cpu_backend(2);
  auto backend1 = make_cpu_backend(1);
  const TokenRows rows = make_token_rows(c.requests, true);
  const PageLayout layout = make_page_layout(key_counts(c.requests), c.page_size, seed);
  std::vector<Fp8Keys> keys;
  for (size_t b = 0; b < c.requests.size(); ++b) {
    keys.push_back(random_keys(seed, 10 + b, c.requests[b].num_keys, c.di, 4.f));
  }
  const int64_t T = rows.size();
  std::vector<uint8_t> q(static_cast<size_t>(T * c.hi * c.di));
  const std::vector<float> qx = random_values(seed, 1, T * c.hi * c.di, 400.f, false);
  for (size_t i = 0; i < q.size(); ++i) q[i] = f32_to_e4m3(qx[i]);
  std::vector<float> qs = random_values(seed, 2, T * c.hi, 1.f, false),
                     w = random_values(seed, 3, T * c.hi, 1.f, false);
  for (float& s : qs) s = std::ldexp(0.5f + std::fabs(s), -8);
  for (float& x : w) x = 0.25f + std::fabs(x);
  w[0] = -0.5f;
  if (hostile) {
    Fp8Keys& k0 = keys[0];
    const int64_t n0 = static_cast<int64_t>(k0.scales.size());
    for (int64_t j = 0; j < n0; ++j) {
      uint8_t* row = k0.codes.data() + j * c.di;
      switch (j % 7) {
        case 0:
          std::memset(row, 0x7f, c.di);
          break;  // NaN key
        case 1:
          std::memset(row, 0, c.di);
          k0.scales[j] = std::ldexp(1.f, -126);
          break;  // zero key, floor scale
        case 2:
          std::memset(row, 0x7e, c.di);
          k0.scales[j] = 3e38f;
          break;  // 448 x huge scale: +inf scores
        case 3:
          std::memset(row, 0x01, c.di);
          k0.scales[j] = std::ldexp(1.f, -126);
          break;  // smallest e4m3 x floor
        case 4:
          std::memset(row, 0x38, c.di);
          k0.scales[j] = 1.f;
          break;  // equal
        default:
          break;
      }
    }
    for (int32_t i = 0; i < c.hi; ++i) qs[i] = 3e38f;  // token 0: q scale at the f32 edge
  }
  auto cache = make_fp8_cache(*backend, layout, c.di, keys);
  ASSERT_TRUE(cache.ok()) << cache.status().to_string();
  std::vector<int32_t> topk(static_cast<size_t>(T * c.k)), one(topk.size());
  std::vector<float> sc(topk.size());
  IndexerTopkParams p;
  p.rows = rows.view();
  p.Hi = c.hi;
  p.Di = c.di;
  p.K = c.k;
  p.q = q.data();
  p.q_dtype = DType::kF8E4M3;
  p.q_scale = qs.data();
  p.w = w.data();
  p.keys = cache->index_keys();
  p.block_table = layout.view();
  p.topk = topk.data();
  p.topk_scores = sc.data();
  ASSERT_TRUE(indexer_topk_run(*backend, p).ok());
  p.topk = one.data();
  p.topk_scores = nullptr;
  ASSERT_TRUE(indexer_topk_run(*backend1, p).ok());
  EXPECT_EQ(topk, one) << "1 thread differs from 2 threads";
  for (int64_t t = 0; t < T; ++t) {
    const int32_t b = rows.request[t], len = rows.key_len[t];
    std::vector<double> s32, s64;
    for (int32_t j = 0; j < len; ++j) {
      const uint8_t* k8 = keys[b].codes.data() + int64_t{j} * c.di;
      const float sk = keys[b].scales[j];
      float s = 0.f;
      double s_d = 0;
      for (int32_t h = 0; h < c.hi; ++h) {
        const uint8_t* q8 = q.data() + (t * c.hi + h) * c.di;
        float dot = 0.f;
        double dot_d = 0;
        for (int32_t d = 0; d < c.di; ++d) {
          dot += e4m3_to_f32(q8[d]) * e4m3_to_f32(k8[d]);
          dot_d += static_cast<double>(e4m3_to_f32(q8[d])) * e4m3_to_f32(k8[d]);
        }
        const float qsh = qs[t * c.hi + h], wh = w[t * c.hi + h];
        s += wh * std::max((qsh * sk) * dot, 0.f);
        const double v = static_cast<double>(qsh) * sk * dot_d;
        s_d += wh * (std::isnan(v) ? v : std::max(v, 0.0));
      }
      s32.push_back(s);
      s64.push_back(s_d);
    }
    std::span<const int32_t> row(topk.data() + t * c.k, c.k);
    // The contract's f32 formula decides the row exactly (NaN lowest, ties to the lower position).
    EXPECT_EQ(std::vector<int32_t>(row.begin(), row.end()), ref::canonical_topk(s32, c.k)) << "token " << t;
    for (int32_t i = 0; i < c.k; ++i) {
      const float want = row[i] >= 0 ? static_cast<float>(s32[row[i]]) : -kInf;
      EXPECT_TRUE(std::memcmp(&sc[t * c.k + i], &want, 4) == 0) << "token " << t << " entry " << i;
    }
    // And it is the fp64 value of the formula up to f32 rounding (finite inputs).
    if (!hostile) {
      EXPECT_EQ(ref::check_topk_row(row, s64, c.k), "") << "token " << t;
    }
  }
}

TEST(Fp8IndexerTopk, MatchesTheFormulaOnOddDimsAndPageSizes) {
  const std::vector<Fp8Case> cases = {
      {3, 17, 5, 1, {{40, 3}, {7, 2}}},
      {5, 33, 16, 61, {{200, 4}, {1, 1}, {130, 20}}},
      {4, 64, 64, 64, {{1013, 3}, {70, 1}}},
      {2, 9, 300, 3, {{200, 2}, {17, 17}}},  // K beyond every context: rows shorter than K
      {2, 8, 32, 16, {{3000, 1}}},           // long decode: key blocks
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    run_fp8_case(cases[i], 0xf8f8 + i, false);
  }
}

TEST(Fp8IndexerTopk, HostileInputsGiveCanonicalRows) {
  const std::vector<Fp8Case> cases = {
      {3, 7, 5, 1, {{60, 3}, {7, 2}}},
      {2, 5, 40, 61, {{130, 4}, {3, 1}}},
      {1, 3, 8, 64, {{70, 2}}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    run_fp8_case(cases[i], 0xbad + i, true);
  }
}

TEST(Fp8IndexerTopk, RefusesMixedDtypesAndMissingScales) {
  auto backend = make_cpu_backend(1);
  PagedCacheConfig cfg{2, 2, 1, 1, 3, DType::kF32, 1, DType::kF8E4M3, Fp8ScaleMode::kFp32};
  auto cache = PagedKvCache::create(*backend, cfg);
  ASSERT_TRUE(cache.ok());
  TokenRows rows;
  rows.request = {0};
  rows.key_len = {1};
  std::vector<int32_t> table = {0, 1}, topk(1);
  std::vector<float> q(3, 1.f), w(1, 1.f);
  IndexerTopkParams p;
  p.rows = rows.view();
  p.Hi = 1;
  p.Di = 3;
  p.K = 1;
  p.q = q.data();
  p.q_dtype = DType::kF32;
  p.w = w.data();
  p.keys = cache->index_keys();
  p.block_table = {table.data(), 1, 2};
  p.topk = topk.data();
  EXPECT_NE(indexer_topk_run(*backend, p).message().find("F8_E4M3 queries need F8_E4M3 keys"), std::string::npos);
  p.q_dtype = DType::kF8E4M3;
  EXPECT_NE(indexer_topk_run(*backend, p).message().find("q_scale"), std::string::npos);
  p.keys = cache->latent();
  EXPECT_FALSE(indexer_topk_run(*backend, p).ok());
}

}  // namespace
}  // namespace dsacp::testing
