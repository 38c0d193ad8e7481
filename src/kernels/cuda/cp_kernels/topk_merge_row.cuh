// One row of the exact merge of the sharded indexer's candidate rows (TopkMergeParams), on the device: what the
// merge kernels of topk_merge.cu run per CTA, and what the top-k runs itself when it merges the row-synchronized
// exchange's rows as they come (IndexerTopkParams::merge). The steps of a row:
//   1. each candidate's order key (score, then the lower global position; NaN lowest: the CPU oracle's
//      topk_rank_key) goes to shared memory; a part's row is read up to its first -1, as on the CPU, and an
//      entry below -1 anywhere is reported;
//   2. a radix select (8 bits a pass, from the top, stopping once the boundary bin is taken whole) finds the
//      K best keys;
//   3. the winners are compacted part by part (each part's winners stay in ascending position order) and each
//      is written at its rank in the merged row: its index in its own part plus, per other part, a binary
//      search for the winners below it. A part whose positions are not ascending (not the indexer's canonical
//      form) falls back to a bitonic sort of the winners.
//   4. optionally (local_topk), the merged row remapped to one part's local positions: that part's winners are
//      already in order (in the canonical form), so winner c of it goes to c - its part's first winner.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "dsacp/kernel_params.h"
#include "kernels/cuda/common/block_scan.cuh"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/comm/peer_sync.cuh"
#include "kernels/cuda/cp_kernels/shard_map.cuh"

