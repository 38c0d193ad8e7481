// GPU FP8 indexer scores, side by side: the persistent wgmma score kernel (the FP8 default, forced through its
// launcher) against the mma.sync kernel on the same plan, over page sizes 4..192, MTP groups and few SMs (many
// items a CTA). One test per case (IndexerScores.SideBySide/<case name>).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "dsacp/backend.h"
#include "dsacp/dtype.h"
#include "dsacp/fp8.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "gpu/gpu_kernel_data.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

// The persistent wgmma score kernel (the FP8 default, forced here through its launcher) against the
// mma.sync kernel on the same plan: every visible score within 1e-5 of the row's largest (NaN where NaN), nothing
// written past a token's key_len (both buffers start poisoned), reruns bit-identical.
struct ScoreSideCase {
  std::string name;
  int Hi;
  int page_size;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  int num_sms = 0;  // > 0: the CTAs the wgmma kernel is given (few: many items a CTA, batch boundaries crossed)
};

void run_scores_side_by_side(const ScoreSideCase& c) {
  using namespace dsacp::cuda;
  const int Hi = c.Hi, Di = 128;
  const std::string name = "indexer scores side by side " + c.name + " (wgmma kernel vs mma.sync kernel)";
  auto [lens, request, key_len] = query_rows(c.ctx, c.qlen);
  const int64_t T = static_cast<int64_t>(request.size());
  const uint64_t seed = 4000 + static_cast<uint64_t>(std::hash<std::string>{}(c.name) % 1000);
  Paging pg = make_paging(lens, c.page_size, 2, seed);
  const int64_t page_bytes = fp8_index_page_bytes(pg.page_size, Di);
  std::vector<uint8_t> pool(static_cast<size_t>(pg.num_pages * page_bytes));
  for (int64_t page = 0; page < pg.num_pages; ++page) {
    for (int32_t i = 0; i < pg.page_size; ++i) {
      for (int d = 0; d < Di; ++d) {
        const uint64_t at = static_cast<uint64_t>((page * pg.page_size + i) * Di + d);
        pool[fp8_index_value_offset(page, i, pg.page_size, Di) + d] =
            (at % 4099 == 17) ? kE4m3NaN : f32_to_e4m3(300.f * uniform_at(seed + 1, at));
      }
      const float sk = std::ldexp(1.f + 0.5f * uniform_at(seed + 2, page * pg.page_size + i), -9);
      std::memcpy(&pool[fp8_index_scale_offset(page, i, pg.page_size, Di)], &sk, 4);
    }
  }
  std::vector<uint8_t> q(static_cast<size_t>(T * Hi * Di));
  for (size_t i = 0; i < q.size(); ++i) q[i] = f32_to_e4m3(6.f * uniform_at(seed + 3, i));
  std::vector<float> qs(static_cast<size_t>(T * Hi)), w(static_cast<size_t>(T * Hi));
  for (size_t i = 0; i < qs.size(); ++i) {
    qs[i] = std::ldexp(1.f + 0.5f * uniform_at(seed + 4, i), static_cast<int>(splitmix64(seed + 5 + i) % 9) - 6);
    w[i] = 0.125f * uniform_at(seed + 6, i);
  }
  auto dput = [](const auto& v) {
    void* d = nullptr;
    const size_t n = std::max<size_t>(16, v.size() * sizeof(v[0]));
    if (cudaMalloc(&d, n) != cudaSuccess) return static_cast<void*>(nullptr);
    if (!v.empty()) cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice);
    return d;
  };
  IndexerTopkParams p;
  p.rows.num_tokens = T;
  p.Hi = Hi;
  p.Di = Di;
  p.K = 2048;
  p.q_dtype = DType::kF8E4M3;
  p.keys = {nullptr, DType::kF8E4M3, pg.num_pages, pg.page_size, Di};
  p.block_table = {nullptr, pg.num_requests, pg.max_pages};
  auto plan = indexer_plan(p, request.data(), key_len.data());
  if (!plan.ok()) {
    report(false, name, plan.status().to_string());
    return;
  }
  const std::vector<ScoreItem> items = indexer_plan_items(*plan);
  std::vector<void*> bufs = {dput(request), dput(key_len), dput(q), dput(qs), dput(w), dput(pool), dput(pg.bt),
                             dput(items), dput(plan->score_offset)};
  const std::vector<float> poison(static_cast<size_t>(std::max<int64_t>(1, plan->max_score_floats)), 12345.f);
  void* d_a = dput(poison);
  void* d_b = dput(poison);
  p.rows.request = static_cast<const int32_t*>(bufs[0]);
  p.rows.key_len = static_cast<const int32_t*>(bufs[1]);
  p.q = bufs[2];
  p.q_scale = static_cast<const float*>(bufs[3]);
  p.w = static_cast<const float*>(bufs[4]);
  p.keys.data = bufs[5];
  p.block_table.data = static_cast<const int32_t*>(bufs[6]);
  const ScoreItem* d_items = static_cast<const ScoreItem*>(bufs[7]);
  const int64_t* d_off = static_cast<const int64_t*>(bufs[8]);
  LaunchContext ctx;  // pass 0: the mma.sync kernel (forced), passes 1 and 2: the wgmma kernel
  ctx.options.indexer_score_kernel = CudaBackendOptions::IndexerScoreKernel::kMmaSync;
  if (c.num_sms > 0) ctx.num_sms = c.num_sms;
  Status st = Status::ok_status();
  std::vector<float> a, b, b2;
  bool applies = true;
  for (int pass = 0; pass < 3 && st.ok(); ++pass) {
    for (const auto& ch : plan->chunks) {
      applies = applies && indexer_scores_wgmma_applies(p, ch.max_group_tokens);
      const ScoreItem* it = d_items + ch.item_begin;
      const int64_t n = ch.item_end - ch.item_begin;
      float* out = static_cast<float*>(pass == 0 ? d_a : d_b);
      if (pass == 0) {
        st = launch_indexer_scores(p, it, n, ch.max_group_tokens, d_off, out, InlinePlan{}, ctx);
      } else {
        st = launch_indexer_scores_wgmma(p, it, n, ch.max_group_tokens, d_off, out, InlinePlan{}, ctx);
      }
      if (!st.ok()) break;
      if (plan->chunks.size() > 1) break;  // (one chunk's rows: later chunks reuse the buffer)
    }
    if (cudaDeviceSynchronize() != cudaSuccess) st = internal_error("side-by-side score launch failed");
    std::vector<float>& dst = pass == 0 ? a : pass == 1 ? b : b2;
    dst.resize(poison.size());
    cudaMemcpy(dst.data(), pass == 0 ? d_a : d_b, dst.size() * 4, cudaMemcpyDeviceToHost);
  }
  for (void* v : bufs) cudaFree(v);
  cudaFree(d_a);
  cudaFree(d_b);
  if (!st.ok() || !applies) {
    report(false, name, st.ok() ? "the wgmma kernel does not apply" : st.to_string());
    return;
  }
  const auto& ch = plan->chunks.front();
  int64_t bad = 0, unwritten = 0, overwritten = 0, nans = 0;
  double max_rel = 0;
  std::vector<uint8_t> visible(a.size(), 0);
  for (int64_t t = ch.t0; t < ch.t1; ++t) {
    const int64_t off = plan->score_offset[t];
    double row_max = 0;
    for (int64_t j = 0; j < key_len[t]; ++j) {
      if (!std::isnan(a[off + j])) row_max = std::max(row_max, std::abs(static_cast<double>(a[off + j])));
    }
    for (int64_t j = 0; j < key_len[t]; ++j) {
      visible[off + j] = 1;
      const float x = a[off + j], y = b[off + j];
      if (y == 12345.f) ++unwritten;
      if (std::isnan(x) || std::isnan(y)) {
        nans += std::isnan(y);
        bad += std::isnan(x) != std::isnan(y);
        continue;
      }
      const double rel = std::abs(static_cast<double>(x) - y) / (row_max + 1e-30);
      max_rel = std::max(max_rel, rel);
      bad += rel > 1e-5;
    }
  }
  for (size_t i = 0; i < b.size(); ++i) overwritten += !visible[i] && b[i] != 12345.f;
  const bool same = std::memcmp(b.data(), b2.data(), b.size() * 4) == 0;
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld, %lld off by > 1e-5 of the row max (max %.1e), %lld NaN, %lld unwritten, "
                "%lld written past key_len, rerun %s", static_cast<long long>(T), static_cast<long long>(bad), max_rel,
                static_cast<long long>(nans), static_cast<long long>(unwritten), static_cast<long long>(overwritten),
                same ? "bit-identical" : "DIFFERS");
  report(bad == 0 && unwritten == 0 && overwritten == 0 && same && nans > 0, name, buf);
}

