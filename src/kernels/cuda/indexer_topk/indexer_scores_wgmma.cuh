// The persistent FP8 score kernel's shared parts (indexer_scores_wgmma.cu: the kernel and its two math loops):
// the shared-memory layout, the producer warps (a ring of stages each, filled by bulk copies), the group's Q load,
// and v5's math loop (one accumulator set a warpgroup; docs/design/2026-12-02-persistent-score-kernel.md).
#pragma once

#include <cuda.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "dsacp/fp8.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mbarrier_sm90.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_sm90.cuh"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "kernels/cuda/indexer_topk/wgmma_f16_sm90.cuh"

namespace dsacp::cuda {
namespace score_wg {
constexpr int kDi = 128;           // bytes of an e4m3 row
constexpr int kBK = 64;            // keys a block (one wgmma M tile)
constexpr int kSub = kScoreKeys / kBK;  // blocks of a score item
// kMW (a template parameter): math warpgroups, each with its own producer warp and ring; a CTA is 128 (1 + kMW)
// threads (the producer warpgroup + the math warpgroups).
constexpr int kStageBytes = kBK * kDi;
constexpr int kMaxStages = 24;     // all rings together (as many as fit in shared memory)
constexpr int kPassN = 128;        // wgmma columns a pass (accumulators: kPassN / 2 registers a thread)

struct WgArgs : ScoreKernelArgs {
  int32_t stages;  // a ring's (kMW rings)
  // v7 at page sizes that are multiples of 64: the key rows of the pool as a 3-D tensor (128 B x page_size rows x
  // num_pages, page stride page_size x 132 B or the pool's padded stride), boxes of 128 B x 64 rows x 1 page, 128B-swizzled into the stage
  CUtensorMap kmap;
};
static_assert(sizeof(WgArgs) <= 4096, "the wgmma score kernel's parameters past 4 KB");

// Shared memory, S = all rings' stages (ring c: stages [c S / kMW, (c + 1) S / kMW)): stages [S][64 x 128 B e4m3]
// | f16 Q [kMW][2 slabs][N x 128 B] | key scales [S][64] f32 | w*q_scale [kMW][N] f32 | block records [S] int4
// | barriers full [S], empty [S]; the base rounded up to 1024 B (swizzle atoms).
template <int kN, int kMW>
struct Layout {
  int stages;
  __host__ __device__ int q_off() const { return stages * kStageBytes; }
  __host__ __device__ int scale_off() const { return q_off() + kMW * 2 * kN * 128; }
  __host__ __device__ int wq_off() const { return scale_off() + stages * kBK * 4; }
  __host__ __device__ int info_off() const { return wq_off() + kMW * kN * 4; }
  __host__ __device__ int bar_off() const { return info_off() + stages * 16; }
  __host__ __device__ int bytes() const { return bar_off() + 2 * stages * 8 + 1024; }
};

// Two e4m3 (the low or high 16 bits of x) -> f16x2, exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x, bool high) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(high ? x >> 16 : x & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
// The same without the shift for the high half (v7): the 16-bit halves are named by a mov, and ptxas reads the
// high one in place (F2FP.F16.E4M3.UNPACK_B R, R.H1). Same values as e4m3x2_to_f16x2.
__device__ __forceinline__ uint32_t e4m3x2_lo_to_f16x2(uint32_t x) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t x) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// ReLU as the CPU oracle's: a NaN stays NaN (contract section 7).
__device__ __forceinline__ float relu(float x) { return x < 0.f ? 0.f : x; }

// The k-step permutation: in k-step ks, quad lane tq's A columns 2 tq + {0, 1} and 2 tq + 8 + {0, 1} are the row's
// bytes 32 tq + 4 ks + {0, 1} and {2, 3}. So logical column 16 ks + 8 h + 2 tq + e holds byte 32 tq + 4 ks + 2 h + e,
// and 16-byte chunk 2 ks + h of a permuted Q row is the f16 of the low (h = 0) or high (h = 1) halves of the row's
// words 8 tq + ks, tq = 0..3.

// mbarrier arrive that also expects `tx` bytes of bulk copies (the phase completes when both are in).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t tx) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar), "r"(tx)
               : "memory");
}
// Bulk copy global -> shared (the copy engine; 16-byte aligned addresses, a multiple of 16 bytes), counted on bar.
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Tensor copy (TMA) of a 3-D box global -> shared, counted on bar (v7's 128B-swizzled stage: the map is
// make_key_tensor_map's, coordinates {byte 0, row in page, page}).
__device__ __forceinline__ void tma_g2s_3d(uint32_t dst, const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                           uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// A ring position: the stage within the ring and the parity of its current use; `wrapped` once every stage has
// been used (the producer then waits for the stage's release before refilling it).
struct RingPos {
  int slot = 0;
  uint32_t phase = 0;
  bool wrapped = false;
  __device__ __forceinline__ void next(int S) {
    if (++slot == S) {
      slot = 0;
      phase ^= 1u;
      wrapped = true;
    }
  }
};

// A producer's ring in shared memory.
struct Ring {
  uint32_t stage;   // first stage's rows
  float* scale;     // [S][kBK]
  int4* info;       // [S] block records
  uint32_t full, empty;  // barriers [S] each
  int S;
};

// Waits for the ring's next stage to be free and writes its block record, arriving with the bytes the copies will
// bring (tx); lane 0 does the shared-memory work. Returns the stage's full barrier.
__device__ __forceinline__ uint32_t begin_stage(const Ring& r, const RingPos& pos, int lane, int4 rec, uint32_t tx) {
  if (pos.wrapped) mbar_wait(r.empty + 8 * pos.slot, pos.phase ^ 1u);
  const uint32_t fb = r.full + 8 * pos.slot;
  if (lane == 0) {
    r.info[pos.slot] = rec;
    mbar_arrive_expect_tx(fb, tx);
  }
  return fb;
}

// ---- page sizes that are multiples of 64: a block is inside one page ----
// 32 items of a producer, one a lane: the item's tokens and keys, the group's longest key_len (keys past it are not
// scored), and each block's page (its block-table entry; kNoSeg: no keys) and first row in that page.
constexpr int32_t kNoSeg = -2;
struct Batch {
  int32_t t0, nt, k0, len;
  int32_t pg[kSub];
  int32_t row[kSub];
};
__device__ __forceinline__ Batch resolve_batch(const WgArgs& a, int64_t it, bool valid, int32_t blocks_per_page) {
  Batch r;
  r.t0 = r.nt = r.k0 = r.len = 0;
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    r.pg[j] = kNoSeg;
    r.row[j] = 0;
  }
  if (!valid) return r;
  const ScoreItem x = plan_item(a.inl, a.items, it);
  const int32_t b = __ldg(a.request + x.t0);
  int32_t len = 0;
#pragma unroll
  for (int i = 0; i < kMaxGroupTokens; ++i) {
    if (i < x.nt) len = max(len, __ldg(a.key_len + x.t0 + i));
  }
  r.t0 = x.t0;
  r.nt = x.nt;
  r.k0 = x.k0;
  r.len = len;
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    if (x.k0 + j * kBK < len) {
      const int32_t blk = x.k0 / kBK + j, p = blk / blocks_per_page;
      r.pg[j] = p < a.max_pages ? __ldg(a.block_table + static_cast<int64_t>(b) * a.max_pages + p) : -1;
      r.row[j] = (blk - p * blocks_per_page) * kBK;
    }
  }
  return r;
}

