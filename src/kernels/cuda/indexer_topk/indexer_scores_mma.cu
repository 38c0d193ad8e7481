// Lightning indexer scores on tensor cores, fused: s(t, j) = sum_h w[t,h] * relu(q[t,h,:] . k[j,:]).
//
// One CTA (8 warps) = one ScoreItem: up to kMaxGroupTokens consecutive tokens of one request against
// kScoreKeys = 256 keys starting at k0. The keys are gathered through the block table with cp.async into
// shared memory (two commit groups of 128 keys, so the second half loads while the first is scored) and
// shared by every token of the group; each token's Q [64, 128] is staged in shared memory.
// Warp w = (head half hw, key slice kw of 4): Q fragments for 32 heads stay in registers while mma.sync
// m16n8k16 computes [32 heads x 32 keys] per 128-key half; ReLU, the head weight and the sum over the warp's heads
// happen in registers (fixed order, then an xor-shuffle tree), and the two head halves are added in shared
// memory (half 0 + half 1). Every score is one fixed sequence of fp32 operations: reruns are bit-identical.
// Only visible keys (j < key_len[t]) are written, into the token's row of the chunk's score buffer.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common/smem_attribute.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/mma_sm80.cuh"
#include "kernels/cuda/indexer_topk/indexer_kernels.h"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps: 2 head halves x 4 key slices of 32
constexpr int kHi = 64, kDi = 128;
constexpr int kRowBytes = kDi * 2;  // 256
constexpr int kHalfKeys = kScoreKeys / 2;

__device__ __forceinline__ uint32_t swz(int r, int c) {
  return static_cast<uint32_t>(r * kRowBytes + ((c ^ (r & 7)) << 4));
}

// Shared memory: row table [256] i32 | keys [256, 128] bf16 | Q [nt, 64, 128] bf16 | partials [2, nt, 256] f32
constexpr int kOffKeys = kScoreKeys * 4;

struct ScoreArgs {
  const ScoreItem* items;
  const int32_t* request;   // [T]
  const int32_t* key_len;   // [T]
  const __nv_bfloat16* q;   // [T, 64, 128]
  const float* w;           // [T, 64]
  const __nv_bfloat16* keys;  // [num_pages * page_size, 128]
  const int32_t* block_table;
  int32_t page_size, max_pages;
  int64_t num_pages;
  const int64_t* score_offset;  // [T]
  float* scores;
  DeviceErrorWord err;
  InlinePlan inl;  // the plan itself (inl.num_groups > 0: items and score_offset unused)
};

static_assert(sizeof(ScoreArgs) <= 4096, "the score kernel's parameters (the inline plan among them) past 4 KB");

