// Sparse MLA attention (decode and prefill, one kernel) on tensor cores: mma.sync m16n8k16 bf16 -> f32.
//
// One CTA = (query token t, head group of HG heads, key split s). Heads are the M dimension, so H = 16, 32, 64
// map to 1, 2, 4 row tiles of 16 natively (H = 128 is two head groups of 64). Other head counts (and head blocks,
// SparseMlaParams::head_blocks) run in the next group up (sparse_mla_shape): a block's last group is partial, its
// rows past the block's heads get zero queries and are not stored, so the keys are read once a group as for a
// whole group (H = 1..8 read what H = 16 reads).
//
// Per CTA:
//   prologue  count the token's used top-k entries (front-packed: stop at the first entry outside
//             [0, key_len)), resolve this split's entries to physical cache rows through the block table
//             (a bad page is reported and its row treated as absent), load Q [HG, 576] into shared memory.
//   main loop tiles of kBN = 32 chosen keys: the latent (512) and rope (64) rows are gathered with cp.async
//             into a ring of [32, 576] bf16 tiles (XOR-swizzled 16-byte chunks, conflict-free ldmatrix; 3 stages
//             for HG = 64, 4 for 32, 2 for HG = 16, which runs two CTAs per SM); S = Q K^T by mma into shared memory (16x16 blocks per warp for
//             HG = 64; 16x8 blocks on all 8 warps for HG <= 32, the 576-long reduction split in two for HG = 16),
//             online softmax (exp2, running max and sum per row), P (bf16) to shared memory, then O += P V by
//             mma with O [16, 512/CS] held in registers by each warp (warp = row tile x column slice).
// Used for H = 16 and 32 (and for 64-head groups with CudaBackendOptions::MlaKernel::kMmaSync); sparse_mla_wgmma_ws32.cu (decode)
// and sparse_mla_wgmma_ws.cu (prefill) are the defaults for 64-head groups.
//   epilogue  out = O / l, lse = m + ln l; with split-K, the normalized partials and their LSE are merged by the
//             cluster of the token's splits through shared memory (mla_cluster_merge: up to 8 splits, the default
//             for 64-head groups), or go to a workspace that launch_lse_merge combines (16 / 32-head groups, more
//             than 8 splits; CudaBackendOptions::mla_cluster_merge forces either).
// fp8_ds_mla records (MlaArgs::record_bytes > 0; 16 / 32-head groups, 64 when forced): each key's e4m3 values and
// tile scales are loaded to registers when its tile is issued and dequantized (scale * value in f32, one rounding
// to bf16) into the same bf16 tile after the current tile's MMAs; the rope goes by cp.async as in the bf16 path.
// Absent keys (past the used entries, bad pages) are zero-filled in shared memory and masked to -inf, so NaN in
// unused cache slots never reaches the result. A token with no used entry gives out = 0, lse = -inf.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_merge.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = 8;
constexpr int kBN = 32;            // keys per tile
static_assert(kBN == kMlaSplitKeyTile, "key splits are whole tiles");
// CTAs per SM (sparse_mla_args.cuh: two for HG = 16, else one).
template <int HG>
__host__ __device__ constexpr int ctas_per_sm_for() { return mla_mma_ctas_per_sm(HG); }
// cp.async ring depth: as deep as shared memory allows (Q takes HG * 1152 bytes) at that occupancy
template <int HG>
__host__ __device__ constexpr int stages_for() { return HG == 64 ? 3 : (HG == 32 ? 4 : 2); }
// QK^T work split: 16x8 score blocks over the 8 warps; with HG = 16 there are only 4 blocks, so the 576-long
// reduction is also split in two (two partial S buffers, added in a fixed order by the softmax).
template <int HG>
__host__ __device__ constexpr int ksplit_for() { return HG == 16 ? 2 : 1; }
constexpr int kDl = 512, kD = 576;  // latent, latent + rope
constexpr int kChunks = kD / 8;    // 16-byte chunks per row
constexpr int kMaxSplitKeys = kMlaMaxSplitKeys;  // entries one CTA handles (row-index table size)
constexpr int kSStride = kBN + 8;  // f32 S row stride
constexpr int kPStride = kBN + 8;  // bf16 P row stride (80-byte rows: conflict-free ldmatrix)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int HG>
struct Smem {
  static constexpr int kStages = stages_for<HG>();
  static constexpr int kQ = HG * kD * 2;
  static constexpr int kKV = kStages * kBN * kD * 2;
  static constexpr int kS = ksplit_for<HG>() * HG * kSStride * 4;
  static constexpr int kP = HG * kPStride * 2;
  static constexpr int kOffQ = 0;
  static constexpr int kOffKV = kOffQ + kQ;
  static constexpr int kOffS = kOffKV + kKV;
  static constexpr int kOffP = kOffS + kS;
  static constexpr int kOffAlpha = kOffP + kP;            // [HG] f32
  static constexpr int kOffL = kOffAlpha + HG * 4;        // [HG] f32
  static constexpr int kOffM = kOffL + HG * 4;            // [HG] f32
  static constexpr int kOffRow = kOffM + HG * 4;          // [kMaxSplitKeys] i32
  static constexpr int kOffMisc = kOffRow + kMaxSplitKeys * 4;  // [4] i32
  static constexpr int kBytes = kOffMisc + 16;
};

