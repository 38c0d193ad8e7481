// Exact top-k per row in the contract's canonical form, the filter form (TopkForm::kFilter): two walks over each key
// instead of five. A thread-block cluster of C CTAs of kT threads per row (C = 1, 2, 4, 8; kT = 256, 512, 1024), CTA
// r owning the slice [r*S, (r+1)*S) of the row's positions; warp w of a CTA a contiguous segment of the slice (a
// multiple of 128 positions), its lanes reading 16 bytes each, so a warp iteration covers 128 positions = 4 words of
// a position bitmap.
//
// rank key u(s): larger = better; NaN = 0 (below everything), -0 == +0, the CPU oracle's map.
//   1. Walk 1 (from HBM): a 2048-bin histogram of the first digit, the 11 top bits of the order key of fp16(s)
//      rounded toward zero (NaN alone in bin 0): monotone in u and finer than u's own top bits over the few octaves
//      scores span, so the boundary bin holds few keys. With C > 1, after one cluster barrier every CTA sums the C
//      histograms through distributed shared memory and finds the same boundary bin b1, the keys above it, and M,
//      the cluster's count of keys in it; each CTA also knows its own counts above b1 and in b1.
//   2. Walk 2 (registers where the warp's segment is one batch of loads, else L1 / L2): each warp writes the words of
//      the bitmap GT (keys with a digit above b1: all taken) from its lanes' nibbles (three shuffles), zeroes the
//      words of EQ, and appends the keys of bin b1 (position, u) to the CTA's candidate list (ballot offsets, one
//      shared atomic a warp; the list's order is free: nothing below depends on it).
//   3. The K-th key u* among the cluster's M candidates (after a second cluster barrier every CTA copies its peers'
//      candidate keys): digits of up to 11 bits from the highest bit where candidates differ (one or two passes over
//      a few hundred keys for real scores), the same u* and `need` (how many u == u* to take) in every CTA. Each
//      CTA sets its candidates' bits: u > u* into GT, u == u* into EQ. The keys > u* and == u* of the CTAs before
//      this one come from their counts above b1 and the copied candidates, with no third barrier.
//   4. The output: a block scan of the bitmaps' popcounts, then each thread writes its words' taken positions in
//      position order: position i at G(i) + min(E(i), need): ascending, front-packed, ties to the lower positions.
// M above the candidate buffer (heavy ties: every key equal, a narrow row of a million keys): three radix passes
// (11/11/10 bits of u) walk the slice again over the keys of bin b1 with warp-aggregated atomics, then one walk
// writes GT / EQ from u against u*, and a cluster barrier exchanges the CTAs' counts. Rows with key_len <= K are
// 0..n-1 then -1. The result is a function of the scores alone (counts and bitmaps): bit-identical run to run.
// What bounds it (ncu, b = 64 x 32K, 512 threads, C = 2): not bytes (DRAM < 30%) nor issue slots (SM 35%) but each
// CTA's chain of loads and barriers at ~1 CTA an SM (docs/design/2026-12-02-topk.md).
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/indexer_topk/cluster_topk.h"
#include "kernels/cuda/indexer_topk/filter_topk_parts.cuh"
#include "kernels/cuda/indexer_topk/topk_common.cuh"

