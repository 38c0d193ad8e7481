// Exact top-k per row in the contract's canonical form, the register form (TopkForm::kRegister): a thread-block
// cluster of C CTAs of 256 threads per row as in cluster_topk.cu, but each thread owns a contiguous chunk of its
// CTA's slice, and only the first digit walks the slice.
//
// rank key u(s): larger = better; NaN = 0 (below everything), -0 == +0, the CPU oracle's map.
//   1. First digit: the 11 top bits of the order key of fp16(s) rounded toward zero (5 exponent and 5 mantissa bits;
//      NaN alone in bin 0). It is monotone in u, and finer than u's own top bits over the few octaves scores span,
//      so the boundary bin holds few keys. Each thread histograms its chunk (keys in registers where the chunk is
//      at most kRegKeys long, else streamed from L2) with plain shared atomics; the cluster sums the histograms
//      through distributed shared memory (reduce-scatter) and every CTA finds the same boundary bin b1, the keys
//      above it, and M, the cluster's count of keys in it.
//   2. M <= kCandidates (the same answer in every CTA): each thread counts its keys above b1 (G) and compacts its keys
//      in b1 into the CTA's candidate buffer at a block-scan offset. Every CTA then runs the same three radix passes
//      (11/11/10 bits of u) over the cluster's M candidates, read through distributed shared memory, and reaches the
//      same K-th key u* and `need` (how many u == u* to take). Each thread's keys > u* and == u* are G plus its own
//      candidates compared with u*.
//      M > kCandidates (heavy ties: every key equal, a narrow row of a million keys): the three passes walk the
//      chunks again, keys in b1 only, with warp-aggregated atomics and the cluster reduction, then one walk counts.
//   3. One block scan of the threads' (> u*, == u*) counts plus the CTAs' totals exchanged in the cluster give every
//      thread its first output index; the thread walks its own chunk in position order and writes each taken
//      position i at G(i) + min(E(i), need): ascending, front-packed, ties to the lower positions.
// Rows with key_len <= K are 0..n-1 then -1. The cluster size (register_topk_cluster) is the largest whose clusters
// all fit one wave: every CTA's chain of passes and barriers is about as long whatever its slice, so a second wave
// (64 rows of 8-CTA clusters: an H200 holds 62 at once) costs a whole chain again.
// What bounds it (ncu, b = 64 x 32K, C = 8): not bytes (DRAM 3.5%) but each warp's serial chain of ~2K instructions
// at ~14 cycles, a third of them waiting at CTA barriers (docs/design/2026-12-02-topk.md).
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/topk_common.cuh"

namespace dsacp::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kT = 256;
constexpr int kW = kT / 32;
constexpr int kBins = 2048;
constexpr int kRegKeys = 32;  // rank keys a thread holds in registers (a slice of up to kT * kRegKeys keys)
constexpr int kMinBlocks = 3;  // CTAs an SM (80 registers a thread): a b = 64 decode's 4-CTA clusters in one wave
constexpr int kMaxC = 8;
constexpr unsigned kFull = topk::kFullMask;
constexpr int kCap = kRegisterTopkCandidates;

using topk::rank_key;

// The first digit of rank key u: the fp16 order key of the float u stands for (NaN: u = 0, bin 0 alone; -0 is +0 in
// u), rounded toward zero: monotone in u, since rounding is.
__device__ __forceinline__ uint32_t first_digit(uint32_t u) {
  if (u == 0u) return 0u;
  const float s = __uint_as_float((u & 0x80000000u) ? (u ^ 0x80000000u) : ~u);
  uint32_t h = __half_as_ushort(__float2half_rz(s));
  h = (h & 0x8000u) ? (~h & 0xffffu) : (h | 0x8000u);
  return h >> 5;
}

__device__ __forceinline__ float4 load4(const float* p, int32_t avail) {
  if (avail >= 4) return __ldg(reinterpret_cast<const float4*>(p));
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
  if (avail > 0) r.x = __ldg(p);
  if (avail > 1) r.y = __ldg(p + 1);
  if (avail > 2) r.z = __ldg(p + 2);
  return r;
}