// Byte offset of 16-byte chunk c of row r in a [rows, 576] bf16 tile with XOR swizzle.
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * (kD * 2) + ((c ^ (r & 7)) << 4));
}

// One thread's share of an fp8_ds_mla key tile in flight (kFp8): four 16-byte chunks of its key's e4m3 values
// (chunk c0 + 8k lies in tile k) and the key's four tile scales.
struct Fp8Share {
  uint4 v[4];
  float4 scale;
};

template <int HG, bool kFp8>
__global__ void __launch_bounds__(kThreads, ctas_per_sm_for<HG>()) sparse_mla_mma_kernel(const MlaArgs a) {
  using L = Smem<HG>;
  constexpr int kStages = L::kStages;
  constexpr int RG = HG / 16;          // row tiles
  constexpr int CS = kWarps / RG;      // column slices of O
  constexpr int kCols = kDl / CS;      // O columns per warp
  constexpr int kNT = kCols / 8;       // O n-tiles per warp
  constexpr int TPR = kThreads / HG;   // softmax threads per row
  constexpr int KPT = kBN / TPR;       // keys per softmax thread
  static_assert(KPT >= 1 && kNT % 2 == 0, "tile shape");

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem + L::kOffQ);
  const uint32_t sKV = smem_u32(smem + L::kOffKV);
  float* sS = reinterpret_cast<float*>(smem + L::kOffS);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + L::kOffP);
  float* sAlpha = reinterpret_cast<float*>(smem + L::kOffAlpha);
  float* sL = reinterpret_cast<float*>(smem + L::kOffL);
  float* sM = reinterpret_cast<float*>(smem + L::kOffM);
  int32_t* sRow = reinterpret_cast<int32_t*>(smem + L::kOffRow);
  int32_t* sMisc = reinterpret_cast<int32_t*>(smem + L::kOffMisc);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = mla_cta_token(a, HG);
  const int h0 = mla_cta_head0(a, HG);
  const int nh = mla_cta_heads(a, HG);  // < HG: a head block's partial last group (rows from nh on: zero q, no stores)
  const int split = blockIdx.z;

  // ---- prologue: used entries, this split's rows ----
  const MlaSplitKeys keys = mla_split_keys<kThreads>(a, t, split, &sMisc[0]);
  const int nkeys = keys.nkeys;
  for (int i = tid; i < nkeys; i += kThreads) sRow[i] = mla_cache_row(a, keys, t, i);

  // ---- Q [HG, 576] ----
  mla_load_q<HG, kThreads>(a, t, h0, tid, sQ, swz, nh);
  __syncthreads();  // sRow visible to the gather

  const int ntiles = (nkeys + kBN - 1) / kBN;
  // Gather of one tile: thread -> row j = tid / 8, chunks (tid % 8) + 8k, k < 9 (one row lookup per thread).
  static_assert(kBN * kChunks == kThreads * 9, "gather shape");
  auto load_tile = [&](int tile, int stage) {
    const uint32_t base = sKV + stage * (kBN * kD * 2);
    const int j = tid >> 3, c0 = tid & 7;
    const int key = tile * kBN + j;
    const int32_t row = key < nkeys ? sRow[key] : -1;
    const __nv_bfloat16* lat = mla_latent_row(a, row);
    const __nv_bfloat16* rop = mla_rope_row(a, row);
    const int bytes = row >= 0 ? 16 : 0;
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      const int c = c0 + 8 * k;
      const void* src = c < 64 ? static_cast<const void*>(lat + c * 8) : static_cast<const void*>(rop + (c - 64) * 8);
      cp_async_16(base + swz(j, c), src, bytes);
    }
  };

  // fp8_ds_mla records: the rope (bf16) goes to the tile by cp.async as above; the e4m3 values and scales are
  // loaded into registers when the tile is issued (fp8_issue, kStages - 1 tiles ahead like the cp.async ring) and
  // dequantized into the tile's bf16 rows after this tile's MMAs (fp8_store), so the MMA path reads the same bf16
  // tile. Thread -> key j = tid / 8, e4m3 chunks (tid % 8) + 8k, k < 4 (bf16 chunks 2c, 2c + 1), rope chunk tid % 8.
  auto fp8_issue = [&](int tile, int stage, Fp8Share& sh) {
    const uint32_t base = sKV + stage * (kBN * kD * 2);
    const int j = tid >> 3, c0 = tid & 7;
    const int key = tile * kBN + j;
    const int32_t row = key < nkeys ? sRow[key] : -1;
    const unsigned char* rec = mla_record(a, row);
    cp_async_16(base + swz(j, 64 + c0), rec + a.record_bytes - 128 + c0 * 16, row >= 0 ? 16 : 0);
    if (row >= 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) sh.v[k] = __ldg(reinterpret_cast<const uint4*>(rec + (c0 + 8 * k) * 16));
      sh.scale = __ldg(reinterpret_cast<const float4*>(rec + 512));
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) sh.v[k] = make_uint4(0u, 0u, 0u, 0u);
      sh.scale = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  auto fp8_store = [&](int stage, const Fp8Share& sh) {
    const uint32_t base = sKV + stage * (kBN * kD * 2);
    const int j = tid >> 3, c0 = tid & 7;
    const float sc[4] = {sh.scale.x, sh.scale.y, sh.scale.z, sh.scale.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int c = c0 + 8 * k;
      const uint4 lo = mla_dequant8(sh.v[k].x, sh.v[k].y, sc[k]);
      const uint4 hi = mla_dequant8(sh.v[k].z, sh.v[k].w, sc[k]);
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(base + swz(j, 2 * c)), "r"(lo.x), "r"(lo.y),
                   "r"(lo.z), "r"(lo.w));
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(base + swz(j, 2 * c + 1)), "r"(hi.x),
                   "r"(hi.y), "r"(hi.z), "r"(hi.w));
    }
  };

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < ntiles) {
      if constexpr (kFp8) {
        Fp8Share sh;
        fp8_issue(st, st, sh);
        fp8_store(st, sh);
      } else {
        load_tile(st, st);
      }
    }
    cp_async_commit();
  }

  // softmax state: thread owns row sr, keys [sk0, sk0 + KPT) of each tile
  const int sr = tid / TPR;
  const int sk0 = (tid % TPR) * KPT;
  float m_run = -INFINITY, l_run = 0.f;

  // PV warp tile
  const int prg = warp % RG, pcs = warp / RG;
  float o[kNT][4];
