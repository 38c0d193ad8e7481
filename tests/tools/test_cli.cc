// The dsacp CLI end to end: help, refused flags, make-case -> replay, malformed cases refused in one line.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "dsacp/case_file.h"
#include "dsacp/mpi_context.h"
#include "dsacp/replay.h"
#include "support/scratch_dir.h"

namespace dsacp {
namespace {

struct CmdResult {
  int code;
  std::string output;  // stdout and stderr together
};

// Runs the CLI through /bin/sh; `env` (env(1)'s arguments: NAME=VALUE assignments, -u NAME) changes the child's
// environment only, never the test process's.
CmdResult run_cli(const std::string& args, const std::string& env = "") {
  const std::string cmd = (env.empty() ? std::string() : "env " + env + " ") + DSACP_CLI_PATH + " " + args + " 2>&1";
  CmdResult r{-1, ""};
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

constexpr const char* kScratchStem = "dsacp_cli_test";

// Every test gets its scratch directory empty and removes it when it ends, passed or failed.
class Cli : public ::testing::Test {
 protected:
  testing::ScratchDir scratch_{kScratchStem};
};

// A file in the running test's scratch directory (made by its Cli fixture).
std::string temp_path(const std::string& name) { return (testing::scratch_dir_path(kScratchStem) / name).string(); }

int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

TEST_F(Cli, HelpForEveryCommand) {
  EXPECT_EQ(run_cli("--help").code, 0);
  for (const char* cmd : {"run", "replay", "make-case"}) {
    CmdResult r = run_cli(std::string(cmd) + " --help");
    EXPECT_EQ(r.code, 0) << cmd;
    EXPECT_NE(r.output.find("usage: dsacp"), std::string::npos) << r.output;
  }
  CmdResult r = run_cli("frobnicate");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("unknown command"), std::string::npos);
}

TEST_F(Cli, InvalidLayoutsAreRefusedInOneLine) {
  const std::string case_path = temp_path("layout_case.safetensors");
  ASSERT_EQ(run_cli("make-case " + case_path + " --heads 4").code, 0);
  const std::string out = temp_path("layout_out.safetensors");
  struct Bad {
    const char* flags;
    const char* says;
  } bad[] = {{"--dsa-cp --pcp 2 --dcp 2", "DSA-CP with PCP"},
             {"--dcp 3", "H must be a multiple of D"},
             {"--dcp 2 --pcp-decode gathered", "gathered decodes with DCP"},
             {"--indexer mirrored", "--indexer: expected one of sharded, replicated"},
             {"--dcp 0", "--dcp: expected an integer"}};
  for (const Bad& b : bad) {
    CmdResult r = run_cli("replay " + case_path + " --out " + out + " " + b.flags);
    EXPECT_NE(r.code, 0) << b.flags;
    EXPECT_NE(r.output.find(b.says), std::string::npos) << b.flags << ": " << r.output;
    EXPECT_EQ(count_lines(r.output), 1) << r.output;
  }
  // Without a usable GPU (or in a CPU-only build), and for CP layouts on cuda, --device cuda is refused in one
  // line naming the reason.
  CmdResult r = run_cli("run --device cuda");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("unsupported: --device cuda"), std::string::npos) << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

// The serving options on the command line: --topk-form slot and --lse-base 2 are recorded in the result file,
// --topk-from replays with a precomputed top-k (the same result as the indexer's), a slot result is refused there.
TEST_F(Cli, ReplayServingOptions) {
  const std::string case_path = temp_path("serving_case.safetensors");
  ASSERT_EQ(run_cli("make-case " + case_path + " --query-lens 1,3,9 --context-lens 70,20,0 --heads 4 --topk 16").code, 0);
  const std::string plain = temp_path("serving_plain.safetensors"), forms = temp_path("serving_forms.safetensors"),
                    pre = temp_path("serving_pre.safetensors");
  CmdResult r = run_cli("replay " + case_path + " --out " + plain + " --page-size 16");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_cli("replay " + case_path + " --out " + forms + " --page-size 16 --dcp 2 --topk-form slot --lse-base 2");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_cli("replay " + case_path + " --out " + pre + " --page-size 16 --topk-from " + plain);
  ASSERT_EQ(r.code, 0) << r.output;
  auto a = result_read(plain), b = result_read(forms), p = result_read(pre);
  ASSERT_TRUE(a.ok() && b.ok() && p.ok());
  EXPECT_EQ(b->topk_form, TopkForm::kSlot);
  EXPECT_EQ(b->lse_base, LseBase::kTwo);
  for (int64_t i = 0; i < a->lse.numel(); ++i) {
    EXPECT_NEAR(b->lse.get_f32(i), a->lse.get_f32(i) * kLog2E, 1e-5 * std::max(1.f, std::fabs(a->lse.get_f32(i))));
  }
  EXPECT_EQ(0, std::memcmp(p->topk_indices.data(), a->topk_indices.data(), a->topk_indices.nbytes()));
  EXPECT_EQ(0, std::memcmp(p->out.data(), a->out.data(), a->out.nbytes()));
  r = run_cli("replay " + case_path + " --out " + pre + " --topk-from " + forms);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("are slots"), std::string::npos) << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  r = run_cli("replay " + case_path + " --out " + pre + " --lse-base 10");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

TEST_F(Cli, MpiLauncherChecksTheWorldSize) {
  // Outside mpirun the MPI world is this one process (an MPI singleton): a 2-rank layout is refused in one
  // line. Built without MPI, the launcher is refused as unsupported. Either way nothing waits.
  const char* asan = std::getenv("ASAN_OPTIONS");  // OpenMPI keeps memory until exit: no leak report
  const std::string no_leaks =
      "'ASAN_OPTIONS=" + std::string(asan ? asan : "") + (asan ? ":" : "") + "detect_leaks=0'";
  auto cli = [&](const std::string& args, const std::string& more_env = "") {
    return run_cli(args, more_env + (more_env.empty() ? "" : " ") + no_leaks);
  };
  CmdResult r = cli("replay no_such_case.safetensors --out x.safetensors --pcp 2 --launcher mpi");
  EXPECT_EQ(r.code, 2) << r.output;
  if (mpi_available()) {
    EXPECT_NE(r.output.find("the MPI world has 1 processes, the layout P=2 x D=1 needs 2"), std::string::npos)
        << r.output;
  } else {
    EXPECT_NE(r.output.find("unsupported: built without MPI"), std::string::npos) << r.output;
  }
  // --launcher env: GPU ranks only, and the torchrun-style variables must be set.
  r = cli("replay c.safetensors --out x.safetensors --launcher env");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--launcher env runs GPU ranks"), std::string::npos) << r.output;
  r = cli("replay c.safetensors --out x.safetensors --launcher env --device cuda", "-u RANK");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("RANK is not set"), std::string::npos) << r.output;
  r = cli("replay c.safetensors --out x.safetensors --nccl-id-file /tmp/id");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--nccl-id-file applies to --launcher env"), std::string::npos) << r.output;
  EXPECT_EQ(cli("replay c.safetensors --out x.safetensors --launcher slurm").code, 2);
}

TEST_F(Cli, GpusOptionIsCheckedInOneLine) {
  CmdResult r = run_cli("run --gpus 2");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--gpus applies to --device cuda only"), std::string::npos) << r.output;
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
  r = run_cli("run --gpus 0");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--gpus"), std::string::npos) << r.output;
}

TEST_F(Cli, BadOptionValuesAreNamed) {
  CmdResult r = run_cli("run --topk abc");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--topk: expected an integer"), std::string::npos) << r.output;
  r = run_cli("run --mtp 17");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--mtp"), std::string::npos) << r.output;
  r = run_cli("replay");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("expected 1 argument"), std::string::npos) << r.output;
}

