// Issue #30: what the CLI does with bad input — never a crash, a hang or lost data; one line naming the cause.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "dsacp/case_file.h"
#include "support/scratch_dir.h"

namespace dsacp {
namespace {

struct Cmd {
  int code;            // exit status; -1 when a signal ended it
  std::string output;  // stdout and stderr together
  double seconds;
};

// `prefix` runs first in the same shell (e.g. "ulimit -f 1;").
Cmd cli(const std::string& args, const std::string& prefix = "") {
  const std::string cmd = "(" + prefix + " " + std::string(DSACP_CLI_PATH) + " " + args + ") 2>&1";
  Cmd r{-1, "", 0};
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

constexpr const char* kScratchStem = "dsacp_bad_input";

// Every test gets this directory empty and removes it when it ends, passed or failed.
class CliBadInput : public ::testing::Test {
 protected:
  testing::ScratchDir scratch_{kScratchStem};
};

// The directory of the running test (made by its CliBadInput fixture).
std::string dir() { return testing::scratch_dir_path(kScratchStem).string(); }

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

bool has(const Cmd& r, const std::string& text) { return r.output.find(text) != std::string::npos; }

std::string small_case(const std::string& name) {
  const std::string path = dir() + "/" + name;
  const Cmd r = cli("make-case " + path + " --query-lens 2,3 --context-lens 40,7 --topk 8 --heads 2 --latent-dim 16"
                    " --rope-dim 8 --index-heads 2 --index-dim 16");
  EXPECT_EQ(r.code, 0) << r.output;
  return path;
}

constexpr bool kSanitized =
#if defined(__SANITIZE_ADDRESS__)
    true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
    true;
#else
    false;
#endif
#else
    false;
#endif

// 1. --out naming the case (same path, ./path, a hard link, a symbolic link) replaced the case with the result.
TEST_F(CliBadInput, OutThatIsTheCaseIsRefusedAndTheCaseKept) {
  const std::string c = small_case("keep.safetensors");
  const std::string before = bytes_of(c);
  const std::string d = dir();
  std::filesystem::remove(d + "/hard.safetensors");
  std::filesystem::remove(d + "/sym.safetensors");
  std::filesystem::create_hard_link(c, d + "/hard.safetensors");
  std::filesystem::create_symlink(c, d + "/sym.safetensors");
  for (const std::string& out : {c, d + "/./keep.safetensors", d + "/hard.safetensors", d + "/sym.safetensors"}) {
    const Cmd r = cli("replay " + c + " --out " + out);
    EXPECT_EQ(r.code, 2) << out << ": " << r.output;
    EXPECT_TRUE(has(r, "is the case file")) << r.output;
    EXPECT_EQ(lines(r.output), 1) << r.output;
    EXPECT_EQ(bytes_of(c), before) << out;
  }
}

// 2. The fixed RESULT.tmp: a user's file of that name was consumed; errors named RESULT.tmp.
TEST_F(CliBadInput, ResultTmpOfTheUserIsNeverTouched) {
  const std::string c = small_case("tmp_case.safetensors");
  const std::string out = dir() + "/tmp_result.safetensors";
  std::ofstream(out + ".tmp") << "mine";
  const Cmd r = cli("replay " + c + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(bytes_of(out + ".tmp"), "mine");
  const Cmd bad = cli("replay " + c + " --out " + dir() + "/no/such/dir/r.safetensors");
  EXPECT_EQ(bad.code, 1) << bad.output;
  EXPECT_FALSE(has(bad, ".tmp")) << bad.output;
}

// 7. A write cut short by the file-size limit said "write failed: Success" (or SIGXFSZ killed the process).
TEST_F(CliBadInput, FileSizeLimitIsReportedByName) {
  const std::string c = small_case("fsize_case.safetensors");
  const std::string out = dir() + "/fsize_result.safetensors";
  std::filesystem::remove(out);
  const Cmd r = cli("replay " + c + " --out " + out, "ulimit -f 1;");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(has(r, "the file size limit (ulimit -f) was reached")) << r.output;
  EXPECT_EQ(lines(r.output), 1) << r.output;
  EXPECT_FALSE(std::filesystem::exists(out));
  for (const auto& e : std::filesystem::directory_iterator(dir())) {
    EXPECT_EQ(e.path().string().find("fsize_result.safetensors.dsacp"), std::string::npos) << "left behind: " << e.path();
  }
}

// 3. "topk": "100000000" took 23 GB and was killed by the OOM killer; --pcp 1024 took 9 GB first.
TEST_F(CliBadInput, MemoryIsCheckedBeforeItIsTaken) {
  const std::string c = small_case("mem_case.safetensors");
  auto cf = case_read(c);
  ASSERT_TRUE(cf.ok()) << cf.status().to_string();
  const std::string big = dir() + "/mem_big.safetensors";
  for (int32_t K : {100000000, 2000000000}) {
    cf->topk = K;
    ASSERT_TRUE(case_write(big, *cf).ok());
    const Cmd r = cli("replay " + big + " --out " + dir() + "/mem_r.safetensors" +
                      (K == 100000000 ? " --max-memory 2G" : ""));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_TRUE(has(r, "resource exhausted: ")) << r.output;
    EXPECT_TRUE(has(r, "this replay needs about")) << r.output;
    EXPECT_TRUE(has(r, "K=" + std::to_string(K))) << r.output;
    EXPECT_EQ(lines(r.output), 1) << r.output;
    EXPECT_LT(r.seconds, 5.0) << r.output;
  }
  Cmd r = cli("run --pcp 1024 --dcp 1 --no-progress");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(has(r, "this workload needs about")) << r.output;
  EXPECT_LT(r.seconds, 5.0);
  r = cli("run --requests 1 --prompt-len 64 --decode-steps 1 --pcp 1 --dcp 1 --heads 2 --latent-dim 16 "
          "--rope-dim 8 --index-heads 2 --index-dim 16 --topk 8 --max-memory 1K --no-progress");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(has(r, "more than the 1.0 KiB allowed (--max-memory)")) << r.output;
  r = cli("run --max-memory 12Q");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, "--max-memory: expected a byte count")) << r.output;
}

// The least address space (KiB, `ulimit -v`) in which the CLI starts and reads a case: the binary and its shared
// libraries (a CUDA + NCCL build maps far more than a CPU one); 0 if it never starts below 16 GiB.
int64_t cli_start_vm_kib(const std::string& case_path) {
  int64_t lo = 16 << 10, hi = 16 << 20;
  auto starts = [&](int64_t kib) {
    return cli("replay " + case_path + " --out " + dir() + "/vm_probe.safetensors --threads 1",
               "ulimit -v " + std::to_string(kib) + ";").code == 0;
  };
  if (!starts(hi)) return 0;
  while (hi - lo > (4 << 10)) {
    const int64_t mid = (lo + hi) / 2;
    if (starts(mid)) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

// 4. With little address space, --pcp 32 hung in RankWorkers, --pcp 8 and --threads 1024 ended in
// std::terminate. (Not under ASan: its shadow memory needs more address space than the limit leaves.)
TEST_F(CliBadInput, ThreadsThatCannotStartNeverAbortOrHang) {
  if (kSanitized) GTEST_SKIP() << "ulimit -v and AddressSanitizer do not mix";
  const std::string c = small_case("thr_case.safetensors");
  const std::string big = dir() + "/thr_big.safetensors";
  ASSERT_EQ(cli("make-case " + big + " --query-lens 600,300 --context-lens 3000,100 --topk 64").code, 0);
  const std::string out = dir() + "/thr_r.safetensors";
  // ~100 MB above what a single-threaded replay needs: room for a few threads' stacks (8 MiB each), not for 32.
  const int64_t base = cli_start_vm_kib(c);
  ASSERT_GT(base, 0) << "the CLI did not start under any address-space limit";
  const std::string limit = "ulimit -v " + std::to_string(base + 100000) + "; timeout 60";
  Cmd r = cli("replay " + c + " --out " + out + " --pcp 32", limit);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(has(r, "resource exhausted")) << r.output;
  EXPECT_TRUE(has(r, "cannot start the thread of CP rank")) << r.output;
  EXPECT_EQ(lines(r.output), 1) << r.output;
  for (const auto& [file, flags] : {std::pair{big, "--threads 1024"}, std::pair{c, "--pcp 8 --threads 1024"},
                                    std::pair{c, "--pcp 4 --threads 512"}}) {
    r = cli("replay " + file + " --out " + out + " --comm-timeout 10 " + flags, limit);
    EXPECT_TRUE(r.code == 0 || r.code == 1) << flags << ": " << r.output;  // not a signal, not 124 (hung)
    EXPECT_FALSE(has(r, "terminate")) << flags << ": " << r.output;
    EXPECT_EQ(lines(r.output), 1) << flags << ": " << r.output;
  }
}

// 7. Messages: the real cause, one line, no doubled prefix; strict integers; --samples 0; --json threads.
TEST_F(CliBadInput, MessagesNameTheRealCause) {
  Cmd r = cli("run --bogus");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r, "dsacp run: error: invalid argument: unknown option \"--bogus\" (see dsacp run --help)"))
      << r.output;
  for (const char* v : {"' 2'", "'2 '", "+2", "0x2"}) {
    r = cli(std::string("run --pcp ") + v);
    EXPECT_EQ(r.code, 2) << v << ": " << r.output;
    EXPECT_TRUE(has(r, "--pcp: expected an integer")) << r.output;
  }
  r = cli("run --scale 1e39");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(has(r, "not finite as an f32")) << r.output;
  r = cli("run --scale ' 0.5'");
  EXPECT_EQ(r.code, 2) << r.output;
  const std::string small = "--requests 1 --prompt-len 40 --decode-steps 1 --pcp 1 --dcp 1 --heads 2 --latent-dim 16 "
                            "--rope-dim 8 --index-heads 2 --index-dim 16 --topk 8 --no-progress";
  r = cli("run " + small + " --samples 0");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "not checked (--samples 0)")) << r.output;
  EXPECT_FALSE(has(r, "PASS")) << r.output;
  r = cli("run " + small + " --threads 3 --json");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "\"threads\":3,")) << r.output;
  r = cli("run " + small + " --json");
  EXPECT_FALSE(has(r, "\"threads\":0,")) << r.output;
  // The NCCL transport's sizes are options with bounds (no environment variables): out of range is refused.
  r = cli("run " + small + " --nccl-window-mb -1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(has(r, "--nccl-window-mb")) << r.output;
  EXPECT_EQ(lines(r.output), 1) << r.output;
  r = cli("run " + small + " --nccl-peer-exchange-mb 5000");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(has(r, "--nccl-peer-exchange-mb")) << r.output;
  r = cli("run " + small + " --nccl-window-mb 0 --nccl-peer-exchange-mb 16");
  EXPECT_EQ(r.code, 0) << r.output;
  // A FIFO as the case blocked forever; /dev/zero said "internal error: std::bad_alloc".
  const std::string fifo = dir() + "/case.fifo";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  r = cli("replay " + fifo + " --out " + dir() + "/f.safetensors", "timeout 20");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_TRUE(has(r, "is a FIFO, expected a regular file")) << r.output;
  r = cli("replay /dev/zero --out " + dir() + "/z.safetensors");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_FALSE(has(r, "bad_alloc")) << r.output;
  // A 100,000-character tensor name: the line stays short.
  const std::string c = small_case("long_name.safetensors");
  SafetensorsFile f = std::move(safetensors_read(c)).value();
  f.tensors[std::string(100000, 'x')] = Tensor::zeros(DType::kF32, {1}).value();
  ASSERT_TRUE(safetensors_write(c, f).ok());
  r = cli("replay " + c + " --out " + dir() + "/l.safetensors");
  EXPECT_EQ(r.code, 2) << r.output.substr(0, 300);
  EXPECT_TRUE(has(r, "unexpected tensor")) << r.output.substr(0, 300);
  EXPECT_LT(r.output.size(), 700u) << r.output.substr(0, 300);
  EXPECT_EQ(lines(r.output), 1);
}

