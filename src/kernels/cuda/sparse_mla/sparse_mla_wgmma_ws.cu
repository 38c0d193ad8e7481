// Sparse MLA attention for 64-head groups (H = 64, 128), warp-specialized, on Hopper wgmma (sm_90a).
//
// One CTA = (token, 64 heads, key split), three warpgroups, and the keys taken in pairs of 64-key tiles:
//   WG2 (producer, 56 registers) resolves the chosen entries to cache rows through the block table and gathers
//        the pair's two [64 keys, 576] tiles with cp.async into smem stages 0 and 1.
//   WG0 owns tile 0 of the pair and output columns [0, 256); WG1 owns tile 1 and columns [256, 512).
//   Each consumer scores its whole tile (S = Q K^T, m64n64k16, Q and K from shared memory) and keeps P in
//   registers, so O_w += P_own V_own[:, cols_w] reads P from registers; the other warpgroup's P comes through
//   shared memory for O_w += P_other V_other[:, cols_w].
//   FlashMLA's seesaw for the row maxima: WG0 publishes max(m, its tile's max) and does its local P*V against
//   it; WG1 folds in its own tile and publishes the pair's max; WG0 then rescales the P it hands over, its O and
//   its row sums. WG0's QK^T and local P*V run while WG1 scores.
// An odd last tile is paired with an empty one (every key absent: zero-filled, masked).
// Shared memory holds Q, the pair's two tiles and one P buffer, no more, so each tile is refilled in parts as soon
// as the last reader of each part is done (FlashMLA's fine-grained release), in this order:
//   tile 0's rope slab (read only by WG0's QK^T: WG0's P goes to its own buffer), tile 0's V columns [0, 256)
//   (WG0's local P*V), tile 0's columns [256, 512) (WG1's remote P*V, which WG1 does before its local one),
//   tile 1's columns [0, 256) and rope slab (WG0's remote P*V, reading WG1's P over that slab), and tile 1's
//   columns [256, 512) (WG1's local P*V).
// Each QK^T takes its tile's parts in the order they come back, so the next pair's tile 0 is complete by the middle
// of the pair and tile 1 lands while WG0 scores tile 0 and does its local P*V. Full and empty mbarriers per part;
// the gathers arrive on "full" through cp.async.mbarrier.arrive.noinc (the producer never waits for its copies).
// The layout needs the whole 227 KB with a 1024-byte-aligned base (what the driver gives: its 1 KB reserve comes
// first); a misaligned base is reported (kDevSmemAlign) rather than computed wrongly.
// Semantics match sparse_mla_mma.cu exactly (front-packed entries, absent rows zero-filled and masked, bad pages
// reported, out = 0 and lse = -inf without keys, split-K partials merged by LSE).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mbarrier_sm90.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_sm90.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_merge.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_seesaw.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 384;  // consumers: warpgroups 0, 1; producer: warpgroup 2
constexpr int kBN = 64;        // keys per tile
constexpr int kSlabBytes = 64 * 128;             // one [64 rows, 64 bf16] swizzled slab
constexpr int kTileBytes = 9 * kSlabBytes;       // [64 rows, 576] = 73728
constexpr int kOffQ = 0;                         // Q [64, 576]
constexpr int kOffKV = kOffQ + kTileBytes;       // stages 0, 1 (tiles 0, 1 of the pair)
constexpr int kOffP0 = kOffKV + 2 * kTileBytes;  // WG0's P [64, 64] for WG1 (WG1's P goes over tile 1's rope slab)
constexpr int kOffMax = kOffP0 + kSlabBytes;      // [2 pair parities][2][64] f32: WG0's, then the pair's row max
constexpr int kOffL = kOffMax + 2 * 2 * 64 * 4;  // [2][64] f32
constexpr int kOffRing = kOffL + 2 * 64 * 4;     // [4][64] i32: tile i's cache rows in slot i % 4, -1 = absent
constexpr int kOffMisc = kOffRing + 4 * 64 * 4;  // [4] i32
constexpr int kParts = 5;
constexpr int kOffBar = kOffMisc + 16;           // mbarriers: full[part], empty[part]
constexpr int kSmemBytes = kOffBar + 2 * kParts * 8;
static_assert(kSmemBytes <= 232448, "shared memory");

