// FP8 lightning indexer scores on wgmma, persistent and warp-specialized (the fast path of launch_indexer_scores):
//   s(t, j) = sk[j] * sum_h (w[t,h] * q_scale[t,h]) * relu(q8[t,h,:] . k8[j,:])
// which is the contract's sum_h w * relu((q_scale * sk) * dot) for positive scales (a positive factor commutes
// with the ReLU; the contract's scales are positive and finite, and the cache write's are >= 2^-126).
//
// Work: the chunk's score items (a token group of <= 4 tokens of one request x 256 keys) cut into blocks of 64 keys;
// each CTA (one an SM) takes a contiguous run of whole items. A CTA = 3 warpgroups:
//  - warpgroup 0, the producer: resolves the block table a batch of 8 blocks ahead (the loads of batch n + 1 are in
//    flight while batch n's copies are issued) and gathers each block's 64 e4m3 key rows (16-byte cp.async, 8 lanes
//    a row: whole 128-byte lines a request) and their 64 scales into a ring of stages; a stage's full barrier
//    completes when its copies have landed (cp.async.mbarrier.arrive) and its block record (tokens, keys) is written.
//  - warpgroups 1 and 2, the math: they take the ring's blocks in turn (one multiplies while the other converts or
//    runs its epilogue). Each converts its stage's e4m3 rows to f16 (exact) into its own 128-byte-swizzled tile,
//    releases the stage, and computes D[64 keys, N] = K [64, 128] x Q^T with N = Hi x the group's tokens (wgmma
//    m64nNk16 f16, f32 accumulate: the e4m3 wgmma keeps too few bits in its sums, wgmma_f16_sm90.cuh): each key is
//    read once for every token of its group. The sum over heads is within the thread (its columns, ascending) then
//    over its quad (xor 1, 2): a fixed fp32 order, so reruns are bit-identical. Each warpgroup keeps its own f16
//    copy of the group's Q and of w * q_scale, reloaded when its next block belongs to another group.
// Only visible keys (j < key_len[t]) are written, into token t's row at score_offset[t]: the same output as the
// mma.sync kernel (indexer_scores_mma.cu), which serves the layouts this one does not (bf16, page sizes that are
// not multiples of 4: key rows then are not 16-byte aligned).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "dsacp/fp8.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mbarrier_sm90.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/common/wgmma_sm90.cuh"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"
#include "kernels/cuda/indexer_topk/wgmma_f16_sm90.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kDi = 128;           // bytes of an e4m3 row
constexpr int kBK = 64;            // keys a block (one wgmma M tile)
constexpr int kSub = kScoreKeys / kBK;  // blocks of a score item
constexpr int kThreads = 384;      // producer warpgroup + 2 math warpgroups
constexpr int kBatch = 8;          // blocks the producer resolves at once
constexpr int kStageBytes = kBK * kDi;
constexpr int kMaxStages = 16;

struct WgArgs {
  const ScoreItem* items;
  int64_t num_items;
  const int32_t* request;
  const int32_t* key_len;
  const unsigned char* q;  // [T, Hi, 128] e4m3
  const float* q_scale;    // [T, Hi]
  const float* w;          // [T, Hi]
  const unsigned char* keys;  // FP8 two-plane pages
  const int32_t* block_table;
  int32_t page_size, max_pages;
  int64_t num_pages;
  const int64_t* score_offset;
  float* scores;
  DeviceErrorWord err;
  int32_t stages;
  InlinePlan inl;
};
static_assert(kBatch % kSub == 0, "a producer batch is whole items");
static_assert(sizeof(WgArgs) <= 4096, "the wgmma score kernel's parameters past 4 KB");