TEST_F(Cli, MakeCaseThenReplayMatchesTheLibrary) {
  const std::string case_path = temp_path("case.safetensors");
  const std::string result_path = temp_path("result.safetensors");
  CmdResult r = run_cli("make-case " + case_path +
                        " --query-lens 1,3,17,5 --context-lens 70,33,0,12 --heads 3 --latent-dim 24 --rope-dim 8"
                        " --index-heads 2 --index-dim 16 --topk 20 --seed 9");
  ASSERT_EQ(r.code, 0) << r.output;
  r = run_cli("replay " + case_path + " --out " + result_path + " --page-size 7 --threads 2");
  ASSERT_EQ(r.code, 0) << r.output;
  auto c = case_read(case_path);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto got = result_read(result_path);
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  // The library with another page size and page order gives the same rows bit for bit.
  auto backend = make_cpu_backend(1);
  ReplayOptions opt;
  opt.page_size = 3;
  opt.page_shuffle_seed = 99;
  auto want = replay_case(*backend, *c, opt);
  ASSERT_TRUE(want.ok()) << want.status().to_string();
  ASSERT_EQ(got->topk_indices.nbytes(), want->topk_indices.nbytes());
  EXPECT_EQ(0, std::memcmp(got->topk_indices.data(), want->topk_indices.data(), want->topk_indices.nbytes()));
  EXPECT_EQ(0, std::memcmp(got->out.data(), want->out.data(), want->out.nbytes()));
  EXPECT_EQ(0, std::memcmp(got->lse.data(), want->lse.data(), want->lse.nbytes()));
}

