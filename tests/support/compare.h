// Comparators of the GPU tests' outputs against the CPU oracle's.
#pragma once

#include <cmath>
#include <vector>

namespace dsacp::testing {

// ||a - ref|| / ||ref|| over the entries finite in both (||a - ref|| when ref is zero). *mismatch is set (never
// cleared) when the sizes differ or an entry is finite in one and not in the other.
inline double rel_error_finite(const std::vector<float>& a, const std::vector<float>& ref, bool* mismatch) {
  double num = 0, den = 0;
  if (a.size() != ref.size()) *mismatch = true;
  for (size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    const bool fa = std::isfinite(a[i]), fr = std::isfinite(ref[i]);
    if (fa != fr) *mismatch = true;
    if (!fa || !fr) continue;
    num += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace dsacp::testing
