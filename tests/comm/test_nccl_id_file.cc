// The NCCL id file of process-per-GPU launches (--launcher env): written atomically by rank 0, read by the
// others with a bounded wait. Pure file handling, so it runs without a GPU; a build without NCCL answers
// "unsupported" instead.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "dsacp/nccl_communicator.h"
#include "support/test_seed.h"

namespace dsacp {
namespace {

std::string temp_path(const char* name) {
  return ::testing::TempDir() + "/dsacp_" + name + "_" + std::to_string(testing::test_seed(1) % 100000);
}

TEST(NcclIdFile, RoundTripAndBoundedWait) {
  NcclId id;
  for (size_t i = 0; i < id.bytes.size(); ++i) id.bytes[i] = static_cast<char>(i * 7 + 3);
  const std::string path = temp_path("id");
  std::remove(path.c_str());
  if (!nccl_available()) {
    EXPECT_EQ(nccl_id_write(path, id).code(), StatusCode::kUnsupported);
    return;
  }
  // A reader that starts first waits for the writer.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_TRUE(nccl_id_write(path, id).ok());
  });
  auto got = nccl_id_read(path, std::chrono::seconds(10));
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->bytes, id.bytes);
  std::remove(path.c_str());

  // Nobody writes: a timeout naming the file, after the timeout and not much later.
  const auto t0 = std::chrono::steady_clock::now();
  auto missing = nccl_id_read(path, std::chrono::milliseconds(200));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(missing.status().code(), StatusCode::kTimeout);
  EXPECT_NE(missing.status().message().find(path), std::string::npos) << missing.status().to_string();
  EXPECT_GE(waited, 0.19);
  EXPECT_LT(waited, 5.0);

  // A short file is refused with the sizes, not half-read.
  {
    std::ofstream f(path, std::ios::binary);
    f << "short";
  }
  auto bad = nccl_id_read(path, std::chrono::seconds(1));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("expected 128"), std::string::npos) << bad.status().to_string();
  std::remove(path.c_str());
}

TEST(NcclCommunicator, BadArgumentsAreRefused) {
  NcclId id;
  NcclOptions o;
  auto r = NcclCommunicator::create(id, 2, 5, o);
  ASSERT_FALSE(r.ok());
  if (nccl_available()) {
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  } else {
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  }
}

// A program that links the NCCL communicator starts with CUDA_MODULE_LOADING=EAGER (set before main unless the
// environment the process was started with had a value, which is kept): lazy loading deadlocked two ranks of one
// process (docs/design/gpu-notes.md, session 11). /proc/self/environ is the environment as started.
TEST(NcclCommunicator, ProcessesStartWithEagerModuleLoading) {
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  std::string started_with;
  std::ifstream environ("/proc/self/environ", std::ios::binary);
  for (std::string entry; std::getline(environ, entry, '\0');) {
    if (entry.rfind("CUDA_MODULE_LOADING=", 0) == 0) started_with = entry.substr(20);
  }
  const char* mode = std::getenv("CUDA_MODULE_LOADING");
  ASSERT_NE(mode, nullptr);
  EXPECT_EQ(std::string(mode), started_with.empty() ? "EAGER" : started_with);
}

}  // namespace
}  // namespace dsacp
