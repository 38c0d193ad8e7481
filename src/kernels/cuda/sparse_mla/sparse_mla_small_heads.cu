// Sparse MLA for head groups of 16 (H <= 16 a head block) as a memory-streaming kernel: a decode of few heads does
// little math on each gathered key row (16 heads x 576), so what bounds it is how many bytes are in flight.
//
// One CTA = (token, 16-head group, key split); 160 threads, two CTAs an SM:
//   producer warp  one lane a key: the key's row goes into a ring of 32-key tiles by Hopper bulk copies
//                  (cp.async.bulk global -> shared, completing on the stage's `full` mbarrier with expect_tx; no
//                  thread waits for the bytes): bf16 pools, 2 stages of [32, 1152 + 16 pad] (latent 1024 B, rope
//                  128 B); fp8_ds_mla records, 3 stages of [32, 656] records as stored. An absent key (past the
//                  split's used entries, a bad page) is zero-filled. The lane refills a stage once the four math
//                  warps have released it (`empty` mbarrier).
//   4 math warps   warp w owns latent tile w (dims 128w .. 128w + 127) and rope k-step w: S = Q K^T is computed
//                  in four partial sums over d (warp w: 8 latent k-steps + 1 rope k-step of mma.sync m16n8k16,
//                  its Q fragments in registers), added in a fixed order by the softmax; O [16, 512] is held as
//                  [16, 128] a warp (columns of tile w), so every warp reads only its own 256 (bf16) or 128 (fp8)
//                  latent bytes of a key. The heads are the 16 rows (H < 16: the missing rows run on zero q and
//                  are not stored; the keys are read once, as for 16).
// fp8_ds_mla: no value is dequantized to bf16. e4m3 -> f16 is exact; QK^T runs f16 x f16 on the raw values with Q
// scaled per (row, tile) by a power of two into f16 range, and the tile's scale multiplies the partial sum. For
// P V the tile scale of each key (the reduction dim) goes into P: warp w's A operand is P' = P * s_w(key) / sigma
// (f16, <= 1), sigma a running max per row kept with the softmax's (O is stored in units of sigma and rescaled
// by alpha * sigma_old / sigma_new); V is the raw tile converted to f16 once, by the QK^T pass, into the warp's
// own swizzled buffer. So the result carries only f32-accumulation and f16-operand rounding (below the bf16 bound).
// The epilogue, split-K (merge kernel or cluster merge) and LSE are the mma.sync kernel's (sparse_mla_args.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/common/mbarrier_sm90.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_merge.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kMathWarps = 4;
constexpr int kMathThreads = kMathWarps * 32;
constexpr int kThreads = kMathThreads + 32;  // + the producer warp
constexpr int kBN = 32;                      // keys a tile
constexpr int kSStride = kBN + 8;            // f32 S / P row stride (floats)
constexpr int kPStride = kBN + 8;            // bf16 P row stride (80-byte rows: conflict-free ldmatrix)
constexpr int kBf16Row = 1152 + 16;          // a bf16 key row in the ring (1168 = 16 mod 128: conflict-free)
constexpr int kRecRow = 656;                 // an fp8_ds_mla record (656 = 16 mod 128)
constexpr int kBufRow = 256;                 // fp8: a key's 128 f16 of the warp's tile (chunks swizzled)
constexpr float kLn2 = 0.6931471805599453f;

template <bool kFp8>
struct SmallLayout {
  static constexpr int kRow = kFp8 ? kRecRow : kBf16Row;
  static constexpr int kStages = kFp8 ? 3 : 2;
  static constexpr int kStage = kBN * kRow;
  static constexpr int kOffBuf = kStages * kStage;  // fp8: [4 warps][32 keys][kBufRow]
  static constexpr int kOffS = kOffBuf + (kFp8 ? kMathWarps * kBN * kBufRow : 0);  // [4][16][kSStride] f32
  static constexpr int kOffP = kOffS + kMathWarps * 16 * kSStride * 4;  // fp8 [16][kSStride] f32, bf16 [16][kPStride]
  static constexpr int kOffStats = kOffP + (kFp8 ? 16 * kSStride * 4 : 16 * kPStride * 2);  // alpha, l, m: [3][16]
  static constexpr int kOffBar = kOffStats + 3 * 16 * 4;                // full[kStages], empty[kStages]
  static constexpr int kOffMisc = kOffBar + 2 * kStages * 8;
  static constexpr int kOffRow = kOffMisc + 16;                         // [split_len] i32
  static int bytes(int split_len) { return kOffRow + (split_len + 3) / 4 * 16; }
  static_assert(kOffBar % 16 == 0 && kOffBuf % 16 == 0, "alignment");
  static_assert(mla_cluster_merge_bytes(16) <= kOffBuf, "the cluster merge's rows fit in the ring");
};

