// Lightning indexer scores on tensor cores, fused, for Hi = 32 or 64 heads of Di = 128:
//   bf16: s(t, j) = sum_h w[t,h] * relu(q[t,h,:] . k[j,:])                         (mma.sync m16n8k16 bf16)
//   fp8:  s(t, j) = sum_h w[t,h] * relu((q_scale[t,h] * sk[j]) * (q8[t,h,:] . k8[j,:]))  (mma.sync m16n8k32 e4m3)
// FP8 keys are the two-plane pages of dsacp/fp8.h (a page's e4m3 rows, then its f32 scales).
//
// One CTA (8 warps) = one ScoreItem: up to kMaxGroupTokens consecutive tokens of one request against
// kScoreKeys = 256 keys starting at k0. The keys (and, fp8, their scales) are gathered through the block table with
// cp.async into shared memory (two commit groups of 128 keys, so the second half loads while the first is scored)
// and shared by every token of the group; each token's Q [Hi, 128] is staged in shared memory. The e4m3 m16n8k32
// fragments hold the same bytes per thread as the bf16 m16n8k16 ones, so both paths share one swizzled layout and
// the ldmatrix addressing; an fp8 row is 128 bytes (4 k-steps), a bf16 row 256 (8 k-steps).
// Warp w = (head half hw of Hi/32, key slice kw): Q fragments for 32 heads stay in registers while the MMAs compute
// [32 heads x slice] per 128-key half (slices of 32 keys for Hi = 64, 16 keys for Hi = 32); the scale, ReLU, the
// head weight and the sum over the warp's heads happen in registers (fixed order, then an xor-shuffle tree), and
// the head halves are added in shared memory (half 0 + half 1). Every score is one fixed sequence of fp32
// operations: reruns are bit-identical. Only visible keys (j < key_len[t]) are written, into the token's row.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "dsacp/fp8.h"
#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kDi = 128;
constexpr int kHalfKeys = kScoreKeys / 2;

