// GPU benchmarks of the CUDA kernels on the shapes (sparse MLA decode/prefill, indexer + top-k
// prefill/decode). CUDA events around the launches only (plans, uploads and the backend's error check are
// outside), warm-up, L2 flushed (256 MiB memset) before every timed run, median of the runs. Inputs are random
// bf16 (a 64 MiB random block tiled over each buffer), never zeros. Writes JSON (--json FILE) and prints a table.
// Usage: dsacp_bench_gpu [--json FILE] [--reps N] [--only NAME] [--trace]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dsacp/dtype.h"
#include "dsacp/random.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "bench_gpu_common.h"
#include "bench_layer_stack.h"
#include "gather_ceiling.h"

using namespace dsacp;
using namespace dsacp::bench::gpu;


int main(int argc, char** argv) {
  const char* json = nullptr;
  int reps = 20;
  std::string only;
  bool trace = false;  // --trace: the layers61 b = 64 backend's per-call host times on stderr
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json = argv[++i];
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    if (std::strcmp(argv[i], "--trace") == 0) trace = true;
  }
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  CK(cudaStreamCreate(&g_ctx.stream));
  g_ctx.num_sms = prop.multiProcessorCount;
  int32_t* err = nullptr;
  CK(cudaMalloc(&err, 8));
  CK(cudaMemset(err, 0, 8));
  g_ctx.error.word = err;
  CK(cudaMalloc(&g_flush, kFlushBytes));
  auto want = [&](const char* n) { return only.empty() || std::string(n).find(only) != std::string::npos; };

  if (want("sparse_decode")) {
    bench_sparse_mla("sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps);
    bench_sparse_mla("sparse_decode b=64 ctx32K h=64", 64, 64, 32768, 64, reps);
    bench_sparse_mla("sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps);
    // the head counts a tensor-parallel GPU holds (a 16 / 32-head group, its missing rows masked)
    for (int h : {32, 8, 4, 2, 1}) {
      bench_sparse_mla("sparse_decode b=64 ctx32K h=" + std::to_string(h), 64, h, 32768, 64, reps);
    }
    bench_sparse_mla("sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, reps);
    // over vLLM's combined [pages, 64, 576] bf16 KV (ExternalPools::kv): latent and rope of a key in one row
    for (int h : {128, 64, 16}) {
      bench_sparse_mla("sparse_decode b=64 ctx32K h=" + std::to_string(h) + " combined kv", 64, h, 32768, 64, reps, 0,
                       2048, false, "", true);
    }
  }
  if (want("fp8_ds_mla")) {  // the FP8 latent cache (issue 26's targets; FlashMLA FP8 from perf-anchors.md)
    bench_sparse_mla("fp8_ds_mla sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps, 0, 2048, true,
                     "target<=0.028 FlashMLA-fp8=0.079(padded)");
    bench_sparse_mla("fp8_ds_mla sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps, 0, 2048, true,
                     "target<=0.065 FlashMLA-fp8=0.098");
    bench_sparse_mla("fp8_ds_mla sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, reps, 0, 2048, true,
                     "target<=0.125 FlashMLA-fp8=0.187");
    bench_sparse_mla("fp8_ds_mla sparse_decode b=64 ctx32K h=64", 64, 64, 32768, 64, reps, 0, 2048, true,
                     "target<=0.045 FlashMLA-fp8=0.079");
    bench_sparse_mla("fp8_ds_mla sparse_prefill T=8192 keys8192 h=128", 8192, 128, 8192, 1, std::max(3, reps / 4),
                     0, 2048, true, "target>=600TFLOP/s");
    // h=128 with each CTA dequantizing every tile itself (the paired dequantization off: the default before it)
    g_ctx.options.mla_fp8_pair_dequant = CudaBackendOptions::Choice::kOff;
    bench_sparse_mla("fp8_ds_mla unpaired sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps, 0, 2048, true,
                     "target<=0.065");
    bench_sparse_mla("fp8_ds_mla unpaired sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, reps, 0, 2048,
                     true, "target<=0.125");
    g_ctx.options.mla_fp8_pair_dequant = CudaBackendOptions::Choice::kAuto;
    // the warp-specialized kernel whose producer dequantizes the records (CudaBackendOptions::MlaKernel::kWgmmaWs32)
    g_ctx.options.mla_kernel = CudaBackendOptions::MlaKernel::kWgmmaWs32;
    bench_sparse_mla("fp8_ds_mla ws32 sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps, 0, 2048, true,
                     "target<=0.028");
    bench_sparse_mla("fp8_ds_mla ws32 sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps, 0, 2048, true,
                     "target<=0.065");
    bench_sparse_mla("fp8_ds_mla ws32 sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, reps, 0, 2048,
                     true, "target<=0.125");
    bench_sparse_mla("fp8_ds_mla ws32 sparse_decode b=64 ctx32K h=64", 64, 64, 32768, 64, reps, 0, 2048, true,
                     "target<=0.045");
    // the mma.sync kernel dequantizing on its MMA warps (the default for 64-head groups before the ws32 one)
    g_ctx.options.mla_kernel = CudaBackendOptions::MlaKernel::kMmaSync;
    bench_sparse_mla("fp8_ds_mla mma_sync sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps, 0, 2048, true,
                     "target<=0.065");
    bench_sparse_mla("fp8_ds_mla mma_sync sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, reps, 0, 2048,
                     true, "target<=0.125");
    bench_sparse_mla("fp8_ds_mla mma_sync sparse_decode b=64 ctx32K h=64", 64, 64, 32768, 64, reps, 0, 2048, true,
                     "target<=0.045");
    g_ctx.options.mla_kernel = CudaBackendOptions::MlaKernel::kAuto;
  }
  if (!only.empty() && std::string("fp8mla_one b=64 h=128").find(only) != std::string::npos) {
    // one FP8 decode at the size, by the default rule (for compute-sanitizer and ncu: --reps 1); only when
    // asked for by name
    bench_sparse_mla("fp8mla_one sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps, 0, 2048, true);
  }
  // The streaming kernel for 16-head groups (sparse_mla_small_heads.cu) forced on the decodes above, through the
  // merge kernel (its default) and the cluster merge; bf16 pools and fp8_ds_mla records. (The fp8_ds_mla decode
  // rows above run it by default.)
  if (want("sparse_decode small_heads") || want("fp8_ds_mla small_heads")) {
    using MlaKernel = CudaBackendOptions::MlaKernel;
    using Choice = CudaBackendOptions::Choice;
    g_ctx.options.mla_kernel = MlaKernel::kSmallHeads;
    if (want("sparse_decode small_heads")) {
      for (int h : {16, 8, 1}) {
        bench_sparse_mla("small_heads sparse_decode b=64 ctx32K h=" + std::to_string(h), 64, h, 32768, 64, reps);
      }
      bench_sparse_mla("small_heads sparse_decode b=64 ctx32K h=16 MTP2", 128, 16, 32768, 64, reps);
      g_ctx.options.mla_cluster_merge = Choice::kOn;
      bench_sparse_mla("small_heads cluster_merge sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps);
      g_ctx.options.mla_cluster_merge = Choice::kAuto;
      g_ctx.options.mla_splits = 2;
      bench_sparse_mla("small_heads splits=2 sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps);
      g_ctx.options.mla_splits = 0;
      // over vLLM's combined [pages, 64, 576] bf16 KV: one 1152-byte copy a key
      for (int h : {16, 1}) {
        bench_sparse_mla("small_heads sparse_decode b=64 ctx32K h=" + std::to_string(h) + " combined kv", 64, h, 32768,
                         64, reps, 0, 2048, false, "", true);
      }
    }
    if (want("fp8_ds_mla small_heads")) {
      bench_sparse_mla("small_heads fp8_ds_mla sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps, 0, 2048,
                       true, "target<=0.028");
      bench_sparse_mla("small_heads fp8_ds_mla sparse_decode b=64 ctx32K h=1", 64, 1, 32768, 64, reps, 0, 2048, true);
      g_ctx.options.mla_cluster_merge = Choice::kOn;
      bench_sparse_mla("small_heads cluster_merge fp8_ds_mla sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps,
                       0, 2048, true);
      g_ctx.options.mla_cluster_merge = Choice::kAuto;
    }
    g_ctx.options.mla_kernel = MlaKernel::kAuto;
  }
  if (want("gather")) {  // the decodes' byte ceiling: the same rows gathered with no math (KV bytes only)
    for (int c : {4, 8, 16})
      bench_sparse_mla("gather_ceiling b=64 ctx32K ctas/token=" + std::to_string(c), 64, 16, 32768, 64, reps, c);
  }
  if (want("sparse_prefill")) {
    bench_sparse_mla("sparse_prefill T=8192 keys8192 h=128", 8192, 128, 8192, 1, std::max(3, reps / 4));
    bench_sparse_mla("sparse_prefill T=8192 keys8192 h=64", 8192, 64, 8192, 1, std::max(3, reps / 4));
  }
  if (want("merge_kernel")) {  // the split decodes with the other split-K merge than the default's
    g_ctx.options.mla_cluster_merge = CudaBackendOptions::Choice::kOff;
    bench_sparse_mla("merge_kernel sparse_decode b=64 ctx32K h=64", 64, 64, 32768, 64, reps);
    g_ctx.options.mla_cluster_merge = CudaBackendOptions::Choice::kOn;
    bench_sparse_mla("cluster_merge sparse_decode b=64 ctx32K h=16", 64, 16, 32768, 64, reps);
    g_ctx.options.mla_cluster_merge = CudaBackendOptions::Choice::kAuto;
  }
  if (want("splits")) {  // split-K sweep for the decodes (CudaBackendOptions::mla_splits)
    for (const char* sp : {"1", "2", "3", "4", "6"}) {
      g_ctx.options.mla_splits = std::atoi(sp);
      bench_sparse_mla(std::string("splits sparse_decode h=64 splits=") + sp, 64, 64, 32768, 64, reps);
      bench_sparse_mla(std::string("splits sparse_decode h=16 splits=") + sp, 64, 16, 32768, 64, reps);
      bench_sparse_mla(std::string("splits sparse_decode h=128 splits=") + sp, 64, 128, 32768, 64, reps);
      // a DCP rank's share at b=64 (1024 of the 2048 entries its own)
      bench_sparse_mla(std::string("splits sparse_decode h=128 used=1024 splits=") + sp, 64, 128, 32768, 64, reps, 0,
                       1024);
    }
    g_ctx.options.mla_splits = 0;
  }
  if (want("other_kernel")) {  // each 64-head case on the kernels the default does not pick for it
    using MlaKernel = CudaBackendOptions::MlaKernel;
    g_ctx.options.mla_kernel = MlaKernel::kWgmmaWs;
    bench_sparse_mla("other_kernel ws sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps);
    bench_sparse_mla("other_kernel ws sparse_decode b=64 ctx32K h=128 MTP2", 128, 128, 32768, 64, reps);
    g_ctx.options.mla_kernel = MlaKernel::kWgmmaWs32;
    bench_sparse_mla("other_kernel ws32 sparse_prefill T=8192 keys8192 h=128", 8192, 128, 8192, 1,
                     std::max(3, reps / 4));
    g_ctx.options.mla_kernel = MlaKernel::kAuto;
  }
  if (want("mma_sync")) {  // the mma.sync kernel on the 64-head-group cases, for comparison
    g_ctx.options.mla_kernel = CudaBackendOptions::MlaKernel::kMmaSync;
    bench_sparse_mla("mma_sync sparse_decode b=64 ctx32K h=128", 64, 128, 32768, 64, reps);
    bench_sparse_mla("mma_sync sparse_prefill T=8192 keys8192 h=128", 8192, 128, 8192, 1, std::max(3, reps / 4));
    g_ctx.options.mla_kernel = CudaBackendOptions::MlaKernel::kAuto;
  }
  if (want("indexer_prefill")) bench_indexer("indexer_prefill T=8192 causal", 1, 0, 8192, std::max(3, reps / 4));
  if (want("indexer_decode")) {
    bench_indexer("indexer_decode b=64 ctx32K", 64, 32768 - 1, 1, reps);
    bench_indexer("indexer_decode b=64 ctx64K (a DCP rank's half of 128K)", 64, 65536 - 1, 1, reps);
    bench_indexer("indexer_decode b=64 ctx128K", 64, 131072 - 1, 1, reps);
  }
  if (want("indexer_fp8")) {  // the FP8 indexer (e4m3 q + q_scale, FP8 two-plane key pages), Hi = 64 and 32
    for (const int hi : {64, 32}) {
      const std::string h = " Hi=" + std::to_string(hi);
      for (const int64_t ctx : {32768, 65536, 131072}) {
        for (const int nn : {1, 2, 4}) {
          bench_indexer("indexer_fp8 decode b=64 ctx" + std::to_string(ctx / 1024) + "K next_n=" + std::to_string(nn) +
                            h,
                        64, ctx - nn, nn, reps, hi, true);
        }
      }
      bench_indexer("indexer_fp8 prefill T=8192 causal" + h, 1, 0, 8192, std::max(3, reps / 4), hi, true);
    }
  }
  // One FP8 decode row alone (32K, next_n 1, Hi = 64), for a profiler run of the score kernel; only when asked for.
  if (!only.empty() && want("fp8_score_probe")) {
    bench_indexer("fp8_score_probe decode b=64 ctx32K next_n=1 Hi=64", 64, 32768 - 1, 1, reps, 64, true);
  }
  // The FP8 decode row's fixed part (the intercept of time against context): short contexts, with the L2 flush
  // before each rep and without it (then the keys of the 2K / 8K rows stay in L2); only when asked for.
  if (!only.empty() && want("fp8_fixed_probe")) {
    for (const bool flush : {true, false}) {
      g_flush_on = flush;
      for (const int64_t ctx : {2048, 8192, 32768}) {
        bench_indexer("fp8_fixed_probe decode b=64 ctx" + std::to_string(ctx / 1024) + "K next_n=1 Hi=64" +
                          (flush ? "" : " no flush"),
                      64, ctx - 1, 1, reps, 64, true);
      }
    }
    g_flush_on = true;
  }
  // The same for MTP (next_n 4: N = 256 columns a key block).
  if (!only.empty() && want("fp8_mtp4_probe")) {
    bench_indexer("fp8_mtp4_probe decode b=64 ctx32K next_n=4 Hi=64", 64, 32768 - 4, 4, reps, 64, true);
  }
  if (want("indexer_bf16_hi32")) {
    bench_indexer("indexer_bf16_hi32 decode b=64 ctx32K Hi=32", 64, 32768 - 1, 1, reps, 32);
    bench_indexer("indexer_bf16_hi32 decode b=64 ctx128K Hi=32", 64, 131072 - 1, 1, reps, 32);
    bench_indexer("indexer_bf16_hi32 prefill T=8192 causal Hi=32", 1, 0, 8192, std::max(3, reps / 4), 32);
  }
  // the top-k alone on given scores: decode b = 64 at 32K / 64K / 128K, a causal prefill, one 1M row
  for (const int32_t ctx : {32768, 65536, 131072}) {
    const std::string k = std::to_string(ctx / 1024) + "K";
    if (want(("topk_decode" + k).c_str())) {
      bench_topk("topk b=64 ctx" + k + " K=2048", std::vector<int32_t>(64, ctx), 2048, reps, true);
    }
  }
  if (want("topk_prefill")) {
    std::vector<int32_t> causal(8192);
    for (int32_t i = 0; i < 8192; ++i) causal[i] = i + 1;
    bench_topk("topk prefill T=8192 causal K=2048", causal, 2048, reps, true);
  }
  if (want("topk_floor")) {  // rows of no keys: the launch, the prologue and the -1 rows (the kernel's floor)
    bench_topk("topk b=64 ctx0 K=2048 (launch floor)", std::vector<int32_t>(64, 0), 2048, reps, false);
  }
  if (want("topk_1M")) bench_topk("topk b=1 ctx1M K=2048", std::vector<int32_t>(1, 1 << 20), 2048, reps, true);
  if (want("topk_merge")) {  // the DCP decode's candidate merge (2 ranks: 2 x 2048 candidates a row)
    bench_topk_merge("topk_merge 2 parts b=64 K=2048", 2, 64, 2048, reps, false);
    bench_topk_merge("topk_merge 2 parts b=64 K=2048 one buffer each", 2, 64, 2048, reps, true);
    g_ctx.options.topk_merge_general = true;
    bench_topk_merge("topk_merge 2 parts b=64 K=2048 general kernel", 2, 64, 2048, reps, false);
    g_ctx.options.topk_merge_general = false;
    bench_topk_merge("topk_merge 4 parts b=64 K=2048", 4, 64, 2048, reps, false);
  }
  // A forward pass of 61 planned decode layers through the public API, eagerly and as one CUDA graph replay.
  // b = 64 at 32K: 61 caches of 2.95 GB do not fit one H200, so 32 caches serve the 61 layers (l % 32).
  if (want("layers61")) {
    struct Shape {
      const char* name;
      int32_t b, ctx;
      int distinct;
    };
    // (b = 1 at 2K: a layer's kernels take less than its launches, so the replay saves the host's time)
    for (const Shape& sh : {Shape{"layers61 b=64 ctx32K (32 caches)", 64, 32768, 32},
                            Shape{"layers61 b=8 ctx4K (61 caches)", 8, 4096, 61},
                            Shape{"layers61 b=1 ctx2K (61 caches)", 1, 2048, 61}}) {
      const bench::LayerStackTiming t =
          bench::bench_layer_stack(sh.b, sh.ctx, 61, sh.distinct, std::max(5, reps / 2), trace && sh.b == 64);
      char extra[256];
      std::snprintf(extra, sizeof extra,
                    "graph %.3f ms vs eager %.3f ms (%.2fx), host %.1f us a layer eager (an empty launch %.2f us), "
                    "step_plan %.1f us, %s",
                    t.graph_ms, t.eager_ms, t.eager_ms / t.graph_ms, t.host_us_per_layer, t.empty_launch_us, t.plan_us,
                    t.identical ? "identical outputs" : "OUTPUTS DIFFER");
      std::printf("%-58s eager %8.3f ms  graph %8.3f ms  %s\n", sh.name, t.eager_ms, t.graph_ms, extra);
      g_rows.push_back({std::string(sh.name) + " eager", t.eager_ms, 0, 0, extra});
      g_rows.push_back({std::string(sh.name) + " graph", t.graph_ms, 0, 0, extra});
    }
  }
  int32_t herr[2] = {0, 0};
  CK(cudaMemcpy(herr, err, 8, cudaMemcpyDeviceToHost));
  if (herr[0] != 0) std::printf("WARNING: device error word %d at row %d\n", herr[0], herr[1]);

  if (json != nullptr) {
    FILE* f = std::fopen(json, "w");
    if (f != nullptr) {
      std::fprintf(f, "{\"device\": \"%s\", \"peak_tflops\": %.1f, \"peak_tbs\": %.2f, \"cases\": [\n", prop.name,
                   kPeakTflops, kPeakTBs);
      for (size_t i = 0; i < g_rows.size(); ++i) {
        const Row& r = g_rows[i];
        std::fprintf(f,
                     "  {\"name\": \"%s\", \"ms\": %.5f, \"flops\": %.6e, \"bytes\": %.6e, \"tflops\": %.2f, "
                     "\"gbs\": %.1f, \"extra\": \"%s\"}%s\n",
                     r.name.c_str(), r.ms, r.flops, r.bytes, r.flops / (r.ms * 1e-3) / 1e12,
                     r.bytes / (r.ms * 1e-3) / 1e9, r.extra.c_str(), i + 1 < g_rows.size() ? "," : "");
      }
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  }
  return 0;
}