// Calls f(u, i) for each key i < clen of the thread's chunk, u its rank key: from the registers v (REG), else read
// from `chunk` 16 at a time (four 16-byte loads in flight).
template <bool REG, class F>
__device__ __forceinline__ void walk(const uint32_t (&v)[kRegKeys], const float* chunk, int32_t clen, F&& f) {
  if constexpr (REG) {
#pragma unroll
    for (int i = 0; i < kRegKeys; ++i) {
      if (i < clen) f(v[i], i);
    }
  } else {
#pragma unroll 1
    for (int32_t i0 = 0; i0 < clen; i0 += 16) {
      float4 x[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) x[q] = load4(chunk + i0 + 4 * q, clen - i0 - 4 * q);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (i0 + 4 * q + 0 < clen) f(rank_key(x[q].x), i0 + 4 * q + 0);
        if (i0 + 4 * q + 1 < clen) f(rank_key(x[q].y), i0 + 4 * q + 1);
        if (i0 + 4 * q + 2 < clen) f(rank_key(x[q].z), i0 + 4 * q + 2);
        if (i0 + 4 * q + 3 < clen) f(rank_key(x[q].w), i0 + 4 * q + 3);
      }
    }
  }
}

// As walk, but every thread of the CTA runs the same iterations (i < ch, the same in every thread; ok = i < clen), so
// warp-wide votes inside f are safe.
template <bool REG, class F>
__device__ __forceinline__ void walk_all(const uint32_t (&v)[kRegKeys], const float* chunk, int32_t ch, int32_t clen,
                                         F&& f) {
  if constexpr (REG) {
#pragma unroll
    for (int i = 0; i < kRegKeys; ++i) f(v[i], i < clen);
  } else {
#pragma unroll 1
    for (int32_t i0 = 0; i0 < ch; i0 += 4) {
      const float4 x = load4(chunk + i0, clen - i0);
      f(rank_key(x.x), i0 < clen);
      f(rank_key(x.y), i0 + 1 < clen);
      f(rank_key(x.z), i0 + 2 < clen);
      f(rank_key(x.w), i0 + 3 < clen);
    }
  }
}

struct Found {
  uint32_t bin, above, count;  // the bin holding the rem-th key, the keys in bins above it, the keys in it
};

struct Smem {
  uint32_t hist[kBins];  // this CTA's histogram of the pass
  uint32_t red[kBins / 2];  // C > 1: bin range `rank` of the cluster's sum
  uint32_t cand[kCap];   // the CTA's keys in the boundary bin, in position order
  uint32_t scan[kW], found[3], range_total, pick[2], cnt, off[kMaxC + 1];
  int32_t wsum[2][kW], tot[2], base[2];
};

// The cluster's histogram `hist` (nb bins, every CTA's complete; the caller's __syncthreads done) searched for the
// bin of the rem-th largest key. Leaves every CTA's hist free to clear again.
__device__ Found cluster_find(Smem& sm, int nb, uint32_t rem, int C, int rank) {
  const uint32_t* search = sm.hist;
  uint32_t base_bin = 0, above = 0;
  int m = nb;
  if (C > 1) {
    const topk::ClusterRange cr = topk::cluster_reduce_scatter<kT, kMaxC>(sm.hist, sm.red, nb, rem, C, rank, sm.scan,
                                                                          &sm.range_total, sm.pick);
    search = cr.bins;
    base_bin = cr.base_bin;
    above = cr.above;
    m = cr.m;
  }
  topk::find_bin<kT>(search, m, rem - above, sm.scan, sm.found);
  return Found{base_bin + sm.found[0], above + sm.found[1], sm.found[2]};
}