// L2 prefetch of a group's Q rows, w and q_scale (its math warpgroup's load_group_q then hits L2): lane l's
// item's group, by the first lane of a run of lanes with the same group. Bulk prefetches; w and q_scale widened to
// their 16-byte granules (prefetches never fault, and the granules hold the tensors' own bytes).
__device__ __forceinline__ void bulk_prefetch_l2(const void* p, uint32_t bytes) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{15};
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes + 15) & ~uintptr_t{15};
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(b), "r"(static_cast<uint32_t>(e - b)) : "memory");
}
template <int kHi>
__device__ __forceinline__ void prefetch_group_q(const WgArgs& a, int32_t t0, int32_t nt, int lane) {
  const int32_t prev = __shfl_up_sync(0xffffffffu, t0, 1);
  if (nt > 0 && (lane == 0 || prev != t0)) {
    const int64_t at = static_cast<int64_t>(t0) * kHi;
    bulk_prefetch_l2(a.q + at * kDi, static_cast<uint32_t>(nt) * kHi * kDi);
    bulk_prefetch_l2(a.w + at, static_cast<uint32_t>(nt) * kHi * 4);
    bulk_prefetch_l2(a.q_scale + at, static_cast<uint32_t>(nt) * kHi * 4);
  }
}

// Producer c's items: first + stride n, n < nc. Batches of 32 resolved one batch ahead; per block, the record
// comes from lane q of the batch by shuffle and lane 0 issues the two copies (rows, scales; n rounded up to 4 rows:
// 16-byte scale groups, still inside the page).
template <int kHi, bool kTma>
__device__ __forceinline__ void produce_paged64(const WgArgs& a, const Ring& ring, RingPos& pos, int lane,
                                                int64_t first, int64_t stride, int64_t nc) {
  const int32_t P = a.page_size, bpp = P / kBK;
  const int64_t page_bytes = a.page_stride;
  Batch cur = resolve_batch(a, first + stride * lane, lane < nc, bpp);
  prefetch_group_q<kHi>(a, cur.t0, cur.nt, lane);
  for (int64_t nb = 0; nb < nc; nb += 32) {
    const Batch nxt = resolve_batch(a, first + stride * (nb + 32 + lane), nb + 32 + lane < nc, bpp);
    prefetch_group_q<kHi>(a, nxt.t0, nxt.nt, lane);
    const int nq = static_cast<int>(min(int64_t{32}, nc - nb));
    for (int q = 0; q < nq; ++q) {
      const int32_t t0 = __shfl_sync(0xffffffffu, cur.t0, q), nt = __shfl_sync(0xffffffffu, cur.nt, q);
      const int32_t k0 = __shfl_sync(0xffffffffu, cur.k0, q), len = __shfl_sync(0xffffffffu, cur.len, q);
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const int32_t pg = __shfl_sync(0xffffffffu, cur.pg[j], q), row = __shfl_sync(0xffffffffu, cur.row[j], q);
        const int32_t kb = k0 + j * kBK;
        if (kb >= len) break;  // (uniform)
        const int32_t kend = min(kb + kBK, len);
        const bool ok = pg >= 0 && pg < a.num_pages;
        if (!ok && lane == 0) report_device_error(a.err, kDevBadPage, t0);
        const int32_t n = ok ? (kend - kb + 3) & ~3 : 0;
        // kTma: the whole 64-row box (inside the page), 128B-swizzled
        const uint32_t fb = begin_stage(ring, pos, lane, make_int4(t0, nt, kb, kend),
                                        n == 0 ? 0 : (kTma ? kStageBytes : n * kDi) + n * 4);
        if (lane == 0 && n > 0) {
          const unsigned char* page = a.keys + pg * page_bytes;
          if constexpr (kTma) {
            tma_g2s_3d(ring.stage + pos.slot * kStageBytes, &a.kmap, 0, row, pg, fb);
          } else {
            bulk_g2s(ring.stage + pos.slot * kStageBytes, page + static_cast<int64_t>(row) * kDi, n * kDi, fb);
          }
          bulk_g2s(smem_u32(ring.scale + pos.slot * kBK), page + static_cast<int64_t>(P) * kDi + row * 4, n * 4, fb);
        }
        __syncwarp();
        pos.next(ring.S);
      }
    }
    cur = nxt;
  }
}

