// Context-parallel helper kernels: row gather with f32/bf16 conversion (index -1 = a NaN row) and the
// global-to-local top-k remap (order-preserving compaction, one warp per row). Bad indices are reported through
// the device error word and skipped; the backend turns them into a Status.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

__device__ __forceinline__ float ld(const void* p, bool bf, int64_t i) {
  return bf ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]) : static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void st(void* p, bool bf, int64_t i, float v) {
  if (bf) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

__global__ void gather_rows_kernel(const GatherRowsParams p, bool src_bf, bool dst_bf, DeviceErrorWord err) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= p.num_rows) return;
  const int64_t src = p.index[r];
  if (src < -1 || src >= p.src_rows) {
    if (lane == 0) report_device_error(err, kDevBadIndex, r);
    return;
  }
  for (int d = lane; d < p.dim; d += 32) {
    st(p.dst, dst_bf, r * p.dim + d, src < 0 ? __int_as_float(0x7fc00000) : ld(p.src, src_bf, src * p.dim + d));
  }
}

__global__ void topk_remap_kernel(const TopkRemapParams p, DeviceErrorWord err) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= p.num_rows) return;
  const int32_t* in = p.topk + r * p.K;
  int32_t* out = p.local + r * p.K;
  const int64_t Pt = p.Pt, I = p.I;
  int32_t kept = 0;
  for (int32_t i0 = 0; i0 < p.K; i0 += 32) {
    const int32_t i = i0 + lane;
    const int64_t e = i < p.K ? in[i] : -1;
    if (e < -1) report_device_error(err, kDevBadEntry, r);
    const bool keep = e >= 0 && (e / I) % Pt == p.cr;
    const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
    if (keep) out[kept + __popc(ballot & ((1u << lane) - 1u))] = static_cast<int32_t>((e / (Pt * I)) * I + e % I);
    kept += __popc(ballot);
  }
  for (int32_t i = kept + lane; i < p.K; i += 32) out[i] = -1;
}

}  // namespace

Status launch_gather_rows(const GatherRowsParams& p, const LaunchContext& ctx) {
  if (p.num_rows == 0) return Status::ok_status();
  const int64_t blocks = (p.num_rows * 32 + 255) / 256;
  gather_rows_kernel<<<static_cast<unsigned>(blocks), 256, 0, ctx.stream>>>(p, p.src_dtype == DType::kBF16,
                                                                             p.dst_dtype == DType::kBF16, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("gather_rows_kernel");
  return Status::ok_status();
}

Status launch_topk_remap(const TopkRemapParams& p, const LaunchContext& ctx) {
  if (p.num_rows == 0) return Status::ok_status();
  const int64_t blocks = (p.num_rows * 32 + 255) / 256;
  topk_remap_kernel<<<static_cast<unsigned>(blocks), 256, 0, ctx.stream>>>(p, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_remap_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
