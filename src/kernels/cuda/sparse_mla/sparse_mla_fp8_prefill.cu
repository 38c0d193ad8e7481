// Prefill over an fp8_ds_mla cache through the bf16 kernels (FlashMLA's way for its sparse prefill): the records
// the block table reaches are dequantized once into a bf16 latent / rope pair laid out by (request, logical page)
// (scratch page b * max_pages + c), with a block table of its own, and the bf16 prefill kernel (the 64-key-tile
// wgmma kernel for 64-head groups) runs on that. Each value is scale * value in f32 rounded to bf16 once
// (mla_dequant8: the bytes the mma.sync FP8 path puts in its shared-memory tiles). A prefill's tokens share a
// request's keys many times over, so one pass over the pages (656 B read, 1152 B written a key) costs little
// against the attention; a decode (a few tokens a request) reads each chosen key about once and runs the
// mma.sync kernel over the records directly instead.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/sparse_mla/sparse_mla_args.cuh"

namespace dsacp::cuda {
namespace {

constexpr int kDl = 512, kDr = 64;
constexpr int64_t kMaxScratchBytes = int64_t{8} << 30;

int64_t scratch_rows(const SparseMlaParams& p) {
  return static_cast<int64_t>(p.block_table.num_requests) * p.block_table.max_pages * p.latent.page_size;
}
int64_t bt_offset_bytes(const SparseMlaParams& p) { return (scratch_rows(p) * (kDl + kDr) * 2 + 255) / 256 * 256; }

// One warp a scratch row (request b, logical page c, offset o): lane l dequantizes e4m3 values 16l..16l+15 (tile
// l / 8), lanes 0..7 copy the rope's 16-byte chunks. Lane 0 of a page's first row writes the scratch block table:
// b * max_pages + c, the page's own -1 where the request has no page there, and an id past the scratch for a page
// outside the cache (the attention then reports it as it would over the records).
__global__ void fp8_records_to_bf16_kernel(const unsigned char* __restrict__ records, int32_t record_bytes,
                                           int64_t page_stride,
                                           const int32_t* __restrict__ bt, int32_t max_pages, int32_t page_size,
                                           int64_t num_pages, int64_t rows, __nv_bfloat16* __restrict__ latent,
                                           __nv_bfloat16* __restrict__ rope, int32_t* __restrict__ bt_out) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int64_t bc = r / page_size;  // b * max_pages + c
  const int32_t o = static_cast<int32_t>(r % page_size);
  const int32_t page = bt[bc];
  const bool ok = page >= 0 && page < num_pages;
  if (o == 0 && lane == 0) {
    bt_out[bc] = page < 0 ? page : ok ? static_cast<int32_t>(bc) : static_cast<int32_t>(rows / page_size);
  }
  if (!ok) return;
  const unsigned char* rec = records + static_cast<int64_t>(page) * page_stride + static_cast<int64_t>(o) * record_bytes;
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(rec) + lane);
  const float scale = __ldg(reinterpret_cast<const float*>(rec + kDl) + lane / 8);
  uint4* dst = reinterpret_cast<uint4*>(latent + r * kDl) + 2 * lane;
  dst[0] = mla_dequant8(v.x, v.y, scale);
  dst[1] = mla_dequant8(v.z, v.w, scale);
  if (lane < 8) {
    reinterpret_cast<uint4*>(rope + r * kDr)[lane] = __ldg(reinterpret_cast<const uint4*>(rec + record_bytes - 2 * kDr) + lane);
  }
}

}  // namespace

bool sparse_mla_fp8_via_bf16(const SparseMlaParams& p) {
  if (!p.latent.records() || p.peer.sync.active()) return false;
  const int64_t per_request = p.rows.num_tokens / std::max<int32_t>(1, p.block_table.num_requests);
  return per_request >= 8 && sparse_mla_fp8_scratch_bytes(p) <= kMaxScratchBytes;
}

int64_t sparse_mla_fp8_scratch_bytes(const SparseMlaParams& p) {
  return bt_offset_bytes(p) + static_cast<int64_t>(p.block_table.num_requests) * p.block_table.max_pages * 4;
}

SparseMlaParams sparse_mla_fp8_bf16_view(const SparseMlaParams& p, void* scratch) {
  SparseMlaParams q = p;
  const int64_t rows = scratch_rows(p);
  const int64_t pages = static_cast<int64_t>(p.block_table.num_requests) * p.block_table.max_pages;
  char* base = static_cast<char*>(scratch);
  q.latent = PagedPoolView{base, DType::kBF16, pages, p.latent.page_size, kDl};
  q.rope = PagedPoolView{base + rows * kDl * 2, DType::kBF16, pages, p.latent.page_size, kDr};
  q.block_table.data = reinterpret_cast<const int32_t*>(base + bt_offset_bytes(p));
  return q;
}

Status launch_fp8_records_to_bf16(const SparseMlaParams& p, void* scratch, const LaunchContext& ctx) {
  const int64_t rows = scratch_rows(p);
  if (rows == 0) return Status::ok_status();
  const SparseMlaParams q = sparse_mla_fp8_bf16_view(p, scratch);
  const int64_t threads = rows * 32;
  fp8_records_to_bf16_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, ctx.stream>>>(
      static_cast<const unsigned char*>(p.latent.data), p.latent.record_bytes, pool_page_stride(p.latent),
      p.block_table.data,
      p.block_table.max_pages, p.latent.page_size, p.latent.num_pages, rows,
      static_cast<__nv_bfloat16*>(q.latent.data), static_cast<__nv_bfloat16*>(q.rope.data),
      const_cast<int32_t*>(q.block_table.data));
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("fp8_records_to_bf16_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