// ---- other page sizes (multiples of 4): a block spans <= 64 / page_size + 1 pages ----
// One item as the producer resolved it: for each of its kSub blocks the page of the lane's segment (lane j: the
// block's j-th page; kNoSeg where the block has fewer pages or no keys).
struct ItemRes {
  int32_t t0, nt, k0, len;
  int32_t pg[kSub];
};

// Item it's record and block-table entries (the loads are issued here and used one item later). The group's
// request and key lengths are cached while consecutive items share the group.
template <int kHi>
__device__ __forceinline__ ItemRes resolve_item(const WgArgs& a, int64_t it, int lane, int32_t& seg_t0,
                                                int32_t& seg_b, int32_t& seg_len) {
  const ScoreItem x = plan_item(a.inl, a.items, it);
  if (x.t0 != seg_t0) {
    prefetch_group_q<kHi>(a, x.t0, lane == 0 ? x.nt : 0, lane);
    seg_t0 = x.t0;
    seg_b = a.request[x.t0];
    int32_t m = 0;
    for (int i = 0; i < x.nt; ++i) m = max(m, a.key_len[x.t0 + i]);
    seg_len = m;
  }
  ItemRes r{x.t0, x.nt, x.k0, seg_len, {}};
  const int32_t P = a.page_size;
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    const int32_t kb = x.k0 + j * kBK, kend = min(kb + kBK, seg_len);
    r.pg[j] = kNoSeg;
    if (kb < kend) {
      const int32_t p = kb / P + lane;
      if (p <= (kend - 1) / P) {
        r.pg[j] = p < a.max_pages ? __ldg(a.block_table + static_cast<int64_t>(seg_b) * a.max_pages + p) : -1;
      }
    }
  }
  return r;
}

