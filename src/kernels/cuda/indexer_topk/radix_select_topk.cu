// Exact top-k per row in the contract's canonical form, by radix select on an order-preserving 32-bit key: the
// one-CTA form, which the fused CP merge (kMerge) and the row-synchronized exchange (signal) take; the default
// top-k is the cluster kernel (cluster_topk.cu), and launch_radix_select_topk below picks (launch_topk_rows).
//
// rank key u(s): larger = better; NaN = 0 (below everything), -0 == +0, the same map as the CPU oracle. The
// K-th largest key u* is found with four histogram passes over the row (12, 8, 8, 4 bits; one CTA of 1024 threads
// per row, 16-byte loads, shared-memory histogram: plain atomics in the first pass, warp-aggregated ones via
// match.any in the later passes, where warps without a candidate skip the atomics, hierarchical warp digit search). Rows of up to 49152 keys keep
// their rank keys in shared memory after the first pass, so later passes never touch global memory. Longer rows
// (the 64K-128K contexts of long decodes) take one more pass over global memory after the first: it copies the
// keys of the first pass's boundary bin (with their positions) to shared memory and counts, per output
// segment, the keys above that bin; the last three passes and the segment counts then run over that short list,
// and the row is read from global memory three times in all instead of six. A boundary bin too full for shared
// memory (heavy ties) falls back to passes over the row. Then every position with u > u* is taken,
// plus the first `need` positions with u == u* in position order (ties go to the lower position). The output
// pass walks the row in position order (warp-contiguous segments, lane-interleaved, ballot + popc compaction),
// so the row comes out ascending and front-packed with no sort; rows with key_len <= K are 0..n-1 then -1.
// With a fused merge (IndexerTopkParams::merge, kMerge), the CTA then merges its row with the peers' rows of the
// row-synchronized exchange (merge_row::merge_small_row) in the same shared memory, once the peers' flags came.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/comm/peer_sync.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/cp_kernels/topk_merge_row.cuh"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "kernels/cuda/indexer_topk/topk_common.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int32_t kMaxCacheElems = 49152;  // 192 KiB of rank keys (+ 17.5 KiB static)
constexpr int32_t kMaxBinElems = 24576;    // boundary-bin keys of a long row: 192 KiB of (key, position)

using topk::rank_key;

// Rank keys of elements [i, i + 4) of a row (16-byte aligned, as the plan aligns rows); past n: valid = false.
__device__ __forceinline__ void load4(const float* __restrict__ row, const uint32_t* cache, bool cached, int32_t n,
                                      int32_t i, uint32_t (&u)[4]) {
  if (cached) {
    if (i + 3 < n) {
      const uint4 v = *reinterpret_cast<const uint4*>(cache + i);
      u[0] = v.x, u[1] = v.y, u[2] = v.z, u[3] = v.w;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) u[k] = i + k < n ? cache[i + k] : 0u;
    }
  } else if (i + 3 < n) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(row + i));
    u[0] = rank_key(v.x), u[1] = rank_key(v.y), u[2] = rank_key(v.z), u[3] = rank_key(v.w);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = i + k < n ? rank_key(row[i + k]) : 0u;
  }
}

// The fused merge's shared memory (in the top-k's dynamic block, after the row's top-k is done with it): the
// merge's words, then its keys (next_pow2(K) of them) and the winners' positions (parts x K int32).
using MergeShared = merge_row::MergeRowShared<kThreads>;
constexpr int kMergePer = merge_row::kSmallMax / kThreads;
constexpr size_t kMergeWordsBytes = (sizeof(MergeShared) + 15) / 16 * 16;

size_t merge_smem_bytes(const TopkMergeParams& m) {
  return kMergeWordsBytes + static_cast<size_t>(merge_row::merge_keys_len(m.K)) * sizeof(uint64_t) +
         static_cast<size_t>(m.num_parts) * m.K * sizeof(int32_t);
}

// Row t's merge after its top-k was stored and signalled (kMerge; every thread of the CTA calls it).
template <bool kMerge>
__device__ __forceinline__ void merge_after_topk(const TopkMergeParams& merge, int64_t t, uint32_t* smem,
                                                 DeviceErrorWord err) {
  if constexpr (kMerge) {
    auto& sm = *reinterpret_cast<MergeShared*>(smem);
    uint64_t* keys = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(smem) + kMergeWordsBytes);
    merge_row::merge_small_row<kThreads, kMergePer>(merge, t, sm, keys, merge_row::merge_keys_len(merge.K), err);
  }
}

