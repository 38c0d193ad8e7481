// Sparse MLA attention for 64-head groups (H = 64, 128), warp-specialized, on Hopper wgmma (sm_90a), with 32-key
// tiles so that two pairs of tiles are in flight: the producer gathers pair p + 1 (and p + 2 once pair p is
// done) during the whole of pair p, where the 64-key-tile kernel (sparse_mla_wgmma_ws.cu) has room for one pair
// and refills its parts as they are freed.
//
// One CTA = (token, 64 heads, key split), three warpgroups, keys in pairs of 32-key tiles, four tile slots
// (pair parity x tile):
//   WG2 (producer, 56 registers) resolves the chosen entries to cache rows and gathers each [32 keys, 576] tile
//        with cp.async into its slot; "full" mbarriers per slot (cp.async.mbarrier.arrive.noinc), "empty" ones
//        that both consumers arrive on after their last read of the pair.
//   WG0 owns tile 0 of the pair and output columns [0, 256); WG1 owns tile 1 and columns [256, 512). Each scores
//   its tile (S = Q K^T, m64n32k16, Q and K from shared memory), keeps P in registers for O_w += P_own
//   V_own[:, cols_w] and hands P to the other warpgroup through shared memory in the register-fragment layout
//   (thread i of one warpgroup holds the same rows as thread i of the other), so both P*V run with A from
//   registers (m64n256k16 RS).
//   FlashMLA's seesaw for the row maxima: WG0 publishes max(m, its tile's max) and does its local P*V against it;
//   WG1 folds in its own tile and publishes the pair's max; WG0 then rescales the P it hands over, its O and its
//   row sums.
// An odd last tile is paired with an empty one (every key absent: zero-filled, masked).
// fp8_ds_mla records (kFp8, MlaArgs::record_bytes > 0): the producer copies both tiles of a pair by cp.async as
// raw bytes into their slots (a row's 512 e4m3 bytes over latent slabs 4..7, its rope into slab 8, the scales to
// registers), then dequantizes each tile in place as it lands (mla_dequant8: scale * value in f32, one rounding to
// bf16): chunks 0..255 first (slabs 0..3, clear of the raw bytes), then 256..511 once every producer thread has
// read the raw bytes those stores overwrite. The consumers are unchanged. Many copies are in flight a thread (the
// whole pair, 20 a thread) where register loads held four; the records of pair k + 2 are prefetched into L2
// (cp.async.bulk.prefetch) when its rows are resolved. A partial head group (block_heads < 64) runs on zero query
// rows that are never stored (sparse_mla_shape picks this kernel for 64-head groups).
// Paired (MlaArgs::pair_dequant, a cluster of the token's head groups 2i, 2i + 1, which read the same keys): each
// CTA dequantizes 16 of every tile's 32 rows straight from registers (loaded two tiles ahead, before the slot is free)
// into its own slot and, by st.async completing on the peer's "full" barrier, into the peer's (FlashMLA's sm90 FP8
// decode moves its halves the same way); no raw bytes pass through shared memory. A slot is refilled once both
// CTAs' consumers are done with it; the epilogue writes over the slots only after a cluster barrier past the last
// pair. The row loads are split there (entries a pair ahead of their pages), so they stay in flight behind the
// conversions.
// Semantics match sparse_mla_mma.cu exactly (front-packed entries, absent rows zero-filled and masked, bad pages
// reported, out = 0 and lse = -inf without keys, split-K partials merged by LSE). The layout needs the whole
// 227 KB from a 1024-byte-aligned base (what the driver gives); a misaligned base is reported (kDevSmemAlign).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common/cluster_sm90.cuh"
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
constexpr int kBN = 32;        // keys per tile
constexpr int kQSlabBytes = 64 * 128;            // Q: [64 rows, 64 bf16] swizzled slabs
constexpr int kSlabBytes = kBN * 128;            // a tile: [32 rows, 64 bf16] swizzled slabs
constexpr int kTileBytes = 9 * kSlabBytes;       // [32 rows, 576] = 36864
constexpr int kSlots = 4;                        // tile slots: pair parity x tile
constexpr int kOffQ = 0;                         // Q [64, 576]
constexpr int kOffKV = kOffQ + 9 * kQSlabBytes;  // the four tile slots
constexpr int kOffP = kOffKV + kSlots * kTileBytes;  // [2 warpgroups][2 k-steps][128 threads] uint4: P fragments
constexpr int kOffMax = kOffP + 2 * 2 * 128 * 16;    // [2 pair parities][2][64] f32: WG0's, then the pair's max
constexpr int kOffL = kOffMax + 2 * 2 * 64 * 4;      // [2][64] f32
constexpr int kOffRing = kOffL + 2 * 64 * 4;         // [4 pairs][64] i32: the pair's cache rows, -1 = absent
constexpr int kOffMisc = kOffRing + 4 * 64 * 4;      // [4] i32
constexpr int kOffBar = kOffMisc + 16;               // mbarriers: full[slot], empty[slot]
constexpr int kSmemBytes = kOffBar + 2 * kSlots * 8;
static_assert(kSmemBytes <= 232448, "shared memory");