// Exclusive block scan of the threads' (a, b); returns this thread's bases, sets the CTA's totals in sm.tot.
__device__ __forceinline__ int2 block_scan2(Smem& sm, int32_t a, int32_t b) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int32_t ia = a, ib = b;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int32_t xa = __shfl_up_sync(kFull, ia, off), xb = __shfl_up_sync(kFull, ib, off);
    if (lane >= off) {
      ia += xa;
      ib += xb;
    }
  }
  if (lane == 31) {
    sm.wsum[0][warp] = ia;
    sm.wsum[1][warp] = ib;
  }
  __syncthreads();
  int32_t ba = ia - a, bb = ib - b, ta = 0, tb = 0;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    const int32_t wa = sm.wsum[0][w], wb = sm.wsum[1][w];
    if (w < warp) {
      ba += wa;
      bb += wb;
    }
    ta += wa;
    tb += wb;
  }
  if (tid == 0) {
    sm.tot[0] = ta;
    sm.tot[1] = tb;
  }
  __syncthreads();  // wsum free for the next scan
  return make_int2(ba, bb);
}

template <bool REG>
__global__ void __launch_bounds__(kT, kMinBlocks)
    register_topk_kernel(const float* __restrict__ scores, const int64_t* __restrict__ score_offset,
                         const int32_t* __restrict__ key_len, int64_t t0, int32_t K, int32_t* __restrict__ topk,
                         float* __restrict__ topk_scores, const __grid_constant__ InlinePlan inl) {
  __shared__ __align__(16) Smem sm;
  cg::cluster_group cl = cg::this_cluster();
  const int C = static_cast<int>(cl.num_blocks());
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t t = t0 + blockIdx.x / C;
  const int32_t n = key_len[t];
  int32_t* out = topk + t * K;
  float* out_scores = topk_scores == nullptr ? nullptr : topk_scores + t * K;
  const float* row = scores + plan_score_offset(inl, score_offset, t);
  const int tid = threadIdx.x, lane = tid & 31;

  if (n <= K) {  // the same n in every CTA of the cluster: no barrier is skipped by some and met by others
    topk::short_row_topk<kT>(C, rank, n, K, row, out, out_scores);
    return;
  }
  const int32_t slice = ((n + C - 1) / C + 3) / 4 * 4;
  const int32_t lo = min(n, rank * slice), len = min(n, lo + slice) - lo;
  const int32_t ch = ((len + kT - 1) / kT + 3) / 4 * 4;  // chunk per thread, a multiple of 4: 16-byte aligned
  const int32_t c0 = min(len, tid * ch), clen = min(len, c0 + ch) - c0;
  const float* chunk = row + lo + c0;

  uint32_t v[kRegKeys];  // REG: the chunk's rank keys
  if constexpr (REG) {
#pragma unroll
    for (int q = 0; q < kRegKeys / 4; ++q) {
      const float4 x = load4(chunk + 4 * q, clen - 4 * q);
      v[4 * q] = rank_key(x.x);
      v[4 * q + 1] = rank_key(x.y);
      v[4 * q + 2] = rank_key(x.z);
      v[4 * q + 3] = rank_key(x.w);
    }
  }
  // 1. the first digit
#pragma unroll 1
  for (int i = tid; i < kBins; i += kT) sm.hist[i] = 0;
  __syncthreads();
  walk<REG>(v, chunk, clen, [&](uint32_t u, int32_t) { atomicAdd(&sm.hist[first_digit(u)], 1u); });
  __syncthreads();
  const Found f1 = cluster_find(sm, kBins, static_cast<uint32_t>(K), C, rank);
  const uint32_t b1 = f1.bin;
  uint32_t rem = static_cast<uint32_t>(K) - f1.above;  // keys to take from bin b1
  const bool compact = f1.count <= static_cast<uint32_t>(kCap);  // the same in every CTA of the cluster

  // 2. the thread's keys above b1, and its keys in b1 compacted (when they fit)
  int32_t g = 0, e = 0;
  walk<REG>(v, chunk, clen, [&](uint32_t u, int32_t) {
    const uint32_t d = first_digit(u);
    g += d > b1;
    e += d == b1;
  });
  uint32_t prefix = 0, mask = 0;
  int32_t my_off = 0;
  if (compact) {
    my_off = block_scan2(sm, e, 0).x;
    int32_t w = my_off;
    walk<REG>(v, chunk, clen, [&](uint32_t u, int32_t) {
      if (first_digit(u) == b1) sm.cand[w++] = u;
    });
    if (tid == 0) sm.cnt = static_cast<uint32_t>(sm.tot[0]);
    cl.sync();  // every CTA's candidates and count are there
    if (tid == 0) {
      uint32_t o = 0;
#pragma unroll 1
      for (int q = 0; q < C; ++q) {
        sm.off[q] = o;
        o += *cl.map_shared_rank(&sm.cnt, q);
      }
      sm.off[C] = o;
    }
    // the three digits of u over the cluster's candidates, the same in every CTA
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
      const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
      const int nb = pass == 2 ? kBins / 2 : kBins;
      const uint32_t dm = static_cast<uint32_t>(nb - 1);
#pragma unroll 1
      for (int i = tid; i < nb; i += kT) sm.hist[i] = 0;
      __syncthreads();
#pragma unroll 1
      for (int q = 0; q < C; ++q) {
        const uint32_t* cq = cl.map_shared_rank(sm.cand, q);
        const int32_t nq = static_cast<int32_t>(sm.off[q + 1] - sm.off[q]);
#pragma unroll 1
        for (int32_t i = tid; i < nq; i += kT) {
          const uint32_t u = cq[i];
          if ((u & mask) == prefix) atomicAdd(&sm.hist[(u >> shift) & dm], 1u);
        }
      }
      __syncthreads();
      topk::find_bin<kT>(sm.hist, nb, rem, sm.scan, sm.found);
      prefix |= sm.found[0] << shift;
      mask |= dm << shift;
      rem -= sm.found[1];
    }
    // the thread's candidates against u*
    int32_t gt = 0, eq = 0;
#pragma unroll 1
    for (int32_t j = my_off; j < my_off + e; ++j) {
      const uint32_t u = sm.cand[j];
      gt += u > prefix;
      eq += u == prefix;
    }
    g += gt;
    e = eq;
  } else {
    // heavy ties: the three digits of u over the keys in b1, walking the chunks again
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
      const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
      const int nb = pass == 2 ? kBins / 2 : kBins;
      const uint32_t dm = static_cast<uint32_t>(nb - 1);
#pragma unroll 1
      for (int i = tid; i < nb; i += kT) sm.hist[i] = 0;
      __syncthreads();
      walk_all<REG>(v, chunk, ch, clen, [&](uint32_t u, bool ok) {
        const bool part = ok && first_digit(u) == b1 && (u & mask) == prefix;
        const uint32_t d = (u >> shift) & dm;
        const uint32_t peers = __match_any_sync(kFull, part ? d : 0x10000u + lane);  // equal digits: one atomic
        if (part && lane == __ffs(peers) - 1) atomicAdd(&sm.hist[d], __popc(peers));
      });
      __syncthreads();
      const Found fp = cluster_find(sm, nb, rem, C, rank);
      prefix |= fp.bin << shift;
      mask |= dm << shift;
      rem -= fp.above;
    }
    int32_t eq = 0;
    g = 0;
    walk<REG>(v, chunk, clen, [&](uint32_t u, int32_t) {
      g += u > prefix;
      eq += u == prefix;
    });
    e = eq;
  }
  const uint32_t thr = prefix;                     // u*, the K-th largest key
  const int32_t need = static_cast<int32_t>(rem);  // how many u == u* to take (lowest positions first)

  // 3. output indices: the block scan of (g, e), the CTAs before this one in the cluster, then the chunk's walk
  int2 base = block_scan2(sm, g, e);
  if (C > 1) {
    cl.sync();  // every CTA's totals are there; every CTA is done reading the peers' candidates
    topk::cluster_exclusive_totals(sm.tot, rank, sm.base);
    __syncthreads();
    base.x += sm.base[0];
    base.y += sm.base[1];
    topk::cluster_arrive();  // done reading the peers' memory
  }
  int32_t G = base.x, E = base.y;
  const int32_t pos0 = lo + c0;
  walk<REG>(v, chunk, clen, [&](uint32_t u, int32_t i) {
    int32_t at = -1;
    if (u > thr) {
      at = G + min(E, need);
      ++G;
    } else if (u == thr) {
      if (E < need) at = G + E;
      ++E;
    }
    if (at >= 0) {
      out[at] = pos0 + i;
      if (out_scores != nullptr) out_scores[at] = __ldg(chunk + i);  // the score bit for bit (u has no -0, NaN bits)
    }
  });
  if (C > 1) topk::cluster_wait();  // no CTA exits while read
}

void make_config(cudaLaunchConfig_t& cfg, cudaLaunchAttribute* attr, int64_t rows, int cluster, cudaStream_t stream) {
  topk::cluster_launch_config(cfg, attr, rows, cluster, kT, 0, stream);
}

bool in_registers(int32_t max_len, int cluster) {
  const int64_t slice = ((int64_t{max_len} + cluster - 1) / cluster + 3) / 4 * 4;
  return slice <= int64_t{kT} * kRegKeys;
}

// How many clusters of `cluster` CTAs of the kernel the device holds at once (the placement of clusters on the
// GPCs leaves fewer than SMs x CTAs an SM / cluster: 62 of 8 CTAs on an H200 at 4 CTAs an SM). Asked once a form.
int max_active_clusters(bool reg, int cluster, cudaStream_t stream) {
  static std::atomic<int> cache[2][4] = {{-1, -1, -1, -1}, {-1, -1, -1, -1}};
  const int ci = cluster == 1 ? 0 : cluster == 2 ? 1 : cluster == 4 ? 2 : 3;
  std::atomic<int>& n = cache[reg ? 1 : 0][ci];
  if (n.load() < 0) {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[1];
    make_config(cfg, attr, 1, cluster, stream);
    int got = 0;
    const cudaError_t e = reg ? cudaOccupancyMaxActiveClusters(&got, register_topk_kernel<true>, &cfg)
                              : cudaOccupancyMaxActiveClusters(&got, register_topk_kernel<false>, &cfg);
    n.store(e == cudaSuccess ? got : 0);
  }
  return n.load();
}

}  // namespace