// The kernel's parameters stay within 4 KB: the inline plan, the exchange's row sync and the fused merge's params
// are the large ones (the 12 pointers and scalars besides them take < 128 bytes).
static_assert(sizeof(InlinePlan) + sizeof(WindowRowSync) + sizeof(TopkMergeParams) + sizeof(DeviceErrorWord) + 128 <=
                  4096,
              "radix_select_topk_kernel's parameters past 4 KB");

template <bool kMerge>
__global__ void __launch_bounds__(kThreads) radix_select_topk_kernel(const float* __restrict__ scores,
                                                                     const int64_t* __restrict__ score_offset,
                                                                     const int32_t* __restrict__ key_len,
                                                                     int64_t t0, int32_t K, int32_t cache_elems,
                                                                     int32_t bin_elems,
                                                                     int32_t* topk,  // (the fused merge reads
                                                                     float* topk_scores,  // them back: no restrict)
                                                                     const WindowRowSync signal,
                                                                     const TopkMergeParams merge,
                                                                     DeviceErrorWord err,
                                                                     const __grid_constant__ InlinePlan inl) {
  // [cache_elems] rank keys of the row, when it fits; else [bin_elems] boundary-bin keys, then their positions
  extern __shared__ __align__(16) uint32_t s_cache[];
  __shared__ uint32_t hist[4096];
  __shared__ uint32_t s_prefix, s_remaining, s_bin_count;
  __shared__ int32_t s_nc;
  __shared__ int32_t s_cnt_gt[kWarps], s_cnt_eq[kWarps], s_base_out[kWarps], s_base_eq[kWarps];

  const int64_t t = t0 + blockIdx.x;
  const int32_t n = key_len[t];
  int32_t* out = topk + t * K;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row = scores + plan_score_offset(inl, score_offset, t);
  float* out_scores = topk_scores == nullptr ? nullptr : topk_scores + t * K;  // optional [T, K]
  if (n <= K) {
    topk::short_row_topk<kThreads>(1, 0, n, K, row, out, out_scores);
    peer::window_row_signal(signal, t);
    merge_after_topk<kMerge>(merge, t, s_cache, err);
    return;
  }
  const bool cached = n <= cache_elems;
  // Output segments: warp w owns positions [w*seg, (w+1)*seg) of the ordered compaction below.
  const int32_t seg = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  uint32_t* bin_u = s_cache;  // the boundary bin's keys (filtered rows)
  int32_t* bin_i = reinterpret_cast<int32_t*>(s_cache + bin_elems);
  bool filtered = false;  // passes 1-3 and the segment counts over the boundary bin's list
  int32_t nc = 0;

  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(K);
  // digits: 12 bits (sign, exponent, 3 mantissa bits: spreads typical scores over many bins), then 8, 8, 4
  constexpr int kShift[4] = {20, 12, 4, 0};
  constexpr int kBits[4] = {12, 8, 8, 4};
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = kShift[pass];
    const int nbins = 1 << kBits[pass];
    if (pass == 1 && !cached && bin_elems > 0 && static_cast<int32_t>(s_bin_count) <= bin_elems) {
      // The filter pass: the boundary bin's keys to shared memory, the keys above it counted per segment.
      if (tid < kWarps) s_cnt_gt[tid] = 0, s_cnt_eq[tid] = 0;
      if (tid == 0) s_nc = 0;
      __syncthreads();
      for (int32_t base = 0; base < n; base += kThreads * 4) {
        const int32_t i = base + tid * 4;
        uint32_t u[4];
        load4(row, s_cache, false, n, i, u);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const bool valid = i + k < n;
          if (valid && (u[k] & mask) > prefix) atomicAdd(&s_cnt_gt[(i + k) / seg], 1);
          const bool in_bin = valid && (u[k] & mask) == prefix;
          const uint32_t ballot = __ballot_sync(0xffffffffu, in_bin);
          if (ballot != 0u) {
            int32_t at = 0;
            if (lane == 0) at = atomicAdd(&s_nc, __popc(ballot));
            at = __shfl_sync(0xffffffffu, at, 0) + __popc(ballot & ((1u << lane) - 1u));
            if (in_bin) {
              bin_u[at] = u[k];
              bin_i[at] = i + k;
            }
          }
        }
      }
      __syncthreads();
      filtered = true;
      nc = s_nc;  // == s_bin_count
    }
    for (int i = tid; i < nbins; i += kThreads) hist[i] = 0;
    __syncthreads();
    if (filtered) {
      // Passes 1-3 over the boundary bin's keys (all of them match the prefix of pass 0).
      for (int32_t base = 0; base < nc; base += kThreads) {
        const int32_t j = base + tid;
        const uint32_t u = j < nc ? bin_u[j] : 0u;
        const bool part = j < nc && (u & mask) == prefix;
        if (__any_sync(0xffffffffu, part)) {
          const uint32_t digit = (u >> shift) & static_cast<uint32_t>(nbins - 1);
          const uint32_t peers = __match_any_sync(0xffffffffu, part ? digit : 0x10000u + lane);
          if (part && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
      }
    }
    const bool from_cache = cached && pass != 0;  // the first pass fills the cache
    for (int32_t base = 0; base < n && !filtered; base += kThreads * 4) {
      const int32_t i = base + tid * 4;
      uint32_t u[4];
      load4(row, s_cache, from_cache, n, i, u);
      if (cached && pass == 0) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (i + k < n) s_cache[i + k] = u[k];
        }
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool part = i + k < n && (u[k] & mask) == prefix;
        if (pass == 0) {  // every key takes part and the 12-bit digits spread: plain shared atomics
          if (part) atomicAdd(&hist[u[k] >> shift], 1u);
        } else if (__any_sync(0xffffffffu, part)) {  // later passes: most warps hold no candidate
          const uint32_t digit = (u[k] >> shift) & static_cast<uint32_t>(nbins - 1);
          const uint32_t peers = __match_any_sync(0xffffffffu, part ? digit : 0x10000u + lane);
          if (part && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
      }
    }
    __syncthreads();
    if (warp == 0) {
      // hierarchical digit search from the top bin: each level splits the range over the 32 lanes
      int hi_bin = nbins, count = nbins;
      uint32_t above = 0;  // elements in bins above the range
      while (true) {
        const int per = count >= 32 ? count / 32 : 1;
        const int top = hi_bin - lane * per;
        uint32_t local = 0;
        for (int k = 0; k < per; ++k) {
          const int b = top - 1 - k;
          if (b >= hi_bin - count) local += hist[b];
        }
        uint32_t incl = local;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const uint32_t v = __shfl_up_sync(0xffffffffu, incl, off);
          if (lane >= off) incl += v;
        }
        const int first = __ffs(__ballot_sync(0xffffffffu, above + incl >= remaining)) - 1;
        above += __shfl_sync(0xffffffffu, incl - local, first);
        hi_bin -= first * per;
        count = per;
        if (per == 1) break;
      }
      if (lane == 0) {
        s_prefix = prefix | (static_cast<uint32_t>(hi_bin - 1) << shift);
        s_remaining = remaining - above;
        s_bin_count = hist[hi_bin - 1];
      }
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= static_cast<uint32_t>(nbins - 1) << shift;
  }
  const uint32_t thr = prefix;                             // u*, the K-th largest key
  const int32_t need = static_cast<int32_t>(remaining);    // how many u == u* to take (lowest positions first)

  // ordered compaction: warp w owns positions [w*seg, (w+1)*seg), lane-interleaved 32 at a time
  auto key_at = [&](int32_t i) -> uint32_t { return cached ? s_cache[i] : rank_key(row[i]); };
  const int32_t lo = warp * seg, hi = min(n, lo + seg);
  if (filtered) {
    // Per segment: the keys above the boundary bin (counted by the filter pass) plus the bin's keys above u*,
    // and the bin's keys equal to u*.
    for (int32_t j = tid; j < nc; j += kThreads) {
      const uint32_t u = bin_u[j];
      if (u > thr) atomicAdd(&s_cnt_gt[bin_i[j] / seg], 1);
      if (u == thr) atomicAdd(&s_cnt_eq[bin_i[j] / seg], 1);
    }
  } else {
    int32_t cgt = 0, ceq = 0;
    for (int32_t i0 = lo; i0 < hi; i0 += 32) {
      const int32_t i = i0 + lane;
      const uint32_t u = i < hi ? key_at(i) : 0u;
      cgt += __popc(__ballot_sync(0xffffffffu, i < hi && u > thr));
      ceq += __popc(__ballot_sync(0xffffffffu, i < hi && u == thr));
    }
    if (lane == 0) {
      s_cnt_gt[warp] = cgt;
      s_cnt_eq[warp] = ceq;
    }
  }
  __syncthreads();
  if (tid == 0) {
    int32_t out_base = 0, eq_base = 0;
    for (int w = 0; w < kWarps; ++w) {
      s_base_out[w] = out_base;
      s_base_eq[w] = eq_base;
      const int32_t take_eq = max(0, min(s_cnt_eq[w], need - eq_base));
      out_base += s_cnt_gt[w] + take_eq;
      eq_base += s_cnt_eq[w];
    }
  }
  __syncthreads();
  int32_t out_base = s_base_out[warp], eq_base = s_base_eq[warp];
  const uint32_t lt_mask = (1u << lane) - 1u;
  for (int32_t i0 = lo; i0 < hi; i0 += 32) {
    const int32_t i = i0 + lane;
    const uint32_t u = i < hi ? key_at(i) : 0u;
    const bool eq = i < hi && u == thr;
    const uint32_t eq_ballot = __ballot_sync(0xffffffffu, eq);
    const bool sel = (i < hi && u > thr) || (eq && eq_base + __popc(eq_ballot & lt_mask) < need);
    const uint32_t sel_ballot = __ballot_sync(0xffffffffu, sel);
    if (sel) {
      const int32_t pos = out_base + __popc(sel_ballot & lt_mask);
      out[pos] = i;
      if (out_scores != nullptr) out_scores[pos] = row[i];
    }
    out_base += __popc(sel_ballot);
    eq_base += __popc(eq_ballot);
  }
  peer::window_row_signal(signal, t);
  merge_after_topk<kMerge>(merge, t, s_cache, err);
}

}  // namespace

