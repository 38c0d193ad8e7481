// The fp8_ds_mla latent cache on the CPU backend (contract section 6): the 656-byte record built byte by byte from
// the contract's words and compared with what the cache write stores; the quantizing write (fp32 and ue8m0 rules,
// per 128-value tile) against direct fp64 math, with amax 0, NaN/Inf in the latent and values at the e4m3 edges;
// sparse MLA over the records against fp64 attention over the dequantized latent (scale * value in f32 as the nope
// key and as the value, the rope as stored), page sizes 1, 61, 64, -1 holes in the top-k; refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/backend.h"
#include "dsacp/fp8.h"
#include "dsacp/paged_cache.h"
#include "dsacp/random.h"
#include "kernels/kernel_test_util.h"
#include "support/reference_math.h"
#include "support/test_seed.h"

namespace dsacp::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

using ref::brute_e4m3;
using ref::e4m3_value;

// The contract's scale of one tile in fp64: max(amax / 448, 2^-126) with amax over the finite |x| (rounded to f32
// as an f32 division does), ue8m0 = 2^ceil(log2 .).
float ref_scale(const float* x, int32_t n, Fp8ScaleMode mode) {
  double amax = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (std::isfinite(x[i])) amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  }
  double s = std::max(static_cast<double>(static_cast<float>(amax / 448.0)), std::ldexp(1.0, -126));
  if (mode == Fp8ScaleMode::kUe8m0) s = std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(s))));
  return static_cast<float>(s);
}

