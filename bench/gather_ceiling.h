// The gather ceiling kernel of dsacp_bench_gpu (bench/gather_ceiling.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsacp::bench {

struct GatherCeilingArgs {
  const int32_t* topk;         // [T, K] key positions of each token's request, -1 = absent
  const int32_t* request;      // [T]
  const int32_t* block_table;  // [requests, pages_per_request]
  int pages_per_request, page_size;
  const uint16_t* latent;      // [pages * page_size, 512] bf16 bits
  const uint16_t* rope;        // [pages * page_size, 64]
  int64_t T;
  int K;                       // divisible by ctas_per_token
  uint32_t* sink;
};

// Reads every selected row once; grid (T, ctas_per_token).
cudaError_t launch_gather_ceiling(const GatherCeilingArgs& a, int ctas_per_token, cudaStream_t stream);

}  // namespace dsacp::bench