Status launch_radix_select_one_cta(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                                   const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                                   const LaunchContext& ctx) {
  if (t1 <= t0) return Status::ok_status();
  // rows up to kMaxCacheElems keys keep their rank keys in shared memory after the first pass; longer rows get
  // room for their boundary bin's keys and positions
  const int32_t cache_elems = max_len <= kMaxCacheElems ? (max_len + 3) / 4 * 4 : 0;
  const bool filter = max_len > kMaxCacheElems;
  const int32_t bin_elems = filter ? kMaxBinElems : 0;
  int bytes = std::max(cache_elems * 4, bin_elems * 8);
  if (p.merge.num_rows > 0) {
    bytes = std::max(bytes, static_cast<int>(merge_smem_bytes(p.merge)));
    DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(radix_select_topk_kernel<true>, bytes));
    radix_select_topk_kernel<true><<<static_cast<unsigned>(t1 - t0), kThreads, bytes, ctx.stream>>>(
        scores, score_offset, p.rows.key_len, t0, p.K, cache_elems, bin_elems, p.topk, p.topk_scores, p.signal,
        p.merge, ctx.error, inl);
  } else {
    DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(radix_select_topk_kernel<false>, bytes));
    radix_select_topk_kernel<false><<<static_cast<unsigned>(t1 - t0), kThreads, bytes, ctx.stream>>>(
        scores, score_offset, p.rows.key_len, t0, p.K, cache_elems, bin_elems, p.topk, p.topk_scores, p.signal,
        p.merge, ctx.error, inl);
  }
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("radix_select_topk_kernel");
  return Status::ok_status();
}

// The default top-k: the cluster kernel (cluster_topk.cu), or this one for a fused merge.
Status launch_radix_select_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                                const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                                const LaunchContext& ctx) {
  return launch_topk_rows(p, t0, t1, max_len, score_offset, scores, inl, ctx, TopkLaunchOptions{});
}

}  // namespace dsacp::cuda
