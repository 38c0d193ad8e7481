// A small fork-join helper for the CPU backend: splits [0, n) into contiguous chunks over threads.
#pragma once

#include <cstdint>
#include <functional>

namespace dsacp {

// Runs fn(begin, end) over disjoint chunks covering [0, n), on up to num_threads threads (the caller's
// thread included). Chunks are at least `grain` long. num_threads <= 0 means hardware concurrency.
void parallel_for(int64_t n, int num_threads, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

int default_num_threads();

}  // namespace dsacp