std::vector<ScoreSideCase> side_by_side_cases() {
  std::vector<ScoreSideCase> side;
  side.push_back({"Hi=64 page64 decode b=4", 64, 64, {5000, 2100, 900, 62}, {1, 1, 1, 1}});
  side.push_back({"Hi=32 page16 MTP 4+3+16", 32, 16, {3000, 1000, 2000}, {4, 3, 16}});
  side.push_back({"Hi=64 page16 MTP 2+2", 64, 16, {4000, 700}, {2, 2}});
  side.push_back({"Hi=64 page128 prefill 300", 64, 128, {0}, {300}});
  side.push_back({"Hi=32 page64 decode ctx 200000", 32, 64, {200000}, {1}});
  // pages of several blocks (a block's first row inside its page), the segment producer at page 4 (16 pages a
  // block), and few CTAs: many items a CTA, so the producers' batches of 32 items and the rings wrap many times
  side.push_back({"Hi=64 page128 decode b=3", 64, 128, {9000, 3001, 500}, {1, 1, 1}});
  side.push_back({"Hi=32 page192 MTP 2+1", 32, 192, {7000, 2500}, {2, 1}});
  side.push_back({"Hi=32 page4 decode b=2", 32, 4, {5000, 1300}, {1, 1}});
  side.push_back({"Hi=64 page64 MTP 4+3 on 3 SMs", 64, 64, {40000, 30001}, {4, 3}, 3});
  side.push_back({"Hi=64 page64 decode b=2 ctx 100000 on 2 SMs", 64, 64, {100000, 77777}, {1, 1}, 2});
  side.push_back({"Hi=32 page16 decode ctx 60000 on 2 SMs", 32, 16, {60000}, {1}, 2});
  return side;
}

void PrintTo(const ScoreSideCase& c, std::ostream* os) { *os << c.name; }

class IndexerScores : public GpuTest, public ::testing::WithParamInterface<ScoreSideCase> {};

TEST_P(IndexerScores, SideBySide) { run_scores_side_by_side(GetParam()); }

INSTANTIATE_TEST_SUITE_P(, IndexerScores, ::testing::ValuesIn(side_by_side_cases()),
                         [](const ::testing::TestParamInfo<ScoreSideCase>& i) { return param_name(i.param.name); });

}  // namespace
}  // namespace dsacp::testing
