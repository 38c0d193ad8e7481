// Device pieces the radix-select top-k kernels share (cluster_topk.cu, register_topk.cu, radix_select_topk.cu): the
// rank key, the search of a histogram for the bin holding the rem-th largest key, the cluster's reduce-scatter of
// its CTAs' histograms, the cluster's exclusive prefix of per-CTA totals, and the cluster launch configuration.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsacp::cuda::topk {

namespace cg = cooperative_groups;

inline constexpr unsigned kFullMask = 0xffffffffu;

// A row with no more keys than K (n <= K): every position in order, then -1 (scores: the row's, then -inf), the
// positions [0, K) split over the `C` CTAs of the row's cluster (`rank` this one's) and their kT threads each.
template <int kT>
__device__ __forceinline__ void short_row_topk(int C, int rank, int32_t n, int32_t K, const float* row, int32_t* out,
                                               float* out_scores) {
#pragma unroll 1
  for (int32_t i = rank * kT + static_cast<int32_t>(threadIdx.x); i < K; i += C * kT) {
    out[i] = i < n ? i : -1;
    if (out_scores != nullptr) out_scores[i] = i < n ? row[i] : -INFINITY;
  }
}

// Rank key u(s): larger = better; NaN = 0 (below everything), -0 == +0, never 0 for a number: the CPU oracle's map.
__device__ __forceinline__ uint32_t rank_key(float s) {
  if (s != s) return 0u;
  if (s == 0.f) s = 0.f;
  uint32_t u = __float_as_uint(s);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return u == 0u ? 1u : u;
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// In bins h[0, m) (a higher bin holds larger keys; h may be a peer's shared memory), the bin b where the keys of the
// bins above b are < rem and those plus h[b] are >= rem: s_found = {b, keys above b, h[b]}. Every thread of the
// kThreads-thread CTA calls it; s_scan holds kThreads / 32 words. Not inlined, and its loops rolled: the kernels'
// code is fetched cold from L2 / HBM in every launch (the benchmarks flush L2, and a decode step's other kernels
// evict it), and each new line of code on the critical path waits for that fetch.
template <int kThreads>
__device__ __noinline__ void find_bin(const uint32_t* h, int m, uint32_t rem, uint32_t* s_scan, uint32_t* s_found) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = m >= kThreads ? m / kThreads : 1;
  const int b0 = tid * per;
  uint32_t sum = 0;
#pragma unroll 1
  for (int k = 0; k < per && b0 + k < m; ++k) sum += h[b0 + k];
  uint32_t incl = sum;  // this lane's and the higher lanes' bins
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const uint32_t v = __shfl_down_sync(kFullMask, incl, off);
    if (lane + off < 32) incl += v;
  }
  if (lane == 0) s_scan[warp] = incl;
  __syncthreads();
  uint32_t above = incl - sum;
#pragma unroll 1
  for (int w = warp + 1; w < kWarps; ++w) above += s_scan[w];
  if (b0 < m && above < rem && above + sum >= rem) {
#pragma unroll 1
    for (int k = per - 1; k >= 0; --k) {
      const uint32_t c = h[b0 + k];
      if (above + c >= rem) {
        s_found[0] = static_cast<uint32_t>(b0 + k);
        s_found[1] = above;
        s_found[2] = c;
        break;
      }
      above += c;
    }
  }
  __syncthreads();
}

// Where a pass's bin is searched once the cluster's C > 1 CTAs have their histograms `hist` of nb bins complete
// (the caller's __syncthreads done): the reduce-scatter sums bin range `rank` of every CTA's histogram into `red`
// (nb / C bins), the C range totals pick the range holding the rem-th largest key, and the result is that range in
// its owner's shared memory, with the range's first bin (base_bin) and the keys in the ranges above it (above).
// Two cluster barriers; every CTA's hist is free to clear again when it returns. s_scan holds kThreads / 32 words.
struct ClusterRange {
  const uint32_t* bins;
  uint32_t base_bin, above;
  int m;
};
template <int kThreads, int kMaxCluster>
__device__ __forceinline__ ClusterRange cluster_reduce_scatter(uint32_t* hist, uint32_t* red, int nb, uint32_t rem,
                                                               int C, int rank, uint32_t* s_scan,
                                                               uint32_t* s_range_total, uint32_t* s_pick) {
  constexpr int kWarps = kThreads / 32;
  cg::cluster_group cl = cg::this_cluster();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  cl.sync();  // every CTA's histogram is complete
  const int range = nb / C, rlo = rank * range;
  uint32_t part = 0;
#pragma unroll 1
  for (int i = tid; i < range; i += kThreads) {
    uint32_t s = 0;
#pragma unroll
    for (int q = 0; q < kMaxCluster; ++q) {  // the C loads in flight together
      if (q < C) s += cl.map_shared_rank(hist, q)[rlo + i];
    }
    red[i] = s;
    part += s;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(kFullMask, part, off);
  if (lane == 0) s_scan[warp] = part;
  __syncthreads();
  if (tid == 0) {
    uint32_t s = 0;
#pragma unroll 1
    for (int w = 0; w < kWarps; ++w) s += s_scan[w];
    *s_range_total = s;
  }
  cl.sync();  // every range is summed; the histograms are free again
  if (warp == 0) {
    const uint32_t tot = lane < C ? *cl.map_shared_rank(s_range_total, lane) : 0u;
    uint32_t incl = tot;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const uint32_t v = __shfl_down_sync(kFullMask, incl, off);
      if (lane + off < 32) incl += v;
    }
    const uint32_t above_r = incl - tot;
    const uint32_t hit = __ballot_sync(kFullMask, lane < C && above_r < rem && above_r + tot >= rem);
    if (lane == __ffs(hit) - 1) {
      s_pick[0] = static_cast<uint32_t>(lane);
      s_pick[1] = above_r;
    }
  }
  __syncthreads();
  const int r = static_cast<int>(s_pick[0]);
  return ClusterRange{cl.map_shared_rank(red, r), static_cast<uint32_t>(r * range), s_pick[1], range};
}

// The cluster's CTAs before this one: the sums of their (> u*, == u*) totals `tot[2]` (every CTA's set before a
// cluster barrier the caller has passed), written by thread 0 into base[2]; the caller synchronizes the CTA after.
__device__ __forceinline__ void cluster_exclusive_totals(const int32_t* tot, int rank, int32_t* base) {
  if (threadIdx.x != 0) return;
  cg::cluster_group cl = cg::this_cluster();
  int32_t g = 0, e = 0;
#pragma unroll 1
  for (int q = 0; q < rank; ++q) {
    const int32_t* tq = cl.map_shared_rank(tot, q);
    g += tq[0];
    e += tq[1];
  }
  base[0] = g;
  base[1] = e;
}

// The launch of `rows` rows with `cluster` CTAs of `threads` each (cfg's attribute array is attr[1]).
inline void cluster_launch_config(cudaLaunchConfig_t& cfg, cudaLaunchAttribute* attr, int64_t rows, int cluster,
                                  int threads, size_t smem_bytes, cudaStream_t stream) {
  cfg = cudaLaunchConfig_t{};
  cfg.gridDim = dim3(static_cast<unsigned>(rows * cluster));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
}

}  // namespace dsacp::cuda::topk