float f32_of(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

PagedCacheConfig fp8_config(int64_t num_pages, int32_t ps, int32_t dl, int32_t dr) {
  PagedCacheConfig cfg;
  cfg.num_pages = num_pages;
  cfg.page_size = ps;
  cfg.Dl = dl;
  cfg.Dr = dr;
  cfg.Di = 1;
  cfg.dtype = DType::kF32;
  cfg.latent_format = LatentFormat::kFp8DsMla;
  return cfg;
}

// One call writing latent rows (of latent_dtype, with tile scales for e4m3) and rope rows (of rope_dtype) into the
// record views of `cache`.
Status write_records(Backend& backend, const PagedKvCache& cache, const void* latent, DType latent_dtype,
                     const float* scales, const void* rope, DType rope_dtype, const std::vector<int64_t>& slots,
                     Fp8ScaleMode mode = Fp8ScaleMode::kFp32) {
  CacheWriteParams w;
  w.rows = latent;
  w.rows_dtype = latent_dtype;
  w.row_scales = scales;
  w.num_rows = static_cast<int64_t>(slots.size());
  w.slots = slots.data();
  w.pool = cache.latent();
  w.record_scale_mode = mode;
  w.more[0] = {rope, slots.data(), cache.rope(), rope_dtype};
  return cache_write_run(backend, w);
}

TEST(Fp8DsMlaRecord, BuiltByteByByteFromTheContractAndReadBack) {
  auto backend = make_cpu_backend(2);
  for (int32_t ps : {1, 61, 64}) {
    const int32_t dl = 512, dr = 64;
    const std::vector<int64_t> lens = {ps * 2 + 1, 3};
    const PageLayout layout = make_page_layout(lens, ps, test_seed(0xd5a + ps));
    auto cache = PagedKvCache::create(*backend, fp8_config(layout.num_pages, ps, dl, dr));
    ASSERT_TRUE(cache.ok()) << cache.status().to_string();
    ASSERT_EQ(fp8_ds_mla_record_bytes(dl, dr), 656);
    std::vector<int64_t> slots;
    for (int32_t b = 0; b < 2; ++b) {
      for (int64_t j = 0; j < lens[b]; ++j) slots.push_back(layout.slot(b, j));
    }
    const int64_t n = static_cast<int64_t>(slots.size());
    // Any codes but NaN, any positive scales, any bf16 rope bits.
    std::vector<uint8_t> codes(static_cast<size_t>(n * dl));
    std::vector<float> scales(static_cast<size_t>(n * 4));
    std::vector<uint16_t> rope(static_cast<size_t>(n * dr));
    for (size_t i = 0; i < codes.size(); ++i) {
      const uint8_t c = static_cast<uint8_t>(counter_hash(test_seed(ps), 1, i));
      codes[i] = (c & 0x7f) == 0x7f ? 0x7e : c;
    }
    for (size_t i = 0; i < scales.size(); ++i)
      scales[i] = std::ldexp(1.f + (i % 7) / 8.f, static_cast<int>(i % 21) - 10);
    for (size_t i = 0; i < rope.size(); ++i)
      rope[i] = static_cast<uint16_t>(counter_hash(test_seed(ps), 2, i) & 0x7f7f);
    ASSERT_TRUE(
        write_records(*backend, *cache, codes.data(), DType::kF8E4M3, scales.data(), rope.data(), DType::kBF16, slots)
            .ok());
    // "bytes 0..511 the e4m3 latent values, 512..527 four fp32 scales (value i uses scale i / 128), 528..655 the 64
    // bf16 rope values; records contiguous in a page": the expected pool from those words (unwritten: 0x7f).
    std::vector<uint8_t> want(static_cast<size_t>(layout.num_pages * ps * 656), 0x7f);
    for (int64_t t = 0; t < n; ++t) {
      uint8_t* rec = want.data() + (slots[t] / ps * ps + slots[t] % ps) * 656;
      for (int32_t i = 0; i < 512; ++i) rec[i] = codes[t * 512 + i];
      for (int32_t g = 0; g < 4; ++g) std::memcpy(rec + 512 + 4 * g, &scales[t * 4 + g], 4);
      for (int32_t i = 0; i < 64; ++i) {
        rec[528 + 2 * i] = static_cast<uint8_t>(rope[t * 64 + i] & 0xff);  // little-endian
        rec[528 + 2 * i + 1] = static_cast<uint8_t>(rope[t * 64 + i] >> 8);
      }
    }
    ASSERT_EQ(cache->latent().data, cache->rope().data);
    ASSERT_EQ(cache->bytes(), want.size() + static_cast<size_t>(layout.num_pages * ps * 4));  // + the Di=1 f32 keys
    EXPECT_EQ(std::memcmp(cache->latent().data, want.data(), want.size()), 0) << "page_size " << ps;

    // Read back through attention: one head, q_nope one-hot on value i, q_rope 0, a single chosen key j: the
    // output is that key's dequantized latent row (softmax of one logit is 1), value i's logit scale * value.
    for (int64_t t : {int64_t{0}, n - 1}) {
      const int32_t b = t < lens[0] ? 0 : 1;
      const int32_t j = static_cast<int32_t>(b == 0 ? t : t - lens[0]);
      const int32_t i = static_cast<int32_t>(t % 512);
      std::vector<float> qn(dl, 0.f), qr(dr, 0.f), out(dl), lse(1);
      qn[i] = 1.f;
      const int32_t request = b, key_len = static_cast<int32_t>(lens[b]);
      const int32_t topk[2] = {j, -1};
      SparseMlaParams p;
      p.rows = {1, &request, &key_len};
      p.H = 1;
      p.Dl = dl;
      p.Dr = dr;
      p.K = 2;
      p.scale = 1.f;
      p.q_nope = qn.data();
      p.q_rope = qr.data();
      p.q_dtype = DType::kF32;
      p.latent = cache->latent();
      p.rope = cache->rope();
      p.block_table = layout.view();
      p.topk = topk;
      p.out = out.data();
      p.lse = lse.data();
      ASSERT_TRUE(sparse_mla_run(*backend, p).ok());
      for (int32_t d = 0; d < dl; ++d) {
        const double v = e4m3_value(codes[t * dl + d]) * scales[t * 4 + d / 128];
        ASSERT_EQ(out[d], static_cast<float>(v)) << "page_size " << ps << " key " << t << " value " << d;
      }
      EXPECT_EQ(lse[0], out[i]);  // ln exp(l) = l
    }
  }
}

// The quantizing write against fp64: tiles of different magnitudes, an all-zero tile (amax 0: scale 2^-126, codes
// 0), NaN and +-inf among finite values (they do not raise the scale; NaN stays NaN, inf saturates), values right
// at 448 * scale, and a tile at the e4m3 subnormal edge; bf16 and f32 rows; both scale rules.
TEST(Fp8DsMlaCacheWrite, QuantizesEachTileAgainstFp64) {
  auto backend = make_cpu_backend(3);
  const int32_t dl = 512, dr = 64, ps = 61;
  const std::vector<int64_t> lens = {70, 5};
  const PageLayout layout = make_page_layout(lens, ps, test_seed(77));
  std::vector<int64_t> slots;
  for (int32_t b = 0; b < 2; ++b) {
    for (int64_t j = 0; j < lens[b]; ++j) slots.push_back(layout.slot(b, j));
  }
  const int64_t n = static_cast<int64_t>(slots.size());
  for (const DType rows_dtype : {DType::kF32, DType::kBF16}) {
    for (const Fp8ScaleMode mode : {Fp8ScaleMode::kFp32, Fp8ScaleMode::kUe8m0}) {
      std::vector<float> x = random_values(test_seed(5), 3, n * dl, 1.f, rows_dtype == DType::kBF16);
      std::vector<float> r = random_values(test_seed(5), 4, n * dr, 2.f, false);
      for (int64_t t = 0; t < n; ++t) {
        float* row = x.data() + t * dl;
        const float amp[4] = {1e-3f, 300.f, 0.f, std::ldexp(1.f, -120)};
        for (int32_t i = 0; i < dl; ++i) row[i] *= amp[i / 128];
        if (t % 3 == 0) row[200] = kNaN;
        if (t % 3 == 1) row[130] = kInf, row[131] = -kInf;
        if (t % 5 == 0) row[10] = 448.f * 1e-3f, row[11] = -row[10];
        if (rows_dtype == DType::kBF16) {
          for (int32_t i = 0; i < dl; ++i) row[i] = round_to_bf16(row[i]);
        }
      }
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = f32_to_bf16(x[i]).bits;
      auto cache = PagedKvCache::create(*backend, fp8_config(layout.num_pages, ps, dl, dr));
      ASSERT_TRUE(cache.ok());
      const void* rows = rows_dtype == DType::kBF16 ? static_cast<const void*>(xb.data()) : x.data();
      ASSERT_TRUE(write_records(*backend, *cache, rows, rows_dtype, nullptr, r.data(), DType::kF32, slots, mode).ok());
      const uint8_t* pool = static_cast<const uint8_t*>(cache->latent().data);
      for (int64_t t = 0; t < n; ++t) {
        const uint8_t* rec = pool + slots[t] * 656;
        for (int32_t g = 0; g < 4; ++g) {
          const float* tile = x.data() + t * dl + g * 128;
          const float s = ref_scale(tile, 128, mode);
          ASSERT_EQ(f32_of(rec + 512 + 4 * g), s) << "row " << t << " tile " << g;
          for (int32_t i = 0; i < 128; ++i) {
            ASSERT_EQ(rec[g * 128 + i], brute_e4m3(tile[i] / s)) << "row " << t << " value " << g * 128 + i;
          }
        }
        for (int32_t i = 0; i < dr; ++i) {
          uint16_t bits;
          std::memcpy(&bits, rec + 528 + 2 * i, 2);
          ASSERT_EQ(bits, f32_to_bf16(r[t * dr + i]).bits) << "row " << t << " rope " << i;
        }
        // The all-zero tile: the smallest scale, every code 0; the NaN stays NaN; inf saturates.
        EXPECT_EQ(f32_of(rec + 512 + 8), std::ldexp(1.f, -126));
        if (t % 3 == 0) {
          EXPECT_EQ(rec[200] & 0x7f, 0x7f);
        }
        if (t % 3 == 1) {
          EXPECT_EQ(rec[130], 0x7e);
          EXPECT_EQ(rec[131], 0xfe);
        }
        if (t % 5 == 0 && mode == Fp8ScaleMode::kFp32) {
          EXPECT_EQ(rec[10] & 0x7f, 0x7e);
        }
      }
    }
  }
}

TEST(Fp8DsMlaCacheWrite, RefusesBadTileScalesNamingRowAndTile) {
  auto backend = make_cpu_backend(1);
  auto cache = PagedKvCache::create(*backend, fp8_config(2, 4, 256, 16));
  ASSERT_TRUE(cache.ok());
  const std::vector<int64_t> slots = {0, 5};
  std::vector<uint8_t> codes(2 * 256, 0x38);
  std::vector<float> rope(2 * 16, 1.f);
  for (const float bad : {0.f, -1.f, kNaN, kInf}) {
    std::vector<float> scales = {1.f, 1.f, 1.f, bad};
    const Status st =
        write_records(*backend, *cache, codes.data(), DType::kF8E4M3, scales.data(), rope.data(), DType::kF32, slots);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("row_scales[1, 1]"), std::string::npos) << st.message();
  }
  // e4m3 rows go into the latent view only (not the rope's bf16), and need their scales.
  EXPECT_FALSE(
      write_records(*backend, *cache, codes.data(), DType::kF8E4M3, nullptr, rope.data(), DType::kF32, slots).ok());
  EXPECT_FALSE(
      write_records(*backend, *cache, rope.data(), DType::kF32, nullptr, codes.data(), DType::kF8E4M3, slots).ok());
  // Dl must be a multiple of 128.
  const auto odd = PagedKvCache::create(*backend, fp8_config(2, 4, 200, 16));
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(odd.status().message().find("multiple of 128"), std::string::npos);
}

