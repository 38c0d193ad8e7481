// dsacp_bench_gpu: the indexer + exact top-k cases (bf16 and FP8, decode, MTP and prefill), the top-k alone on
// given scores, and the DCP decode's candidate merge.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bench_gpu_common.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::bench::gpu {
namespace {

// ---- indexer + top-k ---------------------------------------------------------------------------------------
// Random valid e4m3 values (no NaN) tiled over `bytes`, and, for an FP8 key pool, positive f32 scales in each page's
// scale plane.
void* dev_random_e4m3(size_t bytes, int32_t page_size = 0, int32_t Di = 0) {
  static std::vector<uint8_t> block;
  if (block.empty()) {
    block.resize(32u << 20);
    for (size_t i = 0; i < block.size(); ++i) {
      block[i] = f32_to_e4m3(static_cast<float>((splitmix64(700 + i) >> 40) * (12.0 / 16777216.0) - 6.0));
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
      const float sc = 0.01f * (1.f + static_cast<float>((splitmix64(900 + pg * page_size + i) >> 40) / 16777216.0));
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
}  // namespace

void bench_indexer(const std::string& name, int64_t num_requests, int64_t ctx, int64_t qlen, int reps, int Hi,
                   bool fp8) {
  const int K = 2048, page = 64, Di = 128;
  const int64_t total = ctx + qlen;
  const int64_t pages_per_req = (total + page - 1) / page;
  const int64_t num_pages = pages_per_req * num_requests;
  std::vector<int32_t> bt(num_pages);
  for (int64_t i = 0; i < num_pages; ++i) bt[i] = static_cast<int32_t>(i);
  for (int64_t i = num_pages; i > 1; --i) std::swap(bt[i - 1], bt[splitmix64(9 + i) % i]);
  const int64_t T = num_requests * qlen;
  std::vector<int32_t> request(T), key_len(T);
  double visible = 0;
  for (int64_t t = 0; t < T; ++t) {
    request[t] = static_cast<int32_t>(t / qlen);
    key_len[t] = static_cast<int32_t>(ctx + t % qlen + 1);
    visible += key_len[t];
  }
  std::vector<float> w(T * Hi);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((splitmix64(300 + i) >> 40) * (0.25 / 16777216.0) - 0.125);
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
    for (size_t i = 0; i < qs.size(); ++i) qs[i] = 0.5f + static_cast<float>((splitmix64(500 + i) >> 40) / 16777216.0);
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

}  // namespace dsacp::bench::gpu
