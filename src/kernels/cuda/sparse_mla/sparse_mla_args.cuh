// Arguments shared by the sparse MLA kernels (mma.sync for any head group, wgmma for 64-head groups).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

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
  int64_t num_pages;
  float scale_log2;             // scale * log2(e)
  bool out_bf16;
  DeviceErrorWord err;
};

// The Hopper warpgroup-MMA kernel for 64-head groups (H = 64, 128): one CTA per (token, head group, split).
Status launch_sparse_mla_wgmma64(const MlaArgs& args, int groups, const LaunchContext& ctx);

}  // namespace dsacp::cuda