namespace dsacp::cuda {
namespace {

using namespace filter_topk_detail;

template <int kT>
__global__ void __launch_bounds__(kT, (kT >= 1024 ? 1 : 1024 / kT))
    filter_topk_kernel(const float* __restrict__ scores, const int64_t* __restrict__ score_offset,
                       const int32_t* __restrict__ key_len, int64_t t0, int32_t K, int32_t* __restrict__ topk,
                       float* __restrict__ topk_scores, int32_t words_cap, int32_t cap,
                       const __grid_constant__ InlinePlan inl) {
  __shared__ __align__(16) Smem<kT> sm;
  extern __shared__ __align__(16) uint32_t dyn[];
  uint32_t* gtw = dyn;                                              // [words_cap] keys taken (> u*)
  uint32_t* eqw = dyn + words_cap;                                  // [words_cap] keys == u*
  int32_t* cpos = reinterpret_cast<int32_t*>(dyn + 2 * words_cap);  // [cap] the CTA's candidates: slice position
  uint32_t* ckey = dyn + 2 * words_cap + cap;                       // [cap] and rank key
  uint32_t* gkey = dyn + 2 * words_cap + 2 * cap;                   // [cap] C > 1: the cluster's candidate keys

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
  const float* srow = row + lo;
  const Seg sg = warp_segment<kT>(len);
  const bool held = sg.whi - sg.wlo <= 128 * kU;  // the warp's segment is one batch: walk 2 reads the registers

  // 1. walk 1: the first digit's histogram
#pragma unroll
  for (int k = 0; k < kBins / kT; ++k) sm.hist[tid + k * kT] = 0;
  if (tid == 0) sm.cnt = 0;
  __syncthreads();
  float4 x[kU];
#pragma unroll 1
  for (int32_t j0 = sg.wlo; j0 < sg.whi; j0 += 128 * kU) {
#pragma unroll
    for (int q = 0; q < kU; ++q) {
      const int32_t j = j0 + 128 * q + 4 * lane;
      x[q] = load4(srow + j, sg.whi - j);
    }
#pragma unroll
    for (int q = 0; q < kU; ++q) {
      const int32_t j = j0 + 128 * q + 4 * lane;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (j + c < sg.whi) atomicAdd(&sm.hist[first_digit(comp(x[q], c))], 1u);
      }
    }
  }
  if (C > 1) {
    cl.sync();
  } else {
    __syncthreads();
  }
  find_bin<kT>(sm, static_cast<uint32_t>(K), C);
  const uint32_t b1 = sm.found[0];
  const uint32_t M = sm.found[2];  // the cluster's keys in b1
  uint32_t rem = static_cast<uint32_t>(K) - sm.found[1];
  const int32_t my_above = static_cast<int32_t>(sm.found[3]);
  const bool compact = M <= static_cast<uint32_t>(cap);  // the same in every CTA of the cluster
  uint32_t thr = 0, need = 0;
  int32_t G0 = 0, E0 = 0;  // the taken keys > u* and == u* of the CTAs before this one

  if (compact) {
    if (tid == 0) {
      sm.info[0] = my_above;
      sm.info[1] = static_cast<int32_t>(sm.hist[b1]);
    }
    // 2. walk 2: GT words of the keys above b1, EQ words zeroed, the keys of b1 appended to the candidate list
#pragma unroll 1
    for (int32_t j0 = sg.wlo; j0 < sg.whi; j0 += 128 * kU) {
      if (!held) {
#pragma unroll
        for (int q = 0; q < kU; ++q) {
          const int32_t j = j0 + 128 * q + 4 * lane;
          x[q] = load4(srow + j, sg.whi - j);
        }
      }
#pragma unroll
      for (int q = 0; q < kU; ++q) {
        const int32_t jq = j0 + 128 * q;
        if (jq >= sg.whi) break;  // warp-uniform
        const int32_t j = jq + 4 * lane;
        uint32_t gn = 0, en = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const uint32_t d = first_digit(comp(x[q], c));
          const bool v = j + c < sg.whi;
          gn |= static_cast<uint32_t>(v && d > b1) << c;
          en |= static_cast<uint32_t>(v && d == b1) << c;
        }
        put_words(gtw, eqw, jq, gn, 0u, lane);
        if (__any_sync(kFull, en != 0)) {
          const uint32_t lt = (1u << lane) - 1u;
          uint32_t at = 0, total = 0;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const uint32_t bal = __ballot_sync(kFull, (en >> c) & 1u);
            at += __popc(bal & lt);
            total += __popc(bal);
          }
          uint32_t base = 0;
          if (lane == 0) base = atomicAdd(&sm.cnt, total);
          at += __shfl_sync(kFull, base, 0);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            if ((en >> c) & 1u) {
              cpos[at] = j + c;
              ckey[at] = rank_key(comp(x[q], c));
              ++at;
            }
          }
        }
      }
    }
    // 3. the cluster's candidates: this CTA's list, or (C > 1) every CTA's keys copied in rank order
    const uint32_t* keys = ckey;
    uint32_t before = 0;  // candidates of the CTAs before this one (the first `before` of gkey)
    if (C > 1) {
      cl.sync();  // every CTA's list and info are there; every CTA is done reading the histograms
      if (tid < C) {
        const int32_t* pi = cl.map_shared_rank(sm.info, tid);
        sm.peer[0][tid] = pi[0];
        sm.peer[1][tid] = pi[1];
      }
      __syncthreads();
      uint32_t o = 0;
#pragma unroll 1
      for (int q = 0; q < C; ++q) {
        const uint32_t mq = static_cast<uint32_t>(sm.peer[1][q]);
        if (q == rank) before = o;
        if (q < rank) G0 += sm.peer[0][q];
        const uint32_t* src = q == rank ? ckey : cl.map_shared_rank(ckey, q);
#pragma unroll 1
        for (uint32_t i = tid; i < mq; i += kT) gkey[o + i] = src[i];
        o += mq;
      }
      __syncthreads();
      topk::cluster_arrive();  // done reading the peers' shared memory (waited for before the CTA exits)
      keys = gkey;
    } else {
      __syncthreads();
    }
    // the K-th key among the M candidates: the bits where they differ, up to 11 at a time from the highest
    uint32_t diff = 0;
    const uint32_t k0 = keys[0];
