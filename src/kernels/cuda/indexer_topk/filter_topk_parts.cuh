// The filter-form top-k's device pieces (filter_topk.cu's kernel): the first digit of a score, 16-byte loads,
// the block-wide scans, the boundary bin over the cluster's histograms, the warp's segment of a slice, and the
// bitmap words of a walk.
#pragma once

#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/topk_common.cuh"

namespace dsacp::cuda::filter_topk_detail {

namespace cg = cooperative_groups;

constexpr int kBins = 2048;
constexpr int kMaxC = 8;
constexpr int kU = 4;  // warp iterations (16-byte loads a lane) in flight in a walk
constexpr unsigned kFull = topk::kFullMask;

using topk::rank_key;

// The first digit of score s: the fp16 order key of s rounded toward zero, top 11 bits; NaN alone in bin 0 (every
// number lands in 31 or above), -0 as +0. Monotone in rank_key(s).
__device__ __forceinline__ uint32_t first_digit(float s) {
  if (s != s) return 0u;
  if (s == 0.f) s = 0.f;
  const uint32_t h = __half_as_ushort(__float2half_rz(s));
  return ((h & 0x8000u) ? (~h & 0xffffu) : (h | 0x8000u)) >> 5;
}

__device__ __forceinline__ float4 load4(const float* p, int32_t avail) {
  if (avail >= 4) return __ldg(reinterpret_cast<const float4*>(p));
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  if (avail > 0) r.x = __ldg(p);
  if (avail > 1) r.y = __ldg(p + 1);
  if (avail > 2) r.z = __ldg(p + 2);
  return r;
}

__device__ __forceinline__ float comp(const float4& x, int c) { return c == 0 ? x.x : c == 1 ? x.y : c == 2 ? x.z : x.w; }

template <int kT>
struct Smem {
  static constexpr int kW = kT / 32;
  uint32_t hist[kBins];  // walk 1's histogram, then the candidate passes'
  uint32_t ws[2][kW];    // block scans
  uint32_t found[4];     // the bin search: bin, keys above it, keys in it, this CTA's keys above it
  uint32_t cnt;          // the candidate list's fill
  int32_t info[4];       // for the peers: this CTA's keys above b1, keys in b1 (the list), and (fallback) > u*, == u*
  int32_t peer[2][kMaxC];  // the peers' info[0], info[1] (compact) or info[2], info[3] (fallback)
  uint32_t res[2];       // u*, need
  uint32_t bits_or;
};

// Block-wide sums of (a, b) over the threads after this one (kSuffix) or before it; sets *tot to the totals.
template <int kT, bool kSuffix>
__device__ __forceinline__ uint2 block_scan2(Smem<kT>& sm, uint32_t a, uint32_t b, uint2* tot) {
  constexpr int kW = kT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t ia = a, ib = b;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t xa = kSuffix ? __shfl_down_sync(kFull, ia, off) : __shfl_up_sync(kFull, ia, off);
    const uint32_t xb = kSuffix ? __shfl_down_sync(kFull, ib, off) : __shfl_up_sync(kFull, ib, off);
    if (kSuffix ? lane + off < 32 : lane >= off) {
      ia += xa;
      ib += xb;
    }
  }
  if (lane == (kSuffix ? 0 : 31)) {
    sm.ws[0][warp] = ia;
    sm.ws[1][warp] = ib;
  }
  __syncthreads();
  uint32_t ea = ia - a, eb = ib - b, ta = 0, tb = 0;
#pragma unroll 8
  for (int w = 0; w < kW; ++w) {
    const uint32_t wa = sm.ws[0][w], wb = sm.ws[1][w];
    if (kSuffix ? w > warp : w < warp) {
      ea += wa;
      eb += wb;
    }
    ta += wa;
    tb += wb;
  }
  *tot = make_uint2(ta, tb);
  __syncthreads();  // ws free again
  return make_uint2(ea, eb);
}

// The bin of the rem-th largest key in the histogram summed over the cluster's C CTAs (C = 1: this CTA's): sets
// found = {bin, keys in the bins above it, keys in it, this CTA's keys above it} (and this CTA's keys in it is
// sm.hist[bin]). Every CTA's histogram complete before (the caller's barrier: a cluster barrier where C > 1).
template <int kT>
__device__ __forceinline__ void find_bin(Smem<kT>& sm, uint32_t rem, int C) {
  constexpr int kPer = kBins / kT;  // 2, 4 or 8 bins a thread
  cg::cluster_group cl = cg::this_cluster();
  const int b0 = threadIdx.x * kPer;
  uint32_t own[kPer], sum[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) own[k] = sm.hist[b0 + k];
#pragma unroll
  for (int k = 0; k < kPer; ++k) sum[k] = own[k];
  if (C > 1) {
#pragma unroll 1
    for (int q = 0; q < C; ++q) {
      if (q == static_cast<int>(cl.block_rank())) continue;
      const uint32_t* h = cl.map_shared_rank(sm.hist, q);
#pragma unroll
      for (int k = 0; k < kPer; ++k) sum[k] += h[b0 + k];
    }
  }
  uint32_t s = 0, o = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    s += sum[k];
    o += own[k];
  }
  uint2 tot;
  const uint2 above = block_scan2<kT, true>(sm, s, o, &tot);  // the bins of the threads after this one
  if (above.x < rem && above.x + s >= rem) {
    uint32_t a = above.x, ao = above.y;
#pragma unroll
    for (int k = kPer - 1; k >= 0; --k) {
      if (a + sum[k] >= rem) {
        sm.found[0] = static_cast<uint32_t>(b0 + k);
        sm.found[1] = a;
        sm.found[2] = sum[k];
        sm.found[3] = ao;
        break;
      }
      a += sum[k];
      ao += own[k];
    }
  }
  __syncthreads();
}

// The warp's segment of the slice: [wlo, whi), wlo a multiple of 128.
struct Seg {
  int32_t wlo, whi;
};

template <int kT>
__device__ __forceinline__ Seg warp_segment(int32_t len) {
  constexpr int kW = kT / 32;
  const int32_t seg = (len + kW * 128 - 1) / (kW * 128) * 128;
  const int warp = threadIdx.x >> 5;
  return Seg{min(len, warp * seg), min(len, (warp + 1) * seg)};
}

// Walk 2: the bitmap words of the warp's iteration at j0 (positions j0 + 4*lane + c): GT from gt_nib, EQ from eq_nib.
__device__ __forceinline__ void put_words(uint32_t* gtw, uint32_t* eqw, int32_t j0, uint32_t gt_nib, uint32_t eq_nib,
                                          int lane) {
  uint32_t g = gt_nib << (4 * (lane & 7)), e = eq_nib << (4 * (lane & 7));
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) {
    g |= __shfl_xor_sync(kFull, g, off);
    e |= __shfl_xor_sync(kFull, e, off);
  }
  if ((lane & 7) == 0) {
    gtw[(j0 >> 5) + (lane >> 3)] = g;
    eqw[(j0 >> 5) + (lane >> 3)] = e;
  }
}

}  // namespace dsacp::cuda::filter_topk_detail