// One bulk copy global -> this CTA's shared memory (16-byte aligned, a multiple of 16 bytes), completing on bar.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
// d += a * b, m16n8k16, f16 operands, f32 accumulate.
__device__ __forceinline__ void mma_f16_16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two e4m3 (the low byte the low half) as two f16, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v) {
  uint32_t r;
  const unsigned short h = static_cast<unsigned short>(v & 0xffffu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
  return r;
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// The fp8 buffer's physical 16-byte chunk of logical chunk c (0..15) of key row r: conflict-free both for the
// QK^T pass's stores (lanes: rows 8j + lane / 4, chunks 4 (lane % 4) + i) and for ldmatrix.trans of 8 rows.
__device__ __forceinline__ int buf_chunk(int r, int c) {
  const int f = (r & 4) | ((r & 1) << 1) | ((r >> 1) & 1);
  return c ^ f ^ ((c >> 3) & 1);
}
// 2^e with m * 2^e in [2^13, 2^14) (1 for m = 0), and 2^-e.
__device__ __forceinline__ void f16_row_scale(float m, float& f, float& inv) {
  int e = 0;
  if (m > 0.f) {
    int ex;
    frexpf(m, &ex);
    e = min(126, max(-126, 14 - ex));
  }
  f = __int_as_float((e + 127) << 23);
  inv = __int_as_float((127 - e) << 23);
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 2) sparse_mla_small_heads_kernel(const MlaArgs a) {
  using L = SmallLayout<kFp8>;
  constexpr int kStages = L::kStages;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t ring = smem_u32(smem);
  float* sS = reinterpret_cast<float*>(smem + L::kOffS);
  float* sAlpha = reinterpret_cast<float*>(smem + L::kOffStats);
  float* sL = sAlpha + 16;
  float* sM = sAlpha + 32;
  const uint32_t bar0 = smem_u32(smem + L::kOffBar);
  int32_t* sMisc = reinterpret_cast<int32_t*>(smem + L::kOffMisc);
  int32_t* sRow = reinterpret_cast<int32_t*>(smem + L::kOffRow);
  auto full = [&](int s) { return bar0 + 8u * s; };
  auto empty = [&](int s) { return bar0 + 8u * (kStages + s); };

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = mla_cta_token(a, 16);
  const int h0 = mla_cta_head0(a, 16);
  const int nh = mla_cta_heads(a, 16);
  const int split = blockIdx.z;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 32);
      mbar_init(empty(s), kMathWarps);
    }
    fence_mbarrier_init_cluster();
  }
  // ---- prologue: used entries, this split's cache rows (its barriers also order the barrier inits) ----
  const MlaSplitKeys keys = mla_split_keys<kThreads>(a, t, split, &sMisc[0]);
  const int nkeys = keys.nkeys;
  for (int i = tid; i < nkeys; i += kThreads) sRow[i] = mla_cache_row(a, keys, t, i);
  __syncthreads();
  const int ntiles = (nkeys + kBN - 1) / kBN;

  const int g = lane >> 2, q = lane & 3, w = warp;
  const int sr = tid >> 3, sk = (tid & 7) * 4;  // softmax: row, first key of the thread's four
  float m_run = -INFINITY, l_run = 0.f;
  float sig0 = 0.f, sig1 = 0.f;  // fp8: rows g, g + 8's P' normalization
  float o[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  if (warp == kMathWarps) {
    // ---- producer: one key row a lane, bulk copies into the ring ----
    // bf16 latent then rope in one row (ExternalPools::kv, vLLM's 576-wide layout): one 1152-byte copy a key.
    const bool one_row =
        !kFp8 && a.rope == a.latent + 512 && a.rope_unit == a.latent_unit && a.rope_stride == a.latent_stride;
    for (int tile = 0; tile < ntiles; ++tile) {
      const int s = tile % kStages;
      if (tile >= kStages) mbar_wait(empty(s), ((tile / kStages) - 1) & 1);
      const int key = tile * kBN + lane;
      const int32_t row = key < nkeys ? sRow[key] : -1;
      const uint32_t dst = ring + s * L::kStage + lane * L::kRow;
      if (row >= 0) {
        if constexpr (kFp8) {
          mbar_arrive_expect_tx(full(s), kRecRow);
          bulk_g2s(dst, mla_record(a, row), kRecRow, full(s));
        } else {
          mbar_arrive_expect_tx(full(s), 1152);
          if (one_row) {
            bulk_g2s(dst, mla_latent_row(a, row), 1152, full(s));
          } else {
            bulk_g2s(dst, mla_latent_row(a, row), 1024, full(s));
            bulk_g2s(dst + 1024, mla_rope_row(a, row), 128, full(s));
          }
        }
      } else {
        constexpr int kData = kFp8 ? kRecRow : 1152;
        for (int b = 0; b < kData; b += 16) sts128(dst + b, 0u, 0u, 0u, 0u);
        fence_proxy_async_smem();  // before a later bulk copy into the row
        mbar_arrive(full(s));
      }
    }
  } else {
    // ---- math warps: Q fragments (rows g, g + 8; rows from nh on are zero) ----
    const bool v0 = g < nh, v1 = g + 8 < nh;
    const int64_t qrow0 = mla_head_row(a, t, h0 + (v0 ? g : 0)), qrow1 = mla_head_row(a, t, h0 + (v1 ? g + 8 : 0));
    const __nv_bfloat16* qn0 = a.q_nope + qrow0 * 512;
    const __nv_bfloat16* qn1 = a.q_nope + qrow1 * 512;
    const __nv_bfloat16* qp0 = a.q_rope + qrow0 * 64;
    const __nv_bfloat16* qp1 = a.q_rope + qrow1 * 64;
    auto ld32 = [](const __nv_bfloat16* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); };
    uint32_t qa[8][4], qr[4];
    float qinv0 = 1.f, qinv1 = 1.f;
    {
      const int d = 16 * w + 2 * q;
      qr[0] = v0 ? ld32(qp0 + d) : 0u;
      qr[1] = v1 ? ld32(qp1 + d) : 0u;
      qr[2] = v0 ? ld32(qp0 + d + 8) : 0u;
      qr[3] = v1 ? ld32(qp1 + d + 8) : 0u;
    }
    if constexpr (!kFp8) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int d = 128 * w + 16 * i + 2 * q;
        qa[i][0] = v0 ? ld32(qn0 + d) : 0u;
        qa[i][1] = v1 ? ld32(qn1 + d) : 0u;
        qa[i][2] = v0 ? ld32(qn0 + d + 8) : 0u;
        qa[i][3] = v1 ? ld32(qn1 + d + 8) : 0u;
      }
    } else {
      // Thread q's 32 values of the tile, d = 128 w + 32 q + j; k-step i takes j = 4i .. 4i + 3 (slots 2q, 2q + 1
      // and 2q + 8, 2q + 9), the same permutation the key side uses.
      uint32_t w0[16], w1[16];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        const uint4 x0 = v0 ? __ldg(reinterpret_cast<const uint4*>(qn0 + 128 * w + 32 * q + 8 * k)) : z;
        const uint4 x1 = v1 ? __ldg(reinterpret_cast<const uint4*>(qn1 + 128 * w + 32 * q + 8 * k)) : z;
        w0[4 * k] = x0.x, w0[4 * k + 1] = x0.y, w0[4 * k + 2] = x0.z, w0[4 * k + 3] = x0.w;
        w1[4 * k] = x1.x, w1[4 * k + 1] = x1.y, w1[4 * k + 2] = x1.z, w1[4 * k + 3] = x1.w;
      }
      float m0 = 0.f, m1 = 0.f;
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const float2 a0 = bf16x2_to_float2(w0[k]), a1 = bf16x2_to_float2(w1[k]);
        m0 = fmaxf(m0, fmaxf(fabsf(a0.x), fabsf(a0.y)));
        m1 = fmaxf(m1, fmaxf(fabsf(a1.x), fabsf(a1.y)));
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, off));
        m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, off));
      }
      float f0, f1;
      f16_row_scale(m0, f0, qinv0);
      f16_row_scale(m1, f1, qinv1);
      auto cv = [](uint32_t x, float f) {
        const float2 v = bf16x2_to_float2(x);
        return pack_f16x2(v.x * f, v.y * f);
      };
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        qa[i][0] = cv(w0[2 * i], f0);
        qa[i][1] = cv(w1[2 * i], f1);
        qa[i][2] = cv(w0[2 * i + 1], f0);
        qa[i][3] = cv(w1[2 * i + 1], f1);
      }
    }
    const uint32_t buf = smem_u32(smem + L::kOffBuf + w * kBN * kBufRow);  // fp8
    const uint32_t sPu = smem_u32(smem + L::kOffP);
    float* sPf = reinterpret_cast<float*>(smem + L::kOffP);
    __nv_bfloat16* sPb = reinterpret_cast<__nv_bfloat16*>(smem + L::kOffP);

    for (int tile = 0; tile < ntiles; ++tile) {
      const int s = tile % kStages;
      mbar_wait(full(s), (tile / kStages) & 1);
      const uint32_t slot = ring + s * L::kStage;
      // ---- partial S = Q K^T over tile w's dims (+ rope k-step w) ----
      float acc[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      constexpr int kRopeOff = kFp8 ? 528 : 1024;
      const int xcol = 16 * ((lane >> 3) & 1);  // ldmatrix x4: (keys, +0), (keys, +16), (keys + 8, +0), (keys + 8, +16)
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const uint32_t rowa = slot + (16 * p + 8 * (lane >> 4) + (lane & 7)) * L::kRow + xcol;
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(rowa + kRopeOff + 32 * w, b0, b1, b2, b3);
        mma_bf16_16816(acc[2 * p], qr, b0, b1);
        mma_bf16_16816(acc[2 * p + 1], qr, b2, b3);
        if constexpr (!kFp8) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            ldmatrix_x4(rowa + 256 * w + 32 * i, b0, b1, b2, b3);
            mma_bf16_16816(acc[2 * p], qa[i], b0, b1);
            mma_bf16_16816(acc[2 * p + 1], qa[i], b2, b3);
          }
        }
      }
      float sc[4][2];  // fp8: tile w's scales of keys 8j + 2q + e
      if constexpr (kFp8) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          sc[j][0] = lds_f32(slot + (8 * j + 2 * q) * kRecRow + 512 + 4 * w);
          sc[j][1] = lds_f32(slot + (8 * j + 2 * q + 1) * kRecRow + 512 + 4 * w);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = 8 * j + g;
          const uint32_t src = slot + r * kRecRow + 128 * w + 32 * q;
          const uint4 x0 = lds128(src), x1 = lds128(src + 16);
          const uint32_t wd[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
          uint32_t hv[16];
          float al[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            hv[2 * i] = e4m3x2_to_f16x2(wd[i]);
            hv[2 * i + 1] = e4m3x2_to_f16x2(wd[i] >> 16);
            mma_f16_16816(al, qa[i], hv[2 * i], hv[2 * i + 1]);
          }
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            sts128(buf + r * kBufRow + buf_chunk(r, 4 * q + c) * 16, hv[4 * c], hv[4 * c + 1], hv[4 * c + 2],
                   hv[4 * c + 3]);
          }
          acc[j][0] += al[0] * sc[j][0] * qinv0;
          acc[j][1] += al[1] * sc[j][1] * qinv0;
          acc[j][2] += al[2] * sc[j][0] * qinv1;
          acc[j][3] += al[3] * sc[j][1] * qinv1;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));  // every read of the stage is done (values, scales, rope)
      }
      {
        float* dst = sS + w * 16 * kSStride;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = 8 * j + 2 * q;
          *reinterpret_cast<float2*>(&dst[g * kSStride + c]) = make_float2(acc[j][0], acc[j][1]);
          *reinterpret_cast<float2*>(&dst[(g + 8) * kSStride + c]) = make_float2(acc[j][2], acc[j][3]);
        }
      }
      named_bar_sync(1, kMathThreads);

      // ---- online softmax (log2 domain): thread -> row sr, keys sk .. sk + 3 ----
      {
        float sv[4];
        float mx = -INFINITY;
        const float4 p0 = *reinterpret_cast<const float4*>(&sS[(0 * 16 + sr) * kSStride + sk]);
        const float4 p1 = *reinterpret_cast<const float4*>(&sS[(1 * 16 + sr) * kSStride + sk]);
        const float4 p2 = *reinterpret_cast<const float4*>(&sS[(2 * 16 + sr) * kSStride + sk]);
        const float4 p3 = *reinterpret_cast<const float4*>(&sS[(3 * 16 + sr) * kSStride + sk]);
        const float dots[4] = {((p0.x + p1.x) + p2.x) + p3.x, ((p0.y + p1.y) + p2.y) + p3.y,
                               ((p0.z + p1.z) + p2.z) + p3.z, ((p0.w + p1.w) + p2.w) + p3.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = tile * kBN + sk + i;
          const bool valid = key < nkeys && sRow[key] >= 0;
          sv[i] = valid ? dots[i] * a.scale_log2 : -INFINITY;
          mx = fmaxf(mx, sv[i]);
        }
#pragma unroll
        for (int off = 1; off <= 4; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_new = fmaxf(m_run, mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = exp2_ftz(m_run - m_use);
        float pv[4], psum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          pv[i] = exp2_ftz(sv[i] - m_use);
          psum += pv[i];
        }
#pragma unroll
        for (int off = 1; off <= 4; off <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
        l_run = l_run * alpha + psum;
        m_run = m_new;
        if constexpr (kFp8) {
          *reinterpret_cast<float4*>(&sPf[sr * kSStride + sk]) = make_float4(pv[0], pv[1], pv[2], pv[3]);
        } else {
          *reinterpret_cast<uint2*>(&sPb[sr * kPStride + sk]) = make_uint2(pack_bf16x2(pv[0], pv[1]),
                                                                            pack_bf16x2(pv[2], pv[3]));
        }
        if ((tid & 7) == 0) sAlpha[sr] = alpha;
      }
      named_bar_sync(1, kMathThreads);

      // ---- O = alpha O + P V over the warp's 128 columns ----
      const float al0 = sAlpha[g], al1 = sAlpha[g + 8];
      const int vkey = (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix.trans x4: (keys, cols), (keys + 8, cols),
      const int vcol = lane >> 4;                            // (keys, cols + 8), (keys + 8, cols + 8)
      if constexpr (!kFp8) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[i][0] *= al0;
          o[i][1] *= al0;
          o[i][2] *= al1;
          o[i][3] *= al1;
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          uint32_t af[4];
          ldmatrix_x4(sPu + ((lane & 15) * kPStride + kk * 16 + (lane >> 4) * 8) * 2, af[0], af[1], af[2], af[3]);
#pragma unroll
          for (int np = 0; np < 8; ++np) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4_trans(slot + (kk * 16 + vkey) * kBf16Row + 256 * w + (np * 16 + vcol * 8) * 2, b0, b1, b2, b3);
            mma_bf16_16816(o[2 * np], af, b0, b1);
            mma_bf16_16816(o[2 * np + 1], af, b2, b3);
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));
      } else {
        // P' = P * s_w(key) / sigma (rows g, g + 8; keys 8j + 2q + e)
        float x0[4][2], x1[4][2];
        float t0 = 0.f, t1 = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 pa = *reinterpret_cast<const float2*>(&sPf[g * kSStride + 8 * j + 2 * q]);
          const float2 pb = *reinterpret_cast<const float2*>(&sPf[(g + 8) * kSStride + 8 * j + 2 * q]);
          x0[j][0] = pa.x * sc[j][0];
          x0[j][1] = pa.y * sc[j][1];
          x1[j][0] = pb.x * sc[j][0];
          x1[j][1] = pb.y * sc[j][1];
          t0 = fmaxf(t0, fmaxf(x0[j][0], x0[j][1]));
          t1 = fmaxf(t1, fmaxf(x1[j][0], x1[j][1]));
        }
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
          t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, off));
          t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, off));
        }
        const float n0 = fmaxf(al0 * sig0, t0), n1 = fmaxf(al1 * sig1, t1);
        const float i0 = n0 > 0.f ? 1.f / n0 : 0.f, i1 = n1 > 0.f ? 1.f / n1 : 0.f;
        const float f0 = al0 * sig0 * i0, f1 = al1 * sig1 * i1;
        sig0 = n0;
        sig1 = n1;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[i][0] *= f0;
          o[i][1] *= f0;
          o[i][2] *= f1;
          o[i][3] *= f1;
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          const uint32_t af[4] = {pack_f16x2(x0[2 * kk][0] * i0, x0[2 * kk][1] * i0),
                                  pack_f16x2(x1[2 * kk][0] * i1, x1[2 * kk][1] * i1),
                                  pack_f16x2(x0[2 * kk + 1][0] * i0, x0[2 * kk + 1][1] * i0),
                                  pack_f16x2(x1[2 * kk + 1][0] * i1, x1[2 * kk + 1][1] * i1)};
          const int r = kk * 16 + vkey;
