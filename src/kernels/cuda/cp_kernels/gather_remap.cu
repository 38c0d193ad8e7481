// Context-parallel helper kernels: row gather with f32/bf16 conversion (index -1 = a NaN row) and the
// global-to-local top-k remap (order-preserving compaction, one CTA per row). Bad indices are reported through
// the device error word and skipped; the backend turns them into a Status.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/common/block_scan.cuh"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/cp_kernels/shard_map.cuh"
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
  const int64_t at = src < 0 ? 0 : gather_src_offset(p, src);
  for (int d = lane; d < p.dim; d += 32) {
    st(p.dst, dst_bf, r * p.dim + d, src < 0 ? __int_as_float(0x7fc00000) : ld(p.src, src_bf, at + d));
  }
}

// One CTA per row: each thread takes a contiguous chunk of entries, a block scan gives where its kept entries
// go, so the order is kept. The position maps are ShardMap's (32-bit arithmetic: positions are int32).
constexpr int kRemapThreads = 256;

__global__ void __launch_bounds__(kRemapThreads) topk_remap_kernel(const TopkRemapParams p, DeviceErrorWord err) {
  __shared__ int warp_sums[32];
  const int64_t r = blockIdx.x;
  const int32_t* in = p.topk + r * p.K;
  int32_t* out = p.local + r * p.K;
  const int K = p.K;
  const ShardMap map(p.Pt, p.I);
  const int cr = static_cast<int>(p.cr);
  const int chunk = (K + blockDim.x - 1) / blockDim.x;
  const int begin = min(K, static_cast<int>(threadIdx.x) * chunk), end = min(K, begin + chunk);
  int count = 0;
  for (int i = begin; i < end; ++i) {
    const int32_t e = in[i];
    if (e < -1) report_device_error(err, kDevBadEntry, r);
    if (e >= 0 && map.part(e) == cr) ++count;
  }
  int total = 0;
  int at = block_exclusive_scan(count, warp_sums, &total);
  for (int i = begin; i < end; ++i) {
    const int32_t e = in[i];
    if (e < 0) continue;
    if (map.part(e) == cr) out[at++] = map.local(e);
  }
  for (int i = total + threadIdx.x; i < K; i += blockDim.x) out[i] = -1;
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
  if (p.num_rows >= (int64_t{1} << 31)) return unsupported("topk_remap: num_rows >= 2^31 (CUDA grid limit)");
  topk_remap_kernel<<<static_cast<unsigned>(p.num_rows), kRemapThreads, 0, ctx.stream>>>(p, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_remap_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