// 8. Non-finite inputs: NaN index scores rank below every finite score, the same in every layout; replay warns
// once. A case whose scale overflows the scores (3e38) warns that its result is not finite.
TEST_F(CliBadInput, NonFiniteInputsAreDefinedAndWarnedOnce) {
  const std::string c = dir() + "/nan_case.safetensors";
  ASSERT_EQ(cli("make-case " + c + " --query-lens 2,1,9 --context-lens 60,33,0 --topk 16 --seed 3").code, 0);
  auto cf = case_read(c);
  ASSERT_TRUE(cf.ok());
  // Every third context key of the indexer is NaN: its scores are NaN for every query.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t Di = cf->dims.Di;
  for (int64_t j = 0; j < cf->ctx_idx_k.dim(0); j += 3) {
    for (int64_t d = 0; d < Di; ++d) cf->ctx_idx_k.set_f32(j * Di + d, nan);
  }
  ASSERT_TRUE(case_write(c, *cf).ok());
  std::string first;
  for (const char* flags : {"--pcp 1", "--pcp 2", "--dcp 2 --indexer sharded", "--pcp 2 --dcp 2 --interleave 3",
                            "--dcp 3 --dsa-cp --interleave 1", "--dcp 2 --indexer replicated"}) {
    const std::string out = dir() + "/nan_r.safetensors";
    const Cmd r = cli("replay " + c + " --out " + out + " " + flags);
    ASSERT_EQ(r.code, 0) << flags << ": " << r.output;
    EXPECT_EQ(lines(r.output), 2) << r.output;  // the warning and the summary
    EXPECT_TRUE(has(r, "warning: the case's inputs hold non-finite values (first: ctx_idx_k")) << r.output;
    auto res = result_read(out);
    ASSERT_TRUE(res.ok());
    const std::string topk(static_cast<const char*>(res->topk_indices.data()), res->topk_indices.nbytes());
    if (first.empty()) first = topk;
    EXPECT_EQ(topk, first) << flags;
  }
  // Request 0 (60 context keys, 20 of them NaN, 40 finite): K = 16 picks finite keys only.
  auto res = result_read(dir() + "/nan_r.safetensors");
  ASSERT_TRUE(res.ok());
  for (int64_t i = 0; i < 16; ++i) {
    const int32_t pos = res->topk_indices.data_as<int32_t>()[i];
    ASSERT_GE(pos, 0);
    if (pos < 60) {
      EXPECT_NE(pos % 3, 0) << "a NaN-scored key was chosen over finite ones: position " << pos;
    }
  }
  // Finite inputs, a scale that overflows the scores: the result's warning.
  const std::string s = dir() + "/huge_scale.safetensors";
  ASSERT_EQ(cli("make-case " + s + " --query-lens 2 --context-lens 20 --topk 8").code, 0);
  auto sc = case_read(s);
  ASSERT_TRUE(sc.ok());
  sc->scale = 3e38f;
  ASSERT_TRUE(case_write(s, *sc).ok());
  const Cmd r = cli("replay " + s + " --out " + dir() + "/huge_r.safetensors");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(has(r, "warning: the result's")) << r.output;
  EXPECT_EQ(lines(r.output), 2) << r.output;
}

}  // namespace
}  // namespace dsacp
