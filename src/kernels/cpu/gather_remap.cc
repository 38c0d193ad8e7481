// Row gather (with f32/bf16 conversion) and the global-to-local top-k remap of context parallelism.
#include <limits>
#include <string>

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
      for (int64_t d = 0; d < dim; ++d) {
        const float v = src < 0 ? nan : load_as_f32(p.src, p.src_dtype, src * dim + d);
        store_from_f32(p.dst, p.dst_dtype, i * dim + d, v);
      }
    }
  });
  return Status::ok_status();
}

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
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* in = p.topk + r * p.K;
      int32_t* out = p.local + r * p.K;
      int32_t kept = 0;
      for (int32_t i = 0; i < p.K; ++i) {
        const int64_t e = in[i];
        if (e >= 0 && (e / I) % Pt == p.cr) out[kept++] = static_cast<int32_t>((e / (Pt * I)) * I + e % I);
      }
      for (int32_t i = kept; i < p.K; ++i) out[i] = -1;
    }
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu
