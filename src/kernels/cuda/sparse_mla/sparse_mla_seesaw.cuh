// The per-warpgroup softmax steps of the warp-specialized sparse MLA kernels (sparse_mla_wgmma_ws.cu, 64-key
// tiles; sparse_mla_wgmma_ws32.cu, 32-key tiles), FlashMLA's seesaw: WG0 scores tile 0 of a pair, WG1 tile 1;
// WG0 publishes max(m, its tile's max), WG1 folds in its tile and publishes the pair's max, WG0 later rescales to
// it. Scores s[] are one warpgroup's m64nK accumulator for K = kKeys keys: s[4 j + e] (e = 0, 1) is row r0 and
// s[4 j + 2 + e] row r1 (r0 = 16 (warp % 4) + lane / 4, r1 = r0 + 8), key 8 j + 2 (lane % 4) + e; the row
// statistics are in the log2 domain.
#pragma once

#include <cstdint>

#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_sm90.cuh"

namespace dsacp::cuda {

// What seesaw_mask_rowmax leaves the scores to be multiplied by: the scale when positive, else 1 (scaled already).
__device__ __forceinline__ float seesaw_score_scale(float scale_log2) { return scale_log2 > 0.f ? scale_log2 : 1.f; }

// Mask absent keys (rows[key] < 0: past the used entries, bad pages) to -inf and return the tile's row maxima
// (mx0, mx1) of this thread's two rows in the log2 domain, reduced over the quad. With a positive scale the scores
// stay raw (seesaw_exp_rowsum folds the scale into its exponent: one FFMA a score instead of a multiply, a select
// and a subtract); otherwise they are scaled here and the fold uses 1. A tile whose keys are all present (the
// usual case, one vote a warp) skips the per-score mask.
template <int kKeys>
__device__ __forceinline__ void seesaw_mask_rowmax(float (&s)[kKeys / 2], const int32_t* rows, int lane,
                                                   float scale_log2, float& mx0, float& mx1) {
  if (!(scale_log2 > 0.f)) {
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) s[i] *= scale_log2;
  }
  bool present = true;
#pragma unroll
  for (int i = 0; i < kKeys; i += 32) present = present && rows[i + lane] >= 0;
  if (!__all_sync(0xffffffffu, present)) {
#pragma unroll
    for (int j = 0; j < kKeys / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool valid = rows[j * 8 + (lane & 3) * 2 + e] >= 0;
        s[j * 4 + e] = valid ? s[j * 4 + e] : -INFINITY;
        s[j * 4 + 2 + e] = valid ? s[j * 4 + 2 + e] : -INFINITY;
      }
    }
  }
  mx0 = -INFINITY;
  mx1 = -INFINITY;
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) {
    mx0 = fmaxf(mx0, fmaxf(s[j * 4 + 0], s[j * 4 + 1]));
    mx1 = fmaxf(mx1, fmaxf(s[j * 4 + 2], s[j * 4 + 3]));
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  const float c = seesaw_score_scale(scale_log2);
  mx0 *= c;
  mx1 *= c;
}

// The max this warpgroup's P is computed against (tm0, tm1): WG0 its own max(m, mx), published in pmax[0..64) with
// a bar.arrive on bar_max0; WG1 the pair's (WG0's folded with its own), after waiting on bar_max0, published in
// pmax[64..128) with a bar.arrive on bar_max1. pmax alternates by pair, so a write never meets the previous
// pair's reads.
__device__ __forceinline__ void seesaw_exchange_max(int wg, int lane, int r0, int r1, float* pmax, float m0, float m1,
                                                    float mx0, float mx1, int bar_max0, int bar_max1, float& tm0,
                                                    float& tm1) {
  if (wg == 0) {
    tm0 = fmaxf(m0, mx0);
    tm1 = fmaxf(m1, mx1);
    if ((lane & 3) == 0) {
      pmax[r0] = tm0;
      pmax[r1] = tm1;
    }
    named_bar_arrive(bar_max0, 256);
  } else {
    named_bar_sync(bar_max0, 256);
    tm0 = fmaxf(pmax[r0], mx0);
    tm1 = fmaxf(pmax[r1], mx1);
    if ((lane & 3) == 0) {
      pmax[64 + r0] = tm0;
      pmax[64 + r1] = tm1;
    }
    named_bar_arrive(bar_max1, 256);
  }
}

