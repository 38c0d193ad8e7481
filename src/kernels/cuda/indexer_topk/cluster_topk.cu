// Exact top-k per row in the contract's canonical form, by radix select over a thread-block cluster of C CTAs
// per row (C = 1, 2, 4 or 8; 256 threads each). The default top-k (launch_topk_rows picks C and the cache mode).
//
// rank key u(s): larger = better; NaN = 0 (below everything), -0 == +0, the same map as the CPU oracle. CTA r of a
// row's cluster owns the slice [r*S, (r+1)*S) of its positions (S = ceil(n / C) rounded up to 4, so every slice
// starts 16-byte aligned). The K-th largest key u* is found digit by digit, 11, 11 and 10 bits from the top:
//   - each CTA histograms its slice's candidates (keys matching the digits found so far) in shared memory; the
//     first pass reads the slice from global memory (16-byte loads, four in flight per thread, plain shared
//     atomics) and keeps the slice's first `cache_elems` rank keys in shared memory; the later passes read those
//     from there and the rest of the slice again from global memory (L2, where a decode batch's rows stay);
//     candidates are counted with warp-aggregated atomics (match.any) by the warps that hold any;
//   - C > 1: the cluster's histograms are summed through distributed shared memory as a reduce-scatter (CTA r sums
//     bin range r of every CTA's histogram), then every CTA picks the range holding the K-th key from the C range
//     totals and searches that range in its owner's shared memory; every CTA reaches the same digit. Two cluster
//     barriers a pass, and one histogram buffer: a CTA clears it only after the pass's second barrier, when every
//     peer is done reading it.
// Then every position with u > u* is taken, plus the first `need` positions with u == u* in position order (ties go
// to the lower position). Output index of a taken position i = G(i) + min(E(i), need), with G / E the counts of
// keys > u* / == u* before i in the row: each CTA counts its slice per warp segment (ballots), the cluster
// exchanges the CTAs' totals, and the write pass walks the slice in position order, so the row comes out ascending
// and front-packed with no sort. Rows with key_len <= K are 0..n-1 then -1. With a row-synchronized exchange
// (signal), CTA 0 raises the row's flag after a cluster barrier that follows every CTA's stores (launch_topk_rows
// sends such launches to the one-CTA kernel until this has run across GPUs).
//
// What bounds it (ncu, b = 64 x 32K, C = 8): not bytes (DRAM 4% of peak) but each warp's serial instruction
// stream: five walks over the slice (three histogram passes, the count, the write), each key costing a shared
// load, votes and match.any, so a warp issues ~3.6K instructions at ~19 cycles apart, stalled mostly on the
// shared-memory (MIO) pipe. The next step is keys held in registers per thread (contiguous chunks, one block
// scan for the order) and the later passes over the boundary bin's candidates only (docs/design/2026-12-02-topk.md).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/comm/peer_sync.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/topk_common.cuh"

namespace dsacp::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kT = 256;  // threads per CTA
constexpr int kW = kT / 32;
constexpr int kBins = 2048;  // digits of 11, 11 and 10 bits: [21, 32) (sign, exponent, 2 mantissa bits), [10, 21), [0, 10)
constexpr int kUnroll = 4;    // 16-byte loads in flight per thread in the first pass
constexpr int kMaxCluster = 8;
constexpr unsigned kFull = topk::kFullMask;

using topk::cluster_arrive;
using topk::cluster_wait;
using topk::rank_key;

// Row t's flag for the row-synchronized exchange, after every CTA of the cluster stored its part of the row.
__device__ __noinline__ void signal_row(const WindowRowSync& signal, int64_t t, int C, int rank) {
  if (C > 1) {
    __threadfence();
    cg::this_cluster().sync();
  }
  if (rank == 0) peer::window_row_signal(signal, t);
}

