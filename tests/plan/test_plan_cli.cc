// `dsacp plan` end to end: an answer for 1M tokens on 8 GPUs with the repo's calibration, JSON output, one step's
// prediction, and refused configurations in one line with exit code 2.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>

namespace dsacp {
namespace {

struct Out {
  int code = -1;
  std::string text;  // stdout and stderr
};

Out plan(const std::string& args) {
  const std::string cmd = std::string(DSACP_CLI_PATH) + " plan " + args + " 2>&1";
  Out r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.text.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(PlanCli, AnswersForAMillionTokens) {
  const Out o = plan("--model deepseek-v3.2 --context 1048576 --gpus 8");
  ASSERT_EQ(o.code, 0) << o.text;
  EXPECT_NE(o.text.find("chosen: "), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("TTFT"), std::string::npos);
  EXPECT_NE(o.text.find("why it loses"), std::string::npos);
  const Out j = plan("--model glm-5 --context 1048576 --gpus 64 --json");
  ASSERT_EQ(j.code, 0) << j.text;
  EXPECT_NE(j.text.find("\"chosen\": true"), std::string::npos) << j.text;
  EXPECT_NE(j.text.find("\"kv_bytes_per_gpu\""), std::string::npos);
}

TEST(PlanCli, PredictsOneStep) {
  const Out o = plan("--model deepseek-v3.2 --step 1:131071x64 --dcp 2 --json");
  ASSERT_EQ(o.code, 0) << o.text;
  EXPECT_NE(o.text.find("\"step_ms\""), std::string::npos) << o.text;
}

TEST(PlanCli, RefusalsAreOneLine) {
  for (const char* args : {"--model llama --context 1000 --gpus 8", "--model deepseek-v3.2 --context 4 --gpus 8",
                           "--model deepseek-v3.2 --context 100000 --gpus 3 --pcp 1 --dcp 3",
                           "--model deepseek-v3.2 --context 1048576 --batch 64 --gpus 8 --memory-per-gpu 1",
                           "--model deepseek-v3.2 --gpus 8"}) {
    const Out o = plan(args);
    EXPECT_NE(o.code, 0) << args << ": " << o.text;
    EXPECT_EQ(std::count(o.text.begin(), o.text.end(), '\n'), 1) << args << ": " << o.text;
    EXPECT_EQ(o.text.rfind("dsacp plan: error: ", 0), 0u) << o.text;
  }
}

}  // namespace
}  // namespace dsacp
