// Status, dtype (bf16 round-to-nearest-even), tensors and shape checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "dsacp/dtype.h"
#include "dsacp/status.h"
#include "dsacp/tensor.h"

namespace dsacp {
namespace {

TEST(Status, OkAndErrorsCarryMessages) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  Status e = invalid_argument("q_nope: bad");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.to_string(), "invalid argument: q_nope: bad");
  EXPECT_EQ(e.with_context("case x").message(), "case x: q_nope: bad");
}

TEST(Status, ResultHoldsValueOrStatus) {
  Result<int> r = 5;
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, 5);
  Result<int> e = out_of_range("too big");
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kOutOfRange);
  Result<int> bad = Status();  // an ok Status is not a value
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInternal);
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000)).bits, 0x3f80);
  // 1 + 3*2^-8 is half way between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000)).bits, 0x3f82);
  // Just above half way rounds up.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001)).bits, 0x3f81);
  EXPECT_EQ(f32_to_bf16(-2.5f).bits, 0xc020);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // Largest finite float rounds to infinity in bf16 (RNE overflow).
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80);
}

TEST(Bf16, RoundTripIsIdempotentAndWithinHalfUlp) {
  for (uint32_t u = 0x00800000u; u < 0x7f7f0000u; u += 0x00012345u) {  // normal floats below bf16 overflow
    const float f = from_bits(u);
    const float r = round_to_bf16(f);
    EXPECT_EQ(bits_of(round_to_bf16(r)), bits_of(r));
    EXPECT_LE(std::fabs(r - f), std::ldexp(std::fabs(f), -8) * 1.0001f + 1e-45f) << f;
  }
}

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kI32}) {
    auto back = dtype_from_name(dtype_name(t));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, t);
  }
  auto bad = dtype_from_name("F16");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("supported: F32, BF16, I32"), std::string::npos);
}

TEST(Tensor, ZerosShapeAndConversion) {
  auto t = Tensor::zeros(DType::kF32, {2, 3});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->numel(), 6);
  EXPECT_EQ(t->nbytes(), 24u);
  t->set_f32(4, 1.00390625f);  // 1 + 2^-8: rounds to 1.0 in bf16
  auto b = t->to_dtype(DType::kBF16);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->get_f32(4), 1.0f);
  EXPECT_FALSE(Tensor::zeros(DType::kF32, {2, -1}).ok());
  EXPECT_FALSE(Tensor::zeros(DType::kF32, {int64_t{1} << 40, int64_t{1} << 30}).ok());
}

TEST(Tensor, CheckTensorNamesTensorAndShapes) {
  auto t = Tensor::zeros(DType::kF32, {4, 2, 7});
  ASSERT_TRUE(t.ok());
  Status s = check_tensor("q_nope", t->view(), {DType::kBF16, DType::kF32}, {{"T", 4}, {"H", 2}, {"Dl", 8}});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "q_nope: expected BF16 or F32 with shape [T=4, H=2, Dl=8], got F32 [4, 2, 7]");
  EXPECT_TRUE(check_tensor("q_nope", t->view(), {DType::kF32}, {{"T", 4}, {"H", 2}, {"Dl", 7}}).ok());
  TensorView strided = t->view();
  strided.strides[0] = 100;
  EXPECT_FALSE(check_tensor("q_nope", strided, {DType::kF32}, {{"T", 4}, {"H", 2}, {"Dl", 7}}).ok());
}

}  // namespace
}  // namespace dsacp