int register_topk_cluster(int64_t rows, int32_t max_len, const LaunchContext& ctx) {
  // The largest C whose clusters all run in one wave, each CTA with at least 2048 keys of the longest row: every
  // CTA's chain of passes and barriers is the same length whatever its slice, so a second wave doubles the time
  // (measured at b = 64: C = 8 takes two waves and is slower than C = 4 at 32K, 64K and 128K).
  for (int c = 8; c >= 2; c /= 2) {
    if (int64_t{max_len} < int64_t{c} * 2048) continue;
    if (rows <= max_active_clusters(in_registers(max_len, c), c, ctx.stream)) return c;
  }
  return 1;
}

Status launch_register_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                            const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                            const LaunchContext& ctx, int cluster) {
  if (t1 <= t0) return Status::ok_status();
  if (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8) {
    return invalid_argument("register top-k: cluster=" + std::to_string(cluster) + "; expected 1, 2, 4 or 8");
  }
  const int64_t rows = t1 - t0;
  if (rows * cluster >= (int64_t{1} << 31)) {
    return unsupported("register top-k: rows x cluster=" + std::to_string(rows * cluster) + "; expected < 2^31");
  }
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[1];
  make_config(cfg, attr, rows, cluster, ctx.stream);
  auto kernel = in_registers(max_len, cluster) ? register_topk_kernel<true> : register_topk_kernel<false>;
  DSACP_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, kernel, scores, score_offset, p.rows.key_len, t0, p.K, p.topk,
                                                p.topk_scores, inl));
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("register_topk_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