struct Fp8MlaCase {
  int32_t h, dl, dr, k, ps;
  DType q_dtype;
};

// Sparse MLA over records written from random f32 latent (quantized by the write) against fp64 attention over the
// contract's dequantized latent, with front-packed rows, -1 padding, a -1 hole (the scan stops there) and stray
// entries past key_len; empty rows give out 0, lse -inf.
TEST(Fp8DsMlaAttention, MatchesFp64OverTheDequantizedLatent) {
  auto backend = make_cpu_backend(4);
  const Fp8MlaCase cases[] = {{1, 512, 64, 16, 1, DType::kF32},
                              {16, 512, 64, 40, 61, DType::kBF16},
                              {3, 256, 32, 33, 64, DType::kF32},
                              {64, 128, 8, 7, 61, DType::kF32}};
  for (const Fp8MlaCase& c : cases) {
    SCOPED_TRACE("H" + std::to_string(c.h) + " Dl" + std::to_string(c.dl) + " ps" + std::to_string(c.ps));
    const std::vector<RequestShape> shapes = {{90, 3}, {17, 1}, {130, 2}};
    const TokenRows rows = make_token_rows(shapes, true);
    const std::vector<int64_t> lens = key_counts(shapes);
    const PageLayout layout = make_page_layout(lens, c.ps, test_seed(c.h * 7 + c.ps));
    auto cache = PagedKvCache::create(*backend, fp8_config(layout.num_pages, c.ps, c.dl, c.dr));
    ASSERT_TRUE(cache.ok());
    std::vector<int64_t> slots;
    std::vector<int64_t> first(lens.size());
    for (int32_t b = 0; b < static_cast<int32_t>(lens.size()); ++b) {
      first[b] = static_cast<int64_t>(slots.size());
      for (int64_t j = 0; j < lens[b]; ++j) slots.push_back(layout.slot(b, j));
    }
    const int64_t nk = static_cast<int64_t>(slots.size());
    std::vector<float> lat = random_values(test_seed(c.dl + c.h), 1, nk * c.dl, 1.f, false);
    for (int64_t i = 0; i < nk * c.dl; ++i) lat[i] *= (i / 128) % 3 == 0 ? 4.f : 0.25f;  // tiles of their own scale
    const std::vector<float> rope = random_values(test_seed(c.dl + c.h), 2, nk * c.dr, 1.f, true);
    ASSERT_TRUE(
        write_records(*backend, *cache, lat.data(), DType::kF32, nullptr, rope.data(), DType::kF32, slots).ok());
    // The dequantized latent from fp64 math: ref scale and the nearest code, value * scale (exact in fp64, then
    // rounded once to f32 as the f32 product is).
    std::vector<float> deq(lat.size());
    for (int64_t t = 0; t < nk; ++t) {
      for (int32_t g = 0; g < c.dl / 128; ++g) {
        const float* tile = lat.data() + t * c.dl + g * 128;
        const float s = ref_scale(tile, 128, Fp8ScaleMode::kFp32);
        for (int32_t i = 0; i < 128; ++i) {
          deq[t * c.dl + g * 128 + i] = static_cast<float>(e4m3_value(brute_e4m3(tile[i] / s)) * s);
        }
      }
    }
    const int64_t T = rows.size();
    const bool bf = c.q_dtype == DType::kBF16;
    const std::vector<float> qn = random_values(test_seed(9), c.h, T * c.h * c.dl, 1.f, bf);
    const std::vector<float> qr = random_values(test_seed(9), c.h + 1, T * c.h * c.dr, 1.f, bf);
    std::vector<uint16_t> qnb(qn.size()), qrb(qr.size());
    for (size_t i = 0; i < qn.size(); ++i) qnb[i] = f32_to_bf16(qn[i]).bits;
    for (size_t i = 0; i < qr.size(); ++i) qrb[i] = f32_to_bf16(qr[i]).bits;
    // Rows: every third visible key, then -1; token 1 gets a hole (-1) in the middle and a stray entry after it;
    // token 2 an entry past its key_len first (the scan stops at once: no key).
    std::vector<int32_t> topk(static_cast<size_t>(T * c.k), -1);
    for (int64_t t = 0; t < T; ++t) {
      int32_t n = 0;
      for (int32_t j = static_cast<int32_t>(t % 3); j < rows.key_len[t] && n < c.k; j += 3) topk[t * c.k + n++] = j;
      if (t == 1 && n > 2) topk[t * c.k + n / 2] = -1;
      if (t == 2) topk[t * c.k] = rows.key_len[t];
    }
    std::vector<float> out(static_cast<size_t>(T * c.h * c.dl)), lse(static_cast<size_t>(T * c.h));
    SparseMlaParams p;
    p.rows = rows.view();
    p.H = c.h;
    p.Dl = c.dl;
    p.Dr = c.dr;
    p.K = c.k;
    p.scale = 0.0625f;
    p.q_nope = bf ? static_cast<const void*>(qnb.data()) : qn.data();
    p.q_rope = bf ? static_cast<const void*>(qrb.data()) : qr.data();
    p.q_dtype = c.q_dtype;
    p.latent = cache->latent();
    p.rope = cache->rope();
    p.block_table = layout.view();
    p.topk = topk.data();
    p.out = out.data();
    p.lse = lse.data();
    ASSERT_TRUE(sparse_mla_run(*backend, p).ok());
    for (int64_t t = 0; t < T; ++t) {
      const int32_t b = rows.request[t];
      std::vector<int32_t> chosen;
      for (int32_t e = 0; e < c.k; ++e) {
        const int32_t j = topk[t * c.k + e];
        if (j < 0 || j >= rows.key_len[t]) break;
        chosen.push_back(j);
      }
      const std::span<const float> L(deq.data() + first[b] * c.dl, static_cast<size_t>(lens[b] * c.dl));
      const std::span<const float> R(rope.data() + first[b] * c.dr, static_cast<size_t>(lens[b] * c.dr));
      for (int32_t h = 0; h < c.h; ++h) {
        const int64_t r = t * c.h + h;
        const ref::AttentionResult want =
            ref::attention(std::span<const float>(qn.data() + r * c.dl, c.dl),
                           std::span<const float>(qr.data() + r * c.dr, c.dr), L, R, chosen, p.scale, c.dl, c.dr);
        const std::span<const float> got(out.data() + r * c.dl, c.dl);
        if (chosen.empty()) {
          EXPECT_EQ(lse[r], -kInf);
          for (float v : got) ASSERT_EQ(v, 0.f);
          continue;
        }
        EXPECT_LT(ref::rel_norm_error(got, want.out), 1e-5) << "token " << t << " head " << h;
        EXPECT_NEAR(lse[r], want.lse, 1e-5 * std::max(1.0, std::fabs(want.lse))) << "token " << t << " head " << h;
      }
    }
  }
}