// Named barriers (0 is __syncthreads). A named barrier completes when `count` threads arrived (bar.arrive or
// bar.sync), so one that hands data from one party to another is waited on by the receiving party only: two
// consumers each waiting first on a barrier the other waits on later would hold each other up.
constexpr int kBarMax0 = 7;      // WG0's max published (WG0 arrives, WG1 waits: 256)
constexpr int kBarMax1 = 8;      // the pair's max published (WG1 arrives, WG0 waits)
constexpr int kBarP = 9;         // + w: P of warpgroup w in shared memory (w arrives, the other waits)
constexpr int kBarConsumers = 11; // both consumers wait (256): Q loaded; the row sums exchanged
constexpr int kBarProducer = 12; // the producer's 128 threads (the row ring)
// The parts of a pair's tiles, in the order they are given back and refilled:
//   0: tile 0 slab 8 (rope)       last read by WG0's QK^T
//   1: tile 0 slabs 0-3           WG0's local P*V
//   2: tile 0 slabs 4-7           WG1's remote P*V
//   3: tile 1 slabs 0-3 and 8     WG0's remote P*V (WG1's P over slab 8)
//   4: tile 1 slabs 4-7           WG1's local P*V
// full[part]: the producer's 128 threads arrive twice (their copies landed: noinc; their ring rows: release).
// empty[part]: the part's last reader arrives (128 threads of one warpgroup). Phase of pair k: parity k & 1.
constexpr int kFullArrivals = 256, kEmptyArrivals = 128;
__device__ __forceinline__ uint32_t full_bar(uint32_t bars, int part) { return bars + 8 * part; }
__device__ __forceinline__ uint32_t empty_bar(uint32_t bars, int part) { return bars + 8 * (kParts + part); }

