// cache_write and the CPU backend's memory functions: dtype conversion (RNE), skipped rows, bad slots,
// duplicate slots, fill with NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dsacp/backend.h"

namespace dsacp {
namespace {

struct CacheWriteCase {
  DType rows_dtype, pool_dtype;
};

void PrintTo(const CacheWriteCase& c, std::ostream* os) {
  *os << "rows " << dtype_name(c.rows_dtype) << ", pool " << dtype_name(c.pool_dtype);
}

class CacheWriteKernel : public ::testing::TestWithParam<CacheWriteCase> {};

float rne_expected(float x, DType rows, DType pool) {
  return (rows == DType::kBF16 || pool == DType::kBF16) ? round_to_bf16(x) : x;
}

TEST_P(CacheWriteKernel, ScattersConvertsAndSkips) {
  const auto [rows_dtype, pool_dtype] = GetParam();
  auto backend = make_cpu_backend(2);
  const int32_t dim = 3, page_size = 2;
  const int64_t num_pages = 3, slots_total = num_pages * page_size;
  // Values chosen to need rounding to bf16: 1 + 2^-9 (a tie, to even 1.0), 1 + 3*2^-9 (up), 1 + 2^-8 + 2^-10.
  const std::vector<float> values = {
      1.f + 0x1p-9f, 1.f + 3 * 0x1p-9f, -(1.f + 0x1p-8f + 0x1p-10f), 2.5f, -0.f, 1e30f, 7.f, 8.f, 9.f};
  std::vector<uint8_t> rows(values.size() * dtype_size(rows_dtype));
  for (size_t i = 0; i < values.size(); ++i) store_from_f32(rows.data(), rows_dtype, int64_t(i), values[i]);
  const std::vector<int64_t> slots = {5, -1, 0};  // row 1 skipped
  auto pool = backend->allocate(slots_total * dim * dtype_size(pool_dtype));
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE(backend->fill(pool->get(), pool_dtype, slots_total * dim, std::nanf("")).ok());
  CacheWriteParams p{rows.data(), rows_dtype, Fp8ScaleMode::kFp32, nullptr, 3, slots.data(), {pool->get(), pool_dtype, num_pages, page_size, dim}, {}, {}};
  ASSERT_TRUE(cache_write_run(*backend, p).ok());
  for (int64_t s = 0; s < slots_total; ++s) {
    const int64_t row = s == 5 ? 0 : (s == 0 ? 2 : -1);
    for (int32_t d = 0; d < dim; ++d) {
      const float got = load_as_f32(pool->get(), pool_dtype, s * dim + d);
      if (row < 0) {
        EXPECT_TRUE(std::isnan(got)) << "slot " << s << " must stay untouched";
        continue;
      }
      // Through a bf16 side the value is the RNE rounding; f32 -> f32 is exact.
      const float want = rne_expected(values[row * dim + d], rows_dtype, pool_dtype);
      EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << "slot " << s << " d " << d << ": " << got << " vs " << want;
    }
  }
}

std::string cw_name(const ::testing::TestParamInfo<CacheWriteCase>& info) {
  return std::string("rows") + dtype_name(info.param.rows_dtype) + "_pool" + dtype_name(info.param.pool_dtype);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CacheWriteKernel,
                         ::testing::Values(CacheWriteCase{DType::kF32, DType::kF32},
                                           CacheWriteCase{DType::kF32, DType::kBF16},
                                           CacheWriteCase{DType::kBF16, DType::kF32},
                                           CacheWriteCase{DType::kBF16, DType::kBF16}),
                         cw_name);

TEST(CacheWriteErrors, SlotOutOfRangeNamesRowAndSlot) {
  auto backend = make_cpu_backend(2);
  std::vector<float> rows(4 * 2, 1.f), pool(2 * 2 * 2, 0.f);
  for (int64_t bad : {int64_t{4}, int64_t{-2}, int64_t{1} << 40}) {
    std::vector<int64_t> slots = {0, -1, bad, 1};
    CacheWriteParams p{rows.data(), DType::kF32, Fp8ScaleMode::kFp32, nullptr, 4, slots.data(), {pool.data(), DType::kF32, 2, 2, 2}, {}, {}};
    const Status st = cache_write_run(*backend, p);
    EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
    EXPECT_NE(st.message().find("row 2: slot " + std::to_string(bad)), std::string::npos) << st.message();
    EXPECT_EQ(pool[0], 0.f) << "nothing is written when a slot is bad";
  }
}

TEST(CacheWriteKernelOrder, DuplicateSlotsLastRowWins) {
  auto backend = make_cpu_backend(2);
  std::vector<float> rows(1000), pool(8, 0.f);
  std::vector<int64_t> slots(1000);
  for (int i = 0; i < 1000; ++i) {
    rows[i] = float(i);
    slots[i] = i % 8;
  }
  CacheWriteParams p{rows.data(), DType::kF32, Fp8ScaleMode::kFp32, nullptr, 1000, slots.data(), {pool.data(), DType::kF32, 2, 4, 1}, {}, {}};
  ASSERT_TRUE(cache_write_run(*backend, p).ok());
  for (int s = 0; s < 8; ++s) EXPECT_EQ(pool[s], float(992 + s));
}

TEST(KernelCpuBackend, FillAllocateCopy) {
  auto backend = make_cpu_backend(2);
  auto buf = backend->allocate(100);
  ASSERT_TRUE(buf.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->get()) % 64, 0u);
  EXPECT_TRUE(backend->fill(buf->get(), DType::kF32, 25, std::nanf("")).ok());
  EXPECT_TRUE(std::isnan(buf->as<float>()[24]));
  EXPECT_TRUE(backend->fill(buf->get(), DType::kBF16, 50, std::nanf("")).ok());
  EXPECT_TRUE(std::isnan(bf16_to_f32(buf->as<bf16>()[49])));
  EXPECT_TRUE(backend->fill(buf->get(), DType::kI32, 25, -3.f).ok());
  EXPECT_EQ(buf->as<int32_t>()[24], -3);
  EXPECT_EQ(backend->fill(buf->get(), DType::kI32, 25, std::nanf("")).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(backend->fill(buf->get(), DType::kF32, -1, 0.f).code(), StatusCode::kInvalidArgument);
  std::vector<int32_t> host(25, 0);
  EXPECT_TRUE(backend->copy_to_host(host.data(), buf->get(), 100).ok());
  EXPECT_EQ(host[0], -3);
  EXPECT_FALSE(backend->copy_to_device(nullptr, host.data(), 4).ok());
}

// Three pools in one call (the steps' indexer key, latent and rope rows): each pool gets exactly what a call of
// its own would write, with its own rows and slots.
TEST(CacheWriteKernel, MorePoolsWriteWhatSeparateCallsWould) {
  auto backend = make_cpu_backend(2);
  const int dims[3] = {3, 5, 2};
  const std::vector<int64_t> slots_a = {2, -1, 0}, slots_b = {1, 3, -1};
  std::vector<std::vector<float>> rows(3), together(3), apart(3);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3 * dims[i]; ++j) rows[i].push_back(static_cast<float>(10 * i + j) + 0.5f);
    together[i].assign(4 * dims[i], -7.f);
    apart[i] = together[i];
  }
  auto pool = [&](std::vector<float>& v, int dim) { return PagedPoolView{v.data(), DType::kF32, 2, 2, dim}; };
  CacheWriteParams p{rows[0].data(), DType::kF32, Fp8ScaleMode::kFp32, nullptr, 3, slots_a.data(), pool(together[0], dims[0]), {}, {}};
  p.more[0] = {rows[1].data(), slots_a.data(), pool(together[1], dims[1])};
  p.more[1] = {rows[2].data(), slots_b.data(), pool(together[2], dims[2])};
  ASSERT_TRUE(cache_write_run(*backend, p).ok());
  for (int i = 0; i < 3; ++i) {
    CacheWriteParams one{rows[i].data(), DType::kF32, Fp8ScaleMode::kFp32, nullptr, 3, i == 2 ? slots_b.data() : slots_a.data(),
                         pool(apart[i], dims[i]), {}, {}};
    ASSERT_TRUE(cache_write_run(*backend, one).ok());
    EXPECT_EQ(together[i], apart[i]) << "pool " << i;
  }
  EXPECT_EQ(together[2][2], 20.5f);  // row 0 of pool 2 went to slot 1 (its own slots)
  // A more[] pool without slots, or without rows (a missing input, not a skipped write), is refused, naming it.
  p.more[1].slots = nullptr;
  Status s = cache_write_run(*backend, p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("more[].slots"), std::string::npos) << s.to_string();
  p.more[1].slots = slots_b.data();
  p.more[1].rows = nullptr;
  s = cache_write_run(*backend, p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("more[].rows"), std::string::npos) << s.to_string();
}

