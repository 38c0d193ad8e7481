// Every CP layout on GPUs against one GPU on random batches (fresh seeds): ranks on 2 GPUs through NCCL, and
// wider layouts with every rank on GPU 0 (device copies between threads); layouts with fewer than 16 heads a rank;
// FP8 KV layouts. Top-k rows must be identical to one GPU's, out and lse within tolerance; the single GPU is also
// compared with the CPU oracle. And the communicator churn (--churn N).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/case_file.h"
#include "dsacp/nccl_communicator.h"
#include "dsacp/random.h"
#include "dsacp/replay.h"
#include "gpu/gpu_cp_support.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

// The case on one GPU (the layouts' reference), checked against the CPU oracle: top-k identical, out within
// out_tol; the GPU's result, or its error (reported). The oracle's result goes to *oracle_out where given.
Result<StepResult> one_gpu_reference(Backend& gpu, Backend& cpu, const CaseFile& c, const ReplayOptions& one,
                                     double out_tol, const std::string& tag,
                                     Result<StepResult>* oracle_out = nullptr) {
  auto want = replay_case(gpu, c, one);
  if (!want.ok()) {
    report(false, tag + "one GPU", want.status().to_string());
    return want;
  }
  auto oracle = replay_case(cpu, c, one);
  if (oracle.ok()) {
    const Compare cc = compare(*want, *oracle);
    report(cc.topk_same && cc.out_rel < out_tol, tag + "one GPU vs CPU oracle", describe(cc));
  } else {
    report(false, tag + "CPU oracle", oracle.status().to_string());
  }
  if (oracle_out != nullptr) *oracle_out = std::move(oracle);
  return want;
}