// d += a * b for one m16n8k32 e4m3 tile (f32 accumulate): a = 4 regs of 4 e4m3, b = 2 regs, d = 4 f32.
__device__ __forceinline__ void mma_e4m3_16832(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 4-byte async copy (cp.async.ca): FP8 pages whose size is not a multiple of 16 bytes (page_size % 4 != 0: a page
// is page_size * 132 bytes) leave key rows only 4-byte aligned.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// ReLU as the CPU oracle's std::max(x, 0.f): a NaN product stays NaN (the contract's section 7: non-finite inputs
// propagate, and a NaN score ranks lowest), where fmaxf would turn it into 0.
__device__ __forceinline__ float relu(float x) { return x < 0.f ? 0.f : x; }

template <int kHi, bool kFp8>
struct Cfg {
  static constexpr int kRowBytes = kFp8 ? kDi : kDi * 2;  // bytes of one key / query row
  static constexpr int kKSteps = kRowBytes / 32;          // MMA k-steps over a row (32 bytes each)
  static constexpr int kHH = kHi / 32;                    // head halves (warps along the heads)
  static constexpr int kKW = 8 / kHH;                     // key slices of a 128-key half
  static constexpr int kSlice = kHalfKeys / kKW;          // keys of a warp's slice: 32 or 16
  static constexpr int kNP = kSlice / 16;                 // ldmatrix_x4 key pairs of n-tiles per k-step
  // Shared memory: key byte offsets [256] i64 | key scales [256] f32 | keys [256, row] | Q [nt, Hi, row]
  //                | q scales [nt, Hi] f32 | partials [kHH, nt, 256] f32
  static constexpr int kOffScale = kScoreKeys * 8;
  static constexpr int kOffKeys = kOffScale + kScoreKeys * 4;
  static constexpr int kOffQ = kOffKeys + kScoreKeys * kRowBytes;
  static int64_t smem_bytes(int nt) {
    return kOffQ + int64_t{nt} * kHi * kRowBytes + int64_t{nt} * kHi * 4 + int64_t{kHH} * nt * kScoreKeys * 4;
  }
};

template <int kRowBytes>
__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
}

struct ScoreArgs : ScoreKernelArgs {
  bool rows16;  // key rows 16-byte aligned (else copied 4 bytes at a time)
};

static_assert(sizeof(ScoreArgs) <= 4096, "the score kernel's parameters (the inline plan among them) past 4 KB");

// CTAs an SM, so that enough key bytes are in flight (the decode is bound by them): FP8 Hi = 64 at least 3
// (85 registers), the others 2 (128 registers; the smem allows 2 for bf16).
template <int kHi, bool kFp8>
__global__ void __launch_bounds__(kThreads, kFp8 && kHi == 64 ? 3 : 2)
    indexer_scores_mma_kernel(const __grid_constant__ ScoreArgs a) {
  using C = Cfg<kHi, kFp8>;
  constexpr int kRB = C::kRowBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  const ScoreItem item = plan_item(a.inl, a.items, blockIdx.x);
  const int nt = item.nt;
  int64_t* sKeyOff = reinterpret_cast<int64_t*>(smem);            // [256], -1: no key
  float* sKeyScale = reinterpret_cast<float*>(smem + C::kOffScale);  // [256] (fp8)
  const uint32_t sK = smem_u32(smem + C::kOffKeys);
  const uint32_t sQ = smem_u32(smem + C::kOffQ);
  float* sQScale = reinterpret_cast<float*>(smem + C::kOffQ + nt * kHi * kRB);
  float* sPart = sQScale + nt * kHi;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t b = a.request[item.t0];
  int32_t maxlen = 0;
  for (int i = 0; i < nt; ++i) maxlen = max(maxlen, a.key_len[item.t0 + i]);
  const int kend = min(item.k0 + kScoreKeys, maxlen);

  // Q of the group's tokens [nt, Hi, row] and the first half of the keys: commit group 0; second half: group 1.
  for (int idx = tid; idx < nt * kHi * (kRB / 16); idx += kThreads) {
    const int r = idx / (kRB / 16), c = idx % (kRB / 16);
    cp_async_16(sQ + swz<kRB>(r, c), a.q + (static_cast<int64_t>(item.t0) * kHi + r) * kRB + c * 16, 16);
  }
  if constexpr (kFp8) {
    for (int i = tid; i < nt * kHi; i += kThreads) sQScale[i] = a.q_scale[static_cast<int64_t>(item.t0) * kHi + i];
  }
  // Resolve the item's keys to byte offsets first (all block-table loads in parallel), then issue the copies.
  for (int j = tid; j < kScoreKeys; j += kThreads) {
    const int key = item.k0 + j;
    int64_t off = -1;
    float sk = 0.f;
    if (key < kend) {
      const int32_t pg = key / a.page_size;
      const int32_t page = pg < a.max_pages ? a.block_table[static_cast<int64_t>(b) * a.max_pages + pg] : -1;
      if (page >= 0 && page < a.num_pages) {
        const int32_t in_page = key % a.page_size;
        if constexpr (kFp8) {
          off = fp8_index_value_offset(page, in_page, a.page_size, kDi, a.page_stride);
          sk = *reinterpret_cast<const float*>(
              a.keys + fp8_index_scale_offset(page, in_page, a.page_size, kDi, a.page_stride));
        } else {
          off = static_cast<int64_t>(page) * a.page_stride + static_cast<int64_t>(in_page) * kRB;
        }
      } else {
        report_device_error(a.err, kDevBadPage, item.t0);
      }
    }
    sKeyOff[j] = off;
    if constexpr (kFp8) sKeyScale[j] = sk;
  }
  __syncthreads();
  for (int half = 0; half < 2; ++half) {
#pragma unroll 4
    for (int idx = tid; idx < kHalfKeys * (kRB / 16); idx += kThreads) {
      const int j = half * kHalfKeys + idx / (kRB / 16), c = idx % (kRB / 16);
      const int64_t off = sKeyOff[j];
      const unsigned char* src = off >= 0 ? a.keys + off + c * 16 : a.keys;
      if (!kFp8 || a.rows16) {
        cp_async_16(sK + swz<kRB>(j, c), src, off >= 0 ? 16 : 0);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          cp_async_4(sK + swz<kRB>(j, c) + 4 * i, src + (off >= 0 ? 4 * i : 0), off >= 0 ? 4 : 0);
        }
      }
    }
    cp_async_commit();
  }

  const int hw = warp % C::kHH, kw = warp / C::kHH;
  for (int half = 0; half < 2; ++half) {
    if (half == 0) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (item.k0 + half * kHalfKeys >= kend) continue;  // uniform across the CTA
    for (int lt = 0; lt < nt; ++lt) {
      // Q fragments: heads hw*32 + [0, 32) = two m-tiles
      uint32_t qf[2][C::kKSteps][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int ks = 0; ks < C::kKSteps; ++ks) {
          const int r = lt * kHi + hw * 32 + m * 16 + (lane & 15);
          ldmatrix_x4(sQ + swz<kRB>(r, ks * 2 + (lane >> 4)), qf[m][ks][0], qf[m][ks][1], qf[m][ks][2],
                      qf[m][ks][3]);
        }
      }
      const int h0 = hw * 32 + (lane >> 2);
      const float* wt = a.w + static_cast<int64_t>(item.t0 + lt) * kHi + h0;
      const float w00 = wt[0], w01 = wt[8], w10 = wt[16], w11 = wt[24];
      float qs00 = 1.f, qs01 = 1.f, qs10 = 1.f, qs11 = 1.f;
      if constexpr (kFp8) {
        const float* qs = sQScale + lt * kHi + h0;
        qs00 = qs[0], qs01 = qs[8], qs10 = qs[16], qs11 = qs[24];
      }
      const int key0 = half * kHalfKeys + kw * C::kSlice;  // CTA-local first key of this warp
      float acc[2][2 * C::kNP][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 2 * C::kNP; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < C::kKSteps; ++ks) {
#pragma unroll
        for (int np = 0; np < C::kNP; ++np) {
          uint32_t bf[4];
          const int key = key0 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(sK + swz<kRB>(key, ks * 2 + ((lane >> 3) & 1)), bf[0], bf[1], bf[2], bf[3]);
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            if constexpr (kFp8) {
              mma_e4m3_16832(acc[m][2 * np], qf[m][ks], bf[0], bf[1]);
              mma_e4m3_16832(acc[m][2 * np + 1], qf[m][ks], bf[2], bf[3]);
            } else {
              mma_bf16_16816(acc[m][2 * np], qf[m][ks], bf[0], bf[1]);
              mma_bf16_16816(acc[m][2 * np + 1], qf[m][ks], bf[2], bf[3]);
            }
          }
        }
      }
      // weighted ReLU sum over the warp's 32 heads, per key column
      float col[2 * C::kNP][2];
#pragma unroll
      for (int n = 0; n < 2 * C::kNP; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float s;
          if constexpr (kFp8) {
            const float sk = sKeyScale[key0 + n * 8 + (lane & 3) * 2 + e];
            s = w00 * relu((qs00 * sk) * acc[0][n][e]);
            s += w01 * relu((qs01 * sk) * acc[0][n][2 + e]);
            s += w10 * relu((qs10 * sk) * acc[1][n][e]);
            s += w11 * relu((qs11 * sk) * acc[1][n][2 + e]);
          } else {
            s = w00 * relu(acc[0][n][e]);
            s += w01 * relu(acc[0][n][2 + e]);
            s += w10 * relu(acc[1][n][e]);
            s += w11 * relu(acc[1][n][2 + e]);
          }
          s += __shfl_xor_sync(0xffffffffu, s, 4);
          s += __shfl_xor_sync(0xffffffffu, s, 8);
          s += __shfl_xor_sync(0xffffffffu, s, 16);
          col[n][e] = s;
        }
      }
      if (lane < 4) {
        float* dst = sPart + (hw * nt + lt) * kScoreKeys + key0;
#pragma unroll
        for (int n = 0; n < 2 * C::kNP; ++n) {
          *reinterpret_cast<float2*>(dst + n * 8 + lane * 2) = make_float2(col[n][0], col[n][1]);
        }
      }
    }
  }
  __syncthreads();
  for (int lt = 0; lt < nt; ++lt) {
    const int32_t t = item.t0 + lt;
    const int32_t len = a.key_len[t];
    float* row = a.scores + plan_score_offset(a.inl, a.score_offset, t);
    for (int j = tid; j < kScoreKeys; j += kThreads) {
      const int key = item.k0 + j;
      if (key < len) {
        float s = sPart[lt * kScoreKeys + j];
        if constexpr (C::kHH == 2) s += sPart[(nt + lt) * kScoreKeys + j];
        row[key] = s;
      }
    }
  }
}