// Adds the warp's candidates (part) to hist[digit], one atomic per distinct digit (match.any).
__device__ __forceinline__ void add_candidate(uint32_t* hist, bool part, uint32_t digit, int lane) {
  if (__any_sync(kFull, part)) {
    const uint32_t peers = __match_any_sync(kFull, part ? digit : 0x10000u + lane);
    if (part && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
  }
}

__global__ void __launch_bounds__(kT, 4)
    cluster_topk_kernel(const float* __restrict__ scores, const int64_t* __restrict__ score_offset,
                        const int32_t* __restrict__ key_len, int64_t t0, int32_t K, int32_t cache_elems,
                        int32_t* __restrict__ topk, float* __restrict__ topk_scores,
                        const __grid_constant__ WindowRowSync signal, const __grid_constant__ InlinePlan inl) {
  extern __shared__ __align__(16) uint32_t s_cache[];  // [cache_elems] rank keys of the slice's first positions
  __shared__ __align__(16) uint32_t hist[kBins];        // this CTA's histogram of the pass
  __shared__ __align__(16) uint32_t red[kBins / 2];     // C > 1: bin range `rank` of the cluster's sum
  __shared__ uint32_t s_scan[kW], s_found[3], s_range_total, s_pick[2];
  __shared__ int32_t s_wgt[kW], s_weq[kW], s_tot[2], s_base[2];

  cg::cluster_group cl = cg::this_cluster();
  const int C = static_cast<int>(cl.num_blocks());
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t t = t0 + blockIdx.x / C;
  const int32_t n = key_len[t];
  int32_t* out = topk + t * K;
  float* out_scores = topk_scores == nullptr ? nullptr : topk_scores + t * K;  // optional [T, K]
  const float* row = scores + plan_score_offset(inl, score_offset, t);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  if (n <= K) {  // the same n in every CTA of the cluster: no barrier is skipped by some and met by others
    topk::short_row_topk<kT>(C, rank, n, K, row, out, out_scores);
    if (signal.seq != 0) signal_row(signal, t, C, rank);
    return;
  }
  const int32_t slice = ((n + C - 1) / C + 3) / 4 * 4;
  const int32_t lo = min(n, rank * slice), hi = min(n, lo + slice), len = hi - lo;
  const int32_t len4 = len & ~3;  // whole 16-byte groups; the row's last 1-3 keys are read one by one
  const float* srow = row + lo;
  // the slice's first cache_n keys stay in shared memory after the first pass (all of them where they fit; a
  // multiple of 4 or the whole slice), the others are read again from global memory (L2)
  const int32_t cache_n = min(len, cache_elems);

  uint32_t prefix = 0, mask = 0, rem = static_cast<uint32_t>(K);
#pragma unroll 1
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nb = pass == 2 ? kBins / 2 : kBins;
#pragma unroll 1
    for (int i = tid; i < nb; i += kT) hist[i] = 0;
    __syncthreads();
    if (pass == 0) {
      // every key takes part and the 11-bit digits spread: plain shared atomics. kUnroll 16-byte loads in flight,
      // then a rolled loop over them (the registers shift down), so the loop's code stays short.
#pragma unroll 1
      for (int32_t b0 = tid * 4; b0 < len4; b0 += kT * 4 * kUnroll) {
        float4 v0, v1, v2, v3;
        static_assert(kUnroll == 4, "four loads in flight");
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        v0 = __ldg(reinterpret_cast<const float4*>(srow + b0));
        v1 = b0 + 1 * kT * 4 < len4 ? __ldg(reinterpret_cast<const float4*>(srow + b0 + 1 * kT * 4)) : zero;
        v2 = b0 + 2 * kT * 4 < len4 ? __ldg(reinterpret_cast<const float4*>(srow + b0 + 2 * kT * 4)) : zero;
        v3 = b0 + 3 * kT * 4 < len4 ? __ldg(reinterpret_cast<const float4*>(srow + b0 + 3 * kT * 4)) : zero;
#pragma unroll 1
        for (int32_t j = b0; j < min(len4, b0 + kUnroll * kT * 4); j += kT * 4) {
          const uint4 u = make_uint4(rank_key(v0.x), rank_key(v0.y), rank_key(v0.z), rank_key(v0.w));
          if (j < cache_n) *reinterpret_cast<uint4*>(s_cache + j) = u;
          atomicAdd(&hist[u.x >> 21], 1u);
          atomicAdd(&hist[u.y >> 21], 1u);
          atomicAdd(&hist[u.z >> 21], 1u);
          atomicAdd(&hist[u.w >> 21], 1u);
          v0 = v1;
          v1 = v2;
          v2 = v3;
        }
      }
      if (tid < len - len4) {
        const uint32_t u = rank_key(srow[len4 + tid]);
        if (len4 + tid < cache_n) s_cache[len4 + tid] = u;
        atomicAdd(&hist[u >> 21], 1u);
      }
    } else {
      // later passes: few candidates, most warps hold none; warp-aggregated atomics where some do
#pragma unroll 1
      for (int32_t b0 = 0; b0 < len; b0 += kT * 4) {
        const int32_t j = b0 + tid * 4;
        uint4 u = make_uint4(0u, 0u, 0u, 0u);
        if (j < len4) {
          if (j < cache_n) {
            u = *reinterpret_cast<const uint4*>(s_cache + j);
          } else {
            const float4 v = __ldg(reinterpret_cast<const float4*>(srow + j));
            u = make_uint4(rank_key(v.x), rank_key(v.y), rank_key(v.z), rank_key(v.w));
          }
        } else if (j < len) {  // the row's last 1-3 keys
          const bool c = j < cache_n;  // cache_n is len or a multiple of 4: the group is cached whole or not
          u.x = c ? s_cache[j] : rank_key(srow[j]);
          if (j + 1 < len) u.y = c ? s_cache[j + 1] : rank_key(srow[j + 1]);
          if (j + 2 < len) u.z = c ? s_cache[j + 2] : rank_key(srow[j + 2]);
        }
        const uint32_t dm = static_cast<uint32_t>(nb - 1);
        add_candidate(hist, j < len && (u.x & mask) == prefix, (u.x >> shift) & dm, lane);
        add_candidate(hist, j + 1 < len && (u.y & mask) == prefix, (u.y >> shift) & dm, lane);
        add_candidate(hist, j + 2 < len && (u.z & mask) == prefix, (u.z >> shift) & dm, lane);
        add_candidate(hist, j + 3 < len && (u.w & mask) == prefix, (u.w >> shift) & dm, lane);
      }
    }
    __syncthreads();
    const uint32_t* search = hist;  // where the pass's bin is searched, and the bins' offset and count above it
    uint32_t base_bin = 0, above = 0;
    int m = nb;
    if (C > 1) {
      const topk::ClusterRange cr = topk::cluster_reduce_scatter<kT, kMaxCluster>(hist, red, nb, rem, C, rank, s_scan,
                                                                                  &s_range_total, s_pick);
      search = cr.bins;
      base_bin = cr.base_bin;
      above = cr.above;
      m = cr.m;
    }
    topk::find_bin<kT>(search, m, rem - above, s_scan, s_found);
    prefix |= (base_bin + s_found[0]) << shift;
    mask |= static_cast<uint32_t>(nb - 1) << shift;
    rem -= above + s_found[1];
  }
  const uint32_t thr = prefix;                        // u*, the K-th largest key
  const int32_t need = static_cast<int32_t>(rem);     // how many u == u* to take (lowest positions first)

  // warp w walks the slice's positions [w*seg, (w+1)*seg), lane-interleaved 32 at a time
  const int32_t seg = ((len + kW - 1) / kW + 31) / 32 * 32;
  const int32_t wlo = min(len, warp * seg), whi = min(len, wlo + seg);
  // Two walks with one loop's code: phase 0 counts the warp's keys > u* and == u*, phase 1 (after the warps' and
  // the cluster's CTAs' bases are known) writes the taken positions.
  int32_t G = 0, E = 0;
  const uint32_t lt_mask = (1u << lane) - 1u;
#pragma unroll 1
  for (int phase = 0; phase < 2; ++phase) {
#pragma unroll 1
    for (int32_t j0 = wlo; j0 < whi; j0 += 32) {
      const int32_t j = j0 + lane;
      const bool v = j < whi;
      const uint32_t u = v ? (j < cache_n ? s_cache[j] : rank_key(srow[j])) : 0u;
      const bool gt = v && u > thr, eq = v && u == thr;
      const uint32_t gb = __ballot_sync(kFull, gt), eb = __ballot_sync(kFull, eq);
      const int32_t e_before = E + __popc(eb & lt_mask);
      if (phase == 1 && (gt || (eq && e_before < need))) {
        const int32_t pos = G + __popc(gb & lt_mask) + min(e_before, need);
        out[pos] = lo + j;
        if (out_scores != nullptr) out_scores[pos] = srow[j];
      }
      G += __popc(gb);
      E += __popc(eb);
    }
    if (phase == 1) break;
    if (lane == 0) {
      s_wgt[warp] = G;
      s_weq[warp] = E;
    }
    __syncthreads();
    if (tid == 0) {  // the warps' bases in the slice, and the slice's totals
      int32_t g = 0, e = 0;
#pragma unroll 1
      for (int w = 0; w < kW; ++w) {
        const int32_t a = s_wgt[w], b = s_weq[w];
        s_wgt[w] = g;
        s_weq[w] = e;
        g += a;
        e += b;
      }
      s_tot[0] = g;
      s_tot[1] = e;
      s_base[0] = 0;
      s_base[1] = 0;
    }
    __syncthreads();
    if (C > 1) {
      cl.sync();  // every CTA's totals are there
      topk::cluster_exclusive_totals(s_tot, rank, s_base);
      __syncthreads();
      cluster_arrive();  // done reading the peers' shared memory (waited for before the CTA exits)
    }
    G = s_base[0] + s_wgt[warp];
    E = s_base[1] + s_weq[warp];
  }
  if (C > 1) cluster_wait();
  if (signal.seq != 0) signal_row(signal, t, C, rank);
}