void test_layouts(uint64_t seed, int num_gpus) {
  auto cpu = make_cpu_backend(0);
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < std::min(num_gpus, 8); ++g) gpus.push_back(std::move(make_cuda_backend(g)).value());

  const Layout wide[] = {
      {"P2 (NCCL)", make_layout(2, 1), false},
      {"D2 sharded (NCCL)", make_layout(2 / 2, 2), false},
      {"D2 replicated (NCCL)", make_layout(1, 2, IndexerMode::kReplicated), false},
      {"P2 interleave 1 (NCCL)", make_layout(2, 1, IndexerMode::kSharded, 1), false},
      {"P2 gathered decodes (NCCL)", make_layout(2, 1, IndexerMode::kSharded, 0, false, DecodeMode::kGathered), false},
      {"D2 DSA-CP (NCCL)", make_layout(1, 2, IndexerMode::kSharded, 0, true), false},
      {"D2 sharded (NCCL, no window)", without_window(make_layout(1, 2)), false},
      {"D2 sharded (NCCL, window publishes)", with_choices(make_layout(1, 2), CpLayout::WindowRows::kNone, true), false},
      {"D2 sharded (NCCL, window rows: candidates only)",
       with_choices(make_layout(1, 2), CpLayout::WindowRows::kTopkOnly, true), false},
      {"D2 sharded (NCCL, window rows, merge kernel)", with_choices(make_layout(1, 2), CpLayout::WindowRows::kBoth, false),
       false},
      {"D2 replicated (NCCL, no window)", without_window(make_layout(1, 2, IndexerMode::kReplicated)), false},
      {"D2 DSA-CP (NCCL, no window)", without_window(make_layout(1, 2, IndexerMode::kSharded, 0, true)), false},
      {"P2xD2 on one GPU", make_layout(2, 2), true},
      {"P4 on one GPU", make_layout(4, 1), true},
      {"D4 replicated on one GPU", make_layout(1, 4, IndexerMode::kReplicated), true},
      {"D4 DSA-CP on one GPU", make_layout(1, 4, IndexerMode::kSharded, 3, true), true},
      {"P2xD4 on one GPU", make_layout(2, 4), true},
  };
  for (int variant = 0; variant < 2; ++variant) {
    const bool decode_only = variant == 1;
    const int32_t H = decode_only ? 128 : 64;
    const uint64_t s = seed * 31 + variant;
    const CaseFile c = make_case(s, H, decode_only);
    const std::string tag = std::string(decode_only ? "decode-only" : "mixed") + " H=" + std::to_string(H) +
                            " seed " + std::to_string(s) + ": ";
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kF32;
    auto want = one_gpu_reference(*gpus[0], *cpu, c, one, 1e-2, tag);
    if (!want.ok()) continue;
    for (const Layout& l : wide) {
      if (decode_only != l.layout.dsa_cp && l.layout.dsa_cp) continue;  // DSA-CP: the decode-only batch
      if (l.layout.dsa_cp && !decode_only) continue;
      if (!l.one_gpu && num_gpus < l.layout.num_ranks()) continue;
      ReplayOptions o = one;
      o.layout = l.layout;
      std::vector<Backend*> ranks;
      for (int32_t cr = 0; cr < l.layout.num_ranks(); ++cr) ranks.push_back(gpus[l.one_gpu ? 0 : cr].get());
      const auto t0 = Clock::now();
      auto got = replay_case(ranks, c, o);
      if (!got.ok()) {
        report(false, tag + l.name, got.status().to_string());
        continue;
      }
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 5e-3 && cc.lse_abs < 2e-2, tag + l.name + " vs one GPU",
             describe(cc) + " (" + std::to_string(seconds_since(t0)) + " s)");
    }
  }
  // A bf16 output: the local decodes' partials travel in bf16 (the direct head-block path at H=128 over D=2), with
  // the default decode kernel (ws32) and with the prefill kernel (ws) forced, whose merge has its own staging rule.
  using MlaKernel = CudaBackendOptions::MlaKernel;
  for (const auto& [kernel, tag] : {std::pair<MlaKernel, const char*>{MlaKernel::kAuto, ""}, {MlaKernel::kWgmmaWs, "ws"}}) {
    const CaseFile c = make_case(seed * 31 + 2, 128, true);
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kBF16;
    auto want = replay_case(*gpus[0], c, one);
    ReplayOptions o = one;
    o.layout = make_layout(1, 2);
    const bool two = num_gpus >= 2;
    CudaBackendOptions bo;
    bo.mla_kernel = kernel;
    std::vector<std::unique_ptr<Backend>> forced;
    for (int g = 0; g < (two ? 2 : 1); ++g) {
      auto b = make_cuda_backend(g, bo);
      if (b.ok()) forced.push_back(std::move(b).value());
    }
    if (forced.size() != (two ? 2u : 1u)) {
      report(false, std::string("decode-only H=128 bf16 out: backends with MLA kernel ") + tag, "make_cuda_backend failed");
      continue;
    }
    auto got = replay_case(std::vector<Backend*>{forced[0].get(), forced[two ? 1 : 0].get()}, c, o);
    const std::string name = std::string("decode-only H=128 bf16 out (bf16 partials") +
                             (tag[0] != 0 ? ", MLA kernel " + std::string(tag) : std::string()) + "): D2 sharded" +
                             (two ? " (NCCL)" : " on one GPU");
    if (!want.ok() || !got.ok()) {
      report(false, name, (want.ok() ? got : want).status().to_string());
    } else {
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 1e-2 && cc.lse_abs < 2e-2, name + " vs one GPU", describe(cc));
    }
  }
  // Decode batches past one wave of the GPU, at H=128 with bf16 out (bf16 partials):
  //   100 rows: the merged attention's grid (200 CTAs of one an SM) cannot all be resident at once; its partials
  //     fit the 16 MiB window, so both exchanges are row-synced;
  //   160 rows: the top-k's grid (one CTA of a row an SM, merging its row once the peer's came) cannot all be
  //     resident; the partials leave the window (the candidates alone go row by row). Every third row's indexer
  //     weights are 0, so all its scores tie at 0 on both GPUs and the merge must keep the lowest global positions.
  // The kernels that wait for the peer's rows then run beside CTAs not yet started on either GPU: the rows must
  // still arrive (token-major grids: a CTA signals its row before it waits, and never waits for a row whose
  // producer comes after it in its own grid).
  for (const int rows : {100, 160}) {
    if (num_gpus < 2) break;
    CaseGenSpec spec;
    spec.dims = CaseDims{128, 512, 64, 64, 128};
    spec.topk = 512;
    spec.scale = 0.0723f;
    spec.dtype = DType::kBF16;
    spec.seed = seed * 31 + 3 + static_cast<uint64_t>(rows);
    for (int i = 0; i < rows; ++i) {
      spec.requests.push_back({1, 600 + static_cast<int32_t>(counter_hash(spec.seed, 5, i) % 5000)});
    }
    auto c = case_generate(spec);
    if (c.ok() && rows == 160) {
      const int64_t Hi = c->idx_w.shape()[1];
      for (int64_t t = 0; t < rows; t += 3) {
        for (int64_t h = 0; h < Hi; ++h) c->idx_w.set_f32(t * Hi + h, 0.f);
      }
    }
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kBF16;
    auto want = c.ok() ? replay_case(*gpus[0], *c, one) : Result<StepResult>(c.status());
    ReplayOptions o = one;
    o.layout = make_layout(1, 2);
    const auto t0 = Clock::now();
    const std::string name = "decode-only H=128, " + std::to_string(rows) + " rows (grids past one wave" +
                             (rows == 160 ? ", every third row's scores all tied" : "") +
                             "): D2 sharded (NCCL, window rows)";
    if (!want.ok()) {
      report(false, name, want.status().to_string());
    } else if (auto got = replay_case(std::vector<Backend*>{gpus[0].get(), gpus[1].get()}, *c, o); !got.ok()) {
      report(false, name, got.status().to_string());
    } else {
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 1e-2 && cc.lse_abs < 2e-2, name + " vs one GPU",
             describe(cc) + " (" + std::to_string(seconds_since(t0)) + " s)");
    }
  }
  // Two different backends on one GPU cannot be NCCL ranks: refused with the reason, not hung.
  {
    CaseFile c = make_case(seed + 5, 64, false);
    ReplayOptions o;
    o.layout = make_layout(2, 1);
    auto second = make_cuda_backend(0);
    auto got = replay_case(std::vector<Backend*>{gpus[0].get(), second->get()}, c, o);
    report(!got.ok() && got.status().message().find("both on CUDA device 0") != std::string::npos,
           "two backends on one GPU are refused", got.ok() ? "ran" : got.status().to_string());
  }
}