namespace dsacp::cuda::merge_row {

constexpr int kMergeMaxParts = 64;

// The keys a row's unsorted fallback sorts: next_pow2(K).
__host__ __device__ inline int merge_keys_len(int64_t K) {
  int k2 = 1;
  while (k2 < K) k2 <<= 1;
  return k2;
}

__device__ __forceinline__ uint64_t merge_rank_key(float score, int32_t position) {
  uint32_t u;
  if (score != score) {
    u = 0;
  } else {
    if (score == 0.f) score = 0.f;
    u = __float_as_uint(score);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    if (u == 0) u = 1;
  }
  return (static_cast<uint64_t>(u) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(position));
}

__device__ __forceinline__ int32_t key_position(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
}


// Part s's row t and its scores (the parts as one [Pt, T, K] array, or one buffer each: a window's messages).
__device__ __forceinline__ const int32_t* part_topk_row(const TopkMergeParams& p, int s, int64_t t) {
  return (p.part_topk != nullptr ? p.part_topk + s * p.num_rows * p.K : p.part_topk_of[s]) + t * p.K;
}
__device__ __forceinline__ const float* part_scores_row(const TopkMergeParams& p, int s, int64_t t) {
  return (p.part_scores != nullptr ? p.part_scores + s * p.num_rows * p.K : p.part_scores_of[s]) + t * p.K;
}

// Bitonic sort of keys[0, n) (n a power of two), ascending.
__device__ inline void bitonic_sort_ascending(uint64_t* keys, int n) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const uint64_t a = keys[i], b = keys[ixj];
          const bool up = (i & k) == 0;
          if ((a > b) == up) {
            keys[i] = b;
            keys[ixj] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// One radix pass's choice, by one warp (lane `lane`) over a pass's 256 bins (counts of the candidates still in
// the race, by this byte): the digit whose bin holds the need-th best candidate (bins counted from the top), how
// many of that bin are still needed, and whether that is the whole bin (the select is then done).
__device__ __forceinline__ void pick_digit(const unsigned* bins, int need, int lane, int* digit, int* need_left,
                                           int* done) {
  int local = 0;
  for (int j = 0; j < 8; ++j) local += static_cast<int>(bins[lane * 8 + j]);
  int incl = local;  // bins of lanes >= lane
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_down_sync(0xffffffffu, incl, o);
    if (lane + o < 32) incl += y;
  }
  const int above = incl - local;
  if (above < need && need <= incl) {
    int acc = above;
    for (int j = 7; j >= 0; --j) {
      const int h = static_cast<int>(bins[lane * 8 + j]);
      if (acc + h >= need) {
        *digit = lane * 8 + j;
        *need_left = need - acc;
        *done = h == need - acc;
        break;
      }
      acc += h;
    }
  }
}

// Number of sorted[0, n) below v.
__device__ __forceinline__ int lower_bound(const int32_t* sorted, int n, int32_t v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (sorted[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// A merged row out, from the winners' positions compacted part by part (sel[part_start[s] ..
// part_start[s + 1]) are part s's, in its order): each at its rank in the row, or (unsorted parts) sorted in
// `keys` (k2 entries of shared memory); then -1 padding; optionally the row remapped to part local_part. Every
// thread of the block calls it.
__device__ inline void write_merged_row(const TopkMergeParams& p, int64_t t, const int32_t* sel, const int* part_start,
                                 int total, int unsorted, uint64_t* keys, int k2, int* s_scratch) {
  const int S = p.num_parts, K = p.K;
  const int kept = min(total, K);
  int32_t* out = p.topk + t * K;
  int32_t* local = p.local_topk == nullptr ? nullptr : p.local_topk + t * K;
  const int64_t own = p.local_part;
  const ShardMap map(S, p.I);  // map.local: a global position's local position on part `own` (topk_remap's)
  int own_kept = 0;
  if (!unsorted) {
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
      int s = 0;
      while (part_start[s + 1] <= c) ++s;
      const int32_t pos = sel[c];
      int rank = c - part_start[s];
      for (int s2 = 0; s2 < S; ++s2) {
        if (s2 != s) rank += lower_bound(sel + part_start[s2], part_start[s2 + 1] - part_start[s2], pos);
      }
      if (rank < K) out[rank] = pos;
      if (local != nullptr && s == own) local[c - part_start[s]] = map.local(pos);
    }
    own_kept = part_start[own + 1] - part_start[own];
  } else {
    // Not the canonical form: sort the winners' positions (sentinel 0x7fffffff past them).
    __syncthreads();
    for (int i = threadIdx.x; i < k2; i += blockDim.x) keys[i] = i < kept ? static_cast<uint64_t>(sel[i]) : 0x7fffffffu;
    __syncthreads();
    bitonic_sort_ascending(keys, k2);
    for (int i = threadIdx.x; i < kept; i += blockDim.x) out[i] = static_cast<int32_t>(keys[i]);
    if (local != nullptr) {
      // Rare (never the indexer's output): one thread walks the sorted row.
      if (threadIdx.x == 0) {
        int n_own = 0;
        for (int i = 0; i < kept; ++i) {
          const int32_t g = static_cast<int32_t>(keys[i]);
          if (map.part(g) == own) local[n_own++] = map.local(g);
        }
        *s_scratch = n_own;
      }
      __syncthreads();
      own_kept = *s_scratch;
    }
  }
  for (int i = kept + threadIdx.x; i < K; i += blockDim.x) out[i] = -1;
  if (local != nullptr) {
    for (int i = own_kept + threadIdx.x; i < K; i += blockDim.x) local[i] = -1;
  }
}

// The DCP decode's merge (merge_small_row; parts x K <= 4096: 2 parts of K = 2048): 1024 threads, 4 candidates
// each in registers (contiguous, loaded as vectors where aligned), one load round. The radix select starts below
// the leading bytes every candidate shares (from the block's min and max key) and counts into per-warp
// histograms (no atomics contention across warps); then the same compaction and output as the general kernel
// (topk_merge.cu).
constexpr int kSmallMax = 4096;  // parts x K of the small kernel: kSmallThreads x kSmallPer, both variants

__device__ __forceinline__ unsigned long long shfl_xor_u64(unsigned long long v, int o) {
  const uint32_t lo = __shfl_xor_sync(0xffffffffu, static_cast<uint32_t>(v), o);
  const uint32_t hi = __shfl_xor_sync(0xffffffffu, static_cast<uint32_t>(v >> 32), o);
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

template <int kSmallThreads>
struct MergeRowShared {
  unsigned hist[kSmallThreads / 32][256];  // per-warp histograms of a radix pass
  unsigned bins[256];
  int valid_len[kMergeMaxParts];
  int part_start[kMergeMaxParts + 1];
  int warp_sums[32];
  int s_digit, s_need, s_done, s_unsorted;
  unsigned long long w_min[kSmallThreads / 32], w_max[kSmallThreads / 32];  // per warp: its smallest, largest key
  int w_valid[kSmallThreads / 32];                                          // and its valid candidates
};

// Merges row t (every thread of a block of kSmallThreads calls it; it has barriers). `sm` and `keys` are shared
// memory: keys has k2 entries (the unsorted fallback's sort), then the winners' positions (n int32). A window
// exchange's parts are read once the other ranks raised row t's flag; a failed wait writes nothing.
template <int kSmallThreads, int kSmallPer>
__device__ __forceinline__ void merge_small_row(const TopkMergeParams& p, int64_t t, MergeRowShared<kSmallThreads>& sm,
                                                uint64_t* keys, int k2, DeviceErrorWord err) {
  static_assert(kSmallThreads * kSmallPer == kSmallMax && kSmallPer % 4 == 0, "one load round of 4-vectors");
  constexpr int kSmallWarps = kSmallThreads / 32;
  const int S = p.num_parts, K = p.K, n = S * K;
  int32_t* sel = reinterpret_cast<int32_t*>(keys + k2);
  auto& hist = sm.hist;
  auto& bins = sm.bins;
  int* valid_len = sm.valid_len;
  int* part_start = sm.part_start;
  int* warp_sums = sm.warp_sums;
  int &s_digit = sm.s_digit, &s_need = sm.s_need, &s_done = sm.s_done, &s_unsorted = sm.s_unsorted;
  if (!peer::window_row_wait(p.wait, t, &s_done)) return;
  const ShardMap map(S, p.I);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int s = threadIdx.x; s < S; s += blockDim.x) valid_len[s] = K;
  if (threadIdx.x == 0) s_unsorted = 0;
  // 1. This thread's candidates [i0, i0 + kSmallPer): positions and scores.
  const int i0 = threadIdx.x * kSmallPer;
  int32_t pos[kSmallPer];
  float sc[kSmallPer];
  const bool one_part = i0 < n && (i0 / K) == (min(i0 + kSmallPer, n) - 1) / K;
  const int s0 = i0 / K, j0 = i0 - (i0 / K) * K;
  // Candidate i0 + e's part and column (no division per candidate).
  auto locate = [&](int e, int* s, int* j) {
    *s = s0;
    *j = j0 + e;
    while (*j >= K) *j -= K, ++*s;
  };
  const int32_t* row0 = i0 < n ? part_topk_row(p, s0, t) + j0 : nullptr;
  const float* score0 = i0 < n ? part_scores_row(p, s0, t) + j0 : nullptr;
  if (one_part && i0 + kSmallPer <= n && (reinterpret_cast<uintptr_t>(row0) & 15) == 0 &&
      (reinterpret_cast<uintptr_t>(score0) & 15) == 0) {
#pragma unroll
    for (int v = 0; v < kSmallPer / 4; ++v) {
      const int4 a = reinterpret_cast<const int4*>(row0)[v];
      const float4 c = reinterpret_cast<const float4*>(score0)[v];
      pos[4 * v] = a.x, pos[4 * v + 1] = a.y, pos[4 * v + 2] = a.z, pos[4 * v + 3] = a.w;
      sc[4 * v] = c.x, sc[4 * v + 1] = c.y, sc[4 * v + 2] = c.z, sc[4 * v + 3] = c.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kSmallPer; ++e) {
      const int i = i0 + e;
      pos[e] = -1;
      sc[e] = 0.f;
      if (i < n) {
        int s, j;
        locate(e, &s, &j);
        pos[e] = part_topk_row(p, s, t)[j];
        sc[e] = part_scores_row(p, s, t)[j];
      }
    }
  }
  // The entry before this thread's first (the ascending-order check across thread boundaries).
  const int32_t before = i0 < n && j0 > 0 ? row0[-1] : -1;
  __syncthreads();  // valid_len, s_unsorted initialized
#pragma unroll
  for (int e = 0; e < kSmallPer; ++e) {
    const int i = i0 + e;
    if (i >= n) continue;
    if (pos[e] < -1) report_device_error(err, kDevBadEntry, t);
    if (pos[e] == -1) {
      int s, j;
      locate(e, &s, &j);
      atomicMin(&valid_len[s], j);
    }
  }
  __syncthreads();
  uint64_t key[kSmallPer];
  int my_valid = 0;
  unsigned long long lo = ~0ull, hi = 0;
#pragma unroll
  for (int e = 0; e < kSmallPer; ++e) {
    const int i = i0 + e;
    key[e] = 0;  // below every candidate's key
    if (i >= n) continue;
    int s, j;
    locate(e, &s, &j);
    const int32_t l = pos[e];
    if (j < valid_len[s] && l >= 0) {
      key[e] = merge_rank_key(sc[e], map.global(l, s));
      ++my_valid;
      lo = min(lo, static_cast<unsigned long long>(key[e]));
      hi = max(hi, static_cast<unsigned long long>(key[e]));
      const int32_t prev = e > 0 && j > 0 ? pos[e - 1] : before;
      if (j > 0 && l <= prev) s_unsorted = 1;  // not ascending: the sort fallback
    }
  }
  // The block's smallest and largest key and its valid candidates: per warp by shuffles, then every warp reduces
  // the warps' values itself (one barrier, no atomics).
  auto reduce = [&](unsigned long long& a, unsigned long long& b, int& c) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a = min(a, shfl_xor_u64(a, o));
      b = max(b, shfl_xor_u64(b, o));
      c += __shfl_xor_sync(0xffffffffu, c, o);
    }
  };
  reduce(lo, hi, my_valid);
  if (lane == 0) {
    sm.w_min[warp] = lo;
    sm.w_max[warp] = hi;
    sm.w_valid[warp] = my_valid;
  }
  __syncthreads();
  unsigned long long s_min = lane < kSmallWarps ? sm.w_min[lane] : ~0ull;
  unsigned long long s_max = lane < kSmallWarps ? sm.w_max[lane] : 0ull;
  int valid = lane < kSmallWarps ? sm.w_valid[lane] : 0;
  reduce(s_min, s_max, valid);

  // 2. Radix select: winners are the nonzero keys with (key & mask) >= prefix. The bytes above the highest one
  //    where the smallest and largest keys differ are every candidate's: they are taken as the prefix at once.
  //    (12-bit digits from the highest differing bit, one 4096-bin histogram, measured no faster on an H200.)
  uint64_t prefix = 0, mask = 0;
  if (valid > K) {
    const uint64_t diff = s_min ^ s_max;  // nonzero: more than K distinct keys
    const int top = (63 - __clzll(static_cast<long long>(diff))) / 8;
    mask = top == 7 ? 0 : ~((uint64_t{1} << (8 * (top + 1))) - 1);
    prefix = s_min & mask;
    int need = K;
    for (int byte = top; byte >= 0; --byte) {
#pragma unroll
      for (int b = lane; b < 256; b += 32) hist[warp][b] = 0;
      __syncwarp();
      const int shift = 8 * byte;
#pragma unroll
      for (int e = 0; e < kSmallPer; ++e) {
        if (key[e] != 0 && (key[e] & mask) == prefix) atomicAdd(&hist[warp][(key[e] >> shift) & 0xFF], 1u);
      }
      __syncthreads();
      if (threadIdx.x < 256) {
        unsigned sum = 0;
#pragma unroll
        for (int w = 0; w < kSmallWarps; ++w) sum += hist[w][threadIdx.x];
        bins[threadIdx.x] = sum;
      }
      __syncthreads();
      if (warp == 0) pick_digit(bins, need, lane, &s_digit, &s_need, &s_done);
      __syncthreads();
      need = s_need;
      prefix |= static_cast<uint64_t>(s_digit) << shift;
      mask |= uint64_t{0xFF} << shift;
      if (s_done) break;  // (s_done is rewritten only after two more barriers)
    }
  }

  // 3. Compaction in index order (part by part), then the row out.
  int count = 0;
#pragma unroll
  for (int e = 0; e < kSmallPer; ++e) count += key[e] != 0 && (key[e] & mask) >= prefix;
  int total = 0;
  int at = block_exclusive_scan(count, warp_sums, &total);
#pragma unroll
  for (int e = 0; e < kSmallPer; ++e) {
    const int i = i0 + e;
    if (i < n && (j0 + e) % K == 0) part_start[s0 + (j0 + e) / K] = at;
    if (key[e] != 0 && (key[e] & mask) >= prefix) sel[at++] = key_position(key[e]);
  }
  if (threadIdx.x == 0) part_start[S] = total;
  __syncthreads();
  write_merged_row(p, t, sel, part_start, total, s_unsorted, keys, k2, &s_need);
}


}  // namespace dsacp::cuda::merge_row
