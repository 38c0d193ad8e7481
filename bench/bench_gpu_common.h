// dsacp_bench_gpu's shared pieces (bench_gpu.cc, bench_gpu_mla.cc, bench_gpu_indexer.cc): exits on CUDA
// errors, random device inputs, the timer (L2 flushed before every timed run), the result rows, and the
// benchmark families' entry points.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dsacp/dtype.h"
#include "dsacp/random.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::bench::gpu {

using namespace dsacp::cuda;

#define CK(x)                                                                                     \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s failed: %s at %s:%d\n", #x, cudaGetErrorName(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
#define CS(x)                                                              \
  do {                                                                     \
    Status s_ = (x);                                                       \
    if (!s_.ok()) {                                                        \
      std::fprintf(stderr, "%s failed: %s\n", #x, s_.to_string().c_str()); \
      std::exit(2);                                                        \
    }                                                                      \
  } while (0)

inline std::vector<uint16_t> g_block;  // 64 MiB of random bf16 in [-1, 1)

inline void* dev_random_bf16(size_t elems, float amp = 1.f) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(elems * 2, 16)));
  static bool init = false;
  if (!init) {
    g_block.resize(32u << 20);
    for (size_t i = 0; i < g_block.size(); ++i) {
      g_block[i] = f32_to_bf16(static_cast<float>((splitmix64(i) >> 40) * (2.0 / 16777216.0) - 1.0)).bits;
    }
    init = true;
  }
  std::vector<uint16_t> scaled;
  const std::vector<uint16_t>* src = &g_block;
  if (amp != 1.f) {
    scaled.resize(g_block.size());
    for (size_t i = 0; i < g_block.size(); ++i) scaled[i] = f32_to_bf16(amp * bf16_to_f32(bf16{g_block[i]})).bits;
    src = &scaled;
  }
  for (size_t off = 0; off < elems; off += src->size()) {
    const size_t n = std::min(src->size(), elems - off);
    CK(cudaMemcpy(static_cast<uint16_t*>(p) + off, src->data(), n * 2, cudaMemcpyHostToDevice));
  }
  return p;
}
template <typename T>
T* dev_copy(const std::vector<T>& v) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(v.size() * sizeof(T), 16)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(p);
}

inline void* g_flush = nullptr;
inline bool g_flush_on = true;  // off only inside the fp8_fixed_probe rows (the L2 flush's cost next to the kernel's)
constexpr size_t kFlushBytes = size_t{256} << 20;

// median ms of `reps` runs, L2 flushed before each (flush = false: not flushed, the inputs and the code warm in L2)
inline double time_ms(const std::function<void()>& fn, int reps, cudaStream_t stream, bool flush = true) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaStreamSynchronize(stream));
  std::vector<double> v;
  for (int i = 0; i < reps; ++i) {
    if (flush && g_flush_on) CK(cudaMemsetAsync(g_flush, i & 0xff, kFlushBytes, stream));
    CK(cudaEventRecord(a, stream));
    fn();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    v.push_back(ms);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  std::string name;
  double ms, flops, bytes;
  std::string extra;
};
inline std::vector<Row> g_rows;

constexpr double kPeakTflops = 762.0;  // measured bf16 8192^3 matmul (perf-anchors.md)
constexpr double kPeakTBs = 4.18;      // measured device-to-device copy

inline void record(const std::string& name, double ms, double flops, double bytes, const std::string& extra = "") {
  g_rows.push_back({name, ms, flops, bytes, extra});
  const double tf = flops / (ms * 1e-3) / 1e12, gbs = bytes / (ms * 1e-3) / 1e9;
  const double floor_ms = std::max(flops / (kPeakTflops * 1e12), bytes / (kPeakTBs * 1e12)) * 1e3;
  std::printf("%-44s %9.4f ms %8.1f TFLOP/s %8.1f GB/s  floor %.4f ms (%.0f%% of floor speed) %s\n", name.c_str(), ms,
              tf, gbs, floor_ms, 100.0 * floor_ms / ms, extra.c_str());
  std::fflush(stdout);
}

inline LaunchContext g_ctx;

// ---- the families (bench_gpu_mla.cc, bench_gpu_indexer.cc) ----
// Sparse MLA over T tokens of num_requests requests with keys_per_token keys each (decode: a token a request).
// gather_ctas > 0: the gather ceiling (bench/gather_ceiling.cu) on the same pages and entries instead; used < 2048:
// each row's first `used` entries are keys, the rest -1 (a DCP rank's rows); fp8: fp8_ds_mla records; `extra`
// goes into the row.
// combined_kv: bf16 latent and rope in one [pages, 64, 576] buffer (vLLM's layout: row_stride 576).
void bench_sparse_mla(const std::string& name, int64_t T, int H, int64_t keys_per_token, int64_t num_requests,
                      int reps, int gather_ctas = 0, int used = 2048, bool fp8 = false, const std::string& extra = "",
                      bool combined_kv = false);
// Indexer + top-k (bf16, or fp8: e4m3 q + q_scale and FP8 two-plane key pages), and its parts alone.
void bench_indexer(const std::string& name, int64_t num_requests, int64_t ctx, int64_t qlen, int reps, int Hi = 64,
                   bool fp8 = false);
// The exact top-k alone on given scores (rows of `lens` keys), K; variants: the non-default forms too.
void bench_topk(const std::string& name, const std::vector<int32_t>& lens, int K, int reps, bool variants);
// The DCP decode's exact candidate merge of `parts` ranks' top-K rows.
void bench_topk_merge(const std::string& name, int parts, int64_t rows, int K, int reps, bool per_part);

}  // namespace dsacp::bench::gpu