#pragma unroll 1
    for (uint32_t i = tid; i < M; i += kT) diff |= keys[i] ^ k0;
    diff = __reduce_or_sync(kFull, diff);
    if (tid == 0) sm.bits_or = 0;
    __syncthreads();
    if (lane == 0 && diff != 0) atomicOr(&sm.bits_or, diff);
    __syncthreads();
    diff = sm.bits_or;
    int top = diff == 0 ? -1 : 31 - __clz(diff);
    uint32_t known = top >= 31 ? 0u : ~((2u << top) - 1u), prefix = k0 & known;
    if (top < 0) known = ~0u, prefix = k0;
#pragma unroll 1
    while (top >= 0) {
      const int low = max(0, top - 10);
      const uint32_t dm = (2u << (top - low)) - 1u;
#pragma unroll
      for (int k = 0; k < kBins / kT; ++k) sm.hist[tid + k * kT] = 0;
      __syncthreads();
#pragma unroll 1
      for (uint32_t i = tid; i < M; i += kT) {
        const uint32_t u = keys[i];
        if ((u & known) == prefix) atomicAdd(&sm.hist[(u >> low) & dm], 1u);
      }
      __syncthreads();
      find_bin<kT>(sm, rem, 1);
      prefix |= sm.found[0] << low;
      known |= dm << low;
      rem -= sm.found[1];
      top = low - 1;
    }
    thr = prefix;
    need = rem;
    // this CTA's candidates into the bitmaps; the candidates of the CTAs before it counted
    const uint32_t mine = static_cast<uint32_t>(sm.info[1]);
#pragma unroll 1
    for (uint32_t i = tid; i < mine; i += kT) {
      const uint32_t u = ckey[i];
      const int32_t p = cpos[i];
      if (u > thr) atomicOr(&gtw[p >> 5], 1u << (p & 31));
      if (u == thr) atomicOr(&eqw[p >> 5], 1u << (p & 31));
    }
    uint32_t bg = 0, be = 0;
#pragma unroll 1
    for (uint32_t i = tid; i < before; i += kT) {
      bg += keys[i] > thr;
      be += keys[i] == thr;
    }
    uint2 tot;
    block_scan2<kT, false>(sm, bg, be, &tot);  // its barriers also order the bitmap updates before the output
    G0 += static_cast<int32_t>(tot.x);
    E0 = static_cast<int32_t>(tot.y);
  } else {
    // heavy ties: the three digits of u over the keys of bin b1, walking the slice again
    uint32_t prefix = 0, mask = 0;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
      const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
      const uint32_t dm = pass == 2 ? 1023u : 2047u;
      if (C > 1) cl.sync();  // every CTA is done reading the histograms of the last search
#pragma unroll
      for (int k = 0; k < kBins / kT; ++k) sm.hist[tid + k * kT] = 0;
      __syncthreads();
#pragma unroll 1
      for (int32_t j0 = sg.wlo; j0 < sg.whi; j0 += 128) {
        const int32_t j = j0 + 4 * lane;
        const float4 y = load4(srow + j, sg.whi - j);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float s = comp(y, c);
          const uint32_t u = rank_key(s);
          const bool part = j + c < sg.whi && first_digit(s) == b1 && (u & mask) == prefix;
          const uint32_t d = (u >> shift) & dm;
          const uint32_t peers = __match_any_sync(kFull, part ? d : 0x10000u + lane);  // equal digits: one atomic
          if (part && lane == __ffs(peers) - 1) atomicAdd(&sm.hist[d], __popc(peers));
        }
      }
      if (C > 1) {
        cl.sync();
      } else {
        __syncthreads();
      }
      find_bin<kT>(sm, rem, C);
      prefix |= sm.found[0] << shift;
      mask |= dm << shift;
      rem -= sm.found[1];
    }
    thr = prefix;
    need = rem;
    // one walk: GT and EQ from u against u*, and this CTA's counts
    uint32_t ng = 0, ne = 0;
