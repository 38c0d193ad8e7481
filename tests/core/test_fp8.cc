// dsacp/fp8.h against direct fp64 math: every e4m3 code decoded, f32 -> e4m3 against a brute-force
// nearest-even search, both scale rules on odd group sizes, and the two-plane indexer page offsets.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "dsacp/fp8.h"
#include "dsacp/random.h"
#include "support/reference_math.h"

namespace dsacp {
namespace {

using ref::brute_e4m3;
using ref::e4m3_value;

TEST(Fp8, EveryCodeDecodesToItsDefinition) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_value(c);
    const float got = e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << c;  // 0x80 is -0
      EXPECT_EQ(f32_to_e4m3(got), c) << "round trip of code " << c;
    }
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.f, -9));
}

TEST(Fp8, ConversionMatchesBruteForceNearestEven) {
  std::vector<float> xs = {0.f,
                           -0.f,
                           448.f,
                           -448.f,
                           449.f,
                           464.f,
                           465.f,
                           479.99f,
                           480.f,
                           1e30f,
                           -1e30f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           -std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::min(),
                           std::ldexp(1.f, -10),
                           std::ldexp(1.f, -10) * 1.0000001f,
                           std::ldexp(3.f, -10),
                           std::ldexp(1.f, -6),
                           std::ldexp(15.f, -10),
                           0.0625f * 17 / 16};
  // Every midpoint between neighbouring codes (ties), and one f32 ulp either side of it.
  for (int c = 0; c < 0x7e; ++c) {
    const float mid = static_cast<float>((e4m3_value(c) + e4m3_value(c + 1)) / 2);  // exact in f32
    for (float v : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e9f)}) {
      xs.push_back(v);
      xs.push_back(-v);
    }
  }
  // 448..480 densely, and random f32 bit patterns over the e4m3 range and beyond.
  for (float v = 440.f; v <= 490.f; v += 0.25f) xs.push_back(v);
  for (uint64_t i = 0; i < 200000; ++i) {
    const uint32_t r = static_cast<uint32_t>(counter_hash(0xf8, 1, i));
    const uint32_t e = 100 + (r >> 24) % 40;  // 2^-27 .. 2^12
    xs.push_back(fp8_bits_f32((r & 0x807fffffu) | (e << 23)));
  }
  int bad = 0;
  for (float x : xs) {
    const uint8_t want = brute_e4m3(x), got = f32_to_e4m3(x);
    if (want != got && ++bad < 10)
      ADD_FAILURE() << "x=" << x << " (0x" << std::hex << fp8_f32_bits(x) << "): want 0x" << int(want) << ", got 0x"
                    << int(got);
  }
  EXPECT_EQ(bad, 0);
}

// Direct fp64 rules of the contract: amax over finite |x|, s = max(amax / 448, 2^-126), ue8m0 = 2^ceil(log2 s).
double ref_scale(const std::vector<float>& row, Fp8ScaleMode mode) {
  double amax = 0;
  for (float x : row) {
    if (std::isfinite(x)) amax = std::max(amax, std::fabs(static_cast<double>(x)));
  }
  double s = static_cast<double>(static_cast<float>(amax / 448.0));  // the f32 quotient
  s = std::max(s, std::ldexp(1.0, -126));
  if (mode == Fp8ScaleMode::kUe8m0) s = std::ldexp(1.0, static_cast<int>(std::ceil(std::log2(s))));
  return s;
}

TEST(Fp8, ScaleRulesAndQuantizationOnOddRows) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> rows = {
      {0.f, -0.f, 0.f},                                  // amax 0: the floor 2^-126
      {448.f, 1.f, -3.f, 0.5f, 7.f},                     // amax at the e4m3 max: scale 1
      {std::ldexp(1.f, -9), 0.f, -std::ldexp(1.f, -9)},  // amax at the smallest subnormal
      {1e38f, -3e38f, 2.f, 1.f, 0.f, 5.f, 6.f},          // huge amax
      {nan, 2.f, -inf, inf, 0.25f},                      // non-finite values stay out of amax
      {nan, inf},                                        // nothing finite: the floor
      {1e-40f, -3e-41f, 0.f},                            // f32 subnormals only
  };
  for (int n : {1, 3, 7, 61, 127, 129}) {
    std::vector<float> r(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      const uint32_t h = static_cast<uint32_t>(counter_hash(0x5ca1e, n, i));
      r[i] = (static_cast<float>(h % 20001) - 10000.f) * std::ldexp(1.f, static_cast<int>(h >> 28) - 12);
    }
    rows.push_back(r);
  }
  for (Fp8ScaleMode mode : {Fp8ScaleMode::kFp32, Fp8ScaleMode::kUe8m0}) {
    for (size_t ri = 0; ri < rows.size(); ++ri) {
      const std::vector<float>& row = rows[ri];
      float amax = 0.f;
      for (float x : row) amax = std::max(amax, fp8_amax_term(x));
      const float scale = fp8_scale_from_amax(amax, mode);
      const double want = ref_scale(row, mode);
      ASSERT_EQ(static_cast<double>(scale), want) << "row " << ri << " mode " << int(mode);
      EXPECT_TRUE(fp8_scale_ok(scale));
      for (float x : row) {
        const uint8_t q = fp8_quantize(x, scale);
        // e4m3 of the f32 quotient (the double quotient rounded once to f32 is the IEEE f32 division).
        const float quot = static_cast<float>(static_cast<double>(x) / want);
        EXPECT_EQ(q, brute_e4m3(quot)) << "row " << ri << " x=" << x;
        if (std::isfinite(x)) {
          // In range: |x / scale| <= 448, so the dequantized value is within half an e4m3 step of x.
          const double dq = static_cast<double>(fp8_dequantize(q, scale));
          const double r = std::fabs(x / want);  // ilogb(0) is INT_MIN: zero takes the subnormal step
          const double step =
              r == 0 ? std::ldexp(1.0, -9) : std::max(std::ldexp(1.0, -9), std::ldexp(1.0, std::ilogb(r) - 3));
          EXPECT_LE(std::fabs(dq - x), 0.5 * step * want * (1 + 1e-6)) << "row " << ri << " x=" << x;
        }
      }
    }
  }
  EXPECT_FALSE(fp8_scale_ok(0.f));
  EXPECT_FALSE(fp8_scale_ok(-1.f));
  EXPECT_FALSE(fp8_scale_ok(inf));
  EXPECT_FALSE(fp8_scale_ok(nan));
  EXPECT_TRUE(fp8_scale_ok(std::numeric_limits<float>::denorm_min()));
}

TEST(Fp8, TwoPlanePageOffsets) {
  EXPECT_EQ(fp8_index_page_bytes(64, 128), 64 * 132);
  for (int32_t ps : {1, 61, 64}) {
    for (int32_t di : {3, 128}) {
      const int64_t page = 5;
      for (int32_t off = 0; off < ps; ++off) {
        EXPECT_EQ(fp8_index_value_offset(page, off, ps, di), page * ps * (di + 4) + off * di);
        EXPECT_EQ(fp8_index_scale_offset(page, off, ps, di), page * ps * (di + 4) + ps * di + off * 4);
      }
    }
  }
}

}  // namespace
}  // namespace dsacp
