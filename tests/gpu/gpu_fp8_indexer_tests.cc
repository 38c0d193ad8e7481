// GPU FP8 indexer (e4m3 q + q_scale, two-plane FP8 key pages) against direct host math: the pool written by the
// GPU cache write (bytes against dsacp/fp8.h on the host), scores + top-k against fp64 scores of the dequantized
// values; the persistent wgmma score kernel's page sizes, short rows, next_n 1..16 and the plan in device memory;
// (full size only) 70K-320K-key rows. One test per case (Fp8Indexer.Case/<case name>).
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

// FP8 indexer (e4m3 q + q_scale, two-plane FP8 key pages) against direct host math: the pool is written by the GPU
// cache write from f32/bf16 rows (bytes compared with dsacp/fp8.h run on the host), then scores + top-k are
// checked against fp64 scores of the dequantized values (canonical form, the set up to near-ties, exact duplicates
// tie to the lower position, NaN keys lowest) and rerun bit-identical.
struct Fp8Case {
  std::string name;
  int Hi = 64;
  int K = 2048;
  int page_size = 64;
  std::vector<int64_t> ctx;
  std::vector<int> qlen;
  Fp8ScaleMode mode = Fp8ScaleMode::kFp32;
  DType rows_dtype = DType::kF32;
  bool hostile = false;  // NaN / Inf / zero / tiny / large keys
};