#pragma unroll 1
    for (int32_t j0 = sg.wlo; j0 < sg.whi; j0 += 128) {
      const int32_t j = j0 + 4 * lane;
      const float4 y = load4(srow + j, sg.whi - j);
      uint32_t gn = 0, en = 0;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t u = rank_key(comp(y, c));
        const bool v = j + c < sg.whi;
        gn |= static_cast<uint32_t>(v && u > thr) << c;
        en |= static_cast<uint32_t>(v && u == thr) << c;
      }
      ng += __popc(gn);
      ne += __popc(en);
      put_words(gtw, eqw, j0, gn, en, lane);
    }
    uint2 tot;
    block_scan2<kT, false>(sm, ng, ne, &tot);
    if (C > 1) {
      if (tid == 0) {
        sm.info[2] = static_cast<int32_t>(tot.x);
        sm.info[3] = static_cast<int32_t>(tot.y);
      }
      cl.sync();  // every CTA's counts are there, and every CTA is done reading the histograms
      if (tid < rank) {
        const int32_t* pi = cl.map_shared_rank(sm.info, tid);
        sm.peer[0][tid] = pi[2];
        sm.peer[1][tid] = pi[3];
      }
      __syncthreads();
      topk::cluster_arrive();
#pragma unroll 1
      for (int q = 0; q < rank; ++q) {
        G0 += sm.peer[0][q];
        E0 += sm.peer[1][q];
      }
    }
  }

  // 4. the output: each thread's words in position order, at the block scan of their popcounts
  const int32_t nw = (len + 31) / 32;
  const int32_t per = (nw + kT - 1) / kT;
  const int32_t w0 = min(nw, tid * per), w1 = min(nw, w0 + per);
  uint32_t cg_ = 0, ce = 0;
#pragma unroll 1
  for (int32_t w = w0; w < w1; ++w) {
    cg_ += __popc(gtw[w]);
    ce += __popc(eqw[w]);
  }
  uint2 tot;
  const uint2 pre = block_scan2<kT, false>(sm, cg_, ce, &tot);
  int32_t G = G0 + static_cast<int32_t>(pre.x), E = E0 + static_cast<int32_t>(pre.y);
  const int32_t nd = static_cast<int32_t>(need);
#pragma unroll 1
  for (int32_t w = w0; w < w1; ++w) {
    const uint32_t g = gtw[w];
    uint32_t m = g | eqw[w];
    while (m != 0u) {
      const int b = __ffs(m) - 1;
      m &= m - 1u;
      const int32_t p = w * 32 + b;
      int32_t at = -1;
      if ((g >> b) & 1u) {
        at = G + min(E, nd);
        ++G;
      } else {
        if (E < nd) at = G + E;
        ++E;
      }
      if (at >= 0) {
        out[at] = lo + p;
        if (out_scores != nullptr) out_scores[at] = __ldg(srow + p);  // the score bit for bit
      }
    }
  }
  if (C > 1) topk::cluster_wait();  // no CTA exits while its shared memory is read
}

template <int kT>
void make_config(cudaLaunchConfig_t& cfg, cudaLaunchAttribute* attr, int64_t rows, int cluster, size_t smem,
                 cudaStream_t stream) {
  topk::cluster_launch_config(cfg, attr, rows, cluster, kT, smem, stream);
}

int candidate_cap(int threads) { return threads >= 512 ? 4096 : 2048; }

int64_t words_cap(int32_t max_len, int cluster) {
  const int64_t slice = ((int64_t{max_len} + cluster - 1) / cluster + 3) / 4 * 4;
  return (slice + 127) / 128 * 4;
}

int64_t dyn_smem(int32_t max_len, int cluster, int threads) {
  return (2 * words_cap(max_len, cluster) + int64_t{candidate_cap(threads)} * (cluster > 1 ? 3 : 2)) * 4;
}

template <int kT>
int max_active_clusters_t(int cluster, cudaStream_t stream) {
  static std::atomic<int> cache[4] = {-1, -1, -1, -1};
  const int ci = cluster == 1 ? 0 : cluster == 2 ? 1 : cluster == 4 ? 2 : 3;
  if (cache[ci].load() < 0) {
    const int bytes = static_cast<int>(dyn_smem(1 << 16, cluster, kT));
    int got = 0;
    if (ensure_dynamic_smem_limit(filter_topk_kernel<kT>, bytes) == cudaSuccess) {
      cudaLaunchConfig_t cfg;
      cudaLaunchAttribute attr[1];
      make_config<kT>(cfg, attr, 1, cluster, static_cast<size_t>(bytes), stream);
      if (cudaOccupancyMaxActiveClusters(&got, filter_topk_kernel<kT>, &cfg) != cudaSuccess) got = 0;
    }
    (void)cudaGetLastError();
    cache[ci].store(got);
  }
  return cache[ci].load();
}

