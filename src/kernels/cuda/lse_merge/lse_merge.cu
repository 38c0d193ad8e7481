// LSE merge of S partial attention results over disjoint key sets (also the split-K combine of sparse MLA).
// One CTA per (token, head) row; thread 0 derives the part weights (fixed order, f64 like the CPU oracle), then
// every thread scales its columns. A part whose LSE is not finite has weight 0 and its out is never read.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 128;

constexpr int kMaxSharedParts = 256;

// Part weights once per row by thread 0 (in f64 and the parts' fixed order, like the CPU oracle: the same float
// weight per part), then every column is the fixed-order sum over parts.
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename OutT, typename PartT>
__global__ void __launch_bounds__(kThreads) lse_merge_kernel(const PartT* __restrict__ part_out,
                                                             const float* __restrict__ part_lse, int num_parts,
                                                             int64_t rows, int dl, OutT* __restrict__ out,
                                                             float* __restrict__ lse, LseMergeRows map) {
  __shared__ float weight[kMaxSharedParts];
  __shared__ double s_max, s_sum;
  const int64_t r = blockIdx.x;
  const bool shared_weights = num_parts <= kMaxSharedParts;
  if (threadIdx.x == 0) {
    double max_lse = -INFINITY;
    for (int s = 0; s < num_parts; ++s) {
      const float l = part_lse[s * rows + r];
      if (isfinite(l)) max_lse = fmax(max_lse, static_cast<double>(l));
    }
    double sum = 0.0;
    if (max_lse != -INFINITY) {
      for (int s = 0; s < num_parts; ++s) {
        const float l = part_lse[s * rows + r];
        if (isfinite(l)) sum += exp(static_cast<double>(l) - max_lse);
      }
      for (int s = 0; shared_weights && s < num_parts; ++s) {
        const float l = part_lse[s * rows + r];
        weight[s] = isfinite(l) ? static_cast<float>(exp(static_cast<double>(l) - max_lse) / sum) : 0.f;
      }
    }
    s_max = max_lse;
    s_sum = sum;
  }
  __syncthreads();
  const double max_lse = s_max, sum = s_sum;
  // Destination row: r = t * H + h into head blocks of [T, block_heads] (r itself for the plain layout).
  int64_t dst = r;
  if (map.block_heads != map.H) {
    const int64_t t = r / map.H;
    const int h = static_cast<int>(r - t * map.H);
    dst = (static_cast<int64_t>(h / map.block_heads) * map.T + t) * map.block_heads + h % map.block_heads;
  }
  OutT* o = out + dst * dl;
  for (int d = threadIdx.x; d < dl; d += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < num_parts && max_lse != -INFINITY; ++s) {
      const float l = part_lse[s * rows + r];
      if (!isfinite(l)) continue;
      const float w = shared_weights ? weight[s] : static_cast<float>(exp(static_cast<double>(l) - max_lse) / sum);
      acc += w * to_f32(part_out[(s * rows + r) * dl + d]);
    }
    o[d] = static_cast<OutT>(acc);
  }
  // Last, so that an lse over part 0's (an in-place merge) is not read after it changed.
  __syncthreads();
  if (threadIdx.x == 0 && lse != nullptr) {
    lse[dst] = max_lse == -INFINITY ? -INFINITY : static_cast<float>(max_lse + log(sum));
  }
}

}  // namespace

Status launch_lse_merge(const LseMergeParams& p, void* out, DType out_dtype, const LaunchContext& ctx,
                        const LseMergeRows& rows) {
  if (p.num_rows == 0) return Status::ok_status();
  if (p.num_rows >= (int64_t{1} << 31)) return unsupported("lse_merge: num_rows >= 2^31 (CUDA grid limit)");
  LseMergeRows map = rows;
  if (map.H <= 1 || map.block_heads < 1) map = LseMergeRows{p.num_rows, 1, 1};  // the plain layout
  const dim3 grid(static_cast<unsigned>(p.num_rows));
  auto launch = [&](auto* typed_out, auto* typed_parts) {
    using OutT = std::remove_pointer_t<decltype(typed_out)>;
    using PartT = std::remove_const_t<std::remove_pointer_t<decltype(typed_parts)>>;
    lse_merge_kernel<OutT, PartT><<<grid, kThreads, 0, ctx.stream>>>(typed_parts, p.part_lse, p.num_parts,
                                                                     p.num_rows, p.Dl, typed_out, p.lse, map);
  };
  const bool bf16_parts = p.part_dtype == DType::kBF16;
  if (!bf16_parts && p.part_dtype != DType::kF32) {
    return unsupported(std::string("lse_merge: part dtype ") + dtype_name(p.part_dtype) + " (supported: F32, BF16)");
  }
  if (out_dtype == DType::kBF16) {
    auto* o = static_cast<__nv_bfloat16*>(out);
    if (bf16_parts) launch(o, static_cast<const __nv_bfloat16*>(p.part_out));
    else launch(o, static_cast<const float*>(p.part_out));
  } else if (out_dtype == DType::kF32) {
    auto* o = static_cast<float*>(out);
    if (bf16_parts) launch(o, static_cast<const __nv_bfloat16*>(p.part_out));
    else launch(o, static_cast<const float*>(p.part_out));
  } else {
    return unsupported(std::string("lse_merge: out dtype ") + dtype_name(out_dtype) + " (supported: F32, BF16)");
  }
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("lse_merge_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
