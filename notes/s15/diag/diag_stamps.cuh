// DIAGNOSTIC ONLY (session 15, never committed to src): %globaltimer stamps per row, per translation unit.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <time.h>
namespace dsacp::cuda::diag {
constexpr int kRows = 256;
constexpr int kSlots = 16;  // slots 8..11: merge_small_row's phase stamps [row * 16 + phase] (rows < 64)
static __device__ unsigned long long g_stamps[kSlots * kRows];
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp(int slot, int64_t row) {
  if (threadIdx.x == 0 && row >= 0 && row < kRows) g_stamps[slot * kRows + row] = now_ns();
}
inline int dump(unsigned long long* host) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, g_stamps, sizeof(g_stamps)));
}
}  // namespace dsacp::cuda::diag
// The offset of the GPU's %globaltimer from the host's CLOCK_REALTIME (ns), from the fastest of 7 round trips
// of a one-thread kernel (the midpoint of the host's time before the launch and after the synchronize).
#define DSACP_DIAG_OFFSET_FN(name)                                                                         \
  static __device__ unsigned long long g_diag_now;                                                          \
  static __global__ void diag_now_kernel() { g_diag_now = dsacp::cuda::diag::now_ns(); }                    \
  extern "C" long long name() {                                                                             \
    long long best = 0, best_rt = -1;                                                                       \
    for (int i = 0; i < 7; ++i) {                                                                           \
      timespec a, b;                                                                                        \
      clock_gettime(CLOCK_REALTIME, &a);                                                                    \
      diag_now_kernel<<<1, 1>>>();                                                                          \
      cudaDeviceSynchronize();                                                                              \
      clock_gettime(CLOCK_REALTIME, &b);                                                                    \
      unsigned long long g = 0;                                                                             \
      cudaMemcpyFromSymbol(&g, g_diag_now, sizeof(g));                                                      \
      const long long ha = a.tv_sec * 1000000000ll + a.tv_nsec, hb = b.tv_sec * 1000000000ll + b.tv_nsec; \
      if (best_rt < 0 || hb - ha < best_rt) best_rt = hb - ha, best = static_cast<long long>(g) - (ha + hb) / 2; \
    }                                                                                                       \
    return best;                                                                                            \
  }
#define DSACP_DIAG_DUMP_FN(name) \
  extern "C" int name(unsigned long long* host) { return dsacp::cuda::diag::dump(host); }