// Registers a thread after setmaxnreg (the CTA's 168 x 384): bf16 224 / 56; fp8_ds_mla 216 / 72, the producer's
// in-place dequantization holding a tile's raw chunks and the pair's copies in flight; paired 200 / 104, the producer
// holding three tiles' chunks (the one it converts and the next two's loads: an L2 round trip is about two tiles'
// conversions; one tile ahead was 10 % slower).
constexpr int kFp8ConsumerRegs = 216, kFp8ProducerRegs = 72;
constexpr int kPairedConsumerRegs = 200, kPairedProducerRegs = 104;
static_assert(2 * 128 * kPairedConsumerRegs + 128 * kPairedProducerRegs <= 168 * kThreads, "the register file");
static_assert(2 * 128 * kFp8ConsumerRegs + 128 * kFp8ProducerRegs <= 168 * kThreads, "the register file");

// Named barriers (0 is __syncthreads); each hands data from one party to the other, waited on by the receiver only.
constexpr int kBarMax0 = 7;       // WG0's max published (WG0 arrives, WG1 waits: 256)
constexpr int kBarMax1 = 8;       // the pair's max published (WG1 arrives, WG0 waits)
constexpr int kBarP = 9;          // + w: P of warpgroup w in shared memory (w arrives, the other waits)
constexpr int kBarConsumers = 11; // both consumers wait (256): Q loaded; the row sums exchanged
constexpr int kBarProducer = 12;  // the producer's 128 threads (the row ring)
// full[slot]: the producer's 128 threads arrive twice (their copies landed: noinc; their ring rows: release).
// empty[slot]: both consumers' 256 threads arrive after their last read of the pair. Pair k uses slot
// (k % 2) * 2 + tile for the (k / 2)-th time: "full" phase parity (k / 2) & 1.
// Paired CTAs (kPaired): full[slot] also waits for the peer's half of the tile, 16 KB of transaction bytes that its
// st.async stores complete (thread 0 expects them as it arrives); empty[slot] gets one arrival from each of the peer's
// 8 consumer warps too (for every pair but the last two, which no producer waits for), since the peer's producer
// writes this slot.
constexpr int kFullArrivals = 256;
__host__ __device__ constexpr int empty_arrivals(bool paired) { return paired ? 256 + 8 : 256; }
__device__ __forceinline__ uint32_t full_bar(uint32_t bars, int slot) { return bars + 8 * slot; }
__device__ __forceinline__ uint32_t empty_bar(uint32_t bars, int slot) { return bars + 8 * (kSlots + slot); }

// The L2 prefetch of one fp8_ds_mla record (656 B: a multiple of 16, records 16-byte aligned).
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

// fp8_ds_mla: a tile's e4m3 rows land raw over its latent slabs 4..7 ([32 rows][512 B], linear) and are
// dequantized in place into the bf16 slabs 0..8 (sparse_mla_wgmma_ws32.cu's producer).
constexpr int kRawOff = 4 * kSlabBytes;
static_assert(kRawOff + kBN * 512 == 8 * kSlabBytes, "the raw rows fill latent slabs 4..7 exactly");

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void sts128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// 16 bytes to the peer CTA's shared memory at dst (a shared::cluster address), completing as transaction bytes on
// the peer's barrier at remote_bar.
__device__ __forceinline__ void st_async_to_peer(uint32_t dst, uint4 v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(dst),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
               : "memory");
}