// Shared memory: stages [S][64 x 128 B e4m3] | f16 key tiles [2 warpgroups][2 slabs][64 x 128 B] | f16 Q [2][2
// slabs][N x 128 B] | key scales [S][64] f32 | w*q_scale [2][N] f32 | block records [S] int4 | barriers full [S],
// empty [S]; the base rounded up to 1024 B (swizzle atoms).
constexpr int kTileSlab = kBK * 128;  // bytes of one 64-column f16 slab of a key tile
template <int kN>
struct Layout {
  int stages;
  __host__ __device__ int tile_off() const { return stages * kStageBytes; }
  __host__ __device__ int q_off() const { return tile_off() + 2 * 2 * kTileSlab; }
  __host__ __device__ int scale_off() const { return q_off() + 2 * 2 * kN * 128; }
  __host__ __device__ int wq_off() const { return scale_off() + stages * kBK * 4; }
  __host__ __device__ int info_off() const { return wq_off() + 2 * kN * 4; }
  __host__ __device__ int bar_off() const { return info_off() + stages * 16; }
  __host__ __device__ int bytes() const { return bar_off() + 2 * stages * 8 + 1024; }
};

__device__ __forceinline__ uint32_t sw128(int r, int c) {
  return static_cast<uint32_t>(r * 128 + ((c ^ (r & 7)) << 4));
}
// 16 e4m3 (one 16-byte chunk) -> 16 f16 (two 16-byte chunks), exact.
__device__ __forceinline__ void e4m3x16_to_f16(const uint4& v, uint4& lo, uint4& hi) {
  const uint32_t in[4] = {v.x, v.y, v.z, v.w};
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(in[i] & 0xffffu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(in[i] >> 16), __NV_E4M3);
    out[2 * i] = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
    out[2 * i + 1] = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// ReLU as the CPU oracle's: a NaN stays NaN (contract section 7).
__device__ __forceinline__ float relu(float x) { return x < 0.f ? 0.f : x; }

// One batch of the producer: kBatch consecutive flattened blocks (kBatch / kSub whole items), each resolved to its
// keys and the pages of the 4 key rows this thread copies.
struct Batch {
  int32_t t0[kBatch / kSub], nt[kBatch / kSub];
  int32_t kb[kBatch], kend[kBatch];  // kb < 0: no block
  int32_t page[kBatch][4];
};

struct SegCache {
  int32_t t0 = -1, b = 0, maxlen = 0;
};

__device__ __forceinline__ void load_segment(const WgArgs& a, int32_t t0, int32_t nt, SegCache& sc) {
  sc.t0 = t0;
  sc.b = a.request[t0];
  int32_t m = 0;
  for (int i = 0; i < nt; ++i) m = max(m, a.key_len[t0 + i]);
  sc.maxlen = m;
}

__device__ __forceinline__ int32_t page_of(const WgArgs& a, int32_t b, int32_t key) {
  const int32_t pg = key / a.page_size;
  return pg < a.max_pages ? __ldg(a.block_table + static_cast<int64_t>(b) * a.max_pages + pg) : -1;
}

// Resolve blocks [fa, fa + kBatch) of [.., f1) (fa a multiple of kSub): thread pt copies 16-byte chunk pt & 7 of
// rows 16 r + pt / 8 (r < 4), so a warp instruction reads 4 whole 128-byte rows; lane 0 of warp w also copies the
// scales of rows 16 r + 4 w .. + 3 (one page: page sizes are multiples of 4).
__device__ __forceinline__ void resolve(const WgArgs& a, int64_t fa, int64_t f1, int pt, SegCache& sc, Batch& bt) {
  constexpr int kItems = kBatch / kSub;
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t item = fa / kSub + k;
    const ScoreItem x = (item * kSub < f1) ? plan_item(a.inl, a.items, item) : ScoreItem{-1, 0, 0, 0};
    bt.t0[k] = x.t0;
    bt.nt[k] = x.nt;
    if (x.t0 >= 0 && x.t0 != sc.t0) load_segment(a, x.t0, x.nt, sc);
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      const int kk = k * kSub + j;
      bt.kb[kk] = -1;
      bt.kend[kk] = 0;
      const int32_t kb = x.k0 + j * kBK;
      const int32_t kend = min(kb + kBK, sc.maxlen);
      if (x.t0 >= 0 && kb < kend) {
        bt.kb[kk] = kb;
        bt.kend[kk] = kend;
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int32_t key = kb + 16 * r + (pt >> 3);
        bt.page[kk][r] = (bt.kb[kk] >= 0 && key < kend) ? page_of(a, sc.b, key) : -1;
      }
    }
  }
}

