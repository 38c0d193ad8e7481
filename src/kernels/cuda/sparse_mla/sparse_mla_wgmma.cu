// Sparse MLA attention for 64-head groups (H = 64, 128) on Hopper warpgroup MMA (wgmma, sm_90a).
//
// One CTA = (token, 64 heads, key split), two warpgroups. Shared memory holds Q [64, 576] and a 2-stage ring of
// gathered key tiles [64 keys, 576], all in the 128-byte-swizzled K-major layout wgmma reads directly (nine
// 64-column slabs of [64 rows, 128 B]); the chosen rows are gathered with cp.async (row ids resolved two tiles
// ahead into a small ring, so no copy waits on a block-table load).
// Per tile of 64 keys:
//   S_w = Q K_w^T   warpgroup w scores its 32 keys: 36 x wgmma m64n32k16 (A = Q, B = K tile, both from smem)
//   softmax         row max exchanged between the warpgroups through shared memory; exp2 in registers;
//                   P (bf16) written to a swizzled [64, 64] tile; each warpgroup keeps its partial row sum
//   O_w += P V_w    warpgroup w owns output columns [256w, 256w + 256): 4 x wgmma m64n256k16 with A = P and
//                   B = the same key tile read MN-major (the latent part of the rows is V), O in 128 registers
// Since session 7 the warp-specialized kernel (sparse_mla_wgmma_ws.cu) is faster on every 64-head case; this one
// stays for comparison (DSACP_MLA_KERNEL=wgmma, the benchmark's other_kernel rows) and as the way around a
// shared-memory base the other kernel cannot use.
// Semantics match sparse_mla_mma.cu exactly (front-packed entries, absent rows zero-filled and masked, bad pages
// reported, out = 0 and lse = -inf without keys, split-K partials merged by LSE).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/common/wgmma_sm90.cuh"
#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kBN = 64;        // keys per tile
constexpr int kDl = 512, kDr = 64;
constexpr int kSlabBytes = 64 * 128;             // one [64 rows, 64 bf16] swizzled slab
constexpr int kTileBytes = 9 * kSlabBytes;       // [64 rows, 576] = 73728
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kTileBytes;
constexpr int kOffP = kOffKV + 2 * kTileBytes;
constexpr int kOffMax = kOffP + kSlabBytes;      // [2][64] f32
constexpr int kOffL = kOffMax + 2 * 64 * 4;      // [2][64] f32
constexpr int kOffRing = kOffL + 2 * 64 * 4;     // [3][64] i32 cache rows of the next tiles
constexpr int kOffMisc = kOffRing + 3 * 64 * 4;  // [4] i32
constexpr int kSmemUsed = kOffMisc + 16;
constexpr int kSmemBytes = kSmemUsed + 1024;     // slack to align the base to 1024 B (swizzle atoms)
static_assert(kSmemBytes <= 232448, "shared memory");
// Three barriers per tile: max exchange, P complete, end of tile (which also publishes the next tile).

// Byte offset of 16-byte chunk c (0..71) of row r in a [64, 576] tile.
__device__ __forceinline__ uint32_t tile_off(int r, int c) { return sw128_chunk_off(r, c, kSlabBytes); }

