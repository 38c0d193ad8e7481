// Random test data from dsacp/random.h's splitmix64, as a function of (seed, index) so that a check can regenerate
// any element: the GPU tests' inputs.
#pragma once

#include <cstdint>

#include "dsacp/random.h"

namespace dsacp::testing {

// Uniform in [-1, 1), 24 random bits of splitmix64(seed * FNV prime + i).
inline float uniform_at(uint64_t seed, uint64_t i) {
  return static_cast<float>((splitmix64(seed * 0x100000001b3ull + i) >> 40) * (2.0 / 16777216.0) - 1.0);
}

}  // namespace dsacp::testing
