// Arguments shared by the sparse MLA kernels (mma.sync for any head group, wgmma for 64-head groups).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/common/device_error.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {

struct MlaArgs {
  const int32_t* request;   // [T]
  const int32_t* key_len;   // [T]
  const __nv_bfloat16* q_nope;  // [T, H, 512]
  const __nv_bfloat16* q_rope;  // [T, H, 64]
  const __nv_bfloat16* latent;  // [num_pages * page_size, 512]
  const __nv_bfloat16* rope;    // [num_pages * page_size, 64]
  const int32_t* block_table;   // [num_requests, max_pages]
  const int32_t* topk;          // [T, K]
  void* out;                    // [T, H, 512] f32 or bf16 (splits == 1)
  float* lse;                   // [T, H]
  float* part_out;              // [S, T, H, 512] (splits > 1)
  float* part_lse;              // [S, T, H]
  int64_t T;
  int32_t H, K, page_size, max_pages, num_requests, splits, split_len;
  int32_t block_heads;          // heads per block of the q / out / lse layout (H: the plain [T, H] layout)
  int64_t num_pages;
  float scale_log2;             // scale * log2(e)
  bool out_bf16;
  DeviceErrorWord err;
};

// The row of (token t, head h) in the caller's q / out / lse layout (SparseMlaParams::head_blocks blocks of
// [T, block_heads]); the split-K workspace keeps the plain t * H + h.
__device__ __forceinline__ int64_t mla_head_row(const MlaArgs& a, int64_t t, int h) {
  return (static_cast<int64_t>(h / a.block_heads) * a.T + t) * a.block_heads + h % a.block_heads;
}

// The Hopper warpgroup-MMA kernels for 64-head groups (H = 64, 128): one CTA per (token, head group, split).
// wgmma64: two warpgroups that gather and compute in turn (decode); wgmma_ws: warp-specialized, a producer
// warpgroup and a pair of 64-key tiles per step (prefill). sparse_mla_kernel_choice picks.
Status launch_sparse_mla_wgmma64(const MlaArgs& args, int groups, const LaunchContext& ctx);
Status launch_sparse_mla_wgmma_ws(const MlaArgs& args, int groups, const LaunchContext& ctx);

// The prologue both sparse MLA kernels share, for token t and key split `split`: checks the token's request
// row and key length (a bad one is reported through a.err and the token uses no key), finds how many leading
// top-k entries are used (the first entry outside [0, key_len) ends the list) and returns this split's
// entries. Every thread of the block must call it; smem_word is one int32 of shared memory.
struct MlaSplitKeys {
  int32_t request;         // the token's block-table row
  const int32_t* entries;  // this split's first used top-k entry
  int nkeys;               // used entries in this split
};

template <int kThreads>
__device__ __forceinline__ MlaSplitKeys mla_split_keys(const MlaArgs& a, int64_t t, int split, int32_t* smem_word) {
  const int tid = threadIdx.x;
  const int32_t b = a.request[t];
  const int32_t len = a.key_len[t];
  const bool row_ok = b >= 0 && b < a.num_requests && len >= 0;
  if (tid == 0) {
    *smem_word = a.K;
    if (!row_ok) report_device_error(a.err, b < 0 || b >= a.num_requests ? kDevBadRequest : kDevBadKeyLen, t);
  }
  __syncthreads();
  const int32_t* trow = a.topk + t * a.K;
  if (row_ok) {
    for (int i = tid; i < a.K; i += kThreads) {
      const int32_t e = trow[i];
      if (e < 0 || e >= len) atomicMin(smem_word, i);
    }
  }
  __syncthreads();
  const int n_used = row_ok ? *smem_word : 0;
  // The used entries are split evenly (in whole 64-key tiles) between the splits, so a row with fewer used
  // entries than K (a short context, or a CP rank's remapped top-k: its own keys first, then -1) still gives
  // every split work. Both chunk and split_len times splits cover n_used <= K.
  const int chunk = a.splits == 1 ? a.split_len : min(a.split_len, ((n_used + a.splits - 1) / a.splits + 63) / 64 * 64);
  const int kb = split * chunk;
  const int ke = min(n_used, kb + chunk);
  return MlaSplitKeys{b, trow + min(kb, a.K), max(0, ke - kb)};
}

}  // namespace dsacp::cuda
