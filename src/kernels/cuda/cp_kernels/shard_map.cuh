// The KV sharding's position maps on the device, for the CP kernels (the candidate merge, the top-k remap).
#pragma once

#include <cstdint>

namespace dsacp::cuda {

// KvSharding's maps (S parts, interleave I) in 32-bit arithmetic (positions are int32; a 64-bit division costs
// ~70 instructions and ran for every candidate): local position l of part s -> global, global -> local, global -> part.
// Shifts when the interleave is a power of two (the page size, by default).
struct ShardMap {
  uint32_t S, I, shift;
  bool pow2;
  __device__ ShardMap(int parts, int64_t interleave)
      : S(static_cast<uint32_t>(parts)), I(static_cast<uint32_t>(interleave)), shift(0),
        pow2((interleave & (interleave - 1)) == 0) {
    while ((uint32_t{1} << shift) < I) ++shift;
  }
  __device__ __forceinline__ uint32_t div_i(uint32_t x) const { return pow2 ? x >> shift : x / I; }
  __device__ __forceinline__ uint32_t mod_i(uint32_t x) const { return pow2 ? x & (I - 1) : x % I; }
  __device__ __forceinline__ int32_t global(int32_t l, int s) const {
    const uint32_t u = static_cast<uint32_t>(l);
    return static_cast<int32_t>((div_i(u) * S + static_cast<uint32_t>(s)) * I + mod_i(u));
  }
  __device__ __forceinline__ int32_t local(int32_t g) const {
    const uint32_t u = static_cast<uint32_t>(g), unit = div_i(u);
    return static_cast<int32_t>((unit / S) * I + mod_i(u));
  }
  __device__ __forceinline__ int part(int32_t g) const { return static_cast<int>(div_i(static_cast<uint32_t>(g)) % S); }
};

}  // namespace dsacp::cuda