// P = exp2(c s - tm) in place (c = seesaw_score_scale; -inf rows: against 0, every P = 0); the running row sums l
// move from the running max m to tm and gain this tile's sums; al0, al1 = exp2(m - tm), the factor O must be scaled
// by; m becomes tm.
template <int kKeys>
__device__ __forceinline__ void seesaw_exp_rowsum(float (&s)[kKeys / 2], float scale_log2, float tm0, float tm1,
                                                  float& m0, float& m1, float& l0, float& l1, float& al0, float& al1) {
  const float c = seesaw_score_scale(scale_log2);
  const float tu0 = tm0 == -INFINITY ? 0.f : tm0, tu1 = tm1 == -INFINITY ? 0.f : tm1;
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int j = 0; j < kKeys / 8; ++j) {
    s[j * 4 + 0] = exp2_ftz(fmaf(s[j * 4 + 0], c, -tu0));
    s[j * 4 + 1] = exp2_ftz(fmaf(s[j * 4 + 1], c, -tu0));
    s[j * 4 + 2] = exp2_ftz(fmaf(s[j * 4 + 2], c, -tu1));
    s[j * 4 + 3] = exp2_ftz(fmaf(s[j * 4 + 3], c, -tu1));
    ps0 += s[j * 4 + 0] + s[j * 4 + 1];
    ps1 += s[j * 4 + 2] + s[j * 4 + 3];
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    ps0 += __shfl_xor_sync(0xffffffffu, ps0, off);
    ps1 += __shfl_xor_sync(0xffffffffu, ps1, off);
  }
  al0 = m0 == -INFINITY ? 0.f : exp2_ftz(m0 - tu0);
  al1 = m1 == -INFINITY ? 0.f : exp2_ftz(m1 - tu1);
  l0 = l0 * al0 + ps0;
  l1 = l1 * al1 + ps1;
  m0 = tm0;
  m1 = tm1;
}

// P (bf16, scaled by f0 / f1 per row) as the wgmma A fragments of the kKeys / 16 k-steps (keys 16 kk .. 16 kk + 15).
template <int kKeys>
__device__ __forceinline__ void seesaw_pack_p(const float (&s)[kKeys / 2], float f0, float f1,
                                              uint32_t (&pa)[kKeys / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    pa[kk][0] = pack_bf16x2(s[8 * kk + 0] * f0, s[8 * kk + 1] * f0);
    pa[kk][1] = pack_bf16x2(s[8 * kk + 2] * f1, s[8 * kk + 3] * f1);
    pa[kk][2] = pack_bf16x2(s[8 * kk + 4] * f0, s[8 * kk + 5] * f0);
    pa[kk][3] = pack_bf16x2(s[8 * kk + 6] * f1, s[8 * kk + 7] * f1);
  }
}

// WG0, once its local P*V against its own max (tm0, tm1) is issued: waits on bar_max1 for the pair's max (WG1's,
// in pmax[64..128)), packs its P scaled to it into pf (for the caller to hand over), and moves its row sums l and
// max m there. f0, f1 = exp2(tm - pair max) (0 for a -inf row) are what its O rows still need once the local P*V
// is done.
template <int kKeys>
__device__ __forceinline__ void seesaw_wg0_to_pair_max(int bar_max1, const float* pmax, int r0, int r1, float tm0,
                                                       float tm1, const float (&s)[kKeys / 2],
                                                       uint32_t (&pf)[kKeys / 16][4], float& l0, float& l1,
                                                       float& m0, float& m1, float& f0, float& f1) {
  named_bar_sync(bar_max1, 256);
  const float pm0 = pmax[64 + r0], pm1 = pmax[64 + r1];
  f0 = tm0 == -INFINITY ? 0.f : exp2_ftz(tm0 - pm0);
  f1 = tm1 == -INFINITY ? 0.f : exp2_ftz(tm1 - pm1);
  seesaw_pack_p<kKeys>(s, f0, f1, pf);
  l0 *= f0;
  l1 *= f1;
  m0 = pm0;
  m1 = pm1;
}

}  // namespace dsacp::cuda