__global__ void __launch_bounds__(kThreads) indexer_scores_mma_kernel(const __grid_constant__ ScoreArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const ScoreItem item = plan_item(a.inl, a.items, blockIdx.x);
  const int nt = item.nt;
  int32_t* sRowIdx = reinterpret_cast<int32_t*>(smem);  // [256]
  const uint32_t sK = smem_u32(smem + kOffKeys);
  const uint32_t sQ = sK + kScoreKeys * kRowBytes;
  float* sPart = reinterpret_cast<float*>(smem + kOffKeys + kScoreKeys * kRowBytes + nt * kHi * kRowBytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t b = a.request[item.t0];
  int32_t maxlen = 0;
  for (int i = 0; i < nt; ++i) maxlen = max(maxlen, a.key_len[item.t0 + i]);
  const int kend = min(item.k0 + kScoreKeys, maxlen);

  // Q of the group's tokens [nt, 64, 128] and the first half of the keys: commit group 0; second half: group 1.
  for (int idx = tid; idx < nt * kHi * 16; idx += kThreads) {
    const int r = idx >> 4, c = idx & 15;
    cp_async_16(sQ + swz(r, c), a.q + (static_cast<int64_t>(item.t0) * kHi + r) * kDi + c * 8, 16);
  }
  // Resolve the item's keys to cache rows first (all block-table loads in parallel), then issue the copies.
  for (int j = tid; j < kScoreKeys; j += kThreads) {
    const int key = item.k0 + j;
    int32_t row = -1;
    if (key < kend) {
      const int32_t pg = key / a.page_size;
      const int32_t page = pg < a.max_pages ? a.block_table[static_cast<int64_t>(b) * a.max_pages + pg] : -1;
      if (page >= 0 && page < a.num_pages) {
        row = page * a.page_size + key % a.page_size;
      } else {
        report_device_error(a.err, kDevBadPage, item.t0);
      }
    }
    sRowIdx[j] = row;
  }
  __syncthreads();
  for (int half = 0; half < 2; ++half) {
#pragma unroll 4
    for (int idx = tid; idx < kHalfKeys * 16; idx += kThreads) {
      const int j = half * kHalfKeys + (idx >> 4), c = idx & 15;
      const int32_t row = sRowIdx[j];
      const void* src = row >= 0 ? static_cast<const void*>(a.keys + static_cast<int64_t>(row) * kDi + c * 8)
                                 : static_cast<const void*>(a.keys);
      cp_async_16(sK + swz(j, c), src, row >= 0 ? 16 : 0);
    }
    cp_async_commit();
  }

  const int hw = warp & 1, kw = warp >> 1;
  for (int half = 0; half < 2; ++half) {
    if (half == 0) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (item.k0 + half * kHalfKeys >= kend) continue;  // uniform across the CTA
    for (int lt = 0; lt < nt; ++lt) {
      // Q fragments: heads hw*32 + [0, 32) = two m-tiles, 8 k-steps
      uint32_t qf[2][8][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          const int r = lt * kHi + hw * 32 + m * 16 + (lane & 15);
          ldmatrix_x4(sQ + swz(r, ks * 2 + (lane >> 4)), qf[m][ks][0], qf[m][ks][1], qf[m][ks][2], qf[m][ks][3]);
        }
      }
      const float* wt = a.w + static_cast<int64_t>(item.t0 + lt) * kHi + hw * 32 + (lane >> 2);
      const float w00 = wt[0], w01 = wt[8], w10 = wt[16], w11 = wt[24];
#pragma unroll 1
      for (int sub = 0; sub < kHalfKeys / 128; ++sub) {
        const int key0 = half * kHalfKeys + sub * 128 + kw * 32;  // CTA-local first key of this warp
        float acc[2][4][4];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int n = 0; n < 4; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            uint32_t bf[4];
            const int key = key0 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
            ldmatrix_x4(sK + swz(key, ks * 2 + ((lane >> 3) & 1)), bf[0], bf[1], bf[2], bf[3]);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              mma_bf16_16816(acc[m][2 * np], qf[m][ks], bf[0], bf[1]);
              mma_bf16_16816(acc[m][2 * np + 1], qf[m][ks], bf[2], bf[3]);
            }
          }
        }
        // weighted ReLU sum over the warp's 32 heads, per key column
        float col[4][2];
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float s = w00 * fmaxf(acc[0][n][e], 0.f);
            s += w01 * fmaxf(acc[0][n][2 + e], 0.f);
            s += w10 * fmaxf(acc[1][n][e], 0.f);
            s += w11 * fmaxf(acc[1][n][2 + e], 0.f);
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            s += __shfl_xor_sync(0xffffffffu, s, 8);
            s += __shfl_xor_sync(0xffffffffu, s, 16);
            col[n][e] = s;
          }
        }
        if (lane < 4) {
          float* dst = sPart + (hw * nt + lt) * kScoreKeys + key0;
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            *reinterpret_cast<float2*>(dst + n * 8 + lane * 2) = make_float2(col[n][0], col[n][1]);
          }
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
      if (key < len) row[key] = sPart[lt * kScoreKeys + j] + sPart[(nt + lt) * kScoreKeys + j];
    }
  }
}

}  // namespace

int64_t indexer_scores_smem_bytes(int max_group_tokens) {
  return kOffKeys + int64_t{kScoreKeys} * kRowBytes + int64_t{max_group_tokens} * kHi * kRowBytes +
         int64_t{2} * max_group_tokens * kScoreKeys * 4;
}


Status launch_indexer_scores(const IndexerTopkParams& p, const ScoreItem* items, int64_t num_items,
                             int max_group_tokens, const int64_t* score_offset, float* scores,
                             const InlinePlan& inl, const LaunchContext& ctx) {
  if (num_items == 0) return Status::ok_status();
  ScoreArgs a{};  // (a.inl zeroed: the device plan)
  if (inl.num_groups > 0) a.inl = inl;
  a.items = items;
  a.request = p.rows.request;
  a.key_len = p.rows.key_len;
  a.q = static_cast<const __nv_bfloat16*>(p.q);
  a.w = p.w;
  a.keys = static_cast<const __nv_bfloat16*>(p.keys.data);
  a.block_table = p.block_table.data;
  a.page_size = p.keys.page_size;
  a.max_pages = p.block_table.max_pages;
  a.num_pages = p.keys.num_pages;
  a.score_offset = score_offset;
  a.scores = scores;
  a.err = ctx.error;
  const int bytes = static_cast<int>(indexer_scores_smem_bytes(max_group_tokens));
  DSACP_CUDA_RETURN_IF_ERROR(
      ensure_dynamic_smem_limit(indexer_scores_mma_kernel, bytes));
  indexer_scores_mma_kernel<<<static_cast<unsigned>(num_items), kThreads, bytes, ctx.stream>>>(a);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("indexer_scores_mma_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