// Producer c's items (first + stride n, n < nc) one item ahead; per block, lane j copies the block's j-th page segment (rows [s0, s1) of its
// page, rounded up to 4 rows: still inside the page, page sizes being multiples of 4).
template <int kHi>
__device__ __forceinline__ void produce_segments(const WgArgs& a, const Ring& ring, RingPos& pos, int lane,
                                                 int64_t first, int64_t stride, int64_t nc) {
  const int32_t P = a.page_size;
  const int64_t page_bytes = a.page_stride;
  int32_t seg_t0 = -1, seg_b = 0, seg_len = 0;
  ItemRes cur{};
  if (nc > 0) cur = resolve_item<kHi>(a, first, lane, seg_t0, seg_b, seg_len);
  for (int64_t n = 0; n < nc; ++n) {
    ItemRes nxt{};
    if (n + 1 < nc) nxt = resolve_item<kHi>(a, first + stride * (n + 1), lane, seg_t0, seg_b, seg_len);
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int32_t kb = cur.k0 + j * kBK, kend = min(kb + kBK, cur.len);
      if (kb >= kend) break;  // (uniform)
      const int32_t p = kb / P + lane, s0 = max(kb, p * P), s1 = min(kend, (p + 1) * P);
      const int32_t pg = cur.pg[j];
      const bool ok = pg >= 0 && pg < a.num_pages;
      if (pg != kNoSeg && !ok) report_device_error(a.err, kDevBadPage, cur.t0);
      const int32_t n_rows = ok ? (s1 - s0 + 3) & ~3 : 0;
      const uint32_t tx = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(n_rows) * (kDi + 4));
      const uint32_t fb = begin_stage(ring, pos, lane, make_int4(cur.t0, cur.nt, kb, kend), tx);
      __syncwarp();
      if (n_rows > 0) {
        const unsigned char* page = a.keys + pg * page_bytes;
        const int32_t in_page = s0 - p * P, row = s0 - kb;
        bulk_g2s(ring.stage + pos.slot * kStageBytes + row * kDi, page + static_cast<int64_t>(in_page) * kDi,
                 n_rows * kDi, fb);
        bulk_g2s(smem_u32(ring.scale + pos.slot * kBK + row), page + static_cast<int64_t>(P) * kDi + in_page * 4,
                 n_rows * 4, fb);
      }
      pos.next(ring.S);
    }
    cur = nxt;
  }
}

