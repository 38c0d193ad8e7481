// The GPU test binaries' shared frame: options, shared backends, the check log hooked into GoogleTest, main's body.
#include "gpu/gpu_test.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gpu/crash_trace.h"

namespace dsacp::testing {
namespace {

GpuTestOptions& mutable_options() {
  static GpuTestOptions o;
  return o;
}

struct SharedBackends {
  std::unique_ptr<Backend> gpu, cpu;
  std::string reason;
};

SharedBackends& shared() {
  static SharedBackends* s = [] {
    auto* b = new SharedBackends;  // never destroyed: the process ends with _Exit
    auto count = cuda_device_count();
    if (!count.ok() || *count < 1) {
      b->reason = count.ok() ? "0 CUDA devices" : count.status().to_string();
    } else {
      auto g = make_cuda_backend(0);
      if (g.ok()) {
        b->gpu = std::move(g).value();
      } else {
        b->reason = g.status().to_string();
      }
    }
    b->cpu = make_cpu_backend(0);
    return b;
  }();
  return *s;
}

}  // namespace

const GpuTestOptions& gpu_test_options() { return mutable_options(); }

void parse_gpu_test_options(int* argc, char** argv, uint64_t seed_modulus) {
  GpuTestOptions& o = mutable_options();
  o.seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  if (seed_modulus != 0) o.seed %= seed_modulus;
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < *argc;
    if (a == "--quick") {
      o.quick = true;
    } else if (a == "--sanitizer-subset") {
      o.sanitizer_subset = true;
      o.quick = true;
    } else if (a == "--seed" && has_value) {
      o.seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--churn" && has_value) {
      o.churn = std::atoi(argv[++i]);
    } else if (a == "--window" && has_value) {
      o.window = std::atoi(argv[++i]);
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  argv[out] = nullptr;
}

CheckLog& check_log() {
  static CheckLog log;
  return log;
}

Backend* shared_gpu() { return shared().gpu.get(); }
Backend& shared_cpu() { return *shared().cpu; }
std::string no_gpu_reason() { return shared().reason; }

void GpuTest::SetUp() {
  checks0_ = check_log().checks();
  failures0_ = check_log().failures();
  if (shared_gpu() == nullptr) {
    skipped_ = true;
    GTEST_SKIP() << "no usable GPU: " << no_gpu_reason();
  }
}

void GpuTest::TearDown() {
  if (skipped_ || IsSkipped()) return;
  const int checks = check_log().checks() - checks0_;
  RecordProperty("checks", checks);
  RecordProperty("failed_checks", check_log().failures() - failures0_);
  EXPECT_GT(checks, 0) << "the test ran no check";
}

std::string param_name(const std::string& case_name) {
  std::string s;
  for (char ch : case_name) {
    const bool alnum = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
    if (alnum) {
      s += ch;
    } else if (ch != '=' && !s.empty() && s.back() != '_') {
      s += '_';
    }
  }
  while (!s.empty() && s.back() == '_') s.pop_back();
  return s;
}

void run_gpu_tests(const char* title) {
  install_crash_trace();
  check_log().on_failure = [](const std::string& line) { ADD_FAILURE() << line; };
  const GpuTestOptions& o = gpu_test_options();
  if (!GTEST_FLAG_GET(list_tests)) {
    std::printf("%s: %s%sseed %llu\n", title, o.quick ? "--quick, " : "", o.sanitizer_subset ? "--sanitizer-subset, " : "",
                static_cast<unsigned long long>(o.seed));
  }
  const int rc = RUN_ALL_TESTS();
  if (!GTEST_FLAG_GET(list_tests)) {
    std::printf("%d checks, %d failures\n", check_log().checks(), check_log().failures());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(rc);
}

}  // namespace dsacp::testing
