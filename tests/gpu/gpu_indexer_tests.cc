// GPU bf16 indexer (scores + top-k) against the CPU oracle: decode, MTP, causal and chunked prefill, page sizes
// 1 / 61 / 64, 32 and 64 indexer heads, the plan inline and in device memory, and (full size only) a 140K-key
// context, rows of bulk ties and key offsets past 2^31. One test per case (Indexer.Case/<case name>).
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
#include "gpu/gpu_kernel_data.h"
#include "gpu/gpu_test.h"

namespace dsacp::testing {
namespace {

struct IdxCase {
  std::string name;
  int K = 2048;
  int page_size = 64;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  int64_t first_page = 0;  // pages from this id up (to push key element offsets past 2^31)
  int distinct_keys = 0;   // > 0: every request's keys repeat this many distinct rows (scores tie in bulk)
  int Hi = 64;
};

void run_indexer_case(Backend& gpu, Backend& cpu, const IdxCase& c) {
  const int Hi = c.Hi, Di = 128;
  auto [lens, request, key_len] = query_rows(c.ctx, c.qlen);
  const int64_t T = static_cast<int64_t>(request.size());
  Paging pg = make_paging(lens, c.page_size, 4, 77, c.first_page);
  std::vector<uint16_t> keys = make_pool(pg, lens, Di, 600);
  // duplicate a few key rows so exact ties occur (ties must go to the lower position)
  for (int32_t b = 0; b < pg.num_requests; ++b) {
    for (int64_t j = 7; j + 100 < lens[b]; j += 997) {
      std::memcpy(&keys[pg.row_of(b, j + 100) * Di], &keys[pg.row_of(b, j) * Di], Di * 2);
    }
    for (int64_t j = c.distinct_keys; c.distinct_keys > 0 && j < lens[b]; ++j) {
      std::memcpy(&keys[pg.row_of(b, j) * Di], &keys[pg.row_of(b, j % c.distinct_keys) * Di], Di * 2);
    }
  }
  std::vector<uint16_t> q = random_bf16(T * Hi * Di, 700);
  std::vector<float> w(T * Hi);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.125f * uniform_at(701, i);
  std::vector<int32_t> topk_c(T * c.K);
  std::vector<float> scores_c(T * c.K);
  IndexerTopkParams p;
  p.rows.num_tokens = T;
  p.Hi = Hi;
  p.Di = Di;
  p.K = c.K;
  p.q_dtype = DType::kBF16;
  p.keys = {nullptr, DType::kBF16, pg.num_pages, pg.page_size, Di};
  p.block_table = {nullptr, pg.num_requests, pg.max_pages};
  IndexerTopkParams pc = p;
  pc.rows.request = request.data();
  pc.rows.key_len = key_len.data();
  pc.q = q.data();
  pc.w = w.data();
  pc.keys.data = keys.data();
  pc.block_table.data = pg.bt.data();
  pc.topk = topk_c.data();
  pc.topk_scores = scores_c.data();
  const auto t0 = std::chrono::steady_clock::now();
  Status sc = indexer_topk_run(cpu, pc);
  const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!sc.ok()) {
    report(false, "indexer_topk " + c.name, "CPU oracle failed: " + sc.to_string());
    return;
  }
  Dev d_req = upload(gpu, request), d_len = upload(gpu, key_len), d_q = upload(gpu, q), d_w = upload(gpu, w);
  Dev d_keys = upload(gpu, keys), d_bt = upload(gpu, pg.bt);
  Dev d_topk = upload(gpu, std::vector<int32_t>(T * c.K, 0x7eadbeef));
  IndexerTopkParams pgp = p;
  pgp.rows.request = d_req.ptr<int32_t>();
  pgp.rows.key_len = d_len.ptr<int32_t>();
  pgp.q = d_q.buf.get();
  pgp.w = d_w.ptr<float>();
  pgp.keys.data = d_keys.buf.get();
  pgp.block_table.data = d_bt.ptr<int32_t>();
  pgp.topk = d_topk.ptr<int32_t>();
  Dev d_scores = upload(gpu, std::vector<float>(T * c.K, 12345.f));
  pgp.topk_scores = d_scores.ptr<float>();
  Status sg = indexer_topk_run(gpu, pgp);
  if (!sg.ok()) {
    report(false, "indexer_topk " + c.name, sg.to_string());
    return;
  }
  std::vector<int32_t> topk_g = download<int32_t>(gpu, d_topk, T * c.K);
  std::vector<float> scores_g = download<float>(gpu, d_scores, T * c.K);
  // topk_scores on rows equal to the CPU's: same -inf padding, values within fp32 rounding of the CPU's
  double score_err = 0, score_max = 0;
  bool score_pad_ok = true;
  for (int64_t t = 0; t < T; ++t) {
    if (!std::equal(&topk_g[t * c.K], &topk_g[t * c.K] + c.K, &topk_c[t * c.K])) continue;
    for (int64_t i = 0; i < c.K; ++i) {
      const float a = scores_g[t * c.K + i], r = scores_c[t * c.K + i];
      if (std::isinf(a) || std::isinf(r)) {
        if (a != r) score_pad_ok = false;
        continue;
      }
      score_err = std::max(score_err, static_cast<double>(std::abs(a - r)));
      score_max = std::max(score_max, static_cast<double>(std::abs(r)));
    }
  }
  const bool scores_ok = score_pad_ok && score_err <= 1e-4 * score_max + 1e-6;
  Status sg2 = indexer_topk_run(gpu, pgp);
  std::vector<int32_t> topk_g2 = download<int32_t>(gpu, d_topk, T * c.K);
  const bool rerun_same = sg2.ok() && topk_g == topk_g2;