#pragma unroll
  for (int i = 0; i < kNT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  for (int tile = 0; tile < ntiles; ++tile) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int nt = tile + kStages - 1;
    Fp8Share pending;
    if (nt < ntiles) {
      if constexpr (kFp8) {
        fp8_issue(nt, nt % kStages, pending);
      } else {
        load_tile(nt, nt % kStages);
      }
    }
    cp_async_commit();
    const uint32_t kv = sKV + (tile % kStages) * (kBN * kD * 2);

    // ---- S = Q K^T (raw dot products; the softmax scales) ----
    if constexpr (HG == 64) {  // warp -> 16x16 block (rows rb*16, keys cb*16)
      const int rb = warp % RG, cb = warp / RG;
      // two independent accumulator chains per n-tile (even / odd k-steps) halve the dependent-mma depth
      float acc[2][2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
      const int arow = rb * 16 + (lane & 15);
      const int akc = lane >> 4;
      const int bkey = cb * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int bkc = (lane >> 3) & 1;
#pragma unroll 6
      for (int ks = 0; ks < kD / 16; ks += 2) {
#pragma unroll
        for (int par = 0; par < 2; ++par) {
          uint32_t af[4], bf[4];
          ldmatrix_x4(sQ + swz(arow, (ks + par) * 2 + akc), af[0], af[1], af[2], af[3]);
          ldmatrix_x4(kv + swz(bkey, (ks + par) * 2 + bkc), bf[0], bf[1], bf[2], bf[3]);
          mma_bf16_16816(acc[0][par], af, bf[0], bf[1]);
          mma_bf16_16816(acc[1][par], af, bf[2], bf[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][0][e] += acc[nt][1][e];
      const int r = rb * 16 + (lane >> 2);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int c = cb * 16 + nt * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(&sS[r * kSStride + c]) =
            make_float2(acc[nt][0][0], acc[nt][0][1]);
        *reinterpret_cast<float2*>(&sS[(r + 8) * kSStride + c]) =
            make_float2(acc[nt][0][2], acc[nt][0][3]);
      }
    } else {  // HG = 16, 32: warp -> 16x8 block (rows rb*16, keys nb*8), K split KS ways
      constexpr int KS = ksplit_for<HG>();
      constexpr int kBlocks = RG * (kBN / 8);
      static_assert(kBlocks * KS == kWarps, "one block per warp");
      const int blk = warp % kBlocks, kh = warp / kBlocks;
      const int rb = blk % RG, nb = blk / RG;
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const int arow = rb * 16 + (lane & 15);
      const int akc = lane >> 4;
      const int bkey = nb * 8 + (lane & 7);
      const int bkc = lane >> 3;  // 0..3: chunks of two k-steps
      constexpr int kSteps = kD / 16 / KS;
#pragma unroll 3
      for (int ks = kh * kSteps; ks < (kh + 1) * kSteps; ks += 2) {
        uint32_t a0[4], a1[4], bf[4];
        ldmatrix_x4(sQ + swz(arow, ks * 2 + akc), a0[0], a0[1], a0[2], a0[3]);
        ldmatrix_x4(sQ + swz(arow, ks * 2 + 2 + akc), a1[0], a1[1], a1[2], a1[3]);
        ldmatrix_x4(kv + swz(bkey, ks * 2 + bkc), bf[0], bf[1], bf[2], bf[3]);
        mma_bf16_16816(acc[0], a0, bf[0], bf[1]);
        mma_bf16_16816(acc[1], a1, bf[2], bf[3]);
      }
      float* dst = sS + kh * (HG * kSStride);
      const int r = rb * 16 + (lane >> 2);
      const int c = nb * 8 + (lane & 3) * 2;
      *reinterpret_cast<float2*>(&dst[r * kSStride + c]) = make_float2(acc[0][0] + acc[1][0], acc[0][1] + acc[1][1]);
      *reinterpret_cast<float2*>(&dst[(r + 8) * kSStride + c]) =
          make_float2(acc[0][2] + acc[1][2], acc[0][3] + acc[1][3]);
    }
    __syncthreads();

    // ---- online softmax (log2 domain) ----
    {
      float s[KPT];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < KPT; ++i) {
        const int key = tile * kBN + sk0 + i;
        const bool valid = key < nkeys && sRow[key] >= 0;
        float dot = sS[sr * kSStride + sk0 + i];
        if constexpr (ksplit_for<HG>() == 2) dot += sS[HG * kSStride + sr * kSStride + sk0 + i];
        s[i] = valid ? dot * a.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[i]);
      }
#pragma unroll
      for (int off = TPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2_ftz(m_run - m_use);
      float psum = 0.f;
#pragma unroll
      for (int i = 0; i < KPT; i += 2) {
        const float p0 = exp2_ftz(s[i] - m_use);
        const float p1 = KPT > 1 ? exp2_ftz(s[i + 1] - m_use) : 0.f;
        psum += p0 + p1;
        if (KPT > 1) {
          *reinterpret_cast<uint32_t*>(&sP[sr * kPStride + sk0 + i]) = pack_bf16x2(p0, p1);
        } else {
          sP[sr * kPStride + sk0 + i] = __float2bfloat16_rn(p0);
        }
      }
#pragma unroll
      for (int off = TPR / 2; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      l_run = l_run * alpha + psum;
      m_run = m_new;
      if ((tid % TPR) == 0) sAlpha[sr] = alpha;
    }
    __syncthreads();

    // ---- O = alpha O + P V ----
    {
      const float al0 = sAlpha[prg * 16 + (lane >> 2)];
      const float al1 = sAlpha[prg * 16 + (lane >> 2) + 8];
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        o[i][0] *= al0;
        o[i][1] *= al0;
        o[i][2] *= al1;
        o[i][3] *= al1;
      }
      const uint32_t pbase = smem_u32(sP);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        uint32_t af[4];
        ldmatrix_x4(pbase + ((prg * 16 + (lane & 15)) * kPStride + kk * 16 + (lane >> 4) * 8) * 2, af[0], af[1],
                    af[2], af[3]);
        const int vkey = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
          uint32_t bf[4];
          const int chunk = (pcs * kCols + np * 16) / 8 + (lane >> 4);
          ldmatrix_x4_trans(kv + swz(vkey, chunk), bf[0], bf[1], bf[2], bf[3]);
          mma_bf16_16816(o[2 * np], af, bf[0], bf[1]);
          mma_bf16_16816(o[2 * np + 1], af, bf[2], bf[3]);
        }
      }
    }
    if constexpr (kFp8) {
      // stage nt % kStages was last read in the previous tile (every thread passed this tile's first barrier)
      if (nt < ntiles) fp8_store(nt % kStages, pending);
    }
  }
  cp_async_wait<0>();

  // ---- epilogue ----
  mla_allow_dependents();
  if ((tid % TPR) == 0) {
    sL[sr] = l_run;
    sM[sr] = m_run;
  }
  __syncthreads();
  const int r0 = prg * 16 + (lane >> 2);
  const float l0 = sL[r0], l1 = sL[r0 + 8];
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f;
  const float inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  // (token, head) row of r0 in the caller's layout, the cluster merge's rows or the split-K workspace; r0 + 8 is
  // row0 + 8 (a head group never straddles a head block). Rows from nh on are not stored.
  float* smem_part = reinterpret_cast<float*>(smem);  // the cluster merge's partial rows, over Q and the tiles
  static_assert(mla_cluster_merge_bytes(HG) <= L::kOffAlpha, "the cluster merge's rows fit below the row stats");
  const int64_t row0 = mla_out_row(a, t, h0, r0);
  const bool st0 = r0 < nh, st1 = r0 + 8 < nh;
  mla_with_out_rows(a, split, smem_part, [&](auto* out) {
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      const int c = pcs * kCols + i * 8 + (lane & 3) * 2;
      if (st0) mla_store_pair(out + row0 * kDl + c, o[i][0] * inv0, o[i][1] * inv0);
      if (st1) mla_store_pair(out + (row0 + 8) * kDl + c, o[i][2] * inv1, o[i][3] * inv1);
    }
  });
  if (tid < nh) {
    const float l = sL[tid];
    mla_lse_rows(a, split, smem_part, HG)[mla_out_row(a, t, h0, tid)] =
        l > 0.f ? (sM[tid] + log2f(l)) * kLn2 : -INFINITY;
  }
  mla_cluster_merge<HG, kThreads>(a, t, h0, smem_part, nh);
}

