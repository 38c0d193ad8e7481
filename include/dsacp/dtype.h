// Element types dsacp stores: f32, bf16 (round-to-nearest-even from f32), i32, and FP8 e4m3 (dsacp/fp8.h: the
// indexer keys and queries, the fp8_ds_mla latent record; always with f32 scales beside it).
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include "dsacp/status.h"

namespace dsacp {

enum class DType : uint8_t { kF32, kBF16, kI32, kF8E4M3 };

inline size_t dtype_size(DType t) { return t == DType::kBF16 ? 2 : t == DType::kF8E4M3 ? 1 : 4; }
// safetensors spelling: "F32", "BF16", "I32", "F8_E4M3".
const char* dtype_name(DType t);
Result<DType> dtype_from_name(std::string_view name);

// bfloat16 stored as its raw 16 bits.
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest, ties to even. NaN stays NaN (quiet), infinities stay infinities.
inline bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  }
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// The value f would have after a round trip through bf16.
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// Reads element i of a buffer of f32 or bf16 as float.
inline float load_as_f32(const void* data, DType t, int64_t i) {
  if (t == DType::kBF16) return bf16_to_f32(static_cast<const bf16*>(data)[i]);
  return static_cast<const float*>(data)[i];
}
inline void store_from_f32(void* data, DType t, int64_t i, float v) {
  if (t == DType::kBF16) {
    static_cast<bf16*>(data)[i] = f32_to_bf16(v);
  } else {
    static_cast<float*>(data)[i] = v;
  }
}

}  // namespace dsacp