// A math warpgroup's view of its group (the tokens of the blocks it is scoring): the first token, the count, and
// this thread's token (t0 + tq, tq < nt): its key_len (0 if absent) and its score row.
struct GroupView {
  int32_t t0 = -1, nt = 0;
  int32_t my_len = 0;
  float* my_row = nullptr;
};

// Loads group (t0, nt)'s Q into the warpgroup's shared copy (f16, permuted, 128B-swizzled: [2 slabs][kN x 128 B])
// and w * q_scale (sWq[kN]); the caller has waited for every wgmma that read the old Q (the first barrier then
// also orders the epilogues' reads of sWq before the writes). Every global load of a batch is issued before any
// is used, and the first batch and the epilogue values before the first barrier: one round trip for N <= 64 (four
// for N = 256), where a load-then-store loop paid one an iteration (the producer has prefetched the lines into L2:
// prefetch_group_q).
template <int kHi, int kN>
__device__ __forceinline__ void load_group_q(const WgArgs& a, int32_t t0, int32_t nt, uint32_t sQ, float* sWq,
                                             int bar, int wt, GroupView& gv) {
  constexpr int kIt = kN / 16;               // (row, k-step) pairs a thread: kN x 8 over 128 threads
  constexpr int kB = kIt < 4 ? kIt : 4;      // pairs a batch (16 words in flight a thread)
  constexpr int kCols = (kN + 127) / 128;    // w * q_scale columns a thread
  const int tq = wt & 3, n_idx = nt * kHi * 8;
  uint32_t wv[kB][4];
  auto issue = [&](int b) {
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      const int idx = wt + 128 * (b * kB + i), r = idx >> 3, ks = idx & 7;
      const uint32_t* qrow = reinterpret_cast<const uint32_t*>(a.q + (static_cast<int64_t>(t0) * kHi + r) * kDi);
#pragma unroll
      for (int j = 0; j < 4; ++j) wv[i][j] = idx < n_idx ? __ldg(qrow + 8 * j + ks) : 0u;
    }
  };
  auto store = [&](int b) {
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      const int idx = wt + 128 * (b * kB + i), r = idx >> 3, ks = idx & 7;
      if (idx < n_idx) {
        const uint32_t q0 = sQ + sw128_chunk_off(r, 2 * ks, kN * 128), q1 = sQ + sw128_chunk_off(r, 2 * ks + 1, kN * 128);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q0), "r"(e4m3x2_to_f16x2(wv[i][0], false)),
                     "r"(e4m3x2_to_f16x2(wv[i][1], false)), "r"(e4m3x2_to_f16x2(wv[i][2], false)),
                     "r"(e4m3x2_to_f16x2(wv[i][3], false)));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q1), "r"(e4m3x2_to_f16x2(wv[i][0], true)),
                     "r"(e4m3x2_to_f16x2(wv[i][1], true)), "r"(e4m3x2_to_f16x2(wv[i][2], true)),
                     "r"(e4m3x2_to_f16x2(wv[i][3], true)));
      }
    }
  };
  issue(0);
  float wq[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int col = wt + 128 * c;
    const int64_t at = static_cast<int64_t>(t0) * kHi + col;
    wq[c] = col < nt * kHi ? __ldg(a.w + at) * __ldg(a.q_scale + at) : 0.f;
  }
  const int32_t my_len = tq < nt ? __ldg(a.key_len + t0 + tq) : 0;
  const int64_t my_off = tq < nt ? plan_score_offset(a.inl, a.score_offset, t0 + tq) : 0;
  named_bar_sync(bar, 128);
  store(0);
#pragma unroll
  for (int b = 1; b < kIt / kB; ++b) {
    issue(b);
    store(b);
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    if (wt + 128 * c < kN) sWq[wt + 128 * c] = wq[c];
  }
  gv.my_len = my_len;
  gv.my_row = a.scores + my_off;
  gv.t0 = t0;
  gv.nt = nt;
  fence_proxy_async_smem();  // Q's generic writes -> the async proxy (wgmma)
  named_bar_sync(bar, 128);
}

