// Micro-benchmark: where the DCP decode's candidate merge (merge_row::merge_small_row, 1024 threads x 4) spends
// its time, phase by phase (thread 0's clock64 at each phase's end, DSACP_MERGE_STAMPS), for b=64 rows of 2 x 2048
// candidates. Two score shapes:
//   uniform   scores 2 + U[0, 1) (bench_gpu's topk_merge case)
//   tail      each part's row is the top 2048 of 65536 normal samples (an indexer row's candidates)
// Not part of the build; compile on the GPU machine:
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -I src -I include bench/micro/merge_phases.cu \
//     -o /tmp/merge_phases
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

__device__ long long g_stamps[1024 * 16];
#define DSACP_MERGE_STAMPS g_stamps
#include "kernels/cuda/cp_kernels/topk_merge_row.cuh"

#include "micro_check.h"

using namespace dsacp;
using namespace dsacp::cuda;

__global__ void __launch_bounds__(1024) merge_kernel(const TopkMergeParams p, int k2) {
  extern __shared__ uint64_t keys[];
  __shared__ merge_row::MergeRowShared<1024> sm;
  merge_row::merge_small_row<1024, 4>(p, blockIdx.x, sm, keys, k2, DeviceErrorWord{});
}

// Runs the merge kReps times; prints the time a launch and the phases of the last launch.
void run(const char* name, const TopkMergeParams& p, int rows, int K, int k2, int smem, int reps, int clock_khz) {
  CK(cudaFuncSetAttribute(merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  merge_kernel<<<rows, 1024, smem>>>(p, k2);
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; ++i) merge_kernel<<<rows, 1024, smem>>>(p, k2);
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  std::vector<long long> st(1024 * 16);
  CK(cudaMemcpyFromSymbol(st.data(), g_stamps, st.size() * sizeof(long long)));
  // Phase ends: 1 wait, 2 loads + valid lengths, 3 keys + count scan, 8.. each radix pass, 4 select done,
  // 5 compaction, 6 row written. Mean over the rows of (stamp - the row's start), in us; a pass's stamp counts
  // where it belongs to the last launch (between its stamps 3 and 4).
  const int order[] = {1, 2, 3, 8, 9, 10, 11, 12, 4, 5, 6};
  const char* label[] = {"wait", "loads", "keys+scan", "pass1", "pass2", "pass3", "pass4", "pass5", "select",
                         "compaction", "row out"};
  std::printf("%s: kernel %.2f us a launch (b=%d, 2 x %d); phase ends, mean over rows (us since the CTA began):\n",
              name, 1000.0 * ms / reps, rows, K);
  for (int j = 0; j < 11; ++j) {
    double sum = 0;
    int n = 0;
    for (int r = 0; r < rows; ++r) {
      const long long a = st[r * 16], b = st[r * 16 + order[j]];
      const bool pass = order[j] >= 8;
      if (b > a && (!pass || (b >= st[r * 16 + 3] && b <= st[r * 16 + 4]))) {
        sum += static_cast<double>(b - a);
        ++n;
      }
    }
    if (n > 0) std::printf("  %-10s %7.2f us  (%d rows)\n", label[j], sum / n / (clock_khz / 1000.0), n);
  }
}

int main() {
  constexpr int kRows = 64, kK = 2048, kParts = 2, kReps = 50;
  const size_t per = static_cast<size_t>(kRows) * kK;
  const char* names[] = {"uniform", "tail"};
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  for (int shape = 0; shape < 2; ++shape) {
    std::vector<int32_t> topk(kParts * per);
    std::vector<float> scores(kParts * per);
    std::mt19937 rng(7 + shape);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> uni(0.f, 1.f);
    for (int s = 0; s < kParts; ++s) {
      for (int r = 0; r < kRows; ++r) {
        const size_t at = s * per + static_cast<size_t>(r) * kK;
        if (shape == 0) {
          for (int i = 0; i < kK; ++i) {
            topk[at + i] = 7 * i + static_cast<int32_t>(rng() % 7);
            scores[at + i] = 2.f + uni(rng);
          }
        } else {
          std::vector<std::pair<float, int32_t>> row(65536);
          for (int i = 0; i < 65536; ++i) row[i] = {normal(rng), i};
          std::nth_element(row.begin(), row.begin() + kK, row.end(), [](auto a, auto b) { return a.first > b.first; });
          std::sort(row.begin(), row.begin() + kK, [](auto a, auto b) { return a.second < b.second; });
          for (int i = 0; i < kK; ++i) {
            topk[at + i] = row[i].second;
            scores[at + i] = row[i].first;
          }
        }
      }
    }
    int32_t *d_topk, *d_out, *d_local;
    float* d_scores;
    CK(cudaMalloc(&d_topk, topk.size() * 4));
    CK(cudaMalloc(&d_scores, scores.size() * 4));
    CK(cudaMalloc(&d_out, per * 4));
    CK(cudaMalloc(&d_local, per * 4));
    CK(cudaMemcpy(d_topk, topk.data(), topk.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_scores, scores.data(), scores.size() * 4, cudaMemcpyHostToDevice));
    TopkMergeParams p;
    p.num_parts = kParts;
    p.num_rows = kRows;
    p.K = kK;
    p.I = 64;
    p.topk = d_out;
    p.local_topk = d_local;
    for (int s = 0; s < kParts; ++s) {
      p.part_topk_of[s] = d_topk + s * per;
      p.part_scores_of[s] = d_scores + s * per;
    }
    const int k2 = kK;
    const int smem = k2 * 8 + kParts * kK * 4;
    run(names[shape], p, kRows, kK, k2, smem, kReps, clock_khz);
    cudaFree(d_topk);
    cudaFree(d_scores);
    cudaFree(d_out);
    cudaFree(d_local);
  }
  return 0;
}