template <int kHi, int kNT>
__global__ void __launch_bounds__(kThreads, 1) indexer_scores_wgmma_kernel(const __grid_constant__ WgArgs a) {
  constexpr int kN = kHi * kNT;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const Layout<kN> L{a.stages};
  const int S = a.stages;
  const uint32_t sStage = base;
  float* sScale = reinterpret_cast<float*>(smem + L.scale_off());
  int4* sInfo = reinterpret_cast<int4*>(smem + L.info_off());
  const uint32_t bars = base + L.bar_off();
  auto full_bar = [&](int s) { return bars + 8 * s; };
  auto empty_bar = [&](int s) { return bars + 8 * (S + s); };

  const int tid = threadIdx.x, wg = tid >> 7;
  if (tid < 2 * S) mbar_init(bars + 8 * tid, tid < S ? 129 : 128);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();

  // this CTA's flattened blocks [f0, f1): whole items, split evenly
  const int64_t f0 = a.num_items * blockIdx.x / gridDim.x * kSub, f1 = a.num_items * (blockIdx.x + 1) / gridDim.x * kSub;

  if (wg == 0) {
    // ==== producer ====
    const int pt = tid;
    SegCache sc;
    Batch cur, nxt;
    int ring = 0;
    auto issue = [&](const Batch& bt) {
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (bt.kb[k] < 0) continue;  // (uniform)
        const int slot = ring % S, u = ring / S;
        if (u > 0) mbar_wait(empty_bar(slot), (u - 1) & 1);
        const uint32_t st = sStage + slot * kStageBytes;
        const int32_t kend = bt.kend[k];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int row = 16 * r + (pt >> 3), ch = pt & 7;
          const int32_t pg = bt.page[k][r], key = bt.kb[k] + row;
          const bool ok = pg >= 0 && pg < a.num_pages;
          if (!ok && key < kend) report_device_error(a.err, kDevBadPage, bt.t0[k / kSub]);
          const int32_t in_page = key % a.page_size;
          const unsigned char* src =
              ok ? a.keys + fp8_index_value_offset(pg, in_page, a.page_size, kDi) + ch * 16 : a.keys;
          cp_async_16(st + sw128(row, ch), src, ok ? 16 : 0);
          if ((pt & 31) == 0) {  // scales of rows row .. row + 3
            const unsigned char* ssrc =
                ok ? a.keys + fp8_index_scale_offset(pg, in_page, a.page_size, kDi) : a.keys;
            const uint32_t dst = smem_u32(sScale + slot * kBK + row);
            if (ok && key + 3 < kend) {
              cp_async_16(dst, ssrc, 16);
            } else {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const bool v = ok && key + e < kend;
                cp_async_4(dst + 4 * e, ssrc + (v ? 4 * e : 0), v ? 4 : 0);
              }
            }
          }
        }
        if (pt == 0) sInfo[slot] = make_int4(bt.t0[k / kSub], bt.nt[k / kSub], bt.kb[k], bt.kend[k]);
        cp_async_mbar_arrive_noinc(full_bar(slot));
        if (pt == 0) mbar_arrive(full_bar(slot));
        ++ring;
      }
    };
    resolve(a, f0, f1, pt, sc, cur);
    for (int64_t fa = f0; fa < f1; fa += kBatch) {
      if (fa + kBatch < f1) resolve(a, fa + kBatch, f1, pt, sc, nxt);
      issue(cur);
      cur = nxt;
    }
    // end markers, one for each math warpgroup
    for (int e = 0; e < 2; ++e, ++ring) {
      const int slot = ring % S, u = ring / S;
      if (u > 0) mbar_wait(empty_bar(slot), (u - 1) & 1);
      if (pt == 0) sInfo[slot] = make_int4(-1, 0, -1, 0);
      cp_async_mbar_arrive_noinc(full_bar(slot));
      if (pt == 0) mbar_arrive(full_bar(slot));
    }
    cp_async_wait<0>();
    return;
  }

  // ==== math warpgroups ====
  const int c = wg - 1, wt = tid & 127, wl = wt >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const uint32_t sTile = base + L.tile_off() + c * 2 * kTileSlab;  // f16 keys [2 slabs][64 x 128 B]
  const uint32_t sQ = base + L.q_off() + c * 2 * kN * 128;          // f16 Q [2 slabs][N x 128 B]
  float* sWq = reinterpret_cast<float*>(smem + L.wq_off()) + c * kN;
  const int bar = 1 + c;  // the warpgroup's named barrier
  int32_t cur_t0 = -1, cur_nt = 0;
  int32_t my_len = 0;       // key_len of token t0 + tq (tq < nt), else 0
  float* my_row = nullptr;  // its score row
  float acc[kN / 2];
  for (int ring = c;; ring += 2) {
    const int slot = ring % S, u = ring / S;
    mbar_wait(full_bar(slot), u & 1);
    const int4 info = sInfo[slot];
    if (info.z < 0) break;
    const int32_t t0 = info.x, nt = info.y, kb = info.z;
    // The warpgroup's previous wgmma is done (waited) and its epilogue read sWq: the tile, Q and sWq are free.
    named_bar_sync(bar, 128);
    if (t0 != cur_t0) {
      // the group's Q (rows tok * Hi + h) as f16, and w * q_scale
      for (int idx = wt; idx < nt * kHi * 8; idx += 128) {
        const int r = idx >> 3, ch = idx & 7;
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(a.q + (static_cast<int64_t>(t0) * kHi + r) * kDi) + ch);
        uint4 lo, hi;
        e4m3x16_to_f16(v, lo, hi);
        const uint32_t q0 = sQ + sw128_chunk_off(r, 2 * ch, kN * 128), q1 = sQ + sw128_chunk_off(r, 2 * ch + 1, kN * 128);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q0), "r"(lo.x), "r"(lo.y), "r"(lo.z), "r"(lo.w));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(q1), "r"(hi.x), "r"(hi.y), "r"(hi.z), "r"(hi.w));
      }
      for (int col = wt; col < kN; col += 128) {
        const int64_t at = static_cast<int64_t>(t0) * kHi + col;
        sWq[col] = col < nt * kHi ? a.w[at] * a.q_scale[at] : 0.f;
      }
      my_len = tq < nt ? a.key_len[t0 + tq] : 0;
      my_row = a.scores + (tq < nt ? plan_score_offset(a.inl, a.score_offset, t0 + tq) : 0);
      cur_t0 = t0;
      cur_nt = nt;
    }
    // the stage's e4m3 rows -> the f16 tile (thread: chunks wt + 128 i, 8 threads a row)
    const uint32_t st = sStage + slot * kStageBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = wt + 128 * i, r = idx >> 3, ch = idx & 7;
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(st + sw128(r, ch)));
      uint4 lo, hi;
      e4m3x16_to_f16(v, lo, hi);
      const uint32_t k0 = sTile + sw128_chunk_off(r, 2 * ch, kTileSlab), k1 = sTile + sw128_chunk_off(r, 2 * ch + 1, kTileSlab);
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(k0), "r"(lo.x), "r"(lo.y), "r"(lo.z), "r"(lo.w));
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(k1), "r"(hi.x), "r"(hi.y), "r"(hi.z), "r"(hi.w));
    }
    const int row0 = wl * 16 + g;
    const float sk0 = sScale[slot * kBK + row0], sk1 = sScale[slot * kBK + row0 + 8];
    mbar_arrive(empty_bar(slot));  // the stage is read (converted, scales in registers)
    fence_proxy_async_smem();      // the tile's (and Q's) generic writes -> the async proxy (wgmma)
    named_bar_sync(bar, 128);
    // D = K [64 keys, 128] x Q^T [128, N]: 8 k-steps of 16 columns (slab ks / 4, 32 bytes each within it)
    wgmma_fence();
    const uint64_t da = wgmma_desc_sw128(sTile, 16, 1024);
    const uint64_t db = wgmma_desc_sw128(sQ, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t ka = (ks >> 2) * kTileSlab + (ks & 3) * 32, kq = (ks >> 2) * kN * 128 + (ks & 3) * 32;
      wgmma_m64k16_f16<kN>(acc, da + (ka >> 4), db + (kq >> 4), ks > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) reg_fence(acc[i]);

    float mine0 = 0.f, mine1 = 0.f;  // token tq's scores of rows row0, row0 + 8
#pragma unroll
    for (int tok = 0; tok < kNT; ++tok) {
      if (tok < cur_nt) {
        float s0 = 0.f, s1 = 0.f;
#pragma unroll
        for (int ii = 0; ii < kHi / 8; ++ii) {
          const int i = tok * (kHi / 8) + ii;
          const float2 wv = *reinterpret_cast<const float2*>(sWq + 8 * i + 2 * tq);
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
    if (tq < cur_nt) {
      const int32_t k0 = kb + row0, k1 = k0 + 8;
      if (k0 < my_len) my_row[k0] = mine0;
      if (k1 < my_len) my_row[k1] = mine1;
    }
  }
}

template <int kHi, int kNT>
Status launch_wg(WgArgs& a, const LaunchContext& ctx) {
  constexpr int kN = kHi * kNT;
  int device = 0, optin = 0;
  DSACP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  DSACP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  Layout<kN> L{kMaxStages};
  while (L.stages > 2 && L.bytes() > optin) --L.stages;
  a.stages = L.stages;
  const int bytes = L.bytes();
  DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(indexer_scores_wgmma_kernel<kHi, kNT>, bytes));
  const int grid = static_cast<int>(std::min<int64_t>(std::max(ctx.num_sms, 1), a.num_items));
  indexer_scores_wgmma_kernel<kHi, kNT><<<grid, kThreads, bytes, ctx.stream>>>(a);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("indexer_scores_wgmma_kernel");
  return Status::ok_status();
}

}  // namespace

