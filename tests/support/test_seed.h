// Seeds of the randomized tests. By default fixed (reproducible); DSACP_TEST_SEED=N shifts every seed by N, and
// DSACP_TEST_SEED=random picks a fresh N per process (printed once, so a failure can be replayed).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace dsacp::testing {

inline uint64_t test_seed_offset() {
  static const uint64_t offset = [] {
    const char* env = std::getenv("DSACP_TEST_SEED");
    if (env == nullptr || *env == '\0') return uint64_t{0};
    uint64_t v = 0;
    if (std::string(env) == "random") {
      v = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) % 1000000007ull;
    } else {
      v = std::strtoull(env, nullptr, 10);
    }
    std::fprintf(stderr, "[dsacp tests] DSACP_TEST_SEED=%llu\n", static_cast<unsigned long long>(v));
    return v;
  }();
  return offset;
}

// The seed a test uses: its fixed base, shifted by DSACP_TEST_SEED.
inline uint64_t test_seed(uint64_t base) { return base + 0x9e3779b97f4a7c15ull * test_seed_offset(); }

}  // namespace dsacp::testing