// A NaN latent value reaches the outputs of the heads that chose its key (and only those); an inf value saturates
// to 448 * scale and stays finite.
TEST(Fp8DsMlaAttention, NonFiniteLatentValues) {
  auto backend = make_cpu_backend(2);
  const int32_t dl = 128, dr = 8, ps = 4;
  const std::vector<int64_t> lens = {6};
  const PageLayout layout = make_page_layout(lens, ps, test_seed(3));
  auto cache = PagedKvCache::create(*backend, fp8_config(layout.num_pages, ps, dl, dr));
  ASSERT_TRUE(cache.ok());
  std::vector<int64_t> slots;
  for (int64_t j = 0; j < 6; ++j) slots.push_back(layout.slot(0, j));
  std::vector<float> lat = random_values(test_seed(4), 1, 6 * dl, 1.f, false), rope(6 * dr, 0.f);
  lat[2 * dl + 5] = kNaN;
  lat[4 * dl + 7] = kInf;
  ASSERT_TRUE(write_records(*backend, *cache, lat.data(), DType::kF32, nullptr, rope.data(), DType::kF32, slots).ok());
  const std::vector<int32_t> request = {0, 0, 0}, key_len = {6, 6, 6};
  const std::vector<int32_t> topk = {0, 2, 3, 1, 4, -1, 0, -1, 2};  // token 2: the hole hides key 2
  std::vector<float> qn(3 * dl, 0.01f), qr(3 * dr, 0.f), out(3 * dl), lse(3);
  SparseMlaParams p;
  p.rows = {3, request.data(), key_len.data()};
  p.H = 1;
  p.Dl = dl;
  p.Dr = dr;
  p.K = 3;
  p.scale = 1.f;
  p.q_nope = qn.data();
  p.q_rope = qr.data();
  p.q_dtype = DType::kF32;
  p.latent = cache->latent();
  p.rope = cache->rope();
  p.block_table = layout.view();
  p.topk = topk.data();
  p.out = out.data();
  p.lse = lse.data();
  ASSERT_TRUE(sparse_mla_run(*backend, p).ok());
  EXPECT_TRUE(std::isnan(lse[0]));
  for (int32_t d = 0; d < dl; ++d) EXPECT_TRUE(std::isfinite(out[dl + d])) << d;
  EXPECT_TRUE(std::isfinite(lse[1]));
  for (int32_t d = 0; d < dl; ++d) EXPECT_TRUE(std::isfinite(out[2 * dl + d])) << d;
}