bool indexer_scores_wgmma_applies(const IndexerTopkParams& p, int max_group_tokens) {
  return p.keys.dtype == DType::kF8E4M3 && p.q_dtype == DType::kF8E4M3 && (p.Hi == 32 || p.Hi == 64) &&
         p.Di == kDi && p.keys.page_size % 4 == 0 && reinterpret_cast<uintptr_t>(p.keys.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && max_group_tokens >= 1 && max_group_tokens <= kMaxGroupTokens;
}

Status launch_indexer_scores_wgmma(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                                   int max_group_tokens, const int64_t* score_offset, float* scores,
                                   const InlinePlan& inl, const LaunchContext& ctx) {
  if (num_items == 0) return Status::ok_status();
  WgArgs a{};
  if (inl.num_groups > 0) a.inl = inl;
  a.items = items;
  a.num_items = num_items;
  a.request = p.rows.request;
  a.key_len = p.rows.key_len;
  a.q = static_cast<const unsigned char*>(p.q);
  a.q_scale = p.q_scale;
  a.w = p.w;
  a.keys = static_cast<const unsigned char*>(p.keys.data);
  a.block_table = p.block_table.data;
  a.page_size = p.keys.page_size;
  a.max_pages = p.block_table.max_pages;
  a.num_pages = p.keys.num_pages;
  a.score_offset = score_offset;
  a.scores = scores;
  a.err = ctx.error;
  const int nt = max_group_tokens <= 1 ? 1 : max_group_tokens <= 2 ? 2 : 4;
  if (p.Hi == 32) {
    return nt == 1 ? launch_wg<32, 1>(a, ctx) : nt == 2 ? launch_wg<32, 2>(a, ctx) : launch_wg<32, 4>(a, ctx);
  }
  return nt == 1 ? launch_wg<64, 1>(a, ctx) : nt == 2 ? launch_wg<64, 2>(a, ctx) : launch_wg<64, 4>(a, ctx);
}

}  // namespace dsacp::cuda