template <int HG>
Status launch_hg(const MlaArgs& args, int groups, const LaunchContext& ctx) {
  constexpr int bytes = Smem<HG>::kBytes;
  static_assert(bytes * ctas_per_sm_for<HG>() <= 227 * 1024, "shared memory");
  if (args.record_bytes > 0) {
    return launch_mla_grid(sparse_mla_mma_kernel<HG, true>, "sparse_mla_mma_kernel (fp8_ds_mla)", args, groups,
                           kThreads, bytes, ctx.stream);
  }
  return launch_mla_grid(sparse_mla_mma_kernel<HG, false>, "sparse_mla_mma_kernel", args, groups, kThreads, bytes,
                         ctx.stream);
}

}  // namespace

Status launch_sparse_mla(const SparseMlaParams& p, int splits, float* workspace, const LaunchContext& ctx) {
  DSACP_RETURN_IF_ERROR(sparse_mla_supported(p, ctx.options));
  if (p.rows.num_tokens == 0) return Status::ok_status();
  MlaArgs a{};
  a.request = p.rows.request;
  a.key_len = p.rows.key_len;
  a.q_nope = static_cast<const __nv_bfloat16*>(p.q_nope);
  a.q_rope = static_cast<const __nv_bfloat16*>(p.q_rope);
  a.latent = static_cast<const __nv_bfloat16*>(p.latent.data);
  a.rope = static_cast<const __nv_bfloat16*>(p.rope.data);
  a.latent_stride = pool_row_stride(p.latent);
  a.rope_stride = pool_row_stride(p.rope);
  if (p.latent.records()) {
    a.records = static_cast<const unsigned char*>(p.latent.data);
    a.record_bytes = p.latent.record_bytes;
  }
  MlaRowUnits units;
  std::string why;
  if (!mla_row_units(p, &units, &why)) return internal_error("sparse_mla: " + why);  // (sparse_mla_supported)
  a.page_units = units.page_units;
  a.key_units = units.key_units;
  a.latent_unit = units.latent_unit;
  a.rope_unit = units.rope_unit;
  a.record_unit = units.record_unit;
  a.block_table = p.block_table.data;
  a.topk = p.topk;
  a.out = p.out;
  a.lse = p.lse;
  a.T = p.rows.num_tokens;
  a.H = p.H;
  a.block_heads = p.H / p.head_blocks;
  const MlaShape shape = sparse_mla_shape(p, ctx.options);
  a.block_groups = shape.block_groups;
  a.groups = shape.groups;
  a.K = p.K;
  a.page_size = p.latent.page_size;
  a.max_pages = p.block_table.max_pages;
  a.num_requests = p.block_table.num_requests;
  a.num_pages = p.latent.num_pages;
  a.splits = std::max(1, splits);
  a.split_len = mla_split_len(p.K, a.splits);
  if (a.split_len > kMaxSplitKeys) return internal_error("sparse_mla: split of more than 2048 keys");
  a.scale_log2 = p.scale * kLog2e;
  a.out_bf16 = p.out_dtype == DType::kBF16;
  a.cluster_merge = sparse_mla_cluster_merge(a.splits, shape.head_group, ctx.options);
  a.pair_dequant = sparse_mla_fp8_pair_dequant(p, a.splits, ctx.options);
  a.err = ctx.error;
  a.peer = p.peer;
  if (p.peer.sync.active() && a.splits != 1) {
    return internal_error("sparse_mla: partials merged across ranks with " + std::to_string(a.splits) +
                          " key splits (the caller plans one)");
  }
  const int64_t rows = a.T * a.H;
  if (a.splits > 1 && !a.cluster_merge) {
    if (workspace == nullptr) return internal_error("sparse_mla: split-K without a workspace");
    a.part_out = workspace;
    a.part_lse = workspace + static_cast<int64_t>(a.splits) * rows * kDl;
  }
  const int groups = shape.groups;
  switch (shape.head_group) {
    case 16:
      DSACP_RETURN_IF_ERROR(shape.kernel == MlaKernel::kSmallHeads ? launch_sparse_mla_small_heads(a, groups, ctx)
                                                                    : launch_hg<16>(a, groups, ctx));
      break;
    case 32: DSACP_RETURN_IF_ERROR(launch_hg<32>(a, groups, ctx)); break;
    default:
      switch (shape.kernel) {
        case MlaKernel::kWgmmaWs: DSACP_RETURN_IF_ERROR(launch_sparse_mla_wgmma_ws(a, groups, ctx)); break;
        case MlaKernel::kWgmmaWs32: DSACP_RETURN_IF_ERROR(launch_sparse_mla_wgmma_ws32(a, groups, ctx)); break;
        case MlaKernel::kMmaSync: DSACP_RETURN_IF_ERROR(launch_hg<64>(a, groups, ctx)); break;
      }
      break;
  }
  if (a.splits > 1 && !a.cluster_merge) {
    LseMergeParams m;
    m.num_parts = a.splits;
    m.num_rows = rows;
    m.Dl = kDl;
    m.part_out = a.part_out;
    m.part_lse = a.part_lse;
    m.out = nullptr;
    m.lse = p.lse;
    DSACP_RETURN_IF_ERROR(
        launch_lse_merge(m, p.out, p.out_dtype, ctx, LseMergeRows{a.T, a.H, a.block_heads}, /*after_producer=*/true));
  }
  return Status::ok_status();
}

}  // namespace dsacp::cuda
