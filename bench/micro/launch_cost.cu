// Micro-benchmark: the host's cost of the CUDA calls a step makes before its indexer launch, by kind and by the
// size of a launch's parameters (the inline indexer plan and the cache write's carried upload put 2-3 KB there),
// from one thread on one GPU and from two threads on two GPUs at once (the CP step's rank threads). Not part of
// the build; compile on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a bench/micro/launch_cost.cu -o /tmp/launch_cost
// Rows: microseconds per call on the host, one thread alone, then both threads together (each on its own GPU,
// pinned): back to back (median of 15 batches of 200 calls; the stream synchronized between batches, not inside
// them), and one call onto an idle stream (median of 200, each after a synchronize and 50 us of spinning).
#include <cuda_runtime.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "micro_check.h"

template <int kBytes>
struct Params {
  alignas(16) char data[kBytes];
};

template <int kBytes>
__global__ void param_kernel(const __grid_constant__ Params<kBytes> p, int* sink) {
  if (p.data[threadIdx.x % kBytes] == 123 && sink != nullptr) *sink = 1;
}

using Clock = std::chrono::steady_clock;

struct Gpu {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  void* pinned = nullptr;
  void* dev = nullptr;
};

template <int kBytes>
void launch(Gpu& g) {
  Params<kBytes> p;
  std::memset(p.data, 1, kBytes);
  param_kernel<kBytes><<<1, 32, 0, g.stream>>>(p, nullptr);
}

// The call kinds, by name.
std::vector<std::pair<std::string, std::function<void(Gpu&)>>> kinds() {
  return {
      {"launch, 16 B params", launch<16>},
      {"launch, 1 KB params", launch<1024>},
      {"launch, 2 KB params", launch<2048>},
      {"launch, 3 KB params", launch<3072>},
      {"launch, 4000 B params", launch<4000>},
      {"cudaMemcpyAsync H2D 1 KB pinned", [](Gpu& g) { CK(cudaMemcpyAsync(g.dev, g.pinned, 1024, cudaMemcpyHostToDevice, g.stream)); }},
      {"cudaEventRecord", [](Gpu& g) { CK(cudaEventRecord(g.event, g.stream)); }},
      {"cudaSetDevice (current)", [](Gpu& g) { CK(cudaSetDevice(g.device)); }},
  };
}

double per_call_us(Gpu& g, const std::function<void(Gpu&)>& call) {
  CK(cudaSetDevice(g.device));
  std::vector<double> batches;
  for (int b = 0; b < 16; ++b) {
    CK(cudaStreamSynchronize(g.stream));
    const auto t0 = Clock::now();
    for (int i = 0; i < 200; ++i) call(g);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 200;
    if (b > 0) batches.push_back(us);  // (the first batch warms up)
  }
  CK(cudaStreamSynchronize(g.stream));
  std::sort(batches.begin(), batches.end());
  return batches[batches.size() / 2];
}

// One call onto an idle stream (synchronized, then 50 us of spinning, as a step's first launch after the last
// step's end): median host time of 200.
double idle_call_us(Gpu& g, const std::function<void(Gpu&)>& call) {
  CK(cudaSetDevice(g.device));
  std::vector<double> v;
  for (int i = 0; i < 201; ++i) {
    CK(cudaStreamSynchronize(g.stream));
    const auto spin = Clock::now();
    while (Clock::now() - spin < std::chrono::microseconds(50)) {
    }
    const auto t0 = Clock::now();
    call(g);
    if (i > 0) v.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  CK(cudaStreamSynchronize(g.stream));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  std::vector<Gpu> gpus(std::min(n, 2));
  for (int d = 0; d < static_cast<int>(gpus.size()); ++d) {
    Gpu& g = gpus[d];
    g.device = d;
    CK(cudaSetDevice(d));
    CK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&g.event, cudaEventDisableTiming));
    CK(cudaMallocHost(&g.pinned, 1024));
    CK(cudaMalloc(&g.dev, 1024));
  }
  for (int mode = 0; mode < 2; ++mode) {
  auto measure = mode == 0 ? per_call_us : idle_call_us;
  std::printf("%s\n%-34s %12s %22s\n", mode == 0 ? "back to back:" : "one call onto an idle stream:", "call",
              "one thread", "two threads (each)");
  std::vector<std::pair<std::string, std::function<void(Gpu&)>>> all = kinds();
  all.push_back({"3 launches (3 KB, 2 KB, 2 KB)", [](Gpu& g) { launch<3072>(g); launch<2048>(g); launch<2048>(g); }});
  for (const auto& kind : all) {
    const std::string& name = kind.first;
    const std::function<void(Gpu&)>& call = kind.second;
    pin(2);
    const double alone = measure(gpus[0], call);
    double both[2] = {0, 0};
    if (gpus.size() == 2) {
      std::atomic<int> ready{0};
      std::vector<std::thread> threads;
      for (int d = 0; d < 2; ++d) {
        threads.emplace_back([&, d] {
          pin(2 + d);
          CK(cudaSetDevice(d));
          ready.fetch_add(1);
          while (ready.load() < 2) {
          }
          both[d] = measure(gpus[d], call);
        });
      }
      for (auto& t : threads) t.join();
    }
    std::printf("%-34s %10.2f us %10.2f / %.2f us\n", name.c_str(), alone, both[0], both[1]);
  }
  }
  return 0;
}