#pragma unroll
          for (int np = 0; np < 8; ++np) {
            uint32_t b0, b1, b2, b3;
            ldmatrix_x4_trans(buf + r * kBufRow + buf_chunk(r, np * 2 + vcol) * 16, b0, b1, b2, b3);
            mma_f16_16816(o[2 * np], af, b0, b1);
            mma_f16_16816(o[2 * np + 1], af, b2, b3);
          }
        }
        __syncwarp();  // the buffer is rewritten by the next tile's QK^T pass
      }
    }
  }

  // ---- epilogue ----
  mla_allow_dependents();
  if (warp < kMathWarps && (tid & 7) == 0) {
    sL[sr] = l_run;
    sM[sr] = m_run;
  }
  __syncthreads();  // the stats, and every read of the ring: the cluster merge's rows go over it
  float* smem_part = reinterpret_cast<float*>(smem);
  if (warp < kMathWarps) {
    const float l0 = sL[g], l1 = sL[g + 8];
    const float s0 = kFp8 ? sig0 : 1.f, s1 = kFp8 ? sig1 : 1.f;
    const float inv0 = l0 > 0.f ? s0 / l0 : 0.f, inv1 = l1 > 0.f ? s1 / l1 : 0.f;
    const bool st0 = g < nh, st1 = g + 8 < nh;
    const int64_t row0 = mla_out_row(a, t, h0, g), row1 = mla_out_row(a, t, h0, g + 8);
    mla_with_out_rows(a, split, smem_part, [&](auto* out) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int c = 128 * w + 8 * i + 2 * q;
        if (st0) mla_store_pair(out + row0 * 512 + c, o[i][0] * inv0, o[i][1] * inv0);
        if (st1) mla_store_pair(out + row1 * 512 + c, o[i][2] * inv1, o[i][3] * inv1);
      }
    });
    if (tid < nh) {
      const float l = sL[tid];
      mla_lse_rows(a, split, smem_part, 16)[mla_out_row(a, t, h0, tid)] =
          l > 0.f ? (sM[tid] + log2f(l)) * kLn2 : -INFINITY;
    }
  }
  mla_cluster_merge<16, kThreads>(a, t, h0, smem_part, nh);
}

template <bool kFp8>
Status launch_small(const MlaArgs& a, int groups, const LaunchContext& ctx) {
  return launch_mla_grid(sparse_mla_small_heads_kernel<kFp8>,
                         kFp8 ? "sparse_mla_small_heads_kernel (fp8_ds_mla)" : "sparse_mla_small_heads_kernel", a,
                         groups, kThreads, SmallLayout<kFp8>::bytes(a.split_len), ctx.stream);
}

}  // namespace

Status launch_sparse_mla_small_heads(const MlaArgs& a, int groups, const LaunchContext& ctx) {
  return a.record_bytes > 0 ? launch_small<true>(a, groups, ctx) : launch_small<false>(a, groups, ctx);
}

}  // namespace dsacp::cuda
