// The host time of one empty kernel launch on a stream (<<<1, 32>>>, no arguments): the floor under a planned
// layer's host time, which is its launches (dsacp_bench_gpu --only layers61).
#pragma once

#include <cuda_runtime.h>

namespace dsacp::bench {

// Median over `batches` batches of `launches` back-to-back launches (each batch then synchronized), in
// microseconds a launch; -1 when a launch fails.
double empty_launch_host_us(cudaStream_t stream, int launches = 1000, int batches = 5);

}  // namespace dsacp::bench