template <int kHi, bool kFp8>
Status launch_variant(const ScoreArgs& a, int64_t num_items, int max_group_tokens, const LaunchContext& ctx) {
  const int bytes = static_cast<int>(Cfg<kHi, kFp8>::smem_bytes(max_group_tokens));
  DSACP_CUDA_RETURN_IF_ERROR(ensure_dynamic_smem_limit(indexer_scores_mma_kernel<kHi, kFp8>, bytes));
  indexer_scores_mma_kernel<kHi, kFp8><<<static_cast<unsigned>(num_items), kThreads, bytes, ctx.stream>>>(a);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("indexer_scores_mma_kernel");
  return Status::ok_status();
}

}  // namespace

int64_t indexer_scores_smem_bytes(int Hi, bool fp8, int max_group_tokens) {
  if (Hi == 32) return fp8 ? Cfg<32, true>::smem_bytes(max_group_tokens) : Cfg<32, false>::smem_bytes(max_group_tokens);
  return fp8 ? Cfg<64, true>::smem_bytes(max_group_tokens) : Cfg<64, false>::smem_bytes(max_group_tokens);
}

Status launch_indexer_scores(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                             int max_group_tokens, const int64_t* score_offset, float* scores,
                             const InlinePlan& inl, const LaunchContext& ctx) {
  if (num_items == 0) return Status::ok_status();
  using Kernel = CudaBackendOptions::IndexerScoreKernel;
  const Kernel choice = ctx.options.indexer_score_kernel;
  if (choice != Kernel::kMmaSync && indexer_scores_wgmma_applies(p, max_group_tokens) &&
      (choice == Kernel::kWgmma || choice == Kernel::kWgmmaV5 || choice == Kernel::kWgmmaV6 ||
       indexer_scores_wgmma_preferred(p, max_group_tokens))) {
    return launch_indexer_scores_wgmma(p, items, num_items, max_group_tokens, score_offset, scores, inl, ctx);
  }
  ScoreArgs a{};
  fill_score_kernel_args(a, p, items, num_items, score_offset, scores, inl, ctx);
  const bool fp8 = p.keys.dtype == DType::kF8E4M3;
  a.rows16 = !fp8 || (pool_page_stride(p.keys) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.keys.data) % 16 == 0);
  if (p.Hi == 32) {
    return fp8 ? launch_variant<32, true>(a, num_items, max_group_tokens, ctx)
               : launch_variant<32, false>(a, num_items, max_group_tokens, ctx);
  }
  return fp8 ? launch_variant<64, true>(a, num_items, max_group_tokens, ctx)
             : launch_variant<64, false>(a, num_items, max_group_tokens, ctx);
}

}  // namespace dsacp::cuda
