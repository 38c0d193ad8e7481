// The GPU test binaries' shared frame (GoogleTest): the run's options, the shared backends, the check log whose
// failed checks fail the running test, and a skip when there is no usable GPU.
//
// Options (besides GoogleTest's --gtest_filter / --gtest_output=json:FILE / --gtest_list_tests):
//   --quick              smaller cases where a family has them (what compute-sanitizer runs)
//   --sanitizer-subset   the top-k, fp8_ds_mla and small-heads families' subsets for a sanitizer run of one
//                        family (implies --quick)
//   --seed N             the seed of the families that take a fresh one (default: from the clock, printed)
// The CP binary adds --churn N and --window N (see gpu_cp_main.cc).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "dsacp/backend.h"
#include "gpu/check_log.h"

namespace dsacp::testing {

struct GpuTestOptions {
  bool quick = false;
  bool sanitizer_subset = false;
  uint64_t seed = 0;
  int churn = 0;   // CP binary: communicator churn cycles (0: the test is skipped)
  int window = 0;  // CP binary: extra rounds of the window exchange test (0: skipped)
};

const GpuTestOptions& gpu_test_options();

// Parses and removes this binary's options from argv (call before testing::InitGoogleTest, which registers the
// parameterized cases from them). `seed_modulus` bounds the clock seed (0: none).
void parse_gpu_test_options(int* argc, char** argv, uint64_t seed_modulus = 0);

// Runs the tests: installs the crash trace and the check log's failure hook, prints the checks' totals, and
// ends the process with RUN_ALL_TESTS's code without static destructors (detached NCCL teardown threads).
[[noreturn]] void run_gpu_tests(const char* title);

// The run's check log: one "[  OK  ]" / "[ FAIL ]" line per check; a failed check fails the running test.
CheckLog& check_log();
inline void report(bool ok, const std::string& name, const std::string& detail = "") {
  check_log().report(ok, name, detail);
}

// The default CUDA backend on device 0 and the CPU oracle, made once (nullptr / an error when no GPU).
Backend* shared_gpu();
Backend& shared_cpu();
std::string no_gpu_reason();

// Base of every GPU test: skips without a usable GPU; records the test's check counts as test properties
// ("checks", "failed_checks", in --gtest_output's file); a test that ran no check fails.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  Backend& gpu() { return *shared_gpu(); }
  Backend& cpu() { return shared_cpu(); }

 private:
  int checks0_ = 0, failures0_ = 0;
  bool skipped_ = false;
};

// A GoogleTest parameter name from a case name: letters and digits kept, '=' dropped, anything else one '_'.
std::string param_name(const std::string& case_name);

}  // namespace dsacp::testing