TEST(Fp8DsMlaValidate, RecordViewsOnlyWhereTheyBelong) {
  auto backend = make_cpu_backend(1);
  auto cache = PagedKvCache::create(*backend, fp8_config(2, 4, 128, 8));
  ASSERT_TRUE(cache.ok());
  const int32_t request = 0, key_len = 1, topk = 0;
  std::vector<float> qn(128), qr(8), out(128), lse(1);
  const int32_t table[2] = {0, 1};
  SparseMlaParams p;
  p.rows = {1, &request, &key_len};
  p.H = 1;
  p.Dl = 128;
  p.Dr = 8;
  p.K = 1;
  p.scale = 1.f;
  p.q_nope = qn.data();
  p.q_rope = qr.data();
  p.q_dtype = DType::kF32;
  p.latent = cache->latent();
  p.rope = cache->rope();
  p.block_table = {table, 1, 2};
  p.topk = &topk;
  p.out = out.data();
  p.lse = lse.data();
  SparseMlaParams mixed = p;
  std::vector<float> plain_rope(2 * 4 * 8);
  mixed.rope = {plain_rope.data(), DType::kF32, 2, 4, 8};
  const Status st = sparse_mla_run(*backend, mixed);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("fp8_ds_mla"), std::string::npos) << st.message();
  SparseMlaParams wrong = p;
  wrong.latent.record_bytes = wrong.rope.record_bytes = 700;
  EXPECT_EQ(sparse_mla_run(*backend, wrong).code(), StatusCode::kInvalidArgument);
  // The indexer never reads records.
  IndexerTopkParams ip;
  ip.rows = p.rows;
  ip.Hi = 1;
  ip.Di = 128;
  ip.K = 1;
  ip.q = qn.data();
  ip.q_dtype = DType::kF32;
  ip.w = lse.data();
  ip.keys = cache->latent();
  ip.keys.dtype = DType::kF32;
  ip.block_table = p.block_table;
  int32_t tk = 0;
  ip.topk = &tk;
  EXPECT_EQ(indexer_topk_run(*backend, ip).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dsacp::testing
