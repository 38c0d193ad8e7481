// dsacp_gpu_cp_tests: the NCCL communicator and every CP layout on GPUs against one GPU (GoogleTest, label gpu;
// skipped without a GPU). Options: gpu/gpu_test.h (--seed N, --churn N, --window N) and GoogleTest's.
#include <string>

#include "dsacp/nccl_communicator.h"
#include "gpu/gpu_test.h"

int main(int argc, char** argv) {
  dsacp::testing::parse_gpu_test_options(&argc, argv, 1000003);
  ::testing::InitGoogleTest(&argc, argv);
  dsacp::testing::run_gpu_tests((std::string("dsacp GPU CP tests (") + dsacp::nccl_version() + ")").c_str());
}