// The A operand of one stage: rows row0 and row0 + 8, bytes [32 tq, 32 tq + 32) (chunks 2 tq, 2 tq + 1), as loaded
// (e4m3 words x[8], y[8]; rows are 128 B apart, unswizzled: lanes of odd g load their second chunk first, so the 8
// lanes of a quarter warp read 8 distinct 16-byte bank groups) and as the wgmma's f16 fragments.
struct RawRows {
  uint4 xa, xb, ya, yb;
};
__device__ __forceinline__ RawRows load_rows(uint32_t stage, int row0, int g, int tq) {
  const uint32_t st = stage + 32 * tq, odd = (g & 1) * 16;
  return RawRows{lds128(st + row0 * kDi + odd), lds128(st + row0 * kDi + (odd ^ 16)),
                 lds128(st + (row0 + 8) * kDi + odd), lds128(st + (row0 + 8) * kDi + (odd ^ 16))};
}
// v7's stage is 128B-swizzled (chunk c of row r at chunk c ^ (r % 8); rows row0 and row0 + 8 have r % 8 = g):
// the 8 lanes of a quarter warp read 8 distinct bank groups with chunk 2 tq first in every lane, so the
// fragments need no select by lane parity.
__device__ __forceinline__ RawRows load_rows_sw(uint32_t stage, int row0, int g, int tq) {
  const uint32_t ca = ((2 * tq) ^ g) * 16, cb = ca ^ 16;
  const uint32_t x = stage + row0 * kDi, y = x + 8 * kDi;
  return RawRows{lds128(x + ca), lds128(x + cb), lds128(y + ca), lds128(y + cb)};
}
// Fragments of a swizzled stage's rows (xa, ya: chunk 2 tq; xb, yb: 2 tq + 1), without the shifts (v7).
__device__ __forceinline__ void rows_to_f16_sw(const RawRows& r, uint32_t (&af)[8][4]) {
  const uint32_t xw[8] = {r.xa.x, r.xa.y, r.xa.z, r.xa.w, r.xb.x, r.xb.y, r.xb.z, r.xb.w};
  const uint32_t yw[8] = {r.ya.x, r.ya.y, r.ya.z, r.ya.w, r.yb.x, r.yb.y, r.yb.z, r.yb.w};
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    af[ks][0] = e4m3x2_lo_to_f16x2(xw[ks]);
    af[ks][1] = e4m3x2_lo_to_f16x2(yw[ks]);
    af[ks][2] = e4m3x2_hi_to_f16x2(xw[ks]);
    af[ks][3] = e4m3x2_hi_to_f16x2(yw[ks]);
  }
}
// An unswizzled stage's rows (load_rows) without the shifts (v7 at other page sizes): the selects stay.
__device__ __forceinline__ void rows_to_f16_fast(const RawRows& r, int g, uint32_t (&af)[8][4]) {
  const bool odd = g & 1;
  rows_to_f16_sw(RawRows{odd ? r.xb : r.xa, odd ? r.xa : r.xb, odd ? r.yb : r.ya, odd ? r.ya : r.yb}, af);
}
__device__ __forceinline__ void rows_to_f16(const RawRows& r, int g, uint32_t (&af)[8][4]) {
  const bool odd = g & 1;
  const uint4 x0 = odd ? r.xb : r.xa, x1 = odd ? r.xa : r.xb, y0 = odd ? r.yb : r.ya, y1 = odd ? r.ya : r.yb;
  const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
  const uint32_t yw[8] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    af[ks][0] = e4m3x2_to_f16x2(xw[ks], false);
    af[ks][1] = e4m3x2_to_f16x2(yw[ks], false);
    af[ks][2] = e4m3x2_to_f16x2(xw[ks], true);
    af[ks][3] = e4m3x2_to_f16x2(yw[ks], true);
  }
}

