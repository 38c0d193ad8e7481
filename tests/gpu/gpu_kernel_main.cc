// dsacp_gpu_tests: every CUDA kernel family against the CPU oracle (GoogleTest, label gpu; skipped without a GPU).
// Options: gpu/gpu_test.h (--quick, --sanitizer-subset, --seed N) and GoogleTest's (--gtest_filter, ...).
#include "gpu/gpu_test.h"

int main(int argc, char** argv) {
  dsacp::testing::parse_gpu_test_options(&argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  dsacp::testing::run_gpu_tests("dsacp GPU kernel tests");
}