  // Validate each GPU row: canonical form, and a set that is a correct top-k under fp64 scores up to near-ties.
  int64_t rows_exact = 0, bad_rows = 0, swaps = 0;
  std::string first_bad;
  std::vector<double> ref;
  std::vector<float> kf(Di);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = key_len[t];
    const int32_t* g = &topk_g[t * c.K];
    const int32_t* cr = &topk_c[t * c.K];
    if (std::equal(g, g + c.K, cr)) {
      ++rows_exact;
      continue;
    }
    const int64_t want = std::min<int64_t>(c.K, n);
    bool ok = true;
    for (int64_t i = 0; i < c.K; ++i) {
      if (i < want && (g[i] < 0 || g[i] >= n || (i > 0 && g[i] <= g[i - 1]))) ok = false;
      if (i >= want && g[i] != -1) ok = false;
    }
    if (ok) {
      // fp64 scores of the row
      const int32_t b = request[t];
      ref.assign(static_cast<size_t>(n), 0.0);
      double max_abs = 0;
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* kr = &keys[pg.row_of(b, j) * Di];
        double s = 0;
        for (int h = 0; h < Hi; ++h) {
          double dot = 0;
          const uint16_t* qr = &q[(t * Hi + h) * Di];
          for (int d = 0; d < Di; ++d) dot += static_cast<double>(bf16_to_f32(bf16{qr[d]})) * bf16_to_f32(bf16{kr[d]});
          s += static_cast<double>(w[t * Hi + h]) * std::max(dot, 0.0);
        }
        ref[j] = s;
        max_abs = std::max(max_abs, std::abs(s));
      }
      std::vector<uint8_t> chosen(static_cast<size_t>(n), 0);
      double min_chosen = std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < want; ++i) {
        chosen[g[i]] = 1;
        min_chosen = std::min(min_chosen, ref[g[i]]);
      }
      double max_unchosen = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        if (!chosen[j]) max_unchosen = std::max(max_unchosen, ref[j]);
      }
      const double tol = 2e-5 * max_abs + 1e-6;
      if (max_unchosen > min_chosen + tol) ok = false;
      for (int64_t i = 0; i < want; ++i) swaps += std::find(cr, cr + want, g[i]) == cr + want;
    }
    if (!ok) {
      ++bad_rows;
      if (first_bad.empty()) first_bad = " first bad row t=" + std::to_string(t);
    }
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld rows identical to CPU %lld, near-tie swaps %lld, bad rows %lld, rerun %s, cpu %.2fs",
                static_cast<long long>(T), static_cast<long long>(rows_exact), static_cast<long long>(swaps),
                static_cast<long long>(bad_rows), rerun_same ? "bit-identical" : "DIFFERS", cpu_s);
  char sbuf[96];
  std::snprintf(sbuf, sizeof sbuf, ", topk_scores max abs err %.1e of %.1e%s", score_err, score_max,
                score_pad_ok ? "" : " (padding differs)");
  report(bad_rows == 0 && rerun_same && scores_ok, "indexer_topk " + c.name, std::string(buf) + sbuf + first_bad);
}

