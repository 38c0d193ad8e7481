// Exact merge of the sharded indexer's candidate rows on the device (TopkMergeParams), one CTA per row:
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
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common/block_scan.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxParts = 64;
constexpr size_t kMaxSharedBytes = 200 * 1024;

__device__ __forceinline__ uint64_t rank_key(float score, int32_t position) {
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
__device__ void bitonic_sort_ascending(uint64_t* keys, int n) {
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

// keys: max(n, k2) entries, then sel: n int32 (n = parts * K, k2 = next_pow2(K)).
__global__ void __launch_bounds__(kThreads) topk_merge_kernel(const TopkMergeParams p, int keys_len, int k2,
                                                               DeviceErrorWord err) {
  extern __shared__ uint64_t keys[];
  const int S = p.num_parts, K = p.K, n = S * K;
  int32_t* sel = reinterpret_cast<int32_t*>(keys + keys_len);
  __shared__ int valid_len[kMaxParts];
  __shared__ int part_start[kMaxParts + 1];
  __shared__ unsigned hist[256];
  __shared__ int warp_sums[32];
  __shared__ int s_digit, s_need, s_done, s_unsorted;
  const int64_t t = blockIdx.x;
  const int64_t I = p.I;
  for (int s = threadIdx.x; s < S; s += blockDim.x) valid_len[s] = K;
  if (threadIdx.x == 0) s_unsorted = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int s = i / K, j = i % K;
    const int32_t l = part_topk_row(p, s, t)[j];
    if (l < -1) report_device_error(err, kDevBadEntry, t);
    if (l == -1) atomicMin(&valid_len[s], j);
  }
  __syncthreads();
  int my_valid = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    uint64_t key = 0;  // below every candidate's key
    const int s = i / K, j = i % K;
    const int32_t* row = part_topk_row(p, s, t);
    const int32_t l = row[j];
    if (j < valid_len[s] && l >= 0) {
      const int64_t g = ((l / I) * S + s) * I + l % I;
      key = rank_key(part_scores_row(p, s, t)[j], static_cast<int32_t>(g));
      ++my_valid;
      if (j > 0 && l <= row[j - 1]) s_unsorted = 1;  // not ascending: the sort fallback
    }
    keys[i] = key;
  }
  int valid = 0;
  (void)block_exclusive_scan(my_valid, warp_sums, &valid);  // synchronizes: keys are complete after it

  // Radix select: winners are the nonzero keys with (key & mask) >= prefix.
  uint64_t prefix = 0, mask = 0;
  if (valid > K) {
    int need = K;
    for (int byte = 7; byte >= 0; --byte) {
      for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
      __syncthreads();
      const int shift = 8 * byte;
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t k = keys[i];
        if (k != 0 && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xFF], 1u);
      }
      __syncthreads();
      if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int local = 0;
        for (int j = 0; j < 8; ++j) local += static_cast<int>(hist[lane * 8 + j]);
        int incl = local;  // bins of lanes >= lane
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_down_sync(0xffffffffu, incl, o);
          if (lane + o < 32) incl += y;
        }
        const int above = incl - local;
        if (above < need && need <= incl) {
          int acc = above;
          for (int j = 7; j >= 0; --j) {
            const int h = static_cast<int>(hist[lane * 8 + j]);
            if (acc + h >= need) {
              s_digit = lane * 8 + j;
              s_need = need - acc;
              s_done = h == need - acc;
              break;
            }
            acc += h;
          }
        }
      }
      __syncthreads();
      need = s_need;
      prefix |= static_cast<uint64_t>(s_digit) << shift;
      mask |= uint64_t{0xFF} << shift;
      const bool done = s_done;
      __syncthreads();
      if (done) break;
    }
  }

  // Compaction in index order (part by part): contiguous chunks per thread, offsets from a block scan.
  const int chunk = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, static_cast<int>(threadIdx.x) * chunk), end = min(n, begin + chunk);
  int count = 0;
  for (int i = begin; i < end; ++i) {
    const uint64_t k = keys[i];
    count += k != 0 && (k & mask) >= prefix;
  }
  int total = 0;
  int at = block_exclusive_scan(count, warp_sums, &total);
  for (int i = begin; i < end; ++i) {
    if (i % K == 0) part_start[i / K] = at;
    const uint64_t k = keys[i];
    if (k != 0 && (k & mask) >= prefix) sel[at++] = key_position(k);
  }
  if (threadIdx.x == 0) part_start[S] = total;
  __syncthreads();
  const int kept = min(total, K);
  int32_t* out = p.topk + t * K;
  int32_t* local = p.local_topk == nullptr ? nullptr : p.local_topk + t * K;
  const int64_t own = p.local_part;
  // A global position's local position on part `own` (topk_remap's map).
  auto to_local = [&](int32_t g) { return static_cast<int32_t>((g / (S * I)) * I + g % I); };
  int own_kept = 0;
  if (!s_unsorted) {
    for (int c = threadIdx.x; c < total; c += blockDim.x) {
      int s = 0;
      while (part_start[s + 1] <= c) ++s;
      const int32_t pos = sel[c];
      int rank = c - part_start[s];
      for (int s2 = 0; s2 < S; ++s2) {
        if (s2 != s) rank += lower_bound(sel + part_start[s2], part_start[s2 + 1] - part_start[s2], pos);
      }
      if (rank < K) out[rank] = pos;
      if (local != nullptr && s == own) local[c - part_start[s]] = to_local(pos);
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
          if ((g / I) % S == own) local[n_own++] = to_local(g);
        }
        s_need = n_own;
      }
      __syncthreads();
      own_kept = s_need;
    }
  }
  for (int i = kept + threadIdx.x; i < K; i += blockDim.x) out[i] = -1;
  if (local != nullptr) {
    for (int i = own_kept + threadIdx.x; i < K; i += blockDim.x) local[i] = -1;
  }
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Shared memory of one row: the keys (at least next_pow2(K) of them, for the fallback sort) and the winners.
size_t merge_smem_bytes(const TopkMergeParams& p) {
  const int64_t n = int64_t{p.num_parts} * p.K;
  return static_cast<size_t>(std::max<int64_t>(n, next_pow2(p.K))) * sizeof(uint64_t) +
         static_cast<size_t>(n) * sizeof(int32_t);
}

}  // namespace

bool topk_merge_on_device(const TopkMergeParams& p) {
  if (p.num_parts < 1 || p.num_parts > kMaxParts || p.K < 1) return false;
  return merge_smem_bytes(p) <= kMaxSharedBytes && p.num_rows < (int64_t{1} << 31);
}

Status launch_topk_merge(const TopkMergeParams& p, const LaunchContext& ctx) {
  if (p.num_rows == 0) return Status::ok_status();
  if (!topk_merge_on_device(p)) return internal_error("topk_merge: shape not supported on the device");
  const int64_t n = int64_t{p.num_parts} * p.K;
  const int k2 = next_pow2(p.K);
  const int keys_len = static_cast<int>(std::max<int64_t>(n, k2));
  const size_t smem = merge_smem_bytes(p);
  // Static shared memory (~1.5 KB) counts against the 48 KB default too: raise the limit for anything big.
  if (smem > 32 * 1024) {
    DSACP_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  topk_merge_kernel<<<static_cast<unsigned>(p.num_rows), kThreads, smem, ctx.stream>>>(p, keys_len, k2, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_merge_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
