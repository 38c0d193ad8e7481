// LSE merge of S partial attention results over disjoint key sets (also the split-K combine of sparse MLA).
// One warp per (token, head) row, four rows a CTA: the lanes derive the part weights together (f64 like the CPU
// oracle, a fixed reduction order), then every lane scales its columns, 8 at a time with 16-byte loads when the
// rows allow it. A part whose LSE is not finite has weight 0 and its out is never read.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxSharedParts = 64;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// 8 consecutive elements (16-byte aligned for bf16, 32 for f32) as floats, and back.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = v;
}
__device__ __forceinline__ void store8(float* p, const float (&f)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

// The parts: one [S, rows, dl] array (out, lse), or one buffer per part (out_of, lse_of: a window's messages).
template <typename PartT>
struct MergeParts {
  const PartT* out = nullptr;
  const float* lse = nullptr;
  const PartT* out_of[kMaxPartBuffers] = {};
  const float* lse_of[kMaxPartBuffers] = {};
  __device__ __forceinline__ float lse_at(int s, int64_t rows, int64_t r) const {
    return out != nullptr ? lse[s * rows + r] : lse_of[s][r];
  }
  __device__ __forceinline__ const PartT* row(int s, int64_t rows, int64_t r, int dl) const {
    return out != nullptr ? out + (s * rows + r) * dl : out_of[s] + r * dl;
  }
};

template <typename OutT, typename PartT>
__global__ void __launch_bounds__(kThreads) lse_merge_kernel(const MergeParts<PartT> parts, int num_parts,
                                                             int64_t rows, int dl, bool vec, OutT* __restrict__ out,
                                                             float* __restrict__ lse, LseMergeRows map) {
  // Launched as a programmatic dependent of the kernel that wrote the parts (launch_lse_merge's after_producer):
  // wait here until that grid completed and its writes are visible. A no-op in a plain launch.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  __shared__ float weight[kWarps][kMaxSharedParts];  // 0 for a part that is not used
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (r >= rows) return;  // warps are independent: nothing below synchronizes the block
  const bool shared_weights = num_parts <= kMaxSharedParts;
  // The LSE of part s is read by lane s % 32 (all lanes at once, not one lane in a loop): max, then the sum of
  // exp(lse - max) over the parts with a finite LSE, both in f64 like the CPU oracle, reduced over the warp.
  double max_lse = -INFINITY, sum = 0.0;
  for (int s = lane; s < num_parts; s += 32) {
    const float l = parts.lse_at(s, rows, r);
    if (isfinite(l)) max_lse = fmax(max_lse, static_cast<double>(l));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) max_lse = fmax(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, off));
  if (max_lse != -INFINITY) {
    for (int s = lane; s < num_parts; s += 32) {
      const float l = parts.lse_at(s, rows, r);
      if (isfinite(l)) sum += exp(static_cast<double>(l) - max_lse);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  // Weights in shared memory (-1: the part is left out, its LSE is not finite, its rows are never read).
  for (int s = lane; shared_weights && s < num_parts; s += 32) {
    const float l = parts.lse_at(s, rows, r);
    weight[warp][s] = isfinite(l) ? static_cast<float>(exp(static_cast<double>(l) - max_lse) / sum) : -1.f;
  }
  __syncwarp();
  // The weight of part s; `use` false when the part is left out.
  auto part_weight = [&](int s, bool* use) -> float {
    if (shared_weights) {
      const float w = weight[warp][s];
      *use = w >= 0.f;
      return w;
    }
    const float l = parts.lse_at(s, rows, r);
    *use = isfinite(l);
    return *use ? static_cast<float>(exp(static_cast<double>(l) - max_lse) / sum) : 0.f;
  };
  // Destination row: r = t * H + h into head blocks of [T, block_heads] (r itself for the plain layout).
  int64_t dst = r;
  if (map.block_heads != map.H) {
    const int64_t t = r / map.H;
    const int h = static_cast<int>(r - t * map.H);
    dst = (static_cast<int64_t>(h / map.block_heads) * map.T + t) * map.block_heads + h % map.block_heads;
  }
  OutT* o = out + dst * dl;
  const bool any = max_lse != -INFINITY;
  if (vec) {
    for (int c = lane * 8; c < dl; c += 32 * 8) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      // Four parts at a time: their loads are all issued before the first is used (one round trip, not four);
      // the sums keep the parts' order.
      for (int s0 = 0; s0 < num_parts && any; s0 += 4) {
        float x[4][8], w[4];
        bool use[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          use[u] = false;
          w[u] = s0 + u < num_parts ? part_weight(s0 + u, &use[u]) : 0.f;
          if (use[u]) load8(parts.row(s0 + u, rows, r, dl) + c, x[u]);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (!use[u]) continue;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += w[u] * x[u][i];
        }
      }
      store8(o + c, acc);
    }
  } else {
    for (int d = lane; d < dl; d += 32) {
      float acc = 0.f;
      for (int s = 0; s < num_parts && any; ++s) {
        bool use = false;
        const float w = part_weight(s, &use);
        if (!use) continue;
        acc += w * to_f32(parts.row(s, rows, r, dl)[d]);
      }
      o[d] = static_cast<OutT>(acc);
    }
  }
  // Last, so that an lse over part 0's (an in-place merge) is not read after it changed.
  __syncwarp();
  if (lane == 0 && lse != nullptr) {
    lse[dst] = !any ? -INFINITY : static_cast<float>(max_lse + log(sum));
  }
}

}  // namespace