// The 16 e4m3 values of chunk c (values 16c .. 16c + 15) of tile row r, dequantized (mla_dequant8) into bf16
// chunks 2c, 2c + 1 of the swizzled tile at base; `sel` (c / 4 odd) stores the second first, so that the 8 lanes
// of a shared-memory phase (one row, chunks c .. c + 7) hit distinct banks.
__device__ __forceinline__ void store_dequant16(uint32_t base, int r, int c, int sel, uint4 v, float scale) {
  const uint4 lo = mla_dequant8(v.x, v.y, scale);
  const uint4 hi = mla_dequant8(v.z, v.w, scale);
  sts128(base + sw128_chunk_off(r, 2 * c + sel, kSlabBytes), sel ? hi : lo);
  sts128(base + sw128_chunk_off(r, 2 * c + 1 - sel, kSlabBytes), sel ? lo : hi);
}

// The rope of a tile's 32 records (tile_rows: their cache rows, -1 absent: zero-filled) into the slot at base's slab
// 8 by cp.async, from the producer's thread p: 8 chunks a row, 16 rows a pass.
__device__ __forceinline__ void copy_record_ropes(const MlaArgs& a, const int32_t* tile_rows, uint32_t base, int p) {
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r = (p >> 3) + 16 * pass;
    const int32_t row = tile_rows[r];
    cp_async_16(base + sw128_chunk_off(r, 64 + (p & 7), kSlabBytes), mla_record(a, row) + 528 + (p & 7) * 16,
                row >= 0 ? 16 : 0);
  }
}

