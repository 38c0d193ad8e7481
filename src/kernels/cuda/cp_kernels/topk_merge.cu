// Exact merge of the sharded indexer's candidate rows on the device (TopkMergeParams), one CTA per row; the row's
// steps are in topk_merge_row.cuh. The general kernel keeps every candidate's key in shared memory (any parts x K
// that fits); the small one (parts x K <= 4096, the DCP decode's 2 x 2048) keeps them in registers.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/cp_kernels/topk_merge_row.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

using namespace merge_row;

constexpr int kThreads = 1024;
constexpr int kMaxParts = kMergeMaxParts;
constexpr size_t kMaxSharedBytes = 200 * 1024;

// keys: max(n, k2) entries, then sel: n int32 (n = parts * K, k2 = merge_keys_len(K)).
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
  // A window exchange's parts: the other ranks' row t once they raised its flag (a failed wait: nothing written).
  if (!peer::window_row_wait(p.wait, t, &s_done)) return;
  const ShardMap map(S, p.I);
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
      key = merge_rank_key(part_scores_row(p, s, t)[j], map.global(l, s));
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
      if (threadIdx.x < 32) pick_digit(hist, need, threadIdx.x, &s_digit, &s_need, &s_done);
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
  write_merged_row(p, t, sel, part_start, total, s_unsorted, keys, k2, &s_need);
}

// The DCP decode's merge (merge_row::merge_small_row), one row a CTA. keys: k2 entries, then sel: n int32.
template <int kSmallThreads, int kSmallPer>
__global__ void __launch_bounds__(kSmallThreads) topk_merge_small_kernel(const TopkMergeParams p, int k2,
                                                                         DeviceErrorWord err) {
  extern __shared__ uint64_t keys[];
  __shared__ MergeRowShared<kSmallThreads> sm;
  merge_small_row<kSmallThreads, kSmallPer>(p, blockIdx.x, sm, keys, k2, err);
}

// Shared memory of one row: the keys (at least merge_keys_len(K) of them, for the fallback sort) and the winners.
size_t merge_smem_bytes(const TopkMergeParams& p) {
  const int64_t n = int64_t{p.num_parts} * p.K;
  return static_cast<size_t>(std::max<int64_t>(n, merge_keys_len(p.K))) * sizeof(uint64_t) +
         static_cast<size_t>(n) * sizeof(int32_t);
}

}  // namespace

int64_t merge_row_max_candidates() { return kSmallMax; }

bool topk_merge_on_device(const TopkMergeParams& p) {
  if (p.num_parts < 1 || p.num_parts > kMaxParts || p.K < 1) return false;
  return merge_smem_bytes(p) <= kMaxSharedBytes && p.num_rows < (int64_t{1} << 31);
}

Status launch_topk_merge(const TopkMergeParams& p, const LaunchContext& ctx) {
  if (p.num_rows == 0) return Status::ok_status();
  if (!topk_merge_on_device(p)) return internal_error("topk_merge: shape not supported on the device");
  const int64_t n = int64_t{p.num_parts} * p.K;
  const int k2 = merge_keys_len(p.K);
  const int keys_len = static_cast<int>(std::max<int64_t>(n, k2));
  if (n <= kSmallMax && !ctx.options.topk_merge_general) {
    const size_t small = static_cast<size_t>(k2) * sizeof(uint64_t) + static_cast<size_t>(n) * sizeof(int32_t);
    // 1024 threads of 4 candidates (b=64, 2 x 2048 on one H200: 19.9 us against 20.8 with 512 threads of 8)
    DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(topk_merge_small_kernel<1024, 4>, static_cast<int>(small)));
    topk_merge_small_kernel<1024, 4><<<static_cast<unsigned>(p.num_rows), 1024, small, ctx.stream>>>(p, k2, ctx.error);
    DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_merge_small_kernel");
    return Status::ok_status();
  }
  const size_t smem = merge_smem_bytes(p);
  // Static shared memory (~1.5 KB) counts against the 48 KB default too: raise the limit for anything big.
  if (smem > 32 * 1024) {
    DSACP_CUDA_RETURN_IF_ERROR(
        ensure_dynamic_smem_limit(topk_merge_kernel, static_cast<int>(smem)));
  }
  topk_merge_kernel<<<static_cast<unsigned>(p.num_rows), kThreads, smem, ctx.stream>>>(p, keys_len, k2, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_merge_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
