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
#include "bench_layer_stack.h"
#include "gather_ceiling.h"

using namespace dsacp;
using namespace dsacp::cuda;

namespace {

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

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::vector<uint16_t> g_block;  // 64 MiB of random bf16 in [-1, 1)

void* dev_random_bf16(size_t elems, float amp = 1.f) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(elems * 2, 16)));
  static bool init = false;
  if (!init) {
    g_block.resize(32u << 20);
    for (size_t i = 0; i < g_block.size(); ++i) {
      g_block[i] = f32_to_bf16(static_cast<float>((mix(i) >> 40) * (2.0 / 16777216.0) - 1.0)).bits;
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

void* g_flush = nullptr;
bool g_flush_on = true;  // off only inside the fp8_fixed_probe rows (the L2 flush's cost next to the kernel's)
constexpr size_t kFlushBytes = size_t{256} << 20;

// median ms of `reps` runs, L2 flushed before each (flush = false: not flushed, the inputs and the code warm in L2)
double time_ms(const std::function<void()>& fn, int reps, cudaStream_t stream, bool flush = true) {
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
std::vector<Row> g_rows;

constexpr double kPeakTflops = 762.0;  // measured bf16 8192^3 matmul (perf-anchors.md)
constexpr double kPeakTBs = 4.18;      // measured device-to-device copy

void record(const std::string& name, double ms, double flops, double bytes, const std::string& extra = "") {
  g_rows.push_back({name, ms, flops, bytes, extra});
  const double tf = flops / (ms * 1e-3) / 1e12, gbs = bytes / (ms * 1e-3) / 1e9;
  const double floor_ms = std::max(flops / (kPeakTflops * 1e12), bytes / (kPeakTBs * 1e12)) * 1e3;
  std::printf("%-44s %9.4f ms %8.1f TFLOP/s %8.1f GB/s  floor %.4f ms (%.0f%% of floor speed) %s\n", name.c_str(), ms,
              tf, gbs, floor_ms, 100.0 * floor_ms / ms, extra.c_str());
  std::fflush(stdout);
}

LaunchContext g_ctx;

// ---- sparse MLA --------------------------------------------------------------------------------------------
// gather_ctas > 0: time the gather ceiling (bench/gather_ceiling.cu) on the same pages and entries instead.
// used < 2048: only each row's first `used` entries are keys, the rest -1 (a DCP rank's rows: its own keys of
// the merged top-k, then -1).
// fp8: the keys as one pool of fp8_ds_mla records (656 B a key: e4m3 latent, 4 tile scales, bf16 rope), from
// dev_random_records; `extra` goes into the row (the target and FlashMLA's FP8 time for the shape).
void* dev_random_records(int64_t n);
void bench_sparse_mla(const std::string& name, int64_t T, int H, int64_t keys_per_token, int64_t num_requests,
                      int reps, int gather_ctas = 0, int used = 2048, bool fp8 = false,
                      const std::string& extra = "") {
  const int K = 2048, page = 64, Dl = 512, Dr = 64;
  // request b owns keys_per_token keys; tokens are spread over requests evenly (decode: one token each)
  const int64_t pages_per_req = (keys_per_token + page - 1) / page;
  const int64_t num_pages = pages_per_req * num_requests;
  std::vector<int32_t> bt(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) bt[i] = static_cast<int32_t>(i);
  for (int64_t i = num_pages; i > 1; --i) std::swap(bt[i - 1], bt[mix(7 + i) % i]);  // shuffled pages
  std::vector<int32_t> request(T), key_len(T, static_cast<int32_t>(keys_per_token)), topk(T * K);
  for (int64_t t = 0; t < T; ++t) {
    request[t] = static_cast<int32_t>(t * num_requests / T);
    // K distinct positions: random start, odd stride coprime with a power-of-two-ish length
    int64_t stride = 1 + 2 * static_cast<int64_t>(mix(100 + t) % 1000);
    while (std::__gcd(stride, keys_per_token) != 1) stride += 2;
    int64_t pos = static_cast<int64_t>(mix(200 + t) % keys_per_token);
    for (int i = 0; i < K; ++i) {
      topk[t * K + i] = static_cast<int32_t>(pos);
      pos = (pos + stride) % keys_per_token;
    }
    std::sort(&topk[t * K], &topk[t * K] + K);
    for (int i = used; i < K; ++i) topk[t * K + i] = -1;
  }
  SparseMlaParams p;
  p.rows.num_tokens = T;
  p.rows.request = dev_copy(request);
  p.rows.key_len = dev_copy(key_len);
  p.H = H;
  p.Dl = Dl;
  p.Dr = Dr;
  p.K = K;
  p.scale = 0.0721f;
  p.q_nope = dev_random_bf16(T * H * Dl);
  p.q_rope = dev_random_bf16(T * H * Dr);
  p.q_dtype = DType::kBF16;
  const int32_t rec = fp8_ds_mla_record_bytes(Dl, Dr);
  if (fp8) {
    void* records = dev_random_records(num_pages * page);
    p.latent = {records, DType::kF8E4M3, num_pages, page, Dl, rec};
    p.rope = {records, DType::kBF16, num_pages, page, Dr, rec};
  } else {
    p.latent = {dev_random_bf16(num_pages * page * Dl), DType::kBF16, num_pages, page, Dl};
    p.rope = {dev_random_bf16(num_pages * page * Dr), DType::kBF16, num_pages, page, Dr};
  }
  const double key_bytes = fp8 ? rec : 576 * 2;
  p.block_table = {dev_copy(bt), static_cast<int32_t>(num_requests), static_cast<int32_t>(pages_per_req)};
  p.topk = dev_copy(topk);
  CK(cudaMalloc(&p.out, T * H * Dl * 2));
  p.out_dtype = DType::kBF16;
  CK(cudaMalloc(&p.lse, T * H * 4));
  // gathered KV rows (distinct per request)
  const double kv_rows = std::min<double>(static_cast<double>(T) * used, static_cast<double>(num_requests) * keys_per_token);
  float* ws = nullptr;
  if (gather_ctas > 0) {  // the rows alone, no attention
    uint32_t* sink = nullptr;
    CK(cudaMalloc(&sink, 16));
    const dsacp::bench::GatherCeilingArgs g{p.topk, p.rows.request, p.block_table.data, p.block_table.max_pages,
                                            page, static_cast<const uint16_t*>(p.latent.data),
                                            static_cast<const uint16_t*>(p.rope.data), T, K, sink};
    const double ms = time_ms([&] { CK(dsacp::bench::launch_gather_ceiling(g, gather_ctas, g_ctx.stream)); }, reps,
                              g_ctx.stream);
    record(name, ms, 0, kv_rows * 576 * 2, "ctas/token=" + std::to_string(gather_ctas));
    CK(cudaFree(sink));
  } else {
    // a prefill over records runs as the backend runs it: the pages dequantized into scratch, then the bf16
    // kernels (both timed)
    void* fp8_scratch = nullptr;
    const bool via_bf16 = sparse_mla_fp8_via_bf16(p);
    if (via_bf16) CK(cudaMalloc(&fp8_scratch, static_cast<size_t>(sparse_mla_fp8_scratch_bytes(p))));
    const SparseMlaParams run = via_bf16 ? sparse_mla_fp8_bf16_view(p, fp8_scratch) : p;
    const int splits = sparse_mla_num_splits(run, g_ctx);
    const int64_t wsf = sparse_mla_workspace_floats(run, splits, g_ctx.options);
    if (wsf > 0) CK(cudaMalloc(&ws, wsf * 4));
    const double ms = time_ms(
        [&] {
          if (via_bf16) CS(launch_fp8_records_to_bf16(p, fp8_scratch, g_ctx));
          CS(launch_sparse_mla(run, splits, ws, g_ctx));
        },
        reps, g_ctx.stream);
    if (via_bf16) {
      const double dms = time_ms([&] { CS(launch_fp8_records_to_bf16(p, fp8_scratch, g_ctx)); }, reps, g_ctx.stream);
      std::printf("  of which the dequantization into bf16 pages: %.4f ms\n", dms);
      CK(cudaFree(fp8_scratch));
    }
    const double flops = 2.0 * T * H * used * (576 + 512);
    // unique bytes: the KV rows, q, out (bf16), lse, top-k
    const double bytes = kv_rows * key_bytes + T * H * 576 * 2.0 + T * H * Dl * 2.0 + T * H * 4.0 + T * K * 4.0;
    // (the head group the launch runs: records take 64-head groups from 33 heads on, sparse_mla_shape)
    const bool merged_in_kernel = sparse_mla_cluster_merge(splits, sparse_mla_shape(run, g_ctx.options).head_group,
                                                           g_ctx.options);
    record(name, ms, flops, bytes,
           "splits=" + std::to_string(splits) +
               (splits > 1 ? (merged_in_kernel ? " (cluster merge)" : " (merge kernel)") : "") +
               (extra.empty() ? "" : " " + extra));
    if (splits > 1 && !merged_in_kernel) {  // the split-K combine alone (part of the time above)
      LseMergeParams m;
      m.num_parts = splits;
      m.num_rows = T * H;
      m.Dl = Dl;
      m.part_out = ws;
      m.part_lse = ws + static_cast<int64_t>(splits) * T * H * Dl;
      m.lse = p.lse;
      const double mms = time_ms([&] { CS(launch_lse_merge(m, p.out, p.out_dtype, g_ctx, LseMergeRows{T, H, H})); },
                                 reps, g_ctx.stream);
      std::printf("  of which the split-K combine: %.4f ms\n", mms);
    }
  }
  if (fp8) p.rope.data = nullptr;  // the latent view's pool
  for (void* q : {const_cast<void*>(p.q_nope), const_cast<void*>(p.q_rope), p.latent.data, p.rope.data, p.out,
                  static_cast<void*>(p.lse), static_cast<void*>(ws), static_cast<void*>(const_cast<int32_t*>(p.topk)),
                  static_cast<void*>(const_cast<int32_t*>(p.block_table.data)),
                  static_cast<void*>(const_cast<int32_t*>(p.rows.request)),
                  static_cast<void*>(const_cast<int32_t*>(p.rows.key_len))}) {
    if (q != nullptr) CK(cudaFree(q));
  }
}

// n fp8_ds_mla records: a block of 4096 random ones (latent quantized from values of a few magnitudes per tile
// with the fp32 rule, bf16 rope) tiled over the pool.
void* dev_random_records(int64_t n) {
  const int Dl = 512, Dr = 64, rec = fp8_ds_mla_record_bytes(Dl, Dr);
  const int64_t block_n = 4096;
  std::vector<uint8_t> block(static_cast<size_t>(block_n * rec));
  for (int64_t r = 0; r < block_n; ++r) {
    uint8_t* dst = block.data() + r * rec;
    for (int g = 0; g < Dl / kFp8DsMlaTile; ++g) {
      float x[kFp8DsMlaTile];
      float amax = 0.f;
      const float amp = 0.1f + static_cast<float>(mix(900 + r * 4 + g) % 16);
      for (int i = 0; i < kFp8DsMlaTile; ++i) {
        x[i] = amp * static_cast<float>((mix(1000 + r * Dl + g * 128 + i) >> 40) * (2.0 / 16777216.0) - 1.0);
        amax = std::max(amax, fp8_amax_term(x[i]));
      }
      const float scale = fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32);
      for (int i = 0; i < kFp8DsMlaTile; ++i) dst[g * kFp8DsMlaTile + i] = fp8_quantize(x[i], scale);
      std::memcpy(dst + fp8_ds_mla_scale_offset(Dl) + 4 * g, &scale, 4);
    }
    for (int d = 0; d < Dr; ++d) {
      const uint16_t b =
          f32_to_bf16(static_cast<float>((mix(5000 + r * Dr + d) >> 40) * (2.0 / 16777216.0) - 1.0)).bits;
      std::memcpy(dst + fp8_ds_mla_rope_offset(Dl) + 2 * d, &b, 2);
    }
  }
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(n) * rec;
  CK(cudaMalloc(&p, bytes));
  for (size_t off = 0; off < bytes; off += block.size()) {
    CK(cudaMemcpy(static_cast<char*>(p) + off, block.data(), std::min(block.size(), bytes - off),
                  cudaMemcpyHostToDevice));
  }
  return p;
}

// ---- indexer + top-k ---------------------------------------------------------------------------------------
// Random valid e4m3 values (no NaN) tiled over `bytes`, and, for an FP8 key pool, positive f32 scales in each page's
// scale plane.
void* dev_random_e4m3(size_t bytes, int32_t page_size = 0, int32_t Di = 0) {
  static std::vector<uint8_t> block;
  if (block.empty()) {
    block.resize(32u << 20);
    for (size_t i = 0; i < block.size(); ++i) {
      block[i] = f32_to_e4m3(static_cast<float>((mix(700 + i) >> 40) * (12.0 / 16777216.0) - 6.0));
    }
  }
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  if (page_size == 0) {
    for (size_t at = 0; at < bytes; at += block.size()) {
      CK(cudaMemcpy(static_cast<char*>(p) + at, block.data(), std::min(block.size(), bytes - at), cudaMemcpyHostToDevice));
    }
    return p;
  }
  // whole pages at a time: values from the block, then the scales
  const size_t page_bytes = static_cast<size_t>(fp8_index_page_bytes(page_size, Di));
  const size_t pages_per_tile = std::max<size_t>(1, block.size() / page_bytes);
  std::vector<uint8_t> tile(pages_per_tile * page_bytes);
  for (size_t pg = 0; pg < pages_per_tile; ++pg) {
    std::memcpy(&tile[pg * page_bytes], &block[pg * page_bytes], static_cast<size_t>(page_size) * Di);
    for (int32_t i = 0; i < page_size; ++i) {
      const float sc = 0.01f * (1.f + static_cast<float>((mix(900 + pg * page_size + i) >> 40) / 16777216.0));
      std::memcpy(&tile[pg * page_bytes + static_cast<size_t>(page_size) * Di + i * 4], &sc, 4);
    }
  }
  for (size_t at = 0; at < bytes; at += tile.size()) {
    CK(cudaMemcpy(static_cast<char*>(p) + at, tile.data(), std::min(tile.size(), bytes - at), cudaMemcpyHostToDevice));
  }
  return p;
}

// Indexer + top-k (bf16, or fp8: e4m3 q + q_scale and FP8 two-plane key pages), Hi = 32 or 64; also the scores
// alone and the top-k alone on the scores (the rest of the launch sequence).
void bench_indexer(const std::string& name, int64_t num_requests, int64_t ctx, int64_t qlen, int reps, int Hi = 64,
                   bool fp8 = false) {
  const int K = 2048, page = 64, Di = 128;
  const int64_t total = ctx + qlen;
  const int64_t pages_per_req = (total + page - 1) / page;
  const int64_t num_pages = pages_per_req * num_requests;
  std::vector<int32_t> bt(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) bt[i] = static_cast<int32_t>(i);
  for (int64_t i = num_pages; i > 1; --i) std::swap(bt[i - 1], bt[mix(9 + i) % i]);
  const int64_t T = num_requests * qlen;
  std::vector<int32_t> request(T), key_len(T);
  double visible = 0;
  for (int64_t t = 0; t < T; ++t) {
    request[t] = static_cast<int32_t>(t / qlen);
    key_len[t] = static_cast<int32_t>(ctx + t % qlen + 1);
    visible += key_len[t];
  }
  std::vector<float> w(T * Hi);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((mix(300 + i) >> 40) * (0.25 / 16777216.0) - 0.125);
  IndexerTopkParams p;
  p.rows.num_tokens = T;
  p.rows.request = dev_copy(request);
  p.rows.key_len = dev_copy(key_len);
  p.Hi = Hi;
  p.Di = Di;
  p.K = K;
  p.w = dev_copy(w);
  float* q_scale = nullptr;
  if (fp8) {
    std::vector<float> qs(T * Hi);
    for (size_t i = 0; i < qs.size(); ++i) qs[i] = 0.5f + static_cast<float>((mix(500 + i) >> 40) / 16777216.0);
    q_scale = dev_copy(qs);
    p.q = dev_random_e4m3(T * Hi * Di);
    p.q_dtype = DType::kF8E4M3;
    p.q_scale = q_scale;
    p.keys = {dev_random_e4m3(num_pages * fp8_index_page_bytes(page, Di), page, Di), DType::kF8E4M3, num_pages, page,
              Di};
  } else {
    p.q = dev_random_bf16(T * Hi * Di);
    p.q_dtype = DType::kBF16;
    p.keys = {dev_random_bf16(num_pages * page * Di), DType::kBF16, num_pages, page, Di};
  }
  p.block_table = {dev_copy(bt), static_cast<int32_t>(num_requests), static_cast<int32_t>(pages_per_req)};
  CK(cudaMalloc(&p.topk, T * K * 4));
  auto plan = indexer_plan(p, request.data(), key_len.data());
  CS(plan.status());
  IndexerPlanDevice dev;
  dev.items = dev_copy(indexer_plan_items(*plan));
  dev.score_offset = dev_copy(plan->score_offset);
  CK(cudaMalloc(&dev.scores, std::max<int64_t>(1, plan->max_score_floats) * 4));
  const double ms = time_ms([&] { CS(launch_indexer_topk(p, *plan, dev, g_ctx)); }, reps, g_ctx.stream);
  const double ms_scores = time_ms(
      [&] {
        for (const auto& ch : plan->chunks) {
          CS(launch_indexer_scores(p, dev.items + ch.item_begin, ch.item_end - ch.item_begin, ch.max_group_tokens,
                                   dev.score_offset, dev.scores, dev.inl, g_ctx));
        }
      },
      reps, g_ctx.stream);
  // each score kernel on the same plan, forced (CudaBackendOptions::indexer_score_kernel): the mma.sync kernel
  // always, and the persistent wgmma kernel where it applies
  auto time_scores = [&](CudaBackendOptions::IndexerScoreKernel kernel) {
    LaunchContext ctx = g_ctx;
    ctx.options.indexer_score_kernel = kernel;
    return time_ms(
        [&] {
          for (const auto& ch : plan->chunks) {
            CS(launch_indexer_scores(p, dev.items + ch.item_begin, ch.item_end - ch.item_begin, ch.max_group_tokens,
                                     dev.score_offset, dev.scores, dev.inl, ctx));
          }
        },
        reps, g_ctx.stream);
  };
  const double ms_mma = time_scores(CudaBackendOptions::IndexerScoreKernel::kMmaSync);
  double ms_wgmma = -1, ms_v5 = -1, ms_v6_2wg = -1, ms_v6 = -1, ms_v7_rs = -1, ms_v7_bulk = -1;
  const int max_group = plan->chunks.front().max_group_tokens;
  if (indexer_scores_wgmma_applies(p, max_group)) {
    ms_wgmma = time_scores(CudaBackendOptions::IndexerScoreKernel::kWgmma);  // v7, the default
    ms_v5 = time_scores(CudaBackendOptions::IndexerScoreKernel::kWgmmaV5);
    ms_v6 = time_scores(CudaBackendOptions::IndexerScoreKernel::kWgmmaV6);
    // v7 variants: v6's reduce-scatter epilogue at one token a pass; bulk copies (unswizzled stage) instead of TMA
    auto time_variant = [&](const ScoreWgmmaVariant& v) {
      return time_ms(
          [&] {
            for (const auto& ch : plan->chunks) {
              CS(launch_indexer_scores_wgmma(p, dev.items + ch.item_begin, ch.item_end - ch.item_begin,
                                             ch.max_group_tokens, dev.score_offset, dev.scores, dev.inl, g_ctx, v));
            }
          },
          reps, g_ctx.stream);
    };
    ScoreWgmmaVariant v7rs, v7bulk;
    v7rs.epilogue = 1;
    v7bulk.tma_stage = false;
    ms_v7_rs = time_variant(v7rs);
    ms_v7_bulk = time_variant(v7bulk);
    // v6 with 2 math warpgroups where the rule says 3 (heads x group tokens <= 64)
    const int nt = max_group <= 1 ? 1 : max_group <= 2 ? 2 : 4;
    if (Hi * nt <= 64) {
      const ScoreWgmmaVariant v{6, 2, 0, false};
      ms_v6_2wg = time_ms(
          [&] {
            for (const auto& ch : plan->chunks) {
              CS(launch_indexer_scores_wgmma(p, dev.items + ch.item_begin, ch.item_end - ch.item_begin,
                                             ch.max_group_tokens, dev.score_offset, dev.scores, dev.inl, g_ctx, v));
            }
          },
          reps, g_ctx.stream);
    }
  }
  // the top-k alone on the scores of the last chunk (all of them for one chunk; the scores stay as computed)
  const auto& last = plan->chunks.back();
  const double ms_topk = time_ms(
      [&] { CS(launch_radix_select_topk(p, last.t0, last.t1, last.max_len, dev.score_offset, dev.scores, dev.inl,
                                        g_ctx)); },
      reps, g_ctx.stream);
  const double flops = 2.0 * Hi * Di * visible;
  // unique bytes: visible keys once per request (decode) or the request's keys (prefill), q, w, topk out
  const double key_row = fp8 ? Di + 4.0 : Di * 2.0;
  const double key_bytes = static_cast<double>(num_requests) * total * key_row;
  const double bytes = key_bytes + T * Hi * Di * (fp8 ? 1.0 : 2.0) + T * Hi * (fp8 ? 8.0 : 4.0) + T * K * 4.0;
  char extra[768];
  std::snprintf(extra, sizeof extra, "scores only %.4f ms, top-k alone %.4f ms (last chunk), chunks=%zu", ms_scores,
                ms_topk, plan->chunks.size());
  if (fp8) {
    const size_t n = std::strlen(extra);
    std::snprintf(extra + n, sizeof extra - n, ", mma.sync scores kernel %.4f ms", ms_mma);
  }
  if (ms_wgmma >= 0) {
    const size_t n = std::strlen(extra);
    std::snprintf(extra + n, sizeof extra - n,
                  ", wgmma scores kernel %.4f ms, v5 scores kernel %.4f ms, v6 scores kernel %.4f ms, v7 reduce-scatter "
                  "epilogue %.4f ms, v7 bulk-copy stage %.4f ms",
                  ms_wgmma, ms_v5, ms_v6, ms_v7_rs, ms_v7_bulk);
  }
  if (ms_v6_2wg >= 0) {
    const size_t n = std::strlen(extra);
    std::snprintf(extra + n, sizeof extra - n, ", v6 2-warpgroup scores kernel %.4f ms", ms_v6_2wg);
  }
  record(name, ms, flops, bytes, extra);
  if (q_scale != nullptr) CK(cudaFree(q_scale));
  for (void* q : {const_cast<void*>(p.q), p.keys.data, static_cast<void*>(p.topk), static_cast<void*>(dev.scores),
                  static_cast<void*>(const_cast<float*>(p.w)),
                  static_cast<void*>(const_cast<ScoreItem*>(dev.items)),
                  static_cast<void*>(const_cast<int64_t*>(dev.score_offset)),
                  static_cast<void*>(const_cast<int32_t*>(p.block_table.data)),
                  static_cast<void*>(const_cast<int32_t*>(p.rows.request)),
                  static_cast<void*>(const_cast<int32_t*>(p.rows.key_len))}) {
    if (q != nullptr) CK(cudaFree(q));
  }
}

// ---- the top-k alone on given scores -------------------------------------------------------------------------
// Rows of normal scores (an indexer score is a sum of many weighted ReLU terms: close to normal), laid out as the
// indexer's score buffer, K = 2048; the default form, then the one-CTA kernel, the cluster kernel's sizes and
// cache modes, and the register form on the same scores. Bytes: the scores once, the rows out.
void bench_topk(const std::string& name, const std::vector<int32_t>& lens, int K, int reps, bool variants) {
  const int64_t rows = static_cast<int64_t>(lens.size());
  std::vector<int64_t> offset(rows);
  int64_t total = 0;
  int32_t max_len = 0;
  for (int64_t r = 0; r < rows; ++r) {
    offset[r] = total;
    total += (int64_t{lens[r]} + 3) / 4 * 4;
    max_len = std::max(max_len, lens[r]);
  }
  std::vector<float> sc(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    const double u1 = (static_cast<double>(dsacp::counter_hash(11, 0, i) >> 11) + 1.0) / 9007199254740993.0;
    const double u2 = static_cast<double>(dsacp::counter_hash(11, 1, i) >> 11) / 9007199254740992.0;
    sc[i] = static_cast<float>(1.5 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  float* d_scores = dev_copy(sc);
  int64_t* d_offset = dev_copy(offset);
  IndexerTopkParams p;
  p.rows.num_tokens = rows;
  p.rows.key_len = dev_copy(lens);
  p.K = K;
  CK(cudaMalloc(&p.topk, rows * K * 4));
  static InlinePlan inl;  // num_groups 0: the device score offsets
  const double bytes = total * 4.0 + rows * K * 4.0;
  record(name + " [default]", time_ms([&] { CS(launch_radix_select_topk(p, 0, rows, max_len, d_offset, d_scores, inl,
                                                                        g_ctx)); },
                                      reps, g_ctx.stream),
         0, bytes);
  // the same, L2 not flushed: what the kernel takes when its scores (and its code) are still in L2
  record(name + " [default, L2 warm]",
         time_ms([&] { CS(launch_radix_select_topk(p, 0, rows, max_len, d_offset, d_scores, inl, g_ctx)); }, reps,
                 g_ctx.stream, false),
         0, bytes);
  if (variants) {
    struct V {
      std::string tag;
      TopkLaunchOptions o;
    };
    std::vector<V> vs;
    TopkLaunchOptions one;
    one.one_cta = true;
    vs.push_back({"one-CTA 1024 threads", one});
    for (int c : {1, 2, 4, 8}) {
      for (int cache : {-1, 0, 1}) {
        TopkLaunchOptions o;
        o.form = dsacp::cuda::TopkForm::kCluster;
        o.cluster = c;
        o.cache = cache;
        vs.push_back({"C=" + std::to_string(c) + (cache < 0 ? " cache auto" : cache ? " cached" : " uncached"), o});
      }
    }
    for (int c : {0, 1, 2, 4, 8}) {  // the register form (register_topk.cu), its cluster chosen (0) or given
      TopkLaunchOptions o;
      o.form = dsacp::cuda::TopkForm::kRegister;
      o.cluster = c;
      vs.push_back({c == 0 ? std::string("register") : "register C=" + std::to_string(c), o});
    }
    // the filter form (filter_topk.cu): its threads and cluster chosen (0) or given
    for (const auto& [th, c] : std::vector<std::pair<int, int>>{{0, 0}, {1024, 1}, {1024, 2}, {1024, 4}, {1024, 8},
                                                                {512, 2}, {512, 4}, {512, 8}, {256, 1}, {256, 4},
                                                                {256, 8}}) {
      TopkLaunchOptions o;
      o.form = dsacp::cuda::TopkForm::kFilter;
      o.threads = th;
      o.cluster = c;
      if (c > 0 && !dsacp::cuda::filter_topk_fits(max_len, c, th)) continue;  // refused: slices too long
      vs.push_back({th == 0 ? std::string("filter")
                            : "filter T=" + std::to_string(th) + " C=" + std::to_string(c),
                    o});
    }
    for (const V& v : vs) {
      record(name + " [" + v.tag + "]", time_ms([&] { CS(launch_topk_rows(p, 0, rows, max_len, d_offset, d_scores, inl,
                                                                          g_ctx, v.o)); },
                                                reps, g_ctx.stream),
             0, bytes);
    }
  }
  for (void* q : {static_cast<void*>(d_scores), static_cast<void*>(d_offset), static_cast<void*>(p.topk),
                  static_cast<void*>(const_cast<int32_t*>(p.rows.key_len))}) {
    CK(cudaFree(q));
  }
}

// ---- the DCP decode's candidate merge -------------------------------------------------------------------------
// `parts` ranks' local top-K rows of a b=64 decode (ascending local positions, scores from one distribution, so
// the parts' candidates interleave as real ones do), merged exactly; with per_part, every part in its own buffer
// (the window exchange's layout).
void bench_topk_merge(const std::string& name, int parts, int64_t rows, int K, int reps, bool per_part) {
  const size_t per = static_cast<size_t>(rows) * K;
  std::vector<int32_t> topk(parts * per);
  std::vector<float> scores(parts * per);
  for (int s = 0; s < parts; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int i = 0; i < K; ++i) {
        const size_t at = s * per + r * K + i;
        topk[at] = 7 * i + static_cast<int32_t>(dsacp::counter_hash(5, s, at) % 7);
        scores[at] = 2.f + static_cast<float>(dsacp::counter_hash(6, s, at) % 100000) * 1e-5f;
      }
    }
  }
  int32_t* d_topk = dev_copy(topk);
  float* d_scores = dev_copy(scores);
  int32_t* d_out = dev_copy(std::vector<int32_t>(per));
  int32_t* d_local = dev_copy(std::vector<int32_t>(per));
  TopkMergeParams p;
  p.num_parts = parts;
  p.num_rows = rows;
  p.K = K;
  p.I = 64;
  p.topk = d_out;
  p.local_topk = d_local;
  if (per_part) {
    for (int s = 0; s < parts; ++s) {
      p.part_topk_of[s] = d_topk + s * per;
      p.part_scores_of[s] = d_scores + s * per;
    }
  } else {
    p.part_topk = d_topk;
    p.part_scores = d_scores;
  }
  const double ms = time_ms([&] { CS(launch_topk_merge(p, g_ctx)); }, reps, g_ctx.stream);
  record(name, ms, 0, parts * per * 8.0 + per * 8.0);
  for (void* q : {static_cast<void*>(d_topk), static_cast<void*>(d_scores), static_cast<void*>(d_out),
                  static_cast<void*>(d_local)}) {
    CK(cudaFree(q));
  }
}

}  // namespace

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
                    "graph %.3f ms vs eager %.3f ms (%.2fx), host %.1f us a layer eager, step_plan %.1f us, %s",
                    t.graph_ms, t.eager_ms, t.eager_ms / t.graph_ms, t.host_us_per_layer, t.plan_us,
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