int static_smem_bytes() {
  static int bytes = -1;
  if (bytes < 0) {
    cudaFuncAttributes a{};
    bytes = cudaFuncGetAttributes(&a, cluster_topk_kernel) == cudaSuccess ? static_cast<int>(a.sharedSizeBytes)
                                                                          : 32 * 1024;
  }
  return bytes;
}

}  // namespace

Status launch_cluster_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                           const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                           const LaunchContext& ctx, int cluster, int cache) {
  if (t1 <= t0) return Status::ok_status();
  if (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8) {
    return invalid_argument("cluster top-k: cluster=" + std::to_string(cluster) + "; expected 1, 2, 4 or 8");
  }
  const int64_t rows = t1 - t0;
  if (rows * cluster >= (int64_t{1} << 31)) {
    return unsupported("cluster top-k: rows x cluster=" + std::to_string(rows * cluster) + "; expected < 2^31");
  }
  // One CTA's slice of the longest row. By default its rank keys stay in shared memory when the whole slice fits
  // with every CTA of the launch resident at once (up to the 4 CTAs an SM holds by threads); otherwise none do, and
  // the later passes read the slice again from L2 (measured: at b = 64 x 128K, C = 8, re-reading the slice beats
  // both two waves of cached slices and a partly cached slice: the kernel is bound by its shared-memory (MIO)
  // instructions, and L2 loads take that pipe no work). cache 1: as much of the slice as one CTA holds.
  const int64_t slice = ((int64_t{max_len} + cluster - 1) / cluster + 3) / 4 * 4;
  constexpr int64_t kSmemPerSm = 228 * 1024, kSmemPerBlock = 227 * 1024;
  const int64_t fixed = static_smem_bytes() + 1024;  // + the runtime's reserved KiB per CTA
  int64_t cache_elems = 0;
  if (cache == 1) cache_elems = std::min<int64_t>((kSmemPerBlock - fixed) / 16 * 4, slice);
  if (cache < 0) {
    const int64_t sms = std::max(1, ctx.num_sms);
    const int64_t per_sm = std::clamp<int64_t>((rows * cluster + sms - 1) / sms, 1, 4);
    if (slice * 4 + fixed <= std::min(kSmemPerBlock, kSmemPerSm / per_sm)) cache_elems = slice;
  }
  const int bytes = static_cast<int>(cache_elems * 4);
  DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(cluster_topk_kernel, bytes));
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[1];
  topk::cluster_launch_config(cfg, attr, rows, cluster, kT, static_cast<size_t>(bytes), ctx.stream);
  DSACP_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, cluster_topk_kernel, scores, score_offset, p.rows.key_len, t0,
                                                p.K, static_cast<int32_t>(cache_elems), p.topk, p.topk_scores,
                                                p.signal, inl));
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("cluster_topk_kernel");
  return Status::ok_status();
}