__global__ void __launch_bounds__(kThreads, 1) sparse_mla_wgmma64_kernel(const MlaArgs a) {
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const uint32_t sQ = smem_u32(smem + kOffQ);
  const uint32_t sKV = smem_u32(smem + kOffKV);
  const uint32_t sPu = smem_u32(smem + kOffP);
  unsigned char* sP = smem + kOffP;
  float* sMax = reinterpret_cast<float*>(smem + kOffMax);
  float* sL = reinterpret_cast<float*>(smem + kOffL);
  int32_t* sRing = reinterpret_cast<int32_t*>(smem + kOffRing);
  int32_t* sMisc = reinterpret_cast<int32_t*>(smem + kOffMisc);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = tid >> 7, wl = warp & 3;
  const int64_t t = mla_cta_token(a, 64);
  const int h0 = mla_cta_head0(a, 64);
  const int split = blockIdx.z;

  // ---- prologue: used entries, first two tiles' rows, Q ----
  const MlaSplitKeys keys = mla_split_keys<kThreads>(a, t, split, &sMisc[0]);
  const int nkeys = keys.nkeys;
  const int ntiles = (nkeys + kBN - 1) / kBN;

  auto resolve = [&](int key) -> int32_t { return mla_cache_row(a, keys, t, key); };  // -1 = absent
  if (tid < 64) {
    sRing[tid] = resolve(tid);
    sRing[64 + tid] = resolve(64 + tid);
  }
  mla_load_q<64, kThreads>(a, t, h0, tid, sQ, tile_off);
  __syncthreads();  // ring slots 0, 1 visible

  // Gather of one tile: thread -> row j = tid / 4, chunks (tid % 4) + 4k, k < 18 (one row lookup per thread).
  auto load_tile = [&](int tile) {
    const uint32_t base = sKV + (tile & 1) * kTileBytes;
    const int j = tid >> 2, c0 = tid & 3;
    const int32_t row = sRing[(tile % 3) * 64 + j];
    const __nv_bfloat16* lat = a.latent + static_cast<int64_t>(row < 0 ? 0 : row) * kDl;
    const __nv_bfloat16* rop = a.rope + static_cast<int64_t>(row < 0 ? 0 : row) * kDr;
    const int bytes = row >= 0 ? 16 : 0;
#pragma unroll
    for (int k = 0; k < 18; ++k) {
      const int c = c0 + 4 * k;
      const void* src = c < 64 ? static_cast<const void*>(lat + c * 8) : static_cast<const void*>(rop + (c - 64) * 8);
      cp_async_16(base + tile_off(j, c), src, bytes);
    }
  };
  if (ntiles > 0) load_tile(0);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_smem();
  __syncthreads();  // Q and tile 0 visible to wgmma

  const int r0 = wl * 16 + (lane >> 2), r1 = r0 + 8;  // this thread's two rows (heads) of the 64
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  for (int tile = 0; tile < ntiles; ++tile) {
    const int32_t pre = tid < 64 ? resolve((tile + 2) * kBN + tid) : -1;  // rows of tile + 2 (global loads)
    if (tile + 1 < ntiles) load_tile(tile + 1);  // into the stage tile - 1 used (free after the last barrier)
    cp_async_commit();
    const uint32_t kv = sKV + (tile & 1) * kTileBytes;

    // ---- S_w = Q K_w^T : [64 heads, 32 keys] ----
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    wgmma_fence();
    // descriptors advance by adding the byte offset >> 4 to the start-address field (no carry out of it: < 2^18)
    const uint64_t da0 = wgmma_desc_sw128(sQ, 16, 1024);
    const uint64_t db0 = wgmma_desc_sw128(kv + wg * 32 * 128, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < 36; ++ks) {
      const uint32_t koff = (ks >> 2) * kSlabBytes + (ks & 3) * 32;
      wgmma_m64n32k16<0>(s, da0 + (koff >> 4), db0 + (koff >> 4), ks > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 16; ++i) reg_fence(s[i]);

    // ---- softmax (log2 domain) ----
    const int32_t* ring = sRing + (tile % 3) * 64;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kl = wg * 32 + j * 8 + (lane & 3) * 2 + e;  // tile-local key
        const bool valid = tile * kBN + kl < nkeys && ring[kl] >= 0;
        s[j * 4 + e] = valid ? s[j * 4 + e] * a.scale_log2 : -INFINITY;
        s[j * 4 + 2 + e] = valid ? s[j * 4 + 2 + e] * a.scale_log2 : -INFINITY;
        mx0 = fmaxf(mx0, s[j * 4 + e]);
        mx1 = fmaxf(mx1, s[j * 4 + 2 + e]);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    if ((lane & 3) == 0) {
      sMax[wg * 64 + r0] = mx0;
      sMax[wg * 64 + r1] = mx1;
    }
    __syncthreads();
    const float mn0 = fmaxf(m0, fmaxf(sMax[r0], sMax[64 + r0]));
    const float mn1 = fmaxf(m1, fmaxf(sMax[r1], sMax[64 + r1]));
    const float mu0 = mn0 == -INFINITY ? 0.f : mn0;
    const float mu1 = mn1 == -INFINITY ? 0.f : mn1;
    const float al0 = exp2_ftz(m0 - mu0), al1 = exp2_ftz(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p00 = exp2_ftz(s[j * 4 + 0] - mu0), p01 = exp2_ftz(s[j * 4 + 1] - mu0);
      const float p10 = exp2_ftz(s[j * 4 + 2] - mu1), p11 = exp2_ftz(s[j * 4 + 3] - mu1);
      ps0 += p00 + p01;
      ps1 += p10 + p11;
      const int kl = wg * 32 + j * 8 + (lane & 3) * 2;
      const int chunk = kl >> 3;
      *reinterpret_cast<uint32_t*>(sP + r0 * 128 + ((chunk ^ (r0 & 7)) << 4) + (kl & 7) * 2) = pack_bf16x2(p00, p01);
      *reinterpret_cast<uint32_t*>(sP + r1 * 128 + ((chunk ^ (r1 & 7)) << 4) + (kl & 7) * 2) = pack_bf16x2(p10, p11);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      ps0 += __shfl_xor_sync(0xffffffffu, ps0, off);
      ps1 += __shfl_xor_sync(0xffffffffu, ps1, off);
    }
    l0 = l0 * al0 + ps0;
    l1 = l1 * al1 + ps1;
    if (tid < 64) sRing[((tile + 2) % 3) * 64 + tid] = pre;
    fence_proxy_async_smem();
    __syncthreads();  // P (and the ring slot of tile + 2) complete

    // ---- O_w = alpha O_w + P V_w ----
    mla_scale_o_rows(o, al0, al1);
    wgmma_fence();
    const uint64_t pa0 = wgmma_desc_sw128(sPu, 16, 1024);
    const uint64_t vb0 = wgmma_desc_sw128(kv + (4 * wg) * kSlabBytes, kSlabBytes, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16<1>(o, pa0 + ((kk * 32) >> 4), vb0 + ((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) reg_fence(o[i]);
    cp_async_wait<0>();  // tile + 1 landed
    fence_proxy_async_smem();
    __syncthreads();  // tile + 1 visible to wgmma; this stage and P free for reuse
  }
  cp_async_wait<0>();

  // ---- epilogue ----
  float* smem_part = reinterpret_cast<float*>(smem);  // the cluster merge's partial rows, over Q and the tiles
  static_assert(mla_cluster_merge_bytes(64) <= kOffP, "the cluster merge's rows fit over Q and the tiles");
  store_wgmma64_rows(a, t, h0, split, wg, lane, r0, r1, o, l0, l1, sL, [] { __syncthreads(); }, m0, m1, smem_part);
  mla_cluster_merge<64, kThreads>(a, t, h0, smem_part);
  mla_peer_merge<64, kThreads>(a, t, h0, smem_part);
}

}  // namespace

Status launch_sparse_mla_wgmma64(const MlaArgs& args, int groups, const LaunchContext& ctx) {
  return launch_mla_grid(sparse_mla_wgmma64_kernel, "sparse_mla_wgmma64_kernel", args, groups, kThreads, kSmemBytes, ctx.stream);
}

}  // namespace dsacp::cuda
