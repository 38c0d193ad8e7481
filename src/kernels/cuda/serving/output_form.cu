// The serving options' kernels: a caller's precomputed top-k checked and copied (one CTA per row), and the step's
// outputs in the requested forms (global-slot top-k from the block table, base-2 LSE), in exact arithmetic: the
// same values as the CPU backend's (src/kernels/cpu/output_form.cc). Bad rows are reported through the device
// error word, which the backend turns into a Status naming the row.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/device_error.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace dsacp::cuda {
namespace {

constexpr int kThreads = 256;

// Entry i is good when it is -1, or a position below the row's key length that follows a smaller position (or
// is the first entry): the pairwise form of "ascending distinct positions, then -1 to the end".
__global__ void __launch_bounds__(kThreads) topk_input_kernel(const TopkInputParams p, DeviceErrorWord err) {
  const int64_t r = blockIdx.x;
  const int32_t* in = p.topk + r * p.K;
  int32_t* out = p.out + r * p.K;
  const int32_t len = p.key_len[r];
  bool bad = false;
  for (int i = threadIdx.x; i < p.K; i += blockDim.x) {
    const int32_t e = in[i];
    out[i] = e;
    if (e == -1) continue;
    if (e < 0 || e >= len) {
      bad = true;
    } else if (i > 0) {
      const int32_t prev = in[i - 1];
      bad |= prev < 0 || prev >= e;
    }
  }
  if (bad) report_device_error(err, kDevBadTopkRow, r);
}

__global__ void __launch_bounds__(kThreads) output_form_kernel(const OutputFormParams p, int64_t num_slots,
                                                               DeviceErrorWord err) {
  const int64_t total = num_slots + (p.lse != nullptr ? p.lse_count : 0);
  const int64_t Pt = p.Pt, I = p.I, B = p.page_size;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i >= num_slots) {
      float* v = p.lse + (i - num_slots);
      *v = __fmul_rn(*v, kLog2E);
      continue;
    }
    const int64_t e = p.topk[i];
    if (e < 0) {
      p.slots[i] = -1;
      continue;
    }
    const int64_t t = i / p.K;
    const int32_t b = p.request[t];
    const int64_t l = (e / (Pt * I)) * I + e % I;
    const int64_t column = l / B;
    int64_t page = -1;
    if (b >= 0 && b < p.block_table.num_requests && column < p.block_table.max_pages) {
      page = p.block_table.data[static_cast<int64_t>(b) * p.block_table.max_pages + column];
    }
    if (page < 0 || page >= p.num_pages) {
      report_device_error(err, kDevBadPage, t);
      p.slots[i] = -1;
      continue;
    }
    p.slots[i] = static_cast<int32_t>(page * B + l % B);
  }
}

}  // namespace

Status launch_topk_input(const TopkInputParams& p, const LaunchContext& ctx) {
  if (p.num_rows == 0) return Status::ok_status();
  if (p.num_rows >= (int64_t{1} << 31)) return unsupported("precomputed top-k: num_rows >= 2^31 (CUDA grid limit)");
  topk_input_kernel<<<static_cast<unsigned>(p.num_rows), kThreads, 0, ctx.stream>>>(p, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("topk_input_kernel");
  return Status::ok_status();
}

Status launch_output_form(const OutputFormParams& p, const LaunchContext& ctx) {
  const int64_t num_slots = p.slots != nullptr ? p.num_rows * p.K : 0;
  const int64_t total = num_slots + (p.lse != nullptr ? p.lse_count : 0);
  if (total == 0) return Status::ok_status();
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t{ctx.num_sms} * 8);
  output_form_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, ctx.stream>>>(p, num_slots, ctx.error);
  DSACP_CUDA_RETURN_IF_LAUNCH_ERROR("output_form_kernel");
  return Status::ok_status();
}

}  // namespace dsacp::cuda
