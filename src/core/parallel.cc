#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace dsacp {

int default_num_threads() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

void parallel_for(int64_t n, int num_threads, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (num_threads <= 0) num_threads = default_num_threads();
  grain = std::max<int64_t>(grain, 1);
  int64_t chunks = std::min<int64_t>(num_threads, (n + grain - 1) / grain);
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  // Interleaved small chunks balance uneven rows (causal prefills) better than one block per thread.
  const int64_t pieces = std::min<int64_t>(n, chunks * 8);
  const int64_t piece = (n + pieces - 1) / pieces;
  std::atomic_int64_t next{0};
  // An exception in a helper thread (std::bad_alloc) would end the process: it stops the loop and is rethrown
  // on the caller's thread once every helper has joined.
  std::mutex error_mu;
  std::exception_ptr error;
  auto worker = [&]() {
    try {
      for (;;) {
        int64_t b = next.fetch_add(piece);
        if (b >= n) return;
        fn(b, std::min(n, b + piece));
      }
    } catch (...) {
      next.store(n);
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  // A thread that cannot be started (std::system_error: no address space, thread limit; bad_alloc) only
  // means fewer helpers: the pieces are shared through `next`, so the threads that did start (and the
  // caller) do all the work.
  try {
    threads.reserve(static_cast<size_t>(chunks - 1));
    for (int64_t i = 1; i < chunks; ++i) threads.emplace_back(worker);
  } catch (const std::system_error&) {
  } catch (const std::bad_alloc&) {
  }
  worker();
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace dsacp
