// Row gather (with f32/bf16 conversion) and the global-to-local top-k remap of context parallelism.
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp::cpu {

Status gather_rows(const GatherRowsParams& p, int num_threads) {
  for (int64_t i = 0; i < p.num_rows; ++i) {
    if (p.index[i] < -1 || p.index[i] >= p.src_rows) {
      return out_of_range("gather_rows: index[" + std::to_string(i) + "] = " + std::to_string(p.index[i]) +
                          " outside [-1, " + std::to_string(p.src_rows) + ")");
    }
  }
  const int64_t dim = p.dim;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  parallel_for(p.num_rows, num_threads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t src = p.index[i];
      if (src >= 0 && p.src_dtype == p.dst_dtype) {  // bytes as they are (packed fp8_ds_mla records too)
        const size_t row = static_cast<size_t>(dim) * dtype_size(p.src_dtype);
        std::memcpy(static_cast<char*>(p.dst) + i * row, static_cast<const char*>(p.src) + gather_src_offset(p, src) * dtype_size(p.src_dtype),
                    row);
        continue;
      }
      for (int64_t d = 0; d < dim; ++d) {
        const float v = src < 0 ? nan : load_as_f32(p.src, p.src_dtype, gather_src_offset(p, src) + d);
        store_from_f32(p.dst, p.dst_dtype, i * dim + d, v);
      }
    }
  });
  return Status::ok_status();
}

namespace {

// One top-k row (n entries, global positions or -1) remapped to part `cr`'s local positions under the interleave
// I over Pt parts: that part's entries in order, then -1 up to K.
void remap_row(const int32_t* in, int64_t n, int64_t K, int64_t Pt, int64_t I, int64_t cr, int32_t* out) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = in[i];
    if (e >= 0 && (e / I) % Pt == cr) out[kept++] = static_cast<int32_t>((e / (Pt * I)) * I + e % I);
  }
  for (int64_t i = kept; i < K; ++i) out[i] = -1;
}

}  // namespace

Status topk_remap(const TopkRemapParams& p, int num_threads) {
  const int64_t n = p.num_rows * p.K;
  for (int64_t i = 0; i < n; ++i) {
    if (p.topk[i] < -1) {
      return out_of_range("topk_remap: entry " + std::to_string(i) + " = " + std::to_string(p.topk[i]) +
                          " (entries are positions >= 0 or -1)");
    }
  }
  const int64_t Pt = p.Pt, I = p.I;
  parallel_for(p.num_rows, num_threads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) remap_row(p.topk + r * p.K, p.K, p.K, Pt, I, p.cr, p.local + r * p.K);
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu

namespace dsacp::cpu {

Status topk_merge(const TopkMergeParams& p, int num_threads) {
  const int64_t S = p.num_parts, T = p.num_rows, K = p.K, I = p.I;
  for (int64_t s = 0; s < S; ++s) {
    const int32_t* part = topk_merge_part_topk(p, static_cast<int32_t>(s));
    for (int64_t i = 0; i < T * K; ++i) {
      if (part[i] < -1) {
        return out_of_range("topk_merge: part entry " + std::to_string(s * T * K + i) + " = " +
                            std::to_string(part[i]) + " (entries are positions >= 0 or -1)");
      }
    }
  }
  parallel_for(T, num_threads, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> keys;
    for (int64_t t = begin; t < end; ++t) {
      keys.clear();
      for (int64_t s = 0; s < S; ++s) {
        const int32_t* row = topk_merge_part_topk(p, static_cast<int32_t>(s)) + t * K;
        const float* sc = topk_merge_part_scores(p, static_cast<int32_t>(s)) + t * K;
        for (int64_t i = 0; i < K && row[i] >= 0; ++i) {
          const int64_t l = row[i];
          const int64_t g = ((l / I) * S + s) * I + l % I;
          keys.push_back(topk_rank_key(sc[i], static_cast<int32_t>(g)));
        }
      }
      const int64_t n = std::min<int64_t>(K, static_cast<int64_t>(keys.size()));
      if (static_cast<int64_t>(keys.size()) > K) {
        std::nth_element(keys.begin(), keys.begin() + (K - 1), keys.end(), std::greater<uint64_t>());
      }
      int32_t* out = p.topk + t * K;
      for (int64_t i = 0; i < n; ++i) out[i] = topk_rank_key_position(keys[i]);
      std::sort(out, out + n);
      for (int64_t i = n; i < K; ++i) out[i] = -1;
      // The merged row remapped to part local_part's local positions (topk_remap's rule).
      if (p.local_topk != nullptr) remap_row(out, n, K, S, I, p.local_part, p.local_topk + t * K);
    }
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu
