// The host's floor for one kernel launch (bench/launch_floor.h).
#include "launch_floor.h"

#include <algorithm>
#include <chrono>
#include <vector>

namespace dsacp::bench {
namespace {

__global__ void empty_kernel() {}

}  // namespace

double empty_launch_host_us(cudaStream_t stream, int launches, int batches) {
  std::vector<double> us;
  for (int b = 0; b <= batches; ++b) {  // batch 0 warms up (module load, first launch)
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < launches; ++i) empty_kernel<<<1, 32, 0, stream>>>();
    const double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (cudaStreamSynchronize(stream) != cudaSuccess || cudaGetLastError() != cudaSuccess) return -1;
    if (b > 0) us.push_back(t / launches);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

}  // namespace dsacp::bench