std::vector<IdxCase> indexer_cases() {
  std::vector<IdxCase> idx;
  idx.push_back({"decode b=4 ctx 5000 page64", 2048, 64, {5000, 4100, 2049, 100}, {1, 1, 1, 1}});
  idx.push_back({"MTP b=2 x3 page61 K=512", 512, 61, {3000, 1200}, {3, 3}});
  idx.push_back({"prefill 600 causal page1 K=256", 256, 1, {0}, {600}});
  idx.push_back({"chunked prefill ctx 1000 + 333 page64 K=2048", 2048, 64, {1000}, {333}});
  if (!gpu_test_options().quick) {
    idx.push_back({"decode ctx 140000 (128K+) page64", 2048, 64, {140000, 131072}, {1, 1}});
    // Long rows (the top-k's boundary-bin filter) with ties in bulk: 60 distinct keys (each score ~2300 times:
    // the bin fits, ties at the threshold go to the lower positions), and one distinct key (every score equal:
    // the bin is the row, the passes over the row instead).
    IdxCase ties{"decode ctx 140000 + 70000, 60 distinct keys", 2048, 64, {140000, 70000}, {1, 2}};
    ties.distinct_keys = 60;
    idx.push_back(ties);
    ties.name = "decode ctx 100000, every key the same";
    ties.ctx = {100000};
    ties.qlen = {1};
    ties.distinct_keys = 1;
    idx.push_back(ties);
    // element offsets past 2^31 in the indexer pool: pages from 16.8M rows up (row offset * 128 > 2^31)
    idx.push_back({"decode, key offsets past 2^31", 2048, 64, {5000, 3000}, {1, 2}, (int64_t{1} << 31) / 128 / 64 + 10});
  }
  // The plan in the kernels' parameters (one chunk of at most 128 tokens) at its edge: 128 rows inline, 129 from
  // device memory; and a small plan from device memory too (CudaBackendOptions::indexer_inline_plan off).
  for (const int b : {128, 129}) {
    IdxCase edge{b == 128 ? "decode b=128 (plan inline)" : "decode b=129 (plan in device memory)", 512, 64, {}, {}};
    for (int i = 0; i < b; ++i) {
      edge.ctx.push_back(300 + 37 * i);
      edge.qlen.push_back(1);
    }
    idx.push_back(edge);
  }
  {
    // bf16 with 32 indexer heads (GLM-5.x's indexer) against the CPU backend
    IdxCase h32{"Hi=32 decode b=3 page64 K=2048", 2048, 64, {5000, 2100, 300}, {1, 2, 1}};
    h32.Hi = 32;
    idx.push_back(h32);
    h32 = {"Hi=32 prefill 400 causal page61 K=128", 128, 61, {0}, {400}};
    h32.Hi = 32;
    idx.push_back(h32);
  }
  return idx;
}

void PrintTo(const IdxCase& c, std::ostream* os) { *os << c.name; }

class Indexer : public GpuTest, public ::testing::WithParamInterface<IdxCase> {};

TEST_P(Indexer, Case) { run_indexer_case(gpu(), cpu(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(, Indexer, ::testing::ValuesIn(indexer_cases()),
                         [](const ::testing::TestParamInfo<IdxCase>& i) { return param_name(i.param.name); });

// The first case with the plan in device memory (CudaBackendOptions::indexer_inline_plan off).
class IndexerPlanInDeviceMemory : public GpuTest {};

TEST_F(IndexerPlanInDeviceMemory, FirstCase) {
  CudaBackendOptions o;
  o.indexer_inline_plan = false;
  IdxCase device_plan = indexer_cases()[0];
  device_plan.name = "decode b=4 ctx 5000 page64 (plan in device memory)";
  auto be = make_cuda_backend(0, o);
  if (be.ok()) {
    run_indexer_case(**be, cpu(), device_plan);
  } else {
    report(false, device_plan.name + ": backend", be.status().to_string());
  }
}

}  // namespace
}  // namespace dsacp::testing