void run_fp8_indexer_case(Backend& gpu, const Fp8Case& c) {
  const int Hi = c.Hi, Di = 128;
  const std::string name = "indexer_topk fp8 " + c.name;
  auto [lens, request, key_len] = query_rows(c.ctx, c.qlen);
  const int64_t T = static_cast<int64_t>(request.size());
  const uint64_t seed = 900 + static_cast<uint64_t>(std::hash<std::string>{}(c.name) % 1000);
  Paging pg = make_paging(lens, c.page_size, 3, seed);
  // Key rows (f32, rounded to bf16 for bf16 rows), their slots, and the host's expected pool bytes.
  int64_t nrows = 0;
  for (int64_t l : lens) nrows += l;
  std::vector<float> rows(static_cast<size_t>(nrows * Di));
  std::vector<int64_t> slots(static_cast<size_t>(nrows));
  std::vector<int64_t> row_base(lens.size());
  for (int32_t b = 0, r = 0; b < pg.num_requests; ++b) {
    row_base[b] = r;
    for (int64_t j = 0; j < lens[b]; ++j, ++r) {
      // duplicates: key j + 100 repeats key j (j = 7 mod 997), an exact tie
      const int64_t src = (j % 997 == 107) ? j - 100 : j;
      float amp = 1.f;
      if (c.hostile) {
        if (src % 97 == 5) amp = 0.f;        // zero key: scale 2^-126, every value 0
        if (src % 79 == 11) amp = 1e-37f;    // tiny key: the smallest scale, subnormal e4m3 values
        if (src % 73 == 13) amp = 30.f;      // large key
      }
      for (int d = 0; d < Di; ++d) {
        float v = amp * uniform_at(seed + 1 + b, static_cast<uint64_t>(src) * Di + d);
        if (c.hostile && src % 89 == 3 && d == 17) v = std::numeric_limits<float>::quiet_NaN();
        if (c.hostile && src % 83 == 7 && d == 5) v = -std::numeric_limits<float>::infinity();  // saturates
        if (c.rows_dtype == DType::kBF16) v = round_to_bf16(v);
        rows[r * Di + d] = v;
      }
      slots[r] = pg.row_of(b, j);
    }
  }
  const int64_t pool_bytes = pg.num_pages * fp8_index_page_bytes(pg.page_size, Di);
  std::vector<uint8_t> pool_h(static_cast<size_t>(pool_bytes), 0xff);
  for (int64_t r = 0; r < nrows; ++r) {
    float amax = 0.f;
    for (int d = 0; d < Di; ++d) amax = std::max(amax, fp8_amax_term(rows[r * Di + d]));
    const float sc = fp8_scale_from_amax(amax, c.mode);
    const int64_t page = slots[r] / pg.page_size;
    const int32_t off = static_cast<int32_t>(slots[r] % pg.page_size);
    for (int d = 0; d < Di; ++d) {
      pool_h[fp8_index_value_offset(page, off, pg.page_size, Di) + d] = fp8_quantize(rows[r * Di + d], sc);
    }
    std::memcpy(&pool_h[fp8_index_scale_offset(page, off, pg.page_size, Di)], &sc, 4);
  }
  // GPU cache write into a pool filled like the host's
  Dev d_pool = upload(gpu, pool_h);  // (overwritten below except the unused slots)
  {
    std::vector<uint8_t> fill(static_cast<size_t>(pool_bytes), 0xff);
    Status s0 = gpu.copy_to_device(d_pool.buf.get(), fill.data(), fill.size());
    Dev d_rows = c.rows_dtype == DType::kBF16 ? [&] {
      std::vector<uint16_t> rb(rows.size());
      for (size_t i = 0; i < rows.size(); ++i) rb[i] = f32_to_bf16(rows[i]).bits;
      return upload(gpu, rb);
    }() : upload(gpu, rows);
    Dev d_slots = upload(gpu, slots);
    CacheWriteParams cw;
    cw.rows = d_rows.buf.get();
    cw.rows_dtype = c.rows_dtype;
    cw.fp8_scale_mode = c.mode;
    cw.num_rows = nrows;
    cw.slots = d_slots.ptr<int64_t>();
    cw.pool = {d_pool.buf.get(), DType::kF8E4M3, pg.num_pages, pg.page_size, Di};
    Status s = s0.ok() ? gpu.cache_write(cw) : s0;
    if (s.ok()) s = gpu.synchronize();
    const std::vector<uint8_t> got = download<uint8_t>(gpu, d_pool, pool_h.size());
    int64_t diff = 0;
    for (size_t i = 0; i < got.size(); ++i) diff += got[i] != pool_h[i];
    report(s.ok() && diff == 0, "cache_write fp8 " + c.name + " bit-exact vs dsacp/fp8.h on the host",
           s.ok() ? std::to_string(diff) + " bytes differ of " + std::to_string(got.size()) : s.to_string());
  }
  // queries: e4m3 values, positive scales over a wide range, signed head weights
  std::vector<uint8_t> q(static_cast<size_t>(T * Hi * Di));
  for (size_t i = 0; i < q.size(); ++i) q[i] = f32_to_e4m3(6.f * uniform_at(seed + 2, i));
  std::vector<float> qs(static_cast<size_t>(T * Hi)), w(static_cast<size_t>(T * Hi));
  for (size_t i = 0; i < qs.size(); ++i) {
    qs[i] = std::ldexp(1.f + 0.5f * uniform_at(seed + 3, i), static_cast<int>(splitmix64(seed + 4 + i) % 9) - 6);
    w[i] = 0.125f * uniform_at(seed + 5, i);
  }
  Dev d_req = upload(gpu, request), d_len = upload(gpu, key_len), d_q = upload(gpu, q), d_qs = upload(gpu, qs);
  Dev d_w = upload(gpu, w), d_bt = upload(gpu, pg.bt);
  Dev d_topk = upload(gpu, std::vector<int32_t>(T * c.K, 0x7eadbeef));
  Dev d_scores = upload(gpu, std::vector<float>(T * c.K, 12345.f));
  IndexerTopkParams p;
  p.rows = {T, d_req.ptr<int32_t>(), d_len.ptr<int32_t>()};
  p.Hi = Hi;
  p.Di = Di;
  p.K = c.K;
  p.q = d_q.buf.get();
  p.q_dtype = DType::kF8E4M3;
  p.q_scale = d_qs.ptr<float>();
  p.w = d_w.ptr<float>();
  p.keys = {d_pool.buf.get(), DType::kF8E4M3, pg.num_pages, pg.page_size, Di};
  p.block_table = {d_bt.ptr<int32_t>(), pg.num_requests, pg.max_pages};
  p.topk = d_topk.ptr<int32_t>();
  p.topk_scores = d_scores.ptr<float>();
  p.host_request = request.data();
  p.host_key_len = key_len.data();
  Status sg = gpu.indexer_topk(p);
  if (sg.ok()) sg = gpu.synchronize();
  if (!sg.ok()) {
    report(false, name, sg.to_string());
    return;
  }
  const std::vector<int32_t> topk_g = download<int32_t>(gpu, d_topk, T * c.K);
  const std::vector<float> scores_g = download<float>(gpu, d_scores, T * c.K);
  Status sg2 = gpu.indexer_topk(p);
  if (sg2.ok()) sg2 = gpu.synchronize();
  const std::vector<float> scores_g2 = download<float>(gpu, d_scores, T * c.K);  // (bits: NaN scores of NaN keys)
  const bool rerun_same = sg2.ok() && download<int32_t>(gpu, d_topk, T * c.K) == topk_g &&
                          std::memcmp(scores_g2.data(), scores_g.data(), scores_g.size() * sizeof(float)) == 0;
  // fp64 reference from the host's bytes
  int64_t bad_rows = 0, nan_keys = 0;
  double score_err = 0, score_max = 0;
  std::string first_bad;
  std::vector<double> ref, kdq;
  for (int64_t t = 0; t < T; ++t) {
    const int32_t b = request[t];
    const int64_t n = key_len[t];
    ref.assign(static_cast<size_t>(n), 0.0);
    double max_abs = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = pg.row_of(b, j), page = slot / pg.page_size;
      const int32_t off = static_cast<int32_t>(slot % pg.page_size);
      const uint8_t* kv = &pool_h[fp8_index_value_offset(page, off, pg.page_size, Di)];
      float sk;
      std::memcpy(&sk, &pool_h[fp8_index_scale_offset(page, off, pg.page_size, Di)], 4);
      double s = 0;
      for (int h = 0; h < Hi; ++h) {
        double dot = 0;
        const uint8_t* qr = &q[(t * Hi + h) * Di];
        for (int d = 0; d < Di; ++d) dot += static_cast<double>(e4m3_to_f32(qr[d])) * e4m3_to_f32(kv[d]);
        const double x = static_cast<double>(qs[t * Hi + h]) * sk * dot;
        s += static_cast<double>(w[t * Hi + h]) * (x < 0 ? 0.0 : x);
      }
      ref[j] = s;
      if (std::isnan(s)) {
        nan_keys += t == 0;
      } else {
        max_abs = std::max(max_abs, std::abs(s));
      }
    }
    const double tol = 2e-5 * max_abs + 1e-6;
    auto rk = [&](int64_t j) { return std::isnan(ref[j]) ? -std::numeric_limits<double>::infinity() : ref[j]; };
    const int32_t* g = &topk_g[t * c.K];
    const int64_t want = std::min<int64_t>(c.K, n);
    bool ok = true;
    for (int64_t i = 0; i < c.K; ++i) {
      if (i < want && (g[i] < 0 || g[i] >= n || (i > 0 && g[i] <= g[i - 1]))) ok = false;
      if (i >= want && g[i] != -1) ok = false;
    }
    if (ok) {
      std::vector<uint8_t> chosen(static_cast<size_t>(n), 0);
      double min_chosen = std::numeric_limits<double>::infinity();
      for (int64_t i = 0; i < want; ++i) {
        chosen[g[i]] = 1;
        min_chosen = std::min(min_chosen, rk(g[i]));
        const float sgv = scores_g[t * c.K + i];
        if (std::isnan(ref[g[i]]) != std::isnan(sgv)) ok = false;
        if (!std::isnan(sgv)) {
          score_err = std::max(score_err, std::abs(sgv - ref[g[i]]) / (max_abs + 1e-30));
          score_max = std::max(score_max, std::abs(ref[g[i]]));
        }
      }
      for (int64_t i = want; i < c.K; ++i) ok = ok && scores_g[t * c.K + i] == -std::numeric_limits<float>::infinity();
      double max_unchosen = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        if (!chosen[j]) max_unchosen = std::max(max_unchosen, rk(j));
        // an exact duplicate (same bytes, same score) ties to the lower position
        if (j % 997 == 107 && chosen[j] && !chosen[j - 100]) ok = false;
      }
      if (max_unchosen > min_chosen + tol) ok = false;
    }
    if (!ok) {
      ++bad_rows;
      if (first_bad.empty()) first_bad = " first bad row t=" + std::to_string(t);
    }
  }
  char buf[256];
  std::snprintf(buf, sizeof buf, "T=%lld bad rows %lld, rerun %s, topk_scores max rel err %.1e (of the row's max), "
                "NaN keys in row 0: %lld", static_cast<long long>(T), static_cast<long long>(bad_rows),
                rerun_same ? "bit-identical" : "DIFFERS", score_err, static_cast<long long>(nan_keys));
  report(bad_rows == 0 && rerun_same && score_err <= 2e-5, name, std::string(buf) + first_bad);
}

std::vector<Fp8Case> fp8_indexer_cases() {
  std::vector<Fp8Case> fp8;
  fp8.push_back({"Hi=64 decode b=3 page64 K=2048 hostile keys", 64, 2048, 64, {5000, 2100, 900}, {1, 1, 1},
                 Fp8ScaleMode::kFp32, DType::kF32, true});
  fp8.push_back({"Hi=32 MTP 16+3 page61 K=512 ue8m0 bf16 rows", 32, 512, 61, {3000, 1200}, {16, 3},
                 Fp8ScaleMode::kUe8m0, DType::kBF16, false});
  fp8.push_back({"Hi=64 prefill 300 causal page1 K=1 hostile keys", 64, 1, 1, {0}, {300}, Fp8ScaleMode::kUe8m0,
                 DType::kF32, true});
  fp8.push_back({"Hi=32 chunked 1000 + 333 page64 K=2048 hostile keys", 32, 2048, 64, {1000}, {333},
                 Fp8ScaleMode::kFp32, DType::kBF16, true});
  fp8.push_back({"Hi=64 MTP 4+2+1 page64 K=1000", 64, 1000, 64, {4000, 2500, 1700}, {4, 2, 1}, Fp8ScaleMode::kFp32,
                 DType::kF32, false});
  // The persistent wgmma kernel (page sizes that are multiples of 4): page 16 (4 pages a 64-key block) next to 64,
  // rows shorter than a block (1..66 keys), next_n 1..16 (groups of up to 4 tokens, the last one partial), prefill
  // past the inline plan (the plan in device memory), and a 300K+ row that wraps each CTA's stage ring many times.
  fp8.push_back({"Hi=64 decode b=3 page16 K=2048 hostile keys", 64, 2048, 16, {5000, 2100, 900}, {1, 1, 1},
                 Fp8ScaleMode::kFp32, DType::kF32, true});
  fp8.push_back({"Hi=32 decode short rows page16 K=64", 32, 64, 16, {0, 5, 30, 62, 63, 64, 65}, {1, 1, 1, 1, 1, 1, 1},
                 Fp8ScaleMode::kFp32, DType::kF32, false});
  fp8.push_back({"Hi=64 decode short rows page64 K=2048", 64, 2048, 64, {0, 1, 63, 64, 200}, {1, 1, 1, 1, 1},
                 Fp8ScaleMode::kUe8m0, DType::kF32, false});
  fp8.push_back({"Hi=64 MTP next_n 1..16 page64 K=2048", 64, 2048, 64, {3000, 2000, 1000, 4100, 2500, 700, 1800},
                 {1, 2, 3, 4, 5, 8, 16}, Fp8ScaleMode::kFp32, DType::kBF16, false});
  fp8.push_back({"Hi=32 MTP next_n 1..16 page16 K=512", 32, 512, 16, {1500, 2000, 900, 3000, 600}, {16, 3, 1, 4, 7},
                 Fp8ScaleMode::kUe8m0, DType::kF32, true});
  fp8.push_back({"Hi=64 prefill 400 causal page64 K=300 (plan in device memory)", 64, 300, 64, {0}, {400},
                 Fp8ScaleMode::kFp32, DType::kF32, false});
  fp8.push_back({"Hi=32 chunked 600 + 200 page16 K=2048 hostile keys", 32, 2048, 16, {600}, {200},
                 Fp8ScaleMode::kFp32, DType::kF32, true});
  if (!gpu_test_options().quick) {
    fp8.push_back({"Hi=64 decode ctx 320000 + 2 x 40000 page64 K=2048", 64, 2048, 64, {320000, 40000, 40000},
                   {1, 1, 1}, Fp8ScaleMode::kFp32, DType::kBF16, false});
    fp8.push_back({"Hi=32 decode ctx 300000 MTP 2 page16 K=2048 hostile keys", 32, 2048, 16, {300000}, {2},
                   Fp8ScaleMode::kUe8m0, DType::kF32, true});
    fp8.push_back({"Hi=64 decode ctx 140000 page64 K=2048 hostile keys", 64, 2048, 64, {140000}, {1},
                   Fp8ScaleMode::kFp32, DType::kBF16, true});
    fp8.push_back({"Hi=32 decode ctx 70000 x2 page61 K=2048", 32, 2048, 61, {70000}, {2}, Fp8ScaleMode::kUe8m0,
                   DType::kF32, false});
  }
  return fp8;
}

void PrintTo(const Fp8Case& c, std::ostream* os) { *os << c.name; }

class Fp8Indexer : public GpuTest, public ::testing::WithParamInterface<Fp8Case> {};

TEST_P(Fp8Indexer, Case) { run_fp8_indexer_case(gpu(), GetParam()); }

INSTANTIATE_TEST_SUITE_P(, Fp8Indexer, ::testing::ValuesIn(fp8_indexer_cases()),
                         [](const ::testing::TestParamInfo<Fp8Case>& i) { return param_name(i.param.name); });

}  // namespace
}  // namespace dsacp::testing