// ---- v5's math loop: one accumulator set; a block's epilogue follows its wgmma ----
template <int kHi, int kNT>
__device__ __forceinline__ void math_v5(const WgArgs& a, const Ring& ring, uint32_t sQ, float* sWq, int bar,
                                        int wt) {
  constexpr int kN = kHi * kNT;
  constexpr int kPN = kN < kPassN ? kN : kPassN;  // columns a pass
  constexpr int kPT = kPN / kHi;                  // tokens a pass
  const int S = ring.S;
  const int wl = wt >> 5, lane = wt & 31, g = lane >> 2, tq = lane & 3;
  const int row0 = wl * 16 + g;  // the thread's key rows: row0, row0 + 8
  GroupView gv;
  float acc[kPN / 2];
  for (RingPos pos;; pos.next(S)) {
    const int slot = pos.slot;
    mbar_wait(ring.full + 8 * slot, pos.phase);
    const int4 info = ring.info[slot];
    if (info.z < 0) break;
    const int32_t t0 = info.x, nt = info.y, kb = info.z;
    // (the barrier in load_group_q: every warp's last wgmma has been waited for and its epilogue has read sWq)
    if (t0 != gv.t0) load_group_q<kHi, kN>(a, t0, nt, sQ, sWq, bar, wt, gv);
    const RawRows rr = load_rows(ring.stage + slot * kStageBytes, row0, g, tq);
    const float sk0 = ring.scale[slot * kBK + row0], sk1 = ring.scale[slot * kBK + row0 + 8];
    uint32_t af[8][4];
    rows_to_f16(rr, g, af);
    // The stage is read: its words are in af, its scales in sk0 / sk1 (the release orders those loads before the
    // producer's next copies into the slot).
    mbar_arrive(ring.empty + 8 * slot);

    float mine0 = 0.f, mine1 = 0.f;  // token tq's scores of rows row0, row0 + 8
#pragma unroll
    for (int pass = 0; pass < kN / kPN; ++pass) {
      if (pass * kPT >= gv.nt) break;  // (uniform) no token of this pass in the group
      // D = K [64 keys, 128] x Q^T [128, kPN]: 8 k-steps of 16 columns (slab ks / 4, 32 bytes each within it)
      wgmma_fence();
      const uint64_t db = wgmma_desc_sw128(sQ + pass * kPN * 128, 16, 1024);
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const uint32_t kq = (ks >> 2) * kN * 128 + (ks & 3) * 32;
        wgmma_m64k16_f16_rs<kPN>(acc, af[ks], db + (kq >> 4), ks > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kPN / 2; ++i) reg_fence(acc[i]);
#pragma unroll
      for (int pt = 0; pt < kPT; ++pt) {
        const int tok = pass * kPT + pt;
        if (tok < gv.nt) {
          float s0 = 0.f, s1 = 0.f;
#pragma unroll
          for (int ii = 0; ii < kHi / 8; ++ii) {
            const int i = pt * (kHi / 8) + ii;  // the pass's column group
            const float2 wv = *reinterpret_cast<const float2*>(sWq + pass * kPN + 8 * i + 2 * tq);
            s0 = fmaf(wv.x, relu(acc[4 * i]), s0);
            s0 = fmaf(wv.y, relu(acc[4 * i + 1]), s0);
            s1 = fmaf(wv.x, relu(acc[4 * i + 2]), s1);
            s1 = fmaf(wv.y, relu(acc[4 * i + 3]), s1);
          }
          s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
          s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
          s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
          s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
          if (tok == tq) {
            mine0 = sk0 * s0;
            mine1 = sk1 * s1;
          }
        }
      }
    }
    if (tq < gv.nt) {
      const int32_t k0 = kb + row0, k1 = k0 + 8;
      if (k0 < gv.my_len) gv.my_row[k0] = mine0;
      if (k1 < gv.my_len) gv.my_row[k1] = mine1;
    }
  }
}

}  // namespace score_wg
}  // namespace dsacp::cuda
