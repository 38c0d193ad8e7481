// Exact merge of the sharded indexer's candidate rows on the device (TopkMergeParams): one CTA per row sorts the
// Pt * K candidates' order keys (score, then the lower global position; NaN lowest: the CPU oracle's
// topk_rank_key) with a bitonic sort in shared memory, keeps the best K and sorts their positions ascending.
// A part's row is read up to its first -1, as on the CPU; an entry below -1 anywhere is reported.
#include <cuda_runtime.h>

#include <cstdint>

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

// Bitonic sort of keys[0, n) (n a power of two), descending or ascending.
__device__ void bitonic_sort(uint64_t* keys, int n, bool descending) {
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const uint64_t a = keys[i], b = keys[ixj];
          const bool up = ((i & k) == 0) != descending;
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

__global__ void __launch_bounds__(kThreads) topk_merge_kernel(const TopkMergeParams p, int n2, int k2,
                                                               DeviceErrorWord err) {
  extern __shared__ uint64_t keys[];
  __shared__ int valid_len[kMaxParts];
  const int64_t t = blockIdx.x;
  const int S = p.num_parts, K = p.K;
  const int64_t T = p.num_rows, I = p.I;
  for (int s = threadIdx.x; s < S; s += blockDim.x) valid_len[s] = K;
  __syncthreads();
  for (int i = threadIdx.x; i < S * K; i += blockDim.x) {
    const int s = i / K, j = i % K;
    const int32_t l = p.part_topk[(s * T + t) * K + j];
    if (l < -1) report_device_error(err, kDevBadEntry, t);
    if (l == -1) atomicMin(&valid_len[s], j);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n2; i += blockDim.x) {
    uint64_t key = 0;  // below every candidate's key
    if (i < S * K) {
      const int s = i / K, j = i % K;
      const int64_t at = (s * T + t) * K + j;
      const int32_t l = p.part_topk[at];
      if (j < valid_len[s] && l >= 0) {
        const int64_t g = ((l / I) * S + s) * I + l % I;
        key = rank_key(p.part_scores[at], static_cast<int32_t>(g));
      }
    }
    keys[i] = key;
  }
  __syncthreads();
  bitonic_sort(keys, n2, true);
  // The best K, as positions (sentinel 0x7fffffff past the candidates), sorted ascending.
  for (int i = threadIdx.x; i < k2; i += blockDim.x) {
    uint64_t v = 0x7fffffffu;
    if (i < K && keys[i] != 0) v = 0xFFFFFFFFu - static_cast<uint32_t>(keys[i]);
    keys[i] = v;
  }
  __syncthreads();
  bitonic_sort(keys, k2, false);
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const uint64_t v = keys[i];
    p.topk[t * K + i] = v == 0x7fffffffu ? -1 : static_cast<int32_t>(v);
  }
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

bool topk_merge_on_device(const TopkMergeParams& p) {
  if (p.num_parts < 1 || p.num_parts > kMaxParts || p.K < 1) return false;
  return static_cast<size_t>(next_pow2(int64_t{p.num_parts} * p.K)) * sizeof(uint64_t) <= kMaxSharedBytes &&
         p.num_rows < (int64_t{1} << 31);
}

Status launch_topk_merge(const TopkMergeParams& p, const LaunchContext& ctx) {
  if (p.num_rows == 0) return Status::ok_status();
  if (!topk_merge_on_device(p)) return internal_error("topk_merge: shape not supported on the device");
  const int n2 = next_pow2(int64_t{p.num_parts} * p.K), k2 = next_pow2(p.K);
  const size_t smem = static_cast<size_t>(n2) * sizeof(uint64_t);
  if (smem > 48 * 1024) {
    DSACP_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  topk_merge_kernel<<<static_cast<unsigned>(p.num_rows), kThreads, smem, ctx.stream>>>(p, n2, k2, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_merge_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
