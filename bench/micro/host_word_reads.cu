// Micro-benchmark: what it costs when many CTAs read the same word of mapped host memory at once (the row
// signal's and the peer merge's dead checks, one per CTA), against a word of device memory. Session 12's
// question: is the row-synchronized attention's 0.35 ms extra these reads queueing on PCIe?
// Not part of the build; compile on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a bench/micro/host_word_reads.cu -o /tmp/hwr
// Rows: kernel time (us, median of 50) for a grid of N CTAs of 256 threads, thread 0 of each reading the word
// R times (dependent reads), plus a CTA-wide barrier before and after, as window_row_signal does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "micro_check.h"

__global__ void read_word_kernel(const volatile int32_t* word, int reads, int32_t* sink) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int i = 0; i < reads; ++i) acc += *word;
    if (acc != 0) *sink = acc;
  }
  __syncthreads();
}

// Every CTA spins (thread 0) on ld.acquire.sys of a device word for `spins` iterations, reading the host word
// every 256 spins: the shape of the peer merge's wait loop, without a flag ever coming.
__global__ void spin_kernel(const uint64_t* flag, const volatile int32_t* word, int spins, int32_t* sink) {
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int s = 1; s <= spins; ++s) {
      uint64_t v;
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
      acc += static_cast<int32_t>(v);
      if ((s & 255) == 0) acc += *word;
    }
    if (acc != 0) *sink = acc;
  }
}

template <typename Launch>
float median_us(Launch launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < 55; ++i) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 5) t.push_back(ms * 1000.f);
  }
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

int main() {
  int32_t* host_word = nullptr;
  int32_t* host_dev = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&host_word), 64, cudaHostAllocMapped));
  host_word[0] = 0;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host_word, 0));
  int32_t* dev_word = nullptr;
  uint64_t* flag = nullptr;
  int32_t* sink = nullptr;
  CK(cudaMalloc(&dev_word, 64));
  CK(cudaMalloc(&flag, 64));
  CK(cudaMalloc(&sink, 64));
  CK(cudaMemset(dev_word, 0, 64));
  CK(cudaMemset(flag, 0, 64));
  std::printf("%-28s %6s %6s %10s %10s\n", "kernel", "CTAs", "reads", "host us", "device us");
  for (int ctas : {1, 8, 32, 64, 128}) {
    for (int reads : {0, 1, 2, 8}) {
      const float h = median_us([&] { read_word_kernel<<<ctas, 256>>>(host_dev, reads, sink); });
      const float d = median_us([&] { read_word_kernel<<<ctas, 256>>>(dev_word, reads, sink); });
      std::printf("%-28s %6d %6d %10.2f %10.2f\n", "read word (thread 0 / CTA)", ctas, reads, h, d);
    }
  }
  for (int ctas : {1, 64}) {
    for (int spins : {256, 4096}) {
      const float h = median_us([&] { spin_kernel<<<ctas, 256>>>(flag, host_dev, spins, sink); });
      const float d = median_us([&] { spin_kernel<<<ctas, 256>>>(flag, dev_word, spins, sink); });
      std::printf("%-28s %6d %6d %10.2f %10.2f\n", "spin (acquire.sys) + word/256", ctas, spins, h, d);
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}
