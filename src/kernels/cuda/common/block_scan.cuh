// Block-wide exclusive prefix sum of one int per thread (blockDim.x a multiple of 32, at most 1024).
#pragma once

namespace dsacp::cuda {

// `warp_sums` is shared memory of 32 ints. Returns the sum of v over threads < threadIdx.x; *total gets the
// block's sum. Every thread of the block must call it (it synchronizes).
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;  // inclusive sums of the warps
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums may be reused after the call
  return before;
}

}  // namespace dsacp::cuda
