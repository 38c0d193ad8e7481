// dsacp_bench_gpu: the sparse MLA cases (decode, MTP, prefill, fp8_ds_mla records, the gather ceiling).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bench_gpu_common.h"
#include "dsacp/fp8.h"
#include "gather_ceiling.h"

namespace dsacp::bench::gpu {
namespace {

// ---- sparse MLA --------------------------------------------------------------------------------------------
// gather_ctas > 0: time the gather ceiling (bench/gather_ceiling.cu) on the same pages and entries instead.
// used < 2048: only each row's first `used` entries are keys, the rest -1 (a DCP rank's rows: its own keys of
// the merged top-k, then -1).
// fp8: the keys as one pool of fp8_ds_mla records (656 B a key: e4m3 latent, 4 tile scales, bf16 rope), from
// dev_random_records; `extra` goes into the row (the target and FlashMLA's FP8 time for the shape).
void* dev_random_records(int64_t n);

}  // namespace

void bench_sparse_mla(const std::string& name, int64_t T, int H, int64_t keys_per_token, int64_t num_requests,
                      int reps, int gather_ctas, int used, bool fp8, const std::string& extra, bool combined_kv) {
  const int K = 2048, page = 64, Dl = 512, Dr = 64;
  // request b owns keys_per_token keys; tokens are spread over requests evenly (decode: one token each)
  const int64_t pages_per_req = (keys_per_token + page - 1) / page;
  const int64_t num_pages = pages_per_req * num_requests;
  std::vector<int32_t> bt(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) bt[i] = static_cast<int32_t>(i);
  for (int64_t i = num_pages; i > 1; --i) std::swap(bt[i - 1], bt[splitmix64(7 + i) % i]);  // shuffled pages
  std::vector<int32_t> request(T), key_len(T, static_cast<int32_t>(keys_per_token)), topk(T * K);
  for (int64_t t = 0; t < T; ++t) {
    request[t] = static_cast<int32_t>(t * num_requests / T);
    // K distinct positions: random start, odd stride coprime with a power-of-two-ish length
    int64_t stride = 1 + 2 * static_cast<int64_t>(splitmix64(100 + t) % 1000);
    while (std::__gcd(stride, keys_per_token) != 1) stride += 2;
    int64_t pos = static_cast<int64_t>(splitmix64(200 + t) % keys_per_token);
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
  } else if (combined_kv) {
    auto* kv = static_cast<uint16_t*>(dev_random_bf16(num_pages * page * (Dl + Dr)));
    p.latent = {kv, DType::kBF16, num_pages, page, Dl, 0, Dl + Dr};
    p.rope = {kv + Dl, DType::kBF16, num_pages, page, Dr, 0, Dl + Dr};
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
  if (fp8 || combined_kv) p.rope.data = nullptr;  // the latent view's pool (records, or the combined rows)
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
namespace {

void* dev_random_records(int64_t n) {
  const int Dl = 512, Dr = 64, rec = fp8_ds_mla_record_bytes(Dl, Dr);
  const int64_t block_n = 4096;
  std::vector<uint8_t> block(static_cast<size_t>(block_n * rec));
  for (int64_t r = 0; r < block_n; ++r) {
    uint8_t* dst = block.data() + r * rec;
    for (int g = 0; g < Dl / kFp8DsMlaTile; ++g) {
      float x[kFp8DsMlaTile];
      float amax = 0.f;
      const float amp = 0.1f + static_cast<float>(splitmix64(900 + r * 4 + g) % 16);
      for (int i = 0; i < kFp8DsMlaTile; ++i) {
        x[i] = amp * static_cast<float>((splitmix64(1000 + r * Dl + g * 128 + i) >> 40) * (2.0 / 16777216.0) - 1.0);
        amax = std::max(amax, fp8_amax_term(x[i]));
      }
      const float scale = fp8_scale_from_amax(amax, Fp8ScaleMode::kFp32);
      for (int i = 0; i < kFp8DsMlaTile; ++i) dst[g * kFp8DsMlaTile + i] = fp8_quantize(x[i], scale);
      std::memcpy(dst + fp8_ds_mla_scale_offset(Dl) + 4 * g, &scale, 4);
    }
    for (int d = 0; d < Dr; ++d) {
      const uint16_t b =
          f32_to_bf16(static_cast<float>((splitmix64(5000 + r * Dr + d) >> 40) * (2.0 / 16777216.0) - 1.0)).bits;
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

}  // namespace
}  // namespace dsacp::bench::gpu