// Every layout gives the same top-k rows as one device (issue 3: --pcp 4 as --pcp 1), outputs within fp32 rounding.
TEST_F(Cli, ReplayInEveryLayoutMatchesOneDevice) {
  const std::string case_path = temp_path("pcp_case.safetensors");
  ASSERT_EQ(run_cli("make-case " + case_path + " --query-lens 2,1,37,9,1 --context-lens 80,300,0,21,0 --topk 32 --seed 5")
                .code,
            0);
  auto read = [&](const std::string& flags) {
    const std::string out = temp_path("pcp_result" + std::to_string(std::hash<std::string>{}(flags)) + ".safetensors");
    CmdResult r = run_cli("replay " + case_path + " --out " + out + " " + flags);
    EXPECT_EQ(r.code, 0) << flags << ": " << r.output;
    return result_read(out);
  };
  auto one = read("--pcp 1");
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  for (const char* flags : {"--pcp 4", "--pcp 2 --interleave 3", "--pcp 3 --pcp-decode gathered --page-size 8",
                            "--dcp 2 --indexer replicated", "--pcp 2 --dcp 2 --indexer sharded",
                            "--dcp 4 --dsa-cp --interleave 1"}) {
    auto cp = read(flags);
    ASSERT_TRUE(cp.ok()) << cp.status().to_string();
    EXPECT_EQ(0, std::memcmp(cp->topk_indices.data(), one->topk_indices.data(), one->topk_indices.nbytes())) << flags;
    double err = 0;
    for (int64_t i = 0; i < one->out.numel(); ++i) err = std::max(err, double(std::fabs(cp->out.get_f32(i) - one->out.get_f32(i))));
    EXPECT_LT(err, 1e-5) << flags;
  }
  CmdResult bad = run_cli("replay " + case_path + " --out /tmp/x.safetensors --pcp 0");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("--pcp"), std::string::npos) << bad.output;
}

TEST_F(Cli, MalformedCasesAreRefusedInOneLine) {
  const std::string case_path = temp_path("good.safetensors");
  ASSERT_EQ(run_cli("make-case " + case_path).code, 0);
  std::ifstream in(case_path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100u);
  const std::string bad_path = temp_path("bad.safetensors");
  const std::string out_path = temp_path("bad_result.safetensors");
  for (size_t cut : {size_t{0}, size_t{5}, size_t{12}, bytes.size() / 2, bytes.size() - 1}) {
    std::ofstream(bad_path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(cut));
    CmdResult r = run_cli("replay " + bad_path + " --out " + out_path);
    EXPECT_NE(r.code, 0) << "cut at " << cut;
    EXPECT_EQ(count_lines(r.output), 1) << r.output;
    EXPECT_NE(r.output.find("error"), std::string::npos) << r.output;
  }
  CmdResult r = run_cli("replay /nonexistent/case.safetensors --out " + out_path);
  EXPECT_NE(r.code, 0);
  EXPECT_EQ(count_lines(r.output), 1) << r.output;
}

}  // namespace
}  // namespace dsacp