// The default form (kDefaultTopkForm: the filter form where it fits; else the register form where its cluster is 2+
// CTAs, else the cluster kernel: C CTAs a row, C the largest of 1, 2, 4, 8 that keeps rows x C within about four CTAs
// per SM and gives every CTA at least 2048 keys of the longest row), or the form the options name.
Status launch_topk_rows(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                        const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                        const LaunchContext& ctx, const TopkLaunchOptions& opt) {
  // A fused merge, and a row-synchronized exchange (signal: the cluster kernel raises a row's flag after a cluster
  // barrier, but that has not run across GPUs yet), take the one-CTA form.
  if (opt.one_cta || p.merge.num_rows > 0 || p.signal.active()) {
    return launch_radix_select_one_cta(p, t0, t1, max_len, score_offset, scores, inl, ctx);
  }
  TopkForm form = opt.form;
  if (form == TopkForm::kAuto && kDefaultTopkForm == TopkForm::kFilter) form = TopkForm::kFilter;
  if (form == TopkForm::kFilter) {
    const int th = opt.threads > 0 ? opt.threads : filter_topk_threads(t1 - t0, max_len, ctx);
    const int c = opt.cluster > 0 ? opt.cluster : filter_topk_cluster(t1 - t0, max_len, th, ctx);
    if (opt.form == TopkForm::kFilter || filter_topk_fits(max_len, c, th)) {
      return launch_filter_topk(p, t0, t1, max_len, score_offset, scores, inl, ctx, c, th);
    }
    form = TopkForm::kAuto;  // rows too long for the filter form's bitmaps: the rule below
  }
  if (form == TopkForm::kAuto) {
    form = opt.cluster > 1 || (opt.cluster <= 0 && register_topk_cluster(t1 - t0, max_len, ctx) > 1)
               ? TopkForm::kRegister
               : TopkForm::kCluster;
  }
  if (form == TopkForm::kRegister) {
    const int c = opt.cluster > 0 ? opt.cluster : register_topk_cluster(t1 - t0, max_len, ctx);
    return launch_register_topk(p, t0, t1, max_len, score_offset, scores, inl, ctx, c);
  }
  int c = opt.cluster;
  if (c <= 0) {
    const int64_t rows = t1 - t0, slots = 4 * int64_t{std::max(1, ctx.num_sms)};
    c = 1;
    while (c < 8 && rows * (c * 2) <= slots && int64_t{max_len} >= int64_t{c} * 2 * 2048) c *= 2;
  }
  return launch_cluster_topk(p, t0, t1, max_len, score_offset, scores, inl, ctx, c, opt.cache);
}

}  // namespace dsacp::cuda