// Layouts whose ranks hold fewer than 16 heads (H / D < 16: what tensor parallelism leaves a GPU, split again by
// DCP): attention runs them in a 16-head group with the missing rows masked, and the DCP step's partials merged
// inside attention (64 heads a rank only) fall back to the step's other path. Each layout is checked against one
// GPU, and one GPU against the CPU oracle; ranks share GPU 0 unless there are GPUs enough for NCCL.
void test_small_head_layouts(uint64_t seed, int num_gpus) {
  auto cpu = make_cpu_backend(0);
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < std::min(num_gpus, 8); ++g) gpus.push_back(std::move(make_cuda_backend(g)).value());
  struct Variant {
    int32_t H;
    bool decode_only;
  };
  const Layout layouts[] = {
      {"D2 sharded", make_layout(1, 2), true},
      {"D2 replicated", make_layout(1, 2, IndexerMode::kReplicated), true},
      {"D4 sharded", make_layout(1, 4), true},
      {"D8 sharded", make_layout(1, 8), true},
      {"D2 DSA-CP", make_layout(1, 2, IndexerMode::kSharded, 0, true), true},
      {"D4 DSA-CP", make_layout(1, 4, IndexerMode::kSharded, 3, true), true},
      {"P2xD2", make_layout(2, 2), true},
      {"P2xD4", make_layout(2, 4), true},
      {"D2 sharded (NCCL)", make_layout(1, 2), false},
  };
  for (const Variant v : {Variant{16, false}, Variant{16, true}, Variant{8, false}}) {
    const uint64_t s = seed * 37 + static_cast<uint64_t>(v.H) + (v.decode_only ? 1 : 0);
    const CaseFile c = make_case(s, v.H, v.decode_only);
    const std::string tag = std::string(v.decode_only ? "decode-only" : "mixed") + " H=" + std::to_string(v.H) +
                            " seed " + std::to_string(s) + ": ";
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kF32;
    Result<StepResult> oracle = internal_error("the CPU oracle did not run");
    auto want = one_gpu_reference(*gpus[0], *cpu, c, one, 1e-2, tag, &oracle);
    if (!want.ok()) continue;
    for (const Layout& l : layouts) {
      if (l.layout.dsa_cp && !v.decode_only) continue;  // DSA-CP: the decode-only batch
      if (v.H / l.layout.D < 1) continue;
      if (!l.one_gpu && (num_gpus < l.layout.num_ranks() || !nccl_available())) continue;
      ReplayOptions o = one;
      o.layout = l.layout;
      std::vector<Backend*> ranks;
      for (int32_t cr = 0; cr < l.layout.num_ranks(); ++cr) ranks.push_back(gpus[l.one_gpu ? 0 : cr].get());
      const std::string name = tag + l.name + " (" + std::to_string(v.H / l.layout.D) + " heads a DCP rank" +
                               (l.one_gpu ? ", on one GPU)" : ")");
      auto got = replay_case(ranks, c, o);
      if (!got.ok()) {
        report(false, name, got.status().to_string());
        continue;
      }
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 5e-3 && cc.lse_abs < 2e-2, name + " vs one GPU", describe(cc));
      if (l.layout.D == 2 && !l.layout.dsa_cp && oracle.ok()) {
        const Compare co = compare(*got, *oracle);
        report(co.topk_same && co.out_rel < 1e-2, name + " vs CPU oracle", describe(co));
      }
    }
  }
}

