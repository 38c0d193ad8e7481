// Micro-benchmark: what a cross-GPU flag handshake costs on two GPUs of one host (peer access), to see where a
// window publish's ~12 us go. Not part of the build; compile on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I src -I include bench/micro/flag_latency.cu \
//     -o /tmp/flag_latency
// Rows (microseconds per iteration, 2 GPUs, one host thread driving both):
//   empty kernel          back-to-back launches of an empty kernel on one stream
//   host word reads       a kernel that reads two words of mapped host memory (the publish's dead check)
//   publish (host words)  signal the peer + wait for its flag, checking mapped host words first (as now)
//   publish (no words)    the same without the host-word check
//   in-kernel ping-pong   one persistent kernel per GPU, N handshakes inside it (the NVLink round trip alone)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kernels/cuda/comm/peer_sync.cuh"

#include "micro_check.h"

using dsacp::cuda::peer::ld_acquire_sys;  // the flag loads and stores the step's kernels use
using dsacp::cuda::peer::st_release_sys;

__global__ void empty_kernel() {}

__global__ void host_words_kernel(const volatile int32_t* a, const volatile int32_t* b, int32_t* sink) {
  if (*a != 0 || *b != 0) *sink = 1;
}

// Raise my flag in the peer (peer_flag) to seq, wait until my own flag (my_flag) reaches seq.
__global__ void publish_kernel(uint64_t* peer_flag, const uint64_t* my_flag, uint64_t seq,
                               const volatile int32_t* a, const volatile int32_t* b, int check_words, int fence) {
  if (check_words && (*a != 0 || *b != 0)) return;
  if (fence) __threadfence_system();
  st_release_sys(peer_flag, seq);
  while (ld_acquire_sys(my_flag) < seq) {
  }
}

__global__ void pingpong_kernel(uint64_t* peer_flag, const uint64_t* my_flag, uint64_t seq0, int n, int fence) {
  for (int i = 1; i <= n; ++i) {
    if (fence) __threadfence_system();
    st_release_sys(peer_flag, seq0 + i);
    while (ld_acquire_sys(my_flag) < seq0 + i) {
    }
  }
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    std::printf("needs 2 GPUs\n");
    return 1;
  }
  uint64_t* flags[2];
  cudaStream_t st[2];
  int32_t* words[2];  // mapped host memory: [abort, error]
  int32_t* dwords[2];
  int32_t* sink[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&flags[d], 4096));
    CK(cudaMemset(flags[d], 0, 4096));
    CK(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking));
    CK(cudaHostAlloc(&words[d], 64, cudaHostAllocMapped | cudaHostAllocPortable));
    words[d][0] = words[d][1] = 0;
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dwords[d]), words[d], 0));
    CK(cudaMalloc(&sink[d], 64));
  }
  auto sync = [&] {
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      CK(cudaStreamSynchronize(st[d]));
    }
  };
  const int iters = 2000;
  uint64_t seq = 0;
  auto timed = [&](const char* name, auto launch_one) {
    for (int w = 0; w < 2; ++w) {  // warm-up round, then the timed one
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) launch_one();
      sync();
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      if (w == 1) std::printf("%-34s %8.2f us/iter\n", name, us / iters);
    }
  };
  timed("empty kernel (both GPUs)", [&] {
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      empty_kernel<<<1, 32, 0, st[d]>>>();
    }
  });
  timed("host word reads (2 words)", [&] {
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      host_words_kernel<<<1, 32, 0, st[d]>>>(dwords[d], dwords[d] + 1, sink[d]);
    }
  });
  for (int fence = 1; fence >= 0; --fence) {
    for (int check = 1; check >= 0; --check) {
      char name[64];
      std::snprintf(name, sizeof name, "publish (%s, %s)", check ? "host words" : "no words",
                    fence ? "fence.sc.sys" : "no fence");
      timed(name, [&] {
        ++seq;
        for (int d = 0; d < 2; ++d) {
          CK(cudaSetDevice(d));
          publish_kernel<<<1, 1, 0, st[d]>>>(flags[1 - d] + d, flags[d] + (1 - d), seq, dwords[d], dwords[d] + 1, check,
                                             fence);
        }
      });
    }
  }
  for (int fence = 1; fence >= 0; --fence) {
    sync();
    const int m = 20000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int d = 0; d < 2; ++d) {
      CK(cudaSetDevice(d));
      pingpong_kernel<<<1, 1, 0, st[d]>>>(flags[1 - d] + d, flags[d] + (1 - d), seq, m, fence);
    }
    sync();
    seq += m;
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    std::printf("in-kernel handshake (%s)%*s %8.3f us/iter\n", fence ? "fence.sc.sys" : "no fence", fence ? 0 : 4, "",
                us / m);
  }
  return 0;
}