Status launch_lse_merge(const LseMergeParams& p, void* out, DType out_dtype, const LaunchContext& ctx,
                        const LseMergeRows& rows, bool after_producer) {
  if (p.num_rows == 0) return Status::ok_status();
  if (p.num_rows >= (int64_t{1} << 31)) return unsupported("lse_merge: num_rows >= 2^31 (CUDA grid limit)");
  LseMergeRows map = rows;
  if (map.H <= 1 || map.block_heads < 1) map = LseMergeRows{p.num_rows, 1, 1};  // the plain layout
  const dim3 grid(static_cast<unsigned>((p.num_rows + kWarps - 1) / kWarps));
  auto aligned = [](const void* q, uintptr_t a) { return reinterpret_cast<uintptr_t>(q) % a == 0; };
  auto launch = [&](auto* typed_out, auto* typed_parts) {
    using OutT = std::remove_pointer_t<decltype(typed_out)>;
    using PartT = std::remove_const_t<std::remove_pointer_t<decltype(typed_parts)>>;
    MergeParts<PartT> parts;
    bool parts_aligned = aligned(typed_parts, 16);
    if (p.part_out != nullptr) {
      parts.out = typed_parts;
      parts.lse = p.part_lse;
    } else {
      for (int s = 0; s < p.num_parts && s < kMaxPartBuffers; ++s) {
        parts.out_of[s] = static_cast<const PartT*>(p.part_out_of[s]);
        parts.lse_of[s] = p.part_lse_of[s];
        parts_aligned = parts_aligned && aligned(p.part_out_of[s], 16);
      }
    }
    // 8 columns at a time when every row starts on a 16-byte boundary (of both the parts and the output).
    const bool vec = p.Dl % 8 == 0 && parts_aligned && aligned(typed_out, 16);
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(kThreads);
    cfg.stream = ctx.stream;
    cudaLaunchAttribute attr[1];
    if (after_producer) {  // may start while the producer's last CTAs finish; griddepcontrol.wait orders the reads
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, lse_merge_kernel<OutT, PartT>, parts, p.num_parts, p.num_rows, p.Dl, vec,
                              typed_out, p.lse, map);
  };
  if (p.part_out == nullptr && p.num_parts > kMaxPartBuffers) {
    return unsupported("lse_merge: " + std::to_string(p.num_parts) + " parts given one buffer each (at most " +
                       std::to_string(kMaxPartBuffers) + ")");
  }
  const bool bf16_parts = p.part_dtype == DType::kBF16;
  cudaError_t launched = cudaSuccess;
  if (!bf16_parts && p.part_dtype != DType::kF32) {
    return unsupported(std::string("lse_merge: part dtype ") + dtype_name(p.part_dtype) + " (supported: F32, BF16)");
  }
  if (out_dtype == DType::kBF16) {
    auto* o = static_cast<__nv_bfloat16*>(out);
    launched = bf16_parts ? launch(o, static_cast<const __nv_bfloat16*>(p.part_out))
                          : launch(o, static_cast<const float*>(p.part_out));
  } else if (out_dtype == DType::kF32) {
    auto* o = static_cast<float*>(out);
    launched = bf16_parts ? launch(o, static_cast<const __nv_bfloat16*>(p.part_out))
                          : launch(o, static_cast<const float*>(p.part_out));
  } else {
    return unsupported(std::string("lse_merge: out dtype ") + dtype_name(out_dtype) + " (supported: F32, BF16)");
  }
  DSACP_CUDA_RETURN_IF_ERROR(launched);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("lse_merge_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