// CacheWriteParams::upload: the bytes land at `device` before the write reads its slots (which lie there), also
// when there is nothing to write; a bad upload is refused, naming the field.
TEST(CacheWriteKernel, UploadLandsBeforeTheWriteReadsItsSlots) {
  auto backend = make_cpu_backend(2);
  std::vector<float> rows = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, pool(8, -1.f);
  // [3 slots | 2 extra int32]: the slots the write uses, then bytes only a later reader would use.
  std::vector<char> host(3 * sizeof(int64_t) + 2 * sizeof(int32_t));
  const int64_t slots[3] = {3, -1, 0};
  const int32_t extra[2] = {41, -42};
  std::memcpy(host.data(), slots, sizeof slots);
  std::memcpy(host.data() + sizeof slots, extra, sizeof extra);
  auto dev = backend->allocate(host.size());
  ASSERT_TRUE(dev.ok());
  std::memset(dev->get(), 0x7f, host.size());  // stale contents the write must not read
  CacheWriteParams p{rows.data(), DType::kF32, Fp8ScaleMode::kFp32, nullptr, 3, dev->as<int64_t>(), {pool.data(), DType::kF32, 2, 2, 2}, {}, {}};
  p.upload = {host.data(), dev->get(), host.size()};
  ASSERT_TRUE(cache_write_run(*backend, p).ok());
  EXPECT_EQ(std::memcmp(dev->get(), host.data(), host.size()), 0);
  EXPECT_EQ(pool, (std::vector<float>{5.f, 6.f, -1.f, -1.f, -1.f, -1.f, 1.f, 2.f}));
  // Nothing to write: the upload is still made.
  std::memset(dev->get(), 0, host.size());
  p.num_rows = 0;
  ASSERT_TRUE(cache_write_run(*backend, p).ok());
  EXPECT_EQ(std::memcmp(dev->get(), host.data(), host.size()), 0);
  p.num_rows = 3;
  // Too large, misaligned, or without a pointer: refused, naming what is wrong.
  std::vector<char> big(kCacheWriteMaxUploadBytes + 16);
  auto big_dev = backend->allocate(big.size());
  ASSERT_TRUE(big_dev.ok());
  CacheWriteParams q = p;
  q.upload = {big.data(), big_dev->get(), big.size()};
  Status st = cache_write_run(*backend, q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("at most " + std::to_string(kCacheWriteMaxUploadBytes)), std::string::npos) << st.to_string();
  q.upload = {host.data(), static_cast<char*>(dev->get()) + 4, 8};
  st = cache_write_run(*backend, q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("16-byte aligned"), std::string::npos) << st.to_string();
  q.upload = {nullptr, dev->get(), 8};
  st = cache_write_run(*backend, q);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("upload.host"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace dsacp
