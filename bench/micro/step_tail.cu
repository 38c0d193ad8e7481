// Micro-benchmark: what a step's end costs after its last kernel, by how the host learns of the kernels' errors and
// the end. A kernel spins 50 us on the GPU (the step's last kernel), then one of:
//   sync only             cudaStreamSynchronize (the floor)
//   D2H copy + sync       a 40-byte cudaMemcpyAsync of the error words into pinned memory, then the synchronize
//                         (the CUDA backend's read-back today)
//   kernel to host + sync a one-thread kernel storing the 40 bytes into mapped pinned host memory, then the
//                         synchronize
//   event poll + sync     an event after the kernel, polled with cudaEventQuery, then the synchronize (the window
//                         handle's wait before session 14)
// Rows: microseconds from the spinning kernel's launch to the host's return, minus the 50 us (median of 300).
// Not part of the build; compile on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a bench/micro/step_tail.cu -o /tmp/step_tail
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "micro_check.h"

__global__ void spin_kernel(uint64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= ns) break;
  }
}

__global__ void words_to_host(const int32_t* dev, volatile int32_t* host, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) host[i] = dev[i];
}

using Clock = std::chrono::steady_clock;

int main() {
  CK(cudaSetDevice(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int32_t *dev = nullptr, *pinned = nullptr, *mapped_host = nullptr, *mapped_dev = nullptr;
  CK(cudaMalloc(&dev, 64));
  CK(cudaMemset(dev, 0, 64));
  CK(cudaMallocHost(&pinned, 64));
  CK(cudaHostAlloc(&mapped_host, 64, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_dev), mapped_host, 0));
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  const uint64_t spin_ns = 50000;
  std::vector<std::pair<std::string, std::function<void()>>> tails = {
      {"sync only", [&] { CK(cudaStreamSynchronize(s)); }},
      {"D2H copy + sync",
       [&] {
         CK(cudaMemcpyAsync(pinned, dev, 40, cudaMemcpyDeviceToHost, s));
         CK(cudaStreamSynchronize(s));
       }},
      {"kernel to host + sync",
       [&] {
         words_to_host<<<1, 32, 0, s>>>(dev, mapped_dev, 10);
         CK(cudaStreamSynchronize(s));
       }},
      {"event poll + sync",
       [&] {
         CK(cudaEventRecord(ev, s));
         while (cudaEventQuery(ev) == cudaErrorNotReady) std::this_thread::yield();
         CK(cudaStreamSynchronize(s));
       }},
  };
  for (int round = 0; round < 2; ++round) {
    for (auto& tail : tails) {
      std::vector<double> v;
      for (int i = 0; i < 301; ++i) {
        CK(cudaStreamSynchronize(s));
        const auto t0 = Clock::now();
        spin_kernel<<<1, 1, 0, s>>>(spin_ns);
        tail.second();
        const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() - spin_ns / 1000.0;
        if (i > 0) v.push_back(us);
      }
      std::sort(v.begin(), v.end());
      std::printf("%-24s %7.2f us (p10 %.2f, p90 %.2f)\n", tail.first.c_str(), v[v.size() / 2], v[v.size() / 10],
                  v[v.size() * 9 / 10]);
    }
  }
  return 0;
}