// Communicator churn: `cycles` NCCL clusters made, used for one step and released, one after the other (what
// the layout tests do between layouts, where a heap corruption inside ncclCommDestroy showed about one run in
// five). Alternates D2 and P2 layouts on a small decode batch; every step is checked against one GPU.
void test_churn(uint64_t seed, int cycles) {
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int g = 0; g < 2; ++g) gpus.push_back(std::move(make_cuda_backend(g)).value());
  const CaseFile c = make_case(seed, 64, true);
  ReplayOptions one;
  one.page_size = 64;
  auto want = replay_case(*gpus[0], c, one);
  if (!want.ok()) return report(false, "churn: one GPU", want.status().to_string());
  int good = 0;
  const auto t0 = Clock::now();
  for (int i = 0; i < cycles; ++i) {
    ReplayOptions o = one;
    o.layout = i % 2 == 0 ? make_layout(1, 2) : make_layout(2, 1);
    auto got = replay_case(std::vector<Backend*>{gpus[0].get(), gpus[1].get()}, c, o);
    if (got.ok() && compare(*got, *want).topk_same) ++good;
  }
  report(good == cycles, "churn: " + std::to_string(cycles) + " NCCL clusters made, used and released",
         std::to_string(good) + " matched one GPU, " + std::to_string(seconds_since(t0) / std::max(cycles, 1)) +
             " s per cycle");
}


// Every CP layout with FP8 KV (the fp8_ds_mla latent cache: the case's context latent quantized on load, the new
// tokens' by the step's cache write; the gathered views and the KV exchanges move the 656-byte records), every
// rank on GPU 0, against one GPU over the same records: top-k identical, out within the bf16 bound. One GPU is
// also compared with the CPU oracle over the same records.
void test_fp8_kv_layouts(uint64_t seed) {
  auto cpu = make_cpu_backend(0);
  auto gpu = make_cuda_backend(0);
  if (!gpu.ok()) {
    report(false, "FP8 KV layouts: backend", gpu.status().to_string());
    return;
  }
  const Layout layouts[] = {
      {"P2 on one GPU", make_layout(2, 1), true},
      {"D2 sharded on one GPU", make_layout(1, 2), true},
      {"D2 replicated on one GPU", make_layout(1, 2, IndexerMode::kReplicated), true},
      {"P2 gathered decodes on one GPU", make_layout(2, 1, IndexerMode::kSharded, 0, false, DecodeMode::kGathered),
       true},
      {"P2xD2 on one GPU", make_layout(2, 2), true},
      {"P4 on one GPU", make_layout(4, 1), true},
      {"D4 DSA-CP on one GPU", make_layout(1, 4, IndexerMode::kSharded, 3, true), true},
  };
  for (int variant = 0; variant < 2; ++variant) {
    const bool decode_only = variant == 1;
    const int32_t H = decode_only ? 128 : 64;
    const uint64_t s = seed * 37 + 11 + variant;
    const CaseFile c = make_case(s, H, decode_only);
    const std::string tag = std::string("FP8 KV ") + (decode_only ? "decode-only" : "mixed") + " H=" +
                            std::to_string(H) + " seed " + std::to_string(s) + ": ";
    ReplayOptions one;
    one.page_size = 64;
    one.out_dtype = DType::kF32;
    one.latent_fp8 = true;
    auto want = one_gpu_reference(**gpu, *cpu, c, one, 1.5e-2, tag);
    if (!want.ok()) continue;
    for (const Layout& l : layouts) {
      if (l.layout.dsa_cp != decode_only && l.layout.dsa_cp) continue;
      ReplayOptions o = one;
      o.layout = l.layout;
      std::vector<Backend*> ranks(static_cast<size_t>(l.layout.num_ranks()), gpu->get());
      const auto t0 = Clock::now();
      auto got = replay_case(ranks, c, o);
      if (!got.ok()) {
        report(false, tag + l.name, got.status().to_string());
        continue;
      }
      const Compare cc = compare(*got, *want);
      report(cc.topk_same && cc.out_rel < 5e-3 && cc.lse_abs < 2e-2, tag + l.name + " vs one GPU",
             describe(cc) + " (" + std::to_string(seconds_since(t0)) + " s)");
    }
  }
}

int gpu_count() {
  auto count = cuda_device_count();
  return count.ok() ? *count : 0;
}

class CpLayouts : public GpuTest {
 protected:
  uint64_t seed() const { return gpu_test_options().seed; }
};

TEST_F(CpLayouts, AllLayouts) { test_layouts(seed(), gpu_count()); }
TEST_F(CpLayouts, SmallHeads) { test_small_head_layouts(seed(), gpu_count()); }
TEST_F(CpLayouts, Fp8Kv) { test_fp8_kv_layouts(seed()); }

// --churn N: N NCCL clusters made, used and released (skipped without it, or without two GPUs and NCCL).
class CpChurn : public GpuTest {};

TEST_F(CpChurn, Cycles) {
  if (gpu_test_options().churn <= 0) GTEST_SKIP() << "runs with --churn N";
  if (gpu_count() < 2 || !nccl_available()) GTEST_SKIP() << "needs 2 GPUs and NCCL";
  test_churn(gpu_test_options().seed, gpu_test_options().churn);
}

}  // namespace
}  // namespace dsacp::testing