template <int kT>
Status launch_t(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len, const int64_t* score_offset,
                const float* scores, const InlinePlan& inl, const LaunchContext& ctx, int cluster) {
  const int64_t bytes = dyn_smem(max_len, cluster, kT);
  DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(filter_topk_kernel<kT>, static_cast<int>(bytes)));
  cudaLaunchConfig_t cfg;
  cudaLaunchAttribute attr[1];
  make_config<kT>(cfg, attr, t1 - t0, cluster, static_cast<size_t>(bytes), ctx.stream);
  DSACP_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&cfg, filter_topk_kernel<kT>, scores, score_offset, p.rows.key_len, t0,
                                                p.K, p.topk, p.topk_scores,
                                                static_cast<int32_t>(words_cap(max_len, cluster)),
                                                static_cast<int32_t>(candidate_cap(kT)), inl));
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("filter_topk_kernel");
  return Status::ok_status();
}

}  // namespace

bool filter_topk_fits(int32_t max_len, int cluster, int threads) {
  constexpr int64_t kSmemPerBlock = 227 * 1024 - 16 * 1024;  // less the kernel's static shared memory (~9-11 KiB)
  return dyn_smem(max_len, cluster, threads) <= kSmemPerBlock;
}

int filter_topk_threads(int64_t rows, int32_t max_len, const LaunchContext& ctx) {
  // many rows (a prefill's): 256 threads, several CTAs an SM; decode batches: 512 threads up to 32K keys a row, 1024
  // past that (measured at b = 64: 32K 0.0236 ms at 512 against 0.0256 at 1024; 64K and 128K faster at 1024)
  if (rows > 2 * int64_t{std::max(1, ctx.num_sms)}) return 256;
  return max_len <= 32768 ? 512 : 1024;
}

int filter_topk_cluster(int64_t rows, int32_t max_len, int threads, const LaunchContext& ctx) {
  // The smallest C (fewer, larger CTAs a row: measured faster, C = 2 against 4 and 8 at b = 64) whose rows x C fill
  // the SMs (90%), or whose next size would leave fewer than 4 keys a thread; C whose bitmaps do not fit skipped.
  // Then halved (down to the smallest that fits) while the clusters do not all fit one wave.
  const int64_t sms = std::max(1, ctx.num_sms);
  int c = 0, smallest = 0;
  for (int k = 1; k <= 8; k *= 2) {
    if (!filter_topk_fits(max_len, k, threads)) continue;
    if (smallest == 0) smallest = k;
    c = k;
    if (rows * k * 10 >= sms * 9 || int64_t{max_len} < int64_t{k} * 2 * 4 * threads) break;
  }
  if (c == 0) return 8;  // nothing fits: launch_filter_topk refuses it with its message
  auto active = [&](int k) {
    return threads == 1024  ? max_active_clusters_t<1024>(k, ctx.stream)
           : threads == 512 ? max_active_clusters_t<512>(k, ctx.stream)
                            : max_active_clusters_t<256>(k, ctx.stream);
  };
  while (c > smallest && c > 1 && rows > active(c)) c /= 2;
  return c;
}

Status launch_filter_topk(const IndexerTopkParams& p, int64_t t0, int64_t t1, int32_t max_len,
                          const int64_t* score_offset, const float* scores, const InlinePlan& inl,
                          const LaunchContext& ctx, int cluster, int threads) {
  if (t1 <= t0) return Status::ok_status();
  if (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8) {
    return invalid_argument("filter top-k: cluster=" + std::to_string(cluster) + "; expected 1, 2, 4 or 8");
  }
  if (threads != 256 && threads != 512 && threads != 1024) {
    return invalid_argument("filter top-k: threads=" + std::to_string(threads) + "; expected 256, 512 or 1024");
  }
  const int64_t rows = t1 - t0;
  if (rows * cluster >= (int64_t{1} << 31)) {
    return unsupported("filter top-k: rows x cluster=" + std::to_string(rows * cluster) + "; expected < 2^31");
  }
  if (!filter_topk_fits(max_len, cluster, threads)) {
    return unsupported("filter top-k: a slice of " + std::to_string((int64_t{max_len} + cluster - 1) / cluster) +
                       " keys (max_len " + std::to_string(max_len) + ", cluster " + std::to_string(cluster) +
                       ") needs more shared memory than a CTA has");
  }
  if (threads == 1024) return launch_t<1024>(p, t0, t1, max_len, score_offset, scores, inl, ctx, cluster);
  if (threads == 512) return launch_t<512>(p, t0, t1, max_len, score_offset, scores, inl, ctx, cluster);
  return launch_t<256>(p, t0, t1, max_len, score_offset, scores, inl, ctx, cluster);
}

}  // namespace dsacp::cuda
