// Counter-based random values: value = f(seed, stream, index), so any rank or thread can generate exactly
// its own shard of a tensor, and a verifier can regenerate any element without storing it.
#pragma once

#include <cstdint>

namespace dsacp {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t counter_hash(uint64_t seed, uint64_t stream, uint64_t index) {
  return splitmix64(splitmix64(seed ^ splitmix64(stream * 0x632be59bd9b4e019ull)) + index);
}

// Uniform in [-1, 1), 24 random bits.
inline float counter_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = counter_hash(seed, stream, index);
  return static_cast<float>(static_cast<double>(h >> 40) * (2.0 / 16777216.0) - 1.0);
}

}  // namespace dsacp
