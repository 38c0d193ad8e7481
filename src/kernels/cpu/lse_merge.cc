// lse_merge: exact merge of partial attention results over disjoint key sets by their log-sum-exp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/parallel.h"
#include "dsacp/dtype.h"
#include "kernels/cpu/cpu_kernels.h"

namespace dsacp::cpu {

Status lse_merge(const LseMergeParams& p, int num_threads) {
  const int64_t rows = p.num_rows;
  const int64_t dl = p.Dl;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  parallel_for(rows, num_threads, 64, [&](int64_t begin, int64_t end) {
    // Sums go to a row buffer first, so `out` may alias one of the parts (an in-place merge).
    std::vector<float> acc(static_cast<size_t>(dl));
    for (int64_t r = begin; r < end; ++r) {
      // A part with a NaN or infinite LSE holds no keys (or is broken): it counts as -inf, weight 0.
      double max_lse = neg_inf;
      for (int32_t s = 0; s < p.num_parts; ++s) {
        const float l = lse_merge_part_lse(p, s)[r];
        if (std::isfinite(l)) max_lse = std::max(max_lse, static_cast<double>(l));
      }
      if (max_lse == neg_inf) {
        for (int64_t d = 0; d < dl; ++d) store_from_f32(p.out, p.out_dtype, r * dl + d, 0.f);
        p.lse[r] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      for (int32_t s = 0; s < p.num_parts; ++s) {
        const float l = lse_merge_part_lse(p, s)[r];
        if (std::isfinite(l)) sum += std::exp(static_cast<double>(l) - max_lse);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // Parts in a fixed order; a part with weight 0 is skipped, so NaN in its out never leaks.
      for (int32_t s = 0; s < p.num_parts; ++s) {
        const float l = lse_merge_part_lse(p, s)[r];
        if (!std::isfinite(l)) continue;
        const float w = static_cast<float>(std::exp(static_cast<double>(l) - max_lse) / sum);
        const void* part_rows = lse_merge_part_out(p, s, dtype_size(p.part_dtype));
        const int64_t base = r * dl;
        if (p.part_dtype == DType::kF32) {
          const float* part = static_cast<const float*>(part_rows) + base;
          for (int64_t d = 0; d < dl; ++d) acc[d] += w * part[d];
        } else {
          for (int64_t d = 0; d < dl; ++d) acc[d] += w * load_as_f32(part_rows, p.part_dtype, base + d);
        }
      }
      for (int64_t d = 0; d < dl; ++d) store_from_f32(p.out, p.out_dtype, r * dl + d, acc[d]);
      p.lse[r] = static_cast<float>(max_lse + std::log(sum));
    }
  });
  return Status::ok_status();
}

}  // namespace dsacp::cpu
