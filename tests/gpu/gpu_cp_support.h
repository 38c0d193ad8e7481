// The GPU CP tests' shared pieces: ranks as threads, random messages, a step's results against one GPU's,
// the layouts and the random cases.
#pragma once

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
#include "dsacp/random.h"
#include "dsacp/replay.h"

namespace dsacp::testing {

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Runs f(rank) on `n` threads and joins them.
template <typename F>
inline void on_ranks(int n, F f) {
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) t.emplace_back([&f, r] { f(r); });
  for (auto& x : t) x.join();
}

inline std::vector<uint8_t> random_bytes(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(counter_hash(seed, 0xb17e, i));
  return v;
}

struct Compare {
  bool topk_same = false;
  double out_rel = 0, lse_abs = 0;
  int64_t rows_differ = 0;
};

inline Compare compare(const StepResult& got, const StepResult& want) {
  Compare c;
  const int64_t T = want.topk_indices.dim(0), K = want.topk_indices.dim(1);
  c.topk_same = got.topk_indices.nbytes() == want.topk_indices.nbytes();
  if (c.topk_same) {
    for (int64_t t = 0; t < T; ++t) {
      if (std::memcmp(got.topk_indices.data_as<int32_t>() + t * K, want.topk_indices.data_as<int32_t>() + t * K,
                      K * sizeof(int32_t)) != 0) {
        ++c.rows_differ;
      }
    }
    c.topk_same = c.rows_differ == 0;
  }
  double e2 = 0, r2 = 0;
  for (int64_t i = 0; i < want.out.numel(); ++i) {
    const double a = got.out.get_f32(i), b = want.out.get_f32(i);
    e2 += (a - b) * (a - b);
    r2 += b * b;
  }
  c.out_rel = r2 > 0 ? std::sqrt(e2 / r2) : std::sqrt(e2);
  for (int64_t i = 0; i < want.lse.numel(); ++i) {
    const double a = got.lse.get_f32(i), b = want.lse.get_f32(i);
    if (std::isinf(a) && std::isinf(b) && (a > 0) == (b > 0)) continue;
    c.lse_abs = std::max(c.lse_abs, std::fabs(a - b));
  }
  return c;
}

inline std::string describe(const Compare& c) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "top-k %s (%lld rows differ), out rel err %.2e, lse max err %.2e",
                c.topk_same ? "identical" : "DIFFER", static_cast<long long>(c.rows_differ), c.out_rel, c.lse_abs);
  return buf;
}

struct Layout {
  const char* name;
  CpLayout layout;
  bool one_gpu;  // every rank on GPU 0
};

// NCCL without its exchange window: every exchange through the collectives.
inline CpLayout without_window(CpLayout l) {
  l.nccl_window_bytes = 0;
  return l;
}

inline CpLayout with_choices(CpLayout l, CpLayout::WindowRows rows, bool fused_topk_merge) {
  l.window_rows = rows;
  l.fused_topk_merge = fused_topk_merge;
  return l;
}

inline CpLayout make_layout(int P, int D, IndexerMode indexer = IndexerMode::kSharded, int interleave = 0,
                     bool dsa_cp = false, DecodeMode decode = DecodeMode::kLocalMerge) {
  CpLayout l;
  l.P = P;
  l.D = D;
  l.indexer = indexer;
  l.interleave = interleave;
  l.dsa_cp = dsa_cp;
  l.decode_mode = decode;
  l.comm_timeout_ms = 15000;  // a deadlock becomes an error naming the stuck collective, within the run
  return l;
}

inline CaseFile make_case(uint64_t seed, int32_t H, bool decode_only) {
  CaseGenSpec spec;
  spec.dims = CaseDims{H, 512, 64, 64, 128};
  spec.topk = 512;
  spec.scale = 0.0723f;
  spec.dtype = DType::kBF16;
  spec.seed = seed;
  const int nd = 3 + static_cast<int>(counter_hash(seed, 1, 0) % 3);
  for (int i = 0; i < nd; ++i) {
    spec.requests.push_back({1 + static_cast<int32_t>(counter_hash(seed, 2, i) % 3),
                             200 + static_cast<int32_t>(counter_hash(seed, 3, i) % 6000)});
  }
  if (!decode_only) {
    spec.requests.push_back({257, 0});
    spec.requests.push_back({61, 1500 + static_cast<int32_t>(counter_hash(seed, 4, 0) % 1000)});
    spec.requests.push_back({7, 0});
  }
  auto c = case_generate(spec);
  if (!c.ok()) {
    std::printf("case_generate: %s\n", c.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(c).value();
}

}  // namespace dsacp::testing