template <bool kFp8, bool kPaired>
__global__ void __launch_bounds__(kThreads, 1) sparse_mla_wgmma_ws32_kernel(const MlaArgs a) {
  static_assert(kFp8 || !kPaired, "only fp8_ds_mla records share the dequantization");
  extern __shared__ __align__(1024) unsigned char smem[];
  if (!mla_smem_aligned(a, smem)) return;
  const uint32_t sQ = smem_u32(smem + kOffQ);
  const uint32_t sKV = smem_u32(smem + kOffKV);
  uint4* sP = reinterpret_cast<uint4*>(smem + kOffP);
  float* sMax = reinterpret_cast<float*>(smem + kOffMax);
  float* sL = reinterpret_cast<float*>(smem + kOffL);
  int32_t* sRing = reinterpret_cast<int32_t*>(smem + kOffRing);
  int32_t* sMisc = reinterpret_cast<int32_t*>(smem + kOffMisc);
  const uint32_t bars = smem_u32(smem + kOffBar);
  float* smem_part = reinterpret_cast<float*>(smem);  // the cluster merge's partial rows, over Q and the tiles
  unsigned char* peer_stage = smem + mla_peer_stage_offset(64);  // the peer merge's, past them (over the tiles)
  static_assert(mla_peer_stage_offset(64) + kMlaPeerStageBytes <= kOffP, "the peer merge's stage fits below kOffP");
  static_assert(mla_cluster_merge_bytes(64) <= kOffP, "the cluster merge's rows fit over Q and the tiles");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wl = warp & 3;  // warp-uniform to the compiler
  const int64_t t = mla_cta_token(a, 64);
  const int h0 = mla_cta_head0(a, 64);
  const int split = blockIdx.z;
  // (visible after the prologue's __syncthreads; kPaired: to the peer after the cluster barrier below)
  if (tid < 2 * kSlots) {
    mbar_init(bars + 8 * tid, tid < kSlots ? kFullArrivals : empty_arrivals(kPaired));
    if constexpr (kPaired) fence_mbarrier_init_cluster();
  }

  // ---- prologue (all threads): used entries ----
  const MlaSplitKeys keys = mla_split_keys<kThreads>(a, t, split, &sMisc[0]);
  const int nkeys = keys.nkeys;
  const int npairs = (nkeys + 2 * kBN - 1) / (2 * kBN);  // (kPaired: the same in both CTAs: one token, one split)
  if constexpr (kPaired) cluster_sync();  // both CTAs' barriers initialized before either arrives on the other's

  if (wg == 2) {
    // ==== producer ====
    setmaxnreg_dec<kPaired ? kPairedProducerRegs : kFp8 ? kFp8ProducerRegs : 56>();
    const int p = tid - 256;  // 0..127
    if constexpr (kFp8 && !kPaired) {
      // The rows of pair k in ring slot k % 4, resolved two pairs ahead by threads 0..63, each record prefetched
      // into L2 as it is resolved.
      auto resolve_pair = [&](int pair) {
        if (p >= 64) return;
        const int32_t row = mla_cache_row(a, keys, t, pair * 2 * kBN + p);
        sRing[(pair & 3) * 64 + p] = row;
        if (row >= 0) prefetch_l2(mla_record(a, row), a.record_bytes);
      };
      resolve_pair(0);
      if (npairs > 1) resolve_pair(1);
      named_bar_sync(kBarProducer, 128);
      const int pw = p >> 5, pl = p & 31;
      const int half = pl >> 4, c16 = pl & 15;  // a conversion item's row (of two) and 16-value chunk (of 16)
      const int sel = (c16 >> 2) & 1;           // which of its two bf16 chunks a lane stores first (bank-conflict free)
      for (int pair = 0; pair < npairs; ++pair) {
        const int32_t* ring = sRing + (pair & 3) * 64;
        // Both tiles' bytes by cp.async: the e4m3 rows raw into the slot's latent slabs 4..7 (row r at kRawOff +
        // 512 r), the rope into slab 8; the scale of this lane's (row pw + 4 (pl % 8), tile pl / 8) to a register.
        float sc[2];
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) {
          const int slot = (pair & 1) * 2 + tile;
          if (pair >= 2) mbar_wait(empty_bar(bars, slot), ((pair >> 1) - 1) & 1);  // pair - 2 is done with it
          const uint32_t base = sKV + slot * kTileBytes;
          const int32_t* tr = ring + tile * kBN;
#pragma unroll
          for (int k = 0; k < 8; ++k) {  // warp pw: rows pw + 4k, one 512-byte row a warp instruction
            const int r = pw + 4 * k;
            const int32_t row = tr[r];
            cp_async_16(base + kRawOff + r * 512 + pl * 16, mla_record(a, row) + pl * 16, row >= 0 ? 16 : 0);
          }
          copy_record_ropes(a, tr, base, p);
          cp_async_commit();
          cp_async_mbar_arrive_noinc(full_bar(bars, slot));
          const int32_t srow = tr[pw + 4 * (pl & 7)];
          sc[tile] = srow >= 0 ? __ldg(reinterpret_cast<const float*>(mla_record(a, srow) + 512 + (pl >> 3) * 4)) : 0.f;
        }
        // Each tile dequantized in place once its bytes landed: items (row pw + 4k, chunk c), k = 2j + half; chunks
        // 0..15 (slabs 0..3, clear of the raw rows) first, then chunks 16..31, whose stores overwrite the raw rows:
        // read by every producer thread before any of them stores.
#pragma unroll 1
        for (int tile = 0; tile < 2; ++tile) {
          if (tile == 0) {
            cp_async_wait<1>();
          } else {
            cp_async_wait<0>();
          }
          named_bar_sync(kBarProducer, 128);  // every producer thread's copies of the tile landed
          const int slot = (pair & 1) * 2 + tile;
          const uint32_t base = sKV + slot * kTileBytes;
          const float st = tile == 0 ? sc[0] : sc[1];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int k = 2 * j + half, r = pw + 4 * k;
            const float scale = __shfl_sync(0xffffffffu, st, (c16 >> 3) * 8 + k);
            store_dequant16(base, r, c16, sel, lds128(base + kRawOff + r * 512 + c16 * 16), scale);
          }
          uint4 vb[4];
          float sb[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int k = 2 * j + half, r = pw + 4 * k;
            sb[j] = __shfl_sync(0xffffffffu, st, (2 + (c16 >> 3)) * 8 + k);
            vb[j] = lds128(base + kRawOff + r * 512 + (16 + c16) * 16);
          }
          named_bar_sync(kBarProducer, 128);  // the raw rows read
#pragma unroll
          for (int j = 0; j < 4; ++j) store_dequant16(base, pw + 4 * (2 * j + half), 16 + c16, sel, vb[j], sb[j]);
          fence_proxy_async_smem();  // the bf16 rows, to the consumers' wgmma (the async proxy)
          mbar_arrive(full_bar(bars, slot));
        }
        // Pair + 2's rows (its ring slot held pair - 2's, which both consumers are done with: the empty waits above).
        if (pair + 2 < npairs) resolve_pair(pair + 2);
        named_bar_sync(kBarProducer, 128);
      }
    } else if constexpr (kFp8) {
      // Paired (kPaired): this CTA dequantizes rows rb .. rb + 15 of every tile (rb = 16 * its cluster rank), the
      // peer the other 16, each straight from registers into both CTAs' slots: warp pw takes own rows pw + 4k
      // (k < 4), lane pl their 16-value chunk pl (one 512-byte row a warp load), loaded two tiles ahead (registers need
      // no free slot), converted once the slot is free and stored here and, by st.async completing on the peer's
      // "full" barrier, in the peer's slot. Every row's rope goes into this CTA's slab 8 by cp.async.
      const uint32_t crank = cluster_cta_rank();
      const int rb = 16 * static_cast<int>(crank);
      // The rows of pair k in ring slot k % 4, resolved two pairs ahead by threads 0..63 (all 64 rows: the rope and
      // the consumers' masks need them), this CTA's rows' records prefetched into L2 as they are resolved.
      // In the loop the two loads of a row are split: pair + 3's entries are loaded during pair, their pages during
      // pair + 1, behind the conversions, and the rows stored after them (a row's loads never stall the producer).
      auto publish_row = [&](int pair, int32_t row) {
        sRing[(pair & 3) * 64 + p] = row;
        const bool own = ((p & 31) >> 4) == static_cast<int>(crank);
        if (row >= 0 && own) prefetch_l2(mla_record(a, row), a.record_bytes);
      };
      auto entry_of = [&](int pair) { return pair < npairs ? mla_key_entry(keys, pair * 2 * kBN + p) : -1; };
      int32_t e_ahead = -1;  // threads 0..63: the entry of pair + 2 (loaded during pair - 1)
      if (p < 64) {
        publish_row(0, mla_cache_row(a, keys, t, p));
        if (npairs > 1) publish_row(1, mla_cache_row(a, keys, t, 2 * kBN + p));
        e_ahead = entry_of(2);
      }
      named_bar_sync(kBarProducer, 128);
      const int pw = p >> 5, pl = p & 31;
      const int sel = (pl >> 2) & 1;  // which of its two bf16 chunks a lane stores first (bank-conflict free)
      // Tile n's (pair n / 2, tile n % 2) values of this lane's chunk of own rows pw + 4k, and their tiles' scales
      // (zeros for an absent row).
      struct OwnChunks {
        uint4 v[4];
        float s[4];
      };
      auto load_chunks = [&](int n, OwnChunks& c) {
        const int32_t* tr = sRing + ((n >> 1) & 3) * 64 + (n & 1) * kBN + rb;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int32_t row = tr[pw + 4 * k];
          const unsigned char* rec = mla_record(a, row);
          c.v[k] = row >= 0 ? __ldg(reinterpret_cast<const uint4*>(rec) + pl) : make_uint4(0u, 0u, 0u, 0u);
          c.s[k] = row >= 0 ? __ldg(reinterpret_cast<const float*>(rec + 512) + (pl >> 3)) : 0.f;
        }
      };
      const int ntiles = 2 * npairs;
      OwnChunks cur, nxt, nxt2;  // tiles n, n + 1, n + 2
      load_chunks(0, cur);
      if (ntiles > 1) load_chunks(1, nxt);
      bool resolving = false;
      int32_t page_ahead = -1, e_next = -1;
      for (int n = 0; n < ntiles; ++n) {
        const int pair = n >> 1, tile = n & 1, slot = (pair & 1) * 2 + tile;
        if (n + 2 < ntiles) load_chunks(n + 2, nxt2);  // (its ring rows were published a pair or more ago)
        if (tile == 0) {
          // Pair + 2's pages and pair + 3's entries: loads in flight during the conversions.
          resolving = p < 64 && pair + 2 < npairs;
          if (resolving) {
            page_ahead = mla_entry_page(a, keys, e_ahead);
            e_next = entry_of(pair + 3);
          }
        }
        // pair - 2 is done with the slot in both CTAs (this producer writes the peer's slot too)
        if (pair >= 2) mbar_wait_cluster(empty_bar(bars, slot), ((pair >> 1) - 1) & 1);
        const uint32_t base = sKV + slot * kTileBytes;
        const int32_t* tr = sRing + (pair & 3) * 64 + tile * kBN;
        copy_record_ropes(a, tr, base, p);
        cp_async_commit();
        cp_async_mbar_arrive_noinc(full_bar(bars, slot));
        const uint32_t peer_base = cluster_map(base, crank ^ 1u);
        const uint32_t peer_full = cluster_map(full_bar(bars, slot), crank ^ 1u);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int r = rb + pw + 4 * k;
          const uint4 lo = mla_dequant8(cur.v[k].x, cur.v[k].y, cur.s[k]);
          const uint4 hi = mla_dequant8(cur.v[k].z, cur.v[k].w, cur.s[k]);
          const uint32_t first = sw128_chunk_off(r, 2 * pl + sel, kSlabBytes);
          const uint32_t second = sw128_chunk_off(r, 2 * pl + 1 - sel, kSlabBytes);
          sts128(base + first, sel ? hi : lo);
          sts128(base + second, sel ? lo : hi);
          st_async_to_peer(peer_base + first, sel ? hi : lo, peer_full);
          st_async_to_peer(peer_base + second, sel ? lo : hi, peer_full);
        }
        fence_proxy_async_smem();  // the bf16 rows, to the consumers' wgmma (the async proxy)
        if (p == 0) {
          mbar_arrive_expect_tx(full_bar(bars, slot), 16 * 1024);  // the peer's 16 rows of bf16 latent
        } else {
          mbar_arrive(full_bar(bars, slot));
        }
        if (tile == 1) {
          // Pair + 2's rows (its ring slot held pair - 2's, which both consumers are done with: the empty waits
          // above; the barrier publishes them).
          if (resolving) {
            publish_row(pair + 2, mla_entry_row(a, t, e_ahead, page_ahead));
            e_ahead = e_next;
          }
          named_bar_sync(kBarProducer, 128);
        }
        cur = nxt;
        nxt = nxt2;
      }
    } else {
      // The rows of pair k (64 keys: tile 0 then tile 1) in ring slot k % 4, resolved a pair ahead by threads 0..63.
      auto resolve_pair = [&](int pair) {
        if (p >= 64) return;
        sRing[(pair & 3) * 64 + p] = mla_cache_row(a, keys, t, pair * 2 * kBN + p);
      };
      resolve_pair(0);
      named_bar_sync(kBarProducer, 128);
      for (int pair = 0; pair < npairs; ++pair) {
#pragma unroll 1
        for (int tile = 0; tile < 2; ++tile) {
          const int slot = (pair & 1) * 2 + tile;
          if (pair >= 2) mbar_wait(empty_bar(bars, slot), ((pair >> 1) - 1) & 1);  // pair - 2 is done with it
          // 8 threads per row, 16 rows per pass: each warp instruction reads 4 whole 128-byte segments.
          const uint32_t base = sKV + slot * kTileBytes;
          const int32_t* ring = sRing + (pair & 3) * 64 + tile * kBN;
#pragma unroll 1  // the producer has 56 registers
          for (int pass = 0; pass < 2; ++pass) {
            const int r = (p >> 3) + 16 * pass;
            const int32_t row = ring[r];
            const int64_t row_ok = row < 0 ? 0 : row;
            const __nv_bfloat16* lat = a.latent + row_ok * a.latent_unit + (p & 7) * 8;
            const int bytes = row >= 0 ? 16 : 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              cp_async_16(base + sw128_chunk_off(r, (p & 7) + 8 * k, kSlabBytes), lat + k * 64, bytes);
            }
            cp_async_16(base + sw128_chunk_off(r, (p & 7) + 64, kSlabBytes),
                        a.rope + row_ok * a.rope_unit + (p & 7) * 8, bytes);
          }
          cp_async_mbar_arrive_noinc(full_bar(bars, slot));
          mbar_arrive(full_bar(bars, slot));
        }
        // The next pair's rows (its ring slot was last read by pair - 3's gathers and masks, long done).
        if (pair + 1 < npairs) resolve_pair(pair + 1);
        named_bar_sync(kBarProducer, 128);
      }
    }
    cp_async_wait<0>();
    // kPaired: the peer's last stores land in this CTA's slots until its consumers have them; the epilogue's rows
    // (smem_part, the peer merge's stage) go over the slots only after both CTAs are past their last pair.
    if constexpr (kPaired) cluster_sync();
    mla_cluster_merge<64, kThreads>(a, t, h0, smem_part, kFp8 ? mla_cta_heads(a, 64) : 64);
    mla_peer_merge<64, kThreads, 0>(a, t, h0, smem_part, peer_stage);  // (the consumers sum unstaged rows)
    if constexpr (kPaired) cluster_sync();  // neither CTA exits while the other may still reach its shared memory
    return;
  }

  // ==== consumers: warpgroup wg owns tile wg of each pair and output columns [256 wg, 256 wg + 256) ====
  // Q, while the producer gathers the first pairs
  const int nh = kFp8 ? mla_cta_heads(a, 64) : 64;  // rows stored (a partial group: FP8 records only)
  mla_load_q<64, 256>(a, t, h0, tid, sQ, [](int r, int c) { return sw128_chunk_off(r, c, kQSlabBytes); }, nh);
  cp_async_commit();
  setmaxnreg_inc<kPaired ? kPairedConsumerRegs : kFp8 ? kFp8ConsumerRegs : 224>();
  const int other = wg ^ 1;
  const int wt = tid & 127;                          // this thread's index in its warpgroup
  const int r0 = wl * 16 + (lane >> 2), r1 = r0 + 8;  // this thread's two rows (heads) of the 64

  float m0 = -INFINITY, m1 = -INFINITY;  // the running max (log2 domain), the same in both warpgroups
  float l0 = 0.f, l1 = 0.f;              // this warpgroup's tiles' share of the row sums
  float s[16];
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  cp_async_wait<0>();
  fence_proxy_async_smem();
  named_bar_sync(kBarConsumers, 256);  // Q visible to wgmma

  // S = Q K_own^T : [64 heads, 32 keys] for pair `pair`, one commit group; waited for at the top of the pair.
  auto wait_full = [&](int slot, uint32_t parity) {
    if constexpr (kPaired) {
      mbar_wait_cluster(full_bar(bars, slot), parity);  // the peer's producer arrives on it too
    } else {
      mbar_wait(full_bar(bars, slot), parity);
    }
  };
  auto issue_qk = [&](int pair) {
    const int slot = (pair & 1) * 2 + wg;
    wait_full(slot, (pair >> 1) & 1);
    fence_proxy_async_smem();
    wgmma_fence();
    const uint64_t da0 = wgmma_desc_sw128(sQ, 16, 1024);
    const uint64_t db0 = wgmma_desc_sw128(sKV + slot * kTileBytes, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < 36; ++ks) {
      const uint32_t qoff = (ks >> 2) * kQSlabBytes + (ks & 3) * 32, koff = (ks >> 2) * kSlabBytes + (ks & 3) * 32;
      wgmma_m64n32k16<0>(s, da0 + (qoff >> 4), db0 + (koff >> 4), ks > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  if (npairs > 0) issue_qk(0);

  for (int pair = 0; pair < npairs; ++pair) {
    const uint32_t par = (pair >> 1) & 1;
    const int own_slot = (pair & 1) * 2 + wg, other_slot = (pair & 1) * 2 + other;
    const uint32_t own_tile = sKV + own_slot * kTileBytes, other_tile = sKV + other_slot * kTileBytes;
    // ---- this pair's S (issued at the end of the previous pair, behind its P*V) ----
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 16; ++i) reg_fence(s[i]);

    // ---- softmax, the seesaw way (sparse_mla_seesaw.cuh) ----
    float mx0, mx1, tm0, tm1, al0, al1;
    seesaw_mask_rowmax<kBN>(s, sRing + (pair & 3) * 64 + wg * kBN, lane, a.scale_log2, mx0, mx1);
    float* pmax = sMax + (pair & 1) * 128;
    seesaw_exchange_max(wg, lane, r0, r1, pmax, m0, m1, mx0, mx1, kBarMax0, kBarMax1, tm0, tm1);
    seesaw_exp_rowsum<kBN>(s, a.scale_log2, tm0, tm1, m0, m1, l0, l1, al0, al1);
    uint32_t pa[2][4];
    seesaw_pack_p<kBN>(s, 1.f, 1.f, pa);
    // P to the other warpgroup: fragment kk of thread wt at [wg][kk][wt] (thread wt of the other warpgroup holds
    // the same rows and reads it back as its own A fragment)
    auto store_p = [&](const uint32_t (&pv)[2][4]) {
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) sP[(wg * 2 + kk) * 128 + wt] = make_uint4(pv[kk][0], pv[kk][1], pv[kk][2], pv[kk][3]);
      named_bar_arrive(kBarP + wg, 256);
    };
    if (wg == 1) store_p(pa);  // already against the pair's max

    mla_scale_o_rows(o, al0, al1);
    // O_w += P V[:, cols_w] over one tile (P from registers)
    auto pv_tile = [&](const uint32_t (&pv)[2][4], uint32_t tile) {
      const uint64_t vb = wgmma_desc_sw128(tile + (4 * wg) * kSlabBytes, kSlabBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) wgmma_m64n256k16_rs<1>(o, pv[kk], vb + ((kk * 16 * 128) >> 4), 1);
    };
    // The other warpgroup's P, once handed over, and its tile (landed: the other warpgroup waited for it)
    auto other_p = [&](uint32_t (&po)[2][4]) {
      named_bar_sync(kBarP + other, 256);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const uint4 v = sP[(other * 2 + kk) * 128 + wt];
        po[kk][0] = v.x;
        po[kk][1] = v.y;
        po[kk][2] = v.z;
        po[kk][3] = v.w;
      }
      wait_full(other_slot, par);
      fence_proxy_async_smem();
    };
    uint32_t po[2][4];
    if (wg == 0) {
      wgmma_fence();
      pv_tile(pa, own_tile);  // local P*V against WG0's own max, while WG1 scores
      wgmma_commit();
      // From its max to the pair's (WG1's): f scales the P it hands over, then (once the local P*V is done) its O
      // and l.
      uint32_t pf[kBN / 16][4];
      float f0, f1;
      seesaw_wg0_to_pair_max<kBN>(kBarMax1, pmax, r0, r1, tm0, tm1, s, pf, l0, l1, m0, m1, f0, f1);
      store_p(pf);
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 128; ++i) reg_fence(o[i]);
      mla_scale_o_rows(o, f0, f1);
      other_p(po);
      wgmma_fence();
      pv_tile(po, other_tile);
      wgmma_commit();
    } else {
      other_p(po);
      wgmma_fence();
      pv_tile(po, other_tile);
      pv_tile(pa, own_tile);
      wgmma_commit();
    }
    // The next pair's S goes to the tensor cores right behind this pair's P*V (its tiles landed during this pair:
    // two pairs are in flight), so the pipe does not drain between pairs.
    if (pair + 1 < npairs) {
      issue_qk(pair + 1);
      wgmma_wait<1>();
    } else {
      wgmma_wait<0>();
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) reg_fence(o[i]);
    mbar_arrive(empty_bar(bars, own_slot));  // both tiles of the pair: read for the last time by this warpgroup
    mbar_arrive(empty_bar(bars, other_slot));
    if constexpr (kPaired) {  // the peer's producer writes these slots of this CTA too, after its own empty wait
      if (pair + 2 < npairs) {
        __syncwarp();  // one arrival a warp: every lane's reads are done (wgmma_wait above)
        if (lane == 0) {
          mbar_arrive_remote(cluster_map(empty_bar(bars, own_slot), cluster_cta_rank() ^ 1u));
          mbar_arrive_remote(cluster_map(empty_bar(bars, other_slot), cluster_cta_rank() ^ 1u));
        }
      }
    }
  }

  // ---- epilogue ----
  wgmma_wait<0>();  // nothing is in flight here; said so the compiler need not infer it
  if constexpr (kPaired) cluster_sync();  // (the producer's, above: the peer's stores into the slots are done)
  store_wgmma64_rows(a, t, h0, split, wg, lane, r0, r1, o, l0, l1, sL, [] { named_bar_sync(kBarConsumers, 256); }, m0,
                     m1, smem_part, nh);
  mla_cluster_merge<64, kThreads>(a, t, h0, smem_part, nh);
  mla_peer_merge<64, kThreads, 256>(a, t, h0, smem_part, peer_stage);
  if constexpr (kPaired) cluster_sync();
}

}  // namespace

Status launch_sparse_mla_wgmma_ws32(const MlaArgs& args, int groups, const LaunchContext& ctx) {
  if (args.record_bytes > 0 && args.pair_dequant) {
    return launch_mla_grid(sparse_mla_wgmma_ws32_kernel<true, true>, "sparse_mla_wgmma_ws32_kernel (fp8_ds_mla, paired)",
                           args, groups, kThreads, kSmemBytes, ctx.stream);
  }
  if (args.record_bytes > 0) {
    return launch_mla_grid(sparse_mla_wgmma_ws32_kernel<true, false>, "sparse_mla_wgmma_ws32_kernel (fp8_ds_mla)", args,
                           groups, kThreads, kSmemBytes, ctx.stream);
  }
  return launch_mla_grid(sparse_mla_wgmma_ws32_kernel<false, false>, "sparse_mla_wgmma_ws32_kernel", args, groups,
                         kThreads, kSmemBytes, ctx.stream);
}

}  // namespace dsacp::cuda
