// FP8 e4m3 (the "fn" variant: no infinities, NaN = S.1111.111, max finite 448) and the quantization rules of the
// contract's section 6, written once for every backend: the functions are plain C++ (host) and, when a CUDA unit
// includes this header, device functions too, so the CPU oracle and the GPU kernels quantize bit-identically.
//
// Conversion f32 -> e4m3: round to nearest, ties to even; |x| > 448 (infinities included) saturates to +-448
// (PTX cvt.rn.satfinite.e4m3x2.f32); NaN -> NaN (0x7f with the sign).
// Scale of a group of values (a token's indexer key, a 128-value tile of a latent), from amax = the largest |x|
// over the group's finite values (NaN and infinities do not enter amax: they stay NaN / saturate):
//   kFp32:  scale = max(amax / 448, 2^-126)
//   kUe8m0: scale = 2^ceil(log2(max(amax / 448, 2^-126)))  (a power of two: exact, no log2 is evaluated)
// quantized value = e4m3(x / scale) (IEEE f32 division); dequantized value = scale * float(e4m3).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSACP_HD __host__ __device__ __forceinline__
#else
#define DSACP_HD inline
#endif

namespace dsacp {

enum class Fp8ScaleMode : uint8_t { kFp32, kUe8m0 };

inline constexpr float kE4m3Max = 448.f;
inline constexpr uint8_t kE4m3NaN = 0x7f;

DSACP_HD uint32_t fp8_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
DSACP_HD float fp8_bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// f32 -> e4m3 bits, round to nearest even, saturating (see above).
DSACP_HD uint8_t f32_to_e4m3(float f) {
  const uint32_t u = fp8_f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | kE4m3NaN);
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // |x| >= 448 (and infinities)
  if (a < 0x3c800000u) {                                              // |x| < 2^-6: subnormal, step 2^-9
    const float s = fp8_bits_f32(a) * 512.f;                          // exact; s < 8
    uint32_t n = static_cast<uint32_t>(s);
    const float frac = s - static_cast<float>(n);
    if (frac > 0.5f || (frac == 0.5f && (n & 1u) != 0u)) ++n;  // n == 8 is the smallest normal, 0x08
    return static_cast<uint8_t>(sign | n);
  }
  // normal: keep exponent + 3 mantissa bits, round the 20 dropped bits to nearest even, rebias 127 -> 7
  uint32_t q = a >> 20;
  const uint32_t rem = a & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (q & 1u) != 0u)) ++q;
  return static_cast<uint8_t>(sign | (q - ((127u - 7u) << 3)));
}

// e4m3 bits -> f32 (exact).
DSACP_HD float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
  if (e == 15u && m == 7u) return fp8_bits_f32(sign | 0x7fc00000u);
  if (e == 0u) return fp8_bits_f32(sign | fp8_f32_bits(static_cast<float>(m) * 0.001953125f));
  return fp8_bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// |x| for amax: 0 for NaN and infinities (they do not enter the scale).
DSACP_HD float fp8_amax_term(float x) {
  const uint32_t a = fp8_f32_bits(x) & 0x7fffffffu;
  return a >= 0x7f800000u ? 0.f : fp8_bits_f32(a);
}

// The scale of a group whose amax (over finite |x|) is `amax`.
DSACP_HD float fp8_scale_from_amax(float amax, Fp8ScaleMode mode) {
  const float min_scale = 1.1754943508222875e-38f;  // 2^-126
  float s = amax / kE4m3Max;
  if (!(s > min_scale)) s = min_scale;
  if (mode == Fp8ScaleMode::kUe8m0) {
    const uint32_t u = fp8_f32_bits(s);
    if ((u & 0x007fffffu) != 0u) s = fp8_bits_f32((u & 0x7f800000u) + 0x00800000u);  // next power of two
  }
  return s;
}

DSACP_HD uint8_t fp8_quantize(float x, float scale) { return f32_to_e4m3(x / scale); }
DSACP_HD float fp8_dequantize(uint8_t v, float scale) { return scale * e4m3_to_f32(v); }

// A scale a caller hands over (case file, already-quantized rows) is usable iff it is positive and finite.
DSACP_HD bool fp8_scale_ok(float s) { return s > 0.f && s <= 3.4028234663852886e38f; }

// The FP8 indexer-key page (contract section 6; vLLM / DeepGEMM / TensorRT-LLM layout): a page of page_size tokens
// holds page_size * Di e4m3 values (token-major) first, then page_size f32 scales. 132 bytes a token for Di = 128.
DSACP_HD int64_t fp8_index_page_bytes(int32_t page_size, int32_t Di) {
  return static_cast<int64_t>(page_size) * (Di + 4);
}
// Byte offsets, from the pool's start, of slot (page, offset)'s values and of its scale; page_stride: bytes from
// one page to the next (0: dense, fp8_index_page_bytes).
DSACP_HD int64_t fp8_index_value_offset(int64_t page, int32_t offset, int32_t page_size, int32_t Di,
                                        int64_t page_stride = 0) {
  return page * (page_stride > 0 ? page_stride : fp8_index_page_bytes(page_size, Di)) + static_cast<int64_t>(offset) * Di;
}
DSACP_HD int64_t fp8_index_scale_offset(int64_t page, int32_t offset, int32_t page_size, int32_t Di,
                                        int64_t page_stride = 0) {
  return page * (page_stride > 0 ? page_stride : fp8_index_page_bytes(page_size, Di)) +
         static_cast<int64_t>(page_size) * Di + static_cast<int64_t>(offset) * 4;
}

// The fp8_ds_mla latent record (contract section 6; vLLM's / FlashMLA's layout): one record of
// fp8_ds_mla_record_bytes(Dl, Dr) bytes a token holds the latent and the rope key together: Dl e4m3 latent
// values, then Dl / 128 f32 scales (value i uses scale i / 128), then Dr bf16 rope values. Dl = 512, Dr = 64:
// 512 + 16 + 128 = 656 bytes. Records are contiguous in a page (record of slot s at s * record_bytes).
inline constexpr int32_t kFp8DsMlaTile = 128;
DSACP_HD int32_t fp8_ds_mla_record_bytes(int32_t Dl, int32_t Dr) { return Dl + 4 * (Dl / kFp8DsMlaTile) + 2 * Dr; }
// Byte offsets inside a record: the scales, and the rope values.
DSACP_HD int32_t fp8_ds_mla_scale_offset(int32_t Dl) { return Dl; }
DSACP_HD int32_t fp8_ds_mla_rope_offset(int32_t Dl) { return Dl + 4 * (Dl / kFp8DsMlaTile); }

}  // namespace dsacp
