// The memory estimate and its checks: host (through the CPU backend's replay) and device (a fake GPU backend
// that reports its free memory), refused in one line before anything is allocated.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/memory_estimate.h"

namespace dsacp {
namespace {

// A backend that only says which device it is and how much of it is free.
class FakeGpu final : public Backend {
 public:
  FakeGpu(int device, int64_t free_bytes) : device_(device), free_(free_bytes) {}
  std::string name() const override { return "cuda:" + std::to_string(device_); }
  int cuda_device() const override { return device_; }
  int64_t device_memory_free() const override { return free_; }
  Result<DeviceBuffer> allocate(size_t) override { return unsupported("fake"); }
  Status copy_to_device(void*, const void*, size_t) override { return unsupported("fake"); }
  Status copy_to_host(void*, const void*, size_t) override { return unsupported("fake"); }
  Status copy_on_device(void*, const void*, size_t) override { return unsupported("fake"); }
  Status fill(void*, DType, int64_t, float) override { return unsupported("fake"); }
  Status synchronize() override { return Status(); }
  Status cache_write(const CacheWriteParams&) override { return unsupported("fake"); }
  Status indexer_topk(const IndexerTopkParams&) override { return unsupported("fake"); }
  Status sparse_mla(const SparseMlaParams&) override { return unsupported("fake"); }
  Status lse_merge(const LseMergeParams&) override { return unsupported("fake"); }
  Status gather_rows(const GatherRowsParams&) override { return unsupported("fake"); }
  Status topk_remap(const TopkRemapParams&) override { return unsupported("fake"); }
  Status topk_merge(const TopkMergeParams&) override { return unsupported("fake"); }

 private:
  int device_;
  int64_t free_;
};

MemoryEstimate estimate_of(uint64_t bytes) {
  MemoryEstimate e;
  e.step = bytes;
  return e;
}

TEST(DeviceMemoryCheck, EachDeviceGetsItsRanksShare) {
  FakeGpu gpu0(0, 10'000), gpu1(1, 10'000);
  // 4 ranks, 4000 bytes each: two on each GPU fit (8000 <= 10000).
  EXPECT_TRUE(device_memory_check(estimate_of(16'000), 4, {&gpu0, &gpu0, &gpu1, &gpu1}, "this replay").ok());
  // All four on GPU 0: 16000 > 10000.
  const Status s = device_memory_check(estimate_of(16'000), 4, {&gpu0, &gpu0, &gpu0, &gpu0}, "this replay");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("this replay needs about 15.6 KiB of GPU memory on cuda:0 (4 ranks"), std::string::npos)
      << s.message();
  EXPECT_NE(s.message().find("9.8 KiB free"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
}

TEST(DeviceMemoryCheck, HostBackendsAndUnknownFreeMemoryAreSkipped) {
  auto cpu = make_cpu_backend(1);
  FakeGpu unknown(0, -1);
  EXPECT_TRUE(device_memory_check(estimate_of(uint64_t{1} << 62), 2, {cpu.get(), &unknown}, "x").ok());
}

TEST(DeviceMemoryCheck, AHostileEstimateSaturatesInsteadOfWrapping) {
  FakeGpu gpu(0, int64_t{1} << 40);
  const Status s = device_memory_check(estimate_of(~uint64_t{0}), 1, {&gpu}, "this replay");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.message();
}

}  // namespace
}  // namespace dsacp