// Byte offset of 16-byte chunk c (0..71) of row r in a [64, 576] tile.
__device__ __forceinline__ uint32_t tile_off(int r, int c) { return sw128_chunk_off(r, c, kSlabBytes); }

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_wgmma_ws_kernel(const MlaArgs a) {
  extern __shared__ __align__(1024) unsigned char smem[];
  if (!mla_smem_aligned(a, smem)) return;
  const uint32_t sQ = smem_u32(smem + kOffQ);
  const uint32_t sKV = smem_u32(smem + kOffKV);
  float* sMax = reinterpret_cast<float*>(smem + kOffMax);
  float* sL = reinterpret_cast<float*>(smem + kOffL);
  int32_t* sRing = reinterpret_cast<int32_t*>(smem + kOffRing);
  int32_t* sMisc = reinterpret_cast<int32_t*>(smem + kOffMisc);
  const uint32_t bars = smem_u32(smem + kOffBar);
  float* smem_part = reinterpret_cast<float*>(smem);  // the cluster merge's partial rows, over Q and the tiles
  unsigned char* peer_stage = smem + mla_peer_stage_offset(64);  // the peer merge's, past them (over the tiles)
  static_assert(mla_peer_stage_offset(64) + kMlaPeerStageBytes <= kOffP0, "the peer merge's stage fits below kOffP0");
  static_assert(mla_cluster_merge_bytes(64) <= kOffP0, "the cluster merge's rows fit over Q and the tiles");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wl = warp & 3;  // warp-uniform to the compiler
  const int64_t t = mla_cta_token(a, 64);
  const int h0 = mla_cta_head0(a, 64);
  const int split = blockIdx.z;
  if (tid < 2 * kParts) mbar_init(bars + 8 * tid, tid < kParts ? kFullArrivals : kEmptyArrivals);  // visible after
                                                                                                   // the prologue's
                                                                                                   // __syncthreads

  // ---- prologue (all threads): used entries ----
  const MlaSplitKeys keys = mla_split_keys<kThreads>(a, t, split, &sMisc[0]);
  const int nkeys = keys.nkeys;
  const int npairs = (nkeys + 2 * kBN - 1) / (2 * kBN);

  if (wg == 2) {
    // ==== producer ====
    setmaxnreg_dec<56>();
    const int p = tid - 256;  // 0..127
    // Rows of tile i (cache rows, -1 = absent) in ring slot i % 4: resolved one pair ahead by threads 0..63.
    auto resolve_pair = [&](int pair) {
      if (p >= 64) return;
#pragma unroll
      for (int st = 0; st < 2; ++st) {  // both lookups in flight together
        sRing[((2 * pair + st) & 3) * 64 + p] = mla_cache_row(a, keys, t, (2 * pair + st) * kBN + p);
      }
    };
    // Gather part `part` (see kParts) of pair `pair`: 8 threads per row, 16 rows per pass (each warp instruction
    // reads 4 whole 128-byte segments).
    auto gather_part = [&](int pair, int part) {
      const int tile = part >= 3 ? 1 : 0;
      const int lat0 = part == 2 || part == 4 ? 4 : 0;  // first latent slab
      const bool latent = part != 0, rope = part == 0 || part == 3;
      const uint32_t base = sKV + tile * kTileBytes;
      const int32_t* ring = sRing + ((2 * pair + tile) & 3) * 64;
#pragma unroll 1  // the producer has 56 registers
      for (int pass = 0; pass < 4; ++pass) {
        const int r = (p >> 3) + 16 * pass;
        const int32_t row = ring[r];
        const int64_t row_ok = row < 0 ? 0 : row;
        const int bytes = row >= 0 ? 16 : 0;
        if (latent) {
          const __nv_bfloat16* lat = a.latent + row_ok * a.latent_unit + (p & 7) * 8;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int slab = lat0 + k;
            cp_async_16(base + tile_off(r, (p & 7) + 8 * slab), lat + slab * 64, bytes);
          }
        }
        if (rope) cp_async_16(base + tile_off(r, (p & 7) + 64), a.rope + row_ok * a.rope_unit + (p & 7) * 8, bytes);
      }
      cp_async_mbar_arrive_noinc(full_bar(bars, part));
      mbar_arrive(full_bar(bars, part));
    };
    resolve_pair(0);
    named_bar_sync(kBarProducer, 128);
    for (int pair = 0; pair < npairs; ++pair) {
      // In the order the parts are given back during the previous pair.
#pragma unroll 1
      for (int part = 0; part < kParts; ++part) {
        if (pair > 0) mbar_wait(empty_bar(bars, part), (pair - 1) & 1);
        gather_part(pair, part);
      }
      // The next pair's rows (its ring slots were last read by the previous pair's gathers, issued above, and by
      // the consumers' masks of the previous pair, done before its last part was given back).
      if (pair + 1 < npairs) resolve_pair(pair + 1);
      named_bar_sync(kBarProducer, 128);
    }
    cp_async_wait<0>();
    mla_cluster_merge<64, kThreads>(a, t, h0, smem_part);
    mla_peer_merge<64, kThreads, 0>(a, t, h0, smem_part, peer_stage);  // (the consumers sum unstaged rows)
    return;
  }

  // ==== consumers: warpgroup wg owns stage wg's tile and output columns [256 wg, 256 wg + 256) ====
  mla_load_q<64, 256>(a, t, h0, tid, sQ, tile_off);  // Q, while the producer gathers the first pair
  cp_async_commit();
  setmaxnreg_inc<224>();
  const int other = wg ^ 1;
  const int r0 = wl * 16 + (lane >> 2), r1 = r0 + 8;  // this thread's two rows (heads) of the 64
  const uint32_t own_tile = sKV + wg * kTileBytes, other_tile = sKV + other * kTileBytes;
  // WG0's P goes to its own buffer (so tile 0's rope slab is free after WG0's QK^T), WG1's over tile 1's rope slab
  // (read only by WG1's QK^T, complete by then).
  const uint32_t tile1_rope = sKV + kTileBytes + 8 * kSlabBytes;
  const uint32_t other_p = wg == 0 ? tile1_rope : smem_u32(smem + kOffP0);
  unsigned char* own_p_ptr = wg == 0 ? smem + kOffP0 : smem + kOffKV + kTileBytes + 8 * kSlabBytes;

  float m0 = -INFINITY, m1 = -INFINITY;  // the running max (log2 domain), the same in both warpgroups
  float l0 = 0.f, l1 = 0.f;              // this warpgroup's tiles' share of the row sums
  float s[32];
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  cp_async_wait<0>();
  fence_proxy_async_smem();
  named_bar_sync(kBarConsumers, 256);  // Q visible to wgmma

  for (int pair = 0; pair < npairs; ++pair) {
    // ---- S = Q K_own^T : [64 heads, 64 keys], the tile's parts in the order they come back ----
    const uint32_t par = pair & 1;
    {
      const uint64_t da0 = wgmma_desc_sw128(sQ, 16, 1024);
      const uint64_t db0 = wgmma_desc_sw128(own_tile, 16, 1024);
      auto qk_slab = [&](int slab, int first) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint32_t koff = slab * kSlabBytes + kk * 32;
          wgmma_m64n64k16<0>(s, da0 + (koff >> 4), db0 + (koff >> 4), first && kk == 0 ? 0 : 1);
        }
      };
      // Each part as it lands (wgmma_fence after each wait: ptxas would insert it after the wait loop).
      auto wait_part = [&](int part) {
        mbar_wait(full_bar(bars, part), par);
        fence_proxy_async_smem();
        wgmma_fence();
      };
      if (wg == 0) {
        wait_part(0);
        qk_slab(8, 1);
        wait_part(1);
#pragma unroll
        for (int k = 0; k < 4; ++k) qk_slab(k, 0);
        wait_part(2);
#pragma unroll
        for (int k = 4; k < 8; ++k) qk_slab(k, 0);
        wgmma_commit();
        wgmma_wait<0>();
      } else {
        wait_part(3);
#pragma unroll
        for (int k = 0; k < 4; ++k) qk_slab(k, k == 0);
        qk_slab(8, 0);
        wait_part(4);
#pragma unroll
        for (int k = 4; k < 8; ++k) qk_slab(k, 0);
        wgmma_commit();
        wgmma_wait<0>();
      }
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) reg_fence(s[i]);
    if (wg == 0) mbar_arrive(empty_bar(bars, 0));  // tile 0's rope slab: read for the last time

    // ---- softmax, the seesaw way (sparse_mla_seesaw.cuh): WG0 needs only its own max for its local P*V, so it
    // runs while WG1 scores; WG1 folds WG0's max into the pair's; WG0 rescales what it hands over (and its O) after.
    float mx0, mx1, tm0, tm1, al0, al1;
    seesaw_mask_rowmax<kBN>(s, sRing + ((2 * pair + wg) & 3) * 64, lane, a.scale_log2, mx0, mx1);
    float* pmax = sMax + (pair & 1) * 128;
    seesaw_exchange_max(wg, lane, r0, r1, pmax, m0, m1, mx0, mx1, kBarMax0, kBarMax1, tm0, tm1);
    seesaw_exp_rowsum<kBN>(s, a.scale_log2, tm0, tm1, m0, m1, l0, l1, al0, al1);
    uint32_t pa[4][4];
    seesaw_pack_p<kBN>(s, 1.f, 1.f, pa);
    // P into shared memory for the other warpgroup (WG0: its buffer; WG1: over tile 1's rope slab), keys
    // 8 j + 2 (lane % 4) (+1) of rows r0, r1 in a swizzled [64, 64] tile
    auto store_p = [&](const uint32_t (&pv)[4][4]) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int kl = j * 8 + (lane & 3) * 2;
        const int chunk = kl >> 3;
        const uint32_t v0 = pv[j >> 1][(j & 1) * 2 + 0], v1 = pv[j >> 1][(j & 1) * 2 + 1];
        *reinterpret_cast<uint32_t*>(own_p_ptr + r0 * 128 + ((chunk ^ (r0 & 7)) << 4) + (kl & 7) * 2) = v0;
        *reinterpret_cast<uint32_t*>(own_p_ptr + r1 * 128 + ((chunk ^ (r1 & 7)) << 4) + (kl & 7) * 2) = v1;
      }
      fence_proxy_async_smem();
      named_bar_arrive(kBarP + wg, 256);
    };
    if (wg == 1) store_p(pa);  // already against the pair's max

    mla_scale_o_rows(o, al0, al1);
    // O_w += P_own V_own[:, cols_w] (P from registers)
    auto local_pv = [&] {
      wgmma_fence();
      const uint64_t vb = wgmma_desc_sw128(own_tile + (4 * wg) * kSlabBytes, kSlabBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs<1>(o, pa[kk], vb + ((kk * 16 * 128) >> 4), 1);
      wgmma_commit();
    };
    // O_w += P_other V_other[:, cols_w] (P from shared memory, once the other warpgroup handed it over and the
    // part holding V_other[:, cols_w] landed)
    auto remote_pv = [&](int part) {
      named_bar_sync(kBarP + other, 256);
      mbar_wait(full_bar(bars, part), par);
      fence_proxy_async_smem();
      wgmma_fence();
      const uint64_t pb = wgmma_desc_sw128(other_p, 16, 1024);
      const uint64_t vb = wgmma_desc_sw128(other_tile + (4 * wg) * kSlabBytes, kSlabBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16<1>(o, pb + ((kk * 32) >> 4), vb + ((kk * 16 * 128) >> 4), 1);
      wgmma_commit();
    };
    if (wg == 0) {
      local_pv();
      // From its max to the pair's (WG1's): f scales the P it hands over, then (once its local P*V is done) its O
      // and l.
      uint32_t pf[kBN / 16][4];
      float f0, f1;
      seesaw_wg0_to_pair_max<kBN>(kBarMax1, pmax, r0, r1, tm0, tm1, s, pf, l0, l1, m0, m1, f0, f1);
      store_p(pf);
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) reg_fence(o[i]);
      mbar_arrive(empty_bar(bars, 1));  // tile 0 slabs 0-3: read for the last time
      mla_scale_o_rows(o, f0, f1);
      remote_pv(3);
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) reg_fence(o[i]);
      mbar_arrive(empty_bar(bars, 3));  // tile 1 slabs 0-3 and 8: read for the last time
    } else {
      remote_pv(2);  // first, so tile 0 comes back early
      local_pv();
      wgmma_wait<1>();
      mbar_arrive(empty_bar(bars, 2));  // tile 0 slabs 4-7: read for the last time
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) reg_fence(o[i]);
      mbar_arrive(empty_bar(bars, 4));  // tile 1 slabs 4-7: read for the last time
    }
  }

  // ---- epilogue ----
  store_wgmma64_rows(a, t, h0, split, wg, lane, r0, r1, o, l0, l1, sL, [] { named_bar_sync(kBarConsumers, 256); }, m0,
                     m1, smem_part);
  mla_cluster_merge<64, kThreads>(a, t, h0, smem_part);
  mla_peer_merge<64, kThreads, 256>(a, t, h0, smem_part, peer_stage);
}

}  // namespace

Status launch_sparse_mla_wgmma_ws(const MlaArgs& args, int groups, const LaunchContext& ctx) {
  return launch_mla_grid(sparse_mla_wgmma_ws_kernel, "sparse_mla_wgmma_ws_kernel", args, groups, kThreads, kSmemBytes, ctx.stream);
}

}  // namespace dsacp::cuda
